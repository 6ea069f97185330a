"""The one reader of checkpoints outside the trainer's resume (titanlite.components.checkpoint.index:
step_to_read, read_checkpoint), which export, generation, a new run's initial weights and every
script go through: given a run folder, a damaged newest step falls back to the newest intact one
with one line; given a step folder, a damaged one is refused in one line naming what is wrong and
the intact steps beside it; a read that fails after the checks passed counts as damage too. Here
on step folders made in the test (their files recorded as a save records them); through the
scripts, on real checkpoints: the catalogue (tests/faults/cases_scripts.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from titanlite.components.checkpoint.index import (
    file_record,
    read_checkpoint,
    step_dir,
    step_to_read,
)
from titanlite.errors import UserError


def _step(folder: Path, step: int) -> Path:
    """A complete step folder as the checkpointer publishes one: its files, then state.json
    recording them, then the marker."""
    path = step_dir(folder, step)
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(bytes(range(256)) * 40)
    (path / ".metadata").write_bytes(b"metadata" * 10)
    (path / "state.json").write_text(json.dumps({"step": step, "files": file_record(path)}))
    (path / "complete").write_text(f"{step}\n")
    return path


@pytest.fixture
def checkpoints(tmp_path) -> Path:
    folder = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        _step(folder, step)
    return folder


def test_a_run_folder_falls_back_past_damaged_steps_with_a_line_each(checkpoints, caplog):
    assert step_to_read(checkpoints) == step_dir(checkpoints, 6)
    (step_dir(checkpoints, 6) / "__0_0.distcp").write_bytes(b"cut")
    (step_dir(checkpoints, 4) / ".metadata").unlink()
    assert step_to_read(checkpoints) == step_dir(checkpoints, 2)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "step-00000006 is damaged (__0_0.distcp holds 3 bytes" in lines[0]
    assert ".metadata is missing" in lines[1]
    assert not (step_dir(checkpoints, 6).with_name("step-00000006.damaged")).exists()  # only read


def test_a_damaged_step_folder_is_refused_naming_the_intact_ones_beside_it(checkpoints):
    (step_dir(checkpoints, 6) / "__0_0.distcp").write_bytes(b"cut")
    with pytest.raises(UserError) as e:
        step_to_read(step_dir(checkpoints, 6), flag="STEP_FOLDER")
    line = str(e.value)
    assert line.startswith(
        f"STEP_FOLDER '{step_dir(checkpoints, 6)}' is damaged (__0_0.distcp holds 3 bytes"
    )
    assert (
        str(step_dir(checkpoints, 4)) in line
        and str(step_dir(checkpoints, 2)) in line
        and "\n" not in line
    )
    with pytest.raises(UserError, match="--step 6: .* is damaged"):
        step_to_read(checkpoints, step=6)
    (step_dir(checkpoints, 4) / "complete").unlink()
    with pytest.raises(UserError, match="is incomplete .its save never finished"):
        step_to_read(step_dir(checkpoints, 4))


def test_a_read_that_fails_after_the_checks_counts_as_damage(checkpoints, caplog):
    def read(path: Path) -> Path:
        if path.name == "step-00000006":
            raise RuntimeError("PytorchStreamReader failed reading zip archive")  # what DCP raises
        return path

    assert read_checkpoint(checkpoints, read) == step_dir(checkpoints, 4)
    assert "step-00000006 failed to load (RuntimeError: PytorchStreamReader" in caplog.text
    with pytest.raises(UserError) as e:
        read_checkpoint(step_dir(checkpoints, 6), read, flag="STEP_FOLDER")
    assert "failed to load" in str(e.value) and str(step_dir(checkpoints, 4)) in str(e.value)
    with pytest.raises(UserError, match="failed to load"):
        read_checkpoint(checkpoints, read, step=6)


def test_a_run_folder_reads_its_own_checkpoint_folder(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(f'[checkpoint]\nfolder = "{tmp_path / "elsewhere"}"\n')
    _step(tmp_path / "elsewhere", 3)
    assert step_to_read(run) == step_dir(tmp_path / "elsewhere", 3)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="holds no complete checkpoint"):
        step_to_read(tmp_path / "empty")


def _llama(flavor: str):
    from dataclasses import replace

    import titanlite.models  # noqa: F401  (registers llama3)
    from titanlite.models.registry import get_flavor, get_model_spec

    spec = get_model_spec("llama3")
    return spec.model_cls(replace(get_flavor(spec, flavor), vocab_size=256))


@pytest.mark.parametrize(
    "source, target, extra, drop, refused",
    [
        ("debugmodel", "debugmodel", False, [], None),
        ("debugmodel", "debugmodel_tied", False, [], "output.weight"),  # the trained head, unread
        ("debugmodel", "debugmodel_tied", False, ["output.weight"], None),  # ... by choice
        ("debugmodel_tied", "debugmodel_tied", False, [], None),
        ("debugmodel", "debugmodel", True, [], "extra.weight"),  # a tensor this model has none of
        ("debugmodel", "debugmodel", True, ["extra.weight"], None),
    ],
)
def test_a_new_runs_initial_weights_are_taken_both_ways(
    tmp_path, source, target, extra, drop, refused
):
    """checkpoint.initial_load_path: each of the model's tensors in the checkpoint (check_fits),
    and each of the checkpoint's taken by a tensor of its own, but those named in
    checkpoint.initial_load_drop. Which tensors the source tied: its state.json's groups."""
    import torch
    import torch.distributed.checkpoint as dcp

    from titanlite.components.checkpoint.resume import check_initial_fits, tied_groups

    model = _llama(source)
    state = dict(model.state_dict())
    if extra:
        state["extra.weight"] = torch.zeros(3)
    path = tmp_path / "step-00000004"
    dcp.save({"model": state}, checkpoint_id=str(path), no_dist=True)
    (path / "state.json").write_text(json.dumps({"step": 4, "tied": tied_groups(model)}))
    with torch.device("meta"):
        ours = _llama(target)
    if refused is None:
        check_initial_fits(path, ours, drop)
    else:
        with pytest.raises(UserError, match=f"holds {refused}.*initial_load_drop"):
            check_initial_fits(path, ours, drop)


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_tied"])
def test_a_new_run_refuses_initial_weights_trained_with_another_tokenizer(tmp_path, flavor):
    """Token ids of another tokenizer index the same rows for other tokens: a start from a
    checkpoint whose state.json names another tokenizer is refused, unless the tables a token id
    indexes (the embedding, an untied head) start afresh; an unknown fingerprint on either side
    (an older checkpoint, a built-in tokenizer not trained yet) is not judged."""
    import torch
    import torch.distributed.checkpoint as dcp

    from titanlite.components.checkpoint.resume import check_initial_fits, tied_groups, token_tables

    model = _llama(flavor)
    path = tmp_path / "step-00000004"
    dcp.save({"model": dict(model.state_dict())}, checkpoint_id=str(path), no_dist=True)
    state = {"step": 4, "tied": tied_groups(model)}
    (path / "state.json").write_text(json.dumps({**state, "tokenizer": "aaaa"}))
    with torch.device("meta"):
        ours = _llama(flavor)
    tables = token_tables(ours)
    assert tables == [
        "tok_embeddings.weight",
        "output.weight",
    ]  # tied, the head's name loads it too
    for tokenizer in ("aaaa", None):
        check_initial_fits(path, ours, [], tokenizer)
    with pytest.raises(UserError, match="trained with another tokenizer .*initial_load_drop"):
        check_initial_fits(path, ours, [], "bbbb")
    with pytest.raises(UserError, match="another tokenizer"):  # the head would still load
        check_initial_fits(path, ours, tables[:1], "bbbb")
    check_initial_fits(path, ours, tables, "bbbb")
    (path / "state.json").write_text(json.dumps(state))  # a checkpoint that names no tokenizer
    check_initial_fits(path, ours, [], "bbbb")
