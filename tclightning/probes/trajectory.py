"""Rank-1 trajectory analysis of saved weight points (RELEX-style, as in the original
experiments: docs/trajectory.md).

Input: the points ``x_0 .. x_{n-1}`` a :class:`~tclightning.callbacks.trajectory.TrajectoryRecorder`
wrote (``<run_dir>/trajectory/point-*.pt``), in step order; steps ``d_t = x_{t+1} - x_t``.
All metrics in float64 (definitions also in docs/trajectory.md):

* ``evr1``: variance explained by the top direction ``u`` of the centred trajectory:
  ``sigma_1^2 / sum_i sigma_i^2`` of ``X - mean(X)``. ``u`` is oriented along the travel
  (``u . (x_last - x_0) >= 0``). A straight line gives 1.
* ``off_line_share``: share of the net move off that line, in energy:
  ``1 - (u . D)^2 / |D|^2`` with ``D = x_last - x_0``. ``off_line_share_path``: the same over the
  path, ``sum_t |d_t - (u . d_t) u|^2 / sum_t |d_t|^2``.
* ``early_late_cos``: ``|cos(u_early, u_late)|``, the top directions of the first half
  ``x_0..x_h`` and the second half ``x_h..x_{n-1}`` (``h = (n - 1) // 2``, both centred).
* ``step_alignment``: mean over steps of ``|cos(d_t, u)|``.
* ``op_ratio`` (forward linear projectability): mean over ``t = 1..n-2`` of
  ``|x_{t+1} - (2 x_t - x_{t-1})| / |x_{t+1} - x_t|`` — the error of predicting the next point by
  linear extrapolation of the last two, relative to the error of predicting no move. 0 on a
  line walked at constant speed; ~sqrt(2) for a random walk; below 1 means linear extrapolation
  beats do-nothing.
* ``op_ratio_damped``, ``gamma``: the same with the best fixed damping,
  ``x_{t+1} ~ x_t + gamma d_{t-1}``, ``gamma = clip(sum_t d_t . d_{t-1} / sum_t |d_{t-1}|^2, 0, 1)``;
  ``<= ~1`` (``gamma = 0`` is do-nothing), the original experiments' "op ratio 0.90 -> 1.00"
  (GSM8K -> Big-Math).

Steps with a zero denominator are skipped; a metric that needs more points than there are is
``None`` (EVR₁ needs 2 points, ``op_ratio`` 3, ``early_late_cos`` 4).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from tclightning.console import shown
from tclightning.errors import TclightningError
from tclightning.files import open_regular, regular_file, replace_text, save_figure
from tclightning.tensor_files import (FLOAT_DTYPES, BrokenTensorFile, RefusedTensorFile, load_checked,
                                      thin_tensor)

METRICS = (
    "evr1", "off_line_share", "off_line_share_path", "early_late_cos", "step_alignment",
    "op_ratio", "op_ratio_damped", "gamma",
)


MAX_POINTS = 2000
"""The most trajectory points analysed (a point every 10 steps of a 20,000-step run): counted before
any is read."""


def load_trajectory(path: str | Path) -> tuple[list[int], Tensor, dict[str, Any]]:
    """``(steps, X, meta)`` from a run directory (its ``trajectory/``) or a folder of ``point-*.pt``."""
    root = Path(path)
    folder = root / "trajectory" if (root / "trajectory").is_dir() else root
    files = sorted(folder.glob("point-*.pt"))
    if len(files) > MAX_POINTS:
        raise TclightningError(f"{folder}: {len(files)} trajectory points, more than the {MAX_POINTS} analysed "
                               "(each is loaded whole; about 4 ms a point); give it a folder of the points you want")
    if not files:
        raise TclightningError(
            f"{path}: no trajectory points (point-*.pt); record them with the TrajectoryRecorder callback"
        )
    records = [_point(f) for f in files]
    records.sort(key=lambda r: r["step"])
    dims = {int(r["point"].numel()) for r in records}
    if len(dims) != 1:
        raise TclightningError(f"{folder}: points of different sizes {sorted(dims)}; record one run with one setting")
    steps = [int(r["step"]) for r in records]
    twice = next((step for step, following in zip(steps, steps[1:]) if step == following), None)
    if twice is not None:  # a trajectory has one point a step: two folders' points mixed, or files copied
        raise TclightningError(f"{folder}: two points of step {twice}; record one run into one folder")
    first = records[0]
    meta = {k: first.get(k) for k in POINT_FIELDS}
    for record in records[1:]:  # another seed is another random projection; another model, another space
        other = next((k for k in POINT_FIELDS if record.get(k) != meta[k]), None)
        if other is not None:
            raise TclightningError(f"{folder}: points of different sketches (step {first['step']} has {other} "
                                   f"{meta[other]!r}, step {record['step']} has {other} {record.get(other)!r}); "
                                   "record one run with one setting into one folder")
    return steps, torch.stack([r["point"].double() for r in records]), meta


POINT_FIELDS = ("unit", "method", "dim", "seed", "num_params")
"""What a trajectory point records beside its step and point (each a plain value)."""


MAX_COORDINATE = 1e100
"""The largest magnitude a point's value may have: squared and summed over any model's size it stays
finite in float64 (a weight is a few units at most)."""


def _point(path: Path) -> dict[str, Any]:
    """One trajectory point, read as data only: a record with a whole ``step`` and a 1-D finite
    float ``point``; one line naming the file otherwise (a FIFO named point-*.pt is never opened)."""
    regular_file(path, "trajectory point")  # a FIFO named point-*.pt is never opened
    try:
        with open_regular(path, "trajectory point") as opened:  # checked as read: a file swapped in is refused
            record = load_checked(opened)  # checked before torch.load runs a single call of its pickle
    except (RefusedTensorFile, BrokenTensorFile) as err:
        raise TclightningError(f"trajectory point {path}: {err}") from None
    except Exception as err:  # noqa: BLE001 - garbage, cut short, a pickle asking for code: the file, not a bug
        raise TclightningError(f"trajectory point {path}: not a point file ({type(err).__name__})") from None
    point = record.get("point") if isinstance(record, dict) else None
    if not isinstance(point, Tensor):  # before any walk: a list holding itself has no end
        raise TclightningError(f"trajectory point {path}: its point is not a tensor, as TrajectoryRecorder writes")
    meta = {key: record.get(key) for key in POINT_FIELDS}
    if not all(value is None or isinstance(value, int) or (isinstance(value, str) and len(value) <= 200)
               or (isinstance(value, float) and math.isfinite(value)) for value in meta.values()):
        raise TclightningError(f"trajectory point {path}: its {', '.join(POINT_FIELDS)} are not plain short values "
                               "(finite numbers, short text), as TrajectoryRecorder writes")  # the report holds them
    thin = thin_tensor(point)
    if thin is not None:  # before any value is read: a stride of 0 expands one number to any size
        raise TclightningError(f"trajectory point {path}: {thin}, which torch.save never writes")
    step = record.get("step") if isinstance(record, dict) else None
    if type(step) is not int or step < 0 or not isinstance(point, Tensor) or point.dim() != 1 \
            or point.dtype not in FLOAT_DTYPES or point.numel() < 2 or not bool(torch.isfinite(point).all()):
        raise TclightningError(f"trajectory point {path}: not a point (a whole step >= 0 and a 1-D finite float "
                               "point of at least 2 values, as TrajectoryRecorder writes)")
    if float(point.abs().max()) > MAX_COORDINATE:  # its squared distances would overflow to inf
        raise TclightningError(f"trajectory point {path}: a value past {MAX_COORDINATE:g} in magnitude, which no "
                               "model's weights hold (the analysis squares them)")
    return {**record, "point": point.detach()}  # a Parameter, or a tensor that requires grad, is its values here


def _top(x: Tensor) -> tuple[Tensor, Tensor]:
    """(unit top direction oriented along travel, squared singular values) of the centred rows of ``x``."""
    xc = x - x.mean(dim=0, keepdim=True)
    # economy SVD through the small Gram matrix: n x n, never D x D
    vals, vecs = torch.linalg.eigh(xc @ xc.T)
    vals = vals.clamp(min=0).flip(0)
    u = xc.T @ vecs[:, -1]
    norm = u.norm()
    u = u / norm if norm > 0 else u
    if float(u @ (x[-1] - x[0])) < 0:
        u = -u
    return u, vals


def _cos(a: Tensor, b: Tensor) -> float | None:
    na, nb = a.norm(), b.norm()
    return None if na == 0 or nb == 0 else float((a @ b) / (na * nb))


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def analyze_points(x: Tensor) -> dict[str, Any]:
    """The metrics of the module doc for the trajectory ``x`` (``n x D``), plus per-step series."""
    x = x.double()
    n = x.shape[0]
    out: dict[str, Any] = {name: None for name in METRICS}
    out["points"] = n
    series: dict[str, list[float | None]] = {"step_alignment": [], "op_ratio": []}
    out["series"] = series
    if n < 2:
        return out
    u, sq = _top(x)
    total = float(sq.sum())
    out["evr1"] = float(sq[0]) / total if total > 0 else None
    net = x[-1] - x[0]
    if float(net.norm()) > 0:
        out["off_line_share"] = max(0.0, 1.0 - float(u @ net) ** 2 / float(net @ net))
    d = x[1:] - x[:-1]
    along = d @ u
    path = float((d * d).sum())
    if path > 0:
        out["off_line_share_path"] = max(0.0, 1.0 - float((along**2).sum()) / path)
    for step in d:
        c = _cos(step, u)
        series["step_alignment"].append(None if c is None else abs(c))
    out["step_alignment"] = _mean([v for v in series["step_alignment"] if v is not None])
    if n >= 3:
        ratios, num, den = [], 0.0, 0.0
        for t in range(1, n - 1):
            move = float(d[t].norm())
            error = float((d[t] - d[t - 1]).norm())  # x_{t+1} - (2 x_t - x_{t-1})
            ratio = error / move if move > 0 else None
            series["op_ratio"].append(ratio)
            if ratio is not None:
                ratios.append(ratio)
            num += float(d[t] @ d[t - 1])
            den += float(d[t - 1] @ d[t - 1])
        out["op_ratio"] = _mean(ratios)
        gamma = min(max(num / den, 0.0), 1.0) if den > 0 else 0.0
        out["gamma"] = gamma
        damped = [float((d[t] - gamma * d[t - 1]).norm() / d[t].norm()) for t in range(1, n - 1) if d[t].norm() > 0]
        out["op_ratio_damped"] = _mean(damped)
    if n >= 4:
        h = (n - 1) // 2
        c = _cos(_top(x[: h + 1])[0], _top(x[h:])[0])
        out["early_late_cos"] = None if c is None else abs(c)
    return out


def analyze_run(path: str | Path) -> dict[str, Any]:
    """Load a run's trajectory and analyse it: metrics, ``steps``, ``meta`` and per-step ``series``."""
    return _analyze(path)[0]


def _analyze(path: str | Path) -> tuple[dict[str, Any], Tensor]:
    steps, x, meta = load_trajectory(path)
    report = analyze_points(x)
    report.update(path=str(path), steps=steps, meta=meta)
    if report["points"] < 3:
        report["note"] = f"only {report['points']} points: record more (TrajectoryRecorder every=...) for all metrics"
    return report, x


def _fmt(value: float | None) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.4f}"


def to_markdown(report: dict[str, Any]) -> str:
    """A markdown summary: one table of the metrics with their meaning."""
    meta = {key: shown(str(value)) for key, value in report.get("meta", {}).items()}  # written by the run: any text
    steps = report.get("steps", [])
    span = f"{steps[0]}..{steps[-1]}" if steps else "-"
    lines = [
        f"# Trajectory analysis: `{shown(str(report.get('path', '')))}`",
        "",
        (
            f"{report['points']} points ({meta.get('unit', 'step')} {span}), {meta.get('method')} of "
            f"{meta.get('num_params')} parameters to {meta.get('dim')} numbers."
        ),
        "",
        "| metric | value | meaning |",
        "| --- | --- | --- |",
        f"| EVR₁ | {_fmt(report['evr1'])} | variance of the centred trajectory along its top direction u |",
        f"| off-line share (net) | {_fmt(report['off_line_share'])} | energy share of x_last − x_0 off u |",
        f"| off-line share (path) | {_fmt(report['off_line_share_path'])} | energy share of the per-step moves off u |",
        f"| early/late \\|cos\\| | {_fmt(report['early_late_cos'])} | top direction of the first half vs the second |",
        f"| step alignment | {_fmt(report['step_alignment'])} | mean \\|cos(x_t+1 − x_t, u)\\| |",
        f"| op ratio (linear) | {_fmt(report['op_ratio'])} | mean ‖x_t+1 − (2x_t − x_t−1)‖ / ‖x_t+1 − x_t‖; <1 beats do-nothing |",
        f"| op ratio (damped) | {_fmt(report['op_ratio_damped'])} | same with x_t + γ(x_t − x_t−1), best fixed γ = {_fmt(report['gamma'])} |",
    ]
    if report.get("note"):
        lines += ["", f"Note: {report['note']}."]
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], x: Tensor, path: str | Path, name: str = "") -> Path:
    """PNG: the trajectory on its top two directions, per-step alignment and per-step op ratio,
    each panel with labelled axes, under a title naming the run (``name``), points and steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = x.double()
    xc = x - x.mean(dim=0, keepdim=True)
    vals, vecs = torch.linalg.eigh(xc @ xc.T)
    coords = vecs[:, -2:].flip(1) * vals[-2:].flip(0).clamp(min=0).sqrt()  # PC scores
    steps = report.get("steps") or list(range(x.shape[0]))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    ax = axes[0]
    pc2 = coords[:, 1] if coords.shape[1] > 1 else torch.zeros(len(coords))
    ax.plot(coords[:, 0].numpy(), pc2.numpy(), "-o", markersize=3)
    ax.set(title=f"trajectory on PC1/PC2 (EVR₁ {_fmt(report['evr1'])})", xlabel="PC1", ylabel="PC2")
    ax = axes[1]
    align = report["series"]["step_alignment"]
    ax.plot(steps[1 : 1 + len(align)], [float("nan") if v is None else v for v in align], "-o", markersize=3)
    ax.set(title=f"update alignment with the line (mean {_fmt(report['step_alignment'])})", xlabel="step",
           ylabel="|cos(update, top direction u)|", ylim=(0, 1.05))
    ax = axes[2]
    ratio = report["series"]["op_ratio"]
    ax.plot(steps[2 : 2 + len(ratio)], [float("nan") if v is None else v for v in ratio], "-o", markersize=3)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set(title=f"forward projectability (mean {_fmt(report['op_ratio'])})", xlabel="step",
           ylabel="error: extrapolation / no move")  # below the dashed 1: extrapolating helps
    of = f" of {name}" if name else ""
    fig.suptitle(f"rank-1 weight trajectory{of}: {x.shape[0]} points, steps {steps[0]}-{steps[-1]}")
    fig.tight_layout()
    out = Path(path)
    save_figure(fig, out, dpi=100)
    plt.close(fig)
    return out


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> tuple[dict[str, Any], dict[str, Path]]:
    """Analyse ``run_dir`` and write ``trajectory.json``, ``trajectory.md``, ``trajectory.png`` to ``out_dir``
    (default ``<run_dir>/analysis``); returns the report and the paths."""
    report, x = _analyze(run_dir)
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / "analysis"
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "trajectory.json", "markdown": out / "trajectory.md", "png": out / "trajectory.png"}
    replace_text(paths["json"], json.dumps(report, indent=2, allow_nan=False) + "\n")
    replace_text(paths["markdown"], to_markdown(report))
    plot(report, x, paths["png"], name=Path(run_dir).resolve().name)
    return report, paths
