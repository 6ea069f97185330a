"""What a run leaves for use outside titanlite (export_run): its full weights as one torch.save file
(checkpoint.export_weights) and a Hugging Face folder (checkpoint.export_hf), the latter from a
checkpoint too (export_checkpoint). One full tensor at a time (Llama's q/k row permutation needs it
whole), so host memory is bounded by one shard; the shard plan comes from the shapes first."""

from __future__ import annotations

import io
import json
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from titanlite.components.checkpoint.index import publish
from titanlite.config import JobConfig
from titanlite.distributed.liveness import phase
from titanlite.distributed.parallelize import unwrap
from titanlite.distributed.param_init import canonical_name
from titanlite.distributed.utils import first_error
from titanlite.errors import TrainingError, UserError
from titanlite.models.registry import MetaModel
from titanlite.tools.cache import atomic_write_bytes
from titanlite.tools.records import read_json

logger = logging.getLogger("titanlite")

DEFAULT_SHARD_BYTES = 5 * 10**9  # the Hugging Face Hub's usual shard size
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Files beside tokenizer.json that name its special tokens and chat template, copied as they are.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
# config.json keys taken from the source folder: they describe tokens and the context length the
# model was made for, which titanlite's args do not carry.
_CARRIED_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings")


def companion_files(source: Path | None, tokenizer: Any) -> dict[str, bytes]:
    """Files written beside the weights: the source folder's generation_config.json and the run's
    tokenizer: a Hugging Face one's files as they are, a SentencePiece model as tokenizer.model with
    the tokenizer_config.json that has transformers encode as titanlite does (none for synthetic
    tokens)."""
    files: dict[str, bytes] = {}
    if source is not None and (source / "generation_config.json").is_file():
        files["generation_config.json"] = (source / "generation_config.json").read_bytes()
    if tokenizer is None:
        logger.info(
            "the export holds no tokenizer: the run trained on synthetic tokens, which have none"
        )
    elif tokenizer.folder is not None:
        folder = tokenizer.folder
        files |= {n: (folder / n).read_bytes() for n in TOKENIZER_FILES if (folder / n).is_file()}
    else:
        piece = tokenizer.sp.id_to_piece
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",  # transformers converts tokenizer.model
            "bos_token": piece(tokenizer.bos_id),
            "eos_token": piece(tokenizer.eos_id),
            "pad_token": piece(tokenizer.pad_id),
            "unk_token": piece(tokenizer.sp.unk_id()),
            "add_bos_token": False,  # titanlite adds its specials itself, as a prompt format says
            "add_eos_token": False,
        }
        files["tokenizer.model"] = tokenizer.model_proto
        files["tokenizer_config.json"] = (json.dumps(config, indent=2) + "\n").encode()
    return files


def hf_config(meta: MetaModel, dtype_name: str, source: Path | None) -> dict:
    """config.json: the adapter's, plus the token ids and context length of the source folder's."""
    config = meta.spec.hf.config_from_args(meta.args)
    max_position = config.get("max_position_embeddings", 0)
    if source is not None and (source / "config.json").is_file():
        theirs = read_json(source / "config.json")
        config.update({key: theirs[key] for key in _CARRIED_KEYS if key in theirs})
        config["max_position_embeddings"] = max(config["max_position_embeddings"], max_position)
    config["torch_dtype"] = config["dtype"] = dtype_name  # for transformers 4; for 5
    return config


def write_hf_folder(
    folder: Path,
    params: dict[str, torch.Tensor],
    fetch: Callable[[str], torch.Tensor],
    meta: MetaModel,
    dtype_name: str,
    source: Path | None,
    tokenizer: Any,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    writes: bool = True,
) -> tuple[str | None, int]:
    """The folder for `params` (only their shapes are read), written if `writes`. `fetch(name)`
    gives the full tensor, called by every rank in the same order (a gather inside is collective).
    Returns this rank's failure in one line (nothing is published then) and the shard count."""
    from safetensors.torch import save_file

    adapter, args, dtype = meta.spec.hf, meta.args, DTYPES[dtype_name]
    shards: list[list[str]] = [[]]  # titanlite names (each one or more HF tensors); a big one alone
    size = total = 0
    for name, p in params.items():
        pieces = adapter.write(name, torch.empty(p.shape, device="meta"), args)
        nbytes = sum(converted.numel() for _, converted in pieces) * dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
        total += nbytes
    if not writes:  # the other ranks take part in each gather, in the same order
        for name in params:
            fetch(name)
        return None, len(shards)
    tmp = folder.with_name(folder.name + ".tmp")
    error, weight_map = None, {}
    try:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        except OSError as e:
            error = f"cannot create {tmp}: {e}"
        for i, shard in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            if len(shards) == 1:
                file = "model.safetensors"
            tensors = {}
            for name in shard:
                full = fetch(name)  # after a failure too: the gathers go on
                if not error:
                    for hf_name, converted in adapter.write(name, full, args):
                        converted = converted.detach().to(device="cpu", dtype=dtype)
                        tensors[hf_name] = converted.contiguous()
                        weight_map[hf_name] = file
            if error:
                continue
            try:
                save_file(tensors, str(tmp / file), metadata={"format": "pt"})
            except OSError as e:
                error = f"writing {tmp / file}: {e}"
        if not error:
            written = {"config.json": hf_config(meta, dtype_name, source)}
            if len(shards) > 1:
                weight_map = dict(sorted(weight_map.items()))
                index = {"metadata": {"total_size": total}, "weight_map": weight_map}
                written["model.safetensors.index.json"] = index
            try:
                for name, content in written.items():
                    (tmp / name).write_text(json.dumps(content, indent=2) + "\n")
                for name, data in companion_files(source, tokenizer).items():
                    (tmp / name).write_bytes(data)
                publish(tmp, folder)
                for note in adapter.unsaid(args) if adapter.unsaid else ():
                    logger.warning(f"exported {folder}: {note}")
            except OSError as e:
                error = f"publishing {folder}: {e}"
    finally:  # a failure, a tensor that cannot be read, a stop: nothing half-written stays
        shutil.rmtree(tmp, ignore_errors=True)
    return error, len(shards)


def export_hf(
    model: nn.Module,
    folder: Path,
    meta: MetaModel,
    dtype_name: str,
    source: Path | None,
    tokenizer: Any,
) -> None:
    """The trained (possibly sharded) model as a Hugging Face folder; every rank calls it.
    `source`: the folder the model came from (its token ids and context length are kept);
    `tokenizer`: the run's (None: synthetic tokens; see companion_files)."""
    start = time.perf_counter()
    params = {canonical_name(n): p.detach() for n, p in unwrap(model).named_parameters()}
    rank = dist.get_rank() if dist.is_initialized() else 0

    def fetch(name: str) -> torch.Tensor:
        p = params[name]
        return p.full_tensor() if isinstance(p, DTensor) else p

    error, n = write_hf_folder(
        folder, params, fetch, meta, dtype_name, source, tokenizer, writes=rank == 0
    )
    error = first_error(error)
    if error:
        raise TrainingError(
            f"Hugging Face export failed ({error}); the run's checkpoints are intact"
        )
    if rank == 0:
        logger.info(
            f"exported a Hugging Face folder to {folder} ({n} shard(s), {dtype_name}) "
            f"in {time.perf_counter() - start:.1f}s"
        )


def export_weights(model: torch.nn.Module, path: Path) -> None:
    """The full, unsharded model weights as one torch.save file at `path` (for evaluation or
    conversion); every rank takes part in the gather, rank 0 writes atomically."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    if dist.get_rank() == 0:
        buf = io.BytesIO()
        torch.save(state, buf)
        atomic_write_bytes(path, buf.getvalue())
        logger.info(f"exported full weights to {path}")


@phase("export")
def export_run(
    cfg: JobConfig, model: torch.nn.Module, meta, tokenizer, run_dir: Path
) -> list[Path]:
    """The exports the config asks for, into the run folder (every rank calls it); `meta`: the
    MetaModel. Returns what it wrote."""
    c = cfg.checkpoint
    written = []
    if c.export_weights:
        export_weights(model, run_dir / "weights.pt")
        written.append(run_dir / "weights.pt")
    if c.export_hf:
        source = Path(cfg.model.hf_assets_path).expanduser() if cfg.model.hf_assets_path else None
        export_hf(model, run_dir / "hf", meta, c.export_dtype, source, tokenizer)
        written.append(run_dir / "hf")
    return written


def export_checkpoint(
    step_folder: Path,
    folder: Path,
    dtype_name: str,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    import_module: str = "",
) -> int:
    """An intact titanlite step folder (index.read_checkpoint checked it) as a Hugging Face
    folder, in one process with no process group: the model rebuilt from its state.json
    (model.py). Returns the number of shards."""
    from titanlite.components.checkpoint.model import read_tensors, rebuild

    cfg, tok, meta = rebuild(step_folder, import_module)
    if meta.spec.hf is None:
        raise UserError(
            f"model '{meta.spec.name}' has no HFAdapter in its registry entry; it cannot be exported"
        )
    params = dict(meta.model.named_parameters())

    def fetch(name: str) -> torch.Tensor:
        tensor = torch.empty(params[name].shape, dtype=torch.float32)
        read_tensors(step_folder, {name: tensor})
        return tensor

    source = Path(cfg.model.hf_assets_path).expanduser() if cfg.model.hf_assets_path else None
    error, n = write_hf_folder(
        folder, params, fetch, meta, dtype_name, source, tok, max_shard_bytes
    )
    if error:
        raise TrainingError(f"the export failed ({error}); nothing was published at '{folder}'")
    return n
