"""Where numbers go: a progress line, a JSONL file (one object per log step) and TensorBoard."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from titanlite.tools.cache import atomic_write_bytes
from titanlite.tools.formatting import fmt, format_duration

logger = logging.getLogger("titanlite")


def progress_line(rec: dict[str, Any], total_steps: int) -> str:
    width = len(str(total_steps))
    parts = [
        f"step {rec['step']:>{width}}/{total_steps}",
        "loss skipped" if rec["loss"] is None else f"loss {rec['loss']:.4f}",
        f"grad_norm {rec['grad_norm']:.3f}",
        f"lr {rec['lr']:.2e}",
        f"tok/s {rec['tokens_per_s']:,.0f}",
        f"mem {rec['memory_gib']:.2f}GiB",
    ]
    if "mfu_pct" in rec:
        parts.append(f"mfu {rec['mfu_pct']:.1f}%")
    parts.append(f"eta {format_duration(rec['eta_s'])}")
    return " | ".join(parts)


def diagnostics_line(d: dict[str, Any]) -> str:
    return " | ".join(
        [
            f"diag step {d['step']}",
            f"loss std {fmt(d.get('loss_std'), '.4f')} (max r{d.get('loss_max_rank', '-')})",
            f"tokens {d['tokens_min']}..{d['tokens_max']}",
            f"grad_norm cv {fmt(d.get('grad_norm_cv'), '.3f')}",
            f"cos {fmt(d.get('cos_mean_pairwise'), '.3f')} (min to mean r{d.get('cos_to_mean_min_rank', '-')} "
            f"{fmt(d.get('cos_to_mean_min'), '.3f')})",
            f"noise scale {fmt(d.get('noise_scale_tokens'), ',.0f')} tokens",
        ]
    )


class MetricsWriter:
    """Writes on rank 0 only. The JSONL file is flushed after every record so scripts can tail it."""

    def __init__(
        self, run_dir: Path | None, total_steps: int, tensorboard: bool, purge_step: int | None = None
    ) -> None:
        self.total_steps = total_steps
        self._jsonl = None
        self._diag = None
        self._events = None
        self._eval = None
        self._tb = None
        if run_dir is None:
            return
        self._jsonl = (run_dir / "metrics.jsonl").open("a", encoding="utf-8")
        self._diag = (run_dir / "diagnostics.jsonl").open("a", encoding="utf-8")
        self._events = (run_dir / "events.jsonl").open("a", encoding="utf-8")
        self._eval = (run_dir / "eval.jsonl").open("a", encoding="utf-8")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tb"), purge_step=purge_step)

    def write(self, rec: dict[str, Any]) -> None:
        logger.info(progress_line(rec, self.total_steps))
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(rec) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for key, value in rec.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(f"train/{key}", value, rec["step"])

    def write_diagnostics(self, records: list[dict[str, Any]]) -> None:
        """Every measured step in full (per-rank vectors too) to diagnostics.jsonl; scalars to
        TensorBoard under diag/; a one-line summary of the latest to the console."""
        if not records:
            return
        if self._diag is not None:
            for rec in records:
                self._diag.write(json.dumps(rec) + "\n")
            self._diag.flush()
        if self._tb is not None:
            for rec in records:
                for key, value in rec.items():
                    if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                        self._tb.add_scalar(f"diag/{key}", value, rec["step"])
        logger.info(diagnostics_line(records[-1]))

    def write_eval(self, rec: dict[str, Any]) -> None:
        """An eval's record: a console line, a line in eval.jsonl, TensorBoard scalars under eval/."""
        logger.info(
            f"eval step {rec['step']} | loss {rec['eval_loss']:.4f} | perplexity {rec['eval_perplexity']:.2f} | "
            f"{rec['eval_tokens']:,} tokens of {rec['eval_sequences']:,} sequences in {rec['eval_s']:.1f}s"
        )
        if self._eval is not None:
            self._eval.write(json.dumps(rec) + "\n")
            self._eval.flush()
        if self._tb is not None:
            for key, value in rec.items():
                if key.startswith("eval_"):
                    self._tb.add_scalar(f"eval/{key[5:]}", value, rec["step"])

    def write_alerts(self, alerts: list) -> None:
        """Alerts: a console warning, a line in events.jsonl and TensorBoard text."""
        for alert in alerts:
            logger.warning(alert.line())
            if self._events is not None:
                self._events.write(json.dumps(alert.to_dict()) + "\n")
                self._events.flush()
            if self._tb is not None:
                self._tb.add_text(f"alerts/{alert.name}", alert.line(), alert.step)

    def close(self) -> None:
        for f in (self._jsonl, self._diag, self._events, self._eval):
            if f is not None:
                f.close()
        if self._tb is not None:
            self._tb.close()


def truncate_after(run_dir: Path, step: int) -> None:
    """A resumed run continues from `step`: drop the records of later steps (written before the
    crash) from the JSONL files, and a line cut off by the crash; each file rewritten atomically."""
    for name in ("metrics.jsonl", "diagnostics.jsonl", "events.jsonl", "eval.jsonl", "samples.jsonl"):
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
