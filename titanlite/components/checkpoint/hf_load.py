"""Pretrained weights from a Hugging Face folder into the sharded model through its HFAdapter: names
and shapes checked from the headers, then one full tensor at a time (memory bounded by the largest),
not DCP's HuggingFaceStorageReader's slices: Llama's q/k row permutation mixes FSDP's dim-0 shards."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from titanlite.distributed.parallelize import unwrap
from titanlite.distributed.param_init import canonical_name, copy_full_
from titanlite.errors import UserError
from titanlite.models.registry import HFAdapter, models_reading
from titanlite.tools.process import heartbeat
from titanlite.tools.records import read_json

logger = logging.getLogger("titanlite")

# Buffers older transformers saved with the weights and every version recomputes from config.json
# on load (as titanlite's models do): skipped for every model, before its adapter sees a name.
DERIVED_BUFFERS = (".rotary_emb.inv_freq",)


def safetensors_header(path: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's name and shape in a safetensors file, from its header alone (an 8-byte
    little-endian length, the JSON header, then the data), once the file holds every byte the
    header describes: a truncated or damaged file is one UserError."""
    again = "download it again"
    if not path.is_file():
        raise UserError(f"'{path}' is missing; {again}")
    size = path.stat().st_size
    with path.open("rb") as f:
        length = int.from_bytes(f.read(8), "little")  # a shorter file fails the bound below
        if not 0 < length <= size - 8:
            raise UserError(
                f"'{path}' is not a safetensors file or is cut short ({size:,} bytes); {again}"
            )
        try:
            header = json.loads(f.read(length))
            tensors = {n: t for n, t in header.items() if n != "__metadata__"}
            ends = [t["data_offsets"][1] for t in tensors.values()]
            shapes = {n: tuple(int(d) for d in t["shape"]) for n, t in tensors.items()}
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            raise UserError(f"'{path}' has a damaged safetensors header; {again}") from None
    need = 8 + length + max(ends, default=0)
    if size < need:
        raise UserError(
            f"'{path}' is cut short: {size:,} of the {need:,} bytes its header describes; {again}"
        )
    return shapes


def weight_files(folder: Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """HF tensor name -> (the safetensors file that holds it, its shape), every file checked whole
    and, with a shard index, the index and the shards' headers agreeing both ways (one UserError
    names the first name one lists and the other lacks)."""
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        path = folder / "model.safetensors"
        return {name: (path, shape) for name, shape in safetensors_header(path).items()}
    weight_map = read_json(index, "download it again").get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise UserError(
            f"'{index}' is not a safetensors index (no weight_map of names to files); download it again"
        )
    again = f"the index and the shards disagree: download {index.name} and the shards again"
    out = {}
    for file in sorted(set(weight_map.values())):
        held = safetensors_header(folder / file)
        listed = {name for name, f in weight_map.items() if f == file}
        if lost := sorted(listed - set(held)):
            raise UserError(
                f"'{index}' lists {_some(lost)} in {file}, which does not hold them; {again}"
            )
        if unlisted := sorted(set(held) - listed):
            raise UserError(
                f"'{folder / file}' holds {_some(unlisted)}, which '{index}' does not list; {again}"
            )
        out.update({name: (folder / file, held[name]) for name in sorted(listed)})
    return out


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _piece_shape(index: tuple, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple] | None:
    """The shape a piece at `index` of a parameter of `shape` has, and its box (each dim's
    start and stop); None: the index does not fit the shape."""
    if len(index) > len(shape):
        return None
    piece, box = [], []
    for at, size in zip(index, shape, strict=False):
        if isinstance(at, int):
            if not 0 <= at < size:
                return None
            box.append((at, at + 1))
        else:
            start, stop, step = at.indices(size)
            if step != 1 or stop <= start:
                return None
            piece.append(stop - start)
            box.append((start, stop))
    rest = list(shape[len(index) :])
    return tuple(piece + rest), tuple(box + [(0, n) for n in rest])


def check_family(folder: Path, adapter: HFAdapter | None) -> None:
    """`folder`'s model family (config.json's architectures, else its model_type) is one this
    model's adapter reads; else one UserError naming the family and the model.name that reads it,
    before any weight is compared (another family's names and shapes are no fault of the folder)."""
    if adapter is None:
        raise UserError(
            f"'{folder}' holds Hugging Face weights but this model has no HFAdapter to read them"
        )
    if not (folder / "config.json").is_file():  # names no family: its weights are compared alone
        return
    config = read_json(
        folder / "config.json", "a Hugging Face model folder's config.json is a JSON object"
    )
    archs = config.get("architectures") or [config.get("model_type")]
    archs = [str(a) for a in archs if a] if isinstance(archs, list) else [str(archs)]
    if not archs or set(archs) & set(adapter.architectures):
        return
    readers = models_reading(archs)
    fix = (
        f"--model.name {readers[0]} --model.hf_assets_path {folder}"
        if readers
        else "a model.name whose adapter reads it (a fork registers one with register_model)"
    )
    raise UserError(
        f"'{folder}' holds another model family ({', '.join(archs)}) than this run's model, which reads "
        f"{', '.join(adapter.architectures)}; to train that model set {fix}, or give a folder of the family this model reads"
    )


def another_model(folder: Path, adapter: HFAdapter, args: Any) -> str:
    """How the model `folder`'s config.json describes differs from the one this run builds
    (`args`; its sequence length and dropout are the run's own), as "key theirs vs ours" for up
    to three keys; "" where they agree (then the weights are what is wrong)."""
    if not (folder / "config.json").is_file() or not dataclasses.is_dataclass(args):
        return ""
    try:  # a config.json a bounded reader refuses is refused in its own words
        theirs = adapter.args_from_config(read_json(folder / "config.json"))
    except (KeyError, TypeError, ValueError):  # a fork's reader: the weights are compared alone
        return ""
    keys = [f.name for f in dataclasses.fields(args) if f.name not in ("max_seq_len", "dropout")]
    differ = [k for k in keys if getattr(theirs, k, None) != getattr(args, k)]
    return ", ".join(
        f"{k} {getattr(theirs, k, None)!r} vs {getattr(args, k)!r}" for k in differ[:3]
    )


def _not_this_model(folder: Path, adapter: HFAdapter, args: Any, why: str) -> UserError:
    """The error of a folder whose weights this model cannot take: another model, where its
    config.json describes one (another_model), else `why`."""
    other = another_model(folder, adapter, args)
    if not other:
        return UserError(why)
    return UserError(
        f"'{folder}' holds another model than this run builds (config.json vs this run: {other}); "
        f"to train the model it holds set --model.hf_assets_path {folder}, or give a folder of this model"
    )


def hf_plan(
    params: dict[str, tuple[int, ...]], folder: Path, adapter: HFAdapter | None, args: Any
) -> list[tuple[str, str, Path, tuple | None]]:
    """(HF name, parameter name, file, Index) for every weight the model takes from `folder`,
    from the headers alone: `params` (canonical name -> shape) must be covered exactly, a
    parameter held in pieces by distinct pieces whose sizes add up to it, else one UserError.
    The preflight runs it on the meta model; the load again."""
    check_family(folder, adapter)
    plan = []
    pieces: dict[str, dict[tuple, str]] = {}  # parameter -> its pieces' boxes -> HF name
    for hf_name, (path, shape) in weight_files(folder).items():
        if hf_name.endswith(DERIVED_BUFFERS):
            continue
        mapped = adapter.read(hf_name, torch.empty(shape, device="meta"), args)
        if mapped is None:
            continue
        name, converted, index = mapped
        if name not in params:
            why = f"'{folder}' holds '{hf_name}', which this model has no parameter for"
            raise _not_this_model(folder, adapter, args, why)
        want = tuple(params[name])
        fits = None if index is None else _piece_shape(index, want)
        if fits is not None:
            want, box = fits
            if box in pieces.setdefault(name, {}):
                raise UserError(
                    f"'{folder}' holds '{hf_name}' and '{pieces[name][box]}', which fill the same "
                    f"part of the model's '{name}'; remove the duplicate or download the folder again"
                )
            pieces[name][box] = hf_name
        if tuple(converted.shape) != want or (index is not None and fits is None):
            why = (
                f"'{hf_name}' in '{folder}' has shape {shape}, the model's '{name}' "
                f"{tuple(params[name])}; the folder's config.json does not match its weights"
            )
            raise _not_this_model(folder, adapter, args, why)
        plan.append((hf_name, name, path, index))
    for name, boxes in pieces.items():
        whole = [n for hf, n, _, index in plan if n == name and index is None]
        held = sum(math.prod(b - a for a, b in box) for box in boxes)
        if whole or held != math.prod(params[name]):
            raise UserError(
                f"'{folder}' holds {len(boxes)} pieces of the model's '{name}' covering {held:,} of its "
                f"{math.prod(params[name]):,} values{' and the whole of it' if whole else ''}; "
                "download the folder again, or point model.hf_assets_path at the model its config.json describes"
            )
    missing = sorted(set(params) - {name for _, name, _, _ in plan})
    if missing:
        why = (
            f"'{folder}' lacks weights for {_some(missing)}; download the folder again, or point "
            "model.hf_assets_path at the model its config.json describes"
        )
        raise _not_this_model(folder, adapter, args, why)
    return plan


def load_hf_weights(model: nn.Module, folder: Path, adapter: HFAdapter | None, args: Any) -> None:
    """Every parameter of `model` from `folder`'s weights, after hf_plan checked them all; a
    parameter held in pieces is put together on the host first, one parameter at a time."""
    from safetensors import safe_open

    start = time.perf_counter()
    params = {canonical_name(n): p for n, p in unwrap(model).named_parameters()}
    plan = hf_plan({n: tuple(p.shape) for n, p in params.items()}, folder, adapter, args)
    by_param: dict[str, list[tuple[str, Path, tuple | None]]] = {}
    for hf_name, name, path, index in plan:
        by_param.setdefault(name, []).append((hf_name, path, index))
    done = 0

    def say(seconds: float) -> None:
        logger.info(
            f"loading pretrained weights from {folder}: {done} of {len(plan)} tensors ({seconds:.0f}s)"
        )

    with ExitStack() as stack, heartbeat(say):
        paths = sorted({path for _, _, path, _ in plan})
        handles = {path: stack.enter_context(safe_open(path, framework="pt")) for path in paths}
        for name, entries in by_param.items():
            full = None
            for hf_name, path, index in entries:
                _, converted, _ = adapter.read(hf_name, handles[path].get_tensor(hf_name), args)
                if index is None:
                    full = converted
                else:
                    if full is None:
                        full = torch.empty(params[name].shape, dtype=converted.dtype)
                    full[index] = converted
                done += 1
            copy_full_(params[name], full)
    logger.info(
        f"loaded {len(plan)} pretrained tensors from {folder} in {time.perf_counter() - start:.1f}s"
    )
