"""Reading device values on the host once: the only kind of host sync the training loop allows,
and only on log steps."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def readback(tensors: Sequence[torch.Tensor]) -> list[Any]:
    """The values of several device tensors with one host read (one sync, not one per tensor).
    Each comes back as `tensor.tolist()` gives it, as floats (exact for integers below 2**53)."""
    flat = torch.cat([t.detach().reshape(-1).double() for t in tensors]).tolist()
    out, pos = [], 0
    for t in tensors:
        values = flat[pos : pos + t.numel()]
        pos += t.numel()
        out.append(_nest(values, tuple(t.shape)))
    return out


def _nest(values: list[float], shape: tuple[int, ...]) -> Any:
    if not shape:
        return values[0]
    if len(shape) == 1:
        return values
    step = len(values) // shape[0] if shape[0] else 0
    return [_nest(values[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]
