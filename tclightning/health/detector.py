"""The health detector: feed it ``(step, metrics)``, get a verdict with reasons.

Pure Python + numpy. Each rule's firing opens an *episode* (keyed ``rule:metric``); an episode
stays open while the rule keeps firing and closes after the rule has been checked
``clear_after`` times in a row without firing (hysteresis, so a noisy metric does not flap).
The state is the worst severity among open episodes. An *event* is recorded when an episode
opens (``fired``), escalates to collapsing (``escalated``), closes (``cleared``), and when the
whole state returns to healthy (``recovered``) -- that list is the timeline ``analyze health``
prints and the once-per-episode console warnings come from.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from tclightning.health.history import MetricHistory
from tclightning.health.rules import Finding, HealthState, Rule, default_rules
from tclightning.health.rules.base import severity_label


@dataclass(frozen=True)
class HealthEvent:
    """One line of the timeline. ``kind`` is fired | escalated | cleared | recovered; ``severity``
    is info | warning | collapsing (healthy for cleared and recovered)."""

    step: int
    kind: str
    rule: str
    metric: str
    severity: str
    state: str
    message: str
    values: Mapping[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        # JSON has no NaN/Inf: a non-finite number (the value a NaN finding reports) becomes null
        d["values"] = {k: (float(v) if v is not None and math.isfinite(v) else None) for k, v in self.values.items()}
        return d


@dataclass(frozen=True)
class Verdict:
    """The detector's answer for one update.

    ``state``: worst severity of the open episodes; ``findings``: the latest finding of every open
    episode (worst first); ``events``: what changed in this update.
    """

    step: int
    state: HealthState
    findings: tuple[Finding, ...]
    events: tuple[HealthEvent, ...]

    @property
    def reasons(self) -> str:
        """One line per open episode: ``[severity] rule: message``."""
        return "\n".join(f"[{severity_label(f.severity)}] {f.rule}: {f.message}" for f in self.findings)

    def state_ignoring(self, rules: Iterable[str]) -> HealthState:
        """The state computed without findings from ``rules`` (e.g. a tolerated standing gap)."""
        skip = set(rules)
        return max((f.severity for f in self.findings if f.rule not in skip), default=HealthState.HEALTHY)


@dataclass
class _Episode:
    finding: Finding
    start: int
    owner: int
    quiet: int = 0
    worst: HealthState = HealthState.HEALTHY


class HealthDetector:
    """Runs the rules on each update and keeps episodes, events and the first warning/collapse steps.

    ``update(step, metrics)`` may be called more than once for the same step (train metrics,
    then validation metrics); a rule runs only when one of its ``triggers`` is in the update (or
    always, for a rule without triggers).

    Args:
        rules: the rules to run (default: :func:`~tclightning.health.rules.default_rules`).
        clear_after: checks in a row without firing before an episode closes. 5 keeps one quiet
            batch from ending an episode (and re-warning at the next noisy one).
        max_points: how many recent points of each metric to keep (older ones are dropped; the
            first points are kept for baselines).
        max_events: how many timeline events to keep in memory and in checkpoints.
    """

    def __init__(
        self,
        rules: Sequence[Rule] | None = None,
        clear_after: int = 5,
        max_points: int = 512,
        max_events: int = 1000,
    ) -> None:
        self.rules: list[Rule] = list(rules) if rules is not None else default_rules()
        self.clear_after = clear_after
        self.max_events = max_events
        self.history = MetricHistory(max_points=max_points)
        self.events: list[HealthEvent] = []
        self.first_warning_step: int | None = None
        self.first_collapse_step: int | None = None
        self._episodes: dict[str, _Episode] = {}
        self._state = HealthState.HEALTHY
        self._step: int | None = None

    @property
    def state(self) -> HealthState:
        return self._state

    @property
    def findings(self) -> tuple[Finding, ...]:
        """The latest finding of every open episode, worst first."""
        eps = sorted(self._episodes.values(), key=lambda e: (-int(e.finding.severity), e.start))
        return tuple(e.finding for e in eps)

    def verdict(self) -> Verdict:
        """The current verdict without feeding anything."""
        return Verdict(self._step if self._step is not None else -1, self._state, self.findings, ())

    def metrics_read(self) -> set[str]:
        """The canonical metrics the rules read (the non-finite rule's counters included; that rule
        also looks at every other metric, but only for NaN/Inf)."""
        from tclightning.health.rules import NonFiniteRule

        reads: set[str] = set()
        for rule in self.rules:
            reads.update(rule.inputs)
            if isinstance(rule, NonFiniteRule):
                reads.update((*rule.skip_metrics, rule.skipped_step))
        return reads

    def update(self, step: int, metrics: Mapping[str, float]) -> Verdict:
        """Feed one update and return the verdict (see the class docstring)."""
        step = int(step)
        self._step = step
        self.history.add(step, metrics)
        names = set(metrics)
        new_events: list[HealthEvent] = []
        for owner, rule in enumerate(self.rules):
            triggers = rule.triggers
            if triggers and not names.intersection(triggers):
                continue
            fired = {f.key: f for f in rule.check(self.history, step)}
            for key, finding in fired.items():
                episode = self._episodes.get(key)
                if episode is None:
                    self._episodes[key] = _Episode(finding, step, owner, worst=finding.severity)
                    new_events.append(self._event(step, "fired", finding))
                    continue
                if finding.severity > episode.worst:
                    episode.worst = finding.severity
                    new_events.append(self._event(step, "escalated", finding))
                episode.finding, episode.quiet = finding, 0
            for key, episode in list(self._episodes.items()):
                if episode.owner != owner or key in fired:
                    continue
                episode.quiet += 1
                if episode.quiet >= self.clear_after:
                    del self._episodes[key]
                    last = episode.finding
                    quiet = Finding(last.rule, last.metric, HealthState.HEALTHY,
                                    f"quiet for {episode.quiet} checks (fired at step {episode.start})", last.values)
                    new_events.append(self._event(step, "cleared", quiet))
        previous = self._state
        self._state = max((e.finding.severity for e in self._episodes.values()), default=HealthState.HEALTHY)
        if self._state >= HealthState.WARNING and self.first_warning_step is None:
            self.first_warning_step = step
        if self._state >= HealthState.COLLAPSING and self.first_collapse_step is None:
            self.first_collapse_step = step
        # events carry the state after this update
        new_events = [HealthEvent(**{**e.to_dict(), "state": self._state.label}) for e in new_events]
        if previous > HealthState.HEALTHY and self._state == HealthState.HEALTHY:
            new_events.append(HealthEvent(step, "recovered", "detector", "", "healthy", "healthy", "all rules quiet again"))
        self.events.extend(new_events)
        if len(self.events) > self.max_events:
            del self.events[: len(self.events) - self.max_events]
        return Verdict(step, self._state, self.findings, tuple(new_events))

    def _event(self, step: int, kind: str, finding: Finding) -> HealthEvent:
        label = finding.severity.label if kind == "cleared" else severity_label(finding.severity)
        return HealthEvent(step, kind, finding.rule, finding.metric, label, "", finding.message, dict(finding.values))

    def summary(self) -> dict[str, Any]:
        """``{"first_warning_step", "first_collapse_step", "events"}`` (the ``--json`` output)."""
        return {
            "first_warning_step": self.first_warning_step,
            "first_collapse_step": self.first_collapse_step,
            "events": [e.to_dict() for e in self.events],
        }

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly where the detector was (plain Python types)."""
        return {
            "history": self.history.state_dict(),
            "rules": [rule.state_dict() for rule in self.rules],
            "rule_names": [type(rule).__name__ for rule in self.rules],
            "episodes": {
                key: {"finding": _finding_to_dict(ep.finding), "start": ep.start, "owner": ep.owner, "quiet": ep.quiet,
                      "worst": int(ep.worst)}
                for key, ep in self._episodes.items()
            },
            "events": [e.to_dict() for e in self.events],
            "first_warning_step": self.first_warning_step,
            "first_collapse_step": self.first_collapse_step,
            "state": int(self._state),
            "step": self._step,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Inverse of :meth:`state_dict`. The rule list must match the one that saved it."""
        names = [type(rule).__name__ for rule in self.rules]
        if list(state.get("rule_names", names)) != names:
            raise ValueError(f"detector state was saved with rules {state.get('rule_names')}, this detector has {names}")
        self.history.load_state_dict(state["history"])
        for rule, rule_state in zip(self.rules, state["rules"]):
            rule.load_state_dict(rule_state)
        self._episodes = {
            key: _Episode(_finding_from_dict(ep["finding"]), int(ep["start"]), int(ep["owner"]), int(ep["quiet"]),
                          HealthState(int(ep["worst"])))
            for key, ep in state["episodes"].items()
        }
        self.events = [HealthEvent(**e) for e in state["events"]]
        self.first_warning_step = state["first_warning_step"]
        self.first_collapse_step = state["first_collapse_step"]
        self._state = HealthState(int(state["state"]))
        self._step = state.get("step")


def _finding_to_dict(f: Finding) -> dict[str, Any]:
    return {"rule": f.rule, "metric": f.metric, "severity": int(f.severity), "message": f.message,
            "values": {k: float(v) for k, v in f.values.items()}}


def _finding_from_dict(d: Mapping[str, Any]) -> Finding:
    return Finding(d["rule"], d["metric"], HealthState(int(d["severity"])), d["message"], dict(d["values"]))


@dataclass(frozen=True)
class ReplayResult:
    """What :func:`replay` returns: the verdict per step plus the detector's summary."""

    verdicts: tuple[Verdict, ...]
    first_warning_step: int | None
    first_collapse_step: int | None
    events: tuple[HealthEvent, ...]

    def summary(self) -> dict[str, Any]:
        return {
            "first_warning_step": self.first_warning_step,
            "first_collapse_step": self.first_collapse_step,
            "events": [e.to_dict() for e in self.events],
        }


def replay(rows: Iterable[tuple[int, Mapping[str, float]]], detector: HealthDetector | None = None) -> ReplayResult:
    """Feed ``(step, metrics)`` rows in order to ``detector`` (default rules) and collect the verdicts."""
    detector = detector if detector is not None else HealthDetector()
    verdicts = [detector.update(step, metrics) for step, metrics in rows]
    return ReplayResult(tuple(verdicts), detector.first_warning_step, detector.first_collapse_step, tuple(detector.events))
