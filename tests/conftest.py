import os

import pytest


def pytest_addoption(parser):
    parser.addoption(
        "--catalogue",
        action="store_true",
        help="also run the fault catalogue's long cases (tests/test_catalogue.py; minutes each)",
    )
    parser.addoption(
        "--long",
        action="store_true",
        help="also run the long scenarios (marked long: each planted bug localised, minutes in all)",
    )


def pytest_collection_modifyitems(config, items):
    """The catalogue's long cases and the long scenarios are deselected (not skipped) unless
    --catalogue or --long asks for them."""
    off = [m for m in ("catalogue", "long") if not config.getoption(f"--{m}")]
    kept = [item for item in items if not any(item.get_closest_marker(m) for m in off)]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = kept


@pytest.fixture(scope="session", autouse=True)
def _shared_cache(tmp_path_factory):
    """One tokenizer/data cache for the whole session (subprocesses inherit it)."""
    os.environ["TITANLITE_CACHE"] = str(tmp_path_factory.mktemp("titanlite-cache"))
    yield


@pytest.fixture(scope="session")
def prepared_sft(tmp_path_factory, _shared_cache):
    """The built-in SFT set (stdlib functions) prepared by scripts/prepare_data.py, as a user
    would: the resume and invariance tests train from it with --data.path."""
    import json
    import subprocess
    import sys

    from helpers import REPO

    from titanlite.datasets.corpus import stdlib_sft_records

    folder = tmp_path_factory.mktemp("prepared-sft")
    raw = folder / "stdlib_sft.jsonl"
    raw.write_text("".join(json.dumps(r) + "\n" for r in stdlib_sft_records()))
    out = folder / "prepared"
    cmd = [
        sys.executable,
        "scripts/prepare_data.py",
        "--tokenizer",
        "builtin",
        "--mode",
        "sft",
        "--out",
        str(out),
    ]
    proc = subprocess.run([*cmd, str(raw)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return str(out)


@pytest.fixture(scope="session")
def exactness(tmp_path_factory):
    """tests/workers/exactness.py's results by world size (1, 2, 4): one torchrun each, for the
    exactness tests (tests/test_distributed.py) and the golden curves elsewhere (tests/test_golden.py)."""
    from helpers import run_per_world

    return run_per_world(tmp_path_factory, "tests/workers/exactness.py", (1, 2, 4))


@pytest.fixture(scope="session")
def step_counts(tmp_path_factory):
    """tests/workers/step_counts.py's results: one torchrun of 4 ranks for the step-count tests
    and the golden curves (tests/test_golden.py), launched with the golden runs' pins."""
    import json

    from helpers import check, load_script, torchrun

    tmp = tmp_path_factory.mktemp("step_counts")
    pins = load_script("golden_losses").ENV
    check(torchrun(4, "tests/workers/step_counts.py", str(tmp / "out.json"), str(tmp / "runs"), env=pins))
    return json.loads((tmp / "out.json").read_text())
