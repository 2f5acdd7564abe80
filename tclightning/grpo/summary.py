"""End-of-run summary from ``metrics.csv``: what changed between the first and last 10%, and the
health verdict (final state, first warning and first collapse with their rules, rollbacks, stops)."""

from __future__ import annotations

import io
import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from tclightning.files import SameFolder, open_regular, regular_file, replace_text
from tclightning.health.io import METRICS_MAX_BYTES, metrics_rows

HEALTH_LABELS = ("healthy", "warning", "collapsing")
"""``health/state`` values 0, 1, 2 by name."""


def read_metrics(path: str | Path) -> dict[int, dict[str, float]]:
    """``metrics.csv`` merged by step (Lightning writes train and val rows separately). A row cut
    short before its ``step`` cell (a crash in the middle of an append) is left out, and so is one
    of more cells than the header (its cells cannot be told apart) or with no step number; a cell
    that is no number is skipped."""
    merged: dict[int, dict[str, float]] = {}
    regular_file(path, "metrics", METRICS_MAX_BYTES)  # 8 GiB of rows: refused; a FIFO named, never opened
    with io.TextIOWrapper(open_regular(path, "metrics", METRICS_MAX_BYTES), newline="") as handle:
        for row in metrics_rows(handle):
            step_number = _cell_number(row.get("step") or "")
            if step_number is None or not math.isfinite(step_number) or None in row:
                continue
            step = int(step_number)
            for key, value in row.items():
                if key != "step" and value not in ("", None) and (number := _cell_number(value)) is not None:
                    merged.setdefault(step, {})[key] = number
    return dict(sorted(merged.items()))


def _cell_number(cell: str) -> float | None:
    """A cell as a number, or None for one that is not (a cell damaged by hand or by a disk)."""
    try:
        return float(cell)
    except ValueError:
        return None


def _mean(values: list[float]) -> float:
    """Mean of the finite values (a step skipped for NaN logs NaN for what it did not measure)."""
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def _label(value: float) -> str:
    """``health/state`` by name; negative (-1: no monitor has seen its metrics) is ``"no data"``."""
    if not math.isfinite(value) or value < 0:
        return "no data"
    return HEALTH_LABELS[min(int(value), len(HEALTH_LABELS) - 1)]


def _first_event(monitors: Iterable[Any], severities: tuple[str, ...]) -> dict[str, Any] | None:
    """The earliest fired/escalated event at one of ``severities`` over every monitor's detector."""
    best: Any = None
    for monitor in monitors:
        for event in monitor.detector.events:
            if event.kind in ("fired", "escalated") and event.severity in severities:
                if best is None or event.step < best.step:
                    best = event
                break  # events are in step order: the first match is this monitor's earliest
    if best is None:
        return None
    return {"step": int(best.step), "rule": best.rule, "message": best.message}


def health_summary(rows: Mapping[int, Mapping[str, float]], monitors: Iterable[Any] = ()) -> dict[str, Any]:
    """The run's health verdict for ``summary.json`` and the printed summary.

    ``rows``: ``metrics.csv`` merged by step (:func:`read_metrics`); ``monitors``: the run's health
    callbacks (objects with a ``detector`` holding ``events``, and ``rollbacks``, ``stopped_at``;
    anything else is ignored). Returns ``{"state", "first_warning", "first_collapse", "rollbacks",
    "stopped"}``: ``state`` is the ``health/state`` of the last step that logged it (else the
    monitors' worst state, else ``"not monitored"``; ``"no data"`` for -1: no monitor saw its
    metrics); ``first_warning`` / ``first_collapse`` are
    ``{"step", "rule", "message"}`` or ``None`` -- the step is the first ``health/state`` of at least
    1 / 2 in ``metrics.csv``, the rule and message come from the monitors' events (``None`` when the
    run's monitors are not at hand, e.g. a summary rebuilt from the CSV alone); ``rollbacks`` is
    the total over monitors (the last ``health/*_rollbacks`` values when only the CSV is there);
    ``stopped`` is ``{"step", "reason"}`` when a monitor stopped training, else ``None``.
    """
    monitors = [m for m in monitors if hasattr(getattr(m, "detector", None), "events")]
    states = [(step, row["health/state"]) for step, row in rows.items() if "health/state" in row]
    if not states and not monitors:
        return {"state": "not monitored", "first_warning": None, "first_collapse": None, "rollbacks": 0, "stopped": None}
    out: dict[str, Any] = {}
    if states:
        out["state"] = _label(states[-1][1])
    else:
        out["state"] = _label(float(max(int(m.detector.state) for m in monitors)))
    for key, severities, level in (("first_warning", ("warning", "collapsing"), 1), ("first_collapse", ("collapsing",), 2)):
        event = _first_event(monitors, severities)
        csv_step = next((step for step, value in states if math.isfinite(value) and value >= level), None)
        if csv_step is not None and (event is None or event["step"] != csv_step):
            # the CSV is what the user's logs show; keep a rule only if it names that same step
            event = {"step": csv_step, "rule": None, "message": None}
        out[key] = event
    if monitors:
        out["rollbacks"] = sum(int(getattr(m, "rollbacks", 0)) for m in monitors)
    else:
        last: dict[str, float] = {}
        for row in rows.values():
            last.update({k: v for k, v in row.items() if k.startswith("health/") and k.endswith("_rollbacks")})
        out["rollbacks"] = int(sum(v for v in last.values() if math.isfinite(v)))
    stops = [
        {"step": int(e.step), "reason": e.message}
        for m in monitors for e in m.detector.events if e.kind == "stopped"
    ]
    out["stopped"] = min(stops, key=lambda s: s["step"]) if stops else None
    return out


def summarize(
    run_dir: str | Path,
    wall_time_s: float | None = None,
    extra: dict[str, Any] | None = None,
    monitors: Iterable[Any] = (),
) -> dict[str, Any]:
    """Reward over the first vs last 10% of steps, accuracy, gap, wire ratio, time, and
    ``health`` (:func:`health_summary` of ``metrics.csv`` and the run's health ``monitors``);
    written to ``run_dir/summary.json`` and returned."""
    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.csv"
    summary: dict[str, Any] = {"run_dir": str(run_dir)}
    rows: dict[int, dict[str, float]] = {}
    if metrics_path.is_file():
        rows = read_metrics(metrics_path)
        rewards = [(s, r["reward/mean"]) for s, r in rows.items() if "reward/mean" in r]
        tenth = max(1, len(rewards) // 10)
        first, last = _mean([r for _, r in rewards[:tenth]]), _mean([r for _, r in rewards[-tenth:]])
        accuracy = [(s, r["val/accuracy"]) for s, r in rows.items() if "val/accuracy" in r]
        summary.update(
            steps=len(rewards),
            reward_first_10pct=first,
            reward_last_10pct=last,
            reward_gain=last - first,
            val_accuracy_first=accuracy[0][1] if accuracy else None,
            val_accuracy_last=accuracy[-1][1] if accuracy else None,
            response_length_last_10pct=_mean([r.get("response/length_mean", math.nan) for _, r in list(rows.items())[-tenth:]]),
        )
        for key in ("gap/abs_mean", "gap/k3", "wire/ratio"):
            values = [r[key] for r in rows.values() if key in r]
            if values:
                summary[key] = _mean(values)
    summary["health"] = health_summary(rows, monitors)
    if wall_time_s is not None:
        summary["wall_time_s"] = wall_time_s
    summary.update(extra or {})
    with SameFolder(run_dir).held() as folder:  # the run's folder, held: never one put in its place
        replace_text(folder / "summary.json", json.dumps(summary, indent=2))
    return summary


def health_lines(health: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(label, text)`` rows of the printed summary for a :func:`health_summary` dict."""

    def event(value: Mapping[str, Any] | None) -> str:
        if value is None:
            return "none"
        rule = f" ({value['rule']}: {value['message']})" if value.get("rule") else ""
        return f"step {value['step']}{rule}"

    if health["state"] == "not monitored":
        return [("health", "not monitored (no health callbacks, no health/state in metrics.csv)")]
    if health["state"] == "no data":
        lines = [("health", "no data at the last step (the health monitors saw none of the metrics they read)")]
    else:
        lines = [("health", f"{health['state']} at the last step")]
    lines += [("health first warning", event(health.get("first_warning"))),
              ("health first collapse", event(health.get("first_collapse")))]
    if health.get("rollbacks"):
        lines.append(("health rollbacks", str(health["rollbacks"])))
    if health.get("stopped"):
        lines.append(("health stopped training", f"step {health['stopped']['step']} ({health['stopped']['reason']})"))
    return lines


def print_summary(summary: dict[str, Any]) -> None:
    """The summary as a two-column table on the console (health as its own rows)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    colour = {"healthy": "green", "warning": "yellow", "collapsing": "red"}
    table = Table(title="run summary", show_header=False)
    for key, value in summary.items():
        if key == "health" and isinstance(value, Mapping):
            for label, text in health_lines(value):
                style = colour.get(value["state"], "") if label == "health" else ""
                table.add_row(label, f"[{style}]{escape(text)}[/]" if style else escape(text))
            continue
        table.add_row(key, f"{value:.4g}" if isinstance(value, float) else escape(str(value)))
    Console().print(table)
