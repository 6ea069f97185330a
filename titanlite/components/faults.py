"""Fault injection: the [debug] switches, in one object that the trainer, the data path, the
gradient probe and the checkpointer ask. Every switch is off by default; nothing else in
titanlite reads [debug] for a fault.

Faults that the diagnostics must detect (arXiv 2602.14462, "Silent Inconsistency in
Data-Parallel Full Fine-Tuning", studies the seed ones):
- same_data: every rank reads rank 0's share (the "rank not passed to the loader" bug);
- corrupt_labels_rank: that rank's labels are shuffled within each sequence (a bad batch);
- grad_noise_rank: Gaussian noise is added to that rank's local gradient before the reduction
  (a stand-in for a device with silent data corruption), applied by the gradient probe;
- seed_mode: the settings of that study, S1-1 "shared" (all ranks share the seed of dropout and of
  the data shuffle, titanlite's normal mode), S1-2 "rank0_differs", S1-3 "per_rank". Dropout
  (model.dropout) makes seeds matter.
- flip_bit_step: one bit of one parameter flips on one rank (silent data corruption in a
  replica's weights, which only the replica check sees).
- stuck_loader_step: from that step on, one rank's loader hands out that step's batch again and
  again (a reader stuck on a stale buffer), while its sampler moves on.
Faults that the loop and the checkpointer must survive: a step without valid tokens, a NaN
loss, a rank killed at a step or inside a save, a rank that hangs, a save failing as on a full
disk.
"""

from __future__ import annotations

import os
import signal
import time

import torch
from torch.distributed.tensor import DTensor

from titanlite.components.loss import IGNORE_INDEX
from titanlite.config.job_config import Debug
from titanlite.diagnostics.replicas import as_bits

_SEED_STRIDE = 1_000_003


class Faults:
    """This rank's view of the [debug] switches."""

    def __init__(self, debug: Debug, seed: int, rank: int, world: int) -> None:
        self.debug = debug
        self.rank = rank
        self.world = world
        mode = debug.seed_mode
        differs = mode == "per_rank" or (mode == "rank0_differs" and rank == 0)
        # Seed of this rank's dropout RNG and of the data order: training.seed unless injected.
        self.seed = seed + _SEED_STRIDE * (rank + 1) if differs else seed
        # Whose share of the global batch this rank reads.
        self.data_rank = 0 if debug.same_data else rank
        # Draws corrupt_labels' shuffles; checkpointed with the other RNG states.
        self.label_generator = torch.Generator().manual_seed(seed + rank)
        # Some rank perturbs its gradient, so every rank routes its reduction through the probe.
        self.grad_noise = debug.grad_noise_rank >= 0 and world > 1
        # Std of this rank's gradient noise relative to the gradient's RMS (0: none).
        self.grad_noise_scale = debug.grad_noise_scale if debug.grad_noise_rank == rank else 0.0
        self._stuck: list | None = None  # the batch a stuck loader repeats

    def labels(self, step: int, labels: torch.Tensor) -> torch.Tensor:
        """A microbatch's host labels as this step's faults leave them."""
        if step in self.debug.ignore_all_labels_steps:
            labels = torch.full_like(labels, IGNORE_INDEX)
        if self.rank == self.debug.corrupt_labels_rank:
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

    def loss_factor(self, step: int) -> float:
        """What rank 0's loss of this step is multiplied by: NaN (the non-finite stop),
        spike_scale (the spike guard), else 1."""
        if self.rank != 0:
            return 1.0
        if step == self.debug.nan_loss_step:
            return float("nan")
        return self.debug.spike_scale if step == self.debug.spike_step else 1.0

    def kill_at_step(self, step: int) -> None:
        """Rank sigkill_rank dies (SIGKILL) as this step starts: a crash to recover from. Only in
        a run's first attempt, so a worker group that torchrun restarts gets past it."""
        if step == self.debug.sigkill_step and self.rank == self.debug.sigkill_rank and _first_attempt():
            os.kill(os.getpid(), signal.SIGKILL)

    def interrupt_at_step(self, step: int) -> None:
        """Rank 0 sends SIGINT to its launcher as this step starts (to itself without torchrun):
        the stop path, at a known step."""
        if step == self.debug.signal_step and self.rank == 0 and _first_attempt():
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

    def save_fails(self, step: int) -> bool:
        """The last rank's checkpoint write of this step fails as on a full disk."""
        return step == self.debug.fail_save_step and self.rank == self.world - 1


def _first_attempt() -> bool:
    """Not a worker group that torchrun restarted (a fault fires once per run)."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") in ("", "0")
