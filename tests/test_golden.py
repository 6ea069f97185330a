"""Golden loss curves (scripts/golden_losses.py, tests/golden/): fresh runs of the reference
cases, made inside the step-count worker's torchrun with the golden pins, equal the committed
curves bitwise where the identity that decides the bits (torch, machine, data and the kernels'
hashes, titanlite.analysis.numerics) matches the files', and within the rounding tolerance where
it does not, the line saying which; the check sees a deliberate change of numerics (the same
global batch summed in another order) on the CPU that made the files, and a changed normaliser
on any."""

from __future__ import annotations

import itertools

import pytest
from helpers import load_script

from titanlite.analysis import numerics

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
        assert (
            record["overrides"] == overrides
            and record["env"] == golden.ENV
            and record["why"].strip()
        )
        assert [s["step"] for s in record["steps"]] == list(range(1, golden.STEPS + 1))
        assert all(s["loss"] is not None for s in record["steps"]), (
            f"{name}: a step trained nothing"
        )
        assert set(record["identity"]["kernels"]) == set(numerics.KINDS), name


def test_fresh_runs_equal_the_golden_curves(runs):
    assert set(runs["curves"]) == set(golden.CASES)
    for name, steps in runs["curves"].items():
        gold = golden.load(name)
        ok, line = golden.compare(name, gold, steps, runs["identity"])
        assert ok, line
        rtol, how = golden.tolerance(gold["identity"], runs["identity"])
        # bitwise where the kernels are the files' (on their CPU model or, naming it, another)
        if rtol == 0:
            assert how.startswith("bitwise") and line.endswith(f"equal, {how}"), line
        else:
            assert f"equal, {how}; largest relative difference " in line, line


def test_a_reordered_sum_fails_the_check_yet_is_the_same_curve_to_float_precision(runs):
    """Two microbatches of one sequence per rank instead of one of two: the exact loss path
    keeps the curve within rounding, but not bitwise. Where the kernels are the files' the check
    fails on it; under other kernels it cannot tell it from their rounding, and passes."""
    name, _ = golden.REORDERED
    fresh, gold = runs["reordered"][name], golden.load(name)
    assert any(f["loss"] != g["loss"] for f, g in zip(fresh, gold["steps"], strict=True))
    rtol, how = golden.tolerance(gold["identity"], runs["identity"])
    if rtol == 0:
        ok, line = golden.compare(name, gold, fresh, runs["identity"])
        assert not ok and f"{name}: step " in line and line.endswith(f"; {how})"), line
    kernels = {**runs["identity"]["kernels"], "matmul": "0" * 12}
    elsewhere = {**runs["identity"], "cpu": gold["identity"]["cpu"], "kernels": kernels}
    ok, line = golden.compare(name, gold, fresh, elsewhere)
    assert ok and "equal, within 1e-05 (other kernels on the files' CPU model" in line, line


def test_another_cpus_kernels_take_the_rounding_path_and_pass(exactness):
    """The first case trained without the pins (tests/workers/exactness.py at world 4): MKL's own
    GEMM branch instead of COMPATIBLE, as an Intel CPU took its AVX2 branch under the old pins.
    Its kernels' hashes differ from the files', so the check takes the rounding path, names the
    kernels (and the CPU, where its name differs from the files'), and passes; a normaliser off by
    one token in the step's 1,024 fails that path."""
    other = exactness[4]["golden_elsewhere"]
    gold = golden.load(other["name"])
    if other["identity"]["data"] != gold["identity"]["data"]:
        pytest.skip("the built-in data differ from the golden runs': another Python")
    assert "matmul" in numerics.differing(gold["identity"]["kernels"], other["identity"]["kernels"])
    ok, line = golden.compare(other["name"], gold, other["curve"], other["identity"])
    same_model = gold["identity"]["cpu"] == other["identity"]["cpu"]
    words = "other kernels on the files' CPU model, " if same_model else "another CPU: its "
    assert ok and f"equal, within 1e-05 ({words}" in line and "matmul" in line, line
    assert any(f["loss"] != g["loss"] for f, g in zip(other["curve"], gold["steps"], strict=True))
    off_by_one = [{**s, "loss": s["loss"] * 1024 / 1023} for s in other["curve"]]
    ok, line = golden.compare(other["name"], gold, off_by_one, other["identity"])
    assert (
        not ok and f"{other['name']}: step 1 loss " in line and f"; within 1e-05 ({words}" in line
    ), line


def test_the_identity_decides_bitwise_only_where_everything_that_decides_the_bits_matches():
    """Generated identities: a differing torch, architecture or any one kernel's hash takes the
    rounding path and says which; so does another CPU model whose kernels hash alike (a run
    can still part in the last bit there)."""
    made = golden.load(next(iter(golden.CASES)))["identity"]
    assert golden.tolerance(made, made) == (0.0, "bitwise")
    changes = [("torch", "2.14.1+cpu"), ("machine", "aarch64"), ("cpu", "Intel(R) Xeon(R)")]
    changes += [(f"kernels.{kind}", "0" * 12) for kind in made["kernels"]]
    for n in (1, 2):
        for picked in itertools.combinations(changes, n):
            here = {**made, "kernels": dict(made["kernels"])}
            for key, value in picked:
                if key.startswith("kernels."):
                    here["kernels"][key.split(".", 1)[1]] = value
                else:
                    here[key] = value
            rtol, how = golden.tolerance(made, here)
            keys = {key.split(".")[0] for key, _ in picked}
            kinds = ", ".join(
                sorted(k.split(".", 1)[1] for k, _ in picked if k.startswith("kernels."))
            )
            if keys & {"torch", "machine"}:
                assert rtol == golden.ROUNDING_RTOL and how.startswith(
                    "within 1e-05 (another torch"
                ), how
            elif kinds and "cpu" in keys:
                assert (
                    rtol == golden.ROUNDING_RTOL and f"(another CPU: its {kinds} kernels" in how
                ), how
            elif kinds:
                assert rtol == golden.ROUNDING_RTOL and how.startswith(
                    "within 1e-05 (other kernels on the files'"
                ), how
                assert how.endswith(f": {kinds} round differently)"), how
            else:
                assert rtol == golden.ROUNDING_RTOL and how.startswith(
                    "within 1e-05 (another CPU, Intel(R) Xeon(R): its kernels hash as the files'"
                ), how


@pytest.mark.parametrize("pin", ["FOO=1", "MKL_CBWR", "MKL_CBWR=", "=AUTO", "mkl_cbwr=AUTO"])
def test_a_bad_pin_is_one_line_before_any_run(pin, capsys):
    assert golden.main(["--check", "--pin", pin]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1 and f"--pin {pin!r}: give KEY=VALUE with KEY one of OMP_NUM_THREADS" in err[0]
    ), err
    assert golden.pins(["MKL_CBWR=AUTO", "OMP_NUM_THREADS=2"]) == {
        **golden.ENV,
        "MKL_CBWR": "AUTO",
        "OMP_NUM_THREADS": "2",
    }
