"""The datasets the sampler indexes: each gives sequence i as (inputs, labels[, positions]) of
seq_len, `trace(i)` (its sources) and, synthetic data aside, `content_slots(i)` (its slots that
hold tokens, not padding). The held-out split (eval.fraction) holds out the same offsets, drawn
once from training.seed, in every block of BLOCK items: O(1) memory, the same on every rank.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

import numpy as np

from titanlite.datasets.prepared import Prepared
from titanlite.datasets.sampler import permute, stream_keys
from titanlite.errors import UserError
from titanlite.ops.cross_entropy import IGNORE_INDEX


def best_fit_decreasing(costs: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Which SFT records share a packed sequence, from their lengths and seq_len only, so every
    rank computes the same packs: items of `costs` (each in 1..capacity), longest first, each into
    the fullest bin of `capacity` it still fits (Johnson et al., "Worst-case performance bounds for
    simple one-dimensional packing algorithms", SIAM J. Comput. 1974: at most 11/9 OPT + 1 bins).
    Returns (members, starts): bin b holds items members[starts[b]:starts[b+1]], longest first."""
    order = np.argsort(-np.asarray(costs), kind="stable")
    open_at: dict[int, list[int]] = {}  # free capacity -> open bins with exactly that much
    free: list[int] = []  # the free capacities some open bin has, sorted (at most `capacity`)
    bins: list[list[int]] = []
    room: list[int] = []
    for item in order.tolist():
        cost = int(costs[item])
        at = bisect.bisect_left(free, cost)  # the fullest bin it fits
        if at == len(free):
            b = len(bins)
            bins.append([])
            room.append(capacity)
        else:
            b = open_at[free[at]].pop()
            if not open_at[free[at]]:
                free.pop(at)
        bins[b].append(item)
        room[b] -= cost
        if room[b] > 0:
            if not open_at.get(room[b]):
                bisect.insort(free, room[b])
            open_at.setdefault(room[b], []).append(b)
    starts = np.cumsum([0, *(len(x) for x in bins)], dtype=np.int64)
    members = np.fromiter((i for x in bins for i in x), dtype=np.int64, count=int(starts[-1]))
    return members, starts


def restart_positions(starts: np.ndarray, length: int) -> np.ndarray:
    """Each of `length` slots' position within its document, given the slots where documents
    start (slot 0 always starts one): the RoPE positions and document boundaries of attention."""
    slots = np.arange(length, dtype=np.int64)
    bounds = np.union1d([0], np.asarray(starts, dtype=np.int64))
    return slots - bounds[np.searchsorted(bounds, slots, side="right") - 1]


class PackedDataset:
    """Pretraining: sequence i is tokens[i*L : i*L + L] with next-token labels and, with
    `document_mask`, its tokens' positions within their documents."""

    def __init__(self, data: Prepared, seq_len: int, document_mask: bool = False) -> None:
        self.data = data
        self.seq_len = seq_len
        self.document_mask = document_mask

    def __len__(self) -> int:
        return max(0, (self.data.num_tokens - 1) // self.seq_len)

    def __getitem__(self, i: int) -> tuple[np.ndarray, ...]:
        start = i * self.seq_len
        window = self.data.tokens(start, start + self.seq_len + 1)
        if not self.document_mask:
            return window[:-1], window[1:]
        starts = self.data.document_starts(start, start + self.seq_len) - start
        return window[:-1], window[1:], restart_positions(starts, self.seq_len)

    def content_slots(self, i: int) -> int:
        return self.seq_len  # windows have no padding

    def trace(self, i: int) -> list[dict]:
        start = i * self.seq_len
        return self.data.trace(start, start + self.seq_len + 1)


def to_example(
    ids: np.ndarray, target: np.ndarray, seq_len: int, pad_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """A record's tokens and target mask -> (inputs, labels) of seq_len, truncated or padded:
    position j's label is token j+1 if it is a target, else IGNORE_INDEX."""
    ids, target = ids[: seq_len + 1], target[: seq_len + 1]
    inputs = np.full(seq_len, pad_id, dtype=np.int64)
    labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int64)
    inputs[: len(ids) - 1] = ids[:-1]
    labels[: len(ids) - 1] = np.where(target[1:], ids[1:], IGNORE_INDEX)
    return inputs, labels


class SFTDataset:
    """Prepared records, padded or truncated to seq_len."""

    def __init__(self, data: Prepared, seq_len: int, pad_id: int) -> None:
        self.data = data
        self.seq_len = seq_len
        self.pad_id = pad_id
        # the input positions each record fills
        self.slots = np.minimum(data.document_lengths(), seq_len + 1) - 1

    def __len__(self) -> int:
        return self.data.num_docs

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        ids, target = self.data.document(i)
        return to_example(ids, target, self.seq_len, self.pad_id)

    def records(self, i: int) -> np.ndarray:
        """The record indices of sequence i, in their order inside it."""
        return np.array([i])

    def trace(self, i: int) -> list[dict]:
        records = self.records(i).tolist()
        return [{**self.data.source(r), "tokens": [0, int(self.slots[r]) + 1]} for r in records]

    def content_slots(self, i: int) -> int:
        return int(self.slots[self.records(i)].sum())

    def check_targets(self) -> str | None:
        """Raise if no record has a target token inside the window (every step would be skipped);
        else a start-up line when some records have none, or None."""
        first = self.data.first_targets()
        # The label of position j is token j+1: a target at token t (1 <= t <= seq_len) is seen.
        seen = (first >= 1) & (first <= self.seq_len)
        missing = int(len(first) - seen.sum())
        if missing == 0:
            return None
        where = f"SFT data '{self.data.folder}'"
        if missing == len(first):
            has = first[first >= 1]
            if not len(has):
                raise UserError(
                    f"{where}: none of its {len(first):,} records has a target token; check the data"
                )
            raise UserError(
                f"{where}: none of its {len(first):,} records has a target token within seq_len="
                f"{self.seq_len} (the prompt alone fills it); seq_len >= {int(has.min())} gives some a "
                f"target, >= {int(has.max())} all of them"
            )
        return (
            f"{where}: {missing:,} of {len(first):,} records ({missing / len(first):.1%}) have no target "
            f"token within seq_len={self.seq_len}; they add no valid tokens"
        )


class PackedSFTDataset(SFTDataset):
    """Records packed into sequences of seq_len (best_fit_decreasing), with positions that
    restart at every record: each record's loss and gradient are those of the record run alone.
    A record longer than the window is truncated; one of a single token (no label) is dropped.
    `records`: the records to pack (a split's part); None: all."""

    def __init__(
        self, data: Prepared, seq_len: int, pad_id: int, records: np.ndarray | None = None
    ) -> None:
        super().__init__(data, seq_len, pad_id)
        kept = np.arange(len(self.slots)) if records is None else np.asarray(records, np.int64)
        kept = kept[self.slots[kept] > 0]
        members, self.starts = best_fit_decreasing(self.slots[kept], seq_len)
        self.members = kept[members]

    def __len__(self) -> int:
        return len(self.starts) - 1

    def records(self, i: int) -> np.ndarray:
        return self.members[self.starts[i] : self.starts[i + 1]]

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        inputs = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        labels = np.full(self.seq_len, IGNORE_INDEX, dtype=np.int64)
        starts, at = [], 0
        for r in self.records(i).tolist():
            n = int(self.slots[r])
            ids, target = self.data.document(r)
            inputs[at : at + n], labels[at : at + n] = to_example(ids, target, n, self.pad_id)
            starts.append(at)
            at += n
        starts.append(at)  # the padding after the last record is a document of its own
        return inputs, labels, restart_positions(np.asarray(starts), self.seq_len)


SYNTHETIC_SIZE = 1 << 40  # the sampler never stores its permutation: the size costs nothing


class SyntheticDataset:
    """Random tokens for benchmarks (`data.mode = "synthetic"`): sequence i is drawn from a
    generator seeded with (seed, i), so it depends on its index alone, like a real dataset's."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int) -> None:
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.seed = seed

    def __len__(self) -> int:
        return SYNTHETIC_SIZE

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng([self.seed, int(i)])
        window = rng.integers(0, self.vocab_size, self.seq_len + 1, dtype=np.int64)
        return window[:-1], window[1:]

    def trace(self, i: int) -> list[dict]:
        tokens = [0, self.seq_len + 1]
        return [{"file": "synthetic", "kind": "synthetic", "row": int(i), "tokens": tokens}]


class _Remapped:
    """A dataset whose item i is item j of another (`_locate`): read, traced and counted there."""

    def _locate(self, i: int) -> tuple[Any, int]:
        raise NotImplementedError

    def __getitem__(self, i: int) -> tuple[np.ndarray, ...]:
        dataset, j = self._locate(i)
        return dataset[j]

    def trace(self, i: int) -> list[dict]:
        dataset, j = self._locate(i)
        return dataset.trace(j)

    def content_slots(self, i: int) -> int:
        dataset, j = self._locate(i)
        return dataset.content_slots(j)


class MixtureDataset(_Remapped):
    """Datasets as one index space, with their weights (the sampler decides how often each is
    read)."""

    def __init__(
        self, parts: list, weights: list[float], identity: list[dict] | None = None
    ) -> None:
        self.parts = parts
        self.weights = weights
        self.identity = identity  # what it trains on, by content (spec.data_identity)
        self.sizes = [len(p) for p in parts]
        self.starts = np.cumsum([0, *self.sizes], dtype=np.int64)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _locate(self, i: int) -> tuple[Any, int]:
        k = int(np.searchsorted(self.starts, i, side="right")) - 1
        return self.parts[k], i - int(self.starts[k])


BLOCK = 10_000  # the held-out split's block of items
_SPLIT_STREAM = 0x73706C  # its key stream, apart from the sampler's


class HeldOut:
    """The split of [0, n) into training and eval indices."""

    def __init__(self, n: int, fraction: float, seed: int) -> None:
        self.n = n
        keys = stream_keys(seed, _SPLIT_STREAM, np.zeros(BLOCK, np.int64))
        held = np.sort(permute(np.arange(BLOCK), BLOCK, keys)[: max(1, round(BLOCK * fraction))])
        self.offsets = {"eval": held, "train": np.setdiff1d(np.arange(BLOCK), held)}

    def size(self, part: str) -> int:
        offsets = self.offsets[part]
        full, rest = divmod(self.n, BLOCK)
        return full * len(offsets) + int(np.searchsorted(offsets, rest))

    def indices(self, part: str, i: np.ndarray | int) -> np.ndarray:
        """The indices into [0, n) of the part's items i ("train" or "eval")."""
        offsets = self.offsets[part]
        block, k = np.divmod(np.asarray(i, dtype=np.int64), len(offsets))
        return block * BLOCK + offsets[k]


class Subset(_Remapped):
    """Items `index(i)` of a dataset, for i in [0, size): a split part, or an eval set's sample."""

    def __init__(self, dataset, size: int, index: Callable[[int], int | np.ndarray]) -> None:
        self.dataset = dataset
        self.size = size
        self.index = index

    def __len__(self) -> int:
        return self.size

    def _locate(self, i: int) -> tuple[Any, int]:
        if not 0 <= i < self.size:
            raise IndexError(i)
        return self.dataset, int(self.index(i))


def spaced(total: int, count: int, i: int) -> int:
    """The i-th of `count` indices spread evenly over [0, total)."""
    return i * total // count
