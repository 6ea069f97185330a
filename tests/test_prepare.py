"""Data preparation (scripts/prepare_data.py, titanlite.datasets.prepare) and the memory-mapped
reading of its output: every input kind gives the reference tokenizer's tokens and traces back
to its rows, the trainer's on-the-fly preparation gives the script's order, a killed preparation
is never accepted and resumes, bad inputs are one line and exit 2, mixtures hit their weights."""

from __future__ import annotations

import fcntl
import gzip
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import HANG_S, REPO, load_script, run_script

from titanlite.config import parse_args
from titanlite.config.layout import resolve_layout
from titanlite.datasets.build import build_dataset, build_tokenizer
from titanlite.datasets.prepare import prepare
from titanlite.datasets.prepared import Prepared
from titanlite.datasets.sampler import MIX_BLOCK, GlobalBatchSampler, permute, stream_keys
from titanlite.datasets.sequences import PackedDataset
from titanlite.errors import TrainingError, UserError
from titanlite.ops.cross_entropy import IGNORE_INDEX

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
]


def _docs(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(5, 80)))) + f" #{i}" for i in range(n)]


def _cfg(*args):
    base = [
        "--training.seq_len",
        "32",
        "--training.global_batch_size",
        "4",
        "--training.local_batch_size",
        "2",
    ]
    return parse_args([*base, *args])[0]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(_cfg())


def _script(*args: str) -> subprocess.CompletedProcess:
    return run_script("prepare_data", *args)


def _one_line_exit_2(proc: subprocess.CompletedProcess, needle: str) -> None:
    """Exit 2 and one error line naming the problem (progress lines may come before it)."""
    errors = [
        line for line in proc.stderr.splitlines() if "error" in line.lower() or "Traceback" in line
    ]
    assert proc.returncode == 2 and len(errors) == 1 and needle in errors[0], (
        proc.returncode,
        proc.stderr,
    )


def _write_inputs(folder, docs: list[str]) -> dict[str, list[str]]:
    """The same documents as txt files, jsonl (with a blank line), jsonl.gz, parquet (3 row groups,
    another text column name) and a save_to_disk-style arrow folder (2 files listed in state.json)."""
    folder.mkdir()
    (folder / "txt").mkdir()
    for i, d in enumerate(docs[:3]):
        (folder / "txt" / f"{i}.txt").write_text(d)
    lines = [json.dumps({"text": d, "id": i}) for i, d in enumerate(docs)]
    (folder / "a.jsonl").write_text("\n".join(lines[:5]) + "\n\n" + "\n".join(lines[5:]) + "\n")
    with gzip.open(folder / "a.jsonl.gz", "wt") as fh:
        fh.write("\n".join(lines) + "\n")
    pq.write_table(
        pa.table({"content": docs, "n": list(range(len(docs)))}),
        folder / "a.parquet",
        row_group_size=7,
    )
    arrow = folder / "arrow"
    arrow.mkdir()
    half = len(docs) // 2
    names = ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]
    for name, part in zip(names, (docs[:half], docs[half:]), strict=True):
        table = pa.table({"text": part})
        with pa.ipc.new_stream(arrow / name, table.schema) as writer:
            writer.write_table(table, max_chunksize=4)
    (arrow / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names]}))
    return {
        "txt": str(folder / "txt"),
        "jsonl": str(folder / "a.jsonl"),
        "jsonl.gz": str(folder / "a.jsonl.gz"),
    }


def test_every_input_kind_gives_the_reference_tokens_and_traces_to_its_rows(tmp_path, tok):
    docs = _docs(20)
    _write_inputs(tmp_path / "raw", docs)
    raw = tmp_path / "raw"
    cases = {
        "txt": ([raw / "txt"], docs[:3], "text"),
        "jsonl": ([raw / "a.jsonl"], docs, "text"),
        "jsonl.gz": ([raw / "a.jsonl.gz"], docs, "text"),
        "parquet": ([raw / "a.parquet"], docs, "content"),
        "arrow": ([raw / "arrow"], docs, "text"),
    }
    for kind, (inputs, want_docs, field) in cases.items():
        out = tmp_path / f"prep-{kind}"
        # tiny shards: a jsonl is cut into byte ranges, parquet into row groups, over 2 workers
        proc = _script("--tokenizer", "builtin", "--out", str(out), "--text-field", field, "--shard-mb", "0.0005",
                       "--workers", "2", *map(str, inputs))  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        data = Prepared(out)
        want = np.concatenate([[tok.bos_id, *tok.encode(d), tok.eos_id] for d in want_docs])
        assert (
            data.num_docs == len(want_docs) and (data.tokens(0, data.num_tokens) == want).all()
        ), kind
        data.check_tokenizer(tok)
        # document 12 (or the last txt file): its file and row (the jsonl's blank line 6 counts)
        d = min(12, len(want_docs) - 1)
        src = data.source(d)
        row = {"txt": 0, "jsonl": d + 1, "jsonl.gz": d, "parquet": d, "arrow": d - 10}[kind]
        assert src["kind"] == kind and src["row"] == row, (kind, src)
        if kind == "arrow":
            assert src["file"].endswith("data-00001-of-00002.arrow")
        assert "prepared 100.0%" in proc.stderr and "tok/s" in proc.stderr and "eta" in proc.stderr

    # A packed window spans documents: its trace lists each with the token range it takes.
    data = Prepared(tmp_path / "prep-jsonl")
    ds = PackedDataset(data, 32)
    for i in (0, 7, len(ds) - 1):
        trace = ds.trace(i)
        assert sum(b - a for a, b in (t["tokens"] for t in trace)) == 33
        lengths = [len(tok.encode(docs[t["row"] - (t["row"] > 5)])) + 2 for t in trace]
        assert all(
            0 <= t["tokens"][0] < t["tokens"][1] <= n for t, n in zip(trace, lengths, strict=True)
        )


def test_on_the_fly_preparation_is_the_scripts_order_and_mixtures_hit_their_weights(tmp_path, tok):
    docs = _docs(300, seed=1)
    raw = tmp_path / "raw.jsonl"
    raw.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    out = tmp_path / "prep"
    prepare([raw], out, tok, workers=2, shard_bytes=2000)
    cfg = _cfg("--data.path", str(raw))  # raw: prepared into the cache, one shard, in-process
    on_the_fly = build_dataset(cfg, tok)
    cfg.data.path = str(out)
    scripted = build_dataset(cfg, tok)
    assert len(scripted) == len(on_the_fly) > 100
    assert all((scripted[i][0] == on_the_fly[i][0]).all() for i in range(len(scripted)))

    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"text": d}) + "\n" for d in _docs(50, seed=2)))
    cfg.data.path = f"{out}:0.7,{other}:0.3"
    mix = build_dataset(cfg, tok)
    assert mix.sizes[0] == len(scripted) and mix.weights == pytest.approx([0.7, 0.3])
    sampler = GlobalBatchSampler(mix.sizes, 16, 0, mix.weights)
    picks = sampler.sequences(np.arange(10_000))
    share = float((picks < mix.sizes[0]).mean())
    assert abs(share - 0.7) < 0.01, share
    small = (
        picks[picks >= mix.sizes[0]] - mix.sizes[0]
    )  # the small set is read in full, then repeats
    first = small[: mix.sizes[1]]
    assert sorted(first.tolist()) == list(range(mix.sizes[1]))
    j = int(small[0])
    assert (mix[mix.sizes[0] + j][0] == mix.parts[1][j][0]).all()
    with pytest.raises(UserError, match="give each a positive weight"):
        cfg.data.path = f"{out},{other}:0.3"
        build_dataset(cfg, tok)


def test_sampler_is_a_computed_permutation_independent_of_dp_and_accumulation():
    for n in (1, 2, 3, 17, 1000, 4097):
        y = permute(np.arange(n), n, stream_keys(5, 0, np.zeros(n, np.int64)))
        assert sorted(y.tolist()) == list(range(n))
    mixed = GlobalBatchSampler([100, 40], 16, 3, [0.5, 0.5])
    for sizes, weights in (([100], None), ([100, 40], [0.5, 0.5])):
        ref = GlobalBatchSampler(sizes, 16, 3, weights)
        want = [ref.global_batch(t).tolist() for t in range(20)]
        for lb, dp in [(8, 1), (1, 1), (8, 2), (2, 4), (1, 16), (4, 2)]:
            cfg = _cfg("--training.global_batch_size", "16", "--training.local_batch_size", str(lb))
            layout = resolve_layout(cfg, dp)
            samplers = [GlobalBatchSampler(sizes, 16, 3, weights, layout, r) for r in range(dp)]
            got = [
                [i for s in samplers for _ in range(16 // (lb * dp)) for i in next(s)]
                for _ in range(20)
            ]
            assert got == want, (sizes, lb, dp)
            # A sequence's place in the data stream (its dropout key) is the same at every layout.
            for t in (0, 7):
                for s in samplers:
                    for m in range(16 // (lb * dp)):
                        first = s.stream_position(t, m)
                        part = s.rank_share(t)[m * lb : (m + 1) * lb].tolist()
                        assert want[t][first - 16 * t : first - 16 * t + lb] == part, (lb, dp, t, m)
    assert (
        mixed.global_batch(0).tolist()
        != GlobalBatchSampler([100, 40], 16, 4, [0.5, 0.5]).global_batch(0).tolist()
    )
    one = GlobalBatchSampler([100], 20, 3)
    assert sorted(one.sequences(np.arange(100)).tolist()) == list(range(100))  # an epoch: each once
    assert one.sequences(np.arange(100)).tolist() != one.sequences(np.arange(100, 200)).tolist()
    with pytest.raises(UserError, match="has 3 sequences"):
        GlobalBatchSampler([3], 8, 0)


def test_killed_preparation_is_refused_then_resumes_to_the_same_folder(tmp_path, tok):
    raw = tmp_path / "raw.jsonl"
    raw.write_text("".join(json.dumps({"text": d}) + "\n" for d in _docs(8000, seed=3)))
    ref = tmp_path / "ref"
    prepare([raw], ref, tok, shard_bytes=20_000)
    out = tmp_path / "out"
    args = [
        "--tokenizer",
        "builtin",
        "--out",
        str(out),
        "--shard-mb",
        str(20_000 / 2**20),
        "--workers",
        "1",
        str(raw),
    ]
    proc = subprocess.Popen([sys.executable, "scripts/prepare_data.py", *args], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.time() + 120
    while (
        not (out / "shard-00002.json").exists() and time.time() < deadline and proc.poll() is None
    ):
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "meta.json").exists()
    pre = subprocess.run(
        [sys.executable, "-m", "titanlite.preflight", "--world-size", "2", "--config", "train_configs/debug_model.toml", "--data.path", str(out)],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    _one_line_exit_2(pre, "is incomplete (its preparation did not finish)")
    done = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*.json")}
    assert done
    again = _script(*args)
    assert again.returncode == 0, again.stderr
    assert all((out / name).stat().st_mtime_ns == t for name, t in done.items())  # kept, not redone
    a, b = Prepared(ref), Prepared(out)
    assert (
        a.meta["shards"] == b.meta["shards"]
        and (a.tokens(0, a.num_tokens) == b.tokens(0, b.num_tokens)).all()
    )
    assert not list(out.glob(".shard-*"))  # no temporary file left behind

    # A second preparation of the same folder (another run, another node) waits for the lock,
    # then finds the work done and writes nothing.
    again = tmp_path / "again"
    again.mkdir()
    with open(again / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        waiting = subprocess.Popen([sys.executable, "scripts/prepare_data.py", *args[:3], str(again), *args[4:]],
                                   cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
        assert "waiting for another preparation" in waiting.stderr.readline()
        assert not list(again.glob("shard-*"))
        fcntl.flock(lock, fcntl.LOCK_UN)
    assert waiting.wait(timeout=HANG_S) == 0
    listing = {p.name: p.stat().st_mtime_ns for p in again.iterdir()}
    assert Prepared(again).meta["shards"] == a.meta["shards"]
    prepare([raw], again, tok, shard_bytes=20_000)  # done already: nothing is written
    assert {p.name: p.stat().st_mtime_ns for p in again.iterdir()} == listing


def test_a_full_disk_stops_the_preparation_in_one_line_and_the_rerun_resumes(
    tmp_path, tok, monkeypatch
):
    """The third shard's write comes up short, as numpy reports it (no errno), with 1 MiB left:
    one line that says the disk is full, no temporary file, the shards written kept."""
    import errno
    import types

    from titanlite.datasets import prepare as prepare_module
    from titanlite.tools import cache

    raw = tmp_path / "raw.jsonl"
    raw.write_text("".join(json.dumps({"text": d}) + "\n" for d in _docs(3000, seed=5)))
    ref = prepare([raw], tmp_path / "ref", tok, shard_bytes=20_000)
    add = prepare_module._ShardWriter.add

    def short_write(writer, *args) -> None:
        if writer.name == "shard-00002":
            raise OSError("38996 requested and 29726 written")
        add(writer, *args)

    out = tmp_path / "out"
    with monkeypatch.context() as m:
        m.setattr(prepare_module._ShardWriter, "add", short_write)
        m.setattr(cache.shutil, "disk_usage", lambda path: types.SimpleNamespace(free=1 << 20))
        with pytest.raises(TrainingError, match=r"^preparing the data: disk full under '.*' \(1\.0 MiB left\); "
                           r".* then rerun: the 2 of \d+ shards written are kept$"):  # fmt: skip
            prepare([raw], out, tok, shard_bytes=20_000)
    assert sorted(p.name for p in out.glob("shard-*.json")) == [
        "shard-00000.json",
        "shard-00001.json",
    ]
    assert not list(out.glob(".shard-*"))
    assert prepare([raw], out, tok, shard_bytes=20_000)["shards"] == ref["shards"]
    # ... a short write with space left is not a full disk: the error as it came
    with monkeypatch.context() as m:
        m.setattr(prepare_module._ShardWriter, "add", short_write)
        with pytest.raises(OSError, match="requested and"):
            prepare([raw], tmp_path / "other", tok, shard_bytes=20_000)
    # ENOSPC, however deep: a cause, or one rank's failure among those DCP gathers
    enospc = OSError(errno.ENOSPC, "No space left on device")
    gathered = RuntimeError("a rank failed")
    gathered.failures = {1: (enospc, None)}
    assert cache.disk_full(gathered, tmp_path).startswith(f"disk full under '{tmp_path}' (")
    assert cache.disk_full(RuntimeError("unexpected pos 704 vs 598"), tmp_path) is None


def test_bad_inputs_are_one_line_and_leave_nothing_half_written(tmp_path, tok):
    raw = tmp_path / "raw.jsonl"
    raw.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"body": "no text"}) + "\n")
    out = tmp_path / "out"
    proc = _script("--tokenizer", "builtin", "--out", str(out), str(raw))
    _one_line_exit_2(proc, f"'{raw}' line 2 has no string field \"text\"; set data.text_field")
    assert not (out / "meta.json").exists() and not list(out.glob("shard-*"))
    lines = [json.dumps({"text": d}) for d in _docs(300)]
    lines[249] = "{oops"
    raw.write_text("\n".join(lines) + "\n")  # line 250 lies in a later byte range: still named
    _one_line_exit_2(
        _script("--tokenizer", "builtin", "--out", str(out), "--shard-mb", "0.002", str(raw)),
        f"'{raw}' line 250 is not valid JSON",
    )
    assert not (out / "meta.json").exists() and not list(out.glob(".shard-*"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.jsonl").write_text("\n")
    _one_line_exit_2(
        _script("--tokenizer", "builtin", "--out", str(tmp_path / "e"), str(tmp_path / "empty")),
        "hold no documents",
    )
    _one_line_exit_2(
        _script("--tokenizer", "builtin", "--out", str(out), str(tmp_path / "nothing")),
        "does not exist",
    )
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 not really")
    _one_line_exit_2(
        _script("--tokenizer", "builtin", "--out", str(out), str(broken)),
        "is not a readable parquet file",
    )

    raw.write_text("".join(json.dumps({"text": d}) + "\n" for d in _docs(50)))
    good = tmp_path / "good"
    prepare([raw], good, tok, shard_bytes=1000)
    # another tokenizer than the run's: refused before torchrun starts
    other = tmp_path / "other.model"
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(sentence_iterator=iter(_docs(300)), model_prefix=str(other.with_suffix("")),
                                   vocab_size=60, model_type="bpe", byte_fallback=False)  # fmt: skip
    pre = [
        sys.executable,
        "-m",
        "titanlite.preflight",
        "--world-size",
        "2",
        "--config",
        "train_configs/debug_model.toml",
        "--data.path",
        str(good),
    ]
    proc = subprocess.run(
        [*pre, "--model.tokenizer_path", str(other)], cwd=REPO, capture_output=True, text=True
    )
    _one_line_exit_2(proc, "was tokenized with builtin:")
    # only the recorded vocabulary edited: the refusal names the field that differs
    meta = json.loads((good / "meta.json").read_text())
    edited = json.loads(json.dumps(meta))
    edited["tokenizer"]["vocab_size"] = 50000
    (good / "meta.json").write_text(json.dumps(edited))
    with pytest.raises(
        UserError, match=re.escape("they differ (vocab_size 50000 vs 2048: meta.json vs this run)")
    ):
        Prepared(good).check_tokenizer(tok)
    (good / "meta.json").write_text(json.dumps(meta))
    proc = subprocess.run([*pre, "--data.mode", "sft"], cwd=REPO, capture_output=True, text=True)
    _one_line_exit_2(proc, "was prepared for pretrain but data.mode is sft")
    # an unreadable (truncated) shard: refused at start-up, by name
    shard = good / "shard-00001.tokens"
    shard.write_bytes(shard.read_bytes()[:-2])
    _one_line_exit_2(
        subprocess.run(pre, cwd=REPO, capture_output=True, text=True),
        "shard file shard-00001.tokens is",
    )
    _one_line_exit_2(
        _script("--tokenizer", "builtin", "--mode", "sft", "--out", str(good), str(raw)),
        "already holds a preparation of other inputs",
    )


def test_sft_records_without_a_target_at_seq_len(tmp_path, tok):
    """A set where no record has a target inside seq_len stops before training, saying how many
    and what seq_len fits; one where some have none says what fraction at start-up."""
    long_prompt = " ".join(WORDS * 8)
    recs = [{"instruction": long_prompt, "output": "short"} for _ in range(6)]
    recs += [
        {
            "messages": [
                {"role": "user", "content": long_prompt},
                {"role": "assistant", "content": "ok"},
            ]
        }
    ]
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    cfg = _cfg("--data.mode", "sft", "--data.path", str(path), "--training.seq_len", "64")
    with pytest.raises(
        UserError,
        match=r"none of its 7 records has a target token within seq_len=64 .*seq_len >= \d+",
    ):
        build_dataset(cfg, tok)
    first = min(len(tok.encode(r["instruction"])) for r in recs[:6])
    assert first > 64
    path.write_text(
        "".join(json.dumps(r) + "\n" for r in [*recs, {"instruction": "hi", "output": "there"}])
    )
    ds = build_dataset(cfg, tok)
    note = ds.parts[0].check_targets()
    assert note and "7 of 8 records (87.5%) have no target token within seq_len=64" in note
    x, y = ds[7]
    assert tok.decode(y[y != IGNORE_INDEX].tolist()[:-1]) == "there"
    assert ds.trace(7)[0]["row"] == 7 and ds.trace(7)[0]["file"] == str(path.resolve())

    # The same records as parquet (chat and alpaca rows in one table): the same tokens and targets.
    rows = [*recs, {"instruction": "hi", "output": "there"}]
    table = pa.Table.from_pylist([{"messages": None, "input": None, **r} for r in rows])
    pq.write_table(table, tmp_path / "sft.parquet")
    a, b = tmp_path / "from-jsonl", tmp_path / "from-parquet"
    prepare([path], a, tok, mode="sft")
    prepare([tmp_path / "sft.parquet"], b, tok, mode="sft")
    pa_, pb = Prepared(a), Prepared(b)
    for i in range(len(rows)):
        (ta, ma), (tb, mb) = pa_.document(i), pb.document(i)
        assert (ta == tb).all() and (ma == mb).all() and ma.any()


def test_trace_batch_names_the_documents_each_rank_read(tmp_path, tok, capsys):
    """scripts/trace_batch.py: a step's sequences, each rank's share as its loader reads it, and
    the source rows behind every sequence."""
    tool = load_script("trace_batch")
    raw = tmp_path / "raw.jsonl"
    raw.write_text("".join(json.dumps({"text": d}) + "\n" for d in _docs(200, seed=4)))
    args = [
        "--training.seq_len",
        "32",
        "--training.global_batch_size",
        "8",
        "--data.path",
        str(raw),
    ]
    args += ["--config", "train_configs/debug_model.toml", "--training.local_batch_size", "2"]
    assert tool.main(["--step", "3", "--dp", "2", "--rank", "1", "--json", *args]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    cfg = parse_args(args)[0]
    ds = build_dataset(cfg, tok)
    layout = resolve_layout(cfg, 2)
    loader_rank1 = GlobalBatchSampler(ds.sizes, 8, cfg.training.seed, None, layout, 1)
    for _ in range(4):  # steps 1 and 2: two microbatches each
        next(loader_rank1)
    assert [r["sequence"] for r in rows] == next(loader_rank1) + next(loader_rank1)
    assert [r["position"] for r in rows] == [4, 5, 6, 7] and {r["rank"] for r in rows} == {1}
    for r in rows:
        assert r["sources"] == ds.trace(r["sequence"]) and r["sources"][0]["file"] == str(
            raw.resolve()
        )
    assert tool.main(["--step", "0", *args]) == 2
    assert "--step is '0'; it must be a whole number >= 1" in capsys.readouterr().err


def test_a_folder_says_what_it_left_out(tmp_path):
    """Files of no readable kind under a data folder are left out, and said so, by suffix."""
    from titanlite.datasets.corpus import discover

    (tmp_path / "a.txt").write_text("text\n")
    (tmp_path / "sub").mkdir()
    for name in ("x.py", "y.py", "z.py", "README", "w.csv"):
        (tmp_path / "sub" / name).write_text("x\n")
    (tmp_path / ".hidden.py").write_text("x\n")  # hidden: not data, not counted
    said: list[str] = []
    assert discover(tmp_path, said.append) == [tmp_path / "a.txt"]
    assert said == [
        f"data path '{tmp_path}': 5 file(s) of no readable kind left out (3 .py, 1 (no suffix), 1 .csv); "
        "read: .txt, .md, .jsonl, .jsonl.gz, .parquet, .arrow"
    ], said
    said.clear()
    assert discover(tmp_path / "a.txt", said.append) == [tmp_path / "a.txt"] and said == []


@pytest.mark.parametrize("seed", range(6))
def test_the_epochs_said_at_start_are_what_the_sampler_reads(seed):
    """epochs(steps), which the loader says as a run starts, against the positions the sampler
    hands each dataset over those steps, for generated data sizes, mixtures, batches and steps."""
    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, 4))
    sizes = [int(x) for x in rng.integers(20, 3000, size=k)]
    weights = [float(w) for w in rng.uniform(0.1, 1.0, size=k)] if k > 1 else None
    g = int(rng.choice([4, 8, 16, 64]))
    steps = int(rng.integers(1, 300)) * (MIX_BLOCK // g if k > 1 else 1)  # whole blocks: exact
    sampler = GlobalBatchSampler(sizes, g, 3, weights)
    datasets, _ = sampler.datasets_of(np.arange(steps * g))
    read = np.bincount(datasets, minlength=k)
    assert sampler.epochs(steps) == pytest.approx(
        [r / n for r, n in zip(read, sizes, strict=True)], rel=1e-12
    )
    line = sampler.epochs_line(steps)
    assert line.startswith(f"data: {sum(sizes):,} sequences; {steps} steps of {g} read ")
    assert ("read again" in line) == (max(read[d] / sizes[d] for d in range(k)) > 1), line
