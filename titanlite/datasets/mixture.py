"""Several datasets as one index space, with their weights: the sampler (titanlite.datasets.sampler)
decides how often each is read; this only maps a global index to a dataset and its own index."""

from __future__ import annotations

import numpy as np


class MixtureDataset:
    """Datasets as one index space, with their weights (the sampler decides how often each is read)."""

    def __init__(self, parts: list, weights: list[float], identity: list[dict] | None = None) -> None:
        self.parts = parts
        self.weights = weights
        # what it trains on, by content (titanlite.datasets.spec.data_identity); None: the config
        # says all of it (synthetic data, an eval set)
        self.identity = identity
        self.sizes = [len(p) for p in parts]
        self.starts = np.cumsum([0, *self.sizes], dtype=np.int64)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _find(self, i: int) -> tuple[int, int]:
        k = int(np.searchsorted(self.starts, i, side="right")) - 1
        return k, i - int(self.starts[k])

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        k, j = self._find(i)
        return self.parts[k][j]

    def trace(self, i: int) -> list[dict]:
        k, j = self._find(i)
        return self.parts[k].trace(j)

    def content_slots(self, i: int) -> int:
        """Slots of sequence i that hold tokens rather than padding."""
        k, j = self._find(i)
        return self.parts[k].content_slots(j)
