"""``LengthFeedbackMonitor``: response length growing against reward, truncation, length-gap coupling."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tclightning.callbacks.health_actions import HealthMonitor
from tclightning.health.rules import (
    LengthDriftRule,
    LengthFeedbackRule,
    LengthGapCouplingRule,
    NonFiniteRule,
    Rule,
    TruncationRule,
)


class LengthFeedbackMonitor(HealthMonitor):
    """Sees the hub's length feedback loop coming (16k collapse, stale-anchor ratchet).

    Reads ``response/length_mean``, ``response/length_max``, ``response/truncated_frac``,
    ``reward/mean`` (``val/accuracy`` as fallback) and ``gap/abs_mean``; logs ``health/length``.
    Rules: :class:`~tclightning.health.rules.LengthFeedbackRule` (``window``, ``growth_warn``),
    :class:`~tclightning.health.rules.LengthDriftRule` (``drift_growth_warn``),
    :class:`~tclightning.health.rules.TruncationRule` (``truncation_rise_warn``,
    ``truncation_collapse``), :class:`~tclightning.health.rules.LengthGapCouplingRule`, and NaN/Inf
    in the length metrics. Threshold reasons are in those rules' docstrings; ``rules`` replaces
    the whole set. Other arguments: :class:`~tclightning.callbacks.health_actions.HealthMonitor`.
    """

    def __init__(
        self,
        window: int = 20,
        growth_warn: float = 0.12,
        drift_growth_warn: float = 0.2,
        truncation_rise_warn: float = 0.05,
        truncation_collapse: float = 0.5,
        rules: Sequence[Rule] | None = None,
        name: str = "length",
        **kwargs: Any,
    ) -> None:
        if rules is None:
            rules = [
                NonFiniteRule(["response/length_mean", "response/length_max", "response/truncated_frac"]),
                LengthFeedbackRule(window=window, growth_warn=growth_warn),
                LengthDriftRule(growth_warn=drift_growth_warn),
                TruncationRule(rise_warn=truncation_rise_warn, level_collapse=truncation_collapse),
                LengthGapCouplingRule(window=window),
            ]
        super().__init__(rules=rules, name=name, **kwargs)
