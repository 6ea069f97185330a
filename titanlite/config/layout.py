"""The run's plan: every quantity derived from a config at a world size (mesh, accumulation,
tokens per step, batch unit, diagnostics method, loss chunk), computed once, torch-free so the
preflight can use it. Also what a rehearsal (titanlite.rehearsal: rank 0 of `world` on a fake
process group, values meaningless) changes: it keeps what costs memory, compute or traffic and
drops what would read or keep the values (checkpoints, evals, exports, metrics files, skips)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from titanlite.config.fields import value_of, whole_number
from titanlite.config.job_config import JobConfig
from titanlite.errors import UserError


@dataclass(frozen=True)
class AxisKind:
    """What the ranks along one mesh axis split. Every component reads its groups, counts and
    prices from these two facts through Layout and ParallelDims, never from an axis's name."""

    splits: str  # what the axis divides among its ranks, as messages and reports say it
    # its ranks hold different tokens of the same sequences: they join the normaliser's group and
    # the data-parallel gradient sum, and one diagnostics replica spans them
    distinct_tokens: bool
    # each rank takes one equal piece of every sequence's positions (ParallelDims.piece)
    splits_positions: bool


# The axes a model may declare beyond dp_replicate x dp_shard, in mesh order (outer first).
# Tensor parallelism is innermost so that its ranks, which exchange activations in every block,
# are neighbours in torchrun's rank order (one node's GPUs). A pipeline axis (whole layers per
# rank, the same tokens) and an expert axis (experts per rank) are further rows of this table.
AXIS_KINDS: dict[str, AxisKind] = {
    "cp": AxisKind("sequence positions", distinct_tokens=True, splits_positions=True),
    "tp": AxisKind("tensors", distinct_tokens=False, splits_positions=False),
}


@dataclass(frozen=True)
class Layout:
    dp_replicate: int  # outer mesh dim: replicas
    dp_shard: int  # inner mesh dim: FSDP shards per replica
    mode: str  # fsdp | ddp | hsdp
    grad_accum: int  # microbatches per rank per optimizer step
    skip_grad_sync: bool  # no gradient reduction on non-final microbatches
    global_batch: int  # sequences per optimizer step over all ranks
    local_batch: int  # sequences per microbatch on one rank
    seq_len: int  # positions per sequence
    diagnostics_method: str  # diagnostics.method with 'auto' resolved (see resolve_layout)
    # The mesh axes after the data-parallel ones, (name, degree) in AXIS_KINDS' order: the ranks
    # along them read the same sequences, and each axis's kind says what they split.
    axes: tuple[tuple[str, int], ...] = ()

    def _degree(self, distinct_tokens: bool) -> int:
        return math.prod(
            d for n, d in self.axes if AXIS_KINDS[n].distinct_tokens == distinct_tokens
        )

    @property
    def dp(self) -> int:
        """Data-parallel ranks: ranks that read distinct sequences."""
        return self.dp_replicate * self.dp_shard

    @property
    def seq_split(self) -> int:
        """Ranks that split one sequence's positions between them (ParallelDims.piece)."""
        return math.prod(d for n, d in self.axes if AXIS_KINDS[n].splits_positions)

    @property
    def model_split(self) -> int:
        """Ranks that hold the same tokens and split the model between them (tensor parallelism)."""
        return self._degree(distinct_tokens=False)

    @property
    def token_ranks(self) -> int:
        """Ranks that hold distinct tokens: the normaliser's group, and the data-parallel
        gradient sum of a parameter the model does not split."""
        return self.dp * self._degree(distinct_tokens=True)

    @property
    def shard_ranks(self) -> int:
        """Ranks FSDP shards a parameter over (ParallelDims.shard_mesh without dp_replicate):
        dp_shard and the axes whose ranks hold distinct tokens."""
        return self.dp_shard * self._degree(distinct_tokens=True)

    @property
    def replica_ranks(self) -> int:
        """Ranks that read one data-parallel rank's sequences (a diagnostics replica)."""
        return math.prod(d for _, d in self.axes)

    @property
    def world(self) -> int:
        """Every rank of the job."""
        return self.dp * self.replica_ranks

    @property
    def tokens_per_rank_step(self) -> float:
        """One rank's share of the tokens computed per optimizer step: its replica's (seq_len x
        local batch x accumulation) over the ranks that split them (a piece of each sequence,
        or a slice of each tensor), so that per-rank throughput and TFLOP/s are what a rank does."""
        return self.seq_len * self.local_batch * self.grad_accum / self.replica_ranks

    @property
    def rank_share(self) -> int:
        """Sequences each data-parallel rank scores per step: local batch x accumulation."""
        return self.local_batch * self.grad_accum

    @property
    def batch_unit(self) -> int:
        """Sequences the global batch moves by with the layout kept (batch-size advice's step)."""
        return self.dp * self.local_batch


def mesh_text(
    mode: str, dp_replicate: int, dp_shard: int, axes: dict[str, int] | None = None
) -> str:
    """A layout's mesh as every report writes it: "fsdp 1x4", "hsdp 2x2xcp=2"."""
    extra = "".join(f"x{name}={degree}" for name, degree in (axes or {}).items())
    return f"{mode} {dp_replicate}x{dp_shard}{extra}"


def axes_text() -> str:
    """The axes a config may name, as refusals list them: "cp (sequence positions), tp (tensors)"."""
    return ", ".join(f"{name} ({kind.splits})" for name, kind in AXIS_KINDS.items())


def extra_axes(entries: list[str]) -> tuple[tuple[str, int], ...]:
    """parallelism.axes ("name=degree" each) as (name, degree) pairs in mesh order (AXIS_KINDS');
    one UserError if malformed or naming an axis titanlite does not know."""
    out: dict[str, int] = {}
    for entry in entries:
        name, _, degree = str(entry).partition("=")
        name = name.strip()
        if not name.isidentifier() or not whole_number(degree.strip()) or int(degree) < 1:
            raise UserError(
                f'parallelism.axes entry {entry!r} is not name=degree (e.g. "cp=2": a name and a degree >= 1)'
            )
        if name in ("dp_replicate", "dp_shard") or name in out:
            raise UserError(
                f"parallelism.axes names '{name}' twice or as a data-parallel axis; name each axis once"
            )
        if name not in AXIS_KINDS:
            raise UserError(
                f"parallelism.axes names '{name}', which is no mesh axis titanlite knows; "
                f"use {axes_text()}"
            )
        out[name] = int(degree)
    return tuple((name, out[name]) for name in AXIS_KINDS if name in out)


def resolve_layout(cfg: JobConfig, world_size: int) -> Layout:
    p, t = cfg.parallelism, cfg.training
    axes = extra_axes(p.axes)
    split = math.prod(d for _, d in axes)
    named = " x ".join(f"{n}={d}" for n, d in axes)
    if world_size % split:
        raise UserError(
            f"parallelism.axes {named} take {split} ranks per data-parallel rank, which does not divide "
            f"the {world_size} ranks; launch a multiple of {split} (NPROC)"
        )
    world_size //= split  # the data-parallel ranks
    extra = f" (after the {split} of {named} per data-parallel rank)" if split > 1 else ""
    if p.dp_shard == -1:
        if world_size % p.dp_replicate:
            raise UserError(
                f"parallelism.dp_replicate={p.dp_replicate} does not divide the {world_size} "
                f"ranks{extra}; pick a divisor of the world size"
            )
        shard = world_size // p.dp_replicate
    elif p.dp_shard < 1:
        raise UserError(f"parallelism.dp_shard is {p.dp_shard}; use -1 or a positive degree")
    else:
        shard = p.dp_shard
    if p.dp_replicate * shard != world_size:
        raise UserError(
            f"dp_replicate x dp_shard = {p.dp_replicate} x {shard} != {world_size} ranks{extra}; "
            "set --parallelism.dp_shard -1 or launch that many ranks (NPROC)"
        )
    mode = p.mode
    if mode == "auto":
        mode = ("hsdp" if shard > 1 else "ddp") if p.dp_replicate > 1 else "fsdp"
    if mode == "fsdp" and p.dp_replicate != 1:
        raise UserError(
            "parallelism.mode 'fsdp' needs dp_replicate 1; use mode 'hsdp' for replicas"
        )
    if mode == "ddp" and shard != 1:
        raise UserError("parallelism.mode 'ddp' needs dp_shard 1 (or -1 with dp_replicate = ranks)")
    if mode == "ddp" and p.skip_grad_sync == "off":
        # DDP all-reduces the *accumulated* .grad: under SUM, the already-reduced earlier
        # microbatches would be summed again and count dp times (averaging hides this).
        raise UserError(
            "parallelism.skip_grad_sync 'off' cannot be exact with ddp (it re-reduces the "
            "accumulated gradient); use 'auto' or 'on', or mode fsdp/hsdp"
        )
    if mode == "ddp" and p.reshard_after_forward != "auto":
        raise UserError(
            f"parallelism.reshard_after_forward '{p.reshard_after_forward}' is for fsdp/hsdp, which shard "
            "parameters; ddp holds them whole: leave it 'auto', or use mode fsdp/hsdp"
        )
    dp = p.dp_replicate * shard
    per_micro = t.local_batch_size * dp
    if t.global_batch_size % per_micro:
        raise UserError(
            f"training.global_batch_size={t.global_batch_size} is not a multiple of "
            f"local_batch_size x dp = {t.local_batch_size} x {dp} = {per_micro}; "
            "change one of them so it divides"
        )
    accum = t.global_batch_size // per_micro
    skip = {"on": True, "off": False}.get(p.skip_grad_sync, mode == "ddp")
    method = cfg.diagnostics.method
    # exact replaces the gradient's reduction; it cannot under hsdp (the reduce-scatter spans one
    # replica) nor under ddp with a tensor split (torch's replicate all-reduces inside FSDP)
    tensor_split = math.prod(d for n, d in axes if not AXIS_KINDS[n].distinct_tokens) > 1
    no_exact = {"hsdp": "under hsdp the reduce-scatter spans one replica"}
    if tensor_split:
        no_exact["ddp"] = "under ddp a tensor split's replicate all-reduces inside FSDP"
    if method == "auto":
        # exact needs each rank's whole-step local gradient at once (free under ddp, one
        # microbatch, or skip_grad_sync); not past dp = sketch_dim / 4, where the dp x dp Gram
        # outweighs gathering sketches
        small = mode not in no_exact and 4 * dp <= cfg.diagnostics.sketch_dim
        method = "exact" if small and (accum == 1 or skip) else "sketch"
    if cfg.diagnostics.enable and method == "exact" and mode in no_exact:
        raise UserError(
            f"diagnostics.method 'exact' needs fsdp or ddp{' without a tensor split' * tensor_split} "
            f"({no_exact[mode]}); use diagnostics.method = 'sketch' or 'auto'"
        )
    batch = (t.global_batch_size, t.local_batch_size, t.seq_len)
    layout = Layout(p.dp_replicate, shard, mode, accum, skip, *batch, method, axes)
    if t.seq_len % layout.model_split:
        raise UserError(
            f"training.seq_len {t.seq_len} does not split into {layout.model_split} equal pieces, "
            f"which a tensor split's sequence parallelism gives its ranks between blocks "
            f"(parallelism.axes); pick a multiple of {layout.model_split}"
        )
    if t.seq_len % layout.seq_split:
        raise UserError(
            f"training.seq_len {t.seq_len} does not split into {layout.seq_split} equal pieces "
            f"(parallelism.axes); pick a multiple of {layout.seq_split}"
        )
    return layout


def holds_unsharded_grads(layout: Layout) -> bool:
    """Whether FSDP/HSDP keeps unsharded gradients across microbatches (DDP holds them anyway)."""
    return layout.mode != "ddp" and layout.grad_accum > 1 and layout.skip_grad_sync


def loss_chunk(budget_mib: float, local_batch: int, seq_len: int, vocab: int) -> int:
    """Sequence positions per loss chunk so that one chunk's fp32 logits fit in `budget_mib`; 0
    (no chunks) when the whole sequence fits, or when the budget is 0."""
    if budget_mib <= 0:
        return 0
    chunk = max(1, int(budget_mib * 2**20 // (local_batch * vocab * 4)))
    return 0 if chunk >= seq_len else chunk


def loss_chunks(cfg: JobConfig, vocab: int) -> tuple[int, int]:
    """(training's, eval's) loss chunk at vocabulary `vocab`, known once the model is built."""
    t, budget = cfg.training, cfg.loss.chunk_logits_mib
    eval_batch = cfg.eval.local_batch_size or t.local_batch_size
    train = loss_chunk(budget, t.local_batch_size, t.seq_len, vocab)
    return train, loss_chunk(budget, eval_batch, t.seq_len, vocab)


def rank_share(cfg: JobConfig, dp: int) -> int:
    """Sequences each of `dp` data-parallel ranks scores per step: the global batch split evenly."""
    gb, dp = cfg.training.global_batch_size, max(dp, 1)
    if gb % dp:
        raise UserError(
            f"global batch {gb} does not split over dp={dp}; pick a global_batch_size divisible by {dp}"
        )
    return gb // dp


def fitting_local_batch(cfg: JobConfig, dp: int) -> int:
    """The largest local batch <= the config's that splits a rank's share (the global batch kept at
    any dp)."""
    share = rank_share(cfg, dp)
    return max(b for b in range(1, min(cfg.training.local_batch_size, share) + 1) if share % b == 0)


def rehearsal_batch(global_batch: int, local_batch: int, world: int) -> int:
    """The global batch at `world` ranks: the config's if world x local divides it, else that."""
    return global_batch if global_batch % (world * local_batch) == 0 else world * local_batch


def apply_rehearsal(cfg: JobConfig) -> str | None:
    """Set what a rehearsal changes; the one line that says so (None when it changes nothing)."""
    t, world = cfg.training, cfg.rehearsal.world
    if world <= 0:  # 0: a training run; below: the bounds check refuses it
        return None
    changes = {
        "training.global_batch_size": rehearsal_batch(
            t.global_batch_size, t.local_batch_size, world
        ),
        "training.steps": cfg.rehearsal.steps,
        "checkpoint.every": 0,
        "checkpoint.at_end": False,
        "checkpoint.export_weights": False,
        "checkpoint.export_hf": False,
        "checkpoint.initial_load_path": "",
        "eval.every": 0,
        "eval.at_end": False,
        "eval.at_start": False,
        "metrics.enable_tensorboard": False,
        "metrics.enable_wandb": False,
        "spike_guard.skip": "off",
        # the first step measured too, so that a measured step's first gradient accumulation
        # (exact skips a microbatch's sync) runs before the watched steps: DTensor's sharding
        # propagation of it fails inside the memory tracker unless cached outside
        "diagnostics.measure_first": 1,
        "diagnostics.every": 2,  # then every other step from the second: the report has both kinds
        "diagnostics.on_alert": "warn",
    }
    changes = {k: v for k, v in changes.items() if value_of(cfg, k) != v}
    if not changes:
        return None
    batch = changes.get("training.global_batch_size", t.global_batch_size)
    accum = batch // (world * t.local_batch_size)
    why = ""
    if batch != t.global_batch_size:
        why = f"; the config's {t.global_batch_size} does not split over {world}"
    for key, value in changes.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    return (
        f"rehearsal: rank 0 of {world} on a fake process group, {cfg.rehearsal.steps} steps; global batch "
        f"{batch} ({world} ranks x local {t.local_batch_size} x accumulation {accum}{why}); no checkpoint, "
        "eval, export, initial load or metrics file; initial weights drawn for this rank's shard "
        "alone; alerts muted; every update applied"
    )
