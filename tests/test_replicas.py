"""The replica check's hash and verdict, in one process (the distributed path: test_diagnostics)."""

from __future__ import annotations

import pytest
import torch

from titanlite.diagnostics import replicas
from titanlite.diagnostics.replicas import ReplicaCheck, as_bits, fingerprint


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_fingerprint_sees_every_bit_and_position_whatever_the_chunking(monkeypatch, dtype):
    t = torch.randn(257, 33, generator=torch.Generator().manual_seed(0)).to(dtype)
    h = int(fingerprint(t))
    assert 0 <= h < 2**52 and h == int(fingerprint(t.clone()))
    bits = 8 * t.element_size()
    for pos, bit in [(0, 0), (4000, 7), (t.numel() - 1, bits - 1)]:
        u = t.clone()
        one = as_bits(u.view(-1)[pos : pos + 1])
        one.bitwise_xor_(torch.ones_like(one) << bit)
        assert int(fingerprint(u)) != h, (pos, bit)
    swapped = t.clone().view(-1)
    swapped[[3, 9]] = swapped[[9, 3]]
    assert swapped[3] != swapped[9] and int(fingerprint(swapped)) != h  # positions count
    monkeypatch.setattr(replicas, "_CHUNK", 1000)  # integer sums: the chunking changes nothing
    assert int(fingerprint(t)) == h


def _check(shards: int, replicas_: int) -> ReplicaCheck:
    check = ReplicaCheck.__new__(ReplicaCheck)
    check.groups = [[r * shards + s for r in range(replicas_)] for s in range(shards)]
    check.names = ["a", "b", "c"]
    check.split = 1
    return check


def test_verdict_names_the_minority_or_every_replica_without_a_majority():
    ok = [1.0, 2.0, 3.0]
    assert _check(1, 3).compare(5, [ok, ok, ok]) is None
    drift = _check(1, 3).compare(5, [ok, [1.0, 2.0, 4.0], ok])
    assert (drift.step, drift.ranks, drift.parameter) == (5, [1], "c")
    # two shards of two replicas (ranks 0, 2 hold shard 0; 1, 3 shard 1): no majority of two
    other = [7.0, 8.0, 9.0]
    drift = _check(2, 2).compare(6, [ok, other, ok, [7.0, 0.0, 9.0]])
    assert (drift.ranks, drift.parameter) == ([1, 3], "b")
    # the same mesh with its 2 shards on a cp axis of 2 (parallelism.axes): the diagnostics name
    # data-parallel replicas, rank // 2
    split = _check(2, 2)
    split.split = 2
    assert split.compare(6, [ok, other, ok, [7.0, 0.0, 9.0]]).ranks == [0, 1]
