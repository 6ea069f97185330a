"""What a run writes into its run folder, under a user's hands: files and folders removed or
replaced while it runs, its lock gone, a full disk; and the modes its files get."""

from __future__ import annotations

import shutil
import stat
import time
from collections.abc import Callable
from pathlib import Path

from faults.fixtures import (
    metrics_step,
    mounted,
    own_cache,
    prepared,
)
from faults.harness import (
    Broke,
    Catalogue,
    Live,
    case,
    expect,
    records,
)

LONG = ("--training.steps", "12", "--checkpoint.every", "0")


def _under_a_live_run(
    name: str, act: Callable[[Path], None], code: int, says: str, then=None
) -> None:
    """`act(run folder)` once step 3 is logged; the run must end `code` (0: on to its last
    step; 3: one line holding `says`), every record whole, and `then(run folder)` hold."""

    @case("run folder", name)
    def _(c: Catalogue) -> None:
        dump = c.dump(name)
        live = c.start(dump, LONG)
        live.wait_for(metrics_step(dump, 3))
        act(dump / "run")
        r = live.finish()
        expect(r, code, says)
        for f in ("metrics.jsonl", "diagnostics.jsonl", "events.jsonl"):
            records(dump / "run" / f)
        if then:
            then(dump / "run")


def _logged_to_the_end(run: Path) -> None:
    steps = [r["step"] for r in records(run / "metrics.jsonl")]
    if 12 not in steps:
        raise Broke(
            f"metrics.jsonl ends at step {max(steps, default=0)}: the records after the removal were lost"
        )


def _tb_events(run: Path) -> None:
    if not list((run / "tb").rglob("events.out.tfevents.*")):
        raise Broke("tb/ holds no events after the run")


_under_a_live_run("rm -rf <run>/tb", lambda run: shutil.rmtree(run / "tb"), 0, "", _tb_events)
_under_a_live_run(
    "rm <run>/metrics.jsonl",
    lambda run: (run / "metrics.jsonl").unlink(),
    0,
    "",
    _logged_to_the_end,
)
_under_a_live_run("rm -rf <run>/logs", lambda run: shutil.rmtree(run / "logs"), 0, "")


def _folder_instead(name: str) -> Callable[[Path], None]:
    def act(run: Path) -> None:
        for _ in range(100):  # the run may write the file again between the two calls: again
            (run / name).unlink(missing_ok=True)
            try:
                (run / name).mkdir()
                return
            except FileExistsError:
                continue
        raise Broke(f"{name} could not be replaced by a folder: the run kept writing it again")

    return act


_under_a_live_run(
    "diagnostics.jsonl replaced by a folder",
    _folder_instead("diagnostics.jsonl"),
    3,
    "diagnostics.jsonl",
)


@case("run folder", "rm -rf <run> while it runs")
def _(c: Catalogue) -> None:
    dump = c.dump("rm-run")
    live = c.start(dump, LONG)
    live.wait_for(metrics_step(dump, 3))
    for _ in range(50):  # as a user reruns `rm -rf` that met a file the run wrote meanwhile
        try:
            shutil.rmtree(dump / "run")
            break
        except OSError:
            time.sleep(0.1)
    expect(live.finish(), 3, "run folder")


@case("run folder", "run.lock removed under a live run, then a second launch")
def _(c: Catalogue) -> None:
    dump = c.dump("lock-removed")
    first: Live = c.start(dump, LONG)
    first.wait_for(metrics_step(dump, 2))
    (dump / "run" / "run.lock").unlink()
    second = c.start(dump, LONG).finish()
    first.finish()
    expect(second, 2, "live run")


@case("run folder", "the run folder on a full disk (checkpoints elsewhere)")
def _(c: Catalogue) -> None:
    with mounted(c.work / "mnt-run-full", "256k") as disk:  # full about step 45 (log_every 1)
        elsewhere = c.dump("full-run-ckpt")
        args = (
            "--training.steps",
            "100",
            "--checkpoint.every",
            "50",
            "--checkpoint.at_end",
            "true",
            "--checkpoint.folder",
            str(elsewhere),
        )
        r = c.start(disk / "dump", args).finish()
        expect(r, 3, "disk full")
        for f in ("metrics.jsonl", "diagnostics.jsonl"):
            records(disk / "dump" / "run" / f)


def _modes(root: Path) -> list[str]:
    """Files under `root` without the modes umask 022 gives (0644; executables 0755)."""
    return [
        f"{p.relative_to(root)} {stat.S_IMODE(p.stat().st_mode):o}"
        for p in sorted(root.rglob("*"))
        if p.is_file() and stat.S_IMODE(p.stat().st_mode) & 0o044 != 0o044
    ]


@case("run folder", "a prepared folder's files have the umask's modes")
def _(c: Catalogue) -> None:
    bad = _modes(prepared(c))
    if bad:
        raise Broke(f"not readable by others under umask 022: {', '.join(bad[:4])}")


@case("run folder", "a resumed run's files keep the umask's modes")
def _(c: Catalogue) -> None:
    dump = c.dump("modes-resume")
    env = own_cache(c, c.work / "cache-modes")
    expect(
        c.start(
            dump,
            ("--training.steps", "2", "--checkpoint.every", "2", "--checkpoint.at_end", "true"),
            env=env,
        ).finish(),
        0,
    )
    expect(
        c.start(
            dump,
            ("--training.steps", "4", "--checkpoint.every", "2", "--checkpoint.at_end", "true"),
            env=env,
        ).finish(),
        0,
    )
    bad = _modes(dump / "run") + _modes(Path(env["TITANLITE_CACHE"]))
    if bad:
        raise Broke(f"not readable by others under umask 022: {', '.join(bad[:4])}")
