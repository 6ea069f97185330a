"""Device and the job's DeviceMesh (dp_replicate x dp_shard x the axes a model declares), with
every group a component reduces over derived from the axes' kinds (titanlite.config.layout's
AXIS_KINDS); the process groups themselves: titanlite.distributed.groups."""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titanlite.config.layout import AXIS_KINDS, Layout
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
    """The job's mesh: dp_replicate x dp_shard, then the axes a model declares (layout.axes). The
    ranks along those axes read the same sequences (they share a dp_rank, the data's coordinate);
    what else they share follows from each axis's kind:
    - a sequence split (cp) gives each rank one piece of every sequence's positions (`piece`):
      its ranks hold distinct tokens, so they join the normaliser's group and the gradient sum;
    - a tensor split (tp) gives each rank the whole sequence and a slice of the model's tensors:
      its ranks hold the same tokens, so the normaliser's group and the data-parallel gradient
      sum leave it out; the model's plan reduces what it replicates over it.
    Gradients of what the model does not split are summed over `token_ranks`: FSDP's
    `shard_mesh`, DDP's `replicate_group`."""

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

    def _axes(self, **kind: bool) -> tuple[str, ...]:
        """The declared axes whose kind has these properties (AxisKind's fields), in mesh order."""
        return tuple(
            n
            for n, _ in self.layout.axes
            if all(getattr(AXIS_KINDS[n], k) == v for k, v in kind.items())
        )

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
    def token_ranks(self) -> int:
        """The ranks of `dp_group`: every rank that holds distinct tokens."""
        return self.layout.token_ranks

    @functools.cached_property
    def dp_group(self) -> dist.ProcessGroup:
        """The normaliser's group: the ranks that hold distinct tokens (data-parallel ranks and
        the pieces of a sequence split) at this rank's place on the model-splitting axes; every
        rank without those."""
        if not self._axes(distinct_tokens=False):
            return dist.group.WORLD
        return self._flat(
            ("dp_replicate", "dp_shard", *self._axes(distinct_tokens=True))
        ).get_group()

    @property
    def seq_rank(self) -> int:
        """This rank's place among the ranks that split its sequences' positions (0: none)."""
        rank, degrees = 0, dict(self.layout.axes)
        for name in self._axes(splits_positions=True):
            rank = rank * degrees[name] + self.mesh.get_local_rank(name)
        return rank

    def axis_group(self, name: str) -> dist.ProcessGroup:
        """The process group of one declared axis (a model's parallelize_fn asks for its own)."""
        return self.mesh.get_group(name)

    def axis_mesh(self, name: str) -> DeviceMesh:
        """One declared axis's mesh, for a tensor-parallel plan's DTensors."""
        return self.mesh[name]

    @property
    def tensor_mesh(self) -> DeviceMesh | None:
        """The mesh of the axis that splits the model's tensors (its ranks hold the same tokens),
        for a tensor-parallel plan's DTensors; None without one."""
        split = self._axes(distinct_tokens=False)
        return self.mesh[split[0]] if split else None

    def _flat(self, names: tuple[str, ...]) -> DeviceMesh:
        if len(names) == 1:
            return self.mesh[names[0]]
        if names not in self._flats:  # flattened once: kept, so each name is flattened once
            self._flats[names] = self.mesh[names]._flatten("_".join(names))
        return self._flats[names]

    @functools.cached_property
    def _flats(self) -> dict[tuple[str, ...], DeviceMesh]:
        return {}

    @property
    def shard_mesh(self) -> DeviceMesh:
        """FSDP's mesh: dp_shard and the sequence split's axes flattened (HSDP: under
        dp_replicate); a tensor split's axis is the model's own, not FSDP's."""
        inner = ("dp_shard", *self._axes(distinct_tokens=True))
        if self.mode == "fsdp":
            return self._flat(inner)
        if not self.layout.axes:
            return self.mesh
        return self.mesh["dp_replicate", self._flat(inner).mesh_dim_names[0]]

    @property
    def replicate_mesh(self) -> DeviceMesh:
        """DDP's mesh: dp_replicate and the sequence split's axes flattened."""
        return self._flat(("dp_replicate", *self._axes(distinct_tokens=True)))

    @property
    def replicate_group(self) -> dist.ProcessGroup:
        """DDP's group: the ranks of replicate_mesh."""
        return self.replicate_mesh.get_group()

    def piece(self, batch):
        """This rank's positions of each sequence of a Microbatch: the seq_rank-th of seq_split
        equal pieces (the sequence's keys whole). Without a sequence split, the batch itself."""
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
