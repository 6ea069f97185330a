"""Validate a config for a given world size before any worker starts (used by run_train.sh).

`python -m titanlite.preflight --world-size N [--config FILE] [--section.key value ...]`
prints nothing and exits 0 when the config is usable, or prints one line and exits 2.
`python -m titanlite.preflight --help` prints run_train.sh's usage and every config key.
Imports no torch, so it answers in well under a second.
"""

from __future__ import annotations

import sys

from titanlite.config.layout import validate
from titanlite.config.manager import config_help, parse_args, wants_help
from titanlite.datasets.spec import check_data_tokenizer
from titanlite.errors import UserError

USAGE = """usage: ./run_train.sh [--config FILE] [--section.key VALUE ...]
Trains with torchrun on this node (default config: train_configs/debug_model.toml).
Environment: NGPU / NPROC ranks on this node (default: the GPU count, else 2 CPU ranks);
LOG_RANK local ranks that print (default 0, e.g. 0,1); NNODES, NODE_RANK, MASTER_ADDR,
MASTER_PORT for several nodes. Exit codes: 0 done, 2 bad input (one line says what), 3 the run
was stopped (non-finite loss, diagnostics.on_alert = stop, a failed checkpoint save)."""


def main(argv: list[str]) -> int:
    if wants_help(argv):
        print(config_help(USAGE))
        return 0
    try:
        if len(argv) < 2 or argv[0] != "--world-size" or not argv[1].isdigit():
            raise UserError("usage: python -m titanlite.preflight --world-size N [--config FILE] [overrides]")
        cfg, _ = parse_args(argv[2:])
        validate(cfg, int(argv[1]))
        check_data_tokenizer(
            cfg.data.mode, cfg.data.path, cfg.model.tokenizer_path or cfg.model.hf_assets_path
        )
    except UserError as e:
        print(f"titanlite: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
