"""Host reads and collectives: readback, the one kind of host sync the training loop allows (on
log steps only), and counters for what a step must not grow silently (exact counts in the tests,
next to timings in scripts/bench.py), which cost far more than they measure, so they wrap
counted steps, never timed ones."""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten


def readback(tensors: Any) -> Any:
    """The values of the device tensors in `tensors` (a tensor, or lists, tuples and dicts of
    them) with one host read (one sync, not one per tensor), in the same structure. Each comes
    back as `tensor.tolist()` gives it, as floats (exact for integers below 2**53)."""
    leaves, spec = tree_flatten(tensors)
    flat = torch.cat([t.detach().reshape(-1).double() for t in leaves]).tolist()
    out, pos = [], 0
    for t in leaves:  # each leaf's values back in its shape, on the host
        out.append(np.reshape(flat[pos : pos + t.numel()], tuple(t.shape)).tolist())
        pos += t.numel()
    return tree_unflatten(out, spec)


HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")


class HostSyncCounter:
    """Counts every host read of a tensor (HOST_READS) and torch.cuda.synchronize, per
    `phase(name)`, so a test can tell log steps (where reading metrics is allowed) from the rest.
    The patches are Python-level, blind inside compiled graphs: count eager steps (compiled ones
    are checked on a GPU by torch.cuda.set_sync_debug_mode, scripts/gpu_check.py)."""

    def __init__(self) -> None:
        self.counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self._phase: str | None = None
        self._installed = False

    def install(self) -> None:
        if self._installed:
            return
        self._installed = True
        for name in HOST_READS:
            setattr(torch.Tensor, name, self._wrap(getattr(torch.Tensor, name), name))
        torch.cuda.synchronize = self._wrap(torch.cuda.synchronize, "cuda.synchronize")

    def _wrap(self, orig, name: str):
        def counted(*args, **kwargs):
            if self._phase is not None:
                self.counts[self._phase][name] += 1
            return orig(*args, **kwargs)

        return counted

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        outer, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = outer


# Dispatcher ops that move data between ranks (c10d: torch.distributed's calls, DDP and FSDP;
# _c10d_functional: DTensor and functional collectives). Waits and wrappers are not collectives.
_NOT_COLLECTIVES = {"wait_tensor", "_wrap_tensor_autograd"}


class CollectiveCounter(TorchDispatchMode):
    """Counts the collectives issued while active (whatever issued them: DDP's reducer, FSDP,
    DTensor), per (group label, op), with `payload`, the buffer each moves, and `wire`, what one
    rank sends of it in a ring of n ranks: (n-1)/n of it, twice for an all-reduce (nccl-tests'
    PERFORMANCE.md). `groups` labels this rank's group names; others count under `other`, or
    their own name if it is None."""

    def __init__(self, groups: dict[str, str] | None = None, other: str | None = None) -> None:
        super().__init__()
        self.groups = groups or {}
        self.other = other
        self.counts: collections.Counter = collections.Counter()
        self.payload: collections.Counter = collections.Counter()
        self.wire: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is not torch.Tensor for t in types):
            # A tensor subclass (DTensor) first: modes run before subclasses, so let it desugar
            # into plain ops, its own collectives included, which then come back here.
            return NotImplemented
        ns, op = func.namespace, func._opname
        if ns == "c10d" or (ns == "_c10d_functional" and op not in _NOT_COLLECTIVES):
            group, size = _group(ns, args, kwargs or {})
            key = (self.groups.get(group, self.other or group), op.rstrip("_"))
            payload = _payload(ns, op, args, size)
            self.counts[key] += 1
            self.payload[key] += payload
            twice = op.replace("_", "").startswith("allreduce")  # an all-reduce sends it twice
            self.wire[key] += payload * (size - 1) / size * (2 if twice else 1)
        return func(*args, **(kwargs or {}))

    def by_group(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for (group, op), n in sorted(self.counts.items()):
            out.setdefault(group, {})[op] = n
        return out


def _group(ns: str, args: tuple, kwargs: dict) -> tuple[str, int]:
    """The group's name and size."""
    if ns == "_c10d_functional":  # the group travels by name, the last positional argument
        name = str(kwargs.get("group_name", args[-1]))
        return name, _resolve_process_group(name).size()
    for a in args:  # c10d ops take the ProcessGroup as a boxed script object
        if isinstance(a, torch._C.ScriptObject):
            pg = torch._C._distributed_c10d.ProcessGroup.unbox(a)
            return pg.group_name, pg.size()
    return "?", 1


def _bytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    return sum(_bytes(y) for y in x) if isinstance(x, (list, tuple)) else 0


def _payload(ns: str, op: str, args: tuple, size: int) -> int:
    """The bytes one collective moves: its larger side (outputs or inputs, the first two
    arguments of c10d's ops); a functional all-gather's output is its input times the group."""
    if op == "barrier":
        return 0
    if ns == "_c10d_functional":
        return _bytes(args[0]) * (size if op.startswith("all_gather") else 1)
    return max(_bytes(args[0]), _bytes(args[1]) if len(args) > 1 else 0)
