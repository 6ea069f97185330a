"""The process groups titanlite makes, in one place: the job's (nccl on CUDA, gloo on CPU) and
the host-side groups beside it (`host_group`: stop agreement, async checkpoints, the data build),
which a rehearsal (titanlite.rehearsal) swaps for torch's fake process group by the one switch
below. The fake group lives in torch's internals; `fake_store` names the module when a torch
upgrade moves it (tests/test_rehearsal.py holds that).
"""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

# torch's fake process group: collectives return at once, on tensors of their true shapes.
FAKE = "fake"
FAKE_MODULE = "torch.testing._internal.distributed.fake_pg"

# A tensor split's parameters are DTensors on (data-parallel, tensor) meshes, whose whole value
# (a gradient norm, a checkpoint's or an export's tensor) DTensor gathers one mesh dim at a time,
# warning each time that it cannot merge the two collectives: a note for kernels, not for a run.
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def fake_store() -> dist.Store:
    """The fake group's store; importing its module registers the "fake" backend."""
    import importlib

    try:
        return importlib.import_module(FAKE_MODULE).FakeStore()
    except (ImportError, AttributeError) as e:
        raise RuntimeError(
            f"torch {torch.__version__} has no {FAKE_MODULE}.FakeStore ({e}); the rehearsal needs torch's "
            "fake process group: use the torch pyproject.toml pins, or update titanlite/distributed/groups.py"
        ) from None


def rehearsing() -> bool:
    """This process is a rehearsal's one rank (its world is the fake group)."""
    return dist.is_initialized() and dist.get_backend() == FAKE


def host_group(timeout: timedelta) -> dist.ProcessGroup:
    """A group of every rank for host-side agreement: gloo, which waits on no device stream; in a
    rehearsal, a fake one (gloo would wait for peers that do not exist)."""
    return dist.new_group(backend=FAKE if rehearsing() else "gloo", timeout=timeout)


def init_distributed(device: torch.device, timeout_s: int = 600, fake_world: int = 0) -> None:
    """nccl on CUDA, gloo on CPU. Without torchrun's env, a one-rank group on a free port.
    `fake_world` > 0: rank 0 of that many on torch's fake process group (a rehearsal)."""
    if dist.is_initialized():
        return
    if fake_world:
        dist.init_process_group(FAKE, store=fake_store(), rank=0, world_size=fake_world)
        return
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        with socket.socket() as s:  # a free port
            s.bind(("127.0.0.1", 0))
            os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    timeout = timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent keeps its store across restarts (--max-restarts), where new_group's
        # member addresses, keyed by a name every attempt repeats, would send a restarted worker
        # to a dead peer (torch 2.13, c10d rendezvous): a prefix per attempt keeps them apart.
        env = os.environ
        store = dist.TCPStore(
            env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=timeout
        )
        attempt = f"titanlite/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        kwargs.update(
            store=dist.PrefixStore(attempt, store),
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
        )
    dist.init_process_group(backend, timeout=timeout, **kwargs)
