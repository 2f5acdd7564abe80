"""Where the anchor's dense pass runs across processes (``anchor.placement``; pure logic).

``pipeline`` (the default): every stage rank snapshots its own stage and ``M`` comes from a second,
dense pipelined pass over the cuts (``[T, d]`` activations and gradients cross every cut).

``sampler``: the sampling rank (rank 0), which holds a whole copy of the policy for sampling, also
runs the anchor alone: it snapshots the whole policy, computes ``M`` on a hook-free dense clone of
it (the replayed rollouts are already there, so nothing crosses a cut), keeps ``M_bar`` (the EMA)
of every parameter and, at each delivery, sends every other stage rank only ``sign(M_bar)`` of that
stage's parameters. ``signed_ema`` with the ``none`` projector reads nothing of ``M_bar`` but its
sign, so the merge on each stage is exactly the one the pipeline placement gives.

This module holds :data:`PLACEMENTS` and :class:`SignRelay`, the sampling rank's ``M_bar`` of the
stages it sends signs to (checkpointed with the anchor).

The sign message itself (its format and byte count) is :mod:`tclightning.sign_message`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from tclightning.anchor.mergers import ema_update

PLACEMENTS = ("pipeline", "sampler")
"""``anchor.placement``: where the anchor's dense forward/backward runs."""


class SignRelay:
    """The sampling rank's ``M_bar`` of each stage it sends signs to (``anchor.placement: sampler``).

    :meth:`fold` applies the merger's own EMA (:func:`~tclightning.anchor.mergers.ema_update`, the
    same ``beta``) to a stage's share of ``M`` and returns that stage's ``M_bar``; its sign is what
    crosses. The sampling rank's own stage is merged there from ``M`` itself (its merger keeps its
    ``M_bar``), so ``m_bar`` holds only the other stages' (and nothing with ``beta = 0``). Empty on
    the other ranks."""

    def __init__(self, beta: float) -> None:
        self.beta = float(beta)
        self.m_bar: dict[int, list[Tensor]] = {}

    def fold(self, stage: int, m: Sequence[Tensor]) -> list[Tensor]:
        """``M_bar <- beta M_bar + (1 - beta) M`` for ``stage`` (the first ``M`` sets it); returns it.
        With ``beta = 0`` ``M_bar`` is the newest ``M`` and nothing needs keeping: no stage-sized
        buffer stays on the sampling rank (the next ``M`` replaces it whatever it was)."""
        m_bar = ema_update(self.m_bar.get(stage), m, self.beta)
        if self.beta > 0:
            self.m_bar[stage] = m_bar
        return m_bar

    def state_dict(self) -> dict[str, Any]:
        """``M_bar`` per stage, on CPU."""
        return {"beta": self.beta, "m_bar": {stage: [t.detach().to("cpu", copy=True) for t in tensors]
                                            for stage, tensors in self.m_bar.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.m_bar = {int(stage): [t.detach().float().clone() for t in tensors]
                      for stage, tensors in state.get("m_bar", {}).items()}


__all__ = ["PLACEMENTS", "SignRelay"]
