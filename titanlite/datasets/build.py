"""Build this rank's data loader: tokenizer, dataset (cached), sampler, StatefulDataLoader; and
trace a step's sequences from the config alone (trace_step)."""

from __future__ import annotations

import functools
import json
import os
import time
import warnings
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torchdata.stateful_dataloader import StatefulDataLoader

from titanlite.config import JobConfig
from titanlite.config.layout import Layout
from titanlite.datasets import corpus
from titanlite.datasets.batch import collate
from titanlite.datasets.prepare import META, data_key, prepare
from titanlite.datasets.prepared import Prepared, is_prepared
from titanlite.datasets.sampler import GlobalBatchSampler
from titanlite.datasets.sequences import (
    HeldOut,
    MixtureDataset,
    PackedDataset,
    PackedSFTDataset,
    SFTDataset,
    Subset,
    SyntheticDataset,
    spaced,
)
from titanlite.datasets.spec import parse_data_path
from titanlite.datasets.tokenizer import (
    HFTokenizer,
    Tokenizer,
    builtin_tokenizer_path,
    load_tokenizer,
    train_builtin_tokenizer,
)
from titanlite.datasets.workers import leave_stops_to_parent
from titanlite.distributed.groups import host_group
from titanlite.distributed.utils import first_error
from titanlite.errors import UserError
from titanlite.tools.cache import atomic_write_bytes, cache_dir, disk_full
from titanlite.tools.process import init_logging

logger = init_logging()


BUILD_WAIT = timedelta(hours=2)  # the longest a cache build (tokenizer, data up to 2 GiB) may take


def _built_once(path: Path, build, what: str) -> None:
    """One rank per node (local rank 0) builds a missing cache file while the others wait; a
    bad-input error met by the builder is raised on every rank alike."""
    error = None
    if int(os.environ.get("LOCAL_RANK", "0")) == 0 and not path.exists():
        began = time.perf_counter()
        logger.info(f"{what} (once, into {path.parent}) ...")
        try:
            build()
            logger.info(f"{what}: done in {time.perf_counter() - began:.1f}s")
        except UserError as e:
            error = str(e)
        except OSError as e:
            full = disk_full(e, path.parent)
            if full is None:
                raise
            error = f"building {path.name}: {full}; free space or move the cache (data.cache_dir, TITANLITE_CACHE)"
    # The others wait for work here, not for a peer: on a group whose timeout is not
    # comm.timeout_s, which a user may set to seconds to catch hung ranks fast.
    waiting = host_group(BUILD_WAIT) if dist.is_initialized() else None
    error = first_error(error, waiting)
    if error:
        raise UserError(error)


def build_tokenizer(cfg: JobConfig, train: bool = True) -> Tokenizer | HFTokenizer | None:
    """model.tokenizer_path, else model.hf_assets_path's, else the built-in one; None for synthetic
    data, and (`train` False) for a built-in tokenizer not trained yet on this machine."""
    if cfg.data.mode == "synthetic":
        return None
    if cfg.model.tokenizer_path or cfg.model.hf_assets_path:
        return load_tokenizer(cfg.model.tokenizer_path or cfg.model.hf_assets_path)
    vocab = cfg.model.builtin_vocab_size
    path = builtin_tokenizer_path(cache_dir(cfg.data.cache_dir), vocab)
    if train:
        what = f"training the built-in tokenizer ({vocab:,} tokens)"
        _built_once(path, lambda: train_builtin_tokenizer(path, vocab), what)
    elif not path.is_file():
        return None
    return Tokenizer(path.read_bytes(), f"builtin:{path.name}")


def _prepared_on_the_fly(cfg: JobConfig, tok: Tokenizer | HFTokenizer, name: str) -> Path:
    """Raw inputs (or the built-in data for name "") prepared into the cache, once per node."""
    cache, mode = cache_dir(cfg.data.cache_dir), cfg.data.mode
    if name:
        files = corpus.discover(name, logger.warning)
    elif mode == "sft":
        jsonl = cache / f"sft-stdlib-{corpus.corpus_fingerprint()}.jsonl"

        def build() -> None:
            lines = (json.dumps(r) for r in corpus.stdlib_sft_records())
            atomic_write_bytes(jsonl, ("\n".join(lines) + "\n").encode())

        _built_once(jsonl, build, "writing the built-in SFT set from the standard library")
        files = [jsonl]
    else:
        files = list(corpus.stdlib_files())
    out = cache / f"prepared-{mode}-{data_key(files, tok, mode, cfg.data.text_field)}"
    size = sum(f.stat().st_size for f in files)
    workers = min(os.cpu_count() or 1, 8) if size > 256 << 20 else 1
    what = f"preparing {len(files):,} file(s) of {size / 2**20:,.1f} MB into token shards"
    _built_once(
        out / META,
        lambda: prepare(files, out, tok, mode, cfg.data.text_field, workers, say=logger.info),
        what,
    )
    return out


def _open_prepared(cfg: JobConfig, tok: Tokenizer | HFTokenizer, name: str) -> Prepared:
    """One dataset of a data path, prepared (on the fly for raw inputs) and checked."""
    folder = Path(name).expanduser() if name else None
    if folder is None or not is_prepared(folder):
        folder = _prepared_on_the_fly(cfg, tok, name)
    data = Prepared(folder)
    data.check_mode(cfg.data.mode)
    data.check_tokenizer(tok)
    return data


def _sequences(cfg: JobConfig, data: Prepared, tok: Tokenizer | HFTokenizer, part: str | None):
    """The sequences of one prepared dataset: all of them (part None), or the "train" or "eval"
    part of eval.fraction's split (SFT records are split before they are packed)."""
    seq_len, d = cfg.training.seq_len, cfg.data
    if d.mode == "sft":
        dataset = SFTDataset(data, seq_len, tok.pad_id)
        note = dataset.check_targets()
        if note and part != "eval" and int(os.environ.get("RANK", "0")) == 0:
            logger.warning(note)
    else:
        dataset = PackedDataset(data, seq_len, d.document_mask)
    held = HeldOut(len(dataset), cfg.eval.fraction, cfg.training.seed) if part else None
    if d.packing:
        records = held.indices(part, np.arange(held.size(part))) if held else None
        return PackedSFTDataset(data, seq_len, tok.pad_id, records)
    if not held:
        return dataset
    return Subset(dataset, held.size(part), functools.partial(held.indices, part))


def build_dataset(cfg: JobConfig, tok: Tokenizer | HFTokenizer | None, vocab_size: int = 0):
    """Every dataset of data.path, prepared (on the fly for raw inputs), less eval.fraction's
    held-out part, as one MixtureDataset; synthetic data draws below `vocab_size`."""
    t = cfg.training
    if cfg.data.mode == "synthetic":
        synthetic = SyntheticDataset(vocab_size or cfg.model.vocab_size, t.seq_len, t.seed)
        return MixtureDataset([synthetic], [1.0])
    parts = parse_data_path(cfg.data.path) or [("", 1.0)]
    part = "train" if cfg.eval.fraction > 0 else None
    prepared = [_open_prepared(cfg, tok, name) for name, _ in parts]
    # what it trains on, by content (spec.data_identity): a resume compares it
    named = zip(prepared, parts, strict=True)
    identity = [{"content": data.content, "weight": w, "path": name} for data, (name, w) in named]
    sequences = [_sequences(cfg, data, tok, part) for data in prepared]
    return MixtureDataset(sequences, [w for _, w in parts], identity)


def build_eval_dataset(
    cfg: JobConfig, tok: Tokenizer | HFTokenizer | None
) -> MixtureDataset | None:
    """The eval set: eval.path's data, else eval.fraction's held-out part of every dataset of
    data.path (None: neither), cut to eval.max_sequences spread evenly over it."""
    e = cfg.eval
    if not e.path and e.fraction <= 0:
        return None
    names = [e.path] if e.path else [n for n, _ in parse_data_path(cfg.data.path) or [("", 1.0)]]
    part = None if e.path else "eval"
    datasets = [_sequences(cfg, _open_prepared(cfg, tok, name), tok, part) for name in names]
    dataset = MixtureDataset(datasets, [1.0] * len(datasets))
    if not len(dataset):
        raise UserError(
            f"eval.fraction = {e.fraction:g} holds out no sequence of this data; raise it, or set eval.path"
        )
    if e.max_sequences and e.max_sequences < len(dataset):
        spread = functools.partial(spaced, len(dataset), e.max_sequences)
        dataset = MixtureDataset([Subset(dataset, e.max_sequences, spread)], [1.0])
    return dataset


def build_dataloader(
    cfg: JobConfig, dataset, layout: Layout, dp_rank: int, pin_memory: bool, seed: int | None = None
) -> StatefulDataLoader:
    """This rank's loader of its share of the plan's (`layout`) global batch. `seed`: of the data
    order (default training.seed; see titanlite.tools.seeds)."""
    seed = cfg.training.seed if seed is None else seed
    repeats = cfg.rehearsal.world > 0
    sampler = GlobalBatchSampler(
        dataset.sizes, layout.global_batch, seed, dataset.weights, layout, dp_rank, repeats
    )
    if dp_rank == 0:
        logger.info(sampler.epochs_line(cfg.training.steps))
    with warnings.catch_warnings():  # torchdata calls torch.set_vital, which torch has deprecated
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        return StatefulDataLoader(
            dataset,
            batch_sampler=sampler,
            num_workers=cfg.data.num_workers,
            collate_fn=collate,
            pin_memory=pin_memory,
            worker_init_fn=leave_stops_to_parent if cfg.data.num_workers else None,
            # Its own generator: creating an iterator draws a seed, which must not move the global
            # (dropout) RNG stream, or a resumed run would not repeat the uninterrupted one.
            generator=torch.Generator().manual_seed(cfg.training.seed),
        )


def trace_step(
    cfg: JobConfig, step: int, dp: int = 1, rank: int | None = None, dataset=None
) -> list[dict]:
    """Each sequence of 1-based step `step`: its position, the rank that reads it at `dp`, its
    index and its sources, from the config alone (scripts/trace_batch.py)."""
    g = cfg.training.global_batch_size
    if step < 1 or g % dp or (rank is not None and not 0 <= rank < dp):
        raise UserError(
            f"--step must be >= 1, --dp divide global_batch_size {g}, and --rank be in [0, dp)"
        )
    dataset = dataset or build_dataset(cfg, build_tokenizer(cfg))
    sampler = GlobalBatchSampler(dataset.sizes, g, cfg.training.seed, dataset.weights)
    out = []
    for j, index in enumerate(sampler.global_batch(step - 1).tolist()):
        entry = {"position": j, "rank": j // (g // dp), "sequence": index}
        if rank is None or entry["rank"] == rank:
            out.append({**entry, "sources": dataset.trace(index)})
    return out
