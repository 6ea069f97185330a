#!/usr/bin/env python3
"""Peak memory of one forward + backward at a large vocabulary: the loss on the whole sequence's
logits against the loss in chunks (loss.chunk_logits_mib), measured, beside what the memory
estimate counts for the logits.

    ./scripts/loss_memory.py [--vocab 32768] [--seq 2048] [--batch 2] [--dim 256]
                                            [--layers 2] [--budgets 0 64 16] [--device cpu]

Each budget runs in a fresh process (a process's memory high-water mark only rises): the model
and the batch are made first, then one step; the figure is the step's peak above what was held
before it (GPU: max_memory_allocated; CPU: the resident set's high-water mark, ru_maxrss, with
glibc told to map every block over 64 KiB on its own, MALLOC_MMAP_THRESHOLD_, so that a freed
block leaves the resident set: by default its heap kept freed chunk buffers and a 64-position
chunk showed 570 MiB where it holds 193).
Budget 0 is the whole sequence at once. Written as JSON with --out.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from titanlite.tools.venv import use_project_venv  # noqa: E402

use_project_venv()  # any python3 will do: without titanlite's dependencies it re-executes in .venv

from titanlite.tools.cli import Script  # noqa: E402

MiB = 2**20


def _rss() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def one(args, budget: float) -> dict:
    """One step at `budget` MiB per chunk of fp32 logits, in this process."""
    import torch

    from titanlite.config.layout import loss_chunk
    from titanlite.distributed.param_init import ParamInit
    from titanlite.models.llama3 import Llama3, Llama3Args
    from titanlite.ops.cross_entropy import IGNORE_INDEX
    from titanlite.tools.memory import estimate_memory

    device = torch.device(args.device)
    model_args = Llama3Args(
        dim=args.dim, n_layers=args.layers, n_heads=4, vocab_size=args.vocab, max_seq_len=args.seq
    )
    with torch.device(device):
        model = Llama3(model_args)
    model.init_weights(ParamInit(model, 0))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)
    labels = tokens.roll(-1, dims=1)
    labels[:, -1] = IGNORE_INDEX
    chunk = loss_chunk(budget, args.batch, args.seq, args.vocab) or args.seq
    est = estimate_memory(
        model,
        model_args,
        local_batch=args.batch,
        seq_len=args.seq,
        param_dtype=torch.float32,
        activation_checkpoint="none",
        loss_chunk=chunk,
        labels_path=True,
    )
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = _rss()
    start = time.perf_counter()
    loss = model(
        tokens, labels=labels, loss_chunk=chunk if chunk < args.seq else 0
    ).sum()  # the labels path
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = _rss() - before
    return {
        "budget_mib": budget,
        "chunk_positions": chunk,
        "loss": loss.item(),
        "step_s": time.perf_counter() - start,
        "peak_mib": peak / MiB,
        "estimated_logits_mib": est.logits_bytes / MiB,
        "estimated_activations_mib": est.activation_bytes / MiB,
    }


SCRIPT = Script("loss_memory", __doc__)
SCRIPT.arg("--vocab", kind="int", default=32768, at_least=2, at_most=1 << 22, help="vocabulary")
SCRIPT.arg(
    "--seq", kind="int", default=2048, at_least=1, at_most=1 << 20, help="tokens per sequence"
)
SCRIPT.arg("--batch", kind="int", default=2, at_least=1, at_most=4096, help="sequences")
SCRIPT.arg("--dim", kind="int", default=256, at_least=1, at_most=1 << 16, help="model width")
SCRIPT.arg("--layers", kind="int", default=2, at_least=1, at_most=1024, help="blocks")
SCRIPT.arg(
    "--budgets",
    kind="float",
    nargs="+",
    default=[0, 64, 16],
    at_least=0.0,
    at_most=1 << 20,
    help="loss.chunk_logits_mib values; 0: the whole sequence",
)
SCRIPT.arg("--device", kind="choice", choices=("cpu", "cuda"), default="cpu", help="where it runs")
SCRIPT.arg("--out", kind="out_file", help="the rows as JSON")
SCRIPT.arg(
    "--one",
    kind="float",
    at_least=0.0,
    at_most=1 << 20,
    internal=True,
    help="one budget, in a fresh process",
)


def run(args) -> int:
    if args.one is not None:
        print(json.dumps(one(args, args.one)))
        return 0
    rows = []
    for budget in args.budgets:
        cmd = [sys.executable, __file__, "--one", str(budget)]
        for key in ("vocab", "seq", "batch", "dim", "layers", "device"):
            cmd += [f"--{key}", str(getattr(args, key))]
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            print(
                f"loss_memory: error: budget {budget:g} failed:\n{proc.stderr[-2000:]}",
                file=sys.stderr,
            )
            return 1
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print(
        f"vocab {args.vocab}, {args.batch} x {args.seq} tokens, dim {args.dim}, {args.layers} layers, {args.device}"
    )
    print(
        f"{'budget MiB':>10}{'chunk':>7}{'loss':>10}{'step s':>8}{'peak MiB':>10}{'est. logits MiB':>17}"
    )
    for r in rows:
        budget = "whole" if r["budget_mib"] <= 0 else f"{r['budget_mib']:g}"
        print(
            f"{budget:>10}{r['chunk_positions']:>7}{r['loss']:>10.2f}{r['step_s']:>8.2f}"
            f"{r['peak_mib']:>10.0f}{r['estimated_logits_mib']:>17.0f}"
        )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    return SCRIPT.run(run, argv)


if __name__ == "__main__":
    sys.exit(main())
