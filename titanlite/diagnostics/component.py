"""The diagnostics component, one of the trainer's hooks (titanlite.tools.hooks), and collect()
on log steps. A measured step's rows (step_record.py) and Gram or sketches are gathered
asynchronously on the component's own group, so none of it queues behind the gradient traffic;
results stay device tensors until collect() reads them all at once."""

from __future__ import annotations

import logging
import socket
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from titanlite.config.job_config import JobConfig
from titanlite.config.layout import Layout
from titanlite.diagnostics.alerts import Alert, AlertMonitor
from titanlite.diagnostics.probe import GradProbe, TensorSplit, install
from titanlite.diagnostics.replicas import ReplicaCheck, gather
from titanlite.diagnostics.stats import NoiseScale, step_metrics, term_metrics
from titanlite.diagnostics.step_record import (
    RECORD_VERSION,
    SHARED,
    RankRow,
    RankStep,
    content_fingerprint,
    fold_replicas,
    unpack,
)
from titanlite.diagnostics.stragglers import Arrival
from titanlite.distributed.parallel_dims import ParallelDims
from titanlite.ops.cross_entropy import IGNORE_INDEX
from titanlite.tools.hooks import Step
from titanlite.tools.instrument import readback

logger = logging.getLogger("titanlite")


@dataclass
class _Pending:
    """A measured step whose gathers are in flight: device tensors, read at the next log step."""

    step: int
    per_rank: torch.Tensor  # [world, row]: each rank's step_record.RankStep, packed
    directions: torch.Tensor  # exact: [world, world] Gram; sketch: [world, k] sketches
    global_norm: torch.Tensor  # the step's reduced (pre-clip) gradient norm
    works: list
    exact: bool

    def gram(self) -> torch.Tensor:
        """[world, world] inner products of the ranks' local gradients (exact or from sketches)."""
        if self.exact:
            return self.directions
        d = self.directions.double()
        return d @ d.T


class Diagnostics:
    """Off (dp = 1 or diagnostics.enable = false) it measures nothing and builds nothing but the
    alert runner (the spike guard's alerts go through it); `group`, `probe`, `replicas` and
    `arrival` are None then. The method and the batch-size advice's unit are the plan's
    (`layout`); `sampler` (datasets/sampler.py GlobalBatchSampler) names each rank's sequences."""

    def __init__(
        self,
        job: JobConfig,
        model: torch.nn.Module,
        dims: ParallelDims,
        layout: Layout,
        sampler=None,
        trace: Callable[[int], list[dict]] | None = None,
    ) -> None:
        cfg = job.diagnostics
        self.cfg = cfg
        # The replicas compared: data-parallel ranks. With parallelism.axes each is
        # `layout.replica_ranks` consecutive ranks: `split` pieces of its sequences (a sequence
        # split), each held by `copies` ranks that read the same tokens and split the model's
        # tensors. Every rank measures its part, and the parts are folded into their replica as
        # the step is read (step_record.fold_replicas).
        self.world, self.split, self.copies = dims.dp_size, layout.seq_split, layout.model_split
        self.ranks = layout.world  # every rank of the group: world x replica_ranks
        self.trace = trace  # a sequence index -> its sources (file, row, token range)
        self.enabled = cfg.enable and self.world > 1
        self.measuring = False
        self._pending: list[_Pending] = []
        self.noise = NoiseScale(cfg.noise_scale_ema)
        self.group: dist.ProcessGroup | None = None
        self.probe: GradProbe | None = None
        self.replicas: ReplicaCheck | None = None
        self.arrival: Arrival | None = None
        self._times = [float("nan")] * 3  # this measured step's Arrival times
        self._ready: dict | None = None  # before_update's end_step inputs, for after_update
        self._terms: list[str] = []  # the model's loss terms, in the measured rows' order
        self.sampler = sampler
        if cfg.enable and self.world == 1:
            logger.info("diagnostics: off (they compare ranks, and dp = 1)")
        self.method = layout.diagnostics_method
        # exact needs the whole-step local gradient at once: a measured step reduces only on its
        # last microbatch. The sketch adds up per microbatch when the layout reduces each one.
        self.whole_step = self.method == "exact"
        self.per_microbatch = (
            self.method == "sketch" and layout.grad_accum > 1 and not layout.skip_grad_sync
        )
        # each rank's host (gathered below); off, only the spike guard's alerts, which name no rank
        hosts: list = [socket.gethostname()] * self.ranks
        if self.enabled:
            timeout = timedelta(seconds=job.comm.timeout_s)
            self.group = dist.new_group(ranks=list(range(self.ranks)), timeout=timeout)
            dist.all_gather_object(hosts, socket.gethostname(), group=self.group)
        hosts = hosts[:: layout.replica_ranks]  # a replica's: its first rank's
        # every alert goes through it: also the spike guard's, which works at dp = 1
        self.monitor = AlertMonitor(job.alerts, hosts, layout.batch_unit, layout.rank_share)
        if self.enabled:
            self.arrival = Arrival(self.group, dims.device)
            self.replicas = ReplicaCheck(model, dims, cfg.replica_check_every, self.group)
            mesh = dims.tensor_mesh
            split = TensorSplit(self.copies, mesh.get_local_rank() if mesh is not None else 0)
            self.probe = GradProbe(
                self.method, self.ranks, cfg.sketch_dim, job.training.seed, dims.device, split
            )
            install(model, self.probe)

    @property
    def method_used(self) -> str:
        """What run.json records: the method, or "off"."""
        return self.method if self.enabled else "off"

    def state_dict(self) -> dict:
        """Host state that a resumed run must continue from (the same on every rank)."""
        if not self.enabled:
            return {}
        noise = {"trace_ema": self.noise.trace_ema, "gsq_ema": self.noise.gsq_ema}
        return {"noise": noise, "monitor": self.monitor.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if self.enabled and state:
            self.noise = NoiseScale(self.cfg.noise_scale_ema, **state["noise"])
            if note := self.monitor.load_state_dict(state["monitor"]):
                logger.info(note)

    def generators(self) -> dict[str, torch.Generator]:
        """RNG streams a checkpoint must carry (the gradient-noise fault's)."""
        return {"grad_noise": self.probe.noise_generator} if self.probe is not None else {}

    def begin(self, s: Step) -> None:
        """As the step starts, before its data: arm the probe and start the step's clock."""
        self.measuring = self.enabled and self.cfg.measures(s.step)
        if self.enabled:
            self.probe.start(self.measuring, self.per_microbatch)
            self.arrival.start()

    def ready(self, s: Step) -> None:
        """The data loaded. A measured step times it and waits for the other ranks at a one-value
        barrier (stragglers.py); a measured `exact` step skips the earlier microbatches' reduction,
        so that the probe sees each rank's whole-step gradient at once."""
        if self.measuring:
            self._times = self.arrival.arrive()
            s.skip_grad_sync = s.skip_grad_sync or self.whole_step

    def before_update(self, s: Step) -> None:
        """end_step's inputs from the trainer's step: its microbatches (datasets/batch.py
        Microbatch), per-sequence loss sums and the pre-clip gradient norm; the sequences' indices
        from the sampler. Host values go to the device without a wait. The gathers start after
        the update (after_update), once every hook has had its say on the skip flag."""
        if not self.measuring:
            return
        tokens = torch.cat([(batch.labels != IGNORE_INDEX).sum(-1) for batch in s.micro])
        content = content_fingerprint(torch.cat([batch.inputs for batch in s.micro]))
        index = self.sampler.rank_share(s.step - 1)
        # indices and the hash are integers below 2**53: exact in float64
        host = np.concatenate([index, [self.sampler.order_hash(s.step - 1)], self._times])
        host = torch.from_numpy(host.astype(np.float64)).to(content.device, non_blocking=True)
        sequence_index, order, times = host.split([len(index), 1, len(self._times)])
        self._ready = dict(
            sequence_loss_sums=s.sample_sums,
            sequence_tokens=tokens,
            sequence_index=sequence_index,
            sequence_content=content,
            order=order,
            times=times,
            terms=s.terms,
        )

    def end_step(
        self,
        step: int,
        grad_norm: torch.Tensor,
        *,
        sequence_loss_sums: torch.Tensor,
        sequence_tokens: torch.Tensor,
        sequence_index: torch.Tensor,
        sequence_content: torch.Tensor,
        order: torch.Tensor,
        times: torch.Tensor | None = None,
        terms: dict[str, torch.Tensor] | None = None,
        shared: torch.Tensor | None = None,
    ) -> None:
        """Start the async gathers of this measured step (step_record.RankStep's fields, per
        sequence in microbatch order; `times`: NaN, none, unless given; `terms`: this rank's
        shares of the model's loss terms, and `shared`: its values of step_record.SHARED, which
        ride the same gather). Reads nothing on the host."""
        if not self.measuring:
            return
        self.probe.measuring = self.measuring = False
        sums, tokens = sequence_loss_sums.double(), sequence_tokens.double()
        if times is None:
            times = torch.full((3,), float("nan"), dtype=torch.float64, device=sums.device)
        self._terms = list(terms or {})
        mine = RankStep(
            loss_sum=sums.sum(),
            tokens=tokens.sum(),
            norm_sq=self.probe.local_norm_sq(),
            order=order,
            times=times,
            shared=shared,
            terms=torch.stack([t.double() for t in terms.values()]) if terms else None,
            sequence_loss_sums=sums,
            sequence_tokens=tokens,
            sequence_index=sequence_index,
            sequence_content=sequence_content,
        ).pack()
        per_rank, gathered = gather(mine, self.ranks, self.group)
        if self.whole_step:
            directions = self.probe.gram.clone()
            reduced = dist.all_reduce(directions, group=self.group, async_op=True)
        else:
            directions, reduced = gather(self.probe.sketch.clone(), self.ranks, self.group)
        norm = grad_norm.detach().double().clone()
        self._pending.append(
            _Pending(step, per_rank, directions, norm, [gathered, reduced], self.whole_step)
        )

    def after_update(self, s: Step) -> None:
        """After the optimizer step: start a measured step's gathers, with the step's values every
        rank must share as this rank holds them (step_record.SHARED), the skip flag final; and the
        replica check if one is due. Reads nothing."""
        if self.measuring and self._ready is not None:
            shared = torch.cat([t.double().reshape(-1) for t in (s.tokens, s.grad_norm, s.skip)])
            self.end_step(s.step, s.grad_norm, shared=shared, **self._ready)
        self._ready = None
        if self.replicas is not None and self.replicas.due(s.step):
            self.replicas.start(s.step)

    def spike_alerts(self, spikes: list[tuple[int, dict]], records: list[dict]) -> list[Alert]:
        """spike_skipped (catalogue.py) of each (step, SpikeGuard.event), with the step's sequences:
        with their losses where `records` (this log step's diagnostics) measured it; else from the
        data order, on the host (no device read)."""
        measured = {r["step"]: r["rank_samples"] for r in records}
        alerts = []
        for step, event in spikes:
            per_rank = measured.get(step)
            if per_rank is None:
                per_rank = [
                    [{"index": int(i), "tokens": None, "loss": None} for i in share]
                    for share in self.sampler.shares(step - 1)
                ]
            for alert in self.monitor.observe("spikes", step, event):
                alert.samples = [self.locate(r, x) for r, rank in enumerate(per_rank) for x in rank]
                alerts.append(alert)
        return alerts

    def locate(self, rank: int, sample: dict) -> dict:
        """A sequence record of `rank` with its sources (file, row) added."""
        sources = self.trace(sample["index"]) if self.trace is not None else []
        return {"rank": rank, **sample, "sources": sources}

    def collect(self) -> tuple[list[dict], list[Alert]]:
        """Log step: one host read of every pending measured step and replica check; returns the
        steps' records and the alerts they raise (the same on every rank)."""
        if not self._pending and (self.replicas is None or not self.replicas.pending):
            return [], []
        for p in self._pending:
            for w in p.works:
                w.wait()
        checks = self.replicas.take() if self.replicas is not None else []
        steps = [
            {"per_rank": p.per_rank, "gram": p.gram(), "norm": p.global_norm} for p in self._pending
        ]
        steps, hashes = readback((steps, [c.hashes for c in checks]))
        alerts = []
        for check, h in zip(checks, hashes, strict=True):
            drift = self.replicas.compare(check.step, h)
            alerts += self.monitor.observe("replicas", check.step, {"drift": drift})
        records = []
        for p, got in zip(self._pending, steps, strict=True):
            rec = self._record(p.step, got)
            raised = self.monitor.update(rec)
            for alert in raised:  # the data behind each rank an alert names
                samples = rec["rank_samples"]
                alert.samples = [self.locate(r, s) for r in alert.ranks for s in samples[r]]
            rec["alerts"] = [a.name for a in raised]
            records.append(rec)
            alerts += raised
        self._pending.clear()
        return records, alerts

    def _record(self, step: int, got: dict) -> dict:
        """A measured step's diagnostics.jsonl record from what its gathers read back."""
        rows = [unpack(row, len(self._terms)) for row in got["per_rank"]]
        # every rank's own, before the ranks of a replica fold into one (rules.shared_mismatch)
        shared = {name: [row[f"shared_{name}"] for row in rows] for name in SHARED}
        rows, gram = fold_replicas(
            rows, got["gram"], self.split, not self.per_microbatch, self.copies
        )
        ranks = [RankRow.of(row) for row in rows]
        tokens, norms_sq = [r.tokens for r in ranks], [r.norm_sq for r in ranks]
        rec = {
            "step": step,
            "version": RECORD_VERSION,
            "method": self.method,
            "norms": "sketch" if self.per_microbatch else "exact",
        }
        rec.update(step_metrics([r.loss_sum for r in ranks], tokens, norms_sq, gram))
        rec.update(term_metrics(self._terms, [r.terms for r in ranks], tokens))
        total = sum(tokens)
        rank_sq = [
            g * (total / n) ** 2 if n > 0 else 0.0 for g, n in zip(norms_sq, tokens, strict=True)
        ]
        noise = self.noise.update(rank_sq, tokens, got["norm"] ** 2)
        known = [r.step_s for r in ranks if r.step_s is not None]
        rec.update(
            noise_scale_tokens=noise,
            batch_tokens=int(total),
            batch_sequences=sum(len(r.sequences) for r in ranks),
            noise_to_batch=noise / total if noise is not None and total > 0 else None,
            rank_load_s=[r.load_s for r in ranks],
            rank_wait_s=[r.wait_s for r in ranks],
            step_s=statistics.median(known) if known else None,
            rank_samples=[r.sequences for r in ranks],
            data_order=[r.order for r in ranks],
            replica_ranks=self.split * self.copies,
            rank_shared=shared,
        )
        return rec
