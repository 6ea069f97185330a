"""The held-out split (eval.fraction): which sequences (SFT: records) are kept for evaluation and
never trained on, in O(1) memory for any data size.

The index space is cut into blocks of BLOCK consecutive items; in every block the same
round(BLOCK x fraction) offsets, drawn once from training.seed (titanlite.datasets.sampler's
permutation), are held out. The eval set is spread over the whole data, the split depends on
nothing but (size, fraction, seed), so every rank and every dp computes the same one, and the
i-th training or eval item is found by arithmetic, never by a stored index list.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from titanlite.datasets.sampler import permute, stream_keys

BLOCK = 10_000
_SPLIT_STREAM = 0x73706C  # its key stream, apart from the sampler's


class HeldOut:
    """The split of [0, n) into training and eval indices."""

    def __init__(self, n: int, fraction: float, seed: int) -> None:
        self.n = n
        held = max(1, round(BLOCK * fraction))
        order = permute(np.arange(BLOCK), BLOCK, stream_keys(seed, _SPLIT_STREAM, np.zeros(BLOCK, np.int64)))
        in_eval = np.zeros(BLOCK, dtype=bool)
        in_eval[order[:held]] = True
        self.offsets = {"eval": np.flatnonzero(in_eval), "train": np.flatnonzero(~in_eval)}

    def size(self, part: str) -> int:
        offsets = self.offsets[part]
        full, rest = divmod(self.n, BLOCK)
        return full * len(offsets) + int(np.searchsorted(offsets, rest))

    def indices(self, part: str, i: np.ndarray | int) -> np.ndarray:
        """The indices into [0, n) of the part's items i ("train" or "eval")."""
        offsets = self.offsets[part]
        block, k = np.divmod(np.asarray(i, dtype=np.int64), len(offsets))
        return block * BLOCK + offsets[k]


class Subset:
    """Items `index(i)` of a dataset, for i in [0, size): a split part, or an eval set's sample."""

    def __init__(self, dataset, size: int, index: Callable[[int], int | np.ndarray]) -> None:
        self.dataset = dataset
        self.size = size
        self.index = index

    def __len__(self) -> int:
        return self.size

    def _at(self, i: int) -> int:
        if not 0 <= i < self.size:
            raise IndexError(i)
        return int(self.index(i))

    def __getitem__(self, i: int):
        return self.dataset[self._at(i)]

    def trace(self, i: int) -> list[dict]:
        return self.dataset.trace(self._at(i))

    def content_slots(self, i: int) -> int:
        return self.dataset.content_slots(self._at(i))


def split_part(dataset, held: HeldOut, part: str) -> Subset:
    """The "train" or "eval" part of `dataset` under `held`."""
    return Subset(dataset, held.size(part), functools.partial(held.indices, part))


def spaced(total: int, count: int, i: int) -> int:
    """The i-th of `count` indices spread evenly over [0, total)."""
    return i * total // count
