"""The user-facing surface: the launcher, bad input, refusals, run folders, fault switches."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from helpers import (
    HANG_S,
    REPO,
    check,
    in_process,
    read_metrics,
    served_scalars,
    tensorboard_items,
    train,
)
from torch.utils.tensorboard import SummaryWriter

from titanlite.config import load_config
from titanlite.errors import UserError

SMALL = [
    "--config",
    "train_configs/debug_model.toml",
    "--training.seq_len",
    "64",
    "--training.global_batch_size",
    "4",
    "--training.local_batch_size",
    "1",
    "--metrics.log_every",
    "1",
]


def single(*args: str, timeout: float = HANG_S) -> subprocess.CompletedProcess:
    """`python -m titanlite.train` without torchrun: a one-rank job."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "titanlite.train", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def refused(*args: str) -> subprocess.CompletedProcess:
    """titanlite.train's main(argv) in this process, as `python -m titanlite.train` runs it (one
    rank): for input it refuses before any training."""
    import titanlite.train

    return in_process(titanlite.train.main, args)


def one_line_error(proc: subprocess.CompletedProcess, needle: str) -> None:
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("titanlite: error:")]
    assert len(lines) == 1 and needle in lines[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "args, needle",
    [
        (
            ["--training.global_batch_size", "3", "--training.local_batch_size", "2"],
            "is not a multiple of local_batch_size",
        ),
        (["--training.stepz", "3"], "did you mean 'training.steps'"),
        (
            ["--data.path", "/nonexistent/data.jsonl"],
            "data.path '/nonexistent/data.jsonl' does not exist",
        ),
    ],
)
def test_bad_input_is_one_line_and_leaves_nothing(tmp_path, args, needle):
    proc = refused("--job.dump_folder", str(tmp_path / "out"), *args)
    one_line_error(proc, needle)
    assert not (tmp_path / "out").exists()


def test_malformed_toml_and_bad_data_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[training]\nsteps = = 3\n")
    one_line_error(refused("--config", str(bad)), "is not valid TOML")
    data = tmp_path / "d.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\nnot json\n')
    proc = refused(
        *SMALL,
        "--data.mode",
        "sft",
        "--data.path",
        str(data),
        "--job.dump_folder",
        str(tmp_path / "out"),
    )
    one_line_error(proc, "line 2 is not valid JSON")
    assert not (tmp_path / "out").exists()


def test_launcher_preflight_rejects_before_starting_workers(tmp_path):
    env = {**os.environ, "NPROC": "2"}
    proc = subprocess.run(
        ["./run_train.sh", "--training.global_batch_size", "6", "--training.local_batch_size", "4"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert proc.returncode == 2
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith("titanlite: error: training.global_batch_size=6")
    )
    assert "torch.distributed" not in proc.stderr
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    proc = subprocess.run(
        ["./run_train.sh", "--job.dump_folder", str(blocker / "runs")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert (
        f"job.dump_folder '{blocker}/runs/" in proc.stderr
        and f"'{blocker}' is a file" in proc.stderr
    )


def test_model_too_big_for_this_machine_is_refused(tmp_path):
    from titanlite.tools.memory import available_bytes

    if available_bytes(torch.device("cpu"))[0] > 120 * 2**30:
        pytest.skip("this host could hold an 8B model's training state")
    # Through the launcher: the worker's one line and exit code 2, not torchrun's failure dump.
    proc = subprocess.run(
        [
            "./run_train.sh",
            *SMALL[2:],
            "--model.flavor",
            "8B",
            "--job.dump_folder",
            str(tmp_path / "out"),
        ],
        cwd=REPO,
        env={**os.environ, "NPROC": "2"},
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    one_line_error(proc, "needs about")
    assert "per rank but" in proc.stderr and "ChildFailedError" not in proc.stderr
    assert not (tmp_path / "out").exists()


def test_run_folder_metrics_skip_and_export(tmp_path):
    """A healthy 2-rank SFT run with one all-ignored step: it is skipped, the run goes on. Every
    step has its row in metrics.jsonl and its point in TensorBoard, not only the log steps; the
    curves that matter sort first; the model as loaded is evaluated and the summary gives the
    eval before and after."""
    out = tmp_path / "out"
    proc = train(
        2,
        *SMALL,
        "--data.mode",
        "sft",
        "--training.seq_len",
        "256",
        "--training.steps",
        "4",
        "--metrics.log_every",
        "3",
        "--eval.fraction",
        "0.05",
        "--eval.max_sequences",
        "4",
        "--eval.at_start",
        "true",
        "--faults.ignore_all_labels_steps",
        "2",
        "--checkpoint.export_weights",
        "true",
        "--job.dump_folder",
        str(out),
        "--job.run_name",
        "r",
    )
    check(proc)
    run = out / "r"
    assert load_config(str(run / "config.toml")).faults.ignore_all_labels_steps == [2]
    recs = read_metrics(run)
    assert [(r["step"], r["row"]) for r in recs] == [
        (1, "log"),
        (2, "step"),
        (3, "log"),
        (4, "log"),
    ]
    for key in ("loss", "grad_norm", "lr", "valid_tokens", "tokens_per_s", "memory_gib", "eta_s"):
        assert key in recs[0]
    assert recs[1]["loss"] is None and recs[1]["skipped"] and recs[1]["valid_tokens"] == 0
    assert recs[2]["skipped_steps"] == 1 and recs[2]["loss_window_steps"] == 1
    assert all(r["loss"] > 0 and r["valid_tokens"] > 0 for r in (recs[0], recs[2], recs[3]))
    assert (
        len({r["grad_norm"] for r in recs}) == 4 and recs[0]["lr"] < recs[1]["lr"]
    )  # each step's own
    assert "step 2: no valid token in the whole global batch" in proc.stderr + proc.stdout
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 4]
    before, after = (f"{e['loss']:.4f}" for e in evals)
    assert f"eval loss {before} -> {after}, perplexity " in proc.stderr + proc.stdout
    # TensorBoard: every step, read back with its own event reader; loss, eval loss, lr and grad
    # norm sort before the rest; the run is the log dir's own (".") as a real server shows it.
    scalars, _ = tensorboard_items(run / "tb")
    tags = sorted({tag for tag, _ in scalars})
    assert (
        tags[:4] == ["1_loss", "2_eval_loss", "3_lr", "4_grad_norm"] and "diag/loss_std" in tags
    ), tags
    assert sorted(s for tag, s in scalars if tag == "1_loss") == [
        1,
        3,
        4,
    ]  # step 2 trained on no token
    assert sorted(s for tag, s in scalars if tag == "3_lr") == [1, 2, 3, 4]
    assert sorted(s for tag, s in scalars if tag == "2_eval_loss") == [0, 4]
    with SummaryWriter(
        run / "tb" / "long"
    ) as long:  # more points than TensorBoard shows by default
        for step in range(1, 1501):
            long.add_scalar("1_loss", 1.0 / step, step)
    served = served_scalars(run / "tb", [(".", "1_loss"), ("long", "1_loss")])
    assert [s for s, _ in served[(".", "1_loss")]] == [1, 3, 4]
    assert [v for _, v in served[(".", "1_loss")]] == pytest.approx(
        [recs[i]["loss"] for i in (0, 2, 3)], rel=1e-6
    )
    assert [s for s, _ in served[("long", "1_loss")]] == list(range(1, 1501))
    weights = torch.load(run / "weights.pt")
    assert "tok_embeddings.weight" in weights and weights["tok_embeddings.weight"].shape == (
        2048,
        256,
    )
    # The same name again would mix two runs in one file: refused, the folder untouched.
    before = (run / "metrics.jsonl").read_text()
    proc = single(*SMALL, "--job.dump_folder", str(out), "--job.run_name", "r")
    one_line_error(proc, "already holds a run")
    assert (run / "metrics.jsonl").read_text() == before


def test_skipped_step_leaves_params_and_optimizer_state_untouched():
    from titanlite.components.optimizer import build_optimizer, set_skip
    from titanlite.config import JobConfig

    model = torch.nn.Linear(4, 3)
    opt = build_optimizer(model, JobConfig())
    model(torch.randn(2, 4)).sum().backward()
    set_skip(opt, torch.tensor(False))
    opt.step()
    snapshot = [p.detach().clone() for p in model.parameters()]
    state = {k: v.clone() for k, v in opt.state[model.weight].items()}
    set_skip(opt, torch.tensor(True))
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(snapshot, model.parameters(), strict=True))
    assert all(torch.equal(state[k], opt.state[model.weight][k]) for k in state)


def test_nan_loss_on_one_rank_stops_the_run(tmp_path):
    proc = train(
        2,
        *SMALL,
        "--training.steps",
        "6",
        "--metrics.log_every",
        "2",
        "--faults.nan_loss_step",
        "3",
        "--parallelism.dp_replicate",
        "2",
        "--job.dump_folder",
        str(tmp_path),
        "--job.run_name",
        "nan",
    )
    assert proc.returncode != 0
    assert "titanlite: stopped: non-finite loss at step 3 on 1 of 2 rank(s)" in proc.stderr
    assert [r["step"] for r in read_metrics(tmp_path / "nan")] == [1, 2]


def test_model_registered_from_outside_the_package_trains(tmp_path):
    """The fork model (tests/fork_model.py, written only from the registry's contract) through
    the trainer: SFT records packed, the loss in chunks (256 KiB of logits: 32 of 256 positions
    at a time), eval, diagnostics; its exactness in every mode is tests/test_distributed.py's."""
    proc = train(
        2,
        *SMALL,
        "--model.name",
        "fork_lm",
        "--model.flavor",
        "tiny",
        "--model.import_module",
        "fork_model",
        "--data.mode",
        "sft",
        "--data.packing",
        "true",
        "--training.seq_len",
        "256",
        "--loss.chunk_logits_mib",
        "0.25",
        "--eval.fraction",
        "0.1",
        "--eval.every",
        "8",
        "--training.steps",
        "8",
        "--optimizer.lr",
        "0.01",
        "--lr_scheduler.warmup_steps",
        "1",
        "--job.dump_folder",
        str(tmp_path),
        "--job.run_name",
        "fork",
    )
    check(proc)
    metrics = read_metrics(tmp_path / "fork")
    losses = [r["loss"] for r in metrics if "loss" in r]
    assert len(losses) == 8 and losses[-1] < losses[0]
    evals = [json.loads(x) for x in (tmp_path / "fork" / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [8] and evals[0]["loss"] < losses[0]
    cfg = load_config(str(tmp_path / "fork" / "config.toml"))
    assert (cfg.model.name, cfg.data.packing, cfg.loss.chunk_logits_mib) == ("fork_lm", True, 0.25)


@pytest.mark.parametrize(
    "cmd",
    [
        ["./run_train.sh", "--help"],
        [sys.executable, "-m", "titanlite.train", "--config", "x.toml", "-h"],
    ],
)
def test_help_prints_every_config_key_and_exits_0(cmd):
    from dataclasses import fields

    from titanlite.config import JobConfig
    from titanlite.config.job_config import sections

    env = {**os.environ, "NPROC": "2", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("usage: ")
    for name, section in sections(JobConfig()):
        for f in fields(section):
            assert f"  --{name}.{f.name} " in proc.stdout, f"{name}.{f.name}"
    assert "--faults." not in proc.stdout  # a plugin's section, only when a config names it


@pytest.mark.parametrize(
    "env, message",
    [
        ({"NPROC": "0"}, "NPROC is '0'; it must be a whole number >= 1 and <= 1,024"),
        ({"NNODES": "2"}, "NNODES=2 needs NODE_RANK, this node's index from 0 to 1"),
        ({"NPROC": "2", "LOG_RANK": "5"}, "LOG_RANK is '5'; it must name local ranks from 0 to 1 (NPROC=2), e.g. 0 or 0,1"),
    ],
)  # fmt: skip
def test_run_train_environment_values_are_one_line(tmp_path, env, message):
    """run_train.sh's environment, through the launcher's front door (every variable and kind of
    mistake: tests/test_front_door.py), as a user meets it."""
    proc = subprocess.run(
        ["./run_train.sh", "--job.dump_folder", str(tmp_path / "out")],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert (proc.returncode, proc.stderr.strip()) == (2, f"titanlite: error: {message}")
    assert not (tmp_path / "out").exists()


def test_the_model_is_checked_by_the_preflight(tmp_path):
    """An unknown flavor is one line from the launcher, before any worker or run folder."""
    proc = subprocess.run(
        [
            "./run_train.sh",
            "--model.flavor",
            "gigantic_999b",
            "--job.dump_folder",
            str(tmp_path / "out"),
        ],
        cwd=REPO,
        env={**os.environ, "NPROC": "2"},
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(
        "titanlite: error: model.flavor 'gigantic_999b' is not a flavor of llama3"
    ), line
    assert not (tmp_path / "out").exists()


def test_a_folder_whose_start_failed_is_reused_by_the_same_command(tmp_path):
    """A start that failed in the workers (a truncated weights file, a bad tokenizer) leaves a run
    folder without a logged step: the same command, once fixed, reuses it; a folder whose run
    logged a step is refused."""
    from titanlite.components.run.plan import resume_plan

    cfg = load_config(None, ["--job.dump_folder", str(tmp_path), "--job.run_name", "r"])
    run = tmp_path / "r"
    run.mkdir()
    for name in ("config.toml", "run.json", "metrics.jsonl"):
        (run / name).write_text("")
    assert resume_plan(cfg, run, restarted=False) == (None, None)
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 7.0}\n')
    with pytest.raises(UserError, match="already holds a run without a checkpoint to resume"):
        resume_plan(cfg, run, restarted=False)


def test_an_error_the_workers_find_is_printed_once_and_adds_no_logs(tmp_path):
    """Every rank finds an empty data file alike: the console shows rank 0's line only, and the
    existing run folder it was launched into gains nothing (no logs/ of the refused launch)."""
    data = tmp_path / "empty.jsonl"
    data.write_text("")
    (tmp_path / "out" / "r").mkdir(parents=True)
    proc = subprocess.run(
        [
            "./run_train.sh",
            *SMALL[2:],
            "--data.path",
            str(data),
            "--job.dump_folder",
            str(tmp_path / "out"),
            "--job.run_name",
            "r",
        ],  # fmt: skip
        cwd=REPO,
        env={**os.environ, "NPROC": "2"},
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    one_line_error(proc, str(data))
    assert "[rank1]" not in proc.stderr, proc.stderr
    assert list((tmp_path / "out" / "r").iterdir()) == []


def test_the_launcher_blames_the_cause_in_every_combination_of_failures():
    """Every combination of three ranks' exit codes (a stop of their own, a crash, a lost peer),
    each rank alive or not when torchrun stopped the rest: the rank blamed is never one torchrun
    stopped while another failed by itself, never a lost peer while a rank stopped or crashed, and
    never a crash while a rank stopped the run itself."""
    import itertools

    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from titanlite.components.run.torchrun import NO_RESTART, cause
    from titanlite.errors import EXIT_LOST_RANK

    codes = (2, 3, 130, 143, 1, -9, -15, EXIT_LOST_RANK)

    def kind(code: int) -> int:
        return 0 if code in NO_RESTART else 2 if code == EXIT_LOST_RANK else 1

    for exits in itertools.product(codes, repeat=3):
        for alive in itertools.product((False, True), repeat=3):
            stopped = {r for r in range(3) if alive[r]}
            failures = {
                r: ProcessFailure(local_rank=r, pid=100 + r, exitcode=c, error_file="")
                for r, c in enumerate(exits)
            }
            rank, first = cause(failures, stopped)
            assert first is failures[rank]
            own = [r for r in range(3) if r not in stopped] or list(range(3))
            assert rank in own, (exits, stopped)
            assert kind(exits[rank]) == min(kind(exits[r]) for r in own), (exits, stopped)


def test_a_rank_stopped_by_its_own_signal_is_the_cause_though_a_peer_failed_first(tmp_path, capsys):
    """A stop that reaches one rank (a signal to it or to one of its DataLoader workers) before
    the first step: it ends with its line while its peer, in a collective, loses it (exit 4) and
    torchrun stops the rank before its own exit code is in. Every signal, the stopped rank alive
    or not and on the console or not: the launch ends with the stop's code and the rank's line."""
    import itertools

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from titanlite.components.run.torchrun import report_failure
    from titanlite.errors import BEFORE_FIRST_STEP, EXIT_LOST_RANK

    for i, (sig, exit1, shown) in enumerate(
        itertools.product(("SIGINT", "SIGTERM"), (-15, 130, 143), (None, {0}))
    ):
        line = f"titanlite: stopped by {sig} {BEFORE_FIRST_STEP}"
        logs = tmp_path / str(i)
        for rank, text in ((0, "titanlite: stopped: a collective lost its connection"), (1, line)):
            (logs / "attempt_0" / str(rank)).mkdir(parents=True)
            (logs / "attempt_0" / str(rank) / "stderr.log").write_text(text + "\n")
        failures = {
            0: ProcessFailure(local_rank=0, pid=100, exitcode=EXIT_LOST_RANK, error_file=""),
            1: ProcessFailure(local_rank=1, pid=101, exitcode=exit1, error_file=""),
        }
        code = report_failure(ChildFailedError("titanlite.train", failures), logs, shown, {1})
        assert code == 128 + getattr(signal, sig), (sig, exit1, shown, code)
        printed = capsys.readouterr().err.splitlines()
        assert printed == ([] if shown is None else [f"[rank1]: {line}"]), printed
    # without such a line the lost peer is still named after a crash-free stop by torchrun
    logs = tmp_path / "plain"
    for rank in (0, 1):
        (logs / "attempt_0" / str(rank)).mkdir(parents=True)
        (logs / "attempt_0" / str(rank) / "stderr.log").write_text("[titanlite r0] step 1/9\n")
    failures = {
        0: ProcessFailure(local_rank=0, pid=100, exitcode=EXIT_LOST_RANK, error_file=""),
        1: ProcessFailure(local_rank=1, pid=101, exitcode=-15, error_file=""),
    }
    assert report_failure(ChildFailedError("t", failures), logs, None, {1}) == EXIT_LOST_RANK


def test_the_launcher_says_why_a_rank_stopped_when_its_log_lacks_its_line(tmp_path, capsys):
    """A rank's log is its stderr: on a full disk its one line may not land. Every combination of
    the failed rank's log holding its line or not, another rank's holding one or not, and rank 0
    on the console or not: the launcher's output holds one line saying why, never none."""
    import itertools

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from titanlite.components.run.torchrun import report_failure

    line = "titanlite: stopped: writing metrics.jsonl failed: disk full"
    for i, (own, other, shown) in enumerate(
        itertools.product((True, False), (True, False), (None, {1}))
    ):
        logs = tmp_path / str(i)
        for rank, holds in ((0, own), (1, other)):
            (logs / "attempt_0" / str(rank)).mkdir(parents=True)
            (logs / "attempt_0" / str(rank) / "stderr.log").write_text(
                "[titanlite r0] step 1/9\n" + (line + "\n" if holds else "")
            )
        failure = ProcessFailure(local_rank=0, pid=100, exitcode=3, error_file="")
        assert (
            report_failure(ChildFailedError("titanlite.train", {0: failure}), logs, shown, set())
            == 3
        )
        printed = capsys.readouterr().err.splitlines()
        if own and (shown is None or other):  # on the console already: rank 0's, or rank 1's alike
            assert printed == [], (own, other, shown)
        elif own or other:
            assert printed == [f"[rank0]: {line}" if own else line], (own, other, shown, printed)
        else:
            assert (
                len(printed) == 1 and "rank 0 failed with exit code 3 and its log " in printed[0]
            ), printed
            assert "is the disk under it full?" in printed[0], printed
    # the logs removed with the run folder (rm -rf): the console's line stands, nothing is guessed
    failure = ProcessFailure(local_rank=0, pid=100, exitcode=3, error_file="")
    assert (
        report_failure(
            ChildFailedError("titanlite.train", {0: failure}), tmp_path / "gone", None, set()
        )
        == 3
    )
    assert capsys.readouterr().err == ""
