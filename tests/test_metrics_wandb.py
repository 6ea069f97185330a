"""Optional W&B logging: the same keys at the same steps as TensorBoard, one W&B run per run
folder across resumes, wandb never imported when off, and its absence refused before any worker."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types
from dataclasses import asdict
from typing import Any

import pytest
from helpers import HANG_S, REPO, tensorboard_items

from titanlite.components.metrics import WANDB_ID_FILE, WANDB_STEP, MetricsWriter, tensorboard_dir
from titanlite.config import JobConfig, parse_args
from titanlite.diagnostics.alerts import Alert
from titanlite.errors import UserError
from titanlite.validation import validate

MISSING = (
    "metrics.enable_wandb: the wandb package is not installed; `pip install wandb` or set "
    "metrics.enable_wandb = false"
)


class FakeRun:
    """What MetricsWriter uses of a wandb Run: define_metric, log, finish."""

    def __init__(self, init: dict[str, Any]) -> None:
        self.init = init
        self.axes: dict[str, str | None] = {}
        self.logged: list[dict[str, Any]] = []
        self.finished = False

    def define_metric(self, name: str, step_metric: str | None = None) -> None:
        self.axes[name] = step_metric

    def log(self, data: dict[str, Any]) -> None:
        assert not self.finished
        self.logged.append(dict(data))

    def finish(self) -> None:
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch) -> types.ModuleType:
    """A stub `wandb` module in sys.modules; its `runs` lists every run wandb.init made."""
    mod = types.ModuleType("wandb")
    mod.runs = []

    def init(**kwargs: Any) -> FakeRun:
        run = FakeRun(kwargs)
        mod.runs.append(run)
        return run

    mod.init = init
    monkeypatch.setitem(sys.modules, "wandb", mod)
    return mod


def wandb_cfg(mode: str = "online") -> JobConfig:
    cfg = JobConfig()
    cfg.metrics.enable_wandb = True
    cfg.metrics.wandb_mode = mode
    return cfg


def train_rec(step: int) -> dict[str, Any]:
    return {
        "step": step,
        "loss": 2.5 / step,
        "loss_window_mean": None,  # not a scalar: in neither sink
        "grad_norm": 0.75,
        "lr": 1e-3,
        "valid_tokens": 512,
        "tokens_per_s": 1000.0,
        "memory_gib": 0.5,
        "eta_s": 3.0,
        "diag": {"loss_std": 0.01},  # nested: in neither sink
    }


def diag_rec(step: int) -> dict[str, Any]:
    return {
        "step": step,
        "loss_std": 0.01 * step,
        "tokens_min": 256,
        "tokens_max": 256,
        "grad_norm_cv": 0.05,
        "measured_exact": True,  # a bool: in neither sink
        "loss_per_rank": [1.0, 2.0],  # a per-rank vector: in neither sink
    }


def write_some(writer: MetricsWriter) -> None:
    """One log step as train.py writes it: the train record, then the diagnostics of the steps
    up to it (earlier steps after a later one), then alerts."""
    writer.write(
        [
            {"step": 3, "row": "step", "loss": 0.9, "grad_norm": 0.5, "lr": 1e-3, "skipped": False},
            train_rec(4),
        ]
    )
    writer.write_diagnostics([diag_rec(s) for s in (1, 2, 3, 4)])
    writer.write_alerts([Alert("identical_data", 3, [0, 1], ["h", "h"], "loss std 0")])
    writer.write_scalars(
        "eval", {"step": 4, "loss": 3.0, "perplexity": 20.1}
    )  # a further group, through the same path
    writer.write([train_rec(8)])


def wandb_items(run: FakeRun) -> tuple[dict[tuple[str, int], float], set[tuple[str, int]]]:
    """The same from the stub's log calls, at the `step` axis each call carries."""
    scalars, text = {}, set()
    for data in run.logged:
        step = data[WANDB_STEP]
        for key, value in data.items():
            if key == WANDB_STEP:
                continue
            if isinstance(value, str):
                text.add((key, step))
            else:
                assert (key, step) not in scalars, f"{key} logged twice at step {step}"
                scalars[(key, step)] = value
    return scalars, text


def test_wandb_logs_the_tensorboard_keys_at_the_same_steps(tmp_path, fake_wandb):
    cfg = wandb_cfg()
    writer = MetricsWriter(tmp_path, 8, tensorboard=True, cfg=cfg)
    write_some(writer)
    writer.close()

    (run,) = fake_wandb.runs
    run_id = (tmp_path / WANDB_ID_FILE).read_text().strip()
    assert run.init == {
        "project": "titanlite",
        "entity": None,
        "mode": "online",
        "dir": str(tmp_path),
        "name": tmp_path.name,
        "id": run_id,
        "resume": "allow",
        "config": asdict(cfg),
    }
    assert run.finished

    tb_scalars, tb_text = tensorboard_items(tensorboard_dir(tmp_path))
    wb_scalars, wb_text = wandb_items(run)
    assert wb_scalars.keys() == tb_scalars.keys()
    for key, value in tb_scalars.items():  # TensorBoard keeps float32
        assert wb_scalars[key] == pytest.approx(value, rel=1e-6), key
    assert wb_text == tb_text == {("alerts/identical_data", 3)}
    # Not vacuous: every group is there, and what is no scalar is in neither sink.
    tags = {tag for tag, _ in tb_scalars}
    want = {
        ("1_loss", 3),
        ("1_loss", 4),
        ("1_loss", 8),
        ("diag/loss_std", 1),
        ("2_eval_loss", 4),
        ("3_lr", 3),
    }
    assert want <= tb_scalars.keys()
    assert not tags & {
        "train/step",
        "train/loss_window_mean",
        "train/diag",
        "diag/measured_exact",
        "train/skipped",
    }
    assert not any(tag.startswith("diag/loss_per_rank") for tag in tags)
    # Every group is charted against the training step (W&B drops a `step=` below one it has seen).
    assert run.axes == {
        WANDB_STEP: None,
        **{f"{g}/*": WANDB_STEP for g in ("train", "diag", "alerts", "eval")},
        **{tag: WANDB_STEP for tag in ("1_loss", "2_eval_loss", "3_lr", "4_grad_norm")},
    }


def test_a_resumed_run_continues_the_same_wandb_run(tmp_path, fake_wandb):
    MetricsWriter(tmp_path, 8, tensorboard=False, cfg=wandb_cfg()).close()
    first = (tmp_path / WANDB_ID_FILE).read_text()
    resumed = MetricsWriter(tmp_path, 8, tensorboard=False, purge_step=5, cfg=wandb_cfg())
    resumed.write([train_rec(5)])
    resumed.close()
    other = tmp_path / "other"
    other.mkdir()
    MetricsWriter(other, 8, tensorboard=False, cfg=wandb_cfg()).close()

    assert (tmp_path / WANDB_ID_FILE).read_text() == first
    a, b, c = fake_wandb.runs
    assert a.init["id"] == b.init["id"] == first.strip() and b.init["resume"] == "allow"
    assert c.init["id"] != a.init["id"]
    assert all(run.finished for run in fake_wandb.runs)
    assert [d[WANDB_STEP] for d in b.logged] == [5]


def test_wandb_is_never_imported_when_off(tmp_path, monkeypatch, fake_wandb):
    monkeypatch.delitem(sys.modules, "wandb")

    class NoWandb:
        """A meta path finder that fails the test on any attempt to import wandb."""

        def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
            assert name.partition(".")[0] != "wandb", "wandb imported with metrics.enable_wandb off"

    monkeypatch.setattr(sys, "meta_path", [NoWandb(), *sys.meta_path])
    cfg = JobConfig()
    validate(cfg, 1)
    writer = MetricsWriter(tmp_path, 8, tensorboard=True, cfg=cfg)
    write_some(writer)
    writer.close()
    assert "wandb" not in sys.modules and not fake_wandb.runs
    assert not (tmp_path / WANDB_ID_FILE).exists() and not (tmp_path / "wandb").exists()
    # Rank > 0 writes nothing, whatever the config says.
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb)
    MetricsWriter(None, 8, tensorboard=True, cfg=wandb_cfg()).close()
    assert not fake_wandb.runs


def test_missing_wandb_is_refused_in_one_line_before_any_worker(monkeypatch, capsys):
    from titanlite import preflight

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    cfg, _ = parse_args(["--metrics.enable_wandb", "true"])
    with pytest.raises(UserError) as e:
        validate(cfg, 1)
    assert str(e.value) == MISSING
    cfg.metrics.enable_wandb = False
    validate(cfg, 1)
    assert preflight.main(["--world-size", "1", "--metrics.enable_wandb", "true"]) == 2
    assert capsys.readouterr().err == f"titanlite: error: {MISSING}\n"
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "wandb" else real(name, *a),
    )
    validate(wandb_cfg(), 1)  # installed: nothing to refuse


def test_trainer_refuses_missing_wandb_in_one_line(tmp_path):
    """`python -m titanlite.train` without the preflight: the trainer's validate refuses it too.
    wandb is hidden from the subprocess (a None in sys.modules makes find_spec say "absent"),
    so the test holds whether or not it is installed."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text('import sys\nsys.modules["wandb"] = None\n')
    proc = subprocess.run(
        [sys.executable, "-m", "titanlite.train", "--metrics.enable_wandb", "true"]
        + ["--job.dump_folder", str(tmp_path / "out")],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": f"{hide}{os.pathsep}{REPO}"},
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1] == f"titanlite: error: {MISSING}", proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


def test_real_wandb_offline_writes_into_the_run_folder(tmp_path, monkeypatch):
    """The real package (a test-only dependency) in offline mode: no network, the run in the run
    folder, its resume in the same W&B run."""
    pytest.importorskip("wandb")
    for var in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for _ in range(2):  # a run and its resume
        writer = MetricsWriter(run_dir, 8, tensorboard=True, cfg=wandb_cfg("offline"))
        write_some(writer)
        writer.close()
    run_id = (run_dir / WANDB_ID_FILE).read_text().strip()
    runs = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    assert runs, list(
        (run_dir / "wandb").iterdir()
    )  # one per start (one if both began in one second)
    assert all((r / f"run-{run_id}.wandb").is_file() for r in runs)
