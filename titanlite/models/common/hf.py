"""The Hugging Face names and config values the decoder families share: the embedding, final
norm and head, each block's attention and its input norm, a SwiGLU's three projections, and
RoPE's base as DECODER_KEYS (titanlite.models.hf_keys) declares it. A family's hf.py adds its
own names (its MLP, its norms) and its config keys to these."""

from __future__ import annotations

import re
from typing import Any

# the Decoder's own parameters
TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# a block's attention (titanlite.models.common.attention) and the norm before it
ATTENTION = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
}
# the per-head q and k norms of an Attention built with qk_norm_eps
QK_NORMS = {
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}


def swiglu(module: str) -> dict[str, str]:
    """A block's SwiGLU (titanlite.models.common.feed_forward) at `module` -> transformers' mlp."""
    return {
        f"{module}.w1.weight": "mlp.gate_proj.weight",
        f"{module}.w3.weight": "mlp.up_proj.weight",
        f"{module}.w2.weight": "mlp.down_proj.weight",
    }


class Names:
    """titanlite's parameter names <-> transformers', from the top-level names and a block's
    names (`layers.<i>.<x>` <-> `model.layers.<i>.<y>`)."""

    def __init__(self, layer: dict[str, str], top: dict[str, str] = TOP) -> None:
        self.top, self.layer = top, layer
        self.top_back = {v: k for k, v in top.items()}
        self.layer_back = {v: k for k, v in layer.items()}

    def to_hf(self, name: str) -> str | None:
        """titanlite's `name` in transformers' naming; None if neither map knows it."""
        return _rename(name, self.top, self.layer, src="", dst="model.")

    def from_hf(self, name: str) -> str | None:
        """transformers' `name` in titanlite's naming; None if neither map knows it."""
        return _rename(name, self.top_back, self.layer_back, src="model.", dst="")


def _rename(
    name: str, top: dict[str, str], layer: dict[str, str], src: str, dst: str
) -> str | None:
    if name in top:
        return top[name]
    match = re.fullmatch(re.escape(src) + r"layers\.(\d+)\.(.+)", name)
    if match and match.group(2) in layer:
        return f"{dst}layers.{match.group(1)}.{layer[match.group(2)]}"
    return None


def tied_head_copy(name: str, tie_embeddings: bool) -> bool:
    """Whether a folder's tensor is the head's copy of a tied embedding, which titanlite holds
    once, as the embedding (the registry's tied-head rule): from_hf returns None for it."""
    return name == "lm_head.weight" and tie_embeddings


def rope_theta(values: dict[str, Any]) -> float:
    """RoPE's base from DECODER_KEYS' values: rope_parameters' (or rope_scaling's) rope_theta,
    else the top-level rope_theta, else 10000."""
    theta = (
        values["rope.rope_theta"] if values["rope.rope_theta"] is not None else values["rope_theta"]
    )
    return float(theta if theta is not None else 10000.0)
