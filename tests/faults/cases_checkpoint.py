"""Damaged, changed, unfinished and foreign checkpoints; small, full and read-only disks."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

from faults.fixtures import (
    base,
    bitwise,
    config_edit,
    copy_hf,
    data,
    garbage,
    hf_args,
    mounted,
    resumed_by_hand,
    truncate,
)
from faults.harness import (
    CKPT,
    RESUME6,
    Broke,
    Catalogue,
    case,
    expect,
    listing,
    losses,
    unchanged,
)


# checkpoints: damaged, changed, on small or read-only disks
def _fallback(name: str, damage: Callable[[Path], str]) -> None:
    """The newest checkpoint damaged: set aside with one line naming the file, the resume from
    the older intact one, bitwise."""

    @case("checkpoint", name)
    def _(c: Catalogue) -> None:
        dump = base(c, re.sub(r"\W+", "_", name))
        step4 = dump / "run" / "checkpoints" / "step-00000004"
        named = damage(step4)
        r = c.run(dump, RESUME6)
        expect(r, 0)
        if not any("step-00000004" in ln and named in ln for ln in r.err.splitlines()):
            raise Broke(f"no line names {named} of step 4")
        if not (step4.parent / "step-00000004.damaged").is_dir():
            raise Broke("step 4 was not set aside as step-00000004.damaged")
        bitwise(c, dump / "run", resumed_by_hand(c, 2))


def _cut(file: str, keep: Callable[[int], int]) -> Callable[[Path], str]:
    def damage(step: Path) -> str:
        truncate(step / file, keep((step / file).stat().st_size))
        return file

    return damage


def _delete(file: str) -> Callable[[Path], str]:
    def damage(step: Path) -> str:
        (step / file).unlink()
        return file

    return damage


def _state_step(step: Path) -> str:
    state = json.loads((step / "state.json").read_text())
    (step / "state.json").write_text(json.dumps({**state, "step": 40}))
    return "state.json"


_fallback("a .distcp of the newest checkpoint cut to half", _cut("__0_0.distcp", lambda n: n // 2))
_fallback("its .metadata deleted", _delete(".metadata"))
_fallback("its rng-rank1.pt cut to 100 bytes", _cut("rng-rank1.pt", lambda n: 100))
_fallback("its __1_0.distcp deleted", _delete("__1_0.distcp"))
_fallback("its state.json cut at 1000 bytes", _cut("state.json", lambda n: 1000))
_fallback("its state.json step 4 edited to 40", _state_step)


@case("checkpoint", "its complete marker deleted (unfinished: the older step)")
def _(c: Catalogue) -> None:
    dump = base(c, "marker")
    (dump / "run" / "checkpoints" / "step-00000004" / "complete").unlink()
    r = c.run(dump, RESUME6)
    expect(r, 0)
    if "resumed from step 2" not in r.out + r.err:
        raise Broke("did not resume from step 2")
    bitwise(c, dump / "run", resumed_by_hand(c, 2))


def _resume_refused(name: str, args: tuple[str, ...], says: str) -> None:
    @case("checkpoint", name)
    def _(c: Catalogue) -> None:
        dump = base(c, re.sub(r"\W+", "_", name))
        before = listing(dump)
        expect(c.run(dump, (*RESUME6, *args)), 2, says)
        unchanged(before, dump)


_resume_refused("load_step 3 (not there)", ("--checkpoint.load_step", "3"), "load_step")
_resume_refused(
    "a resume with --model.flavor debugmodel_tied",
    ("--model.flavor", "debugmodel_tied"),
    "model.flavor",
)
_resume_refused(
    "a resume with training.steps 3, below the checkpoint's step 4",
    ("--training.steps", "3"),
    "raise --training.steps to 4",
)
_resume_refused(
    "a resume with --model.builtin_vocab_size 1024",
    ("--model.builtin_vocab_size", "1024"),
    "builtin_vocab_size",
)


def _hf_resume_refused(name: str, edit: Callable[[Path], object], says: str) -> None:
    """An HF run that saved step 2, its folder edited, then resumed: one line, its folder untouched."""

    @case("checkpoint", name)
    def _(c: Catalogue) -> None:
        folder = copy_hf(c, re.sub(r"\W+", "_", name))
        dump = c.dump(name)
        args = hf_args(folder, "--data.path", str(data(c) / "good.jsonl"), *CKPT)
        expect(c.run(dump, ("--training.steps", "2", *args)), 0)
        edit(folder)
        before = listing(dump)
        expect(c.run(dump, ("--training.steps", "4", *args)), 2, says)
        unchanged(before, dump)


_hf_resume_refused(
    "an HF run resumed after its config.json's intermediate_size changed",
    config_edit(intermediate_size=256),
    "intermediate_size",
)


@case("checkpoint", "a dp=2 checkpoint resumed at NPROC=1")
def _(c: Catalogue) -> None:
    dump = base(c, "reshard")
    expect(c.start(dump, RESUME6, env={"NPROC": "1"}).finish(), 0)
    ref, got = resumed_by_hand(c, 4), losses(dump / "run")
    err = max(abs(got[s] - ref[s]) / abs(ref[s]) for s in (5, 6))
    if err > 1e-5:
        raise Broke(f"steps 5-6 differ from the dp=2 resume by {err:.1e} (relative)")


@case("checkpoint", "two launches into one run folder at the same moment")
def _(c: Catalogue) -> None:
    dump = c.dump("two-launches")
    a, b = (c.start(dump, ("--training.steps", "4")) for _ in range(2))
    ra, rb = a.finish(), b.finish()
    codes = sorted((ra.code, rb.code))
    if codes != [0, 2]:
        raise Broke(f"exits {ra.code} and {rb.code}, promised one run (0) and one refusal (2)")
    expect(ra if ra.code == 2 else rb, 2, "in use by a live run")


def _checkpoint_folder_refused(
    name: str, says: str, size: str | None = None, read_only: bool = False
) -> None:
    """checkpoint.folder on a mount the preflight refuses: one line, nothing written."""

    @case("checkpoint", name)
    def _(c: Catalogue) -> None:
        dump = c.dump(name)
        source = c.dump(f"{name}-source") if read_only else None
        with mounted(c.work / f"mnt-{len(name)}", size, read_only_of=source) as folder:
            args = ("--training.steps", "2", *CKPT, "--checkpoint.folder", str(folder))
            expect(c.start(dump, args).finish(), 2, says)
            unchanged({}, folder)
        unchanged({}, dump)


_checkpoint_folder_refused("a checkpoint folder on a 20 MiB tmpfs", "free", size="20m")


@case("checkpoint", "the disk fills at the 2nd save (110 MiB tmpfs)")
def _(c: Catalogue) -> None:
    with mounted(c.work / "mnt-110m", "110m") as disk:
        dump = disk / "dump"
        r = c.start(
            dump,
            ("--training.steps", "4", "--checkpoint.every", "1", "--checkpoint.at_end", "true"),
        ).finish()
        expect(r, 3, "disk full")
        kept = sorted(p.name for p in (dump / "run" / "checkpoints").iterdir())
        if kept != ["step-00000001"]:
            raise Broke(f"the checkpoint folder holds {kept}, not step 1 alone")


def _read_only_case(name: str, args: tuple[str, ...], says: str, with_base: bool = False) -> None:
    @case("checkpoint", name)
    def _(c: Catalogue) -> None:
        src = base(c, re.sub(r"\W+", "_", name)) if with_base else c.dump(name)
        before = listing(src)
        with mounted(c.work / "mnt-ro", read_only_of=src) as ro:
            expect(c.start(ro, args).finish(), 2, says)
        unchanged(before, src)


_read_only_case("a read-only dump folder, a new run", ("--training.steps", "2"), "writable")
_read_only_case("a read-only run folder with checkpoints, resumed", RESUME6, "writable", True)
_read_only_case(
    "a read-only run folder with checkpoints, resumed without saving",
    ("--training.steps", "6"),
    "writable",
    True,
)


_checkpoint_folder_refused("a checkpoint.folder on a read-only mount", "writable", read_only=True)


_hf_resume_refused(
    "a bad tokenizer found by the workers on a resume",
    lambda f: garbage(f / "tokenizer.json"),
    "tokenizer",
)


@case("checkpoint", "the run_name of a finished run without checkpoints")
def _(c: Catalogue) -> None:
    dump = c.dump("finished")
    expect(c.run(dump, ("--training.steps", "2")), 0)
    before = listing(dump)
    expect(c.run(dump, ("--training.steps", "4")), 2, "without a checkpoint")
    unchanged(before, dump)


@case("checkpoint", "checkpoint.initial_load_path names a step whose .distcp is cut short")
def _(c: Catalogue) -> None:
    dump = base(c, "initial-damaged")
    step = dump / "run" / "checkpoints" / "step-00000004"
    truncate(step / "__0_0.distcp", 1000)
    new = c.dump("initial-damaged-new")
    args = ("--training.steps", "2", "--checkpoint.initial_load_path", str(step))
    expect(c.run(new, args), 2, "__0_0.distcp")
    unchanged({}, new)
