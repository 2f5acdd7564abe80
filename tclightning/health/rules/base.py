"""The vocabulary every health rule shares: :class:`HealthState`, :class:`Finding`, :class:`Rule`.

No Lightning import (the callbacks and ``tclightning analyze health`` both use these).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from tclightning.health.history import MetricHistory


class HealthState(IntEnum):
    """The verdict, logged as the scalar ``health/state``: 0 healthy, 1 warning, 2 collapsing.

    A finding at ``HEALTHY`` severity is *information* (label ``info``): reported in the timeline,
    ``analyze health`` and TensorBoard text, never a warning state (e.g. a rising gap, which on
    the library of real runs came before no collapse).
    """

    HEALTHY = 0
    WARNING = 1
    COLLAPSING = 2

    @property
    def label(self) -> str:
        return self.name.lower()


INFO = "info"
"""The label of a finding at ``HEALTHY`` severity: information that does not change the state."""


def severity_label(severity: HealthState) -> str:
    """How a finding's severity is printed: ``info``, ``warning`` or ``collapsing``."""
    return INFO if severity == HealthState.HEALTHY else severity.label


def parse_severity(label: str) -> HealthState:
    """Inverse of :func:`severity_label` (``healthy`` also reads as ``HEALTHY``)."""
    return HealthState.HEALTHY if label == INFO else HealthState[label.upper()]


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


def fmt_number(x: float) -> str:
    """A number as rule messages print it: 4 significant digits, 3 in scientific notation when
    very large or small, and ``nan``/``inf`` as themselves."""
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
