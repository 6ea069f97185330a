from __future__ import annotations

import torch
import torch.nn.functional as F

from titanlite.components.loss import IGNORE_INDEX, LossBalancer, count_valid, cross_entropy_sum


def test_cross_entropy_sum_is_fp32_sum_over_valid_tokens():
    logits = torch.randn(2, 5, 11, dtype=torch.bfloat16)
    labels = torch.randint(0, 11, (2, 5))
    labels[0, :3] = IGNORE_INDEX
    got = cross_entropy_sum(logits, labels)
    assert got.dtype == torch.float32
    keep = labels != IGNORE_INDEX
    want = F.cross_entropy(logits.float()[keep], labels[keep], reduction="sum")
    torch.testing.assert_close(got, want)
    assert int(count_valid(labels)) == 7


def test_single_process_balancer_normalises_by_the_whole_step():
    """With accumulation, each microbatch is divided by the step's total, not its own count."""
    labels = [
        torch.tensor([[1, 2, IGNORE_INDEX]]),
        torch.tensor([[IGNORE_INDEX] * 3]),
        torch.tensor([[4, 5, 6]]),
    ]
    bal = LossBalancer("global", None, 1, 3)
    bal.begin_step(labels)
    assert int(bal.global_tokens()) == 5
    sums = [torch.tensor(2.0), torch.tensor(0.0), torch.tensor(9.0)]
    total = sum(bal.scale(s, m) for m, s in enumerate(sums))
    torch.testing.assert_close(total, torch.tensor(11.0 / 5))


def test_local_mean_is_the_naive_mean_of_means():
    labels = [torch.tensor([[1, 2, IGNORE_INDEX]]), torch.tensor([[4, 5, 6]])]
    bal = LossBalancer("local_mean", None, 1, 2)
    bal.begin_step(labels)
    total = bal.scale(torch.tensor(2.0), 0) + bal.scale(torch.tensor(9.0), 1)
    torch.testing.assert_close(total, torch.tensor((2.0 / 2 + 9.0 / 3) / 2))


def test_zero_valid_tokens_gives_zero_not_nan():
    labels = [torch.full((2, 4), IGNORE_INDEX)]
    bal = LossBalancer("global", None, 1, 1)
    bal.begin_step(labels)
    logits = torch.randn(2, 4, 7, requires_grad=True)
    loss = bal.scale(cross_entropy_sum(logits, labels[0]), 0)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(logits.grad) == 0
    assert int(bal.global_tokens()) == 0
