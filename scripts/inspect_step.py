#!/usr/bin/env python3
"""Print the samples of one step of a run: what each rank trained on, with its sources and losses.

    ./scripts/inspect_step.py RUN_DIR --step 21 [--rank 2] [--chars 100] [--json]

From the run folder alone (config.toml, run.json; no checkpoint, no GPU): every sequence of the
step's global batch (or of one rank's share), with its dataset index, sources (file and row, or
stdlib:<module> for the built-in data), token and target counts and the head of its decoded
text. When the step was measured (diagnostics.jsonl), each rank's own report is used: the indices
it read and each sequence's token-mean loss; a rank that read other sequences than the config
assigns it (a data-loading fault) is flagged. Alerts in events.jsonl name the same samples.
A step split over the ranks the way it ran (a run resumed at another layout keeps the earlier
ones in run.json); one the run never reached, or a rehearsal's folder, is said first.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titanlite.tools.venv import use_project_venv  # noqa: E402

use_project_venv()  # any python3 will do: without titanlite's dependencies it re-executes in .venv

import numpy as np  # noqa: E402

from titanlite.components.run.folder import layout_at  # noqa: E402
from titanlite.config import load_config  # noqa: E402
from titanlite.config.layout import rank_share  # noqa: E402
from titanlite.datasets.build import build_dataset, build_tokenizer, trace_step  # noqa: E402
from titanlite.datasets.corpus import source_name  # noqa: E402
from titanlite.errors import UserError  # noqa: E402
from titanlite.ops.cross_entropy import IGNORE_INDEX  # noqa: E402
from titanlite.tools.cli import Script  # noqa: E402
from titanlite.tools.records import (  # noqa: E402
    RUN_FOLDER_KINDS,
    folder_kind,
    read_json,
    read_records,
)


def reported(run_dir: Path, step: int) -> list[list[dict]] | None:
    """Each rank's samples of `step` as its diagnostics recorded them, if the step was measured."""
    for rec in read_records(run_dir / "diagnostics.jsonl"):
        if rec.get("step") == step and "rank_samples" in rec:
            return rec["rank_samples"]
    return None


def not_run(run_dir: Path, step: int, steps: int) -> str | None:
    """Why `step` of this folder trained on nothing, if it did not (folder_kind): a rehearsal runs
    one rank's share on its own sampler, and a run's steps end at its last metrics record."""
    kind = folder_kind(run_dir)
    if kind != "run":
        return f"{run_dir} is {RUN_FOLDER_KINDS[kind]}: below is what step {step} of a run with its config trains on"
    done = [
        r["step"] for r in read_records(run_dir / "metrics.jsonl") if isinstance(r.get("step"), int)
    ]
    if step <= max(done, default=0):
        return None
    return f"step {step} never ran in {run_dir} (its metrics end at step {max(done, default=0)}, of {steps} planned): below is what its config assigns that step"


def inspect_step(run_dir: Path, step: int, rank: int | None, chars: int) -> list[dict]:
    folder_kind(run_dir)  # a folder that is no run's: one line, before any work
    cfg = load_config(str(run_dir / "config.toml"))
    dp = layout_at(read_json(run_dir / "run.json"), step).get(
        "world_size"
    )  # at a resume's layout, if so
    if not isinstance(dp, int) or dp < 1:
        raise UserError(
            f"{run_dir / 'run.json'} names no world size; pass a run folder (outputs/<run>)"
        )
    if rank is not None and rank >= dp:
        raise UserError(
            f"--rank is {rank} but step {step} ran on {dp} ranks; give a rank from 0 to {dp - 1}"
        )
    if why := not_run(run_dir, step, cfg.training.steps):
        print(f"{SCRIPT.prog}: note: {why}", file=sys.stderr, flush=True)
    tok = build_tokenizer(cfg)
    dataset = build_dataset(cfg, tok)
    rows = trace_step(cfg, step, dp, rank, dataset)
    ranks = reported(run_dir, step)
    per_rank = rank_share(cfg, dp)
    out = []
    for row in rows:
        r, i = row["rank"], row["position"] % per_rank
        sample = ranks[r][i] if ranks is not None else None
        index = sample["index"] if sample else row["sequence"]
        inputs, labels = dataset[index][:2]
        text = tok.decode(np.asarray(inputs)[: 4 * chars].tolist())[:chars]
        out.append(
            {
                "step": step,
                "rank": r,
                "position": row["position"],
                "index": index,
                "assigned": row["sequence"],  # what the config gives this position
                "tokens": len(inputs),
                "targets": int((np.asarray(labels) != IGNORE_INDEX).sum()),
                "loss": sample["loss"] if sample else None,
                "sources": dataset.trace(index),
                "text": text,
            }
        )
    return out


SCRIPT = Script("inspect_step", __doc__)
SCRIPT.arg("run_dir", kind="folder", help="the run folder")
SCRIPT.arg(
    "--step", kind="int", required=True, at_least=1, at_most=10**12, help="training step, from 1"
)
SCRIPT.arg("--rank", kind="int", at_least=0, at_most=1 << 20, help="only this dp rank's share")
SCRIPT.arg(
    "--chars",
    kind="int",
    default=100,
    at_least=1,
    at_most=10**6,
    help="characters of decoded text to show",
)
SCRIPT.arg("--json", kind="switch", help="one JSON object per sequence")


def show(args) -> int:
    for row in inspect_step(args.run_dir, args.step, args.rank, args.chars):
        if args.json:
            print(json.dumps(row))
            continue
        where = "; ".join(f"{source_name(s['file'])} row {s['row']}" for s in row["sources"])
        loss = f", loss {row['loss']:.3f}" if row["loss"] is not None else ""
        odd = (
            f" (the config assigns #{row['assigned']}: a data fault?)"
            if row["index"] != row["assigned"]
            else ""
        )
        print(
            f"step {row['step']} rank {row['rank']} #{row['index']}{odd}: {row['tokens']} tokens, "
            f"{row['targets']} targets{loss} | {where}\n    {row['text']!r}"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    return SCRIPT.run(show, argv)


if __name__ == "__main__":
    sys.exit(main())
