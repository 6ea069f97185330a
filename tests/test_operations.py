"""Runs that survive real operations, through run_train.sh and the launcher as a user starts them
(2 CPU ranks, the debug model on the built-in data; checkpoint, signal and restart exactness
are in tests/test_checkpoint.py):

- a second launch on a live run folder is refused in one line naming the holder; a SIGKILL of the
  launcher's process group leaves no worker behind; the next launch takes the stale lock over
  and resumes;
- a second Ctrl-C stops at once, in one line, without orphans;
- a rank that stops responding makes the other stop within comm.timeout_s plus a grace, exit 4,
  with one line naming the rank (shown by the launcher although LOG_RANK hides that rank); a
  rank frozen inside a step (SIGSTOP) is named by its stopped heartbeat, with the phase;
- scripts/train.slurm, its two node tasks on this machine (NNODES=2, one rank each), trains the
  losses of one node with two ranks;
- the lock, the free-space estimate and the multi-node naming rule, in process.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import HANG_S, REPO, read_metrics

from titanlite.components.checkpoint.index import MARKER as CHECKPOINT_MARKER
from titanlite.components.run.lock import STALE_S, RunLock
from titanlite.components.run.plan import check_checkpoint_space, run_name
from titanlite.config import load_config
from titanlite.errors import UserError

FAST = [
    "--training.seq_len",
    "128",
    "--training.local_batch_size",
    "2",
    "--training.global_batch_size",
    "4",
    "--metrics.log_every",
    "1",
    "--metrics.enable_tensorboard",
    "false",
]


def launch(tmp: Path, name: str, *extra: str, env: dict | None = None, **popen) -> subprocess.Popen:
    """./run_train.sh in a session of its own (a terminal's Ctrl-C reaches its process group)."""
    cmd = ["./run_train.sh", *FAST, "--job.dump_folder", str(tmp), "--job.run_name", name, *extra]
    full_env = {**os.environ, "NPROC": "2", "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen(
        cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, **popen,
    )  # fmt: skip


def until(ready, what: str, proc: subprocess.Popen | None = None) -> None:
    """Poll `ready()` until it holds (at most HANG_S); `proc` must not end meanwhile."""
    end = time.monotonic() + HANG_S
    while not ready():
        assert proc is None or proc.poll() is None, proc.communicate()
        assert time.monotonic() < end, f"{what}: not after {HANG_S}s"
        time.sleep(0.02)


def finish(proc: subprocess.Popen, timeout: float = HANG_S) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def wait_for_step(
    run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = HANG_S
) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if (run_dir / "metrics.jsonl").is_file() and any(
            r["step"] >= step for r in read_metrics(run_dir)
        ):
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError(f"no step {step} in {run_dir} after {timeout}s")


def workers_of(tmp: Path) -> list[int]:
    """Live titanlite.train processes whose command line names the dump folder `tmp`."""
    pids = []
    for d in Path("/proc").iterdir():
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        launcher = b"titanlite.launch" in cmd
        if (
            b"titanlite.train" in cmd
            and not launcher
            and str(tmp).encode() in cmd
            and d.name.isdigit()
        ):
            state = (d / "stat").read_text().split(") ")[-1][:1]
            if state != "Z":
                pids.append(int(d.name))
    return pids


def handles(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler of its own for `sig` (its SigCgt mask in /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next(ln for ln in status.splitlines() if ln.startswith("SigCgt:"))
    return bool(int(caught.split()[1], 16) >> (sig - 1) & 1)


@pytest.mark.slow
def test_one_live_run_per_folder_and_no_orphans(tmp_path):
    ckpt = ("--training.steps", "300", "--checkpoint.every", "2", "--checkpoint.at_end", "true")
    first = launch(tmp_path, "held", *ckpt)
    wait_for_step(tmp_path / "held", 2, first)
    code, _, err = finish(launch(tmp_path, "held", *ckpt))
    assert code == 2 and err.count("\n") == 1, err
    assert f"is in use by a live run (host {socket.gethostname()}, pid {first.pid}, started " in err

    os.killpg(first.pid, signal.SIGKILL)  # the launcher's whole process group, as a scheduler would
    first.wait()
    # a killed launcher waits for nothing: its workers die with it (their parent-death signal)
    # and end as the kernel gets to them
    until(lambda: not workers_of(tmp_path), "the killed launcher's workers gone")
    folders = (tmp_path / "held" / "checkpoints").glob("step-*")
    newest = max(
        int(p.name[5:]) for p in folders if p.name[5:].isdigit() and (p / "complete").is_file()
    )
    code, out, err = finish(
        launch(
            tmp_path,
            "held",
            "--training.steps",
            str(newest + 1),  # one step past wherever the killed run's checkpoints reached
            "--checkpoint.every",
            "2",
            "--checkpoint.at_end",
            "true",
        )
    )
    assert code == 0, err[-3000:]
    assert f"taking over the stale lock of host {socket.gethostname()} pid {first.pid}" in out + err
    assert "resumed from step" in out + err and not (tmp_path / "held" / "run.lock").exists()


@pytest.mark.slow
def test_second_ctrl_c_stops_at_once(tmp_path):
    proc = launch(
        tmp_path,
        "twice",
        "--training.steps",
        "300",
        "--checkpoint.every",
        "100",
        "--checkpoint.at_end",
        "true",
    )
    wait_for_step(tmp_path / "twice", 2, proc)
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    code, _, err = finish(proc)
    assert code == 130, err[-3000:]
    assert (
        err.strip().splitlines()[-1].startswith("titanlite: stopped at once by a second SIGINT")
    ), err[-3000:]
    assert "Traceback" not in err and workers_of(tmp_path) == []


@pytest.mark.slow
def test_hung_rank_is_named_and_the_others_stop(tmp_path):
    """Rank 0 hangs as step 3 starts; rank 1 waits in step 3's first collective until the 5 s
    timeout. LOG_RANK=0 hides rank 1, so its line comes from its log file, via the launcher."""
    hang = ("--comm.timeout_s", "5", "--faults.hang_step", "3", "--faults.hang_rank", "0")
    proc = launch(tmp_path, "hung", "--training.steps", "50", *hang)
    wait_for_step(tmp_path / "hung", 2, proc)
    code, _, err = finish(proc)
    assert code == 4, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith(
        "[rank1]: titanlite: stopped: a collective waited over comm.timeout_s = 5s at step 3"
    )
    assert "rank(s) 0 did not arrive (last step reached: 0: 2)" in line
    assert workers_of(tmp_path) == []


@pytest.mark.slow
def test_a_frozen_rank_is_named_with_the_phase_it_froze_in(tmp_path):
    """Rank 1 stops itself (SIGSTOP) as it enters the backward of step 3: it reached the step, so
    no rank is behind; its heartbeat stops with it, which names it (catalogue: the other points
    of the step, scripts/fault_catalogue.py)."""
    freeze = (
        "--comm.timeout_s",
        "5",
        "--faults.freeze_step",
        "3",
        "--faults.freeze_phase",
        "backward",
    )
    proc = launch(tmp_path, "frozen", "--training.steps", "50", *freeze)
    wait_for_step(tmp_path / "frozen", 2, proc)
    code, _, err = finish(proc)
    assert code == 4, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith(
        "titanlite: stopped: a collective waited over comm.timeout_s = 5s at step 3"
    ), line
    assert (
        "rank(s) 1 stopped responding (rank 1 last seen in backward of step 3; its heartbeat stopped)"
        in line
    )
    assert "raise comm.timeout_s" not in line
    assert workers_of(tmp_path) == []


def launcher_of(proc: subprocess.Popen) -> bool:
    """Whether run_train.sh has exec'd the launcher (and Python has run its first lines)."""
    try:
        return b"titanlite.launch" in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize(
    "sig, when",
    [(signal.SIGINT, "workers"), (signal.SIGTERM, "workers"), (signal.SIGTERM, "launcher")],
)
def test_a_signal_before_the_first_step_stops_in_one_line_and_writes_nothing(tmp_path, sig, when):
    """The signal comes while the launcher imports torch, or as soon as the workers exist, while
    they import torch (it waits, pending, until their stop handler is installed): either way the
    stop is the promised one, with no traceback."""
    proc = launch(tmp_path, "early", "--training.steps", "3")
    if when == "workers":
        until(lambda: workers_of(tmp_path), "the workers started", proc)
    else:  # its stop handler is installed, before its imports
        until(lambda: launcher_of(proc) and handles(proc.pid, sig), "the launcher's handler", proc)
    os.killpg(proc.pid, sig)
    code, _, err = finish(proc)
    name = signal.Signals(sig).name
    assert code == 128 + sig, err[-3000:]
    assert (
        err.strip().splitlines()[-1]
        == f"titanlite: stopped by {name} before the first step; nothing was written"
    )
    assert "Traceback" not in err and not (tmp_path / "early").exists()
    assert workers_of(tmp_path) == []


def alive_with(text: str) -> list[int]:
    """Live processes whose command line holds `text` (a launcher's DataLoader workers too)."""
    pids = []
    for d in Path("/proc").iterdir():
        try:
            found = d.name.isdigit() and text.encode() in (d / "cmdline").read_bytes()
            if found and (d / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                pids.append(int(d.name))
        except OSError:
            continue
    return pids


@pytest.mark.slow
def test_timeout_s_int_during_a_rehearsal_is_one_line_and_leaves_nothing(tmp_path):
    """As `timeout -s INT` stops a rehearsal whose loader has a worker process: SIGINT to the
    launcher, then to its whole process group (the DataLoader worker included). One line, exit
    130, no folder left, no process left."""
    cmd = ["./run_train.sh", "--rehearse", "8", "--rehearsal.steps", "30", "--data.num_workers", "1",
           "--training.seq_len", "128", "--job.dump_folder", str(tmp_path)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # fmt: skip
    said = []
    for line in proc.stdout:  # the event: a step done, the loader's worker serving
        said.append(line)
        if "rehearsal: step 2/30 done" in line:
            break
    assert len(alive_with(str(tmp_path))) == 2, "".join(said)  # the launcher and its loader worker
    os.kill(proc.pid, signal.SIGINT)
    os.killpg(proc.pid, signal.SIGINT)
    rest, _ = proc.communicate(timeout=HANG_S)
    lines = [ln for ln in "".join(said).splitlines() + rest.splitlines() if ln.strip()]
    assert proc.returncode == 130, lines[-30:]
    assert lines[-1].startswith("titanlite: stopped by SIGINT after rehearsal step "), lines[-30:]
    assert "nothing was kept" in lines[-1] and not any("Traceback" in ln for ln in lines)
    assert sum(ln.startswith("titanlite: stopped") for ln in lines) == 1, lines[-30:]
    assert list(tmp_path.iterdir()) == [] and alive_with(str(tmp_path)) == []


def test_a_stopped_rehearsal_leaves_an_earlier_one_s_folder_as_it_was(tmp_path):
    """What a rehearsal rerun under the same name does to its folder before a stop (each file
    rewritten, added, in a new subfolder, removed), undone: the folder holds what it held."""
    from titanlite.components.run.undo import FolderSnapshot

    run = tmp_path / "run"
    (run / "tb").mkdir(parents=True)
    (run / "empty").mkdir()
    earlier = {"rehearsal.json": '{"complete": true}', "config.toml": "a", "tb/events": "e"}
    for name, text in earlier.items():
        (run / name).write_text(text)
    (run / "run.lock").write_text("held")
    for change in ("rewrite", "add", "nest", "remove"):
        before = FolderSnapshot(run)
        if change == "rewrite":
            (run / "rehearsal.json").write_text('{"complete": false}')
        elif change == "add":
            (run / "run.json").write_text("{}")
        elif change == "nest":
            (run / "logs" / "x").mkdir(parents=True)
            (run / "logs" / "x" / "stderr.log").write_text("log")
        else:
            (run / "tb" / "events").unlink()
        before.restore()
        files = {str(p.relative_to(run)): p.read_text() for p in run.rglob("*") if p.is_file()}
        assert files == {**earlier, "run.lock": "held"}, change
        assert sorted(p.name for p in run.iterdir() if p.is_dir()) == ["empty", "tb"], change


# a launcher-like child: its first SIGINT starts a graceful stop, during which the user presses
# Ctrl-C again (it reaches the script); its second SIGINT ends it at once
def python(code: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter at the repository's root, its output captured."""
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=HANG_S
    )


LAUNCHER_LIKE = """
import os, signal, sys, time
seen = []
def on(s, f):
    seen.append(s)
    if len(seen) == 1:
        os.kill(os.getppid(), signal.SIGINT)
    else:
        sys.exit(130)
signal.signal(signal.SIGINT, on)
print(flush=True)
script = os.getppid()
while len(seen) < 2 and os.getppid() == script:  # an orphan ends: the test fails, never hangs
    time.sleep(0.01)
"""
SECOND_STOP = f"""
import subprocess, sys
from titanlite.tools.process import stop_child

child = subprocess.Popen([sys.executable, "-c", {LAUNCHER_LIKE!r}], stdout=subprocess.PIPE)
child.stdout.readline()
try:
    stop_child(child, 2)
except KeyboardInterrupt:
    print(child.returncode, file=sys.stderr)
"""


def test_a_second_stop_to_a_script_goes_on_to_its_child_which_it_still_waits_for():
    """A script that stops its launcher child (tools/process.py stop_child) and gets a second
    Ctrl-C meanwhile passes it on and returns only once the child has exited."""
    proc = python(SECOND_STOP)
    assert (proc.returncode, proc.stderr) == (0, "130\n"), proc.stderr[-3000:]


def test_a_signal_after_the_last_step_changes_nothing():
    """Once the loop has ended, a stop signal is ignored: without that, CPython's finalization
    restores the default action and a run that printed done: is killed by it."""
    code = (
        "import os, signal, time\n"
        "from titanlite.components.run.stop import StopSignals\n"
        "stops = StopSignals()\n"
        "stops.armed = True\n"
        "stops.finish()\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(0.2)\n"
        "print(signal.getsignal(signal.SIGINT) == signal.getsignal(signal.SIGTERM) == signal.SIG_IGN)\n"
    )
    proc = python(code)
    # ignored, not handled: finalization restores the default action of handled signals only
    assert (proc.returncode, proc.stdout.strip()) == (0, "True"), proc.stderr


def test_a_stop_raised_where_python_cannot_raise_it_stops_at_the_loop_in_silence():
    """A set-up stop that lands inside a callback Python swallows: an at-fork hook (a worker
    process starting), a __del__, a weakref finalizer; SIGINT and SIGTERM. Nothing is printed
    there, the set-up goes on, and the loop's start stops with the one line. Another exception
    swallowed so is still printed."""
    code = (
        "import gc, os, signal, weakref\n"
        "from titanlite.components.run.stop import StopSignals\n"
        "from titanlite.errors import Stopped\n"
        "class Odd:\n"
        "    def __init__(self, act):\n"
        "        self.act = act\n"
        "    def __del__(self):\n"
        "        self.act()\n"
        "def forked(act):\n"
        "    os.register_at_fork(after_in_parent=act)\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        os._exit(0)\n"
        "    os.waitpid(pid, 0)\n"
        "def finalized(act):\n"
        "    o = Odd(lambda: None)\n"
        "    weakref.finalize(o, act)\n"
        "    del o; gc.collect()\n"
        "WHERE = {'fork': forked, 'del': lambda act: (Odd(act), gc.collect()), 'finalize': finalized}\n"
        "for where, run in WHERE.items():\n"
        "    for sig in (signal.SIGINT, signal.SIGTERM):\n"
        "        stops = StopSignals()\n"
        "        fired = []\n"
        "        def act(sig=sig, fired=fired):\n"
        "            if not fired:  # an at-fork hook stays registered: once\n"
        "                fired.append(1)\n"
        "                os.kill(os.getpid(), sig)\n"
        "                sum(range(10))  # Python runs the handler here, inside the callback\n"
        "        run(act)\n"
        "        try:\n"
        "            stops.arm(None)\n"
        "            print(where, sig.name, 'not stopped')\n"
        "        except Stopped as e:\n"
        "            print(where, e)\n"
        "def bug():\n"
        "    raise ValueError('printed')\n"
        "Odd(bug); gc.collect()\n"
    )
    proc = python(code)
    assert proc.stdout.splitlines() == [
        f"{where} stopped by {sig} before the first step; nothing was written"
        for where in ("fork", "del", "finalize")
        for sig in ("SIGINT", "SIGTERM")
    ], (proc.stdout, proc.stderr)
    assert "Stopped" not in proc.stderr and "ValueError: printed" in proc.stderr, proc.stderr


STOPS_IN_CHILDREN = """
import os, signal, subprocess, sys, time
from titanlite.components.run.stop import StopSignals
from titanlite.datasets.workers import leave_stops_to_parent
from torchdata.stateful_dataloader import StatefulDataLoader

heard = []  # every stop signal the rank's handler ran for (the first one stops; the rest repeat it)

class Noted(StopSignals):
    def _handle(self, signum, frame):
        super()._handle(signum, frame)
        if os.getpid() == self.pid:
            heard.append(signum)

stops = Noted()
stops.armed = True  # in the loop: a signal is noted, the stop comes after the step

def delivered(sig, to):
    before = heard.count(sig)
    for pid in to:  # from another process, as a user's or a scheduler's signal comes
        kill = ["kill", f"-{sig.name[3:]}", "--", str(pid or -os.getpgid(0))]
        subprocess.run(kill, check=True, start_new_session=True)
    end = time.monotonic() + HANG_S
    while heard.count(sig) == before:
        assert time.monotonic() < end, (sig, to)
        time.sleep(0.01)

loader = StatefulDataLoader(list(range(64)), batch_size=1, num_workers=2,
                            worker_init_fn=leave_stops_to_parent)
batches = iter(loader)
got = [next(batches), next(batches)]  # one from each worker: both have run worker_init_fn
workers = [w.pid for w in batches._workers]
rank = os.getpid()
ready, say_ready = os.pipe()
forked = os.fork()  # a bare fork, as a data-preparation pool's worker is made
if forked == 0:
    # Python clears the signals noted while it sets the child up after the fork: a signal that
    # lands then is lost, so the test signals the child only once it runs its own code
    os.write(say_ready, b"1")
    while os.getppid() == rank:
        time.sleep(0.1)
    os._exit(0)
assert os.read(ready, 1) == b"1"
for sig in (signal.SIGINT, signal.SIGTERM):  # to one child alone: the rank hears it from the child
    for to in ([workers[0]], [workers[1]], [forked]):
        delivered(sig, to)
for sig in (signal.SIGINT, signal.SIGTERM):  # 0: the whole process group, once or twice
    for to in ([0], [0, workers[1], 0]):
        delivered(sig, to)
assert stops.received == signal.SIGINT  # the first one is the stop
got += list(batches)  # the loader kept serving: no worker died of a signal
os.kill(forked, signal.SIGKILL)
print(len(got), file=sys.stderr)
""".replace("HANG_S", str(HANG_S))


def test_a_stop_to_a_rank_s_children_is_the_rank_s_stop():
    """SIGINT and SIGTERM to one DataLoader worker, to each, to a bare fork of the rank (a
    data-preparation worker), to the whole process group, and to the group twice with a worker
    between: each reaches the rank as one stop signal, and the workers keep serving batches
    until the rank stops them (none dies of the signal or raises the rank's stop in itself)."""
    proc = subprocess.run(
        [sys.executable, "-W", "ignore::UserWarning", "-c", STOPS_IN_CHILDREN], cwd=REPO, capture_output=True, text=True,
        timeout=HANG_S, start_new_session=True,
    )  # fmt: skip
    assert (proc.returncode, proc.stderr) == (0, "64\n"), proc.stderr[-3000:]


REAP = """
import os, signal, subprocess, sys, tempfile
from titanlite.components.run.children import adopt_orphans, children, reap

adopt_orphans()
# a child that starts a grandchild and exits, as a rank that ends before its DataLoader workers
told = os.path.join(tempfile.mkdtemp(), "go")  # the grandchild exits once this file exists
wait = f"import os, time\\nwhile not os.path.exists({told!r}): time.sleep(0.01)"
middle = subprocess.run([sys.executable, "-c", "import subprocess, sys; "
    f"print(subprocess.Popen([sys.executable, '-c', {wait!r}], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)"],
    capture_output=True, text=True)
orphan = int(middle.stdout)
stubborn = subprocess.Popen([sys.executable, "-c", "import signal, time; "
    "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(3600)"],
    stdout=subprocess.PIPE)
stubborn.stdout.readline()
assert sorted(children()) == sorted([orphan, stubborn.pid]), (children(), orphan, stubborn.pid)
open(told, "w").close()
# the orphan exits on its own; the stubborn one is killed once the wait is cut short
killed = reap(hurry=lambda: orphan not in children())
assert killed == [stubborn.pid] and children() == [] and stubborn.wait() == -signal.SIGKILL
print("ok", file=sys.stderr)
"""


def test_the_launcher_waits_for_every_process_it_started_and_kills_what_stays():
    """The launcher's children, and their orphaned children (the subreaper), are waited for; one
    still running when the wait ends is killed and named."""
    proc = python(REAP)
    assert (proc.returncode, proc.stderr) == (0, "ok\n"), proc.stderr[-3000:]
    from titanlite.components.run.children import STOP_WAIT_S, killed_line

    assert killed_line([7, 9], False) == (
        f"2 process(es) it started (pid 7, 9) were still running {STOP_WAIT_S}s after the launch ended and were killed"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


FAKE_SRUN = """#!/usr/bin/env bash
# srun on one machine: one task per node of the allocation, each with its SLURM_NODEID.
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_NNODES; i++)); do SLURM_NODEID=$i "$@" & pids+=($!); done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""


@pytest.mark.slow
def test_slurm_script_on_two_nodes_matches_one_node(tmp_path):
    """scripts/train.slurm under a stand-in srun that runs its two node tasks on this machine:
    run_train.sh with NNODES=2, one rank per node, static rendezvous on localhost. The same
    losses, bitwise, as one node with two ranks."""
    steps = ("--training.steps", "4")
    temp = (
        tmp_path / "temp"
    )  # the launcher's TMPDIR: torchrun makes a folder there unless told not to
    temp.mkdir()
    assert finish(launch(tmp_path, "one-node", *steps, env={"TMPDIR": str(temp)}))[0] == 0
    assert not list(temp.glob("torchelastic_*")), list(temp.iterdir())
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\necho 127.0.0.1\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    slurm = {
        "SLURM_JOB_ID": "4242",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "n[1-2]",
        "SLURM_SUBMIT_DIR": str(REPO),
    }
    env = {
        **os.environ,
        **slurm,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "NPROC": "1",
        "OMP_NUM_THREADS": "1",
    }
    env["MASTER_PORT"] = str(_free_port())
    cmd = ["bash", "scripts/train.slurm", *FAST, *steps, "--job.dump_folder", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "debug_model-slurm4242"  # the default name under SLURM: the job id
    want = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "one-node")}
    got = {r["step"]: r["loss"] for r in read_metrics(run)}
    assert got == want and sorted(got) == [1, 2, 3, 4]
    assert json.loads((run / "run.json").read_text())["world_size"] == 2
    assert sorted(p.name.split("-")[-1] for p in (run / "logs").iterdir()) == ["node0", "node1"]
    (node1,) = (run / "logs").glob("*node1")
    (log,) = node1.rglob("stderr.log")  # the console of node 1's rank
    last = log.read_text().strip().splitlines()[-1]
    assert "done: steps 1-4 in " in last and "the run's summary is rank 0's" in last, last


def test_run_lock_refuses_a_live_holder_and_takes_over_a_stale_one(tmp_path, caplog):
    held = RunLock(tmp_path)
    held.acquire()
    with pytest.raises(
        UserError, match=rf"in use by a live run \(host {socket.gethostname()}, pid {os.getpid()}"
    ):
        RunLock(tmp_path).acquire()
    held.release()
    assert not (tmp_path / "run.lock").exists()
    # A lock file left by a process that is gone (no flock on it): taken over with a warning.
    (tmp_path / "run.lock").write_text(
        json.dumps({"host": socket.gethostname(), "pid": 999999, "started": "x"})
    )
    again = RunLock(tmp_path)
    again.acquire()
    assert "taking over the stale lock" in caplog.text and "pid 999999" in caplog.text
    again.release()
    # Another host's lock, whose flock this host may not see: live while its heartbeat is fresh.
    (tmp_path / "run.lock").write_text(json.dumps({"host": "elsewhere", "pid": 1, "started": "x"}))
    with pytest.raises(UserError, match="host elsewhere, pid 1"):
        RunLock(tmp_path).acquire()
    old = time.time() - STALE_S - 1
    os.utime(tmp_path / "run.lock", (old, old))
    RunLock(tmp_path).acquire()


def test_a_live_run_is_refused_before_its_checkpoints_are_read(tmp_path):
    """A live run writes and prunes its checkpoints: a second launch names the live run, not the
    checkpoint it caught half written, whether it probes the lock (the preflight) or takes it."""
    from titanlite.preflight import plan_run

    step = tmp_path / "held" / "checkpoints" / "step-00000002"
    step.mkdir(parents=True)
    (step / CHECKPOINT_MARKER).write_text("")
    (step / "state.json").write_text("{")
    argv = [
        "--job.dump_folder",
        str(tmp_path),
        "--job.run_name",
        "held",
        "--checkpoint.load_step",
        "2",
    ]
    live = RunLock(tmp_path / "held")
    live.acquire()
    for hold in (None, lambda cfg, run_dir: RunLock(run_dir).acquire()):
        with pytest.raises(UserError, match=f"in use by a live run .*pid {os.getpid()}"):
            plan_run(argv, world_size=1, hold=hold)
    live.release()
    with pytest.raises(UserError, match="step-00000002 is damaged"):
        plan_run(argv, world_size=1)


def test_checkpoint_space_and_multi_node_names(tmp_path, monkeypatch):
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=3 * 2**30))
    check_checkpoint_space(tmp_path / "ck", 2 * 2**30, "a model")
    with pytest.raises(
        UserError, match=r"has 3.0 GiB free but one checkpoint of a model needs about 4.0 GiB"
    ):
        check_checkpoint_space(tmp_path / "ck", 4 * 2**30, "a model")
    cfg = load_config(None)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(UserError, match="needs --job.run_name"):
        run_name(cfg, "train_configs/llama_1b.toml", nnodes=2)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert run_name(cfg, "train_configs/llama_1b.toml", nnodes=2) == "llama_1b-slurm4242"


@pytest.mark.parametrize(
    "data, name",
    [
        ("{d}/mine.jsonl", "mine"),
        ("{d}/corpus", "corpus"),
        ("{d}/a.txt:0.7,{d}/b.parquet:0.3", "a+b"),
        ("{d}/my notes (v2).txt", "my-notes-v2"),
        ("{d}/" + "x" * 90 + ".txt", "x" * 64),
    ],
)
@pytest.mark.parametrize("config", [None, "train_configs/debug_model.toml", "with_data.toml"])
@pytest.mark.parametrize("slurm", [None, "4242"])
def test_a_run_on_data_its_config_does_not_hold_is_named_after_the_data(
    tmp_path, monkeypatch, data, name, config, slurm
):
    """No run name: a run on --data.path that its config does not hold is named after the data
    (file stem, folder name, a mixture's names), on any config, at a rehearsal and under SLURM;
    a config's own data.path keeps the config's name."""
    (tmp_path / "corpus").mkdir()
    own = tmp_path / "with_data.toml"
    own.write_text(f'[data]\npath = "{tmp_path / "own.jsonl"}"\n')
    path = str(own) if config == "with_data.toml" else config and str(REPO / config)
    if slurm is None:
        monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    else:
        monkeypatch.setenv("SLURM_JOB_ID", slurm)
    cfg = load_config(path, ["--data.path", data.format(d=tmp_path)])
    got = run_name(cfg, path)
    assert got.startswith(f"{name}-") and (slurm is None or got == f"{name}-slurm{slurm}"), got
    cfg.rehearsal.world = 8
    assert run_name(cfg, path).startswith(f"{name}-rehearse8-")
    stem = Path(path).stem if path else "default"
    assert run_name(load_config(path), path).startswith(f"{stem}-")
    if config == "with_data.toml":  # the config's own data, typed again on the command line
        again = load_config(path, ["--data.path", str(tmp_path / "own.jsonl")])
        assert run_name(again, path).startswith("with_data-")


@pytest.mark.parametrize("owner_there", [True, False])
def test_another_runs_checkpoints_are_refused_with_a_fix_that_works(tmp_path, owner_there):
    """A checkpoint.folder outside the run folder that another run wrote: the fix names that run
    only where it still is (a moved or removed run is not offered), and a new run from one
    gets a checkpoint.folder of its own (in this one it would be refused again)."""
    from titanlite.components.checkpoint.index import step_dir
    from titanlite.components.checkpoint.resume import check_resumable

    owner, folder = tmp_path / "outputs" / "old-name", tmp_path / "elsewhere" / "ck"
    if owner_there:
        owner.mkdir(parents=True)
    step = step_dir(folder, 6)
    step.mkdir(parents=True)
    (step / "state.json").write_text(json.dumps({"run_folder": str(owner), "identity": {}}))
    mine = tmp_path / "outputs" / "new-name"
    mine.mkdir(parents=True)
    cfg = load_config(None, ["--checkpoint.folder", str(folder)])
    with pytest.raises(UserError) as e:
        check_resumable(folder, 6, cfg, mine)
    line = str(e.value)
    assert (
        f"checkpoint.initial_load_path = '{step}'" in line and "another checkpoint.folder" in line
    )
    assert ("resume that run" in line) == owner_there, line
    assert owner_there or "no longer there (moved or removed)" in line


def test_preflight_estimates_a_checkpoint_from_the_model_shapes(tmp_path, monkeypatch):
    """llama3 1B: 12 bytes per parameter (float32 weights and AdamW's two moments)."""
    from titanlite.preflight import plan_run

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=2**30))
    argv = [
        "--config",
        "train_configs/llama_1b.toml",
        "--job.dump_folder",
        str(tmp_path),
        "--checkpoint.every",
        "10",
        "--checkpoint.at_end",
        "true",
    ]
    with pytest.raises(
        UserError,
        match=r"llama3 1B \(1.04B parameters, weights and AdamW state\) needs about 11.6 GiB",
    ):
        plan_run(argv, world_size=8)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize("phase, step", [("eval", 2), ("save", 3), ("start", 3)])
def test_a_stop_at_any_moment_ends_with_the_stop_line_never_0(tmp_path, phase, step):
    """A Ctrl-C raised deterministically (faults.signal_phase) in an eval, a save or the last step:
    exit 130 with the stop line, at most one step late (here none: the host waits in these
    phases anyway, so the ranks settle there). In the exports that end a run: the catalogue."""
    proc = launch(
        tmp_path, f"stop-{phase}", "--training.steps", "3", "--checkpoint.every", "1", "--checkpoint.at_end", "true",
        "--eval.fraction", "0.002", "--eval.every", "1",
        "--faults.signal_step", str(step), "--faults.signal_phase", phase,
    )  # fmt: skip
    code, out, err = finish(proc)
    last = err.strip().splitlines()[-1]
    assert code == 130, (code, err[-2000:])
    ending = (
        "as the run ended: its steps up to 3"
        if step == 3
        else f"after step {step}; checkpoint step-{step}"
    )
    assert last.startswith("titanlite: stopped by SIGINT ") and ending in last, last
    assert "Traceback" not in err and workers_of(tmp_path) == []


@pytest.mark.slow
def test_a_full_disk_under_the_run_folder_stops_it_in_one_line_with_every_record_whole(tmp_path):
    """The run folder's writes fail as on a full disk from step 3 (faults.write_error, injected at
    the writer: half a record lands, then ENOSPC): exit 3, one line naming the disk and what was
    kept, no half record in any file."""
    proc = launch(tmp_path, "full", "--training.steps", "5", "--checkpoint.every", "2", "--checkpoint.at_end", "true",
                  "--faults.write_error", "full", "--faults.write_error_step", "3")  # fmt: skip
    code, out, err = finish(proc)
    last = err.strip().splitlines()[-1]
    assert (
        code == 3 and last.startswith("titanlite: stopped: writing ") and "disk full under" in last
    ), err[-2000:]
    assert "records up to step 2 are whole" in last and "newest checkpoint is step 2" in last, last
    assert [r["step"] for r in read_metrics(tmp_path / "full")] == [1, 2]
    for name in ("diagnostics.jsonl", "events.jsonl"):
        text = (tmp_path / "full" / name).read_text() if (tmp_path / "full" / name).exists() else ""
        assert all(json.loads(line) for line in text.splitlines()), name
    assert "Traceback" not in err


def test_a_lost_connection_names_a_peer_that_ended_never_one_still_computing(monkeypatch):
    """Generated heartbeat records (each peer behind, at the step in this rank's phase or in
    another, or never seen): a connection lost is a peer that ended; the line says so at once
    (no wait: the launcher may stop this rank), names the peers behind or elsewhere, and never
    calls them still computing or hung."""
    import random

    from titanlite.distributed import liveness

    slept: list[float] = []  # the waits explain() makes: none but the heartbeat's period (0 here)
    monkeypatch.setattr(liveness.time, "sleep", slept.append)
    rng = random.Random(0)
    for case in range(300):
        beat = object.__new__(liveness.Heartbeat)
        beat.rank, beat.world, beat.timeout_s, beat._period = 0, rng.randint(2, 12), 5.0, 0.0
        seen = {0: (5, 1, "eval")}
        for r in range(1, beat.world):
            seen[r] = rng.choice(
                [None, (4, 1, "eval"), (5, 1, "eval"), (5, 1, "forward"), (5, 1, "data")]
            )
        beat._read = lambda seen=seen: dict(seen)
        liveness._current[0] = "eval"
        line = beat.explain(5, "lost")
        assert not any(slept), (case, slept)
        assert "a peer ended" in line and "still computing" not in line and "hung" not in line, line
        odd = [r for r in range(1, beat.world) if seen[r] != (5, 1, "eval")]
        if odd:
            assert f"most likely among rank(s) {', '.join(map(str, odd[:8]))}" in line, (seen, line)
        else:
            assert "most likely" not in line, line
    liveness._current[0] = "set-up"


def test_a_peer_lost_in_the_set_up_is_one_line_never_gloos_traceback(monkeypatch, capsys):
    """A rank that ends during the set-up (a stop before the first step, a failure) breaks its
    peers' collective of the set-up (data preparation): each error text of a lost or timed-out
    peer, at any world size, ends the rank with exit 4 and one line; another error, or a single
    rank, is raised as it was."""
    from types import SimpleNamespace

    from titanlite import train
    from titanlite.distributed import liveness
    from titanlite.errors import EXIT_LOST_RANK

    monkeypatch.setattr(train.os, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    monkeypatch.setattr(train, "StopSignals", lambda: None)
    texts = [f"[pair.cc:553] {k.capitalize()} by peer [127.0.0.1]:5016" for k in liveness._LOST]
    texts += ["Timed out waiting 1800000ms for recv operation to complete", "a plain bug"]
    for world, text in ((w, t) for w in (1, 2, 16) for t in texts):
        group = SimpleNamespace(is_initialized=lambda: True, get_world_size=lambda w=world: w)
        monkeypatch.setattr(liveness, "dist", group)  # a world of `world` ranks, seen by liveness

        def trainer(*args, text=text):
            raise RuntimeError(text)

        monkeypatch.setattr(train, "Trainer", trainer)
        ours = world > 1 and text != "a plain bug"
        try:
            train.main([])
            raise AssertionError("main returned")
        except SystemExit as e:
            assert ours and e.code == EXIT_LOST_RANK, (world, text, e.code)
        except RuntimeError as e:
            assert not ours and str(e) == text, (world, text)
        err = capsys.readouterr().err.strip().splitlines()
        if ours:
            assert len(err) == 1 and "a collective of the set-up" in err[0], err
