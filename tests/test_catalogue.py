"""The fault catalogue (tests/faults), one test per case, named by its family and name.

The cheap cases (every bad input that must stop before any worker) run through the launcher's
own code in this process, in a second each, and the quick runs marked for CI launch
./run_train.sh or a script; both run in CI. The rest (kills, signals at every moment, damaged
checkpoints resumed: minutes) carry the `catalogue` marker and run with `--catalogue`
(scripts/test.sh tests/test_catalogue.py --catalogue) or as a table through
scripts/fault_catalogue.py. A case that is not HELD fails with its verdict and why."""

from __future__ import annotations

import pytest
from faults import CASES, Case, Catalogue, verdict


@pytest.fixture(scope="session")
def catalogues(tmp_path_factory) -> dict[bool, Catalogue]:
    """{cheap: its catalogue}: in-process launches for the cheap cases, real ones for the rest."""
    return {
        cheap: Catalogue(tmp_path_factory.mktemp(f"catalogue-{cheap}"), cheap=cheap)
        for cheap in (True, False)
    }


@pytest.mark.parametrize(
    "case",
    [pytest.param(k, marks=() if k.cheap or k.ci else pytest.mark.catalogue) for k in CASES],
    ids=[k.id for k in CASES],
)
def test_fault_case(case: Case, catalogues: dict[bool, Catalogue]) -> None:
    said, why = verdict(catalogues[case.cheap], case)
    if said == "SKIPPED":
        pytest.skip(why)
    assert said == "HELD", f"{said}: {why}"


def test_the_catalogue_keeps_its_cases() -> None:
    """No case is lost, and ids are unique (each is a test of its own)."""
    assert len(CASES) >= 137 and sum(k.cheap for k in CASES) >= 49
    assert len({k.id for k in CASES}) == len(CASES)
