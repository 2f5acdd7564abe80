"""Per-metric time series and the small robust statistics the health rules share.

Pure Python + numpy (no Lightning): the callbacks and ``tclightning analyze health`` both
feed the same :class:`MetricHistory`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

#: 1 / Phi^-1(3/4): turns a median absolute deviation into a Gaussian standard deviation.
MAD_TO_SIGMA = 1.4826


def robust_sigma(values: Sequence[float] | np.ndarray) -> float:
    """Gaussian-equivalent spread of ``values``: ``1.4826 * median(|x - median(x)|)``.

    Robust to a few outliers (a collapse step, a spike); 0.0 for fewer than two values.
    """
    x = np.asarray(values, dtype=float)
    if x.size < 2:
        return 0.0
    return float(MAD_TO_SIGMA * np.median(np.abs(x - np.median(x))))


def step_noise(values: Sequence[float] | np.ndarray) -> float:
    """Per-step noise of a series: ``robust_sigma(diff(x)) / sqrt(2)``.

    First differences remove a slow trend, so a learning curve does not count as noise;
    for white noise of standard deviation s the result is s.
    """
    x = np.asarray(values, dtype=float)
    if x.size < 3:
        return 0.0
    return robust_sigma(np.diff(x)) / math.sqrt(2.0)


def window_mean_noise(values: Sequence[float] | np.ndarray, width: int) -> float:
    """Noise of a ``width``-point moving mean, measured rather than assumed.

    ``robust_sigma(m[t] - m[t-width]) / sqrt(2)`` where ``m`` is the moving mean: non-overlapping
    neighbouring windows, so slow (autocorrelated) wander is counted too, which ``s/sqrt(width)``
    would miss. 0.0 when there are fewer than ``2*width + 2`` points.
    """
    x = np.asarray(values, dtype=float)
    if width < 1 or x.size < 2 * width + 2:
        return 0.0
    csum = np.concatenate(([0.0], np.cumsum(x)))
    means = (csum[width:] - csum[:-width]) / width
    return robust_sigma(means[width:] - means[:-width]) / math.sqrt(2.0)


def halves(values: Sequence[float] | np.ndarray) -> tuple[float, float]:
    """Medians of the first and second half of ``values`` (the middle point goes to neither)."""
    x = np.asarray(values, dtype=float)
    h = x.size // 2
    return float(np.median(x[:h])), float(np.median(x[-h:]))


def halves_z(values: Sequence[float] | np.ndarray, noise: float) -> float:
    """How many standard errors the second half's median sits above the first half's.

    ``(med2 - med1) / (1.2533 * noise * sqrt(2 / h))`` for halves of h points each
    (1.2533 = sqrt(pi/2), the efficiency loss of a median against a mean).
    """
    x = np.asarray(values, dtype=float)
    h = x.size // 2
    if h < 1:
        return 0.0
    first, second = halves(x)
    se = 1.2533 * noise * math.sqrt(2.0 / h)
    if se <= 0.0:
        return math.inf if second > first else (-math.inf if second < first else 0.0)
    return (second - first) / se


def relative_change(before: float, after: float) -> float:
    """``after / before - 1``, guarded against a zero baseline (then the absolute change)."""
    if abs(before) < 1e-12:
        return after - before
    return after / before - 1.0


class MetricHistory:
    """Per-metric ``(step, value)`` series fed by :meth:`add`.

    Keeps the last ``max_points`` points of each metric (older ones are dropped) plus its first
    ``head_points`` values forever, so baselines ("at the start of the run") survive a long run.
    A second :meth:`add` for a step already recorded replaces that step's value (Lightning logs
    train and validation metrics for the same step at different times). NaN/Inf values appear
    in ``last_update`` (for the non-finite rule) but never enter the series, so the windowed
    statistics stay finite.
    """

    def __init__(self, max_points: int = 512, head_points: int = 32) -> None:
        if max_points < 8 or head_points < 1:
            raise ValueError("max_points must be >= 8 and head_points >= 1")
        self.max_points = max_points
        self.head_points = head_points
        self._steps: dict[str, list[int]] = {}
        self._values: dict[str, list[float]] = {}
        self._head: dict[str, list[float]] = {}
        self._count: dict[str, int] = {}
        self.last_update: dict[str, float] = {}
        self.last_step: int | None = None

    def add(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record one update; ``last_update`` becomes exactly ``metrics`` (as floats)."""
        update = {name: float(value) for name, value in metrics.items()}
        for name, value in update.items():
            if not math.isfinite(value):
                continue
            steps = self._steps.setdefault(name, [])
            values = self._values.setdefault(name, [])
            if steps and steps[-1] == step:
                values[-1] = value
                head = self._head[name]
                if self._count[name] <= len(head):
                    head[self._count[name] - 1] = value
                continue
            steps.append(step)
            values.append(value)
            self._count[name] = self._count.get(name, 0) + 1
            head = self._head.setdefault(name, [])
            if len(head) < self.head_points:
                head.append(value)
            if len(values) > 2 * self.max_points:
                del steps[: -self.max_points]
                del values[: -self.max_points]
        self.last_update = update
        self.last_step = step

    @property
    def empty(self) -> bool:
        """Whether no metric has arrived yet."""
        return not self._values

    def has(self, name: str) -> bool:
        """Whether ``name`` was ever recorded."""
        return name in self._values

    def count(self, name: str) -> int:
        """How many steps of ``name`` were ever recorded (not capped by ``max_points``)."""
        return self._count.get(name, 0)

    def values(self, name: str, last: int | None = None) -> np.ndarray:
        """The most recent ``last`` values of ``name`` (all kept ones when None), oldest first."""
        values = self._values.get(name, [])
        if last is not None:
            values = values[-last:] if last > 0 else []
        return np.asarray(values, dtype=float)

    def steps(self, name: str, last: int | None = None) -> np.ndarray:
        """The steps matching :meth:`values`."""
        steps = self._steps.get(name, [])
        if last is not None:
            steps = steps[-last:] if last > 0 else []
        return np.asarray(steps, dtype=np.int64)

    def head(self, name: str, n: int | None = None) -> np.ndarray:
        """The first ``n`` values ever recorded for ``name`` (at most ``head_points``)."""
        head = self._head.get(name, [])
        return np.asarray(head[:n] if n is not None else head, dtype=float)

    def latest(self, name: str) -> float | None:
        """The newest value of ``name``, or None."""
        values = self._values.get(name)
        return values[-1] if values else None

    def aligned(self, names: Sequence[str], last: int) -> tuple[np.ndarray, np.ndarray]:
        """Steps where every metric in ``names`` has a value, among the latest ``last`` of the first.

        Returns ``(steps, matrix)`` with ``matrix[i, j]`` the value of ``names[j]`` at ``steps[i]``.
        """
        if not names or not all(self.has(n) for n in names):
            return np.zeros(0, dtype=np.int64), np.zeros((0, len(names)))
        lookups = [dict(zip(self._steps[n][-2 * last :], self._values[n][-2 * last :])) for n in names[1:]]
        rows: list[tuple[int, list[float]]] = []
        for step, value in zip(self._steps[names[0]][-last:], self._values[names[0]][-last:]):
            others = [lk.get(step) for lk in lookups]
            if all(v is not None for v in others):
                rows.append((step, [value, *others]))  # type: ignore[list-item]
        if not rows:
            return np.zeros(0, dtype=np.int64), np.zeros((0, len(names)))
        return np.asarray([r[0] for r in rows]), np.asarray([r[1] for r in rows], dtype=float)

    def state_dict(self) -> dict[str, Any]:
        """Plain lists and numbers only (safe for ``torch.save`` and JSON)."""
        return {
            "max_points": self.max_points,
            "head_points": self.head_points,
            "steps": {k: list(v[-self.max_points :]) for k, v in self._steps.items()},
            "values": {k: list(v[-self.max_points :]) for k, v in self._values.items()},
            "head": {k: list(v) for k, v in self._head.items()},
            "count": dict(self._count),
            "last_step": self.last_step,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Inverse of :meth:`state_dict`."""
        self.max_points = int(state["max_points"])
        self.head_points = int(state["head_points"])
        self._steps = {k: [int(s) for s in v] for k, v in state["steps"].items()}
        self._values = {k: [float(x) for x in v] for k, v in state["values"].items()}
        self._head = {k: [float(x) for x in v] for k, v in state["head"].items()}
        self._count = {k: int(v) for k, v in state["count"].items()}
        self.last_step = state.get("last_step")
        self.last_update = {}
