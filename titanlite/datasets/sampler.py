"""Which sequences each rank reads: a function of (seed, global batch size, step) only.

Step t's global batch is a fixed, ordered list of global_batch_size sequence indices drawn from a
per-epoch permutation seeded by (seed, epoch). The dp ranks split it into contiguous slices
(rank r takes positions [r*G/dp, (r+1)*G/dp)) and each rank cuts its slice into microbatches
of local_batch_size. Changing dp or the accumulation steps changes who computes which sequence,
never which sequences a step contains, nor their order.
"""

from __future__ import annotations

import numpy as np

from titanlite.errors import UserError


class GlobalBatchSampler:
    """Yields this rank's microbatches (lists of sequence indices), forever. Stateful."""

    def __init__(
        self,
        num_sequences: int,
        global_batch_size: int,
        local_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
    ) -> None:
        if num_sequences < global_batch_size:
            raise UserError(
                f"the data has {num_sequences} sequences but training.global_batch_size is "
                f"{global_batch_size}; lower the batch or seq_len, or add data"
            )
        if global_batch_size % (local_batch_size * dp_size):
            raise ValueError("global batch must be a multiple of local batch x dp")
        self.num_sequences = num_sequences
        self.global_batch_size = global_batch_size
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.grad_accum = global_batch_size // (local_batch_size * dp_size)
        self.steps_per_epoch = num_sequences // global_batch_size  # the tail of an epoch is dropped
        self.microbatches_yielded = 0
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    def global_batch(self, step: int) -> np.ndarray:
        """The ordered sequence indices of 0-based step `step`, for every rank alike."""
        epoch, pos = divmod(step, self.steps_per_epoch)
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_sequences)
            self._perm_epoch = epoch
        return self._perm[pos * self.global_batch_size : (pos + 1) * self.global_batch_size]

    def __iter__(self) -> GlobalBatchSampler:
        return self

    def __next__(self) -> list[int]:
        step, micro = divmod(self.microbatches_yielded, self.grad_accum)
        per_rank = self.global_batch_size // self.dp_size
        start = self.dp_rank * per_rank + micro * self.local_batch_size
        self.microbatches_yielded += 1
        return [int(i) for i in self.global_batch(step)[start : start + self.local_batch_size]]

    def __len__(self) -> int:  # DataLoader asks; the stream is endless
        return 2**62

    def state_dict(self) -> dict:
        return {"microbatches_yielded": self.microbatches_yielded}

    def load_state_dict(self, state: dict) -> None:
        self.microbatches_yielded = int(state["microbatches_yielded"])
