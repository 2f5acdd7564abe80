"""``GapMonitor``: the sampler-trainer gap's level and trend."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tclightning.callbacks.health_actions import HealthMonitor
from tclightning.health.rules import Rule, gap_rules
from tclightning.settings import check_arguments, number, positive


class GapMonitor(HealthMonitor):
    """Watches ``gap/abs_mean`` and ``gap/k3`` (the sampler-trainer gap, docs/metrics.md); logs ``health/gap``.

    Rules: the gap family, :func:`~tclightning.health.rules.gap_rules` with ``nonfinite=True,
    coupling=True``: :class:`~tclightning.health.rules.GapLevelRule` on ``gap/abs_mean``
    (``abs_mean_band``, 0.5 nats: a measured agentic run died at 0.61, dense engines sit at 0.006)
    and on ``gap/k3`` (``k3_band``, 0.2), which also gives the "full size before the first update"
    warning at the first step (a gap that crosses the band only later is information);
    :class:`~tclightning.health.rules.GapTrendRule` (``rise_warn``: +50% on the start, information);
    :class:`~tclightning.health.rules.LengthGapCouplingRule`; NaN/Inf in the gap metrics.
    ``rules`` replaces the whole set. Other arguments:
    :class:`~tclightning.callbacks.health_actions.HealthMonitor`.
    """

    def __init__(
        self,
        abs_mean_band: float = 0.5,
        k3_band: float = 0.2,
        rise_warn: float = 0.5,
        window: int = 20,
        rules: Sequence[Rule] | None = None,
        name: str = "gap",
        **kwargs: Any,
    ) -> None:
        check_arguments(type(self).__name__, {
            "abs_mean_band": (abs_mean_band, number(0.0, low_open=True)),
            "k3_band": (k3_band, number(0.0, low_open=True)),
            "rise_warn": (rise_warn, number(0.0, low_open=True)),
            "window": (window, positive()),
        })
        if rules is None:
            rules = gap_rules(abs_mean_band, k3_band, rise_warn, window, nonfinite=True, coupling=True)
        super().__init__(rules=rules, name=name, **kwargs)
