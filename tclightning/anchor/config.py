"""Anchor circuit section of a recipe: each key with its range and help (:func:`tclightning.settings.setting`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tclightning.anchor.mergers import MERGERS
from tclightning.anchor.placement import PLACEMENTS
from tclightning.anchor.projectors import PROJECTORS
from tclightning.settings import grouped, integer, moved_keys, number, one_of, options_of, positive, setting, share


@dataclass
class ProjectorOptions:
    """``anchor.projector_options``: how the projector repairs ``M_bar``'s staleness."""

    gamma: float = setting(0.5, number(0.0), "damping of damped_linear / rank1")
    window: int = setting(8, integer(2), "rank1: weight snapshots kept for the trajectory direction")


@dataclass
class ControlVariateOptions:
    """``anchor.control_variate``: the ``control_variate`` merger's correction."""

    weight: float = setting(1.0, number(0.0), "weight of the compression-bias correction")
    clip: float = setting(1.0, number(0.0), "correction norm <= clip * ||G_comp|| (0 = no bound)")


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
    projector_options: dict[str, Any] = grouped(ProjectorOptions, "the projector's options")
    warmup_ticks: int = setting(
        0, integer(0),
        "la_warmup (LA-WARMUP-V2): K/C start at 1/1 and step up geometrically (1, 2, 4, ... K), the final K/C in "
        "force from this tick on; 0 = no warm-up")
    control_variate: dict[str, Any] = grouped(ControlVariateOptions, "control_variate merger only")
    placement: str = setting("pipeline", one_of(PLACEMENTS),
                             "pipeline (each stage's M from a dense pipelined pass: d per token crosses every cut) | "
                             "sampler (across processes: the sampling rank computes M on its whole copy and sends "
                             "each stage only sign(M_bar), 1 bit a coordinate; signed_ema with projector none)")


    @property
    def projector_settings(self) -> ProjectorOptions:
        """``projector_options`` as :class:`ProjectorOptions` (the options it leaves out at their defaults)."""
        return options_of(ProjectorOptions, self.projector_options)

    @property
    def control_variate_settings(self) -> ControlVariateOptions:
        """``control_variate`` as :class:`ControlVariateOptions` (the options it leaves out at their defaults)."""
        return options_of(ControlVariateOptions, self.control_variate)


RETIRED_KEYS = ("mask_kappa", "trust_floor", "warmup_shape", "warmup_stages")
"""Keys of the ``anchor`` section an earlier version saved that no option reads now: a run's record or
a checkpoint that holds them is read without them. ``mask_kappa`` and ``trust_floor`` were read only by
the retired ``masked`` and ``trust`` mergers; ``warmup_shape`` / ``warmup_stages`` chose la_warmup's
never-measured ``linear`` ramp (``geometric``, the one LA-WARMUP-V2 ran, is the ramp now)."""

MOVED_KEYS: dict[str, str] = {
    "projector_gamma": "projector_options.gamma",
    "projector_window": "projector_options.window",
    "cv_weight": "control_variate.weight",
    "cv_clip": "control_variate.clip",
    "warmup": "warmup_ticks (la_warmup over that many ticks; 0 = no warm-up)",
}
"""Keys of the ``anchor`` section an earlier version read, and the key that holds each now (:func:`upgrade`)."""


def upgrade(section: Mapping[str, Any]) -> dict[str, Any]:
    """An ``anchor`` section as an earlier version saved it, in today's keys: the projector's and the
    control variate's options in their mappings, and ``warmup: none`` as ``warmup_ticks: 0``."""
    out = moved_keys(section, {old: new for old, new in MOVED_KEYS.items() if old != "warmup"})
    if "warmup" in out and out.pop("warmup") != "la_warmup":
        out["warmup_ticks"] = 0
    return out
