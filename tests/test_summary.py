"""What a run tells its user as it starts (notes of what is on) and as it ends (the summary), and
the step line's plain-words spread of the ranks."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from titanlite.components.checkpoint.index import MARKER as CHECKPOINT_MARKER
from titanlite.components.summary import (
    TENSORBOARD_ALL_POINTS,
    RunTally,
    progress_line,
    quiet_faults,
    summary_lines,
)
from titanlite.config import load_config
from titanlite.preflight import startup_notes


class _Alert:
    def __init__(self, name: str) -> None:
        self.name = name


def _record(step: int, loss: float | None, skipped: int = 0) -> dict:
    return {
        "step": step,
        "loss": loss,
        "loss_window_mean": 2.5,
        "loss_window_steps": 10,
        "skipped_steps": skipped,
    }


def test_summary_says_what_this_invocation_did_and_where_to_look(tmp_path):
    run = tmp_path / "run"
    folder = run / "checkpoints"
    for step in (20, 30):
        (folder / f"step-{step:08d}").mkdir(parents=True)
        (folder / f"step-{step:08d}" / CHECKPOINT_MARKER).write_text("")
    (folder / "step-00000040.tmp").mkdir()  # not complete: not named
    tally = RunTally()
    tally.record(_record(20, 3.0, skipped=1))
    tally.record(_record(30, 2.4567, skipped=2))
    tally.record_eval({"step": 30, "loss": 2.75, "perplexity": 15.64})
    for name in ("single_rank_outlier", "identical_data", "single_rank_outlier"):
        tally.alerts[name] += 1
    tally.notes["batch_size_advice"] += 1  # a note, not an alert: not counted with them
    tally.last_diag = {
        "step": 30,
        "batch_tokens": 2048,
        "noise_scale_tokens": 81920.4,
        "noise_to_batch": 40.0002,
    }
    lines = summary_lines(tally, 11, 30, 12.34, run, folder, [run / "hf"], tensorboard=True)
    assert lines[0] == f"done: 20 steps (11-30, resumed after step 10) in 12.3s; run folder {run}"
    assert lines[1] == "final loss 2.4567 at step 30 (mean over the last 10 steps 2.5000)"
    assert lines[2] == "eval loss 2.7500, perplexity 15.64 at step 30"
    assert (
        lines[3]
        == f"alerts: 3 (identical_data x1, single_rank_outlier x2); each in {run}/events.jsonl"
    )
    assert lines[4].startswith("skipped steps: 3 ")
    assert lines[5] == (
        "batch 2,048 tokens; gradient noise scale 81,920 tokens (40x the batch) at step 30; "
        f"batch_size_advice in {run}/events.jsonl"
    )
    assert lines[6] == f"checkpoint {folder}/step-00000030; export {run}/hf"
    # every point of every curve (TensorBoard keeps 1,000 of a tag unless told)
    tb = f"--logdir {run}/tb {TENSORBOARD_ALL_POINTS}; metrics {run}/metrics.jsonl"
    assert lines[7].endswith(tb) and "tensorboard" in lines[7]
    assert len(lines) == 8
    # A fresh run with nothing to report, and a resume with nothing left to run.
    quiet = summary_lines(RunTally(), 1, 5, 1.0, run, tmp_path / "none", [], tensorboard=False)
    assert quiet[0].startswith("done: 5 steps (1-5) in 1.0s") and "alerts: none" in quiet
    assert quiet[-1] == f"see: metrics {run}/metrics.jsonl"
    one = RunTally()
    one.record({**_record(1, 8.0), "loss_window_steps": 1})
    lines = summary_lines(one, 1, 1, 1.0, run, folder, [], tensorboard=False)
    assert (
        lines[0].startswith("done: 1 step (1-1) in ") and lines[1] == "final loss 8.0000 at step 1"
    )
    for last in (30, 20):  # training.steps, or a debug.stop_after_step before the checkpoint
        done = summary_lines(RunTally(), 31, last, 0.1, run, folder, [], tensorboard=False)
        assert done[0].startswith(
            "done: the checkpoint is at step 30 already, the last to run; nothing ran (raise --training.steps"
        )


@pytest.mark.parametrize("noise", [-0.02, -0.0, 0.0, 1e-9, 0.09, 0.49, 0.5, 0.99])
def test_a_noise_scale_below_one_token_is_not_measurable(tmp_path, noise):
    """Below one token (a zero, a negative estimate, one that rounds to 0 or 1 token): neither
    the summary nor the diagnostics line gives it as a figure; the summary says why."""
    from titanlite.components.summary import diagnostics_line

    diag = {
        "step": 20,
        "batch_tokens": 2048,
        "noise_scale_tokens": noise,
        "noise_to_batch": noise / 2048,
        "tokens_min": 1,
        "tokens_max": 2,
    }
    tally = RunTally()
    tally.last_diag = diag
    lines = summary_lines(tally, 1, 20, 1.0, tmp_path, tmp_path, [], tensorboard=False)
    (line,) = [x for x in lines if x.startswith("batch ")]
    assert line.startswith(
        f"batch 2,048 tokens; gradient noise scale not measurable at step 20 (its estimate is {noise:.2g} tokens"
    )
    assert not re.search(r"-?\d tokens \(", line) and "x the batch" not in line
    assert "noise scale" not in diagnostics_line(diag)
    measured = {**diag, "noise_scale_tokens": 1.0, "noise_to_batch": 1 / 2048}
    assert "noise scale 1 tokens" in diagnostics_line(measured)


def test_summary_gives_the_eval_before_and_after(tmp_path):
    tally = RunTally()
    tally.record_eval({"step": 0, "loss": 2.598, "perplexity": 13.44})
    lines = summary_lines(tally, 1, 0, 1.0, tmp_path, tmp_path, [], tensorboard=False)
    assert "eval loss 2.5980, perplexity 13.44 at step 0" in lines  # only the "before" so far
    tally.record_eval({"step": 10, "loss": 2.3, "perplexity": 9.97})
    tally.record_eval({"step": 20, "loss": 2.098, "perplexity": 8.15})
    lines = summary_lines(tally, 1, 20, 1.0, tmp_path, tmp_path, [], tensorboard=False)
    want = (
        "eval loss 2.5980 -> 2.0980, perplexity 13.44 -> 8.15 (the model as loaded -> at step 20)"
    )
    assert want in lines, lines


def test_silence_with_faults_on_is_explained():
    diag = {"rank_loss": [1.0] * 4}  # a measured step at dp=4
    short = load_config(None, ["--faults.corrupt_labels_rank", "1", "--training.steps", "20"])
    line = quiet_faults(short, 20, diag)
    assert line.startswith(
        "fault switches on (corrupt_labels_rank = 1): 20 measured step(s) are too few"
    ), line
    assert "single_rank_outlier" in line and "from measured step 21" in line
    assert "dispersion_rising_loss_falling from measured step 120" in line
    at_dp2 = quiet_faults(short, 20, {"rank_loss": [1.0, 2.0]})
    assert "dispersion_spike" not in at_dp2 and "cosine_drop" in at_dp2  # the dp=2 note names those
    long = load_config(None, ["--faults.same_data", "true", "--training.steps", "400"])
    assert (
        quiet_faults(long, 400, diag)
        == "fault switches on (same_data = True), and every alert had the history to judge"
    )
    assert "measured no step" in quiet_faults(long, 400, None)
    assert (
        quiet_faults(load_config(None, ["--faults.nan_loss_step", "3"]), 20, diag) is None
    )  # no alert names it
    lines = summary_lines(
        RunTally(), 1, 20, 1.0, Path("r"), Path("c"), [], False, quiet_faults(short, 20, diag)
    )
    assert lines[1].startswith(
        "alerts: none; fault switches on (corrupt_labels_rank = 1): 20 measured"
    )


def test_step_line_shows_the_ranks_spread_in_plain_words():
    rec = {
        "step": 10,
        "loss": 4.0,
        "grad_norm": 1.0,
        "lr": 1e-3,
        "tokens_per_s": 100.0,
        "memory_gib": 0.5,
        "eta_s": 5,
        "diag": {"loss_std": 0.02, "grad_norm_cv": 0.123},
    }
    assert progress_line(rec, 100).endswith("| eta 0:00:05 | ranks loss ±0.5%, grad norm ±12%")
    assert progress_line(rec, 100, "full").endswith("| eta 0:00:05")
    assert progress_line({**rec, "diag": None}, 100).endswith("| eta 0:00:05")


def test_startup_notes_name_what_is_on(tmp_path: Path):
    cfg = load_config(None, ["--training.steps", "200"])
    assert startup_notes(cfg, 4) == []
    # 100 steps: too few for the trend rule at dp=4 (at dp=2 the dp=2 note names it)
    (trend,) = startup_notes(load_config(None, ["--training.steps", "100"]), 4)
    assert trend.startswith("diagnostics: 100 measured step(s) are too few for some alerts"), trend
    assert ": dispersion_rising_loss_falling from measured step 120;" in trend, trend
    (short,) = startup_notes(load_config(None, ["--training.steps", "20"]), 4)
    assert "identical_data" in short and "from measured step 21" in short, short
    notes = startup_notes(
        load_config(None, ["--faults.corrupt_labels_rank", "1", "--training.steps", "200"]), 2
    )
    assert notes[0].startswith("[faults] is set (corrupt_labels_rank = 1): ")
    assert notes[1].startswith(
        "diagnostics: with 2 data-parallel ranks the alerts that compare ranks with each other "
        "(dispersion_spike, dispersion_rising_loss_falling"
    )
    assert "each rank is still checked against its own history" in notes[1]
    assert len(notes) == 2
    # one sequence per rank per step (the debug config's batch of 8 at dp=8): the rank test cannot fire
    (few,) = startup_notes(cfg, 8)
    assert "per-sample test cannot fire with 1 sequence(s) per rank per step at dp=8" in few, few
    assert startup_notes(load_config(None, ["--diagnostics.enable", "false"]), 2) == []
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": 64}))
    hf = ["--model.hf_assets_path", str(folder), "--training.steps", "200", "--training.seq_len"]
    (long,) = startup_notes(load_config(None, [*hf, "128"]), 4)
    assert "training.seq_len 128 is longer than the 64 positions" in long
    assert startup_notes(load_config(None, [*hf, "64"]), 4) == []


def test_a_sample_of_whitespace_is_visible_on_the_console(caplog):
    from titanlite.components.metrics import MetricsWriter

    caplog.set_level("INFO", logger="titanlite")
    MetricsWriter(None, 10, tensorboard=False).write_samples(
        5, [{"prompt": "Hi", "text": "\n\n\t"}]
    )
    assert "sample step 5 | 'Hi' -> '\\n\\n\\t'" in caplog.text


def test_the_measured_step_count_is_the_schedules():
    """measured_steps (closed form: a million-step run is counted at start-up) against the
    schedule it counts, over generated schedules and run lengths."""
    import random

    from titanlite.config.monitor_config import Diagnostics

    rng = random.Random(0)
    for _ in range(400):
        d = Diagnostics(
            measure_first=rng.randint(0, 60), every=rng.choice([0, 1, 2, 3, 7, 50, 500])
        )
        last = rng.randint(0, 600)
        assert d.measured_steps(last) == sum(d.measures(s) for s in range(1, last + 1)), (d, last)
