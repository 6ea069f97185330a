"""The log step's host side: one read of several device tensors, and the window's record.
(End to end, with skipped steps in a real run: tests/test_step_counts.py.)"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from titanlite.components.step_window import RunRates, StepWindow, WindowRecord
from titanlite.distributed.utils import first_error
from titanlite.errors import TrainingError
from titanlite.tools.instrument import readback


def test_readback_returns_each_tensor_as_tolist_would():
    tensors = [
        torch.tensor(2.5),
        torch.tensor([1, 2, 3]),
        torch.arange(6.0).reshape(2, 3),
        torch.arange(8).reshape(2, 2, 2),
        torch.tensor([True, False]),
    ]
    assert readback(tensors) == [t.double().tolist() for t in tensors]


def window(losses: list[float], skipped: list[bool]) -> WindowRecord:
    n = len(losses)
    steps = list(range(1, n + 1))
    return WindowRecord(
        steps,
        losses,
        [0] * n,
        skipped,
        [0.5 * s for s in steps],
        [10 * s for s in steps],
        [1e-3 / s for s in steps],
    )


def test_window_mean_is_over_the_steps_that_trained():
    rates = RunRates(64, 2, 10, 0, torch.device("cpu"), torch.float32)
    log = window([8.0, 0.0, 6.0], [False, True, False]).rows(1.0, 1.0, rates)[-1]
    assert (log["loss_window_mean"], log["loss_window_steps"]) == (7.0, 2)
    assert window([0.0, 0.0], [True, True]).rows(1.0, 1.0, rates)[-1]["loss_window_mean"] is None


def test_every_step_gets_its_row_and_the_log_step_the_windows_figures():
    rates = RunRates(64, 2, 10, 0, torch.device("cpu"), torch.float32)
    rows = window([8.0, 0.0, 6.0], [False, True, False]).rows(
        window_s=3.0, elapsed_s=9.0, run=rates
    )
    assert [(r["step"], r["row"]) for r in rows] == [(1, "step"), (2, "step"), (3, "log")]
    assert [r["loss"] for r in rows] == [8.0, None, 6.0]  # a skipped step's loss is no loss
    assert [r["grad_norm"] for r in rows] == [0.5, 1.0, 1.5]
    assert [r["valid_tokens"] for r in rows] == [10, 20, 30]
    assert [r["lr"] for r in rows] == [1e-3, 1e-3 / 2, 1e-3 / 3]
    assert [r["skipped"] for r in rows] == [False, True, False]
    step_keys = {"step", "row", "loss", "grad_norm", "lr", "valid_tokens", "skipped"}
    assert set(rows[0]) == set(rows[1]) == step_keys  # one row format: the log row adds to it
    log = rows[-1]
    assert step_keys < set(log) and (
        log["loss_window_mean"],
        log["loss_window_steps"],
        log["skipped_steps"],
    ) == (7.0, 2, 1)
    assert log["tokens_per_s"] == 64 * 3 / 3.0 and log["eta_s"] == (10 - 3) * 3.0 / 3


def test_first_error_without_a_process_group_is_the_own_one():
    assert first_error(None) is None and first_error("bad") == "bad"


def test_the_log_rows_reader_keeps_the_rows_with_the_windows_figures(tmp_path):
    """Readers of throughput, memory or ETA (scripts/gpu_check.py, the peer benchmark) take the
    log steps' rows; a run written before rows per step had log rows only, without "row"."""
    from titanlite.tools.records import metrics_rows

    rates = RunRates(64, 2, 10, 0, torch.device("cpu"), torch.float32)
    rows = window([8.0, 7.0, 6.0], [False] * 3).rows(window_s=3.0, elapsed_s=9.0, run=rates)
    old = {"step": 10, "loss": 5.0, "tokens_per_s": 1.0}
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [*rows, old]))
    assert [r["step"] for r in metrics_rows(path)] == [1, 2, 3, 10]
    logged = metrics_rows(path, logged=True)
    assert [r["step"] for r in logged] == [3, 10] and all("tokens_per_s" in r for r in logged)


@pytest.fixture
def one_process(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_models_loss_terms_are_read_with_the_loss_and_get_their_rows(one_process):
    """StepWindow keeps each step's shares of the terms beside its loss share (one all-reduce,
    one read at the log step); each row gets the terms and the total the step minimised (none
    for a skipped step); a model whose terms change names between steps is one line."""
    w = StepWindow()
    for step, (loss, share) in enumerate([(8.0, 0.25), (7.0, 0.5)], start=1):
        aux = torch.tensor(share)
        terms = {"aux": aux, "z": torch.tensor(0.125)}
        skip = torch.tensor(step == 2)
        w.add(
            step, torch.tensor(loss), torch.tensor(10), torch.tensor(1.0), skip, 1e-3, terms=terms
        )
    record = w.read(None)
    assert record.terms == [{"aux": 0.25, "z": 0.125}, {"aux": 0.5, "z": 0.125}]
    rates = RunRates(64, 1, 10, 0, torch.device("cpu"), torch.float32)
    rows = record.rows(window_s=1.0, elapsed_s=1.0, run=rates)
    assert (rows[0]["terms"], rows[0]["loss_total"]) == ({"aux": 0.25, "z": 0.125}, 8.375)
    assert (rows[1]["terms"], rows[1]["loss_total"]) == (None, None)
    changed = r"step 3: the model's loss terms are \['aux'\], not \['aux', 'z'\] as before"
    with pytest.raises(TrainingError, match=changed):
        w.add(
            3,
            torch.tensor(6.0),
            torch.tensor(10),
            torch.tensor(1.0),
            torch.tensor(False),
            1e-3,
            terms={"aux": aux},
        )


@pytest.mark.parametrize("step_s", [1.0, 7.0, 15.0, 29.0])
def test_a_long_log_interval_says_it_is_going_before_a_step_would_pass_the_heartbeat(
    monkeypatch, caplog, step_s
):
    """Steps of step_s seconds between log steps: a line comes before the next step would end
    past HEARTBEAT_S since the last one, so the console is never silent longer (host clock only)."""
    import logging

    from titanlite.components import step_window
    from titanlite.tools.process import HEARTBEAT_S

    clock = [0.0]
    monkeypatch.setattr(step_window.time, "monotonic", lambda: clock[0])
    window = step_window.StepWindow()
    said = [0.0]
    with caplog.at_level(logging.INFO, logger="titanlite"):
        for step in range(1, 60):
            clock[0] += step_s
            before = len(caplog.records)
            one = torch.tensor(1.0)
            window.add(
                step, one, torch.tensor(4), one, torch.tensor(False), 1e-3,
                until_log=lambda step=step: 100 - step,
            )  # fmt: skip
            if len(caplog.records) > before:
                said.append(clock[0])
    gaps = [b - a for a, b in zip(said, said[1:], strict=False)]
    assert gaps and max(gaps) <= HEARTBEAT_S, gaps


@pytest.mark.parametrize("step_s", [0.3, 1.9, 7.0, 29.0])
@pytest.mark.parametrize("log_every", [None, 1, 5, 40])
def test_the_progress_line_comes_only_where_a_log_step_follows_and_not_in_its_second(
    monkeypatch, caplog, one_process, step_s, log_every
):
    """Steps of step_s seconds, logged every log_every steps (None: never, as in a rehearsal): a
    progress line promises a log step, so none is said at a log step, where none follows, or
    where the log line is expected within PROGRESS_GAP_S of it."""
    import logging

    from titanlite.components import step_window
    from titanlite.tools.process import HEARTBEAT_S

    clock = [0.0]
    monkeypatch.setattr(step_window.time, "monotonic", lambda: clock[0])
    window = step_window.StepWindow()

    last = 119  # the run's last step, a log step as every run's is

    def until_log(step: int) -> int | None:
        return None if log_every is None else min(-step % log_every, last - step)

    logged = []  # the console's time of each progress line and each log line
    one = torch.tensor(1.0)
    with caplog.at_level(logging.INFO, logger="titanlite"):
        for step in range(1, last + 1):
            clock[0] += step_s
            before = len(caplog.records)
            window.add(
                step, one, torch.tensor(4), one, torch.tensor(False), 1e-3,
                until_log=lambda step=step: until_log(step),
            )  # fmt: skip
            if len(caplog.records) > before:
                assert until_log(step), f"a progress line at step {step}, {until_log(step)}"
                logged.append(("progress", step, clock[0]))
            if until_log(step) == 0:
                window.read(None)
                logged.append(("log", step, clock[0]))
    progress = [(step, t) for kind, step, t in logged if kind == "progress"]
    if log_every is None:
        assert not progress
    for i, (kind, step, t) in enumerate(logged):
        if kind == "progress":  # the log line it promises comes, and not within the gap
            t_log = next(t_next for k, _, t_next in logged[i + 1 :] if k == "log")
            assert t_log - t >= step_window.PROGRESS_GAP_S, (step, t, t_log)
    if log_every is not None and log_every * step_s > 2 * HEARTBEAT_S:
        assert progress  # a long interval still says it is going
