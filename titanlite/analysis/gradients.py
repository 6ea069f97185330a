"""The gradient verdict of an invariance comparison: each parameter's reduced gradient at one step
of two runs, from their fingerprints (titanlite.components.fingerprints; scripts/invariance.py has
every run record its first step's). The step's token mean can average a defect away from the
loss; the gradient of the parameter the defect touches keeps it. The tolerance per dtype:
titanlite.analysis.tolerance.GRADIENT_TOLERANCE.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from titanlite.analysis.localize import apart
from titanlite.errors import UserError

REDUCED = " reduced grad"  # a parameter's fingerprint key (titanlite.components.fingerprints)


@dataclass
class GradientCheck:
    """Each parameter's reduced gradient at one step of both runs (their fingerprints: sum, sum
    of squares and sum of |x| of the whole gradient; titanlite.analysis.localize.apart), against
    the gradient tolerance. The loss averages a defect over the step's tokens; the gradient of
    the parameter it touches does not."""

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
