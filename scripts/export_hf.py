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

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titanlite.tools.venv import use_project_venv  # noqa: E402

use_project_venv()  # any python3 will do: without titanlite's dependencies it re-executes in .venv

from titanlite.components.checkpoint.hf_export import DTYPES, export_checkpoint  # noqa: E402
from titanlite.components.checkpoint.index import read_checkpoint  # noqa: E402
from titanlite.tools.cli import Script  # noqa: E402

SCRIPT = Script("export_hf", __doc__)
SCRIPT.arg(
    "step_folder",
    kind="folder",
    help="a titanlite checkpoint step folder, or a run folder (its newest intact step); read only",
)
SCRIPT.arg("out", kind="new_folder", help="the Hugging Face folder to write")
SCRIPT.arg(
    "--dtype",
    kind="choice",
    choices=tuple(sorted(DTYPES)),
    default="float32",
    help="dtype of the weights",
)
SCRIPT.arg(
    "--max-shard-gb",
    kind="float",
    default=5.0,
    above=0.0,
    at_most=10_000.0,
    help="largest safetensors file, in GB",
)
SCRIPT.arg("--import-module", kind="text", default="", help="module that registers a fork's model")


def export(args) -> int:
    def write(step_folder):
        shards = export_checkpoint(
            step_folder, args.out, args.dtype, int(args.max_shard_gb * 1e9), args.import_module
        )
        return step_folder, shards

    step_folder, n = read_checkpoint(args.step_folder, write, flag="STEP_FOLDER")
    print(f"wrote {args.out} from {step_folder} ({n} safetensors file(s), {args.dtype})")
    return 0


def main(argv: list[str] | None = None) -> int:
    return SCRIPT.run(export, argv)


if __name__ == "__main__":
    sys.exit(main())
