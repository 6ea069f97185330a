"""CountSketch: a shared-seed sparse random projection of a gradient to k dimensions.

Coordinate i goes to bucket h(i) with sign s(i), both from a hash seeded identically on every
rank, so <sketch(a), sketch(b)> is an unbiased estimate of <a, b> with variance at most
(|a|^2 |b|^2 + <a, b>^2) / k: a cosine's error is about sqrt(2 / k) (0.044 at k = 1024).
It costs O(D) per gradient of D values and no memory per parameter: the hash is computed from
the coordinate index, in chunks. A dense k x D Gaussian projection would cost k x D FLOPs.
"""

from __future__ import annotations

import torch

_P = 2**31 - 1  # a Mersenne prime; indices are reduced mod P before multiplying, no int64 overflow
_CHUNK = 1 << 22


class CountSketch:
    def __init__(self, k: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.k = k
        self.a, self.b, self.c, self.d = (int(x) for x in torch.randint(1, _P, (4,), generator=g))

    def add_(self, out: torch.Tensor, values: torch.Tensor, offset: int) -> None:
        """out[k] += sketch of the flat `values`, whose first element is coordinate `offset`."""
        flat = values.reshape(-1)
        for start in range(0, flat.numel(), _CHUNK):
            part = flat[start : start + _CHUNK]
            idx = torch.arange(offset + start, offset + start + part.numel(), device=part.device) % _P
            bucket = (idx * self.a + self.b) % _P % self.k
            sign = ((idx * self.c + self.d) % _P % 2) * 2 - 1
            out.index_add_(0, bucket, part.to(out.dtype) * sign.to(out.dtype))
