"""Where each rank's local, unreduced gradient passes: FSDP2's reduce-scatter and DDP's comm hook.
On a measured step the probe takes the local gradient's squared norm and either its CountSketch
(`sketch`: linear, so microbatch sketches add up; the norm then comes from the sketch) or, at no
extra volume, the Gram of all ranks' local gradients (`exact`: the reduce-scatter becomes an
all-to-all, each rank sums the rows and keeps rows @ rows.T over its shard; not under HSDP, whose
reduce-scatter spans one replica). It never reads a value on the host. The sketch takes signs from
a cached +-1 table at a hashed phase per segment, with a hashed whole-segment flip, so colliding
pairs carry independent signs and the estimate keeps the CountSketch variance; k is a prime
(titanlite/diagnostics/README.md, `sketch`: LLM gradients concentrate on a few feature columns)."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from titanlite.distributed.parallelize import ReduceScatterComm, reduce_scatter

_MASK64 = (1 << 64) - 1


def prev_prime(n: int) -> int:
    """The largest prime <= n (n >= 2)."""
    while n > 2 and any(n % d == 0 for d in range(2, int(n**0.5) + 1)):
        n -= 1
    return n


_P = prev_prime(1 << 20)  # segment length = sign-table length


def _mix(x: int) -> int:
    """splitmix64: a well-spread 64-bit hash of an integer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class CountSketch:
    def __init__(self, k: int, seed: int, device: torch.device | str = "cpu") -> None:
        self.k = prev_prime(k)
        self.seed = seed
        g = torch.Generator().manual_seed(seed)
        self._sign = (torch.randint(0, 2, (_P,), generator=g).float() * 2 - 1).to(device)
        self._scratch = torch.empty(0, device=device)

    def _rows(self, n: int) -> torch.Tensor:
        """A reused zeroed-tail buffer of whole rows of k for n values."""
        size = -(-n // self.k) * self.k
        if self._scratch.numel() < size:
            self._scratch = torch.empty(size, device=self._sign.device)
        buf = self._scratch[:size]
        buf[n:].zero_()
        return buf

    def add_(self, out: torch.Tensor, values: torch.Tensor, offset: int) -> None:
        """out[k] += sketch of the flat `values`, whose first element is coordinate `offset`
        (the same coordinates on every rank: that is all the ranks share)."""
        flat = values.reshape(-1)
        pos = 0
        while pos < flat.numel():
            segment, within = divmod(offset + pos, _P)
            n = min(_P - within, flat.numel() - pos)
            h = _mix(self.seed * 0x100000001B3 + segment)
            phi, beta = (h + within) % _P, ((h >> 24) + within) % self.k
            rows = self._rows(n)
            head = min(n, _P - phi)  # the table slice may wrap around
            torch.mul(flat[pos : pos + head], self._sign[phi : phi + head], out=rows[:head])
            if head < n:
                torch.mul(flat[pos + head : pos + n], self._sign[: n - head], out=rows[head:n])
            summed = rows.view(-1, self.k).sum(0)
            out.add_(summed.roll(beta), alpha=1.0 if (h >> 63) & 1 else -1.0)
            pos += n


_UNIT_STRIDE = 1 << 40  # coordinate offset between FSDP units / DDP buckets, for the sketch hash


class GradProbe:
    def __init__(self, method: str, world: int, sketch_dim: int, seed: int, device: torch.device):
        self.method = method
        self.world = world
        self.measuring = False
        self.per_microbatch = False
        self.noise_scale = 0.0  # > 0 only on the grad_noise fault's rank (titanlite.faults sets it)
        self.noise_generator = torch.Generator(device=device).manual_seed(seed + 17)
        self.norm_sq = torch.zeros((), dtype=torch.float64, device=device)
        self.gram = torch.zeros(world, world, dtype=torch.float64, device=device)
        self.countsketch = CountSketch(sketch_dim, seed, device) if method == "sketch" else None
        k = self.countsketch.k if self.countsketch else 0
        self.sketch = torch.zeros(k, dtype=torch.float32, device=device)

    def start(self, measuring: bool, per_microbatch: bool = False) -> None:
        """Arm for a step; `per_microbatch`: the step's gradient arrives as several microbatch
        gradients (sketch only), so the norm is taken from the summed sketch at the end."""
        self.measuring = measuring
        self.per_microbatch = per_microbatch
        if measuring:
            self.norm_sq.zero_()
            self.gram.zero_()
            self.sketch.zero_()

    def local_norm_sq(self) -> torch.Tensor:
        """|local gradient|^2 of the step: exact, or from the sketch (see the module doc)."""
        if self.per_microbatch:
            return self.sketch.double().square().sum()
        return self.norm_sq.clone()

    def perturb(self, local: torch.Tensor) -> None:
        """The grad_noise fault: add N(0, (scale * RMS)^2) noise to this rank's local gradient."""
        if self.noise_scale > 0:
            rms = local.float().norm() / local.numel() ** 0.5
            noise = torch.randn(local.shape, generator=self.noise_generator, device=local.device)
            local.add_((noise * (self.noise_scale * rms)).to(local.dtype))

    def observe(self, local: torch.Tensor, offset: int) -> None:
        """Account for one flat piece of this rank's local gradient."""
        flat = local.reshape(-1).float()
        if not self.per_microbatch:
            self.norm_sq += torch.dot(flat, flat).double()
        if self.method == "sketch":
            self.countsketch.add_(self.sketch, flat, offset)

    def reduce_with_gram(self, padded: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        """All-to-all of `padded` (world equal chunks); returns this rank's summed chunk."""
        recv = torch.empty_like(padded)
        dist.all_to_all_single(recv, padded, group=group)
        return self.sum_with_gram(recv)

    def sum_with_gram(self, received: torch.Tensor) -> torch.Tensor:
        """The device work on every rank's copy of this rank's shard (world rows): their sum,
        and the partial Gram matrix added up."""
        rows = received.view(self.world, -1).float()
        self.gram += (rows @ rows.T).double()
        return rows.sum(0)


class ProbingReduceScatter(ReduceScatterComm):
    """FSDP2 custom reduce-scatter (see FSDPModule.set_custom_reduce_scatter)."""

    def __init__(self, probe: GradProbe, unit: int) -> None:
        self.probe = probe
        self.offset = unit * _UNIT_STRIDE

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        probe = self.probe
        probe.perturb(input_tensor)
        if probe.measuring:
            probe.observe(input_tensor, self.offset)
            if probe.method == "exact":
                output_tensor.copy_(probe.reduce_with_gram(input_tensor, group))
                return None
        return reduce_scatter(output_tensor, input_tensor, group, op, async_op)


def _probe_bucket(probe: GradProbe, buf: torch.Tensor, index: int, group: dist.ProcessGroup):
    """DDP interceptor (see SumHookState): perturb and observe bucket `index` (`buf`: the bucket
    in the reduce dtype); in `exact` mode reduce it here and return it."""
    probe.perturb(buf)
    if not probe.measuring:
        return None
    probe.observe(buf, index * _UNIT_STRIDE)
    if probe.method != "exact":
        return None  # the hook's plain SUM all-reduce follows
    chunk = -(-buf.numel() // probe.world)
    padded = torch.zeros(chunk * probe.world, dtype=buf.dtype, device=buf.device)
    padded[: buf.numel()] = buf
    summed = probe.reduce_with_gram(padded, group).to(buf.dtype)
    gathered = torch.empty_like(padded)
    dist.all_gather(list(gathered.view(probe.world, chunk).unbind(0)), summed, group=group)
    return buf.copy_(gathered[: buf.numel()])


def install(model: torch.nn.Module, probe: GradProbe) -> None:
    """Route the model's gradient reduction through the probe (FSDP/HSDP units or DDP)."""
    if isinstance(model, DistributedDataParallel):
        model.titanlite_hook_state.interceptor = functools.partial(_probe_bucket, probe)
        return
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for i, unit in enumerate(units):
        unit.set_custom_reduce_scatter(ProbingReduceScatter(probe, i))
