"""Figures of run folders (matplotlib, no display): any runs overlaid, and an invariance verdict.

Steps are whole numbers on every axis; labels say what is drawn in plain words.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from titanlite.analysis.compare import Comparison
    from titanlite.analysis.runs import Run


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _whole_steps(ax: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    lo, hi = ax.get_xlim()
    if hi - lo < 2:  # one logged step: a span of whole steps around it
        ax.set_xlim((lo + hi) / 2 - 1, (lo + hi) / 2 + 1)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")


def _series(records: dict[int, dict], key: str) -> tuple[list[int], list[float]]:
    steps = sorted(s for s, r in records.items() if r.get(key) is not None)
    return steps, [records[s][key] for s in steps]


# (title, where the values are, key); a panel no run has values for is left out.
PANELS = (
    ("training loss", "metrics", "loss"),
    ("held-out loss (eval)", "evals", "loss"),
    ("learning rate", "metrics", "lr"),
    ("gradient norm (before clipping)", "metrics", "grad_norm"),
)


DASHES = ("-", "--", ":", "-.")  # run i's line style, in turn


def plot_runs(runs: list[Run], path: Path) -> None:
    """Each run's loss, eval loss, learning rate and gradient norm against the step, overlaid."""
    plt = _pyplot()
    panels = [p for p in PANELS if any(_series(getattr(r, p[1]), p[2])[0] for r in runs)]
    cols = 2 if len(panels) > 1 else 1
    rows = (len(panels) + 1) // 2
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.6 * rows), squeeze=False)
    for ax, (title, where, key) in zip(axes.flat, panels, strict=False):
        drawn: dict[tuple, str] = {}  # a curve already drawn -> the run that drew it
        for i, run in enumerate(runs):
            steps, values = _series(getattr(run, where), key)
            if not steps:
                continue
            same = drawn.setdefault((tuple(steps), tuple(values)), run.name)
            label = run.name if same == run.name else f"{run.name} (= {same})"
            # each run's own dash, the later ones thinner: a curve equal to another's shows on it
            style = {"ls": DASHES[i % len(DASHES)], "lw": max(0.8, 2.4 - 0.5 * i)}
            ax.plot(steps, values, marker="." if len(steps) < 30 else None, label=label, **style)
        ax.set_title(title, fontsize=10)
        _whole_steps(ax)
        if key == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_invariance(comparisons: list[Comparison], path: Path) -> None:
    """Loss curves of every run (top) and each one's relative loss difference to the first
    (bottom, log scale) against the tolerance, under the verdict."""
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    ref = comparisons[0].ref
    steps, losses = _series(ref.metrics, "loss")
    top.plot(steps, losses, label=f"{ref.name} ({ref.layout})", lw=2.5)
    floor = 1e-12  # a zero difference (bitwise equal) has no logarithm: drawn at this floor
    for cmp in comparisons:
        rows = [r for r in cmp.rows if r.loss[1] is not None]
        (line,) = top.plot(
            [r.step for r in rows],
            [r.loss[1] for r in rows],
            "--",
            label=f"{cmp.other.name} ({cmp.other.layout})",
        )
        rel = [(r.step, r.rel) for r in cmp.rows if r.rel is not None]
        bottom.plot(
            [s for s, _ in rel],
            [max(v, floor) for _, v in rel],
            marker=".",
            color=line.get_color(),
            label=cmp.other.name,
        )
    first = comparisons[0]
    bottom.plot([r.step for r in first.rows], [first.rtol_at(r) for r in first.rows], color="red", ls=":",
                label=f"tolerance ({first.rtol})")  # fmt: skip
    bottom.set_yscale("log")
    bottom.set_ylabel(
        f"relative loss difference to {ref.name}\n(equal losses drawn at 1e-12)", fontsize=8
    )
    _whole_steps(bottom)
    top.set_ylabel("training loss")
    top.legend(fontsize=7)
    bottom.legend(fontsize=7)
    verdict = "PASS" if all(c.passed for c in comparisons) else "FAIL"
    top.set_title(f"{verdict}: loss curves and their relative difference to {ref.name}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
