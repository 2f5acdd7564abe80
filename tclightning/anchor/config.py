"""Anchor circuit section of a recipe (the circuit itself lands with the two-circuit issue)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AnchorConfig:
    """The dense, late anchor gradient ``M`` and how it is merged into the fast circuit's.

    ``merger``: ``none`` (fast circuit alone) is the only value accepted until the anchor
    circuit exists; ``signed_ema`` computes ``G = alpha G_comp + (1 - alpha) |G_comp| sign(M_bar)``
    with ``M_bar <- beta M_bar + (1 - beta) M``. ``latency`` K and ``cadence`` C are in optimizer
    ticks ("5/5" = K=5, C=5).
    """

    merger: str = "none"  # none | signed_ema | dense
    alpha: float = 0.25
    beta: float = 0.0
    latency: int = 5
    cadence: int = 5
    projector: str = "none"  # none | damped_linear | rank1
