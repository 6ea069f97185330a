"""Dropout whose mask is a function of the sample, not of the rank that runs it.

torch's dropout draws from the device generator, so a sequence's mask depends on where the
layout puts it: dp=8 and dp=16 train on different masks. Here each sequence's key comes from its
position in the data stream, and element (sequence, site, i)'s mask is a hash of (key, site, i):
the same at every world size and accumulation, and again in a recomputation (activation
checkpointing) with no RNG state to stash. The hash is a 32-bit xorshift-multiply mixer (Wellons,
"Prospecting for Hash Functions", 2018) in int64 with every product below 2**63, so exact on every
backend; about ten integer operations an element (scripts/bench_dropout.py measures the cost).
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_ROUNDS = (0x7FEB352D, 0x2C1B3C6D)  # odd multipliers below 2**31: x * c < 2**63 for x < 2**32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit mix of int64 `x` (read modulo 2**32), uniform over [0, 2**32)."""
    x = x & _M32
    for c in _ROUNDS:
        x = x ^ (x >> 16)
        x = (x * c) & _M32
    return x ^ (x >> 15)


def sample_keys(seed: int, first: int, n: int, device: torch.device) -> torch.Tensor:
    """[n] int64 keys of the sequences at data-stream positions first .. first + n - 1 (made on
    the device: nothing waits on the host)."""
    pos = torch.arange(first, first + n, dtype=torch.int64, device=device)
    return _hash32(_hash32(pos) ^ _hash32(pos >> 32) ^ _hash32(torch.tensor(seed, device=device)))


def keyed_dropout(x: torch.Tensor, p: float, keys: torch.Tensor, site: int) -> torch.Tensor:
    """Dropout of `x` [B, ...] with probability `p`, sequence b's mask drawn from (keys[b], site);
    `site` tells apart the dropout layers of one forward (e.g. 2 x layer + branch)."""
    if p <= 0.0:
        return x
    per_sample = x[0].numel()
    base = _hash32(keys ^ _hash32(torch.full_like(keys, site)))
    counter = torch.arange(per_sample, dtype=torch.int64, device=x.device)
    keep = _hash32(base[:, None] + counter[None, :]) >= int(p * 2**32)
    return x * keep.view(x.shape).to(x.dtype) * (1.0 / (1.0 - p))
