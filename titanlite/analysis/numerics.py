"""What decides whether two CPU runs agree bit for bit: the kernels' summation order (MKL's GEMM
branch, ATEN_CPU_CAPABILITY), which pins do not fix everywhere (MKL_CBWR binds on Intel CPUs only:
oneMKL Developer Guide, "Getting Started with Conditional Numerical Reproducibility"). So
`kernels()` hashes what each kind of op of a Llama step returns, on torch's own primitives (a change
of titanlite's numerics must not move them), on inputs with the same bits everywhere and full
24-bit mantissas; scripts/golden_losses.py demands bitwise equality only where all hashes agree."""

from __future__ import annotations

import hashlib
import platform
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from titanlite.models.llama3 import llama3_flavors
from titanlite.models.llama3.model import ffn_hidden_dim
from titanlite.ops.cross_entropy import IGNORE_INDEX

# The golden runs' shapes: the debug Llama's, its built-in vocabulary, a microbatch of 2 x 128.
_DEBUG = llama3_flavors["debugmodel"]
DIM, HEADS, HIDDEN = _DEBUG.dim, _DEBUG.n_heads, ffn_hidden_dim(_DEBUG)
VOCAB, BATCH, SEQ = 2048, 2, 128
TOKENS = BATCH * SEQ


def _exact(gen: torch.Generator, *shape: int, grad: bool = True) -> torch.Tensor:
    """Values in [-1, 1) with 24 significant bits, identical on every machine; a leaf that takes
    a gradient unless `grad` is False."""
    x = torch.randint(-(2**23), 2**23, shape, generator=gen) * 2.0**-23
    return x.requires_grad_(grad)


def _digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:12]


def _matmul(gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """F.linear forward and both gradients (the NT, NN and TN GEMMs) at the model's shapes."""
    out = []
    for n_in, n_out in ((DIM, DIM), (DIM, HIDDEN), (HIDDEN, DIM), (DIM, VOCAB)):
        x, w = _exact(gen, TOKENS, n_in), _exact(gen, n_out, n_in)
        y = F.linear(x, w)
        y.backward(_exact(gen, TOKENS, n_out, grad=False))
        out += [y, x.grad, w.grad]
    return tuple(out)


def _attention(gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """SDPA, causal and under a dense document mask (packed sequences), forward and backward."""
    shape = (BATCH, HEADS, SEQ, DIM // HEADS)
    docs = (torch.arange(SEQ) >= SEQ // 3).long() + (torch.arange(SEQ) >= SEQ // 2).long()
    mask = (docs[:, None] == docs[None, :]) & torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    out = []
    for kwargs in ({"is_causal": True}, {"attn_mask": mask}):
        q, k, v = (_exact(gen, *shape) for _ in range(3))
        y = F.scaled_dot_product_attention(q, k, v, **kwargs)
        y.backward(_exact(gen, *shape, grad=False))
        out += [y, q.grad, k.grad, v.grad]
    return tuple(out)


def _norm(gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """RMSNorm as the model writes it (pow, mean, rsqrt), forward and backward."""
    x, w = _exact(gen, TOKENS, DIM), _exact(gen, DIM)
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    y.backward(_exact(gen, TOKENS, DIM, grad=False))
    return y, x.grad, w.grad


def _pointwise(gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """SwiGLU's silu and product, forward and backward, and the transcendental functions RoPE
    and the schedules use (vectorized approximations, one per CPU capability)."""
    a, b = _exact(gen, TOKENS, HIDDEN), _exact(gen, TOKENS, HIDDEN)
    y = F.silu(a) * b
    y.backward(_exact(gen, TOKENS, HIDDEN, grad=False))
    x = _exact(gen, 4099, grad=False) * 8
    unary = (x.exp(), x.abs().log1p(), x.cos(), x.sin(), x.abs().pow(0.37), x.tanh())
    return (y, a.grad, b.grad, *unary)


def _cross_entropy(gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Token cross entropy (log-softmax over the vocabulary, ignored labels), summed, and its gradient."""
    logits = (_exact(gen, TOKENS, VOCAB, grad=False) * 8).requires_grad_()
    labels = torch.randint(0, VOCAB, (TOKENS,), generator=gen)
    labels[::7] = IGNORE_INDEX
    loss = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none").sum()
    loss.backward()
    return loss, logits.grad


def _reductions(gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Long sums, means and norms (odd lengths: vector bodies and tails), and the foreach norm
    the gradient clipping takes."""
    xs = [_exact(gen, n, grad=False) for n in (7, 4099, 65_537, 1_000_003)]
    norms = torch._foreach_norm(xs, 2.0)
    return (*(x.sum() for x in xs), *(x.mean() for x in xs), *(x.norm() for x in xs), *norms)


def _embedding(gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """An embedding's gradient: rows read many times accumulate."""
    table = _exact(gen, VOCAB, DIM)
    ids = torch.randint(0, VOCAB // 16, (BATCH, SEQ), generator=gen)
    F.embedding(ids, table).backward(_exact(gen, BATCH, SEQ, DIM, grad=False))
    return (table.grad,)


def _optimizer(gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Two steps of fused AdamW with weight decay, as the trainer builds it."""
    params = [_exact(gen, DIM, DIM), _exact(gen, DIM)]
    opt = torch.optim.AdamW(params, lr=8e-4, weight_decay=0.1, fused=True)
    for _ in range(2):
        for p in params:
            p.grad = _exact(gen, *p.shape, grad=False)
        opt.step()
    return tuple(params)


KINDS: dict[str, Callable[[torch.Generator], tuple[torch.Tensor, ...]]] = {
    "matmul": _matmul,
    "attention": _attention,
    "norm": _norm,
    "pointwise": _pointwise,
    "cross_entropy": _cross_entropy,
    "reductions": _reductions,
    "embedding": _embedding,
    "optimizer": _optimizer,
}


def kernels() -> dict[str, str]:
    """Each kind of op's hash of the bits it returned, computed in this process (its pins and
    thread count included); milliseconds. Leaves torch's global RNG untouched."""
    kinds = enumerate(KINDS.items())
    return {name: _digest(*run(torch.Generator().manual_seed(i))) for i, (name, run) in kinds}


def cpu_name() -> str:
    """This CPU's model as the kernel reports it: with the kernels' hashes, it decides whether a
    golden curve is held bitwise (scripts/golden_losses.py)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def differing(a: dict[str, str], b: dict[str, str]) -> list[str]:
    """The kinds of op whose bits differ between two `kernels()` results (a kind only one has counts)."""
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
