#!/usr/bin/env python3
"""Write a titanlite checkpoint as a Hugging Face folder (safetensors shards + index, config.json,
tokenizer files) that transformers' AutoModelForCausalLM.from_pretrained loads.

    ./scripts/export_hf.py STEP_FOLDER OUT_FOLDER [--dtype bfloat16] [--max-shard-gb 5]

STEP_FOLDER: a complete checkpoint, e.g. outputs/my-run/checkpoints/step-00001000; it is only
read. The model is rebuilt from what the checkpoint says it trained (model, flavor or
hf_assets_path, tokenizer), so the run's config is not needed; a fork's model needs
--import-module. One process, no GPU; memory is bounded by one shard.
Exit status: 0 written, 2 bad input (one line says what; nothing is written).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titanlite.tools.venv import use_project_venv  # noqa: E402

use_project_venv()  # any python3 will do: without titanlite's dependencies it re-executes in .venv

from titanlite.components.checkpoint.hf_export import DTYPES, export_checkpoint  # noqa: E402
from titanlite.errors import UserError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("step_folder", type=Path, help="a titanlite checkpoint step folder (read only)")
    p.add_argument("out", type=Path, help="the Hugging Face folder to write (new or empty)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="dtype of the weights")
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors file, in GB")
    p.add_argument("--import-module", default="", help="module that registers a fork's model")
    args = p.parse_args(argv)
    try:
        n = export_checkpoint(
            args.step_folder.expanduser(),
            args.out.expanduser(),
            args.dtype,
            int(args.max_shard_gb * 1e9),
            args.import_module,
        )
    except UserError as e:
        print(f"export_hf: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} ({n} safetensors file(s), {args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
