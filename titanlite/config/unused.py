"""Config keys that another key's value makes unused (a flavor beside model.hf_assets_path, whose
config.json gives the model): UNUSED lists each with the keys that decide it and why.

A run records what it trained, so such a key never holds a value in the run: `settle` puts it
back to its default, and config.toml (titanlite.config.manager.to_toml) writes it as a comment
that says why it is not used, so a run folder never holds a value the run did not use and two
runs that trained the same model compare as the same. Set by the user, it is refused in one
line where the user set it at the same level as, or after, what makes it unused (both in the
config file, or it on the command line), since they asked for it and would not get it; set in
the config file when the command line made it unused (a flavor in the file, a folder on the
command line), it gives one note, since the later word is the user's wish. Its default is no
one's wish: it is recorded as unused without a word.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from titanlite.config.fields import value_of
from titanlite.errors import UserError

# where a key's value came from, from the weakest: its default, the config file, a flag
LEVELS = ("default", "config file", "command line")


@dataclass(frozen=True)
class Unused:
    key: str  # "section.key" that goes unused
    by: tuple[str, ...]  # the keys whose values decide it (named in the refusal)
    when: Callable[[Callable[[str], Any]], bool]  # the config's values (a getter) -> unused
    why: str  # why it is not used, as a sentence fragment after "not used: "


def _source(get: Callable[[str], Any]) -> bool:
    """A tokenizer of the user's is named, or there is none (synthetic data)."""
    return bool(get("model.tokenizer_path") or get("model.hf_assets_path")) or (
        get("data.mode") == "synthetic"
    )


UNUSED = (
    Unused(
        "model.flavor",
        ("model.hf_assets_path",),
        lambda get: bool(get("model.hf_assets_path")),
        "model.hf_assets_path's config.json gives the model's shapes",
    ),
    Unused(
        "model.vocab_size",
        ("model.hf_assets_path",),
        lambda get: bool(get("model.hf_assets_path")),
        "model.hf_assets_path's config.json gives the vocabulary",
    ),
    Unused(
        "model.builtin_vocab_size",
        ("model.tokenizer_path", "model.hf_assets_path", "data.mode"),
        _source,
        "the built-in tokenizer is not used (model.tokenizer_path or model.hf_assets_path names "
        "another, or data.mode = 'synthetic' has none)",
    ),
    Unused(
        "model.tokenizer_path",
        ("data.mode",),
        lambda get: get("data.mode") == "synthetic",
        "data.mode = 'synthetic' draws token ids with no tokenizer",
    ),
    Unused(
        "model.dropout_masks",
        ("model.dropout",),
        lambda get: not get("model.dropout"),
        "model.dropout is 0, so there are no dropout masks",
    ),
    Unused(
        "checkpoint.initial_load_model_only",
        ("checkpoint.initial_load_path",),
        lambda get: not get("checkpoint.initial_load_path"),
        "checkpoint.initial_load_path is empty, so nothing is loaded",
    ),
    Unused(
        "checkpoint.initial_load_drop",
        ("checkpoint.initial_load_path",),
        lambda get: not get("checkpoint.initial_load_path"),
        "checkpoint.initial_load_path is empty, so nothing is loaded",
    ),
)


def unused(get: Callable[[str], Any]) -> dict[str, str]:
    """{key: why} of the keys the values (`get("section.key")`) leave unused."""
    return {u.key: u.why for u in UNUSED if u.when(get)}


def unused_in(cfg: Any) -> dict[str, str]:
    """unused() of a JobConfig."""
    return unused(lambda key: value_of(cfg, key))


def _default(cfg: Any, dotted: str) -> Any:
    section_name, key = dotted.split(".")
    section = getattr(cfg, section_name)
    default = type(section)()
    return getattr(default, key)


def settle(cfg: Any, origin: dict[str, str] | None = None) -> list[str]:
    """Put each unused key of `cfg` back to its default; `origin`: where each key the user set
    came from (LEVELS; absent: its default). A key set at the level of what makes it unused, or
    later, is refused in one line; one set earlier gives a note (returned)."""
    origin = origin or {}
    notes = []
    for rule in UNUSED:
        if not rule.when(lambda key: value_of(cfg, key)):
            continue
        set_at = origin.get(rule.key, "default")
        deciding = max((origin.get(k, "default") for k in rule.by), key=LEVELS.index)
        value = value_of(cfg, rule.key)
        shown = [k for k in rule.by if value_of(cfg, k) != _default(cfg, k)] or list(rule.by)
        by = " and ".join(f"{k} = {value_of(cfg, k)!r}" for k in shown)
        if set_at != "default" and LEVELS.index(set_at) >= LEVELS.index(deciding):
            raise UserError(
                f"{rule.key} = {value!r} ({set_at}) is not used beside {by}: {rule.why}; "
                f"remove {rule.key}, or change {' or '.join(shown)}"
            )
        if set_at != "default" and value != _default(cfg, rule.key):
            notes.append(
                f"{rule.key} = {value!r} from the {set_at} is not used beside {by} from the "
                f"{deciding}: {rule.why}; config.toml records it as unused"
            )
        section_name, key = rule.key.split(".")
        setattr(getattr(cfg, section_name), key, _default(cfg, rule.key))
    return notes
