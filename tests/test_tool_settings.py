"""A tool's verdict is over the settings it was asked for: every config key, enumerated from the
config's dataclasses (the [faults] plugin's included), is given with a value other than its
default as an override to each script that runs cases through the harness (check_model,
invariance with --localize, diagnose_scenarios); each is either honoured in every run the script
plans (its config holds the value) or refused in one line naming the key, before any rank starts.
In process: the scripts' own planning functions, no rank launched."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from dataclasses import MISSING, fields
from typing import Any

import pytest
from helpers import REPO

from titanlite.analysis.settings import Fixes, value
from titanlite.config import parse_args
from titanlite.config.job_config import JobConfig, plugin_section
from titanlite.config.unused import unused_in
from titanlite.errors import UserError

GIVEN = "asked-value"  # a text key's value: a refusal of it as a bad value names it

# keys whose generated value must be one the config accepts in context (a registered model, its
# flavor, an axis of the model's); the others are generated from their declaration
VALID = {
    "model.name": "qwen3_moe",
    "model.flavor": "debugmodel_per_layer",
    "parallelism.axes": '["cp=2"]',
    "faults.ignore_all_labels_steps": "[3]",
}


def _other(default: Any, meta: dict) -> str | None:
    """A value other than `default` within the field's declared choices and bounds (None: a
    choice of one, which no override can change)."""
    if isinstance(default, bool):
        return str(not default).lower()
    if meta.get("choices"):
        return next((c for c in meta["choices"] if c != default), None)
    if isinstance(default, list):
        return json.dumps([GIVEN])
    if isinstance(default, int | float):
        ok = {">=": float.__ge__, ">": float.__gt__, "<=": float.__le__, "<": float.__lt__}
        step = 1 if isinstance(default, int) else 0.5
        # twice a positive default first: a batch stays divisible by the ranks that split it
        twice = (default * 2,) if default > 0 else ()
        for v in (*twice, default + step, default + 2 * step, default - step, step):
            if v != default and all(ok[op](float(v), float(b)) for op, b in meta["bounds"].items()):
                return str(v)
        raise AssertionError(f"no other value within {meta['bounds']}")
    return GIVEN


def every_key() -> dict[str, str]:
    """Every config key with a value other than its default."""
    plugin = [("faults", plugin_section("faults"))]
    sections = [
        (f.name, f.default_factory()) for f in fields(JobConfig) if f.default_factory is not MISSING
    ]
    out = {}
    for name, section in [*sections, *plugin]:
        for f in fields(section):
            key = f"{name}.{f.name}"
            out[key] = VALID.get(key) or _other(getattr(section, f.name), dict(f.metadata))
    return {k: v for k, v in out.items() if v is not None}


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"script_{name}", REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def judge(fixes: Fixes, key: str, given: str, plan) -> str | None:
    """What is wrong with one tool's answer to `--key given` ("": nothing): `plan()` gives the
    config asked and every run's, or raises the tool's refusal, which must name the key."""
    try:
        asked, runs = plan()
    except UserError as e:
        line = str(e)
        named = key in line or GIVEN in line  # the tool's refusal, or one of the value itself
        return None if named and "\n" not in line else f"--{key} {given}: refused as {line!r}"
    want = value(asked, key)
    for run in runs:
        got = value(run, key)
        if got == want or (key in fixes.at_most and got <= want):
            continue
        return f"--{key} {given}: not refused, but a run has {got!r} (asked {want!r})"
    return None


def sweep(fixes: Fixes, plan_of) -> None:
    """Every key through `plan_of(flags)`; every failure listed at once."""
    keys = every_key()
    assert len(keys) > 140 and "faults.same_data" in keys and "training.seq_len" in keys
    bad = [judge(fixes, k, v, lambda k=k, v=v: plan_of([f"--{k}={v}"])) for k, v in keys.items()]
    bad = [b for b in bad if b]
    assert not bad, "\n".join(bad)


def test_check_model_honours_or_refuses_every_key():
    tool = _load("check_model")
    from titanlite.analysis.check_cases import FIXES, plan

    model = ["--model.name", "llama3"]

    def plan_of(flags: list[str]):
        args = tool.SCRIPT.parse([*model, *flags, "--worlds", "2"])
        tool.prepare(args)
        return parse_args(args.overrides)[0], plan(args.overrides, args.worlds)

    sweep(FIXES, plan_of)
    # the case: one line naming each key and what the cases run it at
    with pytest.raises(UserError) as e:
        plan_of(
            [
                "--training.seq_len",
                "512",
                "--training.global_batch_size",
                "64",
                "--parallelism.mode",
                "ddp",
            ]
        )
    assert str(e.value) == (
        "check_model fixes training.seq_len (16), training.global_batch_size (16) and parallelism.mode "
        "(each of fsdp, ddp, hsdp) in its cases; drop --training.seq_len --training.global_batch_size "
        "--parallelism.mode"
    )
    # a value the cases run at anyway is honoured; the verdict line names what differs
    args = tool.SCRIPT.parse([*model, "--training.seq_len", "16", "--worlds", "2"])
    ran_at = tool.prepare(args)
    assert ran_at.startswith("ran at model.vocab_size 64, training.global_batch_size 16") and (
        "training.seq_len" not in ran_at and "parallelism.mode" in ran_at
    ), ran_at


def test_check_model_reads_the_hf_folder_before_any_rank(tmp_path):
    """The folder's family (and its config.json) is checked where the command starts: a folder of
    another model is one line before any rank."""
    tool = _load("check_model")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3MoeForCausalLM"]}))
    args = tool.SCRIPT.parse(["--model.name", "llama3", "--hf", str(tmp_path)])
    launched = []
    tool.harness.launch = lambda *a, **k: launched.append(a)
    with pytest.raises(UserError, match="holds a Qwen3MoeForCausalLM but model 'llama3' reads"):
        tool.body(args)
    assert not launched


@pytest.fixture(scope="module")
def invariance():
    return _load("invariance")


def test_invariance_honours_or_refuses_every_key(invariance, tmp_path):
    base = ["--config", "train_configs/debug_sft.toml", "--dp", "2", "4", "--localize"]

    def plan_of(flags: list[str]):
        args = invariance.SCRIPT.parse([*base, *flags, "--out", str(tmp_path / "inv")])
        out, plans, names, _ = invariance.layouts(args)
        runs = [parse_args(r)[0] for r in invariance.planned(args, plans, names, out)]
        return parse_args(["--config", str(args.config), *args.overrides])[0], runs

    sweep(invariance.LOCALIZE, plan_of)
    # a local batch the layouts stay within is honoured; --microbatch whole runs more
    plan_of(["--training.local_batch_size", "4", "--microbatch", "whole"])
    with pytest.raises(UserError, match="^invariance --localize fixes training.local_batch_size"):
        plan_of(["--training.local_batch_size", "1", "--microbatch", "whole"])


def test_invariance_says_what_it_starts_while_its_ranks_are_silent(
    invariance, tmp_path, monkeypatch
):
    """Before a run's first step line, a line says its ranks are starting (the run's own lines
    do not count: the user sees none of them); none after it. The child prints its step line only
    once the starting line was said, so no clock decides the outcome."""
    said: list[str] = []
    go = tmp_path / "go"

    def fake_print(line: str, **_) -> None:
        said.append(line)
        if "starting" in line:
            go.touch()

    monkeypatch.setattr(invariance, "print", fake_print, raising=False)
    monkeypatch.setattr(invariance, "STARTING_S", 0.04)
    child = (
        "import os, time\n"
        "print('titanlite: a line of the run', flush=True)\n"
        "t = time.monotonic()\n"  # a generous bound: a broken script fails, it does not hang
        f"while not os.path.exists({str(go)!r}) and time.monotonic() - t < 600: time.sleep(0.01)\n"
        "print('step  1/1 | loss 1 | eta 0:00:00', flush=True)\n"
    )
    code, tail = invariance.run_with_progress(
        [sys.executable, "-c", child], dict(os.environ), "r", 2
    )
    assert code == 0 and tail[-1].startswith("step  1/1")
    first = next(i for i, line in enumerate(said) if "step 1/1" in line)
    assert first > 0 and all("2 rank(s) starting" in line for line in said[:first]), said
    assert not any("starting" in line for line in said[first:]), said


@pytest.fixture(scope="module")
def scenarios_tool():
    return _load("diagnose_scenarios")


def test_diagnose_scenarios_honours_or_refuses_every_key(scenarios_tool, tmp_path):
    def plan_of(flags: list[str], base: tuple[str, ...] = ("--dp", "2", "--steps", "4")):
        args = scenarios_tool.SCRIPT.parse([*base, *flags, "--out", str(tmp_path / "s")])
        runs, _ = scenarios_tool.settings(args, scenarios_tool.resolve(args))
        return parse_args(["--config", str(args.config), *args.overrides])[0], runs

    args = scenarios_tool.SCRIPT.parse(["--dp", "2", "--steps", "4"])
    scenarios_tool.resolve(args)
    sweep(scenarios_tool.fixes(args), plan_of)
    # --quick sets what it stops on: an override of that is refused, the same value honoured
    with pytest.raises(
        UserError, match=r"^diagnose_scenarios fixes diagnostics.on_alert \(stop with --quick\)"
    ):
        plan_of(["--quick", "--diagnostics.on_alert", "warn"], base=())
    plan_of(["--quick", "--diagnostics.on_alert", "stop"], base=())


def test_quick_runs_the_scenarios_asked_and_says_why_it_adds_the_healthy_run(
    scenarios_tool, capsys
):
    args = scenarios_tool.SCRIPT.parse(["--quick", "--scenarios", "same_data"])
    scenarios_tool.resolve(args)
    assert args.scenarios == ["healthy", "same_data"] and (args.dp, args.steps, args.onset) == (
        2,
        60,
        40,
    )
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "--quick adds the healthy run: the baseline" in said[0]
    args = scenarios_tool.SCRIPT.parse(["--quick", "--scenarios", "healthy", "same_data"])
    scenarios_tool.resolve(args)
    assert args.scenarios == ["healthy", "same_data"] and not capsys.readouterr().err
    # --quick's own settings: another one beside it is refused, naming both
    with pytest.raises(
        UserError, match="^--quick runs at --dp 2 --steps 60 --onset 40; drop --dp 4"
    ):
        scenarios_tool.resolve(scenarios_tool.SCRIPT.parse(["--quick", "--dp", "4"]))


def test_a_replay_refuses_what_it_cannot_replay(scenarios_tool, tmp_path):
    """--replay reads recorded runs: an override outside [alerts] is refused, not ignored."""
    args = scenarios_tool.SCRIPT.parse(["--replay", str(tmp_path), "--training.seq_len", "16"])
    with pytest.raises(UserError, match=r"^diagnose_scenarios --replay fixes training.seq_len"):
        scenarios_tool.replay_main(args, args.overrides)


def test_every_generated_value_is_taken_by_the_config():
    """The sweep's values are other than the defaults and each loads by itself: a refusal in the
    sweep is the tool's, not the config's. A key the defaults leave unused (dropout masks at
    dropout 0) is the config's own one-line refusal, naming the key, in every tool alike."""
    keys = every_key()
    defaults = parse_args([])[0]
    unused = unused_in(defaults)
    for key, given in keys.items():
        if key in unused:
            with pytest.raises(UserError, match=rf"^{key} = .* is not used beside "):
                parse_args([f"--{key}", given])
            continue
        cfg = parse_args([f"--{key}", given])[0]
        assert value(cfg, key) != value(defaults, key), key
