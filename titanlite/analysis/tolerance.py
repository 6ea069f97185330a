"""How far apart two runs' losses may be and still be the same curve: compare_runs' default
tolerance per dtype, as a function of the horizon k (updates since the first compared step).

Layouts differ by rounding alone. The tolerances are set above the largest relative loss
difference by step k of two pairs of layouts: dp 1 vs dp 4 of debug_model.toml (FSDP, 300
steps, scripts/invariance.py, CPU) and accumulation 1 vs 4 of llama_1b (30 steps,
scripts/gpu_check.sh --only accum, GPU). What those pairs measured, and each tolerance's margin
over it, is kept beside the scripts: scripts/README.md ("Invariance") and scripts/figures/.
- fp32: flat 1e-5. Summation order alone differs (the loss path is exact), and the difference
  does not grow with the step.
- bf16: the curves drift apart as training goes on. A GPU's kernels tile each shape
  differently, so every op of another layout rounds differently, where the CPU's per-row
  matmuls round the same in any layout. The tolerance grows by u / 16 per update (bf16's unit
  roundoff u = 2^-8): 7.3e-3 at step 30. It stops at 2e-2 (reached at step 81): past that, two
  curves more than 2e-2 apart on the same batch differ by more than rounding. Confirm it on a
  GPU with scripts/gpu_check.sh --only accum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from titanlite.errors import UserError


@dataclass(frozen=True)
class Tolerance:
    """The largest relative loss difference that still counts as the same curve, k updates
    after the first compared step: min(cap, first + per_step * k). Flat where per_step is 0."""

    first: float  # at the first compared step (a forward pass on the same weights)
    per_step: float = 0.0  # growth per update since then
    cap: float = math.inf  # the most it grows to

    def __post_init__(self) -> None:
        """A tolerance under which every comparison passes (inf, nan) or none can (<= 0) is no
        verdict: refused, whoever builds it (a script's --rtol is checked at its front door too)."""
        if not (math.isfinite(self.first) and self.first > 0):
            raise UserError(f"rtol is {self.first!r}; it must be a finite number > 0")
        if not (math.isfinite(self.per_step) and self.per_step >= 0) or not self.cap > 0:
            raise UserError(
                f"a tolerance growing by {self.per_step!r} per step up to {self.cap!r} is no verdict"
            )

    def at(self, k: int) -> float:
        return min(self.cap, self.first + self.per_step * k)

    def __str__(self) -> str:
        if not self.per_step:
            return f"{self.first:g}"
        return f"{self.first:.3g} + {self.per_step:.3g} per step (at most {self.cap:g})"


BF16_PER_STEP = 2.0**-8 / 16
DEFAULT_TOLERANCE = {
    "float32": Tolerance(1e-5),
    "bfloat16": Tolerance(BF16_PER_STEP, BF16_PER_STEP, 2e-2),
}


def default_tolerance(runs: list[Any]) -> Tolerance:
    """The loosest tolerance of the runs' parameter dtypes (`param_dtype`; unknown counts as bf16)."""
    bf16 = DEFAULT_TOLERANCE["bfloat16"]
    return max(
        (DEFAULT_TOLERANCE.get(r.param_dtype, bf16) for r in runs), key=lambda t: t.at(1_000_000)
    )


# The gradient verdict: each parameter's reduced gradient at the first compared step, where both
# layouts start from the same weights, so only the step's own rounding parts them. A gradient's
# fingerprint (sum, sum of squares, sum of |x|; titanlite.analysis.localize.apart) is compared
# relative to its scale.
# - fp32: 1e-5, about 170 units of fp32 roundoff (u = 2^-24): far above what healthy layouts part
#   by, and far below what the defects the tests plant move (a load-balancing loss by each
#   microbatch's own formula, noise seeded by the rank); scripts/README.md ("Invariance") has
#   the measurements and the margins.
# - bf16: 16 u (u = 2^-8): each layout's bf16 gradient is within 8 u of the fp32 one
#   (tests/test_distributed.py, the bf16 cases), so two layouts are within 16 u of each other.
#   Defects as small as the ones above hide under bf16's rounding; check them in fp32.
GRADIENT_TOLERANCE = {"float32": 1e-5, "bfloat16": 16 * 2.0**-8}


def gradient_tolerance(runs: list[Any]) -> float:
    """The loosest gradient tolerance of the runs' parameter dtypes (unknown counts as bf16)."""
    return max(GRADIENT_TOLERANCE.get(r.param_dtype, GRADIENT_TOLERANCE["bfloat16"]) for r in runs)
