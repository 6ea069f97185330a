"""Signals at every moment from the launcher's first line to its last; killed, hung and frozen ranks;
every `debug.*` fault."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

from faults.fixtures import (
    at_step,
    continues,
    data,
    in_save,
    metrics_step,
    no_orphans,
    own_cache,
    shared_run,
    stop_case,
    workers,
)
from faults.harness import (
    CKPT,
    HANG_S,
    RESUME6,
    Broke,
    Catalogue,
    Live,
    case,
    expect,
    losses,
    unchanged,
)

stop_case(
    "SIGTERM to the launcher during a step",
    at_step(3, signal.SIGTERM, who="launcher"),
    143,
    "stopped by SIGTERM",
)
stop_case(
    "Ctrl-C (SIGINT to the process group)", at_step(3, signal.SIGINT), 130, "stopped by SIGINT"
)
stop_case(
    "Ctrl-C twice 0.3 s apart", at_step(3, signal.SIGINT, signal.SIGINT, gap=0.3), 130, "SIGINT"
)
stop_case(
    "SIGTERM while a checkpoint is being written",
    in_save(signal.SIGTERM),
    143,
    "SIGTERM",
    ("--training.steps", "6", "--checkpoint.every", "1", "--checkpoint.at_end", "true"),
)
stop_case(
    "SIGTERM twice during a save",
    in_save(signal.SIGTERM, signal.SIGTERM),
    143,
    "SIGTERM",
    ("--training.steps", "6", "--checkpoint.every", "1", "--checkpoint.at_end", "true"),
)
stop_case("SIGKILL of worker rank 1", at_step(3, signal.SIGKILL, who="1"), 1, "rank 1")
stop_case("kill -9 of the launcher's process group", at_step(3, signal.SIGKILL), -9, "")
stop_case(
    "kill -9 of the launcher alone during an async save",
    in_save(signal.SIGKILL),
    -9,
    "",
    (
        "--training.steps",
        "6",
        "--checkpoint.every",
        "1",
        "--checkpoint.at_end",
        "true",
        "--checkpoint.async_mode",
        "async",
    ),
)
stop_case("SIGTERM to worker rank 1 alone", at_step(3, signal.SIGTERM, who="1"), 143, "SIGTERM")
stop_case(
    "SIGTERM to the launcher and every worker at once (SLURM)",
    at_step(3, signal.SIGTERM, who="everyone"),
    143,
    "SIGTERM",
)
stop_case("SIGHUP to the launcher", at_step(3, signal.SIGHUP, who="launcher"), 143, "")
stop_case(
    "SIGSTOP of worker rank 1 (a frozen rank)",
    at_step(3, signal.SIGSTOP, who="1"),
    4,
    "rank(s) 1 stopped responding",
    (*RESUME6, "--comm.timeout_s", "10"),
)


@case("signals/faults", "kill -9 of the group, SFT packed with a loader worker")
def _(c: Catalogue) -> None:
    args = (
        "--training.steps",
        "6",
        *CKPT,
        "--data.mode",
        "sft",
        "--data.path",
        str(data(c) / "sft.jsonl"),
        "--data.packing",
        "true",
        "--data.num_workers",
        "1",
    )
    ref = c.dump("sft-ref")
    expect(c.start(ref, args).finish(), 0)
    dump = c.dump("sft-kill")
    live = c.start(dump, args)
    at_step(3, signal.SIGKILL)(c, dump, live)
    live.finish()
    no_orphans(dump)
    expect(c.start(dump, args).finish(), 0)
    if losses(dump / "run") != losses(ref / "run"):
        raise Broke("not bitwise after the rerun")


@case("signals/faults", "SIGTERM during data preparation")
def _(c: Catalogue) -> None:
    env = own_cache(c, c.work / "cache-prep-stop")
    dump = c.dump("prep-stop")
    live = c.start(dump, ("--training.steps", "2"), env=env)
    live.wait_for(lambda: any(Path(env["TITANLITE_CACHE"]).glob("prepared-*/.shard-*")))
    live.signal(signal.SIGTERM)
    expect(live.finish(), 143, "before the first step; nothing was written")
    unchanged({}, dump)


@case("signals/faults", "Ctrl-C with checkpointing off")
def _(c: Catalogue) -> None:
    dump = c.dump("ctrl-c-no-ckpt")
    live = c.start(dump, ("--training.steps", "6"))
    at_step(2, signal.SIGINT)(c, dump, live)
    expect(live.finish(), 130, "checkpointing is off")


for _delay in (1.0, 2.0, 3.5):

    @case("signals/faults", f"Ctrl-C {_delay} s after the launch")
    def _(c: Catalogue, delay=_delay) -> None:
        dump = c.dump(f"ctrl-c-{delay}")
        live = c.start(dump, ("--training.steps", "6", *CKPT))
        time.sleep(delay)
        live.signal(signal.SIGINT)
        r = live.finish()
        expect(r, 130, "stopped by SIGINT")
        if "before the first step" in r.last:
            unchanged({}, dump)
        else:
            continues(c, dump)


for _sig, _after in (
    (signal.SIGINT, 0.0),
    (signal.SIGINT, 0.3),
    (signal.SIGINT, 0.6),
    (signal.SIGTERM, 0.3),
):

    @case("signals/faults", f"{_sig.name} while the workers import torch (+{_after} s)")
    def _(c: Catalogue, sig=_sig, after=_after) -> None:
        dump = c.dump(f"early-{sig.name}-{after}")
        live = c.start(dump, ("--training.steps", "6", *CKPT))
        live.wait_for(lambda: bool(workers(dump)))
        time.sleep(after)
        live.signal(sig)
        r = live.finish()
        expect(r, 128 + sig, f"stopped by {sig.name}")
        if "before the first step" in r.last:
            unchanged({}, dump)
        no_orphans(dump)


for _i in range(3):

    @case("signals/faults", f"Ctrl-C as done: is printed ({_i + 1})")
    def _(c: Catalogue, i=_i) -> None:
        dump = c.dump(f"ctrl-c-done-{i}")
        live = c.start(dump, ("--training.steps", "3"))
        live.wait_for(lambda: live.saw("done:"))
        time.sleep(0.05 * i)
        live.signal(signal.SIGINT)
        expect(live.finish(), 0)


def fault(
    name: str,
    args: tuple[str, ...],
    code: int,
    says: str,
    env: dict | None = None,
    then: bool = True,
) -> None:
    @case("signals/faults", name)
    def _(c: Catalogue) -> None:
        dump = c.dump(name)
        expect(c.start(dump, (*RESUME6, *args), env=env).finish(), code, says)
        no_orphans(dump)
        if then:
            continues(c, dump)


fault(
    "faults.sigkill_step 3 of rank 1",
    ("--faults.sigkill_step", "3", "--faults.sigkill_rank", "1"),
    1,
    "rank 1",
)
fault(
    "faults.sigkill_step 3 of rank 1 with MAX_RESTARTS=1",
    ("--faults.sigkill_step", "3", "--faults.sigkill_rank", "1"),
    0,
    "",
    env={"MAX_RESTARTS": "1"},
    then=False,
)
fault("faults.signal_step 3", ("--faults.signal_step", "3"), 130, "SIGINT")
fault(
    "faults.hang_step 3 of rank 1, comm.timeout_s 5",
    ("--faults.hang_step", "3", "--faults.hang_rank", "1", "--comm.timeout_s", "5"),
    4,
    "rank(s) 1 did not arrive",
)
fault("faults.sigkill_in_save 4", ("--faults.sigkill_in_save", "4"), 1, "rank 0")
fault("faults.fail_save_step 4", ("--faults.fail_save_step", "4"), 3, "disk full")
fault("faults.nan_loss_step 3", ("--faults.nan_loss_step", "3"), 3, "non-finite", then=False)
for _phase in ("data", "forward", "backward", "optimizer", "checkpoint"):
    fault(
        f"a rank frozen (SIGSTOP) in {_phase}",
        ("--faults.freeze_step", "4", "--faults.freeze_phase", _phase, "--comm.timeout_s", "8"),
        4,
        f"rank(s) 1 stopped responding (rank 1 last seen in {_phase} of step",
    )


# a stop that lands as the run ends: never exit 0, at most one step late
def _late_stop(
    name: str, wait: Callable[[Path, Live], bool], sig: int, args: tuple[str, ...]
) -> None:
    @case("signals/faults", name)
    def _(c: Catalogue) -> None:
        dump = c.dump(name)
        live = c.start(dump, args)
        live.wait_for(lambda: wait(dump, live))
        live.signal(sig)
        r = live.finish()
        expect(r, 128 + sig, f"stopped by {signal.Signals(sig).name}")
        no_orphans(dump)


_EVAL = ("--training.steps", "6", *CKPT, "--eval.fraction", "0.002")
_late_stop("Ctrl-C in the last step", lambda d, live: metrics_step(d, 5)(), signal.SIGINT, RESUME6)
_late_stop(
    "Ctrl-C during the final eval", lambda d, live: metrics_step(d, 6)(), signal.SIGINT, _EVAL
)


@case(
    "signals/faults",
    "Ctrl-C during the Hugging Face export at the end (faults.signal_phase export)",
)
def _(c: Catalogue) -> None:
    """In the exports, not after them: the moment the signal lands is the run's own (a signal
    from outside may land after the run's last look, when "done:" says all is done: exit 0)."""
    dump = c.dump("export-ctrl-c")
    at_export = ("--faults.signal_step", "4", "--faults.signal_phase", "export")
    expect(
        c.start(
            dump, ("--training.steps", "4", "--checkpoint.export_hf", "true", *at_export)
        ).finish(),
        130,
        "as the run ended",
    )
    if not (dump / "run" / "hf" / "model.safetensors").is_file():
        raise Broke("the export the run was in is not whole")
    no_orphans(dump)


@case("signals/faults", "Ctrl-C to generate.py while it generates")
def _(c: Catalogue) -> None:
    prompts = [a for i in range(64) for a in ("--prompt", f"def f{i}(")]
    live = c.start_script("generate", str(shared_run(c)), *prompts, "--max-new-tokens", "1000")
    time.sleep(4)  # loading, or generating: either way a Ctrl-C is one line
    if live.proc.poll() is not None:
        raise Broke(
            f"it ended (exit {live.proc.poll()}) before the Ctrl-C; the case needs a longer generation"
        )
    live.signal(signal.SIGINT)
    expect(live.finish(), 130, "generate")


@case("signals/faults", "Ctrl-C to invariance.py during a run")
def _(c: Catalogue) -> None:
    out = c.dump("invariance-ctrl-c")
    live = c.start_script(
        "invariance", "--config", "train_configs/debug_model.toml", "--dp", "1", "2", "--steps", "30",
        "--out", str(out / "o"), "--training.seq_len", "128",
    )  # fmt: skip
    live.wait_for(
        lambda: live.saw("step 1/") or any((out / "o").glob("*/metrics.jsonl")), timeout=HANG_S
    )
    live.signal(signal.SIGINT)
    expect(live.finish(), 130, "invariance")
