from __future__ import annotations

import dataclasses
import itertools
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from titanlite.config import load_config, parse_args
from titanlite.config.fields import value_of
from titanlite.config.job_config import JobConfig, sections
from titanlite.config.layout import resolve_layout
from titanlite.config.manager import to_toml
from titanlite.datasets.spec import check_data_files
from titanlite.errors import UserError
from titanlite.validation import validate


def test_overrides_types_and_lists():
    cfg, path = parse_args(
        [
            "--training.steps",
            "5",
            "--optimizer.lr=3e-4",
            "--metrics.enable_tensorboard",
            "false",
            "--faults.ignore_all_labels_steps",
            "2,3",
        ]
    )
    assert path is None
    assert cfg.training.steps == 5 and cfg.optimizer.lr == 3e-4
    assert cfg.metrics.enable_tensorboard is False
    assert cfg.faults.ignore_all_labels_steps == [2, 3]


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--training.stpes", "4"],
            "unknown config key 'training.stpes' (did you mean 'training.steps'?)",
        ),
        (["--trainig.steps", "4"], "unknown config section 'trainig' (did you mean 'training'?)"),
        (
            ["--training.steps", "four"],
            "config key 'training.steps' must be an integer, got 'four'",
        ),
        (
            ["--loss.normalization", "mean"],
            "config key 'loss.normalization' is 'mean'; choose one of global, local_mean",
        ),
        (["--training.steps"], "override '--training.steps' has no value"),
        (["steps=3"], "unexpected argument 'steps=3'"),
        (["--config", "nope.toml"], "config file 'nope.toml' not found"),
    ],
)
def test_bad_flags_give_one_line_naming_the_fix(argv, message):
    with pytest.raises(UserError) as e:
        parse_args(argv)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_toml_errors(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[training\nsteps = 3\n")
    with pytest.raises(UserError, match="is not valid TOML"):
        load_config(str(bad))
    bad.write_text("[training]\nsteps = 'ten'\n")
    with pytest.raises(UserError, match="'training.steps' must be an integer"):
        load_config(str(bad))
    bad.write_text("[optimiser]\nlr = 1.0\n")
    with pytest.raises(UserError, match="did you mean 'optimizer'"):
        load_config(str(bad))
    bad.write_text("[training]\nglobal_batch = 8\n")
    with pytest.raises(UserError, match="did you mean 'training.global_batch_size'"):
        load_config(str(bad))


def test_resolved_config_round_trips(tmp_path):
    cfg, _ = parse_args(
        [
            "--training.seq_len",
            "128",
            "--job.description",
            'say "hi"',
            "--faults.ignore_all_labels_steps",
            "4",
        ]
    )
    f = tmp_path / "config.toml"
    f.write_text(to_toml(cfg))
    assert load_config(str(f)) == cfg


def _layout(world, **kw):
    args = []
    for k, v in kw.items():
        args += [f"--{k.replace('__', '.')}", str(v)]
    return resolve_layout(parse_args(args)[0], world)


def test_layout_modes_and_accumulation():
    lay = _layout(8, training__global_batch_size=32, training__local_batch_size=2)
    assert (lay.mode, lay.dp_replicate, lay.dp_shard, lay.grad_accum, lay.skip_grad_sync) == (
        "fsdp",
        1,
        8,
        2,
        False,
    )
    lay = _layout(
        8, parallelism__dp_replicate=8, training__global_batch_size=8, training__local_batch_size=1
    )
    assert (lay.mode, lay.dp_shard, lay.grad_accum, lay.skip_grad_sync) == ("ddp", 1, 1, True)
    lay = _layout(
        8, parallelism__dp_replicate=2, training__global_batch_size=16, training__local_batch_size=1
    )
    assert (lay.mode, lay.dp_replicate, lay.dp_shard, lay.grad_accum) == ("hsdp", 2, 4, 2)
    lay = _layout(
        2,
        parallelism__dp_replicate=2,
        parallelism__mode="hsdp",
        training__global_batch_size=4,
        training__local_batch_size=2,
    )
    assert (lay.mode, lay.dp_replicate, lay.dp_shard) == ("hsdp", 2, 1)
    # the axes' ranks read the same sequences: the data-parallel ranks are the world over their
    # product, and only the sequence split cuts positions
    lay = _layout(
        8,
        parallelism__axes='["tp=2", "cp=2"]',
        training__global_batch_size=8,
        training__local_batch_size=1,
    )
    assert (lay.dp, lay.seq_split, lay.world, lay.grad_accum, lay.axes) == (
        2,
        2,
        8,
        4,
        (("cp", 2), ("tp", 2)),
    )


@pytest.mark.parametrize(
    "world, kw, message",
    [
        (
            2,
            dict(training__global_batch_size=7, training__local_batch_size=1),
            "global_batch_size=7 is not a multiple",
        ),
        (4, dict(parallelism__dp_replicate=3), "dp_replicate=3 does not divide the 4 ranks"),
        (4, dict(parallelism__dp_shard=3), "dp_replicate x dp_shard = 1 x 3 != 4 ranks"),
        (2, dict(parallelism__mode="ddp", parallelism__dp_shard=2), "mode 'ddp' needs dp_shard 1"),
        (
            2,
            dict(parallelism__dp_replicate=2, parallelism__skip_grad_sync="off"),
            "cannot be exact with ddp",
        ),
        (
            4,
            dict(parallelism__axes='["cp=3"]'),
            "axes cp=3 take 3 ranks per data-parallel rank, which does not divide the 4",
        ),
        (4, dict(parallelism__axes='["cp"]'), "entry 'cp' is not name=degree"),
        (4, dict(parallelism__axes='["cp=0"]'), "entry 'cp=0' is not name=degree"),
        (4, dict(parallelism__axes='["2=2"]'), "entry '2=2' is not name=degree"),
        (4, dict(parallelism__axes='["cp=2", "cp=2"]'), "names 'cp' twice"),
        (4, dict(parallelism__axes='["dp_shard=2"]'), "as a data-parallel axis"),
        (
            4,
            dict(parallelism__axes='["cp=2"]', parallelism__dp_shard=4),
            "1 x 4 != 2 ranks (after the 2 of cp=2 per data-parallel rank)",
        ),
        (
            4,
            dict(parallelism__axes='["cp=4"]', training__seq_len=6),
            "seq_len 6 does not split into 4 equal pieces",
        ),
    ],
)
def test_bad_layouts(world, kw, message):
    with pytest.raises(UserError, match=re.escape(message)):
        _layout(world, **kw)


def test_missing_files_are_named(tmp_path):
    cfg, _ = parse_args(["--data.path", str(tmp_path / "none.jsonl")])
    with pytest.raises(UserError, match="none.jsonl' does not exist"):
        check_data_files(cfg)
    cfg, _ = parse_args(["--model.tokenizer_path", str(tmp_path / "tok.model")])
    with pytest.raises(UserError, match="tok.model' is not a file"):
        validate(cfg, 1)


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--data.mode", "synthetic"],
            "set model.vocab_size (e.g. 128256) or model.hf_assets_path",
        ),
        (
            ["--data.mode", "synthetic", "--model.vocab_size", "512", "--data.path", "x"],
            "leave data.path empty",
        ),
        (["--model.vocab_size", "-1"], "model.vocab_size is -1; it must be >= 0"),
        (["--training.steps", "0"], "training.steps is 0; it must be >= 1"),
    ],
)
def test_synthetic_data_and_vocab_size_are_checked_before_any_worker(argv, message):
    cfg, _ = parse_args(argv)
    with pytest.raises(UserError, match=re.escape(message)):
        validate(cfg, 1)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--data.packing", "true"], "data.packing packs SFT records but data.mode is 'pretrain'"),
        (
            ["--data.mode", "sft", "--data.document_mask", "true"],
            "set data.document_mask = false; to pack several SFT records",
        ),
        (["--eval.fraction", "0.7"], "eval.fraction is 0.7; hold out between 0 and 0.5"),
        (
            ["--eval.path", "/nonexistent/val.jsonl"],
            "eval.path '/nonexistent/val.jsonl' does not exist",
        ),
        (["--eval.path", "a:0.5,b:0.5"], "names several datasets; give one"),
        (["--eval.prompts", '["hi, there"]'], "no eval set: set eval.fraction or eval.path"),
        (
            ["--eval.fraction", "0.1", "--eval.top_p", "0"],
            "eval.top_p is 0.0; it must be > 0.0 and <= 1.0",
        ),
        (
            ["--eval.fraction", "0.1", "--eval.sample_tokens", "0"],
            "eval.sample_tokens is 0; it must be >= 1",
        ),
        (["--eval.prompts", "[not json"], "is not a valid JSON list"),
    ],
)
def test_packing_and_eval_options_are_checked_before_any_worker(argv, message):
    with pytest.raises(UserError, match=re.escape(message)):
        cfg = parse_args(argv)[0]
        validate(cfg, 1)
        check_data_files(cfg)


def test_a_model_without_positions_or_keys_is_refused_with_packing_or_keyed_dropout_in_one_line():
    """A fork's model whose forward takes no positions cannot attend per document; one that
    takes no sample_keys cannot key its dropout masks by sample."""
    from titanlite.models.registry import build_meta_model

    toy = [
        "--model.name",
        "toy_mlp",
        "--model.import_module",
        "toy_model",
        "--model.flavor",
        "tiny",
    ]
    cfg, _ = parse_args([*toy, "--data.document_mask", "true"])
    with pytest.raises(UserError, match=re.escape("model 'toy_mlp' has no per-document attention")):
        build_meta_model(cfg, 2048)
    build_meta_model(parse_args(toy)[0], 2048)  # without it: built
    cfg, _ = parse_args([*toy, "--model.dropout", "0.1", "--model.dropout_masks", "sample"])
    with pytest.raises(
        UserError, match=re.escape("model.dropout_masks 'sample': model 'toy_mlp' has no")
    ):
        build_meta_model(cfg, 2048)


def test_a_json_list_on_the_command_line_keeps_its_commas():
    cfg, _ = parse_args(
        ["--eval.prompts", '["a, b", "c"]', "--faults.ignore_all_labels_steps", "1,3"]
    )
    assert cfg.eval.prompts == ["a, b", "c"] and cfg.faults.ignore_all_labels_steps == [1, 3]


def test_vocab_size_pads_the_tokenizers_and_may_not_cut_it():
    from titanlite.models.registry import build_meta_model

    cfg, _ = parse_args(["--model.vocab_size", "4096"])
    assert build_meta_model(cfg, 2048).model.output.weight.shape[0] == 4096
    assert build_meta_model(parse_args([])[0], 2048).model.output.weight.shape[0] == 2048
    with pytest.raises(
        UserError, match=re.escape("model.vocab_size is 4096 but the tokenizer's ids reach 5000")
    ):
        build_meta_model(cfg, 5001)


def test_shipped_configs_load():
    from pathlib import Path

    for f in sorted(Path(__file__).parents[1].glob("train_configs/*.toml")):
        load_config(str(f))


def test_exact_diagnostics_under_hsdp_is_refused_before_any_worker(capsys):
    from titanlite import preflight

    hsdp = ["--parallelism.dp_replicate", "2", "--training.local_batch_size", "1"]
    cfg, _ = parse_args([*hsdp, "--diagnostics.method", "exact"])
    with pytest.raises(
        UserError, match=r"diagnostics.method 'exact' needs fsdp or ddp .* 'sketch'"
    ):
        validate(cfg, 4)
    validate(cfg, 2)  # dp_replicate 2 of 2 ranks is ddp: exact is fine there
    cfg.diagnostics.enable = False
    validate(cfg, 4)  # nothing measures, nothing to refuse
    argv = ["--world-size", "4", *hsdp, "--diagnostics.method", "exact"]
    assert preflight.main(argv) == 2
    assert "titanlite: error: diagnostics.method 'exact'" in capsys.readouterr().err


def test_help_lists_every_key_with_type_default_and_doc():
    from dataclasses import fields

    from titanlite.config import JobConfig
    from titanlite.config.job_config import sections
    from titanlite.config.manager import config_help

    text = config_help("usage: here")
    for name, section in sections(JobConfig()):
        assert f"[{name}]" in text
        for f in fields(section):
            assert f.metadata["help"] in text, f.name
    assert '  --training.device str = "auto"\n' in text and "(one of: auto, cpu, cuda)" in text
    assert "--faults." not in text and "[faults] (titanlite.faults.switches)" in text
    assert "linear warmup steps from lr/warmup_steps to lr (>= 0)\n" in text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--optimizer.lr", "nan"], "optimizer.lr is nan; it must be a finite number > 0.0"),
        (["--optimizer.lr", "inf"], "optimizer.lr is inf; it must be a finite number > 0.0"),
        (["--lr_scheduler.warmup_steps", "-3"], "lr_scheduler.warmup_steps is -3; it must be >= 0"),
        (["--optimizer.beta2", "1"], "optimizer.beta2 is 1.0; it must be >= 0.0 and < 1.0"),
        (
            ["--training.max_norm", "-inf"],
            "training.max_norm is -inf; it must be a finite number >= 0.0",
        ),
        (["--alerts.persist_frac", "0"], "alerts.persist_frac is 0.0; it must be > 0.0 and <= 1.0"),
        (
            ["--spike_guard.min_history", "200"],
            "spike_guard.min_history is 200 but spike_guard.window is 100",
        ),
        (["--job.run_name", ".."], "job.run_name '..' would write outside job.dump_folder"),
        (["--job.run_name", "../escaped"], "job.run_name '../escaped' would write outside"),
        (["--job.run_name", "/tmp/absrun"], "job.run_name '/tmp/absrun' would write outside"),
        (["--job.run_name", "x" * 300], "is 300 bytes; file systems allow 255"),
        (
            ["--faults.hang_rank", "5"],
            "faults.hang_rank is 5 but there are 1 ranks; use -1 or a rank below 1",
        ),
    ],
)
def test_every_value_is_checked_before_any_worker(argv, message):
    """Numbers finite and within the bounds that live with each field (titanlite.config.fields.opt:
    --help prints them), run names inside the dump folder: validate, which the preflight runs
    before any worker, checks them all."""
    with pytest.raises(UserError, match=re.escape(message)):
        validate(parse_args(argv)[0], 1)
    validate(parse_args(["--job.run_name", "sweep/lr-3e-4"])[0], 1)  # nesting groups runs


def test_a_config_file_that_is_not_text_or_is_a_folder_is_one_line(tmp_path):
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe[training]\n")
    with pytest.raises(UserError, match=re.escape("is not UTF-8 text (byte 0); pass a TOML file")):
        load_config(str(binary))
    with pytest.raises(UserError, match="is a folder; pass a .toml file"):
        load_config(str(tmp_path))


@settings(derandomize=True, database=None, max_examples=400, deadline=None)
@given(
    world=st.integers(1, 16),
    replicate=st.integers(-1, 8),
    shard=st.integers(-2, 16),
    global_batch=st.integers(-2, 96),
    local=st.integers(-1, 16),
    seq=st.integers(-1, 8),
    mode=st.sampled_from(["auto", "fsdp", "ddp", "hsdp"]),
    skip=st.sampled_from(["auto", "on", "off"]),
    method=st.sampled_from(["auto", "exact", "sketch"]),
    diagnostics=st.booleans(),
    sketch_dim=st.integers(16, 80),
)
def test_the_plan_is_resolved_once_or_refused_in_one_line(
    world, replicate, shard, global_batch, local, seq, mode, skip, method, diagnostics, sketch_dim
):
    """Any layout, batch and method at any world size: the plan either holds together (the
    global batch is dp x local x accumulation, tokens per step and the batch unit follow, the
    method is resolved) or is refused as one UserError line: never ValueError or
    ZeroDivisionError."""
    cfg = JobConfig()
    p, t = cfg.parallelism, cfg.training
    p.dp_replicate, p.dp_shard, p.mode, p.skip_grad_sync = replicate, shard, mode, skip
    t.global_batch_size, t.local_batch_size, t.seq_len = global_batch, local, seq
    cfg.diagnostics.method, cfg.diagnostics.enable = method, diagnostics
    cfg.diagnostics.sketch_dim = sketch_dim
    try:
        plan = validate(cfg, world)  # the door: bounds, then the layout
    except UserError as e:
        assert "\n" not in str(e) and str(e)
        return
    assert plan.dp == world and plan.global_batch == plan.local_batch * plan.dp * plan.grad_accum
    assert plan.tokens_per_rank_step * plan.dp == global_batch * seq
    assert plan.batch_unit * plan.grad_accum == plan.global_batch
    assert plan.diagnostics_method in ("exact", "sketch")
    assert plan.diagnostics_method == method or method == "auto"
    if method == "auto" and 4 * plan.dp > sketch_dim:  # past it the sketch sends less than the Gram
        assert plan.diagnostics_method == "sketch"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--eval.prompts", '["hi"]'], "eval.prompts with parallelism.axes"),
        (
            ["--diagnostics.enable", "false", "--debug.fingerprint_step", "11"],
            "debug.fingerprint_step is 11 but the run has 10",
        ),
        (["--debug.stop_after_step", "11"], "debug.stop_after_step is 11"),
    ],
)
def test_what_a_sequence_split_or_a_debug_step_cannot_do_is_refused(flags, message):
    cfg, _ = parse_args(["--parallelism.axes", '["cp=2"]', "--training.steps", "10", *flags])
    with pytest.raises(UserError, match=re.escape(message)):
        validate(cfg, 2)
    cfg.eval.prompts = []
    cfg.debug.fingerprint_step = cfg.debug.stop_after_step = 10
    validate(cfg, 2)


# ---- keys another key leaves unused (titanlite.config.unused) ---------------------------------

# For each UNUSED rule: the settings that leave the key unused, and a value of the key's own
ASIDE = {
    "model.flavor": ({"model.hf_assets_path": "assets/hf/SmolLM2-135M"}, "1B"),
    "model.vocab_size": ({"model.hf_assets_path": "assets/hf/SmolLM2-135M"}, 1024),
    "model.builtin_vocab_size": ({"model.tokenizer_path": "tok/tokenizer.json"}, 1024),
    "model.tokenizer_path": ({"data.mode": "synthetic", "model.vocab_size": 256}, "tok/tokenizer.json"),
    "model.dropout_masks": ({"model.dropout": 0.0}, "sample"),
    "checkpoint.initial_load_model_only": ({"checkpoint.initial_load_path": ""}, False),
    "checkpoint.initial_load_drop": ({"checkpoint.initial_load_path": ""}, ["layers.0.attention.wq.weight"]),
}  # fmt: skip


def _flags(settings: dict) -> list[str]:
    out = []
    for key, value in settings.items():
        text = ",".join(value) if isinstance(value, list) else str(value).lower() if isinstance(value, bool) else str(value)  # fmt: skip
        out += [f"--{key}", text]
    return out


def _toml(tmp_path, settings: dict) -> str:
    from titanlite.config.manager import _toml_value

    tables: dict = {}
    for key, value in settings.items():
        section, name = key.split(".")
        tables.setdefault(section, []).append(f"{name} = {_toml_value(value)}")
    path = tmp_path / "config.toml"
    path.write_text("".join(f"[{s}]\n" + "\n".join(lines) + "\n" for s, lines in tables.items()))
    return str(path)


def test_every_unused_rule_has_a_case():
    from titanlite.config.unused import UNUSED

    assert {u.key for u in UNUSED} == set(ASIDE)


@pytest.mark.parametrize("key", ASIDE)
def test_a_key_another_leaves_unused_is_refused_where_asked_last_else_recorded_as_unused(
    key, tmp_path
):
    """Set at the level of what leaves it unused or later: one line naming it. Set in the file
    with the command line leaving it unused: one note, and the run holds its default. At its
    default: nothing said. Either way config.toml records it as unused, never a value, and two
    runs that differ only in it have one identity (compare_runs and a resume take them as one)."""
    from titanlite.config.fields import identity, value_of

    deciding, value = ASIDE[key]
    mine = {key: value}
    for file, flags in (({**deciding, **mine}, {}), ({}, {**deciding, **mine}), (deciding, mine)):
        with pytest.raises(UserError) as e:
            load_config(_toml(tmp_path, file) if file else None, _flags(flags), notes=[])
        said = str(e.value)
        assert "\n" not in said and said.startswith(f"{key} = ") and "is not used beside" in said, (
            said
        )
    notes: list[str] = []
    noted = load_config(_toml(tmp_path, mine), _flags(deciding), notes=notes)
    assert len(notes) == 1 and notes[0].startswith(f"{key} = ") and "config.toml records it as unused" in notes[0], notes  # fmt: skip
    quiet: list[str] = []
    default = load_config(None, _flags(deciding), notes=quiet)
    assert quiet == [] and value_of(noted, key) == value_of(default, key) != value
    name = key.split(".")[1]
    for cfg in (noted, default):
        text = to_toml(cfg)
        assert f"\n# {name}: not used (" in text and f"\n{name} = " not in text, text
        (tmp_path / "back.toml").write_text(text)
        assert load_config(str(tmp_path / "back.toml")) == cfg
    assert identity(noted) == identity(default) and to_toml(noted) == to_toml(default)


def test_two_runs_of_one_hugging_face_folder_compare_whatever_flavor_their_files_named(tmp_path):
    """compare_runs takes two runs of the same folder as the same model, whatever flavor their
    config files held (the command line named the folder)."""
    from titanlite.analysis.compare import config_diff
    from titanlite.analysis.runs import load_run

    runs = []
    for name, file in (("a", {"model.flavor": "1B"}), ("b", {})):
        folder = tmp_path / name
        folder.mkdir()
        cfg = load_config(
            _toml(tmp_path, file) if file else None,
            _flags({"model.hf_assets_path": "hf/x"}),
            notes=[],
        )
        (folder / "config.toml").write_text(to_toml(cfg))
        (folder / "run.json").write_text('{"mode": "fsdp", "dp_replicate": 1, "dp_shard": 2, "local_batch_size": 2, "grad_accum": 1, "param_dtype": "float32"}')  # fmt: skip
        (folder / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
        runs.append(load_run(folder))
    assert config_diff(*runs).refused == []


# A fix a refusal offers: `set KEY = VALUE` (and the pairs after it in its clause) or `--KEY VALUE`.
_FIX_VERB = re.compile(r"\b(?:set|add|use)\b|\bor\b")
_VALUE = r"('[^']*'|\"[^\"]*\"|true|false|-?[0-9][0-9.e+-]*)"
_PAIR = re.compile(rf"--([a-z_]+\.[a-z_]+)[ =]{_VALUE}|\b([a-z_]+\.[a-z_]+) = {_VALUE}")


def offered_fixes(message: str) -> list[tuple[str, str]]:
    """Each `key = value` a refusal tells the user to set: the pairs that follow a fix's verb
    (set, add, use, or) within one clause (clauses end at ';' and ':')."""
    fixes = []
    for clause in re.split(r"[;:] ", message):
        verb = _FIX_VERB.search(clause)
        if verb:
            fixes += [(k or k2, v or v2) for k, v, k2, v2 in _PAIR.findall(clause[verb.end() :])]
    return fixes


def _switches() -> list[tuple[str, list]]:
    """Every true/false and choice key of the config, with each value it takes."""
    out = []
    for name, section in sections(JobConfig()):
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            if isinstance(value, bool):
                out.append((f"{name}.{f.name}", [False, True]))
            elif f.metadata.get("choices"):
                out.append((f"{name}.{f.name}", list(f.metadata["choices"])))
    return out


def _text(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def test_offered_fixes_reads_what_a_refusal_tells_the_user_to_set():
    assert offered_fixes(
        "x is on: set data.packing = false (and data.document_mask = true to keep)"
    ) == [
        ("data.packing", "false"),
        ("data.document_mask", "true"),
    ]
    assert offered_fixes("a = false needs b; set it to true") == []
    assert offered_fixes("y; add --data.accept_change true to go on") == [
        ("data.accept_change", "true")
    ]
    assert offered_fixes("z; use diagnostics.method = 'sketch' or 'auto'") == [
        ("diagnostics.method", "'sketch'")
    ]


def _refusal(settings: dict[str, object]) -> str | None:
    """The preflight's config checks (validate, the data files) on the defaults with `settings`
    set: the refusal's line, or None."""
    cfg = JobConfig()
    for key, value in settings.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    try:
        validate(cfg, 1)
        check_data_files(cfg)
    except UserError as e:
        return str(e)
    return None


def test_no_refusal_offers_a_fix_the_config_already_holds():
    """Every true/false and choice key at each of its values; then every pair and triple of the
    keys those refusals name, at every combination of their values: where a refusal tells the
    user to set `key = value`, the config does not hold that value already."""
    switches = dict(_switches())
    assert len(switches) > 20
    named: set[str] = set()  # the keys the rules read, as their refusals name them
    for key, values in switches.items():
        for value in values:
            if (line := _refusal({key: value})) is not None:
                named |= set(re.findall(r"[a-z_]+\.[a-z_]+", line)) & set(switches) | {key}
    assert {"data.packing", "data.document_mask", "data.mode"} <= named, named
    checked = 0
    for n in (1, 2, 3):
        for keys in itertools.combinations(sorted(named), n):
            for values in itertools.product(*(switches[k] for k in keys)):
                settings = dict(zip(keys, values, strict=True))
                line = _refusal(settings)
                for key, fix in offered_fixes(line or ""):
                    held = settings.get(key, value_of(JobConfig(), key))
                    assert _text(held) != fix.strip("'\""), (
                        f"{settings}: '{line}' offers {key} = {fix}"
                    )
                    checked += 1
    assert checked > 10, checked
