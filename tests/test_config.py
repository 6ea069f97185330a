from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from titanlite.config import load_config, parse_args
from titanlite.config.job_config import JobConfig
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
    # extra axes split sequences: the data-parallel ranks are the world over their product
    lay = _layout(
        8,
        parallelism__axes='["cp=2", "x=2"]',
        training__global_batch_size=8,
        training__local_batch_size=1,
    )
    assert (lay.dp, lay.seq_split, lay.world, lay.grad_accum, lay.axes) == (
        2,
        4,
        8,
        4,
        (("cp", 2), ("x", 2)),
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
            "split each sequence over 3 ranks, which does not divide the 4",
        ),
        (4, dict(parallelism__axes='["cp"]'), "entry 'cp' is not name=degree"),
        (4, dict(parallelism__axes='["cp=0"]'), "entry 'cp=0' is not name=degree"),
        (4, dict(parallelism__axes='["2=2"]'), "entry '2=2' is not name=degree"),
        (4, dict(parallelism__axes='["cp=2", "cp=2"]'), "names 'cp' twice"),
        (4, dict(parallelism__axes='["dp_shard=2"]'), "as a data-parallel axis"),
        (
            4,
            dict(parallelism__axes='["cp=2"]', parallelism__dp_shard=4),
            "1 x 4 != 2 ranks (after the 2 that split",
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
        (["--data.mode", "sft", "--data.document_mask", "true"], "for SFT set data.packing = true"),
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
