"""Two layouts' fingerprints of the same step compared (titanlite.components.fingerprints): the
gradient verdict (each parameter's reduced gradient keeps a defect that the step's token mean can
average away from the loss), and where two layouts part (scripts/invariance.py --localize).

Both layouts take the step from the same state (step 1: the same initial weights; later the
reference's checkpoint of the step before, resharded). The walk, in order:
  1. each module's forward output, in the reference's order (a module runs after those it reads,
     so the first one that parts is where a difference enters);
  2. the gradients reaching the modules' outputs, in backward's order (an auxiliary loss enters
     at the module whose output it reads);
  3. each parameter's reduced gradient (a difference in the reduction itself);
  4. the model's own output and the logged loss, last: when only they part, the loss is put
     together differently from agreeing parts.
Each sequence is compared by itself, relative to its scale."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from titanlite.components.fingerprints import FILE
from titanlite.errors import UserError
from titanlite.tools.records import read_json

ROOT = "(model)"
REDUCED = " reduced grad"  # a parameter's fingerprint key

# What a localisation run changes besides its layout and step, none of which changes the step's
# maths: no recomputation in backward (a checkpointed block's inner outputs are not in the graph),
# no compile (hooks see eager modules), no eval, no export, checkpoints inside the run folder.
RUN_FLAGS = (
    "--training.activation_checkpoint", "none",
    "--training.compile", "false",
    "--eval.every", "0",
    "--eval.at_end", "false",
    "--checkpoint.export_weights", "false",
    "--checkpoint.export_hf", "false",
    "--checkpoint.folder", "checkpoints",
    "--checkpoint.at_end", "false",
)  # fmt: skip


# What a localisation rerun fixes, in words (scripts/invariance.py --localize refuses an override
# of one its reruns would not hold, titanlite.analysis.settings).
RERUNS = "in --localize's reruns"
FIXES = {
    **{RUN_FLAGS[i][2:]: f"{RUN_FLAGS[i + 1]} {RERUNS}" for i in range(0, len(RUN_FLAGS), 2)},
    "checkpoint.every": f"the step before the parting one {RERUNS}",
    "checkpoint.load_step": f"the step before the parting one {RERUNS}",
    "debug.stop_after_step": f"the parting step {RERUNS}",
    "debug.fingerprint_step": f"the parting step {RERUNS}",
}
# Of those, the ones that could change a step's numbers: the localisation line names them where
# the reruns ran them otherwise than the config (the others say where files go and when to stop).
NAMED = ("training.activation_checkpoint", "training.compile")


def base_flags(step: int) -> list[str]:
    """The reference layout's run that writes the checkpoint of `step` - 1 (none at step 1)."""
    before = str(step - 1)
    return [*RUN_FLAGS, "--checkpoint.every", before, "--debug.stop_after_step", before]


def step_flags(step: int) -> list[str]:
    """Each layout's run of `step` with fingerprints (resuming the copied checkpoint after step 1)."""
    resume = ["--checkpoint.load_step", str(step - 1)] if step > 1 else []
    return [*RUN_FLAGS, *resume, "--checkpoint.every", "0", "--debug.fingerprint_step", str(step),
            "--debug.stop_after_step", str(step)]  # fmt: skip


def read(folder: Path) -> dict:
    """A localisation run's fingerprints."""
    return read_json(folder / FILE, f"the localisation run in {folder} did not reach its step")


def apart(a: list[float], b: list[float]) -> float:
    """How far two fingerprints (sum, sum of squares, sum of |x|) are, relative to their scale:
    the sum against the sum of |x| (which bounds it), the others against themselves."""
    scale = (max(a[2], b[2]), max(a[1], b[1]), max(a[2], b[2]))
    return max((abs(x - y) / s if s > 0 else 0.0) for x, y, s in zip(a, b, scale, strict=False))


@dataclass
class Divergence:
    where: str  # "<module> forward", "<module> grad", "<parameter> reduced grad", "loss"
    step: int
    what: str  # how far apart, and where in the tensor
    tol: float

    def line(self) -> str:
        return f"first divergence: {self.where} at step {self.step}: {self.what}, beyond tolerance {self.tol:.0e}; everything before it agrees"


def walk(record: dict) -> list[str]:
    """The reference's keys in the order the module doc gives."""
    order = record["order"]
    root = [k for k in order if k.startswith(ROOT) and k.endswith(" forward")]
    rest = [k for k in order if k not in root]
    forward = [k for k in rest if k.endswith(" forward")]
    grads = [k for k in rest if k.endswith(" grad") and not k.endswith(" reduced grad")]
    reduced = [k for k in rest if k.endswith(" reduced grad")]
    return forward + grads + reduced + root


def first_divergence(ref: dict, other: dict, tol: float) -> Divergence | None:
    """The first place, in walk order, where `other`'s fingerprints part from `ref`'s."""
    step = ref["step"]
    for key in walk(ref):
        mine, theirs = ref["records"][key], other["records"].get(key)
        if theirs is None:
            return Divergence(f"{key} (not run by the other layout)", step, "the whole tensor", tol)
        rows = sorted(set(mine) | set(theirs), key=int)
        both = mine.keys() & theirs.keys()
        gaps = {r: apart(mine[r], theirs[r]) if r in both else math.inf for r in rows}
        bad = {r: g for r, g in gaps.items() if not g <= tol}
        if bad:
            row = max(bad, key=bad.get)
            what = f"{len(bad)} of {len(rows)} sequences, the most {bad[row]:.2e} (sequence {row})"
            return Divergence(key, step, "the whole tensor" if row == "-1" else what, tol)
    a, b = ref["loss"], other["loss"]
    gap = abs(a - b) / max(abs(a), 1e-30)
    return (
        None if gap <= tol else Divergence("loss", step, f"the logged loss, {gap:.2e} apart", tol)
    )


@dataclass
class GradientCheck:
    """Each parameter's reduced gradient at one step of both runs against the gradient tolerance."""

    step: int
    worst: float  # the largest relative difference of a parameter's gradient fingerprint
    parameter: str  # where
    tol: float
    missing: list[str]  # parameters with a gradient in one run only

    @property
    def passed(self) -> bool:
        return not self.missing and self.worst <= self.tol

    def line(self) -> str:
        head = f"gradient at step {self.step}: "
        if self.missing:
            return f"FAIL {head}{len(self.missing)} parameter(s) have a gradient in one run only, first {self.missing[0]}"
        verdict = "PASS" if self.passed else "FAIL"
        sign = "<=" if self.passed else "beyond"
        return f"{verdict} {head}largest relative difference {self.worst:.3g} ({self.parameter}) {sign} {self.tol:g}"


def gradient_check(ref: dict, other: dict, tol: float) -> GradientCheck:
    """Two runs' fingerprints of the same step: every parameter's reduced gradient."""
    if ref["step"] != other["step"]:
        raise UserError(
            f"the runs' fingerprints are of steps {ref['step']} and {other['step']}; record the same step"
        )
    mine, theirs = (
        {k[: -len(REDUCED)]: v["-1"] for k, v in fp["records"].items() if k.endswith(REDUCED)}
        for fp in (ref, other)
    )
    missing = sorted(mine.keys() ^ theirs.keys())
    gaps = {name: apart(mine[name], theirs[name]) for name in mine.keys() & theirs.keys()}
    worst = max(gaps, key=lambda n: gaps[n] if not math.isnan(gaps[n]) else math.inf, default="")
    return GradientCheck(ref["step"], gaps.get(worst, 0.0), worst, tol, missing)
