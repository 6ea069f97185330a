"""Cross-rank helpers: agreeing on an error, gradient clipping across shards; and the peak
FLOP/s of known accelerators."""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def first_error(error: str | None, group: dist.ProcessGroup | None = None) -> str | None:
    """Every rank of `group` passes its own error (None: fine) and gets the first one any rank
    had, so all raise the same one-line error together instead of some hanging in the next
    collective. A no-op without a process group."""
    if not dist.is_initialized():
        return error
    errors: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    return next((e for e in errors if e), None)


def grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of `grads` taken whole (a DTensor's over its shards), each tensor's squares
    accumulated in float64 and the tensors' sum too, so that two shardings of one gradient log
    one norm (a float32 norm's rounding grows with a tensor's size and differs by sharding:
    titanlite/components/README.md). Gradients on different meshes (FSDP's alone, FSDP's x a
    tensor split's) are summed per mesh, where DTensor counts a replicated one once, then
    together. A float64 device tensor, never read on the host."""
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    totals = []
    for group in _by_mesh(grads).values():
        norms = torch._foreach_norm(group, 2, dtype=torch.float64)
        total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))
        if isinstance(total, DTensor):  # each rank holds the norm of its shards (Partial)
            total = total.full_tensor()
        totals.append(total)
    return totals[0] if len(totals) == 1 else torch.linalg.vector_norm(torch.stack(totals))


def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Global L2 norm of all gradients (over shards too, grad_norm), clipped to max_norm if > 0;
    returns the pre-clip norm as a float64 device tensor, never read on the host here."""
    params = [p for p in params if p.grad is not None]
    total = grad_norm([p.grad for p in params])
    if max_norm > 0:
        for group in _by_mesh(params).values():  # a foreach op takes one mesh's DTensors
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
    return total


def _by_mesh(tensors: list[torch.Tensor]) -> dict[object, list[torch.Tensor]]:
    """`tensors` grouped by the mesh their gradients live on (None: plain tensors), in order."""
    out: dict[object, list[torch.Tensor]] = {}
    for t in tensors:
        g = t.grad if t.grad is not None else t
        out.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(t)
    return out


# Dense bf16 peak FLOP/s (no sparsity), for MFU.
_PEAK_BF16 = {
    "H100": 989e12,
    "H200": 989e12,
    "H800": 989e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
}


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    if device.type != "cuda" or dtype != torch.bfloat16:
        return None
    name = torch.cuda.get_device_name(device)
    return next((value for key, value in _PEAK_BF16.items() if key in name), None)


def set_deterministic() -> None:
    """training.deterministic: deterministic kernels only (an error where none exists). cuBLAS
    picks reduction splits by workspace unless given a fixed one, which it reads when its handle
    is made, at the first matmul (PyTorch's "Reproducibility" notes): set before any."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
