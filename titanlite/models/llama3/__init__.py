"""Llama 3 flavors and registration."""

from dataclasses import replace

from titanlite.models.llama3.hf import LLAMA3_HF
from titanlite.models.llama3.model import Llama3, Llama3Args
from titanlite.models.llama3.parallelize import parallelize_llama
from titanlite.models.registry import ModelSpec, register_model

_TINY = Llama3Args(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=16)

llama3_flavors = {
    # torchtitan's debug shapes; the vocabulary comes from the tokenizer (2048 built in).
    "debugmodel": Llama3Args(dim=256, n_layers=6, n_heads=16, rope_theta=500000),
    # The same with the output head tied to the embedding, as Llama 3.2 1B/3B have it.
    "debugmodel_tied": Llama3Args(
        dim=256, n_layers=6, n_heads=16, rope_theta=500000, tie_embeddings=True
    ),
    # the model check's size (scripts/check_model.py; the suite's exactness worker): 4 heads and
    # 2 key-value heads, which a tensor split of 2 divides
    "tiny": _TINY,
    "tiny_tied": replace(_TINY, tie_embeddings=True),
    # Llama 3.2 1B
    "1B": Llama3Args(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.5,
        multiple_of=256,
        rope_theta=500000,
        rope_scaling_factor=32.0,
        tie_embeddings=True,
    ),
    # Llama 3.1 8B
    "8B": Llama3Args(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=1024,
        rope_theta=500000,
        rope_scaling_factor=8.0,
    ),
}

register_model(
    ModelSpec("llama3", Llama3, llama3_flavors, parallelize_llama, hf=LLAMA3_HF, axes=("tp",))
)

__all__ = ["Llama3", "Llama3Args", "llama3_flavors"]
