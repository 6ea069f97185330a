#!/usr/bin/env python3
"""Prepare raw data once, with every core, for training from memory-mapped shards.

    ./scripts/prepare_data.py --tokenizer TOKENIZER --out /data/tok/fineweb /data/raw/*.parquet
    ./scripts/prepare_data.py --tokenizer assets/hf/Llama-3.2-1B --mode sft --out /data/tok/sft chat.jsonl

TOKENIZER is a SentencePiece .model, a tokenizer.json or a Hugging Face model folder, or
`builtin` (the built-in stdlib tokenizer, --builtin-vocab-size). Inputs are files or folders of
.txt, .jsonl, .jsonl.gz, .parquet and .arrow (a `datasets.save_to_disk` folder). Then train with
`--data.path OUT` (and the same tokenizer). Run it again after an interruption: finished shards
are kept. Exit 2 with one line on bad input; the output folder is only complete once meta.json is.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titanlite.tools.venv import use_project_venv  # noqa: E402

use_project_venv()  # any python3 will do: without titanlite's dependencies it re-executes in .venv

from titanlite.datasets.corpus import discover  # noqa: E402
from titanlite.datasets.prepare import prepare  # noqa: E402
from titanlite.datasets.tokenizer import (  # noqa: E402
    Tokenizer,
    builtin_tokenizer_path,
    load_tokenizer,
    train_builtin_tokenizer,
)
from titanlite.errors import UserError  # noqa: E402
from titanlite.tools.cache import cache_dir  # noqa: E402
from titanlite.tools.cli import Script  # noqa: E402


def tokenizer(spec: str, vocab_size: int, cache: str):
    if spec == "builtin":
        path = builtin_tokenizer_path(cache_dir(cache), vocab_size)
        if not path.exists():
            train_builtin_tokenizer(path, vocab_size)
        return Tokenizer(path.read_bytes(), f"builtin:{path.name}")
    if not Path(spec).expanduser().exists():
        raise UserError(
            f"--tokenizer '{spec}' does not exist; give a .model, a tokenizer.json, a model folder or 'builtin'"
        )
    return load_tokenizer(spec)


SCRIPT = Script(
    "prepare_data",
    __doc__,
    stop_hint="run the same command again to resume: finished shards are kept",
)
SCRIPT.arg(
    "inputs",
    kind="path",
    nargs="+",
    help="files or folders of .txt/.jsonl/.jsonl.gz/.parquet/.arrow",
)
SCRIPT.arg(
    "--out",
    kind="out_folder",
    required=True,
    help="the prepared folder (created; resumed if unfinished)",
)
SCRIPT.arg(
    "--tokenizer",
    kind="text",
    required=True,
    help=".model, tokenizer.json, HF model folder, or 'builtin'",
)
SCRIPT.arg(
    "--mode",
    kind="choice",
    choices=("pretrain", "sft"),
    default="pretrain",
    help="pretraining text or SFT records",
)
SCRIPT.arg(
    "--text-field",
    kind="text",
    default="text",
    help="jsonl field / parquet, arrow column of the text",
)
SCRIPT.arg(
    "--workers",
    kind="int",
    default=os.cpu_count() or 1,
    at_least=1,
    at_most=1024,
    help="processes (default: every core)",
)
SCRIPT.arg(
    "--shard-mb",
    kind="float",
    default=64.0,
    above=0.0,
    at_most=1 << 20,
    help="input megabytes per shard",
)
SCRIPT.arg(
    "--builtin-vocab-size",
    kind="int",
    default=2048,
    at_least=256,
    at_most=1 << 20,
    help="vocabulary of --tokenizer builtin",
)
SCRIPT.arg(
    "--cache-dir",
    kind="out_folder",
    help="where --tokenizer builtin is cached (default: TITANLITE_CACHE or ~/.cache/titanlite)",
)


def run(args) -> int:
    say = lambda line: print(f"prepare_data: note: {line}", file=sys.stderr)  # noqa: E731
    files = [f for path in args.inputs for f in discover(str(path), say)]
    if len(set(files)) != len(files):
        raise UserError(
            "an input file is named twice (a file and a folder that holds it?); name it once"
        )
    tok = tokenizer(args.tokenizer, args.builtin_vocab_size, str(args.cache_dir or ""))
    prepare(
        files, args.out, tok, args.mode, args.text_field, args.workers, int(args.shard_mb * 2**20)
    )
    print(f"train with: --data.path {args.out} --data.mode {args.mode}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return SCRIPT.run(run, argv)


if __name__ == "__main__":
    sys.exit(main())
