"""Health rules: each looks at a :class:`MetricHistory` and says what it sees, with numbers.

A rule is a small object with a ``name``, the canonical metrics it reads (``inputs``), the ones
whose arrival makes it look again (``triggers``) and ``check(history, step) -> [Finding]``.
Thresholds are constructor parameters; each default carries the reason for its value in the
docstring. No Lightning import: :class:`~tclightning.health.detector.HealthDetector` strings the
rules together, and the callbacks and ``tclightning analyze health`` share it.

One module per family, each with the function that builds it from a monitor's thresholds:

* :mod:`~tclightning.health.rules.length`: :func:`length_rules` (length vs reward, slow
  ratchet, truncation, length-gap coupling);
* :mod:`~tclightning.health.rules.gap`: :func:`gap_rules` (gap level above a band, gap trend);
* :mod:`~tclightning.health.rules.outcome`: :func:`outcome_rules` (reward and accuracy drop,
  dead reward, entropy, grad-norm spikes, NaN/Inf);
* :mod:`~tclightning.health.rules.nonfinite` (the NaN/Inf rule) and
  :mod:`~tclightning.health.rules.base` (:class:`HealthState`, :class:`Finding`, :class:`Rule`).

The failure modes are three measured collapses of compressed-pipeline GRPO runs: a length
feedback loop at 16k-token generation length, a length ratchet driven by a stale anchor
gradient (K=20), and an agentic run whose sampler-trainer gap was at full size before the first
update.
"""

from __future__ import annotations

from tclightning.health.history import MetricHistory
from tclightning.health.rules.base import Finding, HealthState, Rule
from tclightning.health.rules.gap import GAP_METRICS, GapLevelRule, GapTrendRule, gap_rules
from tclightning.health.rules.length import (
    LENGTH_METRICS,
    LengthDriftRule,
    LengthFeedbackRule,
    LengthGapCouplingRule,
    TruncationRule,
    length_rules,
)
from tclightning.health.rules.nonfinite import SKIP_METRICS, NonFiniteRule
from tclightning.health.rules.outcome import (
    EntropyRule,
    GradNormSpikeRule,
    RewardDeadRule,
    RewardDropRule,
    outcome_rules,
)


def default_rules() -> list[Rule]:
    """Every rule with its default thresholds (what :class:`CollapseDetector` uses): the outcome,
    length and gap families, in that order, each rule once."""
    return [*outcome_rules(), *length_rules(), *gap_rules()]


__all__ = [
    "GAP_METRICS",
    "LENGTH_METRICS",
    "SKIP_METRICS",
    "EntropyRule",
    "Finding",
    "GapLevelRule",
    "GapTrendRule",
    "GradNormSpikeRule",
    "HealthState",
    "LengthDriftRule",
    "LengthFeedbackRule",
    "LengthGapCouplingRule",
    "MetricHistory",
    "NonFiniteRule",
    "RewardDeadRule",
    "RewardDropRule",
    "Rule",
    "TruncationRule",
    "default_rules",
    "gap_rules",
    "length_rules",
    "outcome_rules",
]
