"""Golden loss curves (scripts/golden_losses.py, tests/golden/): fresh runs of the reference
cases, made inside the step-count worker's torchrun with the golden pins, equal the committed
curves bitwise on the torch version, machine and data they were made with; and the check sees a
deliberate change of numerics (the same global batch summed in another order)."""

from __future__ import annotations

import pytest
from helpers import load_script

golden = load_script("golden_losses")


@pytest.fixture(scope="module")
def runs(step_counts):
    got = step_counts["golden"]
    made = golden.load(next(iter(golden.CASES)))["identity"]
    if got["identity"]["data"] != made["data"]:
        pytest.skip(
            f"the built-in data differ from the golden runs' ({made} vs {got['identity']}): another Python"
        )
    return got


def test_every_case_has_a_golden_file_made_as_the_script_makes_it():
    for name, overrides in golden.CASES.items():
        record = golden.load(name)
        assert record["overrides"] == overrides and record["env"] == golden.ENV and record["why"].strip()
        assert [s["step"] for s in record["steps"]] == list(range(1, golden.STEPS + 1))
        assert all(s["loss"] is not None for s in record["steps"]), f"{name}: a step trained nothing"


def test_fresh_runs_equal_the_golden_curves(runs):
    assert set(runs["curves"]) == set(golden.CASES)
    for name, steps in runs["curves"].items():
        ok, line = golden.compare(name, golden.load(name), steps, runs["identity"])
        assert ok, line


def test_a_reordered_sum_fails_the_check_yet_is_the_same_curve_to_float_precision(runs):
    """Two microbatches of one sequence per rank instead of one of two: the exact loss path
    keeps the curve within rounding, but not bitwise, and the check must say so."""
    name, _ = golden.REORDERED
    fresh, gold = runs["reordered"][name], golden.load(name)
    ok, line = golden.compare(name, gold, fresh, runs["identity"])
    if runs["identity"] == gold["identity"]:
        assert not ok and f"{name}: step " in line, line
    assert any(f["loss"] != g["loss"] for f, g in zip(fresh, gold["steps"], strict=True))
    for f, g in zip(fresh, gold["steps"], strict=True):
        assert abs(f["loss"] - g["loss"]) <= golden.OTHER_TORCH_RTOL * g["loss"], (f, g)
