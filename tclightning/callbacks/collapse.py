"""``CollapseDetector``: every health rule, with the actions that stop or undo a collapse."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tclightning.callbacks.health_actions import HealthMonitor
from tclightning.health.rules import Rule, default_rules


class CollapseDetector(HealthMonitor):
    """Watches every known collapse precursor (docs/health.md) and acts on it.

    Rules (default :func:`~tclightning.health.rules.default_rules`): NaN/Inf anywhere; reward and
    held-out accuracy falling from their peak beyond their noise; reward dead; entropy collapse or
    explosion; grad-norm spikes; the length family (length vs reward, slow ratchet, truncation,
    length-gap coupling); the gap family (level above band, rising trend). Logs ``health/collapse``
    and ``health/state``.

    The defaults only log and warn; ``actions=["log", "warn", "rollback"]`` (the
    ``callbacks/collapse-guard.yaml`` preset) keeps a last-healthy checkpoint every
    ``checkpoint_every`` steps and rolls back to it at ``collapsing``. Every other argument is
    :class:`~tclightning.callbacks.health_actions.HealthMonitor`'s.
    """

    def __init__(self, rules: Sequence[Rule] | None = None, name: str = "collapse", **kwargs: Any) -> None:
        super().__init__(rules=list(rules) if rules is not None else default_rules(), name=name, **kwargs)
