"""The batch-size advisor: what the measured gradient noise scale says about the run's batch.

"An Empirical Model of Large-Batch Training" (McCandlish et al., arXiv 1812.06162) finds that
the critical batch, past which a larger batch stops buying fewer steps, is about the gradient
noise scale B_noise, estimated by B_simple (stats.NoiseScale, in tokens, EMA-smoothed). Well
below it a step's gradient is mostly noise: doubling the batch nearly halves the steps to a
given loss, for about the same tokens. Well above it the extra batch buys little: the same loss
costs more tokens. B_simple moves as training goes (it grows as the loss falls), so the advice
is given only when the ratio (to the batch's mean tokens over those steps: an SFT batch's vary
by step) stays past `advice_ratio` either way for `advice_steps` measured steps, and again only
when it has moved a further `advice_ratio`-fold the same way (the noise scale keeps growing over
a long run, and the batch it asks for with it). The batch is part of the run's identity (a
resumed run keeps it), so the advice is for the next run, with the flag that would set it.
"""

from __future__ import annotations

import statistics
from collections import deque

from titanlite.config.job_config import Alerts as AlertsConfig
from titanlite.diagnostics.window import Finding


class BatchAdvisor:
    """`unit`: the sequences the global batch moves by with everything else kept (dp x the local
    batch: only the accumulation changes), for the suggested flag."""

    def __init__(self, cfg: AlertsConfig, unit: int) -> None:
        self.cfg = cfg
        self.unit = max(1, unit)
        # B_simple over the batch's mean tokens in the window: an SFT batch's tokens vary by step
        self.ratios: deque[float] = deque(maxlen=cfg.advice_steps)
        self.tokens: deque[float] = deque(maxlen=cfg.advice_steps)  # the batch's tokens per step
        self.advised = 0.0  # the ratio last advised on (0: none since the ratio was in the band)

    def state_dict(self) -> dict:
        return {"ratios": list(self.ratios), "tokens": list(self.tokens), "advised_ratio": self.advised}

    def load_state_dict(self, state: dict) -> None:
        self.ratios.extend(state.get("ratios", []))
        self.tokens.extend(state.get("tokens", []))
        self.advised = state.get("advised_ratio", 0.0)

    def update(self, rec: dict) -> Finding | None:
        """A measured-step record (component.Diagnostics.collect: noise_scale_tokens,
        batch_tokens, batch_sequences): the advice, when it is due."""
        noise, tokens, sequences = (
            rec.get("noise_scale_tokens"),
            rec.get("batch_tokens"),
            rec.get("batch_sequences"),
        )
        # B_simple <= 0: the ranks' gradients agree beyond their noise (the same data, say), and
        # the estimate says nothing about the batch
        if noise is None or noise <= 0 or not tokens or not sequences:
            return None
        self.tokens.append(tokens)
        tokens = statistics.fmean(self.tokens)
        self.ratios.append(noise / tokens)
        r, typical = self.cfg.advice_ratio, statistics.median(self.ratios)
        side = 1 if typical >= r else -1 if typical <= 1 / r else 0
        if side == 0:
            self.advised = 0.0  # back in the band: a later excursion is advised again
            return None
        edge = r if side > 0 else 1 / r
        if self.advised and (self.advised > 1) == (side > 0):  # advised on this side: a further fold
            edge = self.advised * r if side > 0 else self.advised / r
        past = all(x >= edge for x in self.ratios) if side > 0 else all(x <= edge for x in self.ratios)
        if len(self.ratios) < self.cfg.advice_steps or not past:
            return None
        before, ratio = self.advised, statistics.median(self.ratios)
        self.advised = ratio
        per_seq = tokens / sequences
        suggest = max(self.unit, round(ratio * sequences / self.unit) * self.unit)
        flag = f"--training.global_batch_size {suggest}"
        head = (
            f"the gradient noise scale B_simple (McCandlish et al., arXiv 1812.06162) has been about "
            f"{ratio * tokens:,.0f} tokens for the last {len(self.ratios)} measured steps, "
        )
        if side > 0:
            msg = head + (
                f"{ratio:.0f}x this run's batch of {tokens:,.0f} tokens{_since(before)}: its steps are dominated by gradient noise, "
                "so a larger batch would reach a given loss in nearly proportionally fewer steps for about the "
                f"same tokens, up to about that size ({suggest} sequences of ~{per_seq:,.0f} tokens)"
            )
        else:
            msg = head + (
                f"1/{1 / ratio:.0f} of this run's batch of {tokens:,.0f} tokens{_since(before)}: past the noise scale extra batch "
                "buys little, so each step spends more tokens than its gradient needs, and a smaller batch would "
                f"reach a given loss with fewer tokens (in more steps): about {suggest} sequences"
            )
        msg += f"; the batch is part of the run's identity, so this is for the next run: {flag} (re-tune the learning rate)"
        values = {
            "noise_scale_tokens": ratio * tokens,
            "batch_tokens": tokens,
            "suggested_global_batch": suggest,
        }
        return Finding("batch_size_advice", [], msg, values)


def _since(before: float) -> str:
    """The ratio of an earlier advice in this excursion, as the message says it."""
    if not before:
        return ""
    return (
        f" (advised at {before:.0f}x before)" if before >= 1 else f" (advised at 1/{1 / before:.0f} before)"
    )
