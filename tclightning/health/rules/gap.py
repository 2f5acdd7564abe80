"""The gap family: the sampler-trainer gap's level above a band and its rise on its start."""

from __future__ import annotations

import numpy as np

from tclightning.health.history import MetricHistory, relative_change
from tclightning.health.rules.base import Finding, HealthState, Rule, fmt_number
from tclightning.health.rules.length import LengthGapCouplingRule
from tclightning.health.rules.nonfinite import NonFiniteRule


GAP_METRICS = ("gap/abs_mean", "gap/k3", "gap/max", "gap/outside_5x_frac", "gap/prob_abs_mean")
"""The gap metrics whose NaN/Inf the gap family flags when it runs alone (``nonfinite=True``)."""


class GapLevelRule(Rule):
    """The sampler-trainer gap above a band -> warning (including "full size before the first update").

    ``level = median(last window values)`` of ``metric``; warning when ``level > band``. On the
    first value of the run the message says the gap is already at full size before any update:
    a measured agentic run with compressed cuts showed exactly that (0.61) and completed no task
    from step 6 on, so this is the earliest warning that case allows.

    Defaults: ``band=0.5`` nats of mean |logp_trainer - logp_sampler| for ``gap/abs_mean``:
    dense engines sit near 0.006, the agentic run that died had 0.61. For ``gap/k3`` use
    ``band=0.2``: the KL of a Gaussian per-token gap with mean |delta| = 0.5 (k3 ~ E[delta^2]/2
    = (pi/4) * 0.5^2), twenty times the worst measured dense engine (0.01). A
    codec whose standing gap is above the band (5% PRF: ~10 nats) keeps this warning on for the
    whole run; that is informative, and callbacks list ``gap.level`` in ``tolerated_rules`` so it
    does not block "last healthy" checkpoints. ``window=5``.
    """

    name = "gap.level"

    def __init__(self, metric: str = "gap/abs_mean", band: float = 0.5, window: int = 5) -> None:
        self.metric = metric
        self.band = band
        self.window = window
        self.inputs = (metric,)

    def check(self, history: MetricHistory, step: int) -> list[Finding]:
        recent = history.values(self.metric, self.window)
        if recent.size == 0:
            return []
        level = float(np.median(recent))
        if not level > self.band:
            return []
        values = {"level": level, "band": self.band}
        if history.count(self.metric) == 1:
            msg = (
                f"{self.metric} {fmt_number(level)} > band {fmt_number(self.band)} at the first step, before any update: "
                "the gap is already at full size (a measured agentic run stopped completing tasks by step 6 at a gap of 0.61)"
            )
        else:
            msg = f"{self.metric} {fmt_number(level)} above band {fmt_number(self.band)}"
        return [Finding(self.name, self.metric, HealthState.WARNING, msg, values)]


class GapTrendRule(Rule):
    """The gap rising relative to where it started.

    ``rise = median(last window/2 values) / median(first baseline_points values) - 1``;
    warning when ``rise >= rise_warn``.

    Defaults: ``rise_warn=0.5``: a compressed run's gap is structural and roughly constant
    when healthy (it is already at full size before the first update), with per-step noise
    of a few %, so +50% is a trend, not noise; ``window=20``, ``baseline_points=10``.
    """

    name = "gap.trend"

    def __init__(
        self, metric: str = "gap/abs_mean", window: int = 20, baseline_points: int = 10, rise_warn: float = 0.5
    ) -> None:
        self.metric = metric
        self.window = window
        self.baseline_points = baseline_points
        self.rise_warn = rise_warn
        self.inputs = (metric,)

    def check(self, history: MetricHistory, step: int) -> list[Finding]:
        if history.count(self.metric) < self.baseline_points + self.window // 2:
            return []
        baseline = float(np.median(history.head(self.metric, self.baseline_points)))
        current = float(np.median(history.values(self.metric, max(self.window // 2, 1))))
        rise = relative_change(baseline, current)
        if rise < self.rise_warn:
            return []
        values = {"current": current, "baseline": baseline, "rise": rise}
        msg = f"{self.metric} {fmt_number(current)} is {rise:+.0%} on its start {fmt_number(baseline)}: the gap is growing"
        return [Finding(self.name, self.metric, HealthState.WARNING, msg, values)]


def gap_rules(
    abs_mean_band: float = 0.5,
    k3_band: float = 0.2,
    rise_warn: float = 0.5,
    window: int = 20,
    *,
    nonfinite: bool = False,
    coupling: bool = False,
) -> list[Rule]:
    """The gap family, in this order: :class:`GapLevelRule` on ``gap/abs_mean`` (``abs_mean_band``)
    and on ``gap/k3`` (``k3_band``), :class:`GapTrendRule` on ``gap/abs_mean`` (``window``,
    ``rise_warn``).

    Every other threshold is the rule's default (reasons in its docstring). For a monitor that
    runs this family alone: ``nonfinite=True`` puts a
    :class:`~tclightning.health.rules.nonfinite.NonFiniteRule` on :data:`GAP_METRICS` first, and
    ``coupling=True`` adds :class:`~tclightning.health.rules.length.LengthGapCouplingRule`
    (``window``) last. :func:`~tclightning.health.rules.default_rules` leaves both off: it has its
    own ``NonFiniteRule`` and takes the coupling rule from the length family.
    """
    rules: list[Rule] = [NonFiniteRule(GAP_METRICS)] if nonfinite else []
    rules += [
        GapLevelRule("gap/abs_mean", band=abs_mean_band),
        GapLevelRule("gap/k3", band=k3_band),
        GapTrendRule("gap/abs_mean", window=window, rise_warn=rise_warn),
    ]
    if coupling:
        rules.append(LengthGapCouplingRule(window=window))
    return rules
