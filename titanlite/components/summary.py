"""What the console says (rank 0): the progress line of a log step, a measured step's
diagnostics line, and the lines a run ends with (one fact each: what ran, the final loss, the
last eval, alerts, skips, the gradient noise scale, what was kept, where to look).
"""

from __future__ import annotations

import os
import shlex
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from titanlite.components.checkpoint.index import complete_steps, step_dir
from titanlite.config.job_config import JobConfig
from titanlite.diagnostics.alerts import history_note
from titanlite.tools.records import fmt, format_duration

# TensorBoard shows 1,000 points of a tag, sampled, unless told to keep more (0 keeps none).
TENSORBOARD_ALL_POINTS = "--samples_per_plugin scalars=100000"


def progress_line(rec: dict[str, Any], total_steps: int, diag: str = "short") -> str:
    """The step line; `diag` = "short" adds the measured step's spread across ranks in plain words."""
    width = len(str(total_steps))
    parts = [
        f"step {rec['step']:>{width}}/{total_steps}",
        "loss skipped" if rec["loss"] is None else f"loss {rec['loss']:.4f}",
        *([terms_text(rec)] if rec.get("terms") else []),
        *([load_text(rec["expert_load"])] if rec.get("expert_load") else []),
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


# The least gradient noise scale worth a figure: an estimate below one token says the ranks'
# gradients agree beyond their noise (the same data on every rank, say), not a batch size.
NOISE_SCALE_MIN_TOKENS = 1.0


def measurable_noise(d: dict[str, Any]) -> float | None:
    """A diagnostics record's gradient noise scale in tokens, None where there is no figure to
    show: not measured, or below NOISE_SCALE_MIN_TOKENS (summary_lines says why)."""
    noise = d.get("noise_scale_tokens")
    return noise if noise is not None and noise >= NOISE_SCALE_MIN_TOKENS else None


def diagnostics_line(d: dict[str, Any]) -> str:
    """A measured step's line; its noise scale only where measurable (measurable_noise)."""
    noise = measurable_noise(d)
    parts = [
        f"diag step {d['step']}",
        f"loss std {fmt(d.get('loss_std'), '.4f')} (max r{d.get('loss_max_rank', '-')})",
        f"tokens {d['tokens_min']}..{d['tokens_max']}",
        f"grad_norm cv {fmt(d.get('grad_norm_cv'), '.3f')}",
        f"cos {fmt(d.get('cos_mean_pairwise'), '.3f')} (min to mean r{d.get('cos_to_mean_min_rank', '-')} "
        f"{fmt(d.get('cos_to_mean_min'), '.3f')})",
    ]
    parts += [f"noise scale {noise:,.0f} tokens"] if noise is not None else []
    return " | ".join(parts)


def terms_text(rec: dict[str, Any]) -> str:
    """A row's loss terms beside its loss (the cross entropy), and what the step minimised."""
    terms = ", ".join(f"{name} {value:.4g}" for name, value in rec["terms"].items())
    return f"{terms}, total {rec['loss_total']:.4f}"


def load_text(load: dict[str, Any]) -> str:
    """A log row's expert load in a few words: the most uneven layer's largest expert share over
    its smallest (components/expert_load.py; inf: an expert of that layer got no token)."""
    worst = load["worst"]
    ratio = load["max_min"][worst]
    return f"experts max/min {'inf' if ratio is None else f'{ratio:.1f}x'} (layer {worst})"


def load_lines(rec: dict[str, Any]) -> list[str]:
    """The summary's expert load: the most and the least loaded expert of the last log step's
    window (components/expert_load.py)."""
    load = rec.get("expert_load")
    if not load:
        return []
    most, least = load["most"], load["least"]
    return [
        f"expert load at step {rec['step']} (its log window): most loaded expert {most['expert']} "
        f"of layer {most['layer']} ({100 * most['share']:.1f}% of the layer's routing slots, "
        f"{most['x_even']:.2f}x even); least loaded expert {least['expert']} of layer "
        f"{least['layer']} ({100 * least['share']:.1f}%, {least['x_even']:.2f}x even); {load_text(load)}"
    ]


@dataclass
class RunTally:
    """What the summary needs from the records rank 0 writes, kept as they are written."""

    last: dict[str, Any] | None = None  # the newest metrics record
    last_eval: dict[str, Any] | None = None
    start_eval: dict[str, Any] | None = None  # the model as loaded (eval.at_start: step 0)
    # alert name -> how many this invocation raised
    alerts: Counter = field(default_factory=Counter)
    notes: Counter = field(default_factory=Counter)  # the same for notes (batch_size_advice)
    last_diag: dict[str, Any] | None = None  # the newest measured step's diagnostics record
    skipped: int = 0  # steps skipped (no token, non-finite, a spike) by this invocation

    def record(self, rec: dict[str, Any]) -> None:
        self.last = rec
        self.skipped += rec.get("skipped_steps", 0)

    def record_eval(self, rec: dict[str, Any]) -> None:
        if rec["step"] == 0:
            self.start_eval = rec
        self.last_eval = rec


def quiet_faults(cfg: JobConfig, last: int, diag: dict[str, Any] | None) -> str | None:
    """Why a run with fault switches on that the alerts should name raised none (`last`: its last
    step; `diag`: its newest measured step's record, None if it measured none)."""
    faults = cfg.faults.diagnosed() if cfg.faults is not None else []
    if not faults:
        return None
    on = f"fault switches on ({', '.join(faults)})"
    if diag is None:
        return (
            f"{on}, but the diagnostics measured no step (they need diagnostics.enable and dp >= 2)"
        )
    world = len(diag.get("rank_loss", ()))  # the data-parallel ranks it measured
    short = history_note(cfg.alerts, cfg.diagnostics.measured_steps(last), world)
    return f"{on}: {short}" if short else f"{on}, and every alert had the history to judge"


def shown(path: Path) -> str:
    """`path` as a command line takes it: relative to the working folder when inside it."""
    absolute = Path(os.path.abspath(path))
    inside = absolute.is_relative_to(Path.cwd())
    return shlex.quote(str(absolute.relative_to(Path.cwd()) if inside else absolute))


def summary_lines(
    tally: RunTally,
    first: int,
    last: int,
    seconds: float,
    run_dir: Path,
    checkpoints: Path,
    exports: list[Path],
    tensorboard: bool,
    quiet: str | None = None,
) -> list[str]:
    """`first`..`last`: the steps this invocation ran; `checkpoints`: checkpoint.folder (its
    newest complete step is named); `exports`: what export_run wrote; `quiet`: why no alert
    fired (quiet_faults)."""
    if first > last:
        head = f"done: the checkpoint is at step {first - 1} already, the last to run; nothing ran (raise --training.steps to train on)"
    else:
        resumed = f", resumed after step {first - 1}" if first > 1 else ""
        n = last - first + 1
        head = f"done: {n} step{'s' if n != 1 else ''} ({first}-{last}{resumed}) in {seconds:.1f}s"
    lines = [f"{head}; run folder {shown(run_dir)}"]
    rec = tally.last
    if rec is not None:
        loss = "skipped" if rec["loss"] is None else f"{rec['loss']:.4f}"
        mean = fmt(rec.get("loss_window_mean"), ".4f")
        n = rec.get("loss_window_steps", 0)
        window = f" (mean over the last {n} steps {mean})" if n > 1 else ""
        lines.append(f"final loss {loss} at step {rec['step']}{window}")
        if rec.get("terms"):
            lines.append(
                f"loss terms at step {rec['step']}: {terms_text(rec)} (the loss above is the cross entropy)"
            )
        lines += load_lines(rec)
    e, e0 = tally.last_eval, tally.start_eval
    if e is not None and e0 is not None and e is not e0:
        lines.append(
            f"eval loss {e0['loss']:.4f} -> {e['loss']:.4f}, perplexity {e0['perplexity']:.2f} -> "
            f"{e['perplexity']:.2f} (the model as loaded -> at step {e['step']})"
        )
    elif e is not None:
        lines.append(
            f"eval loss {e['loss']:.4f}, perplexity {e['perplexity']:.2f} at step {e['step']}"
        )
    if tally.alerts:
        names = ", ".join(f"{name} x{k}" for name, k in sorted(tally.alerts.items()))
        lines.append(
            f"alerts: {sum(tally.alerts.values())} ({names}); each in {shown(run_dir / 'events.jsonl')}"
        )
    else:
        lines.append("alerts: none" + (f"; {quiet}" if quiet else ""))
    if tally.skipped:
        lines.append(
            f"skipped steps: {tally.skipped} (no valid token, a non-finite gradient or a spike)"
        )
    diag = tally.last_diag or {}
    noise = diag.get("noise_scale_tokens")
    if noise is not None and diag.get("batch_tokens"):
        line = f"batch {diag['batch_tokens']:,} tokens; gradient noise scale "
        if measurable_noise(diag) is not None:
            line += f"{noise:,.0f} tokens ({diag['noise_to_batch']:.2g}x the batch) at step {diag['step']}"
        else:
            line += (
                f"not measurable at step {diag['step']} (its estimate is {noise:.2g} tokens, below "
                f"{NOISE_SCALE_MIN_TOKENS:g}: the ranks' gradients agree beyond their noise, as on "
                "the same data)"
            )
        if tally.notes["batch_size_advice"]:
            line += f"; batch_size_advice in {shown(run_dir / 'events.jsonl')}"
        lines.append(line)
    steps = complete_steps(checkpoints)
    kept = [f"checkpoint {shown(step_dir(checkpoints, steps[-1]))}"] if steps else []
    kept += [f"export {shown(p)}" for p in exports]
    if kept:
        lines.append("; ".join(kept))
    look = [f"metrics {shown(run_dir / 'metrics.jsonl')}"]
    if tensorboard:
        tb = Path(sys.executable).parent / "tensorboard"
        command = shown(tb) if tb.is_file() else "tensorboard"
        look.insert(0, f"{command} --logdir {shown(run_dir / 'tb')} {TENSORBOARD_ALL_POINTS}")
    lines.append("see: " + "; ".join(look))
    return lines
