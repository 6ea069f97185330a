"""config.json's values, each read through its declaration: a model family's adapter declares
every key it reads (a `Key`: its kind, its bounds, whether null is allowed and what null then
means, its value when absent) and the relations between them (a `Relation`: top-k at most the
experts, two keys of one meaning that agree, ...), as the TOML keys declare theirs. A value
outside its declaration is one UserError naming the file, the key, the value and the bound.

Whole numbers are JSON integers: 8.0 is refused as 8.7 is, as the TOML keys refuse it and as
transformers, which builds its tensors from the value as written, cannot build a model from it.
A fork's adapter declares its keys the same way (HFAdapter.keys, titanlite/models/registry.py).
Torch-free: the preflight reads through here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from titanlite.errors import UserError

# a key's value when absent: REQUIRED means the config is not complete without it
REQUIRED = object()

KINDS = ("whole", "float", "bool", "str", "object", "layers", "ids", "strs")

# The rope settings live in one object: rope_parameters (transformers 5) or rope_scaling (older
# configs); a key named "rope.<k>" is <k> of whichever the config holds.
ROPE = "rope."


@dataclass(frozen=True)
class Key:
    """One config.json key: what it must hold, and what titanlite takes when it is absent."""

    name: str  # config.json's name ("rope.<k>": a key of the rope object)
    kind: str  # one of KINDS: whole (a JSON integer), float (finite), bool, str, object, layers
    # (a list of whole numbers), ids (a whole number or a list of them), strs (a list of strings)
    at_least: float | None = None  # numbers: the smallest allowed (each item of a list)
    above: float | None = None  # numbers: strictly above this
    choices: tuple[Any, ...] | None = None  # the only values titanlite can honour
    why: str = ""  # what a value outside `choices` would need (said in the refusal)
    null: str | None = None  # what null means where the format allows it; None: null refused
    default: Any = REQUIRED  # the value when absent (and when null, where null is allowed)

    def bound(self) -> str:
        """What the key must hold, as the refusal says it."""
        what = {
            "whole": "a whole number",
            "float": "a finite number",
            "bool": "true or false",
            "str": "a string",
            "object": "an object",
            "layers": "a list of whole numbers",
            "ids": "a whole number or a list of them",
            "strs": "a list of strings",
        }[self.kind]
        if self.at_least is not None:
            what += f" >= {self.at_least:g}"
        if self.above is not None:
            what += f" > {self.above:g}"
        if self.choices is not None:
            what = " or ".join(_shown(c) for c in self.choices)
        if self.null is not None:
            what += f", or null ({self.null})"
        return what


@dataclass(frozen=True)
class Relation:
    """A rule over several keys, checked once each holds a value (absent or null ones skip it)."""

    keys: tuple[str, ...]  # the keys it relates (named in the refusal with their values)
    holds: Callable[..., bool]  # the keys' values, in order -> whether the rule holds
    rule: str  # the rule in words, as the refusal says it
    # checked whatever the config holds, a key absent (or null) given as None (a rule on which
    # keys are there); else only where every key holds a value
    partial: bool = False


def same(a: str, b: str, agree: Callable[[Any, Any], bool] | None = None) -> Relation:
    """Two keys that say one thing: where a config holds both, they must agree (titanlite would
    take one and transformers the other)."""
    return Relation(
        (a, b),
        agree or (lambda x, y: x == y),
        "they say the same thing, so they must agree (titanlite and transformers could each take another); keep one of them",
    )


@dataclass(frozen=True)
class ConfigKeys:
    """A family's declared keys and relations; `read` gives each key's value, checked."""

    family: str  # the model, as a refusal names it ("Llama 3")
    keys: tuple[Key, ...] = ()
    relations: tuple[Relation, ...] = ()
    names: frozenset[str] = field(init=False)  # the top-level config.json keys it reads

    def __post_init__(self) -> None:
        names = {k.name for k in self.keys if not k.name.startswith(ROPE)}
        if any(k.name.startswith(ROPE) for k in self.keys):
            names |= {"rope_parameters", "rope_scaling"}
        object.__setattr__(self, "names", frozenset(names))

    def __add__(self, other: ConfigKeys) -> ConfigKeys:
        """These keys and `other`'s (its declaration of a key replaces this one's)."""
        theirs = {k.name for k in other.keys}
        return ConfigKeys(
            other.family or self.family,
            tuple(k for k in self.keys if k.name not in theirs) + other.keys,
            self.relations + other.relations,
        )

    def read(self, config: dict, path: Any = "config.json") -> dict[str, Any]:
        """{name: value} for every declared key (its default where absent or, if allowed, null);
        a value outside its declaration, a missing required key or a broken relation is one
        UserError naming `path`."""
        values, where = {}, {}
        for key in self.keys:
            present, value, named = _lookup(config, key.name)
            where[key.name] = (present, named)
            if not present or (value is None and key.null is not None):
                if key.default is REQUIRED:
                    raise UserError(
                        f"{path}: no key '{named}' ({key.bound()}); it is not a complete "
                        f"{self.family} config"
                    )
                values[key.name] = key.default
                continue
            if not _fits(key, value):
                why = f"; {key.why}" if key.why and key.choices is not None else ""
                raise UserError(f"{path}: {named} = {_shown(value)}; it must be {key.bound()}{why}")
            values[key.name] = value
        for rel in self.relations:
            found = [
                (where[k][0], values[k], where[k][1]) if k in values else _lookup(config, k)
                for k in rel.keys
            ]
            given = [value for _, value, _ in found]
            if None in given and not rel.partial:
                continue
            if not rel.holds(*given):
                said = " and ".join(
                    f"{named} = {_shown(value)}" if present else f"no {named}"
                    for present, value, named in found
                )
                raise UserError(f"{path}: {said}; {rel.rule}")
        return values


def _lookup(config: dict, name: str) -> tuple[bool, Any, str]:
    """(present, value, the name it goes by in this config) of a key; "a.b" is b of object a,
    "rope.b" b of the rope object."""
    if name.startswith(ROPE):
        inner = name[len(ROPE) :]
        for outer in ("rope_parameters", "rope_scaling"):
            rope = config.get(outer)
            if isinstance(rope, dict):
                return inner in rope, rope.get(inner), f"{outer}.{inner}"
        return False, None, f"rope_parameters.{inner}"
    head, _, rest = name.partition(".")
    if not rest:
        return head in config, config.get(head), name
    outer = config.get(head)
    if not isinstance(outer, dict):
        return False, None, name
    return rest in outer, outer.get(rest), name


def _whole(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _fits(key: Key, value: Any) -> bool:
    if key.kind == "whole":
        items, ok = [value], _whole
    elif key.kind == "float":
        items, ok = [value], _number
    elif key.kind in ("layers", "ids"):
        items = value if isinstance(value, list) else [value] if key.kind == "ids" else None
        if items is None:
            return False
        ok = _whole
    elif key.kind == "strs":
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    else:
        kind = {"bool": bool, "str": str, "object": dict}[key.kind]
        if not isinstance(value, kind):
            return False
        return key.choices is None or value in key.choices
    if not all(ok(v) for v in items):
        return False
    if key.at_least is not None and any(v < key.at_least for v in items):
        return False
    if key.above is not None and any(v <= key.above for v in items):
        return False
    return key.choices is None or value in key.choices


def _shown(value: Any) -> str:
    """A value as config.json writes it (null, true, "silu", 8.7)."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


# What every decoder titanlite reads from config.json shares (both built-in families; a fork's
# adapter may start from it too: DECODER_KEYS + ConfigKeys("Mine", ...)): the widths, the heads,
# the vocabulary, the norm and RoPE's base, and the one rule on grouped-query attention.
DECODER_KEYS = ConfigKeys(
    "",
    (
        Key("hidden_size", "whole", at_least=1),
        Key("num_hidden_layers", "whole", at_least=1),
        Key("num_attention_heads", "whole", at_least=1),
        Key("num_key_value_heads", "whole", at_least=1, null="as many as num_attention_heads", default=None),
        Key("head_dim", "whole", at_least=1, null="hidden_size / num_attention_heads", default=None),
        Key("vocab_size", "whole", at_least=1),
        Key("rms_norm_eps", "float", above=0, default=1e-6),
        Key("tie_word_embeddings", "bool", default=False),
        Key("rope_theta", "float", above=0, null="rope_parameters' rope_theta, else 10000", default=None),
        Key("rope_scaling", "object", null="no scaling", default=None),
        Key("rope_parameters", "object", null="rope_theta's, no scaling", default=None),
        Key("rope.rope_theta", "float", above=0, default=None),
    ),
    (
        Relation(
            ("num_attention_heads", "num_key_value_heads"),
            lambda h, kv: h % kv == 0,
            "num_key_value_heads must divide num_attention_heads (each KV head serves a whole group of heads)",
        ),
    ),
)  # fmt: skip
