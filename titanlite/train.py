"""The trainer: `python -m titanlite.train --config FILE [--section.key value ...]` (via torchrun).

Hot-path rule: between log steps nothing waits on the host. Metrics stay device tensors and are
read once per log step (`_log`); zero-token and non-finite steps are skipped on the device.
Set-up lives with what it sets up (models/registry, distributed/parallelize, components/...);
this file holds the step and the loop.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.profiler import record_function

from titanlite.components.checkpoint import Checkpointer, export_weights
from titanlite.components.checkpoint_index import resume_changes
from titanlite.components.evaluate import Evaluator
from titanlite.components.faults import Faults
from titanlite.components.generate import sample_text
from titanlite.components.hf_checkpoint import load_hf_weights
from titanlite.components.hf_export import export_hf
from titanlite.components.loss import (
    IGNORE_INDEX,
    LossBalancer,
    loss_chunk,
    sequence_losses,
)
from titanlite.components.metrics import MetricsWriter
from titanlite.components.optimizer import build_lr_scheduler, build_optimizer, continue_schedule, set_skip
from titanlite.components.run_folder import open_run_folder, run_info
from titanlite.components.run_plan import checkpoint_folder, is_restart
from titanlite.components.spike_guard import SpikeGuard
from titanlite.components.step_window import StepWindow
from titanlite.components.stop import Stopped, StopSignals
from titanlite.config import JobConfig, parse_args
from titanlite.config.layout import initial_load_kind, validate
from titanlite.config.manager import config_help, wants_help
from titanlite.datasets.build import (
    Microbatch,
    build_dataloader,
    build_dataset,
    build_eval_dataset,
    build_tokenizer,
)
from titanlite.datasets.records import prompt_format
from titanlite.diagnostics.alerts import Alert
from titanlite.diagnostics.component import Diagnostics
from titanlite.diagnostics.data_checks import content_fingerprint
from titanlite.distributed.liveness import EXIT_LOST_RANK, Heartbeat, flight_recorder_env, lost_peer
from titanlite.distributed.parallel_dims import ParallelDims, init_distributed, resolve_device
from titanlite.distributed.parallelize import grad_sync, materialize
from titanlite.distributed.utils import clip_grad_norm_, peak_flops
from titanlite.errors import LostRank, TrainingError, UserError
from titanlite.models.registry import build_meta_model
from titanlite.tools.logging import init_logging
from titanlite.tools.memory import check_memory, peak_memory_gib
from titanlite.tools.process import die_with_parent

logger = init_logging()


def forward_backward(
    model: nn.Module,
    micro: list[Microbatch] | list[tuple[torch.Tensor, torch.Tensor]],
    balancer: LossBalancer,
    dims: ParallelDims,
    *,
    skip_grad_sync: bool,
    loss_factor: float = 1.0,
    loss_chunk: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accumulate this rank's gradients for one step.

    Returns (this rank's share of the step's loss, its summed cross entropy per sequence, in
    microbatch order). The shares of all ranks sum to the logged loss (see
    titanlite.components.loss); the per-sequence sums feed the diagnostics.
    `loss_factor` scales this rank's loss (debug: NaN for the non-finite stop, a spike for the guard).
    `loss_chunk`: see sequence_losses.
    """
    micro = [Microbatch(*batch) for batch in micro]
    balancer.begin_step([batch.labels for batch in micro])
    loss_total = torch.zeros((), device=dims.device)
    sample_sums = []
    for m, batch in enumerate(micro):
        sync = m == len(micro) - 1 or not skip_grad_sync
        with grad_sync(model, sync):
            with dims.autocast(), record_function("titanlite.forward"):
                per_sample = sequence_losses(model, batch, loss_chunk)
            if loss_factor != 1.0:
                per_sample = per_sample * loss_factor
            loss = balancer.scale(per_sample.sum(), m)
            with record_function("titanlite.backward"):
                loss.backward()
        loss_total += loss.detach()
        sample_sums.append(per_sample.detach())
    return loss_total, torch.cat(sample_sums)


class Trainer:
    def __init__(
        self, cfg: JobConfig, config_path: str | None = None, stops: StopSignals | None = None
    ) -> None:
        self.cfg = cfg
        t = cfg.training
        self.stops = stops or StopSignals()
        self.device = resolve_device(t.device)
        if self.device.type == "cuda":
            flight_recorder_env(_trace_dir(cfg), cfg.comm.trace_buffer)
        init_distributed(self.device, cfg.comm.timeout_s)
        self.rank = dist.get_rank()
        self.heartbeat = Heartbeat(cfg.comm.timeout_s, watch=self.device.type == "cuda")
        self.layout = validate(cfg, dist.get_world_size())
        self.dims = ParallelDims.build(
            self.layout, self.device, t.mixed_precision_param, t.mixed_precision_reduce
        )
        self.faults = Faults(cfg.debug, t.seed, self.rank, self.dims.dp_size)
        torch.manual_seed(self.faults.seed)  # dropout; init has its own seeds
        if t.deterministic:
            # cuBLAS picks reduction splits by workspace unless given a fixed one, which it reads
            # when its handle is made, at the first matmul (PyTorch's "Reproducibility" notes).
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)

        # The model is checked (name, flavor, memory) before the data is tokenized.
        self.tokenizer = build_tokenizer(cfg)
        self.meta = meta = build_meta_model(cfg, self.tokenizer.vocab_size if self.tokenizer else 0)
        if cfg.checkpoint.export_hf and meta.spec.hf is None:
            raise UserError(
                f"checkpoint.export_hf: model '{meta.spec.name}' has no HFAdapter in its registry entry; "
                "add one (see models/llama3/hf.py) or use checkpoint.export_weights"
            )
        self.loss_chunk = loss_chunk(cfg, meta)
        check_memory(meta.model, meta.args, cfg, self.layout, self.device, self.dims.param_dtype)
        self.flops_per_token = meta.flops_per_token
        dataset = build_dataset(cfg, self.tokenizer, meta.args.vocab_size)
        eval_data = build_eval_dataset(cfg, self.tokenizer)
        self.dataloader = build_dataloader(
            cfg, dataset, self.dims.dp_rank, self.dims.dp_size, self.device.type == "cuda", self.faults
        )
        self.model = materialize(meta.spec.parallelize_fn(meta.model, self.dims, cfg), self.dims, t.seed)
        self.diagnostics = Diagnostics(
            cfg.diagnostics,
            self.model,
            self.dims,
            self.layout,
            t.seed,
            self.faults,
            cfg.comm.timeout_s,
            dataset.trace,
        )
        self.evaluator = None
        if eval_data is not None:
            batch = cfg.eval.local_batch_size or t.local_batch_size
            self.evaluator = Evaluator(eval_data, self.dims, batch, loss_chunk(cfg, meta, batch))
            if self.rank == 0:
                e = cfg.eval
                where = f"'{e.path}'" if e.path else f"{e.fraction:g} of the data, held out"
                when = f"every {e.interval} steps and " if e.interval else ""
                logger.info(f"eval: {len(eval_data):,} sequences ({where}), {when}after the last step")
        self.optimizer = build_optimizer(self.model, cfg)
        self.scheduler = build_lr_scheduler(self.optimizer, cfg)
        self.guard = SpikeGuard(cfg.diagnostics, self.device, self.dims.dp_group)
        self.balancer = LossBalancer(
            cfg.loss.normalization, self.dims.dp_group, self.dims.dp_size, self.layout.grad_accum
        )

        info = run_info(cfg, self.dims, self.diagnostics.method_used)
        self.run_dir, resume, self.run_lock = open_run_folder(cfg, config_path, info)
        self.metrics = MetricsWriter(
            self.run_dir if self.rank == 0 else None,
            t.steps,
            cfg.metrics.enable_tensorboard,
            purge_step=resume + 1 if resume is not None else 1 if is_restart() else None,
            cfg=cfg,
        )
        folder = checkpoint_folder(cfg, self.run_dir)
        self.checkpointer = Checkpointer(cfg, folder, self.model, self.optimizer, self.faults, self.run_dir)
        self.start_step = 1
        if resume is not None:
            self._resume(resume)
        else:  # initial weights start a new run, never a resumed one
            self._initial_load()
        self._batches = iter(self.dataloader)  # after a resume has set the position
        self.window = StepWindow()
        self._tokens_per_rank_step = t.seq_len * t.local_batch_size * self.layout.grad_accum

    # ---- checkpoints ----------------------------------------------------------------------------
    def _generators(self) -> dict[str, torch.Generator]:
        return {"labels": self.faults.label_generator, **self.diagnostics.generators()}

    def _resume(self, step: int) -> None:
        """Continue after `step`: weights, optimizer and RNG from the checkpoint, the schedule and
        diagnostics from its state.json, and the data position from the step. Every config value
        that differs from the checkpoint's run is printed with what takes effect."""
        state = self.checkpointer.load(step, self._generators())
        if self.rank == 0:
            for line in resume_changes(state, self.cfg):
                logger.info(line)
        self.scheduler.load_state_dict(state["scheduler"])
        if not self.cfg.checkpoint.restore_hparams:
            continue_schedule(self.optimizer, self.scheduler, self.cfg, step)
        self.diagnostics.load_state_dict(state["diagnostics"])
        self.guard.load_state_dict(state.get("spike_guard", {}))
        self.dataloader.batch_sampler.load_state_dict({"microbatches_yielded": step * self.layout.grad_accum})
        self.start_step = step + 1

    def _initial_load(self) -> None:
        """checkpoint.initial_load_path, else model.hf_assets_path's weights, else keep the
        random init. A titanlite checkpoint may bring its optimizer state and schedule position."""
        c = self.cfg.checkpoint
        source = c.initial_load_path or self.cfg.model.hf_assets_path
        if not source:
            return
        path = Path(source).expanduser()
        if initial_load_kind(path) == "hf":
            load_hf_weights(self.model, path, self.meta.spec.hf, self.meta.args)
            return
        state = self.checkpointer.load_initial(path, with_optimizer=not c.initial_load_model_only)
        if not c.initial_load_model_only:
            continue_schedule(self.optimizer, self.scheduler, self.cfg, state["scheduler"]["last_epoch"])

    def save_checkpoint(self, step: int) -> None:
        host = {
            "scheduler": self.scheduler.state_dict(),
            "diagnostics": self.diagnostics.state_dict(),
            "spike_guard": self.guard.state_dict(),
        }
        self.checkpointer.save(step, host, self._generators())

    def is_checkpoint_step(self, step: int) -> bool:
        every = self.cfg.checkpoint.interval
        return every > 0 and (step % every == 0 or step == self.cfg.training.steps)

    # ---- the step -------------------------------------------------------------------------------
    def next_microbatches(self, step: int) -> list[Microbatch]:
        micro = []
        for _ in range(self.layout.grad_accum):
            batch = next(self._batches)
            batch = batch._replace(labels=self.faults.labels(step, batch.labels))
            micro.append(batch.to(self.device))
        return self.faults.stuck_batch(step, micro)

    def train_step(self, step: int) -> None:
        """One optimizer step. Its parts are named for torch.profiler (titanlite.data, .forward,
        .backward, .clip, .optimizer: scripts/bench.py's step-time breakdown)."""
        with record_function("titanlite.data"):
            micro = self.next_microbatches(step)
        self.heartbeat.reached(step)
        measured = self.diagnostics.begin_step(step)
        loss_total, sample_sums = forward_backward(
            self.model,
            micro,
            self.balancer,
            self.dims,
            skip_grad_sync=self.diagnostics.skip_grad_sync(self.layout.skip_grad_sync, measured),
            loss_factor=self.faults.loss_factor(step),
            loss_chunk=self.loss_chunk,
        )
        with record_function("titanlite.clip"):
            grad_norm = clip_grad_norm_(self.model.parameters(), self.cfg.training.max_norm)
        if measured:
            sample_tokens = torch.cat([(batch.labels != IGNORE_INDEX).sum(-1) for batch in micro])
            content = content_fingerprint(torch.cat([batch.inputs for batch in micro]))
            sampler = self.dataloader.batch_sampler
            host = np.append(sampler.rank_share(step - 1), sampler.order_hash(step - 1))
            # host to device: no wait on the device; indices and the hash are exact in float64
            host = torch.from_numpy(host.astype(np.float64)).to(self.device, non_blocking=True)
            self.diagnostics.end_step(
                step, sample_sums, sample_tokens, host[:-1], content, host[-1:], grad_norm
            )
        tokens = self.balancer.global_tokens()
        skip = (tokens == 0) | ~torch.isfinite(grad_norm)
        guard = self.guard.check(loss_total, grad_norm, skip) if self.guard.enabled else None
        if guard is not None:
            skip = skip | guard[0].bool()
        with record_function("titanlite.optimizer"):
            set_skip(self.optimizer, skip)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.diagnostics.after_update(step)
        self.window.add(step, loss_total, tokens, grad_norm, skip, guard)

    def is_log_step(self, step: int) -> bool:
        """Also every checkpoint and eval step: a checkpoint follows a log, so no step's record is
        lost, and an eval reads the host there."""
        freq, last = self.cfg.metrics.log_freq, self.cfg.training.steps
        return (
            step == self.start_step
            or step % freq == 0
            or step == last
            or self.is_checkpoint_step(step)
            or self.is_eval_step(step)
        )

    def is_eval_step(self, step: int) -> bool:
        every = self.cfg.eval.interval
        return self.evaluator is not None and (
            step == self.cfg.training.steps or (every > 0 and step % every == 0)
        )

    def evaluate(self, step: int) -> None:
        """The eval set's loss and perplexity, and eval.prompts decoded (every rank computes in
        lockstep, rank 0 writes). Sampling draws from a generator of its own, seeded by step."""
        began = time.perf_counter()
        rec = {"step": step, **self.evaluator.run(self.model), "seconds": time.perf_counter() - began}
        if self.rank == 0:
            self.metrics.write_eval(rec)
        if not self.cfg.eval.prompts:
            return
        e = self.cfg.eval
        generator = torch.Generator(device=self.device).manual_seed(self.cfg.training.seed * 1_000_003 + step)
        with self.dims.autocast():
            texts = sample_text(
                self.model,
                self.tokenizer,
                e.prompts,
                e.sample_tokens,
                fmt=prompt_format(e.prompt_format, self.cfg.data.mode, self.tokenizer),
                temperature=e.temperature,
                top_p=e.top_p,
                generator=generator,
                group=self.dims.dp_group,
            )
        if self.rank == 0:
            self.metrics.write_samples(
                step, [{"prompt": p, "text": x} for p, x in zip(e.prompts, texts, strict=True)]
            )

    def _log(self, step: int, lr: float, window_s: float, elapsed_s: float) -> None:
        w = self.window.read(self.dims.dp_group)
        for s, bad in zip(w.steps, w.nonfinite_ranks, strict=True):
            if bad:
                raise TrainingError(
                    f"non-finite loss at step {s} on {bad} of {self.dims.dp_size} rank(s); its "
                    "update was skipped and the run stops. Lower optimizer.lr, raise warmup, or check the data"
                )
        guards = w.guard or [None] * len(w.steps)
        spikes = [(s, g) for s, g in zip(w.steps, guards, strict=True) if g is not None and g[0]]
        for s, empty, skipped, guard in zip(w.steps, w.empty, w.skipped, guards, strict=True):
            if skipped and not (guard is not None and guard[0]):
                why = "no valid token in the whole global batch" if empty else "a non-finite gradient norm"
                logger.warning(f"step {s}: {why}; its optimizer update was skipped")
        n = len(w.steps)
        tps = self._tokens_per_rank_step * n / max(window_s, 1e-9)
        rec = {
            "step": step,
            "loss": None if w.skipped[-1] else w.losses[-1],
            "loss_window_mean": w.loss_mean,  # over the steps since the last log that trained
            "loss_window_steps": len(w.trained_losses),
            "grad_norm": w.grad_norm,
            "lr": lr,
            "valid_tokens": w.tokens,
            "tokens_per_s": tps,
            "tokens_per_s_global": tps * self.dims.dp_size,
            "skipped_steps": sum(w.skipped),
            "memory_gib": peak_memory_gib(self.device),
            "elapsed_s": elapsed_s,
            "eta_s": (self.cfg.training.steps - step) * window_s / n,
        }
        if self.flops_per_token:
            rec["tflops"] = self.flops_per_token * tps / 1e12
            peak = peak_flops(self.device, self.dims.param_dtype)
            if peak:
                rec["mfu_pct"] = 100 * self.flops_per_token * tps / peak
        diag, alerts = self.diagnostics.collect()
        if diag:
            rec["diag"] = {k: v for k, v in diag[-1].items() if isinstance(v, (int, float)) and k != "step"}
        measured = {d["step"]: d for d in diag}
        skipped = [self._spike(s, guard, measured.get(s)) for s, guard in spikes]
        if self.rank == 0:
            self.metrics.write(rec)
            self.metrics.write_diagnostics(diag)
            self.metrics.write_alerts(skipped + alerts)
        for s, guard in spikes:
            self._spike_stop(s, guard)
        if alerts and self.cfg.diagnostics.on_alert == "stop":
            raise TrainingError(f"diagnostics.on_alert = 'stop': {alerts[0].line()}")

    def _spike(self, step: int, guard: list[float], measured: dict | None) -> Alert:
        """The event of a step the spike guard skipped, with the step's sequences: from its
        diagnostics record if it was measured (their losses too), else from the data order."""
        _, value, threshold, _ = guard
        g = self.cfg.diagnostics
        msg = (
            f"{self.guard.metric} {value:.4g} above the spike guard's threshold {threshold:.4g} (mean + "
            f"{g.spike_k:g} std of the last applied steps); its optimizer update was skipped "
            f"(scripts/inspect_step.py {self.run_dir} --step {step} lists its sequences)"
        )
        if measured is not None:
            per_rank = measured["rank_samples"]
        else:  # from the data order, host-side: no device value is read
            shares = self.dataloader.batch_sampler.shares(step - 1)
            per_rank = [[{"index": int(i), "tokens": None, "loss": None} for i in share] for share in shares]
        samples = [self.diagnostics.locate(r, x) for r, rank in enumerate(per_rank) for x in rank]
        return Alert("spike_skipped", step, [], [], msg, values={"value": value}, samples=samples)

    def _spike_stop(self, step: int, guard: list[float]) -> None:
        """The stop after more than spike_max_consecutive skipped spikes in a row."""
        in_a_row, g = guard[3], self.cfg.diagnostics
        if in_a_row > g.spike_max_consecutive:
            raise TrainingError(
                f"the spike guard skipped {int(in_a_row)} steps in a row, up to step {step} (more than "
                f"diagnostics.spike_max_consecutive = {g.spike_max_consecutive}): the run diverges or its "
                "data went bad; resume from an earlier checkpoint with a lower optimizer.lr, or check the data"
            )

    # ---- the loop -------------------------------------------------------------------------------
    def train(self) -> None:
        steps = self.cfg.training.steps
        sync_debug = self.cfg.debug.sync_debug and self.device.type == "cuda"
        start = window_start = time.perf_counter()
        self.stops.arm(self.cfg.comm.timeout_s)
        step = self.start_step
        try:
            for step in range(self.start_step, steps + 1):
                self.faults.kill_at_step(step)
                self.faults.interrupt_at_step(step)
                self.faults.hang_at_step(step)
                self.faults.flip_bit(step, self.model)
                # From the second step: the first compiles (training.compile, FlexAttention's
                # kernels), and compiling and autotuning wait on the device by design.
                if sync_debug and step > self.start_step:
                    torch.cuda.set_sync_debug_mode("error")
                lr = self.scheduler.get_last_lr()[0]
                self.train_step(step)
                stop = self.stops.poll() if step < steps else 0
                if self.is_log_step(step) or stop:
                    self.heartbeat.idle()
                    if sync_debug:
                        torch.cuda.set_sync_debug_mode("default")
                    now = time.perf_counter()
                    self._log(step, lr, now - window_start, now - start)
                    if self.is_eval_step(step):
                        self.evaluate(step)
                    if self.is_checkpoint_step(step):
                        self.save_checkpoint(step)
                    if stop:
                        self._stop(step, stop)
                    window_start = time.perf_counter()
            self.heartbeat.idle()
            self.stops.drain()
            self.checkpointer.wait()  # the last async save is settled before the run reports success
        except RuntimeError as e:
            how = lost_peer(e) if dist.get_world_size() > 1 else None
            if how:
                raise LostRank(self.heartbeat.explain(step, how)) from None
            raise
        if self.cfg.checkpoint.export_weights:
            export_weights(self.model, self.run_dir / "weights.pt")
        if self.cfg.checkpoint.export_hf:
            self._export_hf(self.run_dir / "hf")
        logger.info(f"done: {steps} steps in {time.perf_counter() - start:.1f}s; run folder {self.run_dir}")

    def _stop(self, step: int, signum: int) -> None:
        """Every rank, after the step all agreed on: a settled checkpoint (unless checkpointing is
        off), then Stopped with the line that says how to continue and the grace a stop needs."""
        name = signal.Signals(signum).name
        if self.cfg.checkpoint.interval <= 0:
            raise Stopped(
                signum,
                f"stopped by {name} after step {step}; checkpointing is off (checkpoint.interval = 0), so nothing was saved",
            )
        began = time.perf_counter()
        if not self.is_checkpoint_step(step):
            self.save_checkpoint(step)
        self.checkpointer.wait()
        took = time.perf_counter() - began
        raise Stopped(
            signum,
            f"stopped by {name} after step {step}; checkpoint step-{step} (saved in {took:.1f}s: a "
            f"scheduler's grace period must cover a step plus that); rerun the same command to continue",
        )

    def _export_hf(self, folder: Path) -> None:
        """The model as a Hugging Face folder (every rank calls it), with the tokenizer's files
        when it is a Hugging Face one."""
        source = self.cfg.model.hf_assets_path
        export_hf(
            self.model,
            folder,
            self.meta.spec.hf,
            self.meta.args,
            self.cfg.checkpoint.export_dtype,
            Path(source).expanduser() if source else None,
            self.tokenizer.folder if self.tokenizer else None,
        )

    def close(self) -> None:
        self.heartbeat.close()
        self.checkpointer.close()
        self.metrics.close()
        if self.run_lock is not None:
            self.run_lock.release()


USAGE = """usage: torchrun [torchrun options] -m titanlite.train [--config FILE] [--section.key VALUE ...]
(./run_train.sh runs it so, after checking the config; without torchrun: one rank)"""


def _trace_dir(cfg: JobConfig) -> Path:
    """Where NCCL's flight recorder dumps: the run folder's comm_trace/ when the launcher named
    the run (it always does), else the dump folder's."""
    base = Path(cfg.job.dump_folder).expanduser()
    return (base / cfg.job.run_name if cfg.job.run_name else base) / "comm_trace"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if wants_help(argv):
        print(config_help(USAGE))
        return 0
    die_with_parent()
    trainer = None
    try:
        stops = StopSignals()  # first: a signal during set-up stops at once, in one line
        cfg, path = parse_args(argv)
        trainer = Trainer(cfg, path, stops)
        trainer.train()
        return 0
    except UserError as e:
        print(f"titanlite: error: {e}", file=sys.stderr, flush=True)
        return 2
    except TrainingError as e:
        print(f"titanlite: stopped: {e}", file=sys.stderr, flush=True)
        return 3
    except LostRank as e:
        print(f"titanlite: stopped: {e}", file=sys.stderr, flush=True)
        if trainer is not None:
            trainer.close()
        sys.stdout.flush()
        # A clean teardown would wait on the lost peer (gloo's pending sends, tens of seconds).
        os._exit(EXIT_LOST_RANK)
    except Stopped as e:
        print(f"titanlite: {e}", file=sys.stderr, flush=True)
        return 128 + e.signum
    finally:
        if trainer is not None:
            trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
