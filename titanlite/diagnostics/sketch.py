"""CountSketch: a shared-seed sparse random projection of a gradient to k dimensions.

Coordinate i goes to bucket h(i) with sign s(i), both the same on every rank, so
<sketch(a), sketch(b)> is an unbiased estimate of <a, b> with variance about
(|a|^2 |b|^2 + <a, b>^2) / k: a cosine's error is about sqrt(2 / k) (0.044 at k = 1021).

Built to cost two passes over the values (a multiply and a column sum), no per-value hashing
and no scatter. Coordinates come in segments of P (a prime near 2^20). Within a segment the sign
of offset j is T[(phi + j) mod P] from a cached random +-1 table T, and the bucket is
(j + beta) mod k; phi, beta and a whole-segment sign flip come from a hash of the segment's
index. So every pair of coordinates that share a bucket carries the product of two distinct
independent table signs (times independent flips across segments): the estimate is unbiased
with the CountSketch variance above. The segment is multiplied by a slice of T, viewed as
rows of k and summed over rows.

k is rounded down to a prime. With a power of two, a weight matrix's column (stride = row
length, a multiple of k) would land in a single bucket, and LLM gradients concentrate on a few
outlier feature columns: with a prime k the cosine's error on such a matrix stays within the
bound above, with a power of two it does not (tests/test_diagnostics.py holds both). Those
errors, and the sketch's time per value against a table-hashed index_add, as measured:
titanlite/diagnostics/README.md, `sketch`.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def prev_prime(n: int) -> int:
    """The largest prime <= n (n >= 2)."""
    while n > 2 and any(n % d == 0 for d in range(2, int(n**0.5) + 1)):
        n -= 1
    return n


_P = prev_prime(1 << 20)  # segment length = sign-table length


def _mix(x: int) -> int:
    """splitmix64: a well-spread 64-bit hash of an integer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class CountSketch:
    def __init__(self, k: int, seed: int) -> None:
        self.k = prev_prime(k)
        self.seed = seed
        g = torch.Generator().manual_seed(seed)
        self._sign = torch.randint(0, 2, (_P,), generator=g).float() * 2 - 1
        self._on: dict[torch.device, torch.Tensor] = {}
        self._scratch: dict[torch.device, torch.Tensor] = {}

    def _table(self, device: torch.device) -> torch.Tensor:
        if device not in self._on:
            self._on[device] = self._sign.to(device)
        return self._on[device]

    def _rows(self, n: int, device: torch.device) -> torch.Tensor:
        """A reused zeroed-tail buffer of whole rows of k for n values."""
        size = -(-n // self.k) * self.k
        buf = self._scratch.get(device)
        if buf is None or buf.numel() < size:
            buf = self._scratch[device] = torch.empty(size, device=device)
        buf = buf[:size]
        buf[n:].zero_()
        return buf

    def add_(self, out: torch.Tensor, values: torch.Tensor, offset: int) -> None:
        """out[k] += sketch of the flat `values`, whose first element is coordinate `offset`
        (the same coordinates on every rank: that is all the ranks share)."""
        flat = values.reshape(-1)
        sign = self._table(flat.device)
        pos = 0
        while pos < flat.numel():
            segment, within = divmod(offset + pos, _P)
            n = min(_P - within, flat.numel() - pos)
            h = _mix(self.seed * 0x100000001B3 + segment)
            phi, beta = (h + within) % _P, ((h >> 24) + within) % self.k
            rows = self._rows(n, flat.device)
            head = min(n, _P - phi)  # the table slice may wrap around
            torch.mul(flat[pos : pos + head], sign[phi : phi + head], out=rows[:head])
            if head < n:
                torch.mul(flat[pos + head : pos + n], sign[: n - head], out=rows[head:n])
            summed = rows.view(-1, self.k).sum(0)
            out.add_(summed.roll(beta), alpha=1.0 if (h >> 63) & 1 else -1.0)
            pos += n
