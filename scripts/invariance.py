#!/usr/bin/env python3
"""Run one config at several layouts with the same global batch, then compare.

    ./scripts/invariance.py --config C --dp 8 16 [--modes fsdp ddp hsdp] [--steps N]
        [--microbatch largest|whole] [--rtol X] [--out DIR] [--dry-run] [--localize]
        [--section.key value ...]
    ./scripts/invariance.py --config C --layouts "dp=4" "dp=2,cp=2" [...]

One run per (layout, mode), launched one after another on this machine with
`NPROC=world ./run_train.sh` (CPU ranks, or GPUs when there are that many), everything but the
layout equal: global batch, seed, data and model come from the config and the overrides. A
layout is a data-parallel degree and any mesh axes beside it (--layouts, each "dp=N" then
",axis=degree" per axis: the kinds of titanlite.config.layout.AXIS_KINDS); its world is dp times
every axis's degree. --dp 8 16 is the short form of --layouts dp=8 dp=16, with the config's
parallelism.axes in every run. An
override of a setting the script fixes in a run (the steps, the layout, where runs go; with
--localize, what its reruns set) is refused in one line naming what sets it, unless every run
holds it (a local batch is a bound: each layout runs the largest up to it that carries B / dp);
the verdict line names the settings the runs ran at where they differ from the config's. Each
rank's share of the global batch, B / dp, is carried as local_batch_size x accumulation with the
largest local batch <= the config's that divides it (so a config with local_batch_size 2 at
global batch 16 runs dp=8 as 2 x 1 and dp=16 as 1 x 1): every layout then runs microbatches of
one size where it can, which is what a job at another dp would run. --microbatch whole runs
each rank's share as one microbatch, no accumulation (dp=8 vs dp=16 at B = 64: microbatches of
8 vs 4): the analysis of dp=8 vs dp=16 runs, where a defect that depends on what shares a
microbatch (batch statistics, a loss term by each microbatch's own formula) shows too. hsdp runs dp_replicate = --replicas
(default 2) x dp_shard = dp / replicas. Every run logs every step. Then scripts/compare_runs.py's
verdict over all runs against the first, with its table and plot in --out: the loss curve and
every loss term the model adds, step by step, and each parameter's reduced gradient at step 1
(every run records its first step's fingerprints), where the layouts start from the same
weights: a defect the step's token mean averages away still moves the gradient it touches.

--localize: when a layout parts from the first, its first parting step is compared module by
module (titanlite.analysis.localize says how): step 1 from the runs' own fingerprints; a later
step rerun at both layouts from the same state (the reference's checkpoint of the step before,
resharded), with per-module fingerprints. The first module whose forward output or gradient
differs is named. Runs already in --out are reused.

--dry-run prints the commands instead (to launch them elsewhere, e.g. dp=16 over two 8-GPU
nodes with your scheduler, then compare the run folders with scripts/compare_runs.py); with
--localize, on an --out that holds those runs, it compares them and prints the commands that
localize where they part.
Exit status: 0 all layouts give the same curve, 1 some part (named), 2 bad input or a run failed.
"""

from __future__ import annotations

import collections
import json
import math
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from titanlite.tools.venv import use_project_venv  # noqa: E402

use_project_venv()  # any python3 will do: without titanlite's dependencies it re-executes in .venv

from titanlite.analysis.compare import compare, report  # noqa: E402
from titanlite.analysis.localize import FIXES as localize_fixes  # noqa: E402
from titanlite.analysis.localize import (  # noqa: E402
    NAMED,
    base_flags,
    first_divergence,
    read,
    step_flags,
)
from titanlite.analysis.runs import load_run  # noqa: E402
from titanlite.analysis.settings import Fixes  # noqa: E402
from titanlite.analysis.tolerance import default_tolerance  # noqa: E402
from titanlite.components.checkpoint.resume import flat_config  # noqa: E402
from titanlite.components.run.torchrun import MAX_RANKS  # noqa: E402
from titanlite.config import load_config, parse_args  # noqa: E402
from titanlite.config.command_line import (  # noqa: E402
    absolute,
    resolve_paths,
)
from titanlite.config.fields import whole_number  # noqa: E402
from titanlite.config.layout import (  # noqa: E402
    extra_axes,
    fitting_local_batch,
    mesh_text,
    rank_share,
)
from titanlite.errors import UserError  # noqa: E402
from titanlite.tools.cli import Script  # noqa: E402
from titanlite.tools.process import stop_child  # noqa: E402


def layout_shapes(args) -> list[tuple[int, tuple[tuple[str, int], ...] | None]]:
    """Each layout asked as (dp, its axes in mesh order); axes None: the config's (--dp)."""
    if (args.dp is None) == (args.layouts is None):
        raise UserError(
            'give the layouts to compare once: --layouts "dp=4" "dp=2,cp=2" (dp and any mesh axes), '
            "or --dp 8 16 (data parallelism alone)"
        )
    if args.dp is not None:
        return [(dp, None) for dp in args.dp]
    shapes = []
    for text in args.layouts:
        parts = [part.strip().partition("=") for part in text.split(",")]
        dp = [degree for name, _, degree in parts if name.strip() == "dp"]
        if len(dp) != 1 or not whole_number(dp[0]) or not 1 <= int(dp[0]) <= MAX_RANKS:
            raise UserError(
                f'--layouts {text!r} needs one dp=N (N from 1 to {MAX_RANKS}), then any axes: "dp=2,cp=2"'
            )
        try:
            axes = extra_axes(["".join(part) for part in parts if part[0].strip() != "dp"])
        except UserError as e:
            raise UserError(f"--layouts {text!r}: {e}") from None
        shapes.append((int(dp[0]), axes))
    return shapes


def plan(
    cfg,
    dp: int,
    mode: str,
    replicas: int,
    microbatch: str = "largest",
    axes: tuple[tuple[str, int], ...] | None = None,
) -> dict:
    """The layout flags of one run: mesh degrees, its axes (None: the config's) and a local
    batch that carries B / dp (the largest that fits the config's, or all of it: --microbatch)."""
    local = fitting_local_batch(cfg, dp)
    if microbatch == "whole":
        local = rank_share(cfg, dp)
    if mode == "hsdp" and (dp % replicas or dp // replicas < 2 or replicas < 2):
        raise UserError(
            f"hsdp at dp={dp} needs --replicas R with R >= 2 dividing it into shards of >= 2"
        )
    rep, shard = {"fsdp": (1, dp), "ddp": (dp, 1), "hsdp": (replicas, dp // replicas)}[mode]
    axes = extra_axes(cfg.parallelism.axes) if axes is None else axes
    return {
        "mode": mode,
        "dp_replicate": rep,
        "dp_shard": shard,
        "local_batch_size": local,
        "accum": rank_share(cfg, dp) // local,
        "axes": axes,
        # ranks per data-parallel rank: every mesh axis beyond data parallelism
        "split": math.prod(d for _, d in axes),
    }


def run_name(prefix: str, p: dict) -> str:
    axes = "".join(f"-{n}{d}" for n, d in p["axes"])
    return (
        f"{prefix}{p['mode']}-{p['dp_replicate']}x{p['dp_shard']}{axes}-lb{p['local_batch_size']}"
    )


STEP_LINE = re.compile(r"step +(\d+)/(\d+) \|.*\| eta ([\d:]+)")
PROGRESS_S = 10.0  # at most one progress line per this many seconds, and the last step's


STARTING_S = 20.0  # until the first step line, a line per this many seconds saying the ranks start


def lines_or_ticks(stream, every: float):
    """The lines of `stream` as they come, and None after each `every` seconds without one (a
    reader thread: the caller speaks while the run is silent)."""
    got: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in stream:
            got.put(line)
        got.put(None)

    threading.Thread(target=pump, daemon=True).start()
    while True:
        try:
            line = got.get(timeout=every)
        except queue.Empty:
            yield None
            continue
        if line is None:
            return
        yield line


def run_with_progress(
    cmd: list[str], env: dict[str, str], name: str, world: int = 1
) -> tuple[int, list[str]]:
    """Run one layout, printing its progress (step, elapsed, the run's own ETA) as it goes, and
    while its `world` ranks start (before the first step, which takes a while on a loaded
    machine); returns the exit code and the output's last lines (for a failure's report)."""
    start, shown, said, stepped = time.monotonic(), -PROGRESS_S, 0.0, False
    tail: collections.deque[str] = collections.deque(maxlen=15)
    # a session of its own: a stop of this script reaches the run once, passed on from here
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        # a tick at least every STARTING_S; the run's own lines (kept for a failure's report)
        # do not count as said: the user sees only this script's lines
        for line in lines_or_ticks(proc.stdout, STARTING_S / 4):
            now = time.monotonic() - start
            m = STEP_LINE.search(line) if line is not None else None
            stepped = stepped or m is not None  # the first step line is shown (below), not this
            if not stepped and now - said >= STARTING_S:
                print(
                    f"  [{name}] {world} rank(s) starting (importing torch, building the model, "
                    f"reading the data), {now:.0f}s",
                    flush=True,
                )
                said = now
            if line is None:
                continue
            tail.append(line.rstrip())
            if m and (now - shown >= PROGRESS_S or m[1] == m[2]):
                print(f"  [{name}] step {m[1]}/{m[2]}, {now:.0f}s, eta {m[3]}", flush=True)
                shown = now
    except BaseException as e:  # the run checkpoints and stops, then this script does
        stop_child(proc, getattr(e, "signum", signal.SIGINT))
        raise
    return proc.wait(), list(tail)


SCRIPT = Script(
    "invariance",
    __doc__,
    overrides="every run",
    stop_hint="the runs already finished are kept in --out; the one stopped checkpointed as its run_train.sh says",
)
SCRIPT.arg("--config", kind="file", required=True, help="the config every layout runs")
SCRIPT.arg(
    "--dp",
    kind="int",
    nargs="+",
    at_least=1,
    at_most=MAX_RANKS,
    help="data-parallel degrees, e.g. 8 16 (--layouts' short form: the config's axes in every run)",
)
SCRIPT.arg(
    "--layouts",
    kind="text",
    nargs="+",
    help='layouts, each dp=N and any mesh axes, e.g. "dp=4" "dp=2,cp=2"',
)
SCRIPT.arg(
    "--modes",
    kind="choice",
    nargs="+",
    choices=("fsdp", "ddp", "hsdp"),
    default=["fsdp"],
    help="data-parallel modes",
)
SCRIPT.arg(
    "--replicas",
    kind="int",
    default=2,
    at_least=2,
    at_most=MAX_RANKS,
    help="dp_replicate of the hsdp runs",
)
SCRIPT.arg(
    "--microbatch",
    kind="choice",
    choices=("largest", "whole"),
    default="largest",
    help="each rank's microbatch: the largest <= the config's local batch that carries B / dp, or all of B / dp at once (no accumulation)",
)
SCRIPT.arg("--steps", kind="int", default=30, at_least=1, at_most=10**9, help="steps of every run")
SCRIPT.arg(
    "--rtol",
    kind="float",
    above=0.0,
    at_most=1.0,
    help="flat verdict tolerance (default: 1e-5 fp32; bf16 grows with the step)",
)
SCRIPT.arg("--out", kind="out_folder", help="folder for the runs and the comparison")
SCRIPT.arg("--prefix", kind="name", default="", help="run-name prefix")
SCRIPT.arg("--dry-run", kind="switch", help="print the launch commands only")
SCRIPT.arg(
    "--localize",
    kind="switch",
    help="when layouts part, rerun the first parting step of both from the same state and name the first module where they differ",
)


# Every run records the fingerprints of its first step, where all layouts start from the same
# weights: the gradient verdict compares each parameter's reduced gradient there.
FIRST_STEP = ["--debug.fingerprint_step", "1"]


# The keys this script sets in its runs, and what sets them instead of an override: an override
# every run holds is honoured, any other refused in one line (titanlite.analysis.settings).
FIXES = Fixes(
    "invariance",
    {
        "training.steps": "set by --steps",
        "metrics.log_every": "1: every run logs every step",
        "parallelism.mode": "set by --modes",
        "parallelism.dp_replicate": "set by --dp or --layouts, --modes and --replicas",
        "parallelism.dp_shard": "set by --dp or --layouts, --modes and --replicas",
        "parallelism.axes": "set by --layouts",
        "training.local_batch_size": "each layout's: the largest at most the one asked that carries "
        "B / dp, or all of B / dp with --microbatch whole",
        "job.dump_folder": "set by --out",
        "job.run_name": "set by --prefix and the layout",
        "debug.fingerprint_step": "1 in every run, and the step --localize reruns",
    },
    always={"rehearsal.world": "0: every layout trains; a rehearsal logs no curve to compare"},
    at_most=frozenset({"training.local_batch_size"}),
    # the layout's keys are named by each run's line of the table (A = ...); the rest say where
    # files go and what is logged
    unnamed=frozenset(
        {"metrics.log_every", "job.dump_folder", "job.run_name", "debug.fingerprint_step"}
        | {"parallelism.mode", "parallelism.dp_replicate", "parallelism.dp_shard"}
        | {"parallelism.axes"}
        | {"training.local_batch_size"}
    ),
)
# --localize's reruns fix more (titanlite.analysis.localize); the verdict's line names those that
# could change a step's numbers
LOCALIZE = Fixes(
    "invariance --localize",
    {**FIXES.keys, **localize_fixes},
    always=FIXES.always,
    at_most=FIXES.at_most,
    unnamed=(frozenset(FIXES.keys) | frozenset(localize_fixes)) - frozenset(NAMED),
)


def run_args(args, p: dict, out: Path, name: str, extra: list[str] = ()) -> list[str]:
    """run_train.sh's arguments for one run of layout `p` into out/name."""
    cmd = ["--config", str(args.config), *args.overrides]
    cmd += ["--training.steps", str(args.steps), "--metrics.log_every", "1"]
    cmd += ["--parallelism.mode", p["mode"], "--parallelism.dp_replicate", str(p["dp_replicate"])]
    cmd += [
        "--parallelism.dp_shard",
        str(p["dp_shard"]),
        "--parallelism.axes",
        json.dumps([f"{n}={d}" for n, d in p["axes"]]),
        "--training.local_batch_size",
        str(p["local_batch_size"]),
    ]
    return [*cmd, "--job.dump_folder", str(out), "--job.run_name", name, *(extra or FIRST_STEP)]


def planned(args, plans: list[dict], names: list[str], out: Path) -> list[list[str]]:
    """run_train.sh's arguments of every run this command may make: one per layout and, with
    --localize, the reruns of a parting step (the step is known once the runs are compared: its
    flags set the same keys at any step after the first)."""
    runs = [run_args(args, p, out, n) for p, n in zip(plans, names, strict=True)]
    if args.localize:
        folder = out / "localize-step2"
        runs.append(run_args(args, plans[0], folder, "base", base_flags(2)))
        runs += [
            run_args(args, p, folder, n, step_flags(2)) for p, n in zip(plans, names, strict=True)
        ]
    return runs


def check_settings(args, plans: list[dict], names: list[str], out: Path) -> str:
    """Every override honoured in every run (planned's), else one line naming those that are not
    and what sets them, and each layout's run valid, before any run starts; returns what the layouts' runs ran at where it
    differs from the config (the verdict line's)."""
    from titanlite.validation import validate

    asked = parse_args(["--config", str(args.config), *args.overrides])[0]
    runs = [parse_args(r)[0] for r in planned(args, plans, names, out)]
    (LOCALIZE if args.localize else FIXES).check(args.overrides, asked, runs)
    for cfg, p in zip(runs, plans, strict=False):  # each layout's run, before the first starts
        validate(cfg, p["dp_replicate"] * p["dp_shard"] * p["split"])
    return FIXES.ran_at(asked, runs[: len(plans)])


def check_reused(args, p: dict, out: Path, name: str) -> None:
    """A run --localize reuses ran what this command asks of it, key by key; else one line
    naming the keys that differ (a verdict on other runs' settings is no verdict)."""
    asked, ran = (
        parse_args(run_args(args, p, out, name))[0],
        load_config(str(out / name / "config.toml")),
    )
    for cfg in (
        asked,
        ran,
    ):  # a path typed relative, recorded absolute: compared as the files they name
        resolve_paths(cfg, absolute)
    asked, ran = flat_config(asked), flat_config(ran)
    differ = [f"{k} {ran[k]!r} (asked {v!r})" for k, v in asked.items() if k in ran and ran[k] != v]
    if differ:
        raise UserError(
            f"--localize reuses the runs in {out}, but {name} ran with {'; '.join(differ[:4])}"
            f"{' ...' if len(differ) > 4 else ''}; pass another --out to run them as asked"
        )


def launch(args, p: dict, out: Path, name: str, extra: list[str] = ()) -> None:
    """One run of layout `p` into out/name (--dry-run: print its command)."""
    cmd = [str(REPO / "run_train.sh"), *run_args(args, p, out, name, extra)]
    world = p["dp_replicate"] * p["dp_shard"] * p["split"]
    if args.dry_run:
        print(f"NPROC={world} " + shlex.join(cmd), flush=True)
        return
    mesh = mesh_text(p["mode"], p["dp_replicate"], p["dp_shard"], dict(p["axes"]))
    layout = f"{mesh}, local batch {p['local_batch_size']} x accum {p['accum']}"
    print(f"[{name}] {layout}: starting {world} rank(s), run folder {out / name}", flush=True)
    code, tail = run_with_progress(cmd, {**os.environ, "NPROC": str(world)}, name, world)
    if code != 0:
        raise UserError(
            f"run {name} failed (exit {code}): {tail[-1] if tail else 'it printed nothing'}; its log: {out / name / 'logs'}"
        )


def localize(args, plans: list[dict], names: list[str], cmp, out: Path) -> str:
    """Rerun the first step where `cmp`'s layouts part, both from the same state, with per-module
    fingerprints (titanlite.analysis.localize); returns the first divergence's line."""
    step = cmp.first_bad_step
    other = names.index(cmp.other.name)
    # a gradient that parted is judged at the gradient's tolerance, a curve at the loss's
    gradient = cmp.gradient is not None and not cmp.gradient.passed and cmp.gradient.step == step
    tol = cmp.gradient.tol if gradient else cmp.rtol.at(step - cmp.rows[0].step)
    if cmp.ref.fingerprints is not None and cmp.ref.fingerprints["step"] == step:
        # the runs recorded this step already (their first), from the same initial weights
        print(
            f"localizing step {step}: {names[0]} against {names[other]}, from their own fingerprints",
            flush=True,
        )
        found = first_divergence(cmp.ref.fingerprints, cmp.other.fingerprints, tol)
        where = f"fingerprints: {out / names[0]} and {out / names[other]}"
    else:
        folder = out / f"localize-step{step}"
        if folder.exists():
            raise UserError(
                f"{folder} already exists (an earlier localisation); remove it or pass another --out"
            )
        print(
            f"localizing step {step}: {names[0]} against {names[other]}, from the same state",
            flush=True,
        )
        # the reference's state after the step before, copied into each layout's run
        launch(args, plans[0], folder, "base", base_flags(step))
        saved = f"checkpoints/step-{step - 1:08d}"
        for name in (names[0], names[other]):
            if args.dry_run:
                print(shlex.join(["mkdir", "-p", str((folder / name / saved).parent)]))
                print(
                    shlex.join(
                        ["cp", "-r", str(folder / "base" / saved), str(folder / name / saved)]
                    )
                )
            else:
                shutil.copytree(folder / "base" / saved, folder / name / saved)
        for i in (0, other):
            launch(args, plans[i], folder, names[i], step_flags(step))
        if args.dry_run:
            return f"the commands above localize step {step}; compare their fingerprints with --localize once they ran"
        found = first_divergence(*(read(folder / names[i]) for i in (0, other)), tol)
        asked = parse_args(["--config", str(args.config), *args.overrides])[0]
        reruns = [run_args(args, plans[i], folder, names[i], step_flags(step)) for i in (0, other)]
        ran_at = LOCALIZE.ran_at(asked, [parse_args(r)[0] for r in reruns])
        where = f"fingerprints: {folder}" + (f"; the reruns {ran_at}" if ran_at else "")
    if found is None:
        return f"no divergence at step {step} from the same state: the runs part through the state they carry"
    return found.line() + f" ({where})"


def layouts(args) -> tuple[Path, list[dict], list[str], str]:
    """Everything decided before a run starts: the output folder, each layout's plan and run
    name, every override honoured by every run or refused (check_settings), and what the runs
    ran at where it differs from the config, for the verdict line."""
    cfg, _ = parse_args(
        ["--config", str(args.config), *args.overrides, "--training.steps", str(args.steps)]
    )
    out = (
        args.out
        or REPO / "outputs" / f"invariance-{Path(args.config).stem}-{datetime.now():%Y%m%d-%H%M%S}"
    )
    plans = [
        plan(cfg, dp, mode, args.replicas, args.microbatch, axes)
        for dp, axes in layout_shapes(args)
        for mode in args.modes
    ]
    if len(plans) < 2:
        raise UserError(
            "one layout has nothing to compare with; give two or more --layouts, --dp degrees or --modes"
        )
    names = [run_name(args.prefix, p) for p in plans]
    if len(set(names)) < len(names):
        raise UserError(
            "two of the requested layouts are the same run; list each layout and mode once"
        )
    return out, plans, names, check_settings(args, plans, names, out)


def run(args) -> int:
    out, plans, names, ran_at = layouts(args)
    done = [(out / n / "metrics.jsonl").exists() for n in names]
    reuse = args.localize and all(done)
    if not args.dry_run and any(done) and not reuse:
        raise UserError(f"{out} already holds these runs; pass another --out")
    if reuse:
        for p, name in zip(plans, names, strict=True):
            check_reused(args, p, out, name)
        print(f"the runs in {out} are compared again (--localize)", flush=True)
    for p, name in zip(plans, names, strict=True):
        if not reuse:
            launch(args, p, out, name)
    if args.dry_run and not reuse:
        if args.localize:  # the step to rerun is known once the runs are compared
            print(
                f"# --localize: once these runs are done, the same command prints the commands that localize where they part, from {out}"
            )
        return 0
    runs = [load_run(out / n) for n in names]
    rtol = args.rtol if args.rtol is not None else default_tolerance(runs)
    comparisons = [compare(runs[0], other, rtol) for other in runs[1:]]
    print(report(comparisons, out / "compare"))
    passed = all(c.passed for c in comparisons)
    settings = f", {ran_at}" if ran_at else ""
    print(
        ("PASS: " if passed else "FAIL: ")
        + f"{len(runs)} layouts, rtol {comparisons[0].rtol}{settings}"
    )
    if passed:
        return 0
    first = next(c for c in comparisons if not c.passed)
    if args.localize:
        print(localize(args, plans, names, first, out))
    else:
        print(
            f"to find where they part, add --localize: step {first.first_bad_step} of {first.ref.name} and "
            f"{first.other.name} is compared module by module from the same state (the runs in --out are reused)"
        )
    return 1


def main(argv: list[str] | None = None) -> int:
    return SCRIPT.run(run, argv)


if __name__ == "__main__":
    sys.exit(main())
