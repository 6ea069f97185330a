"""The training loop: `python -m titanlite.train --config FILE [--section.key value ...]` (via
torchrun; ./run_train.sh checks the config first).

Hot-path rule: between log steps nothing waits on the host. Metrics stay device tensors and are
read once per log step (`_log`); zero-token, non-finite and spiking steps are skipped on the
device.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from titanlite.components.checkpoint.checkpointer import Checkpointer
from titanlite.components.checkpoint.hf_export import export_run
from titanlite.components.evaluate import build_evaluator
from titanlite.components.fingerprints import FingerprintStep
from titanlite.components.loss import LossBalancer, forward_backward, sequence_losses
from titanlite.components.metrics import MetricsWriter, scalar_tags
from titanlite.components.optimizer import build_lr_scheduler, build_optimizer, set_skip
from titanlite.components.run.folder import open_run_folder, run_info
from titanlite.components.run.plan import checkpoint_folder, trace_folder
from titanlite.components.run.stop import StopSignals
from titanlite.components.spike_guard import SpikeGuard
from titanlite.components.step_window import RunRates, StepWindow
from titanlite.config import JobConfig, config_help, parse_args, wants_help
from titanlite.config.fields import due
from titanlite.config.job_config import plugin_hook
from titanlite.datasets.batch import Microbatch
from titanlite.datasets.build import build_dataloader, build_dataset, build_tokenizer
from titanlite.datasets.spec import check_data_files
from titanlite.diagnostics.component import Diagnostics
from titanlite.distributed.groups import init_distributed
from titanlite.distributed.liveness import (
    Heartbeat,
    flight_recorder_env,
    lost_in_set_up,
    lost_peer,
    phase,
)
from titanlite.distributed.parallel_dims import ParallelDims, resolve_device
from titanlite.distributed.parallelize import materialize
from titanlite.distributed.utils import clip_grad_norm_, set_deterministic
from titanlite.errors import ENDINGS, LostRank, TrainingError, report
from titanlite.models.registry import build_meta_model
from titanlite.tools.hooks import Hooks, Step
from titanlite.tools.memory import check_memory
from titanlite.tools.process import die_with_parent, init_logging
from titanlite.validation import validate

logger = init_logging()


class Trainer:
    def __init__(
        self, cfg: JobConfig, config_path: str | None = None, stops: StopSignals | None = None
    ) -> None:
        self.cfg = cfg
        t = cfg.training
        self.stops = stops or StopSignals()
        self.device = resolve_device(t.device)
        if self.device.type == "cuda":
            flight_recorder_env(trace_folder(cfg), cfg.comm.trace_buffer)
        init_distributed(self.device, cfg.comm.timeout_s, fake_world=cfg.rehearsal.world)
        self.rank = dist.get_rank()
        self.heartbeat = Heartbeat(cfg.comm.timeout_s, watch=self.device.type == "cuda")
        self.layout = layout = validate(cfg, dist.get_world_size())
        check_data_files(cfg)
        self.dims = dims = ParallelDims.build(
            layout, self.device, t.mixed_precision_param, t.mixed_precision_reduce
        )
        # Fault injection (titanlite.faults) only when the config names its [faults] section.
        self.faults = plugin_hook(cfg, "faults", t.seed, self.rank, dims.dp_size)
        seed = self.faults.seed if self.faults else t.seed
        torch.manual_seed(seed)  # dropout (the rule: titanlite.tools.seeds); init has its own seeds
        keyed = cfg.model.dropout > 0 and cfg.model.dropout_masks == "sample"
        self.dropout_seed = seed if keyed else None
        if t.deterministic:
            set_deterministic()

        # The model is checked (name, flavor, capabilities, memory) before the data is tokenized.
        self.tokenizer = build_tokenizer(cfg)
        self.meta = meta = build_meta_model(cfg, self.tokenizer.vocab_size if self.tokenizer else 0)
        # the model's labels path when it has one, chunked or whole
        self.loss_path = meta.loss_path()
        self.memory_estimate = check_memory(meta, cfg, self.layout, self.device, dims.param_dtype)
        dataset = build_dataset(cfg, self.tokenizer, meta.args.vocab_size)
        self.evaluator = build_evaluator(cfg, dims, self.tokenizer, meta.loss_path(evaluating=True))
        cuda = self.device.type == "cuda"
        self.dataloader = build_dataloader(cfg, dataset, self.layout, dims.dp_rank, cuda, seed=seed)
        sampler = self.dataloader.batch_sampler
        self.model = materialize(
            meta.spec.parallelize_fn(meta.model, dims, cfg), dims, t.seed, bool(cfg.rehearsal.world)
        )
        self.diagnostics = Diagnostics(cfg, self.model, dims, self.layout, sampler, dataset.trace)
        self.optimizer = build_optimizer(self.model, cfg)
        self.scheduler = build_lr_scheduler(self.optimizer, cfg)
        self.guard = SpikeGuard(cfg.spike_guard, self.device, dims.dp_group)
        self.balancer = LossBalancer(
            cfg.loss.normalization, dims.dp_group, dims.token_ranks, layout.grad_accum
        )

        info = run_info(cfg, dims, self.diagnostics.method_used)
        self.run_dir, resume, self.run_lock = open_run_folder(
            cfg, config_path, info, dataset.identity
        )
        folder = checkpoint_folder(cfg, self.run_dir)
        # a failed write of rank 0's stops every rank
        self.metrics = MetricsWriter.for_run(cfg, self.run_dir, resume, folder, self.stops.fail)
        self.checkpointer = Checkpointer(
            cfg,
            folder,
            self.model,
            self.optimizer,
            self.scheduler,
            self.run_dir,
            data=dataset.identity,
        )
        if self.faults:
            self.faults.attach(self)  # through the parts' seams, before a restore or a batch
        self.checkpointer.track(
            {"diagnostics": self.diagnostics, "spike_guard": self.guard},
            self.diagnostics.generators(),
        )
        # The step's side concerns, in the order the trainer calls them (titanlite.tools.hooks).
        fingerprints = FingerprintStep.at(
            cfg.debug.fingerprint_step, self.model, sampler, self.run_dir, dims
        )
        guard = self.guard if self.guard.enabled else None
        self.hooks = Hooks([self.faults, self.heartbeat, self.diagnostics, fingerprints, guard])
        self.start_step = self.checkpointer.restore(resume, meta)
        done = (self.start_step - 1) * self.layout.grad_accum  # the data position is the step's
        self.dataloader.batch_sampler.load_state_dict({"microbatches_yielded": done})
        self._batches: Iterator | None = None  # begin() starts the loader's workers
        self.rates = RunRates(
            layout.tokens_per_rank_step,
            layout.world,
            t.steps,
            meta.flops_per_token,
            self.device,
            dims.param_dtype,
        )
        self.window = StepWindow.of(self.model, self.balancer.statistics)
        self.last_step = min(t.steps, s) if (s := cfg.debug.stop_after_step) > 0 else t.steps

    # ---- the step -------------------------------------------------------------------------------
    def next_microbatches(self, s: Step) -> list[Microbatch]:
        micro = []
        if self._batches is None:  # a caller that runs train_step itself, without begin()
            self._batches = iter(self.dataloader)
        for m in range(self.layout.grad_accum):
            batch = self.hooks.microbatch(s, m, next(self._batches))
            if self.dropout_seed is not None:  # masks keyed by sample (titanlite.ops.dropout)
                batch = self.dataloader.batch_sampler.keyed(
                    batch, self.dropout_seed, s.step - 1, m, self.device
                )
            micro.append(self.dims.piece(batch.to(self.device)))
        return micro

    def train_step(self, step: int) -> None:
        """One optimizer step; its side concerns are hooks (titanlite.tools.hooks: the order of the
        calls). Its parts are named for torch.profiler (titanlite.data, .forward, .backward, .clip,
        .optimizer: scripts/bench.py's step-time breakdown)."""
        s = Step(step, self.layout.skip_grad_sync, sequence_losses)
        self.hooks.begin(s)
        with phase("data"):
            s.micro = self.next_microbatches(s)
        self.hooks.ready(s)  # the plan is decided before the forward
        s.loss, s.sample_sums, s.terms = forward_backward(
            self.model, s.micro, self.balancer, self.dims,
            skip_grad_sync=s.skip_grad_sync, path=self.loss_path, losses=s.losses,
        )  # fmt: skip
        self.hooks.backward(s)
        with phase("clip"):
            s.grad_norm = clip_grad_norm_(self.model.parameters(), self.cfg.training.max_norm)
        s.tokens = self.balancer.global_tokens()
        s.skip = (s.tokens == 0) | ~torch.isfinite(s.grad_norm)  # decided on the device; hooks add
        self.hooks.before_update(s)
        s.lr = self.scheduler.get_last_lr()[0]  # a host number: the rate this step's update uses
        with phase("optimizer"):
            set_skip(self.optimizer, s.skip)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.hooks.after_update(s)
        self.window.add(
            step, s.loss, s.tokens, s.grad_norm, s.skip, s.lr, s.guard, s.terms,
            until_log=lambda: self.steps_to_log(step),
        )  # fmt: skip

    def steps_to_log(self, step: int) -> int | None:
        """The steps from `step` to the next log step (0: `step` is one); None in a rehearsal,
        which reads its window without logging."""
        if self.cfg.rehearsal.world:
            return None
        return next(s - step for s in range(step, self.last_step + 1) if self.is_log_step(s))

    def is_log_step(self, step: int) -> bool:
        """Also every checkpoint and eval step: a checkpoint follows a log, so no step's record is
        lost, and an eval reads the host there."""
        return (
            step in (self.start_step, self.last_step)
            or due(step, self.cfg.metrics.log_every)
            or self.checkpointer.due(step)
            or self.is_eval_step(step)
        )

    def is_eval_step(self, step: int) -> bool:
        return self.evaluator is not None and self.evaluator.due(step)

    def _log(self, step: int, window_s: float, elapsed_s: float) -> None:
        """The log step: one read of the window and one of the diagnostics; records and events."""
        w = self.window.read(self.dims.dp_group)
        spikes = self.guard.spikes(w.steps, w.guard)
        w.check_skips({s for s, _ in spikes}, self.dims.token_ranks)
        rows = w.rows(window_s, elapsed_s, self.rates)
        diag, alerts = self.diagnostics.collect()
        if diag:
            rows[-1]["diag"] = {
                k.split("/", 1)[1]: v for k, v in scalar_tags("diag", diag[-1]).items()
            }
        spiked = [(s, self.guard.event(v, self.run_dir)) for s, v in spikes]
        events = self.diagnostics.spike_alerts(spiked, diag)
        if self.rank == 0:
            self.metrics.check()
            self.metrics.write(rows)
            self.metrics.write_diagnostics(diag)
            self.metrics.write_alerts(events + alerts)
        self.guard.check_stop(spikes)
        stops = [a for a in alerts if a.is_alert]  # notes (batch_size_advice) never stop a run
        if stops and self.cfg.diagnostics.on_alert == "stop":
            raise TrainingError(f"diagnostics.on_alert = 'stop': {stops[0].line()}")

    def evaluate(self, step: int) -> None:
        rec, samples = self.evaluator.run(self.model, step)
        if self.rank == 0:
            self.metrics.write_eval(rec, samples)

    # ---- the loop -------------------------------------------------------------------------------
    def begin(self, timeout_s: int | None) -> None:
        """As the loop starts: a stop signal from now on ends it between steps (stops.arm), and
        the loader's workers start, so a stop during the set-up leaves none behind."""
        self.stops.arm(timeout_s)
        self._batches = iter(self.dataloader)

    def train(self) -> None:
        steps = self.last_step
        sync_debug = self.cfg.debug.sync_debug and self.device.type == "cuda"
        start = window_start = time.perf_counter()
        self.begin(self.cfg.comm.timeout_s)
        step, stop = self.start_step, 0
        if self.evaluator is not None and self.cfg.eval.at_start and self.start_step == 1:
            self.evaluate(0)  # the model as loaded; a resumed run has it in eval.jsonl already
        try:
            for step in range(self.start_step, steps + 1):
                # From the second step: the first compiles (training.compile, FlexAttention's
                # kernels), and compiling and autotuning wait on the device by design.
                if sync_debug and step > self.start_step:
                    torch.cuda.set_sync_debug_mode("error")
                self.train_step(step)
                stop = self.stops.poll()
                if self.is_log_step(step) or stop:
                    self.heartbeat.idle()
                    if sync_debug:
                        torch.cuda.set_sync_debug_mode("default")
                    now = time.perf_counter()
                    self._log(step, now - window_start, now - start)
                    if self.is_eval_step(step):
                        self.evaluate(step)
                    if self.checkpointer.due(step):
                        self.checkpointer.save(step)
                    # a signal in the eval or save, a failed write
                    stop = self.stops.settle() or stop
                    if stop and step < steps:  # at the last step: after the exports, below
                        self.checkpointer.stop(step, stop)
                    window_start = time.perf_counter()
            self.heartbeat.idle()
            self.checkpointer.wait()  # the last async save is settled before the run reports success
        except RuntimeError as e:
            how = lost_peer(e) if dist.get_world_size() > 1 else None
            if how:
                raise LostRank(self.heartbeat.explain(step, how)) from None
            raise
        exports = export_run(self.cfg, self.model, self.meta, self.tokenizer, self.run_dir)
        # the last look: a signal after it (after "done:") is void
        stop = self.stops.finish() or stop
        self.metrics.finish(
            self.start_step, steps, time.perf_counter() - start, self.checkpointer.folder, exports
        )
        if stop:  # in the last step or the exports: the run did all, but says so
            self.checkpointer.stop(steps, stop, finished=True)

    def close(self) -> None:
        self.hooks.close()
        self.checkpointer.close()
        self.metrics.close()
        if self.run_lock is not None:
            self.run_lock.release()


USAGE = """usage: torchrun [torchrun options] -m titanlite.train [--config FILE] [--section.key VALUE ...]
(./run_train.sh runs it so, after checking the config; without torchrun: one rank)"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if wants_help(argv):
        print(config_help(USAGE))
        return 0
    die_with_parent()
    trainer = None
    try:
        stops = StopSignals()  # first: a signal during set-up stops at once, in one line
        try:
            trainer = Trainer(*parse_args(argv), stops)
        except RuntimeError as e:  # a peer that stopped or failed in the set-up
            if (line := lost_in_set_up(e)) is None:
                raise
            raise LostRank(line) from None
        trainer.train()
        return 0
    except ENDINGS as e:
        code = report(e)
        if isinstance(e, LostRank):
            if trainer is not None:
                trainer.close()
            sys.stdout.flush()
            # A clean teardown would wait on the lost peer (gloo's pending sends, tens of seconds).
            os._exit(code)
        return code
    finally:
        if trainer is not None:
            trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
