"""Distributed checkpoints (torch.distributed.checkpoint) that a crash cannot corrupt.

A step folder `<folder>/step-<N>` holds the DCP shards of model and optimizer (resharded on load,
so dp degree and mode may change), state.json (the step, the parts registered with track(), what
resume.py checks), each rank's RNG states and the `complete` marker, written last. It is written
as `step-<N>.tmp` and published by one rename (index.publish): a run killed mid-save leaves only a
`.tmp` folder that loading ignores. The data position is the step itself: the order is a function
of (seed, global batch, step) only (datasets/sampler.py), at any dp.
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from titanlite.components.checkpoint.hf_load import load_hf_weights
from titanlite.components.checkpoint.index import (
    MARKER,
    complete_steps,
    file_record,
    initial_load_kind,
    publish,
    quarantine,
    step_dir,
)
from titanlite.components.checkpoint.resume import (
    check_initial_fits,
    check_same_model,
    flat_config,
    hf_config,
    model_record,
    resume_changes,
    tied_groups,
    written_at,
)
from titanlite.components.optimizer import continue_schedule, realign_schedule
from titanlite.config import JobConfig
from titanlite.config.fields import due, identity
from titanlite.datasets.build import build_tokenizer
from titanlite.distributed.groups import host_group
from titanlite.distributed.liveness import phase
from titanlite.distributed.utils import first_error
from titanlite.errors import Stopped, TrainingError, UserError
from titanlite.tools.cache import disk_full, first_cause
from titanlite.tools.seeds import reshard_seed

logger = logging.getLogger("titanlite")


class Checkpointer:
    """Saves and loads the training state; every rank calls it together. In async mode the write
    runs on a thread whose DCP collectives use a gloo group of their own, so they never queue
    behind the step's; the next save() or wait() settles it, a failure raising on every rank."""

    def __init__(
        self,
        cfg: JobConfig,
        folder: Path,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        run_dir: Path,
        data: list[dict] | None,
    ):
        self.cfg = cfg
        self.folder = folder
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler  # a tracked part; restore() also continues its schedule
        self.parts: dict[str, Stateful] = {"scheduler": scheduler}  # saved in state.json
        self.generators: dict[str, torch.Generator] = {}  # saved per rank with torch's RNG
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        # seams for fault injection (titanlite.faults)
        self.storage_writer = lambda step, path: dcp.FileSystemWriter(path)  # a step's DCP writer
        self.written: Callable[[int], None] = lambda step: None  # rank 0: DCP wrote, not published
        # each rank's torch stream its own: a resharded resume reseeds it
        self.per_rank_torch = False
        self.is_async = cfg.checkpoint.async_mode == "async"
        self.group = host_group(timedelta(seconds=cfg.comm.timeout_s)) if self.is_async else None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="checkpoint")  # async writes
        self._pending: tuple[int, Path, Future] | None = None
        self._staged_s = 0.0  # the newest async save's staging time
        tok = build_tokenizer(cfg, train=False)
        # what state.json records of the run for resume.py's checks (restore adds the model's)
        self.record: dict[str, Any] = {
            "world_size": self.world,
            "run_folder": str(run_dir.resolve()),
            "hf_config": hf_config(cfg),  # the config.json the model was built from, if any
            "data": data,  # what the data holds, by content (datasets/spec.py)
            "tokenizer": tok.fingerprint if tok else None,  # what its token ids mean
        }

    def track(self, parts: dict[str, Stateful], generators: dict[str, torch.Generator]) -> None:
        """Register host-side parts of the training state (saved in state.json under their names)
        and RNG streams (saved per rank)."""
        self.parts.update(parts)
        self.generators.update(generators)

    def due(self, step: int) -> bool:
        """Every checkpoint.every steps, and after the last with checkpoint.at_end."""
        c = self.cfg.checkpoint
        return due(step, c.every) or (c.at_end and step == self.cfg.training.steps)

    def restore(self, resume: int | None, meta) -> int:
        """The run's first step: after `resume` with everything it saved (saying each config value
        that changed), or from checkpoint.initial_load_path, model.hf_assets_path or the init."""
        self.record.update(model_args=model_record(meta.args), tied=tied_groups(meta.model))
        if resume is not None:
            check_same_model(self.folder, resume, meta, self.cfg)  # as the preflight did
            path = step_dir(self.folder, resume)
            state, error = self._load_state(path, with_optimizer=True, step=resume)
            if error:  # damage the sizes and checksums missed: set aside, the rerun falls back
                if self.rank == 0:
                    quarantine(path, error, self.cfg.metrics.enable_wandb)
                raise TrainingError(
                    f"checkpoint {path} failed to load ({error}); it is set aside as {path.name}.damaged, so "
                    "the same command resumes from the newest intact checkpoint"
                )
            written = f"written at {written_at(state)}"
            logger.info(f"checkpoint: resumed from step {resume} ({path}, {written})")
            for name, part in self.parts.items():  # the scheduler's position among them
                part.load_state_dict(state.get(name, {}))
            if self.cfg.checkpoint.restore_hparams:
                lr = realign_schedule(self.optimizer, self.scheduler, self.cfg, resume)
            else:
                continue_schedule(self.optimizer, self.scheduler, self.cfg, resume)
                lr = None
            if self.rank == 0:
                for line in resume_changes(state, self.cfg, lr):
                    logger.info(line)
            return resume + 1
        c = self.cfg.checkpoint
        source = c.initial_load_path or self.cfg.model.hf_assets_path
        if not source:
            return 1
        path = Path(source).expanduser()
        if initial_load_kind(path) == "hf":
            load_hf_weights(self.model, path, meta.spec.hf, meta.args)
            return 1
        state, error = self._load_state(path, with_optimizer=not c.initial_load_model_only)
        if error:
            raise UserError(error)
        what = "model" if c.initial_load_model_only else "model and optimizer"
        logger.info(
            f"checkpoint: {what} loaded from {path} (step {state['step']} of that run) as step 0"
        )
        if not c.initial_load_model_only:
            step = state["scheduler"]["last_epoch"]
            continue_schedule(self.optimizer, self.scheduler, self.cfg, step)
        return 1

    def stop(self, step: int, signum: int, finished: bool = False) -> None:
        """Every rank, after the step all agreed to stop after: a settled checkpoint (unless
        checkpointing is off), then Stopped with the line that says how to continue and the grace
        a stop needs. `finished`: the stop came as the run ended, every step and export done."""
        name = signal.Signals(signum).name
        saves = self.cfg.checkpoint.saves
        if finished:
            kept = f"checkpoint step-{step} holds it" if saves else "checkpointing is off"
            line = f"stopped by {name} as the run ended: its steps up to {step} and its exports are done ({kept})"
        elif not saves:
            line = f"stopped by {name} after step {step}; checkpointing is off (checkpoint.every = 0 and checkpoint.at_end = false), so nothing was saved"
        else:
            began = time.perf_counter()
            if not self.due(step):
                self.save(step)
            self.wait()
            took = time.perf_counter() - began
            line = f"stopped by {name} after step {step}; checkpoint step-{step} (saved in {took:.1f}s: a scheduler's grace period must cover a step plus that); rerun the same command to continue"
        raise Stopped(signum, line)

    def _dcp_state(self) -> dict[str, Any]:
        return {
            "model": get_model_state_dict(self.model),
            "optim": get_optimizer_state_dict(self.model, self.optimizer),
        }

    @phase("checkpoint")
    def save(self, step: int) -> None:
        """Write step-<step> atomically (in async mode: start writing it); on failure remove the
        partial folder and raise on every rank."""
        self.wait()
        start = time.perf_counter()
        final = step_dir(self.folder, step)
        tmp = final.with_name(final.name + ".tmp")
        error = None
        if self.rank == 0:
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)  # a save killed earlier
                tmp.mkdir()
            except OSError as e:
                error = f"cannot create {tmp}: {e}"
        self._settle(step, tmp, error)
        states = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            states["cuda"] = torch.cuda.get_rng_state()
        states |= {name: g.get_state() for name, g in self.generators.items()}
        try:
            torch.save(states, tmp / f"rng-rank{self.rank}.pt")
        except (OSError, RuntimeError) as e:  # RuntimeError: the zip writer's short write
            error = self._save_error(e, f"rank {self.rank}: ")
        self._settle(step, tmp, error)
        # Serialised now: the scheduler and diagnostics move on while an async write runs.
        run = {"step": step, "identity": identity(self.cfg), "config": flat_config(self.cfg)}
        parts = {name: part.state_dict() for name, part in self.parts.items()}
        state = json.dumps({**run, **self.record, **parts})
        writer = self.storage_writer(step, str(tmp))
        if not self.is_async:
            error = self._write(
                step, tmp, lambda: dcp.save(self._dcp_state(), storage_writer=writer), state, start
            )
            self._settle(step, tmp, error)
            return
        try:
            staged = dcp.async_save(
                self._dcp_state(), storage_writer=writer, process_group=self.group
            )
        except (Exception, CheckpointException) as e:
            self._settle(step, tmp, self._save_error(e))
            return
        self._staged_s = time.perf_counter() - start  # what training waited; the write goes on
        job = self._executor.submit(self._write, step, tmp, staged.result, state, start)
        self._pending = (step, tmp, job)

    def _write(
        self, step: int, tmp: Path, write: Callable[[], Any], state: str, start: float
    ) -> str | None:
        """DCP's write (every rank), then the publish (rank 0); returns the failure in one line."""
        try:
            write()  # DCP raises on every rank if any rank's write failed
        except (Exception, CheckpointException) as e:
            error = self._save_error(e)
            logger.error(f"checkpoint: the save of step {step} failed: {error}")
            return error
        final = step_dir(self.folder, step)
        if self.rank == 0:
            self.written(step)
            try:
                record = {**json.loads(state), "files": file_record(tmp)}
                (tmp / "state.json").write_text(json.dumps(record))
                (tmp / MARKER).write_text(f"{step}\n")
                publish(tmp, final)
            except OSError as e:
                return str(e)
            keep = self.cfg.checkpoint.keep_latest_k
            for old in complete_steps(self.folder)[:-keep] if keep > 0 else []:
                shutil.rmtree(step_dir(self.folder, old), ignore_errors=True)
        mode = f" (async: training waited {self._staged_s:.2f}s of it)" if self.is_async else ""
        logger.info(
            f"checkpoint: saved step {step} to {final} in {time.perf_counter() - start:.2f}s{mode}"
        )
        return None

    def _save_error(self, e: BaseException, where: str = "") -> str:
        """A failed save in one line, which says so when the disk is full."""
        cause = f"{where}{first_cause(e)}"
        full = disk_full(e, self.folder)
        if full is not None:
            cause = f"{full}: {cause}; free space, lower checkpoint.keep_latest_k or point checkpoint.folder at a larger disk, then rerun the same command"
        return cause

    def _settle(self, step: int, tmp: Path, error: str | None) -> None:
        """If any rank failed, every rank raises the same error (the run stops: exit 3)."""
        first = first_error(error, self.group)
        if first is None:
            return
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        kept = complete_steps(self.folder)
        intact = f"the checkpoint of step {kept[-1]} is intact" if kept else "no earlier one exists"
        raise TrainingError(f"checkpoint save at step {step} failed: {first}; {intact}")

    def wait(self) -> None:
        """Every rank: finish the pending async save and raise on every rank if it failed."""
        if self._pending is not None:
            step, tmp, job = self._pending
            self._pending = None
            self._settle(step, tmp, job.result())

    def close(self) -> None:
        """On any exit: let a background write finish (and publish) before the process groups go
        away; no collectives, so an exit on an error cannot hang on them."""
        self._executor.shutdown(wait=True)

    def _load_rng(self, path: Path, step: int, resharded: bool) -> None:
        """This rank's RNG states; at another world size (`resharded`), rank 0's torch state on
        every rank (titanlite.tools.seeds: the ranks' streams are one) and every per-rank stream
        reseeded from (seed, step, rank), torch's too under per_rank_torch."""
        states = torch.load(path / f"rng-rank{0 if resharded else self.rank}.pt", weights_only=True)
        torch.set_rng_state(states["torch"])
        if "cuda" in states and torch.cuda.is_available():
            torch.cuda.set_rng_state(states["cuda"])
        seed = self.cfg.training.seed
        if resharded and self.per_rank_torch:
            torch.manual_seed(reshard_seed(seed, step, self.rank, 0))
        for i, (name, g) in enumerate(self.generators.items()):
            if resharded:
                g.manual_seed(reshard_seed(seed, step, self.rank, i + 1))
            elif name in states:
                g.set_state(states[name])

    def _load_state(
        self, path: Path, with_optimizer: bool, step: int | None = None
    ) -> tuple[dict[str, Any] | None, str | None]:
        """On every rank, the model (and optimizer) from step folder `path`, resharded by DCP: a
        resume's (`step`; its RNG states too) or another run's, checked first. Returns its
        state.json and any rank's failure in one line, the same on every rank."""
        host, error = None, None
        drop = self.cfg.checkpoint.initial_load_drop if step is None else []
        try:
            host = json.loads((path / "state.json").read_text())
            if step is None:
                check_initial_fits(path, self.model, drop, self.record["tokenizer"])
            state = (
                self._dcp_state() if with_optimizer else {"model": get_model_state_dict(self.model)}
            )
            state["model"] = {k: v for k, v in state["model"].items() if k not in drop}
            dcp.load(state, checkpoint_id=str(path))
            options = StateDictOptions(strict=not drop)  # a dropped tensor keeps its init
            set_model_state_dict(self.model, state["model"], options=options)
            if with_optimizer:
                set_optimizer_state_dict(self.model, self.optimizer, state["optim"])
            if step is not None:
                self._load_rng(path, step, resharded=host["world_size"] != self.world)
        except UserError as e:
            error = str(e)
        except (Exception, CheckpointException) as e:  # damage its sizes and checksums missed
            error = f"rank {self.rank}: {first_cause(e)}"
            if step is None:
                error = f"checkpoint '{path}' failed to load ({error}); it is damaged: point checkpoint.initial_load_path at an intact step"
        return host, first_error(error, self.group)
