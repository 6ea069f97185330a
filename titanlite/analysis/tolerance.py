"""How far apart two runs' losses may be and still be the same curve, per dtype, as a function of
the horizon k (updates since the first compared step). Set above the largest relative difference
between two pairs of layouts: dp 1 vs 4 of debug_model.toml (CPU), accumulation 1 vs 4 of
llama_1b (GPU). What those pairs measured, and the margins: scripts/README.md ("Invariance").
- fp32: flat 1e-5. Summation order alone differs, and the difference does not grow.
- bf16: a GPU's kernels tile each shape differently per layout, so the curves drift apart: u / 16
  per update (u = 2^-8), capped at 2e-2 (step 81), past which curves differ by more than rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Tolerance:
    """The largest relative loss difference still the same curve k updates after the first
    compared step: min(cap, first + per_step * k). A script's --rtol is checked at its door."""

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
    """The loosest tolerance of the runs' parameter dtypes (`param_dtype`): fp32's only when
    every run's is float32 (an unknown dtype counts as bf16)."""
    fp32 = all(r.param_dtype == "float32" for r in runs)
    return DEFAULT_TOLERANCE["float32" if fp32 else "bfloat16"]


# Each parameter's reduced gradient at the first compared step (same weights: only the step's
# rounding parts them). fp32: about 170 u, far above healthy layouts, far below planted defects;
# bf16: 16 u, as each layout is within 8 u of fp32 (tests/test_distributed.py). Check in fp32.
GRADIENT_TOLERANCE = {"float32": 1e-5, "bfloat16": 16 * 2.0**-8}


def gradient_tolerance(runs: list[Any]) -> float:
    """The loosest gradient tolerance of the runs' parameter dtypes (unknown counts as bf16)."""
    return max(GRADIENT_TOLERANCE.get(r.param_dtype, GRADIENT_TOLERANCE["bfloat16"]) for r in runs)
