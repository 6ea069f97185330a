"""How far apart two runs' losses may be and still be the same curve: compare_runs' default
tolerance per dtype, as a function of the horizon k (updates since the first compared step).

Layouts differ by rounding alone. The tolerances are set above the largest relative loss
difference by step k of two pairs of layouts: dp 1 vs dp 4 of debug_model.toml (FSDP, 300
steps, scripts/invariance.py, CPU) and accumulation 1 vs 4 of llama_1b (30 steps,
scripts/gpu_check.sh --only accum, GPU); scripts/README.md ("Invariance") keeps the measurements
and each tolerance's margin.
- fp32: flat 1e-5. Summation order alone differs, and the difference does not grow.
- bf16: a GPU's kernels tile each shape differently per layout, so the curves drift apart. The
  tolerance grows by u / 16 per update (u = 2^-8): 7.3e-3 at step 30, capped at 2e-2 (step
  81): past that, curves further apart on the same batch differ by more than rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Tolerance:
    """The largest relative loss difference that still counts as the same curve, k updates
    after the first compared step: min(cap, first + per_step * k). Flat where per_step is 0.
    (A script's --rtol is checked at its front door.)"""

    first: float  # at the first compared step (a forward pass on the same weights)
    per_step: float = 0.0  # growth per update since then
    cap: float = math.inf  # the most it grows to

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
    tolerances = [DEFAULT_TOLERANCE.get(r.param_dtype, bf16) for r in runs]
    return max(tolerances, key=lambda t: t.at(1_000_000))


# The gradient verdict: each parameter's reduced gradient at the first compared step, where both
# layouts start from the same weights, so only the step's own rounding parts them (fingerprints
# compared relative to their scale, titanlite.analysis.localize.apart).
# - fp32: 1e-5, about 170 units of fp32 roundoff: far above what healthy layouts part by, far
#   below what the defects the tests plant move (scripts/README.md, "Invariance").
# - bf16: 16 u (u = 2^-8): each layout's bf16 gradient is within 8 u of the fp32 one
#   (tests/test_distributed.py, the bf16 cases). Small defects hide under it; check in fp32.
GRADIENT_TOLERANCE = {"float32": 1e-5, "bfloat16": 16 * 2.0**-8}


def gradient_tolerance(runs: list[Any]) -> float:
    """The loosest gradient tolerance of the runs' parameter dtypes (unknown counts as bf16)."""
    return max(GRADIENT_TOLERANCE.get(r.param_dtype, GRADIENT_TOLERANCE["bfloat16"]) for r in runs)
