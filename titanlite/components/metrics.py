"""Where numbers go: a progress line per log step (components/summary.py), JSONL files
(metrics.jsonl: a row per step), TensorBoard and, if enabled, Weights & Biases."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch.distributed as dist

from titanlite.components.run.files import RECORD_FILES, RunFiles
from titanlite.components.run.plan import is_restart
from titanlite.components.sinks import TensorBoard, WandB
from titanlite.components.summary import (
    RunTally,
    diagnostics_line,
    progress_line,
    quiet_faults,
    summary_lines,
)
from titanlite.config.job_config import JobConfig
from titanlite.errors import TrainingError
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


def _scalar(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def scalar_tags(prefix: str, rec: dict[str, Any]) -> dict[str, float]:
    """tag -> value for every number of a record but its step and format version (None, a bool,
    a nested dict or list are not scalars): `<prefix>/<key>`, or its FIRST_TAGS name; a training
    row's loss terms as `5_loss_terms/<name>` and `5_loss_terms/total`. What every sink gets, so
    their keys are equal."""
    tags = {
        f"{prefix}/{key}": value
        for key, value in rec.items()
        if key not in ("step", "version", "loss_total") and _scalar(value)
    }
    out = {FIRST_TAGS.get(tag, tag): value for tag, value in tags.items()}
    if prefix == "train" and isinstance(rec.get("terms"), dict):
        out.update({f"{TERM_TAGS}/{name}": v for name, v in rec["terms"].items() if _scalar(v)})
        if _scalar(rec.get("loss_total")):
            out[f"{TERM_TAGS}/total"] = rec["loss_total"]
    return out


class MetricsWriter:
    """Writes on rank 0 only, every record through the run folder's one writer
    (components/run/files.py: whole records, written as they come so scripts can tail them).
    TensorBoard and W&B are sinks fed through write_scalars and _text only, so they hold the same
    keys at the same steps. A write that fails (a full disk, a file replaced by a folder) is one
    line: `on_failure(line)` hears it (the trainer stops every rank there), or it is raised;
    either way nothing more is written."""

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
        self.files.open()
        if tensorboard:
            self._sinks.append(TensorBoard(run_dir, purge_step, self.files))
        if cfg is not None and cfg.metrics.enable_wandb:
            self._sinks.append(WandB(run_dir, cfg.metrics, asdict(cfg)))

    @property
    def fail_write(self) -> Callable[[str], OSError | None] | None:
        return self.files.fail_write if self.files is not None else None

    @fail_write.setter
    def fail_write(self, fail: Callable[[str], OSError | None] | None) -> None:
        """A test seam (titanlite.faults's write_error): `fail(name)` is an OSError that the
        write of the run folder's file `name` meets instead of the disk, or None."""
        for part in [self.files, *self._sinks]:
            if hasattr(part, "fail_write"):
                part.fail_write = fail

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
        if rank0 is not None and resume is not None:  # the summary's "before", evaluated by the first launch
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
        """A log step's rows (components/step_window.py: a row per step since the last log, the
        log step's last): all to metrics.jsonl and the sinks; the console line and the summary
        from the log step's."""
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
        """An eval's record: a console line, a line in eval.jsonl, scalars in the sinks under eval/
        (its loss as 2_eval_loss); then its samples. The first eval of the run (step 0 with
        eval.at_start) is the summary's "before"."""
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
        logger.info(f"sample step {step} | {samples[0]['prompt'][:40]!r} -> {samples[0]['text'][:80]!r}")
        self._append(
            "samples.jsonl", [{"step": step, "index": i, **sample} for i, sample in enumerate(samples)]
        )
        for i, sample in enumerate(samples):
            self._text(f"samples/{i}", f"{sample['prompt']}{sample['text']}", step)

    def write_alerts(self, alerts: list) -> None:
        """Alerts: a console warning, a line in events.jsonl and text in the sinks (alerts/<name>);
        notes (level "info") the same, on the console as information."""
        for alert in alerts:
            if alert.is_alert:
                logger.warning(alert.line())
                self.tally.alerts[alert.name] += 1
            else:
                logger.info(alert.line())
                self.tally.notes[alert.name] += 1
            self._append("events.jsonl", [alert.to_dict()])
            self._text(f"alerts/{alert.name}", alert.line(), alert.step)

    def finish(self, first: int, last: int, seconds: float, checkpoints: Path, exports: list[Path]) -> None:
        """The run's closing lines (components/summary.py), on rank 0; one line elsewhere."""
        if self.run_dir is not None:
            quiet = quiet_faults(self.cfg, last, self.tally.last_diag) if self.cfg is not None else None
            lines = summary_lines(
                self.tally, first, last, seconds, self.run_dir, checkpoints, exports, self.tensorboard, quiet
            )
            for line in lines:
                logger.info(line)
        else:  # another node's console ends here too, and says where the rest is
            logger.info(
                f"done: steps {first}-{last} in {seconds:.1f}s; the run's summary is rank 0's, on the "
                "first node's console and in its log under <run folder>/logs"
            )

    def close(self) -> None:
        if self.files is not None:
            self.files.close()
        for sink in self._sinks:
            sink.close()
        self._sinks = []


def truncate_after(run_dir: Path, step: int) -> None:
    """A resumed run continues from `step`: drop the records of later steps (written before the
    crash) from the JSONL files, and a line cut off by the crash; each file rewritten atomically."""
    for name in RECORD_FILES:
        path = run_dir / name
        if not path.is_file():
            continue
        kept = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("step", 0) <= step:
                kept.append(line + "\n")
        atomic_write_bytes(path, "".join(kept).encode())
