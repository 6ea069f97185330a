"""Number formatting shared by the console line, the run comparison and the scripts' tables."""

from __future__ import annotations

from typing import Any


def fmt(value: Any, spec: str) -> str:
    """`format(value, spec)`, or "-" for a missing value (a skipped step, an empty rank)."""
    return "-" if value is None else format(value, spec)


def format_duration(seconds: float) -> str:
    """H:MM:SS."""
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
