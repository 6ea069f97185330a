"""The rehearsal's report (rehearsal.json) and its table. Traffic: the bytes one rank sends per
step in a ring over each group (the diagnostics': the measured step's extra); its time over
`rehearsal.link_gbps`, which FSDP's prefetch hides at most up to the compute time. A rehearsal
cannot tell NCCL's speed and topology, stragglers, contention, or a host's data loading."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch

from titanlite.config.layout import mesh_text
from titanlite.rehearsal.meter import StepCost
from titanlite.rehearsal.plan import Plan, derive
from titanlite.tools.records import fmt

if TYPE_CHECKING:
    from titanlite.train import Trainer

GiB = 2**30


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _wire(cost: StepCost) -> dict[str, float]:
    """Bytes one rank sends per group in this step."""
    return {
        group: sum(op["wire"] for op in ops.values()) for group, ops in cost.collectives.items()
    }


def summarize(trainer: Trainer, costs: list[StepCost], plan: Plan) -> dict[str, Any]:
    """rehearsal.json: rank 0's figures from its steps' costs; where the steps ran part of the
    model (plan.blocks), the whole model's derived from them, and the part's under "measured"."""
    cfg, layout, device = trainer.cfg, trainer.layout, trainer.device
    estimate = plan.estimate if plan.blocks else trainer.memory_estimate
    watched = {c.measured: c for c in costs if c.peak_bytes}
    plain, diag = watched.get(False) or next(iter(watched.values())), watched.get(True)
    timed = [c for c in costs[1:] if not math.isnan(c.compute_s)]
    compute_s = _median([c.compute_s for c in timed if not c.measured])
    compute_s = compute_s or _median([c.compute_s for c in timed])
    measured_s = _median([c.compute_s for c in timed if c.measured])
    # what a measured step adds, from the steps that ran (a part's, before any scaling)
    extra_s = None if None in (measured_s, compute_s) else measured_s - compute_s
    traffic = _wire(plain)
    peak, measured = plain.peak_bytes, None
    if plan.blocks:
        measured = {"peak_bytes": peak, "traffic_bytes": traffic, "compute_s": compute_s}
        derived = derive(plan, trainer, measured)
        measured["estimate_bytes"] = trainer.memory_estimate.total_bytes
        measured["compute_ratio"] = derived["compute_ratio"]
        peak, traffic, compute_s = (
            derived["peak_bytes"],
            derived["traffic_bytes"],
            derived["compute_s"],
        )
    comm_s = sum(traffic.values()) / (cfg.rehearsal.link_gbps * 1e9 / 8)
    collect = [c for c in costs if c.measured and c.record_bytes]
    diagnosed = None
    if diag is not None:
        extra = {g: b - traffic.get(g, 0.0) for g, b in _wire(diag).items()}
        diagnosed = {
            "step_s": extra_s,
            "peak_bytes": diag.peak_bytes - plain.peak_bytes,
            "traffic_bytes": {g: b for g, b in extra.items() if b > 0},
            "host_s": _median([c.collect_s for c in collect]),
            "record_bytes": max((c.record_bytes for c in collect), default=0),
        }
    method = trainer.diagnostics.method_used
    internal = ("skip_grad_sync", "diagnostics_method")
    shape = {k: v for k, v in asdict(layout).items() if k not in internal}
    return {
        "world": cfg.rehearsal.world,
        "rank": 0,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "model": f"{cfg.model.name}/{cfg.model.flavor}",
        "params": plan.params,
        "layout": {**shape, "axes": dict(layout.axes), "diagnostics": method},
        "blocks": {"run": plan.blocks or plan.n_blocks, "of": plan.n_blocks},
        "measured": measured,  # on the blocks run, where they are not all (else null)
        "plan": plan.report(),
        "peak_bytes": peak,
        "peak_parts": plain.peak_parts,
        "device_bytes": cfg.rehearsal.device_gb * 1e9,
        "estimate_bytes": estimate.total_bytes,
        "estimate": estimate.summary(),
        "estimate_parts": asdict(estimate),
        "compute_s": compute_s,
        "tokens_per_s": layout.tokens_per_rank_step / compute_s if compute_s else None,
        "traffic_bytes": traffic,
        "link_gbps": cfg.rehearsal.link_gbps,
        "comm_s": comm_s,
        "comm_hidden": None if compute_s is None else comm_s <= compute_s,
        "host_reads": sum(n for c in costs if c.peak_bytes for n in c.host_reads.values()),
        # every step from the second ran under torch.cuda.set_sync_debug_mode("error")
        "sync_debug": cfg.debug.sync_debug and device.type == "cuda",
        "diagnostics": diagnosed,
        "steps": [asdict(c) for c in costs],
    }


def _mib(b: float) -> str:
    return f"{b / 2**20:,.1f} MiB"


HIDES = {
    True: "hidden by compute",
    False: "longer than compute: communication-bound",
    None: "no step timed",
}


def table(r: dict[str, Any]) -> str:
    """What a user reads first: the per-rank figures, one per line."""
    lay = r["layout"]
    lines = [
        f"rehearsal of rank 0 of {r['world']} on {r['device']}: {r['model']} ({r['params']:,} params), "
        f"{mesh_text(lay['mode'], lay['dp_replicate'], lay['dp_shard'], lay['axes'])}, global batch {lay['global_batch']} "
        f"({lay['local_batch']} x {lay['seq_len']} tokens x accumulation {lay['grad_accum']} per rank)",
        f"  peak tensor memory   {r['peak_bytes'] / GiB:.2f} GiB{_peak_source(r)}; the estimate: {r['estimate']}",
        f"  step compute         {fmt(r['compute_s'], '.3f')} s{_compute_source(r)}; {fmt(r['tokens_per_s'], ',.0f')} "
        "tokens/s per rank (compute only: an upper bound"
        + ("; this CPU's, which says nothing of a GPU's time)" if r["device"] == "cpu" else ")"),
    ]
    part = r.get("measured")  # None: the whole model ran (and in records written before parts)
    for group, b in sorted(r["traffic_bytes"].items()):
        source = ""
        if part is not None and group in r["plan"]["traffic_bytes"]:
            source = f" ({_mib(part['traffic_bytes'].get(group, 0.0))} {_on_part(r)} + the other blocks' from their shapes)"
        lines.append(f"  sent per step        {_mib(b)} on {group}{source}")
    link = f"{r['comm_s']:.3f} s per step at {r['link_gbps']:g} Gbit/s"
    lines.append(f"  communication        {link} ({HIDES[r['comm_hidden']]})")
    reads = f"  host reads           {r['host_reads']} in the watched steps (0 expected)"
    if r["sync_debug"]:
        reads += "; no device sync in any step from the second (sync_debug)"
    lines.append(reads)
    d = r["diagnostics"]
    if d is not None:
        sent = [f"{_mib(b)} ({g})" for g, b in sorted(d["traffic_bytes"].items())]
        lines.append(
            f"  diagnostics ({lay['diagnostics']})  per measured step: {_cost(d['step_s'])} on the device, "
            f"{_mib(d['peak_bytes'])} more memory, {' + '.join(sent) or 'nothing'} more sent; rank 0's host work "
            f"{fmt(d['host_s'], '.3f')} s, record {d['record_bytes'] / 1024:,.1f} KiB"
        )
    lines.append(verdict(r["peak_bytes"], r["device_bytes"], "peak tensor memory"))
    if part is not None:
        lines.append(
            f"  (measured on the first {r['blocks']['run']} of the model's {r['blocks']['of']} blocks; the rest "
            "derived: --rehearsal.blocks 0 measures the whole model)"
        )
    return "\n".join(lines)


def _on_part(r: dict[str, Any]) -> str:
    return f"measured on {r['blocks']['run']} of {r['blocks']['of']} blocks"


def _peak_source(r: dict[str, Any]) -> str:
    part = r.get("measured")  # None: the whole model ran (and in records written before parts)
    if part is None:
        return ""
    rest = r["estimate_bytes"] - part["estimate_bytes"]
    return f" ({part['peak_bytes'] / GiB:.2f} GiB {_on_part(r)} + the other blocks' {rest / GiB:.2f} GiB by the estimate)"


def _compute_source(r: dict[str, Any]) -> str:
    part = r.get("measured")  # None: the whole model ran (and in records written before parts)
    if part is None or part["compute_s"] is None:
        return ""
    return (
        f" ({part['compute_s']:.3f} s {_on_part(r)} x {part['compute_ratio']:.2f}, the whole model's FLOPs "
        "per token over the part's)"
    )


def plan_table(plan: Plan, cfg, device: str) -> str:
    """The figures that need no step, printed before the first: the whole model's parameters, its
    estimate per rank, FSDP's traffic from the shapes, the verdict by the estimate, and what the
    steps run."""
    est = plan.estimate
    lines = [
        f"rehearsal plan of rank 0 of {cfg.rehearsal.world} (no step needed): {plan.model} ({plan.params:,} params, "
        f"{plan.n_blocks} blocks)",
        f"  est. memory per rank {est.summary()}",
    ]
    for group, b in sorted(plan.traffic.items()):
        what = (
            "FSDP's gathers and reductions"
            if group.startswith("dp_")
            else "the tensor split's exchanges"
        )
        lines.append(f"  sent per step        {_mib(b)} on {group} ({what}, from the shapes)")
    if not plan.traffic:
        lines.append(
            "  sent per step        measured by the steps (this layout's traffic is not planned)"
        )
    lines.append(verdict(est.total_bytes, cfg.rehearsal.device_gb * 1e9, "the estimate"))
    steps = cfg.rehearsal.steps
    if plan.blocks:
        what = (
            f"  next: {steps} steps on {device} of the first {plan.blocks} of the {plan.n_blocks} blocks ({plan.why}), "
            "the other blocks derived; --rehearsal.blocks 0 runs the whole model"
        )
    else:
        what = f"  next: {steps} steps on {device} of the whole model, measured"
    lines.append(what)
    return "\n".join(lines)


def _cost(seconds: float | None) -> str:
    """A measured step's extra time: below zero it is the steps' own noise, not a saving."""
    if seconds is None:
        return "n/a"
    if seconds <= 0:
        return f"no time above the steps' noise ({seconds:+.3f} s)"
    return f"{seconds:+.3f} s"


# What a device holds beside the tensors: the CUDA context and the allocator's slack.
DEVICE_OVERHEAD_BYTES = 2 * GiB


def verdict(peak: float, device: float, what: str) -> str:
    """Whether rank 0's `peak` (`what` it is), plus a device's context and slack, fits
    rehearsal.device_gb (`device` bytes)."""
    need = peak + DEVICE_OVERHEAD_BYTES
    size = f"{device / 1e9:g}"
    name = f"fits {'an' if size.startswith(('8', '11', '18')) else 'a'} {size} GB device"
    if what == "the estimate":
        name += " by the estimate"
    basis = (
        f"{what} {peak / GiB:.2f} GiB + {DEVICE_OVERHEAD_BYTES / GiB:.0f} GiB for the "
        f"CUDA context and allocator, of {device / GiB:.1f} GiB; rehearsal.device_gb sets the device"
    )
    if need <= device:
        return f"{name}: yes, with {(device - need) / GiB:.1f} GiB to spare ({basis})"
    return (
        f"{name}: no, {(need - device) / GiB:.1f} GiB over ({basis}); shard over more ranks, lower "
        "training.local_batch_size, or set training.activation_checkpoint"
    )
