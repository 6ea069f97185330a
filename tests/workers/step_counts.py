"""Run under torchrun (4 ranks): what one training step issues, counted with
titanlite.tools.instrument.

host_syncs: whole training runs with every host read counted, separately for log steps (where
    reading metrics is allowed) and all other moments of the loop; diagnostics measure every
    step, sketch under FSDP and exact under DDP.
collectives: per case, the collectives of one ordinary step (step 3: DDP rebuilds its buckets
    once, at step 2) and of one log, by group ("diagnostics": the diagnostics' own group; "main":
    all others, the data-parallel groups), with the structure they follow from (FSDP units, units that
    reshard after forward, DDP buckets, microbatches). Also the bytes of unsharded gradient FSDP
    holds when each later microbatch of that step starts, and what the memory estimate counts.

metrics: the metrics.jsonl records of the DDP host-sync run (log steps 1, 3, 6, 7; steps 2 and
    5 have no valid token, so their updates are skipped). The "moe" cases: tests/fork_moe.py, its
    loss terms, its step-statistics pass and its expert load; moe_metrics and qwen3_moe_metrics:
    the records of its host-sync run and of train_configs/debug_moe.toml's (host_syncs
    "qwen3_moe"), the same steps.
golden: first, before anything is counted, the golden-curve cases of scripts/golden_losses.py
    (this torchrun is launched with its pins) and the deliberately reordered case, with the
    identity (torch, machine, data, the kernels' hashes) that decides a bitwise comparison.

Writes {"host_syncs": {case: {phase: counts}}, "qwen3_moe": {phase: counts}, "collectives":
{case: {...}}, "metrics": [...], "moe_metrics": [...], "qwen3_moe_metrics": [...], "golden":
{"identity", "curves", "reordered"}} (rank 0).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist
from helpers import load_script
from torch.distributed.fsdp import FSDPModule

from titanlite.config import parse_args
from titanlite.tools.instrument import CollectiveCounter, HostSyncCounter
from titanlite.tools.memory import measured_step_bytes
from titanlite.train import Trainer

HOST = HostSyncCounter()
DIAG_EVERY_STEP = ["--diagnostics.measure_first", "1000"]
DDP = ["--parallelism.dp_replicate", "4"]
HSDP = ["--parallelism.dp_replicate", "2"]
# tests/fork_moe.py: loss terms, and the step-statistics pass, whose sums join the normaliser's all-reduce
MOE = ["--model.name", "fork_moe", "--model.import_module", "fork_moe", "--model.flavor", "tiny"]


def trainer(
    out_dir: str, name: str, *overrides: str, config: str = "train_configs/debug_model.toml"
) -> Trainer:
    cfg, _ = parse_args(
        [
            "--config",
            config,
            "--training.steps",
            "7",
            "--metrics.log_every",
            "3",
            "--training.seq_len",
            "64",
            "--training.global_batch_size",
            "8",
            "--training.local_batch_size",
            "1",
            "--job.dump_folder",
            out_dir,
            "--job.run_name",
            name,
            "--metrics.enable_tensorboard",
            "false",
            *overrides,
        ]
    )
    return Trainer(cfg)


def host_syncs(out_dir: str, name: str, *overrides: str, **config: str) -> dict:
    t = trainer(out_dir, name, *overrides, **config)
    HOST.counts.clear()
    log = t._log

    def counted_log(*a, **k):
        with HOST.phase("log"):
            return log(*a, **k)

    t._log = counted_log
    begin = t.begin

    def counted_begin(
        *a, **k
    ):  # once a run, before the first step: the set-up's (a seed's .item())
        with HOST.phase("begin"):
            return begin(*a, **k)

    t.begin = counted_begin
    with HOST.phase("non_log"):
        t.train()
    t.close()
    return {phase: dict(c) for phase, c in HOST.counts.items()}


def structure(t: Trainer) -> dict:
    units = [m for m in t.model.modules() if isinstance(m, FSDPModule)]
    info = {
        "units": len(units),
        "micro": t.layout.grad_accum,
        "layers": len(t.model.layers) if units else 0,
    }
    # units that free their gathered params after forward (FSDP's own record of it)
    info["resharding"] = sum(
        u._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None for u in units
    )
    if t.layout.mode == "ddp":
        info["buckets"] = t.model._get_ddp_logging_data()["num_buckets_reduced"]
    return info


def unsharded_grad_bytes(model) -> int:
    """Bytes of unsharded gradient the FSDP units hold now (kept when a reduction is skipped)."""
    total = 0
    for unit in (m for m in model.modules() if isinstance(m, FSDPModule)):
        group = unit._get_fsdp_state()._fsdp_param_group
        for p in group.fsdp_params if group is not None else []:
            unsharded = getattr(p, "_unsharded_param", None)
            for g in (
                p.unsharded_accumulated_grad,
                unsharded.grad if unsharded is not None else None,
            ):
                total += g.numel() * g.element_size() if g is not None else 0
    return total


def collectives(out_dir: str, name: str, *overrides: str) -> dict:
    t = trainer(out_dir, name, *overrides)
    labels = {t.diagnostics.group.group_name: "diagnostics"} if t.diagnostics.enabled else {}
    for step in (1, 2):
        t.train_step(step)
    held: list[int] = []  # at each microbatch's forward: what the earlier ones left behind
    hook = t.model.register_forward_pre_hook(lambda *_: held.append(unsharded_grad_bytes(t.model)))
    with CollectiveCounter(labels, other="main") as step_count:
        t.train_step(3)
    hook.remove()
    with CollectiveCounter(labels, other="main") as log_count:
        t._log(3, 1.0, 1.0)
    params = sum(p.numel() for p in t.model.parameters())
    block = (
        sum(p.numel() for p in t.model.layers[0].parameters()) if hasattr(t.model, "layers") else 0
    )
    result = {
        "step": step_count.by_group(),
        "log": log_count.by_group(),
        "method": t.diagnostics.method_used,
        "held_grad_bytes": max(held[1:]),
        "estimated_held_bytes": measured_step_bytes(t.cfg, t.layout, params, block)[0],
        "params": params,
        **structure(t),
    }
    t.close()
    return result


def main() -> None:
    out, out_dir = sys.argv[1], sys.argv[2]
    golden = load_script("golden_losses")
    reordered_case, change = golden.REORDERED
    golden_runs = {
        "curves": golden.run_cases(f"{out_dir}/golden", golden.CASES),
        "reordered": golden.run_cases(
            f"{out_dir}/reordered", {reordered_case: golden.CASES[reordered_case] + change}
        ),
    }
    if dist.get_rank() == 0:  # the kernels' hashes, under this torchrun's pins
        golden_runs["identity"] = golden.identity()
    HOST.install()
    sft = ["--data.mode", "sft", "--training.seq_len", "256"]
    results = {
        "host_syncs": {
            "fsdp_sketch": host_syncs(out_dir, "h-fsdp", *sft, "--diagnostics.method", "sketch"),
            "ddp_exact_skip": host_syncs(
                out_dir, "h-ddp", *DDP, "--faults.ignore_all_labels_steps", "2,5"
            ),
            "fsdp_moe": host_syncs(out_dir, "h-moe", *MOE),
        },
        # train_configs/debug_moe.toml (Qwen3-MoE): its experts' loop reads run lengths on the
        # host (free on a CPU), so only its log steps' reads are compared
        "qwen3_moe": host_syncs(out_dir, "h-qwen3-moe", config="train_configs/debug_moe.toml"),
        "collectives": {
            name: collectives(out_dir, f"c-{name}", *extra)
            for name, extra in {
                "fsdp": ["--diagnostics.enable", "false"],
                "fsdp_skip_sync": [
                    "--diagnostics.enable",
                    "false",
                    "--parallelism.skip_grad_sync",
                    "on",
                ],
                "fsdp_reshard": [
                    "--diagnostics.enable",
                    "false",
                    "--parallelism.reshard_after_forward",
                    "always",
                ],
                "ddp": ["--diagnostics.enable", "false", *DDP],
                "hsdp": ["--diagnostics.enable", "false", *HSDP],
                "fsdp_exact": ["--diagnostics.method", "exact", *DIAG_EVERY_STEP],
                "fsdp_sketch": ["--diagnostics.method", "sketch", *DIAG_EVERY_STEP],
                "ddp_exact": ["--diagnostics.method", "exact", *DIAG_EVERY_STEP, *DDP],
                "hsdp_sketch": [*DIAG_EVERY_STEP, *HSDP],
                "fsdp_unmeasured": [
                    "--diagnostics.measure_first",
                    "0",
                    "--diagnostics.every",
                    "500",
                ],
                "fsdp_auto_accum4": [*DIAG_EVERY_STEP, "--training.global_batch_size", "16"],
                "fsdp_moe": ["--diagnostics.enable", "false", *MOE],
                "fsdp_moe_reshard": [
                    "--diagnostics.enable",
                    "false",
                    *MOE,
                    "--parallelism.reshard_after_forward",
                    "always",
                ],
                "ddp_moe": ["--diagnostics.enable", "false", *MOE, *DDP],
            }.items()
        },
    }
    if dist.get_rank() == 0:
        for key, run in (
            ("metrics", "h-ddp"),
            ("moe_metrics", "h-moe"),
            ("qwen3_moe_metrics", "h-qwen3-moe"),
        ):
            lines = (Path(out_dir) / run / "metrics.jsonl").read_text().splitlines()
            results[key] = [json.loads(line) for line in lines]
        results["golden"] = golden_runs
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
