"""Where each rank's local, unreduced gradient passes: FSDP2's reduce-scatter and DDP's comm hook.
On a measured step the probe takes the local gradient's squared norm and either its CountSketch
(`sketch`: linear, so microbatch sketches add up; the norm then comes from the sketch) or, at no
extra volume, the Gram of all ranks' local gradients (`exact`: the reduce-scatter becomes an
all-to-all, each rank sums the rows and keeps rows @ rows.T over its shard; not under HSDP, whose
reduce-scatter spans one replica). It never reads a value on the host. The sketch takes signs from
a cached +-1 table at a hashed phase per segment, with a hashed whole-segment flip, so colliding
pairs carry independent signs and the estimate keeps the CountSketch variance; k is a prime
(titanlite/diagnostics/README.md, `sketch`: LLM gradients concentrate on a few feature columns).

Under a tensor split each rank of a replica holds its slices of the split matrices (disjoint: their
inner products add over the split) and the whole gradient of what the plan replicates over it
(norm weights: the same on each of its ranks). So every rank sketches at coordinates of its own
(its place on the split, TensorSplit.offset), and the replicated parameters count on the split's
first rank only (TensorSplit.mask): a replica's row is then the sum of its ranks' rows. Where FSDP
reduces a unit alone (`reduces_alone`) the probe reads the gradient from the reduction's buffers."""

from __future__ import annotations

import functools
import logging

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo
from torch.distributed.tensor import Replicate
from torch.nn.parallel import DistributedDataParallel

from titanlite.distributed.parallelize import ReduceScatterComm, reduce_scatter

_MASK64 = (1 << 64) - 1
logger = logging.getLogger("titanlite")


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
# ... and between the ranks of a tensor split within a unit (up to 128 ranks of 8G values each)
_SPLIT_STRIDE = 1 << 33


class TensorSplit:
    """This rank's place on the axis that splits the model's tensors (`degree` 1: none): the sketch
    coordinates of its slices, and which of its gradient values it counts."""

    def __init__(self, degree: int = 1, rank: int = 0) -> None:
        self.degree, self.rank = degree, rank

    def offset(self, unit: int) -> int:
        """The sketch coordinate of the first value of `unit`'s buffer on this rank."""
        return unit * _UNIT_STRIDE + self.rank * _SPLIT_STRIDE

    def mask(self, unit: FSDPModule) -> torch.Tensor | None:
        """[row] 0 where a row of the unit's reduce-scatter input (one per rank of its group, FSDP's
        copy-in: each parameter's padded shard in turn) holds a parameter replicated over the split,
        1 elsewhere; None where this rank counts every value (no split, or its first rank)."""
        if self.degree == 1 or self.rank == 0:
            return None
        parts = []
        for group in unit._get_fsdp_state()._fsdp_param_groups:
            for fp in group.fsdp_params:
                spec = getattr(fp, "_unsharded_dtensor_spec", None)
                replicated = spec is not None and all(
                    isinstance(p, Replicate) for p in spec.placements
                )
                n = fp.padded_sharded_param_size.numel()
                parts.append(torch.full((n,), 0.0 if replicated else 1.0))
        return torch.cat(parts) if parts else None


class GradProbe:
    """`world`: the ranks of the diagnostics' group (every rank); the Gram is indexed by global rank.
    `split`: this rank's place on a tensor split (module doc)."""

    def __init__(
        self,
        method: str,
        world: int,
        sketch_dim: int,
        seed: int,
        device: torch.device,
        split: TensorSplit | None = None,
    ):
        self.method = method
        self.world = world
        self.split = split or TensorSplit()
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

    def observe(self, local: torch.Tensor, offset: int, mask: torch.Tensor | None = None) -> None:
        """Account for one flat piece of this rank's local gradient (`mask`: TensorSplit.mask's,
        applied to each of its equal rows)."""
        flat = local.reshape(-1).float()
        if mask is not None:
            flat = (flat.view(-1, mask.numel()) * mask).reshape(-1)
        if not self.per_microbatch:
            self.norm_sq += sum_of_squares(flat)
        if self.method == "sketch":
            self.countsketch.add_(self.sketch, flat, offset)

    def reduce_with_gram(
        self, padded: torch.Tensor, group: dist.ProcessGroup, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """All-to-all of `padded` (one equal chunk per rank of `group`); returns this rank's
        summed chunk."""
        recv = torch.empty_like(padded)
        dist.all_to_all_single(recv, padded, group=group)
        return self.sum_with_gram(recv, _global_ranks(group, recv.device), mask)

    def sum_with_gram(
        self,
        received: torch.Tensor,
        ranks: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The device work on every rank's copy of this rank's shard (one row per rank of the
        reducing group): their sum, and the partial Gram matrix added up at the rows' global
        ranks (`ranks`; None: the group is every rank, in order)."""
        rows = received.view(ranks.numel() if ranks is not None else self.world, -1).float()
        counted = rows if mask is None else rows * mask
        partial = (counted @ counted.T).double()
        if ranks is None:
            self.gram += partial
        else:
            self.gram.index_put_((ranks[:, None], ranks[None, :]), partial, accumulate=True)
        return rows.sum(0)


_ROW = 4096  # values per float32 partial sum of sum_of_squares


def sum_of_squares(flat: torch.Tensor) -> torch.Tensor:
    """float64 |flat|^2 of a float32 vector: float32 sums of rows of _ROW values, added in float64.
    One float32 dot over millions of values is off by about 5e-6 relative, which the noise scale,
    a difference of such norms, would multiply; this is within 2e-9, at about a dot's cost."""
    n = flat.numel() // _ROW * _ROW
    rows = flat[:n].view(-1, _ROW)
    tail = flat[n:]
    return torch.linalg.vecdot(rows, rows).double().sum() + torch.dot(tail, tail).double()


@functools.cache
def _global_ranks(group: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
    """The global ranks of a group, in its order: where its rows go in the [world, world] Gram."""
    return torch.tensor(dist.get_process_group_ranks(group), device=device)


def reduces_alone(unit: FSDPModule) -> bool:
    """Whether the unit's reduce-scatter spans this rank alone, so that FSDP calls no
    reduce-scatter and all-reduces the gradient itself: HSDP with shards of one rank, and
    torch's FSDP-based replicate (DDP with a tensor split)."""
    mesh_info = unit._get_fsdp_state()._fsdp_param_groups[0].mesh_info
    return not isinstance(mesh_info, FSDPMeshInfo) or mesh_info.shard_mesh_size == 1


class ProbingReduceScatter(ReduceScatterComm):
    """FSDP2 custom reduce-scatter (see FSDPModule.set_custom_reduce_scatter). Where the unit
    reduces alone (reduces_alone) FSDP never calls it, but it still allocates the reduction's
    buffers through it: the input, into which FSDP then copies the local gradient, and then the
    output, which FSDP all-reduces. So the second allocation of each reduction reads the first
    (`sketch` only: the Gram would need the reduction itself; tests/test_diagnostics.py holds
    FSDP to this order)."""

    def __init__(self, probe: GradProbe, unit: int, module: FSDPModule | None = None) -> None:
        self.probe = probe
        self.offset = probe.split.offset(unit)
        self.module = module  # the unit, for TensorSplit.mask
        self._mask: torch.Tensor | None = None
        self._mask_for: int | None = None  # the input size the mask was built for
        self.alone = module is not None and reduces_alone(module)
        self._filled: torch.Tensor | None = None  # alone: this reduction's input, once allocated

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buf = super().allocate(size, dtype=dtype, device=device)
        if self.alone:
            if self._filled is None:
                self._filled = buf  # the input: FSDP copies the local gradient in next
            else:
                local, self._filled = self._filled, None
                self.probe.perturb(local)
                if self.probe.measuring:
                    self.probe.observe(local, self.offset, self.mask(local, 1))
        return buf

    def mask(self, input_tensor: torch.Tensor, ranks: int) -> torch.Tensor | None:
        """TensorSplit.mask for this input (`ranks` rows), built once per input size. The input
        holds the parameters that have a gradient: if one has none (frozen, or unused this
        step) the mask does not fit, and every value counts, with a warning."""
        if self.module is None or self.probe.split.degree == 1 or self.probe.split.rank == 0:
            return None
        if self._mask_for != input_tensor.numel():
            mask = self.probe.split.mask(self.module)
            if mask is not None and mask.numel() * ranks != input_tensor.numel():
                logger.warning(
                    "diagnostics: a unit's gradient buffer does not hold every parameter (one has no "
                    "gradient); its parameters replicated over the tensor split count on each rank"
                )
                mask = None
            self._mask = None if mask is None else mask.to(input_tensor.device)
            self._mask_for = input_tensor.numel()
        return self._mask

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        probe = self.probe
        probe.perturb(input_tensor)
        if probe.measuring:
            mask = self.mask(input_tensor, group.size())
            probe.observe(input_tensor, self.offset, mask)
            if probe.method == "exact":
                output_tensor.copy_(probe.reduce_with_gram(input_tensor, group, mask))
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
    world = group.size()
    chunk = -(-buf.numel() // world)
    padded = torch.zeros(chunk * world, dtype=buf.dtype, device=buf.device)
    padded[: buf.numel()] = buf
    summed = probe.reduce_with_gram(padded, group).to(buf.dtype)
    gathered = torch.empty_like(padded)
    dist.all_gather(list(gathered.view(world, chunk).unbind(0)), summed, group=group)
    return buf.copy_(gathered[: buf.numel()])


def install(model: torch.nn.Module, probe: GradProbe) -> None:
    """Route the model's gradient reduction through the probe (FSDP/HSDP units or DDP)."""
    if isinstance(model, DistributedDataParallel):
        model.titanlite_hook_state.interceptor = functools.partial(_probe_bucket, probe)
        return
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for i, unit in enumerate(units):
        unit.set_custom_reduce_scatter(ProbingReduceScatter(probe, i, unit))
