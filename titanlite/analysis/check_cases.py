"""What scripts/check_model.py runs, planned without a rank: the cases at each world size (every
mode at accumulation 1 and 2, packed documents where the model takes them, each extra mesh axis
it declares), the config each runs at, and what those configs fix whatever the overrides say
(`FIXES`, titanlite.analysis.settings). titanlite.analysis.model_check runs them under torchrun."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path

from titanlite.analysis.settings import Fixes
from titanlite.config import JobConfig, parse_args
from titanlite.models.registry import MetaModel, build_meta_model

GLOBAL_BATCH, SEQ, VOCAB = 16, 16, 64
LOSS_CHUNK = 5  # positions per chunk: 16 a sequence makes 4 chunks, the last one short
MODES = ("fsdp", "ddp", "hsdp")


@dataclass(frozen=True)
class Case:
    mode: str
    accum: int
    packed: bool
    loss_chunk: int  # 0: logits, then the loss
    axis: str = ""  # an extra mesh axis the model declares, split 2 ways ("": none)


def cases(cfg: JobConfig, world: int, meta: MetaModel | None = None) -> list[Case]:
    """Every mode at accumulation 1 and 2 on the unequal batch; packed (the loss in chunks) where
    the model takes them; each extra mesh axis the model declares, split 2 ways (`meta`: the
    model of `cfg`, built already)."""
    meta = meta or build_meta_model(cfg, 0)
    takes = inspect.signature(meta.model.forward).parameters
    packs, chunks = "positions" in takes, {"labels", "loss_chunk"} <= takes.keys()
    out = [Case(m, a, False, 0) for m in MODES for a in (1, 2) if GLOBAL_BATCH % (world * a) == 0]
    if packs:
        out += [Case(m, 2, True, LOSS_CHUNK if chunks else 0) for m in MODES]
    elif chunks:
        out += [Case(m, 2, False, LOSS_CHUNK) for m in MODES]
    for axis in meta.spec.axes if world % 2 == 0 else ():
        out += [Case(m, 2, False, 0, axis) for m in MODES]
        out += [Case(m, 2, True, LOSS_CHUNK if chunks else 0, axis) for m in MODES if packs]
    return out


# What the cases fix, whatever the overrides say (scripts/check_model.py refuses an override of
# one in one line, titanlite.analysis.settings): the tiny batch, each case's layout, one fp32 CPU
# process per rank, the token-mean loss that one process's reference computes.
_PER_CASE = "each case's"
FIXES = Fixes(
    "check_model",
    {
        "model.vocab_size": f"{VOCAB}",
        "training.seq_len": f"{SEQ}",
        "training.global_batch_size": f"{GLOBAL_BATCH}",
        "training.local_batch_size": f"{_PER_CASE}: the batch split over its ranks and microbatches",
        "training.compile": "false",
        "training.device": "cpu",
        "training.mixed_precision_param": "float32",
        "parallelism.mode": "each of " + ", ".join(MODES),
        "parallelism.dp_replicate": _PER_CASE,
        "parallelism.dp_shard": _PER_CASE,
        "parallelism.axes": "none, then each extra axis the model declares split 2 ways",
        "data.packing": "false, then true where the model takes positions",
        "loss.normalization": "global, as one process's reference",
        "model.hf_assets_path": "the --hf folder where it compares with transformers",
    },
    always={
        "data": f"a synthetic batch of {GLOBAL_BATCH} sequences of {SEQ} tokens",
        "loss.chunk_logits_mib": f"{_PER_CASE}: the logits whole, or in chunks of {LOSS_CHUNK} positions",
        "training.steps": "one forward and backward per case",
        "training.max_norm": "the gradient is compared before any clipping",
        **{
            s: "one forward and backward per case: no optimizer step"
            for s in ("optimizer", "lr_scheduler", "spike_guard")
        },
        "checkpoint": "the initial weights drawn from training.seed; nothing read or written",
        "eval": "no evaluation",
        **{
            s: "no training run"
            for s in ("job", "metrics", "diagnostics", "alerts", "faults", "rehearsal", "debug")
        },
        "comm": "the ranks' process group at its defaults",
        **{
            k: f"no tokenizer: {VOCAB} token ids"
            for k in ("model.tokenizer_path", "model.builtin_vocab_size")
        },
    },
    where="in its cases",
)


def check_config(argv: list[str]) -> JobConfig:
    """The model's config from `--section.key VALUE` flags, at the check's tiny batch."""
    cfg, _ = parse_args(argv)
    cfg.model.vocab_size, cfg.training.seq_len = VOCAB, SEQ
    cfg.training.global_batch_size = GLOBAL_BATCH
    cfg.training.compile = False
    cfg.training.device, cfg.training.mixed_precision_param = "cpu", "float32"
    cfg.loss.normalization = "global"
    return cfg


def case_config(argv: list[str], case: Case, world: int) -> JobConfig:
    """The config one case runs at `world` ranks: the check's, at the case's layout."""
    cfg = check_config(argv)
    dp = world // (2 if case.axis else 1)
    cfg.parallelism.mode = case.mode
    cfg.parallelism.dp_replicate = {"fsdp": 1, "ddp": dp, "hsdp": 2 if dp >= 2 else 1}[case.mode]
    cfg.parallelism.dp_shard = -1
    cfg.parallelism.axes = [f"{case.axis}=2"] if case.axis else []
    cfg.training.local_batch_size = GLOBAL_BATCH // (dp * case.accum)
    cfg.data.packing = case.packed
    return cfg


def hf_config(argv: list[str], folder: Path) -> JobConfig:
    """The config --hf reads the folder's model at (its own vocabulary)."""
    cfg = check_config(argv)
    cfg.model.hf_assets_path, cfg.model.vocab_size = str(folder), 0
    return cfg


def plan(
    argv: list[str], worlds: list[int], hf: Path | None = None, meta: MetaModel | None = None
) -> list[JobConfig]:
    """Every config the check runs, without starting a rank: the references, each case at each
    world size, and --hf's model (`meta`: check_config's model, built already)."""
    cfg = check_config(argv)
    meta = meta or build_meta_model(cfg, 0)
    runs = [cfg, *(case_config(argv, c, w) for w in worlds for c in cases(cfg, w, meta))]
    return runs + ([hf_config(argv, hf)] if hf is not None else [])
