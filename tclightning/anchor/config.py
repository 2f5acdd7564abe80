"""Anchor circuit section of a recipe."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AnchorConfig:
    """The dense, late anchor gradient ``M`` and how it is merged into the fast circuit's ``G_comp``.

    ``merger``: ``none`` (the fast circuit alone), ``signed_ema`` (the sign(M) anchor:
    ``M_bar <- beta M_bar + (1 - beta) M`` when an ``M`` arrives, then per coordinate
    ``G = alpha G_comp + (1 - alpha) |G_comp| sign(M_hat)``, ``M_hat`` = projector(``M_bar``)), or
    ``dense`` (the control: the trainer itself is dense, nothing to merge); the correcting
    mergers ``control_variate`` (``G = G_comp + cv_weight * (M - G_hat)``, ``G_hat`` the fast
    circuit at the anchor's snapshot), ``masked`` and ``trust`` (formulas in
    :mod:`tclightning.anchor.mergers`). ``latency`` K and
    ``cadence`` C are in optimizer ticks ("5/5" = K=5, C=5). See docs/anchor.md.
    """

    merger: str = "none"  # none | signed_ema | dense | control_variate | masked | trust
    alpha: float = 0.25  # correction weight (stable in the original experiments, docs/anchor.md)
    beta: float = 0.0  # anchor memory (0 = freshest)
    latency: int = 5  # K: ticks between the snapshot and the delivery of its M
    cadence: int = 5  # C: ticks between anchor snapshots
    projector: str = "none"  # none | damped_linear | rank1 (staleness repair of M_bar)
    projector_gamma: float = 0.5  # damping of damped_linear / rank1
    projector_window: int = 8  # rank1: weight snapshots kept for the trajectory direction
    warmup: str = "none"  # none | la_warmup (LA-WARMUP-V2: K/C start at 1/1 and step up)
    warmup_ticks: int = 100  # la_warmup: the final K/C is in force from this tick on
    warmup_shape: str = "geometric"  # la_warmup: geometric (1, 2, 4, ... K) | linear
    warmup_stages: int = 5  # la_warmup, linear shape: number of latency stages
    cv_weight: float = 1.0  # control_variate: weight of the compression-bias correction
    cv_clip: float = 1.0  # control_variate: correction norm <= cv_clip * ||G_comp|| (0 = no bound)
    mask_kappa: float = 1.0  # masked: confident where |M_bar| >= kappa * rms(M_bar) of its tensor
    trust_floor: float = 0.5  # trust: consecutive-anchor agreement at which the trust is 0
