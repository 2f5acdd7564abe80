"""End-of-run summary from ``metrics.csv``: what changed between the first and last 10%."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any


def read_metrics(path: str | Path) -> dict[int, dict[str, float]]:
    """``metrics.csv`` merged by step (Lightning writes train and val rows separately)."""
    merged: dict[int, dict[str, float]] = {}
    with Path(path).open(newline="") as handle:
        for row in csv.DictReader(handle):
            step = int(float(row["step"]))
            for key, value in row.items():
                if key != "step" and value not in ("", None):
                    merged.setdefault(step, {})[key] = float(value)
    return dict(sorted(merged.items()))


def _mean(values: list[float]) -> float:
    """Mean of the finite values (a step skipped for NaN logs NaN for what it did not measure)."""
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def summarize(run_dir: str | Path, wall_time_s: float | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Reward over the first vs last 10% of steps, accuracy, gap, wire ratio, time."""
    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.csv"
    summary: dict[str, Any] = {"run_dir": str(run_dir)}
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
    if wall_time_s is not None:
        summary["wall_time_s"] = wall_time_s
    summary.update(extra or {})
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def print_summary(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="run summary", show_header=False)
    for key, value in summary.items():
        table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    Console().print(table)
