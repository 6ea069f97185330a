"""Reading device values on the host once: the only kind of host sync the training loop allows,
and only on log steps."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


def readback(tensors: Any) -> Any:
    """The values of the device tensors in `tensors` (a tensor, or lists, tuples and dicts of
    them) with one host read (one sync, not one per tensor), in the same structure. Each comes
    back as `tensor.tolist()` gives it, as floats (exact for integers below 2**53)."""
    leaves, spec = tree_flatten(tensors)
    flat = torch.cat([t.detach().reshape(-1).double() for t in leaves]).tolist()
    out, pos = [], 0
    for t in leaves:
        values = flat[pos : pos + t.numel()]
        pos += t.numel()
        out.append(_nest(values, tuple(t.shape)))
    return tree_unflatten(out, spec)


def _nest(values: list[float], shape: tuple[int, ...]) -> Any:
    if not shape:
        return values[0]
    if len(shape) == 1:
        return values
    step = len(values) // shape[0] if shape[0] else 0
    return [_nest(values[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]
