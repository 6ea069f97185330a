"""Every rule on a config that needs no torch and no process group (the data files are
titanlite.datasets.spec's): the preflight runs it before torchrun starts, every worker again.
A problem is one UserError that names it and the fix."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from titanlite.components.checkpoint.index import initial_load_kind
from titanlite.config.job_config import JobConfig
from titanlite.config.layout import AXIS_KINDS, Layout, resolve_layout
from titanlite.config.manager import check_values
from titanlite.errors import UserError
from titanlite.models.hf_files import check_hf_folder


def validate(cfg: JobConfig, world_size: int) -> Layout:
    """The plan at `world_size` ranks, once every rule (module doc) holds."""
    check_values(cfg)
    check_run_name(cfg.job.run_name)
    layout = resolve_layout(cfg, world_size)
    if cfg.faults is not None:  # the fault plugin's own rules (titanlite.faults.switches)
        cfg.faults.check(cfg.diagnostics.enable, world_size)
    split = [f"{n}={d}" for n, d in layout.axes if not AXIS_KINDS[n].distinct_tokens]
    if split:
        check_tensor_split_run(cfg, split[0])
    if layout.axes and cfg.eval.prompts:
        raise UserError(
            "eval.prompts with parallelism.axes: decoding runs whole prompts on every rank, which a model "
            "that splits sequences does not take; remove the prompts"
        )
    for key in ("fingerprint_step", "stop_after_step"):
        if getattr(cfg.debug, key) > cfg.training.steps:
            raise UserError(
                f"debug.{key} is {getattr(cfg.debug, key)} but the run has {cfg.training.steps} steps "
                "(training.steps); pick a step of the run, or -1"
            )
    s = cfg.spike_guard
    if s.min_history > s.window:
        raise UserError(
            f"spike_guard.min_history is {s.min_history} but spike_guard.window is {s.window}; "
            "the guard cannot need more values than its window holds"
        )
    if not cfg.job.dump_folder.strip():
        raise UserError(
            "job.dump_folder is empty; name the folder that holds the run folders (default ./outputs)"
        )
    c = cfg.checkpoint
    if not c.folder:
        raise UserError(
            "checkpoint.folder is empty; name a folder (default: checkpoints, inside the run folder)"
        )
    if cfg.metrics.enable_wandb and importlib.util.find_spec("wandb") is None:
        raise UserError(
            "metrics.enable_wandb: the wandb package is not installed; `pip install wandb` or set "
            "metrics.enable_wandb = false"
        )
    m, d, e = cfg.model, cfg.data, cfg.eval
    if d.mode == "synthetic" and (d.path or not (m.vocab_size or m.hf_assets_path)):
        raise UserError(
            "data.mode = 'synthetic' draws random tokens below model.vocab_size: set model.vocab_size "
            "(e.g. 128256) or model.hf_assets_path, and leave data.path empty"
        )
    # Each fix offered below is one the config does not hold already (tests/test_config.py).
    if d.packing and d.mode != "sft":
        why = ", whose windows are packed already" if d.mode == "pretrain" else ""
        mask = d.mode == "pretrain" and not d.document_mask
        raise UserError(
            f"data.packing packs SFT records but data.mode is '{d.mode}'{why}: set data.packing = false"
            + (
                " (and data.document_mask = true to keep attention within documents)"
                if mask
                else ""
            )
        )
    if d.document_mask and d.mode != "pretrain":
        also = ""
        if d.mode == "sft":
            also = (
                " (with data.packing on, as it is, each packed record attends within itself already)"
                if d.packing
                else "; to pack several SFT records in a sequence, each attending within itself, also set data.packing = true"
            )
        raise UserError(
            f"data.document_mask is for pretraining windows but data.mode is '{d.mode}': set "
            f"data.document_mask = false{also}"
        )
    if not 0.0 <= e.fraction <= 0.5:
        raise UserError(f"eval.fraction is {e.fraction}; hold out between 0 and 0.5 of the data")
    if e.path and e.fraction:
        raise UserError(
            f"eval.path and eval.fraction = {e.fraction:g} are both set: the eval set is eval.path's, so the "
            "fraction would leave training data unused; set one of them"
        )
    if d.mode == "synthetic" and (e.fraction or e.path or e.prompts):
        raise UserError(
            "synthetic data has no held-out text or tokenizer: leave [eval] unset with data.mode = 'synthetic'"
        )
    if not (e.path or e.fraction):
        check_eval_switches(e, d.mode)
    if m.tokenizer_path and not Path(m.tokenizer_path).expanduser().is_file():
        raise UserError(
            f"model.tokenizer_path '{m.tokenizer_path}' is not a file; point it at a "
            "SentencePiece .model or a tokenizer.json, or leave it empty"
        )
    if m.hf_assets_path:
        check_hf_folder(Path(m.hf_assets_path).expanduser(), need_tokenizer=not m.tokenizer_path)
    if c.initial_load_path:
        kind = initial_load_kind(Path(c.initial_load_path).expanduser())
        if kind == "hf" and not c.initial_load_model_only:
            raise UserError(
                "checkpoint.initial_load_model_only = false needs a titanlite checkpoint (a Hugging "
                "Face folder holds no optimizer state); set it to true"
            )
    return layout


# The [eval] keys that act on an eval set, and what each does: set without one (eval.path or
# eval.fraction), each is refused, as every switch without its input is.
EVAL_SWITCHES = {
    "prompts": "are decoded at each eval",
    "at_start": "evaluates the model as loaded, before the first step",
    "every": "evaluates every this many steps",
    "max_sequences": "cuts the eval set to this many sequences",
}


def check_eval_switches(e: Any, mode: str) -> None:
    """No key of EVAL_SWITCHES away from its default in `e` (a JobConfig's eval section) that
    has no eval set."""
    default = type(e)()
    for key, what in EVAL_SWITCHES.items():
        if getattr(e, key) == getattr(default, key):
            continue
        back = f"set eval.{key} = {json.dumps(getattr(default, key))}"
        fix = back if mode == "synthetic" else f"set eval.fraction or eval.path, or {back}"
        raise UserError(f"eval.{key} {what}, but the run has no eval set: {fix}")


def check_tensor_split_run(cfg: JobConfig, axis: str) -> None:
    """What a run with a split of the model's tensors (`axis`, "tp=2") cannot do in this version."""
    refusals = {
        "model.dropout": (
            bool(cfg.model.dropout),
            "dropout on the residual stream's pieces would draw other masks than the unsplit "
            "model's; set --model.dropout 0",
        ),
        "training.compile": (
            cfg.training.compile,
            "compiling blocks whose tensors are DTensors is not checked in this version; set "
            "--training.compile false",
        ),
    }
    for key, (refused, why) in refusals.items():
        if refused:
            raise UserError(f"{key} with parallelism.axes {axis}: {why}")


def check_run_name(name: str) -> None:
    """job.run_name names a folder inside job.dump_folder: a name, or a relative path that groups
    runs ('sweep/lr-3e-4'); never absolute, from '~' or through '.' or '..'."""
    parts = name.split("/")
    if name.startswith(("/", "~")) or any(p in (".", "..") for p in parts):
        raise UserError(
            f"job.run_name '{name}' would write outside job.dump_folder; give a name, or a relative "
            "path like 'sweep/run-1', without '.', '..' or a leading '/' or '~'"
        )
    long = next((p for p in parts if len(p.encode()) > 255), None)
    if long is not None:
        raise UserError(
            f"job.run_name: the folder name '{long[:20]}...' is {len(long.encode())} bytes; file systems allow 255"
        )
