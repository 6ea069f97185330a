"""Where numbers go: a progress line, a JSONL file (one object per log step) and TensorBoard."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger("titanlite")


def format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


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


class MetricsWriter:
    """Writes on rank 0 only. The JSONL file is flushed after every record so scripts can tail it."""

    def __init__(self, run_dir: Path | None, total_steps: int, tensorboard: bool) -> None:
        self.total_steps = total_steps
        self._jsonl = None
        self._tb = None
        if run_dir is None:
            return
        self._jsonl = (run_dir / "metrics.jsonl").open("a", encoding="utf-8")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tb"))

    def write(self, rec: dict[str, Any]) -> None:
        logger.info(progress_line(rec, self.total_steps))
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(rec) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for key, value in rec.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(f"train/{key}", value, rec["step"])

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
