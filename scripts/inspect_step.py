#!/usr/bin/env python3
"""Print the samples of one step of a run: what each rank trained on, with its sources and losses.

    ./scripts/inspect_step.py RUN_DIR --step 21 [--rank 2] [--chars 100] [--json]

From the run folder alone (config.toml, run.json; no checkpoint, no GPU): every sequence of the
step's global batch (or of one rank's share), with its dataset index, sources (file and row, or
stdlib:<module> for the built-in data), token and target counts and the head of its decoded
text. When the step was measured (diagnostics.jsonl), each rank's own report is used: the indices
it read and each sequence's token-mean loss; a rank that read other sequences than the config
assigns it (a data-loading fault) is flagged. Alerts in events.jsonl name the same samples.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titanlite.tools.venv import use_project_venv  # noqa: E402

use_project_venv()  # any python3 will do: without titanlite's dependencies it re-executes in .venv

import numpy as np  # noqa: E402

from titanlite.config import load_config  # noqa: E402
from titanlite.datasets.build import build_dataset, build_tokenizer  # noqa: E402
from titanlite.datasets.corpus import source_name  # noqa: E402
from titanlite.datasets.trace import trace_step  # noqa: E402
from titanlite.errors import UserError  # noqa: E402
from titanlite.ops.cross_entropy import IGNORE_INDEX  # noqa: E402


def reported(run_dir: Path, step: int) -> list[list[dict]] | None:
    """Each rank's samples of `step` as its diagnostics recorded them, if the step was measured."""
    path = run_dir / "diagnostics.jsonl"
    if not path.exists():
        return None
    for line in path.read_text().splitlines():
        rec = json.loads(line) if line else {}
        if rec.get("step") == step and "rank_samples" in rec:
            return rec["rank_samples"]
    return None


def inspect_step(run_dir: Path, step: int, rank: int | None, chars: int) -> list[dict]:
    for name in ("config.toml", "run.json"):
        if not (run_dir / name).is_file():
            raise UserError(f"{run_dir} has no {name}; pass a run folder (outputs/<run>)")
    cfg = load_config(str(run_dir / "config.toml"))
    dp = json.loads((run_dir / "run.json").read_text())["world_size"]
    tok = build_tokenizer(cfg)
    dataset = build_dataset(cfg, tok)
    rows = trace_step(cfg, step, dp, rank, dataset)
    ranks = reported(run_dir, step)
    per_rank = cfg.training.global_batch_size // dp
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path, help="the run folder")
    ap.add_argument("--step", type=int, required=True, help="training step, from 1")
    ap.add_argument("--rank", type=int, help="only this dp rank's share")
    ap.add_argument("--chars", type=int, default=100, help="characters of decoded text to show")
    ap.add_argument("--json", action="store_true", help="one JSON object per sequence")
    args = ap.parse_args(argv)
    try:
        rows = inspect_step(args.run_dir, args.step, args.rank, args.chars)
    except UserError as e:
        print(f"inspect_step: error: {e}", file=sys.stderr)
        return 2
    for row in rows:
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


if __name__ == "__main__":
    sys.exit(main())
