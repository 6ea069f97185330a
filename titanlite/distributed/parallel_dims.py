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
    """The data-parallel layout of this job. titanlite's mesh is all data parallel, so the dp
    group is the world; a fork that adds tensor parallelism extends the mesh and `dp_group`."""

    layout: Layout
    device: torch.device
    mesh: DeviceMesh
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype

    @classmethod
    def build(cls, layout: Layout, device: torch.device, param_dtype: str, reduce_dtype: str) -> ParallelDims:
        if dist.get_world_size() != layout.dp:
            raise UserError(f"layout needs {layout.dp} ranks but the job has {dist.get_world_size()}")
        mesh = init_device_mesh(
            device.type,
            (layout.dp_replicate, layout.dp_shard),
            mesh_dim_names=("dp_replicate", "dp_shard"),
        )
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
        return dist.get_rank()

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return dist.group.WORLD

    def autocast(self) -> contextlib.AbstractContextManager:
        """DDP has no parameter-dtype policy, so its bf16 forward runs under autocast."""
        if self.mode == "ddp" and self.param_dtype != torch.float32:
            return torch.autocast(self.device.type, dtype=self.param_dtype)
        return contextlib.nullcontext()
