"""GRPO: config, advantages, loss (surrogate, KL, TIS/masking, the gap), prompt stream, the one
update loop (``update.py``, through a :class:`~tclightning.backend.Backend`) and the
LightningModule. The math modules are pure functions; ``module.py`` is the Lightning glue."""

from __future__ import annotations

from tclightning._lazy import lazy_attributes

_EXPORTS = {
    "GRPOConfig": "tclightning.grpo.config",
    "GRPOModule": "tclightning.grpo.module",
    "group_advantages": "tclightning.grpo.advantages",
    "policy_loss": "tclightning.grpo.loss",
    "gap_metrics": "tclightning.grpo.loss",
    "grpo_update": "tclightning.grpo.update",
    "MicrobatchLoss": "tclightning.grpo.update",
}

__getattr__ = lazy_attributes(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
