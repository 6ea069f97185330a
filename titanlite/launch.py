"""torchrun, the titanlite way: `python -m titanlite.launch [torchrun args] -m titanlite.train
[train args]`, or (run_train.sh) `... --from-env --caller-cwd DIR [train args]`, torchrun's
arguments then from NPROC, NNODES, ... First the preflight, the run folder's name fixed (a
restarted worker group reopens it) and node 0's run lock; then torchrun's agent, every rank's
output kept in <run>/logs/<launch>-node<k>/attempt_<n>/<local rank>/, SIGINT / SIGTERM passed
on to the workers (they checkpoint and exit 128 + the signal; a second one kills them), and no
restart after an exit a restart cannot fix. Exit code: the workers', or 1 on a crash. Its last
line comes once every process it started has exited (components/run/children.py).
"""

from __future__ import annotations

import os
import signal
import sys

from titanlite.errors import BEFORE_FIRST_STEP, Stopped, report, stopped_before_first_step


def _stopped_while_importing(signum: int, frame) -> None:
    """A stop while this module imports torch (seconds): nothing exists yet to clean up."""
    os._exit(report(stopped_before_first_step(signum)))


for _sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(_sig, _stopped_while_importing)

if __name__ == "__main__" and sys.argv[1:2] == ["--from-env"]:  # before torch is imported
    from titanlite.config.command_line import first_look, wants_help
    from titanlite.errors import UserError

    if wants_help(sys.argv[2:]):  # (it steps over run_train.sh's --caller-cwd DIR as a flag's)
        from titanlite.preflight import main as preflight

        sys.exit(preflight(sys.argv[2:]))  # the usage and every config key
    try:  # a typo in a flag, a key or a path: one line in a moment, not after torch's import
        from titanlite.datasets.spec import check_data_files

        check_data_files(first_look(sys.argv[2:]))
    except UserError as e:
        sys.exit(report(e))

# the rest after the handler: importing torch takes seconds
import contextlib
import logging
import shutil
import time
import uuid
from pathlib import Path

import torch.distributed.elastic.multiprocessing.api as mp_api
import torch.distributed.launcher.api as launcher_api
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import config_from_args, get_args_parser

from titanlite.components.checkpoint.index import quarantine_damaged, set_aside_abandoned
from titanlite.components.run.children import adopt_orphans, children, killed_line, reap
from titanlite.components.run.lock import HELD_ENV, RunLock
from titanlite.components.run.plan import checkpoint_folder
from titanlite.components.run.torchrun import (
    NO_RESTART,
    STOP_SIGNALS,
    cause,
    how,
    printed_by,
    report_failure,
    torchrun_args,
)
from titanlite.components.run.undo import FolderSnapshot
from titanlite.config import JobConfig
from titanlite.config.command_line import CALLER_ENV, launcher_words
from titanlite.config.manager import NOTES_SHOWN_ENV
from titanlite.errors import ENDINGS, EXIT_TRAINING, UserError, exit_code
from titanlite.preflight import plan_run
from titanlite.tools.paths import existing_parent
from titanlite.tools.process import AGENT_PID_ENV, init_logging

FAILURE_GRACE_S = 5  # after a worker failed, the others' SIGTERM before SIGKILL


class _Agent(LocalElasticAgent):
    """torchrun's agent, which skips hopeless restarts and says when it restarts."""

    current: _Agent | None = None
    stopping = 0  # the stop signal passed on to the workers; 0: none
    starting = False  # the workers are being started: a signal waits until their pids are known
    deferred: list[int] = []  # the signals that came meanwhile, in order
    ending = 0  # the signal that ends the launch (raised once); 0: none yet
    last_failure = ""  # the line of the failure a restart follows

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _Agent.current = self
        self.stopped: set[int] = set()  # local ranks torchrun itself stopped after another failed

    def _monitor_workers(self, worker_group):
        result = super()._monitor_workers(worker_group)
        if result.is_failed():
            codes = {f.exitcode for f in result.failures.values()}
            if _Agent.stopping or codes & NO_RESTART:
                self._remaining_restarts = 0
            rank, first = cause(result.failures, self.stopped)
            self.last_failure = f"rank {rank} {how(first.exitcode)}"
        return result

    def _start_workers(self, worker_group):
        # Started with the stop signals blocked (inherited): one that comes while they import
        # torch stays pending until their handler is installed (components/run/stop.py).
        # The mask is this thread's; the launcher's other threads still take a signal, which Python
        # then handles here, in the middle of the start: it waits (_Agent.deferred) until the
        # workers' pids are known, or workers started before it would live on unstopped.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        _Agent.starting = True
        try:
            pids = super()._start_workers(worker_group)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            _Agent.starting = False
        # When a worker fails, torchrun stops the others with a 30 s grace before SIGKILL whatever
        # --shutdown-timeout says; they wait on the dead peer in a collective, which no grace ends.
        ctx, self.stopped = self._pcontext, set()
        close = ctx.close

        def close_quickly(death_sig=None, timeout=30) -> None:
            # the ranks still alive here are stopped by torchrun: their SIGTERM or SIGKILL is an
            # effect of the failure, never its cause (a hung rank is killed after its peer's exit 4)
            handlers = getattr(ctx, "subprocess_handlers", {})
            self.stopped |= {lr for lr, h in handlers.items() if h.proc.poll() is None}
            close(death_sig, min(timeout, FAILURE_GRACE_S))

        ctx.close = close_quickly
        while _Agent.deferred:
            _on_signal(_Agent.deferred.pop(0), None)
        return pids

    def _restart_workers(self, worker_group) -> None:
        left = self._remaining_restarts
        line = f"titanlite: {self.last_failure}; restarting the workers ({left} restart(s) left after this one); they resume from the last complete checkpoint"
        print(line, file=sys.stderr, flush=True)
        super()._restart_workers(worker_group)


def _on_signal(signum: int, frame) -> None:
    """The first SIGINT/SIGTERM goes on to the workers, which stop after their step with a
    checkpoint; a second one (or one before the workers run) kills them and ends the launch."""
    if _Agent.starting:
        _Agent.deferred.append(signum)
        return
    agent = _Agent.current
    pids = list(agent._pcontext.pids().values()) if agent and agent._pcontext else []
    first = bool(pids) and not _Agent.stopping
    if first:
        _Agent.stopping = signum
        agent._remaining_restarts = 0
    forward = signum if signum in STOP_SIGNALS else signal.SIGTERM  # SIGHUP, SIGQUIT
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            if first:  # the rank alone: it stops its DataLoader workers itself
                os.kill(pid, forward)
            else:  # the rank's whole process group, its DataLoader workers included
                os.killpg(pid, signal.SIGKILL)
    if not first:
        if _Agent.ending:  # the launch ends already: a later signal must not raise in its clean-up
            return
        _Agent.ending = signum
        sig = signal.Signals(signum)
        raise SignalException(f"launcher got {sig.name}", sigval=sig)


class _RunLogs(DefaultLogsSpecs):
    """torchrun's per-rank log files, in a folder of the run folder (not a random temp one)."""

    def _make_log_dir(self, log_dir: str | None, rdzv_run_id: str) -> str:
        return str(log_dir)


class _NoTag(str):
    """An empty console tag per line (torchrun ignores a falsy one): titanlite's lines have one."""

    def __bool__(self) -> bool:
        return True


def _launcher_options(argv: list[str]) -> tuple[bool, list[str]]:
    """(--from-env given, the rest) after the launcher's own leading options; --caller-cwd DIR
    becomes the workers' caller folder (relative paths are read there; a fork's module too)."""
    from_env = argv[:1] == ["--from-env"]
    if from_env:
        argv = argv[1:]
    if argv[:1] == ["--caller-cwd"]:
        if len(argv) < 2 or not Path(argv[1]).is_dir():
            raise UserError(
                f"--caller-cwd needs the folder the command was run in, got {argv[1:2]}"
            )
        caller = str(Path(argv[1]).absolute())
        os.environ[CALLER_ENV] = caller
        if caller not in sys.path:  # a fork's module beside the user's config (model.import_module)
            sys.path.append(caller)
            path = os.environ.get("PYTHONPATH")
            os.environ["PYTHONPATH"] = f"{path}{os.pathsep}{caller}" if path else caller
        argv = argv[2:]
    return from_env, argv


def main(argv: list[str]) -> int:
    init_logging()  # the launcher's own warnings (a stale run lock taken over) look like the workers'
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    for sig in STOP_SIGNALS:
        signal.signal(sig, _on_signal)
    mp_api._terminate_process_handler = _on_signal  # what torchrun's agent installs as it starts
    launcher_api.LocalElasticAgent = _Agent
    _Agent.stopping = _Agent.ending = 0
    ours = set(children())  # the children it already has are not the launch's (main run in a test)
    lock, made, log_dir, code, early = None, None, None, 1, False
    ending: Exception | None = None  # its own last line: said once its processes are gone
    try:
        from_env, argv = _launcher_options(argv)
        if from_env:  # run_train.sh: torchrun's arguments from the environment
            rdzv, env = torchrun_args(os.environ)
            os.environ.update(env)
            argv = [*rdzv, "-m", "titanlite.train", *argv]
        args = get_args_parser().parse_args(argv)
        args.training_script_args = launcher_words(args.training_script_args)
        try:
            nnodes = int(str(args.nnodes).split(":")[-1])
            world = nnodes * int(args.nproc_per_node)
        except ValueError:
            raise UserError(
                f"titanlite.launch needs numbers for --nnodes and --nproc-per-node, got {args.nnodes!r} and {args.nproc_per_node!r}"
            ) from None

        def hold(cfg: JobConfig, run_dir: Path) -> None:
            """Make the run folder and, on node 0, take its lock (then the preflight reads its checkpoints)."""
            nonlocal lock, made
            base = existing_parent(run_dir)
            if base != run_dir.absolute():  # the first folder this launch creates
                made = base / run_dir.absolute().relative_to(base).parts[0]
            run_dir.mkdir(parents=True, exist_ok=True)
            if args.node_rank == 0:
                lock = RunLock(run_dir)
                lock.acquire()
                os.environ[HELD_ENV] = str(lock.path.resolve())

        cfg, run_dir = plan_run(args.training_script_args, world, nnodes, hold=hold)
        os.environ[NOTES_SHOWN_ENV] = "1"  # the workers load the same config: no second note
        if cfg.rehearsal.world:  # one process, here, in place of torchrun's workers
            from titanlite.rehearsal.run import rehearse

            cfg.job.run_name = run_dir.name
            # a folder an earlier rehearsal of this name left: as it was, if this one stops
            before = FolderSnapshot(run_dir) if made is None else None
            try:
                rehearse(cfg)
            except ENDINGS as e:  # a signal (Stopped) or a stop the trainer raised: one line
                early = isinstance(e, Stopped)  # its report never came: the run folder goes too
                keeps_nothing = isinstance(e, (Stopped, UserError))  # what its line says
                if before is not None and keeps_nothing:
                    before.restore()
                ending, code = e, exit_code(e)
                return code
            return 0
        if not cfg.job.run_name:  # fixed now, so a restarted worker group reopens this folder
            args.training_script_args += ["--job.run_name", run_dir.name]
        if lock is not None:
            # as the preflight planned: the damaged newest steps set aside, and a rewind's newer ones
            folder = checkpoint_folder(cfg, run_dir)
            quarantine_damaged(folder, cfg.metrics.enable_wandb)
            set_aside_abandoned(folder, cfg.checkpoint.load_step)
        os.environ[AGENT_PID_ENV] = str(os.getpid())
        log_dir = run_dir / "logs" / time.strftime(f"%Y%m%d-%H%M%S-node{args.node_rank}")
        shown = None
        if args.local_ranks_filter:
            shown = {int(r) for r in args.local_ranks_filter.split(",")}
        if args.standalone:  # a rendezvous on a free local port, as torch.distributed.run.run
            args.rdzv_backend, args.rdzv_endpoint = "c10d", "localhost:0"
            args.rdzv_id = str(uuid.uuid4())
        if args.master_port is None:
            args.master_port = 29500
        args.log_dir = os.devnull  # not torchrun's empty temp folder: _RunLogs replaces it
        config, cmd, cmd_args = config_from_args(args)
        config.logs_specs = _RunLogs(log_dir=str(log_dir), tee=Std.ALL, local_ranks_filter=shown)
        config.log_line_prefix_template = config.log_line_prefix_template or _NoTag("")
        try:
            launcher_api.elastic_launch(config=config, entrypoint=cmd)(*cmd_args)
            code = 0
            for sig in STOP_SIGNALS:  # the workers finished after their last look: too late now
                signal.signal(sig, signal.SIG_IGN)
        except ChildFailedError as e:
            code = report_failure(e, log_dir, shown, _Agent.current.stopped)
            stopped = code in {128 + s for s in STOP_SIGNALS}
            early = stopped and printed_by(BEFORE_FIRST_STEP, log_dir, None)
    except UserError as e:
        code = report(e)
    except SignalException as e:
        early = not _Agent.stopping  # the workers never ran
        ending = stopped_before_first_step(int(e.sigval))
        if not early:
            line = f"stopped at once by a second {e.sigval.name}: the workers were killed mid-step; rerun the same command to resume from the last complete checkpoint"
            ending = Stopped(int(e.sigval), line)
        code = exit_code(ending)
    finally:
        ending = _when_all_are_gone(ending, ours)
        if lock is not None:
            lock.release()
        # bad input found by the workers, a stop before the first step, a failure before the run
        # folder was opened (a full disk while the data is prepared): nothing of it to keep
        unopened = log_dir is not None and not (log_dir.parents[1] / "config.toml").exists()
        early = early or code == 2 or (code == EXIT_TRAINING and unopened)
        if early and made is not None:  # leave nothing behind
            shutil.rmtree(made, ignore_errors=True)
        elif early and log_dir is not None:  # ... not even a log folder in an existing run folder
            shutil.rmtree(log_dir, ignore_errors=True)
            with contextlib.suppress(OSError):
                log_dir.parent.rmdir()  # logs/, if this launch's were its only ones
        if ending is not None:
            report(ending)
    return code


def _when_all_are_gone(ending: Exception | None, before: set[int]) -> Exception | None:
    """Wait for every process the launch started to exit (a second stop signal, or STOP_WAIT_S,
    kills those left); the launcher's last line (`ending`), naming any it had to kill."""
    second: list[int] = []
    for sig in STOP_SIGNALS:  # a signal now hurries the wait; nothing is left to stop
        signal.signal(sig, lambda signum, frame: second.append(signum))
    killed = reap(hurry=lambda: bool(second), old=before)
    if not killed:
        return ending
    line = killed_line(killed, bool(second))
    if ending is None:
        print(f"titanlite: {line}", file=sys.stderr, flush=True)
        return None
    if isinstance(ending, Stopped):
        return Stopped(ending.signum, f"{ending}; {line}")
    return type(ending)(f"{ending}; {line}")


if __name__ == "__main__":
    adopt_orphans()  # a rank's children outlive it as the launcher's, which waits for them
    code = main(sys.argv[1:])
    # CPython's finalization restores the default action, which kills: a second Ctrl-C then would
    # turn the exit code just promised into death by the signal
    for _sig in STOP_SIGNALS:
        signal.signal(_sig, signal.SIG_IGN)
    sys.exit(code)
