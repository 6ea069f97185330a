"""Run torchtitan 0.3.0 (installed from PyPI, unmodified) on CPU ranks with gloo.

    .venv-torchtitan/bin/torchrun --nproc_per_node 2 scripts/peer/run_torchtitan.py \
        --module tt_cpu_config --config tt_cpu_debugmodel [--section.key value ...]

Every change is a runtime monkeypatch applied here, before torchtitan's own `main()` runs;
no file under site-packages is edited. Each patch says why it is needed.
"""

from __future__ import annotations

import os
import resource
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for tt_cpu_config

import torch
import torch.distributed as dist

PATCHES: list[str] = []


def _note(msg: str) -> None:
    PATCHES.append(msg)


# ---------------------------------------------------------------------------------------
# P1. triton import. torchtitan.trainer -> models.common -> moe -> token_dispatcher ->
# distributed.minimal_async_ep -> .kernels does a module-level `import triton` (MoE
# expert-parallel kernels, never run by llama3); the CPU torch wheel has no triton. A fake
# `triton` package would be seen by torch too (torch._dynamo inspects triton.language at
# import), so instead the one kernels module is stubbed: every name it exports raises if
# ever called. Only done when triton is really absent.
import importlib.util  # noqa: E402

_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"
if importlib.util.find_spec("triton") is None:

    class _NoTritonKernels(types.ModuleType):
        def __getattr__(self, name: str):
            if name.startswith("__"):
                raise AttributeError(name)

            def _unavailable(*_a, **_k):
                raise RuntimeError(f"{_KERNELS}.{name}: triton kernel, unavailable on CPU")

            return _unavailable

    sys.modules[_KERNELS] = _NoTritonKernels(_KERNELS)
    _note(
        "triton: stub for torchtitan.distributed.minimal_async_ep.kernels (imports triton at load; MoE-only)"
    )

# ---------------------------------------------------------------------------------------
# P2. Device: torchtitan picks `_get_available_device_type() or "cuda"` at import, so on a
# machine with no accelerator it selects cuda. Point every module-level copy at cpu.
import torchtitan.tools.utils as tt_utils  # noqa: E402

tt_utils.device_type, tt_utils.device_module = "cpu", torch.cpu

import torchtitan.components.metrics as tt_metrics  # noqa: E402
import torchtitan.distributed.parallel_dims as tt_parallel_dims  # noqa: E402
import torchtitan.distributed.utils as tt_dist_utils  # noqa: E402

for _m in (tt_metrics, tt_dist_utils):
    _m.device_type, _m.device_module = "cpu", torch.cpu
tt_parallel_dims.device_type = "cpu"
try:
    import torchtitan.models.common.token_dispatcher as tt_td  # noqa: E402

    tt_td.device_type, tt_td.device_module = "cpu", torch.cpu
except Exception:  # MoE only; not used by llama3
    pass
_note("device: torchtitan.tools.utils.device_type/device_module -> 'cpu'/torch.cpu (+ copies)")

# ---------------------------------------------------------------------------------------
# P3. Memory monitor: DeviceMemoryMonitor calls device_module.get_device_name,
# get_device_properties, memory_stats, reset_peak_memory_stats, empty_cache: cuda-only APIs.
# Replace it with a CPU monitor reporting this process's peak RSS (ru_maxrss).
_GiB = 1024**3


class CpuMemoryMonitor:
    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.device_name = "cpu"
        self.device_capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        self.device_capacity_gib = self.device_capacity / _GiB

    def get_peak_stats(self):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        pct = 100 * peak / self.device_capacity
        return tt_metrics.DeviceMemStats(peak / _GiB, pct, peak / _GiB, pct, 0, 0)

    def reset_peak_stats(self) -> None:
        pass


tt_metrics.build_device_memory_monitor = CpuMemoryMonitor
_note("metrics: build_device_memory_monitor -> CPU monitor (peak RSS), no cuda memory APIs")

# ---------------------------------------------------------------------------------------
# P4. FSDP reduce op on gloo. torchtitan sets gradient_divide_factor=1.0 on every FSDP unit
# (its loss is already sum / global valid tokens, so gradients must be summed, not averaged).
# With an explicit factor FSDP2 reduce-scatters with ReduceOp.PREMUL_SUM(1/factor), which gloo
# does not implement. set_force_sum_reduction_for_comms(True) on every unit makes FSDP use
# ReduceOp.SUM and then divide by the factor (1.0: nothing), so gradients are unchanged.
import torchtitan.distributed.fsdp as tt_fsdp  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402

_orig_disable_div = tt_fsdp.disable_fsdp_gradient_division


def _disable_div_and_force_sum(model: torch.nn.Module) -> None:
    _orig_disable_div(model)  # set_gradient_divide_factor(1.0) on every FSDPModule
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


tt_fsdp.disable_fsdp_gradient_division = _disable_div_and_force_sum
_note(
    "fsdp: + set_force_sum_reduction_for_comms(True) on every FSDP unit (gloo has no PREMUL_SUM); divide factor stays 1.0"
)

# ---------------------------------------------------------------------------------------
# P5. set_pg_timeouts (after step 1) calls dist.barrier(device_ids=[device_module
# .current_device()]); gloo's barrier rejects device_ids. Run the original with a barrier
# that drops the argument.
# P6. The same function then calls torch.distributed.set_timeout(timeout, group), an API
# newer than torch 2.13.0 (AttributeError); 2.13 has the same operation as
# distributed_c10d._set_pg_timeout(timeout, group), supplied while the function runs.
import torch.distributed.distributed_c10d as c10d  # noqa: E402

_orig_set_pg_timeouts = tt_dist_utils.set_pg_timeouts


def _set_pg_timeouts_gloo(*args, **kwargs):
    real_barrier = dist.barrier
    had_set_timeout = hasattr(dist, "set_timeout")

    def barrier(group=None, async_op=False, device_ids=None):
        return real_barrier(group=group, async_op=async_op)

    dist.barrier = barrier
    if not had_set_timeout:
        dist.set_timeout = c10d._set_pg_timeout
    try:
        return _orig_set_pg_timeouts(*args, **kwargs)
    finally:
        dist.barrier = real_barrier
        if not had_set_timeout:
            del dist.set_timeout


tt_dist_utils.set_pg_timeouts = _set_pg_timeouts_gloo
_note("dist: set_pg_timeouts' barrier without device_ids (gloo)")
if not hasattr(dist, "set_timeout"):
    _note(
        "dist: torch.distributed.set_timeout (missing in torch 2.13.0) -> distributed_c10d._set_pg_timeout, inside set_pg_timeouts only"
    )

# P7 (attention: FlexAttention -> causal SDPA), tokenizer and data are in tt_cpu_config.py:
# they are config choices (torchtitan's own ScaledDotProductAttention module), not patches.

if __name__ == "__main__":
    if int(os.environ.get("RANK", "0")) == 0:
        for p in PATCHES:
            print(f"[run_torchtitan] patch: {p}", flush=True)
    from torchtitan.train import main

    main()
