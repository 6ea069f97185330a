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

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titanlite.tools.venv import use_project_venv  # noqa: E402

use_project_venv()  # any python3 will do: without titanlite's dependencies it re-executes in .venv

from titanlite.config import parse_args  # noqa: E402
from titanlite.datasets.build import trace_step  # noqa: E402
from titanlite.errors import UserError  # noqa: E402
from titanlite.tools.cli import Script  # noqa: E402

SCRIPT = Script("trace_batch", __doc__, overrides="the config the batch is traced with")
SCRIPT.arg("--config", kind="file", help="the run's config (default: the built-in defaults)")
SCRIPT.arg(
    "--step", kind="int", required=True, at_least=1, at_most=10**12, help="training step, from 1"
)
SCRIPT.arg(
    "--dp",
    kind="int",
    default=1,
    at_least=1,
    at_most=1 << 20,
    help="data-parallel degree of the run (for --rank)",
)
SCRIPT.arg("--rank", kind="int", at_least=0, at_most=1 << 20, help="only this dp rank's share")
SCRIPT.arg("--json", kind="switch", help="one JSON object per sequence")


def trace(args) -> int:
    if args.rank is not None and args.rank >= args.dp:
        raise UserError(
            f"--rank is {args.rank} but --dp is {args.dp}; give a rank from 0 to {args.dp - 1}"
        )
    cfg, _ = parse_args([*(["--config", str(args.config)] if args.config else []), *args.overrides])
    for row in trace_step(cfg, args.step, args.dp, args.rank):
        if args.json:
            print(json.dumps(row))
            continue
        where = "; ".join(
            f"{s['file']} row {s['row']} tokens {s['tokens'][0]}-{s['tokens'][1]}"
            for s in row["sources"]
        )
        print(
            f"step {args.step} position {row['position']} rank {row['rank']} sequence {row['sequence']}: {where}"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    return SCRIPT.run(trace, argv)


if __name__ == "__main__":
    sys.exit(main())
