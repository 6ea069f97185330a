"""Run under torchrun (1 or 2 ranks): pretrained Hugging Face weights through the trainer.

argv: OUT.json, ASSETS (holding the HF folders `tied` and `untied`), RUNS (the dump folder).
For each folder and mode (FSDP, DDP): a Trainer with model.hf_assets_path, so config.json,
tokenizer.json and the weights take the production path; then
- the logits of titanlite's model on fixed tokens against transformers' LlamaForCausalLM
  loaded from the same folder;
- one step's reduced gradient (forward_backward on this rank's share of a fixed batch, exact
  loss) against the HF model's gradient of the same global token-mean loss;
- two training steps, to see the run go on from there.
At world 2, fine-tuning from the untied folder on chat records (`finetune`): 5 steps with
checkpoints every 2 and the Hugging Face export; the same run resumed from its step 2 (FSDP, and
resharded to DDP); new runs started from that checkpoint (weights only; with the optimizer and
the schedule position) and from the exported folder. With UPSTREAM (world 1): the world-2
fine-tune's step-2 checkpoint continued at dp=1.
argv: OUT.json ASSETS RUNS [UPSTREAM]. Writes JSON (rank 0).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.tensor import DTensor
from transformers import LlamaForCausalLM

from titanlite.components.loss import forward_backward
from titanlite.components.optimizer import lr_factor
from titanlite.config import parse_args
from titanlite.distributed.parallel_dims import init_distributed
from titanlite.distributed.parallelize import unwrap
from titanlite.distributed.param_init import canonical_name
from titanlite.models.llama3.hf import LLAMA3_HF
from titanlite.ops.cross_entropy import IGNORE_INDEX
from titanlite.train import Trainer

BATCH, SEQ = 4, 24


def batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    labels = torch.roll(tokens, -1, dims=1)
    labels[0, :20] = IGNORE_INDEX  # ranks with different valid-token counts
    labels[:, -1] = IGNORE_INDEX
    return tokens, labels


def case(assets: str, runs: str, name: str, mode: str) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    overrides = [
        *("--model.hf_assets_path", f"{assets}/{name}", "--data.mode", "pretrain"),
        *("--training.seq_len", "32", "--training.steps", "2", "--metrics.log_every", "1"),
        *(
            "--training.global_batch_size",
            str(BATCH),
            "--training.local_batch_size",
            str(BATCH // world),
        ),
        *("--diagnostics.enable", "false", "--metrics.enable_tensorboard", "false"),
        *("--job.dump_folder", runs, "--job.run_name", f"{name}-{mode}-{world}"),
    ]
    overrides += [
        "--parallelism.mode",
        mode,
        "--parallelism.dp_replicate",
        str(world if mode in ("ddp", "hsdp") else 1),  # HSDP: 2 replicas of 1 shard
    ]
    t = Trainer(parse_args(overrides)[0])
    hf = LlamaForCausalLM.from_pretrained(f"{assets}/{name}")
    args = unwrap(t.model).args
    tokens, labels = batch(args.vocab_size)
    with torch.no_grad():
        ours, theirs = t.model(tokens), hf(tokens).logits
    logits_err = ((ours - theirs).abs().max() / theirs.abs().max()).item()

    per = BATCH // world
    mine = [(tokens[rank * per : (rank + 1) * per], labels[rank * per : (rank + 1) * per])]
    forward_backward(t.model, mine, t.balancer, t.dims, skip_grad_sync=t.layout.skip_grad_sync)
    logits = hf(tokens).logits
    loss = F.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    (loss / (labels != IGNORE_INDEX).sum()).backward()
    hf_grads = dict(hf.named_parameters())
    grad_err = 0.0
    for n, p in unwrap(t.model).named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        hf_name, grad = LLAMA3_HF.to_hf(canonical_name(n), grad, args)
        want = hf_grads[hf_name].grad
        grad_err = max(grad_err, ((grad - want).norm() / want.norm()).item())
    t.optimizer.zero_grad(set_to_none=True)
    t.train()
    t.close()
    return {
        "name": name,
        "mode": t.layout.mode,
        "world": world,
        "tied": args.tie_embeddings,
        "logits_err": logits_err,
        "grad_err": grad_err,
        "run": f"{runs}/{name}-{mode}-{world}",
    }


def sft_trainer(assets: str, runs: str, name: str, *extra: str) -> Trainer:
    """The untied folder fine-tuned on the test's chat records (assets/chat.jsonl)."""
    overrides = [
        *(
            "--model.hf_assets_path",
            f"{assets}/untied",
            "--data.mode",
            "sft",
            "--data.path",
            f"{assets}/chat.jsonl",
        ),
        *("--training.seq_len", "160", "--training.steps", "5", "--metrics.log_every", "1"),
        *("--training.global_batch_size", "4", "--training.local_batch_size", "1"),
        *(
            "--optimizer.lr",
            "1e-3",
            "--lr_scheduler.warmup_steps",
            "2",
            "--lr_scheduler.decay_type",
            "constant",
        ),
        *("--diagnostics.enable", "false", "--metrics.enable_tensorboard", "false"),
        *("--job.dump_folder", runs, "--job.run_name", name),
        *extra,
    ]
    return Trainer(parse_args(overrides)[0])


def full_params(t: Trainer) -> dict[str, torch.Tensor]:
    return {
        canonical_name(n): (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in unwrap(t.model).named_parameters()
    }


def full_optimizer_state(t: Trainer) -> dict:
    """A copy: the state dict's tensors (the step counts at least) are the optimizer's own."""
    state = get_optimizer_state_dict(
        t.model, t.optimizer, options=StateDictOptions(full_state_dict=True)
    )
    return {
        name: {k: v.detach().clone() for k, v in s.items()} for name, s in state["state"].items()
    }


def max_diff(a: dict, b: dict) -> float:
    """Largest absolute difference over matching tensors (nested dicts); inf if the keys differ."""
    if a.keys() != b.keys():
        return float("inf")
    diffs = [
        max_diff(a[k], b[k]) if isinstance(a[k], dict) else (a[k] - b[k]).abs().max().item()
        for k in a
    ]
    return max(diffs, default=0.0)


def losses(run: str) -> dict[int, float]:
    return {
        r["step"]: r["loss"]
        for r in map(json.loads, Path(run, "metrics.jsonl").read_text().splitlines())
    }


def listing(folder: Path) -> list:
    return sorted(
        (str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns)
        for p in folder.rglob("*")
    )


def run_to_end(t: Trainer) -> None:
    t.train()
    t.close()


def finetune(assets: str, runs: str) -> dict:
    """World 2: the fine-tune, its resume and reshard, and new runs started from it."""
    ft = sft_trainer(
        assets, runs, "ft", "--checkpoint.every", "2", "--checkpoint.at_end", "true", "--checkpoint.keep_latest_k", "0",
        "--checkpoint.export_hf", "true",
    )  # fmt: skip
    run_to_end(ft)
    tokens = batch(ft.meta.args.vocab_size)[0]
    with torch.no_grad():
        logits = ft.model(tokens)
    if dist.get_rank() == 0:
        torch.save({"tokens": tokens, "logits": logits}, f"{runs}/ft_logits.pt")
    trained = full_params(ft)
    step2 = Path(runs, "ft", "checkpoints", "step-00000002")
    source_before = listing(step2.parent)

    def resumed(name: str, *extra: str) -> Trainer:
        copy_checkpoint(step2, Path(runs, name))
        return sft_trainer(assets, runs, name, "--checkpoint.every", "0", *extra)

    fsdp = resumed("ft-resumed")
    start = full_params(fsdp), full_optimizer_state(fsdp), fsdp.start_step
    run_to_end(fsdp)
    run_to_end(resumed("ft-ddp", "--parallelism.mode", "ddp", "--parallelism.dp_replicate", "2"))
    hsdp = (
        "--parallelism.mode",
        "hsdp",
        "--parallelism.dp_replicate",
        "2",
        "--checkpoint.export_hf",
        "true",
    )
    run_to_end(resumed("ft-hsdp", *hsdp))
    # ... and at dp=1 x tp=2, exported from there and from its own checkpoint by one process
    split = ("--parallelism.axes", '["tp=2"]', "--diagnostics.enable", "false")
    export = ("--checkpoint.export_hf", "true", "--checkpoint.at_end", "true")
    run_to_end(resumed("ft-tp", *split, *export))

    initial = (
        "--checkpoint.initial_load_path",
        str(step2),
        "--checkpoint.every",
        "1",
        "--checkpoint.at_end",
        "true",
    )
    model_only = sft_trainer(assets, runs, "from-ckpt", *initial, "--training.steps", "2")
    model_only_state = (
        full_params(model_only),
        len(model_only.optimizer.state),
        model_only.scheduler.last_epoch,
    )
    run_to_end(model_only)
    with_optim = sft_trainer(
        assets, runs, "from-ckpt-optim", *initial, "--checkpoint.initial_load_model_only", "false",
        "--optimizer.lr", "5e-4", "--training.steps", "2",
    )  # fmt: skip
    optim_state = full_optimizer_state(with_optim)
    lrs = {g["lr"] for g in with_optim.optimizer.param_groups}
    want_lr = 5e-4 * lr_factor(2, with_optim.cfg)
    run_to_end(with_optim)
    from_export = sft_trainer(
        assets, runs, "from-hf", "--checkpoint.initial_load_path", f"{runs}/ft/hf"
    )
    exported = full_params(from_export)
    from_export.close()
    return {
        "losses": {
            name: losses(f"{runs}/{name}")
            for name in ("ft", "ft-resumed", "ft-ddp", "ft-hsdp", "from-ckpt")
        },
        "resume_start_step": start[2],
        "model_only_vs_resume": max_diff(model_only_state[0], start[0]),
        "model_only_optimizer_entries": model_only_state[1],
        "model_only_last_epoch": model_only_state[2],
        "optim_vs_resume": max_diff(optim_state, start[1]),
        "optim_lrs": sorted(lrs),
        "optim_want_lr": want_lr,
        "export_reload_vs_trained": max_diff(exported, trained),
        "source_untouched": listing(step2.parent) == source_before,
        "from_ckpt_checkpoints": sorted(
            p.name for p in Path(runs, "from-ckpt", "checkpoints").iterdir()
        ),
    }


def copy_checkpoint(step: Path, run_dir: Path) -> None:
    """A step folder copied into a new run folder, which then resumes from it (a run folder
    resumes only its own checkpoints)."""
    if dist.get_rank() == 0:
        shutil.copytree(step, run_dir / "checkpoints" / step.name)
    dist.barrier()


def main() -> None:
    out, assets, runs = sys.argv[1:4]
    upstream = sys.argv[4] if len(sys.argv) > 4 else None
    init_distributed(torch.device("cpu"))
    modes = ("fsdp", "ddp", "hsdp") if dist.get_world_size() == 2 else ("fsdp", "ddp")
    results = {
        "cases": [case(assets, runs, name, mode) for name in ("tied", "untied") for mode in modes]
    }
    if dist.get_world_size() == 2:
        results["finetune"] = finetune(assets, runs)
    if upstream:
        copy_checkpoint(Path(upstream, "ft", "checkpoints", "step-00000002"), Path(runs, "ft-dp1"))
        run_to_end(sft_trainer(assets, runs, "ft-dp1", "--checkpoint.load_step", "2"))
        results["dp1_losses"] = losses(f"{runs}/ft-dp1")
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
