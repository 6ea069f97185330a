"""Which sequences each rank reads: a function of (seed, global batch size, step) only, computed,
never stored. Step t holds stream positions [t*G, (t+1)*G) in order; the dp ranks take contiguous
slices of it, cut into microbatches: dp and accumulation change who computes which sequence,
never which sequences a step holds, nor their order.

Position p of a dataset of N sequences is pi_(seed, p // N)(p mod N), a seeded permutation per
epoch. A mixture's blocks of MIX_BLOCK positions hold round(w_d * MIX_BLOCK) positions of dataset
d in a permuted order; the c-th given to dataset d reads its own stream position c.

The permutations are a balanced Feistel network (6 rounds, a splitmix64 round function) on the
smallest power of four >= N, cycle-walked back into [0, N) (Black and Rogaway, "Ciphers with
Arbitrary Finite Domains", CT-RSA 2002).
"""

from __future__ import annotations

import numpy as np
import torch

from titanlite.config.layout import Layout
from titanlite.errors import UserError
from titanlite.ops.dropout import sample_keys

MIX_BLOCK = 4096
_MIX_STREAM = 0x6D6978  # the block permutations' key stream, apart from the datasets' (0, 1, ...)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a bijective avalanche of 64-bit words."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def stream_keys(seed: int, stream: int, epochs: np.ndarray) -> np.ndarray:
    """One 64-bit key per element: the permutation of (seed, stream, epoch)."""
    head = np.asarray([(seed & (2**64 - 1)) ^ (stream * 0x51ED27)], dtype=np.uint64)
    head = _mix64(head + _GOLDEN)
    return _mix64(head ^ _mix64(np.asarray(epochs, dtype=np.uint64) + _GOLDEN))


def permute(x: np.ndarray, n: int, keys: np.ndarray) -> np.ndarray:
    """pi_key(x) for x in [0, n): a bijection of [0, n) per key (see the module docstring)."""
    half = max(1, (max(n - 1, 1).bit_length() + 1) // 2)
    low = np.uint64((1 << half) - 1)
    shift = np.uint64(half)
    rounds = [_mix64(keys + np.uint64(r * 0x9E3779B97F4A7C15 % 2**64)) for r in range(6)]

    def feistel(v: np.ndarray, idx: np.ndarray) -> np.ndarray:
        left, right = v >> shift, v & low
        for rk in rounds:
            left, right = right, left ^ (_mix64(right ^ rk[idx]) & low)
        return (left << shift) | right

    y = np.asarray(x, dtype=np.uint64).copy()
    todo = np.arange(len(y))
    y = feistel(y, todo)
    while True:  # cycle walking: apply again until back inside [0, n)
        todo = todo[y[todo] >= np.uint64(n)]
        if not len(todo):
            return y.astype(np.int64)
        y[todo] = feistel(y[todo], todo)


def block_counts(weights: list[float]) -> np.ndarray:
    """Positions per block for each dataset: weights x MIX_BLOCK, rounded by largest remainder."""
    exact = np.asarray(weights, dtype=np.float64) / sum(weights) * MIX_BLOCK
    counts = np.floor(exact).astype(np.int64)
    order = np.argsort(-(exact - counts), kind="stable")
    counts[order[: MIX_BLOCK - counts.sum()]] += 1
    return counts


class GlobalBatchSampler:
    """Yields this rank's microbatches (lists of indices into the concatenated datasets), forever.
    Stateful: its state is the number of microbatches it has yielded."""

    def __init__(
        self,
        sizes: list[int],
        global_batch_size: int,
        seed: int,
        weights: list[float] | None = None,
        layout: Layout | None = None,
        dp_rank: int = 0,
        repeats: bool = False,
    ) -> None:
        """`layout`: the plan whose dp, local batch and accumulation cut this rank's microbatches
        (None: one rank reading whole global batches). `repeats`: a step may hold a sequence more
        than once (a rehearsal's, whose values nobody reads); else too little data is refused."""
        if (sum(sizes) < global_batch_size and not repeats) or min(sizes) < 1:
            raise UserError(
                f"the data has {sum(sizes)} sequences (per dataset: {sizes}) but training.global_batch_size "
                f"is {global_batch_size}; lower the batch or seq_len, or add data"
            )
        self.sizes = list(sizes)
        self.starts = np.cumsum([0, *sizes[:-1]], dtype=np.int64)
        self.counts = block_counts(weights or [1.0] * len(sizes))
        self.count_starts = np.cumsum([0, *self.counts[:-1]], dtype=np.int64)
        self.global_batch_size = global_batch_size
        self.local_batch = layout.local_batch if layout else global_batch_size
        self.dp_size = layout.dp if layout else 1
        self.grad_accum = layout.grad_accum if layout else 1
        self.dp_rank = dp_rank
        self.seed = seed
        self.microbatches_yielded = 0
        self._cached: tuple[int, np.ndarray] | None = None
        self._block_cache: tuple[int, np.ndarray, np.ndarray] | None = None

    def epochs(self, steps: int) -> list[float]:
        """How many times `steps` steps read each dataset over (a mixture's shares per block)."""
        shares = self.counts * (steps * self.global_batch_size / MIX_BLOCK)
        return (shares / np.asarray(self.sizes)).tolist()

    def epochs_line(self, steps: int) -> str:
        """What the data loader says as the run starts: the data and how often the run reads it."""
        epochs = self.epochs(steps)
        said = ", ".join(f"{e:.3g}" for e in epochs)
        said = f"{said} epoch(s) of it" if len(epochs) == 1 else f"of its datasets {said} epoch(s)"
        reread = max(epochs) > 1
        again = " (past one epoch a sequence is read again, in a new order)" if reread else ""
        return f"data: {sum(self.sizes):,} sequences; {steps} steps of {self.global_batch_size} read {said}{again}"

    def _block(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """(dataset, position in its own stream) of every position of one mixing block."""
        if self._block_cache is None or self._block_cache[0] != block:
            keys = stream_keys(self.seed, _MIX_STREAM, np.full(MIX_BLOCK, block))
            q = permute(np.arange(MIX_BLOCK), MIX_BLOCK, keys)
            d = np.searchsorted(self.count_starts, q, side="right") - 1
            c = np.empty(MIX_BLOCK, dtype=np.int64)
            for k, n in enumerate(self.counts):  # each dataset's positions in stream order
                sel = d == k
                c[sel] = block * n + np.arange(int(sel.sum()))
            self._block_cache = (block, d, c)
        return self._block_cache[1], self._block_cache[2]

    def datasets_of(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(dataset, position in that dataset's own stream) of global stream positions."""
        if len(self.sizes) == 1:
            return np.zeros(len(positions), np.int64), positions
        d, c = np.empty_like(positions), np.empty_like(positions)
        blocks, r = np.divmod(positions, MIX_BLOCK)
        for b in np.unique(blocks):
            sel = blocks == b
            bd, bc = self._block(int(b))
            d[sel], c[sel] = bd[r[sel]], bc[r[sel]]
        return d, c

    def sequences(self, positions: np.ndarray) -> np.ndarray:
        """Indices into the concatenated datasets of global stream positions."""
        d, c = self.datasets_of(np.asarray(positions, dtype=np.int64))
        out = np.empty(len(c), dtype=np.int64)
        for k, n in enumerate(self.sizes):
            sel = d == k
            epoch, pos = np.divmod(c[sel], n)
            out[sel] = self.starts[k] + permute(pos, n, stream_keys(self.seed, k, epoch))
        return out

    def global_batch(self, step: int) -> np.ndarray:
        """The ordered sequence indices of 0-based step `step`, for every rank alike."""
        if self._cached is None or self._cached[0] != step:
            g = self.global_batch_size
            self._cached = (step, self.sequences(np.arange(step * g, (step + 1) * g)))
        return self._cached[1]

    def order_hash(self, step: int) -> int:
        """A 52-bit hash (exact in a float64) of step `step`'s ordered global batch: ranks whose
        hashes differ split different batches (data_order_mismatch)."""
        idx = self.global_batch(step).astype(np.uint64)
        pos = _mix64(np.arange(1, len(idx) + 1, dtype=np.uint64) * _GOLDEN)
        return int(np.bitwise_xor.reduce(_mix64(idx ^ pos))) & ((1 << 52) - 1)

    def __iter__(self) -> GlobalBatchSampler:
        return self

    def shares(self, step: int) -> list[np.ndarray]:
        """Every rank's sequences of 0-based step `step`, rank by rank, each in microbatch order."""
        return np.split(self.global_batch(step), self.dp_size)

    def rank_share(self, step: int) -> np.ndarray:
        """This rank's sequences of 0-based step `step`, in microbatch order."""
        return self.shares(step)[self.dp_rank]

    def stream_position(self, step: int, micro: int) -> int:
        """Stream position of the first sequence of this rank's microbatch `micro` of 0-based
        `step` (the same at any dp and accumulation)."""
        rank_start = self.dp_rank * self.local_batch * self.grad_accum
        return step * self.global_batch_size + rank_start + micro * self.local_batch

    def keyed(self, batch, seed: int, step: int, micro: int, device: torch.device):
        """`batch` (this rank's microbatch `micro` of 0-based `step`) with its sequences' dropout
        keys (titanlite.ops.dropout.sample_keys), made on `device`."""
        first = self.stream_position(step, micro)
        return batch._replace(keys=sample_keys(seed, first, len(batch.inputs), device))

    def __next__(self) -> list[int]:
        step, micro = divmod(self.microbatches_yielded, self.grad_accum)
        start = micro * self.local_batch
        self.microbatches_yielded += 1
        return [int(i) for i in self.rank_share(step)[start : start + self.local_batch]]

    def __len__(self) -> int:  # DataLoader asks; the stream is endless
        return 2**62

    def state_dict(self) -> dict:
        return {"microbatches_yielded": self.microbatches_yielded}

    def load_state_dict(self, state: dict) -> None:
        self.microbatches_yielded = int(state["microbatches_yielded"])
