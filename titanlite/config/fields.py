"""`opt`: a config field with its one-line doc, its choices and its bounds, which the manager
(titanlite.config.manager) checks and prints in --help."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def opt(
    default: Any,
    help: str,
    choices: tuple[str, ...] | None = None,
    *,
    at_least: float | None = None,
    above: float | None = None,
    at_most: float | None = None,
    below: float | None = None,
) -> Any:
    """A dataclass field with its one-line doc and, for strings, the allowed values; for numbers,
    the bounds a value must keep (checked with every config: titanlite.config.manager.check_values)."""
    meta: dict[str, Any] = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    bounds = {">=": at_least, ">": above, "<=": at_most, "<": below}
    meta["bounds"] = {op: v for op, v in bounds.items() if v is not None}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)
