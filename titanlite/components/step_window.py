"""The steps since the last log step, kept as device tensors and read on the host once there:
one all-reduce sums the loss shares over ranks (titanlite.components.loss) and one host read
takes everything, so every step gets its row in metrics.jsonl at no extra cost; a
mixture-of-experts model's expert load (components/expert_load.py) rides the same read.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from titanlite.components.expert_load import ExpertLoad, load_record
from titanlite.distributed.utils import peak_flops
from titanlite.errors import TrainingError
from titanlite.tools.instrument import readback
from titanlite.tools.memory import peak_memory_gib
from titanlite.tools.process import HEARTBEAT_S

logger = logging.getLogger("titanlite")
# The least expected time from a progress line to the log line it announces: less, and the
# two would print in the same second.
PROGRESS_GAP_S = 2.0


@dataclass
class WindowRecord:
    """The window on the host, the same on every rank."""

    steps: list[int]
    losses: list[float]  # each step's global loss (NaN where a rank's loss was non-finite)
    nonfinite_ranks: list[int]  # how many ranks had a non-finite loss, per step
    skipped: list[bool]  # the optimizer update was skipped (empty, a non-finite grad norm, a spike)
    grad_norms: list[float]  # each step's pre-clip gradient norm
    tokens: list[int]  # each step's valid tokens over all ranks (0: none in the global batch)
    lrs: list[float]  # each step's learning rate
    # The spike guard's [spike, value, threshold, spikes in a row] per step (None: guard off).
    guard: list[list[float] | None] | None = None
    # each step's named loss terms the model adds, global like the loss ({}: none)
    terms: list[dict[str, float]] | None = None
    # the window's expert load (expert_load.load_record; None: the model reports none)
    expert_load: dict | None = None

    def check_skips(self, spike_steps: set[int], ranks: int) -> None:
        """A non-finite loss stops the run; every other skipped step (but the spike guard's,
        which are events of their own) gets a warning saying why."""
        for s, bad in zip(self.steps, self.nonfinite_ranks, strict=True):
            if bad:
                raise TrainingError(
                    f"non-finite loss at step {s} on {bad} of {ranks} rank(s); its update was skipped "
                    "and the run stops. Lower optimizer.lr, raise warmup, or check the data"
                )
        for s, tokens, skipped in zip(self.steps, self.tokens, self.skipped, strict=True):
            if skipped and s not in spike_steps:
                why = "a non-finite gradient norm"
                if not tokens:
                    why = "no valid token in the whole global batch"
                logger.warning(f"step {s}: {why}; its optimizer update was skipped")

    def rows(self, window_s: float, elapsed_s: float, run: RunRates) -> list[dict]:
        """metrics.jsonl's rows of the window, one per step (`"row": "step"`); the last, the log
        step's, adds the window's throughput, memory and ETA (`"row": "log"`)."""
        rows = []
        for i, step in enumerate(self.steps):
            skipped = self.skipped[i]
            row = {
                "step": step,
                "row": "step",
                "loss": None if skipped else self.losses[i],
                "grad_norm": self.grad_norms[i],
                "lr": self.lrs[i],
                "valid_tokens": self.tokens[i],
                "skipped": skipped,
            }
            terms = self.terms[i] if self.terms else None
            if terms:  # the model's own loss terms, and the loss it trained on: the sum
                row["terms"] = None if skipped else terms
                row["loss_total"] = None if skipped else row["loss"] + sum(terms.values())
            rows.append(row)
        n = len(self.steps)
        # the steps that trained: a skipped step's loss is 0 (no token) or meaningless
        trained = [row["loss"] for row in rows if not row["skipped"]]
        tps = run.tokens_per_rank_step * n / max(window_s, 1e-9)
        log = rows[-1]
        log.update(
            row="log",
            loss_window_mean=sum(trained) / len(trained) if trained else None,
            loss_window_steps=len(trained),
            tokens_per_s=tps,
            tokens_per_s_global=tps * run.world,
            skipped_steps=sum(self.skipped),
            memory_gib=peak_memory_gib(run.device),
            elapsed_s=elapsed_s,
            eta_s=(run.total_steps - log["step"]) * window_s / n,
        )
        if self.expert_load is not None:
            log["expert_load"] = self.expert_load
        if run.flops_per_token:
            log["tflops"] = run.flops_per_token * tps / 1e12
            peak = peak_flops(run.device, run.param_dtype)
            if peak:
                log["mfu_pct"] = 100 * run.flops_per_token * tps / peak
        return rows


@dataclass(frozen=True)
class RunRates:
    """What turns a window's steps into throughput, MFU and ETA."""

    tokens_per_rank_step: float  # the plan's (titanlite.config.layout.Layout)
    world: int  # every rank of the job: the global figure is a rank's times this
    total_steps: int
    flops_per_token: int  # 0: unknown (no TFLOP/s, no MFU)
    device: torch.device
    param_dtype: torch.dtype


class StepWindow:
    def __init__(self, load: ExpertLoad | None = None) -> None:
        self._load = load  # the expert load of a model that reports one, summed on the device
        self._steps: list[int] = []
        self._shares: list[torch.Tensor] = []  # per step: [loss share, loss non-finite]
        self._norms: list[torch.Tensor] = []  # per step: [grad norm, valid tokens, update skipped]
        self._lrs: list[float] = []  # per step, from the host's scheduler
        self._guard: list[torch.Tensor] = []  # per step, when the spike guard is on
        self._terms: list[str] | None = None  # the model's loss terms' names, in the shares' order
        # the last line the console showed; the last step added
        self._said = self._added = time.monotonic()

    @classmethod
    def of(cls, model: nn.Module, statistics: Callable[[], torch.Tensor | None]) -> StepWindow:
        """The trainer's window, with the expert load when the model reports one (`statistics`:
        the step's, LossBalancer.statistics)."""
        return cls(ExpertLoad.of(model, statistics))

    def add(
        self,
        step: int,
        loss_share: torch.Tensor,
        tokens: torch.Tensor,
        grad_norm: torch.Tensor,
        skipped: torch.Tensor,
        lr: float,
        guard: torch.Tensor | None = None,
        terms: dict[str, torch.Tensor] | None = None,
        until_log: Callable[[], int | None] = lambda: None,
    ) -> None:
        """Record a step; every tensor stays on the device. `terms`: this rank's shares of the
        model's named loss terms (the same names every step). `until_log()`: the steps from this
        one to the next log step (0: this one is; None: none follows, as in a rehearsal), asked
        only when a progress line is due."""
        terms = terms or {}
        if self._terms is None:  # the first step tells
            self._terms = list(terms)
        elif list(terms) != self._terms:
            raise TrainingError(
                f"step {step}: the model's loss terms are {list(terms)}, not {self._terms} as before; "
                "a model returns the same named terms every training step"
            )
        self._steps.append(step)
        flag = (~torch.isfinite(loss_share)).to(loss_share.dtype)
        self._shares.append(
            torch.stack([loss_share, flag, *(terms[n].to(loss_share.dtype) for n in self._terms)])
        )
        self._norms.append(torch.stack([grad_norm.double(), tokens.double(), skipped.double()]))
        self._lrs.append(lr)
        if guard is not None:
            self._guard.append(guard)
        if self._load is not None:
            self._load.add()
        # a host clock, no device read: said before the next step would end past HEARTBEAT_S
        now = time.monotonic()
        last, self._added = now - self._added, now
        if now - self._said + last >= HEARTBEAT_S:
            ahead = until_log()
            # The line promises a log step: none where none follows, and none where the log line
            # would come within PROGRESS_GAP_S of it (the same second, on a console's clock).
            if ahead is not None and ahead * last >= PROGRESS_GAP_S:
                logger.info(
                    f"at step {step}; its figures show at the next log step (metrics.log_every)"
                )
                self._said = now

    def read(self, group: dist.ProcessGroup | None) -> WindowRecord:
        """One all-reduce and one host read; the window is empty afterwards."""
        self._said = self._added = time.monotonic()
        shared = torch.stack(self._shares).double()  # summed over ranks -> global values
        dist.all_reduce(shared, group=group)
        guarded = [torch.stack(self._guard)] if self._guard else []
        figures = self._load.take() if self._load is not None else None
        loaded = [] if figures is None else [figures]
        shared, norms, *rest = readback([shared, torch.stack(self._norms), *guarded, *loaded])
        guard, load = rest[: len(guarded)], rest[len(guarded) :]
        record = WindowRecord(
            steps=list(self._steps),
            losses=[loss for loss, *_ in shared],
            nonfinite_ranks=[int(bad) for _, bad, *_ in shared],
            skipped=[bool(s) for _, _, s in norms],
            guard=guard[0] if guard else None,
            grad_norms=[norm for norm, _, _ in norms],
            tokens=[int(t) for _, t, _ in norms],
            lrs=list(self._lrs),
            terms=[dict(zip(self._terms, row[2:], strict=True)) for row in shared],
            expert_load=load_record(self._load.names, load[0]) if load else None,
        )
        for kept in (self._steps, self._shares, self._guard, self._norms, self._lrs):
            kept.clear()
        return record
