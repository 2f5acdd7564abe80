"""Projectors: staleness repair of the anchor EMA ``M_bar`` before the merger takes its sign.

Pure logic (no Lightning). A projector sees every change of ``M_bar`` (``observe``) and, for
``rank1``, the weights (``observe_weights``); ``project(M_bar, tick)`` returns ``M_hat``, which the
``signed_ema`` merger uses in place of ``M_bar``.

Notation: anchors are numbered by arrival; the newest was computed at the weight snapshot of
tick ``t0`` and the one before it at ``t0_prev``; ``t`` is the current optimizer tick;
``delta = M_bar - M_bar_prev`` is the last anchor-to-anchor change of the EMA (``M_bar_prev`` is
``M_bar`` just before the newest anchor was folded in).

**Staleness factor** (shared by ``damped_linear`` and ``rank1``)::

    s(t) = clamp((t - t0) / (t0 - t0_prev), 0, max_factor)

the age of the newest anchor measured in anchor intervals: ``delta`` is how ``M_bar`` moved over
``t0 - t0_prev`` ticks of weights, so linear extrapolation to the weights of tick ``t`` moves it
``s(t)`` times as far. With a fixed K/C circuit ``s = K/C`` on the delivery tick and grows by
``1/C`` each tick until the next anchor (1 → 2 for 5/5). When snapshot ticks are not given,
the arrival ticks stand in for them (then ``s = 0`` on the arrival tick). Until two anchors
have arrived there is no ``delta`` and ``M_hat = M_bar``.

Names (``PROJECTORS``):

* ``none`` (the default, as in the original experiments): ``M_hat = M_bar``.
* ``damped_linear(gamma)``: ``M_hat = M_bar + gamma * s(t) * delta`` — extrapolate along the last
  anchor-to-anchor change, damped by ``gamma`` (0 = none, 1 = plain linear).
* ``rank1(gamma, window, every)``: the top direction ``u`` of the recent weight trajectory as a
  1-D position state. Keep the last ``window`` weight snapshots (flattened over the anchor
  parameters, every ``every`` ticks, on CPU), centre them, and take ``u`` = top right singular
  vector of the centred ``window x d`` matrix (computed from its ``window x window`` Gram matrix).
  Then ``M_hat = M_bar + gamma * s(t) * (u . delta) * u``: the damped linear repair applied only
  along the line the weights actually travel; the part of ``M_bar`` off the line is left as is
  (do-nothing, which the original experiments found best where the trajectory is not projectable). Until two
  snapshots exist ``M_hat = M_bar``. Memory: ``window * d`` numbers in ``snapshot_dtype`` on CPU
  plus ``d`` for ``u`` (restrict the anchor parameters or use bfloat16 for large models).

``damped_linear`` and ``rank1`` keep one extra parameter-sized buffer (``delta``) on the
device of ``M_bar``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from tclightning.errors import TclightningError

PROJECTORS = ("none", "damped_linear", "rank1")


def staleness_factor(tick: int, t0: int, t0_prev: int, max_factor: float = 4.0) -> float:
    """``clamp((tick - t0) / (t0 - t0_prev), 0, max_factor)``; 0 when the interval is not positive."""
    interval = t0 - t0_prev
    if interval <= 0:
        return 0.0
    return float(min(max((tick - t0) / interval, 0.0), max_factor))


def damped_linear(m_bar: Sequence[Tensor], delta: Sequence[Tensor], gamma: float, factor: float) -> list[Tensor]:
    """``M_hat = M_bar + gamma * factor * delta`` (new tensors)."""
    return [m + d.to(m.device, m.dtype) * (gamma * factor) for m, d in zip(m_bar, delta)]


def top_direction(snapshots: Sequence[Tensor]) -> Tensor:
    """Unit top right singular vector of the centred ``n x d`` trajectory (rows = snapshots).

    Through the ``n x n`` Gram matrix, so the cost is ``O(n^2 d)`` and nothing ``d x d`` exists.
    Oriented so that ``u . (x_last - x_first) >= 0`` (the direction of travel).
    """
    x = torch.stack([s.double() for s in snapshots])
    xc = x - x.mean(dim=0, keepdim=True)
    _, vecs = torch.linalg.eigh(xc @ xc.T)
    u = xc.T @ vecs[:, -1]
    norm = u.norm()
    if norm == 0:
        return torch.zeros(x.shape[1], dtype=torch.float32)
    u = u / norm
    if float(u @ (x[-1] - x[0])) < 0:
        u = -u
    return u.float()


class Projector:
    """``none``: ``M_hat = M_bar``. Base class; the module doc gives every formula."""

    name = "none"

    def observe(
        self, m_bar: Sequence[Tensor], m_bar_prev: Sequence[Tensor] | None, *,
        snapshot_tick: int | None = None, tick: int | None = None,
    ) -> None:
        """``M_bar`` changed from ``m_bar_prev`` (None for the first anchor) to ``m_bar``."""

    def observe_weights(self, params: Sequence[Tensor], tick: int) -> None:
        """The weights before the update of optimizer tick ``tick`` (only ``rank1`` uses them)."""

    def project(self, m_bar: Sequence[Tensor], *, tick: int | None = None) -> list[Tensor]:
        return list(m_bar)

    def to(self, device: torch.device | str) -> Projector:
        """Move the parameter-sized state to ``device`` (weight snapshots stay on CPU)."""
        return self

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("name", self.name) != self.name:
            raise TclightningError(f"checkpoint holds the state of projector {state.get('name')!r}, not {self.name!r}")


class DampedLinearProjector(Projector):
    """``M_hat = M_bar + gamma * s(t) * (M_bar - M_bar_prev)``, ``s`` the staleness factor."""

    name = "damped_linear"

    def __init__(self, gamma: float = 0.5, max_factor: float = 4.0) -> None:
        if gamma < 0:
            raise TclightningError(f"{self.name}: gamma must be >= 0, got {gamma}")
        self.gamma = float(gamma)
        self.max_factor = float(max_factor)
        self.delta: list[Tensor] | None = None
        self.t0: int | None = None
        self.t0_prev: int | None = None
        self.last_tick: int | None = None

    def observe(
        self, m_bar: Sequence[Tensor], m_bar_prev: Sequence[Tensor] | None, *,
        snapshot_tick: int | None = None, tick: int | None = None,
    ) -> None:
        if tick is not None:
            self.last_tick = int(tick)
        t0 = snapshot_tick if snapshot_tick is not None else tick
        self.t0_prev, self.t0 = self.t0, (None if t0 is None else int(t0))
        self.delta = None if m_bar_prev is None else [m - p for m, p in zip(m_bar, m_bar_prev)]

    def factor(self, tick: int | None) -> float:
        """The staleness factor ``s(tick)`` (0 without two timed anchors)."""
        tick = self.last_tick if tick is None else tick
        if tick is None or self.t0 is None or self.t0_prev is None:
            return 0.0
        return staleness_factor(tick, self.t0, self.t0_prev, self.max_factor)

    def project(self, m_bar: Sequence[Tensor], *, tick: int | None = None) -> list[Tensor]:
        if tick is not None:
            self.last_tick = int(tick)
        factor = self.factor(tick)
        if self.delta is None or factor == 0.0 or self.gamma == 0.0:
            return list(m_bar)
        return damped_linear(m_bar, self._direction(), self.gamma, factor)

    def _direction(self) -> list[Tensor]:
        assert self.delta is not None
        return self.delta

    def to(self, device: torch.device | str) -> Projector:
        if self.delta is not None:
            self.delta = [d.to(device) for d in self.delta]
        return self

    def state_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "gamma": self.gamma, "max_factor": self.max_factor,
            "delta": None if self.delta is None else [d.clone() for d in self.delta],
            "t0": self.t0, "t0_prev": self.t0_prev, "last_tick": self.last_tick,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        delta = state.get("delta")
        self.delta = None if delta is None else [d.clone() for d in delta]
        self.t0, self.t0_prev, self.last_tick = state.get("t0"), state.get("t0_prev"), state.get("last_tick")


class Rank1Projector(DampedLinearProjector):
    """``M_hat = M_bar + gamma * s(t) * (u . delta) u``, ``u`` the top direction of the weight trajectory."""

    name = "rank1"

    def __init__(
        self, gamma: float = 1.0, window: int = 8, every: int = 1, max_factor: float = 4.0,
        snapshot_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(gamma=gamma, max_factor=max_factor)
        if window < 2:
            raise TclightningError(f"rank1: window must be >= 2 snapshots, got {window}")
        if every < 1:
            raise TclightningError(f"rank1: every must be >= 1 tick, got {every}")
        self.window = int(window)
        self.every = int(every)
        self.snapshot_dtype = snapshot_dtype
        self.snapshots: list[Tensor] = []  # flattened weights, oldest first, on CPU
        self.snapshot_ticks: list[int] = []
        self._u: Tensor | None = None  # cache; invalidated by a new snapshot
        self._along: list[Tensor] | None = None  # cache of (u . delta) u per tensor

    def observe(
        self, m_bar: Sequence[Tensor], m_bar_prev: Sequence[Tensor] | None, *,
        snapshot_tick: int | None = None, tick: int | None = None,
    ) -> None:
        super().observe(m_bar, m_bar_prev, snapshot_tick=snapshot_tick, tick=tick)
        self._along = None

    def observe_weights(self, params: Sequence[Tensor], tick: int) -> None:
        if self.snapshot_ticks and tick - self.snapshot_ticks[-1] < self.every:
            return
        flat = torch.cat([p.detach().reshape(-1).to("cpu", self.snapshot_dtype) for p in params])
        self.snapshots.append(flat)
        self.snapshot_ticks.append(int(tick))
        del self.snapshots[: -self.window], self.snapshot_ticks[: -self.window]
        self._u, self._along = None, None

    def to(self, device: torch.device | str) -> Projector:
        super().to(device)
        self._along = None
        return self

    def direction(self) -> Tensor | None:
        """The unit top direction ``u`` (flattened, CPU) or None with fewer than two snapshots."""
        if len(self.snapshots) < 2:
            return None
        if self._u is None:
            self._u = top_direction(self.snapshots)
        return self._u

    def project(self, m_bar: Sequence[Tensor], *, tick: int | None = None) -> list[Tensor]:
        if self.direction() is None:
            if tick is not None:
                self.last_tick = int(tick)
            return list(m_bar)
        return super().project(m_bar, tick=tick)

    def _direction(self) -> list[Tensor]:
        assert self.delta is not None
        if self._along is None:
            u = self.direction()
            assert u is not None
            if u.numel() != sum(d.numel() for d in self.delta):
                raise TclightningError(
                    f"rank1: weight snapshots have {u.numel()} numbers but M_bar has "
                    f"{sum(d.numel() for d in self.delta)}: observe_weights must get the anchor parameters"
                )
            pieces = torch.split(u, [d.numel() for d in self.delta])
            parts = [p.to(d.device, torch.float32).view_as(d) for p, d in zip(pieces, self.delta)]
            coef = sum(float((p * d.float()).sum()) for p, d in zip(parts, self.delta))
            self._along = [p * coef for p in parts]
        return self._along

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update(
            window=self.window, every=self.every,
            snapshots=[s.clone() for s in self.snapshots], snapshot_ticks=list(self.snapshot_ticks),
        )
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.snapshots = [s.clone() for s in state.get("snapshots", [])]
        self.snapshot_ticks = [int(t) for t in state.get("snapshot_ticks", [])]
        self._u, self._along = None, None


def make_projector(name: str | None = "none", **kwargs: Any) -> Projector:
    """Build a projector by name (``none``, ``damped_linear``, ``rank1``) with its options."""
    name = name or "none"
    if name == "none":
        if kwargs:
            raise TclightningError(f"projector 'none' takes no options, got {sorted(kwargs)}")
        return Projector()
    if name == "damped_linear":
        return DampedLinearProjector(**_only(kwargs, {"gamma", "max_factor"}, name))
    if name == "rank1":
        return Rank1Projector(**_only(kwargs, {"gamma", "window", "every", "max_factor", "snapshot_dtype"}, name))
    raise TclightningError(f"unknown projector {name!r}; choose one of {', '.join(PROJECTORS)}")


def _only(kwargs: dict[str, Any], allowed: set[str], name: str) -> dict[str, Any]:
    extra = set(kwargs) - allowed
    if extra:
        raise TclightningError(f"projector {name!r} has no option(s) {sorted(extra)}; it takes {sorted(allowed)}")
    return kwargs
