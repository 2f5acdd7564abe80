"""Replay the health detector over a library of real runs: collapses it must catch, healthy runs it must leave alone.

    PYTHONPATH=. python benchmarks/health_library.py            # replay, print the table
    PYTHONPATH=. python benchmarks/health_library.py --json     # one JSON object per run
    PYTHONPATH=. python benchmarks/health_library.py --generate # re-run the recipes (about an hour on 2 cores)

The library (``benchmarks/health_library/*.csv``) holds the ``metrics.csv`` of real runs of this
project's recipes on the embedded task, trimmed to the columns the health rules read. Each run is
one of :data:`RUNS`: the recipe, the overrides and whether it is meant as a collapse or as a
healthy run. For every run the replay prints

* ``fall``: the first step whose 3-step reward mean is more than 0.15 below the mean of the
  run's first 5 steps (a collapse as a user sees it on the reward curve; none for a healthy run);
* ``first warning`` / ``first collapsing``: the first step at which the detector's state
  (without :data:`STANDING_RULES`) reached warning / collapsing, with the rule that got there first;
* ``other warnings``: for a run that did not fall, every warning episode (false alarms); for one
  that fell, the episodes that began more than 10 steps before the fall (reported, not judged);
* ``gap.level``: the step of the standing-gap warning (0 for the PRF recipes), apart.

A run is judged by what it did, not by what its recipe was meant to do: one that fell must be
warned by its fall step + 1 and called collapsing by + 3; one that did not fall and was meant
as healthy must raise no warning and no collapse.

A healthy run of 200 steps is the first 200 steps of its 1000-step run (the learning rate has no
horizon: the same seed gives the same first 200 steps), so the replay cuts it from the longer file.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tclightning.health.detector import HealthDetector
from tclightning.health.io import read_metrics_csv
from tclightning.health.rules import HealthState

LIBRARY = Path(__file__).parent / "health_library"

FALL_DROP = 0.15
"""A run has fallen when its 3-step reward mean is this far below its first 5 steps' mean."""

STANDING_RULES = ("gap.level",)
"""A standing gap above its band is a warning known at step 0 (a 5% PRF codec); the table gives it
its own column, and the first warning is the first one from anything else."""

KEPT_COLUMNS = (
    "reward/mean", "reward/std", "reward/sem", "reward/count", "val/accuracy", "val/count",
    "response/length_mean", "response/length_max", "response/truncated_frac",
    "gap/abs_mean", "gap/k3", "gap/max", "gap/outside_5x_frac", "gap/prob_abs_mean",
    "policy/entropy", "policy/grad_norm", "policy/skipped_ticks", "policy/skipped_step", "loss/policy",
)


@dataclass(frozen=True)
class LibraryRun:
    """One run of the library: ``file`` under :data:`LIBRARY`, made by ``recipe`` with ``overrides``."""

    file: str
    recipe: str
    overrides: tuple[str, ...]
    kind: str  # "collapse" or "healthy"
    steps: int | None = None  # replay only the first ``steps`` rows (a 200-step view of a 1000-step file)

    @property
    def name(self) -> str:
        return self.file if self.steps is None else f"{self.file}@{self.steps}"


def _collapse(recipe: str, seed: int, steps: int, *extra: str, file: str | None = None) -> LibraryRun:
    name = file or f"{recipe}-s{seed}"
    return LibraryRun(name, recipe, (f"trainer.seed={seed}", f"trainer.steps={steps}", *extra), "collapse")


def _healthy(recipe: str, seed: int, steps: int | None = None, *extra: str, tag: str = "") -> LibraryRun:
    return LibraryRun(f"{recipe}{tag}-s{seed}-1000", recipe, (f"trainer.seed={seed}", "trainer.steps=1000", *extra),
                      "healthy", steps)


FLOAT_COEFFICIENTS = ("pipeline.bits=null", "pipeline.bits_lead=false", "pipeline.entropy_coding=false")
"""``fast-only-lowrank`` with float basis coefficients (6 a token) in place of its quantised ones, same bytes."""


RUNS: tuple[LibraryRun, ...] = (
    _collapse("shallow-compressed", 0, 100),
    _collapse("shallow-compressed", 1, 100),
    _collapse("all-compressed", 0, 100),
    _collapse("all-compressed", 1, 100),
    _collapse("anchor-20-20", 0, 100),
    _collapse("la-warmup-v2", 0, 100),
    _collapse("agentic-shallow", 0, 40),
    _collapse("tiny", 0, 30, "grpo.lr=1000.0", "trainer.checkpoint_every=1", file="tiny-lr1e3-s0"),
    *(_healthy(recipe, seed, steps) for recipe in ("tiny", "fast-only-lowrank", "fast-only-lowrank-half")
      for seed in (0, 1, 2) for steps in (200, None)),
    *(_healthy("fast-only-lowrank", seed, steps, *FLOAT_COEFFICIENTS, tag="-float") for seed in (0, 1, 2)
      for steps in (200, None)),
)


# ----------------------------------------------------------------------------- reading
def read_rows(path: Path, steps: int | None = None) -> list[tuple[int, dict[str, float]]]:
    """``(step, metrics)`` rows in step order (train and validation rows of a step merged), the
    first ``steps`` of them when given."""
    return [(s, m) for s, m in read_metrics_csv(path) if steps is None or s < steps]


def fall_step(rows: list[tuple[int, dict[str, float]]], drop: float = FALL_DROP) -> int | None:
    """First step whose 3-step reward mean is ``drop`` below the mean of the first 5 steps.

    A run that falls inside its first 7 steps would count its own fall in its start: there the
    start is the steps before the 3-step window (a run that breaks at step 1 falls at step 3,
    against step 0).
    """
    series = [(s, m["reward/mean"]) for s, m in rows if math.isfinite(m.get("reward/mean", math.nan))]
    values = np.asarray([v for _, v in series])
    for i in range(3, len(series)):
        start = values[: min(5, i - 2)].mean()
        if values[i - 2 : i + 1].mean() < start - drop:
            return series[i][0]
    return None


# ----------------------------------------------------------------------------- replay
def replay_run(run: LibraryRun) -> dict[str, Any]:
    """Replay one library run through the default detector; the numbers of the table."""
    rows = read_rows(LIBRARY / f"{run.file}.csv", run.steps)
    detector = HealthDetector()
    first_warning: tuple[int, str] | None = None
    first_collapse: tuple[int, str] | None = None
    episodes: list[tuple[int, str]] = []  # (step, rule) where the state (standing gap aside) became a warning
    previous = HealthState.HEALTHY
    for step, metrics in rows:
        verdict = detector.update(step, metrics)
        state = verdict.state_ignoring(STANDING_RULES)
        rules = [f.rule for f in verdict.findings if f.rule not in STANDING_RULES]
        if state >= HealthState.WARNING and first_warning is None:
            first_warning = (step, rules[0])
        if state >= HealthState.COLLAPSING and first_collapse is None:
            first_collapse = (step, rules[0])
        if state >= HealthState.WARNING and previous < HealthState.WARNING:
            episodes.append((step, rules[0]))
        previous = state
    fall = fall_step(rows)
    standing = [e.step for e in detector.events
                if e.rule in STANDING_RULES and e.kind in ("fired", "escalated") and e.severity != "info"]
    out: dict[str, Any] = {
        "run": run.name,
        "kind": run.kind,
        "recipe": run.recipe,
        "overrides": list(run.overrides),
        "steps": len(rows),
        "fall_step": fall,
        "first_warning_step": first_warning[0] if first_warning else None,
        "first_warning_rule": first_warning[1] if first_warning else None,
        "first_collapse_step": first_collapse[0] if first_collapse else None,
        "first_collapse_rule": first_collapse[1] if first_collapse else None,
        # a run that did not fall should raise none; one that fell may warn long before (reported, not judged)
        "other_warnings": [{"step": s, "rule": r} for s, r in episodes if fall is None or s < fall - 10],
        "standing_gap_warning_step": min(standing) if standing else None,
    }
    out["ok"] = verdict_ok(out)
    return out


def verdict_ok(result: dict[str, Any]) -> bool:
    """The acceptance of one run. A run that fell (whatever its recipe was meant to do): warned by
    its fall step + 1 and called collapsing by + 3. A healthy run that did not fall: no warning and
    no collapse, the standing gap included. A collapse recipe whose run did not fall: not called collapsing."""
    fall, warn, collapse = result["fall_step"], result["first_warning_step"], result["first_collapse_step"]
    if fall is not None:
        return warn is not None and warn <= fall + 1 and collapse is not None and collapse <= fall + 3
    if result["kind"] == "healthy":
        return warn is None and collapse is None and result["standing_gap_warning_step"] is None
    return collapse is None


def _cell(step: int | None, rule: str | None = None) -> str:
    return "--" if step is None else (f"{step} ({rule})" if rule else str(step))


def print_table(results: list[dict[str, Any]]) -> None:
    print("| run | meant as | steps | fall | first warning | first collapsing | other warnings | gap.level | ok |")
    print("| --- | --- | ---: | ---: | --- | --- | --- | ---: | --- |")
    for r in results:
        others = ", ".join(_cell(a["step"], a["rule"]) for a in r["other_warnings"]) or "--"
        print(f"| {r['run']} | {r['kind']} | {r['steps']} | {_cell(r['fall_step'])} | "
              f"{_cell(r['first_warning_step'], r['first_warning_rule'])} | "
              f"{_cell(r['first_collapse_step'], r['first_collapse_rule'])} | {others} | "
              f"{_cell(r['standing_gap_warning_step'])} | {'yes' if r['ok'] else 'NO'} |")


# ----------------------------------------------------------------------------- generating
def generate(runs: tuple[LibraryRun, ...], only: set[str] | None) -> None:
    """Run each library recipe (quietly, in a scratch folder) and keep its trimmed ``metrics.csv``."""
    from tclightning.run import run as run_recipe

    LIBRARY.mkdir(exist_ok=True)
    done: set[str] = set()
    for item in runs:
        if item.file in done or (only and item.file not in only):
            continue
        done.add(item.file)
        with tempfile.TemporaryDirectory() as scratch:
            print(f"[health library] {item.file}: tclightning run --recipe {item.recipe} {' '.join(item.overrides)}",
                  flush=True)
            try:
                run_recipe(item.recipe, [*item.overrides, f"logging.root={scratch}", "logging.loggers=[csv]"],
                           quiet=True)
            except Exception as err:  # a run that breaks (NaN twice in a row) keeps what it logged
                print(f"[health library] {item.file} ended with: {err}", flush=True)
            (metrics,) = Path(scratch).glob("*/*/metrics.csv")
            trim(metrics, LIBRARY / f"{item.file}.csv")


def trim(source: Path, target: Path) -> None:
    """Copy ``step`` and :data:`KEPT_COLUMNS` of a ``metrics.csv``, numbers at 6 significant digits."""
    with source.open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    columns = [c for c in KEPT_COLUMNS if rows and c in rows[0]]
    tmp = target.with_suffix(".csv.tmp")
    with tmp.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["step", *columns])
        for row in rows:
            cells = [row.get(c, "") for c in columns]
            if not any(cells):
                continue
            writer.writerow([row["step"], *(f"{float(v):.6g}" if v else "" for v in cells)])
    shutil.move(tmp, target)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="one JSON object per run")
    parser.add_argument("--generate", action="store_true", help="re-run the recipes into the library first")
    parser.add_argument("--only", default="", help="comma-separated library files to generate (default: all)")
    args = parser.parse_args(argv)
    if args.generate:
        generate(RUNS, {s for s in args.only.split(",") if s} or None)
    results = [replay_run(r) for r in RUNS if (LIBRARY / f"{r.file}.csv").is_file()]
    if args.json:
        for r in results:
            print(json.dumps(r))
    else:
        print_table(results)
        print(f"\n{sum(r['ok'] for r in results)} of {len(results)} runs as they should be")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
