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
    """The sampler-trainer gap above a band: a warning when it is so from the start, else information.

    ``level = median(last window values)`` of ``metric``, ``start = median(first window values)``.
    Above ``band``: a warning when the start is above it too (the codec's forward is that far from
    the sampler's before training moved it; on the first value the message says so), otherwise
    an ``info`` finding. Measured on the library of real runs (``benchmarks/health_library.py``):
    of the runs whose gap was above the band from their first steps (the 5% PRF recipes at
    2.3-2.9 nats, a low-rank run at 0.6 from step 1, the agentic PRF run at 4.8), all but the
    agentic one fell within 25 steps; a gap that crossed the band later (0.5-0.6 nats from step
    24 on, in two healthy low-rank runs) came with no fall, and in the runs that fell it crossed
    at the fall itself, too late to be a warning. A measured agentic run with compressed cuts
    had a gap of 0.61 before its first update and completed no task from step 6 on, so the
    first value is the earliest warning that case allows.

    Defaults: ``band=0.5`` nats of mean |logp_trainer - logp_sampler| for ``gap/abs_mean``:
    dense engines sit near 0.006, the agentic run that died had 0.61. For ``gap/k3`` use
    ``band=0.2``: the KL of a Gaussian per-token gap with mean |delta| = 0.5 (k3 ~ E[delta^2]/2
    = (pi/4) * 0.5^2), twenty times the worst measured dense engine (0.01). A
    codec whose standing gap is above the band (5% PRF) keeps this warning on for the whole run;
    callbacks list ``gap.level`` in ``tolerated_rules`` so it does not block "last healthy"
    checkpoints. ``window=5`` (the first step of a compressed run can be a dense cold start, gap 0).
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
        start = float(np.median(history.head(self.metric, self.window)))
        values = {"level": level, "band": self.band, "start": start}
        if history.count(self.metric) == 1:
            msg = (
                f"{self.metric} {fmt_number(level)} > band {fmt_number(self.band)} at the first step, before any update: "
                "the gap is already at full size (a measured agentic run stopped completing tasks by step 6 at a gap of 0.61)"
            )
        elif start > self.band:
            msg = f"{self.metric} {fmt_number(level)} above band {fmt_number(self.band)} since the start ({fmt_number(start)})"
        else:
            msg = (f"{self.metric} {fmt_number(level)} above band {fmt_number(self.band)}, risen from {fmt_number(start)} "
                   "at the start")
            return [Finding(self.name, self.metric, HealthState.HEALTHY, msg, values)]
        return [Finding(self.name, self.metric, HealthState.WARNING, msg, values)]


class GapTrendRule(Rule):
    """The gap rising relative to where it started: information, not a warning.

    ``rise = median(last window/2 values) / median(first baseline_points values) - 1``;
    an ``info`` finding when ``rise >= rise_warn`` (``severity`` to make it a warning).

    Information by default because on the library of real runs
    (``benchmarks/health_library.py``) no collapse was preceded by a rising gap (the PRF runs'
    gap stays within +/-10% of its step-0 level until after the reward has fallen), while the
    healthy default run's gap grows from 0.16 to 0.25 nats (+50%) as its policy sharpens. A gap
    that grows *with* the response length is a warning (``length.gap_coupling``).
    ``rise_warn=0.5``: per-step noise of a few %, so +50% is a trend, not noise; ``window=20``,
    ``baseline_points=10``.
    """

    name = "gap.trend"

    def __init__(
        self,
        metric: str = "gap/abs_mean",
        window: int = 20,
        baseline_points: int = 10,
        rise_warn: float = 0.5,
        severity: HealthState = HealthState.HEALTHY,
    ) -> None:
        self.metric = metric
        self.severity = HealthState(severity)
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
        return [Finding(self.name, self.metric, self.severity, msg, values)]


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
