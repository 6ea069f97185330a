"""A tool's verdict is over the settings it was asked for. Each script that runs cases through the
harness (check_model, invariance and its --localize, diagnose_scenarios) plans its runs' configs
before any rank starts and declares the keys it fixes in them (`Fixes`); `Fixes.check` compares
every `--section.key` override with every planned run: an override each run holds is honoured, one
a run would not hold (or one the runs do not take from the config) is refused in one line that names
it and what the tool fixes. `Fixes.ran_at` names the settings the runs ran at where they differ
from the config's, for the verdict line."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from titanlite.config import JobConfig
from titanlite.config.manager import moved_keys, words
from titanlite.errors import UserError

_MISSING = object()


def value(cfg: JobConfig, dotted: str) -> Any:
    """`cfg`'s value of "section.key"; a plugin section the config does not name has none."""
    section, _, key = dotted.partition(".")
    return getattr(getattr(cfg, section, None), key, _MISSING)


def override_keys(overrides: list[str]) -> list[str]:
    """The "section.key" names an override list sets, in order, each once (an old [debug] name of
    a [faults] switch as the switch it now is)."""
    moved = moved_keys()
    keys = [moved.get(name, name) for name, _ in words(overrides) if "." in name]
    return list(dict.fromkeys(keys))


def _shown(v: Any) -> str:
    """A value as a config file writes it (true, not True)."""
    if isinstance(v, bool):
        return str(v).lower()
    return "[" + ", ".join(map(_shown, v)) + "]" if isinstance(v, list) else str(v)


@dataclass(frozen=True)
class Fixes:
    """What one tool sets in the runs it makes, whatever the overrides say."""

    tool: str  # the script's name, as its messages start
    keys: dict[str, str]  # "section.key" -> what the tool runs it at, in words
    # a section or key the runs do not take from the config (a synthetic batch, a constant), or
    # one the tool sets from its own flags -> what they use instead: refused whenever given
    always: dict[str, str] = field(default_factory=dict)
    where: str = "in its runs"  # "in its cases"
    # keys whose override is a bound the runs stay within (invariance's local batch: the largest
    # that carries each rank's share, at most the one asked)
    at_most: frozenset[str] = frozenset()
    # keys the verdict line leaves unnamed: where a run's files go and what it is called
    unnamed: frozenset[str] = frozenset()

    def why(self, key: str) -> str | None:
        """The declared reason for `key`: its own, else its section's."""
        return self.keys.get(key) or self.keys.get(key.split(".")[0])

    def _always(self, key: str) -> str | None:
        return self.always.get(key) or self.always.get(key.split(".")[0])

    def check_always(self, overrides: list[str]) -> None:
        """The overrides of keys no run takes from the config refused, before anything is built
        (`check` refuses them too, beside the others)."""
        refused = {key: why for key in override_keys(overrides) if (why := self._always(key))}
        self._refuse(refused)

    def check(self, overrides: list[str], asked: JobConfig, runs: Iterable[JobConfig]) -> None:
        """Every override honoured in every run of `runs` (each run's config as the tool will
        build it), else one UserError naming the overrides it does not honour and what the tool
        runs them at. `asked`: the config with the overrides, as the user gave them."""
        runs = list(runs)
        refused: dict[str, str] = {}  # key -> what the tool runs it at
        for key in override_keys(overrides):
            always = self._always(key)
            if always:
                refused[key] = always
                continue
            want = value(asked, key)
            ran = [value(r, key) for r in runs]
            if all(v == want or (key in self.at_most and v <= want) for v in ran):
                continue
            shown = " / ".join(dict.fromkeys(_shown(v) for v in ran if v is not _MISSING))
            refused[key] = self.why(key) or shown
        self._refuse(refused)

    def _refuse(self, refused: dict[str, str]) -> None:
        if refused:
            what = _and([f"{k} ({why})" for k, why in refused.items()])
            drop = " ".join(f"--{k}" for k in refused)
            raise UserError(f"{self.tool} fixes {what} {self.where}; drop {drop}")

    def ran_at(self, config: JobConfig, runs: Iterable[JobConfig]) -> str:
        """The declared keys the runs ran at other values than `config` holds ("" when none):
        what the verdict line names, a key every run holds at one value with it, the others as
        varying from run to run."""
        runs = list(runs)
        fixed, varying = [], []
        for key in (k for k in self.keys if "." in k and k not in self.unnamed):
            ran = list(dict.fromkeys(_shown(value(r, key)) for r in runs))
            if ran == [_shown(value(config, key))]:
                continue
            if len(ran) == 1:
                fixed.append(f"{key} {ran[0]}")
            else:
                varying.append(key)
        said = ", ".join(fixed)
        if varying:
            said += ("; " if said else "") + f"{_and(varying)} varying by run"
        return f"ran at {said}" if said else ""


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]
