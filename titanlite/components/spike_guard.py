"""The spike guard: skip the update of a step whose global gradient norm (or loss) stands far
above its recent history (the "skip mechanism" of the Loss Dispersion Reference Manual's anomaly
tables), on the device through the zero-token skip's found_inf path. Skipped steps never enter
the history, so a run of spikes cannot raise its own threshold; the history is checkpointed, so a
resumed run decides as the uninterrupted one."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from titanlite.config.job_config import SpikeGuard as SpikeGuardConfig
from titanlite.errors import TrainingError


class SpikeVerdict(NamedTuple):
    """The guard's decision on one step, read on the host at the log step."""

    spike: bool  # the step's update was skipped as a spike (the same on every rank)
    value: float  # the guarded metric's value
    threshold: float
    in_a_row: int  # spikes skipped in a row, this one included


class SpikeGuard:
    def __init__(
        self, cfg: SpikeGuardConfig, device: torch.device, group: dist.ProcessGroup | None
    ) -> None:
        self.cfg = cfg
        self.metric = cfg.skip  # "off", "grad_norm" or "loss"
        self.enabled = self.metric != "off"
        self.group = group
        self.history = torch.zeros(cfg.window, dtype=torch.float64, device=device)
        self.count = torch.zeros((), dtype=torch.int64, device=device)  # values ever added
        self.consecutive = torch.zeros((), dtype=torch.int64, device=device)
        self._slots = torch.arange(cfg.window, device=device)

    def check(
        self, loss_share: torch.Tensor, grad_norm: torch.Tensor, skipped: torch.Tensor
    ) -> torch.Tensor:
        """Every rank, every step, before the optimizer step. `skipped`: the step is skipped for
        another reason (no valid token, non-finite norm). Returns [spike, value, threshold,
        consecutive spikes] (float64, device); the spike flag is the same on every rank."""
        if self.metric == "loss":  # the global loss: the ranks' shares summed (one all-reduce)
            value = loss_share.detach().double().clone()
            if self.group is not None:
                dist.all_reduce(value, group=self.group)
        else:
            value = grad_norm.detach().double()
        known = self.count.clamp(max=self.history.numel())
        used = self._slots < known
        n = known.clamp(min=1).double()
        mean = torch.where(used, self.history, 0.0).sum() / n
        std = (torch.where(used, (self.history - mean) ** 2, 0.0).sum() / n).sqrt()
        threshold = mean + self.cfg.k * std
        spike = (known >= self.cfg.min_history) & (value > threshold) & ~skipped
        keep = ~(spike | skipped)
        slot = (self.count % self.history.numel()).view(1)
        self.history.index_copy_(
            0, slot, torch.where(keep, value, self.history.index_select(0, slot))
        )
        self.count += keep.long()
        self.consecutive.copy_(torch.where(spike, self.consecutive + 1, 0))
        return torch.stack([spike.double(), value, threshold, self.consecutive.double()])

    def before_update(self, s) -> None:
        """The trainer's hook (titanlite.tools.hooks): a spike's update is skipped with the rest."""
        s.guard = self.check(s.loss, s.grad_norm, s.skip)
        s.skip = s.skip | s.guard[0].bool()

    @staticmethod
    def spikes(steps: list[int], rows: list[list[float]] | None) -> list[tuple[int, SpikeVerdict]]:
        """The spikes among a log window's steps, from check()'s rows read on the host."""
        if rows is None:  # the guard is off
            return []
        verdicts = [SpikeVerdict(bool(r[0]), r[1], r[2], int(r[3])) for r in rows]
        return [(s, v) for s, v in zip(steps, verdicts, strict=True) if v.spike]

    def event(self, verdict: SpikeVerdict, run_dir: Path) -> dict:
        """What the spike_skipped alert (titanlite.diagnostics.catalogue) reports of a skipped step."""
        return {
            "metric": self.metric,
            "value": verdict.value,
            "threshold": verdict.threshold,
            "k": self.cfg.k,
            "run_dir": str(run_dir),
        }

    def check_stop(self, spikes: list[tuple[int, SpikeVerdict]]) -> None:
        """Stop the run once more than max_consecutive spikes were skipped in a row."""
        limit = self.cfg.max_consecutive
        for step, verdict in spikes:
            if verdict.in_a_row > limit:
                raise TrainingError(
                    f"the spike guard skipped {verdict.in_a_row} steps in a row, up to step {step} (more "
                    f"than spike_guard.max_consecutive = {limit}): the run diverges or its data went "
                    "bad; resume from an earlier checkpoint with a lower optimizer.lr, or check the data"
                )

    def state_dict(self) -> dict:
        """Host values (read at a checkpoint step, which is a log step)."""
        if not self.enabled:
            return {}
        return {
            "history": self.history.tolist(),
            "count": int(self.count),
            "consecutive": int(self.consecutive),
        }

    def load_state_dict(self, state: dict) -> None:
        if not self.enabled or not state:
            return
        history, count, window = state["history"], state["count"], self.history.numel()
        if len(history) != window:  # another window: the most recent values, oldest first
            start = count % len(history) if count > len(history) else 0
            history = (history[start:] + history[:start])[: min(count, len(history))][-window:]
            count = len(history)
            history += [0.0] * (window - count)
        self.history.copy_(torch.tensor(history, dtype=torch.float64))
        self.count.fill_(count)
        self.consecutive.fill_(state["consecutive"])
