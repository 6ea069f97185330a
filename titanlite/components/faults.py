"""Fault injection: the [debug] switches, in one object that the trainer and the checkpointer
ask. Every switch is off by default; nothing else in titanlite reads [debug] for a fault, but
the seed rule (titanlite.tools.seeds), which takes debug.seed_mode.

Faults that the diagnostics must detect (arXiv 2602.14462, "Silent Inconsistency in
Data-Parallel Full Fine-Tuning", studies the seed ones):
- same_data: every rank reads rank 0's share (the "rank not passed to the loader" bug);
- corrupt_labels_rank: that rank's labels are shuffled within each sequence (a bad batch);
- grad_noise_rank: Gaussian noise is added to that rank's local gradient before the reduction
  (a stand-in for a device with silent data corruption), applied by the diagnostics' gradient
  probe, so it needs diagnostics on;
- seed_mode: the settings of that study, S1-1 "shared" (titanlite's rule), S1-2 "rank0_differs",
  S1-3 "per_rank"; applied where the rule is, titanlite.tools.seeds. Dropout (model.dropout)
  makes seeds matter.
- flip_bit_step: one bit of one parameter flips on one rank (silent data corruption in a
  replica's weights, which only the replica check sees).
- stuck_loader_step: from that step on, one rank's loader hands out that step's batch again and
  again (a reader stuck on a stale buffer), while its sampler moves on.
- slow_rank: that rank's data loading takes extra host time, slow_factor - 1 times its own step
  time (a straggler: a slow loader or a busy host), which every other rank then waits for.
corrupt_labels, grad_noise and slow_rank act from fault_from_step: a fault that starts in a run
that was healthy, so rules that compare a rank with its own history have one.
Faults that the loop and the checkpointer must survive: a step without valid tokens, a NaN
loss, a rank killed at a step or inside a save, a rank that hangs before a step, a rank frozen
(SIGSTOP) inside a phase of a step, a save failing as on a full disk, the run folder's writes
failing as on a full or read-only disk.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from collections.abc import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from titanlite.components.run.plan import is_restart
from titanlite.config.job_config import Debug
from titanlite.diagnostics.replicas import as_bits
from titanlite.distributed.liveness import on_phase
from titanlite.ops.cross_entropy import IGNORE_INDEX
from titanlite.tools.seeds import fault_seed


class Faults:
    """This rank's view of the [debug] switches."""

    def __init__(self, debug: Debug, seed: int, rank: int, world: int) -> None:
        self.debug = debug
        self.rank = rank
        self.world = world
        # Whose share of the global batch this rank reads.
        self.data_rank = 0 if debug.same_data else None  # None: its own share (the mesh's dp rank)
        # Draws corrupt_labels' shuffles; checkpointed with the other RNG states.
        self.label_generator = torch.Generator().manual_seed(fault_seed(seed, rank))
        # Std of this rank's gradient noise relative to the gradient's RMS (0: none).
        self.grad_noise_scale = debug.grad_noise_scale if debug.grad_noise_rank == rank else 0.0
        self._stuck: list | None = None  # the batch a stuck loader repeats
        self._step = 0  # the step running (at_step)
        self._started: float | None = None  # host time the step started (slow_rank)
        self._own_s: float | None = None  # slow_rank: this rank's step time without its delay (EMA)
        self._slept = 0.0  # the delay slow_rank added to the step before
        if debug.freeze_step >= 0 and rank == debug.freeze_rank:
            on_phase(self.freeze)

    def freeze(self, phase: str) -> None:
        """Rank freeze_rank stops itself (SIGSTOP, as a debugger or an operator would) as it enters
        freeze_phase of freeze_step: a frozen process whose heartbeat stops with it. It stops a
        second into the phase, after its heartbeat (every 0.5 s) has published the phase."""
        if self._step == self.debug.freeze_step and phase == self.debug.freeze_phase:
            time.sleep(1.0)
            os.kill(os.getpid(), signal.SIGSTOP)

    def labels(self, step: int, labels: torch.Tensor) -> torch.Tensor:
        """A microbatch's host labels as this step's faults leave them."""
        if step in self.debug.ignore_all_labels_steps:
            labels = torch.full_like(labels, IGNORE_INDEX)
        if self.rank == self.debug.corrupt_labels_rank and step >= self.debug.fault_from_step:
            labels = labels.clone()
            for row in labels:  # shuffle each sequence's valid labels among its valid positions
                valid = (row != IGNORE_INDEX).nonzero().flatten()
                row[valid] = row[valid[torch.randperm(len(valid), generator=self.label_generator)]]
        return labels

    def stuck_batch(self, step: int, micro: list) -> list:
        """The step's microbatches as this rank's loader delivers them: from stuck_loader_step
        on, on stuck_loader_rank, the batch of that step again."""
        d = self.debug
        if d.stuck_loader_step < 0 or self.rank != d.stuck_loader_rank or step < d.stuck_loader_step:
            return micro
        if step == d.stuck_loader_step or self._stuck is None:
            self._stuck = micro
        return self._stuck

    def flip_bit(self, step: int, model: torch.nn.Module) -> None:
        """Rank flip_bit_rank flips the lowest bit of its first parameter's first local element
        as this step starts: its replica silently differs from then on."""
        if step != self.debug.flip_bit_step or self.rank != self.debug.flip_bit_rank:
            return
        for p in model.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            if local.numel():
                with torch.no_grad():
                    bits = as_bits(local.detach().view(-1)[:1])
                    bits ^= 1
                return

    def slow_loader(self, step: int) -> None:
        """Rank slow_rank, in its data loading, from fault_from_step: a host delay of
        (slow_factor - 1) x its own step time (an EMA of its step times less the delays added, so
        the delay does not feed on itself): its steps take about slow_factor times as long."""
        d = self.debug
        if self.rank != d.slow_rank:
            return
        now = time.perf_counter()
        if self._started is not None:
            own = now - self._started - self._slept
            self._own_s = own if self._own_s is None else 0.8 * self._own_s + 0.2 * own
        self._started, self._slept = now, 0.0
        if step >= d.fault_from_step and self._own_s is not None:
            self._slept = (d.slow_factor - 1) * self._own_s
            time.sleep(self._slept)

    def at_step(self, step: int, model: torch.nn.Module) -> None:
        """As a step starts, before its batch: the faults that fire at a step."""
        self._step = step
        self.kill_at_step(step)
        self.interrupt("start")
        self.hang_at_step(step)
        self.flip_bit(step, model)

    def losses(self, fn: Callable) -> Callable:
        """The training loss function `fn` (titanlite.components.loss.sequence_losses), wrapped
        when a loss fault is set: rank 0's per-sequence losses are multiplied at nan_loss_step by
        NaN (the non-finite stop) and at spike_step by spike_scale (the spike guard)."""
        d = self.debug
        if self.rank != 0 or (d.nan_loss_step < 0 and d.spike_step < 0):
            return fn
        factors = {d.spike_step: d.spike_scale, d.nan_loss_step: float("nan")}

        def faulty(*args, **kwargs):
            out = fn(*args, **kwargs)
            return out._replace(ce=out.ce * factors.get(self._step, 1.0))

        return faulty

    def kill_at_step(self, step: int) -> None:
        """Rank sigkill_rank dies (SIGKILL) as this step starts: a crash to recover from. Only in
        a run's first attempt, so a worker group that torchrun restarts gets past it."""
        if step == self.debug.sigkill_step and self.rank == self.debug.sigkill_rank and not is_restart():
            os.kill(os.getpid(), signal.SIGKILL)

    def interrupt(self, phase: str) -> None:
        """Rank 0 sends SIGINT to its launcher (to itself without torchrun) in `phase` of
        signal_step (debug.signal_phase): the stop path, at a known moment."""
        d = self.debug
        if self._step == d.signal_step and phase == d.signal_phase and self.rank == 0 and not is_restart():
            os.kill(os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else os.getpid(), signal.SIGINT)

    def hang_at_step(self, step: int) -> None:
        """Rank hang_rank stops responding as this step starts (before it takes its batch), as on
        a hung data read: its peers wait in their next collective until comm.timeout_s."""
        if step == self.debug.hang_step and self.rank == self.debug.hang_rank:
            while True:
                time.sleep(60)

    def kill_in_save(self, step: int) -> None:
        """Rank 0 dies inside this step's save, after DCP wrote, before the publish."""
        if step == self.debug.sigkill_in_save and self.rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)

    def write_error(self, name: str) -> OSError | None:
        """Rank 0's write of the run folder's file `name` fails, from write_error_step on, as on
        a full or a read-only disk (components/run/files.py cuts the half record back)."""
        kind = self.debug.write_error
        if kind == "none" or self.rank != 0 or self._step < self.debug.write_error_step:
            return None
        code = errno.ENOSPC if kind == "full" else errno.EROFS
        return OSError(code, f"{os.strerror(code)} (injected by debug.write_error)", name)

    def save_fails(self, step: int) -> bool:
        """The last rank's checkpoint write of this step fails as on a full disk."""
        return step == self.debug.fail_save_step and self.rank == self.world - 1


class FullDiskWriter(dcp.FileSystemWriter):
    """Faults.save_fails: this rank's shard write fails as on a full disk, inside DCP, so
    the failure travels the real path (DCP gathers it and raises on every rank)."""

    def write_data(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device (injected by debug.fail_save_step)")
