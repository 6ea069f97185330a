#!/usr/bin/env python3
"""Decode a few prompts with a titanlite checkpoint and print each prompt with its completion.

    ./scripts/generate.py RUN_DIR --prompt "def parse(" [--prompt ...] [--step N]
        [--max-new-tokens 64] [--temperature 0] [--top-p 1.0] [--seed 0] [--device auto]
        [--format auto|text|alpaca|chat]

RUN_DIR: a run folder (its newest complete checkpoint, or --step N) or directly a checkpoint step
folder, e.g. outputs/my-run/checkpoints/step-00001000; it is only read. The model and tokenizer
are rebuilt from what the checkpoint says it trained (as scripts/export_hf.py does), the weights
loaded whole in one process. A prompt is put to the model as the run's data put prompts
(--format auto: an SFT run's alpaca prompt, or a user turn of its chat template; a pretraining
run's BOS and text), or as --format says.
Temperature 0 is greedy; above 0, nucleus sampling with --top-p, seeded by --seed (the same
command prints the same text). A fork's model needs --import-module.
Exit status: 0 printed, 2 bad input (one line says what).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titanlite.tools.venv import use_project_venv  # noqa: E402

use_project_venv()  # any python3 will do: without titanlite's dependencies it re-executes in .venv

import torch  # noqa: E402

from titanlite.components.checkpoint.index import read_checkpoint  # noqa: E402
from titanlite.errors import UserError  # noqa: E402
from titanlite.tools.cli import Script  # noqa: E402

SCRIPT = Script("generate", __doc__)
SCRIPT.arg("run_dir", kind="folder", help="a run folder or a checkpoint step folder (read only)")
SCRIPT.arg(
    "--step",
    kind="int",
    at_least=1,
    at_most=10**12,
    help="the run's checkpoint of this step (default: newest)",
)
SCRIPT.arg(
    "--prompt",
    kind="text",
    action="append",
    required=True,
    help="text to continue; repeat for more",
)
SCRIPT.arg(
    "--max-new-tokens",
    kind="int",
    default=64,
    at_least=1,
    at_most=1 << 20,
    help="tokens to add to each prompt at most",
)
SCRIPT.arg(
    "--temperature",
    kind="float",
    default=0.0,
    at_least=0.0,
    at_most=100.0,
    help="0: greedy; > 0: sample",
)
SCRIPT.arg(
    "--top-p", kind="float", default=1.0, above=0.0, at_most=1.0, help="nucleus sampling mass"
)
SCRIPT.arg(
    "--seed",
    kind="int",
    default=0,
    at_least=0,
    at_most=2**63 - 1,
    help="seed of the sampling generator",
)
SCRIPT.arg(
    "--device",
    kind="choice",
    choices=("auto", "cpu", "cuda"),
    default="auto",
    help="where the model runs",
)
SCRIPT.arg(
    "--format",
    kind="choice",
    choices=("auto", "text", "alpaca", "chat"),
    default="auto",
    help="how a prompt is put to the model (auto: as the run's data put them)",
)
SCRIPT.arg("--import-module", kind="text", default="", help="module that registers a fork's model")


def pick_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda but no GPU is visible; use --device auto or cpu")
    return torch.device("cuda" if choice != "cpu" and torch.cuda.is_available() else "cpu")


def complete(args) -> int:
    from titanlite.components.checkpoint.model import load_model
    from titanlite.components.generate import sample_text
    from titanlite.datasets.records import prompt_format

    device = pick_device(args.device)
    step_folder, (model, (cfg, tok, _)) = read_checkpoint(
        args.run_dir,
        lambda p: (p, load_model(p, device, args.import_module)),
        step=args.step,
    )
    if tok is None:
        raise UserError(
            f"checkpoint '{step_folder}' trained on synthetic data; it has no tokenizer for text"
        )
    completions = sample_text(
        model,
        tok,
        args.prompt,
        args.max_new_tokens,
        fmt=prompt_format(args.format, cfg.data.mode, tok),
        temperature=args.temperature,
        top_p=args.top_p,
        generator=torch.Generator().manual_seed(
            args.seed
        ),  # on the CPU: the same draws on any device
    )
    how = (
        "greedy" if args.temperature == 0 else f"temperature {args.temperature}, top-p {args.top_p}"
    )
    print(f"# {step_folder} ({how}, up to {args.max_new_tokens} new tokens)")
    for i, (prompt, completion) in enumerate(zip(args.prompt, completions, strict=True), 1):
        print(f"--- {i} ---\n{prompt}{completion}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return SCRIPT.run(complete, argv)


if __name__ == "__main__":
    sys.exit(main())
