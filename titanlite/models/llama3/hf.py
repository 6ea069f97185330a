"""Llama 3 <-> Hugging Face transformers' LlamaForCausalLM: config.json and weight names.

Rotary embeddings: titanlite, like Meta's reference code, rotates consecutive pairs of each
head's q/k features (x0, x1), (x2, x3), ...; transformers rotates the two halves of the head
against each other. The models agree when each head's q and k rows are reordered: pair members
2i and 2i+1 become rows i and i + head_dim/2 (the permutation of transformers' Llama weight
conversion script). Each tensor converts on its own, so a sharded model converts one full
tensor at a time.
"""

from __future__ import annotations

import torch

from titanlite.errors import UserError
from titanlite.models.common.hf import ATTENTION, Names, rope_theta, swiglu, tied_head_copy
from titanlite.models.hf_keys import DECODER_KEYS, ConfigKeys, Key, Relation
from titanlite.models.llama3.model import Llama3Args, ffn_hidden_dim
from titanlite.models.registry import HFAdapter

_NAMES = Names(
    {**ATTENTION, **swiglu("feed_forward"), "ffn_norm.weight": "post_attention_layernorm.weight"}
)


def _to_halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k rows, titanlite's pair layout -> transformers' half layout."""
    rows, cols = w.shape
    return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _to_pairs(w: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k rows, transformers' half layout -> titanlite's pair layout."""
    rows, cols = w.shape
    return w.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def _heads(name: str, args: Llama3Args) -> int | None:
    if name.endswith("attention.wq.weight"):
        return args.n_heads
    if name.endswith("attention.wk.weight"):
        return args.n_kv_heads or args.n_heads
    return None


def from_hf(name: str, tensor: torch.Tensor, args: Llama3Args) -> tuple[str, torch.Tensor] | None:
    """One transformers tensor -> (titanlite name, tensor); None for a tied head's copy, which
    titanlite holds once, as the embedding."""
    if tied_head_copy(name, args.tie_embeddings):
        return None
    ours = _NAMES.from_hf(name)
    if ours is None:
        raise UserError(
            f"the Hugging Face weights hold '{name}', which a Llama 3 model has no place for"
        )
    heads = _heads(ours, args)
    return ours, (_to_pairs(tensor, heads) if heads else tensor)


def to_hf(name: str, tensor: torch.Tensor, args: Llama3Args) -> tuple[str, torch.Tensor]:
    """One titanlite tensor -> (transformers name, tensor)."""
    theirs = _NAMES.to_hf(name)
    if theirs is None:
        raise ValueError(f"no Hugging Face name for titanlite's '{name}'")
    heads = _heads(name, args)
    return theirs, (_to_halves(tensor, heads) if heads else tensor)


_LLAMA3_ROPE = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# titanlite's Llama: dim = heads x head_dim, q/k/v/o without bias, SwiGLU (silu), RoPE with
# Llama 3's scaling or none
LLAMA3_KEYS = DECODER_KEYS + ConfigKeys(
    "Llama 3",
    (
        Key("intermediate_size", "whole", at_least=1),
        Key("hidden_act", "str", choices=("silu",), why="titanlite's Llama 3 computes SwiGLU", default="silu"),
        Key("attention_bias", "bool", choices=(False,), why="titanlite's Llama 3 has no biases", null="false", default=False),
        Key("mlp_bias", "bool", choices=(False,), why="titanlite's Llama 3 has no biases", null="false", default=False),
        Key("rope.rope_type", "str", choices=("default", "llama3"), why="titanlite's Llama 3 has no other RoPE", default=None),
        Key("rope.type", "str", choices=("default", "llama3"), why="titanlite's Llama 3 has no other RoPE", default=None),
        Key("rope.factor", "float", above=0, default=None),
        Key("rope.low_freq_factor", "float", above=0, default=None),
        Key("rope.high_freq_factor", "float", above=0, default=None),
        Key("rope.original_max_position_embeddings", "whole", at_least=1, default=None),
    ),
    (
        Relation(
            ("hidden_size", "num_attention_heads", "head_dim"),
            lambda d, h, hd: hd * h == d,
            "head_dim x num_attention_heads must be hidden_size (titanlite's Llama 3 splits the width into its heads)",
        ),
        Relation(
            ("hidden_size", "num_attention_heads"),
            lambda d, h: d % h == 0,
            "num_attention_heads must divide hidden_size (titanlite's Llama 3 splits the width into its heads)",
        ),
        Relation(
            ("hidden_size", "num_attention_heads"),
            lambda d, h: d % h or (d // h) % 2 == 0,
            "hidden_size / num_attention_heads, a head's width, must be even (RoPE rotates pairs of features)",
        ),
        Relation(
            ("rope.low_freq_factor", "rope.high_freq_factor"),
            lambda low, high: high > low,
            "high_freq_factor must be above low_freq_factor (Llama 3's RoPE scaling divides by their difference)",
        ),
        *(
            Relation(
                (kind, *(f"rope.{k}" for k in _LLAMA3_ROPE)),
                lambda kind, *given: kind != "llama3" or None not in given,
                "Llama 3's RoPE scaling needs all four of factor, low_freq_factor, high_freq_factor and original_max_position_embeddings",
                partial=True,
            )
            for kind in ("rope.rope_type", "rope.type")
        ),
    ),
)  # fmt: skip


def args_from_config(config: dict) -> Llama3Args:
    """Llama3Args from a transformers LlamaConfig (config.json), old style (rope_theta,
    rope_scaling) or new (rope_parameters), every key read through LLAMA3_KEYS. vocab_size is
    config.json's; max_seq_len is left to training.seq_len."""
    v = LLAMA3_KEYS.read(config)
    heads = v["num_attention_heads"]
    args = {
        "dim": v["hidden_size"],
        "n_layers": v["num_hidden_layers"],
        "n_heads": heads,
        "n_kv_heads": v["num_key_value_heads"] or heads,
        "vocab_size": v["vocab_size"],
        "hidden_dim": v["intermediate_size"],
        "norm_eps": float(v["rms_norm_eps"]),
        "tie_embeddings": v["tie_word_embeddings"],
    }
    args["rope_theta"] = rope_theta(v)
    if (v["rope.rope_type"] or v["rope.type"] or "default") == "llama3":
        args.update(
            rope_scaling_factor=float(v["rope.factor"]),
            rope_low_freq_factor=float(v["rope.low_freq_factor"]),
            rope_high_freq_factor=float(v["rope.high_freq_factor"]),
            rope_original_max_len=v["rope.original_max_position_embeddings"],
        )
    return Llama3Args(**args)


def config_from_args(args: Llama3Args) -> dict:
    """config.json for transformers' LlamaForCausalLM (the keys Meta's own folders use)."""
    head_dim = args.dim // args.n_heads
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads or args.n_heads,
        "head_dim": head_dim,
        "intermediate_size": ffn_hidden_dim(args),
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "max_position_embeddings": max(args.max_seq_len, args.rope_original_max_len),
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    if args.rope_scaling_factor is not None:
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": args.rope_scaling_factor,
            "low_freq_factor": args.rope_low_freq_factor,
            "high_freq_factor": args.rope_high_freq_factor,
            "original_max_position_embeddings": args.rope_original_max_len,
        }
    return config


LLAMA3_HF = HFAdapter(
    architectures=("LlamaForCausalLM",),
    args_from_config=args_from_config,
    config_from_args=config_from_args,
    from_hf=from_hf,
    to_hf=to_hf,
    keys=LLAMA3_KEYS,
)
