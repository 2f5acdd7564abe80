"""Collapse detection as pure logic (no Lightning): rules, the detector, synthetic traces, readers.

``HealthDetector().update(step, metrics)`` returns a :class:`Verdict` (``healthy`` / ``warning``
/ ``collapsing`` with reasons). The callbacks in :mod:`tclightning.callbacks` and
``tclightning analyze health`` are thin layers over it. See ``docs/health.md``.
"""

from tclightning.health.detector import (
    HealthDetector,
    HealthEvent,
    ReplayResult,
    Verdict,
    replay,
)
from tclightning.health.history import MetricHistory
from tclightning.health.names import PRESETS, resolve_metric_names, set_metric_names
from tclightning.health.rules import (
    EntropyRule,
    Finding,
    GapLevelRule,
    GapTrendRule,
    GradNormSpikeRule,
    HealthState,
    LengthDriftRule,
    LengthFeedbackRule,
    LengthGapCouplingRule,
    NonFiniteRule,
    RewardDeadRule,
    RewardDropRule,
    Rule,
    TruncationRule,
    default_rules,
    gap_rules,
    length_rules,
    outcome_rules,
)

__all__ = [
    "EntropyRule",
    "Finding",
    "GapLevelRule",
    "GapTrendRule",
    "GradNormSpikeRule",
    "HealthDetector",
    "HealthEvent",
    "HealthState",
    "LengthDriftRule",
    "LengthFeedbackRule",
    "LengthGapCouplingRule",
    "MetricHistory",
    "NonFiniteRule",
    "PRESETS",
    "ReplayResult",
    "RewardDeadRule",
    "RewardDropRule",
    "Rule",
    "TruncationRule",
    "Verdict",
    "default_rules",
    "gap_rules",
    "length_rules",
    "outcome_rules",
    "replay",
    "resolve_metric_names",
    "set_metric_names",
]
