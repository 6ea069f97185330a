"""The doors between components: the launcher's words before the config reads them, paths typed
in a folder of the user's own, exceptions from code and files titanlite does not own, sizes
that grow without bound, settings compared or reused across runs, and what a new user meets
in the first hour. Each case is a user's command; most stop before any worker (cheap)."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

from faults.fixtures import base, data, prepared, shared_run
from faults.harness import (
    CKPT,
    HANG_S,
    REPO,
    RESUME6,
    Bent,
    Broke,
    Catalogue,
    Result,
    case,
    expect,
    listing,
    records,
    unchanged,
)

DEBUG_WARMUP = (
    10  # train_configs/debug_model.toml's lr_scheduler.warmup_steps (the default's is 200)
)
MY_TOML = """[training]
global_batch_size = 8
local_batch_size = 4
[lr_scheduler]
warmup_steps = 3
"""


def _refused(
    family: str, name: str, args: tuple[str, ...], says: str, cwd=None, cheap: bool = True
) -> None:
    """Exit 2 in one line holding `says`, nothing written (`cwd(c)`: the caller's folder)."""

    @case(family, name, cheap=cheap)
    def _(c: Catalogue) -> None:
        dump = c.dump(name)
        where = cwd(c) if cwd else REPO
        before = listing(where) if cwd else {}
        # two steps at most: a launch that should have been refused is over soon
        expect(c.run(dump, ("--training.steps", "2", *args), cwd=where), 2, says)
        unchanged({}, dump)
        if cwd:
            unchanged(before, where)


def _plans(family: str, name: str, args, check, cwd=None) -> None:
    """The launch runs (exit 0) with a config `check(c, cfg, result)` accepts."""

    @case(family, name, cheap=True)
    def _(c: Catalogue) -> None:
        r, cfg = c.planned(name, args(c) if callable(args) else args, cwd(c) if cwd else REPO)
        expect(r, 0)
        if not cfg:
            raise Broke("no config reached the workers")
        check(c, cfg, r)


def _default_config(c: Catalogue, cfg: dict, r: Result) -> None:
    if cfg["lr_scheduler.warmup_steps"] != DEBUG_WARMUP:
        raise Broke("the default config (train_configs/debug_model.toml) was not applied")


# ---- the launcher's words ------------------------------------------------------------------------
W = "doors/launcher words"
_refused(W, "--config= (an empty value)", ("--config=",), "--config")
_refused(W, "--config '' (an empty word)", ("--config", ""), "--config")
_refused(W, "--config twice", ("--config", "train_configs/debug_model.toml", "--config", "train_configs/debug_sft.toml"), "--config")  # fmt: skip
_refused(W, "--config=A --config B", ("--config=train_configs/debug_model.toml", "--config", "train_configs/debug_model.toml"), "--config")  # fmt: skip
for _value in ("0", "-3", "abc", "1.5", "100000000", "65537"):
    _refused(W, f"--rehearse {_value}", ("--rehearse", _value), "--rehearse")
_refused(W, "--rehearse= (no value)", ("--rehearse=",), "--rehearse")
_refused(W, "--rehearse 8 and --rehearsal.world 16", ("--rehearse", "8", "--rehearsal.world", "16"), "--rehearse")  # fmt: skip
_refused(W, "--rehearsal.world 70000", ("--rehearsal.world", "70000"), "rehearsal.world")
_refused(W, "--faults.nan_loss_step 2 --debug.nan_loss_step 3 (a moved key)", ("--faults.nan_loss_step", "2", "--debug.nan_loss_step", "3"), "debug.nan_loss_step")  # fmt: skip
_plans(
    W,
    "a value holding ' --config '",
    ("--job.description", "tried --config other.toml first"),
    _default_config,
)
_plans(W, "a value that is '--config'", ("--job.description", "--config"), _default_config)
_plans(
    W, "a value holding '--config='", ("--job.description=see --config=x.toml",), _default_config
)


def _agreeing(c: Catalogue, cfg: dict, r: Result) -> None:
    if cfg.get("faults.nan_loss_step") != 3:
        raise Broke(
            f"faults.nan_loss_step {cfg.get('faults.nan_loss_step')}, asked 3 twice (old and new name)"
        )


_plans(
    W,
    "--debug.nan_loss_step 3 --faults.nan_loss_step 3 (a moved key, agreeing)",
    ("--debug.nan_loss_step", "3", "--faults.nan_loss_step", "3"),
    _agreeing,
)


# ---- paths mean what the user typed, from the user's own folder ------------------------------------
P = "doors/paths"


def home(c: Catalogue) -> Path:
    """A user's own folder outside the checkout, holding a config, data and a README.md of its own."""

    def make() -> Path:
        h = c.work / "home"
        h.mkdir(parents=True, exist_ok=True)
        shutil.copy(data(c) / "good.jsonl", h / "mine.jsonl")
        (h / "my.toml").write_text(MY_TOML)
        return h

    return c.once("home", make)  # type: ignore[return-value]


def _empty_home(c: Catalogue) -> Path:
    h = c.work / "empty-home"
    h.mkdir(parents=True, exist_ok=True)
    return h


for _key, _value in (
    ("--data.path", "README.md"),  # the checkout has one; the user's folder does not
    ("--eval.path", "README.md"),
    ("--checkpoint.initial_load_path", "train_configs"),
    ("--model.hf_assets_path", "train_configs"),
    ("--model.tokenizer_path", "README.md"),
    ("--data.path", "README.md:0.5,pyproject.toml:0.5"),
):
    _refused(
        P, f"{_key} {_value} from a folder without it", (_key, _value), "empty-home", _empty_home
    )
_refused(P, "--config train_configs/debug_model.toml from a folder without it", ("--config", "train_configs/debug_model.toml"), "empty-home", _empty_home)  # fmt: skip


def _own_config(c: Catalogue, cfg: dict, r: Result) -> None:
    if cfg["lr_scheduler.warmup_steps"] != 3:
        raise Broke("the config file in the user's folder was not the one applied")


def _own_data(c: Catalogue, cfg: dict, r: Result) -> None:
    want = str(home(c) / "mine.jsonl")
    if cfg["data.path"] != want:
        raise Broke(f"data.path reached the workers as {cfg['data.path']!r}, not {want!r}")
    if want not in r.err + r.out:
        raise Bent("no start-up line names the absolute path of the data read")


_plans(P, "--config my.toml from the user's folder", ("--config", "my.toml"), _own_config, home)
_plans(
    P,
    "--data.path mine.jsonl from the user's folder",
    ("--data.path", "mine.jsonl"),
    _own_data,
    home,
)


def _names_config(c: Catalogue, cfg: dict, r: Result) -> None:
    if str(REPO / "train_configs" / "debug_model.toml") not in r.err + r.out:
        raise Bent("no start-up line names the absolute path of the config read")


_plans(P, "start-up names the config it reads", (), _names_config)


# ---- exceptions at the boundary: one line ------------------------------------------------------------
E = "doors/exceptions"


def _fork(c: Catalogue, name: str, body: str) -> Path:
    """A user's fork module `name` in a folder of its own (that folder is the caller's)."""
    folder = c.work / f"fork-{name}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.py").write_text(body)
    return folder


for _mod, _body, _says in (
    ("raises_runtime", "raise RuntimeError('registry offline')\n", "registry offline"),
    ("raises_key", "{}['missing']\n", "KeyError"),
    ("bad_syntax", "def broken(:\n", "SyntaxError"),
    ("exits", "import sys\nsys.exit(7)\n", "exited with code 7"),
):
    _refused(E, f"a fork module that fails on import ({_mod})", ("--model.import_module", _mod), _says, lambda c, m=_mod, b=_body: _fork(c, m, b))  # fmt: skip
for _axes in ('["cp=²"]', '["cp=٢"]', '["cp=2.0"]', '["cp=0x2"]', '["=2"]'):
    _refused(E, f"--parallelism.axes {_axes}", ("--parallelism.axes", _axes), "parallelism.axes")


@case(E, "check_model.py on a fork that fails on import")
def _(c: Catalogue) -> None:
    folder = _fork(c, "fails_in_check", "raise ValueError('half-written fork')\n")
    env = {"PYTHONPATH": str(folder)}
    args = ("--model.name", "x", "--model.import_module", "fails_in_check")
    r = c.script("check_model", *args, env=env, timeout=HANG_S)
    expect(r, 2, "fails_in_check")


@case(E, "compare_runs.py on a run whose config.toml is not UTF-8")
def _(c: Catalogue) -> None:
    run = Path(shutil.copytree(shared_run(c), c.dump("nonutf8-config") / "run"))
    (run / "config.toml").write_bytes(b'[job]\ndescription = "caf\xe9"\n')
    r = c.script(
        "compare_runs",
        str(run),
        str(shared_run(c)),
        "--out",
        str(run.parent / "cmp"),
        timeout=HANG_S,
    )
    expect(r, 2, "config.toml")


# ---- one checkpoint reader, checked both ways -------------------------------------------------------
K = "doors/checkpoint reader"


def _untied_step(c: Catalogue) -> str:
    return str(
        shared_run(c) / "checkpoints" / "step-00000004"
    )  # the debug model: a head of its own


@case(K, "initial_load_path of an untied run into a tied model")
def _(c: Catalogue) -> None:
    dump = c.dump("untied-into-tied")
    args = ("--model.flavor", "debugmodel_tied", "--checkpoint.initial_load_path", _untied_step(c))
    expect(c.run(dump, ("--training.steps", "2", *args)), 2, "output.weight")
    unchanged({}, dump)


@case(K, "... with --checkpoint.initial_load_drop output.weight")
def _(c: Catalogue) -> None:
    dump = c.dump("untied-into-tied-dropped")
    args = ("--model.flavor", "debugmodel_tied", "--checkpoint.initial_load_path", _untied_step(c))
    expect(
        c.run(
            dump,
            ("--training.steps", "2", *args, "--checkpoint.initial_load_drop", "output.weight"),
        ),
        0,
    )


@case(K, "a rewind, then a plain resume, follows one timeline")
def _(c: Catalogue) -> None:
    dump = base(c, "rewind")
    expect(c.run(dump, ("--training.steps", "3", *CKPT, "--checkpoint.load_step", "2")), 0)
    run = dump / "run"
    if not (run / "checkpoints" / "step-00000004.abandoned").is_dir():
        raise Broke("the abandoned step 4 was not set aside as step-00000004.abandoned")
    expect(c.run(dump, RESUME6), 0)
    steps = [r["step"] for r in records(run / "metrics.jsonl") if "step" in r]
    if steps != list(range(1, 7)):
        raise Broke(f"metrics.jsonl holds steps {steps}, not one timeline 1-6")


# ---- stops reach what a script started -----------------------------------------------------------
S = "doors/stops"


def _alive(text: str) -> list[int]:
    """Pids of live processes whose command line holds `text`."""
    pids = []
    for d in Path("/proc").iterdir():
        try:
            found = d.name.isdigit() and text.encode() in (d / "cmdline").read_bytes()
            if found and (d / "stat").read_text().split(") ")[-1][:1] != "Z":  # not a zombie
                pids.append(int(d.name))
        except OSError:
            continue
    return pids


@case(S, "SIGTERM to diagnose_scenarios.py stops its runs too")
def _(c: Catalogue) -> None:
    out = c.dump("scenarios-term") / "out"
    live = c.start_script(
        "diagnose_scenarios",
        "--dp",
        "2",
        "--steps",
        "40",
        "--scenarios",
        "healthy",
        "--out",
        str(out),
    )
    live.wait_for(lambda: (out / "healthy" / "metrics.jsonl").is_file(), timeout=HANG_S)
    live.proc.send_signal(signal.SIGTERM)  # the script alone, as a scheduler or `kill` sends it
    r = live.finish(timeout=HANG_S)
    if r.code != 128 + signal.SIGTERM:
        raise Broke(f"exit {r.code}, promised {128 + signal.SIGTERM}: {r.last[:200]}")
    if left := _alive(str(out)):  # the script has exited: what it started has too
        raise Broke(f"its runs train on without it: pids {left}")


@case(S, "SIGTERM in the middle of a rehearsal's steps")
def _(c: Catalogue) -> None:
    dump = c.dump("rehearsal-term")
    live = c.start(dump, ("--rehearse", "8", "--rehearsal.steps", "30"))
    live.wait_for(lambda: live.saw("rehearsal: step 2/30 done"), timeout=HANG_S)
    live.signal(signal.SIGTERM)
    expect(live.finish(timeout=HANG_S), 128 + signal.SIGTERM, "nothing was kept")
    unchanged({}, dump)


# ---- sizes a machine can plan for ------------------------------------------------------------------
Z = "doors/sizes"
for _key, _value in (
    ("--data.num_workers", "100000"),
    ("--rehearsal.steps", "100000000"),
    ("--eval.sample_tokens", "100000000"),
    ("--alerts.window", "1000000000"),
    ("--spike_guard.window", "1000000000"),
):
    _refused(Z, f"{_key} {_value}", (_key, _value), _key[2:])


# ---- settings compared or reused -----------------------------------------------------------------
R = "doors/settings"


def _names_overlap(c: Catalogue, cfg: dict, r: Result) -> None:
    if not any("eval.path" in ln and "held-out" in ln for ln in r.err.splitlines()):
        raise Broke("an eval set equal to the training data is not named at start-up")


_plans(R, "eval.path equal to data.path", lambda c: ("--data.path", str(prepared(c)), "--eval.path", str(prepared(c))), _names_overlap)  # fmt: skip
_plans(R, "eval.path equal to a raw data.path, nothing prepared yet", lambda c: ("--data.path", str(data(c) / "good.jsonl"), "--eval.path", str(data(c) / "good.jsonl")), _names_overlap)  # fmt: skip
_refused(R, "eval.at_start without eval data", ("--eval.at_start", "true"), "eval.at_start")


def _comma_named(c: Catalogue) -> Path:
    """good.jsonl under a name the mixture syntax would split (a comma and a colon)."""
    path = c.work / "odd-names" / "good,v2:0.5.jsonl"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(data(c) / "good.jsonl", path)
    return path


def _one_dataset(c: Catalogue, cfg: dict, r: Result) -> None:
    if cfg["data.path"] != str(_comma_named(c)):
        raise Broke(f"data.path reached the workers as {cfg['data.path']!r}")


_plans(R, "a data file whose name holds a comma and a colon", lambda c: ("--data.path", str(_comma_named(c))), _one_dataset)  # fmt: skip
_refused(R, "eval.path and eval.fraction both set", ("--eval.path", "README.md", "--eval.fraction", "0.1"), "eval.fraction")  # fmt: skip


def _one_prompt(c: Catalogue, cfg: dict, r: Result) -> None:
    if cfg["eval.prompts"] != ["Hello, world"]:
        raise Broke(f"eval.prompts 'Hello, world' became {cfg['eval.prompts']}")


_plans(R, "--eval.prompts 'Hello, world' is one prompt", ("--eval.fraction", "0.1", "--eval.prompts", "Hello, world"), _one_prompt)  # fmt: skip


@case(R, "invariance.py --localize reuses runs made with other settings")
def _(c: Catalogue) -> None:
    out = c.dump("localize-reuse") / "out"
    base_args = [
        "--config",
        "train_configs/debug_model.toml",
        "--dp",
        "1",
        "2",
        "--steps",
        "2",
        "--out",
        str(out),
    ]
    base_args += ["--training.seq_len", "128"]
    expect(c.script("invariance", *base_args, timeout=HANG_S), 0)
    before = listing(out)
    r = c.script("invariance", *base_args, "--localize", "--optimizer.lr", "1e-3", timeout=HANG_S)
    expect(r, 2, "optimizer.lr")
    unchanged(before, out)


@case(R, "a resume with a longer schedule runs its first step at the new schedule's lr")
def _(c: Catalogue) -> None:
    from titanlite.components.optimizer import lr_factor
    from titanlite.config import parse_args

    dump = base(c, "longer-schedule")  # 4 steps, checkpoints at 2 and 4
    r = c.run(dump, ("--training.steps", "8", *CKPT))
    expect(r, 0)
    cfg = parse_args(["--config", "train_configs/debug_model.toml", "--training.steps", "8"])[0]
    want = cfg.optimizer.lr * lr_factor(4, cfg)
    got = {row["step"]: row.get("lr") for row in records(dump / "run" / "metrics.jsonl")}.get(5)
    if got is None or abs(got - want) > 1e-12 * want:
        raise Broke(f"step 5 ran at lr {got}, the new schedule's is {want}")
    if f"{want:.3g}" not in r.err:
        raise Bent("the resume line does not give the lr its first step runs at")


@case(R, "compare_runs --invariance of a run missing its first steps")
def _(c: Catalogue) -> None:
    run = Path(shutil.copytree(shared_run(c), c.dump("missing-steps") / "run"))
    rows = [
        ln
        for ln in (run / "metrics.jsonl").read_text().splitlines()
        if json.loads(ln).get("step", 0) > 2
    ]
    (run / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    out = run.parent / "cmp"
    r = c.script(
        "compare_runs",
        str(run),
        str(shared_run(c)),
        "--invariance",
        "--out",
        str(out),
        timeout=HANG_S,
    )
    expect(r, 2, "step")


# ---- the first hour --------------------------------------------------------------------------------
F = "doors/first hour"


@case(F, "NGPU=2 without a GPU says it means CPU ranks")
def _(c: Catalogue) -> None:
    dump = c.dump("ngpu-cpu")
    r = c.run(dump, ("--training.steps", "1"), env={"NGPU": "2"})
    expect(r, 0)
    if "CPU rank" not in r.err:
        raise Bent("nothing says NGPU=2 means 2 CPU ranks on a machine without a GPU")


@case(F, "the first start-up lines are the run's, not the alert rules'", cheap=True)
def _(c: Catalogue) -> None:
    r, _ = c.planned("first-lines", ())
    lines = [ln for ln in r.err.splitlines() if ln.startswith("titanlite:")]
    if lines and "alert" in lines[0]:
        raise Bent(f"the first line is about alert rules: {lines[0][:120]}")
