"""Models. Importing this package registers the built-in ones."""

from titanlite.models import (
    llama3,  # noqa: F401  (registers "llama3")
    qwen3_moe,  # noqa: F401  (registers "qwen3_moe")
)
from titanlite.models.registry import ModelSpec, get_model_spec, register_model

__all__ = ["ModelSpec", "get_model_spec", "register_model"]
