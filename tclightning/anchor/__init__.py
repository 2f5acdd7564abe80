"""The anchor circuit (dense, late gradient ``M``), the mergers and the projectors (docs/anchor.md).

Pure logic, no Lightning: :mod:`~tclightning.anchor.anchor` (:class:`Anchor`, the feature in one
object, built from the recipe by :func:`build_anchor`), :mod:`~tclightning.anchor.circuit`
(schedule and pending jobs), :mod:`~tclightning.anchor.mergers` (``none``, ``signed_ema``,
``control_variate``) and :mod:`~tclightning.anchor.projectors` (``none``, ``damped_linear``, ``rank1``).
The Lightning callback for any module is :class:`tclightning.callbacks.anchor_merge.AnchorMerge`.
"""

from tclightning.anchor.anchor import Anchor, AnchorDelivery, build_anchor
from tclightning.anchor.circuit import (
    AnchorCircuit,
    AnchorJob,
    AnchorSchedule,
    Stage,
    cpu_snapshot,
)
from tclightning.anchor.mergers import (
    MERGERS,
    ControlVariateMerger,
    Merger,
    NoneMerger,
    SignedEMAMerger,
    control_variate_merge_,
    cosine,
    ema_update,
    make_merger,
    sign_agreement,
    signed_ema_merge,
    signed_ema_merge_,
)
from tclightning.anchor.projectors import (
    PROJECTORS,
    DampedLinearProjector,
    Projector,
    Rank1Projector,
    make_projector,
    staleness_factor,
    top_direction,
)

__all__ = [
    "MERGERS",
    "PROJECTORS",
    "Anchor",
    "AnchorCircuit",
    "AnchorDelivery",
    "AnchorJob",
    "ControlVariateMerger",
    "AnchorSchedule",
    "DampedLinearProjector",
    "Merger",
    "NoneMerger",
    "Projector",
    "Rank1Projector",
    "SignedEMAMerger",
    "Stage",
    "build_anchor",
    "control_variate_merge_",
    "cosine",
    "cpu_snapshot",
    "ema_update",
    "make_merger",
    "make_projector",
    "sign_agreement",
    "signed_ema_merge",
    "signed_ema_merge_",
    "staleness_factor",
    "top_direction",
]
