"""Per-module fingerprints of one training step (debug.fingerprint_step), which
titanlite.analysis.localize compares between two layouts to name where they part: (sum, sum of
squares, sum of |x|) per sequence of each module's output and of its gradient. Sums add over any
split of a sequence (context parallelism) or of a tensor (a tensor split's heads, hidden units
and residual-stream pieces), and a sequence is named by its place in the data stream, which no
layout changes. What a tensor split's ranks compute alike counts once (Recorder.gather)."""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from titanlite.distributed.parallel_dims import ParallelDims
from titanlite.distributed.parallelize import unwrap
from titanlite.distributed.param_init import canonical_name

FILE = "fingerprints.json"
logger = logging.getLogger("titanlite")


def summary(t: torch.Tensor, rows: int | None = None) -> list[list[float]]:
    """(sum, sum of squares, sum of |x|) of each of `rows` equal blocks of `t` along its first
    dimension (default: each row), in float64."""
    x = t.detach().reshape(rows or t.shape[0], -1).double()
    return torch.stack([x.sum(1), (x * x).sum(1), x.abs().sum(1)], 1).tolist()


def _accumulate(table: dict[int, list[float]], row: int, vec: list[float]) -> None:
    """Add a fingerprint into `table`'s row: the pieces of a sequence sum to its whole."""
    table[row] = [a + b for a, b in zip(table[row], vec, strict=True)] if row in table else vec


def merge(everyone: list[dict], same_on: int, into: dict) -> None:
    """Every rank's records (`everyone`, in rank order) summed per sequence into `into`. A tensor
    split's `same_on` ranks are consecutive (its axis is the mesh's innermost): what they compute
    alike (a replicated value, a block run whole, the per-sequence losses) records bitwise alike
    and counts once; their pieces and slices differ, and add."""
    for first in range(0, len(everyone), same_on):
        split = everyone[first : first + same_on]
        for key in {k for theirs in split for k in theirs}:
            for row in {r for theirs in split for r in theirs.get(key, {})}:
                vecs = [theirs[key][row] for theirs in split if row in theirs.get(key, {})]
                alike = len(vecs) == len(split) and all(v == vecs[0] for v in vecs)
                for vec in vecs[:1] if alike else vecs:
                    _accumulate(into.setdefault(key, {}), row, vec)


class Recorder:
    """Hooks on every module of `model` for one step. Wrap the step's loss function with
    `losses`, call `parameters` after backward (before clipping), then `gather`."""

    def __init__(
        self, model: torch.nn.Module, rows: Callable[[int, int], list[int]], same_on: int = 1
    ) -> None:
        """`rows(micro, n)`: the global sequence ids of the `n` rows of microbatch `micro`;
        `same_on`: a tensor split's degree, whose ranks are consecutive."""
        self.rows_of = rows
        self.same_on = same_on
        self.records: dict[str, dict[int, list[float]]] = {}
        self.order: list[str] = []
        self._rows: list[int] = []
        self._micro = 0
        self._positions = 0  # the microbatch's sequence positions (a token-major output's rows)
        self._forward = False
        self._calls: Counter[str] = Counter()
        self._handles: list[RemovableHandle] = []
        for name, module in unwrap(model).named_modules():
            label = canonical_name(name) or "(model)"
            self._handles.append(module.register_forward_hook(self._hook(label)))

    def losses(self, fn: Callable) -> Callable:
        """`fn` (sequence_losses' signature) with each call's sequences named for the hooks."""

        def wrapped(model, batch, path, step=None):
            self._rows = self.rows_of(self._micro, len(batch.inputs))
            self._calls, self._forward = Counter(), True
            self._positions = batch.inputs.shape[1]
            self._micro += 1
            try:
                return fn(model, batch, path, step)
            finally:
                self._forward = False  # a recomputation in backward is not a forward of the step

        return wrapped

    def _add(self, key: str, rows: list[int], t: torch.Tensor) -> None:
        if key not in self.records:
            self.records[key] = {}
            if self._micro == 1:
                self.order.append(key)
        if isinstance(t, DTensor):  # this rank's part (gather counts copies once)
            t = t.to_local()
        for row, vec in zip(rows, summary(t, len(rows)), strict=True):
            _accumulate(self.records[key], row, vec)

    def _hook(self, label: str):
        def hook(_module, _args, out) -> None:
            if not self._forward:
                return
            items = out if isinstance(out, (tuple, list)) else [out]
            outs = [t for t in items if isinstance(t, torch.Tensor) and self._per_row(t)]
            for i, t in enumerate(t for t in outs if t.is_floating_point()):
                name = label if len(outs) == 1 else f"{label}[{i}]"
                self._calls[name] += 1
                call = self._calls[name]
                suffix = f" call {call}" if call > 1 else ""
                self._add(f"{name}{suffix} forward", self._rows, t)
                if t.requires_grad:
                    rows, key = self._rows, f"{name}{suffix} grad"
                    t.register_hook(lambda g, rows=rows, key=key: self._add(key, rows, g))

        return hook

    def _per_row(self, t: torch.Tensor) -> bool:
        """Whether `t` is [B, ...] or token-major [B*S, ...] (module doc): either is summarised
        per sequence (`summary` views it as [B, -1])."""
        n = len(self._rows)
        return t.ndim >= 1 and t.shape[0] in (n, n * self._positions)

    def parameters(self, model: torch.nn.Module) -> None:
        """Each parameter's reduced gradient, whole (every rank calls this: FSDP gathers)."""
        for name, p in unwrap(model).named_parameters():
            if p.grad is None:
                continue
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            key = f"{canonical_name(name)} reduced grad"
            self.records[key] = {-1: summary(g.reshape(1, -1))[0]}
            self.order.append(key)

    def gather(self, loss: torch.Tensor) -> dict | None:
        """Every rank's records summed per sequence, with the step's loss; on rank 0 (else None)."""
        for h in self._handles:
            h.remove()
        mine = {k: v for k, v in self.records.items() if not k.endswith("reduced grad")}
        everyone: list[dict] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(everyone, mine)
        if dist.get_rank() != 0:
            return None
        merged = {k: dict(v) for k, v in self.records.items() if k.endswith("reduced grad")}
        merge(everyone, self.same_on, merged)
        return {"order": self.order, "records": merged, "loss": float(loss)}


class FingerprintStep:
    """The trainer's hook (titanlite.tools.hooks) that records debug.fingerprint_step: a row is
    named by its position in the data stream (datasets/sampler.py), the same at any layout."""

    def __init__(
        self, step: int, model: torch.nn.Module, sampler, folder: Path, dims: ParallelDims
    ) -> None:
        self.step, self.model, self.sampler, self.folder = step, model, sampler, folder
        self.dims = dims
        self.recorder: Recorder | None = None

    @classmethod
    def at(
        cls, step: int, model: torch.nn.Module, sampler, folder: Path, dims: ParallelDims
    ) -> FingerprintStep | None:
        """The hook for debug.fingerprint_step `step`; None when it is off (-1)."""
        return cls(step, model, sampler, folder, dims) if step > 0 else None

    def ready(self, s) -> None:
        if s.step == self.step:
            at = self.sampler.stream_position
            self.recorder = Recorder(
                self.model,
                lambda m, n: [at(s.step - 1, m) + i for i in range(n)],
                self.dims.layout.model_split,
            )
            s.losses = self.recorder.losses(s.losses)

    def backward(self, s) -> None:
        """After backward, before clipping: the reduced gradients, then everything gathered and
        written by rank 0 (host work on that step only)."""
        if self.recorder is None:
            return
        self.recorder.parameters(self.model)
        loss = s.loss.detach().clone()
        dist.all_reduce(loss, group=self.dims.dp_group)  # the logged loss: the shares of the step
        record = self.recorder.gather(loss)
        self.recorder = None
        if record is not None:
            path = self.folder / FILE
            path.write_text(json.dumps({"step": self.step, **record}))
            logger.info(f"fingerprints of step {self.step}: {path}")
