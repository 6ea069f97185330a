"""The step's hook protocol (titanlite/tools/hooks.py) and the fault plugin's reach: calls in the
trainer's order, hooks in their registration order, and no fault parameter in the parts a run
without the plugin builds."""

from __future__ import annotations

import inspect

import pytest

from titanlite.tools.hooks import CALLS, Hooks, Step


class Recording:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def begin(self, s: Step) -> None:
        self.log.append((self.name, "begin", s.step))

    def microbatch(self, s: Step, m: int, batch: list) -> list:
        return [*batch, self.name]

    def before_update(self, s: Step) -> None:
        s.skip = s.skip or self.name == "guard"


def test_hooks_run_in_registration_order_and_a_microbatch_passes_through_each():
    log: list = []
    hooks = Hooks([Recording("faults", log), None, Recording("guard", log)])
    s = Step(3, False, None, skip=False)
    hooks.begin(s)
    hooks.ready(s)  # nobody defines it: nothing runs
    assert log == [("faults", "begin", 3), ("guard", "begin", 3)]
    assert hooks.microbatch(s, 0, ["read"]) == ["read", "faults", "guard"]
    hooks.before_update(s)
    assert s.skip is True
    hooks.add(Recording("late", log))
    hooks.begin(s)
    assert [name for name, *_ in log[2:]] == ["faults", "guard", "late"]


def test_a_hook_defining_no_call_is_refused():
    class Typo:
        def befor_update(self, s: Step) -> None: ...

    with pytest.raises(TypeError, match="defines none of the hook calls"):
        Hooks([Typo()])
    assert set(CALLS) == {
        "begin",
        "microbatch",
        "ready",
        "backward",
        "before_update",
        "after_update",
        "close",
    }


def test_no_fault_parameter_reaches_the_checkpointer_the_metrics_writer_or_the_loader():
    """The fault plugin reaches them through seams it sets after they are built; their
    constructors take nothing of it."""
    from titanlite.components.checkpoint.checkpointer import Checkpointer
    from titanlite.components.metrics import MetricsWriter
    from titanlite.components.run.files import RunFiles
    from titanlite.datasets.build import build_dataloader
    from titanlite.diagnostics.component import Diagnostics

    for fn in (
        Checkpointer,
        MetricsWriter,
        MetricsWriter.for_run,
        RunFiles,
        build_dataloader,
        Diagnostics,
    ):
        params = set(inspect.signature(fn).parameters)
        assert not params & {
            "faults",
            "inject",
            "read_rank",
            "grad_noise_scale",
            "fault_from_step",
        }, fn


def test_the_fault_plugin_hears_phases_only_between_its_first_step_and_its_close():
    """A Trainer that fails in its set-up is never closed: its injector must leave no phase
    listener behind in the process (a later Trainer there would fire its faults)."""
    from titanlite.distributed import liveness
    from titanlite.faults.inject import Faults
    from titanlite.faults.switches import FaultSwitches

    before = list(liveness._on_phase)
    faults = Faults(FaultSwitches(), seed=0, rank=0, world=1)
    assert liveness._on_phase == before  # built, as in a set-up that then fails
    faults.begin(Step(1, False, None))
    assert liveness._on_phase == [*before, faults.phase]
    faults.close()
    faults.close()  # the trainer's close after a failed step closes it again
    assert liveness._on_phase == before
