"""A prepared folder (titanlite.datasets.prepare), read memory-mapped: what is held is one entry
per shard, and at most MAX_OPEN shards are mapped at a time (a few thousand would otherwise
exhaust file descriptors)."""

from __future__ import annotations

import bisect
from collections import OrderedDict
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from titanlite.datasets.prepare import FORMAT, META, read_json, tokenizer_key
from titanlite.errors import UserError, first_line

MAX_OPEN = 64
PREPARE_HINT = "run scripts/prepare_data.py again with the same inputs and --out"


def is_prepared(path: Path) -> bool:
    """A prepared folder, complete or not (raw inputs never hold meta.json or shard indexes)."""
    return path.is_dir() and ((path / META).is_file() or any(path.glob("shard-*.json")))


def _mapped(path: Path, dtype: np.dtype, count: int) -> np.ndarray:
    """A shard file, memory-mapped: a .npy by its header, a raw file as `dtype` (an empty one
    cannot be mapped)."""
    if path.suffix == ".npy":
        return np.load(path, mmap_mode="r")
    return np.memmap(path, dtype, "r") if count else np.zeros(0, dtype)


class Prepared:
    """Token ranges, documents and their sources of one prepared folder."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder = Path(folder)
        self.meta = meta = read_json(folder / META)
        if meta is None:
            if (folder / META).is_file():
                raise UserError(
                    f"prepared data '{folder}': meta.json is unreadable; {PREPARE_HINT}"
                )
            raise UserError(
                f"prepared data '{folder}' is incomplete (its preparation did not finish); {PREPARE_HINT} to resume it"
            )
        if meta.get("format") != FORMAT or "content" not in meta:  # older: no content key
            raise UserError(
                f"prepared data '{folder}' was written by another titanlite (format {meta.get('format')}) "
                f"than this one, which reads format {FORMAT} with a content key; prepare it again"
            )
        self.mode: str = meta["mode"]
        self.dtype = np.dtype(meta["dtype"])
        self.shards: list[dict] = meta["shards"]
        self.token_starts = np.cumsum([0] + [s["tokens"] for s in self.shards], dtype=np.int64)
        self.doc_starts = np.cumsum([0] + [s["docs"] for s in self.shards], dtype=np.int64)
        self.num_tokens = int(self.token_starts[-1])
        self.num_docs = int(self.doc_starts[-1])
        self.content: str = meta["content"]  # what it trains on (prepare.content_key)
        self._open: OrderedDict[int, dict] = OrderedDict()
        self._check_files()

    def __getstate__(self) -> dict:  # data-loader workers map the files themselves
        return {**self.__dict__, "_open": OrderedDict()}

    def _files(self, k: int) -> dict[str, tuple[Path, np.dtype, int]]:
        """Shard k's files: array name -> (path, dtype, the length its index says)."""
        s = self.shards[k]
        name, docs = s["name"], s["docs"]
        files = {
            "tokens": (self.folder / f"{name}.tokens", self.dtype, s["tokens"]),
            "offsets": (self.folder / f"{name}.offsets.npy", np.dtype(np.int64), docs + 1),
            "rows": (self.folder / f"{name}.rows.npy", np.dtype(np.int64), docs),
        }
        if self.mode == "sft":
            files["mask"] = (self.folder / f"{name}.mask", np.dtype(np.uint8), s["tokens"])
            files["first"] = (self.folder / f"{name}.first.npy", np.dtype(np.int32), docs)
        return files

    def _check_files(self) -> None:
        """Every shard file readable and of the length and type its index says: a damaged folder
        stops the run at start-up, in one line naming the file, not hours in."""
        for k in range(len(self.shards)):
            for path, dtype, count in self._files(k).values():
                try:
                    array = _mapped(path, dtype, count)
                except (OSError, ValueError) as e:
                    self._damaged(path, f"is unreadable ({first_line(e)})")
                if array.dtype != dtype or array.shape != (count,):
                    why = f"is {array.size} {array.dtype} values, its index says {count} {dtype}"
                    self._damaged(path, why)

    def _damaged(self, path: Path, why: str) -> NoReturn:
        raise UserError(
            f"prepared data '{self.folder}': shard file {path.name} {why}; the folder is damaged: delete it "
            "and prepare it again (scripts/prepare_data.py with the same inputs and --out)"
        )

    def check_mode(self, mode: str) -> None:
        if self.mode != mode:
            raise UserError(
                f"prepared data '{self.folder}' was prepared for {self.mode} but data.mode is {mode}; prepare "
                f"it with --mode {mode} or set data.mode = '{self.mode}'"
            )

    def check_tokenizer(self, tok: Any) -> None:
        """The run must tokenize as the preparation did (same model, same SFT format)."""
        ours, theirs = tokenizer_key(tok, self.mode), self.meta["tokenizer"]
        keys = [k for k in ours if k != "source" and ours[k] != theirs.get(k)]
        differ = [f"{k} {theirs.get(k)!r} vs {ours[k]!r}" for k in keys]
        if differ:
            raise UserError(
                f"prepared data '{self.folder}' was tokenized with {theirs.get('source')} and this run's "
                f"tokenizer is {tok.source}, and they differ ({', '.join(differ)}: meta.json vs this run); "
                "prepare the data again with this tokenizer, or train with that one"
            )

    def _shard(self, k: int) -> dict:
        arrays = self._open.get(k)
        if arrays is None:
            files = self._files(k).items()
            arrays = self._open[k] = {name: _mapped(*file) for name, file in files}
            if len(self._open) > MAX_OPEN:
                self._open.popitem(last=False)
        else:
            self._open.move_to_end(k)
        return arrays

    def _spans(self, start: int, stop: int):
        """(shard, its first stream offset, the shard's own range of [start, stop)) of every shard
        that tokens [start, stop) touch, in order."""
        k = int(np.searchsorted(self.token_starts, start, side="right")) - 1
        while k < len(self.shards) and self.token_starts[k] < stop:
            base = int(self.token_starts[k])
            yield k, base, max(start - base, 0), min(stop, int(self.token_starts[k + 1])) - base
            k += 1

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the whole stream (all shards back to back), as int64."""
        parts = [self._shard(k)["tokens"][lo:hi] for k, _, lo, hi in self._spans(start, stop)]
        return np.concatenate(parts).astype(np.int64)

    def _doc(self, d: int) -> tuple[int, int]:
        k = int(np.searchsorted(self.doc_starts, d, side="right")) - 1
        return k, d - int(self.doc_starts[k])

    def document(self, d: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Document d's tokens (int64) and, for SFT, its target mask."""
        k, j = self._doc(d)
        arrays = self._shard(k)
        a, b = int(arrays["offsets"][j]), int(arrays["offsets"][j + 1])
        mask = np.asarray(arrays["mask"][a:b], dtype=bool) if "mask" in arrays else None
        return np.asarray(arrays["tokens"][a:b], dtype=np.int64), mask

    def source(self, d: int) -> dict:
        """Where document d came from: its file, kind and row (0-based line or table row)."""
        k, j = self._doc(d)
        pieces = self.shards[k]["pieces"]  # (source, first document, first row), by first document
        p = bisect.bisect_right(pieces, j, key=lambda piece: piece[1]) - 1
        src, _, row_base = pieces[p]
        entry = self.meta["sources"][src]
        row = row_base + int(self._shard(k)["rows"][j])
        return {"file": entry["path"], "kind": entry["kind"], "row": row}

    def trace(self, start: int, stop: int) -> list[dict]:
        """The documents behind tokens [start, stop): source, row and the token range within each."""
        out = []
        for k, _, lo, hi in self._spans(start, stop):
            offsets = self._shard(k)["offsets"]
            j = int(np.searchsorted(offsets, lo, side="right")) - 1
            while j < len(offsets) - 1 and offsets[j] < hi:
                a, b = int(offsets[j]), int(offsets[j + 1])
                if b > a:
                    doc = self.source(int(self.doc_starts[k]) + j)
                    out.append({**doc, "tokens": [max(lo, a) - a, min(hi, b) - a]})
                j += 1
        return out

    def document_lengths(self) -> np.ndarray:
        """Every document's token count, int64 (8 bytes per document)."""
        return np.concatenate([np.diff(self._shard(k)["offsets"]) for k in range(len(self.shards))])

    def document_starts(self, start: int, stop: int) -> np.ndarray:
        """The stream offsets in [start, stop) where a document begins (shard starts included)."""
        out = [np.zeros(0, np.int64)]
        for k, base, _, _ in self._spans(start, stop):
            offsets = self._shard(k)["offsets"][:-1] + base
            out.append(offsets[(offsets >= start) & (offsets < stop)])
        return np.concatenate(out)

    def first_targets(self) -> np.ndarray:
        """SFT: every record's first target token (-1: none), int32 (4 bytes per record)."""
        return np.concatenate([self._shard(k)["first"] for k in range(len(self.shards))])
