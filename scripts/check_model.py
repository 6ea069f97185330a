#!/usr/bin/env python3
"""Check that a registered model trains exactly under titanlite, in one command.

    ./scripts/check_model.py --model.name NAME [--model.import_module MODULE]
                             [--model.flavor FLAVOR] [--worlds 1 2 4] [--section.key value ...]

For each world size, one torchrun of CPU ranks (gloo) runs every case inside one process group
(titanlite/analysis/check_cases.py, run by titanlite/analysis/model_check.py): FSDP, DDP and
HSDP at gradient accumulation 1 and 2 on a batch whose sequences hold very unequal numbers of
valid labels, and packed documents with the loss in chunks where the model takes positions and
labels. Each case's reduced gradient, logged
loss and every loss term the model adds (a line per term) are compared with one process's on
the whole batch, through the model's own loss path (packed: every document run on its own), and
the initial weights with one process's. With --hf DIR, the model read from that Hugging Face
folder through its adapter is compared with transformers' AutoModelForCausalLM of the folder in
fp32 (logits, summed loss, every gradient, by the names transformers saves: its experts fused in
memory are one tensor each on disk), and its export must give back the folder's tensors bitwise.
One verdict line per check; the last names the settings the cases ran at where they differ from
the config's. An override of a setting the cases fix (the tiny batch, each case's layout, fp32 on
CPU; data, optimizer and the other sections no case reads) is refused in one line naming what
the cases run instead, and the --hf folder is read before any rank starts.

model.import_module is imported in every rank as Python finds it: on PYTHONPATH, to which this
script adds the current directory. Exit status: 0 every check passed, 1 one failed (named),
2 bad input or a rank failed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from titanlite.tools.venv import use_project_venv  # noqa: E402

use_project_venv()  # any python3 will do: without titanlite's dependencies it re-executes in .venv

from titanlite.analysis import harness  # noqa: E402
from titanlite.analysis.check_cases import (  # noqa: E402
    FIXES,
    GLOBAL_BATCH,
    check_config,
    hf_config,
    plan,
)
from titanlite.analysis.model_check import hf_verdicts, verdicts  # noqa: E402
from titanlite.config import parse_args  # noqa: E402
from titanlite.errors import UserError  # noqa: E402
from titanlite.models.registry import build_meta_model  # noqa: E402
from titanlite.tools.cli import Script  # noqa: E402

SCRIPT = Script("check_model", __doc__, overrides="every rank's model config")
SCRIPT.arg(
    "--hf",
    kind="folder",
    help="a Hugging Face folder the model's adapter reads: also compare with transformers (needs it installed)",
)
SCRIPT.arg(
    "--worlds",
    kind="int",
    nargs="+",
    default=[1, 2, 4],
    at_least=1,
    at_most=GLOBAL_BATCH // 2,
    help="world sizes, one torchrun each",
)


def prepare(args) -> str:
    """Everything that needs no rank, checked before one starts: the model named and built, the
    --hf folder holding that model's family (and transformers installed to compare with), each
    override honoured by every case or refused. Returns what the cases ran at, in words, where it
    differs from the config's (the verdict line's)."""
    overrides = args.overrides
    if "--model.name" not in overrides and not any(
        o.startswith("--model.name=") for o in overrides
    ):
        raise UserError(
            "name the model to check: --model.name NAME (and --model.import_module for a fork's)"
        )
    FIXES.check_always(overrides)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    meta = build_meta_model(check_config(overrides), 0)  # a config error: one line, not in W ranks
    if args.hf:
        if importlib.util.find_spec("transformers") is None:
            raise UserError(
                "--hf compares with transformers, which is not installed: pip install transformers"
            )
        build_meta_model(hf_config(overrides, args.hf), 0)  # the folder holds this model's family
    asked = parse_args(overrides)[0]
    runs = plan(overrides, args.worlds, args.hf, meta)
    FIXES.check(overrides, asked, runs)
    return FIXES.ran_at(asked, runs)


def body(args) -> int:
    ran_at = prepare(args)
    overrides = args.overrides
    pythonpath = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.worlds:
            out = Path(tmp) / f"world{world}.json"
            argv = ["-m", "titanlite.analysis.model_check", str(out), *overrides]
            began = time.monotonic()

            def say(seconds: float, w: int = world) -> None:
                print(
                    f"check_model: {w} rank(s) still running ({seconds:.0f}s)",
                    file=sys.stderr,
                    flush=True,
                )

            proc = harness.launch(world, argv, {"PYTHONPATH": pythonpath}, say, cwd=os.getcwd())
            harness.check(proc, f"the check at {world} rank(s)")
            results.append(json.loads(out.read_text()))
            print(
                f"check_model: {world} rank(s) done in {time.monotonic() - began:.0f}s",
                file=sys.stderr,
                flush=True,
            )
    checks = verdicts(results) + (hf_verdicts(overrides, args.hf) if args.hf else [])
    for what, ok, detail in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {what}: {detail}")
    failed = [what for what, ok, _ in checks if not ok]
    # one rank splits nothing: the loss path is checked, data parallelism is not
    alone = " at 1 rank only, which splits no batch: add --worlds 2 4 to check data parallelism" * (
        max(args.worlds) == 1
    )
    settings = f" ({ran_at})" if ran_at else ""
    print(
        f"{'FAIL' if failed else 'PASS'}: {len(checks) - len(failed)} of {len(checks)} checks passed"
        f"{settings}{alone}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(SCRIPT.run(body))
