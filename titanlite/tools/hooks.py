"""The step's side concerns as hooks: the diagnostics, the spike guard, the fingerprints
recorder, the heartbeat, fault injection (titanlite.faults) and the rehearsal's meter are
objects with some of the calls below, and the trainer makes them in this order, each call in
the order the hooks were registered:

  begin(step)                 as the step starts, before its data
  microbatch(step, m, batch)  each microbatch as read, on the host; returns the batch to use
  ready(step)                 the data on the device: the plan (micro, skip_grad_sync, losses)
                              is decided here, before the forward
  backward(step)              after backward, before the clip
  before_update(step)         the norm known, before the update: a hook may add to `skip`
  after_update(step)          the update applied (or skipped) on the device
  close()                     the run ends, however it ends

Every call but close runs on the hot path: nothing in it may wait on the host. The log step
reads what the hooks left on the device (titanlite/train.py `_log`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

CALLS = ("begin", "microbatch", "ready", "backward", "before_update", "after_update", "close")


@dataclass
class Step:
    """One optimizer step as it passes through the trainer and its hooks."""

    step: int
    skip_grad_sync: bool  # the earlier microbatches skip the gradient reduction
    losses: Callable  # the per-sequence loss (titanlite.components.loss.sequence_losses' signature)
    micro: list = field(default_factory=list)  # this rank's microbatches on the device
    loss: torch.Tensor | None = None  # this rank's share of the step's loss
    sample_sums: torch.Tensor | None = None  # per-sequence summed losses, in microbatch order
    terms: dict[str, torch.Tensor] = field(default_factory=dict)  # the model's loss terms
    grad_norm: torch.Tensor | None = None  # the reduced gradient's norm, before clipping
    tokens: torch.Tensor | None = None  # valid tokens over every rank and microbatch
    skip: torch.Tensor | None = None  # the update is skipped (a device bool)
    guard: torch.Tensor | None = None  # the spike guard's verdict row, when it is on
    lr: float = 0.0  # the rate this step's update uses


class Hooks:
    """The registered hooks, called in order; a hook defines only the calls it needs."""

    def __init__(self, hooks: list[Any]) -> None:
        self._calls: dict[str, list[Callable]] = {name: [] for name in CALLS}
        for hook in hooks:
            self.add(hook)

    def add(self, hook: Any) -> None:
        """Register `hook` after the others; None (a concern that is off) is left out."""
        if hook is None:
            return
        found = [name for name in CALLS if callable(getattr(hook, name, None))]
        if not found:
            raise TypeError(f"{type(hook).__name__} defines none of the hook calls {CALLS}")
        for name in found:
            self._calls[name].append(getattr(hook, name))

    def _run(self, name: str, *args: Any) -> None:
        for fn in self._calls[name]:
            fn(*args)

    def microbatch(self, s: Step, m: int, batch: Any) -> Any:
        for fn in self._calls["microbatch"]:
            batch = fn(s, m, batch)
        return batch

    def begin(self, s: Step) -> None:
        self._run("begin", s)

    def ready(self, s: Step) -> None:
        self._run("ready", s)

    def backward(self, s: Step) -> None:
        self._run("backward", s)

    def before_update(self, s: Step) -> None:
        self._run("before_update", s)

    def after_update(self, s: Step) -> None:
        self._run("after_update", s)

    def close(self) -> None:
        self._run("close")
