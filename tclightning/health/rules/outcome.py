"""The outcome family: what the run produces and how it optimises -- reward and held-out
accuracy falling from their peak, reward dead, entropy collapse or explosion, grad-norm spikes,
and NaN/Inf anywhere."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from tclightning.health.history import MetricHistory, step_noise, window_mean_noise
from tclightning.health.rules.base import Finding, HealthState, Rule, fmt_number
from tclightning.health.rules.nonfinite import NonFiniteRule


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
            f"{self.metric} {fmt_number(current)} is {fmt_number(drop)} below its peak {fmt_number(self._peak)} (step {self._peak_step}), "
            f"{z:.1f} x its noise {fmt_number(sigma)}"
        )
        if z >= self.collapse_sigmas and (current <= start or drop >= self.collapse_gain_frac * gain):
            where = "below its start " + fmt_number(start) if current <= start else f"{drop / gain:.0%} of the gain gone"
            return [Finding(self.name, self.metric, HealthState.COLLAPSING, f"{what}; {where}", values)]
        return [Finding(self.name, self.metric, HealthState.WARNING, what, values)]

    def state_dict(self) -> dict[str, Any]:
        return {"peak": self._peak, "peak_step": self._peak_step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._peak = state.get("peak")
        self._peak_step = state.get("peak_step")


class RewardDeadRule(Rule):
    """No rollout earns any reward for ``dead_steps`` steps after some did -> ``collapsing``.

    With every reward zero, every GRPO advantage is zero: the run has stopped learning (a
    measured agentic run with compressed cuts completed no task from step 6 on). ``dead_steps=3`` steps so a
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
        what = f"{self.metric} {fmt_number(current)} is {ratio:.2f} x its start {fmt_number(baseline)}"
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
        what = f"{self.metric} {fmt_number(current)} is {current / reference:.0f} x its recent median {fmt_number(reference)}"
        if n >= self.spikes_to_collapse:
            return [Finding(self.name, self.metric, HealthState.COLLAPSING, f"{what}; {n} spikes in {self.window} steps", values)]
        return [Finding(self.name, self.metric, HealthState.WARNING, what, values)]

    def state_dict(self) -> dict[str, Any]:
        return {"spike_steps": list(self._spike_steps)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._spike_steps = [int(s) for s in state.get("spike_steps", [])]


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
