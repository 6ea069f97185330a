"""Each rank's RNG states in a step folder (rng-rank<r>.pt), and how a resume restores them: at
the same world size each rank its own; at another, rank 0's torch state on every rank (the seed
rule of titanlite.tools.seeds: the ranks' streams are one) and every per-rank stream reseeded
from (seed, step, rank)."""

from __future__ import annotations

from pathlib import Path

import torch

from titanlite.tools.seeds import reshard_seed


def _states(generators: dict[str, torch.Generator]) -> dict[str, torch.Tensor]:
    states = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    states.update({name: g.get_state() for name, g in generators.items()})
    return states


def _set_states(states: dict[str, torch.Tensor], generators: dict[str, torch.Generator]) -> None:
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
    for name, g in generators.items():
        if name in states:
            g.set_state(states[name])


def save_rng(folder: Path, rank: int, generators: dict[str, torch.Generator]) -> None:
    torch.save(_states(generators), folder / f"rng-rank{rank}.pt")


def load_rng(
    folder: Path,
    rank: int,
    generators: dict[str, torch.Generator],
    resharded: bool,
    seed: int,
    step: int,
    per_rank_torch: bool = False,
) -> None:
    """`resharded`: the step was written at another world size. `per_rank_torch`: a seed fault
    (faults.seed_mode) gives each rank a torch stream of its own, reseeded here too."""
    if not resharded:
        _set_states(torch.load(folder / f"rng-rank{rank}.pt", weights_only=True), generators)
        return
    _set_states(torch.load(folder / "rng-rank0.pt", weights_only=True), {})
    if per_rank_torch:
        torch.manual_seed(reshard_seed(seed, step, rank, 0))
    for i, g in enumerate(generators.values()):
        g.manual_seed(reshard_seed(seed, step, rank, i + 1))
