"""Everything about a run that can be checked before any worker starts (titanlite.launch runs it):
the config, data, run folder, model (on the meta device), initial weights and checkpoint folder
(resumable, room for one more); a problem is one UserError. `python -m titanlite.preflight
--world-size N [--config FILE] [overrides]` runs the same checks: nothing (exit 0) or one line
(exit 2); `--help` prints run_train.sh's usage and every config key."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from titanlite.components.checkpoint.index import step_to_read
from titanlite.components.checkpoint.resume import check_initial_fits, check_same_model
from titanlite.components.run.lock import RunLock
from titanlite.components.run.plan import (
    check_checkpoint_space,
    checkpoint_folder,
    resume_plan,
    run_folder,
)
from titanlite.config import JobConfig
from titanlite.config.command_line import absolute, parse_args, wants_help
from titanlite.config.fields import whole_number
from titanlite.config.layout import mesh_text, rank_share
from titanlite.config.manager import NOTES_SHOWN_ENV, config_help
from titanlite.datasets.spec import (
    check_data_files,
    check_data_tokenizer,
    data_identity,
    eval_overlap,
    parse_data_path,
)
from titanlite.diagnostics.alerts import history_note
from titanlite.diagnostics.rules import silent_rules_note
from titanlite.errors import UserError, report
from titanlite.tools.paths import check_writable
from titanlite.tools.records import read_json
from titanlite.validation import validate

USAGE = """usage: ./run_train.sh [--config FILE] [--section.key VALUE ...]
Trains with torchrun on this node (default config: train_configs/debug_model.toml); a relative
path (a flag's, the config's) means the folder you run it from. --rehearse W: a rehearsal of the
run as rank 0 of W ranks (1 to 65,536), no training.
Environment: NGPU / NPROC ranks on this node (default: the GPU count, else 2 CPU ranks);
LOG_RANK local ranks that print (default 0, e.g. 0,1; every rank's log is in <run>/logs);
MAX_RESTARTS restarts of a failed worker group, which resume from the last checkpoint (one node);
NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT for several nodes (and --job.run_name).
Ctrl-C or SIGTERM: the step finishes, a checkpoint is written, exit 128+signal; Ctrl-C twice
stops at once. Exit codes: 0 done, 2 bad input (one line says what), 3 the run was stopped
(non-finite loss, diagnostics.on_alert = stop, a failed checkpoint save), 4 a rank stopped
responding (comm.timeout_s; the line names it), 130/143 stopped by SIGINT/SIGTERM."""

CHECKPOINT_BYTES_PER_PARAM = 12  # float32 weights plus AdamW's two float32 moments


def plan_run(
    argv: list[str],
    world_size: int,
    nnodes: int = 1,
    check_space: bool = True,
    hold: Callable[[JobConfig, Path], None] | None = None,
) -> tuple[JobConfig, Path]:
    """`hold(cfg, run_dir)` takes the run folder (the launcher: its lock), else a folder a live run
    holds is refused; either way before its checkpoints are read (a live run may be pruning them)."""
    config_notes: list[str] = []  # said after the run's own lines, once every check passed
    cfg, path = parse_args(argv, config_notes)
    layout = validate(cfg, cfg.rehearsal.world or world_size)  # a rehearsal's: the one it rehearses
    check_data_files(cfg)
    check_data_tokenizer(cfg.data.path, cfg.model.tokenizer_path or cfg.model.hf_assets_path)
    run_dir = run_folder(cfg, path, nnodes)
    check_writable(run_dir, "job.dump_folder")
    if hold is None:
        RunLock(run_dir).refuse_if_held()
    else:
        hold(cfg, run_dir)
    folder = checkpoint_folder(cfg, run_dir)
    if folder.exists() and not folder.is_dir():
        raise UserError(
            f"checkpoint.folder '{folder}' is a file; point checkpoint.folder at a folder"
        )
    resume = resume_plan(cfg, run_dir, restarted=False, data=data_identity(cfg))[0]
    meta = _meta_model(cfg)  # the name, flavor and capabilities, on the meta device
    n = sum(p.numel() for p in meta.model.parameters())
    if resume is None:
        check_initial_weights(cfg, meta)
    else:
        check_same_model(folder, resume, meta, cfg)
    if cfg.checkpoint.saves:
        check_writable(folder, "checkpoint.folder")
        if check_space:
            flavor = "the Hugging Face model" if cfg.model.hf_assets_path else cfg.model.flavor
            what = f"{cfg.model.name} {flavor} ({n / 1e9:.2f}B parameters, weights and AdamW state)"
            check_checkpoint_space(folder, n * CHECKPOINT_BYTES_PER_PARAM, what)
    if not os.environ.get(NOTES_SHOWN_ENV):  # once every check passed: a refusal stays one line
        print(f"titanlite: {plan_line(cfg, layout, n, world_size)}", file=sys.stderr)
        print(f"titanlite: reads {'; '.join(inputs(cfg, path))}", file=sys.stderr)
        for note in config_notes + startup_notes(cfg, layout.dp):
            print(f"titanlite: note: {note}", file=sys.stderr)
    return cfg, run_dir


def plan_line(cfg: JobConfig, layout: Any, params: int, world_size: int) -> str:
    """The run in one line, first on the console: the model, the mesh, the ranks and where they run."""
    model = f"{cfg.model.name} {'from ' + cfg.model.hf_assets_path if cfg.model.hf_assets_path else cfg.model.flavor}"
    model += f" ({params / 1e6:,.1f}M parameters)"
    mesh = mesh_text(layout.mode, layout.dp_replicate, layout.dp_shard, dict(layout.axes))
    if cfg.rehearsal.world:
        return f"rehearsing {model} on {mesh} as rank 0 of {cfg.rehearsal.world:,} ranks, in one process here"
    import torch

    ranks = f"{world_size} GPU rank(s)"
    if not torch.cuda.is_available():
        ranks = f"{world_size} CPU rank(s) (no GPU here)"
    return f"training {model} on {mesh}: {ranks}, {cfg.training.steps:,} step(s)"


def inputs(cfg: JobConfig, path: str | None) -> list[str]:
    """What the run reads, each by its absolute path (titanlite.config.command_line's)."""
    data = ", ".join(
        absolute(n) + (f" ({w:.0%})" if w != 1 else "") for n, w in parse_data_path(cfg.data.path)
    )
    out = [
        f"config {absolute(path) if path else '(built-in defaults)'}",
        f"data {data or '(built-in stdlib text)'}",
    ]
    optional = {
        "eval data": cfg.eval.path,
        "initial weights": cfg.checkpoint.initial_load_path or cfg.model.hf_assets_path,
        "tokenizer": cfg.model.tokenizer_path,
    }
    return out + [f"{what} {absolute(value)}" for what, value in optional.items() if value]


def startup_notes(cfg: JobConfig, dp: int) -> list[str]:
    """What is on that a user may not know of (fault switches, rules this dp cannot run, ...)."""
    notes = []
    if cfg.faults is not None:
        on = ", ".join(cfg.faults.switches_on()) or "every switch off"
        notes.append(
            f"[faults] is set ({on}): fault injection for tests and fault scenarios, not a real run"
        )
    if cfg.diagnostics.enable:
        silent = silent_rules_note(dp, rank_share(cfg, dp), cfg.alerts)
        measured = cfg.diagnostics.measured_steps(cfg.training.steps)
        short = dp >= 2 and history_note(cfg.alerts, measured, dp)
        notes += [f"diagnostics: {note}" for note in (silent, short) if note]
    if overlap := eval_overlap(cfg):
        notes.append(overlap)
    if cfg.model.hf_assets_path:
        config = Path(cfg.model.hf_assets_path).expanduser() / "config.json"
        trained = read_json(config).get("max_position_embeddings") or 0
        if 0 < trained < cfg.training.seq_len:
            notes.append(
                f"training.seq_len {cfg.training.seq_len} is longer than the {trained} positions the model was trained on ({config}: max_position_embeddings); the positions beyond are untrained, so lower training.seq_len to {trained} unless you mean to extend its context"
            )
    return notes


def check_initial_weights(cfg: JobConfig, meta: Any) -> None:
    """A fresh run's initial weights (checkpoint.initial_load_path or model.hf_assets_path) are
    whole and fit the model (`meta`) both ways; a resume never reads them."""
    from titanlite.components.checkpoint.hf_load import hf_plan
    from titanlite.components.checkpoint.index import initial_load_kind
    from titanlite.datasets.build import build_tokenizer
    from titanlite.distributed.param_init import canonical_name

    source = cfg.checkpoint.initial_load_path or cfg.model.hf_assets_path
    if not source:
        return
    path = Path(source).expanduser()
    if initial_load_kind(path) == "hf":
        shapes = {canonical_name(n): tuple(p.shape) for n, p in meta.model.named_parameters()}
        hf_plan(shapes, path, meta.spec.hf, meta.args)
    else:  # a titanlite step folder: verified as every reader of a checkpoint verifies it
        step = step_to_read(path, flag="checkpoint.initial_load_path")
        # every tensor taken, both ways, and token ids that mean what they meant
        tok = build_tokenizer(cfg, train=False)
        fingerprint = tok.fingerprint if tok else None
        check_initial_fits(step, meta.model, cfg.checkpoint.initial_load_drop, fingerprint)


def _meta_model(cfg: JobConfig) -> Any:
    """cfg's model on the meta device (imports torch), with its tokenizer's vocabulary."""
    from titanlite.datasets.tokenizer import load_tokenizer
    from titanlite.models.registry import build_meta_model

    m = cfg.model
    if cfg.data.mode == "synthetic":
        vocab = 0  # no tokenizer: model.vocab_size (or the folder's config.json) gives it
    elif m.tokenizer_path or m.hf_assets_path:  # the folder's config.json must hold its ids
        vocab = load_tokenizer(m.tokenizer_path or m.hf_assets_path).vocab_size
    else:
        vocab = m.builtin_vocab_size
    return build_meta_model(cfg, vocab)


def main(argv: list[str]) -> int:
    if wants_help(argv):
        print(config_help(USAGE))
        return 0
    try:
        if len(argv) < 2 or argv[0] != "--world-size" or not whole_number(argv[1]):
            raise UserError(
                "usage: python -m titanlite.preflight --world-size N [--config FILE] [overrides]"
            )
        plan_run(argv[2:], int(argv[1]), check_space=False)
    except UserError as e:
        return report(e)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
