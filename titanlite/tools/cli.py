"""The front door of every script (scripts/*.py): its arguments declared with their kind, in the
spirit of the config's `opt` fields (a number always has an upper bound: a value past it is a
typo), and checked whole before the script does anything, so bad input writes nothing. A refusal
is one UserError naming the argument, the value and the fix; `Script.run` ends in one line."""

from __future__ import annotations

import argparse
import difflib
import math
import operator
import os
import re
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from titanlite.errors import Stopped, TrainingError, UserError
from titanlite.tools.paths import KINDS, check_path

NUMBERS = ("int", "float")
PATHS = tuple(KINDS)
KIND_NAMES = (*NUMBERS, "choice", "text", "name", "switch", *PATHS)
_INT = re.compile(r"[+-]?\d+")
# (Arg field, how --help writes it, the test a value must pass)
_BOUNDS = (
    ("at_least", ">=", operator.ge),
    ("above", ">", operator.gt),
    ("at_most", "<=", operator.le),
    ("below", "<", operator.lt),
)


@dataclass(frozen=True)
class Arg:
    """One argument: its flags (or a positional's name), its kind and what bounds it."""

    flags: tuple[str, ...]
    kind: str
    help: str
    default: Any = None
    nargs: str | int | None = None
    required: bool = False
    choices: tuple[str, ...] = ()
    at_least: float | None = None
    above: float | None = None
    at_most: float | None = None
    below: float | None = None
    action: str | None = None  # "append": the flag may be given several times (a list)
    internal: bool = False  # set only by the script itself (a worker it launches): not in --help

    @property
    def positional(self) -> bool:
        return not self.flags[0].startswith("-")

    @property
    def name(self) -> str:
        """How the user writes it: --flag, or a positional's NAME."""
        return self.flags[0].upper() if self.positional else self.flags[-1]

    @property
    def dest(self) -> str:
        return self.flags[0] if self.positional else self.flags[-1].lstrip("-").replace("-", "_")

    def bounds(self) -> str:
        rules = []
        for field, op, _ in _BOUNDS:
            b = getattr(self, field)
            if b is not None:
                whole = float(b).is_integer() and abs(b) < 1e16
                rules.append(f"{op} {int(b):,}" if whole else f"{op} {b:g}")
        return " and ".join(rules)

    def describe(self) -> str:
        """What a value must be, in words (for --help and for refusals)."""
        if self.kind in NUMBERS:
            what = "a whole number" if self.kind == "int" else "a finite number"
            return f"{what} {self.bounds()}"
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        if self.kind == "name":
            return "a file name (no '/', not '.' or '..', at most 255 bytes)"
        return KINDS.get(self.kind, "")

    def check(self, value: str) -> Any:
        """One value (text, as given) as this argument's kind, or one UserError."""
        wrong = f"{self.name} is {value!r}; it must be {self.describe()}"
        if self.kind in NUMBERS:
            return self._number(value, UserError(wrong))
        if self.kind == "choice" and value not in self.choices:
            close = difflib.get_close_matches(value, self.choices, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise UserError(wrong + hint)
        too_long = len(value.encode()) > 255
        if self.kind == "name" and ("/" in value or value in (".", "..") or too_long):
            raise UserError(wrong)
        if self.kind in PATHS:
            if not value:
                raise UserError(f"{self.name} is empty; give {KINDS[self.kind]}")
            return check_path(Path(value).expanduser(), self.kind, self.name)
        return value

    def _number(self, value: str, wrong: UserError) -> int | float:
        if self.kind == "int":
            if not _INT.fullmatch(value.strip()):
                raise wrong
            number: int | float = int(value)
        else:
            try:
                number = float(value)
            except ValueError:
                raise wrong from None
            if not math.isfinite(number):
                raise wrong
        for field, _, ok in _BOUNDS:
            bound = getattr(self, field)
            if bound is not None and not ok(number, bound):
                raise wrong
        return number


class _Parser(argparse.ArgumentParser):
    """argparse for the layout of the command line only; its complaints become UserErrors."""

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{message}; see {self.prog} --help")


class Script:
    """A script's arguments. Declare them with `arg`, then `main(body)`: body(args) runs with
    every value checked, and returns the exit code (None: 0)."""

    def __init__(self, prog: str, doc: str, overrides: str = "", stop_hint: str = "") -> None:
        """`doc`: --help's description; `overrides`: where `--section.key VALUE` overrides go ("":
        none); `stop_hint`: what the stop line adds after a Ctrl-C or SIGTERM."""
        self.prog, self.overrides, self.stop_hint = prog, overrides, stop_hint
        epilog = None
        if overrides:
            epilog = f"Any --section.key VALUE of the config (./run_train.sh --help lists them) is passed on to {overrides}."
        self.parser = _Parser(
            prog=prog,
            description=doc.strip(),
            epilog=epilog,
            allow_abbrev=False,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        self.args: list[Arg] = []

    def arg(self, *flags: str, kind: str, help: str, **spec: Any) -> None:
        """Declare one argument; see Arg for the fields and the module doc for the kinds."""
        if kind not in KIND_NAMES:
            raise TypeError(f"unknown kind {kind!r} of {flags}")
        a = Arg(tuple(flags), kind, help, **spec)
        if kind in NUMBERS and a.at_most is None and a.below is None:
            raise TypeError(f"{a.name}: a number declares an upper bound (at_most or below)")
        if kind == "choice" and not a.choices:
            raise TypeError(f"{a.name}: a choice declares its choices")
        self.args.append(a)
        what = a.describe()
        text = argparse.SUPPRESS if a.internal else f"{help} ({what})" if what else help
        if kind == "switch":
            self.parser.add_argument(*flags, action="store_true", help=text)
            return
        extra: dict[str, Any] = {"nargs": a.nargs, "default": None, "help": text}
        if a.action:
            extra["action"] = a.action
        if not a.positional:
            extra.update(required=a.required, dest=a.dest)
        if kind == "choice":
            extra["metavar"] = a.dest.upper()
        self.parser.add_argument(*flags, **extra)

    def parse(self, argv: Sequence[str]) -> argparse.Namespace:
        """Every argument checked (defaults are the script's own and are not); the overrides
        as `args.overrides`. One UserError on the first problem."""
        argv = self._glued(list(argv))
        if self.overrides:
            ns, rest = self.parser.parse_known_args(argv)
            ns.overrides = self._check_overrides(rest)
        else:
            ns = self.parser.parse_args(argv)
        for a in self.args:
            value = getattr(ns, a.dest)
            if value is None or a.kind == "switch":
                if value is None and a.default is not None:
                    setattr(ns, a.dest, a.default)
                continue
            checked = [a.check(v) for v in value] if isinstance(value, list) else a.check(value)
            setattr(ns, a.dest, checked)
        return ns

    def _glued(self, argv: list[str]) -> list[str]:
        """`--flag -x` as `--flag=-x` where -x is a value, not a flag ('-inf', '-1e3'): argparse
        would take it for a flag and say the value is missing, not what is wrong with it."""
        flags = {f for a in self.args for f in a.flags}
        takes = {f for a in self.args if not a.positional and a.kind != "switch" for f in a.flags}
        out: list[str] = []
        for token in argv:
            value = token.startswith("-") and not token.startswith("--") and token not in flags
            if value and out and out[-1] in takes:
                out[-1] = f"{out[-1]}={token}"
            else:
                out.append(token)
        return out

    def _check_overrides(self, rest: list[str]) -> list[str]:
        from titanlite.config.manager import check_values, load_config

        flags = [f for a in self.args if not a.positional for f in a.flags]
        for token in rest:
            if token.startswith("-") and "." not in token.split("=")[0]:
                close = difflib.get_close_matches(token.split("=")[0], flags, n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                raise UserError(f"unknown argument '{token}'{hint}; see {self.prog} --help")
        # keys, types, choices, bounds: one line on the first problem
        check_values(load_config(None, rest))
        return rest

    def run(
        self, body: Callable[[argparse.Namespace], int | None], argv: Sequence[str] | None = None
    ) -> int:
        """The script: its arguments checked, then `body`; every ending as one line."""
        term = signal.signal(signal.SIGTERM, self._on_term)
        interrupt = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            return int(body(self.parse(sys.argv[1:] if argv is None else argv)) or 0)
        except UserError as e:
            print(f"{self.prog}: error: {e}", file=sys.stderr, flush=True)
            return 2
        except TrainingError as e:
            print(f"{self.prog}: stopped: {e}", file=sys.stderr, flush=True)
            return 3
        except (KeyboardInterrupt, Stopped) as e:
            signum = e.signum if isinstance(e, Stopped) else signal.SIGINT
            hint = f"; {self.stop_hint}" if self.stop_hint else ""
            line = f"{self.prog}: stopped by {signal.Signals(signum).name}{hint}"
            print(line, file=sys.stderr, flush=True)
            return 128 + signum
        # `| head` closed the output: nothing more to say (Python's own advice)
        except BrokenPipeError:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 1
        finally:
            signal.signal(signal.SIGTERM, term)
            signal.signal(signal.SIGINT, interrupt)

    @staticmethod
    def _on_term(signum: int, frame) -> None:
        raise Stopped(signum, signal.Signals(signum).name)
