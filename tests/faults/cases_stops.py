"""A stop by every delivery at every moment, generated: SIGINT and SIGTERM, to the launcher
alone, to its process group (a terminal's Ctrl-C), to the launcher and then its group (`timeout
-s`, CI systems, schedulers), to the group twice, to one worker rank, to one of a rank's
DataLoader workers; in every phase of a run, of a rehearsal and of a script that launches ranks.
Each ends in one line of titanlite's, the documented exit code (128 + the signal), no process
left, and where the line says nothing was written, nothing was."""

from __future__ import annotations

import itertools
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from faults.fixtures import metrics_step, no_orphans, own_cache, workers
from faults.harness import HANG_S, Broke, Catalogue, Live, case, expect, unchanged

Deliver = Callable[[Path, Live, int], None]
_N = itertools.count()  # each case's dump folder
Ready = Callable[[Catalogue, Path, Live], bool]


def children_of(pid: int) -> list[int]:
    """The live children of `pid` (a rank's DataLoader workers)."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            state, ppid = (d / "stat").read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue
        if d.name.isdigit() and int(ppid) == pid and state != "Z":
            found.append(int(d.name))
    return found


def rank_pid(dump: Path, rank: int) -> int:
    """Worker rank `rank`'s pid: its DataLoader workers share its command line and environment,
    but only the rank leads a session (torchrun starts each in one of its own)."""
    for d in Path("/proc").iterdir():
        try:
            cmd = (d / "cmdline").read_bytes()
            ours = b"titanlite.train" in cmd and b"titanlite.launch" not in cmd
            if not (d.name.isdigit() and ours and str(dump).encode() in cmd):
                continue
            env = (d / "environ").read_bytes().split(b"\0")
            if f"RANK={rank}".encode() in env and os.getsid(int(d.name)) == int(d.name):
                return int(d.name)
        except (OSError, ProcessLookupError):
            continue
    raise Broke(f"no worker rank {rank} running at the moment the case needs")


def _twice(dump: Path, live: Live, sig: int) -> None:
    live.signal(sig)
    time.sleep(0.3)  # the moment of the second: a user's second Ctrl-C
    live.signal(sig)


def _to_loader_worker(of: Callable[[Path, Live], int]) -> Deliver:
    def deliver(dump: Path, live: Live, sig: int) -> None:
        live.wait_for(lambda: bool(children_of(of(dump, live))))  # data.num_workers = 1
        os.kill(children_of(of(dump, live))[0], sig)

    return deliver


DELIVERIES: dict[str, Deliver] = {
    "the launcher alone": lambda dump, live, sig: os.kill(live.proc.pid, sig),
    "its process group": lambda dump, live, sig: live.signal(sig),
    "the launcher, then its group": lambda dump, live, sig: (
        os.kill(live.proc.pid, sig),
        live.signal(sig),
    ),
    "its process group twice": _twice,
    "worker rank 1": lambda dump, live, sig: os.kill(rank_pid(dump, 1), sig),
}
TO_LOADER = "a DataLoader worker of rank 1"
LOADER = _to_loader_worker(lambda dump, live: rank_pid(dump, 1))

RUN = (
    "--training.steps", "100", "--checkpoint.every", "2", "--checkpoint.at_end", "true",
    "--data.num_workers", "1", "--eval.fraction", "0.002", "--eval.every", "4",
)  # fmt: skip


def _saving(c: Catalogue, dump: Path, live: Live) -> bool:
    return metrics_step(dump, 2)() and any((dump / "run" / "checkpoints").glob("*.tmp"))


# (phase, its moment, whether the rank's DataLoader workers exist then, its own cache)
PHASES: list[tuple[str, Ready, bool, bool]] = [
    ("the workers' imports", lambda c, dump, live: len(workers(dump)) == 2, False, False),
    (
        "data preparation",
        lambda c, dump, live: any((c.work / f"cache-{dump.name}").glob("prepared-*/.shard-*")),
        False,
        True,
    ),
    ("the set-up and first step", lambda c, dump, live: (dump / "run" / "config.toml").is_file(), True, False),
    ("a step", lambda c, dump, live: metrics_step(dump, 3)(), True, False),
    ("an eval", lambda c, dump, live: metrics_step(dump, 4)(), True, False),
    ("a save", _saving, True, False),
]  # fmt: skip


def _stopped(dump: Path, r, sig: int) -> None:
    """The promise of every stop: exit 128 + sig, titanlite's one line, no worker left, and
    nothing written where the line says so."""
    expect(r, 128 + sig, "stopped")
    no_orphans(dump)
    if "nothing was written" in r.last or "nothing was kept" in r.last:
        unchanged({}, dump)


for _phase, _ready, _loaders, _own in PHASES:
    for _how, _deliver in [*DELIVERIES.items(), *([(TO_LOADER, LOADER)] if _loaders else [])]:
        for _sig in (signal.SIGINT, signal.SIGTERM):
            _n = next(_N)

            @case("stops", f"{_sig.name} to {_how} during {_phase}")
            def _(c: Catalogue, ready=_ready, deliver=_deliver, sig=_sig, own=_own, n=_n) -> None:
                dump = c.dump(f"stop-{n}")
                env = own_cache(c, c.work / f"cache-{dump.name}") if own else None
                live = c.start(dump, RUN, env=env)
                live.wait_for(lambda: ready(c, dump, live), timeout=HANG_S)
                deliver(dump, live, sig)
                _stopped(dump, live.finish(), sig)


REHEARSAL = ("--rehearse", "8", "--rehearsal.steps", "30", "--data.num_workers", "1")
REHEARSAL_PHASES: list[tuple[str, Ready]] = [
    ("set-up", lambda c, dump, live: (dump / "run" / "rehearsal.json").is_file()),
    ("steps", lambda c, dump, live: live.saw("rehearsal: step 2/30 done")),
]
REHEARSAL_DELIVERIES = {
    **{k: v for k, v in DELIVERIES.items() if k != "worker rank 1"},  # it runs in the launcher
    TO_LOADER.replace("of rank 1", "of the rehearsal"): _to_loader_worker(lambda d, live: live.proc.pid),
}  # fmt: skip
for _phase, _ready in REHEARSAL_PHASES:
    for _how, _deliver in REHEARSAL_DELIVERIES.items():
        for _sig in (signal.SIGINT, signal.SIGTERM):
            _n = next(_N)

            @case("stops", f"{_sig.name} to {_how} during a rehearsal's {_phase}")
            def _(c: Catalogue, ready=_ready, deliver=_deliver, sig=_sig, n=_n) -> None:
                dump = c.dump(f"stop-{n}")
                live = c.start(dump, REHEARSAL)
                live.wait_for(lambda: ready(c, dump, live), timeout=HANG_S)
                deliver(dump, live, sig)
                r = live.finish()
                expect(r, 128 + sig, "stopped")
                unchanged({}, dump)  # a rehearsal's report comes whole at its end, or nothing
                if children_of(live.proc.pid):
                    raise Broke("the rehearsal's DataLoader workers outlived it")


for _how in (
    "the launcher alone", "its process group", "the launcher, then its group", "its process group twice",
):  # fmt: skip
    for _sig in (signal.SIGINT, signal.SIGTERM):
        _n = next(_N)

        @case(
            "stops",
            f"{_sig.name} to {_how.replace('launcher', 'script')} while invariance.py runs its ranks",
        )
        def _(c: Catalogue, deliver=DELIVERIES[_how], sig=_sig, n=_n) -> None:
            out = c.dump(f"stop-{n}")
            live = c.start_script(
                "invariance", "--config", "train_configs/debug_model.toml", "--dp", "1", "2",
                "--steps", "30", "--out", str(out / "o"), "--training.seq_len", "128",
            )  # fmt: skip
            live.wait_for(lambda: any((out / "o").glob("*/metrics.jsonl")), timeout=HANG_S)
            deliver(out, live, sig)
            expect(live.finish(), 128 + sig, "invariance")
            no_orphans(out)
