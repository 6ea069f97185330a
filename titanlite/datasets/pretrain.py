"""Pretraining: a prepared token stream cut into seq_len windows."""

from __future__ import annotations

import numpy as np

from titanlite.datasets.prepared import Prepared


class PackedDataset:
    """Sequence i is tokens[i*L : i*L + L] with next-token labels; every label is a target. A
    window spans several documents: trace(i) names them all."""

    def __init__(self, data: Prepared, seq_len: int) -> None:
        self.data = data
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(0, (self.data.num_tokens - 1) // self.seq_len)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        start = i * self.seq_len
        window = self.data.tokens(start, start + self.seq_len + 1)
        return window[:-1], window[1:]

    def trace(self, i: int) -> list[dict]:
        start = i * self.seq_len
        return self.data.trace(start, start + self.seq_len + 1)
