#!/usr/bin/env python3
"""Data at scale: preparation throughput and memory, and training memory at two data sizes.

    ./scripts/bench_data.py                       # 100 MB and 1 GB of jsonl (about 15 min on 2 cores)
    ./scripts/bench_data.py --sizes-mb 20 200     # quicker

A synthetic jsonl corpus is made from the standard library's sources at each size (10x apart by
default). Measured, side by side in one run:
- preparation (scripts/prepare_data.py, built-in tokenizer) at the small size with 1 and with
  2 workers: tokens/s and their ratio; and at every size with all workers;
- peak anonymous memory (RssAnon, sampled every 20 ms: mapped file pages are not counted, so
  the memory-mapped shards do not inflate it) of the preparation (all its processes together)
  and of the first training steps (debug model, 2 CPU ranks; the largest rank);
- time from launch to the first training step.
It fails (exit 1) if the largest size raises peak training anonymous memory by more than
--max-growth (10%) over the smallest: training memory must not depend on the data's size.
The report goes to --out as JSON; titanlite/datasets/README.md's table renders one kept in
scripts/figures/ (markdown).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from titanlite.tools.venv import use_project_venv  # noqa: E402

use_project_venv()  # any python3 will do: without titanlite's dependencies it re-executes in .venv

from titanlite.analysis.harness import torchrun_command  # noqa: E402
from titanlite.datasets.corpus import stdlib_files  # noqa: E402
from titanlite.datasets.tokenizer import builtin_tokenizer_path, train_builtin_tokenizer  # noqa: E402
from titanlite.tools.cli import Script  # noqa: E402


def make_corpus(folder: Path, megabytes: float, file_mb: float = 64) -> Path:
    """jsonl files of {"text": a stdlib source file} until `megabytes` are written."""
    folder.mkdir(parents=True, exist_ok=True)
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in stdlib_files()]
    target, written, part, copy = int(megabytes * 2**20), 0, 0, 0
    fh = None
    while written < target:
        for i, text in enumerate(texts):
            if fh is None or fh.tell() >= file_mb * 2**20:
                if fh is not None:
                    fh.close()
                fh = open(folder / f"part-{part:05d}.jsonl", "w", encoding="utf-8")  # noqa: SIM115
                part += 1
            line = json.dumps({"text": f"# copy {copy}\n{text}", "id": f"{copy}-{i}"}) + "\n"
            fh.write(line)
            written += len(line.encode())
            if written >= target:
                break
        copy += 1
    fh.close()
    return folder


def _tree(pid: int) -> list[int]:
    """pid and all its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            children = []
        todo += [int(c) for c in children]
    return out


def _anon_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def watch(cmd: list[str], env: dict, until=None, timeout: float = 3600) -> dict:
    """Run cmd, sampling the anonymous memory of its process tree every 20 ms: peak of the sum
    over the tree, and peak of the largest process below the root (a rank, a worker). `until`:
    a callable that returns True at the event whose time since launch is reported."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    peak_total = peak_child = 0
    event = None
    while proc.poll() is None:
        pids = _tree(proc.pid)
        sizes = {p: _anon_kib(p) for p in pids}
        peak_total = max(peak_total, sum(sizes.values()))
        peak_child = max([peak_child, *(v for p, v in sizes.items() if p != proc.pid)])
        if event is None and until is not None and until():
            event = time.perf_counter() - start
        if time.perf_counter() - start > timeout:
            proc.kill()
        time.sleep(0.02)
    output = proc.stdout.read()
    if proc.returncode != 0:
        raise SystemExit(
            f"bench_data: {' '.join(cmd[:3])} ... failed (exit {proc.returncode}):\n{output[-3000:]}"
        )
    return {
        "wall_s": time.perf_counter() - start,
        "peak_anon_mib_total": peak_total / 1024,
        "peak_anon_mib_largest_child": peak_child / 1024,
        "event_s": event,
    }


def prepare(corpus: Path, out: Path, workers: int, env: dict, shard_mb: float) -> dict:
    cmd = [sys.executable, "scripts/prepare_data.py", "--tokenizer", "builtin", "--out", str(out)]
    cmd += ["--workers", str(workers), "--shard-mb", str(shard_mb), str(corpus)]
    row = watch(cmd, env)
    meta = json.loads((out / "meta.json").read_text())
    row.update(
        tokens=meta["tokens"], docs=meta["docs"], shards=len(meta["shards"]), workers=workers
    )
    row["tokens_per_s"] = meta["tokens"] / row["wall_s"]
    return row


def train(prepared: Path, runs: Path, name: str, steps: int, env: dict) -> dict:
    cmd = torchrun_command(
        2,
        "-m",
        "titanlite.train",
        "--config",
        "train_configs/debug_model.toml",
        "--data.path",
        str(prepared),
        "--training.steps",
        str(steps),
        "--metrics.log_every",
        "1",
        "--metrics.enable_tensorboard",
        "false",
        "--job.dump_folder",
        str(runs),
        "--job.run_name",
        name,
    )
    metrics = runs / name / "metrics.jsonl"
    row = watch(cmd, env, until=lambda: metrics.exists() and metrics.stat().st_size > 0)
    row["time_to_first_step_s"] = row.pop("event_s")
    return row


SCRIPT = Script("bench_data", __doc__)
SCRIPT.arg(
    "--sizes-mb",
    kind="float",
    nargs="+",
    default=[100, 1000],
    above=0.0,
    at_most=1 << 20,
    help="corpus sizes (MB of jsonl)",
)
SCRIPT.arg(
    "--steps", kind="int", default=5, at_least=1, at_most=10**6, help="training steps per size"
)
SCRIPT.arg(
    "--shard-mb",
    kind="float",
    default=16.0,
    above=0.0,
    at_most=1 << 20,
    help="preparation shard size (MB of input)",
)
SCRIPT.arg(
    "--max-growth",
    kind="float",
    default=0.10,
    at_least=0.0,
    at_most=100.0,
    help="allowed training memory growth, largest vs smallest",
)
SCRIPT.arg("--work", kind="folder", help="working folder (default: a temporary one, removed)")
SCRIPT.arg("--out", kind="out_file", default="bench_data.json", help="the report")


def run(args) -> int:
    sizes = sorted(args.sizes_mb)
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        work = Path(tmp)
        env = {**os.environ, "TITANLITE_CACHE": str(work / "cache"), "OMP_NUM_THREADS": "1"}
        env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
        report: dict = {"cores": os.cpu_count(), "sizes_mb": sizes, "steps": args.steps}
        report.update(max_growth=args.max_growth, prepare={}, train={})
        # The built-in tokenizer is trained once, before anything is timed.
        tokenizer = builtin_tokenizer_path(work / "cache", 2048)
        train_builtin_tokenizer(tokenizer, 2048)
        for mb in sizes:
            corpus = make_corpus(work / f"corpus-{mb:g}", mb)
            on_disk = sum(f.stat().st_size for f in corpus.iterdir()) / 2**20
            print(
                f"corpus {mb:g} MB: {on_disk:.0f} MiB of jsonl in {len(list(corpus.iterdir()))} files",
                flush=True,
            )
            runs = (
                [(1, f"{mb:g}-w1"), (2, f"{mb:g}-w2")]
                if mb == sizes[0]
                else [(os.cpu_count() or 1, f"{mb:g}")]
            )
            for workers, name in runs:
                row = prepare(corpus, work / f"prep-{name}", workers, env, args.shard_mb)
                report["prepare"][name] = row
                print(
                    f"prepare {name:>8}: {row['tokens']:,} tokens in {row['wall_s']:.1f}s = {row['tokens_per_s']:,.0f} tok/s"
                    f" | peak anon {row['peak_anon_mib_total']:.0f} MiB (all processes)",
                    flush=True,
                )
            prepared = work / f"prep-{runs[-1][1]}"
            row = train(prepared, work / "runs", f"train-{mb:g}", args.steps, env)
            report["train"][f"{mb:g}"] = row
            print(
                f"train  {mb:>7g}MB: peak anon {row['peak_anon_mib_largest_child']:.0f} MiB per rank "
                f"(largest) | time to first step {row['time_to_first_step_s']:.1f}s",
                flush=True,
            )
            for name in [n for _, n in runs]:  # disk: keep only what the next size needs
                subprocess.run(["rm", "-rf", str(work / f"prep-{name}")], check=False)
            subprocess.run(["rm", "-rf", str(corpus)], check=False)
        small = report["prepare"][f"{sizes[0]:g}-w1"]["tokens_per_s"]
        report["prepare_speedup_2_vs_1_workers"] = (
            report["prepare"][f"{sizes[0]:g}-w2"]["tokens_per_s"] / small
        )
        lo = report["train"][f"{sizes[0]:g}"]["peak_anon_mib_largest_child"]
        hi = report["train"][f"{sizes[-1]:g}"]["peak_anon_mib_largest_child"]
        report["train_memory_growth"] = hi / lo - 1
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(
        f"preparation 2 vs 1 workers: {report['prepare_speedup_2_vs_1_workers']:.2f}x | training peak anon "
        f"{sizes[-1]:g} MB vs {sizes[0]:g} MB: {report['train_memory_growth']:+.1%} (limit +{args.max_growth:.0%}) "
        f"| {args.out}"
    )
    if report["train_memory_growth"] > args.max_growth:
        print("bench_data: FAIL: training memory grows with the data's size", file=sys.stderr)
        return 1
    return 0


def _size(mb: float) -> str:
    return f"{mb / 1000:g} GB" if mb >= 1000 else f"{mb:g} MB"


def _rate(row: dict) -> str:
    return f"{row['tokens_per_s'] / 1e6:.2f}M tokens/s"


def _row(cells: list[str]) -> str:
    return "|" + "|".join(f" {c} " if c else " " for c in cells) + "|\n"


def markdown(report: dict) -> str:
    """titanlite/datasets/README.md's table of a report (what --out writes;
    scripts/figures/bench_data-*.json): a column per size, the ratios computed here."""
    sizes, prep, train = report["sizes_mb"], report["prepare"], report["train"]
    one, two = prep[f"{sizes[0]:g}-w1"], prep[f"{sizes[0]:g}-w2"]
    rest = [prep[f"{mb:g}"] for mb in sizes[1:]]
    mem = [train[f"{mb:g}"]["peak_anon_mib_largest_child"] for mb in sizes]
    growth = (
        f"**{mem[-1] / mem[0] - 1:+.1%}**; the benchmark fails above {report['max_growth']:+.0%}"
    )
    rows = [
        ["", *(f"{_size(mb)} of jsonl" for mb in sizes)],
        ["---"] * (len(sizes) + 1),
        ["tokens", *(f"{r['tokens'] / 1e6:.1f}M" for r in [one, *rest])],
        [
            "preparation, 1 worker",
            f"{_rate(one)}, peak anonymous memory {one['peak_anon_mib_total']:.0f} MiB",
        ]
        + [""] * len(rest),
        [
            "preparation, 2 workers",
            f"{_rate(two)} (**{two['tokens_per_s'] / one['tokens_per_s']:.2f}x**), "
            f"{two['peak_anon_mib_total']:.0f} MiB (all processes)",
            *(
                ("" if r["workers"] == 2 else f"{r['workers']} workers: ")
                + f"{_rate(r)}, {r['wall_s']:.0f} s, {r['peak_anon_mib_total']:.0f} MiB"
                for r in rest
            ),
        ],
        [
            f"first {report['steps']} training steps (debug model, 2 ranks): "
            "peak anonymous memory of the largest rank",
            *(f"{m:.0f} MiB" for m in mem[:-1]),
            f"{mem[-1]:.0f} MiB ({growth})",
        ],
        [
            "time from launch to the first step",
            *(f"{train[f'{mb:g}']['time_to_first_step_s']:.1f} s" for mb in sizes),
        ],
    ]
    return "".join(map(_row, rows)) + "\n"


def main(argv: list[str] | None = None) -> int:
    return SCRIPT.run(run, argv)


if __name__ == "__main__":
    sys.exit(main())
