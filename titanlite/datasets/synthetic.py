"""Random tokens for speed and memory benchmarks: a model's real vocabulary (128,256 for Llama 3)
without its tokenizer or a corpus. `data.mode = "synthetic"` with `model.vocab_size`."""

from __future__ import annotations

import numpy as np

# Sequences in the index space: the sampler computes its permutation per step, never stores it,
# so the size costs nothing, and no benchmark reads this far.
SIZE = 1 << 40


class SyntheticDataset:
    """Sequence i: seq_len + 1 tokens drawn uniformly from [0, vocab_size) by a generator seeded
    with (seed, i), so it depends on its index alone, like a real dataset's: every rank, a
    resumed run and the diagnostics' data checks see the same sequence for the same index.
    Every label is a target."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int) -> None:
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.seed = seed

    def __len__(self) -> int:
        return SIZE

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        window = np.random.default_rng([self.seed, int(i)]).integers(
            0, self.vocab_size, self.seq_len + 1, dtype=np.int64
        )
        return window[:-1], window[1:]

    def trace(self, i: int) -> list[dict]:
        return [{"file": "synthetic", "kind": "synthetic", "row": int(i), "tokens": [0, self.seq_len + 1]}]
