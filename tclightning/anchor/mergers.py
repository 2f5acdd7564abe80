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

* ``none``: ``G = G_comp`` (the fast circuit alone; ``M`` is ignored). The dense control is the
  ``dense`` pipeline layout with this merger: there ``G_comp`` *is* the dense gradient.
* ``signed_ema(alpha, beta)``: the sign(M) anchor of the original two-circuit method. When an ``M`` arrives
  ``M_bar <- beta * M_bar + (1 - beta) * M`` (the first ``M`` initialises ``M_bar = M``; the
  signs are the same as starting from zero, and the projectors see an unbiased magnitude). Then
  per coordinate ``G = alpha * G_comp + (1 - alpha) * |G_comp| * sign(M_hat)`` where ``M_hat`` is
  ``M_bar`` after the projector (``none`` by default: ``M_hat = M_bar``). Before the first ``M``
  arrives ``G = G_comp``. ``sign(0) = 0``: where ``M_hat`` is exactly 0 the correction term
  vanishes and ``G = alpha * G_comp``. Since ``|G| <= |G_comp|`` coordinate-wise, the merge never
  grows the gradient (clipping before or after it gives the same bound).
* ``control_variate(weight, beta, clip)``: *corrects* ``G_comp`` instead of overriding its
  direction (the fresh fast gradient keeps the lead, the late anchor only repairs what
  compression biases); it keeps the newest ``M`` for the online staleness signals
  (:meth:`Merger.reference`). The anchor job also runs the *fast* (compressed) circuit on its
  replay batch at the snapshot weights, ``G_hat = G_comp(theta(t-K))``, so the
  anchor delivers the compression bias on that batch, ``c = M - G_hat``. When it arrives
  ``c_bar <- beta * c_bar + (1 - beta) * c`` (the first ``c`` initialises ``c_bar``), and every
  later tick steps with::

      G = G_comp + weight * scale * c_bar,   scale = min(1, clip * ||G_comp|| / ||weight * c_bar||)

  (norms over every anchor tensor; ``clip = 0`` disables the bound). The direction stays the
  fresh ``G_comp``; with no compression ``G_hat = M``, so ``c = 0`` and ``G = G_comp``, the
  dense gradient. With ``K = 0`` and ``weight = 1`` (no clip) the arrival tick steps with exactly
  ``M``. The bound keeps a stale correction from outweighing the fresh gradient.

Retired: ``masked`` (the signed correction only where a confident anchor disagrees) and ``trust``
(the signed correction scaled by an online trust), measured in docs/two-circuits.md, and
``dense`` (``G = M`` on an arrival tick), a control the ``dense`` layout with ``none`` already is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from tclightning.anchor.projectors import Projector, make_projector
from tclightning.errors import TclightningError

MERGERS = ("none", "signed_ema", "control_variate")
RETIRED_MERGERS = ("dense", "masked", "trust")
"""Mergers measured and removed: named in the error a recipe or checkpoint asking for one gets."""


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


def cosine(a: Sequence[Tensor], b: Sequence[Tensor]) -> float:
    """Cosine between two gradients taken as one vector over all tensors (0 when either is 0)."""
    _check_lengths(a, b, "a", "b")
    dot = na = nb = 0.0
    for x, y in zip(a, b):
        x32, y32 = x.detach().float(), y.detach().to(x.device, torch.float32)
        dot += float((x32 * y32).sum())
        na += float((x32 * x32).sum())
        nb += float((y32 * y32).sum())
    return dot / (na ** 0.5 * nb ** 0.5) if na > 0 and nb > 0 else 0.0


def global_norm(tensors: Sequence[Tensor]) -> float:
    """``sqrt(sum ||t||^2)`` over the tensors, in float32."""
    return float(sum(float(t.detach().float().pow(2).sum()) for t in tensors)) ** 0.5


def control_variate_merge_(
    grads: Sequence[Tensor], correction: Sequence[Tensor], weight: float = 1.0, clip: float = 1.0,
) -> float:
    """In place: ``G = G_comp + weight * scale * c`` with ``scale = min(1, clip ||G_comp|| /
    ||weight c||)`` (``clip = 0``: ``scale = 1``). Returns the applied ``||weight scale c|| / ||G_comp||``
    (0 when ``G_comp`` is 0)."""
    _check_lengths(grads, correction, "G_comp", "correction")
    g_norm = global_norm(grads)
    c_norm = abs(weight) * global_norm(correction)
    scale = 1.0
    if clip > 0 and c_norm > 0:
        scale = min(1.0, clip * g_norm / c_norm)
    for g, c in zip(grads, correction):
        g.add_(c.to(g.device, g.dtype), alpha=weight * scale)
    return c_norm * scale / g_norm if g_norm > 0 else 0.0


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
    needs_fast = False  # whether each anchor job must also run the fast circuit at its snapshot

    def observe(
        self, m: Sequence[Tensor], *, snapshot_tick: int | None = None, tick: int | None = None,
        fast: Sequence[Tensor] | None = None,
    ) -> None:
        """A new anchor gradient ``M`` (computed at the snapshot of ``snapshot_tick``) arrived at
        ``tick``; ``fast``: the fast circuit's gradient on the same batch at the same snapshot
        (given when :attr:`needs_fast`)."""

    def reference(self) -> list[Tensor] | None:
        """The anchor direction the fresh gradient is compared with (``M_bar``, or the newest
        ``M``); None before the first ``M`` or for mergers without one."""
        return None

    def tick_metrics(self) -> dict[str, float]:
        """Figures of the last :meth:`merge_` (e.g. ``anchor/correction_ratio``), averaged per RL step by the caller."""
        return {}

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

    def observe(
        self, m: Sequence[Tensor], *, snapshot_tick: int | None = None, tick: int | None = None,
        fast: Sequence[Tensor] | None = None,
    ) -> None:
        previous = self.m_bar
        self.m_bar = ema_update(previous, m, self.beta)
        self.updates += 1
        self.projector.observe(self.m_bar, previous, snapshot_tick=snapshot_tick, tick=tick)

    def observe_signs(self, signs: Sequence[Tensor], *, snapshot_tick: int | None = None,
                      tick: int | None = None) -> None:
        """``sign(M_bar)`` of an EMA kept elsewhere arrived (``anchor.placement: sampler``: the sampling
        rank folds ``M`` with this ``beta`` and sends the signs): ``M_bar`` becomes it. The merge
        and ``sign_agreement`` read only ``sign(M_bar)``, so with the ``none`` projector they are
        exactly those of the ``M_bar`` the signs came from."""
        previous = self.m_bar
        self.m_bar = [s.detach().float().clone() for s in signs]
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

    def reference(self) -> list[Tensor] | None:
        return self.m_bar

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


class ControlVariateMerger(Merger):
    """``c_bar <- beta c_bar + (1 - beta) (M - G_hat)``; ``G = G_comp + weight * scale * c_bar``
    (module doc). Keeps two parameter-sized float32 buffers: ``c_bar`` and the newest ``M`` (the
    reference direction of the staleness signals). ``anchor/correction_ratio``: the applied
    correction's norm over ``||G_comp||`` at the last tick."""

    name = "control_variate"
    needs_anchor = True
    needs_fast = True

    def __init__(self, weight: float = 1.0, beta: float = 0.0, clip: float = 1.0) -> None:
        if weight < 0:
            raise TclightningError(f"control_variate: weight must be >= 0, got {weight}")
        if not 0.0 <= beta < 1.0:
            raise TclightningError(f"control_variate: beta must be in [0, 1), got {beta}")
        if clip < 0:
            raise TclightningError(f"control_variate: clip must be >= 0 (0 = no bound), got {clip}")
        self.weight, self.beta, self.clip = float(weight), float(beta), float(clip)
        self.c_bar: list[Tensor] | None = None
        self.m_last: list[Tensor] | None = None
        self.updates = 0
        self._ratio: float | None = None

    def observe(
        self, m: Sequence[Tensor], *, snapshot_tick: int | None = None, tick: int | None = None,
        fast: Sequence[Tensor] | None = None,
    ) -> None:
        if fast is None:
            raise TclightningError(
                "control_variate needs the fast circuit's gradient at the anchor's snapshot with every M "
                "(the anchor job's compressed pass); none was given")
        _check_lengths(m, fast, "M", "G_hat")
        bias = [x.detach().float() - f.detach().to(x.device, torch.float32) for x, f in zip(m, fast)]
        self.c_bar = ema_update(self.c_bar, bias, self.beta)
        self.m_last = [x.detach().float().clone() for x in m]
        self.updates += 1

    def merge_(self, grads: Sequence[Tensor], *, tick: int | None = None, index: Sequence[int] | None = None) -> None:
        if self.c_bar is None:
            self._ratio = None
            return
        self._ratio = control_variate_merge_(grads, _pick(self.c_bar, index), self.weight, self.clip)

    def sign_agreement(self, g_comp: Sequence[Tensor], index: Sequence[int] | None = None) -> float | None:
        return None if self.m_last is None else sign_agreement(g_comp, _pick(self.m_last, index))

    def reference(self) -> list[Tensor] | None:
        return self.m_last

    def tick_metrics(self) -> dict[str, float]:
        return {} if self._ratio is None else {"anchor/correction_ratio": self._ratio}

    def to(self, device: torch.device | str) -> Merger:
        if self.c_bar is not None:
            self.c_bar = [c.to(device) for c in self.c_bar]
        if self.m_last is not None:
            self.m_last = [m.to(device) for m in self.m_last]
        return self

    def state_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "weight": self.weight, "beta": self.beta, "clip": self.clip,
            "c_bar": None if self.c_bar is None else [t.detach().clone() for t in self.c_bar],
            "m_last": None if self.m_last is None else [t.detach().clone() for t in self.m_last],
            "updates": self.updates,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        c_bar, m_last = state.get("c_bar"), state.get("m_last")
        self.c_bar = None if c_bar is None else [t.detach().float().clone() for t in c_bar]
        self.m_last = None if m_last is None else [t.detach().float().clone() for t in m_last]
        self.updates = int(state.get("updates", 0))


def make_merger(
    name: str = "signed_ema", *, alpha: float = 0.25, beta: float = 0.0, projector: Projector | str | None = None,
    weight: float = 1.0, clip: float = 1.0, **projector_kwargs: Any,
) -> Merger:
    """Build a merger by name (``MERGERS``); projector options go to the projector.

    ``alpha``: ``signed_ema``; ``beta``: ``signed_ema``, ``control_variate``; ``weight``/``clip``:
    ``control_variate``."""
    if name == "none":
        return NoneMerger()
    if name == "control_variate":
        return ControlVariateMerger(weight=weight, beta=beta, clip=clip)
    if name == "signed_ema":
        proj = projector if isinstance(projector, Projector) else make_projector(projector or "none", **projector_kwargs)
        return SignedEMAMerger(alpha=alpha, beta=beta, projector=proj)
    retired = f" ({name} was tried and retired, docs/two-circuits.md)" if name in RETIRED_MERGERS else ""
    raise TclightningError(f"unknown merger {name!r}{retired}; choose one of {', '.join(MERGERS)}")
