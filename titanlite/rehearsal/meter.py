"""What one rehearsed step costs rank 0: compute time, peak tensor memory, collective bytes per
process group and host reads. Peak memory is the CUDA allocator's on a GPU, torch's MemTracker on
a CPU (it sees every tensor, so the process's own memory does not blur it). The watchers slow the
step they watch, so a step is either watched (memory, bytes, host reads) or timed, never both."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from titanlite.tools.instrument import CollectiveCounter, HostSyncCounter

# The private tracker, named here so a torch upgrade that moves it fails in one place, loudly
# (tests/test_rehearsal.py imports it).
MEM_TRACKER = "torch.distributed._tools.mem_tracker.MemTracker"


def mem_tracker():
    """A MemTracker for a step of several microbatches: it refuses a root module's second forward,
    so each one resets the modules' stats; the device's totals and peak run on."""
    import importlib

    module, name = MEM_TRACKER.rsplit(".", 1)
    try:
        tracker = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise RuntimeError(
            f"torch {torch.__version__} has no {MEM_TRACKER} ({e}); a rehearsal on a CPU needs it: use "
            "the torch pyproject.toml pins, or update titanlite/rehearsal/meter.py"
        ) from None

    class StepTracker(tracker):
        def _pre_fw_hook(self, module, inputs) -> None:
            mods = self._mod_tracker
            again = module in self.memory_tracking and not mods.is_bw
            if again and set(mods.parents) - {mods.get_known_fqn(module)} == {"Global"}:
                self.reset_mod_stats()
            super()._pre_fw_hook(module, inputs)

    return StepTracker()


@dataclass
class StepCost:
    step: int
    measured: bool  # a measured step of the diagnostics
    # a timed step: its time on this device, collectives returning at once (nan: watched)
    compute_s: float
    peak_bytes: int  # a watched step: its peak tensor memory
    host_reads: dict[str, int]  # titanlite's own host reads and syncs in the step (0 expected)
    # per (group label, op): calls, payload bytes, bytes one rank sends
    collectives: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    peak_parts: dict[str, int] = field(default_factory=dict)  # MemTracker's split (CPU only)
    collect_s: float = 0.0  # rank 0's host work on the diagnostics' record (its statistics, alerts)
    record_bytes: int = 0  # that record as one JSON line of diagnostics.jsonl


_SYNCS = HostSyncCounter()  # one for the process: installing patches torch.Tensor's methods


class StepMeter:
    """`run(step, measured, fn, watch)`: the cost of one rehearsed step, `fn`."""

    def __init__(
        self, device: torch.device, model: torch.nn.Module, optimizer, groups: dict[str, str]
    ) -> None:
        self.device, self.model, self.optimizer, self.groups = device, model, optimizer, groups
        self.cuda = device.type == "cuda"
        _SYNCS.install()

    def run(self, step: int, measured: bool, fn, watch: bool) -> StepCost:
        if not watch:
            return StepCost(step, measured, self._timed(fn), 0, {})
        collectives = CollectiveCounter(self.groups, other="other")
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            tracker = contextlib.nullcontext()
        else:
            tracker = mem_tracker()
            tracker.track_external(self.model, self.optimizer)
        phase = f"rehearsal step {step} ({id(self)})"
        with _SYNCS.phase(phase), collectives, tracker:
            fn()
        parts: dict[str, int] = {}
        if self.cuda:
            peak = torch.cuda.max_memory_allocated(self.device)
        else:  # the tracker's own split at the peak: parameters, activations, optimizer state, ...
            snap = max(tracker.get_tracker_snapshot("peak").values(), key=lambda s: s["Total"])
            peak = snap["Total"]
            parts = {str(getattr(k, "value", k)): int(v) for k, v in snap.items() if k != "Total"}
        by_group: dict[str, dict[str, dict[str, float]]] = {}
        for (group, op), n in sorted(collectives.counts.items()):
            payload, wire = collectives.payload[group, op], collectives.wire[group, op]
            by_group.setdefault(group, {})[op] = {"calls": n, "payload": payload, "wire": wire}
        reads = dict(_SYNCS.counts.pop(phase, {}))
        return StepCost(step, measured, float("nan"), int(peak), reads, by_group, parts)

    def _timed(self, fn) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        fn()
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start


def group_labels(dims, diagnostics) -> dict[str, str]:
    """This rank's group names -> what they carry: the FSDP/HSDP mesh's dims, the world (the loss
    normaliser's token count, the spike guard, DDP's reduction), the diagnostics' own group."""
    labels = {dist.group.WORLD.group_name: "world"}
    for name in dims.mesh.mesh_dim_names or ():
        labels[dims.mesh.get_group(name).group_name] = name
    if getattr(diagnostics, "group", None) is not None:
        labels[diagnostics.group.group_name] = "diagnostics"
    return labels
