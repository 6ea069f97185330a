"""A mixture of experts' load at a log step (titanlite/components/expert_load.py): from known step
statistics through the model's expert_load to the log row, the console, the summary and the
TensorBoard tags. (In a training run, with its host reads counted: tests/test_step_counts.py.)"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from titanlite.components.expert_load import ExpertLoad, load_figures, load_record
from titanlite.components.metrics import scalar_tags
from titanlite.components.step_window import RunRates, StepWindow
from titanlite.components.summary import RunTally, load_text, progress_line, summary_lines
from titanlite.models.qwen3_moe import Qwen3Moe, Qwen3MoeArgs

# a dense layer 0, then MoE layers 1 and 2 of 4 experts, 2 routed per token
ARGS = Qwen3MoeArgs(
    dim=8, n_layers=3, n_heads=2, n_kv_heads=1, head_dim=4, experts=4, top_k=2,
    moe_hidden=8, dense_hidden=8, dense_layers=(0,), vocab_size=16, max_seq_len=8,
)  # fmt: skip


def statistics(layer1: list[int], layer2: list[int]) -> torch.Tensor:
    """Qwen3Moe.routing_counts' layout: each MoE layer's expert counts, then the routed tokens."""
    return torch.tensor([*layer1, *layer2, sum(layer1) // ARGS.top_k])


@pytest.fixture(scope="module")
def model():
    with torch.device("meta"):  # expert_load reads no weight
        return Qwen3Moe(ARGS)


def record(model, stats: torch.Tensor) -> dict | None:
    shares = model.expert_load(stats)
    return load_record(list(shares), load_figures(shares).tolist())


def test_the_load_of_known_statistics(model):
    """Layer 1 routes 10, 20, 30, 40 of its 100 slots; layer 2 evenly: layer 1's max/min is 4,
    its cv std/mean of (.1 .2 .3 .4) = sqrt(.0125) / .25; layer 2 has 1 and 0. The model's own
    layer numbers name them (layer 0 is dense)."""
    rec = record(model, statistics([10, 20, 30, 40], [25, 25, 25, 25]))
    assert rec["max_min"] == pytest.approx({"1": 4.0, "2": 1.0})
    assert rec["cv"] == pytest.approx({"1": math.sqrt(0.0125) / 0.25, "2": 0.0}, abs=1e-12)
    assert rec["worst"] == "1"
    assert rec["most"] == pytest.approx({"layer": "1", "expert": 3, "share": 0.4, "x_even": 1.6})
    assert rec["least"] == pytest.approx({"layer": "1", "expert": 0, "share": 0.1, "x_even": 0.4})
    assert load_text(rec) == "experts max/min 4.0x (layer 1)"


def test_an_expert_without_a_token_makes_its_layer_the_worst(model):
    """An idle expert: its layer's max/min is unbounded (None in JSON, inf on the console) and
    that layer is the worst, whatever the others' spread; no token routed at all: no record."""
    rec = record(model, statistics([10, 20, 30, 40], [0, 50, 25, 25]))
    assert rec["max_min"] == pytest.approx({"1": 4.0, "2": None})
    assert rec["worst"] == "2" and rec["least"]["share"] == 0.0 and rec["least"]["layer"] == "2"
    assert load_text(rec) == "experts max/min inf (layer 2)"
    assert record(model, statistics([0] * 4, [0] * 4)) is None


def test_layers_of_different_expert_counts_each_get_their_figures():
    """A fork's layers need not have one expert count: each layer's figures from its own
    shares, the most and least loaded expert by its share over an even one (1 of 2 at 0.55 is
    1.1x even, 1 of 4 at 0.4 is 1.6x; 0.45 of 2 is 0.9x, 0.2 of 4 is 0.8x)."""
    shares = {
        "a": torch.tensor([0.45, 0.55], dtype=torch.float64),
        "b": torch.tensor([0.4, 0.2, 0.2, 0.2], dtype=torch.float64),
    }
    rec = load_record(list(shares), load_figures(shares).tolist())
    assert rec["max_min"] == pytest.approx({"a": 0.55 / 0.45, "b": 2.0}) and rec["worst"] == "b"
    assert rec["most"] == pytest.approx({"layer": "b", "expert": 0, "share": 0.4, "x_even": 1.6})
    assert rec["least"] == pytest.approx({"layer": "b", "expert": 1, "share": 0.2, "x_even": 0.8})


@pytest.fixture
def one_process(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_window_sums_its_steps_statistics_and_reports_at_the_log_step(model, one_process):
    """Two steps' statistics summed on the device, read with the window's one read: only the
    log row holds the load, and the sum starts again after it. A model without expert_load, or
    without statistics, gets no load."""
    steps = iter([statistics([10, 20, 30, 40], [25] * 4), statistics([30, 20, 10, 0], [25] * 4)])
    load = ExpertLoad.of(model, lambda: next(steps))
    window = StepWindow(load)
    one = torch.tensor(1.0)
    for step in (1, 2):
        window.add(step, one, torch.tensor(4), one, torch.tensor(False), 1e-3)
    rates = RunRates(64, 1, 10, 0, torch.device("cpu"), torch.float32)
    rows = window.read(None).rows(1.0, 1.0, rates)
    assert "expert_load" not in rows[0]
    got = rows[-1]["expert_load"]  # layer 1: 40, 40, 40, 40 of 160
    assert got["max_min"] == pytest.approx({"1": 1.0, "2": 1.0}) and got["cv"]["1"] == 0.0
    assert ExpertLoad.of(torch.nn.Linear(1, 1), lambda: None) is None
    empty = StepWindow(ExpertLoad.of(model, lambda: None))
    empty.add(3, one, torch.tensor(4), one, torch.tensor(False), 1e-3)
    assert "expert_load" not in empty.read(None).rows(1.0, 1.0, rates)[-1]


def test_the_console_summary_and_tensorboard_show_the_load(model, tmp_path):
    rec = record(model, statistics([10, 20, 30, 40], [0, 50, 25, 25]))
    row = {
        "step": 20, "row": "log", "loss": 6.0, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 1.0,
        "memory_gib": 0.5, "eta_s": 0.0, "skipped": False, "expert_load": rec,
    }  # fmt: skip
    assert " | experts max/min inf (layer 2) | grad_norm " in progress_line(row, 20)
    tally = RunTally()
    tally.record(row)
    lines = summary_lines(tally, 1, 20, 1.0, tmp_path, tmp_path, [], tensorboard=False)
    load = [line for line in lines if line.startswith("expert load")]
    assert load == [
        "expert load at step 20 (its log window): most loaded expert 1 of layer 2 (50.0% of the "
        "layer's routing slots, 2.00x even); least loaded expert 0 of layer 2 (0.0%, 0.00x "
        "even); experts max/min inf (layer 2)"
    ]
    tags = {k: v for k, v in scalar_tags("train", row).items() if k.startswith("6_expert_load/")}
    assert tags == pytest.approx(
        {
            "6_expert_load/max_min/1": 4.0,  # layer 2's is unbounded: no point
            "6_expert_load/cv/1": rec["cv"]["1"],
            "6_expert_load/cv/2": rec["cv"]["2"],
        }
    )
