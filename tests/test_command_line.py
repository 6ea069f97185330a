"""The command line's words, read in one place (titanlite.config.command_line), and what paths
in a config mean (titanlite.config.command_line), each class by generated cases: values that hold
`--config` in any form, --config given several times or empty, --rehearse at and past its
bounds in any script's digits, every moved key beside its new name, every path field from a
folder that is not the checkout's."""

from __future__ import annotations

import os
from dataclasses import MISSING, fields
from pathlib import Path

import pytest
from helpers import every_section
from hypothesis import given, settings
from hypothesis import strategies as st

from titanlite.config import parse_args
from titanlite.config.command_line import (
    CALLER_ENV,
    DEFAULT_CONFIG,
    ROOT,
    launcher_words,
    mixture_items,
    wants_help,
)
from titanlite.config.job_config import REHEARSAL_WORLD_MAX
from titanlite.config.manager import check_values, moved_keys
from titanlite.errors import UserError

TEXT = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=30
)
TRICKY = st.sampled_from(
    ["--config", " --config other.toml ", "--config=x.toml", "--rehearse", "-h", "--help", ""]
)


def _config_of(words: list[str]) -> str:
    return words[words.index("--config") + 1]


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.one_of(TEXT, TRICKY), max_size=4))
def test_a_value_is_a_value_whatever_it_holds(values: list[str]) -> None:
    """Without --config the default config applies, and every value reaches the config as typed."""
    argv = [w for v in values for w in ("--job.description", v)]
    words = launcher_words(argv)
    assert _config_of(words) == str(ROOT / DEFAULT_CONFIG)
    cfg, _ = parse_args(words)
    assert cfg.job.description == (values[-1] if values else "debug Llama 3, stdlib pretraining")
    assert not wants_help(argv)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(
    st.lists(
        st.sampled_from(["--training.steps", "--optimizer.lr", "--job.description"]), max_size=6
    )
)
def test_a_key_given_more_than_once_is_said_and_the_last_applies(keys: list[str]) -> None:
    values = {"--training.steps": "7", "--optimizer.lr": "0.002", "--job.description": "x"}
    argv = [
        w
        for i, k in enumerate(keys)
        for w in (k, values[k] if k != "--training.steps" else str(i + 1))
    ]
    notes: list[str] = []
    cfg, _ = parse_args(argv, notes)
    said = sorted(n.split(" is given")[0] for n in notes if " times on the command line" in n)
    assert said == sorted(k for k in set(keys) if keys.count(k) > 1), (keys, notes)
    if "--training.steps" in keys:
        last = max(i for i, k in enumerate(keys) if k == "--training.steps") + 1
        assert cfg.training.steps == last


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("form", ["space", "equals"])
def test_config_given_twice_or_empty_is_refused(n: int, form: str) -> None:
    one = "train_configs/debug_model.toml"
    argv = [
        w for _ in range(n) for w in (["--config", one] if form == "space" else [f"--config={one}"])
    ]
    for entry in (launcher_words, parse_args):
        with pytest.raises(UserError, match=f"--config is given {n} times"):
            entry(argv)
    for empty in (["--config="], ["--config", ""], ["--config", "  "]):
        with pytest.raises(UserError, match="--config is empty"):
            launcher_words(empty)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    st.one_of(
        st.integers(-10, 2 * REHEARSAL_WORLD_MAX).map(str),
        TEXT,
        st.sampled_from(["²", "٢", "८", "1e3", "0x10"]),
    )
)
def test_rehearse_takes_a_whole_number_within_its_bounds(value: str) -> None:
    v = value.strip()
    ok = v.isascii() and v.isdigit() and 1 <= int(v) <= REHEARSAL_WORLD_MAX
    if ok:
        words = launcher_words(["--rehearse", value])
        assert words[words.index("--rehearsal.world") + 1] == str(int(value))
    else:
        with pytest.raises(UserError, match="^--rehearse "):
            launcher_words(["--rehearse", value])
        with pytest.raises(UserError, match="^--rehearse "):
            launcher_words([f"--rehearse={value}"])


def test_rehearse_beside_rehearsal_world_is_refused() -> None:
    for twice in (
        ["--rehearse", "8", "--rehearsal.world", "8"],
        ["--rehearse", "8", "--rehearse=16"],
    ):
        with pytest.raises(UserError, match="given more than once"):
            launcher_words(twice)
    with pytest.raises(UserError, match=f"<= {REHEARSAL_WORLD_MAX}"):
        check_values(
            parse_args(launcher_words(["--rehearsal.world", str(REHEARSAL_WORLD_MAX + 1)]))[0]
        )


def _example(default: object, choices: tuple[str, ...] | None) -> tuple[str, str]:
    if choices:
        return choices[0], choices[1]
    examples = {int: ("3", "5"), float: ("0.3", "0.5"), bool: ("true", "false"), list: ("1", "2")}
    return examples[type(default)]


@pytest.mark.parametrize("old", sorted(moved_keys()))
def test_a_moved_key_beside_its_new_name_on_the_command_line(old: str) -> None:
    """Disagreeing: refused in one line naming both, as in a file; agreeing: taken."""
    new = moved_keys()[old]
    section, _, key = new.partition(".")
    (f,) = [f for f in fields(dict(every_section())[section]) if f.name == key]
    default = f.default if f.default_factory is MISSING else f.default_factory()
    a, b = _example(default, f.metadata.get("choices"))
    with pytest.raises(UserError, match=f"sets both '{new}' and '{old}'"):
        parse_args([f"--{new}", a, f"--{old}", b])
    parse_args([f"--{old}", a, f"--{new}", a])


def _path_fields() -> list[tuple[str, str]]:
    return [
        (f"{name}.{f.name}", f.metadata["path"])
        for name, section in every_section()
        for f in fields(section)
        if "path" in f.metadata
    ]


def test_the_path_fields_are_the_ones_that_hold_paths() -> None:
    """Every field whose doc speaks of a file or folder says it is a path (or is relative to the
    run folder by design)."""
    found = dict(_path_fields())
    assert found.pop("data.path") == "mixture"
    assert set(found) == {
        "job.dump_folder",
        "model.tokenizer_path",
        "model.hf_assets_path",
        "data.cache_dir",
        "eval.path",
        "checkpoint.initial_load_path",
    }


NAME = st.text(
    st.characters(whitelist_categories=("Ll", "Lu", "Nd"), whitelist_characters="_-."),
    min_size=1,
    max_size=12,
).filter(lambda s: s not in (".", ".."))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.sampled_from(_path_fields()), st.lists(NAME, min_size=1, max_size=3))
def test_relative_paths_mean_the_callers_folder(
    tmp_path_factory, field: tuple[str, str], parts: list[str]
) -> None:
    key, kind = field
    caller = tmp_path_factory.mktemp("caller")
    rel = os.path.join(*parts)
    before = os.environ.get(CALLER_ENV)
    os.environ[CALLER_ENV] = str(caller)
    try:
        if kind == "mixture":
            value = f"{rel}:0.25,{rel}-b:0.75"
            got = parse_args([f"--{key}", value])[0].data.path
            assert mixture_items(got) == [
                (str(caller / rel), 0.25),
                (str(caller / f"{rel}-b"), 0.75),
            ]
        else:
            section, _, name = key.partition(".")
            got = getattr(getattr(parse_args([f"--{key}", rel])[0], section), name)
            assert Path(got) == caller / rel
            absolute = str(Path("/somewhere") / rel)
            assert (
                getattr(getattr(parse_args([f"--{key}", absolute])[0], section), name) == absolute
            )
        # the config file's own path, typed relative, is the caller's too
        (caller / "my.toml").write_text("[training]\nsteps = 3\n")
        cfg, path = parse_args(["--config", "my.toml"])
        assert path == str(caller / "my.toml") and cfg.training.steps == 3
    finally:
        if before is None:
            os.environ.pop(CALLER_ENV)
        else:
            os.environ[CALLER_ENV] = before


def test_the_working_folder_as_caller_changes_nothing() -> None:
    """Run from the checkout (the usual case), a relative path stays as typed."""
    os.environ.pop(CALLER_ENV, None)
    cfg, _ = parse_args(["--data.path", "outputs/data/docs:0.5,x:0.5", "--eval.path", "e.jsonl"])
    assert cfg.data.path == "outputs/data/docs:0.5,x:0.5" and cfg.eval.path == "e.jsonl"


def test_every_size_key_has_a_bound_a_machine_can_plan_for():
    """The class of sizes that grow work or memory without a refusal: every integer field whose
    doc speaks of a history, a window, processes, tokens decoded, dimensions or ranks carries an
    explicit at_most (the rest fall back to the INT_LIMIT every whole number has)."""
    words = (
        "history",
        "window",
        "look back",
        "looks back",
        "processes",
        "new tokens",
        "dimensions",
        "ranks, in one",
    )
    unbounded = [
        f"{name}.{f.name}"
        for name, section in every_section()
        for f in fields(section)
        if isinstance(getattr(section, f.name), int)
        and not isinstance(getattr(section, f.name), bool)
        and any(w in f.metadata["help"] for w in words)
        and "<=" not in f.metadata["bounds"]
    ]
    assert not unbounded, unbounded


# Names of data files that the mixture syntax (`a:0.7,b:0.3`) would split: commas, colons with and
# without a weight after them, both, at either end.
ODD_PIECES = (",", ":", ":0.5", ",b:0.5", ":0.5,", ",:", "a:1,b")
ODD_NAMES = [f"d{piece}x.jsonl" for piece in ODD_PIECES] + [
    f"{piece}{piece}.txt" for piece in ODD_PIECES if piece.strip(",:")
]


@pytest.mark.parametrize("name", ODD_NAMES)
def test_a_path_that_exists_is_a_path_whatever_its_name_holds(tmp_path, name):
    """An existing file whose name holds the mixture's commas and colons is read as that file:
    alone (absolute, or relative to the caller's folder), or as one weighted item of a mixture
    beside another such file; a name that exists nowhere is still read as the syntax says."""
    from titanlite.datasets.spec import check_data, parse_data_path

    other = f"o{name}"
    for file in (name, other):
        (tmp_path / file).write_text('{"text": "some words"}\n')
    path, second = str(tmp_path / name), str(tmp_path / other)
    assert mixture_items(path) == [(path, None)]
    assert parse_data_path(path) == [(path, 1.0)]
    check_data("pretrain", path)  # exists: no "does not exist" of a piece of it
    mixture = f"{path}:0.25,{second}:0.75"
    assert mixture_items(mixture) == [(path, 0.25), (second, 0.75)]
    before = os.environ.get(CALLER_ENV)
    os.environ[CALLER_ENV] = str(tmp_path)
    try:  # typed relative, from the folder that holds it
        assert parse_args(["--data.path", name])[0].data.path == path
        assert parse_args(["--eval.path", name])[0].eval.path == path
    finally:
        if before is None:
            os.environ.pop(CALLER_ENV)
        else:
            os.environ[CALLER_ENV] = before
    missing = str(tmp_path / "none" / name.replace(",", ""))
    assert mixture_items(f"{missing}:0.5,{missing}-b:0.5") == [
        (missing, 0.5),
        (f"{missing}-b", 0.5),
    ]
