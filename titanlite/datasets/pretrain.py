"""Pretraining: a prepared token stream cut into seq_len windows."""

from __future__ import annotations

import numpy as np

from titanlite.datasets.packing import restart_positions
from titanlite.datasets.prepared import Prepared


class PackedDataset:
    """Sequence i is tokens[i*L : i*L + L] with next-token labels; every label is a target. A
    window spans several documents: trace(i) names them all. With `document_mask` each item
    also carries its tokens' positions within their documents (restarting at each document and
    at the window's start), so attention stays inside a document."""

    def __init__(self, data: Prepared, seq_len: int, document_mask: bool = False) -> None:
        self.data = data
        self.seq_len = seq_len
        self.document_mask = document_mask

    def __len__(self) -> int:
        return max(0, (self.data.num_tokens - 1) // self.seq_len)

    def __getitem__(self, i: int) -> tuple[np.ndarray, ...]:
        start = i * self.seq_len
        window = self.data.tokens(start, start + self.seq_len + 1)
        if not self.document_mask:
            return window[:-1], window[1:]
        starts = self.data.document_starts(start, start + self.seq_len) - start
        return window[:-1], window[1:], restart_positions(starts, self.seq_len)

    def content_slots(self, i: int) -> int:
        """Slots of sequence i that hold tokens (all of them: windows have no padding)."""
        return self.seq_len

    def trace(self, i: int) -> list[dict]:
        start = i * self.seq_len
        return self.data.trace(start, start + self.seq_len + 1)
