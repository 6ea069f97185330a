"""Qwen3-MoE flavors and registration."""

from dataclasses import replace

from titanlite.models.qwen3_moe.args import Qwen3MoeArgs
from titanlite.models.qwen3_moe.hf import QWEN3_MOE_HF
from titanlite.models.qwen3_moe.model import Qwen3Moe
from titanlite.models.qwen3_moe.parallelize import parallelize_qwen3_moe
from titanlite.models.registry import ModelSpec, register_model

_DEBUG = Qwen3MoeArgs(
    dim=256,
    n_layers=4,
    n_heads=8,
    n_kv_heads=4,
    head_dim=32,
    experts=8,
    top_k=2,
    moe_hidden=128,
    dense_hidden=512,
)

# the model check's size (scripts/check_model.py, the suite's exactness worker): two MoE layers
# around a dense one (mlp_only_layers), 4 experts, 2 active; dims of 16 bytes' multiples, as
# grouped_mm needs
_TINY = Qwen3MoeArgs(
    dim=32,
    n_layers=3,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    experts=4,
    top_k=2,
    moe_hidden=16,
    dense_hidden=48,
    dense_layers=(1,),
)

qwen3_moe_flavors = {
    # a few experts at tiny dims (the vocabulary comes from the tokenizer, 2048 built in), with
    # Qwen3's objective: the layers' load-balancing loss pooled (transformers') at 0.001
    "debugmodel": _DEBUG,
    # each layer's load-balancing loss on its own at Switch Transformer's 0.01: trained from
    # scratch, it keeps balanced the layer that the pooled loss lets collapse
    "debugmodel_per_layer": replace(_DEBUG, aux_per_layer=True, aux_loss_coef=0.01),
    # the pooled loss 100 times stronger, and a z-loss
    "debugmodel_strong": replace(_DEBUG, aux_loss_coef=0.1, z_loss_coef=0.001),
    # the model check's size: transformers' objective, and the per-layer one strong with a z-loss
    "tiny": _TINY,
    "tiny_strong": replace(_TINY, aux_per_layer=True, aux_loss_coef=0.1, z_loss_coef=0.001),
    # a 1B-active MoE for one GPU: Qwen3's fine-grained experts (64, 8 active) at 16 layers of
    # width 2048, 2.4B parameters and 1.0B active at Qwen3's 151,936-row vocabulary
    # (scripts/gpu_check.sh's moe section)
    "2B-A1B": Qwen3MoeArgs(
        n_layers=16, n_heads=16, n_kv_heads=8, experts=64, top_k=8, moe_hidden=256
    ),
    # Qwen3-30B-A3B (128 experts, 8 active: 30.5B parameters, 3.3B active)
    "30B-A3B": Qwen3MoeArgs(max_seq_len=4096),
}

register_model(
    ModelSpec(
        "qwen3_moe",
        Qwen3Moe,
        qwen3_moe_flavors,
        parallelize_qwen3_moe,
        hf=QWEN3_MOE_HF,
        axes=("tp",),
        step_statistics=True,
    )
)

__all__ = ["Qwen3Moe", "Qwen3MoeArgs", "qwen3_moe_flavors"]
