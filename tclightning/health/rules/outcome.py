"""The outcome family: what the run produces and how it optimises -- reward and held-out
accuracy falling from their peak, reward dead, entropy collapse or explosion, grad-norm spikes,
and NaN/Inf anywhere."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from tclightning.health.history import MetricHistory, step_noise
from tclightning.health.rules.base import Finding, HealthState, Rule, fmt_number
from tclightning.health.rules.nonfinite import NonFiniteRule


class RewardDropRule(Rule):
    """Reward (or held-out accuracy) falling below its start or its peak: a sequential test at
    each step's own standard error.

    A step's mean reward is a mean over P x G completions, so the batch measures its own noise:
    ``reward/sem`` (the standard error with each prompt's group as one cluster), else
    ``reward/std / sqrt(reward/count)``, else (a trainer that logs neither) the measured step
    noise of the series, from ``min_points=20`` values on (fewer measure it too poorly: with 8,
    one flat run in 200 was called collapsing). For accuracy (``binomial=True``)
    the error is binomial, ``sqrt(p (1 - p) / n)`` at the start level with ``n`` from ``val/count``.
    The variance ``s^2`` a step is judged with is the mean over the last ``peak_window`` steps
    (one batch's error, measured from its P groups, is itself noisy), plus the start level's own
    and ``noise_floor^2``.

    **Two references.** ``start`` = mean of the first ``start_points`` values (fewer when the
    test fires among them; :class:`RewardDeadRule` catches a run that breaks in its first
    steps), with the fall ``delta = min(drop, drop_fraction * start)``; ``peak`` = the running
    maximum of the ``peak_window``-point mean less two of its standard errors (a level the run
    has held, not its luckiest batch), tested once it is above the start, with the fall
    ``max(delta, peak_gain_frac * (peak - start))``: by default the whole gain, so the test asks
    whether the run is heading back to where it began (a collapse), not whether it dipped (near
    the ceiling single batches scatter far below their mean, and healthy runs at 0.93 dip to
    0.68 for 30 steps and come back).

    **Test.** For each reference, Page's CUSUM of the log-likelihood ratio of "the level fell by
    its ``fall``" against "it stayed", for a Gaussian step mean::

        evidence_t = max(0, evidence_{t-1} + min(cap, fall / s^2 * (min(ref - x_t, fall) - fall / 2)))

    A step below the fallen level counts as one at it (the inner ``min``): one batch can show
    that the reward sits at the fall, never more, so a heavy tail of bad batches does not decide
    alone (at se ~0.045 and a fall of 0.15 one such step gives 5.6). ``cap`` is
    ``warn_evidence / start_steps`` against the start and ``warn_evidence / peak_steps`` against
    the peak: the fewest steps that can warn.

    * warning: either evidence ``>= warn_evidence``;
    * collapsing: the start's evidence ``>= collapse_evidence`` with the mean of the last
      ``recent`` values ``delta`` below the start (the fall ``benchmarks/health_library.py``
      scores), or the peak's with ``collapse_gain_frac`` of the gain gone from the mean of the
      last ``peak_window`` values (a loss that lasts).

    Defaults, measured on the library of real runs (``benchmarks/health_library.py``: every
    fall warned by its step + 1 and called by + 2) and the synthetic stable traces (1% of runs
    warned): ``drop=0.15`` (rewards in [0, 1]: the fall a user reads off a reward curve);
    ``drop_fraction=0.5`` (a task that starts at 0.1 falls by 0.05); ``warn_evidence=8``
    (likelihood ratio e^8 ~ 3000: two batches at the fallen level at se 0.045);
    ``collapse_evidence=10``; ``start_points=5``; ``start_steps=1``; ``recent=3``;
    ``peak_window=10``; ``peak_gain_frac=1.0`` (at 0.5, `fast-only-lowrank-half` seed 1's dip
    from 0.93 to 0.68 at steps 697-727, which it came back from, warned); ``peak_steps=5``
    (healthy runs dip 0.2-0.3 below their peak for 4-6 steps and come back); ``collapse_gain_frac=0.75``;
    ``noise_floor=0.01`` (a batch whose rewards are all equal reports se 0). For sparse
    ``val/accuracy`` use :meth:`for_accuracy`.
    """

    name = "reward.drop"

    def __init__(
        self,
        metric: str = "reward/mean",
        sem_metric: str | None = "reward/sem",
        std_metric: str | None = "reward/std",
        count_metric: str | None = "reward/count",
        binomial: bool = False,
        drop: float = 0.15,
        drop_fraction: float = 0.5,
        warn_evidence: float = 8.0,
        collapse_evidence: float = 10.0,
        start_points: int = 5,
        start_steps: int = 1,
        recent: int = 3,
        peak_window: int = 10,
        peak_gain_frac: float = 1.0,
        peak_steps: int = 5,
        collapse_gain_frac: float = 0.75,
        noise_floor: float = 0.01,
        noise_points: int = 100,
        min_points: int = 20,
        name: str | None = None,
    ) -> None:
        if drop <= 0 or not 0 < drop_fraction <= 1 or not 0 < warn_evidence <= collapse_evidence:
            raise ValueError("need drop > 0, 0 < drop_fraction <= 1 and 0 < warn_evidence <= collapse_evidence")
        if start_points < 1 or recent < 1 or peak_window < 1 or noise_floor <= 0:
            raise ValueError("start_points, recent and peak_window must be >= 1 and noise_floor > 0")
        self.metric = metric
        self.sem_metric = sem_metric
        self.std_metric = std_metric
        self.count_metric = count_metric
        self.binomial = binomial
        self.drop = drop
        self.drop_fraction = drop_fraction
        self.warn_evidence = warn_evidence
        self.collapse_evidence = collapse_evidence
        self.start_points = start_points
        self.start_steps = start_steps
        self.recent = recent
        self.peak_window = peak_window
        self.peak_gain_frac = peak_gain_frac
        self.peak_steps = peak_steps
        self.collapse_gain_frac = collapse_gain_frac
        self.noise_floor = noise_floor
        self.noise_points = noise_points
        self.min_points = min_points
        if name is not None:
            self.name = name
        self.inputs = tuple(m for m in (metric, sem_metric, std_metric, count_metric) if m)
        self._reset()

    def _reset(self) -> None:
        self._start: list[float] = []  # the values of the start level
        self._start_var: list[float] = []  # and their squared standard errors
        self._start_done = False
        self._peak: float | None = None
        self._peak_step: int | None = None
        self._evidence = {"start": 0.0, "peak": 0.0}
        self._evidence_before = dict(self._evidence)  # before the last step: a repeated step replaces it
        self._last_step: int | None = None
        self._recent_var: list[float] = []  # squared standard errors of the last peak_window values

    @classmethod
    def for_accuracy(
        cls,
        metric: str = "val/accuracy",
        count_metric: str | None = "val/count",
        drop: float = 0.2,
        warn_evidence: float = 8.0,
        collapse_evidence: float = 8.0,
        noise_floor: float = 0.012,
    ) -> RewardDropRule:
        """The same test for held-out accuracy, logged every few steps: binomial error from
        ``val/count`` problems (or the evaluations' measured noise after 6, when larger); the
        start is the first evaluation (step 0, before any update), the peak the running maximum
        of two-evaluation means, the recent level the latest evaluation; ``start_steps=2``: a
        fall must show on two evaluations (healthy runs' held-out accuracy moves 0.05-0.1 from
        one to the next); ``drop=0.2`` (at 0.15, `fast-only-lowrank-half` seed 1 at 0.88 and
        0.875 on two evaluations after a start at 1.0 warned, and recovered);
        ``collapse_evidence=8``: called at the second one when it is past the fall;
        ``noise_floor=0.012``: the binomial error of ~900 problems at p = 0.5."""
        return cls(metric=metric, sem_metric=None, std_metric=None, count_metric=count_metric, binomial=True,
                   drop=drop, warn_evidence=warn_evidence, collapse_evidence=collapse_evidence, start_points=1,
                   start_steps=2, recent=1, peak_window=2, noise_floor=noise_floor, noise_points=40, min_points=6, name="accuracy.drop")

    @property
    def triggers(self) -> tuple[str, ...]:
        return (self.metric,)

    def _variance(self, history: MetricHistory, value: float, start: float | None) -> float | None:
        """The squared standard error of this step's value, or None while it cannot be known: the
        batch's own error; for accuracy the larger of the binomial error and the series' measured
        step noise once there are ``min_points`` evaluations (the policy itself wanders between
        evaluations: healthy runs' held-out accuracy moves 0.05-0.1 from one to the next, several
        binomial errors of 128 problems; a step's reward error, measured from its groups, matches
        the reward's measured step noise on the library's runs)."""
        update = history.last_update
        count = update.get(self.count_metric) if self.count_metric else None
        own = None
        if self.binomial and count is not None and count > 0:
            # one pseudo-success and one pseudo-failure: a start at 128/128 does not claim zero error
            p = (min(max(start if start is not None else value, 0.0), 1.0) * count + 1.0) / (count + 2.0)
            own = p * (1.0 - p) / count
        sem = update.get(self.sem_metric) if self.sem_metric else None
        std = update.get(self.std_metric) if self.std_metric else None
        if own is None and sem is not None and math.isfinite(sem):
            own = sem * sem
        elif own is None and std is not None and count is not None and count > 0 and math.isfinite(std):
            own = std * std / count
        if history.count(self.metric) < self.min_points or (own is not None and not self.binomial):
            return own
        # first differences, so a learning curve is not counted as noise; few points measure too small a spread
        recent = history.values(self.metric, self.noise_points)
        measured = (step_noise(recent) * (1.0 + 2.0 / math.sqrt(recent.size))) ** 2
        return measured if own is None else max(own, measured)

    def check(self, history: MetricHistory, step: int) -> list[Finding]:
        value = history.latest(self.metric)
        if value is None or history.steps(self.metric, 1)[0] != step:
            return []  # this step's value was not finite: the non-finite rule speaks for it
        if step == self._last_step:  # the same step again (a re-logged value): replace its increment
            self._evidence = dict(self._evidence_before)
            self._recent_var = self._recent_var[:-1]
        start = float(np.mean(self._start)) if self._start else None
        variance = self._variance(history, value, start)
        if variance is None:
            return []
        self._recent_var = [*self._recent_var, variance][-self.peak_window:]
        self._last_step = step
        self._evidence_before = dict(self._evidence)
        if start is None:  # the first value: the start level so far
            self._start, self._start_var = [value], [variance]
            self._start_done = self.start_points <= 1
            return []
        s2 = float(np.mean(self._recent_var)) + float(np.sum(self._start_var)) / len(self._start) ** 2 + self.noise_floor**2
        delta = min(self.drop, self.drop_fraction * start)
        if delta <= 0:
            return []
        self._evidence["start"] = _cusum(self._evidence["start"], start - value, delta, s2,
                                         cap=self.warn_evidence / self.start_steps)
        peak_fall = None
        if self._peak is not None and self._peak > start:
            peak_fall = max(delta, self.peak_gain_frac * (self._peak - start))
            self._evidence["peak"] = _cusum(self._evidence["peak"], self._peak - value, peak_fall, s2,
                                            cap=self.warn_evidence / self.peak_steps)
        if not self._start_done:
            if self._evidence["start"] >= self.warn_evidence:
                self._start_done = True  # a fall among the first values: judge against the ones before it
            else:
                self._start.append(value)
                self._start_var.append(variance)
                self._start_done = len(self._start) >= self.start_points
        self._update_peak(history, step)
        return self._finding(history, value, start, delta, peak_fall, s2)

    def _finding(self, history: MetricHistory, value: float, start: float, delta: float, peak_fall: float | None,
                 s2: float) -> list[Finding]:
        by_start, by_peak = self._evidence["start"], self._evidence["peak"] if peak_fall is not None else 0.0
        if max(by_start, by_peak) < self.warn_evidence:
            return []
        recent = float(np.mean(history.values(self.metric, self.recent)))
        if by_start >= by_peak:
            reference, fall, evidence, against = start, delta, by_start, "its start"
        else:
            assert self._peak is not None and peak_fall is not None
            reference, fall, evidence, against = self._peak, peak_fall, by_peak, f"its peak (step {self._peak_step})"
        values = {"current": value, "recent": recent, "start": start, "reference": reference, "fall": fall,
                  "evidence": evidence, "sigma": math.sqrt(s2),
                  "peak": self._peak if self._peak is not None else math.nan}
        what = (
            f"{self.metric} {fmt_number(value)} (last {self.recent}: {fmt_number(recent)}) is "
            f"{fmt_number(reference - recent)} below {against} {fmt_number(reference)}: a fall of {fmt_number(fall)} "
            f"is e^{evidence:.1f} times likelier than none at its standard error {fmt_number(math.sqrt(s2))}"
        )
        if by_start >= self.collapse_evidence and recent <= start - delta:
            where = f"below its start {fmt_number(start)} by {fmt_number(start - recent)}"
            return [Finding(self.name, self.metric, HealthState.COLLAPSING, f"{what}; {where}", values)]
        gain = self._peak - start if self._peak is not None else 0.0
        held = float(np.mean(history.values(self.metric, self.peak_window)))  # a loss that lasts, not one batch
        if by_peak >= self.collapse_evidence and self._peak is not None and self._peak - held >= self.collapse_gain_frac * gain:
            where = f"{(self._peak - held) / gain:.0%} of the gain since the start gone over the last {self.peak_window}"
            return [Finding(self.name, self.metric, HealthState.COLLAPSING, f"{what}; {where}", values)]
        return [Finding(self.name, self.metric, HealthState.WARNING, what, values)]

    def _update_peak(self, history: MetricHistory, step: int) -> None:
        """Raise the peak to the latest ``peak_window``-point mean less two of its standard errors."""
        if not self._start_done or history.count(self.metric) < self.peak_window + len(self._start):
            return
        window = history.values(self.metric, self.peak_window)
        se = math.sqrt(float(np.sum(self._recent_var)) + self.noise_floor**2) / self.peak_window
        level = float(window.mean()) - 2.0 * se
        if self._peak is None or level > self._peak:
            self._peak, self._peak_step = level, step

    def state_dict(self) -> dict[str, Any]:
        return {"start": list(self._start), "start_var": list(self._start_var), "start_done": self._start_done,
                "peak": self._peak, "peak_step": self._peak_step, "evidence": dict(self._evidence),
                "evidence_before": dict(self._evidence_before), "last_step": self._last_step,
                "recent_var": list(self._recent_var)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._reset()
        self._start = [float(v) for v in state.get("start", [])]
        self._start_var = [float(v) for v in state.get("start_var", [])]
        self._start_done = bool(state.get("start_done", False))
        self._peak = state.get("peak")
        self._peak_step = state.get("peak_step")
        self._evidence = {k: float(v) for k, v in state.get("evidence", self._evidence).items()}
        self._evidence_before = {k: float(v) for k, v in state.get("evidence_before", self._evidence).items()}
        self._last_step = state.get("last_step")
        self._recent_var = [float(v) for v in state.get("recent_var", [])]


def _cusum(evidence: float, shortfall: float, fall: float, variance: float, cap: float = math.inf) -> float:
    """One step of Page's CUSUM for a Gaussian mean falling by ``fall``: the log-likelihood ratio
    increment ``fall / variance * (shortfall - fall / 2)``, the shortfall capped at ``fall`` and
    the increment at ``cap``."""
    return max(0.0, evidence + min(cap, fall / variance * (min(shortfall, fall) - fall / 2.0)))


DEFF_STEPS = 100
"""``reward.dead``: the design effect is the median over this many recent rewarded steps."""


class RewardDeadRule(Rule):
    """No rollout earns any reward for ``dead_steps`` steps after some did, where chance cannot
    explain it -> ``collapsing``.

    With every reward zero, every GRPO advantage is zero: the run has stopped learning (a
    measured agentic run with compressed cuts completed no task from step 6 on). ``dead_steps=3``
    steps so a single unlucky batch does not count; ``eps`` is the "zero" tolerance.

    A run that earns little loses whole batches by chance: at a mean reward of 0.04 with 32
    completions a step, a batch earns nothing a quarter of the time (a real SmolLM2 run did so
    three steps in a row, then learned). When the trainer logs ``reward/count`` the zero steps
    must also be unlikely at the level the run had: ``(1 - p)^(n / deff) < max_chance``, with
    ``p`` the mean reward of the earlier steps, ``n`` the completions of the zero steps and
    ``deff`` the design effect of the groups (``sem^2 count / (p (1 - p))``, the median over the
    last 100 earlier steps that log ``reward/sem``; 1 without). ``max_chance=1e-3``. A trainer that logs
    no count gets the plain rule.
    """

    name = "reward.dead"

    def __init__(self, metric: str = "reward/mean", dead_steps: int = 3, eps: float = 1e-9,
                 count_metric: str | None = "reward/count", sem_metric: str | None = "reward/sem",
                 max_chance: float = 1e-3) -> None:
        self.metric = metric
        self.dead_steps = dead_steps
        self.eps = eps
        self.count_metric = count_metric
        self.sem_metric = sem_metric
        self.max_chance = max_chance
        self.inputs = tuple(m for m in (metric, count_metric, sem_metric) if m)
        self._seen_reward = False
        self._earned = [0.0, 0.0]  # sum and count of the mean rewards of the steps before the current zero run
        self._deff: list[float] = []  # the design effect of the last DEFF_STEPS steps that logged their error
        self._dead_counts: list[float] = []  # completions of the current run of zero steps

    def check(self, history: MetricHistory, step: int) -> list[Finding]:
        latest = history.latest(self.metric)
        if latest is None:
            return []
        update = history.last_update
        count = update.get(self.count_metric) if self.count_metric else None
        if latest > self.eps:
            self._seen_reward = True
            self._earned = [self._earned[0] + latest, self._earned[1] + len(self._dead_counts) + 1]
            self._dead_counts = []
            sem = update.get(self.sem_metric) if self.sem_metric else None
            if count and sem is not None and math.isfinite(sem) and 0.0 < latest < 1.0:
                deff = max(1.0, sem * sem * count / (latest * (1.0 - latest)))
                self._deff = [*self._deff, deff][-DEFF_STEPS:]
            return []
        self._dead_counts.append(float(count) if count else math.nan)
        recent = history.values(self.metric, self.dead_steps)
        if not self._seen_reward or recent.size < self.dead_steps or np.any(recent > self.eps):
            return []
        dead = self._dead_counts[-self.dead_steps:]
        chance = None
        level = self._earned[0] / self._earned[1] if self._earned[1] else math.nan
        if all(math.isfinite(n) for n in dead) and math.isfinite(level):
            deff = float(np.median(self._deff)) if self._deff else 1.0
            chance = math.exp(sum(dead) / deff * math.log1p(-min(level, 1.0 - 1e-12)))
            if chance >= self.max_chance:
                return []
        msg = f"{self.metric} has been 0 for {self.dead_steps} steps after earlier rewards: no learning signal left"
        if chance is not None:
            msg += f" (chance {chance:.1e} at the earlier mean reward {fmt_number(level)})"
        return [Finding(self.name, self.metric, HealthState.COLLAPSING, msg,
                        {"dead_steps": float(self.dead_steps), "chance": chance if chance is not None else math.nan})]

    def state_dict(self) -> dict[str, Any]:
        return {"seen_reward": self._seen_reward, "earned": list(self._earned), "deff": list(self._deff),
                "dead_counts": list(self._dead_counts)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._seen_reward = bool(state.get("seen_reward", False))
        self._earned = [float(v) for v in state.get("earned", [0.0, 0.0])]
        self._deff = [float(v) for v in state.get("deff", [])]
        self._dead_counts = [float(v) for v in state.get("dead_counts", [])]


class EntropyRule(Rule):
    """Policy entropy collapsing towards zero or exploding, relative to its start.

    ``ratio = median(last window) / median(first baseline_points)`` of ``policy/entropy``.

    * ``entropy.collapse``: warning at ``ratio <= low_warn`` (0.2), collapsing at ``ratio <=
      low_collapse`` (0.05), unless the reward paid for it: a policy that became deterministic
      while ``reward/mean`` rose by ``reward_rise_z`` standard errors (median of the last window
      against the first ``baseline_points``) has learned the task, not lost its exploration.
      On the library of real runs the healthy dense runs' entropy falls 10- to 20-fold over
      1000 steps as their reward goes from 0.35 to 0.9; without a reward gain a twenty-fold fall
      means the policy answers the same way every time, and GRPO's groups stop having any
      variance to learn from.
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
        reward_metric: str = "reward/mean",
        reward_rise_z: float = 2.0,
    ) -> None:
        self.metric = metric
        self.reward_metric = reward_metric
        self.reward_rise_z = reward_rise_z
        self.window = window
        self.baseline_points = baseline_points
        self.low_warn = low_warn
        self.low_collapse = low_collapse
        self.high_warn = high_warn
        self.high_collapse = high_collapse
        self.inputs = (metric, reward_metric)

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
        if ratio <= self.low_warn and not self._reward_paid(history):
            sev = HealthState.COLLAPSING if ratio <= self.low_collapse else HealthState.WARNING
            return [Finding("entropy.collapse", self.metric, sev, f"{what}: the policy is becoming deterministic", values)]
        if ratio >= self.high_warn:
            sev = HealthState.COLLAPSING if ratio >= self.high_collapse else HealthState.WARNING
            return [Finding("entropy.explosion", self.metric, sev, f"{what}: generations are degenerating", values)]
        return []

    def _reward_paid(self, history: MetricHistory) -> bool:
        """Whether the reward's recent median is ``reward_rise_z`` standard errors above its start's."""
        if history.count(self.reward_metric) < self.baseline_points + self.window:
            return False
        start = history.head(self.reward_metric, self.baseline_points)
        recent = history.values(self.reward_metric, self.window)
        noise = step_noise(history.values(self.reward_metric, 100))
        se = 1.2533 * noise * math.sqrt(1.0 / start.size + 1.0 / recent.size)  # of a difference of medians
        return float(np.median(recent) - np.median(start)) >= self.reward_rise_z * max(se, 1e-12)


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
