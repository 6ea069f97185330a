"""The repository's shape holds: size budgets (train.py is the loop, no module grows past one
screenful of concerns, the README stays a guide), every link in every README resolves
(md-link-checker: relative paths and section anchors; web addresses are not fetched, tests run
offline), every measured block of a README is what its committed figures file renders to, and
no package comment or docstring holds a measured figure. The layer order is checked by
import-linter in scripts/test.sh."""

from __future__ import annotations

import ast
import importlib
import inspect
import io
import json
import re
import subprocess
import sys
import tokenize
from collections.abc import Iterator
from pathlib import Path

from helpers import REPO, load_script

# Line budgets: review triggers, not walls. A file over its budget is listed in OVER_BUDGET with
# the reason it is let through; no code is packed to stay under one.
TRAIN_LINES, MODULE_LINES, README_LINES = 300, 400, 400
OVER_BUDGET: dict[str, str] = {
    "titanlite/train.py": "the loop with the Trainer's set-up of its parts, read top to bottom; "
    "the step is the hooks' calls, and the set-up of each part lives with that part",
    "README.md": "two model families' journeys, each a newcomer's first run of it; the families' "
    "reference lives beside their code (titanlite/models/qwen3_moe/README.md)",
}
# A figures file (by the start of its name) -> the script and function that render it: the
# script writes the file, a README holds its rendering between
# `<!-- figures: PATH -->` and `<!-- end figures -->` (PATH relative to the README).
RENDERERS = {
    "gpu_check": ("gpu_check", "markdown"),
    "bench": ("bench", "markdown"),
    "bench_profile": ("bench", "profile_markdown"),
    "diagnose_scenarios": ("diagnose_scenarios", "detection_markdown"),
    "diagnose_healthy": ("diagnose_scenarios", "healthy_markdown"),
    "bench_data": ("bench_data", "markdown"),
    "bench_packing": ("bench", "packing_markdown"),
    "bench_peer": ("peer/bench_peer", "markdown"),
    "rehearsal": ("rehearse_sweep", "example_markdown"),
    "rehearse_sweep": ("rehearse_sweep", "sweep_markdown"),
}
BLOCK = re.compile(r"<!-- figures: (\S+) -->\n(.*?)<!-- end figures -->", re.S)


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def _tracked(pattern: str) -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", pattern], cwd=REPO, capture_output=True, text=True, check=True
    )
    return [REPO / p for p in out.stdout.split()]


def test_size_budgets():
    """Every file over its budget is listed with its reason, and every listed one is over."""
    modules = sorted(REPO.glob("titanlite/**/*.py"))
    assert len(modules) > 50  # the glob found the package
    budgets = {str(p.relative_to(REPO)): MODULE_LINES for p in modules}
    budgets |= {"titanlite/train.py": TRAIN_LINES, "README.md": README_LINES}
    over = {path: n for path, limit in budgets.items() if (n := _lines(REPO / path)) > limit}
    unlisted = {path: n for path, n in over.items() if path not in OVER_BUDGET}
    assert not unlisted, (
        f"over their line budgets: {unlisted}; split by concern (reference text goes beside its code), "
        "or list the file in OVER_BUDGET with the reason"
    )
    assert not set(OVER_BUDGET) - set(over), (
        f"listed in OVER_BUDGET but within budget: {set(OVER_BUDGET) - set(over)}"
    )


def test_every_readme_link_resolves():
    readmes = _tracked("*.md")
    assert REPO / "README.md" in readmes and REPO / "tests/README.md" in readmes
    cmd = [sys.executable, "-m", "md_link_checker", "--no-urls", *map(str, readmes)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_measured_blocks_are_rendered_from_their_files():
    blocks = [
        (md, path, body) for md in _tracked("*.md") for path, body in BLOCK.findall(md.read_text())
    ]
    assert len(blocks) >= 5, "no measured block found"
    for md, path, body in blocks:
        source = md.parent / path
        script, fn = RENDERERS[source.name.split("-")[0]]
        want = getattr(load_script(script), fn)(json.loads(source.read_text()))
        assert body == want, (
            f"{md.relative_to(REPO)}'s block of {path} is not its rendering; paste:\n{want}"
        )


# A measured figure: a number with a unit of time, size or rate, a percentage or an "Nx" ratio;
# or a sentence with a number that says where it ran ("measured 49 MB", "on one CPU core", "a
# healthy dp=4 run").
_NUM = r"(?<![\w.^])\d[\d,]*(?:\.\d+)?(?:e-?\d+)?"
FIGURE = re.compile(
    rf"{_NUM} ?(?:ns|us|µs|ms|s|secs?|seconds?|min|minutes?|hours?|[KMGT]i?B|%)(?!\w)"
    rf"|{_NUM}x(?!\w)"
    rf"|{_NUM} ?(?:tokens?|tok|samples|steps|it|[KMGT]i?B|T?FLOP)/s\b"
)
RAN = re.compile(
    r"\bmeasured\b(?![- ](?:steps?|gradient)\b)"
    r"|\bon (?:this|that|one|an?|\d+) (?:[\w'-]+ ){0,2}?(?:machine|CPUs?|cores?|GPUs?|H100s?|H200s?|A100s?)\b"
    r"|\bhealthy\b[^.;]{0,30}\d[^.;]{0,30}\bruns?\b",
    re.I,
)
# (file, figure) -> why it is no measurement: a constant the code defines, or arithmetic.
NOT_MEASURED = {
    (
        "titanlite/components/checkpoint/index.py",
        "96 GB",
    ): "8B parameters x 12 bytes (weights, two moments)",
    ("titanlite/faults/inject.py", "0.5 s"): "liveness' heartbeat period, a default of its own",
    ("titanlite/distributed/liveness.py", "0.5 s"): "the heartbeat's default period, defined there",
    (
        "titanlite/datasets/build.py",
        "2 GiB",
    ): "the data size BUILD_WAIT is sized for, a design bound",
    ("titanlite/diagnostics/replicas.py", "128 MiB"): "_CHUNK = 2**24 int64 values",
    ("titanlite/diagnostics/registry.py", "6%"): "P(Binomial(20, 1/2) >= 14)",
    ("titanlite/launch.py", "30 s"): "torchrun's shutdown grace, its constant",
    (
        "titanlite/models/common/document_attention.py",
        "16 MiB",
    ): "B x S^2 bytes at B = 4, S = 2,048",
    ("titanlite/ops/cross_entropy.py", "1 GB"): "128,256 x 2,048 x 4 bytes",
    ("titanlite/tools/memory.py", "5%"): "KEEP_GATHERED_SHARE, defined there",
}


def _prose(path: Path) -> Iterator[tuple[int, str]]:
    """(first line, text) of each comment block (comments on consecutive lines) and each
    docstring (module, class, function) of a Python file."""
    src = path.read_text()
    block: list[tokenize.TokenInfo] = []
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type != tokenize.COMMENT:
            continue
        if block and tok.start[0] != block[-1].start[0] + 1:
            yield block[0].start[0], " ".join(t.string.lstrip("#") for t in block)
            block = []
        block.append(tok)
    if block:
        yield block[0].start[0], " ".join(t.string.lstrip("#") for t in block)
    for node in ast.walk(ast.parse(src)):
        kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        if isinstance(node, kinds) and (doc := ast.get_docstring(node)):
            yield node.body[0].lineno, doc


def measured_figures(text: str) -> Iterator[tuple[str, str]]:
    """(figure, its sentence) for each measured figure of a comment or docstring."""
    for sentence in re.split(r"(?<=[.;!?])\s+", " ".join(text.split())):
        hits = list(FIGURE.finditer(sentence))
        if re.search(r"\d", sentence):
            hits += RAN.finditer(sentence)
        for m in hits:
            yield m.group(0), sentence


def test_measured_figure_rule():
    """The rule below finds what a run measured and passes what code defines or derives."""
    for text in (
        "Measured on one CPU core: 3.0 ms per 6.2 M values",
        "a CRC32 runs at about 3.5 GB/s",
        "34,390 tokens/s, 28.6% MFU",
        "0.5 to 0.78x the time",
        "SDPA's buffers: measured 49 MB",
        "the std is noisy (a healthy dp=4 run: 0.13 to 1.3)",
        "the step took 0.94 of the other on 2 CPU ranks",
    ):
        assert list(measured_figures(text)), text
    for text in (
        "10 measured steps; a measured-step record",
        "bf16's unit roundoff u = 2^-8; alpha = 1e-5",
        "local batch 4 x 2,048 at dp=4, fp32, 0x1f, llama_1b",
        "the diagnostics measured. Then 3 ranks",
    ):
        assert not list(measured_figures(text)), text


def test_no_measured_figure_in_package_comments():
    """No comment or docstring of the package holds a measured figure: what a run measured on
    some machine (a time, a rate, a size, a percentage, a speed-up, or any number in a sentence
    that says where it ran) goes stale in code unseen. It lives in a file that the script
    measuring it writes (scripts/figures/, rendered into a README and held by
    test_measured_blocks_are_rendered_from_their_files), or in the README beside that script;
    the comment says where ("measured by scripts/bench.py: scripts/README.md, Performance").

    The rule (measured_figures, its own test above): every comment block (python's tokenize) and
    docstring (ast) is cut into sentences, and a sentence fails on a number with a unit of time
    (ns to hours), size (KB to TiB), rate (tokens/s, GB/s, TFLOP/s ...), a percentage or an
    "Nx" ratio, or on a number in a sentence that says where it ran: "measured" (not the
    diagnostics' "measured step"), "on this/one/an ... machine, CPU, core, GPU", "a healthy
    <size> run". A figure with a unit that is a constant the code defines, or arithmetic, is
    allowed by file and figure in NOT_MEASURED with the reason; an entry no file needs any more
    fails too, so the list stays the exceptions there are."""
    modules = sorted(REPO.glob("titanlite/**/*.py"))
    assert len(modules) > 50  # the glob found the package
    found, allowed = [], set()
    for path in modules:
        rel = str(path.relative_to(REPO))
        for line, text in _prose(path):
            for figure, sentence in measured_figures(text):
                if (rel, figure) in NOT_MEASURED:
                    allowed.add((rel, figure))
                else:
                    found.append(f"{rel}:{line}: {figure!r} in: {sentence}")
    assert not found, (
        "measured figures in package comments or docstrings; move each to the file or "
        + ("README its script writes, and point there:\n" + "\n".join(found))
    )
    stale = set(NOT_MEASURED) - allowed
    assert not stale, (
        f"NOT_MEASURED entries no comment needs any more; remove them: {sorted(stale)}"
    )


def _public(module) -> set[str]:
    """What a module defines for others: its classes and functions, and its constants."""
    return {
        n
        for n, o in vars(module).items()
        if not n.startswith("_")
        and (
            getattr(o, "__module__", None) == module.__name__
            or (n.isupper() and not inspect.ismodule(o))
        )
    }


def test_a_forks_imports_keep_working():
    """The names a fork imports (tests/fork_api.json: the model registry, the attention helpers,
    parallelize_blocks and the init, the cross-entropy and dropout ops, the alert registry) still
    import from where they were: a move re-exports them. A module's new public name must join
    the file, so it is held from then on."""
    api = json.loads((REPO / "tests/fork_api.json").read_text())
    for name, names in api.items():
        module = importlib.import_module(name)
        gone = [n for n in names if not hasattr(module, n)]
        assert not gone, f"{name} no longer has {gone}: a fork imports them there; re-export them"
        new = sorted(_public(module) - set(names))
        assert not new, f"{name}'s new public names {new}: add them to tests/fork_api.json"
