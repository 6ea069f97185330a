"""Where numbers go: a progress line per log step (components/summary.py), JSONL files
(metrics.jsonl: a row per step, through components/run/files.py), and the sinks, TensorBoard
and, when metrics.enable_wandb is on, Weights & Biases, which take scalars and text at a step."""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch.distributed as dist

from titanlite.components.run.files import RunFiles
from titanlite.components.run.plan import is_restart
from titanlite.components.summary import (
    RunTally,
    diagnostics_line,
    progress_line,
    quiet_faults,
    summary_lines,
)
from titanlite.config.job_config import JobConfig
from titanlite.errors import TrainingError, UserError, first_line
from titanlite.tools.cache import atomic_write_bytes
from titanlite.tools.records import read_records

logger = logging.getLogger("titanlite")


# TensorBoard sorts its sections and cards by tag name, so the curves a user opens it for get
# names that sort first; every other number is `<group>/<key>` (train/, eval/, diag/) after them.
FIRST_TAGS = {
    "train/loss": "1_loss",
    "eval/loss": "2_eval_loss",
    "train/lr": "3_lr",
    "train/grad_norm": "4_grad_norm",
}


# The loss terms a model adds (a training row's "terms") and their sum with the loss, next after them.
TERM_TAGS = "5_loss_terms"
# A mixture of experts' load per MoE layer (a log row's "expert_load"): <LOAD_TAGS>/max_min/<layer>
# and <LOAD_TAGS>/cv/<layer> (components/expert_load.py).
LOAD_TAGS = "6_expert_load"


def _scalar(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def scalar_tags(prefix: str, rec: dict[str, Any]) -> dict[str, float]:
    """tag -> value for every number of a record but its step and version: `<prefix>/<key>` or its
    FIRST_TAGS name, a training row's loss terms under TERM_TAGS and expert load under
    LOAD_TAGS. Every sink gets these keys."""
    out = {}
    for key, value in rec.items():
        if key not in ("step", "version", "loss_total") and _scalar(value):
            tag = f"{prefix}/{key}"
            out[FIRST_TAGS.get(tag, tag)] = value
    if prefix == "train" and isinstance(rec.get("terms"), dict):
        out.update({f"{TERM_TAGS}/{name}": v for name, v in rec["terms"].items() if _scalar(v)})
        if _scalar(rec.get("loss_total")):
            out[f"{TERM_TAGS}/total"] = rec["loss_total"]
    if prefix == "train" and isinstance(rec.get("expert_load"), dict):
        for figure in ("max_min", "cv"):
            per_layer = rec["expert_load"][figure].items()
            out.update({f"{LOAD_TAGS}/{figure}/{layer}": v for layer, v in per_layer if _scalar(v)})
    return out


class MetricsWriter:
    """Rank 0's records, through the run folder's one writer (components/run/files.py) and the
    sinks (TensorBoard, W&B: same keys at the same steps). A failed write is one line, to
    `on_failure` (the trainer stops every rank) or raised; after it nothing more is written."""

    def __init__(
        self,
        run_dir: Path | None,
        total_steps: int,
        tensorboard: bool,
        purge_step: int | None = None,
        cfg: JobConfig | None = None,
        checkpoints: Path | None = None,
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        self.total_steps = total_steps
        self.on_failure, self.failure = on_failure, ""
        self.run_dir, self.tensorboard, self.cfg = run_dir, tensorboard, cfg
        self.diag_console = cfg.diagnostics.console if cfg is not None else "full"
        self.tally = RunTally()
        self.files = RunFiles(run_dir, checkpoints) if run_dir is not None else None
        self._sinks: list[TensorBoard | WandB] = []
        if run_dir is None:
            return
        self.files.check()
        if tensorboard:
            self._sinks.append(TensorBoard(run_dir, purge_step, self.files))
        if cfg is not None and cfg.metrics.enable_wandb:
            self._sinks.append(WandB(run_dir, cfg))

    @classmethod
    def for_run(
        cls, cfg: JobConfig, run_dir: Path, resume: int | None, checkpoints: Path, on_failure
    ) -> MetricsWriter:
        """The trainer's writer: rank 0's writes into `run_dir` (the other ranks' write nothing);
        a resumed or restarted run has TensorBoard drop the events of the steps it repeats."""
        purge = resume + 1 if resume is not None else 1 if is_restart() else None
        rank0 = run_dir if dist.get_rank() == 0 else None
        tb = cfg.metrics.enable_tensorboard
        writer = cls(rank0, cfg.training.steps, tb, purge, cfg, checkpoints, on_failure)
        if rank0 is not None and resume is not None:  # the summary's "before": the first launch's
            starts = [r for r in read_records(run_dir / "eval.jsonl") if r.get("step") == 0]
            writer.tally.start_eval = starts[-1] if starts else None
        return writer

    def write_scalars(self, prefix: str, rec: dict[str, Any]) -> None:
        """A record's numbers to every sink as `<prefix>/<key>` at its step: the one path of
        scalars (train/, diag/, and any later group such as eval/)."""
        values = scalar_tags(prefix, rec)
        for sink in self._sinks if values else ():
            self._guard(lambda s=sink: s.scalars(rec["step"], values))

    def _text(self, tag: str, text: str, step: int) -> None:
        for sink in self._sinks:
            self._guard(lambda s=sink: s.text(tag, text, step))

    def _append(self, name: str, records: list[dict[str, Any]]) -> None:
        if self.files is not None:
            self._guard(lambda: self.files.append(name, records))

    def check(self) -> None:
        """Every log step: the run folder's files still where the run writes them."""
        if self.files is not None:
            self._guard(self.files.check)

    def _guard(self, write: Callable[[], None]) -> None:
        """One write into the run folder; after a failure, none (see the class doc)."""
        if self.failure:
            return
        try:
            write()
        except TrainingError as e:
            self.failure = str(e)
            if self.on_failure is None:
                raise
            self.on_failure(self.failure)

    def write(self, rows: list[dict[str, Any]]) -> None:
        """A log step's rows (a row per step since the last log, the log step's last) to
        metrics.jsonl and the sinks; the console line and the summary from the last."""
        logger.info(progress_line(rows[-1], self.total_steps, self.diag_console))
        self.tally.record(rows[-1])
        self._append("metrics.jsonl", rows)
        for row in rows:
            self.write_scalars("train", row)

    def write_diagnostics(self, records: list[dict[str, Any]]) -> None:
        """Every measured step in full (per-rank vectors too) to diagnostics.jsonl; scalars to
        the sinks under diag/; with diagnostics.console = "full", a line of the latest's figures."""
        if not records:
            return
        self.tally.last_diag = records[-1]
        self._append("diagnostics.jsonl", records)
        for rec in records:
            self.write_scalars("diag", rec)
        if self.diag_console == "full":
            logger.info(diagnostics_line(records[-1]))

    def write_eval(self, rec: dict[str, Any], samples: list[dict[str, str]] = ()) -> None:
        """An eval's record: a console line, eval.jsonl, the sinks under eval/; then its samples."""
        logger.info(
            f"eval step {rec['step']} | loss {rec['loss']:.4f} | perplexity {rec['perplexity']:.2f} | "
            f"{rec['tokens']:,} tokens of {rec['sequences']:,} sequences in {rec['seconds']:.1f}s"
        )
        self.tally.record_eval(rec)
        self._append("eval.jsonl", [rec])
        self.write_scalars("eval", rec)
        self.write_samples(rec["step"], samples)

    def write_samples(self, step: int, samples: list[dict[str, str]]) -> None:
        """Decoded prompts ({"prompt", "text"}): samples.jsonl, text in the sinks (samples/<i>)
        and the first one on the console."""
        if not samples:
            return
        # repr: whitespace and control characters stay visible (a model that emits only
        # newlines prints '\n\n...', not an empty string)
        logger.info(
            f"sample step {step} | {samples[0]['prompt'][:40]!r} -> {samples[0]['text'][:80]!r}"
        )
        rows = [{"step": step, "index": i, **sample} for i, sample in enumerate(samples)]
        self._append("samples.jsonl", rows)
        for i, sample in enumerate(samples):
            self._text(f"samples/{i}", f"{sample['prompt']}{sample['text']}", step)

    def write_alerts(self, alerts: list) -> None:
        """Alerts: a console warning, a line in events.jsonl and text in the sinks (alerts/<name>);
        notes (level "info") the same, on the console as information."""
        for alert in alerts:
            logger.log(logging.WARNING if alert.is_alert else logging.INFO, alert.line())
            (self.tally.alerts if alert.is_alert else self.tally.notes)[alert.name] += 1
            self._append("events.jsonl", [alert.to_dict()])
            self._text(f"alerts/{alert.name}", alert.line(), alert.step)

    def finish(
        self, first: int, last: int, seconds: float, checkpoints: Path, exports: list[Path]
    ) -> None:
        """The run's closing lines (components/summary.py), on rank 0; one line elsewhere."""
        if self.run_dir is None:  # another node's console ends here too, and says where the rest is
            logger.info(
                f"done: steps {first}-{last} in {seconds:.1f}s; the run's summary is rank 0's, on the "
                "first node's console and in its log under <run folder>/logs"
            )
            return
        quiet = quiet_faults(self.cfg, last, self.tally.last_diag) if self.cfg else None
        for line in summary_lines(
            self.tally,
            first,
            last,
            seconds,
            self.run_dir,
            checkpoints,
            exports,
            self.tensorboard,
            quiet,
        ):
            logger.info(line)

    def close(self) -> None:
        if self.files is not None:
            self.files.close()
        for sink in self._sinks:
            sink.close()
        self._sinks = []


class TensorBoard:
    """A sink: TensorBoard events in <run folder>/tb (`--logdir <dump folder>` shows each run as
    `<run name>/tb`). Each write flushes, so a failure shows there: tb/ removed under the run is
    made again (with one line), a full disk stops the run (exit 3)."""

    def __init__(self, run_dir: Path, purge_step: int | None, files: RunFiles) -> None:
        self.run_dir, self.log_dir = run_dir, tensorboard_dir(run_dir)
        self.files = files  # the run folder's writer: the stop lines' words of what the run leaves
        _quiet_writer_thread()
        self._writer = self._open(purge_step)

    def _open(self, purge_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(log_dir=str(self.log_dir), purge_step=purge_step)

    def _call(self, write: Callable[[Any], None]) -> None:
        events = Path(self._writer._get_file_writer().event_writer._file_name)
        if not events.is_file():  # tb/ or its event file removed under the run
            if not self.run_dir.is_dir():  # the run folder itself, moved or removed
                raise TrainingError(self.files.gone())
            with contextlib.suppress(Exception):  # the broken writer's own close fails the same way
                self._writer.close()
            logger.warning(
                f"{self.log_dir} was removed while the run wrote to it; writing it again from here"
            )
            self._writer = self._open()
        try:
            fail = self.files.fail_write
            error = fail("tb") if fail else None
            if error is not None:
                raise error
            write(self._writer)
            self._writer.flush()
        except Exception as e:  # noqa: BLE001 - the writer's thread re-raises whatever stopped it
            what = f"TensorBoard's writer under {self.log_dir}"
            fix = "mend that, or set metrics.enable_tensorboard = false"
            raise TrainingError(self.files.failed(e, what, fix)) from None

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self._call(lambda w: [w.add_scalar(tag, value, step) for tag, value in values.items()])

    def text(self, tag: str, text: str, step: int) -> None:
        self._call(lambda w: w.add_text(tag, text, step))

    def close(self) -> None:
        with contextlib.suppress(Exception):  # a failure was reported where it happened
            self._writer.close()


def _quiet_writer_thread() -> None:
    """TensorBoard's writer thread keeps the error that stopped it for the next flush, where
    TensorBoard._call stops the run in one line, and raises it too, which Python prints as a
    thread's traceback: that print is dropped (threading.excepthook), for that thread only."""
    previous = threading.excepthook
    if getattr(previous, "titanlite", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        kept = getattr(args.thread, "exception", None) is args.exc_value is not None
        if not (kept and type(args.thread).__module__.startswith("tensorboard.")):
            previous(args)

    hook.titanlite = True  # type: ignore[attr-defined]
    threading.excepthook = hook


def tensorboard_dir(run_dir: Path) -> Path:
    """Where a run's TensorBoard events go (see TensorBoard)."""
    return run_dir / "tb"


WANDB_ID_FILE = "wandb_id"  # in the run folder: a resumed run continues the same W&B run
WANDB_STEP = "step"  # the x axis of every W&B chart (see WandB)


class WandB:
    """A sink: Weights & Biases (imported only when metrics.enable_wandb is on). Values are logged
    against our own `step` key (define_metric), never wandb's `step=`: W&B drops a value whose step
    is below one it has seen, yet a log step writes the diagnostics of earlier steps after its
    train record, and a resumed run repeats the steps after its checkpoint."""

    def __init__(self, run_dir: Path, cfg: JobConfig) -> None:
        import wandb

        metrics = cfg.metrics
        id_file = run_dir / WANDB_ID_FILE  # made at the folder's first run, kept for its resumes
        run_id = id_file.read_text().strip() if id_file.is_file() else ""
        if not run_id:
            run_id = secrets.token_hex(8)
            atomic_write_bytes(id_file, (run_id + "\n").encode())
        try:
            self._run = wandb.init(
                project=metrics.wandb_project,
                entity=metrics.wandb_entity or None,
                mode=metrics.wandb_mode,
                dir=str(run_dir),
                name=run_dir.name,
                id=run_id,
                resume="allow",
                config=asdict(cfg),
            )
        except Exception as e:  # no login, no network, a bad project: wandb's own exception types
            raise UserError(
                f"metrics.enable_wandb: wandb.init failed ({first_line(e)}); run `wandb login`, "
                "set metrics.wandb_mode = 'offline' or metrics.enable_wandb = false"
            ) from None
        self._run.define_metric(WANDB_STEP)
        self._groups: set[str] = set()

    def _axis(self, tags: Iterable[str]) -> None:
        """Each group ("train", "diag", ...) or lone tag ("1_loss") gets the `step` axis at its
        first value."""
        for tag in tags:
            group, slash, _ = tag.partition("/")
            if group not in self._groups:
                self._groups.add(group)
                self._run.define_metric(f"{group}/*" if slash else group, step_metric=WANDB_STEP)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self._axis(values)
        self._run.log({**values, WANDB_STEP: step})

    def text(self, tag: str, text: str, step: int) -> None:
        self._axis([tag])
        self._run.log({tag: text, WANDB_STEP: step})

    def close(self) -> None:
        self._run.finish()
