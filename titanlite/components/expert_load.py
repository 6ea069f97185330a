"""The expert load a log step reports for a mixture-of-experts model: how the routing slots of
the steps since the last log step spread over each MoE layer's experts, the figure to watch for
router collapse (a few experts taking most tokens; Fedus et al., Switch Transformers, arXiv
2101.03961, section 2.2; Zoph et al., ST-MoE, arXiv 2202.08906).

It costs no collective and no host read of its own: the step statistics (titanlite.models.step,
pattern 2) are already summed over the microbatches and ranks in the normaliser's all-reduce;
each step adds them on the device, and the log step turns the sum into per-layer figures
through the model's `expert_load` (the contract: titanlite/models/registry.py), read with the
window's one host read (components/step_window.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn

from titanlite.distributed.parallelize import unwrap
from titanlite.errors import TrainingError

# per layer, in this order: the largest share, its expert, the smallest, its expert, the
# coefficient of variation (std / mean of the shares), the number of experts
FIGURES = ("max", "argmax", "min", "argmin", "cv", "experts")


def layer_figures(shares: torch.Tensor) -> torch.Tensor:
    """[layers, E] shares -> [layers, len(FIGURES)] float64, on the device."""
    s = shares.double()
    top, top_at = s.max(-1)
    low, low_at = s.min(-1)
    mean = s.mean(-1)
    cv = s.std(-1, correction=0) / mean
    experts = torch.full_like(mean, s.shape[-1])
    return torch.stack([top, top_at.double(), low, low_at.double(), cv, experts], -1)


def load_figures(shares: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's {layer: [E] shares} -> [layers, len(FIGURES)] on the device; layers of one
    expert count in one stack, others one by one."""
    rows = list(shares.values())
    if len({r.shape for r in rows}) == 1:
        return layer_figures(torch.stack(rows))
    return torch.cat([layer_figures(r[None]) for r in rows])


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def load_record(names: list[str], figures: list[list[float]]) -> dict | None:
    """The host figures as the log row's "expert_load": per layer the largest share over the
    smallest (`max_min`; None where an expert got no routing slot) and the coefficient of
    variation (`cv`; 0 is an even spread); the layer of the largest max/min (`worst`); the most
    and least loaded expert (layer, expert, share, and the share over an even one). None when
    the window routed no token."""
    rows = [dict(zip(FIGURES, f, strict=True)) for f in figures]
    if not rows or any(not math.isfinite(r["max"]) for r in rows):
        return None
    ratio = [r["max"] / r["min"] if r["min"] > 0 else math.inf for r in rows]
    worst = max(range(len(rows)), key=lambda i: (ratio[i], rows[i]["cv"]))

    def expert(i: int, key: str) -> dict:
        share = rows[i][key]
        at = rows[i][f"arg{key}"]
        return {
            "layer": names[i],
            "expert": int(at),
            "share": share,
            "x_even": share * rows[i]["experts"],
        }

    most = max(range(len(rows)), key=lambda i: rows[i]["max"] * rows[i]["experts"])
    least = min(range(len(rows)), key=lambda i: rows[i]["min"] * rows[i]["experts"])
    return {
        "max_min": {n: _finite(x) for n, x in zip(names, ratio, strict=True)},
        "cv": {n: _finite(r["cv"]) for n, r in zip(names, rows, strict=True)},
        "worst": names[worst],
        "most": expert(most, "max"),
        "least": expert(least, "min"),
    }


class ExpertLoad:
    """The step statistics of the steps since the last log step, summed on the device, and the
    model's map from them to each MoE layer's expert shares."""

    def __init__(
        self,
        shares: Callable[[torch.Tensor], dict[str, torch.Tensor]],
        statistics: Callable[[], torch.Tensor | None],
    ) -> None:
        self._shares = shares
        self._statistics = statistics
        self._sum: torch.Tensor | None = None
        self.names: list[str] = []  # the layers of the last figures, as the model names them

    @classmethod
    def of(cls, model: nn.Module, statistics: Callable[[], torch.Tensor | None]):
        """For a model with `expert_load` (None without): `statistics` gives the step's."""
        shares = getattr(unwrap(model), "expert_load", None)
        return cls(shares, statistics) if callable(shares) else None

    def add(self) -> None:
        """After a step: its statistics join the window's sum (one device add; none without)."""
        stats = self._statistics()
        if stats is None:
            return
        self._sum = stats.clone() if self._sum is None else self._sum.add_(stats)

    def take(self) -> torch.Tensor | None:
        """The log step: the window's [layers, len(FIGURES)] on the device (None: no statistics
        in the window); the sum starts again."""
        if self._sum is None:
            return None
        total, self._sum = self._sum, None
        shares = self._shares(total)
        if (
            not isinstance(shares, dict)
            or not shares
            or not all(
                isinstance(k, str) and isinstance(v, torch.Tensor) and v.ndim == 1 and len(v)
                for k, v in shares.items()
            )
        ):
            raise TrainingError(
                "the model's expert_load returned no {layer name: [experts] shares} dict; it maps "
                "the summed step statistics to each MoE layer's shares (titanlite/models/registry.py)"
            )
        self.names = list(shares)
        return load_figures(shares)
