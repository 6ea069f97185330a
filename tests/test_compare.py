"""scripts/compare_runs.py on synthetic run folders: experiments overlaid without a verdict; with
--invariance the verdict, the first diverging step, what it refuses to compare, and broken
metrics files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import load_script

from titanlite.analysis.compare import compare
from titanlite.analysis.runs import load_run
from titanlite.analysis.tolerance import DEFAULT_TOLERANCE, Tolerance, default_tolerance
from titanlite.config import load_config
from titanlite.config.manager import to_toml

compare_runs = load_script("compare_runs")
inspect_step = load_script("inspect_step")

LOSSES = [8.0 - 0.1 * i for i in range(20)]


def make_run(
    root: Path, name: str, losses=LOSSES, dtype="float32", overrides=(), mode="fsdp"
) -> Path:
    d = root / name
    d.mkdir()
    cfg = load_config(None, ["--training.global_batch_size", "16", *overrides])
    (d / "config.toml").write_text(to_toml(cfg))
    resolved = {
        "mode": mode,
        "dp_replicate": 1,
        "dp_shard": 8,
        "local_batch_size": 2,
        "grad_accum": 1,
    }
    (d / "run.json").write_text(json.dumps({**resolved, "param_dtype": dtype, "device": "cpu"}))
    lines = [
        json.dumps({"step": i + 1, "loss": v, "grad_norm": 1.0 + v / 100})
        for i, v in enumerate(losses)
    ]
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return d


def run_cli(capsys, *args) -> tuple[int, str, str]:
    code = compare_runs.main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def judge(capsys, *args) -> tuple[int, str, str]:
    return run_cli(capsys, *args, "--invariance")


def test_experiments_are_overlaid_without_a_verdict(tmp_path, capsys):
    """Runs that train different things (learning rate, seed) are compared on purpose: their
    differences and endings are listed, the figures drawn, exit 0; one run draws its own."""
    a = make_run(tmp_path, "a")
    b = make_run(tmp_path, "b", [v * 0.9 for v in LOSSES], overrides=("--optimizer.lr", "4e-4"))
    c = make_run(tmp_path, "c", overrides=("--training.seed", "7"))
    (a / "eval.jsonl").write_text(json.dumps({"step": 10, "loss": 6.5, "perplexity": 665.1}) + "\n")
    code, out, err = run_cli(capsys, a, b, c, "--out", tmp_path / "exp")
    assert code == 0 and not err, err
    assert (
        "optimizer.lr: A 0.0008, B 0.0004, C 0.0008" in out
        and "training.seed: A 42, B 42, C 7" in out
    )
    assert "PASS" not in out and "FAIL" not in out
    rows = {r["label"]: r for r in json.loads((tmp_path / "exp/runs.json").read_text())["runs"]}
    assert (
        rows["B"]["final_loss"] == pytest.approx(LOSSES[-1] * 0.9) and rows["A"]["eval_loss"] == 6.5
    )
    assert (tmp_path / "exp/runs.png").stat().st_size > 10_000
    code, out, _ = run_cli(capsys, a)
    assert code == 0 and "config differences" not in out
    assert (tmp_path / "compare-a/runs.png").is_file()
    # A run equal to another is named as such (its curve lies on the other's); the default
    # folder names every run, or the first two and how many more.
    d = make_run(tmp_path, "d", overrides=("--job.description", "a again"))
    code, out, _ = run_cli(capsys, a, b, d)
    assert code == 0 and "C has A's training loss at every step" in out and "B has" not in out, out
    assert (tmp_path / "compare-a-vs-b-vs-d/runs.png").is_file()
    assert (
        run_cli(capsys, a, b, c, d)[0] == 0
        and (tmp_path / "compare-a-vs-b-and-2-more/runs.png").is_file()
    )
    # The verdict comes only on request: --rtol alone asks for it too.
    assert judge(capsys, a, c, "--out", tmp_path / "j")[0] == 2
    assert run_cli(capsys, a, b, "--rtol", "1e-5", "--out", tmp_path / "j")[0] == 1


def test_same_curve_passes_and_writes_table_json_plot(tmp_path, capsys):
    a = make_run(tmp_path, "a")
    noisy = [v * (1 + 3e-7 * (-1) ** i) for i, v in enumerate(LOSSES)]
    b = make_run(tmp_path, "b", noisy, overrides=("--parallelism.dp_shard", "16"), mode="ddp")
    code, out, _ = judge(capsys, a, b, "--out", tmp_path / "cmp")
    assert code == 0, out
    assert "PASS" in out and "layout differences: parallelism.dp_shard" in out
    summary = json.loads((tmp_path / "cmp/compare.json").read_text())
    assert summary["passed"] and summary["comparisons"][0]["max_rel"] == pytest.approx(
        3e-7, rel=1e-3
    )
    assert (tmp_path / "cmp/compare.png").stat().st_size > 10_000
    assert len((tmp_path / "cmp/table.txt").read_text().splitlines()) > 20


def test_parting_curve_fails_and_names_the_first_step(tmp_path, capsys):
    a = make_run(tmp_path, "a")
    parted = [v * (1 + (2e-4 if i >= 6 else 0.0)) for i, v in enumerate(LOSSES)]
    b = make_run(tmp_path, "b", parted, overrides=("--loss.normalization", "local_mean"))
    c = make_run(tmp_path, "c")
    code, out, _ = judge(capsys, a, c, b, "--out", tmp_path / "cmp")
    assert code == 1
    assert "PASS c vs a" in out
    assert "FAIL b vs a" in out and "first step beyond rtol 1e-05: 7 " in out
    assert "differs beyond layout (may change the curve): loss.normalization" in out
    assert (
        json.loads((tmp_path / "cmp/compare.json").read_text())["comparisons"][1]["first_bad_step"]
        == 7
    )
    # a looser tolerance accepts it
    assert run_cli(capsys, a, b, "--rtol", "1e-3", "--out", tmp_path / "cmp2")[0] == 0
    # Dropout runs at two layouts: masks from the ranks' RNG streams are named as a difference.
    drop = ("--model.dropout", "0.1")
    d8 = make_run(tmp_path, "d8", overrides=drop)
    d16 = make_run(tmp_path, "d16", overrides=(*drop, "--parallelism.dp_shard", "16"))
    keyed = ("--model.dropout_masks", "sample")
    k8 = make_run(tmp_path, "k8", overrides=(*drop, *keyed))
    k16 = make_run(tmp_path, "k16", overrides=(*drop, *keyed, "--parallelism.dp_shard", "16"))
    assert (
        "model.dropout_masks = 'sample' keys them"
        in judge(capsys, d8, d16, "--out", tmp_path / "d")[1]
    )
    assert "dropout masks" not in judge(capsys, k8, k16, "--out", tmp_path / "k")[1]


@pytest.mark.parametrize(
    "override, key",
    [
        (("--training.global_batch_size", "32"), "training.global_batch_size"),
        (("--training.seed", "7"), "training.seed"),
        (("--data.path", "other.jsonl"), "data.path"),
        (("--model.flavor", "1B"), "model.flavor"),
    ],
)
def test_refuses_runs_that_train_different_things(tmp_path, capsys, override, key):
    a = make_run(tmp_path, "a")
    b = make_run(tmp_path, "b", overrides=override)
    code, _, err = judge(capsys, a, b, "--out", tmp_path / "cmp")
    assert code == 2 and "do not train the same thing" in err and key in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "cmp").exists()


def test_broken_or_short_metrics_are_clear_errors(tmp_path, capsys):
    a = make_run(tmp_path, "a")
    missing = make_run(tmp_path, "missing")
    (missing / "metrics.jsonl").unlink()
    cut = make_run(tmp_path, "cut")
    text = (cut / "metrics.jsonl").read_text()
    (cut / "metrics.jsonl").write_text(text[: len(text) - 20])  # killed mid-line
    corrupt = make_run(tmp_path, "corrupt")
    lines = (corrupt / "metrics.jsonl").read_text().splitlines()
    lines[3] = "{not json"
    (corrupt / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    short = make_run(tmp_path, "short", LOSSES[:12])
    cases = {
        missing: "a training run that logged no step",
        cut: "last line (20) is cut off",
        corrupt: "line 4 is not a JSON record",
        short: "metrics stop at step 12, not 20",
        tmp_path / "nowhere": "does not exist; give an existing folder",
    }
    for run, message in cases.items():
        code, _, err = judge(capsys, a, run, "--out", tmp_path / "cmp")
        assert code == 2 and message in err, (run, err)
    assert judge(capsys, a, short, "--steps", "12", "--out", tmp_path / "cmp")[0] == 0
    assert judge(capsys, a)[0] == 2


def test_default_tolerance_follows_the_dtype(tmp_path):
    fp32 = load_run(make_run(tmp_path, "a"))
    bf16 = load_run(make_run(tmp_path, "b", dtype="bfloat16"))
    assert default_tolerance([fp32, fp32]) == DEFAULT_TOLERANCE["float32"] == Tolerance(1e-5)
    assert default_tolerance([fp32, bf16]) == DEFAULT_TOLERANCE["bfloat16"]


def test_bf16_tolerance_grows_with_the_horizon_and_stops_at_its_cap(tmp_path):
    """bf16 rounding differences compound: a difference that fails at the first steps passes
    later; the growth stops at a cap."""
    tol = DEFAULT_TOLERANCE["bfloat16"]
    assert tol.at(0) == 2.0**-12 and tol.at(29) == 30 * 2.0**-12 and tol.at(10_000) == 2e-2
    assert str(tol) == "0.000244 + 0.000244 per step (at most 0.02)"
    a = make_run(tmp_path, "a", dtype="bfloat16")
    for name, step, rel in (("early", 3, 2e-3), ("late", 15, 2e-3), ("far", 20, 1e-2)):
        losses = [v * (1 + rel) if i + 1 == step else v for i, v in enumerate(LOSSES)]
        b = make_run(tmp_path, name, losses, dtype="bfloat16")
        cmp = compare(load_run(a), load_run(b), default_tolerance([load_run(a)]))
        assert cmp.passed == (name == "late"), (name, cmp.verdict())


def _with_terms(run: Path, terms: dict[str, list[float]]) -> None:
    """Add each step's loss terms (and their total with the loss) to a synthetic run's rows."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for i, row in enumerate(rows):
        row["terms"] = {name: values[i] for name, values in terms.items()}
        row["loss_total"] = row["loss"] + sum(row["terms"].values())
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _with_gradients(run: Path, grads: dict[str, list[float]]) -> None:
    """A fingerprints.json of step 1 holding each parameter's reduced-gradient fingerprint."""
    records = {f"{name} reduced grad": {"-1": fp} for name, fp in grads.items()}
    (run / "fingerprints.json").write_text(
        json.dumps({"step": 1, "order": list(records), "records": records, "loss": 8.0})
    )


AUX = [1e-3 * (1 + 0.01 * i) for i in range(20)]
GRADS = {"layers.0.router.weight": [0.5, 2.0, 3.0], "head.weight": [-1.0, 4.0, 5.0]}


def test_a_loss_term_is_a_curve_of_its_own(tmp_path, capsys):
    """The verdict judges each loss term a model adds like the loss: a term that parts fails,
    named, while the loss agrees; a term only one run logs fails too."""
    a, b, c = (make_run(tmp_path, n) for n in "abc")
    _with_terms(a, {"aux": AUX})
    _with_terms(b, {"aux": AUX[:3] + [AUX[3] * (1 + 1e-4)] + AUX[4:]})
    code, out, _ = judge(capsys, a, b)
    assert (
        code == 1
        and "max relative loss difference 0 (step 1); first step beyond rtol 1e-05: 4 (" in out
    )
    (verdict,) = [ln for ln in out.splitlines() if ln.startswith("FAIL b vs a: ")]
    assert verdict.endswith(", loss term aux)"), out
    _with_terms(c, {"aux": AUX})
    code, out, _ = judge(capsys, a, c)
    assert code == 0 and "(and the loss terms aux) <= rtol 1e-05" in out
    d = make_run(tmp_path, "d")
    code, out, _ = judge(capsys, a, d)
    assert code == 1 and "first step beyond rtol 1e-05: 1 (0.001 vs None, loss term aux)" in out


def test_the_gradient_at_the_first_step_is_judged(tmp_path, capsys):
    """With both runs' fingerprints, each parameter's reduced gradient is compared: the curves
    may agree while one parameter's gradient parts; the line names it; a parameter with a
    gradient in one run only fails; without fingerprints there is no gradient line."""
    a, b, c, d = (make_run(tmp_path, n) for n in "abcd")
    _with_gradients(a, GRADS)
    _with_gradients(b, {**GRADS, "layers.0.router.weight": [0.5, 2.0 * (1 + 2e-5), 3.0]})
    code, out, _ = judge(capsys, a, b)
    assert code == 1 and "PASS b vs a: 20 steps, max relative loss difference 0" in out
    assert (
        "FAIL gradient at step 1: largest relative difference 2e-05 (layers.0.router.weight) beyond 1e-05"
        in out
    )
    _with_gradients(c, {**GRADS, "layers.0.router.weight": [0.5, 2.0 * (1 + 5e-6), 3.0]})
    code, out, _ = judge(capsys, a, c)
    assert (
        code == 0
        and "PASS gradient at step 1: largest relative difference 5e-06 (layers.0.router.weight) <= 1e-05"
        in out
    )
    _with_gradients(d, {"head.weight": GRADS["head.weight"]})
    code, out, _ = judge(capsys, a, d)
    assert (
        code == 1
        and "1 parameter(s) have a gradient in one run only, first layers.0.router.weight" in out
    )
    code, out, _ = judge(capsys, make_run(tmp_path, "e"), a)
    assert code == 0 and "gradient at step 1" not in out
    assert "(gradient not judged: e recorded no fingerprints;" in out  # said, not silently dropped


# Folders a tool may be given for a run folder, each made from a run's (make_run), and what the
# reader says of each (tools/records.folder_kind)
FOLDERS = {
    "rehearsal": "{} is a rehearsal's folder",
    "no steps": "{} is the folder of a training run that logged no step",
    "no config.toml": "{} has no config.toml, so it is not a titanlite run folder",
    "no run.json": "{} has no run.json, so it is not a titanlite run folder",
    "run": None,
}
# what each tool does with each: (exit code, its line after "<tool>: ", or None for no line)
NO_CHECKPOINT = (2, "error: RUN_DIR '{}' holds no complete checkpoint")  # a folder of checkpoints
TOOLS = {
    "compare_runs": {k: (0, None) if w is None else (2, f"error: {w}") for k, w in FOLDERS.items()},
    "inspect_step": {
        k: (0, None) if w is None else (2 if "run folder" in w else 0, ("error: " if "run folder" in w else "note: ") + w)
        for k, w in FOLDERS.items()
    },
    "generate": {
        **{k: (2, "error: " + w.replace("{} is", "RUN_DIR '{}' is")) for k, w in FOLDERS.items() if w},
        "run": NO_CHECKPOINT,
        "no config.toml": NO_CHECKPOINT,  # no run folder, so perhaps a checkpoint folder
    },
}  # fmt: skip
generate = load_script("generate")


def _folder(root: Path, kind: str) -> Path:
    d = make_run(root, kind.replace(" ", "-").replace(".", "-"))
    info = json.loads((d / "run.json").read_text())
    (d / "run.json").write_text(json.dumps({**info, "world_size": 8}))  # inspect_step splits by it
    if kind == "rehearsal":  # as a rehearsal leaves it: its report, no step logged
        (d / "rehearsal.json").write_text(json.dumps({"world": 64, "complete": True}))
    if kind in ("rehearsal", "no steps"):
        (d / "metrics.jsonl").write_text("")
    if kind.startswith("no ") and kind.endswith((".toml", ".json")):
        (d / kind.removeprefix("no ")).unlink()
    return d


@pytest.mark.parametrize("kind", FOLDERS)
@pytest.mark.parametrize("tool", TOOLS)
def test_a_tool_says_what_kind_of_folder_it_was_given_in_its_own_name(
    tmp_path, capsys, monkeypatch, tool, kind
):
    """Each tool that reads a run folder asks the one reader (tools/records.folder_kind) what it
    holds, and says it in one line that starts with its own name: compare_runs refuses what has
    no curve; inspect_step shows what the config assigns the step, after a note that no real step
    ran there; generate (the checkpoint reader's, as export_hf's) refuses what holds no
    checkpoint. A folder that is no run's is refused."""
    folder = _folder(tmp_path, kind)
    if tool == "compare_runs":
        code = compare_runs.main([str(folder), "--out", str(tmp_path / "cmp")])
    elif tool == "generate":
        code = generate.main([str(folder), "--prompt", "def f("])
    else:  # the step's data is not what this test is about: none is read
        monkeypatch.setattr(inspect_step, "build_tokenizer", lambda cfg: None)
        monkeypatch.setattr(inspect_step, "build_dataset", lambda cfg, tok: None)
        monkeypatch.setattr(inspect_step, "trace_step", lambda *args: [])
        code = inspect_step.main([str(folder), "--step", "3"])
    err = capsys.readouterr().err
    want, says = TOOLS[tool][kind]
    assert code == want, err
    if says is None:
        assert err == "", err
        return
    (line,) = err.splitlines()
    assert line.startswith(f"{tool}: " + says.format(folder)), line
