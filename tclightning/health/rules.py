"""Health rules: each looks at a :class:`MetricHistory` and says what it sees, with numbers.

A rule is a small object with a ``name``, the canonical metrics it reads (``inputs``), the ones
whose arrival makes it look again (``triggers``) and ``check(history, step) -> [Finding]``.
Thresholds are constructor parameters; each default carries the reason for its value in the
docstring. No Lightning import: :class:`~tclightning.health.detector.HealthDetector` strings the
rules together, and the callbacks and ``tclightning analyze health`` share it.

The failure modes come from the research hub (SPEC.md, "What collapses"): the length feedback
loop at long generation length, the stale-anchor length ratchet, and the agentic run whose
sampler-trainer gap was at full size before the first update.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import numpy as np

from tclightning.health.history import (
    MetricHistory,
    halves,
    halves_z,
    relative_change,
    step_noise,
    window_mean_noise,
)


class HealthState(IntEnum):
    """The verdict, logged as the scalar ``health/state``: 0 healthy, 1 warning, 2 collapsing."""

    HEALTHY = 0
    WARNING = 1
    COLLAPSING = 2

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(frozen=True)
class Finding:
    """One rule firing at one step: which rule, on which metric, how bad, and the numbers."""

    rule: str
    metric: str
    severity: HealthState
    message: str
    values: Mapping[str, float] = field(default_factory=dict)

    @property
    def key(self) -> str:
        """Identity of an episode: ``rule:metric``."""
        return f"{self.rule}:{self.metric}"


def _fmt(x: float) -> str:
    if not math.isfinite(x):
        return str(x)
    if x != 0 and (abs(x) >= 1e4 or abs(x) < 1e-3):
        return f"{x:.3g}"
    return f"{x:.4g}"


class Rule:
    """Base class. Subclasses set ``name``, ``inputs`` and implement :meth:`check`.

    ``triggers`` (default: the first input) are the metrics whose arrival in an update makes the
    detector run the rule; a rule with no triggers runs on every update. Rules keep their own
    state (a running peak, spike steps) in plain Python numbers so :meth:`state_dict` can be
    checkpointed.
    """

    name: str = "rule"
    inputs: tuple[str, ...] = ()

    @property
    def triggers(self) -> tuple[str, ...]:
        return self.inputs[:1]

    def check(self, history: MetricHistory, step: int) -> list[Finding]:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass

    def __repr__(self) -> str:
        params = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in params.items())})"


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
        msg = f"{name} = {_fmt(value)} at step {step}: NaN/Inf in the loss, gradients, weights or logits"
        return Finding(self.name, name, HealthState.COLLAPSING, msg, {"value": value})


class LengthFeedbackRule(Rule):
    """Response length growing over a window while reward is flat or falling.

    Over the last ``window`` steps: ``growth = median(2nd half) / median(1st half) - 1`` for
    ``response/length_mean`` (and the upper tail ``response/length_max``); reward trend
    ``z = (median(2nd half) - median(1st half)) / se`` of ``reward/mean`` (``val/accuracy``
    when no reward is logged), se from the reward's own step noise.

    * warning: ``growth >= growth_warn`` or ``tail_growth >= tail_growth_warn``, and ``z <
      reward_rise_z`` (the reward is not clearly paying for the longer answers);
    * collapsing: ``growth >= growth_collapse`` and ``z <= -reward_fall_z``.

    Defaults: ``window=20`` because the hub's 16k run fell from its peak to below its start
    within 20 steps, so a longer window would see it too late; ``growth_warn=0.12`` is about
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
        tail = history.values("response/length_max", self.window)
        if tail.size == self.window:
            tail_before, tail_after = halves(tail)
            if tail_after - tail_before >= self.min_tokens:
                tail_growth = relative_change(tail_before, tail_after)
        if growth < self.growth_warn and tail_growth < self.tail_growth_warn:
            return []
        reward_name, reward_z = self._reward_trend(history, step)
        values = {"growth": growth, "tail_growth": tail_growth, "reward_z": reward_z, "window": float(self.window)}
        what = f"response length +{growth:.0%} over the last {self.window} steps (tail {tail_growth:+.0%})"
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

    Defaults: ``rise_warn=0.05`` (5 points) is over four standard errors for a batch of 64+
    completions and already means one answer in twenty earns no reward for running out of room;
    ``level_collapse=0.5``: when half the answers hit the limit, the reward signal is mostly
    truncation, which is where the hub's 16k run ended; ``window=10``, ``baseline_points=20``.
    """

    name = "length.truncation"

    def __init__(
        self, window: int = 10, baseline_points: int = 20, rise_warn: float = 0.05, level_collapse: float = 0.5
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
    apart than its window (the hub's K=20 anchor ratchets every 20 steps):
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
            f"response length {_fmt(current)} is {growth:+.0%} on its start {_fmt(start)} while reward/mean "
            f"{_fmt(r_now)} is no better than at the start {_fmt(r_start)} (z={z:.1f}): length is ratcheting up"
        )
        return [Finding(self.name, metric, HealthState.WARNING, msg, values)]


class LengthGapCouplingRule(Rule):
    """Length growth correlated with a rising sampler-trainer gap (the hub's amplifier).

    Over the last ``window`` steps where both are logged: Pearson ``r(length_mean, gap)``,
    and both grew (``median(2nd half)/median(1st half) - 1``). Warning when ``r >= min_corr``,
    ``length_growth >= length_growth_warn`` and ``gap_growth >= gap_growth_warn``.

    Defaults: ``min_corr=0.7`` (independent noise gives |r| > 0.7 over 20 points with
    probability < 0.1%); growth thresholds of 10% are below the length rule's so this fires
    first when the gap amplifies the loop, as in the hub's 16k collapse.
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


class RewardDropRule(Rule):
    """Reward (or accuracy) falling from its peak by more than its own noise.

    ``s = mean(last smooth values)`` of ``metric``; ``peak`` = running max of ``s``; ``start``
    = mean of the first ``smooth`` values; noise ``sigma`` = measured noise of a
    ``smooth``-point mean over the last ``noise_points`` values (the larger of
    :func:`window_mean_noise` and ``step_noise / sqrt(smooth)``, widened by ``1 + 2/sqrt(n)``
    for a spread measured from n points, floored at ``noise_floor``); ``drop = peak - s``;
    ``z = drop / sigma``.

    * warning: ``z >= warn_sigmas`` and ``drop >= min_drop``;
    * collapsing: ``z >= collapse_sigmas``, ``drop >= min_drop`` and either ``s <= start`` (the
      gain is gone) or ``drop >= collapse_gain_frac * (peak - start)``.

    Defaults for per-step ``reward/mean``: ``smooth=10`` steps (one noisy batch never decides);
    ``warn_sigmas=5``: the running peak of a noisy smoothed series sits ~2.5 sigma above its
    mean after a few hundred steps, so 5 sigma is a real fall (4 sigma warned in a quarter of
    300-step stable synthetic runs, 5 sigma in ~2%); ``collapse_sigmas=8``;
    ``min_drop=0.02`` (two points of reward are below any practical concern);
    ``collapse_gain_frac=0.75``. For sparse ``val/accuracy`` use :meth:`for_accuracy`.
    """

    name = "reward.drop"

    def __init__(
        self,
        metric: str = "reward/mean",
        smooth: int = 10,
        warn_sigmas: float = 5.0,
        collapse_sigmas: float = 8.0,
        min_drop: float = 0.02,
        collapse_gain_frac: float = 0.75,
        noise_floor: float = 0.002,
        noise_points: int = 120,
        min_points: int | None = None,
        name: str | None = None,
    ) -> None:
        self.metric = metric
        self.smooth = smooth
        self.warn_sigmas = warn_sigmas
        self.collapse_sigmas = collapse_sigmas
        self.min_drop = min_drop
        self.collapse_gain_frac = collapse_gain_frac
        self.noise_floor = noise_floor
        self.noise_points = noise_points
        self.min_points = min_points if min_points is not None else 3 * smooth
        if name is not None:
            self.name = name
        self.inputs = (metric,)
        self._peak: float | None = None
        self._peak_step: int | None = None

    @classmethod
    def for_accuracy(
        cls,
        metric: str = "val/accuracy",
        smooth: int = 2,
        warn_sigmas: float = 4.0,
        collapse_sigmas: float = 6.0,
        min_drop: float = 0.02,
        noise_floor: float = 0.012,
    ) -> RewardDropRule:
        """The same rule for held-out accuracy, logged every few steps.

        ``smooth=2`` evaluations; ``noise_floor=0.012`` is the standard error of the mean of two
        evaluations on ~900 questions (binomial at p=0.5), which protects the first
        evaluations before the noise can be measured; ``min_points=6`` evaluations.
        """
        return cls(
            metric=metric,
            smooth=smooth,
            warn_sigmas=warn_sigmas,
            collapse_sigmas=collapse_sigmas,
            min_drop=min_drop,
            noise_floor=noise_floor,
            noise_points=40,
            min_points=6,
            name="accuracy.drop",
        )

    def check(self, history: MetricHistory, step: int) -> list[Finding]:
        if history.count(self.metric) < max(self.min_points, self.smooth):
            return []
        current = float(np.mean(history.values(self.metric, self.smooth)))
        if not math.isfinite(current):
            return []
        if self._peak is None or current > self._peak:
            self._peak, self._peak_step = current, step
        start = float(np.mean(history.head(self.metric, self.smooth)))
        recent = history.values(self.metric, self.noise_points)
        measured = max(window_mean_noise(recent, self.smooth), step_noise(recent) / math.sqrt(self.smooth))
        # a spread measured from few points is often too small: widen it by 1 + 2/sqrt(n)
        sigma = max(measured * (1.0 + 2.0 / math.sqrt(recent.size)), self.noise_floor)
        drop = self._peak - current
        z = drop / sigma
        if z < self.warn_sigmas or drop < self.min_drop:
            return []
        gain = self._peak - start
        values = {"current": current, "peak": self._peak, "peak_step": float(self._peak_step or 0), "start": start,
                  "sigma": sigma, "z": z}
        what = (
            f"{self.metric} {_fmt(current)} is {_fmt(drop)} below its peak {_fmt(self._peak)} (step {self._peak_step}), "
            f"{z:.1f} x its noise {_fmt(sigma)}"
        )
        if z >= self.collapse_sigmas and (current <= start or drop >= self.collapse_gain_frac * gain):
            where = "below its start " + _fmt(start) if current <= start else f"{drop / gain:.0%} of the gain gone"
            return [Finding(self.name, self.metric, HealthState.COLLAPSING, f"{what}; {where}", values)]
        return [Finding(self.name, self.metric, HealthState.WARNING, what, values)]

    def state_dict(self) -> dict[str, Any]:
        return {"peak": self._peak, "peak_step": self._peak_step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._peak = state.get("peak")
        self._peak_step = state.get("peak_step")


class RewardDeadRule(Rule):
    """No rollout earns any reward for ``dead_steps`` steps after some did -> ``collapsing``.

    With every reward zero, every GRPO advantage is zero: the run has stopped learning (the
    hub's agentic run "stopped completing any task by step six"). ``dead_steps=3`` steps so a
    single unlucky batch does not count; ``eps`` is the "zero" tolerance.
    """

    name = "reward.dead"

    def __init__(self, metric: str = "reward/mean", dead_steps: int = 3, eps: float = 1e-9) -> None:
        self.metric = metric
        self.dead_steps = dead_steps
        self.eps = eps
        self.inputs = (metric,)
        self._seen_reward = False

    def check(self, history: MetricHistory, step: int) -> list[Finding]:
        latest = history.latest(self.metric)
        if latest is None:
            return []
        if latest > self.eps:
            self._seen_reward = True
            return []
        recent = history.values(self.metric, self.dead_steps)
        if not self._seen_reward or recent.size < self.dead_steps or np.any(recent > self.eps):
            return []
        msg = f"{self.metric} has been 0 for {self.dead_steps} steps after earlier rewards: no learning signal left"
        return [Finding(self.name, self.metric, HealthState.COLLAPSING, msg, {"dead_steps": float(self.dead_steps)})]

    def state_dict(self) -> dict[str, Any]:
        return {"seen_reward": self._seen_reward}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._seen_reward = bool(state.get("seen_reward", False))


class GapLevelRule(Rule):
    """The sampler-trainer gap above a band -> warning (including "full size before the first update").

    ``level = median(last window values)`` of ``metric``; warning when ``level > band``. On the
    first value of the run the message says the gap is already at full size before any update:
    the hub's agentic run showed exactly that and stopped completing tasks by step 6, so this is
    the earliest warning that case allows.

    Defaults: ``band=0.5`` nats of mean |logp_trainer - logp_sampler| for ``gap/abs_mean``:
    dense engines sit near 0.006, the agentic run that died had 0.61. For ``gap/k3`` use
    ``band=0.2``: the KL of a Gaussian per-token gap with mean |delta| = 0.5 (k3 ~ E[delta^2]/2
    = (pi/4) * 0.5^2), twenty times the worst dense engine the hub measured (0.01). A
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
                f"{self.metric} {_fmt(level)} > band {_fmt(self.band)} at the first step, before any update: "
                "the gap is already at full size (the hub's agentic run with 0.61 stopped completing tasks by step 6)"
            )
        else:
            msg = f"{self.metric} {_fmt(level)} above band {_fmt(self.band)}"
        return [Finding(self.name, self.metric, HealthState.WARNING, msg, values)]


class GapTrendRule(Rule):
    """The gap rising relative to where it started.

    ``rise = median(last window/2 values) / median(first baseline_points values) - 1``;
    warning when ``rise >= rise_warn``.

    Defaults: ``rise_warn=0.5``: a compressed run's gap is structural and roughly constant
    when healthy (the hub: "already at full size before the first update"), with per-step noise
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
        msg = f"{self.metric} {_fmt(current)} is {rise:+.0%} on its start {_fmt(baseline)}: the gap is growing"
        return [Finding(self.name, self.metric, HealthState.WARNING, msg, values)]


class EntropyRule(Rule):
    """Policy entropy collapsing towards zero or exploding, relative to its start.

    ``ratio = median(last window) / median(first baseline_points)`` of ``policy/entropy``.

    * ``entropy.collapse``: warning at ``ratio <= low_warn`` (0.2), collapsing at ``ratio <=
      low_collapse`` (0.05). Healthy RLVR lowers entropy two- to four-fold over a run; a
      twenty-fold fall means the policy answers the same way every time, and GRPO's groups
      stop having any variance to learn from.
    * ``entropy.explosion``: warning at ``ratio >= high_warn`` (2.0), collapsing at ``ratio >=
      high_collapse`` (4.0): degenerate, rambling generations (the length loop's companion).
    """

    name = "entropy"

    def __init__(
        self,
        metric: str = "policy/entropy",
        window: int = 10,
        baseline_points: int = 10,
        low_warn: float = 0.2,
        low_collapse: float = 0.05,
        high_warn: float = 2.0,
        high_collapse: float = 4.0,
    ) -> None:
        self.metric = metric
        self.window = window
        self.baseline_points = baseline_points
        self.low_warn = low_warn
        self.low_collapse = low_collapse
        self.high_warn = high_warn
        self.high_collapse = high_collapse
        self.inputs = (metric,)

    def check(self, history: MetricHistory, step: int) -> list[Finding]:
        if history.count(self.metric) < self.baseline_points + self.window // 2:
            return []
        baseline = float(np.median(history.head(self.metric, self.baseline_points)))
        current = float(np.median(history.values(self.metric, self.window)))
        if baseline <= 0:
            return []
        ratio = current / baseline
        values = {"current": current, "baseline": baseline, "ratio": ratio}
        what = f"{self.metric} {_fmt(current)} is {ratio:.2f} x its start {_fmt(baseline)}"
        if ratio <= self.low_warn:
            sev = HealthState.COLLAPSING if ratio <= self.low_collapse else HealthState.WARNING
            return [Finding("entropy.collapse", self.metric, sev, f"{what}: the policy is becoming deterministic", values)]
        if ratio >= self.high_warn:
            sev = HealthState.COLLAPSING if ratio >= self.high_collapse else HealthState.WARNING
            return [Finding("entropy.explosion", self.metric, sev, f"{what}: generations are degenerating", values)]
        return []


class GradNormSpikeRule(Rule):
    """Gradient-norm spikes against the recent median.

    A spike is ``grad_norm > spike_factor * median(previous window values)``. Warning on a
    spike; collapsing when ``spikes_to_collapse`` spikes fall within ``window`` steps.

    Defaults: ``spike_factor=10``: per-step grad norms of LLM RL vary by a factor of 2-3
    (log-normal with sigma ~0.3-0.4), so 10x is a different regime; ``spikes_to_collapse=3`` in
    ``window=20`` steps: repeated blow-ups are instability, not an unlucky batch.
    """

    name = "grad_norm.spike"

    def __init__(
        self, metric: str = "policy/grad_norm", window: int = 20, spike_factor: float = 10.0, spikes_to_collapse: int = 3
    ) -> None:
        self.metric = metric
        self.window = window
        self.spike_factor = spike_factor
        self.spikes_to_collapse = spikes_to_collapse
        self.inputs = (metric,)
        self._spike_steps: list[int] = []

    def check(self, history: MetricHistory, step: int) -> list[Finding]:
        recent = history.values(self.metric, self.window + 1)
        if recent.size < 6:
            return []
        current, reference = float(recent[-1]), float(np.median(recent[:-1]))
        self._spike_steps = [s for s in self._spike_steps if s > step - self.window]
        if not (math.isfinite(current) and reference > 0 and current > self.spike_factor * reference):
            return []
        if not self._spike_steps or self._spike_steps[-1] != step:
            self._spike_steps.append(step)
        n = len(self._spike_steps)
        values = {"current": current, "reference": reference, "ratio": current / reference, "spikes": float(n)}
        what = f"{self.metric} {_fmt(current)} is {current / reference:.0f} x its recent median {_fmt(reference)}"
        if n >= self.spikes_to_collapse:
            return [Finding(self.name, self.metric, HealthState.COLLAPSING, f"{what}; {n} spikes in {self.window} steps", values)]
        return [Finding(self.name, self.metric, HealthState.WARNING, what, values)]

    def state_dict(self) -> dict[str, Any]:
        return {"spike_steps": list(self._spike_steps)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._spike_steps = [int(s) for s in state.get("spike_steps", [])]


def length_rules() -> list[Rule]:
    """The length-feedback family: length vs reward (fast and slow), truncation, length-gap coupling."""
    return [LengthFeedbackRule(), LengthDriftRule(), TruncationRule(), LengthGapCouplingRule()]


def gap_rules() -> list[Rule]:
    """The gap family: level of ``gap/abs_mean`` and ``gap/k3`` above their bands, and trend."""
    return [GapLevelRule("gap/abs_mean", band=0.5), GapLevelRule("gap/k3", band=0.2), GapTrendRule("gap/abs_mean")]


def outcome_rules() -> list[Rule]:
    """What the run produces and how it optimises: reward/accuracy, entropy, grad norm, NaN/Inf."""
    return [
        NonFiniteRule(),
        RewardDropRule(),
        RewardDropRule.for_accuracy(),
        RewardDeadRule(),
        EntropyRule(),
        GradNormSpikeRule(),
    ]


def default_rules() -> list[Rule]:
    """Every rule with its default thresholds (what :class:`CollapseDetector` uses)."""
    return [*outcome_rules(), *length_rules(), *gap_rules()]
