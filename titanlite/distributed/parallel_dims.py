"""Device and the data-parallel DeviceMesh (dp_replicate x dp_shard); the process groups:
titanlite.distributed.groups."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titanlite.config.layout import Layout
from titanlite.distributed.groups import init_distributed  # noqa: F401  (a fork may import it from here)
from titanlite.errors import UserError


def resolve_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise UserError("training.device is 'cuda' but no GPU is visible; use 'auto' or 'cpu'")
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


@dataclass
class ParallelDims:
    """The job's mesh: dp_replicate x dp_shard, then the extra axes a model declares
    (layout.axes), each splitting every sequence's positions over its ranks: those ranks share a
    dp_rank (the data's coordinate) and `piece` gives each its positions. Gradients are summed
    over every rank that holds distinct tokens: FSDP's `shard_mesh`, DDP's `replicate_group`."""

    layout: Layout
    device: torch.device
    mesh: DeviceMesh
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype

    @classmethod
    def build(
        cls, layout: Layout, device: torch.device, param_dtype: str, reduce_dtype: str
    ) -> ParallelDims:
        names = ("dp_replicate", "dp_shard", *(n for n, _ in layout.axes))
        shape = (layout.dp_replicate, layout.dp_shard, *(d for _, d in layout.axes))
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
        if param_dtype == "auto":
            param_dtype = "bfloat16" if device.type == "cuda" else "float32"
        return cls(layout, device, mesh, getattr(torch, param_dtype), getattr(torch, reduce_dtype))

    @property
    def mode(self) -> str:
        return self.layout.mode

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel coordinate: which share of the batch it reads."""
        replica = self.mesh.get_local_rank("dp_replicate")
        return replica * self.layout.dp_shard + self.mesh.get_local_rank("dp_shard")

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """The normaliser's group: every rank (each holds distinct tokens)."""
        return dist.group.WORLD

    @property
    def seq_rank(self) -> int:
        """This rank's place among the ranks that split its sequences (0 without extra axes)."""
        rank = 0
        for name, degree in self.layout.axes:
            rank = rank * degree + self.mesh.get_local_rank(name)
        return rank

    def axis_group(self, name: str) -> dist.ProcessGroup:
        """The process group of one extra axis (a fork's parallelize_fn asks for its own)."""
        return self.mesh.get_group(name)

    def _flat(self, names: tuple[str, ...]) -> DeviceMesh:
        return self.mesh[names]._flatten("_".join(names)) if len(names) > 1 else self.mesh[names[0]]

    @property
    def shard_mesh(self) -> DeviceMesh:
        """FSDP's mesh: dp_shard and the extra axes flattened (HSDP: under dp_replicate)."""
        inner = ("dp_shard", *(n for n, _ in self.layout.axes))
        if self.mode == "fsdp":
            return self._flat(inner)
        if not self.layout.axes:
            return self.mesh
        return self.mesh["dp_replicate", self._flat(inner).mesh_dim_names[0]]

    @property
    def replicate_group(self) -> dist.ProcessGroup:
        """DDP's group: dp_replicate and the extra axes."""
        return self._flat(("dp_replicate", *(n for n, _ in self.layout.axes))).get_group()

    def piece(self, batch):
        """This rank's positions of each sequence of a Microbatch: the seq_rank-th of seq_split
        equal pieces (the sequence's keys whole). Without extra axes, the batch itself."""
        split = self.layout.seq_split
        if split == 1:
            return batch
        n = batch.inputs.shape[1] // split
        lo = self.seq_rank * n
        return type(batch)(*(t if t is None or t.ndim < 2 else t[:, lo : lo + n] for t in batch))

    def autocast(self) -> contextlib.AbstractContextManager:
        """DDP has no parameter-dtype policy, so its bf16 forward runs under autocast."""
        if self.mode == "ddp" and self.param_dtype != torch.float32:
            return torch.autocast(self.device.type, dtype=self.param_dtype)
        return contextlib.nullcontext()
