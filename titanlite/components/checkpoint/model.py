"""The model a checkpoint step folder holds, rebuilt offline (one process, no run config) from the
identity its state.json records, the weights read from DCP: for scripts/export_hf.py and
scripts/generate.py."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from titanlite.config import JobConfig
from titanlite.datasets.tokenizer import HFTokenizer, Tokenizer
from titanlite.models.registry import MetaModel

Rebuilt = tuple[JobConfig, Tokenizer | HFTokenizer | None, MetaModel]


def rebuild(step_folder: Path, import_module: str = "") -> Rebuilt:
    """Config (defaults but the checkpoint's identity keys), tokenizer (None: synthetic data) and
    meta-device model of an intact step folder (the caller checked it)."""
    from titanlite.components.checkpoint.resume import check_fits
    from titanlite.datasets.build import build_tokenizer
    from titanlite.models.hf_files import check_hf_folder
    from titanlite.models.registry import build_meta_model

    saved = json.loads((step_folder / "state.json").read_text())["identity"]
    cfg = JobConfig()
    for dotted, value in saved.items():
        section, key = dotted.split(".")
        setattr(getattr(cfg, section), key, value)
    cfg.model.import_module = import_module
    if cfg.model.hf_assets_path:  # the folder the run was made from gives shapes and tokenizer
        check_hf_folder(
            Path(cfg.model.hf_assets_path).expanduser(), need_tokenizer=not cfg.model.tokenizer_path
        )
    tok = build_tokenizer(cfg)
    meta = build_meta_model(cfg, tok.vocab_size if tok else 0)
    check_fits(step_folder, dict(meta.model.named_parameters()))
    return cfg, tok, meta


def read_tensors(step_folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Fill `tensors` (titanlite parameter names -> full tensors of their shapes) in place from
    the checkpoint's model state, in this process alone."""
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": tensors}, checkpoint_id=str(step_folder), no_dist=True)


def load_model(
    step_folder: Path, device: torch.device, import_module: str = ""
) -> tuple[nn.Module, Rebuilt]:
    """The checkpoint's model with its weights (float32, on `device`, eval mode), whole in this
    process. init_weights runs first for the buffers (RoPE tables) the checkpoint does not hold."""
    from titanlite.distributed.parallelize import to_empty_tied
    from titanlite.distributed.param_init import ParamInit

    cfg, tok, meta = rebuild(step_folder, import_module)
    model = meta.model
    to_empty_tied(model, device)
    with torch.no_grad():
        model.init_weights(ParamInit(model, 0))
    read_tensors(step_folder, {name: p.detach() for name, p in model.named_parameters()})
    return model.eval(), (cfg, tok, meta)
