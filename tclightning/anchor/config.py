"""Anchor circuit section of a recipe: each key with its range and help (:func:`tclightning.settings.setting`)."""

from __future__ import annotations

from dataclasses import dataclass

from tclightning.anchor.circuit import WARMUPS
from tclightning.anchor.mergers import MERGERS
from tclightning.anchor.placement import PLACEMENTS
from tclightning.anchor.projectors import PROJECTORS
from tclightning.settings import integer, number, one_of, positive, setting, share


@dataclass
class AnchorConfig:
    """The dense, late anchor gradient ``M`` and how it is merged into the fast circuit's ``G_comp``.

    ``merger``: ``none`` (the fast circuit alone; with the ``dense`` layout, the dense control),
    ``signed_ema`` (the sign(M) anchor: ``M_bar <- beta M_bar + (1 - beta) M`` when an ``M``
    arrives, then per coordinate ``G = alpha G_comp + (1 - alpha) |G_comp| sign(M_hat)``, ``M_hat``
    = projector(``M_bar``)), or the correcting ``control_variate`` (``G = G_comp + cv_weight *
    (M - G_hat)``, ``G_hat`` the fast circuit at the anchor's snapshot; formulas in
    :mod:`tclightning.anchor.mergers`). ``placement``: where ``M`` is computed across processes
    (:mod:`tclightning.anchor.placement`; one process has one place). ``latency`` K and
    ``cadence`` C are in optimizer ticks ("5/5" = K=5, C=5). See docs/anchor.md.
    """

    merger: str = setting("none", one_of(MERGERS), " | ".join(MERGERS))
    alpha: float = setting(0.25, share(), "correction weight (stable in the original experiments, docs/anchor.md)")
    beta: float = setting(0.0, number(0.0, 1.0, high_open=True), "anchor memory (0 = freshest)")
    latency: int = setting(5, integer(0), "K: ticks between the snapshot and the delivery of its M")
    cadence: int = setting(5, positive(), "C: ticks between anchor snapshots")
    projector: str = setting("none", one_of(PROJECTORS),
                             f"{' | '.join(PROJECTORS)} (staleness repair of M_bar)")
    projector_gamma: float = setting(0.5, number(0.0), "damping of damped_linear / rank1")
    projector_window: int = setting(8, integer(2), "rank1: weight snapshots kept for the trajectory direction")
    warmup: str = setting("none", one_of(WARMUPS),
                          "none | la_warmup (LA-WARMUP-V2: K/C start at 1/1 and step up geometrically, 1, 2, 4, ... K)")
    warmup_ticks: int = setting(100, integer(0), "la_warmup: the final K/C is in force from this tick on")
    cv_weight: float = setting(1.0, number(0.0), "control_variate: weight of the compression-bias correction")
    cv_clip: float = setting(1.0, number(0.0),
                             "control_variate: correction norm <= cv_clip * ||G_comp|| (0 = no bound)")
    placement: str = setting("pipeline", one_of(PLACEMENTS),
                             "pipeline (each stage's M from a dense pipelined pass: d per token crosses every cut) | "
                             "sampler (across processes: the sampling rank computes M on its whole copy and sends "
                             "each stage only sign(M_bar), 1 bit a coordinate; signed_ema with projector none)")


RETIRED_KEYS = ("mask_kappa", "trust_floor", "warmup_shape", "warmup_stages")
"""Keys of the ``anchor`` section an earlier version saved that no option reads now: a run's record or
a checkpoint that holds them is read without them. ``mask_kappa`` and ``trust_floor`` were read only by
the retired ``masked`` and ``trust`` mergers; ``warmup_shape`` / ``warmup_stages`` chose la_warmup's
never-measured ``linear`` ramp (``geometric``, the one LA-WARMUP-V2 ran, is the ramp now)."""
