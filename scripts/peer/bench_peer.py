#!/usr/bin/env python3
"""Side-by-side CPU benchmark: torchtitan 0.3.0 (PyPI, unmodified, patched at run time by
run_torchtitan.py) against titanlite: the llama3 debugmodel (6,163,712 params, vocab 2048) on 2
gloo ranks with FSDP, fp32, seq 512, local batch 2, global batch 4, 40 steps, no activation
checkpointing, no compile, AdamW, clipping at 1.0.

    python3 -m venv .venv-torchtitan
    .venv-torchtitan/bin/pip install torch==2.13.0 torchtitan==0.3.0     # once
    ./scripts/peer/bench_peer.py [--rounds 3] [--steps 40] [--only tt8 tl] [--out DIR]

Each round runs every variant once; the order alternates between rounds (forward, reversed,
...) so that a drift in machine load does not favour one side. Per run: the median of rank 0's
per-step tokens/s over steps 6..steps (each framework's own per-step figure: torchtitan's `tps`,
titanlite's metrics.jsonl `tokens_per_s`), and a wall-clock rate over the same steps, 1024
tokens x (steps - 5) / (time of step `steps` - time of step 5), which also counts per-step work
outside a framework's own timing window. Both frameworks get OMP_NUM_THREADS=1 (2 ranks, 2
cores) and log every step. Every run's output is kept under --out, with results.json: the
settings (steps, rounds, order, each variant's arguments and titanlite's resolved diagnostics
schedule) and every run's figures. scripts/README.md's table renders such a file kept as
scripts/figures/bench_peer-cpu.json (markdown): copy --out's results.json there.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
TL_ROOT = HERE.parents[1]
sys.path.insert(0, str(TL_ROOT))

from titanlite.tools.venv import use_project_venv  # noqa: E402

use_project_venv()  # any python3 will do: without titanlite's dependencies it re-executes in .venv

from titanlite.config import parse_args  # noqa: E402
from titanlite.errors import UserError  # noqa: E402
from titanlite.tools.cli import Script  # noqa: E402
from titanlite.tools.records import metrics_rows  # noqa: E402

TL_TORCHRUN = TL_ROOT / ".venv" / "bin" / "torchrun"
TT_TORCHRUN = (
    Path(os.environ.get("TORCHTITAN_VENV", TL_ROOT / ".venv-torchtitan")) / "bin" / "torchrun"
)

SEQ, LOCAL_BATCH, GLOBAL_BATCH = 512, 2, 4
TOKENS_PER_RANK_STEP = SEQ * LOCAL_BATCH
FIRST_STEP = 6  # steps 1-5 are warmup and excluded

# name -> (framework, extra args, description)
VARIANTS: dict[str, tuple[str, list[str], str]] = {
    "tt8": ("torchtitan", [], "torchtitan default (ChunkedLossWrapper, 8 chunks)"),
    "tt1": ("torchtitan", ["--loss.num_chunks", "1"], "torchtitan, --loss.num_chunks 1"),
    "tl": ("titanlite", [], "titanlite default (diagnostics at their default schedule)"),
    "tl_nodiag": (
        "titanlite",
        ["--diagnostics.enable", "false"],
        "titanlite --diagnostics.enable false",
    ),
    "tl_diag_pw": (
        "titanlite",
        ["--diagnostics.measure_first", "0", "--diagnostics.every", "500"],
        "titanlite, diagnostics schedule past warmup (every 500 steps)",
    ),
    # optional (not in the default order): titanlite on random tokens, like the torchtitan side
    "tl_synth": (
        "titanlite",
        ["--data.mode", "synthetic", "--model.vocab_size", "2048"],
        "titanlite, --data.mode synthetic (random tokens)",
    ),
}
ORDER = ["tt8", "tl", "tt1", "tl_nodiag", "tl_diag_pw"]
TL_CONFIG = "train_configs/debug_model.toml"

ANSI = re.compile(r"\x1b\[[0-9;]*m")
TT_STEP = re.compile(
    r"^\[default(?P<rank>\d+)\]:\[titan\] (?P<ts>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*?"
    r"step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>[-\d.naif]+)\s+grad_norm:\s*(?P<gn>[-\d.naif]+)"
    r".*?tps:\s*(?P<tps>[\d,]+)"
)


def env_for_run() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"  # 2 ranks on 2 cores, the same for both frameworks
    env.setdefault("PYTHONWARNINGS", "ignore::UserWarning,ignore::FutureWarning")
    return env


def command(variant: str, steps: int, tag: str, runs_dir: Path) -> tuple[list[str], Path]:
    fw, extra, _ = VARIANTS[variant]
    # The same step on both sides: both frameworks' configs name these keys alike.
    step = [
        "--training.seq_len", str(SEQ), "--training.local_batch_size", str(LOCAL_BATCH),
        "--training.global_batch_size", str(GLOBAL_BATCH), "--training.steps", str(steps),
        "--metrics.log_freq", "1",
    ]  # fmt: skip
    launch = ["--standalone", "--nproc_per_node", "2"]
    if fw == "torchtitan":
        script = [
            str(HERE / "run_torchtitan.py"),
            "--module",
            "tt_cpu_config",
            "--config",
            "tt_cpu_debugmodel",
        ]
        out = ["--dump_folder", str(runs_dir / tag)]
        return [str(TT_TORCHRUN), *launch, "--tee", "3", *script, *step, *out, *extra], HERE
    config = ["-m", "titanlite.train", "--config", TL_CONFIG]
    out = ["--job.dump_folder", str(runs_dir), "--job.run_name", tag]
    return [str(TL_TORCHRUN), *launch, *config, *step, *out, *extra], TL_ROOT


def parse_tt(log: str, steps: int) -> dict:
    per_rank: dict[int, dict[int, dict]] = {}
    for raw in log.splitlines():
        m = TT_STEP.match(ANSI.sub("", raw))
        if not m:
            continue
        ts = datetime.strptime(m["ts"], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        per_rank.setdefault(int(m["rank"]), {})[int(m["step"])] = {
            "tps": float(m["tps"].replace(",", "")),
            "loss": float(m["loss"]),
            "grad_norm": float(m["gn"]),
            "t": ts,
        }
    out: dict = {}
    for rank, rows in sorted(per_rank.items()):
        sel = [rows[s]["tps"] for s in range(FIRST_STEP, steps + 1) if s in rows]
        rec = {"n": len(sel), "median_tps": statistics.median(sel) if sel else None}
        if FIRST_STEP - 1 in rows and steps in rows:
            dt = rows[steps]["t"] - rows[FIRST_STEP - 1]["t"]
            rec["wall_tps"] = TOKENS_PER_RANK_STEP * (steps - FIRST_STEP + 1) / dt
        rec["loss_first"] = rows.get(1, {}).get("loss")
        rec["loss_last"] = rows.get(steps, {}).get("loss")
        rec["grad_norm_first"] = rows.get(1, {}).get("grad_norm")
        out[f"rank{rank}"] = rec
    return out


def parse_tl(run_dir: Path, steps: int) -> dict:
    # the log steps' rows: they carry tokens_per_s and elapsed_s
    rows = {r["step"]: r for r in metrics_rows(run_dir / "metrics.jsonl", logged=True)}
    sel = [rows[s]["tokens_per_s"] for s in range(FIRST_STEP, steps + 1) if s in rows]
    rec = {"n": len(sel), "median_tps": statistics.median(sel) if sel else None}
    if FIRST_STEP - 1 in rows and steps in rows:
        dt = rows[steps]["elapsed_s"] - rows[FIRST_STEP - 1]["elapsed_s"]
        rec["wall_tps"] = TOKENS_PER_RANK_STEP * (steps - FIRST_STEP + 1) / dt
    rec["loss_first"] = rows.get(1, {}).get("loss")
    rec["loss_last"] = rows.get(steps, {}).get("loss")
    rec["grad_norm_first"] = rows.get(1, {}).get("grad_norm")
    return {"rank0": rec}


def run_one(variant: str, rnd: int, steps: int, out_dir: Path, runs_dir: Path) -> dict:
    tag = f"{datetime.now():%Y%m%d-%H%M%S}-r{rnd}-{variant}"
    cmd, cwd = command(variant, steps, tag, runs_dir)
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(
        cmd,
        cwd=cwd,
        env=env_for_run(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=1200,
    )
    wall = time.perf_counter() - t0
    log_path = out_dir / f"r{rnd}-{variant}.log"
    log_path.write_text(" ".join(cmd) + f"\n# cwd {cwd}\n" + proc.stdout)
    fw = VARIANTS[variant][0]
    parsed = parse_tt(proc.stdout, steps) if fw == "torchtitan" else parse_tl(runs_dir / tag, steps)
    rec = {
        "variant": variant,
        "round": rnd,
        "rc": proc.returncode,
        "wall_s": wall,
        "loadavg_1m_before": load_before,
        "loadavg_1m_after": os.getloadavg()[0],
        "log": str(log_path),
        "ranks": parsed,
    }
    r0 = parsed.get("rank0", {})
    med = r0.get("median_tps")
    wtps = r0.get("wall_tps")
    print(
        f"  round {rnd} {variant:11s} rc={proc.returncode} "
        f"median tok/s r0 {med if med is None else round(med):>6} "
        f"wall tok/s {wtps if wtps is None else round(wtps):>6} "
        f"({r0.get('n', 0)} steps) run {wall:5.1f}s load {load_before:.2f}->{rec['loadavg_1m_after']:.2f}",
        flush=True,
    )
    return rec


SCRIPT = Script("bench_peer", __doc__)
SCRIPT.arg("--rounds", kind="int", default=3, at_least=1, at_most=1000, help="alternating rounds")
SCRIPT.arg(
    "--steps",
    kind="int",
    default=40,
    at_least=FIRST_STEP + 1,
    at_most=10**6,
    help="steps of every run",
)
SCRIPT.arg(
    "--only",
    kind="choice",
    nargs="+",
    choices=tuple(VARIANTS),
    default=ORDER,
    help="variants, in round order",
)
SCRIPT.arg(
    "--out",
    kind="out_folder",
    default=TL_ROOT / "outputs" / f"peer-{datetime.now():%Y%m%d-%H%M%S}",
    help="logs and results",
)


def variant_settings(order: list[str]) -> dict[str, dict]:
    """results.json's "variants": each variant's framework and arguments; for titanlite, the
    diagnostics schedule its config resolves to (what the README's labels name)."""
    out = {}
    for v in order:
        fw, extra, desc = VARIANTS[v]
        rec = {"framework": fw, "args": extra, "description": desc}
        if fw == "titanlite":
            d = parse_args(["--config", str(TL_ROOT / TL_CONFIG), *extra])[0].diagnostics
            rec["diagnostics"] = {
                "enable": d.enable,
                "measure_first": d.measure_first,
                "every": d.every,
            }
        out[v] = rec
    return out


def per_round(results: dict, variant: str, key: str = "median_tps") -> dict[int, float]:
    """{round: rank 0's figure `key`} of the variant's successful runs."""
    out = {}
    for r in results["runs"]:
        x = (
            r["ranks"].get("rank0", {}).get(key)
            if r["variant"] == variant and r["rc"] == 0
            else None
        )
        if x:
            out[r["round"]] = x
    return out


def _median(results: dict, variant: str, key: str = "median_tps") -> float | None:
    xs = list(per_round(results, variant, key).values())
    return statistics.median(xs) if xs else None


def _label(results: dict, v: str) -> str:
    """The README's row label of variant v, its settings read from the results."""
    diag = results["variants"][v].get("diagnostics", {})
    if v == "tt8":
        return "torchtitan default (loss in 8 chunks)"
    if v == "tt1":
        args = results["variants"][v]["args"]
        n = args[args.index("--loss.num_chunks") + 1]
        return f"torchtitan, loss in {n} chunk{'' if n == '1' else 's'}"
    if v == "tl":
        steps, first = results["steps"], diag["measure_first"]
        how = (
            f"measuring every step: {steps} < {first} warmup steps"
            if steps < first
            else f"measuring the first {first} steps, then every {diag['every']}"
        )
        return f"**titanlite default** (diagnostics {how})"
    if v == "tl_nodiag":
        return "titanlite, diagnostics off"
    if v == "tl_diag_pw":
        return f"titanlite, diagnostics past warmup (every {diag['every']} steps)"
    return VARIANTS[v][2]


def markdown(results: dict) -> str:
    """scripts/README.md's comparison of a results.json (scripts/figures/bench_peer-*.json): per
    variant, rank 0's median tokens/s of each round, their median over rounds and its ratio to
    torchtitan default's; then titanlite default / torchtitan default per round and, where the
    file holds the wall-clock rates, the ratio of their medians. A variant without a successful
    run is left out; a round without one is '-'."""
    rounds = range(1, results["rounds"] + 1)
    ref = _median(results, "tt8")
    head = ["tokens/s per rank", *(f"round {r}" for r in rounds), "median", "/ torchtitan default"]
    lines = [head, ["---"] * len(head)]
    for v in VARIANTS:  # the README's row order
        vals = per_round(results, v) if v in results["variants"] else {}
        if not vals:
            continue
        med = statistics.median(vals.values())
        ratio = f"{med / ref:.3f}" if ref else "-"
        lines.append(
            [
                _label(results, v),
                *(f"{vals[r]:,.0f}" if r in vals else "-" for r in rounds),
                f"{med:,.0f}",
                f"**{ratio}**" if v == "tl" else ratio,
            ]
        )
    out = "".join("| " + " | ".join(cells) + " |\n" for cells in lines) + "\n"
    tl, tt = per_round(results, "tl"), per_round(results, "tt8")
    both = [r for r in rounds if r in tl and r in tt]
    if both:
        out += "Per round, titanlite default / torchtitan default is " + ", ".join(
            f"{tl[r] / tt[r]:.3f}" for r in both
        )
        wall_tl, wall_tt = _median(results, "tl", "wall_tps"), _median(results, "tt8", "wall_tps")
        if wall_tl and wall_tt:
            out += f"; wall-clock rates over the same steps give {wall_tl / wall_tt:.3f}"
        out += ".\n\n"
    return out


def run(args) -> int:
    order = list(args.only)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not TT_TORCHRUN.exists():
        raise UserError(
            f"no torchtitan venv at {TT_TORCHRUN.parents[1]}; create it as the docstring says, or set TORCHTITAN_VENV"
        )
    runs_dir = out_dir / "runs"
    runs_dir.mkdir(exist_ok=True)

    print(f"bench_peer: {args.rounds} rounds x {order}, {args.steps} steps, logs in {out_dir}")
    for v in order:
        print(f"  {v:11s} {VARIANTS[v][2]}")
    results: dict = {
        "steps": args.steps,
        "first_step": FIRST_STEP,
        "rounds": args.rounds,
        "order": order,
        "variants": variant_settings(order),
        "runs": [],
    }
    for rnd in range(1, args.rounds + 1):
        seq = order if rnd % 2 == 1 else list(reversed(order))
        print(f"round {rnd}: {' -> '.join(seq)}", flush=True)
        for v in seq:
            results["runs"].append(run_one(v, rnd, args.steps, out_dir, runs_dir))
            (out_dir / "results.json").write_text(json.dumps(results, indent=1))

    span = f"steps {FIRST_STEP}-{args.steps}"
    for key, title in (
        ("median_tps", f"median per-step tok/s per rank (rank 0), {span}"),
        ("wall_tps", f"wall-clock tok/s per rank, {span}"),
    ):
        print(f"\n== {title} ==")
        print(
            "round "
            + " ".join(f"{v:>11s}" for v in order)
            + "   tl/tt8  tl/tt1  tl_nodiag/tt8  tl_diag_pw/tt8"
        )
        table = {v: per_round(results, v, key) for v in order}
        for rnd in range(1, args.rounds + 1):
            vals = {v: table[v].get(rnd) for v in order}

            def ratio(a, b, vals=vals):
                return f"{vals[a] / vals[b]:.3f}" if vals.get(a) and vals.get(b) else "  -  "

            print(
                f"{rnd:5d} "
                + " ".join(f"{vals[v]:11.0f}" if vals[v] else f"{'-':>11s}" for v in order)
                + f"   {ratio('tl', 'tt8'):>6s}  {ratio('tl', 'tt1'):>6s}  {ratio('tl_nodiag', 'tt8'):>13s}"
                + f"  {ratio('tl_diag_pw', 'tt8'):>14s}"
            )
        meds = {v: _median(results, v, key) for v in order}
        print("median" + " ".join(f"{meds[v]:11.0f}" if meds[v] else f"{'-':>11s}" for v in order))
        if meds.get("tt8"):
            for v in order:
                if meds.get(v):
                    print(f"  {v:11s} / tt8 = {meds[v] / meds['tt8']:.3f}")
    print(
        f"\nresults: {out_dir / 'results.json'} (scripts/README.md's table: copy it to scripts/figures/bench_peer-cpu.json)"
    )
    return 0 if all(r["rc"] == 0 for r in results["runs"]) else 1


def main(argv: list[str] | None = None) -> int:
    return SCRIPT.run(run, argv)


if __name__ == "__main__":
    sys.exit(main())
