#!/usr/bin/env python3
"""Run a healthy baseline and each fault-injection switch, and tabulate what the diagnostics saw.

    ./scripts/diagnose_scenarios.py --quick [--out DIR]
    ./scripts/diagnose_scenarios.py [--dp 4] [--steps 30] [--onset S] [--config C] [--out DIR]
                                         [--scenarios NAME ...] [--section.key value ...]
    ./scripts/diagnose_scenarios.py --replay DIR [--alerts.key value ...] [--keep FILE.json.xz]
                                         [--figures FILE.json] [--healthy-figures FILE.json]

Scenarios (train_configs/debug_model.toml by default: debug Llama, built-in pretraining data,
whose packed sequences give every rank the same token count, so a rank's loss is comparable;
[faults] switches, see titanlite/faults/switches.py):
    healthy          no fault
    healthy_sft      no fault, built-in SFT data (unequal token counts), 2 microbatches per rank
    same_data        every rank reads rank 0's share
    corrupt_labels   rank dp/2's labels shuffled within each sequence, from step --onset
    grad_noise       rank 1's local gradient gets noise of 10x its RMS before the reduction, from --onset
    slow_rank        rank dp-1's data loading takes twice its step time more, from --onset (a straggler)
    replica_flip     DDP, replicas compared every step; one bit of rank dp-1's weights flips at step 5
    stuck_loader     from step 5, rank dp-1's loader hands out step 5's batch again and again
    S1-1/S1-2/S1-3   dropout 0.1 with the seed settings of "Silent Inconsistency in Data-Parallel
                     Full Fine-Tuning" (arXiv 2602.14462): shared / rank 0 differs / per rank
--quick: every fault at dp=2, 60 steps, the ongoing faults from step 40 (shuffled labels hurt only
once the model has learned something), each run stopped at its first alert, beside one healthy
run (the long false-alarm runs are in titanlite/diagnostics/README.md): every fault named, with
its rank, in minutes (the README gives the time measured).
One torchrun at --dp ranks runs them one after another in one process group (a run folder each
under --out), every step measured, at least 2 sequences per rank per step (the global batch is
raised to 2 x dp where the config's is smaller: the per-sample rank test needs 2 at dp=8).
--onset (default: half the steps) is when the ongoing faults start, after a healthy stretch
that the rules comparing a rank with its own history need. Then a table, scenario x (global loss
and its step-to-step jitter, loss dispersion, token dispersion, grad-norm CV, mean pairwise
cosine, lowest per-rank cosine to the other ranks' sum and which rank, the per-sample rank test's
largest |Z|, the latest rank's lateness, the rank with the highest loss, alerts), averaged over
the measured steps after the first 5; written with a plot to --out (scenarios.json, which also
holds the largest rise of a rank's gradient noise over its own history and the others',
noise_rise_max; scenarios.png), and each run's gradient noise scale over its batch, step by step,
with the batch-size advice (noise_scale.png).
Overrides apply to every scenario (e.g. --diagnostics.on_alert stop: a run ends at its first
alert, which the table shows); one of a setting the script or a scenario fixes (a scenario's own
switches, the fitted batch, the steps, --quick's) is refused in one line naming what fixes it, and
the table's head names the settings the runs ran at where they differ from the config's. --quick
with --scenarios runs those beside the healthy run (said in one line when not asked for).

A second table, detection: per fault, the alert that names it (and the rank(s) at fault), the
step it started, the step that alert first fired and the steps in between; every other alert is
listed as other (in a healthy scenario, a false alarm). --figures FILE.json also writes it into
FILE.json under this dp, beside the dps FILE.json already holds: scripts/figures/diagnose_scenarios-*.json,
which titanlite/diagnostics/README.md's detection table renders (detection_markdown).
--healthy-figures FILE.json writes the runs of healthy and healthy_sft into FILE.json the same
way, a dp at a time: their alerts, each rule's closest call with the value that fires it (the
rank test's largest |Z|, the largest noise rise over a rank's own history, the rank latest at
the step's start, how often and by how much) and the batch-size advice, or the ratio it watches
at its farthest from 1 when it gave none: scripts/figures/diagnose_healthy-*.json, which the
README's table of false alarms over long healthy runs renders (healthy_markdown).

--replay DIR: no training; the tables again (and replayed.json, replayed.png, noise_scale.png) from DIR's run
folders, with the alerts that today's rules (and the --alerts overrides given; any other is refused) raise on each
run's recorded diagnostics.jsonl:
how thresholds are tuned on a long run recorded once. replica_drift is kept from events.jsonl
(the replica hashes are not recorded).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections import Counter
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from titanlite.tools.venv import use_project_venv  # noqa: E402

use_project_venv()  # any python3 will do: without titanlite's dependencies it re-executes in .venv

from titanlite.analysis.settings import Fixes  # noqa: E402
from titanlite.components.run.torchrun import MAX_RANKS  # noqa: E402
from titanlite.config.manager import moved_keys, words  # noqa: E402
from titanlite.diagnostics.scenarios import detection, expected, scenarios  # noqa: E402
from titanlite.errors import UserError  # noqa: E402
from titanlite.tools.cli import Script  # noqa: E402
from titanlite.tools.records import read_json, read_records  # noqa: E402

SKIP = 5  # the first measured steps: ranks agree strongly while the model learns anything


def scenario_argv(args, name: str, overrides: list[str]) -> list[str]:
    """The trainer's arguments for one scenario (the global batch held, the local batch fitted)."""
    from titanlite.config import parse_args
    from titanlite.config.layout import fitting_local_batch

    argv = [
        "--config",
        str(args.config),
        "--training.steps",
        str(args.steps),
        "--metrics.log_every",
        "1",
    ]
    argv += [
        "--diagnostics.measure_first",
        str(args.steps),
        *overrides,
        *scenarios(args.dp, args.onset)[name],
    ]
    cfg, _ = parse_args(argv)
    if cfg.training.global_batch_size < 2 * args.dp:
        argv += ["--training.global_batch_size", str(2 * args.dp)]
        cfg, _ = parse_args(argv)
    argv += ["--training.local_batch_size", str(fitting_local_batch(cfg, args.dp))]
    return [*argv, "--job.dump_folder", str(args.out), "--job.run_name", name]


def progress(out: Path, names: list[str], steps: int):
    """What the runs are at, from their run folders (their output is kept for the tables): the
    scenario running and its last logged step."""

    def say(seconds: float) -> None:
        started = [n for n in names if (out / n / "metrics.jsonl").is_file()]
        if not started:
            print(
                f"diagnose_scenarios: starting the {len(names)} run(s) ({seconds:.0f}s)",
                file=sys.stderr,
                flush=True,
            )
            return
        rows = read_records(out / started[-1] / "metrics.jsonl")
        step = max((r["step"] for r in rows if "step" in r), default=0)
        print(
            f"diagnose_scenarios: run {len(started)}/{len(names)} ({started[-1]}) at step {step}/{steps} "
            f"({seconds:.0f}s)",
            file=sys.stderr,
            flush=True,
        )

    return say


def worker(args, overrides: list[str]) -> None:
    from titanlite.analysis import harness
    from titanlite.errors import TrainingError

    def train(name: str, trainer) -> dict:
        try:
            trainer.train()
        except TrainingError as e:
            return {"stopped": str(e)}
        return {"stopped": None}

    status = harness.trainers(
        ((n, scenario_argv(args, n, overrides)) for n in args.scenarios), train
    )
    if harness.is_first_rank():
        (args.out / "status.json").write_text(json.dumps(status))
    harness.finish()


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def _most(values: list) -> tuple[int | None, float]:
    """The most frequent value and its share."""
    values = [v for v in values if v is not None]
    if not values:
        return None, 0.0
    top, n = Counter(values).most_common(1)[0]
    return top, n / len(values)


def _argmin_live(values: list) -> tuple[int | None, float | None]:
    live = [(v, r) for r, v in enumerate(values) if v is not None]
    return (min(live)[1], min(live)[0]) if live else (None, None)


def _read(run_dir: Path, name: str) -> list[dict]:
    return read_records(run_dir / name)


def _lateness(rec: dict) -> tuple | None:
    """The latest rank at the step's start: (rank, seconds, share of the step, ...), as
    titanlite/diagnostics/stragglers.py's lateness gives it, or None without the times."""
    from titanlite.diagnostics.registry import point
    from titanlite.diagnostics.stragglers import lateness

    p = point(rec)
    return lateness(p) if p else None


def _late_share(rec: dict) -> float | None:
    """How much later than the others' median the latest rank reached the step's start, as a share
    of the step (titanlite/diagnostics/stragglers.py), or None without the times."""
    late = _lateness(rec)
    return late[2] if late else None


def _latest_rank(records: list[dict]) -> tuple[int | None, float, float | None]:
    """The rank latest at the step's start most often, its share of the steps, and its median
    lateness over those steps as a share of the step (slow_rank's figures)."""
    lates = [x for x in map(_lateness, records) if x is not None]
    rank, share = _most([x[0] for x in lates])
    return rank, share, statistics.median(x[2] for x in lates if x[0] == rank) if lates else None


def _advice_median(records: list[dict]) -> float | None:
    """batch_size_advice's statistic at its farthest from 1 (either way): the median, over its
    advice_steps measured steps, of B_simple over the batch's mean tokens
    (titanlite/diagnostics/rules.py batch_advice)."""
    from titanlite.config.job_config import Alerts
    from titanlite.diagnostics.rules import batch_advice

    cfg, best, kept = Alerts(), None, {"ratios": [], "tokens": [], "advised_ratio": 0.0}
    for rec in records:
        batch_advice(kept, rec, cfg, 1)
        if len(kept["ratios"]) == cfg.advice_steps:
            m = statistics.median(kept["ratios"])
            best = m if best is None or abs(math.log(m)) > abs(math.log(best)) else best
    return best


def _rank_test_max(records: list[dict]) -> float | None:
    """The largest |Z| of the per-sample rank test over the run (titanlite/diagnostics/rank_sum.py)."""
    from titanlite.config.job_config import Alerts
    from titanlite.diagnostics.rank_sum import rank_scores, window_score

    window, scores, best = Alerts().rank_test_window, [], None
    for rec in records:
        losses = [
            [x["loss"] for x in rank if x.get("loss") is not None]
            for rank in rec.get("rank_samples") or []
        ]
        scores = [*scores, rank_scores(losses)][-window:] if losses else scores
        for r in range(len(scores[-1]) if scores else 0):
            z = window_score([s[r] for s in scores])
            best = abs(z) if z is not None and (best is None or abs(z) > best) else best
    return best


def _noise_rise_max(records: list[dict]) -> float | None:
    """The largest rise of a rank's gradient noise per token over its own history and over the
    other ranks' (faulty_worker's own-history rule, titanlite/diagnostics/rules.py), as a factor."""
    from titanlite.config.job_config import Alerts
    from titanlite.diagnostics.registry import Window, point
    from titanlite.diagnostics.rules import noise_rises

    cfg, pts, best = Alerts(), [], None
    for rec in records:
        p = point(rec)
        pts = [*pts, p][-cfg.window :] if p else pts
        if len(pts) < cfg.window:
            continue
        rises = noise_rises(
            Window(cfg, pts[-1], pts[:-1], [], 0, len(rec["rank_loss"]), lambda *_: False)
        )
        for r, x in enumerate(rises):
            others = [y for j, y in enumerate(rises) if j != r and y is not None]
            if x is not None and others:
                rise = min(x, x - statistics.median(others))
                best = rise if best is None or rise > best else best
    return math.exp(best) if best is not None else None


def summarize(
    run_dir: Path, stopped: str | None, want=None, alerts: list[dict] | None = None
) -> dict:
    """One scenario's row from its run folder; `alerts`: replayed ones instead of events.jsonl's."""
    metrics = _read(run_dir, "metrics.jsonl")
    diag = [
        d
        for d in _read(run_dir, "diagnostics.jsonl")
        if d["step"] > SKIP and d.get("loss_std") is not None
    ]
    events = _read(run_dir, "events.jsonl") if alerts is None else alerts
    losses = [m["loss"] for m in metrics if m.get("loss") is not None]
    # A faulty rank's own gradient can dominate the mean and look aligned with it: compare each
    # rank with the sum of the others instead.
    lows = [_argmin_live(d.get("rank_cos_to_others") or []) for d in diag]
    low_rank, low_share = _most([r for r, _ in lows])
    max_rank, max_share = _most([d.get("loss_max_rank") for d in diag])
    latest, latest_share, latest_late = _latest_rank(diag)
    return {
        "late_share": _mean([_late_share(d) for d in diag]),
        "latest_rank": latest,
        "latest_rank_share": latest_share,
        "latest_late_share": latest_late,
        "rank_test_max": _rank_test_max(records := _read(run_dir, "diagnostics.jsonl")),
        "noise_rise_max": _noise_rise_max(records),
        "advice_median": _advice_median(records),
        "steps": metrics[-1]["step"],
        "stopped": stopped,
        "loss_final": losses[-1],
        "loss_jitter": statistics.pstdev([b - a for a, b in zip(losses, losses[1:], strict=False)])
        if len(losses) > 2
        else None,
        "loss_std": _mean([d["loss_std"] for d in diag]),
        "tokens_std": _mean([d.get("tokens_std") for d in diag]),
        "grad_norm_cv": _mean([d.get("grad_norm_cv") for d in diag]),
        "cos_mean": _mean([d.get("cos_mean_pairwise") for d in diag]),
        "cos_to_others_min": _mean([v for _, v in lows]),
        "cos_min_rank": low_rank,
        "cos_min_rank_share": low_share,
        "loss_max_rank": max_rank,
        "loss_max_rank_share": max_share,
        "alerts": (
            alerts := [
                {"name": e["name"], "step": e["step"], "ranks": e["ranks"]}
                for e in events
                if e.get("level", "alert") == "alert"
            ]
        ),
        # notes (batch_size_advice): information, not alerts
        "notes": [
            {"name": e["name"], "step": e["step"], **e["values"]}
            for e in events
            if e.get("level") == "info"
        ],
        **detection(alerts, want),
    }


COLUMNS = [
    ("loss_final", "loss", ".3f"),
    ("loss_jitter", "jitter", ".3f"),
    ("loss_std", "loss std", ".4f"),
    ("tokens_std", "tok std", ".1f"),
    ("grad_norm_cv", "gnorm CV", ".3f"),
    ("cos_mean", "cos mean", ".3f"),
    ("cos_to_others_min", "min cos→rest", ".3f"),
    ("rank_test_max", "max rank |Z|", ".1f"),
    ("late_share", "late %", ".1%"),
]


def table(rows: dict[str, dict]) -> str:
    from titanlite.tools.records import fmt

    head = f"{'scenario':<16}{'steps':>6}" + "".join(f"{t:>14}" for _, t, _ in COLUMNS)
    head += f"{'low-cos rank':>14}{'top-loss rank':>15}  alerts"
    lines = [head]
    for name, r in rows.items():
        cells = "".join(f"{fmt(r[k], f):>14}" for k, _, f in COLUMNS)
        low = (
            f"{r['cos_min_rank']} ({100 * r['cos_min_rank_share']:.0f}%)"
            if r["cos_min_rank"] is not None
            else "-"
        )
        top = (
            f"{r['loss_max_rank']} ({100 * r['loss_max_rank_share']:.0f}%)"
            if r["loss_max_rank"] is not None
            else "-"
        )
        alerts = (
            ", ".join(f"{a['name']}@{a['step']}{a['ranks'] or ''}" for a in r["alerts"]) or "none"
        )
        if r["stopped"]:
            alerts += " (stopped)"
        lines.append(f"{name:<16}{r['steps']:>6}{cells}{low:>14}{top:>15}  {alerts}")
    return "\n".join(lines)


def detection_table(rows: dict[str, dict]) -> str:
    lines = [
        f"{'scenario':<16}{'expected alert (ranks)':<30}{'onset':>6}{'fired':>7}{'steps':>7}  other alerts"
    ]
    for name, r in rows.items():
        wrong = (
            ", ".join(f"{a['name']}@{a['step']}{a['ranks'] or ''}" for a in r["other_alerts"])
            or "none"
        )
        cells = [r["onset"], r["detected_step"], r["steps_to_detection"]]
        shown = "".join(
            f"{'-' if v is None else v:>{w}}" for v, w in zip(cells, (6, 7, 7), strict=True)
        )
        missed = " (not detected)" if r["onset"] is not None and r["detected_step"] is None else ""
        lines.append(f"{name:<16}{r['expected']:<30}{shown}  {wrong}{missed}")
    return "\n".join(lines)


DETECTION = ("expected", "onset", "detected_step", "steps_to_detection", "other_alerts")


def _write_dp(path: Path, flag: str, dp: int, entry: dict) -> None:
    """One dp's entry into the figures file `path`, beside the other dps it already holds."""
    figures = read_json(path, f"a figures file {flag} wrote") if path.is_file() else {}
    figures["source"] = (
        f"scripts/diagnose_scenarios.py {flag}: each dp's entry from the runs its own source names"
    )
    runs = figures.get("dp", {})
    runs[str(dp)] = entry
    figures["dp"] = dict(sorted(runs.items(), key=lambda kv: int(kv[0])))
    path.write_text(json.dumps(figures, indent=1) + "\n")
    print(f"figures (dp={dp}): {path}")


def write_figures(path: Path, rows: dict[str, dict], dp: int, onset: int, source: str) -> None:
    """--figures: this dp's detection per scenario (DETECTION, as scenarios.json holds it) into the
    figures file `path`, beside the other dps it already holds (detection_markdown renders it)."""
    entry = {
        "source": source,
        "steps": max(r["steps"] for r in rows.values()),
        "onset": onset,
        "scenarios": {name: {k: r[k] for k in DETECTION} for name, r in rows.items()},
    }
    _write_dp(path, "--figures", dp, entry)


HEALTHY = {"healthy": "pretraining", "healthy_sft": "SFT"}  # the scenarios --healthy-figures keeps
# what it keeps of each (summarize's keys); alerts and advice as the table shows them
HEALTHY_KEYS = ("steps", "rank_test_max", "noise_rise_max", "latest_rank", "latest_rank_share")
HEALTHY_KEYS += ("latest_late_share", "advice_median")


def write_healthy_figures(
    path: Path, rows: dict[str, dict], dp: int, source: str, folder: Path, overrides: list[str]
) -> None:
    """--healthy-figures: this dp's healthy runs (HEALTHY) into the figures file `path`, beside the
    other dps it holds, with the values that fire the rules under the [alerts] config their
    alerts were raised (or replayed) with (healthy_markdown renders it)."""
    from titanlite.config import parse_args
    from titanlite.diagnostics.rank_sum import threshold

    runs = {name: rows[name] for name in HEALTHY if name in rows}
    if not runs:
        raise UserError(
            f"--healthy-figures keeps the scenarios {' and '.join(HEALTHY)}; these runs hold neither"
        )
    cfg = parse_args(["--config", str(folder / next(iter(runs)) / "config.toml"), *overrides])[
        0
    ].alerts
    entry = {
        "source": source,
        "steps": max(r["steps"] for r in runs.values()),
        "thresholds": {
            "rank_test_z": threshold(cfg.rank_test_alpha, dp),
            "noise_rise": cfg.norm_outlier_factor,
            "slow_margin": cfg.slow_margin,
            "advice_ratio": cfg.advice_ratio,
        },
        "scenarios": {
            name: {
                **{k: r[k] for k in HEALTHY_KEYS},
                "alerts": [{"name": a["name"], "step": a["step"]} for a in r["alerts"]],
                "advice": [
                    {"step": n["step"], "suggested_global_batch": n["suggested_global_batch"]}
                    for n in r["notes"]
                    if n["name"] == "batch_size_advice"
                ],
            }
            for name, r in runs.items()
        },
    }
    _write_dp(path, "--healthy-figures", dp, entry)


def _setting(name: str, flag: str) -> str:
    """A scenario's value of one trainer override (titanlite/diagnostics/scenarios.py)."""
    argv = scenarios(2)[name]
    return argv[argv.index(flag) + 1]


def _detected(d: dict | None) -> str:
    if d is None:
        return "-"  # not run at this dp
    cell = "not named" if d["steps_to_detection"] is None else str(d["steps_to_detection"])
    other = ", ".join(f"`{a['name']}` at step {a['step']}" for a in d["other_alerts"])
    return f"{cell} (also {other})" if other else cell


def detection_markdown(figures: dict) -> str:
    """The diagnostics README's detection table from a figures file that --figures writes
    (scripts/figures/diagnose_scenarios-*.json): per fault, the alert that names it and, per dp,
    the steps from the fault's first step to that alert, both included, with any other alert."""
    faults = [
        (("same_data",), "every rank reads rank 0's share"),
        (("corrupt_labels",), "one rank's labels shuffled"),
        (
            ("grad_noise",),
            f"one rank's gradient + {_setting('grad_noise', '--faults.grad_noise_scale')}x its RMS in noise",
        ),
        (
            ("slow_rank",),
            f"one rank's steps {_setting('slow_rank', '--faults.slow_factor')}x as long",
        ),
        (("replica_flip",), "one bit of one rank's weights"),
        (("stuck_loader",), "one rank's loader stuck on a batch"),
        (("S1-2", "S1-3"), "per-rank shuffle seeds, S1-2 / S1-3"),
    ]
    dps = sorted(figures["dp"], key=int)
    runs = [figures["dp"][dp]["scenarios"] for dp in dps]
    lines = ["| fault (first step) | alert | " + " | ".join(f"dp={dp}" for dp in dps) + " |"]
    lines.append("| --- " * (2 + len(dps)) + "|")
    for names, what in faults:
        found = [run[n] for run in runs for n in names if n in run]
        if not found:
            continue
        onsets = " / ".join(dict.fromkeys(str(d["onset"]) for d in found))
        alerts = " / ".join(dict.fromkeys(f"`{d['expected'].split()[0]}`" for d in found))
        cells = [" / ".join(_detected(run.get(n)) for n in names) for run in runs]
        lines.append(f"| {what} ({onsets}) | {alerts} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _healthy_row(dp: str, what: str, r: dict, t: dict, first: dict | None) -> str:
    """One row of healthy_markdown; `first`: the first row's thresholds (None: this is the first
    row, which says what the figures are and every threshold; later rows repeat one that differs)."""
    new = {k: first is None or v != first[k] for k, v in t.items()}
    alerts = ", ".join(f"`{a['name']}` at step {a['step']}" for a in r["alerts"]) or "none"
    z = "-" if r["rank_test_max"] is None else f"{r['rank_test_max']:.2f}"
    z += f" ({'fires past ' if first is None else ''}{t['rank_test_z']:.2f})"
    rise = "-" if r["noise_rise_max"] is None else f"{r['noise_rise_max']:.2f}x"
    rise += f" ({t['noise_rise']:g}x)" if new["noise_rise"] else ""
    late = "-"
    if r["latest_rank"] is not None:
        steps, step = (" of steps", " of a step") if first is None else ("", "")
        late = f"rank {r['latest_rank']} in {r['latest_rank_share']:.0%}{steps}, by {r['latest_late_share']:.1%}{step}"
        late += f" ({t['slow_margin']:.0%})" if new["slow_margin"] else ""
    advice = ", ".join(f"{a['suggested_global_batch']} at step {a['step']}" for a in r["advice"])
    if not advice:
        m, band = r["advice_median"], t["advice_ratio"]
        where = "inside" if m is not None and 1 / band < m < band else "outside"
        advice = "none" if m is None else f"none: {m:.1f}x at the median, {where} the band"
    return f"| dp={dp} {what} | {alerts} | {z} | {rise} | {late} | {advice} |"


def healthy_markdown(figures: dict) -> str:
    """The diagnostics README's table of false alarms over long healthy runs from a figures file
    that --healthy-figures writes (scripts/figures/diagnose_healthy-*.json): per dp and healthy
    run, its alerts and each rule's closest call against the value that fires it."""
    lines = [
        "| recording | alerts | rank test, largest \\|Z\\| | noise rise over own history "
        "| latest rank at the step's start | `batch_size_advice` (global batch, sequences) |",
        "| --- " * 6 + "|",
    ]
    first = None
    for dp in sorted(figures["dp"], key=int):
        run = figures["dp"][dp]
        for name, what in HEALTHY.items():
            if name in run["scenarios"]:
                lines.append(
                    _healthy_row(dp, what, run["scenarios"][name], run["thresholds"], first)
                )
                first = first or run["thresholds"]
    return "\n".join(lines) + "\n"


def notes_table(rows: dict[str, dict]) -> str:
    """The batch-size advice each run was given (titanlite/diagnostics/rules.py batch_advice)."""
    lines = [
        f"{name:<16}step {n['step']}: noise scale {n['noise_scale_tokens']:,.0f} tokens, batch {n['batch_tokens']:,.0f} "
        f"tokens -> --training.global_batch_size {n['suggested_global_batch']}"
        for name, r in rows.items()
        for n in r["notes"]
    ]
    return "\n\nbatch_size_advice\n" + "\n".join(lines) if lines else ""


def plot(rows: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("loss_jitter", "global loss: step-to-step jitter"),
        ("loss_std", "loss dispersion (std over ranks)"),
        ("loss_max_rank_share", "share of steps the top-loss rank is on top"),
        ("grad_norm_cv", "gradient-norm CV over ranks"),
        ("cos_mean", "mean pairwise gradient cosine"),
        ("cos_to_others_min", "lowest rank's cosine to the others"),
        ("rank_test_max", "per-sample rank test: largest |Z|"),
        ("late_share", "latest rank at the step's start: share of a step"),
    ]
    fig, axes = plt.subplots(2, 4, figsize=(14, 6.5))
    names = list(rows)
    colors = ["tab:green" if not rows[n]["alerts"] else "tab:red" for n in names]
    for ax, (key, title) in zip(axes.flat, panels, strict=True):
        ax.bar(range(len(names)), [rows[n][key] or 0.0 for n in names], color=colors)
        ax.set_title(title, fontsize=9)
        ax.set_xticks(range(len(names)), names, rotation=45, fontsize=7)
    fig.suptitle(
        "fault scenarios: what the diagnostics measure (red: an alert was raised)", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_noise_scale(out: Path, rows: dict[str, dict], path: Path) -> None:
    """Each run's gradient noise scale over its batch, measured step by measured step, with the
    band the batch-size advisor leaves alone and the steps it advised at."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from titanlite.config.job_config import Alerts

    r = Alerts().advice_ratio
    fig, ax = plt.subplots(figsize=(8, 4))
    for name in rows:
        recs = [
            d for d in _read(out / name, "diagnostics.jsonl") if (d.get("noise_to_batch") or 0) > 0
        ]
        line = ax.plot(
            [d["step"] for d in recs], [d["noise_to_batch"] for d in recs], lw=0.8, label=name
        )
        for n in rows[name]["notes"]:
            ax.plot(
                n["step"],
                n["noise_scale_tokens"] / n["batch_tokens"],
                "o",
                color=line[0].get_color(),
            )
    advised = sum(len(row["notes"]) for row in rows.values())
    ax.axhspan(1 / r, r, color="tab:gray", alpha=0.15, label=f"no advice (1/{r:g} to {r:g})")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("B_simple / global batch (a ratio of tokens)")
    said = (
        f"dots: the {advised} batch_size_advice note(s)"
        if advised
        else "no batch_size_advice in these runs"
    )
    ax.set_title(f"gradient noise scale over the batch ({said})", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


SCENARIOS = tuple(scenarios(2))
DEFAULT_DP, DEFAULT_STEPS = 4, 30
QUICK_DP, QUICK_STEPS, QUICK_ONSET = 2, 60, 40  # --quick
QUICK_OVERRIDES = ["--diagnostics.on_alert", "stop", "--metrics.enable_tensorboard", "false"]


def quick_settings(args) -> None:
    """--quick's dp, steps and onset (a different one asked beside it is refused), and its
    scenarios: the ones asked, else every fault, with the healthy run beside them (said when it
    was not asked for)."""
    quick = {"--dp": QUICK_DP, "--steps": QUICK_STEPS, "--onset": QUICK_ONSET}
    given = {"--dp": args.dp, "--steps": args.steps, "--onset": args.onset}
    differ = [f"{flag} {v}" for flag, v in given.items() if v is not None and v != quick[flag]]
    if differ:
        fixed = " ".join(f"{flag} {v}" for flag, v in quick.items())
        raise UserError(f"--quick runs at {fixed}; drop {' '.join(differ)}, or drop --quick")
    args.dp, args.steps, args.onset = QUICK_DP, QUICK_STEPS, QUICK_ONSET
    asked = args.scenarios or [n for n, fault in expected(QUICK_DP, QUICK_ONSET).items() if fault]
    if "healthy" not in asked:
        print(
            "diagnose_scenarios: --quick adds the healthy run: the baseline each fault's bars "
            "stand beside in scenarios.png and the tables",
            file=sys.stderr,
            flush=True,
        )
    args.scenarios = [n for n in SCENARIOS if n in asked or n == "healthy"]


def settings(args, overrides: list[str]) -> tuple[list, str]:
    """Every scenario's config (its run's), each of the user's overrides (args.overrides) honoured
    in every one or refused in one line; and what they ran at where it differs from the config,
    for the table's head. `overrides`: the user's and --quick's."""
    from titanlite.config import parse_args

    runs = [parse_args(scenario_argv(args, name, overrides))[0] for name in args.scenarios]
    asked = parse_args(["--config", str(args.config), *args.overrides])[0]
    fixed = fixes(args)
    fixed.check(args.overrides, asked, runs)
    return runs, fixed.ran_at(asked, runs)


def fixes(args) -> Fixes:
    """What the scenarios' runs fix: the settings of --dp, --steps, --out and --quick, the fitted
    batch, and each scenario's own switches (titanlite.analysis.settings)."""
    own: dict[str, list[str]] = {}
    for name in args.scenarios:
        for key, _ in words(scenarios(args.dp, args.onset)[name]):
            own.setdefault(moved_keys().get(key, key), []).append(name)
    keys = {
        key: f"set by the scenario{'s' * (len(names) > 1)} {', '.join(names)}"
        for key, names in own.items()
    }
    keys |= {
        "training.global_batch_size": f"at least 2 x --dp, {2 * args.dp}",
        "training.local_batch_size": "the largest at most the one asked that carries each rank's share",
        "job.dump_folder": "set by --out",
        "job.run_name": "each scenario's name",
    }
    if args.quick:
        keys |= {key: f"{v} with --quick" for key, v in words(QUICK_OVERRIDES)}
    return Fixes(
        "diagnose_scenarios",
        keys,
        always={
            "training.steps": "set by --steps",
            "diagnostics.measure_first": "--steps: every step measured",
            "metrics.log_every": "1: every step logged",
            "rehearsal.world": "0: every scenario trains; a rehearsal measures no ranks",
        },
        at_most=frozenset({"training.local_batch_size"}),
        # the table names each scenario, whose own switches are its name's
        unnamed=frozenset({"job.dump_folder", "job.run_name", *own}),
    )


SCRIPT = Script(
    "diagnose_scenarios",
    __doc__,
    overrides="every scenario's run (or, with --replay, the [alerts] rules)",
)
SCRIPT.arg(
    "--dp",
    kind="int",
    at_least=2,
    at_most=MAX_RANKS,
    help=f"ranks (the diagnostics compare ranks; default {DEFAULT_DP})",
)
SCRIPT.arg(
    "--steps",
    kind="int",
    at_least=1,
    at_most=10**6,
    help=f"steps of every scenario (default {DEFAULT_STEPS})",
)
SCRIPT.arg(
    "--onset",
    kind="int",
    at_least=1,
    at_most=10**6,
    help="the step ongoing faults start (default: half the steps)",
)
SCRIPT.arg(
    "--config",
    kind="file",
    default=str(REPO / "train_configs/debug_model.toml"),
    help="the config every scenario runs",
)
SCRIPT.arg(
    "--out",
    kind="out_folder",
    help="where the run folders, tables and plots go (default: outputs/scenarios-<time>)",
)
SCRIPT.arg(
    "--scenarios",
    kind="choice",
    nargs="+",
    choices=SCENARIOS,
    help="a subset, in this order (default: all)",
)
SCRIPT.arg(
    "--quick",
    kind="switch",
    help="every fault (or the --scenarios given) beside the healthy run at dp=2, 60 steps, faults from "
    "step 40, each run stopped at its first alert: 3.4 minutes on 2 cores (sets --dp, --steps and --onset)",
)
SCRIPT.arg("--replay", kind="folder", help="tables from this folder's runs, alerts replayed")
SCRIPT.arg(
    "--keep",
    kind="out_file",
    help="also write the runs as one replayable recording (.json.xz: measured steps and alerts; tests/recordings/)",
)
SCRIPT.arg(
    "--figures",
    kind="out_file",
    help="also write this dp's detection per scenario into this figures file, beside the other dps it holds "
    "(scripts/figures/diagnose_scenarios-*.json: the diagnostics README's detection table)",
)
SCRIPT.arg(
    "--healthy-figures",
    kind="out_file",
    help="also write this dp's healthy and healthy_sft runs (alerts, closest calls, batch-size advice) into "
    "this figures file, beside the other dps it holds (scripts/figures/diagnose_healthy-*.json: the "
    "diagnostics README's table of false alarms over long healthy runs)",
)
SCRIPT.arg(
    "--worker", kind="switch", internal=True, help="one rank of the runs (the script launches it)"
)


def resolve(args) -> list[str]:
    """The runs' settings from the flags (--quick's, the defaults), checked; returns the
    overrides every scenario's run takes (the user's, then --quick's)."""
    overrides = args.overrides
    if args.quick:
        quick_settings(args)
        overrides = [*overrides, *QUICK_OVERRIDES]
    args.dp, args.steps = args.dp or DEFAULT_DP, args.steps or DEFAULT_STEPS
    if args.onset is not None and args.onset > args.steps:
        raise UserError(
            f"--onset is {args.onset} but the scenarios run {args.steps} steps; start the faults within them"
        )
    args.onset = args.onset or max(1, args.steps // 2)
    args.scenarios = args.scenarios or list(SCENARIOS)
    if args.healthy_figures and not set(HEALTHY) & set(args.scenarios):
        raise UserError(
            f"--healthy-figures keeps the scenarios {' and '.join(HEALTHY)}; run one of them"
        )
    args.out = args.out or REPO / "outputs" / f"scenarios-{datetime.now():%Y%m%d-%H%M%S}"
    return overrides


def run(args) -> int:
    overrides = args.overrides
    if args.replay:
        return replay_main(args, overrides)
    overrides = resolve(args)
    if args.worker:
        worker(args, overrides)
        return 0
    from titanlite.validation import validate

    runs, ran_at = settings(args, overrides)
    for cfg in runs:  # every scenario's config, before any worker starts
        validate(cfg, args.dp)
    if (args.out / "status.json").exists():
        raise UserError(f"{args.out} already holds scenarios; pass another --out")
    from titanlite.analysis import harness

    flags = [
        "--worker",
        "--dp",
        str(args.dp),
        "--steps",
        str(args.steps),
        "--onset",
        str(args.onset),
    ]
    flags += [
        "--config",
        str(args.config),
        "--out",
        str(args.out),
        "--scenarios",
        *args.scenarios,
        *overrides,
    ]
    say = progress(args.out, args.scenarios, args.steps)
    harness.check(harness.launch(args.dp, [__file__, *flags], say=say), "the runs", str(args.out))
    status = read_json(args.out / "status.json")
    status["onset"] = args.onset
    (args.out / "status.json").write_text(json.dumps(status))
    want = expected(args.dp, args.onset)
    rows = {
        name: summarize(args.out / name, status[name]["stopped"], want[name])
        for name in args.scenarios
    }
    (args.out / "scenarios.json").write_text(json.dumps(rows, indent=1))
    if args.figures:
        cmd = f"--dp {args.dp} --steps {args.steps} --onset {args.onset} --out {args.out}"
        write_figures(
            args.figures, rows, args.dp, args.onset, f"scripts/diagnose_scenarios.py {cmd}"
        )
    if args.healthy_figures:
        cmd = f"--dp {args.dp} --steps {args.steps} --out {args.out}"
        source = f"scripts/diagnose_scenarios.py {cmd}"
        # no overrides: each run's config.toml holds them
        write_healthy_figures(args.healthy_figures, rows, args.dp, source, args.out, [])
    plot(rows, args.out / "scenarios.png")
    plot_noise_scale(args.out, rows, args.out / "noise_scale.png")
    head = f"dp={args.dp}, {args.steps} steps (faults from step {args.onset}), averages over measured steps > {SKIP}"
    head += f"; {ran_at}" if ran_at else ""
    print(f"{head}\n{table(rows)}")
    print(f"\ndetection\n{detection_table(rows)}{notes_table(rows)}")
    print(
        f"\nwritten: {args.out}/{{scenarios.json,scenarios.png,noise_scale.png}} and a run folder per scenario"
    )
    keep(args, args.out, args.scenarios)
    return 0


def keep(args, folder: Path, names) -> None:
    """--keep: the runs as one recording that replays to the alerts they raised."""
    if args.keep:
        from titanlite.diagnostics.replay import save_recording

        save_recording(args.keep, {name: folder / name for name in names})
        print(f"recording: {args.keep}")


def main(argv: list[str] | None = None) -> int:
    return SCRIPT.run(run, argv)


def replay_main(args, overrides: list[str]) -> int:
    """--replay: the tables from recorded runs, alerts from today's rules."""
    from dataclasses import fields

    from titanlite.config import JobConfig
    from titanlite.diagnostics.replay import replay_run

    # a replay reads what the runs recorded: only the rules' thresholds can be asked anew
    recorded = "recorded by the runs: only --alerts.key VALUE applies to a replay"
    replayed = {f.name: recorded for f in fields(JobConfig) if f.name != "alerts"}
    Fixes(
        "diagnose_scenarios --replay", {}, always=replayed, where="in the runs it replays"
    ).check_always(overrides)
    status_file = args.replay / "status.json"
    if not status_file.is_file():
        raise UserError(f"{args.replay} holds no scenarios (no status.json)")
    status = read_json(status_file)
    onset = status.pop("onset", 1)  # recordings made before faults had an onset started at step 1
    dp = read_json(args.replay / next(iter(status)) / "run.json").get("world_size", 2)
    want = expected(dp, onset)
    rows = {
        name: summarize(
            args.replay / name, s["stopped"], want[name], replay_run(args.replay / name, overrides)
        )
        for name, s in status.items()
    }
    (args.replay / "replayed.json").write_text(json.dumps(rows, indent=1))
    if args.figures:
        cmd = " ".join(["--replay", str(args.replay), *overrides])
        write_figures(args.figures, rows, dp, onset, f"scripts/diagnose_scenarios.py {cmd}")
    if args.healthy_figures:
        cmd = " ".join(["--replay", str(args.replay), *overrides])
        source = f"scripts/diagnose_scenarios.py {cmd}"
        write_healthy_figures(args.healthy_figures, rows, dp, source, args.replay, overrides)
    plot(rows, args.replay / "replayed.png")
    plot_noise_scale(args.replay, rows, args.replay / "noise_scale.png")
    print(
        f"replayed over {args.replay} (dp={dp})\n{table(rows)}\n\ndetection\n{detection_table(rows)}{notes_table(rows)}"
    )
    keep(args, args.replay, status)
    return 0


if __name__ == "__main__":
    sys.exit(main())
