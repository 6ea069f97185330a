"""Qwen3-MoE's shapes and loss-term settings (the flavors in __init__.py; a Hugging Face
folder's config.json through hf.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Qwen3MoeArgs:
    dim: int = 2048
    """hidden size"""
    n_layers: int = 48
    """transformer blocks"""
    n_heads: int = 32
    """query heads"""
    n_kv_heads: int = 4
    """key/value heads (grouped-query attention)"""
    head_dim: int = 128
    """features per head (n_heads x head_dim need not be dim)"""
    experts: int = 128
    """experts in each MoE layer"""
    top_k: int = 8
    """experts each token is routed to"""
    moe_hidden: int = 768
    """each expert's SwiGLU width (HF's moe_intermediate_size)"""
    dense_hidden: int = 6144
    """the SwiGLU width of a dense layer (HF's intermediate_size)"""
    dense_layers: tuple[int, ...] = ()
    """layers with a dense SwiGLU MLP instead of experts (HF's mlp_only_layers, decoder_sparse_step)"""
    norm_topk_prob: bool = True
    """renormalise the chosen experts' probabilities to sum to 1"""
    aux_loss_coef: float = 0.001
    """load-balancing loss coefficient (HF's router_aux_loss_coef; 0: none)"""
    aux_per_layer: bool = False
    """the load-balancing loss of each MoE layer on its own, averaged (Switch Transformer's); False: the layers pooled (transformers')"""
    z_loss_coef: float = 0.0
    """router z-loss coefficient (0: none)"""
    experts_impl: str = "auto"
    """loop: one matmul pair per expert; grouped: torch's grouped_mm; auto: grouped on CUDA in bfloat16, else loop"""
    norm_eps: float = 1e-6
    """RMSNorm epsilon"""
    rope_theta: float = 1_000_000.0
    """RoPE base"""
    vocab_size: int = -1
    """filled in from the tokenizer or config.json"""
    max_seq_len: int = 4096
    """filled in from training.seq_len"""
    tie_embeddings: bool = False
    """output head shares the embedding's weight"""

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.n_layers) if i not in self.dense_layers]
