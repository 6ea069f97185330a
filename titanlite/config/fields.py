"""`opt`: a config field with its one-line doc, its choices and its bounds, which the manager
(titanlite.config.manager) checks and prints in --help. `schedule`: a schedule field, with `due`
the one rule every periodic action (checkpoints, evals, logs, measured steps, replica checks)
follows."""

from __future__ import annotations

from dataclasses import field
from typing import Any

# The longest history or window in steps a field may ask for: beyond any run titanlite plans,
# and small enough that what it holds per step fits any machine.
STEPS_MAX = 1_000_000


def whole_number(text: str) -> bool:
    """`text` is a whole number in ASCII digits (str.isdigit also takes '²', which int() refuses,
    and '٢', which int() reads as 2)."""
    return text.isascii() and text.isdigit()


def opt(
    default: Any,
    help: str,
    choices: tuple[str, ...] | None = None,
    *,
    at_least: float | None = None,
    above: float | None = None,
    at_most: float | None = None,
    below: float | None = None,
    path: str | None = None,
    whole_items: bool = False,
) -> Any:
    """A dataclass field with its one-line doc and, for strings, the allowed values; for numbers,
    the bounds a value must keep (checked with every config: titanlite.config.manager.check_values);
    for paths, `path` "file" (one path) or "mixture" (data.path's), read from the caller's folder
    (titanlite.config.paths); for lists whose items may hold commas (prompts), `whole_items`: a
    command-line value is one item unless it is a JSON list."""
    meta: dict[str, Any] = {"help": help}
    if whole_items:
        meta["whole_items"] = True
    if path is not None:
        meta["path"] = path
    if choices is not None:
        meta["choices"] = choices
    bounds = {">=": at_least, ">": above, "<=": at_most, "<": below}
    meta["bounds"] = {op: v for op, v in bounds.items() if v is not None}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def schedule(default: int, what: str, note: str = "") -> Any:
    """A schedule field: `what` happens after steps N, 2N, 3N, ... (N its value); 0: never.
    What happens once at the start or the end of a run is a switch of its own (e.g. at_end)."""
    return opt(default, f"{what} every this many steps; 0: never" + (f"; {note}" if note else ""), at_least=0)


def due(step: int, every: int) -> bool:
    """Whether a schedule field (`every`) is due after `step` (1-based): a multiple; 0: never."""
    return every > 0 and step % every == 0
