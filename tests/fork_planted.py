"""tests/fork_model.py with planted invariance bugs, one a model, for scripts/check_model.py and
scripts/invariance.py --localize to name: fork_batch_stats centres the token embeddings on their
mean over the microbatch's sequences (batch statistics), so a sequence's loss depends on which
sequences share its microbatch; fork_aux_local normalises an auxiliary loss by the microbatch's
own tokens; fork_rank_noise seeds a noise layer by the rank (fork_late_noise: from the second
step on); fork_mlp_noise adds noise of 1e-3, seeded by the rank, to every MLP's output (the loss
moves by about 1e-6, the gradient by far more)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from fork_model import ForkArgs, ForkLM, parallelize_fork

from titanlite.models.registry import ModelSpec, register_model
from titanlite.ops.cross_entropy import IGNORE_INDEX


def _centre(_module: torch.nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
    return out - out.mean(dim=0, keepdim=True)


class BatchStatsLM(ForkLM):
    def __init__(self, args: ForkArgs) -> None:
        super().__init__(args)
        self.tokens.register_forward_hook(_centre)


register_model(ModelSpec("fork_batch_stats", BatchStatsLM, {"tiny": ForkArgs()}, parallelize_fork))


class Router(nn.Module):
    """A mixture-of-experts router's probabilities over 4 experts: what a load-balancing loss reads."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).softmax(-1)


class AuxLocalLM(ForkLM):
    """An auxiliary loss on the router (its squared probabilities summed over the valid tokens)
    normalised by this microbatch's own valid tokens, where the step's loss is normalised by all
    of the step's: how much it weighs depends on how the batch is cut (Megatron-LM#7452)."""

    def __init__(self, args: ForkArgs) -> None:
        super().__init__(args)
        self.router = Router(args.dim)
        self.layers[0].register_forward_hook(self._keep)

    def _keep(self, _module: nn.Module, _args: tuple, out: torch.Tensor) -> None:
        self._hidden = out

    def forward(self, tokens, labels=None, loss_chunk=0, positions=None) -> torch.Tensor:
        out = super().forward(tokens, labels, loss_chunk, positions)
        if labels is None:
            return out
        valid = labels != IGNORE_INDEX
        load = (self.router(self._hidden) ** 2).sum(-1)
        aux = (load * valid).sum() / valid.sum().clamp(min=1)  # the bug: local tokens
        return out + aux / len(out)

    def init_weights(self, init) -> None:
        super().init_weights(init)
        init.normal_(self.router.proj.weight, 1.0)


class RankNoise(nn.Module):
    """Noise from a generator seeded by the rank, through a learned gate that starts at zero: a
    sequence's noise depends on which rank holds it, from the second step on (the first step's
    loss agrees; its gradient of the gate does not)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = torch.Generator(device=x.device).manual_seed(
            dist.get_rank() if dist.is_initialized() else 0
        )
        return x + self.gate * torch.randn(x.shape, generator=g, device=x.device, dtype=x.dtype)


class RankNoiseLM(ForkLM):
    def __init__(self, args: ForkArgs) -> None:
        super().__init__(args)
        self.noise = RankNoise(args.dim)
        self.layers[0].register_forward_hook(lambda _m, _a, out: self.noise(out))

    def init_weights(self, init) -> None:
        super().init_weights(init)
        init.constant_(self.noise.gate, 0.0)


class LateNoise(RankNoise):
    """RankNoise with a fixed gate, from the second training forward on (a persistent counter,
    which checkpoints keep): step 1 agrees at every layout, gradient included; from step 2 on a
    sequence's noise depends on its rank."""

    def __init__(self, dim: int) -> None:
        super().__init__(dim)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        self.seen += 1
        g = torch.Generator(device=x.device).manual_seed(
            dist.get_rank() if dist.is_initialized() else 0
        )
        noise = torch.randn(x.shape, generator=g, device=x.device, dtype=x.dtype) * (self.seen > 1)
        return (
            x + self.gate * noise
        )  # the gate has a gradient (zero) at step 1 too, so AdamW has its state


class LateNoiseLM(RankNoiseLM):
    def __init__(self, args: ForkArgs) -> None:
        super().__init__(args)
        self.noise = LateNoise(args.dim)

    def init_weights(self, init) -> None:
        super().init_weights(init)
        init.constant_(self.noise.gate, 0.1)
        self.noise.seen = torch.zeros((), dtype=torch.long, device=self.noise.gate.device)


for name, cls in (
    ("fork_aux_local", AuxLocalLM),
    ("fork_rank_noise", RankNoiseLM),
    ("fork_late_noise", LateNoiseLM),
):
    register_model(ModelSpec(name, cls, {"tiny": ForkArgs()}, parallelize_fork))


def _mlp_noise(_module: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
    """An MLP's output plus noise of scale 1e-3 from a generator seeded by the rank."""
    g = torch.Generator(device=out.device).manual_seed(
        dist.get_rank() if dist.is_initialized() else 0
    )
    return out + 1e-3 * torch.randn(out.shape, generator=g, device=out.device, dtype=out.dtype)


class MLPNoiseLM(ForkLM):
    def __init__(self, args: ForkArgs) -> None:
        super().__init__(args)
        for layer in self.layers:
            layer.down.register_forward_hook(_mlp_noise)


register_model(ModelSpec("fork_mlp_noise", MLPNoiseLM, {"tiny": ForkArgs()}, parallelize_fork))
