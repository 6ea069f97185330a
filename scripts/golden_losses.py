#!/usr/bin/env python3
"""Golden loss curves: the per-step loss, grad norm and learning rate of a few reference CPU runs,
committed in tests/golden/, so that a change which moves titanlite's numerics fails a test instead
of landing silently inside the tolerances of the exactness tests.

    ./scripts/golden_losses.py --check              fresh runs against the files
    ./scripts/golden_losses.py --write --why TEXT   regenerate the files
    ./scripts/golden_losses.py --check --pin MKL_CBWR=AUTO    what other kernels do (rounding)

The cases (CASES) are fp32 runs of 12 steps (past each config's warmup) on 4 CPU ranks (gloo),
in one torchrun, each a Trainer in turn: the quick-start config (debug_model.toml, built-in
data) under FSDP, DDP and HSDP 2x2, and debug_sft.toml with packing. Each file records the
identity it was made under (below) and the reason given to --write: a changed file in a diff is
then a decision with its reason, not an accident.

Pinned, because each can change the order of floating-point sums: OMP_NUM_THREADS=1 (threads
split matmuls and reductions; run_train.sh sets it from cores / ranks), ATEN_CPU_CAPABILITY=avx2
(PyTorch's vectorized kernels: AVX-512 ones add in another order) and MKL_CBWR=COMPATIBLE (MKL's
GEMMs and vector maths on its SSE2 branch, the one branch MKL runs on any x86-64 CPU, Intel or
not: the AVX2 branch it runs only on Intel CPUs, and silently picks its own elsewhere).

What decides the bits is read off the kernels: each file's identity holds the torch version, the
architecture, the built-in data's fingerprint and the hashes of titanlite.analysis.numerics'
reference ops run under the pins and the CPU's model. Where all of them match, the comparison
is bitwise; where torch, a kernel or the CPU model differs, within ROUNDING_RTOL, and the line
says which ("another torch", "another CPU: matmul, attention"): the reference ops can hash alike
on another CPU model while a whole run parts in the last bit. Data that differ (another
Python's stdlib) cannot be compared: the check says so.
Exit status: 0 equal, 1 a curve differs (the first step is named), 2 a run failed.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from titanlite.tools.venv import use_project_venv  # noqa: E402

use_project_venv()  # any python3 will do: without titanlite's dependencies it re-executes in .venv

from titanlite.errors import UserError  # noqa: E402
from titanlite.tools.cli import Script  # noqa: E402

GOLDEN = REPO / "tests" / "golden"
WORLD = 4
STEPS = 12
ENV = {"OMP_NUM_THREADS": "1", "ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE"}
BATCH = ["--training.global_batch_size", "8", "--training.local_batch_size", "2"]
PRETRAIN = ["--config", "train_configs/debug_model.toml", "--training.seq_len", "128", *BATCH]
CASES: dict[str, list[str]] = {
    "pretrain_fsdp": PRETRAIN,
    "pretrain_ddp": [
        *PRETRAIN,
        "--parallelism.dp_replicate",
        "4",
        "--training.local_batch_size",
        "1",
    ],
    "pretrain_hsdp": [*PRETRAIN, "--parallelism.dp_replicate", "2"],
    # seq 256, the config's own: shorter sequences leave most records without a target token
    "sft_packed_fsdp": [
        "--config",
        "train_configs/debug_sft.toml",
        "--data.packing",
        "true",
        *BATCH,
    ],
}
# A deliberate change of numerics the test runs beside the cases: pretrain_fsdp's global batch
# summed in another order (two microbatches of one sequence per rank instead of one of two).
# Exact to float precision, never bitwise: the golden check must see it.
REORDERED = ("pretrain_fsdp", ["--training.local_batch_size", "1"])
# Other kernels add the same sums in another order. Measured on an AMD EPYC (Zen 4), the largest
# relative difference of loss, grad norm or lr from the golden curves over the 12 steps of a case:
# MKL's Intel AVX2 branch, which the former pin MKL_CBWR=AVX2 chose on an Intel Xeon (run here
# with MKL's CPU-vendor check answered "Intel", which reproduced that Xeon's failing figures to
# the last bit) 1.2e-7; MKL_CBWR=AUTO 1.3e-7; PyTorch's AVX-512 kernels 1.2e-7, its scalar ones
# (ATEN_CPU_CAPABILITY=default) 1.4e-7; no pins at all 1.3e-7; the REORDERED batch 1.2e-7. Under
# COMPATIBLE the Intel branch and this CPU's give the same bits (bitwise, every case). 1e-5
# leaves 70x room and is compare_runs' fp32 tolerance; a change of the loss path's maths is
# orders larger (a normaliser off by one of a step's 1,024 tokens: 1e-3).
ROUNDING_RTOL = 1e-5
FIELDS = ("loss", "grad_norm", "lr")


def identity() -> dict:
    """What decides whether a fresh curve must equal the files bitwise (see the docstring)."""
    import torch

    from titanlite.analysis import numerics
    from titanlite.datasets.corpus import corpus_fingerprint

    return {
        "torch": torch.__version__,
        "machine": platform.machine(),
        "data": corpus_fingerprint(),
        "kernels": numerics.kernels(),
        "cpu": numerics.cpu_name(),
    }


def tolerance(made: dict, here: dict) -> tuple[float, str]:
    """(relative tolerance, how the line names it) for a curve made under `here` against files made
    under `made`: bitwise only where torch, architecture and every kernel hash agree."""
    from titanlite.analysis import numerics

    within = f"within {ROUNDING_RTOL:g}"
    if (made["torch"], made["machine"]) != (here["torch"], here["machine"]):
        return ROUNDING_RTOL, (
            f"{within} (another torch: the files {made['torch']} on {made['machine']}, "
            f"here {here['torch']} on {here['machine']})"
        )
    kinds = ", ".join(numerics.differing(made["kernels"], here["kernels"]))
    made_on = made["cpu"]
    if kinds and made_on != here["cpu"]:
        return ROUNDING_RTOL, (
            f"{within} (another CPU: its {kinds} kernels round differently; the files made on "
            f"{made_on}, here {here['cpu']})"
        )
    if kinds:
        return (
            ROUNDING_RTOL,
            f"{within} (other kernels on the files' CPU model, {made_on}: {kinds} round differently)",
        )
    if made_on != here["cpu"]:
        # the reference ops hash alike, yet a whole run can part in the last bit (an Intel
        # Xeon against the files' AMD EPYC: HSDP's grad norm 1.1e-7 off at step 12)
        return ROUNDING_RTOL, (
            f"{within} (another CPU, {here['cpu']}: its kernels hash as the files' {made_on}'s, "
            "but bits are held only on the CPU model the files were made on)"
        )
    return 0.0, "bitwise"


def run_cases(runs_dir: str, cases: dict[str, list[str]]) -> dict[str, list[dict]]:
    """Inside a torchrun of WORLD ranks: every case's per-step FIELDS (rank 0; {} elsewhere)."""
    from titanlite.analysis import harness

    def train(name: str, trainer) -> list[dict] | None:
        trainer.train()
        if not harness.is_first_rank():
            return None
        lines = (Path(runs_dir) / name / "metrics.jsonl").read_text().splitlines()
        return [{k: json.loads(line)[k] for k in ("step", *FIELDS)} for line in lines]

    quiet = [
        "--training.steps",
        str(STEPS),
        "--metrics.log_every",
        "1",
        "--metrics.enable_tensorboard",
        "false",
    ]
    argvs = (
        (name, [*o, *quiet, "--job.dump_folder", runs_dir, "--job.run_name", name])
        for name, o in cases.items()
    )
    curves = harness.trainers(argvs, train)
    return curves if harness.is_first_rank() else {}


def compare(name: str, golden: dict, fresh: list[dict], here: dict) -> tuple[bool, str]:
    """(equal enough, one line): the fresh curve, made under the identity `here`, against the
    golden file, as tolerance() says."""
    if golden["identity"]["data"] != here["data"]:
        return False, (
            f"{name}: the built-in data differ from the golden run's (another Python stdlib: "
            f"{golden['identity']['data']} vs {here['data']}); not comparable"
        )
    rtol, how = tolerance(golden["identity"], here)
    if len(fresh) != len(golden["steps"]):
        return False, f"{name}: {len(fresh)} steps, the golden curve has {len(golden['steps'])}"
    largest = 0.0
    for g, f in zip(golden["steps"], fresh, strict=True):
        for key in FIELDS:
            a, b = g[key], f[key]
            if a is None or b is None:  # a step without a valid token has no loss
                if a is b:
                    continue
                return False, f"{name}: step {g['step']} {key} {b!r} vs golden {a!r}"
            rel = abs(a - b) / max(abs(a), 1e-30)
            if abs(a - b) > rtol * abs(a) or (rtol == 0 and a != b):
                return (
                    False,
                    f"{name}: step {g['step']} {key} {b!r} vs golden {a!r} (relative {rel:.2g}; {how})",
                )
            largest = max(largest, rel)
    apart = f"; largest relative difference {largest:.2g}" if rtol else ""
    return True, f"{name}: {len(fresh)} steps equal, {how}{apart}"


def load(name: str) -> dict:
    return json.loads((GOLDEN / f"{name}.json").read_text())


def pins(changed: list[str]) -> dict[str, str]:
    """ENV with `changed` (KEY=VALUE each, KEY one of ENV's) applied, or one UserError."""
    env = dict(ENV)
    for item in changed:
        key, sep, value = item.partition("=")
        if not sep or key not in ENV or not value:
            raise UserError(f"--pin {item!r}: give KEY=VALUE with KEY one of {', '.join(ENV)}")
        env[key] = value
    return env


def launch(out: Path, runs: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """One torchrun of WORLD CPU ranks running every case, under the pins `env`."""
    from titanlite.analysis import harness

    argv = [__file__, "--worker", str(out), str(runs)]
    return harness.launch(WORLD, argv, {**env, "PYTHONPATH": str(REPO)})


SCRIPT = Script("golden_losses", __doc__)
SCRIPT.arg("--check", kind="switch", help="compare fresh runs with tests/golden/")
SCRIPT.arg("--write", kind="switch", help="regenerate tests/golden/ (needs --why)")
SCRIPT.arg("--why", kind="text", help="the reason for new golden curves, kept in each file")
SCRIPT.arg(
    "--pin",
    kind="text",
    action="append",
    help="with --check, KEY=VALUE: run under another pin (MKL_CBWR=AUTO: another CPU's GEMMs), as a "
    "measure of what other kernels do; may be given several times",
)
SCRIPT.arg(
    "--worker", kind="text", nargs=2, internal=True, help="OUT RUNS: one rank of the reference runs"
)


def run(args) -> int:
    if sum(bool(x) for x in (args.check, args.write, args.worker)) != 1:
        raise UserError("give one of --check or --write (with --why)")
    if args.worker:
        from titanlite.analysis import harness

        curves = run_cases(args.worker[1], CASES)
        if harness.is_first_rank():
            Path(args.worker[0]).write_text(json.dumps({"identity": identity(), "curves": curves}))
        harness.finish()
        return 0
    if args.write and not (args.why or "").strip():
        raise UserError("--write needs --why 'what changed the numerics, and why that is right'")
    if args.write and args.pin:
        raise UserError(
            "--pin is for --check: the golden files are made under the script's own pins"
        )
    env = pins(args.pin or [])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "curves.json"
        proc = launch(out, Path(tmp) / "runs", env)
        if proc.returncode != 0:
            print(proc.stdout[-3000:] + proc.stderr[-5000:], file=sys.stderr)
            raise UserError(
                f"the reference runs failed (exit {proc.returncode}); their output is above"
            )
        fresh = json.loads(out.read_text())
    if args.write:
        GOLDEN.mkdir(parents=True, exist_ok=True)
        for name, steps in fresh["curves"].items():
            record = {
                "case": name,
                "overrides": CASES[name],
                "world": WORLD,
                "steps_run": STEPS,
                "env": ENV,
            }
            record.update(identity=fresh["identity"], why=args.why.strip(), steps=steps)
            (GOLDEN / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
            print(f"wrote {GOLDEN / name}.json")
        return 0
    results = [
        compare(name, load(name), steps, fresh["identity"])
        for name, steps in fresh["curves"].items()
    ]
    for _, line in results:
        print(line)
    return 0 if all(ok for ok, _ in results) else 1


def main(argv: list[str] | None = None) -> int:
    return SCRIPT.run(run, argv)


if __name__ == "__main__":
    sys.exit(main())
