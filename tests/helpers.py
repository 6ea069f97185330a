"""Shared test helpers: launching torchrun subprocesses and reading a run's metrics."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from titanlite.analysis.harness import torchrun_command

REPO = Path(__file__).resolve().parents[1]
# What a launch says before its workers start, once every check passed (titanlite.preflight):
# the run, what it reads, then its notes. Anything else of titanlite's is a stop or an error.
STARTUP = (
    "titanlite: note:",
    "titanlite: training ",
    "titanlite: rehearsing ",
    "titanlite: reads ",
)
# bf16 keeps an 8-bit significand: each rounding is off by at most u = 2^-8 relative. Rounding
# errors in a chain of n operations add up like a random walk, about sqrt(n) u (Higham and Mary,
# "A New Approach to Probabilistic Rounding Error Analysis", SIAM J. Sci. Comput. 41(5), 2019).
# With bf16 parameters, the deepest gradient of the tiny Llama (tests/workers/exactness.py)
# passes about 64 rounded ops (two blocks of ~11 in forward, each rounded twice again in
# backward, plus embedding, head and loss): 8u = 3.1e-2. Measured over every case at dp 1, 2 and 4: 2.0u to 2.8u. The logged loss, a mean
# over all tokens, averages its errors away: within u (measured 0.03u).
BF16_U = 2.0**-8
BF16_GRAD_TOL = 8 * BF16_U
# How long a test waits for a process or an event before calling it hung: a guard, never a
# measure of speed. A 2-core machine shared with another suite runs a worker several times slower
# than alone, so the guard sits far above any quiet figure; CI's own limit bounds the suite.
HANG_S = 1800


def torchrun(
    nproc: int,
    *args: str,
    timeout: float = HANG_S,
    env: dict | None = None,
    launcher: str = "torch.distributed.run",
    launch: tuple[str, ...] = (),
) -> subprocess.CompletedProcess:
    """Run `torchrun --standalone --nproc_per_node nproc [launch] ARGS` and capture its output
    (launcher "titanlite.launch": with preflight, run lock and the workers' exit codes, as
    run_train.sh does)."""
    cmd = torchrun_command(nproc, *launch, *args, launcher=launcher)
    full_env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}",
    }
    full_env.update(env or {})
    return subprocess.run(
        cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout
    )


def run_per_world(tmp_path_factory, script: str, worlds: tuple[int, ...]) -> dict[int, dict]:
    """One torchrun of `script OUT.json` per world size; returns each world's JSON."""
    out = {}
    for world in worlds:
        path = tmp_path_factory.mktemp(Path(script).stem) / f"world{world}.json"
        check(torchrun(world, script, str(path)))
        out[world] = json.loads(path.read_text())
    return out


def train(
    nproc: int,
    *overrides: str,
    timeout: float = HANG_S,
    launcher: str = "torch.distributed.run",
    launch: tuple[str, ...] = (),
):
    return torchrun(
        nproc,
        "-m",
        "titanlite.train",
        *overrides,
        timeout=timeout,
        launcher=launcher,
        launch=launch,
    )


def load_script(name: str):
    """scripts/<name>.py as a module, to call its functions in the test's process."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # a dataclass of the script looks its module up there
    spec.loader.exec_module(module)
    return module


def in_process(
    main: Callable[[list[str]], int], args: Sequence[str], cwd: Path = REPO
) -> subprocess.CompletedProcess:
    """`main(args)` in this process as its command line runs it from `cwd`, its output captured
    and what a run changes in the process put back (the environment: a one-rank job sets
    MASTER_PORT and the rest; sys.path; the signal handlers; the working folder): seconds
    cheaper than a new interpreter importing torch. For runs that end on their own; a test that
    signals or kills one starts a process."""
    import contextlib
    import io
    import signal

    err, out = io.StringIO(), io.StringIO()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    environ, path, here = dict(os.environ), list(sys.path), os.getcwd()
    try:
        os.chdir(cwd)
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            code = main(list(args))
    finally:
        os.chdir(here)
        os.environ.clear()
        os.environ.update(environ)
        sys.path[:] = path
        for s, h in handlers.items():
            signal.signal(s, h)
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def run_script(name: str, *args: str) -> subprocess.CompletedProcess:
    """scripts/<name>.py's main(args) in this process (in_process), from the repository."""
    return in_process((sys.modules.get(name) or load_script(name)).main, args)


def read_metrics(run_dir: Path) -> list[dict]:
    return [
        json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line
    ]


def check(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )


def tensorboard_items(log_dir: Path) -> tuple[dict[tuple[str, int], float], set[tuple[str, int]]]:
    """Scalars {(tag, step): value} and text {(tag, step)} read back from TensorBoard's events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    scalars = {(tag, e.step): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}
    text = {
        (tag.removesuffix("/text_summary"), e.step)
        for tag in acc.Tags()["tensors"]
        for e in acc.Tensors(tag)
    }
    return scalars, text


def served_scalars(
    logdir: Path, tags: list[tuple[str, str]]
) -> dict[tuple[str, str], list[tuple[int, float]]]:
    """(run, tag) -> its (step, value) points as a real TensorBoard server on 127.0.0.1 (port 0:
    one the system picks) hands them to the browser, through its HTTP API, started with the
    flags the run's summary gives."""
    import re
    import time
    import urllib.error
    import urllib.parse
    import urllib.request

    from titanlite.components.summary import TENSORBOARD_ALL_POINTS

    tb = Path(sys.executable).parent / "tensorboard"
    cmd = [
        str(tb),
        "--logdir",
        str(logdir),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        *TENSORBOARD_ALL_POINTS.split(),
    ]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        said = ""
        while not (found := re.search(r"http://127\.0\.0\.1:(\d+)/", said)):
            line = server.stdout.readline()
            assert line, f"tensorboard ended before serving: {said[-2000:]}"
            said += line
        out = {}
        for run, tag in tags:
            query = urllib.parse.urlencode({"run": run, "tag": tag})
            url = f"http://127.0.0.1:{found.group(1)}/data/plugin/scalars/scalars?{query}"
            for _ in range(
                120
            ):  # the server loads the event files in the background after it starts
                try:
                    with urllib.request.urlopen(url, timeout=30) as reply:  # noqa: S310 - loopback
                        points = json.loads(reply.read())
                except urllib.error.HTTPError:  # the run or tag not loaded yet
                    points = []
                if points:
                    break
                time.sleep(0.5)
            out[(run, tag)] = [(step, value) for _, step, value in points]
        return out
    finally:
        server.kill()
        server.wait()


def every_section() -> list[tuple[str, Any]]:
    """(name, defaults) of every config section, the plugins' (titanlite.faults) included."""
    from titanlite.config.job_config import sections, with_plugins

    return sections(with_plugins())
