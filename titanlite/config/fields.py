"""What the config's keys are, apart from their sections (titanlite.config.job_config): how a
field is declared (`opt`, `schedule`, and `due`, the one schedule rule), which keys make a run's
identity (IDENTITY_KEYS)."""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

# The longest history or window in steps a field may ask for (what it holds fits any machine).
STEPS_MAX = 1_000_000


def whole_number(text: str) -> bool:
    """`text` is a whole number in ASCII digits (str.isdigit also takes '²', which int() refuses,
    and '٢', which int() reads as 2)."""
    return text.isascii() and text.isdigit()


def opt(
    default: Any,
    help: str = "",
    choices: tuple[str, ...] | None = None,
    *,
    at_least: float | None = None,
    above: float | None = None,
    at_most: float | None = None,
    below: float | None = None,
    path: str | None = None,
    whole_items: bool = False,
) -> Any:
    """A dataclass field with its one-line doc (--help), a string's allowed values, a number's
    bounds (checked by titanlite.config.manager.check_values), a path's kind ("file", or data.path's
    "mixture": read from the caller's folder), and `whole_items`: a list whose command-line value
    is one item unless it is a JSON list (prompts may hold commas)."""
    meta: dict[str, Any] = {"help": help, "choices": choices, "whole_items": whole_items}
    if path is not None:
        meta["path"] = path
    bounds = {">=": at_least, ">": above, "<=": at_most, "<": below}
    meta["bounds"] = {op: v for op, v in bounds.items() if v is not None}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def section(cls: type) -> type:
    """A dataclass whose fields' docs are the strings under them (attribute docstrings), so a
    field and its doc read as one unit; --help prints them."""
    cls = dataclass(cls)
    try:
        source = inspect.getsource(cls)
    except OSError:  # no source (a .pyc-only install): --help lists the keys without their docs
        return cls
    body = ast.parse(textwrap.dedent(source)).body[0].body
    for node, doc in zip(body, body[1:], strict=False):
        if isinstance(node, ast.AnnAssign) and isinstance(doc, ast.Expr):
            found = next(f for f in fields(cls) if f.name == ast.unparse(node.target))
            found.metadata = MappingProxyType({**found.metadata, "help": doc.value.value})
    return cls


def schedule(default: int, what: str, note: str = "") -> Any:
    """A schedule field: `what` happens after steps N, 2N, 3N, ... (N its value); 0: never.
    What happens once at the start or the end of a run is a switch of its own (e.g. at_end)."""
    return opt(
        default,
        f"{what} every this many steps; 0: never" + (f"; {note}" if note else ""),
        at_least=0,
    )


def due(step: int, every: int) -> bool:
    """Whether a schedule field (`every`) is due after `step` (1-based): the one rule of every
    periodic action."""
    return every > 0 and step % every == 0


# What makes two runs train the same thing: a checkpoint resumes only into a run that shares it,
# and run comparison gives a verdict only then. The layout, logging, optimizer, precision, dropout
# may differ (they change the curve, not what is trained).
IDENTITY_KEYS = (
    "model.name",
    "model.flavor",
    "model.builtin_vocab_size",
    "model.vocab_size",
    "model.tokenizer_path",
    "model.hf_assets_path",
    "data.mode",
    "data.path",  # with a mixture's weights
    "data.text_field",
    "data.packing",  # which records share a sequence
    "data.document_mask",  # what a token attends to
    "eval.fraction",  # which sequences are held out of training
    "training.seed",
    "training.global_batch_size",
    "training.seq_len",  # the data position is counted in sequences of this length
    "optimizer.weight_decay_embeddings",  # which parameter group a table is in: the optimizer's layout
    "checkpoint.initial_load_path",  # the weights a new run starts from
    "checkpoint.initial_load_model_only",
)


def value_of(cfg: Any, dotted: str) -> Any:
    """A JobConfig's value of "section.key"."""
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


def identity(cfg: Any) -> dict[str, Any]:
    """The identity keys' values of a JobConfig, as {"section.key": value}."""
    return {dotted: value_of(cfg, dotted) for dotted in IDENTITY_KEYS}
