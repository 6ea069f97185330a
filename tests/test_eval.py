"""Held-out evaluation and samples inside a training run (2 ranks, FSDP, packed SFT).

The eval loss at dp 1, 2, 4 and any eval batch: tests/test_distributed.py (eval_cases); the split
and the packing plan: tests/test_packing.py; decoding itself: tests/test_generate.py."""

from __future__ import annotations

import json

import pytest
from helpers import check, read_metrics, train

from titanlite.config import load_config
from titanlite.errors import UserError
from titanlite.validation import EVAL_SWITCHES, validate

PROMPT = "Write the body of `join`, from the Python module `posixpath`."


def _run(tmp_path, name: str, *extra: str) -> tuple[list[dict], str]:
    """The run's metrics rows and its console."""
    proc = train(
        2,
        "--config",
        "train_configs/debug_sft.toml",
        "--training.steps",
        "4",
        "--training.seq_len",
        "256",
        "--training.local_batch_size",
        "2",
        "--data.packing",
        "true",
        "--eval.fraction",
        "0.05",
        "--eval.max_sequences",
        "12",
        "--model.dropout",
        "0.1",  # a draw from the global RNG by eval would change later dropout masks
        "--metrics.enable_tensorboard",
        "false",
        "--job.dump_folder",
        str(tmp_path),
        "--job.run_name",
        name,
        *extra,
    )
    check(proc)
    return read_metrics(tmp_path / name), proc.stdout + proc.stderr


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
def test_eval_never_changes_training_and_writes_loss_and_samples(tmp_path):
    """A run that evaluates (and decodes a prompt) as loaded and every 2 steps, stopped after step 2
    and resumed, logs bitwise the training losses and grad norms of one that evaluates only after
    its last step, whose eval it repeats exactly: eval touches neither the data order nor any RNG,
    and leaves the model as it found it. The resumed run does not evaluate the start again, and
    its summary still gives the eval before and after."""
    decode = ("--eval.prompts", json.dumps([PROMPT]), "--eval.temperature", "0.8")
    often_args = (
        "--eval.every",
        "2",
        "--eval.at_start",
        "true",
        *decode,
        "--checkpoint.every",
        "2",
    )
    _, first = _run(tmp_path, "often", *often_args, "--debug.stop_after_step", "2")
    often, resumed = _run(tmp_path, "often", *often_args)
    once, _ = _run(tmp_path, "once")
    assert (
        "eval step 0 |" in first
        and "eval step 0 |" not in resumed
        and "resumed from step 2" in resumed
    )
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in often] == [
        (r["step"], r["loss"], r["grad_norm"]) for r in once
    ]
    evals, last = _lines(tmp_path / "often/eval.jsonl"), _lines(tmp_path / "once/eval.jsonl")
    assert [e["step"] for e in evals] == [0, 2, 4] and [e["step"] for e in last] == [4]
    assert f"eval loss {evals[0]['loss']:.4f} -> {evals[2]['loss']:.4f}, " in resumed, resumed[
        -3000:
    ]
    assert (
        evals[2]["loss"] == last[0]["loss"]
        and evals[0]["loss"] > evals[1]["loss"] > evals[2]["loss"]
    )
    assert evals[1]["sequences"] == 12 and evals[1]["tokens"] > 0
    assert (
        abs(evals[1]["perplexity"] - 2.718281828 ** evals[1]["loss"])
        < 1e-6 * evals[1]["perplexity"]
    )
    samples = _lines(tmp_path / "often/samples.jsonl")
    assert [(s["step"], s["prompt"]) for s in samples] == [(0, PROMPT), (2, PROMPT), (4, PROMPT)]
    assert all(s["text"] for s in samples) and not (tmp_path / "once/samples.jsonl").read_text()


# a value other than its default for each key of EVAL_SWITCHES (a key added there needs one here)
SWITCHED = {"prompts": '["Hello"]', "at_start": "true", "every": "5", "max_sequences": "8"}


@pytest.mark.parametrize("key", sorted(EVAL_SWITCHES))
def test_an_eval_switch_without_eval_data_is_refused_in_one_line(key):
    """Each [eval] key that acts on an eval set, set with none (neither eval.fraction nor
    eval.path), is refused before any worker in one line naming it and a fix that applies:
    with synthetic data (no eval set can be had) only setting the key back."""
    assert set(SWITCHED) == set(EVAL_SWITCHES)
    switch = [f"--eval.{key}", SWITCHED[key]]
    default = json.dumps(getattr(load_config(None, []).eval, key))
    synthetic = ["--data.mode", "synthetic", "--model.vocab_size", "256"]
    for extra, fix in (
        ([], f"set eval.fraction or eval.path, or set eval.{key} = {default}"),
        (synthetic, "synthetic data has no held-out text" if key == "prompts" else f"no eval set: set eval.{key} = {default}"),
    ):  # fmt: skip
        with pytest.raises(UserError) as e:
            validate(load_config(None, [*switch, *extra]), 1)
        line = str(e.value)
        assert fix in line and "\n" not in line, line
        assert f"eval.{key}" in line or key == "prompts", line
    validate(load_config(None, [*switch, "--eval.fraction", "0.1"]), 1)  # with an eval set
