"""The fault scenarios (trainer overrides: [faults] switches, and the seed settings of arXiv
2602.14462 for S1-1 to S1-3) and the alert that must name each: scripts/diagnose_scenarios.py
runs them, tests/test_scenarios.py and tests/test_alerts.py check them."""

from __future__ import annotations


def scenarios(dp: int, onset: int = 1) -> dict[str, list[str]]:
    """Per scenario, its trainer overrides at `dp` ranks; the ongoing faults start at `onset`."""
    dropout = ["--model.dropout", "0.1", "--faults.seed_mode"]
    start = ["--faults.fault_from_step", str(onset)]
    return {
        "healthy": [],
        "healthy_sft": ["--data.mode", "sft", "--training.local_batch_size", "1"],  # 2 microbatches
        "same_data": ["--faults.same_data", "true"],
        "corrupt_labels": ["--faults.corrupt_labels_rank", str(dp // 2), *start],
        "grad_noise": ["--faults.grad_noise_rank", "1", "--faults.grad_noise_scale", "10", *start],
        "slow_rank": ["--faults.slow_rank", str(dp - 1), "--faults.slow_factor", "3", *start],
        "replica_flip": [  # DDP: every rank a replica; one bit of rank dp-1's weights flips at step 5
            *("--parallelism.dp_replicate", str(dp), "--diagnostics.replica_check_every", "1"),
            *("--faults.flip_bit_step", "5", "--faults.flip_bit_rank", str(dp - 1)),
        ],
        "stuck_loader": [
            "--faults.stuck_loader_step",
            "5",
            "--faults.stuck_loader_rank",
            str(dp - 1),
        ],
        "S1-1": [*dropout, "shared"],
        "S1-2": [*dropout, "rank0_differs"],
        "S1-3": [*dropout, "per_rank"],
    }


def expected(dp: int, onset: int) -> dict[str, tuple[str, list[int], int] | None]:
    """Per scenario: (the alert that names its fault, the rank(s) at fault, the step the fault
    starts), or None where no alert is right."""
    pair = [0, 1]  # of two ranks: both (two replicas), or neither the majority (S1-2)
    return {
        "healthy": None,
        "healthy_sft": None,
        "same_data": ("identical_data", list(range(1, dp)), 1),
        "corrupt_labels": ("single_rank_outlier", [dp // 2], onset),
        "grad_noise": ("faulty_worker", [1], onset),
        "slow_rank": ("slow_rank", [dp - 1], onset),
        "replica_flip": ("replica_drift", [dp - 1] if dp > 2 else pair, 5),
        "stuck_loader": ("stale_batch", [dp - 1], 5),
        "S1-1": None,  # every rank shares the seeds: titanlite's normal mode
        "S1-2": ("data_order_mismatch", [0] if dp > 2 else pair, 1),
        "S1-3": ("data_order_mismatch", list(range(dp)), 1),
    }


def detection(alerts: list[dict], want: tuple[str, list[int], int] | None) -> dict:
    """When the alert that names the fault first fired, and every other alert."""
    hit = [a for a in alerts if want and a["name"] == want[0] and sorted(a["ranks"]) == want[1]]
    first = hit[0]["step"] if hit else None
    return {
        "expected": f"{want[0]} {want[1]}" if want else "none",
        "onset": want[2] if want else None,
        "detected_step": first,
        "steps_to_detection": first - want[2] + 1 if first is not None else None,
        "other_alerts": [a for a in alerts if a not in hit],
    }
