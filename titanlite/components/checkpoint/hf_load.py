"""Pretrained weights from a Hugging Face model folder (model.safetensors, or shards listed in
model.safetensors.index.json) into the model as it is sharded, through the model's HFAdapter.

Every name and shape is checked against the model first, from the files' headers (nothing is
read), so a folder that does not fit fails in one line before any weight moves. Then one full
tensor at a time is read, converted (names; Llama's q/k row permutation mixes rows across FSDP's
dim-0 shards, hence full tensors) and copied into each rank's part: memory is bounded by the
largest single tensor, never by the model. (DCP's HuggingFaceStorageReader reads slices
straight into shards, which the permutation rules out for q and k.)
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from titanlite.distributed.parallelize import unwrap
from titanlite.distributed.param_init import canonical_name, copy_full_
from titanlite.errors import UserError
from titanlite.models.registry import HFAdapter

logger = logging.getLogger("titanlite")

# Buffers older transformers saved with the weights and every version recomputes from config.json
# on load (as titanlite's models do): skipped for every model, before its adapter sees a name.
DERIVED_BUFFERS = (".rotary_emb.inv_freq",)


def safetensors_names(path: Path) -> list[str]:
    """The tensor names of a safetensors file, from its header alone, after checking the file
    holds every byte the header describes (an 8-byte little-endian header length, the JSON header,
    then each tensor at its data_offsets): a truncated or damaged file is one UserError."""
    again = "download it again"
    if not path.is_file():
        raise UserError(f"'{path}' is missing; {again}")
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < length <= size - 8:
            raise UserError(f"'{path}' is not a safetensors file or is cut short ({size:,} bytes); {again}")
        try:
            header = json.loads(f.read(length))
            ends = [t["data_offsets"][1] for name, t in header.items() if name != "__metadata__"]
        except (ValueError, KeyError, TypeError, IndexError):
            raise UserError(f"'{path}' has a damaged safetensors header; {again}") from None
    need = 8 + length + max(ends, default=0)
    if size < need:
        raise UserError(
            f"'{path}' is cut short: {size:,} of the {need:,} bytes its header describes; {again}"
        )
    return [name for name in header if name != "__metadata__"]


def weight_files(folder: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file that holds it, every file checked whole
    (safetensors_names): the preflight calls it before any worker starts."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError) as e:
            raise UserError(f"'{index}' is not a safetensors index ({e}); download it again") from None
        for file in sorted(set(weight_map.values())):
            safetensors_names(folder / file)
        return {name: folder / file for name, file in weight_map.items()}
    path = folder / "model.safetensors"
    return dict.fromkeys(safetensors_names(path), path)


def load_hf_weights(model: nn.Module, folder: Path, adapter: HFAdapter | None, args: Any) -> None:
    """Every parameter of `model` from `folder`'s weights; a missing, unexpected or mis-shaped
    tensor is one UserError naming it."""
    from safetensors import safe_open

    if adapter is None:
        raise UserError(f"'{folder}' holds Hugging Face weights but this model has no HFAdapter to read them")
    start = time.perf_counter()
    params = {canonical_name(n): p for n, p in unwrap(model).named_parameters()}
    files = weight_files(folder)
    with ExitStack() as stack:
        handles = {}
        for path in sorted(set(files.values())):
            if not path.is_file():
                raise UserError(f"'{path}' is missing; the folder's weights are incomplete")
            handles[path] = stack.enter_context(safe_open(path, framework="pt"))
        plan = []  # (HF name, titanlite name) in file order
        for hf_name, path in files.items():
            if hf_name.endswith(DERIVED_BUFFERS):
                continue
            shape = handles[path].get_slice(hf_name).get_shape()
            mapped = adapter.from_hf(hf_name, torch.empty(shape, device="meta"), args)
            if mapped is None:
                continue
            name, converted = mapped
            if name not in params:
                raise UserError(f"'{folder}' holds '{hf_name}', which this model has no parameter for")
            if tuple(converted.shape) != tuple(params[name].shape):
                raise UserError(
                    f"'{hf_name}' in '{folder}' has shape {tuple(shape)}, the model's '{name}' "
                    f"{tuple(params[name].shape)}; the folder's config.json does not match its weights"
                )
            plan.append((hf_name, name))
        missing = sorted(set(params) - {name for _, name in plan})
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise UserError(f"'{folder}' lacks weights for {', '.join(missing[:3])}{more}")
        for hf_name, name in plan:
            tensor = handles[files[hf_name]].get_tensor(hf_name)
            _, converted = adapter.from_hf(hf_name, tensor, args)
            copy_full_(params[name], converted)
    logger.info(f"loaded {len(plan)} pretrained tensors from {folder} in {time.perf_counter() - start:.1f}s")
