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

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titanlite.tools.venv import use_project_venv  # noqa: E402

use_project_venv()  # any python3 will do: without titanlite's dependencies it re-executes in .venv

import torch  # noqa: E402

from titanlite.components.checkpoint.index import complete_steps, step_dir  # noqa: E402
from titanlite.config.layout import initial_load_kind  # noqa: E402
from titanlite.errors import UserError  # noqa: E402


def find_step_folder(path: Path, step: int | None) -> Path:
    """RUN_DIR as a complete step folder: itself, or one of its checkpoint folder's (the newest,
    or `step`). The checkpoint folder is the run's checkpoint.folder (its config.toml), or RUN_DIR
    itself when it holds step folders."""
    if (path / ".metadata").is_file():
        if step is not None:
            raise UserError(
                f"--step picks a checkpoint of a run folder, but '{path}' is a step folder already"
            )
        initial_load_kind(path, "RUN_DIR")  # complete, or one line saying it is not
        return path
    if not path.is_dir():
        raise UserError(f"RUN_DIR '{path}' is not a folder; give a run folder or a checkpoint step folder")
    folder = path
    if not complete_steps(path) and (path / "config.toml").is_file():
        from titanlite.components.run.plan import checkpoint_folder
        from titanlite.config.manager import load_config

        folder = checkpoint_folder(load_config(str(path / "config.toml")), path)
    steps = complete_steps(folder)
    if not steps:
        raise UserError(
            f"'{path}' holds no complete checkpoint (looked in '{folder}'); give a run folder that "
            "trained with checkpoint.interval > 0, or a step folder"
        )
    if step is not None and step not in steps:
        have = ", ".join(map(str, steps))
        raise UserError(
            f"--step {step}: '{folder}' holds no complete checkpoint of that step (complete: {have})"
        )
    return step_dir(folder, steps[-1] if step is None else step)


def pick_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda but no GPU is visible; use --device auto or cpu")
    return torch.device("cuda" if choice != "cpu" and torch.cuda.is_available() else "cpu")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path, help="a run folder or a checkpoint step folder (read only)")
    p.add_argument(
        "--step", type=int, default=None, help="the run's checkpoint of this step (default: newest)"
    )
    p.add_argument("--prompt", action="append", required=True, help="text to continue; repeat for more")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to add to each prompt at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sample")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling generator")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument(
        "--format",
        choices=("auto", "text", "alpaca", "chat"),
        default="auto",
        help="how a prompt is put to the model (auto: as the run's data put them)",
    )
    p.add_argument("--import-module", default="", help="module that registers a fork's model")
    args = p.parse_args(argv)
    try:
        if args.max_new_tokens < 1 or args.temperature < 0 or not 0 < args.top_p <= 1:
            raise UserError("--max-new-tokens must be >= 1, --temperature >= 0 and --top-p in (0, 1]")
        from titanlite.components.checkpoint.model import load_model
        from titanlite.components.generate import sample_text
        from titanlite.datasets.records import prompt_format

        step_folder = find_step_folder(args.run_dir.expanduser(), args.step)
        device = pick_device(args.device)
        model, rebuilt = load_model(step_folder, device, args.import_module)
        if rebuilt.tokenizer is None:
            raise UserError(
                f"checkpoint '{step_folder}' trained on synthetic data; it has no tokenizer for text"
            )
    except UserError as e:
        print(f"generate: error: {e}", file=sys.stderr)
        return 2
    completions = sample_text(
        model,
        rebuilt.tokenizer,
        args.prompt,
        args.max_new_tokens,
        fmt=prompt_format(args.format, rebuilt.cfg.data.mode, rebuilt.tokenizer),
        temperature=args.temperature,
        top_p=args.top_p,
        generator=torch.Generator().manual_seed(args.seed),  # on the CPU: the same draws on any device
    )
    how = "greedy" if args.temperature == 0 else f"temperature {args.temperature}, top-p {args.top_p}"
    print(f"# {step_folder} ({how}, up to {args.max_new_tokens} new tokens)")
    for i, (prompt, completion) in enumerate(zip(args.prompt, completions, strict=True), 1):
        print(f"--- {i} ---\n{prompt}{completion}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
