#!/usr/bin/env python3
"""Generation with the KV cache against the cache-free path, side by side on one model.

    ./scripts/bench_generate.py [--flavor debugmodel] [--prompt-len 32] [--new 64] [--prompts 2] [--rounds 3]

A random-weight llama3 of the flavor (one process, CPU unless a GPU is there) decodes the same
prompts greedily both ways, alternating, `--rounds` times; prints each way's median seconds, the
ratio, and whether the tokens agree (they must). Exit 1 if they do not.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titanlite.tools.venv import use_project_venv  # noqa: E402

use_project_venv()  # any python3 will do: without titanlite's dependencies it re-executes in .venv

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from titanlite.components.generate import generate  # noqa: E402
from titanlite.distributed.param_init import ParamInit  # noqa: E402
from titanlite.models.llama3 import Llama3, llama3_flavors  # noqa: E402
from titanlite.tools.cli import Script  # noqa: E402


class CacheFree(nn.Module):
    """The same model without `kv_cache`: generate's cache-free path."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model, self.args = model, model.args
        self.train(model.training)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)


SCRIPT = Script("bench_generate", __doc__)
SCRIPT.arg(
    "--flavor",
    kind="choice",
    choices=tuple(sorted(llama3_flavors)),
    default="debugmodel",
    help="llama3 flavor",
)
SCRIPT.arg("--vocab", kind="int", default=2048, at_least=2, at_most=1 << 20, help="vocabulary")
SCRIPT.arg(
    "--prompt-len", kind="int", default=32, at_least=1, at_most=1 << 16, help="tokens per prompt"
)
SCRIPT.arg(
    "--new", kind="int", default=64, at_least=1, at_most=1 << 16, help="tokens generated per prompt"
)
SCRIPT.arg(
    "--prompts", kind="int", default=2, at_least=1, at_most=1024, help="prompts decoded together"
)
SCRIPT.arg(
    "--rounds", kind="int", default=3, at_least=1, at_most=1000, help="alternating rounds timed"
)


def run(args) -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    shape = dataclasses.replace(
        llama3_flavors[args.flavor], vocab_size=args.vocab, max_seq_len=args.prompt_len + args.new
    )
    with torch.device(device):
        model = Llama3(shape)
    model.init_weights(ParamInit(model, seed=0))
    model.eval()
    prompts = [
        torch.randint(0, args.vocab, (args.prompt_len,)).tolist() for _ in range(args.prompts)
    ]
    times: dict[str, list[float]] = {"cache": [], "cache-free": []}
    outs = {}
    for _ in range(args.rounds):
        for name, m in (("cache", model), ("cache-free", CacheFree(model))):
            start = time.perf_counter()
            outs[name] = generate(m, prompts, args.new, eos_id=None)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    cached, free = (statistics.median(times[k]) for k in ("cache", "cache-free"))
    same = outs["cache"] == outs["cache-free"]
    print(
        f"{args.flavor} on {device.type}: {args.prompts} prompts of {args.prompt_len} tokens, {args.new} new: "
        f"KV cache {cached:.3f}s, cache-free {free:.3f}s (median of {args.rounds}); "
        f"{free / cached:.1f}x faster; tokens {'equal' if same else 'DIFFER'}"
    )
    return 0 if same else 1


def main(argv: list[str] | None = None) -> int:
    return SCRIPT.run(run, argv)


if __name__ == "__main__":
    sys.exit(main())
