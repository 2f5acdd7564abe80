"""The length family: response length against reward (fast and slow), truncation, and length
growth coupled to the sampler-trainer gap -- the loops seen in a 16k-token run and a stale-anchor run."""

from __future__ import annotations

import numpy as np

from tclightning.health.history import (
    MetricHistory,
    halves,
    halves_z,
    relative_change,
    step_noise,
    window_mean_noise,
)
from tclightning.health.rules.base import Finding, HealthState, Rule, fmt_number
from tclightning.health.rules.nonfinite import NonFiniteRule


LENGTH_METRICS = ("response/length_mean", "response/length_max", "response/truncated_frac")
"""The length metrics whose NaN/Inf the length family flags when it runs alone (``nonfinite=True``)."""


class LengthFeedbackRule(Rule):
    """Response length growing over a window while reward is flat or falling.

    Over the last ``window`` steps: ``growth = median(2nd half) / median(1st half) - 1`` for
    ``response/length_mean`` (and the upper tail ``response/length_max``); reward trend
    ``z = (median(2nd half) - median(1st half)) / se`` of ``reward/mean`` (``val/accuracy``
    when no reward is logged), se from the reward's own step noise.

    * warning: ``growth >= growth_warn`` or ``tail_growth >= tail_growth_warn``, and ``z <
      reward_rise_z`` (the reward is not clearly paying for the longer answers);
    * collapsing: ``growth >= growth_collapse`` and ``z <= -reward_fall_z``.

    Defaults: ``window=20`` because a measured run at 16k-token generation length fell from its
    peak to below its start within 20 steps, so a longer window would see it too late; ``growth_warn=0.12`` is about
    five standard errors of the difference of half-window medians for per-step length noise of
    ~4% (a batch of a few hundred completions), far above the slow healthy drift of RLVR lengths
    (a few % per 20 steps) and well below one stale-anchor ratchet notch (~20%, which a notch
    straddling the two halves only partly shows: 0.15 missed the first notch in 1% of the
    synthetic ratchet runs); ``tail_growth_warn=0.25`` because the
    maximum is a noisier statistic; ``reward_rise_z=2.0`` accepts growth that comes with a
    two-standard-error reward gain (healthy "longer reasoning pays" growth); ``min_tokens=8``:
    growth must also be at least 8 tokens, because on short answers one token is a large
    relative change, while the loops that matter add hundreds;
    ``growth_collapse=0.5`` and ``reward_fall_z=3.0``: length up by half within 20 steps while
    reward clearly falls is the loop itself.
    """

    name = "length.feedback"

    def __init__(
        self,
        window: int = 20,
        growth_warn: float = 0.12,
        tail_growth_warn: float = 0.25,
        reward_rise_z: float = 2.0,
        growth_collapse: float = 0.5,
        reward_fall_z: float = 3.0,
        noise_points: int = 100,
        min_tokens: float = 8.0,
    ) -> None:
        if window < 4:
            raise ValueError("window must be >= 4")
        self.min_tokens = min_tokens
        self.window = window
        self.growth_warn = growth_warn
        self.tail_growth_warn = tail_growth_warn
        self.reward_rise_z = reward_rise_z
        self.growth_collapse = growth_collapse
        self.reward_fall_z = reward_fall_z
        self.noise_points = noise_points
        self.inputs = ("response/length_mean", "response/length_max", "reward/mean", "val/accuracy")

    def check(self, history: MetricHistory, step: int) -> list[Finding]:
        lengths = history.values("response/length_mean", self.window)
        if lengths.size < self.window:
            return []
        before, after = halves(lengths)
        # Growth counts only past `min_tokens` absolute: one token is +25% on a 4-token answer.
        growth = relative_change(before, after) if after - before >= self.min_tokens else 0.0
        tail_growth = 0.0
        tail_before = tail_after = 0.0
        tail = history.values("response/length_max", self.window)
        if tail.size == self.window:
            tail_before, tail_after = halves(tail)
            if tail_after - tail_before >= self.min_tokens:
                tail_growth = relative_change(tail_before, tail_after)
        if growth < self.growth_warn and tail_growth < self.tail_growth_warn:
            return []
        reward_name, reward_z = self._reward_trend(history, step)
        values = {"growth": growth, "tail_growth": tail_growth, "reward_z": reward_z, "window": float(self.window)}
        # name only what grew, with token counts: a "+0%" beside a "+34%" tail reads as a contradiction
        grew = []
        if growth >= self.growth_warn:
            grew.append(f"mean response length {fmt_number(before)} -> {fmt_number(after)} tokens ({growth:+.0%})")
        if tail_growth >= self.tail_growth_warn:
            grew.append(f"longest response {fmt_number(tail_before)} -> {fmt_number(tail_after)} tokens ({tail_growth:+.0%})")
        half = self.window // 2
        what = f"comparing the last {half} steps with the {half} before (medians), {' and '.join(grew)}"
        if reward_name is None:
            return [Finding(self.name, "response/length_mean", HealthState.WARNING, f"{what}; no reward logged to compare", values)]
        if growth >= self.growth_collapse and reward_z <= -self.reward_fall_z:
            msg = f"{what} while {reward_name} falls (z={reward_z:.1f}): length is feeding on itself"
            return [Finding(self.name, "response/length_mean", HealthState.COLLAPSING, msg, values)]
        if reward_z < self.reward_rise_z:
            trend = "falls" if reward_z <= -self.reward_rise_z else "stays flat"
            msg = f"{what} while {reward_name} {trend} (z={reward_z:.1f}): length feedback loop forming"
            return [Finding(self.name, "response/length_mean", HealthState.WARNING, msg, values)]
        return []

    def _reward_trend(self, history: MetricHistory, step: int) -> tuple[str | None, float]:
        reward = history.values("reward/mean", self.window)
        if reward.size >= self.window:
            noise = step_noise(history.values("reward/mean", self.noise_points))
            return "reward/mean", halves_z(reward, noise)
        acc_steps = history.steps("val/accuracy")
        acc = history.values("val/accuracy")
        recent = acc[acc_steps >= step - self.window]
        if recent.size >= 2:
            noise = step_noise(acc) if acc.size >= 5 else 0.0
            return "val/accuracy", halves_z(recent, max(noise, 0.01))
        return None, 0.0


class TruncationRule(Rule):
    """The share of completions cut at the generation limit rising above its start.

    ``rise = mean(last window) - median(first baseline_points)`` of ``response/truncated_frac``.

    * warning: ``rise >= rise_warn``;
    * collapsing: ``rise >= rise_warn`` and ``mean(last window) >= level_collapse``.

    Defaults: ``rise_warn=0.1`` (10 points): one answer in ten earning no reward for running out
    of room; on the library of real runs (``benchmarks/health_library.py``) a healthy run's
    10-step share wandered up to 9.5 points above its start with nothing else wrong, while the
    run that degenerated into truncated answers went to 36%;
    ``level_collapse=0.5``: when half the answers hit the limit, the reward signal is mostly
    truncation, which is where the measured 16k-token run ended; ``window=10``, ``baseline_points=20``.
    """

    name = "length.truncation"

    def __init__(
        self, window: int = 10, baseline_points: int = 20, rise_warn: float = 0.1, level_collapse: float = 0.5
    ) -> None:
        self.window = window
        self.baseline_points = baseline_points
        self.rise_warn = rise_warn
        self.level_collapse = level_collapse
        self.inputs = ("response/truncated_frac",)

    def check(self, history: MetricHistory, step: int) -> list[Finding]:
        metric = self.inputs[0]
        if history.count(metric) < self.window:
            return []
        baseline = float(np.median(history.head(metric, self.baseline_points)))
        current = float(np.mean(history.values(metric, self.window)))
        rise = current - baseline
        if rise < self.rise_warn:
            return []
        values = {"current": current, "baseline": baseline, "rise": rise}
        what = f"truncated share {current:.1%} (start {baseline:.1%}, +{rise * 100:.1f} points)"
        if current >= self.level_collapse:
            msg = f"{what}: most answers now hit the generation limit"
            return [Finding(self.name, metric, HealthState.COLLAPSING, msg, values)]
        return [Finding(self.name, metric, HealthState.WARNING, f"{what}: answers are running into the limit", values)]


class LengthDriftRule(Rule):
    """Response length far above its start while reward is no better than at its start.

    The slow version of :class:`LengthFeedbackRule`, for ratchets whose notches are further
    apart than its window (a stale anchor at K=20 ratchets once every 20 steps):
    ``growth = median(last window) / median(first baseline_points) - 1`` of
    ``response/length_mean``; ``z = (mean(last baseline_points) - mean(first baseline_points)) /
    sigma`` of ``reward/mean``, sigma the measured noise of a ``baseline_points``-step mean
    (floor ``noise_floor``). Warning when ``growth >= growth_warn`` and ``z < reward_gain_z``.

    Defaults: ``growth_warn=0.2``: healthy runs do lengthen their answers, but when they do the
    reward rises with them; 20% longer for no reward is one notch of the ratchet (0.3 let 1% of
    the synthetic ratchet runs through to their second notch). ``reward_gain_z=3.0``,
    ``baseline_points=20``, ``window=10``, ``noise_floor=0.005``; ``min_tokens=8`` as in
    :class:`LengthFeedbackRule` (short answers move by whole tokens).
    """

    name = "length.drift"

    def __init__(
        self,
        window: int = 10,
        baseline_points: int = 20,
        growth_warn: float = 0.2,
        reward_gain_z: float = 3.0,
        noise_floor: float = 0.005,
        min_tokens: float = 8.0,
    ) -> None:
        self.min_tokens = min_tokens
        self.window = window
        self.baseline_points = baseline_points
        self.growth_warn = growth_warn
        self.reward_gain_z = reward_gain_z
        self.noise_floor = noise_floor
        self.inputs = ("response/length_mean", "reward/mean")

    def check(self, history: MetricHistory, step: int) -> list[Finding]:
        metric = self.inputs[0]
        if history.count(metric) < self.baseline_points + self.window:
            return []
        start = float(np.median(history.head(metric, self.baseline_points)))
        current = float(np.median(history.values(metric, self.window)))
        growth = relative_change(start, current)
        if growth < self.growth_warn or current - start < self.min_tokens:
            return []
        if history.count("reward/mean") < 2 * self.baseline_points:
            return []
        r_start = float(np.mean(history.head("reward/mean", self.baseline_points)))
        r_now = float(np.mean(history.values("reward/mean", self.baseline_points)))
        sigma = max(window_mean_noise(history.values("reward/mean", 200), self.baseline_points), self.noise_floor)
        z = (r_now - r_start) / sigma
        if z >= self.reward_gain_z:
            return []
        values = {"growth": growth, "start": start, "current": current, "reward_start": r_start, "reward_now": r_now, "z": z}
        msg = (
            f"response length {fmt_number(current)} is {growth:+.0%} on its start {fmt_number(start)} while reward/mean "
            f"{fmt_number(r_now)} is no better than at the start {fmt_number(r_start)} (z={z:.1f}): length is ratcheting up"
        )
        return [Finding(self.name, metric, HealthState.WARNING, msg, values)]


class LengthGapCouplingRule(Rule):
    """Length growth correlated with a rising sampler-trainer gap (the gap amplifying the loop).

    Over the last ``window`` steps where both are logged: Pearson ``r(length_mean, gap)``,
    and both grew (``median(2nd half)/median(1st half) - 1``). Warning when ``r >= min_corr``,
    ``length_growth >= length_growth_warn`` and ``gap_growth >= gap_growth_warn``.

    Defaults: ``min_corr=0.7`` (independent noise gives |r| > 0.7 over 20 points with
    probability < 0.1%); growth thresholds of 10% are below the length rule's so this fires
    first when the gap amplifies the loop, as it did in the measured 16k-token collapse.
    """

    name = "length.gap_coupling"

    def __init__(
        self,
        window: int = 20,
        min_corr: float = 0.7,
        length_growth_warn: float = 0.10,
        gap_growth_warn: float = 0.10,
        gap_metric: str = "gap/abs_mean",
    ) -> None:
        self.window = window
        self.min_corr = min_corr
        self.length_growth_warn = length_growth_warn
        self.gap_growth_warn = gap_growth_warn
        self.gap_metric = gap_metric
        self.inputs = ("response/length_mean", gap_metric)

    @property
    def triggers(self) -> tuple[str, ...]:
        return self.inputs

    def check(self, history: MetricHistory, step: int) -> list[Finding]:
        _, both = history.aligned(self.inputs, self.window)
        if both.shape[0] < self.window:
            return []
        length, gap = both[:, 0], both[:, 1]
        length_growth = relative_change(*halves(length))
        gap_growth = relative_change(*halves(gap))
        if length_growth < self.length_growth_warn or gap_growth < self.gap_growth_warn:
            return []
        if np.std(length) == 0 or np.std(gap) == 0:
            return []
        corr = float(np.corrcoef(length, gap)[0, 1])
        if corr < self.min_corr:
            return []
        values = {"corr": corr, "length_growth": length_growth, "gap_growth": gap_growth}
        msg = (
            f"response length +{length_growth:.0%} and {self.gap_metric} +{gap_growth:.0%} over {self.window} steps, "
            f"correlated r={corr:.2f}: the gap is amplifying length growth"
        )
        return [Finding(self.name, self.gap_metric, HealthState.WARNING, msg, values)]


def length_rules(
    window: int = 20,
    growth_warn: float = 0.12,
    drift_growth_warn: float = 0.2,
    truncation_rise_warn: float = 0.1,
    truncation_collapse: float = 0.5,
    *,
    nonfinite: bool = False,
) -> list[Rule]:
    """The length family, in this order: :class:`LengthFeedbackRule` (``window``, ``growth_warn``),
    :class:`LengthDriftRule` (``drift_growth_warn``), :class:`TruncationRule`
    (``truncation_rise_warn``, ``truncation_collapse``), :class:`LengthGapCouplingRule` (``window``).

    Every other threshold is the rule's default (reasons in its docstring). ``nonfinite=True``
    puts a :class:`~tclightning.health.rules.nonfinite.NonFiniteRule` on :data:`LENGTH_METRICS`
    first, for a monitor that runs this family alone; :func:`~tclightning.health.rules.default_rules`
    leaves it off (its own ``NonFiniteRule`` watches every metric).
    """
    rules: list[Rule] = [NonFiniteRule(LENGTH_METRICS)] if nonfinite else []
    rules += [
        LengthFeedbackRule(window=window, growth_warn=growth_warn),
        LengthDriftRule(growth_warn=drift_growth_warn),
        TruncationRule(rise_warn=truncation_rise_warn, level_collapse=truncation_collapse),
        LengthGapCouplingRule(window=window),
    ]
    return rules
