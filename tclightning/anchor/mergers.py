"""Mergers: fold the late dense anchor gradient ``M`` into the fast circuit's ``G_comp``.

Pure logic over lists of gradient tensors (one tensor per parameter, same order and shapes as
the parameters); no Lightning import. A run's merger lives in :class:`tclightning.anchor.anchor.Anchor`
(with the circuit that feeds it); the Lightning callback is
:class:`tclightning.callbacks.anchor_merge.AnchorMerge`.

Each merger is a small stateful object with the same three calls:

* ``observe(M)``: a new anchor gradient arrived (at most once per optimizer tick);
* ``merge_(G_comp)`` (in place; ``merge`` on copies): the gradient the optimizer steps with;
* ``state_dict() / load_state_dict()``: everything needed to resume exactly.

Names (``MERGERS``):

* ``none``: ``G = G_comp`` (the fast circuit alone; ``M`` is ignored).
* ``dense``: the control. ``G = M`` for a tick that received an ``M``, else ``G = G_comp``.
  The dense control is run with the ``dense`` layout (no compressed cut), where ``G_comp`` *is*
  the dense gradient at the current weights, so the merger passes it through and no anchor
  circuit is needed (``needs_anchor`` is False); an ``M`` handed to it (e.g. a K=0 anchor in a
  test) replaces ``G_comp`` outright.
* ``signed_ema(alpha, beta)``: the sign(M) anchor of the original two-circuit method. When an ``M`` arrives
  ``M_bar <- beta * M_bar + (1 - beta) * M`` (the first ``M`` initialises ``M_bar = M``; the
  signs are the same as starting from zero, and the projectors see an unbiased magnitude). Then
  per coordinate ``G = alpha * G_comp + (1 - alpha) * |G_comp| * sign(M_hat)`` where ``M_hat`` is
  ``M_bar`` after the projector (``none`` by default: ``M_hat = M_bar``). Before the first ``M``
  arrives ``G = G_comp``. ``sign(0) = 0``: where ``M_hat`` is exactly 0 the correction term
  vanishes and ``G = alpha * G_comp``. Since ``|G| <= |G_comp|`` coordinate-wise, the merge never
  grows the gradient (clipping before or after it gives the same bound).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from tclightning.anchor.projectors import Projector, make_projector
from tclightning.errors import TclightningError

MERGERS = ("none", "dense", "signed_ema")


# ----------------------------------------------------------------------------- pure functions
def ema_update(m_bar: Sequence[Tensor] | None, m: Sequence[Tensor], beta: float) -> list[Tensor]:
    """``M_bar <- beta * M_bar + (1 - beta) * M`` (a new list, float32); ``M_bar = M`` when None."""
    if m_bar is None:
        return [x.detach().float().clone() for x in m]
    _check_lengths(m_bar, m, "M_bar", "M")
    return [b.mul(beta).add_(x.detach().to(b.device, torch.float32), alpha=1.0 - beta) for b, x in zip(m_bar, m)]


def signed_ema_merge_(grads: Sequence[Tensor], m_hat: Sequence[Tensor], alpha: float) -> None:
    """In place: ``G = alpha * G_comp + (1 - alpha) * |G_comp| * sign(M_hat)`` per coordinate, with
    ``grads`` holding ``G_comp`` (e.g. the parameters' ``.grad``). The merge formula, written once."""
    _check_lengths(grads, m_hat, "G_comp", "M_hat")
    for g, m in zip(grads, m_hat):
        # alpha*g + (1-alpha)*|g|*s without a second parameter-sized temporary beyond |g|*s
        corr = g.abs().mul_(torch.sign(m).to(g.device, g.dtype))
        g.mul_(alpha).add_(corr, alpha=1.0 - alpha)


def signed_ema_merge(g_comp: Sequence[Tensor], m_hat: Sequence[Tensor], alpha: float) -> list[Tensor]:
    """:func:`signed_ema_merge_` on copies: ``G`` as new tensors, ``G_comp`` unchanged."""
    out = [g.clone() for g in g_comp]
    signed_ema_merge_(out, m_hat, alpha)
    return out


def sign_agreement(g_comp: Sequence[Tensor], m_bar: Sequence[Tensor]) -> float:
    """Share of coordinates (over all tensors) where ``sign(G_comp) == sign(M_bar)`` (0 counts as a sign)."""
    _check_lengths(g_comp, m_bar, "G_comp", "M_bar")
    agree, total = 0, 0
    for g, m in zip(g_comp, m_bar):
        agree += int((torch.sign(g) == torch.sign(m).to(g.device, g.dtype)).sum())
        total += g.numel()
    return agree / total if total else float("nan")


def _pick(tensors: Sequence[Tensor], index: Sequence[int] | None) -> list[Tensor]:
    return list(tensors) if index is None else [tensors[i] for i in index]


def _check_lengths(a: Sequence[Tensor], b: Sequence[Tensor], na: str, nb: str) -> None:
    if len(a) != len(b):
        raise TclightningError(f"{na} has {len(a)} tensors but {nb} has {len(b)}: they must follow the same parameters")
    for i, (x, y) in enumerate(zip(a, b)):
        if x.shape != y.shape:
            raise TclightningError(f"tensor {i}: {na} has shape {tuple(x.shape)} but {nb} has {tuple(y.shape)}")


# ----------------------------------------------------------------------------- stateful mergers
class Merger:
    """Base merger: ``G = G_comp``; subclasses override ``observe``/``merge``. See the module doc."""

    name = "none"
    needs_anchor = False  # whether the anchor circuit must run for this merger

    def observe(self, m: Sequence[Tensor], *, snapshot_tick: int | None = None, tick: int | None = None) -> None:
        """A new anchor gradient ``M`` (computed at the snapshot of ``snapshot_tick``) arrived at ``tick``."""

    def merge(self, g_comp: Sequence[Tensor], *, tick: int | None = None) -> list[Tensor]:
        """The gradient to step with, as new tensors (``G_comp`` is not modified): :meth:`merge_` on copies."""
        out = [g.clone() for g in g_comp]
        self.merge_(out, tick=tick)
        return out

    def merge_(self, grads: Sequence[Tensor], *, tick: int | None = None, index: Sequence[int] | None = None) -> None:
        """Overwrite ``grads`` (e.g. the ``.grad`` of the parameters) with ``G`` (here: ``G_comp``).

        ``index``: positions of ``grads`` in the full parameter list when some parameters have no
        gradient this tick (those are left alone: a missing gradient stays missing).
        """

    def sign_agreement(self, g_comp: Sequence[Tensor], index: Sequence[int] | None = None) -> float | None:
        """Share of coordinates with ``sign(G_comp) == sign(M_bar)``; None before the first ``M``."""
        return None

    def to(self, device: torch.device | str) -> Merger:
        """Move the state tensors to ``device`` (once, so that merging does not copy every tick)."""
        return self

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("name", self.name) != self.name:
            raise TclightningError(f"checkpoint holds the state of merger {state.get('name')!r}, not {self.name!r}")


class NoneMerger(Merger):
    """``G = G_comp``: the fast circuit alone."""

    name = "none"


class DenseMerger(Merger):
    """The control: ``G = M`` on a tick that received ``M``, else ``G = G_comp`` (see the module doc)."""

    name = "dense"

    def __init__(self) -> None:
        self._fresh: list[Tensor] | None = None

    def observe(self, m: Sequence[Tensor], *, snapshot_tick: int | None = None, tick: int | None = None) -> None:
        self._fresh = [x.detach().clone() for x in m]

    def merge_(self, grads: Sequence[Tensor], *, tick: int | None = None, index: Sequence[int] | None = None) -> None:
        if self._fresh is None:
            return
        fresh = _pick(self._fresh, index)
        _check_lengths(grads, fresh, "G_comp", "M")
        for g, m in zip(grads, fresh):
            g.copy_(m)
        self._fresh = None  # M replaces G_comp only on the tick it arrived

    def to(self, device: torch.device | str) -> Merger:
        if self._fresh is not None:
            self._fresh = [m.to(device) for m in self._fresh]
        return self

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "fresh": self._fresh}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._fresh = state.get("fresh")


class SignedEMAMerger(Merger):
    """``M_bar <- beta M_bar + (1-beta) M``; ``G = alpha G_comp + (1-alpha) |G_comp| sign(P(M_bar))``.

    ``P`` is the projector (``none``: identity). Before the first ``M``, ``G = G_comp``.
    ``M_bar`` is kept in float32 on the device of the first ``M`` (one parameter-sized buffer).
    """

    name = "signed_ema"
    needs_anchor = True

    def __init__(self, alpha: float = 0.25, beta: float = 0.0, projector: Projector | str | None = None) -> None:
        if not 0.0 <= alpha <= 1.0:
            raise TclightningError(f"signed_ema: alpha must be in [0, 1], got {alpha}")
        if not 0.0 <= beta < 1.0:
            raise TclightningError(f"signed_ema: beta must be in [0, 1), got {beta}")
        self.alpha = float(alpha)
        self.beta = float(beta)
        self.projector = make_projector(projector) if not isinstance(projector, Projector) else projector
        self.m_bar: list[Tensor] | None = None
        self.updates = 0  # anchors folded into M_bar so far

    def observe(self, m: Sequence[Tensor], *, snapshot_tick: int | None = None, tick: int | None = None) -> None:
        previous = self.m_bar
        self.m_bar = ema_update(previous, m, self.beta)
        self.updates += 1
        self.projector.observe(self.m_bar, previous, snapshot_tick=snapshot_tick, tick=tick)

    def m_hat(self, *, tick: int | None = None) -> list[Tensor] | None:
        """``M_bar`` after the projector at ``tick`` (None before the first ``M``)."""
        if self.m_bar is None:
            return None
        return self.projector.project(self.m_bar, tick=tick)

    def merge_(self, grads: Sequence[Tensor], *, tick: int | None = None, index: Sequence[int] | None = None) -> None:
        m_hat = self.m_hat(tick=tick)
        if m_hat is not None:
            signed_ema_merge_(grads, _pick(m_hat, index), self.alpha)

    def sign_agreement(self, g_comp: Sequence[Tensor], index: Sequence[int] | None = None) -> float | None:
        return None if self.m_bar is None else sign_agreement(g_comp, _pick(self.m_bar, index))

    def to(self, device: torch.device | str) -> Merger:
        if self.m_bar is not None:
            self.m_bar = [m.to(device) for m in self.m_bar]
        self.projector.to(device)
        return self

    def state_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "alpha": self.alpha,
            "beta": self.beta,
            "m_bar": None if self.m_bar is None else [t.detach().clone() for t in self.m_bar],
            "updates": self.updates,
            "projector": self.projector.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        m_bar = state.get("m_bar")
        self.m_bar = None if m_bar is None else [t.detach().float().clone() for t in m_bar]
        self.updates = int(state.get("updates", 0))
        self.projector.load_state_dict(state.get("projector", {}))


def make_merger(
    name: str = "signed_ema", *, alpha: float = 0.25, beta: float = 0.0, projector: Projector | str | None = None,
    **projector_kwargs: Any,
) -> Merger:
    """Build a merger by name (``none``, ``dense``, ``signed_ema``); projector options go to the projector."""
    if name == "none":
        return NoneMerger()
    if name == "dense":
        return DenseMerger()
    if name == "signed_ema":
        proj = projector if isinstance(projector, Projector) else make_projector(projector or "none", **projector_kwargs)
        return SignedEMAMerger(alpha=alpha, beta=beta, projector=proj)
    raise TclightningError(f"unknown merger {name!r}; choose one of {', '.join(MERGERS)}")
