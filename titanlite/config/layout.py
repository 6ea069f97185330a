"""Derived quantities of a config at a given world size: mesh degrees, mode, accumulation.

Kept free of torch so the launcher's preflight check can use it before any worker starts.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from titanlite.config.job_config import JobConfig
from titanlite.config.manager import check_values
from titanlite.errors import UserError


@dataclass(frozen=True)
class Layout:
    dp_replicate: int  # outer mesh dim: replicas
    dp_shard: int  # inner mesh dim: FSDP shards per replica
    mode: str  # fsdp | ddp | hsdp
    grad_accum: int  # microbatches per rank per optimizer step
    skip_grad_sync: bool  # no gradient reduction on non-final microbatches

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard


def resolve_layout(cfg: JobConfig, world_size: int) -> Layout:
    p, t = cfg.parallelism, cfg.training
    if p.dp_replicate < 1:
        raise UserError(f"parallelism.dp_replicate is {p.dp_replicate}; it must be >= 1")
    if p.dp_shard == -1:
        if world_size % p.dp_replicate:
            raise UserError(
                f"parallelism.dp_replicate={p.dp_replicate} does not divide the {world_size} "
                "ranks; pick a divisor of the world size"
            )
        shard = world_size // p.dp_replicate
    elif p.dp_shard < 1:
        raise UserError(f"parallelism.dp_shard is {p.dp_shard}; use -1 or a positive degree")
    else:
        shard = p.dp_shard
    if p.dp_replicate * shard != world_size:
        raise UserError(
            f"dp_replicate x dp_shard = {p.dp_replicate} x {shard} != {world_size} ranks; "
            "set --parallelism.dp_shard -1 or launch that many ranks (NPROC)"
        )
    mode = p.mode
    if mode == "auto":
        mode = "hsdp" if (p.dp_replicate > 1 and shard > 1) else "ddp" if p.dp_replicate > 1 else "fsdp"
    if mode == "fsdp" and p.dp_replicate != 1:
        raise UserError("parallelism.mode 'fsdp' needs dp_replicate 1; use mode 'hsdp' for replicas")
    if mode == "ddp" and shard != 1:
        raise UserError("parallelism.mode 'ddp' needs dp_shard 1 (or -1 with dp_replicate = ranks)")
    if mode == "ddp" and p.skip_grad_sync == "off":
        # DDP all-reduces the *accumulated* .grad: under SUM, the already-reduced earlier
        # microbatches would be summed again and count dp times (averaging hides this).
        raise UserError(
            "parallelism.skip_grad_sync 'off' cannot be exact with ddp (it re-reduces the "
            "accumulated gradient); use 'auto' or 'on', or mode fsdp/hsdp"
        )
    dp = p.dp_replicate * shard
    for name in ("global_batch_size", "local_batch_size", "seq_len", "steps"):
        if getattr(t, name) < 1:
            raise UserError(f"training.{name} is {getattr(t, name)}; it must be >= 1")
    per_micro = t.local_batch_size * dp
    if t.global_batch_size % per_micro:
        raise UserError(
            f"training.global_batch_size={t.global_batch_size} is not a multiple of "
            f"local_batch_size x dp = {t.local_batch_size} x {dp} = {per_micro}; "
            "change one of them so it divides"
        )
    skip = {"on": True, "off": False}.get(p.skip_grad_sync, mode == "ddp")
    return Layout(p.dp_replicate, shard, mode, t.global_batch_size // per_micro, skip)


def holds_unsharded_grads(layout: Layout) -> bool:
    """Whether FSDP/HSDP keeps every unit's unsharded gradient from one microbatch to the next:
    when the reduction waits for the last microbatch (skip_grad_sync). DDP always holds its full
    gradient, so it holds nothing more."""
    return layout.mode != "ddp" and layout.grad_accum > 1 and layout.skip_grad_sync


def diagnostics_method(method: str, layout: Layout) -> str:
    """diagnostics.method (`method`) at this layout, `auto` resolved.

    `exact` needs each rank's whole-step local gradient at once. That is free under DDP, with one
    microbatch, or when the earlier microbatches skip the reduction anyway; otherwise a measured
    step must skip it, and FSDP then keeps every unit's unsharded gradient across microbatches
    (4 bytes x all parameters per rank). The sketch is linear (the sketch of a sum is the sum of
    the sketches), so it accumulates per microbatch while FSDP reduce-scatters as usual, at
    O(world x sketch_dim) memory: `auto` takes it there, and under HSDP, where exact cannot work.
    """
    if method != "auto":
        return method
    if layout.mode == "hsdp":
        return "sketch"
    return "exact" if layout.grad_accum == 1 or layout.skip_grad_sync else "sketch"


def check_run_name(name: str) -> None:
    """job.run_name names a folder inside job.dump_folder: a name, or a relative path that groups
    runs ('sweep/lr-3e-4'); never absolute, from '~' or through '.' or '..'."""
    from pathlib import Path

    parts = name.split("/")
    if name.startswith(("/", "~")) or Path(name).is_absolute() or any(p in (".", "..") for p in parts):
        raise UserError(
            f"job.run_name '{name}' would write outside job.dump_folder; give a name, or a relative "
            "path like 'sweep/run-1', without '.', '..' or a leading '/' or '~'"
        )
    long = next((p for p in parts if len(p.encode()) > 255), None)
    if long is not None:
        raise UserError(
            f"job.run_name: the folder name '{long[:20]}...' is {len(long.encode())} bytes; file systems allow 255"
        )


def validate(cfg: JobConfig, world_size: int) -> Layout:
    """Every rule on a config that needs no torch (layout, batch sizes, value ranges, option
    combinations, the tokenizer and model files): the preflight runs it before torchrun starts,
    the trainer again in every worker; the data files are titanlite.datasets.spec's to check."""
    from pathlib import Path

    check_values(cfg)
    check_run_name(cfg.job.run_name)
    layout = resolve_layout(cfg, world_size)
    ranks = ["corrupt_labels_rank", "grad_noise_rank", "sigkill_rank", "hang_rank"]
    ranks += ["flip_bit_rank"] if cfg.debug.flip_bit_step >= 0 else []
    ranks += ["stuck_loader_rank"] if cfg.debug.stuck_loader_step >= 0 else []
    ranks += ["freeze_rank"] if cfg.debug.freeze_step >= 0 else []
    for key in ranks:
        if getattr(cfg.debug, key) >= world_size:
            raise UserError(
                f"debug.{key} is {getattr(cfg.debug, key)} but there are {world_size} ranks; use -1 or a rank below {world_size}"
            )
    if cfg.debug.grad_noise_rank >= 0 and not (cfg.diagnostics.enable and world_size > 1):
        raise UserError(
            "debug.grad_noise_rank: the diagnostics' gradient probe injects that noise, and they are off "
            "(diagnostics.enable = false or one rank); turn them on with 2 or more ranks, or set it to -1"
        )
    d = cfg.diagnostics
    if d.spike_min_history > d.spike_window:
        raise UserError(
            f"diagnostics.spike_min_history is {d.spike_min_history} but spike_window is {d.spike_window}; "
            "the guard cannot need more values than its window holds"
        )
    if d.enable and d.method == "exact" and layout.mode == "hsdp":
        raise UserError(
            "diagnostics.method 'exact' needs fsdp or ddp (under hsdp the reduce-scatter spans "
            "one replica); use diagnostics.method = 'sketch' or 'auto'"
        )
    if not cfg.job.dump_folder.strip():
        raise UserError(
            "job.dump_folder is empty; name the folder that holds the run folders (default ./outputs)"
        )
    c = cfg.checkpoint
    if not c.folder:
        raise UserError(
            "checkpoint.folder is empty; name a folder (default: checkpoints, inside the run folder)"
        )
    if cfg.metrics.enable_wandb and importlib.util.find_spec("wandb") is None:  # found, not imported
        raise UserError(
            "metrics.enable_wandb: the wandb package is not installed; `pip install wandb` or set "
            "metrics.enable_wandb = false"
        )
    m = cfg.model
    if m.vocab_size < 0 or (m.vocab_size and m.hf_assets_path):
        raise UserError(
            f"model.vocab_size is {m.vocab_size}; it must be >= 0, and 0 with model.hf_assets_path "
            "(whose config.json gives the vocabulary)"
        )
    if cfg.data.mode == "synthetic" and (cfg.data.path or not (m.vocab_size or m.hf_assets_path)):
        raise UserError(
            "data.mode = 'synthetic' draws random tokens below model.vocab_size: set model.vocab_size "
            "(e.g. 128256) or model.hf_assets_path, and leave data.path empty"
        )
    check_documents_and_eval(cfg)
    if cfg.model.tokenizer_path and not Path(cfg.model.tokenizer_path).expanduser().is_file():
        raise UserError(
            f"model.tokenizer_path '{cfg.model.tokenizer_path}' is not a file; point it at a "
            "SentencePiece .model or a tokenizer.json, or leave it empty"
        )
    if cfg.model.hf_assets_path:
        check_hf_folder(
            Path(cfg.model.hf_assets_path).expanduser(), need_tokenizer=not cfg.model.tokenizer_path
        )
    if c.initial_load_path:
        kind = initial_load_kind(Path(c.initial_load_path).expanduser())
        if kind == "hf" and not c.initial_load_model_only:
            raise UserError(
                "checkpoint.initial_load_model_only = false needs a titanlite checkpoint (a Hugging "
                "Face folder holds no optimizer state); set it to true"
            )
    return layout


def check_documents_and_eval(cfg: JobConfig) -> None:
    """data.packing and data.document_mask fit data.mode; [eval]'s values are in range (its data:
    titanlite.datasets.spec.check_data_files)."""
    d, e = cfg.data, cfg.eval
    if d.packing and d.mode != "sft":
        raise UserError(
            f"data.packing packs SFT records but data.mode is '{d.mode}'; pretraining windows are packed "
            "already: set data.document_mask = true to keep attention within documents"
        )
    if d.document_mask and d.mode != "pretrain":
        raise UserError(
            f"data.document_mask is for pretraining windows but data.mode is '{d.mode}'; for SFT set "
            "data.packing = true (packed records always attend within themselves)"
        )
    if not 0.0 <= e.fraction <= 0.5:
        raise UserError(f"eval.fraction is {e.fraction}; hold out between 0 and 0.5 of the data")
    if d.mode == "synthetic" and (e.fraction or e.path or e.prompts):
        raise UserError(
            "synthetic data has no held-out text or tokenizer: leave [eval] unset with data.mode = 'synthetic'"
        )
    if e.prompts and not (e.path or e.fraction):
        raise UserError(
            "eval.prompts are decoded at each eval, but there is none: set eval.fraction or eval.path"
        )


CHECKPOINT_MARKER = (
    "complete"  # written last into a checkpoint step folder (components/checkpoint/checkpointer.py)
)


def initial_load_kind(path, flag: str = "checkpoint.initial_load_path") -> str:
    """Whether `path` is a Hugging Face model folder ("hf") or a complete checkpoint step folder
    ("titanlite"); anything else is one UserError that says what to point `flag` at."""
    what = "point it at a Hugging Face model folder or a titanlite step folder (<run>/checkpoints/step-N)"
    if not path.is_dir():
        raise UserError(f"{flag} '{path}' is not a folder; {what}")
    if (path / "config.json").is_file():
        check_hf_folder(path, need_tokenizer=False)
        return "hf"
    if (path / ".metadata").is_file():
        if not (path / CHECKPOINT_MARKER).is_file() or not (path / "state.json").is_file():
            raise UserError(
                f"checkpoint '{path}' is incomplete (its save never finished); point {flag} at a "
                "complete step folder"
            )
        return "titanlite"
    steps = sorted(p for p in path.glob("step-*") if (p / CHECKPOINT_MARKER).is_file())
    if steps:
        raise UserError(
            f"'{path}' is a checkpoint folder; point {flag} at one of its step folders, e.g. the "
            f"newest: '{steps[-1]}'"
        )
    raise UserError(f"{flag} '{path}' holds no config.json nor a checkpoint; {what}")


def check_hf_folder(folder, need_tokenizer: bool) -> None:
    """A Hugging Face model folder has config.json (valid JSON), its weights and, unless another
    tokenizer is named, tokenizer.json."""
    import json

    if not folder.is_dir():
        raise UserError(f"model.hf_assets_path '{folder}' is not a folder; point it at a downloaded model")
    try:
        json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"'{folder}' has no config.json; it is not a Hugging Face model folder") from None
    except (OSError, ValueError) as e:
        raise UserError(f"'{folder / 'config.json'}' is not valid JSON ({e})") from None
    if not any((folder / f).is_file() for f in ("model.safetensors", "model.safetensors.index.json")):
        raise UserError(
            f"'{folder}' has no model.safetensors or model.safetensors.index.json; download the weights too"
        )
    if need_tokenizer and not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
        raise UserError(
            f"'{folder}' has no tokenizer.json (nor tokenizer.model); download it, or set model.tokenizer_path"
        )


def fitting_local_batch(cfg: JobConfig, dp: int) -> int:
    """The largest local batch <= the config's that carries this rank's share of the global
    batch (global / dp) in whole microbatches: how the tools keep the global batch at any dp."""
    gb = cfg.training.global_batch_size
    if gb % dp:
        raise UserError(
            f"global batch {gb} does not split over dp={dp}; pick a global_batch_size divisible by {dp}"
        )
    share = gb // dp
    return max(b for b in range(1, min(cfg.training.local_batch_size, share) + 1) if share % b == 0)
