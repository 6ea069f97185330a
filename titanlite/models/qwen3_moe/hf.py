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
from titanlite.models.qwen3_moe.args import Qwen3MoeArgs
from titanlite.models.registry import HFAdapter

_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.experts.gate_up": "mlp.experts.gate_up_proj",  # fused: read only
    "mlp.experts.down": "mlp.experts.down_proj",  # fused: read only
    "mlp.w1.weight": "mlp.gate_proj.weight",  # a dense layer's SwiGLU
    "mlp.w3.weight": "mlp.up_proj.weight",
    "mlp.w2.weight": "mlp.down_proj.weight",
}
_TOP_BACK = {v: k for k, v in _TOP.items()}
_LAYER_BACK = {v: k for k, v in _LAYER.items()}
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_OURS = re.compile(r"layers\.(\d+)\.(.+)")


def from_hf(name: str, tensor: torch.Tensor, args: Qwen3MoeArgs) -> tuple | None:
    """One transformers tensor -> (titanlite name, tensor), or for one expert's projection
    (name, tensor, its index in the stacked parameter); None for a tied head's copy."""
    if name == "lm_head.weight" and args.tie_embeddings:
        return None
    if name in _TOP_BACK:
        return _TOP_BACK[name], tensor
    expert = _EXPERT.fullmatch(name)
    if expert:
        layer, e, kind = int(expert.group(1)), int(expert.group(2)), expert.group(3)
        if kind == "down":
            return f"layers.{layer}.mlp.experts.down", tensor, (e,)
        half = slice(0, args.moe_hidden) if kind == "gate" else slice(args.moe_hidden, None)
        return f"layers.{layer}.mlp.experts.gate_up", tensor, (e, half)
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if match and match.group(2) in _LAYER_BACK:
        return f"layers.{match.group(1)}.{_LAYER_BACK[match.group(2)]}", tensor
    raise UserError(
        f"the Hugging Face weights hold '{name}', which a Qwen3-MoE model has no place for"
    )


def to_hf(
    name: str, tensor: torch.Tensor, args: Qwen3MoeArgs
) -> tuple[str, torch.Tensor] | list[tuple[str, torch.Tensor]]:
    """One titanlite tensor -> (transformers name, tensor); the stacked experts -> one tensor
    per expert and projection (copies, so that each is saved on its own)."""
    if name in _TOP:
        return _TOP[name], tensor
    match = _OURS.fullmatch(name)
    if match is None or match.group(2) not in _LAYER:
        raise ValueError(f"no Hugging Face name for titanlite's '{name}'")
    layer, rest = match.group(1), match.group(2)
    prefix = f"model.layers.{layer}.mlp.experts"
    if rest == "mlp.experts.down":
        return [(f"{prefix}.{e}.down_proj.weight", t.clone()) for e, t in enumerate(tensor)]
    if rest == "mlp.experts.gate_up":
        h = args.moe_hidden
        pieces = []
        for e, t in enumerate(tensor):
            pieces += [
                (f"{prefix}.{e}.gate_proj.weight", t[:h].clone()),
                (f"{prefix}.{e}.up_proj.weight", t[h:].clone()),
            ]
        return pieces
    return f"model.layers.{layer}.{_LAYER[rest]}", tensor


def _dense_layers(config: dict, n_layers: int) -> tuple[int, ...]:
    """The layers transformers gives a dense MLP: those in mlp_only_layers, and those whose
    index + 1 is no multiple of decoder_sparse_step."""
    only = set(config.get("mlp_only_layers") or [])
    step = int(config.get("decoder_sparse_step") or 1)
    return tuple(i for i in range(n_layers) if i in only or (i + 1) % step)


def args_from_config(config: dict) -> Qwen3MoeArgs:
    """Qwen3MoeArgs from a transformers Qwen3MoeConfig (config.json). vocab_size is config.json's;
    max_seq_len is left to training.seq_len. What titanlite's Qwen3-MoE cannot represent is one
    UserError."""
    try:
        heads = int(config["num_attention_heads"])
        n_layers = int(config["num_hidden_layers"])
        experts = config.get("num_experts", config.get("num_local_experts"))
        if experts is None:
            raise KeyError("num_experts")
        args = {
            "dim": int(config["hidden_size"]),
            "n_layers": n_layers,
            "n_heads": heads,
            "n_kv_heads": int(config.get("num_key_value_heads") or heads),
            "head_dim": int(config.get("head_dim") or int(config["hidden_size"]) // heads),
            "experts": int(experts),
            "top_k": int(config["num_experts_per_tok"]),
            "moe_hidden": int(config["moe_intermediate_size"]),
            "dense_hidden": int(config.get("intermediate_size") or 0),
            "dense_layers": _dense_layers(config, n_layers),
            "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
            "aux_loss_coef": float(config.get("router_aux_loss_coef", 0.001)),
            "vocab_size": int(config["vocab_size"]),
            "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
            "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
        }
    except KeyError as e:
        raise UserError(f"config.json has no {e}; it is not a complete Qwen3-MoE config") from None
    unsupported = [
        f"{key} = {config[key]!r}"
        for key, ok in (
            ("hidden_act", lambda v: v == "silu"),
            ("attention_bias", lambda v: not v),
        )
        if key in config and not ok(config[key])
    ]
    if args["experts"] < 1 or len(args["dense_layers"]) == n_layers:
        unsupported.append("no layer with experts")
    if args["dense_layers"] and not args["dense_hidden"]:
        unsupported.append("dense layers without an intermediate_size")
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    args["rope_theta"] = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        unsupported.append(f"rope type {kind!r}")
    if unsupported:
        raise UserError(
            f"config.json asks for what titanlite's Qwen3-MoE does not do: {', '.join(unsupported)}; "
            "use a Qwen3-MoE model folder"
        )
    return Qwen3MoeArgs(**args)


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
    reads=frozenset(
        {
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "num_experts",
            "num_local_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "intermediate_size",
            "mlp_only_layers",
            "decoder_sparse_step",
            "norm_topk_prob",
            "router_aux_loss_coef",
            "vocab_size",
            "rms_norm_eps",
            "tie_word_embeddings",
            "hidden_act",
            "attention_bias",
            "rope_theta",
            "rope_scaling",
            "rope_parameters",
            # transformers' forward switch that returns the router logits (and adds the
            # load-balancing loss to its own loss); titanlite's training always adds it
            "output_router_logits",
        }
    ),  # fmt: skip
)
