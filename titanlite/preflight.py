"""Validate a config for a given world size before any worker starts (used by run_train.sh).

`python -m titanlite.preflight --world-size N [--config FILE] [--section.key value ...]`
prints nothing and exits 0 when the config is usable, or prints one line and exits 2.
Imports no torch, so it answers in well under a second.
"""

from __future__ import annotations

import sys

from titanlite.config.layout import validate
from titanlite.config.manager import parse_args
from titanlite.errors import UserError


def main(argv: list[str]) -> int:
    try:
        if len(argv) < 2 or argv[0] != "--world-size" or not argv[1].isdigit():
            raise UserError("usage: python -m titanlite.preflight --world-size N [--config FILE] [overrides]")
        cfg, _ = parse_args(argv[2:])
        validate(cfg, int(argv[1]))
    except UserError as e:
        print(f"titanlite: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
