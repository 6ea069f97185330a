"""What the console says at a log step: the progress line (loss, the model's loss terms, speed,
memory, ETA, the ranks' spread) and a measured step's diagnostics line. The run's closing lines
are components/summary.py's."""

from __future__ import annotations

from typing import Any

from titanlite.tools.formatting import fmt, format_duration


def progress_line(rec: dict[str, Any], total_steps: int, diag: str = "short") -> str:
    """The step line; `diag` = "short" adds the measured step's spread across ranks in plain words."""
    width = len(str(total_steps))
    parts = [
        f"step {rec['step']:>{width}}/{total_steps}",
        "loss skipped" if rec["loss"] is None else f"loss {rec['loss']:.4f}",
        *([terms_text(rec)] if rec.get("terms") else []),
        f"grad_norm {rec['grad_norm']:.3f}",
        f"lr {rec['lr']:.2e}",
        f"tok/s {rec['tokens_per_s']:,.0f}",
        f"mem {rec['memory_gib']:.2f}GiB",
    ]
    if "mfu_pct" in rec:
        parts.append(f"mfu {rec['mfu_pct']:.1f}%")
    parts.append(f"eta {format_duration(rec['eta_s'])}")
    d = rec.get("diag")
    if diag == "short" and d and rec["loss"]:
        spread = [f"loss ±{100 * d['loss_std'] / rec['loss']:.1f}%"] if "loss_std" in d else []
        spread += [f"grad norm ±{100 * d['grad_norm_cv']:.0f}%"] if "grad_norm_cv" in d else []
        parts.append(f"ranks {', '.join(spread)}")
    return " | ".join(parts)


def diagnostics_line(d: dict[str, Any]) -> str:
    noise = d.get("noise_scale_tokens")  # below zero: not measurable (components/summary.py)
    return " | ".join(
        [
            f"diag step {d['step']}",
            f"loss std {fmt(d.get('loss_std'), '.4f')} (max r{d.get('loss_max_rank', '-')})",
            f"tokens {d['tokens_min']}..{d['tokens_max']}",
            f"grad_norm cv {fmt(d.get('grad_norm_cv'), '.3f')}",
            f"cos {fmt(d.get('cos_mean_pairwise'), '.3f')} (min to mean r{d.get('cos_to_mean_min_rank', '-')} "
            f"{fmt(d.get('cos_to_mean_min'), '.3f')})",
            f"noise scale {fmt(noise if noise is None or noise > 0 else None, ',.0f')} tokens",
        ]
    )


def terms_text(rec: dict[str, Any]) -> str:
    """A row's loss terms beside its loss (the cross entropy), and what the step minimised."""
    terms = ", ".join(f"{name} {value:.4g}" for name, value in rec["terms"].items())
    return f"{terms}, total {rec['loss_total']:.4f}"
