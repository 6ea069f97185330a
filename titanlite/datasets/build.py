"""Build this rank's data loader: tokenizer, dataset (cached), sampler, StatefulDataLoader."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from titanlite.components.faults import Faults
from titanlite.components.tokenizer import (
    HFTokenizer,
    Tokenizer,
    builtin_tokenizer_path,
    load_tokenizer,
    train_builtin_tokenizer,
)
from titanlite.config import JobConfig
from titanlite.datasets import corpus
from titanlite.datasets.pretrain import PackedDataset, build_token_cache
from titanlite.datasets.sampler import GlobalBatchSampler
from titanlite.datasets.sft import SFTDataset
from titanlite.distributed.utils import first_error
from titanlite.errors import UserError
from titanlite.tools.cache import atomic_write_bytes, cache_dir


def _built_once(path: Path, build, is_builder: bool) -> None:
    """One rank per node builds a missing cache file while the others wait; a bad-input error
    met by the builder (a malformed data file, say) is raised on every rank alike."""
    error = None
    if is_builder and not path.exists():
        try:
            build()
        except UserError as e:
            error = str(e)
    error = first_error(error)
    if error:
        raise UserError(error)


def _is_local_leader() -> bool:
    return int(os.environ.get("LOCAL_RANK", "0")) == 0


def build_tokenizer(cfg: JobConfig) -> Tokenizer | HFTokenizer:
    """model.tokenizer_path, else model.hf_assets_path's tokenizer.json, else the built-in one."""
    if cfg.model.tokenizer_path or cfg.model.hf_assets_path:
        return load_tokenizer(cfg.model.tokenizer_path or cfg.model.hf_assets_path)
    path = builtin_tokenizer_path(cache_dir(cfg.data.cache_dir), cfg.model.builtin_vocab_size)
    _built_once(path, lambda: train_builtin_tokenizer(path, cfg.model.builtin_vocab_size), _is_local_leader())
    return Tokenizer(path.read_bytes(), f"builtin:{path.name}")


def build_dataset(cfg: JobConfig, tok: Tokenizer) -> SFTDataset | PackedDataset:
    cache = cache_dir(cfg.data.cache_dir)
    seq_len = cfg.training.seq_len
    if cfg.data.mode == "sft":
        if cfg.data.path:
            records = corpus.sft_records_from_files(cfg.data.path)
        else:
            path = cache / f"sft-stdlib-{corpus.corpus_fingerprint()}.jsonl"

            def build() -> None:
                lines = (json.dumps(r) for r in corpus.stdlib_sft_records())
                atomic_write_bytes(path, ("\n".join(lines) + "\n").encode())

            _built_once(path, build, _is_local_leader())
            records = [json.loads(line) for line in path.read_text().splitlines() if line]
        return SFTDataset(records, tok, seq_len)
    source = (
        corpus.files_fingerprint(corpus.user_files(cfg.data.path))
        if cfg.data.path
        else f"stdlib-{corpus.corpus_fingerprint()}"
    )
    path = cache / f"tokens-{tok.fingerprint}-{source}.npy"
    _built_once(
        path,
        lambda: build_token_cache(path, corpus.pretrain_documents(cfg.data.path), tok),
        _is_local_leader(),
    )
    return PackedDataset(path, seq_len)


def _collate(items: list[tuple[np.ndarray, np.ndarray]]) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = torch.from_numpy(np.stack([x for x, _ in items]))
    labels = torch.from_numpy(np.stack([y for _, y in items]))
    return inputs, labels


def build_dataloader(
    cfg: JobConfig, dataset, dp_rank: int, dp_size: int, pin_memory: bool, faults: Faults | None = None
) -> StatefulDataLoader:
    """This rank's loader. `faults` (default: from cfg.debug) says whose share of each global
    batch it reads and the seed of the data order: its own and training.seed, unless a fault
    is injected."""
    faults = faults or Faults(cfg.debug, cfg.training.seed, dp_rank, dp_size)
    sampler = GlobalBatchSampler(
        len(dataset),
        cfg.training.global_batch_size,
        cfg.training.local_batch_size,
        faults.data_rank,
        dp_size,
        faults.seed,
    )
    return StatefulDataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=cfg.data.num_workers,
        collate_fn=_collate,
        pin_memory=pin_memory,
        # Its own generator: creating an iterator draws a seed, which must not move the global
        # (dropout) RNG stream, or a resumed run would not repeat the uninterrupted one.
        generator=torch.Generator().manual_seed(cfg.training.seed),
    )
