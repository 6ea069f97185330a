"""Every script's arguments: a value of the wrong kind, out of range, not finite, a path of the
wrong kind; each must be refused in one line naming the argument (exit 2), with nothing
written. And what the scripts read: run folders, damaged checkpoints, records cut short."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

from faults.fixtures import (
    data,
    shared_run,
    truncate,
)
from faults.harness import (
    HANG_S,
    Broke,
    Catalogue,
    case,
    expect,
    listing,
    unchanged,
)

RUNLESS = 60.0  # seconds a refused script may take; one still running after it was not refused


def script_refused(family: str, name: str, script: str, args, says: str, ci: bool = False) -> None:
    """`scripts/<script>.py ARGS` is refused in one line holding `says`, exit 2, and writes
    nothing in its work folder (`args(c, work)` gives the arguments; outputs go in `work`)."""

    @case(family, name, ci=ci)
    def _(c: Catalogue) -> None:
        work = c.dump(f"{script}-{name}")
        argv = args(c, work)
        before = listing(work)
        r = c.script(script, *argv, timeout=RUNLESS)
        expect(r, 2, says)
        unchanged(before, work)


def _run(c: Catalogue) -> str:
    return str(shared_run(c))


def _step(c: Catalogue, step: int = 4) -> str:
    return str(shared_run(c) / "checkpoints" / f"step-{step:08d}")


S = "scripts"
for _name, _args, _says in (
    ("compare_runs --invariance --rtol nan", lambda c, w: [_run(c), _run(c), "--invariance", "--rtol", "nan", "--out", str(w / "o")], "--rtol"),
    ("compare_runs --rtol -1", lambda c, w: [_run(c), _run(c), "--rtol", "-1", "--out", str(w / "o")], "--rtol"),
    ("compare_runs --rtol 0", lambda c, w: [_run(c), _run(c), "--rtol", "0", "--out", str(w / "o")], "--rtol"),
    ("compare_runs --invariance --steps 0", lambda c, w: [_run(c), _run(c), "--invariance", "--steps", "0", "--out", str(w / "o")], "--steps"),
    ("compare_runs --max-rows -3", lambda c, w: [_run(c), "--max-rows", "-3", "--out", str(w / "o")], "--max-rows"),
    ("generate.py --temperature nan", lambda c, w: [_run(c), "--prompt", "def", "--temperature", "nan"], "--temperature"),
    ("generate.py --max-new-tokens 10^15", lambda c, w: [_run(c), "--prompt", "def", "--max-new-tokens", "1" + "0" * 15], "--max-new-tokens"),
    ("generate.py --step -1", lambda c, w: [_run(c), "--prompt", "def", "--step", "-1"], "--step"),
    ("export_hf.py --max-shard-gb 0", lambda c, w: [_step(c), str(w / "hf"), "--max-shard-gb", "0"], "--max-shard-gb"),
    ("export_hf.py --max-shard-gb nan", lambda c, w: [_step(c), str(w / "hf"), "--max-shard-gb", "nan"], "--max-shard-gb"),
    ("inspect_step.py --step 0", lambda c, w: [_run(c), "--step", "0"], "--step"),
    ("inspect_step.py --rank -1", lambda c, w: [_run(c), "--step", "1", "--rank", "-1"], "--rank"),
    ("inspect_step.py --chars -5", lambda c, w: [_run(c), "--step", "1", "--chars", "-5"], "--chars"),
    ("trace_batch.py --dp 0", lambda c, w: ["--step", "1", "--dp", "0", "--rank", "0"], "--dp"),
    ("trace_batch.py --step 0", lambda c, w: ["--step", "0"], "--step"),
    ("prepare_data.py --shard-mb nan", lambda c, w: ["--tokenizer", "builtin", "--out", str(w / "p"), "--shard-mb", "nan", str(data(c) / "good.jsonl")], "--shard-mb"),
    ("prepare_data.py --builtin-vocab-size 0", lambda c, w: ["--tokenizer", "builtin", "--builtin-vocab-size", "0", "--out", str(w / "p"), str(data(c) / "good.jsonl")], "--builtin-vocab-size"),
    ("diagnose_scenarios.py --dp 0", lambda c, w: ["--dp", "0", "--out", str(w / "o")], "--dp"),
    ("diagnose_scenarios.py --onset -5", lambda c, w: ["--dp", "2", "--onset", "-5", "--out", str(w / "o")], "--onset"),
    ("bench_generate.py --rounds 0", lambda c, w: ["--rounds", "0"], "--rounds"),
    ("invariance.py --modes hsdp --replicas 0", lambda c, w: ["--config", "train_configs/debug_model.toml", "--dp", "2", "4", "--modes", "hsdp", "--replicas", "0", "--out", str(w / "o"), "--dry-run"], "--replicas"),
    ("invariance.py --prefix ../escaped", lambda c, w: ["--config", "train_configs/debug_model.toml", "--dp", "1", "2", "--prefix", "../escaped", "--out", str(w / "o"), "--steps", "1"], "--prefix"),
    ("loss_memory.py --budgets nan", lambda c, w: ["--budgets", "nan", "--out", str(w / "o.json")], "--budgets"),
    ("gpu_check.py --smoke --steps 0", lambda c, w: ["--smoke", "--steps", "0", "--out", str(w / "o")], "--steps"),
    ("bench_data.py --sizes-mb 0", lambda c, w: ["--sizes-mb", "0", "--out", str(w / "o.json")], "--sizes-mb"),
    ("bench.py --reps 0", lambda c, w: ["--reps", "0", "--out", str(w / "o.json")], "--reps"),
):  # fmt: skip
    script_refused(S, _name, _name.split(".py")[0].split(" ")[0], _args, _says)


def _file(w: Path) -> str:
    (w / "a-file").write_text("x")
    return str(w / "a-file")


for _name, _args, _says in (
    ("export_hf.py to a path that is a file", lambda c, w: [_step(c), _file(w)], "a-file"),
    ("prepare_data.py --out a file", lambda c, w: ["--tokenizer", "builtin", "--out", _file(w), str(data(c) / "good.jsonl")], "--out"),
    ("inspect_step.py on a file", lambda c, w: [_file(w), "--step", "1"], "a-file"),
):  # fmt: skip
    script_refused(S, _name, _name.split(".py")[0].split(" ")[0], _args, _says)


# the examples every such class was found by
script_refused(
    S,
    "invariance.py --dp 0 2 --dry-run",
    "invariance",
    lambda c, w: ["--config", "train_configs/debug_model.toml", "--dp", "0", "2", "--dry-run"],
    "--dp",
    ci=True,
)
script_refused(
    S,
    "compare_runs --out an existing file",
    "compare_runs",
    lambda c, w: [str(w), str(w), "--out", _file(w)],  # refused before any run folder is read
    "--out",
    ci=True,
)


# what the scripts read: damaged checkpoints, records cut short, run folders that are not
def _damaged_copy(c: Catalogue, name: str, damage) -> Path:
    """A copy of the shared run whose checkpoint of step 4 is damaged by `damage(step folder)`."""
    dump = c.dump(name)
    run = Path(shutil.copytree(shared_run(c), dump / "run"))
    damage(run / "checkpoints" / "step-00000004")
    return run


@case(S, "generate.py on a run whose newest checkpoint is damaged", ci=True)
def _(c: Catalogue) -> None:
    run = _damaged_copy(c, "gen-damaged", lambda s: truncate(s / "__0_0.distcp", 1000))
    before = listing(run)
    r = c.script("generate", str(run), "--prompt", "def", "--max-new-tokens", "4")
    expect(r, 0)
    if "step-00000004" not in r.err or "step-00000002" not in r.out + r.err:
        raise Broke(f"no line names the damaged step 4 and the fall back to step 2: {r.err[-300:]}")
    unchanged(before, run)


for _name, _damage, _which in (
    ("export_hf.py on a step whose .distcp is cut short", lambda s: truncate(s / "__0_0.distcp", 1000), "__0_0.distcp"),
    ("export_hf.py on a step whose state.json is garbage", lambda s: (s / "state.json").write_text("{not json"), "state.json"),
):  # fmt: skip

    @case(S, _name)
    def _(c: Catalogue, name=_name, damage=_damage, which=_which) -> None:
        run = _damaged_copy(c, name, damage)
        work = c.dump(name + "-out")
        before = listing(run)
        r = c.script("export_hf", str(run / "checkpoints" / "step-00000004"), str(work / "hf"))
        expect(r, 2, which)
        unchanged(before, run)
        unchanged({}, work)


@case(S, "generate.py --step 2 whose .metadata is deleted")
def _(c: Catalogue) -> None:
    run = _damaged_copy(c, "gen-step-2", lambda s: None)
    (run / "checkpoints" / "step-00000002" / ".metadata").unlink()
    r = c.script("generate", str(run), "--prompt", "def", "--step", "2", "--max-new-tokens", "4")
    expect(r, 2, ".metadata")


@case(S, "inspect_step.py with the last diagnostics record cut short")
def _(c: Catalogue) -> None:
    run = _damaged_copy(c, "inspect-cut", lambda s: None)
    diag = run / "diagnostics.jsonl"
    diag.write_text(diag.read_text() + '{"step": 5, "loss_std": 0.1')
    r = c.script("inspect_step", str(run), "--step", "1")
    expect(r, 0)


@case(S, "inspect_step.py --step 999 of a 4-step run")
def _(c: Catalogue) -> None:
    r = c.script("inspect_step", _run(c), "--step", "999", "--rank", "0")
    expect(r, 0)
    if "step 999 never ran" not in r.err or "metrics end at step 4" not in r.err:
        raise Broke(f"the step that never ran is not named: {r.err[-300:]}")


@case(S, "compare_runs on a run whose run.json is garbage")
def _(c: Catalogue) -> None:
    run = _damaged_copy(c, "compare-runjson", lambda s: None)
    (run / "run.json").write_text("{garbage")
    work = c.dump("compare-runjson-out")
    r = c.script("compare_runs", str(run), "--out", str(work / "o"))
    expect(r, 2, "run.json")
    unchanged({}, work)


@case(S, "compare_runs --rtol inf")
def _(c: Catalogue) -> None:
    """A tolerance under which every comparison passes is refused, not obeyed: --rtol inf."""
    work = c.dump("compare-inf")
    r = c.script("compare_runs", _run(c), _run(c), "--rtol", "inf", "--out", str(work / "o"))
    expect(r, 2, "--rtol")
    unchanged({}, work)


@case(S, "prepare_data.py stopped by SIGTERM, then run again")
def _(c: Catalogue) -> None:

    work = c.dump("prep-sigterm")
    big = work / "big.jsonl"
    rows = (data(c) / "good.jsonl").read_text()
    big.write_text(rows * 40)
    args = (
        "--tokenizer",
        "builtin",
        "--shard-mb",
        "0.05",
        "--workers",
        "1",
        "--out",
        str(work / "p"),
        str(big),
    )
    live = c.start_script("prepare_data", *args)
    live.wait_for(lambda: len(list((work / "p").glob("shard-*.json"))) >= 2, timeout=HANG_S)
    live.signal(signal.SIGTERM)
    expect(live.finish(), 143, "prepare_data")
    expect(c.script("prepare_data", *args), 0)
    ref = c.script("prepare_data", *args[:-3], "--out", str(work / "ref"), str(big))
    expect(ref, 0)
    resumed, whole = (
        json.loads((work / d / "meta.json").read_text())["shards"] for d in ("p", "ref")
    )
    if resumed != whole:
        raise Broke("the resumed preparation's shards differ from an uninterrupted one's")
