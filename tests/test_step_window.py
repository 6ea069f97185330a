"""The log step's host side: one read of several device tensors, and the window's record.
(End to end, with skipped steps in a real run: tests/test_step_counts.py.)"""

from __future__ import annotations

import torch

from titanlite.components.step_window import WindowRecord
from titanlite.distributed.utils import first_error
from titanlite.tools.readback import readback


def test_readback_returns_each_tensor_as_tolist_would():
    tensors = [
        torch.tensor(2.5),
        torch.tensor([1, 2, 3]),
        torch.arange(6.0).reshape(2, 3),
        torch.arange(8).reshape(2, 2, 2),
        torch.tensor([True, False]),
    ]
    assert readback(tensors) == [t.double().tolist() for t in tensors]


def window(losses: list[float], skipped: list[bool]) -> WindowRecord:
    n = len(losses)
    return WindowRecord(list(range(1, n + 1)), losses, [0] * n, skipped, skipped, 1.0, 10)


def test_window_mean_is_over_the_steps_that_trained():
    w = window([8.0, 0.0, 6.0], [False, True, False])
    assert w.trained_losses == [8.0, 6.0] and w.loss_mean == 7.0
    assert window([0.0, 0.0], [True, True]).loss_mean is None


def test_first_error_without_a_process_group_is_the_own_one():
    assert first_error(None) is None and first_error("bad") == "bad"
