"""Load a TOML file into JobConfig, apply `--section.key value` overrides, write it back, and
describe every key (`--help`); a problem is one UserError line naming the key and the fix."""

from __future__ import annotations

import contextlib
import difflib
import functools
import json
import math
import operator
import os
import sys
import typing
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python < 3.11
    import tomli as tomllib

from titanlite.config.fields import value_of
from titanlite.config.job_config import PLUGIN_SECTIONS, JobConfig, plugin_section, sections
from titanlite.config.layout import apply_rehearsal
from titanlite.config.unused import settle, unused_in
from titanlite.errors import UserError


def _closest(name: str, options: list[str]) -> str:
    match = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    return f" (did you mean '{match[0]}'?)" if match else f" (valid: {', '.join(options)})"


def _field_types(section: Any) -> Mapping[str, Any]:
    return _types_of(type(section))


@functools.cache
def _types_of(cls: type) -> Mapping[str, Any]:
    """A section's fields with their types, once per section (typing.get_type_hints evaluates
    every annotation: most of a config's load time when it runs for each key)."""
    hints = typing.get_type_hints(cls)
    return MappingProxyType({f.name: (hints[f.name], f) for f in fields(cls)})


def _coerce(key: str, value: Any, typ: Any, from_cli: bool, split: bool = True) -> Any:
    """Check (TOML) or parse (CLI string) one value; a CLI list: JSON, comma-separated, one item."""
    origin = typing.get_origin(typ)
    if origin is list:
        (item,) = typing.get_args(typ)
        if from_cli and value.strip().startswith("["):  # a JSON list: items may hold commas
            try:
                value = json.loads(value)
            except ValueError:
                raise UserError(f"config key '{key}' is not a valid JSON list: {value!r}") from None
        elif from_cli and not split:
            value = [value] if value.strip() else []
        elif from_cli:
            value = [v for v in value.split(",") if v.strip()] if value.strip() else []
        if not isinstance(value, list):
            raise UserError(f"config key '{key}' must be a list, got {value!r}")
        return [_coerce(key, v, item, from_cli) for v in value]
    if typ is bool:
        if from_cli:
            low = value.lower()
            if low in ("true", "1", "yes", "on"):
                return True
            if low in ("false", "0", "no", "off"):
                return False
        elif isinstance(value, bool):
            return value
        raise UserError(f"config key '{key}' must be true or false, got {value!r}")
    if typ in (int, float):
        allowed = (int,) if typ is int else (int, float)
        if from_cli:
            with contextlib.suppress(ValueError):
                return typ(value)
        elif isinstance(value, allowed) and not isinstance(value, bool):
            return typ(value)
        kind = "an integer" if typ is int else "a number"
        raise UserError(f"config key '{key}' must be {kind}, got {value!r}")
    if typ is str:
        if isinstance(value, str):
            return value
        raise UserError(f"config key '{key}' must be a string, got {value!r}")
    raise TypeError(f"unsupported config type {typ} for {key}")  # a schema bug, not user input


def _set(cfg: JobConfig, dotted: str, value: Any, from_cli: bool) -> None:
    """Set one key; a plugin's section (PLUGIN_SECTIONS) comes with its first key."""
    section_name, _, key = dotted.partition(".")
    names = [f.name for f in fields(cfg)]
    if section_name not in names or not key:
        raise UserError(f"unknown config section '{section_name}'{_closest(section_name, names)}")
    if getattr(cfg, section_name) is None:
        setattr(cfg, section_name, plugin_section(section_name))
    section = getattr(cfg, section_name)
    types = _field_types(section)
    if key not in types:
        raise UserError(
            f"unknown config key '{dotted}'"
            + _closest(key, list(types)).replace("'", f"'{section_name}.", 1)
        )
    typ, f = types[key]
    value = _coerce(dotted, value, typ, from_cli, split=not f.metadata.get("whole_items"))
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise UserError(f"config key '{dotted}' is {value!r}; choose one of {', '.join(choices)}")
    setattr(section, key, value)


HELP_FLAGS = ("-h", "--help")


def words(argv: list[str]) -> list[tuple[str, str | None]]:
    """[(name, value)] in order: `--name value` and `--name=value` as pairs, -h / --help alone;
    a word in a value's place is that value, whatever it holds."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg in HELP_FLAGS:
            out.append((arg, None))
            i += 1
            continue
        if not arg.startswith("--") or arg == "--":
            raise UserError(f"unexpected argument '{arg}'; overrides look like --section.key value")
        name, eq, value = arg[2:].partition("=")
        if eq:
            out.append((name, value))
            i += 1
        elif i + 1 < len(argv):
            out.append((name, argv[i + 1]))
            i += 2
        elif name == "config":
            raise UserError("--config has no value; write --config path/to/file.toml")
        elif arg == "--rehearse":
            raise UserError(
                "--rehearse has no value; write --rehearse W (the number of ranks to rehearse)"
            )
        else:
            raise UserError(f"override '{arg}' has no value; write {arg} VALUE")
    return out


# Set by the launcher once it has loaded the config and printed its notes, so that the workers,
# which load it again, do not repeat them.
NOTES_SHOWN_ENV = "TITANLITE_CONFIG_NOTES_SHOWN"


def moved_keys() -> dict[str, str]:
    """Every [faults] switch by its old name: each was a [debug] key before the plugin took it; a
    config or a flag naming one still loads, with one note."""
    return {f"debug.{f.name}": f"faults.{f.name}" for f in fields(plugin_section("faults"))}


def migrate(data: dict[str, Any], where: str) -> tuple[dict[str, Any], list[str]]:
    """A parsed config with the old [debug] fault keys under [faults], and the old names found."""
    out = {name: dict(table) if isinstance(table, dict) else table for name, table in data.items()}
    debug, found = out.get("debug"), []
    if not isinstance(debug, dict):
        return out, found
    defaults = plugin_section("faults")
    for key in [f.name for f in fields(defaults) if f.name in debug]:
        value = debug.pop(key)
        found.append(f"debug.{key}")
        if value == getattr(defaults, key):
            continue  # an old file's switch at its default asks for no plugin
        target = out.setdefault("faults", {})
        if isinstance(target, dict) and target.setdefault(key, value) != value:
            raise UserError(
                f"{where} sets both 'debug.{key}' and 'faults.{key}', which disagree; keep only 'faults.{key}'"
            )
    return out, found


def _deprecated(found: list[str]) -> str | None:
    """The one note on the old [debug] fault keys (moved_keys) a config still names."""
    if not found:
        return None
    keys = ", ".join(dict.fromkeys(old.split(".")[1] for old in found))
    return f"config keys moved (the old names still load; use the new ones): [debug] {keys} -> [faults]"


_COMPARE = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt}


def _bounds_text(bounds: dict[str, float]) -> str:
    return " and ".join(f"{op} {bound}" for op, bound in bounds.items())


# A whole number past this is a typo, not a wish (and overflows the C ints it reaches); a field
# that may go further says so with its own at_most (training.seed).
INT_LIMIT = 2**31 - 1


def check_values(cfg: JobConfig) -> None:
    """Every number finite and within its field's bounds (a whole number at most INT_LIMIT unless
    its field allows more): one line naming the key, the value and the bounds."""
    for name, section in sections(cfg):
        for f in fields(section):
            value, bounds = getattr(section, f.name), dict(f.metadata.get("bounds", {}))
            if isinstance(value, int) and not isinstance(value, bool) and "<=" not in bounds:
                bounds["<="] = INT_LIMIT
            if isinstance(value, float) and not math.isfinite(value):
                rule = f" {_bounds_text(bounds)}" if bounds else ""
                raise UserError(f"{name}.{f.name} is {value}; it must be a finite number{rule}")
            if isinstance(value, (int, float)) and not all(
                _COMPARE[op](value, b) for op, b in bounds.items()
            ):
                raise UserError(f"{name}.{f.name} is {value}; it must be {_bounds_text(bounds)}")


def load_config(
    path: str | None, overrides: list[str] | None = None, notes: list[str] | None = None
) -> JobConfig:
    """Defaults, then the TOML file (if any), then `--section.key value` overrides. Its notes (moved
    keys, a rehearsal's changes) go into `notes`, else are printed once per launch."""
    cfg, found = JobConfig(), []
    origin: dict[str, str] = {}  # where each key set came from (titanlite.config.unused.LEVELS)
    if path:
        p = Path(path)
        if p.is_dir():
            raise UserError(
                f"config file '{path}' is a folder; pass a .toml file (e.g. train_configs/debug_model.toml)"
            )
        if not p.is_file():
            raise UserError(f"config file '{path}' not found; pass an existing --config file")
        try:
            data = tomllib.loads(p.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as e:
            raise UserError(
                f"config file '{path}' is not UTF-8 text (byte {e.start}); pass a TOML file"
            ) from None
        except tomllib.TOMLDecodeError as e:
            raise UserError(f"config file '{path}' is not valid TOML: {e}") from None
        data, found = migrate(data, f"config file '{path}'")
        for section_name, table in data.items():
            if not isinstance(table, dict):
                raise UserError(
                    f"config entry '{section_name}' in '{path}' must be a [section] table"
                )
            if section_name not in [f.name for f in fields(cfg)]:
                _set(cfg, section_name + ".x", None, False)  # raises with a suggestion
            for key, value in table.items():
                _set(cfg, f"{section_name}.{key}", value, False)
                origin[f"{section_name}.{key}"] = "config file"
    typed: dict[str, tuple[str, Any]] = {}  # key -> (the name it was typed as, the value it got)
    for dotted, value in words(overrides or []):
        if "." not in dotted:
            raise UserError(f"unknown flag '--{dotted}'; overrides look like --section.key value")
        key = moved_keys().get(dotted, dotted) if dotted.startswith("debug.") else dotted
        if key != dotted:
            found.append(dotted)
        _set(cfg, key, value, from_cli=True)
        got = value_of(cfg, key)
        if key in typed and typed[key][0] != dotted and typed[key][1] != got:
            raise UserError(
                f"the command line sets both '{typed[key][0]}' and '{dotted}', which disagree; keep only '{key}'"
            )
        typed[key] = (dotted, got)
        origin[key] = "command line"
    # a key another key leaves unused: refused where the user asked for it last, else recorded
    said = [n for n in (_deprecated(found), *settle(cfg, origin), apply_rehearsal(cfg)) if n]
    settle(cfg)  # what the rehearsal leaves unused (its note says what it turns off)
    if notes is not None:
        notes += said
    elif not os.environ.get(NOTES_SHOWN_ENV):
        for note in said:
            print(f"titanlite: note: {note}", file=sys.stderr)
    return cfg


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(type(v))


def to_toml(cfg: JobConfig) -> str:
    """The resolved config as TOML, one commented key per line; load_config reads it back. A key
    another key leaves unused (titanlite.config.unused) is a comment saying so, never a value."""
    lines, unused = [], unused_in(cfg)
    for name, section in sections(cfg):
        lines.append(f"[{name}]")
        for f in fields(section):
            if f"{name}.{f.name}" in unused:
                lines.append(f"# {f.name}: not used ({unused[f'{name}.{f.name}']})")
                continue
            lines.append(
                f"{f.name} = {_toml_value(getattr(section, f.name))}  # {f.metadata['help']}"
            )
        lines.append("")
    return "\n".join(lines)


def _type_name(typ: Any) -> str:
    if typing.get_origin(typ) is list:
        (item,) = typing.get_args(typ)
        return f"list[{item.__name__}]"
    return typ.__name__


def config_help(usage: str) -> str:
    """`usage`, then every section and key with its type, default, choices, bounds and doc."""
    lines = [
        usage,
        "",
        "A TOML file (--config) sets [section] key = value; a flag --section.key VALUE (or",
        "--section.key=VALUE) overrides it. Lists are comma-separated on the command line.",
    ]
    for name, section in sections(JobConfig()):
        lines += ["", f"[{name}]"]
        for key, (typ, f) in _field_types(section).items():
            default = _toml_value(getattr(section, key))
            choices, bounds = f.metadata.get("choices"), f.metadata.get("bounds")
            doc = f.metadata["help"] + (f" (one of: {', '.join(choices)})" if choices else "")
            doc += f" ({_bounds_text(bounds)})" if bounds else ""
            lines.append(f"  --{name}.{key} {_type_name(typ)} = {default}")
            lines.append(f"        {doc}")
    plugins = ", ".join(
        f"[{name}] ({PLUGIN_SECTIONS[name][0].split(':')[0]})" for name in PLUGIN_SECTIONS
    )
    lines += [
        "",
        f"Plugin sections, loaded when a config or a flag names one; their modules document the keys: {plugins}",
    ]
    return "\n".join(lines)
