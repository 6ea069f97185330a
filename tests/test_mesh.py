"""The mesh's groups, derived from the axes' kinds (titanlite.config.layout.AXIS_KINDS): every
rank of a world built in turn on torch's fake process group, in one process, and the ranks of
each group it would reduce over compared with the ones written out by hand."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from titanlite.config import JobConfig
from titanlite.config.layout import AXIS_KINDS, Layout, resolve_layout
from titanlite.diagnostics.replicas import replica_groups
from titanlite.distributed.groups import fake_store, init_distributed
from titanlite.distributed.parallel_dims import ParallelDims
from titanlite.errors import UserError


def _layout(world: int, axes: list[str], replicate: int = 1, mode: str = "auto") -> Layout:
    cfg = JobConfig()
    cfg.parallelism.axes, cfg.parallelism.dp_replicate, cfg.parallelism.mode = axes, replicate, mode
    cfg.training.global_batch_size, cfg.training.local_batch_size = 16, 1
    cfg.training.seq_len = 8
    return resolve_layout(cfg, world)


def _ranks(group) -> list[int]:
    return sorted(dist.get_process_group_ranks(group))


def _groups(layout: Layout, rank: int) -> dict:
    """What rank `rank` of `layout.world` derives, on the fake process group."""
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=layout.world)
    try:
        dims = ParallelDims.build(layout, torch.device("cpu"), "float32", "float32")
        shard = dims.shard_mesh
        return {
            "dp_rank": dims.dp_rank,
            "seq_rank": dims.seq_rank,
            "token_ranks": dims.token_ranks,
            "normaliser": _ranks(dims.dp_group),
            "fsdp": [_ranks(shard.get_group(d)) for d in range(shard.ndim)],
            "ddp": _ranks(dims.replicate_group),
            "tp": _ranks(dims.axis_group("tp")) if "tp" in dict(layout.axes) else None,
            "replicas": replica_groups(dims),
        }
    finally:
        dist.destroy_process_group()


# Each case: the layout, then per rank what it must derive. Ranks are numbered in mesh order
# (dp_replicate, dp_shard, cp, tp), tp innermost.
def _fsdp_cp_tp(r: int) -> dict:  # 8 ranks: dp_shard 2 x cp 2 x tp 2, rank = s*4 + c*2 + t
    s, c, t = r // 4, r // 2 % 2, r % 2
    tokens = [t, 2 + t, 4 + t, 6 + t]  # every rank at this tp place
    return {
        "dp_rank": s,
        "seq_rank": c,
        "token_ranks": 4,
        "normaliser": tokens,
        "fsdp": [tokens],  # dp_shard x cp flattened
        "ddp": [s * 4 + t, s * 4 + 2 + t],  # dp_replicate x cp
        "tp": [r - t, r - t + 1],
        "replicas": [[i] for i in range(8)],
    }


def _hsdp_tp(r: int) -> dict:  # 8 ranks: dp_replicate 2 x dp_shard 2 x tp 2, rank = p*4 + s*2 + t
    p, s, t = r // 4, r // 2 % 2, r % 2
    return {
        "dp_rank": p * 2 + s,
        "seq_rank": 0,
        "token_ranks": 4,
        "normaliser": [t, 2 + t, 4 + t, 6 + t],
        "fsdp": [[s * 2 + t, 4 + s * 2 + t], [p * 4 + t, p * 4 + 2 + t]],  # replicate, shard
        "ddp": [s * 2 + t, 4 + s * 2 + t],
        "tp": [r - t, r - t + 1],
        "replicas": [[0, 4], [1, 5], [2, 6], [3, 7]],
    }


def _ddp_tp(r: int) -> dict:  # 4 ranks: dp_replicate 2 x tp 2, rank = p*2 + t
    p, t = r // 2, r % 2
    return {
        "dp_rank": p,
        "seq_rank": 0,
        "token_ranks": 2,
        "normaliser": [t, 2 + t],
        "fsdp": [[t, 2 + t], [r]],
        "ddp": [t, 2 + t],
        "tp": [r - t, r - t + 1],
        "replicas": [[0, 2], [1, 3]],
    }


def _fsdp_cp(
    r: int,
) -> dict:  # 4 ranks: dp_shard 2 x cp 2, rank = s*2 + c: every rank's tokens differ
    return {
        "dp_rank": r // 2,
        "seq_rank": r % 2,
        "token_ranks": 4,
        "normaliser": [0, 1, 2, 3],
        "fsdp": [[0, 1, 2, 3]],
        "ddp": [r - r % 2, r - r % 2 + 1],
        "tp": None,
        "replicas": [[0], [1], [2], [3]],
    }


CASES = {
    "fsdp dp_shard 2 x cp 2 x tp 2": (lambda: _layout(8, ["tp=2", "cp=2"]), _fsdp_cp_tp),
    "hsdp 2 x 2 x tp 2": (lambda: _layout(8, ["tp=2"], replicate=2), _hsdp_tp),
    "ddp 2 x tp 2": (lambda: _layout(4, ["tp=2"], replicate=2, mode="ddp"), _ddp_tp),
    "fsdp dp_shard 2 x cp 2": (lambda: _layout(4, ["cp=2"]), _fsdp_cp),
}


@pytest.mark.parametrize("case", CASES)
def test_every_group_follows_from_the_axes_kinds(case):
    make, expected = CASES[case]
    layout = make()
    for rank in range(layout.world):
        assert _groups(layout, rank) == expected(rank), f"{case}, rank {rank}"


def test_the_plan_counts_each_kind_once_in_mesh_order():
    lay = _layout(16, ["tp=2", "cp=2"], replicate=2)
    assert lay.axes == (("cp", 2), ("tp", 2))  # the table's order, whatever the config's
    got = (lay.dp, lay.seq_split, lay.model_split, lay.token_ranks, lay.shard_ranks)
    assert got == (4, 2, 2, 8, 4)
    assert (lay.replica_ranks, lay.world) == (4, 16)
    # a rank's share of the tokens computed: its replica's sequences over the 4 ranks reading them
    assert lay.tokens_per_rank_step == 8 * 1 * lay.grad_accum / 4
    assert list(AXIS_KINDS) == ["cp", "tp"]


@pytest.mark.parametrize("name", ["x", "pp", "ep", "sp"])
def test_an_axis_of_no_known_kind_is_refused_naming_the_kinds(name):
    with pytest.raises(UserError, match=f"names '{name}', which is no mesh axis") as e:
        _layout(4, [f"{name}=2"])
    assert "cp (sequence positions), tp (tensors)" in str(e.value) and "\n" not in str(e.value)


def test_the_trainers_one_rank_world_keeps_the_world_group():
    init_distributed(torch.device("cpu"))
    try:
        dims = ParallelDims.build(_layout(1, []), torch.device("cpu"), "float32", "float32")
        assert dims.dp_group is dist.group.WORLD and dims.token_ranks == 1
    finally:
        dist.destroy_process_group()
