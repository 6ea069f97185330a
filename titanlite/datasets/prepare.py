"""Prepare raw inputs once, with every core, into token shards that training reads memory-mapped.

A prepared folder holds, per shard `shard-NNNNN`:
    .tokens        the documents' tokens back to back (uint16, or uint32 for vocabularies > 65,536);
                   pretraining: <bos> text <eos>; SFT: the record's tokens (titanlite.datasets.records)
    .mask          SFT only: 1 per target token (uint8)
    .offsets.npy   int64, docs + 1 token offsets of its documents
    .rows.npy      int64, each document's row within its input piece
    .first.npy     SFT only: int32, each record's first target token (-1: none)
    .json          written last: its key, counts and pieces; a shard without it does not exist
and `meta.json`, written last of all (without it no run accepts the folder): the format, the
tokenizer, the sources and every shard. Shards hold input pieces in input order, so the document
order does not depend on the number of workers; a shard whose .json carries the same key is
kept, so an interrupted preparation resumes.
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import ExitStack
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from titanlite.datasets.corpus import Piece, files_fingerprint, kind_of, plan_pieces, read_piece
from titanlite.datasets.records import record_tokens, sft_format_key
from titanlite.errors import TrainingError, UserError
from titanlite.tools.cache import atomic_file, atomic_write_bytes, disk_full, fsync_dir

FORMAT = 1
META = "meta.json"
LOCK = ".lock"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def tokenizer_key(tok: Any, mode: str) -> dict:
    """What a prepared folder records of its tokenizer, and a run's tokenizer must match."""
    key = {"fingerprint": tok.fingerprint, "source": tok.source, "vocab_size": tok.vocab_size}
    if mode == "sft":
        key["format"] = sft_format_key(tok)
    return key


def data_key(files: list[Path], tok: Any, mode: str, text_field: str) -> str:
    """Identifies a preparation: the inputs, the tokenizer (and SFT format), mode and text field."""
    what = {
        "format": FORMAT,
        "mode": mode,
        "text_field": text_field if mode == "pretrain" else None,
        "tokenizer": {k: v for k, v in tokenizer_key(tok, mode).items() if k != "source"},
        "sources": files_fingerprint(files),
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:24]


def content_key(mode: str, tok: Any, shards: list[str]) -> str:
    """What a prepared folder trains on (its tokens, masks and tokenizer; not where nor when): a
    resume on other data is refused, the same data moved or copied elsewhere still resumes."""
    what = {"mode": mode, "tokenizer": tok.fingerprint, "shards": shards}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32]


def group_pieces(pieces: list[Piece], shard_bytes: int) -> list[list[Piece]]:
    """Consecutive pieces into shards of at least `shard_bytes` (the last may be smaller)."""
    shards, current, size = [], [], 0
    for piece in pieces:
        current.append(piece)
        size += piece.nbytes
        if size >= shard_bytes:
            shards.append(current)
            current, size = [], 0
    if current:
        shards.append(current)
    return shards


def shard_key(key: str, pieces: list[Piece]) -> str:
    text = key + json.dumps([[p.source, p.start, p.stop] for p in pieces])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


# ---- one shard, in a worker process -------------------------------------------------------------

_TOKENIZER: Any = None


def _init_worker(tok: Any) -> None:
    global _TOKENIZER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker
    _TOKENIZER = tok


class _ShardWriter:
    """The files of one shard; each is renamed into place as `files` closes (cache.atomic_file),
    so a shard interrupted leaves only temporary files."""

    def __init__(self, out: Path, name: str, mode: str, dtype: np.dtype) -> None:
        self.out, self.name, self.dtype = out, name, dtype
        self.files = ExitStack()
        self.tokens = self._open("tokens")
        self.mask = self._open("mask") if mode == "sft" else None
        self.offsets, self.rows, self.first = [0], [], []
        self.content = hashlib.blake2b(digest_size=16)  # what the shard trains on: see content_key

    def _open(self, suffix: str) -> BinaryIO:
        return self.files.enter_context(atomic_file(self.out / f"{self.name}.{suffix}"))

    def add(self, ids: np.ndarray, row: int, mask: np.ndarray | None = None) -> None:
        ids = ids.astype(self.dtype, copy=False)
        ids.tofile(self.tokens)
        self.content.update(np.int64(len(ids)).tobytes())  # the document's bounds, then tokens
        self.content.update(np.ascontiguousarray(ids))
        self.offsets.append(self.offsets[-1] + len(ids))
        self.rows.append(row)
        if mask is not None:
            mask = mask.astype(np.uint8)
            mask.tofile(self.mask)
            self.content.update(np.ascontiguousarray(mask))
            hits = np.flatnonzero(mask)
            self.first.append(int(hits[0]) if len(hits) else -1)

    def publish(self, info: dict) -> dict:
        """The document arrays, every file renamed into place, then .json, written last."""
        np.save(self._open("offsets.npy"), np.asarray(self.offsets, np.int64))
        np.save(self._open("rows.npy"), np.asarray(self.rows, np.int64))
        if self.mask is not None:
            np.save(self._open("first.npy"), np.asarray(self.first, np.int32))
        self.files.close()
        counts = {"tokens": self.offsets[-1], "docs": len(self.rows)}
        info = {**info, **counts, "content": self.content.hexdigest()}
        atomic_write_bytes(self.out / f"{self.name}.json", json.dumps(info).encode())
        return info


def _add(writer: _ShardWriter, tok: Any, mode: str, rows: list[int], docs: list) -> None:
    """A batch of documents tokenized into the shard: SFT records, or texts between BOS and EOS."""
    if mode == "sft":
        for row, record in zip(rows, docs, strict=True):
            ids, mask = record_tokens(record, tok)
            writer.add(np.asarray(ids), row, np.asarray(mask, dtype=bool))
    else:
        for row, ids in zip(rows, tok.encode_batch(docs), strict=True):
            document = itertools.chain((tok.bos_id,), ids, (tok.eos_id,))
            writer.add(np.fromiter(document, np.int64), row)


def write_shard(job: tuple, batch_chars: int = 1 << 20) -> dict:
    """Tokenize one shard's pieces, in batches of about `batch_chars`, and publish it; returns its
    .json content."""
    out, name, pieces, mode, text_field, key = job
    tok = _TOKENIZER
    writer = _ShardWriter(out, name, mode, token_dtype(tok.vocab_size))
    piece_info = []  # per piece: source, first document, rows
    with writer.files:  # on an error, every file is removed
        for piece in pieces:
            first_doc, n_rows = len(writer.rows), 0
            rows, docs, chars = [], [], 0
            for row, doc in read_piece(piece, mode, text_field):
                n_rows = row + 1
                if doc is None:
                    continue
                rows.append(row)
                docs.append(doc)
                chars += len(doc) if isinstance(doc, str) else 1024
                if chars >= batch_chars:
                    _add(writer, tok, mode, rows, docs)
                    rows, docs, chars = [], [], 0
            _add(writer, tok, mode, rows, docs)
            piece_info.append([piece.source, first_doc, n_rows])
        nbytes = sum(p.nbytes for p in pieces)
        return writer.publish({"key": key, "pieces": piece_info, "input_bytes": nbytes})


# ---- the whole preparation ------------------------------------------------------------------------


def _clean_tmp(out: Path) -> None:
    for f in out.glob(".shard-*.tmp"):
        f.unlink(missing_ok=True)


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class Progress:
    """Documents, tokens, tokens/s and ETA (by input bytes), at most every `every` seconds."""

    def __init__(self, total_bytes: int, say: Callable[[str], None], every: float = 2.0) -> None:
        self.total, self.say, self.every = max(total_bytes, 1), say, every
        self.start = self.last = time.perf_counter()
        self.bytes = self.docs = self.tokens = self.new_tokens = 0

    def add(self, info: dict, fresh: bool, last: bool = False) -> None:
        self.bytes += info["input_bytes"]
        self.docs += info["docs"]
        self.tokens += info["tokens"]
        self.new_tokens += info["tokens"] if fresh else 0
        now = time.perf_counter()
        if now - self.last < self.every and not last:
            return
        self.last = now
        elapsed = now - self.start
        rate = self.new_tokens / elapsed if elapsed > 0 else 0.0
        done = self.bytes / self.total
        eta = elapsed * (1 - done) / done if done > 0 and self.new_tokens else 0.0
        self.say(
            f"prepared {done:6.1%} | {self.docs:,} docs | {self.tokens:,} tokens | "
            f"{rate:,.0f} tok/s | eta {time.strftime('%H:%M:%S', time.gmtime(eta))}"
        )


def prepare(
    files: list[Path],
    out: Path,
    tok: Any,
    mode: str = "pretrain",
    text_field: str = "text",
    workers: int = 1,
    shard_bytes: int = 64 << 20,
    say: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr, flush=True),
) -> dict:
    """Prepare `files` into `out` (resuming a preparation that stopped); returns meta.json's content."""
    out.mkdir(parents=True, exist_ok=True)
    key = data_key(files, tok, mode, text_field)
    with open(out / LOCK, "a") as lock:  # closing the file releases the lock
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for another preparation of '{out}' to finish")
            fcntl.flock(lock, fcntl.LOCK_EX)
        meta = read_json(out / META)
        if meta is not None:
            if meta.get("key") == key:
                return meta
            raise UserError(
                f"'{out}' already holds a preparation of other inputs or with another tokenizer or mode; "
                "choose another output folder or delete it"
            )
        _clean_tmp(out)
        shards = group_pieces(plan_pieces(files, shard_bytes), shard_bytes)
        names = [f"shard-{i:05d}" for i in range(len(shards))]
        keys = [shard_key(key, pieces) for pieces in shards]
        infos: list[dict | None] = [read_json(out / f"{n}.json") for n in names]
        infos = [i if i and i.get("key") == k else None for i, k in zip(infos, keys, strict=True)]
        progress = Progress(sum(p.nbytes for s in shards for p in s), say)
        for info in infos:
            if info is not None:
                progress.add(info, fresh=False)
        missing = [i for i, info in enumerate(infos) if info is None]
        todo = [(i, (out, names[i], shards[i], mode, text_field, keys[i])) for i in missing]
        try:
            for n, (i, info) in enumerate(_run(todo, tok, workers), 1):
                infos[i] = info
                progress.add(info, fresh=True, last=n == len(todo))
        except BaseException as e:
            _clean_tmp(out)
            full = disk_full(e, out) if isinstance(e, (OSError, RuntimeError)) else None
            if full is not None:
                done = sum(info is not None for info in infos)
                raise TrainingError(
                    f"preparing the data: {full}; free space or use a larger disk (the cache: "
                    f"data.cache_dir or TITANLITE_CACHE), then rerun: the {done} of {len(infos)} shards "
                    "written are kept"
                ) from None
            raise
        # meta.json, atomically, with the rows of each piece counted from the start of its file
        rows_seen: dict[int, int] = {}
        entries = []
        for name, info in zip(names, infos, strict=True):
            pieces = []
            for source, first_doc, n_rows in info["pieces"]:
                pieces.append([source, first_doc, rows_seen.get(source, 0)])
                rows_seen[source] = rows_seen.get(source, 0) + n_rows
            counts = {"tokens": info["tokens"], "docs": info["docs"]}
            entries.append({"name": name, **counts, "pieces": pieces})
        docs = sum(e["docs"] for e in entries)
        if docs == 0:
            raise UserError(
                f"the inputs ({len(files)} file(s), first '{files[0]}') hold no documents; check the files"
            )
        sources = zip(files_fingerprint(files), files, strict=True)
        meta = {
            "format": FORMAT,
            "key": key,
            "content": content_key(mode, tok, [info["content"] for info in infos]),
            "mode": mode,
            "text_field": text_field,
            "dtype": token_dtype(tok.vocab_size).name,
            "tokenizer": tokenizer_key(tok, mode),
            "sources": [{**source, "kind": kind_of(f, "txt")} for source, f in sources],
            "tokens": sum(e["tokens"] for e in entries),
            "docs": docs,
            "shards": entries,
        }
        fsync_dir(out)
        atomic_write_bytes(out / META, json.dumps(meta, indent=1).encode())
        fsync_dir(out)
        progress.say(
            f"prepared '{out}': {meta['docs']:,} documents, {meta['tokens']:,} tokens in {len(names)} shards"
        )
        return meta


def _run(todo: list[tuple[int, tuple]], tok: Any, workers: int):
    """(shard index, info) in shard order: in this process, or in a pool of `workers`."""
    if workers <= 1 or len(todo) <= 1:
        _init_worker(tok)
        for i, job in todo:
            yield i, write_shard(job)
        return
    # fork: workers start at once and need no importable __main__; a worker that dies (killed,
    # out of memory) breaks the pool with an error instead of hanging it.
    ctx = multiprocessing.get_context("fork")
    n = min(workers, len(todo))
    with ProcessPoolExecutor(n, mp_context=ctx, initializer=_init_worker, initargs=(tok,)) as pool:
        try:
            jobs = [job for _, job in todo]
            for (i, _), info in zip(todo, pool.map(write_shard, jobs), strict=True):
                yield i, info
        except BrokenProcessPool:
            raise UserError(
                "a preparation worker died (out of memory? killed?); run again to resume"
            ) from None
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
