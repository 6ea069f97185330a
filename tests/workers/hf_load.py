"""Run under torchrun (1 or 2 ranks): pretrained Hugging Face weights through the trainer.

argv: OUT.json, ASSETS (holding the HF folders `tied` and `untied`), RUNS (the dump folder).
For each folder and mode (FSDP, DDP): a Trainer with model.hf_assets_path, so config.json,
tokenizer.json and the weights take the production path; then
- the logits of titanlite's model on fixed tokens against transformers' LlamaForCausalLM
  loaded from the same folder;
- one step's reduced gradient (forward_backward on this rank's share of a fixed batch, exact
  loss) against the HF model's gradient of the same global token-mean loss;
- two training steps, to see the run go on from there.
Writes JSON (rank 0).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from transformers import LlamaForCausalLM

from titanlite.components.loss import IGNORE_INDEX
from titanlite.config import parse_args
from titanlite.distributed.parallel_dims import init_distributed
from titanlite.distributed.parallelize import unwrap
from titanlite.distributed.param_init import canonical_name
from titanlite.models.llama3.hf import LLAMA3_HF
from titanlite.train import Trainer, forward_backward

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
        *("--training.seq_len", "32", "--training.steps", "2", "--metrics.log_freq", "1"),
        *("--training.global_batch_size", str(BATCH), "--training.local_batch_size", str(BATCH // world)),
        *("--diagnostics.enable", "false", "--metrics.enable_tensorboard", "false"),
        *("--job.dump_folder", runs, "--job.run_name", f"{name}-{mode}-{world}"),
    ]
    overrides += [
        "--parallelism.mode",
        mode,
        "--parallelism.dp_replicate",
        str(world if mode == "ddp" else 1),
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
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
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


def main() -> None:
    out, assets, runs = sys.argv[1:4]
    init_distributed(torch.device("cpu"))
    results = [case(assets, runs, name, mode) for name in ("tied", "untied") for mode in ("fsdp", "ddp")]
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
