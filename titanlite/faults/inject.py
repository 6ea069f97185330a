"""The fault injector: this rank's view of the [faults] switches (titanlite.faults.switches), a
hook of the trainer's step (titanlite.tools.hooks) and a listener of its phases."""

from __future__ import annotations

import errno
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from titanlite.components.run.plan import is_restart
from titanlite.diagnostics.replicas import as_bits
from titanlite.distributed.liveness import on_phase
from titanlite.faults.switches import FaultSwitches
from titanlite.ops.cross_entropy import IGNORE_INDEX
from titanlite.tools.hooks import Step
from titanlite.tools.seeds import fault_seed, rank_seed


class Faults:
    """This rank's injector of the [faults] switches: a hook of the trainer's step (begin,
    microbatch, ready, close) and a listener of its phases (titanlite.distributed.liveness)."""

    def __init__(self, switches: FaultSwitches, seed: int, rank: int, world: int) -> None:
        self.on, self.rank, self.world = switches, rank, world
        # this rank's seed of dropout and data order: the run's, unless a seed fault is on
        self.seed = rank_seed(seed, rank, switches.seed_mode)
        # draws corrupt_labels' shuffles; checkpointed with the other RNG streams
        self.label_generator = torch.Generator().manual_seed(fault_seed(seed, rank))
        self.model: torch.nn.Module | None = None
        self.probe = None  # the diagnostics' gradient probe (grad_noise), when they are on
        self._stuck: list | None = None  # the batch a stuck loader repeats
        self._step = 0  # the step running
        self._started: float | None = None  # host time the step started (slow_rank)
        self._own_s: float | None = None  # slow_rank: this rank's step time without its delay (EMA)
        self._slept = 0.0  # the delay slow_rank added to the step before
        # phases are heard from the first step: a Trainer that fails in its set-up (never closed)
        # leaves no listener behind in the process
        self._listening: Callable[[], None] | None = None

    def attach(self, trainer: Any) -> None:
        """Reach the trainer's parts through their seams, before it restores a checkpoint or
        reads a batch."""
        self.model = trainer.model
        self.probe = trainer.diagnostics.probe
        if self.on.same_data:
            trainer.dataloader.batch_sampler.dp_rank = 0
        ckpt = trainer.checkpointer
        ckpt.track({}, {"labels": self.label_generator})
        ckpt.per_rank_torch = self.on.seed_mode != "shared"  # a resharded resume reseeds them
        ckpt.storage_writer, ckpt.written = self.storage_writer, self.kill_in_save
        if trainer.metrics.files is not None:  # rank 0 writes the run folder
            trainer.metrics.files.fail_write = self.write_error

    # ---- the hook calls -----------------------------------------------------------------------
    def begin(self, s: Step) -> None:
        """As a step starts, before its batch: the faults that fire at a step."""
        self._step = step = s.step
        on = self.on
        if self._listening is None:
            self._listening = on_phase(self.phase)
        if step == on.sigkill_step and self.rank == on.sigkill_rank and not is_restart():
            os.kill(os.getpid(), signal.SIGKILL)  # a crash; a restarted worker group gets past it
        self.phase("start")
        if step == on.hang_step and self.rank == on.hang_rank:
            while True:  # a hung data read: the peers wait in their next collective
                time.sleep(60)
        if step == on.flip_bit_step and self.rank == on.flip_bit_rank:
            self.flip_bit()
        if self.probe is not None and self.rank == on.grad_noise_rank:
            self.probe.noise_scale = on.grad_noise_scale if step >= on.fault_from_step else 0.0

    def microbatch(self, s: Step, m: int, batch: Any) -> Any:
        """A microbatch's host labels as this step's faults leave them; before the first, the
        straggler's delay."""
        on = self.on
        if m == 0 and self.rank == on.slow_rank:
            self.slow_loader(s.step)
        labels = batch.labels
        if s.step in on.ignore_all_labels_steps:
            labels = torch.full_like(labels, IGNORE_INDEX)
        if self.rank == on.corrupt_labels_rank and s.step >= on.fault_from_step:
            labels = labels.clone()
            for row in labels:  # shuffle each sequence's valid labels among its valid positions
                valid = (row != IGNORE_INDEX).nonzero().flatten()
                row[valid] = row[valid[torch.randperm(len(valid), generator=self.label_generator)]]
        return batch._replace(labels=labels) if labels is not batch.labels else batch

    def ready(self, s: Step) -> None:
        """The step's microbatches as a stuck loader delivers them, and its loss as scaled."""
        on = self.on
        if 0 <= on.stuck_loader_step <= s.step and self.rank == on.stuck_loader_rank:
            if s.step == on.stuck_loader_step or self._stuck is None:
                self._stuck = s.micro
            s.micro = self._stuck
        factor = {on.spike_step: on.spike_scale, on.nan_loss_step: float("nan")}.get(s.step)
        if factor is not None and self.rank == 0:
            fn = s.losses

            def scaled(*args, **kwargs):
                out = fn(*args, **kwargs)
                return out._replace(ce=out.ce * factor)

            s.losses = scaled

    def close(self) -> None:
        if self._listening is not None:
            self._listening()
            self._listening = None

    # ---- the faults ---------------------------------------------------------------------------
    def phase(self, name: str) -> None:
        """As this rank enters a phase (or "start" of a step): rank 0's Ctrl-C of signal_step (to
        its launcher), and freeze_rank's SIGSTOP a second into the phase (after the heartbeat's
        next publish, every 0.5 s)."""
        on = self.on
        moment = {"checkpoint": "save"}.get(name, name)
        at_signal = self._step == on.signal_step and moment == on.signal_phase
        if at_signal and self.rank == 0 and not is_restart():
            launcher = "TORCHELASTIC_RUN_ID" in os.environ
            os.kill(os.getppid() if launcher else os.getpid(), signal.SIGINT)
        if self._step == on.freeze_step and name == on.freeze_phase and self.rank == on.freeze_rank:
            time.sleep(1.0)
            os.kill(os.getpid(), signal.SIGSTOP)

    def flip_bit(self) -> None:
        """The lowest bit of the first parameter's first local element flips."""
        for p in self.model.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            if local.numel():
                with torch.no_grad():
                    bits = as_bits(local.detach().view(-1)[:1])
                    bits ^= 1
                return

    def slow_loader(self, step: int) -> None:
        """A host delay of (slow_factor - 1) x this rank's own step time (an EMA without the delays
        added, so the delay does not feed on itself), from fault_from_step."""
        now = time.perf_counter()
        if self._started is not None:
            own = now - self._started - self._slept
            self._own_s = own if self._own_s is None else 0.8 * self._own_s + 0.2 * own
        self._started, self._slept = now, 0.0
        if step >= self.on.fault_from_step and self._own_s is not None:
            self._slept = (self.on.slow_factor - 1) * self._own_s
            time.sleep(self._slept)

    def write_error(self, name: str) -> OSError | None:
        """Rank 0's write of the run folder's file `name` fails, from write_error_step on, as on
        a full or a read-only disk (components/run/files.py cuts the half record back)."""
        kind = self.on.write_error
        if kind == "none" or self.rank != 0 or self._step < self.on.write_error_step:
            return None
        code = errno.ENOSPC if kind == "full" else errno.EROFS
        return OSError(code, f"{os.strerror(code)} (injected by faults.write_error)", name)

    def storage_writer(self, step: int, path: str) -> dcp.FileSystemWriter:
        """The checkpoint writer of `step`: the last rank's fails inside DCP at fail_save_step."""
        if step == self.on.fail_save_step and self.rank == self.world - 1:
            return FullDiskWriter(path)
        return dcp.FileSystemWriter(path)

    def kill_in_save(self, step: int) -> None:
        """Rank 0 dies inside this step's save, after DCP wrote, before the publish."""
        if step == self.on.sigkill_in_save and self.rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)


class FullDiskWriter(dcp.FileSystemWriter):
    def write_data(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device (injected by faults.fail_save_step)")
