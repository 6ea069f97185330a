"""How a fault case runs and what its promise is: launches (./run_train.sh in a session of its
own, a script, or the launcher's own code in this process), the verdicts and the checks that
give them.

    HELD   titanlite kept its promise: the exit code of the table in titanlite/errors.py, one
           line naming the problem (no traceback, not printed twice), nothing written or lost,
           and where a run was cut short, the same command continuing bitwise
    BENT   the promise kept in substance but not by the letter: the right exit code and nothing
           lost, but more than one line, a line that is not titanlite's, or one that does not
           name the problem
    BROKE  it was not: a traceback, another exit code, something written, lost or silently
           different
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import helpers
from helpers import HANG_S

REPO = Path(__file__).resolve().parents[2]
SMALL = ("--training.seq_len", "128", "--metrics.log_every", "1")
CKPT = ("--checkpoint.every", "2", "--checkpoint.at_end", "true")
RESUME6 = ("--training.steps", "6", *CKPT)


@dataclass
class Result:
    """What one launch did."""

    code: int
    out: str
    err: str

    @property
    def last(self) -> str:
        lines = [ln for ln in self.err.splitlines() if ln.strip()]
        return lines[-1] if lines else ""


class Broke(Exception):
    """A promise broken; the message says which."""


class Bent(Exception):
    """A promise kept in substance, not by the letter; the message says how."""


class Skipped(Exception):
    """The case cannot run here; the message says why."""


VERDICTS = {Broke: "BROKE", Bent: "BENT", Skipped: "SKIPPED"}


# ---- launching -----------------------------------------------------------------------------------


class Live:
    """A command running in a session of its own (so a signal to its group is a Ctrl-C), its
    output collected as it comes."""

    def __init__(self, cmd: list[str], env: dict, cwd: Path = REPO) -> None:
        self.proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        )  # fmt: skip
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [
            threading.Thread(target=self._read, args=(s, buf), daemon=True)
            for s, buf in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))
        ]
        for t in self._readers:
            t.start()

    @staticmethod
    def _read(stream, buf: list[str]) -> None:
        for line in stream:
            buf.append(line)

    def saw(self, text: str) -> bool:
        return any(text in ln for ln in self.out + self.err)

    def wait_for(self, ready: Callable[[], bool], timeout: float = HANG_S) -> None:
        end = time.monotonic() + timeout
        while not ready():
            if self.proc.poll() is not None or time.monotonic() > end:
                raise Broke(f"ended (exit {self.proc.poll()}) before the moment the case needs")
            time.sleep(0.01)

    def signal(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)

    def finish(self, timeout: float = HANG_S) -> Result:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise Broke(f"still running after {timeout:.0f}s") from None
        for t in self._readers:
            t.join()
        return Result(code, "".join(self.out), "".join(self.err))


class Catalogue:
    """The fixtures, made once, and the ways to launch."""

    def __init__(self, work: Path, nproc: int = 2, cheap: bool = False) -> None:
        self.work, self.nproc, self.cheap = work, nproc, cheap
        os.umask(0o022)  # what the modes cases hold files to
        self.env = {
            **os.environ,
            "NPROC": str(nproc),
            "OMP_NUM_THREADS": "1",
            "TITANLITE_CACHE": os.environ.get("TITANLITE_CACHE", str(work / "cache")),
        }
        self._made: dict[str, object] = {}

    def dump(self, name: str) -> Path:
        """A fresh dump folder for one case."""
        path = self.work / "runs" / re.sub(r"[^\w.-]+", "_", name)[:60]
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path

    def argv(self, dump: Path, run_name: str, args: tuple[str, ...]) -> list[str]:
        return ["--job.dump_folder", str(dump), "--job.run_name", run_name, *SMALL, *args]

    def start(
        self,
        dump: Path,
        args: tuple[str, ...],
        run_name: str = "run",
        env: dict | None = None,
        cwd: Path = REPO,
    ) -> Live:
        """run_train.sh with the case's arguments, as a user starts it (from `cwd`)."""
        cmd = [str(REPO / "run_train.sh"), *self.argv(dump, run_name, args)]
        return Live(cmd, {**self.env, **(env or {})}, cwd)

    def run(
        self,
        dump: Path,
        args: tuple[str, ...],
        run_name: str = "run",
        env: dict | None = None,
        cwd: Path = REPO,
    ) -> Result:
        """One launch, to its end: through run_train.sh, or for a cheap catalogue in this
        process (a launch that would start workers is then BROKE: the preflight should have
        stopped it)."""
        if self.cheap and not env:
            return in_process(self.argv(dump, run_name, args), self.nproc, cwd)
        return self.start(dump, args, run_name, env, cwd).finish()

    def planned(self, name: str, args: tuple[str, ...], cwd: Path = REPO) -> tuple[Result, dict]:
        """The config a launch runs with, {"section.key": value} ({} if it ran none), and what it
        printed: for a cheap catalogue what the launcher hands its workers (in this process,
        stopped there); else a one-step run's config.toml."""
        from titanlite.config import load_config, parse_args
        from titanlite.config.job_config import sections

        dump = self.dump(name)
        argv = self.argv(dump, "run", args)
        if self.cheap:
            from titanlite.config.command_line import CALLER_ENV

            r, workers_argv = in_process(argv, self.nproc, cwd, stop_at_workers=True)
            os.environ[CALLER_ENV] = str(cwd)  # as the workers have it
            try:
                cfg = parse_args(workers_argv)[0] if workers_argv is not None else None
            finally:
                os.environ.pop(CALLER_ENV)
        else:
            r = Live(
                [str(REPO / "run_train.sh"), *argv, "--training.steps", "1"], self.env, cwd
            ).finish()
            saved = dump / "run" / "config.toml"
            cfg = load_config(str(saved)) if r.code == 0 and saved.is_file() else None
        if cfg is None:
            return r, {}
        return r, {f"{s}.{k}": v for s, table in sections(cfg) for k, v in vars(table).items()}

    def script(
        self, name: str, *args: str, env: dict | None = None, timeout: float = HANG_S
    ) -> Result:
        """scripts/<name>.py with `args`, to its end, as a user runs it."""
        cmd = [sys.executable, str(REPO / "scripts" / f"{name}.py"), *args]
        return Live(cmd, {**self.env, **(env or {})}).finish(timeout)

    def start_script(self, name: str, *args: str, env: dict | None = None) -> Live:
        cmd = [sys.executable, str(REPO / "scripts" / f"{name}.py"), *args]
        return Live(cmd, {**self.env, **(env or {})})

    def once(self, key: str, make: Callable[[], object]) -> object:
        if key not in self._made:
            self._made[key] = make()
        return self._made[key]


def in_process(args: list[str], nproc: int, cwd: Path = REPO, stop_at_workers: bool = False):
    """titanlite.launch's main as run_train.sh calls it from `cwd`, in this process, stopped
    where it would start the workers (that is BROKE, or with `stop_at_workers` the point: then
    (Result, the workers' arguments or None) is returned)."""
    import torch.distributed.launcher.api as launcher_api

    from titanlite import launch

    argv = [
        "--caller-cwd",
        str(cwd),
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        "--max-restarts",
        "0",
    ]
    argv += ["-m", "titanlite.train"]
    seen: dict[str, list[str]] = {}

    def reached(config, entrypoint):
        def launch_with(*cmd_args):
            seen["argv"] = list(cmd_args)[list(cmd_args).index("titanlite.train") + 1 :]
            raise RuntimeError("reached the workers")

        return launch_with

    def main(argv: list[str]) -> int:
        try:
            return launch.main(argv)
        except RuntimeError as e:
            if "reached the workers" not in str(e):
                raise
            return 0

    real = launcher_api.elastic_launch
    launcher_api.elastic_launch = reached
    try:
        done = helpers.in_process(main, [*argv, *args])
    finally:
        launcher_api.elastic_launch = real
    if "argv" in seen and not stop_at_workers:
        raise Broke("not stopped before the workers (the preflight let it through)")
    r = Result(done.returncode, done.stdout, done.stderr)
    return (r, seen.get("argv")) if stop_at_workers else r


# ---- what a promise is -----------------------------------------------------------------------------


def _core(line: str) -> str:
    """A console line without the rank prefixes torchrun and titanlite add."""
    return re.sub(r"^(\[rank\d+\]:\s*|\[titanlite r\d+\]\s*)", "", line.strip())


OURS = re.compile(r"^(titanlite|[a-z_]+): ")  # titanlite's lines, and each script's (its name)


def expect(r: Result, code: int, says: str = "") -> None:
    """The exit code promised, and for a stop one last line of titanlite's (or the script's)
    that holds `says`, no traceback, and that line printed once."""
    if r.code != code:
        raise Broke(f"exit {r.code}, promised {code}: {r.last[:200]}")
    if code == 0:
        return
    if "Traceback" in r.err:
        # the traceback's own last lines: what raised, for a case that breaks only now and then
        trace = r.err[r.err.index("Traceback") :].strip().splitlines()
        raise Broke(f"a traceback: {r.last[:200]} | {' / '.join(trace[-4:])[:600]}")
    last = _core(r.last)
    if not OURS.match(last) or last.startswith("usage: "):
        raise Bent(f"the last line is not titanlite's: {r.last[:200]}")
    if says and says not in last:
        raise Bent(f"the line does not say {says!r}: {last[:300]}")
    lines = [_core(ln) for ln in (r.out + r.err).splitlines()]
    if lines.count(last) > 1:
        raise Bent(f"the line is printed {lines.count(last)} times")
    if code == 2 and any(ln.startswith("usage: ") for ln in lines):
        raise Bent("a usage block beside the line")


def listing(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under `folder` with its size and mtime (what "nothing written" compares)."""
    if not folder.exists():
        return {}
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != "run.lock"
    }


def unchanged(before: dict, folder: Path) -> None:
    after = listing(folder)
    if after != before:
        changed = sorted(
            set(after) ^ set(before) | {k for k in after if k in before and after[k] != before[k]}
        )
        raise Broke(f"written: {', '.join(changed[:4])}{' ...' if len(changed) > 4 else ''}")


def records(path: Path) -> list[dict]:
    """A JSONL file's records; a line that is not JSON (cut off) is BROKE."""
    if not path.is_file():
        return []
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except ValueError:
                raise Broke(f"{path.name} line {n} is not a whole record: {line[:60]!r}") from None
    return out


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(run_dir / "metrics.jsonl") if "loss" in r}


def refused(
    c: Catalogue, name: str, args: tuple[str, ...], says: str, env: dict | None = None
) -> None:
    """A bad input: exit 2 in one line, nothing written (the dump folder stays empty)."""
    dump = c.dump(name)
    expect(c.run(dump, args, env=env), 2, says)
    unchanged({}, dump)


# ---- the registry ---------------------------------------------------------------------------------


@dataclass
class Case:
    family: str
    name: str
    run: Callable[[Catalogue], None]  # raises Broke, Bent or Skipped; returns when HELD
    cheap: bool = False  # stops before any worker: runs in this process, in a second
    ci: bool = False  # runs workers but in seconds: CI runs it too

    @property
    def id(self) -> str:
        return f"{self.family}: {self.name}"


CASES: list[Case] = []


def case(family: str, name: str, cheap: bool = False, ci: bool = False):
    def register(fn: Callable[[Catalogue], None]) -> Callable[[Catalogue], None]:
        CASES.append(Case(family, name, fn, cheap, ci))
        return fn

    return register


def bad_input(
    family: str,
    name: str,
    args: tuple[str, ...],
    says: str,
    env: dict | None = None,
    cheap: bool = True,
) -> None:
    """A case whose promise is a refusal: exit 2, one line holding `says`, nothing written."""
    case(family, name, cheap)(lambda c: refused(c, name, args, says, env))


def trains(
    family: str,
    name: str,
    args: Callable[[Catalogue], tuple[str, ...]],
    check: Callable[[Catalogue, Result, Path], None] | None = None,
) -> None:
    """A case whose promise is a run: exit 0 (and `check`)."""

    def run(c: Catalogue) -> None:
        dump = c.dump(name)
        r = c.run(dump, ("--training.steps", "2", *args(c)))
        expect(r, 0)
        if check:
            check(c, r, dump / "run")

    case(family, name)(run)


def verdict(c: Catalogue, k: Case) -> tuple[str, str]:
    """("HELD", "") or (BROKE / BENT / SKIPPED, why) for one case; a case that fails to run is
    BROKE with its error."""
    try:
        k.run(c)
    except (Broke, Bent, Skipped) as e:
        return VERDICTS[type(e)], str(e)
    except Exception as e:  # noqa: BLE001 - the case itself failed: a verdict, not a crash
        return "BROKE", f"the case failed to run: {type(e).__name__}: {e}"
    return "HELD", ""
