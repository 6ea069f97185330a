"""Qwen3-MoE <-> Hugging Face transformers' Qwen3MoeForCausalLM: config.json and weight names.

titanlite's RoPE rotates the two halves of a head as transformers' does, so no tensor is
permuted. The experts come two ways: one tensor per expert and projection
(`mlp.experts.<e>.gate_proj.weight`, as the Hub's Qwen3 MoE folders and transformers' own
save_pretrained write them) or fused (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`, as
transformers 5 holds them in memory). Both are read, each per-expert tensor as its piece of the
stacked parameter; exports write one tensor per expert, which every transformers version reads.
"""

from __future__ import annotations

import re

import torch

from titanlite.errors import UserError
from titanlite.models.common.hf import (
    ATTENTION,
    QK_NORMS,
    Names,
    rope_theta,
    swiglu,
    tied_head_copy,
)
from titanlite.models.hf_keys import DECODER_KEYS, ConfigKeys, Key, Relation, same
from titanlite.models.qwen3_moe.args import Qwen3MoeArgs
from titanlite.models.registry import HFAdapter

_NAMES = Names(
    {
        **ATTENTION,
        **QK_NORMS,
        "mlp_norm.weight": "post_attention_layernorm.weight",
        "mlp.router.weight": "mlp.gate.weight",
        "mlp.experts.gate_up": "mlp.experts.gate_up_proj",  # fused: read only
        "mlp.experts.down": "mlp.experts.down_proj",  # fused: read only
        **swiglu("mlp"),  # a dense layer's SwiGLU
    }
)
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_STACKED = re.compile(r"layers\.(\d+)\.mlp\.experts\.(gate_up|down)")


def from_hf(name: str, tensor: torch.Tensor, args: Qwen3MoeArgs) -> tuple | None:
    """One transformers tensor -> (titanlite name, tensor), or for one expert's projection
    (name, tensor, its index in the stacked parameter); None for a tied head's copy."""
    if tied_head_copy(name, args.tie_embeddings):
        return None
    expert = _EXPERT.fullmatch(name)
    if expert:
        layer, e, kind = int(expert.group(1)), int(expert.group(2)), expert.group(3)
        if kind == "down":
            return f"layers.{layer}.mlp.experts.down", tensor, (e,)
        half = slice(0, args.moe_hidden) if kind == "gate" else slice(args.moe_hidden, None)
        return f"layers.{layer}.mlp.experts.gate_up", tensor, (e, half)
    ours = _NAMES.from_hf(name)
    if ours is not None:
        return ours, tensor
    raise UserError(
        f"the Hugging Face weights hold '{name}', which a Qwen3-MoE model has no place for"
    )


def to_hf(
    name: str, tensor: torch.Tensor, args: Qwen3MoeArgs
) -> tuple[str, torch.Tensor] | list[tuple[str, torch.Tensor]]:
    """One titanlite tensor -> (transformers name, tensor); the stacked experts -> one tensor
    per expert and projection (copies, so that each is saved on its own)."""
    stacked = _STACKED.fullmatch(name)
    if stacked:
        prefix = f"model.layers.{stacked.group(1)}.mlp.experts"
        if stacked.group(2) == "down":
            return [(f"{prefix}.{e}.down_proj.weight", t.clone()) for e, t in enumerate(tensor)]
        h = args.moe_hidden
        pieces = []
        for e, t in enumerate(tensor):
            pieces += [
                (f"{prefix}.{e}.gate_proj.weight", t[:h].clone()),
                (f"{prefix}.{e}.up_proj.weight", t[h:].clone()),
            ]
        return pieces
    theirs = _NAMES.to_hf(name)
    if theirs is None:
        raise ValueError(f"no Hugging Face name for titanlite's '{name}'")
    return theirs, tensor


def _dense_layers(only: list[int], step: int, n_layers: int) -> tuple[int, ...]:
    """The layers transformers gives a dense MLP: those in mlp_only_layers, and those whose
    index + 1 is no multiple of decoder_sparse_step."""
    return tuple(i for i in range(n_layers) if i in only or (i + 1) % step)


_EXPERTS = "num_experts or num_local_experts"
# titanlite's Qwen3-MoE: q/k/v/o without bias, per-head q/k norms, SwiGLU (silu) experts and
# dense layers, plain RoPE
QWEN3_MOE_KEYS = DECODER_KEYS + ConfigKeys(
    "Qwen3-MoE",
    (
        Key("num_experts", "whole", at_least=1, default=None),
        Key("num_local_experts", "whole", at_least=1, default=None),
        Key("num_experts_per_tok", "whole", at_least=1),
        Key("moe_intermediate_size", "whole", at_least=1),
        Key("intermediate_size", "whole", at_least=1, null="no dense layer's width", default=None),
        Key("mlp_only_layers", "layers", at_least=0, null="none", default=[]),
        Key("decoder_sparse_step", "whole", at_least=1, default=1),
        Key("norm_topk_prob", "bool", default=False),
        Key("router_aux_loss_coef", "float", at_least=0, default=0.001),
        Key("hidden_act", "str", choices=("silu",), why="titanlite's Qwen3-MoE computes SwiGLU", default="silu"),
        Key("attention_bias", "bool", choices=(False,), why="titanlite's Qwen3-MoE has no biases", null="false", default=False),
        Key("rope.rope_type", "str", choices=("default",), why="titanlite's Qwen3-MoE has no RoPE scaling", default=None),
        Key("rope.type", "str", choices=("default",), why="titanlite's Qwen3-MoE has no RoPE scaling", default=None),
        # transformers' forward switch that returns the router logits (and adds the
        # load-balancing loss to its own loss); titanlite's training always adds it
        Key("output_router_logits", "bool", default=False),
    ),
    (
        same("num_experts", "num_local_experts"),
        Relation(
            ("num_experts", "num_local_experts"),
            lambda a, b: a is not None or b is not None,
            f"{_EXPERTS} must give the number of experts",
            partial=True,
        ),
        *(
            Relation(
                ("num_experts_per_tok", experts),
                lambda k, e: k <= e,
                f"num_experts_per_tok must be at most {experts} (a token is routed to that many distinct experts)",
            )
            for experts in ("num_experts", "num_local_experts")
        ),
        Relation(
            ("head_dim",),
            lambda hd: hd % 2 == 0,
            "head_dim must be even (RoPE rotates the two halves of a head)",
        ),
        Relation(
            ("hidden_size", "num_attention_heads", "head_dim"),
            lambda d, h, hd: hd is not None or (d % h == 0 and (d // h) % 2 == 0),
            "without head_dim, hidden_size / num_attention_heads is a head's width: a whole, even number (RoPE rotates the two halves of a head)",
            partial=True,
        ),
        Relation(
            ("mlp_only_layers", "num_hidden_layers"),
            lambda only, n: all(i < n for i in only),
            "mlp_only_layers must name layers below num_hidden_layers",
        ),
        Relation(
            ("mlp_only_layers", "decoder_sparse_step", "num_hidden_layers"),
            lambda only, step, n: len(_dense_layers(only, step, n)) < n,
            "some layer must have experts (a layer is dense when mlp_only_layers names it or decoder_sparse_step does not divide its index + 1)",
        ),
        Relation(
            ("mlp_only_layers", "decoder_sparse_step", "num_hidden_layers", "intermediate_size"),
            lambda only, step, n, width: width is not None or not _dense_layers(only, step, n),
            "dense layers need intermediate_size, their MLP's width",
            partial=True,
        ),
    ),
)  # fmt: skip


def args_from_config(config: dict) -> Qwen3MoeArgs:
    """Qwen3MoeArgs from a transformers Qwen3MoeConfig (config.json), every key read through
    QWEN3_MOE_KEYS. vocab_size is config.json's; max_seq_len is left to training.seq_len."""
    v = QWEN3_MOE_KEYS.read(config)
    heads, n_layers = v["num_attention_heads"], v["num_hidden_layers"]
    experts = v["num_experts"] if v["num_experts"] is not None else v["num_local_experts"]
    return Qwen3MoeArgs(
        dim=v["hidden_size"],
        n_layers=n_layers,
        n_heads=heads,
        n_kv_heads=v["num_key_value_heads"] or heads,
        head_dim=v["head_dim"] or v["hidden_size"] // heads,
        experts=experts,
        top_k=v["num_experts_per_tok"],
        moe_hidden=v["moe_intermediate_size"],
        dense_hidden=v["intermediate_size"] or 0,
        dense_layers=_dense_layers(v["mlp_only_layers"], v["decoder_sparse_step"], n_layers),
        norm_topk_prob=v["norm_topk_prob"],
        aux_loss_coef=float(v["router_aux_loss_coef"]),
        vocab_size=v["vocab_size"],
        norm_eps=float(v["rms_norm_eps"]),
        tie_embeddings=v["tie_word_embeddings"],
        rope_theta=rope_theta(v),
    )


def config_from_args(args: Qwen3MoeArgs) -> dict:
    """config.json for transformers' Qwen3MoeForCausalLM."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "num_experts": args.experts,
        "num_experts_per_tok": args.top_k,
        "moe_intermediate_size": args.moe_hidden,
        "intermediate_size": args.dense_hidden,
        "mlp_only_layers": list(args.dense_layers),
        "decoder_sparse_step": 1,
        "norm_topk_prob": args.norm_topk_prob,
        "router_aux_loss_coef": args.aux_loss_coef,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "use_sliding_window": False,
        "torch_dtype": "float32",
    }


def unsaid(args: Qwen3MoeArgs) -> list[str]:
    """What of titanlite's objective Qwen3MoeConfig has no key for."""
    notes = []
    if args.aux_per_layer:
        notes.append(
            "the load-balancing loss was each layer's, averaged; transformers' Qwen3MoeForCausalLM "
            f"trains the pooled form at router_aux_loss_coef = {args.aux_loss_coef}"
        )
    if args.z_loss_coef:
        notes.append(
            f"the router z-loss (z_loss_coef {args.z_loss_coef}) has no Qwen3MoeConfig key; "
            "transformers trains without it"
        )
    return notes


QWEN3_MOE_HF = HFAdapter(
    architectures=("Qwen3MoeForCausalLM",),
    args_from_config=args_from_config,
    config_from_args=config_from_args,
    from_hf=from_hf,
    to_hf=to_hf,
    unsaid=unsaid,
    keys=QWEN3_MOE_KEYS,
)
