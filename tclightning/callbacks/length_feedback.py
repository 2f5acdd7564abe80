"""``LengthFeedbackMonitor``: response length growing against reward, truncation, length-gap coupling."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tclightning.callbacks.health_actions import HealthMonitor
from tclightning.health.rules import Rule, length_rules
from tclightning.settings import check_arguments, number, positive


class LengthFeedbackMonitor(HealthMonitor):
    """Sees a length feedback loop coming (a runaway at long generation length, a stale-anchor ratchet).

    Reads ``response/length_mean``, ``response/length_max``, ``response/truncated_frac``,
    ``reward/mean`` (``val/accuracy`` as fallback) and ``gap/abs_mean``; logs ``health/length``.
    Rules: the length family, :func:`~tclightning.health.rules.length_rules` with
    ``nonfinite=True``: :class:`~tclightning.health.rules.LengthFeedbackRule` (``window``,
    ``growth_warn``), :class:`~tclightning.health.rules.LengthDriftRule` (``drift_growth_warn``),
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
        truncation_rise_warn: float = 0.1,
        truncation_collapse: float = 0.5,
        rules: Sequence[Rule] | None = None,
        name: str = "length",
        **kwargs: Any,
    ) -> None:
        check_arguments(type(self).__name__, {
            "window": (window, positive()),
            "growth_warn": (growth_warn, number(0.0, low_open=True)),
            "drift_growth_warn": (drift_growth_warn, number(0.0, low_open=True)),
            "truncation_rise_warn": (truncation_rise_warn, number(0.0, 1.0, low_open=True)),
            "truncation_collapse": (truncation_collapse, number(0.0, 1.0, low_open=True)),
        })
        if rules is None:
            rules = length_rules(
                window, growth_warn, drift_growth_warn, truncation_rise_warn, truncation_collapse, nonfinite=True
            )
        super().__init__(rules=rules, name=name, **kwargs)
