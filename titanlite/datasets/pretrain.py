"""Pretraining: documents tokenized once (cached), concatenated and cut into seq_len windows."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from titanlite.components.tokenizer import Tokenizer
from titanlite.tools.cache import atomic_write_bytes


def build_token_cache(path: Path, docs: list[str], tok: Tokenizer) -> None:
    """<bos> doc <eos> for every document, as one flat array (uint16 when the vocab fits)."""
    dtype = np.uint16 if tok.vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32
    parts = [np.asarray([tok.bos_id, *tok.encode(d), tok.eos_id], dtype=dtype) for d in docs]
    buf = io.BytesIO()
    np.save(buf, np.concatenate(parts) if parts else np.zeros(0, dtype=dtype))
    atomic_write_bytes(path, buf.getvalue())


class PackedDataset:
    """Sequence i is tokens[i*L : i*L + L] with next-token labels; every label is a target."""

    def __init__(self, token_file: Path, seq_len: int) -> None:
        self.tokens = np.load(token_file, mmap_mode="r")
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        start = i * self.seq_len
        window = np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)
        return window[:-1], window[1:]
