#!/usr/bin/env python3
"""Which documents a training step read: every sequence of a step's global batch (or of one
rank's share of it), traced to its source files, rows and token ranges.

    ./scripts/trace_batch.py --config train_configs/llama_1b.toml --data.path /data/tok/fineweb --step 1200
    ./scripts/trace_batch.py --step 1200 --dp 8 --rank 3 --json     # rank 3's share at dp=8

The batch of a step depends only on the seed, the global batch size, seq_len and the data (see
titanlite/datasets/sampler.py), so this needs neither the run nor a GPU. Steps count from 1, as
in the run's logs. Any --section.key value of the run applies (data.path, training.seed, ...).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titanlite.tools.venv import use_project_venv  # noqa: E402

use_project_venv()  # any python3 will do: without titanlite's dependencies it re-executes in .venv

from titanlite.config import parse_args  # noqa: E402
from titanlite.datasets.trace import trace_step  # noqa: E402
from titanlite.errors import UserError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--step", type=int, required=True, help="training step, from 1")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel degree of the run (for --rank)")
    ap.add_argument("--rank", type=int, help="only this dp rank's share")
    ap.add_argument("--json", action="store_true", help="one JSON object per sequence")
    args, rest = ap.parse_known_args(argv)
    try:
        cfg, _ = parse_args(rest)
        rows = trace_step(cfg, args.step, args.dp, args.rank)
    except UserError as e:
        print(f"trace_batch: error: {e}", file=sys.stderr)
        return 2
    for row in rows:
        if args.json:
            print(json.dumps(row))
            continue
        where = "; ".join(
            f"{s['file']} row {s['row']} tokens {s['tokens'][0]}-{s['tokens'][1]}" for s in row["sources"]
        )
        print(
            f"step {args.step} position {row['position']} rank {row['rank']} sequence {row['sequence']}: {where}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
