"""Model registry: name -> (model class, flavors, parallelize function).

A fork adds a model with one call:

    register_model(ModelSpec("mymodel", MyModel, {"small": MyArgs(...)}, parallelize_mymodel))

and selects it with `[model] name = "mymodel"` (plus `import_module = "my_pkg.my_model"` so the
registration runs inside every worker). The contract for a registered model:

- `model_cls(args)` builds it; `args` is a dataclass with the fields `vocab_size` and
  `max_seq_len`, which the trainer fills in from the tokenizer and `training.seq_len`;
- `model(tokens[B, S]) -> logits[B, S, vocab]`;
- `model.init_weights(init: ParamInit)` fills every parameter through `init` (see
  titanlite.distributed.param_init) and recomputes its buffers, so initial weights do not
  depend on how the model is sharded;
- optional `model.num_flops_per_token(seq_len) -> int` for TFLOP/s and MFU;
- `parallelize_fn(model, parallel_dims, job_config) -> nn.Module` applies activation
  checkpointing, compile and FSDP/DDP/HSDP (usually via titanlite.distributed.parallelize).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from titanlite.errors import UserError


@dataclass(frozen=True)
class ModelSpec:
    name: str
    model_cls: type
    flavors: dict[str, Any]
    parallelize_fn: Callable[..., Any]


_REGISTRY: dict[str, ModelSpec] = {}


def register_model(spec: ModelSpec) -> ModelSpec:
    """Add a model; registering the same name again replaces it (convenient in notebooks)."""
    _REGISTRY[spec.name] = spec
    return spec


def get_model_spec(name: str) -> ModelSpec:
    if name not in _REGISTRY:
        match = difflib.get_close_matches(name, list(_REGISTRY), n=1)
        hint = f"did you mean '{match[0]}'?" if match else f"registered: {', '.join(_REGISTRY)}"
        raise UserError(
            f"unknown model.name '{name}' ({hint}); a fork registers its model with "
            "register_model() in the module named by model.import_module"
        )
    return _REGISTRY[name]


def get_flavor(spec: ModelSpec, flavor: str) -> Any:
    if flavor not in spec.flavors:
        match = difflib.get_close_matches(flavor, list(spec.flavors), n=1)
        hint = f"did you mean '{match[0]}'?" if match else f"valid: {', '.join(spec.flavors)}"
        raise UserError(f"model.flavor '{flavor}' is not a flavor of {spec.name} ({hint})")
    return spec.flavors[flavor]
