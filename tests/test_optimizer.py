from __future__ import annotations

import math

import pytest

from titanlite.components.optimizer import lr_factor
from titanlite.config import parse_args


def _cfg(decay: str, warmup: int = 4, steps: int = 14, min_lr: float = 0.1):
    return parse_args(
        [
            "--lr_scheduler.decay_type",
            decay,
            "--lr_scheduler.warmup_steps",
            str(warmup),
            "--training.steps",
            str(steps),
            "--lr_scheduler.min_lr_factor",
            str(min_lr),
        ]
    )[0]


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant"])
def test_warmup_is_linear_up_to_the_peak(decay):
    cfg = _cfg(decay)
    assert [lr_factor(s, cfg) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]


def test_decays_reach_their_floor():
    cos, lin, const = _cfg("cosine"), _cfg("linear"), _cfg("constant")
    assert lr_factor(4, cos) == 1.0 and lr_factor(4, lin) == 1.0
    assert math.isclose(lr_factor(14, cos), 0.1) and math.isclose(lr_factor(14, lin), 0.1)
    assert math.isclose(lr_factor(9, lin), 0.1 + 0.9 * 0.5)
    assert math.isclose(lr_factor(9, cos), 0.1 + 0.9 * 0.5)
    assert lr_factor(6, cos) > lr_factor(6, lin) and lr_factor(12, cos) < lr_factor(12, lin)
    assert all(lr_factor(s, const) == 1.0 for s in range(4, 14))
