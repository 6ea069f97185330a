"""The trainer: `python -m titanlite.train --config FILE [--section.key value ...]` (via torchrun).

Hot-path rule: between log steps nothing waits on the host. Metrics stay device tensors and are
read once per log step (`_log`); zero-token and non-finite steps are skipped on the device.
"""

from __future__ import annotations

import importlib
import json
import os
import resource
import signal
import sys
import time
from dataclasses import replace
from datetime import datetime
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from titanlite.components import checkpoint
from titanlite.components.checkpoint import Checkpointer
from titanlite.components.loss import IGNORE_INDEX, LossBalancer, cross_entropy_sum
from titanlite.components.metrics import MetricsWriter, truncate_after
from titanlite.components.optimizer import build_lr_scheduler, build_optimizer, set_skip
from titanlite.config import JobConfig, parse_args
from titanlite.config.layout import validate
from titanlite.config.manager import to_toml
from titanlite.datasets.build import build_dataloader, build_dataset, build_tokenizer
from titanlite.diagnostics import faults
from titanlite.diagnostics.component import Diagnostics
from titanlite.distributed.parallel_dims import ParallelDims, init_distributed, resolve_device
from titanlite.distributed.parallelize import grad_sync, unwrap, wrap_ddp
from titanlite.distributed.param_init import ParamInit
from titanlite.distributed.utils import clip_grad_norm_, peak_flops
from titanlite.errors import TrainingError, UserError
from titanlite.tools.logging import init_logging
from titanlite.tools.memory import GiB, available_bytes, estimate_memory

logger = init_logging()


def materialize(model: nn.Module, dims: ParallelDims, seed: int) -> nn.Module:
    """Meta-device model (already parallelized by its spec) -> initialized model on the device.

    Weights come from ParamInit, so they are the same for every dp degree and mode; DDP wraps
    the model only now, after init, because it needs real tensors.
    """
    model.to_empty(device=dims.device)
    with torch.no_grad():
        unwrap(model).init_weights(ParamInit(unwrap(model), seed))
    return wrap_ddp(model, dims) if dims.mode == "ddp" else model


def forward_backward(
    model: nn.Module,
    micro: list[tuple[torch.Tensor, torch.Tensor]],
    balancer: LossBalancer,
    dims: ParallelDims,
    *,
    skip_grad_sync: bool,
    nan_loss: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accumulate this rank's gradients for one step.

    Returns (this rank's share of the step's loss, its summed cross entropy). The shares of all
    ranks sum to the logged loss (see titanlite.components.loss); the sum feeds the diagnostics.
    `nan_loss` poisons this rank's loss (debug.nan_loss_step) to exercise the non-finite stop.
    """
    balancer.begin_step([labels for _, labels in micro])
    loss_total = torch.zeros((), device=dims.device)
    loss_sums = torch.zeros((), device=dims.device)
    for m, (inputs, labels) in enumerate(micro):
        sync = m == len(micro) - 1 or not skip_grad_sync
        with grad_sync(model, sync):
            with dims.autocast():
                loss_sum = cross_entropy_sum(model(inputs), labels)
            if nan_loss:
                loss_sum = loss_sum * float("nan")
            loss = balancer.scale(loss_sum, m)
            loss.backward()
        loss_total += loss.detach()
        loss_sums += loss_sum.detach()
    return loss_total, loss_sums


class Trainer:
    def __init__(self, cfg: JobConfig, config_path: str | None = None) -> None:
        self.cfg = cfg
        self.device = resolve_device(cfg.training.device)
        init_distributed(self.device)
        self.rank = dist.get_rank()
        self.layout = validate(cfg, dist.get_world_size())
        torch.manual_seed(faults.rank_seed(cfg, self.rank))  # dropout; init has its own seeds
        self._label_rng = torch.Generator().manual_seed(cfg.training.seed + self.rank)
        if cfg.training.deterministic:
            torch.use_deterministic_algorithms(True)
        if cfg.model.import_module:
            try:
                importlib.import_module(cfg.model.import_module)
            except ImportError as e:
                raise UserError(
                    f"model.import_module '{cfg.model.import_module}' cannot be imported ({e}); check the module path and PYTHONPATH"
                ) from None
        import titanlite.models  # noqa: F401  (registers the built-in models)
        from titanlite.models.registry import get_flavor, get_model_spec

        spec = get_model_spec(cfg.model.name)
        flavor = get_flavor(spec, cfg.model.flavor)
        self.dims = ParallelDims.build(
            self.layout, self.device, cfg.training.mixed_precision_param, cfg.training.mixed_precision_reduce
        )

        self.tokenizer = build_tokenizer(cfg)
        dataset = build_dataset(cfg, self.tokenizer)
        self.dataloader = build_dataloader(
            cfg, dataset, self.dims.dp_rank, self.dims.dp_size, self.device.type == "cuda"
        )

        args = replace(flavor, vocab_size=self.tokenizer.vocab_size, max_seq_len=cfg.training.seq_len)
        if cfg.model.dropout:
            if not hasattr(args, "dropout"):
                raise UserError(
                    f"model.dropout is set but model '{cfg.model.name}' has no dropout; remove it"
                )
            args = replace(args, dropout=cfg.model.dropout)
        with torch.device("meta"):
            model = spec.model_cls(args)
        self._check_memory(model, args)
        self.flops_per_token = (
            model.num_flops_per_token(cfg.training.seq_len) if hasattr(model, "num_flops_per_token") else 0
        )
        model = materialize(spec.parallelize_fn(model, self.dims, cfg), self.dims, cfg.training.seed)
        self.model = model
        self.diagnostics = Diagnostics(cfg.diagnostics, model, self.dims, cfg.training.seed, cfg.debug)
        self.optimizer = build_optimizer(model, cfg)
        self.scheduler = build_lr_scheduler(self.optimizer, cfg)
        self.balancer = LossBalancer(
            cfg.loss.normalization, self.dims.dp_group, self.dims.dp_size, self.layout.grad_accum
        )
        self.run_dir, resume = self._make_run_dir(config_path)
        self.metrics = MetricsWriter(
            self.run_dir if self.rank == 0 else None,
            cfg.training.steps,
            cfg.metrics.enable_tensorboard,
            purge_step=None if resume is None else resume + 1,
        )
        self.checkpointer = Checkpointer(cfg, self._checkpoint_folder(self.run_dir), model, self.optimizer)
        self.start_step = 1
        if resume is not None:
            self._resume(resume)
        self._batches = iter(self.dataloader)  # after a resume has set the position
        # Per step since the last log: (step, loss share, loss non-finite, no valid token, skipped)
        self._window: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._last_grad_norm = torch.zeros((), device=self.device)
        self._last_tokens = torch.zeros((), dtype=torch.int64, device=self.device)
        self._tokens_per_rank_step = (
            cfg.training.seq_len * cfg.training.local_batch_size * self.layout.grad_accum
        )

    # ---- set-up helpers -------------------------------------------------------------------------
    def _check_memory(self, model: nn.Module, args) -> None:
        t = self.cfg.training
        blocks = getattr(model, "layers", None)
        est = estimate_memory(
            model,
            sum(p.numel() for p in blocks[0].parameters()) if blocks is not None and len(blocks) else 0,
            dim=getattr(args, "dim", 0),
            n_layers=getattr(args, "n_layers", 0),
            vocab_size=args.vocab_size,
            local_batch=t.local_batch_size,
            seq_len=t.seq_len,
            shard=self.layout.dp_shard,
            mode=self.layout.mode,
            param_bytes=self.dims.param_dtype.itemsize,
            activation_checkpoint=t.activation_checkpoint != "none",
        )
        avail, what = available_bytes(self.device)
        logger.info(
            f"model {self.cfg.model.name}/{self.cfg.model.flavor}: {est.params:,} params, vocab "
            f"{args.vocab_size}; {self.layout.mode} {self.layout.dp_replicate}x{self.layout.dp_shard}, "
            f"grad accum {self.layout.grad_accum}; est. memory per rank {est.summary()}; "
            f"{avail / GiB:.1f} GiB {what}"
        )
        if est.total_bytes > avail:
            raise UserError(
                f"model {self.cfg.model.flavor} needs about {est.total_bytes / GiB:.1f} GiB per rank "
                f"but {avail / GiB:.1f} GiB is available ({what}); use more ranks or GPUs, a smaller "
                "local_batch_size or seq_len, or training.activation_checkpoint = 'full'"
            )

    def _checkpoint_folder(self, run_dir: Path) -> Path:
        folder = Path(self.cfg.checkpoint.folder).expanduser()
        return folder if folder.is_absolute() else run_dir / folder

    def _make_run_dir(self, config_path: str | None) -> tuple[Path, int | None]:
        """Rank 0 picks the run folder and whether to resume (a complete checkpoint there, or in
        checkpoint.folder); every rank learns both, or the error. A checkpoint trained on
        something else is refused before anything is written."""
        out: list = [None, None, None]
        if self.rank == 0:
            job = self.cfg.job
            stem = Path(config_path).stem if config_path else "default"
            name = job.run_name or f"{stem}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
            run_dir = Path(job.dump_folder).expanduser() / name
            try:
                folder = self._checkpoint_folder(run_dir)
                resume = checkpoint.find(folder, self.cfg.checkpoint.load_step)
                if resume is not None:
                    checkpoint.check_compatible(folder, resume, self.cfg)
                elif (run_dir / "metrics.jsonl").exists():
                    raise UserError(
                        f"run folder '{run_dir}' already holds a run without a checkpoint to resume; "
                        "pick another --job.run_name or move it"
                    )
                run_dir.mkdir(parents=True, exist_ok=True)
                if resume is not None:
                    truncate_after(run_dir, resume)
                (run_dir / "config.toml").write_text(to_toml(self.cfg))
                (run_dir / "run.json").write_text(json.dumps(self._resolved(), indent=1) + "\n")
                out[:2] = str(run_dir), resume
            except UserError as e:
                out[2] = str(e)
        dist.broadcast_object_list(out, src=0)
        if out[2]:
            raise UserError(out[2])
        if self.rank == 0:
            logger.info(f"run folder: {out[0]}")
        return Path(out[0]), out[1]

    def _generators(self) -> dict[str, torch.Generator]:
        gens = {"labels": self._label_rng}
        probe = getattr(self.diagnostics, "probe", None)
        if probe is not None:
            gens["grad_noise"] = probe.noise_generator
        return gens

    def _resume(self, step: int) -> None:
        """Continue after `step`: weights, optimizer and RNG from the checkpoint, the schedule and
        diagnostics from its state.json, and the data position from the step."""
        state = self.checkpointer.load(step, self._generators())
        self.scheduler.load_state_dict(state["scheduler"])
        self.diagnostics.load_state_dict(state["diagnostics"])
        self.dataloader.batch_sampler.load_state_dict({"microbatches_yielded": step * self.layout.grad_accum})
        self.start_step = step + 1

    def save_checkpoint(self, step: int) -> None:
        host = {"scheduler": self.scheduler.state_dict(), "diagnostics": self.diagnostics.state_dict()}
        self.checkpointer.save(step, host, self._generators())

    def is_checkpoint_step(self, step: int) -> bool:
        every = self.cfg.checkpoint.interval
        return every > 0 and (step % every == 0 or step == self.cfg.training.steps)

    def _resolved(self) -> dict:
        """What the config left to the machine ("auto" and derived values), for run comparison."""
        lay = self.layout
        return {
            "world_size": self.dims.dp_size,
            "mode": lay.mode,
            "dp_replicate": lay.dp_replicate,
            "dp_shard": lay.dp_shard,
            "local_batch_size": self.cfg.training.local_batch_size,
            "grad_accum": lay.grad_accum,
            "device": self.device.type,
            "param_dtype": str(self.dims.param_dtype).removeprefix("torch."),
            "reduce_dtype": str(self.dims.reduce_dtype).removeprefix("torch."),
            "diagnostics_method": self.diagnostics.method if self.diagnostics.enabled else "off",
            "torch": torch.__version__,
            "started": datetime.now().isoformat(timespec="seconds"),
        }

    # ---- the step -------------------------------------------------------------------------------
    def next_microbatches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        micro = []
        for _ in range(self.layout.grad_accum):
            inputs, labels = next(self._batches)
            if step in self.cfg.debug.ignore_all_labels_steps:
                labels = torch.full_like(labels, IGNORE_INDEX)
            if self.rank == self.cfg.debug.corrupt_labels_rank:
                labels = faults.corrupt_labels(labels, self._label_rng)
            micro.append(
                (inputs.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True))
            )
        return micro

    def train_step(self, step: int) -> None:
        micro = self.next_microbatches(step)
        measured = self.diagnostics.begin_step(step)
        loss_total, loss_sum = forward_backward(
            self.model,
            micro,
            self.balancer,
            self.dims,
            skip_grad_sync=self.layout.skip_grad_sync or measured,  # the probe sees whole steps
            nan_loss=step == self.cfg.debug.nan_loss_step and self.rank == 0,
        )
        grad_norm = clip_grad_norm_(self.model.parameters(), self.cfg.training.max_norm)
        if measured:
            self.diagnostics.end_step(step, loss_sum, self.balancer.local_tokens(), grad_norm)
        tokens = self.balancer.global_tokens()
        skip = (tokens == 0) | ~torch.isfinite(grad_norm)
        set_skip(self.optimizer, skip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._window.append((step, loss_total, ~torch.isfinite(loss_total), tokens == 0, skip))
        self._last_grad_norm, self._last_tokens = grad_norm, tokens

    def is_log_step(self, step: int) -> bool:
        """Also every checkpoint step: a checkpoint follows a log, so no step's record is lost."""
        freq, last = self.cfg.metrics.log_freq, self.cfg.training.steps
        return step == self.start_step or step % freq == 0 or step == last or self.is_checkpoint_step(step)

    # ---- the log step: the only place the host reads device values ------------------------------
    def _log(self, step: int, lr: float, window_s: float, elapsed_s: float) -> None:
        steps = [s for s, *_ in self._window]
        n = len(steps)
        # Rows: this rank's loss share and non-finite flag, summed over ranks -> global values.
        shared = torch.stack([torch.stack([share, bad]) for _, share, bad, _, _ in self._window]).double()
        dist.all_reduce(shared, group=self.dims.dp_group)
        # Rows already equal on every rank: no valid token, update skipped.
        same = torch.stack([torch.stack([empty, skip]) for *_, empty, skip in self._window]).double()
        last = torch.stack([self._last_grad_norm, self._last_tokens]).double()
        host = torch.cat([shared.flatten(), same.flatten(), last]).tolist()  # the one read
        self._window.clear()
        losses, bad = host[0 : 2 * n : 2], host[1 : 2 * n : 2]
        empty, skipped = host[2 * n : 4 * n : 2], host[2 * n + 1 : 4 * n : 2]
        grad_norm, tokens = host[4 * n], int(host[4 * n + 1])
        for s, b in zip(steps, bad, strict=True):
            if b > 0:
                raise TrainingError(
                    f"non-finite loss at step {s} on {int(b)} of {self.dims.dp_size} rank(s); its "
                    "update was skipped and the run stops. Lower optimizer.lr, raise warmup, or check the data"
                )
        for s, e, sk in zip(steps, empty, skipped, strict=True):
            if sk > 0:
                why = "no valid token in the whole global batch" if e > 0 else "a non-finite gradient norm"
                logger.warning(f"step {s}: {why}; its optimizer update was skipped")
        tps = self._tokens_per_rank_step * n / max(window_s, 1e-9)
        rec = {
            "step": step,
            "loss": None if skipped[-1] else losses[-1],
            "loss_window_mean": sum(losses) / n,
            "grad_norm": grad_norm,
            "lr": lr,
            "valid_tokens": tokens,
            "tokens_per_s": tps,
            "tokens_per_s_global": tps * self.dims.dp_size,
            "skipped_steps": int(sum(skipped)),
            "memory_gib": self._memory_gib(),
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
        if self.rank == 0:
            self.metrics.write(rec)
            self.metrics.write_diagnostics(diag)
            self.metrics.write_alerts(alerts)
        if alerts and self.cfg.diagnostics.on_alert == "stop":
            raise TrainingError(f"diagnostics.on_alert = 'stop': {alerts[0].line()}")

    def _memory_gib(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / GiB
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB

    # ---- the loop -------------------------------------------------------------------------------
    def train(self) -> None:
        steps = self.cfg.training.steps
        sync_debug = self.cfg.debug.sync_debug and self.device.type == "cuda"
        start = window_start = time.perf_counter()
        for step in range(self.start_step, steps + 1):
            if step == self.cfg.debug.sigkill_step and self.rank == 0:  # fault injection: a crash
                os.kill(os.getpid(), signal.SIGKILL)
            if sync_debug:
                torch.cuda.set_sync_debug_mode("error")
            lr = self.scheduler.get_last_lr()[0]
            self.train_step(step)
            if self.is_log_step(step):
                if sync_debug:
                    torch.cuda.set_sync_debug_mode("default")
                now = time.perf_counter()
                self._log(step, lr, now - window_start, now - start)
                if self.is_checkpoint_step(step):
                    self.save_checkpoint(step)
                window_start = time.perf_counter()
        self.checkpointer.wait()  # the last async save is settled before the run reports success
        if self.cfg.checkpoint.export_weights:
            self.export_weights()
        logger.info(f"done: {steps} steps in {time.perf_counter() - start:.1f}s; run folder {self.run_dir}")

    def export_weights(self) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from titanlite.tools.cache import atomic_write_bytes

        state = get_model_state_dict(
            self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if self.rank == 0:
            import io

            buf = io.BytesIO()
            torch.save(state, buf)
            atomic_write_bytes(self.run_dir / "weights.pt", buf.getvalue())
            logger.info(f"exported full weights to {self.run_dir / 'weights.pt'}")

    def close(self) -> None:
        self.checkpointer.close()
        self.metrics.close()


def main(argv: list[str] | None = None) -> int:
    trainer = None
    try:
        cfg, path = parse_args(sys.argv[1:] if argv is None else argv)
        trainer = Trainer(cfg, path)
        trainer.train()
        return 0
    except UserError as e:
        print(f"titanlite: error: {e}", file=sys.stderr, flush=True)
        return 2
    except TrainingError as e:
        print(f"titanlite: stopped: {e}", file=sys.stderr, flush=True)
        return 3
    finally:
        if trainer is not None:
            trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
