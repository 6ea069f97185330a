#!/usr/bin/env python3
"""The diagnostics at any world size: the cluster rehearsal (./run_train.sh --rehearse W) of one
config at each W, for each diagnostics method, in this one process; per W and method, what a
measured step adds: bytes one rank sends on the diagnostics' group, device time and memory, rank
0's host work on the step's record (its statistics and alert rules) and the record's size.

    ./scripts/rehearse_sweep.py                                   # W = 8 ... 1,024, exact and sketch
    ./scripts/rehearse_sweep.py --check                           # exit 1 if W >= 1,024 misses a target
    ./scripts/rehearse_sweep.py --worlds 8 64 --methods sketch --out sweep.json
    ./scripts/rehearse_sweep.py --config train_configs/llama_1b.toml --training.seq_len 256

Each rehearsal's own report is in --runs (rehearsal.json per run folder); the sweep's table is
printed and written to --out as JSON, which sweep_markdown renders (titanlite/rehearsal/README.md's
table: scripts/figures/rehearse_sweep-*.json). At W >= 1,024, rank 0's host work per measured step
must stay under 1 s and the record under 1 MiB (TARGETS; --check fails otherwise). The example in
README.md's "Plan a cluster run" is one rehearsal.json, rendered by example_markdown.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from titanlite.tools.venv import use_project_venv  # noqa: E402

use_project_venv()  # any python3 will do: without titanlite's dependencies it re-executes in .venv

from titanlite.tools.cli import Script  # noqa: E402

WORLDS = (8, 16, 32, 64, 128, 256, 512, 1024)
MiB = 2**20

SCRIPT = Script("rehearse_sweep", __doc__, overrides="every rehearsal")
SCRIPT.arg(
    "--config",
    kind="file",
    default=REPO / "train_configs/debug_model.toml",
    help="the config rehearsed",
)
SCRIPT.arg(
    "--worlds",
    kind="int",
    nargs="+",
    default=list(WORLDS),
    at_least=2,
    at_most=2**20,
    help="world sizes",
)
SCRIPT.arg(
    "--methods",
    kind="choice",
    nargs="+",
    choices=("exact", "sketch"),
    default=["exact", "sketch"],
    help="methods",
)
SCRIPT.arg(
    "--runs", kind="out_folder", help="the rehearsals' run folders (default: a temporary folder)"
)
SCRIPT.arg("--out", kind="out_file", default="rehearse_sweep.json", help="the sweep as JSON")
SCRIPT.arg(
    "--check", kind="switch", help="exit 1 unless every W >= 1,024 meets the targets (TARGETS)"
)

# At 1,024 ranks and beyond, per measured step: rank 0's host work and the record's size.
TARGETS = {"host_s": 1.0, "record_bytes": 2**20}


def row(report: dict) -> dict:
    """What the sweep keeps of one rehearsal.json: the diagnostics' cost per measured step."""
    d = report["diagnostics"] or {}
    return {
        "world": report["world"],
        "method": report["layout"]["diagnostics"],
        "bytes": sum(d.get("traffic_bytes", {}).values()),
        "device_s": d.get("step_s"),
        "memory_bytes": d.get("peak_bytes"),
        "host_s": d.get("host_s"),
        "record_bytes": d.get("record_bytes"),
        "compute_s": report["compute_s"],
    }


def sweep_markdown(sweep: dict) -> str:
    """The sweep's table: per W and method, a measured step's extra cost."""
    lines = [
        "| W | method | sent per rank | rank 0's host work | record | device time | memory |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in sweep["rows"]:
        device = "-" if r["device_s"] is None else f"{r['device_s']:+.3f} s"
        lines.append(
            f"| {r['world']:,} | {r['method']} | {r['bytes'] / MiB:,.2f} MiB | {r['host_s']:.3f} s | "
            f"{r['record_bytes'] / MiB:,.2f} MiB | {device} | {r['memory_bytes'] / MiB:+,.1f} MiB |"
        )
    return "\n".join(lines) + "\n"


def example_markdown(report: dict) -> str:
    """One rehearsal's table as the run prints it (titanlite.rehearsal.report.table)."""
    from titanlite.rehearsal.report import table

    return "```\n" + table(report) + "\n```\n"


def run(args) -> int:
    import torch.distributed as dist

    from titanlite.config import parse_args
    from titanlite.rehearsal.run import rehearse

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        runs = Path(args.runs or tmp)
        for world in args.worlds:
            for method in args.methods:
                argv = [
                    "--config",
                    str(args.config),
                    *args.overrides,
                    "--rehearsal.world",
                    str(world),
                ]
                argv += ["--diagnostics.method", method, "--job.dump_folder", str(runs)]
                cfg, _ = parse_args([*argv, "--job.run_name", f"w{world}-{method}"])
                rows.append(row(rehearse(cfg)))
                dist.destroy_process_group()
                print(sweep_markdown({"rows": rows[-1:]}).splitlines()[-1], flush=True)
    sweep = {"config": str(args.config), "overrides": args.overrides, "rows": rows}
    Path(args.out).write_text(json.dumps(sweep, indent=1) + "\n")
    print(sweep_markdown(sweep) + f"\nsweep: {args.out}")
    missed = [
        f"W={r['world']} {r['method']}: {key} {r[key]:.3g} (target < {limit:.3g})"
        for r in rows
        if r["world"] >= 1024
        for key, limit in TARGETS.items()
        if r[key] is None or r[key] >= limit
    ]
    for line in missed:
        print(f"missed: {line}")
    return 1 if args.check and missed else 0


def main(argv: list[str] | None = None) -> int:
    return SCRIPT.run(run, argv)


if __name__ == "__main__":
    sys.exit(main())
