"""The NaN/Inf rule: a non-finite metric, or the GRPO module's non-finite guard firing."""

from __future__ import annotations

import math
from collections.abc import Sequence

from tclightning.health.history import MetricHistory
from tclightning.health.rules.base import Finding, HealthState, Rule, fmt_number


SKIP_METRICS = ("policy/skipped_ticks", "policy/skipped_step")
"""Counters the GRPO module logs when its non-finite guard skipped an update or a whole step."""


class NonFiniteRule(Rule):
    """NaN or Inf in any metric of the update, or a non-finite skip reported -> ``collapsing`` at once.

    A non-finite loss, gradient norm or log-prob gap means the weights or the optimiser state
    are already poisoned, or would be without the module's guard; no window is needed. The
    guard's counters (``skip_metrics``: ticks skipped for a NaN/Inf loss or gradient, a step
    skipped for NaN/Inf weights or logits) fire when positive. A step skipped whole
    (``skipped_step`` positive) measured nothing, and logs NaN for what it did not measure: that
    update gives the one finding on ``skipped_step`` (none where ``metrics`` leaves it out), not
    one per NaN. ``metrics`` restricts the check (None: all, counters included).
    """

    name = "nonfinite"

    def __init__(
        self,
        metrics: Sequence[str] | None = None,
        skip_metrics: Sequence[str] = SKIP_METRICS,
        skipped_step: str = "policy/skipped_step",
    ) -> None:
        self.metrics = tuple(metrics) if metrics is not None else None
        self.skip_metrics = tuple(skip_metrics)
        self.skipped_step = skipped_step
        self.inputs = self.metrics or ()

    @property
    def triggers(self) -> tuple[str, ...]:
        return ()

    def _watched(self, name: str) -> bool:
        return self.metrics is None or name in self.metrics

    def check(self, history: MetricHistory, step: int) -> list[Finding]:
        update = history.last_update
        if update.get(self.skipped_step, 0.0) > 0:
            return [self._skip_finding(self.skipped_step, update[self.skipped_step], step)] if self._watched(
                self.skipped_step) else []
        findings = []
        for name, value in update.items():
            if not self._watched(name):
                continue
            if not math.isfinite(value):
                findings.append(
                    Finding(self.name, name, HealthState.COLLAPSING, f"{name} is {value} at step {step}", {"value": value})
                )
            elif name in self.skip_metrics and value > 0:
                findings.append(self._skip_finding(name, value, step))
        return findings

    def _skip_finding(self, name: str, value: float, step: int) -> Finding:
        msg = f"{name} = {fmt_number(value)} at step {step}: NaN/Inf in the loss, gradients, weights or logits"
        return Finding(self.name, name, HealthState.COLLAPSING, msg, {"value": value})
