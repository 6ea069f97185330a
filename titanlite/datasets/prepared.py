"""A prepared folder (titanlite.datasets.prepare), read memory-mapped.

Nothing proportional to the data is loaded: the shards' token files, offsets and rows are mapped
and paged in on access; what is held is one entry per shard. At most `max_open` shards are
mapped at a time (a few thousand shards would otherwise exhaust file descriptors).
"""

from __future__ import annotations

import bisect
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from titanlite.datasets.prepare import FORMAT, META, read_json, tokenizer_key
from titanlite.errors import UserError

PREPARE_HINT = "run scripts/prepare_data.py again with the same inputs and --out"


def is_prepared(path: Path) -> bool:
    """A prepared folder, complete or not (raw inputs never hold meta.json or shard indexes)."""
    return path.is_dir() and ((path / META).is_file() or any(path.glob("shard-*.json")))


def _npy_problem(path: Path, dtype: np.dtype, count: int) -> str | None:
    """What is wrong with the .npy file `path`, which must hold `count` values of `dtype`."""
    try:
        with path.open("rb") as f:
            version = np.lib.format.read_magic(f)
            read = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            shape, _, stored = read(f)
            start, size = f.tell(), os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        return "is missing"
    except (OSError, ValueError) as e:
        return f"is not a readable .npy file ({e})"
    if stored != dtype or shape != (count,):
        return f"holds {shape} {stored}, its index says ({count},) {dtype}"
    if size != start + count * dtype.itemsize:
        return f"is {size} bytes, its header says {start + count * dtype.itemsize}"
    return None


def load_meta(folder: Path) -> dict:
    """meta.json of a complete prepared folder, or one UserError that says what to do."""
    meta = read_json(folder / META)
    if meta is None:
        if (folder / META).is_file():
            raise UserError(f"prepared data '{folder}': meta.json is unreadable; {PREPARE_HINT}")
        raise UserError(
            f"prepared data '{folder}' is incomplete (its preparation did not finish); {PREPARE_HINT} to resume it"
        )
    if meta.get("format") != FORMAT:
        raise UserError(
            f"prepared data '{folder}' has format {meta.get('format')} but this titanlite reads format "
            f"{FORMAT}; prepare it again"
        )
    return meta


class Prepared:
    """Token ranges, documents and their sources of one prepared folder."""

    def __init__(self, folder: Path, max_open: int = 64) -> None:
        self.folder = Path(folder)
        self.meta = meta = load_meta(self.folder)
        self.mode: str = meta["mode"]
        self.dtype = np.dtype(meta["dtype"])
        self.shards: list[dict] = meta["shards"]
        self.token_starts = np.cumsum([0] + [s["tokens"] for s in self.shards], dtype=np.int64)
        self.doc_starts = np.cumsum([0] + [s["docs"] for s in self.shards], dtype=np.int64)
        self.num_tokens = int(self.token_starts[-1])
        self.num_docs = int(self.doc_starts[-1])
        self.max_open = max_open
        self._open: OrderedDict[int, dict] = OrderedDict()
        self._check_files()

    def __getstate__(self) -> dict:  # data-loader workers map the files themselves
        return {**self.__dict__, "_open": OrderedDict()}

    def _check_files(self) -> None:
        """Every shard file present, readable and of the size its index says (the token and mask
        files from its token count, the .npy indexes from its document count and their headers):
        a damaged folder stops the run at start-up, in one line naming the file, not hours in
        on the rank whose batch first reaches it."""
        for s in self.shards:
            expect = {"tokens": s["tokens"] * self.dtype.itemsize}
            if self.mode == "sft":
                expect["mask"] = s["tokens"]
            for suffix, size in expect.items():
                path = self.folder / f"{s['name']}.{suffix}"
                try:
                    actual = path.stat().st_size
                except OSError:
                    actual = None
                if actual != size or not os.access(path, os.R_OK):
                    what = (
                        "missing"
                        if actual is None
                        else "unreadable"
                        if actual == size
                        else f"{actual} bytes"
                    )
                    self._damaged(path, f"is {what}, its index says {size} bytes")
            indexes = {"offsets.npy": (np.int64, s["docs"] + 1), "rows.npy": (np.int64, s["docs"])}
            if self.mode == "sft":
                indexes["first.npy"] = (np.int32, s["docs"])
            for suffix, (dtype, count) in indexes.items():
                path = self.folder / f"{s['name']}.{suffix}"
                why = _npy_problem(path, np.dtype(dtype), count)
                if why:
                    self._damaged(path, why)

    def _damaged(self, path: Path, why: str) -> None:
        raise UserError(
            f"prepared data '{self.folder}': shard file {path.name} {why}; the folder is damaged: delete it "
            "and prepare it again (scripts/prepare_data.py with the same inputs and --out)"
        )

    @property
    def content(self) -> str | None:
        """What it trains on (titanlite.datasets.prepare.content_key); None if prepared before
        folders recorded it."""
        return self.meta.get("content")

    def check_mode(self, mode: str) -> None:
        if self.mode != mode:
            raise UserError(
                f"prepared data '{self.folder}' was prepared for {self.mode} but data.mode is {mode}; prepare "
                f"it with --mode {mode} or set data.mode = '{self.mode}'"
            )

    def check_tokenizer(self, tok: Any) -> None:
        """The run must tokenize as the preparation did (same model, same SFT format)."""
        ours, theirs = tokenizer_key(tok, self.mode), self.meta["tokenizer"]
        differ = [
            f"{k} {theirs.get(k)!r} vs {ours[k]!r}"
            for k in ours
            if k != "source" and ours[k] != theirs.get(k)
        ]
        if differ:
            raise UserError(
                f"prepared data '{self.folder}' was tokenized with {theirs.get('source')} and this run's "
                f"tokenizer is {tok.source}, and they differ ({', '.join(differ)}: meta.json vs this run); "
                "prepare the data again with this tokenizer, or train with that one"
            )

    def _shard(self, k: int) -> dict:
        arrays = self._open.get(k)
        if arrays is None:
            name, n = self.shards[k]["name"], self.shards[k]["tokens"]
            base = self.folder / name

            def mapped(suffix: str, dtype) -> np.ndarray:  # a zero-length file cannot be mapped
                return np.memmap(f"{base}.{suffix}", dtype, "r") if n else np.zeros(0, dtype)

            arrays = {
                "tokens": mapped("tokens", self.dtype),
                "offsets": np.load(f"{base}.offsets.npy", mmap_mode="r"),
                "rows": np.load(f"{base}.rows.npy", mmap_mode="r"),
            }
            if self.mode == "sft":
                arrays["mask"] = mapped("mask", np.uint8)
                arrays["first"] = np.load(f"{base}.first.npy", mmap_mode="r")
            self._open[k] = arrays
            if len(self._open) > self.max_open:
                self._open.popitem(last=False)
        else:
            self._open.move_to_end(k)
        return arrays

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the whole stream (all shards back to back), as int64."""
        out = np.empty(stop - start, dtype=np.int64)
        k = int(np.searchsorted(self.token_starts, start, side="right")) - 1
        pos = start
        while pos < stop:
            base = int(self.token_starts[k])
            take = min(stop, int(self.token_starts[k + 1])) - pos
            out[pos - start : pos - start + take] = self._shard(k)["tokens"][
                pos - base : pos - base + take
            ]
            pos += take
            k += 1
        return out

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
        src, first_doc, row_base = pieces[p]
        entry = self.meta["sources"][src]
        return {
            "file": entry["path"],
            "kind": entry["kind"],
            "row": row_base + int(self._shard(k)["rows"][j]),
        }

    def trace(self, start: int, stop: int) -> list[dict]:
        """The documents behind tokens [start, stop): source, row and the token range within each."""
        out = []
        k = int(np.searchsorted(self.token_starts, start, side="right")) - 1
        pos = start
        while pos < stop and k < len(self.shards):
            arrays, base = self._shard(k), int(self.token_starts[k])
            offsets = arrays["offsets"]
            j = int(np.searchsorted(offsets, pos - base, side="right")) - 1
            while j < len(offsets) - 1 and pos < stop:
                a, b = base + int(offsets[j]), base + int(offsets[j + 1])
                if b > a:
                    out.append(
                        {
                            **self.source(int(self.doc_starts[k]) + j),
                            "tokens": [pos - a, min(stop, b) - a],
                        }
                    )
                pos = min(stop, b)
                j += 1
            k += 1
        return out

    def document_lengths(self) -> np.ndarray:
        """Every document's token count, int64 (8 bytes per document)."""
        return np.concatenate(
            [np.diff(self._shard(k)["offsets"]) for k in range(len(self.shards))]
            or [np.zeros(0, np.int64)]
        )

    def document_starts(self, start: int, stop: int) -> np.ndarray:
        """The stream offsets in [start, stop) where a document begins (shard starts included)."""
        out = []
        first = int(np.searchsorted(self.token_starts, start, side="right")) - 1
        last = int(np.searchsorted(self.token_starts, stop, side="left"))
        for k in range(max(first, 0), min(last, len(self.shards))):
            offsets = np.asarray(self._shard(k)["offsets"][:-1]) + self.token_starts[k]
            out.append(offsets[(offsets >= start) & (offsets < stop)])
        return np.concatenate(out or [np.zeros(0, np.int64)])

    def first_targets(self) -> np.ndarray:
        """SFT: every record's first target token (-1: none), int32 (4 bytes per record)."""
        return np.concatenate(
            [self._shard(k)["first"] for k in range(len(self.shards))] or [np.zeros(0, np.int32)]
        )
