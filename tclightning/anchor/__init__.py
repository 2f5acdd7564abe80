"""The anchor circuit (dense, late gradient ``M``), the mergers and the projectors (docs/anchor.md).

Pure logic, no Lightning: :mod:`~tclightning.anchor.circuit` (schedule and pending jobs),
:mod:`~tclightning.anchor.mergers` (``none``, ``dense``, ``signed_ema``) and
:mod:`~tclightning.anchor.projectors` (``none``, ``damped_linear``, ``rank1``). The Lightning side is
:class:`tclightning.callbacks.anchor_merge.AnchorMerge`.
"""

from tclightning.anchor.circuit import (
    AnchorCircuit,
    AnchorJob,
    AnchorSchedule,
    Stage,
    cpu_snapshot,
)
from tclightning.anchor.mergers import (
    MERGERS,
    DenseMerger,
    Merger,
    NoneMerger,
    SignedEMAMerger,
    ema_update,
    make_merger,
    sign_agreement,
    signed_ema_merge,
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
    "AnchorCircuit",
    "AnchorJob",
    "AnchorSchedule",
    "DampedLinearProjector",
    "DenseMerger",
    "Merger",
    "NoneMerger",
    "Projector",
    "Rank1Projector",
    "SignedEMAMerger",
    "Stage",
    "cpu_snapshot",
    "ema_update",
    "make_merger",
    "make_projector",
    "sign_agreement",
    "signed_ema_merge",
    "staleness_factor",
    "top_direction",
]
