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

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titanlite.tools.venv import use_project_venv  # noqa: E402

use_project_venv()  # any python3 will do: without titanlite's dependencies it re-executes in .venv

from titanlite.datasets.prepare import prepare  # noqa: E402
from titanlite.datasets.sources import discover  # noqa: E402
from titanlite.datasets.tokenizer import (  # noqa: E402
    Tokenizer,
    builtin_tokenizer_path,
    load_tokenizer,
    train_builtin_tokenizer,
)
from titanlite.errors import UserError  # noqa: E402
from titanlite.tools.cache import cache_dir  # noqa: E402


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", nargs="+", help="files or folders of .txt/.jsonl/.jsonl.gz/.parquet/.arrow")
    ap.add_argument("--out", required=True, help="the prepared folder (created; resumed if unfinished)")
    ap.add_argument(
        "--tokenizer", required=True, help=".model, tokenizer.json, HF model folder, or 'builtin'"
    )
    ap.add_argument("--mode", choices=("pretrain", "sft"), default="pretrain")
    ap.add_argument("--text-field", default="text", help="jsonl field / parquet, arrow column of the text")
    ap.add_argument(
        "--workers", type=int, default=os.cpu_count() or 1, help="processes (default: every core)"
    )
    ap.add_argument("--shard-mb", type=float, default=64, help="input megabytes per shard (default 64)")
    ap.add_argument("--builtin-vocab-size", type=int, default=2048, help="vocabulary of --tokenizer builtin")
    ap.add_argument("--cache-dir", default="", help="where --tokenizer builtin is cached")
    args = ap.parse_args(argv)
    try:
        if args.workers < 1 or args.shard_mb <= 0:
            raise UserError("--workers must be >= 1 and --shard-mb > 0")
        files = [f for path in args.inputs for f in discover(path)]
        if len(set(files)) != len(files):
            raise UserError("an input file is named twice (a file and a folder that holds it?); name it once")
        tok = tokenizer(args.tokenizer, args.builtin_vocab_size, args.cache_dir)
        out = Path(args.out).expanduser()
        prepare(files, out, tok, args.mode, args.text_field, args.workers, int(args.shard_mb * 2**20))
    except UserError as e:
        print(f"prepare_data: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("prepare_data: interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    print(f"train with: --data.path {out} --data.mode {args.mode}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
