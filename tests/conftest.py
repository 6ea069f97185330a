import json
import os
import time
from collections import defaultdict
from pathlib import Path

import pytest

# The committed baseline of each test file's seconds (tests/durations.json), beside which every
# run prints its own: what moved, and where the suite's time goes.
BASELINE = Path(__file__).with_name("durations.json")
_seconds: dict[str, float] = defaultdict(float)  # per test id: setup + call + teardown
_started = [time.perf_counter()]


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


# Test files that share a session fixture's torchrun run in one pytest-xdist worker, so that it
# runs once (exactness: tests/workers/exactness.py; step_counts: tests/workers/step_counts.py).
SHARED_WORKER = {
    "test_distributed": "workers",
    "test_golden": "workers",
    "test_step_counts": "workers",
}


def _scope(path: str) -> str:
    """The unit a worker runs whole: a test file, or the files of one shared worker."""
    stem = Path(path).stem
    return SHARED_WORKER.get(stem, stem)


class _ByScope:
    """scripts/test.sh runs the suite in two workers (pytest-xdist): each scope whole in one (its
    module and session fixtures' runs once), the longest first as the baseline measured them."""

    @staticmethod
    def pytest_xdist_make_scheduler(config, log):
        from xdist.scheduler import LoadScopeScheduling

        class ByScope(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return _scope(nodeid.split("::", 1)[0])

        config.option.loadscopereorder = False  # keep the collection's order (longest first)
        return ByScope(config, log)


def pytest_configure(config):
    if config.pluginmanager.hasplugin("xdist"):  # its hook exists only with the plugin
        config.pluginmanager.register(_ByScope())


def pytest_collection_modifyitems(config, items):
    """The catalogue's long cases and the long scenarios are deselected (not skipped) unless
    --catalogue or --long asks for them. The rest run longest scope first (tests/durations.json),
    so two workers finish together."""
    off = [m for m in ("catalogue", "long") if not config.getoption(f"--{m}")]
    kept = [item for item in items if not any(item.get_closest_marker(m) for m in off)]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = kept
    seconds: dict[str, float] = defaultdict(float)
    if BASELINE.is_file():
        for path, s in json.loads(BASELINE.read_text())["files"].items():
            seconds[_scope(path)] += s
    items.sort(key=lambda item: -seconds[_scope(str(item.path))])  # stable: a file keeps its order


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
    check(
        torchrun(
            4, "tests/workers/step_counts.py", str(tmp / "out.json"), str(tmp / "runs"), env=pins
        )
    )
    return json.loads((tmp / "out.json").read_text())


def pytest_sessionstart(session):
    _started[0] = time.perf_counter()


def pytest_runtest_logreport(report):
    _seconds[report.nodeid] += report.duration


def per_file(seconds: dict[str, float]) -> dict[str, float]:
    """Seconds per test file (a session fixture's torchrun counts in its first test's setup)."""
    files: dict[str, float] = defaultdict(float)
    for nodeid, s in seconds.items():
        files[nodeid.split("::", 1)[0]] += s
    return dict(files)


def pytest_terminal_summary(terminalreporter, config):
    """Every run ends with its durations per test file beside the baseline's; TITANLITE_DURATIONS
    names a file that receives them as JSON (how tests/durations.json is made)."""
    if not _seconds or hasattr(
        config, "workerinput"
    ):  # a pytest-xdist worker: the controller reports
        return
    files, wall = per_file(_seconds), time.perf_counter() - _started[0]
    base = json.loads(BASELINE.read_text()) if BASELINE.is_file() else {"files": {}}
    old = base["files"]
    tr = terminalreporter
    tr.section("durations per test file (seconds; the baseline's from tests/durations.json)")
    tr.write_line(f"{'file':44} {'now':>8} {'baseline':>9}")
    for name, s in sorted(files.items(), key=lambda kv: -kv[1]):
        was = f"{old[name]:9.1f}" if name in old else f"{'-':>9}"
        tr.write_line(f"{name:44} {s:8.1f} {was}")
    total_was = f"{base['wall_s']:9.1f}" if "wall_s" in base else f"{'-':>9}"
    tr.write_line(f"{'all (wall clock)':44} {wall:8.1f} {total_was}")
    if out := os.environ.get("TITANLITE_DURATIONS"):
        slow = {
            k: round(v, 1) for k, v in sorted(_seconds.items(), key=lambda kv: -kv[1]) if v >= 5
        }
        record = {"wall_s": round(wall, 1), "files": {k: round(v, 1) for k, v in files.items()}}
        Path(out).write_text(json.dumps({**record, "tests_over_5s": slow}, indent=1) + "\n")
