"""An alert added from outside the package, as a fork adds one: one record, a threshold of its
own and state of its own. Imported through `--model.import_module toy_alert` (tests/ is on the
workers' path): it fires on the `toy_at`-th measured step of the run, counted in its state, so it
fires at the same step in a run resumed from a checkpoint only if that state was carried."""

from __future__ import annotations

from titanlite.diagnostics.registry import AlertSpec, Check, Context, Finding, register


class Count:
    """The measured steps this alert has seen."""

    def __init__(self, cfg, world: int, unit: int) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]


def counted(ctx: Context) -> Finding | None:
    ctx.state.n += 1
    if ctx.state.n != ctx.threshold("toy_at"):
        return None
    return Finding("toy_alert", [ctx.world - 1], f"measured step number {ctx.state.n} of the run")


register(
    AlertSpec(
        "toy_alert",
        cause="a test's alert: nothing is wrong",
        checks=(Check(counted),),
        defaults={"toy_at": 5},
        state=Count,
    )
)
