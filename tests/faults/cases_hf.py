"""Bad tokenizers and Hugging Face folders."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

from faults.fixtures import (
    config_edit,
    copy_hf,
    data,
    garbage,
    hf,
    hf_args,
    truncate,
)
from faults.harness import (
    Catalogue,
    case,
    refused,
    trains,
)

# tokenizers and Hugging Face folders
trains(
    "tokenizer/HF",
    "a tiny HF Llama folder (baseline)",
    lambda c: hf_args(hf(c), "--data.path", str(data(c) / "good.jsonl")),
)


def _hf_refused(
    name: str, change: Callable[[Path], tuple[str, ...]], says: str, cheap: bool = False
) -> None:
    @case("tokenizer/HF", name, cheap)
    def _(c: Catalogue) -> None:
        folder = copy_hf(c, re.sub(r"\W+", "_", name))
        extra = change(folder)
        refused(
            c, name, (*hf_args(folder, "--data.path", str(data(c) / "good.jsonl")), *extra), says
        )


_hf_refused(
    "a garbage tokenizer.json in the HF folder",
    lambda f: (garbage(f / "tokenizer.json"), ())[1],
    "tokenizer",
)


for _file, _says in (("tokenizer.json", "tokenizer"), ("bad.model", "bad.model")):

    @case("tokenizer/HF", f"a garbage {_file} as model.tokenizer_path")
    def _(c: Catalogue, file=_file, says=_says) -> None:
        bad = c.work / "tok" / file
        bad.parent.mkdir(parents=True, exist_ok=True)
        garbage(bad)
        args = ("--model.tokenizer_path", str(bad), "--data.path", str(data(c) / "good.jsonl"))
        refused(c, f"garbage {file}", args, says)


def _strip_vocab(folder: Path) -> tuple[str, ...]:
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok["model"].pop("vocab", None)
    tok["model"].pop("merges", None)
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    return ()


_hf_refused("a tokenizer.json without vocab and merges", _strip_vocab, "tokenizer")
_hf_refused(
    "an HF folder with config.json and no safetensors",
    lambda f: ((f / "model.safetensors").unlink(), ())[1],
    "safetensors",
    cheap=True,
)
_hf_refused(
    "model.safetensors cut to 300 kB",
    lambda f: (truncate(f / "model.safetensors", 300_000), ())[1],
    "cut short",
    cheap=True,
)


_hf_refused(
    "config.json intermediate_size 256, the weights 128",
    config_edit(intermediate_size=256),
    "intermediate_size",
)
_hf_refused("config.json vocab 256, the tokenizer 512", config_edit(vocab_size=256), "vocab_size")


# config.json read whole: every key used, known to be harmless, or refused
def _config_replace(text: str):
    def edit(folder: Path) -> tuple[str, ...]:
        (folder / "config.json").write_text(text)
        return ()

    return edit


def _rope_disagrees(folder: Path) -> tuple[str, ...]:
    config = json.loads((folder / "config.json").read_text())
    config["rope_theta"] = 10000.0
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    (folder / "config.json").write_text(json.dumps(config))
    return ()


def _mistral(folder: Path) -> tuple[str, ...]:
    config = json.loads((folder / "config.json").read_text())
    config.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=64)
    (folder / "config.json").write_text(json.dumps(config))
    return ()


for _name, _change, _says in (
    ("config.json: rope_theta and rope_parameters disagree", _rope_disagrees, "rope_theta"),
    ("config.json: attention_dropout 0.1", config_edit(attention_dropout=0.1), "attention_dropout"),
    ("config.json: a Mistral with a sliding window of 64", _mistral, "sliding_window"),
    ("config.json: a JSON list", _config_replace("[1, 2, 3]"), "config.json"),
    ("config.json: hidden_size 64.5", config_edit(hidden_size=64.5), "hidden_size"),
    ("tokenizer_config.json of garbage", lambda f: (garbage(f / "tokenizer_config.json"), ())[1], "tokenizer_config.json"),
    ("generation_config.json of garbage", lambda f: (garbage(f / "generation_config.json"), ())[1], "generation_config.json"),
):  # fmt: skip
    _hf_refused(_name, _change, _says)


# config.json's values read through the family's declared keys (titanlite/models/hf_keys.py):
# each refused by the launcher's preflight, one line, exit 2, no run folder
_QWEN = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 512, "hidden_size": 64,
    "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
    "router_aux_loss_coef": 0.001, "max_position_embeddings": 256, "bos_token_id": 0, "eos_token_id": 1,
}  # fmt: skip


def _qwen(**change) -> Callable[[Path], tuple[str, ...]]:
    """The tiny folder's tokenizer and files with a Qwen3-MoE config.json (`change` applied):
    the config is refused before any weight is read."""

    def edit(folder: Path) -> tuple[str, ...]:
        (folder / "config.json").write_text(json.dumps({**_QWEN, **change}))
        return ("--model.name", "qwen3_moe")

    return edit


for _name, _change, _says in (
    ("config.json: num_experts_per_tok 0", _qwen(num_experts_per_tok=0), "num_experts_per_tok = 0; it must be a whole number >= 1"),
    ("config.json: 9 of 8 experts per token", _qwen(num_experts_per_tok=9), "num_experts_per_tok must be at most num_experts"),
    ("config.json: router_aux_loss_coef null", _qwen(router_aux_loss_coef=None), "router_aux_loss_coef = null"),
    ("config.json: router_aux_loss_coef -0.01", _qwen(router_aux_loss_coef=-0.01), "router_aux_loss_coef = -0.01"),
    ("config.json: num_experts 8.7", _qwen(num_experts=8.7), "num_experts = 8.7"),
    ("config.json: num_experts 8 and num_local_experts 4", _qwen(num_local_experts=4), "num_local_experts = 4"),
    ("config.json: 3 KV heads for 4 heads", config_edit(num_key_value_heads=3), "num_key_value_heads must divide"),
    ("config.json: rms_norm_eps null", config_edit(rms_norm_eps=None), "rms_norm_eps = null"),
):  # fmt: skip
    _hf_refused(_name, _change, _says, cheap=True)


# a key the folder leaves unused, asked for on the command line: refused, not dropped
_hf_refused(
    "--model.flavor 1B beside the folder",
    lambda f: ("--model.flavor", "1B"),
    "model.flavor = '1B' (command line) is not used beside model.hf_assets_path",
    cheap=True,
)


def _with_inv_freq(c: Catalogue) -> tuple[str, ...]:
    """Older transformers saved each layer's rotary inv_freq buffer with the weights."""
    import torch
    from safetensors.torch import load_file, save_file

    folder = copy_hf(c, "inv-freq")
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = 1.0 / (
        10000 ** (torch.arange(0, 16, 2) / 16)
    )
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return hf_args(folder, "--data.path", str(data(c) / "good.jsonl"))


trains(
    "tokenizer/HF",
    "weights that hold a rotary inv_freq buffer (older transformers)",
    _with_inv_freq,
)
