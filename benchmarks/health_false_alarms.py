"""Lead times on the collapse traces and false-alarm rates on stable traces, for the health detector.

    PYTHONPATH=. python benchmarks/health_false_alarms.py --seeds 200

Prints, per collapse trace: first warning step, the step the true accuracy is back below its
start, and the lead time between them (median / min over seeds). Per stable trace: the share of
runs with any warning (all rules, and without the standing ``gap.level`` warning that a codec
above the band raises by design), the share of run-steps in warning, and the number of runs
that ever reached ``collapsing`` (must be 0). ``--json`` prints the same numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np

from tclightning.health.detector import HealthDetector, replay
from tclightning.health.rules import HealthState
from tclightning.health.traces import COLLAPSE_TRACES, STABLE_TRACES

STANDING_RULES = ("gap.level",)


def lead_times(seeds: int) -> dict[str, dict[str, Any]]:
    """Per collapse trace: lead = collapse_step - first_warning_step over ``seeds`` seeds."""
    out: dict[str, dict[str, Any]] = {}
    for name, make in COLLAPSE_TRACES.items():
        leads, firsts, collapses, detected = [], [], [], []
        for seed in range(seeds):
            trace = make(seed)
            result = replay(trace.rows)
            first = result.first_warning_step
            firsts.append(first)
            collapses.append(trace.collapse_step)
            detected.append(result.first_collapse_step)
            if first is not None and trace.collapse_step is not None:
                leads.append(trace.collapse_step - first)
        arr = np.asarray(leads, dtype=float)
        out[name] = {
            "runs": seeds,
            "warned": int(sum(f is not None for f in firsts)),
            "lead_median": float(np.median(arr)) if arr.size else None,
            "lead_min": float(arr.min()) if arr.size else None,
            "lead_ge_10": int((arr >= 10).sum()),
            "first_warning_median": float(np.median([f for f in firsts if f is not None])) if any(
                f is not None for f in firsts) else None,
            "accuracy_below_start_median": float(np.median([c for c in collapses if c is not None])),
            "collapsing_verdict_median": float(np.median([d for d in detected if d is not None])) if any(
                d is not None for d in detected) else None,
        }
    return out


def false_alarms(seeds: int) -> dict[str, dict[str, Any]]:
    """Per stable trace: how often the detector warns or says collapsing."""
    out: dict[str, dict[str, Any]] = {}
    for name, make in STABLE_TRACES.items():
        any_warn = non_standing = collapsing = warn_steps = steps = 0
        rules: dict[str, int] = {}
        for seed in range(seeds):
            trace = make(10_000 + seed)
            detector = HealthDetector()
            verdicts = [detector.update(step, m) for step, m in trace.rows]
            steps += len(verdicts)
            warn_steps += sum(v.state_ignoring(STANDING_RULES) >= HealthState.WARNING for v in verdicts)
            any_warn += detector.first_warning_step is not None
            collapsing += detector.first_collapse_step is not None
            fired = {e.rule for e in detector.events if e.kind == "fired"}
            non_standing += bool(fired - set(STANDING_RULES))
            for rule in fired:
                rules[rule] = rules.get(rule, 0) + 1
        out[name] = {
            "runs": seeds,
            "steps_per_run": steps // seeds,
            "runs_with_any_warning": any_warn / seeds,
            "runs_with_warning_excl_standing_gap": non_standing / seeds,
            "step_share_in_warning_excl_standing_gap": warn_steps / steps,
            "runs_collapsing": collapsing,
            "rules_fired_runs": dict(sorted(rules.items())),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=200, help="seeds per trace kind (default 200)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    t0 = time.time()
    result = {"collapse": lead_times(args.seeds), "stable": false_alarms(args.seeds)}
    result["seconds"] = round(time.time() - t0, 1)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"collapse traces ({args.seeds} seeds each): lead = accuracy-below-start step - first warning step")
    for name, r in result["collapse"].items():
        print(f"  {name:22s} warned {r['warned']}/{r['runs']}  first warning (median) {r['first_warning_median']}  "
              f"accuracy below start (median) {r['accuracy_below_start_median']}  lead median {r['lead_median']} "
              f"min {r['lead_min']}  lead>=10 in {r['lead_ge_10']}/{r['runs']}  collapsing verdict (median) "
              f"{r['collapsing_verdict_median']}")
    print(f"stable traces ({args.seeds} seeds each)")
    for name, r in result["stable"].items():
        print(f"  {name:18s} {r['steps_per_run']} steps: runs with any warning {r['runs_with_any_warning']:.1%}, "
              f"excluding standing gap.level {r['runs_with_warning_excl_standing_gap']:.1%}, "
              f"step share in warning {r['step_share_in_warning_excl_standing_gap']:.3%}, "
              f"collapsing runs {r['runs_collapsing']}  rules: {r['rules_fired_runs']}")
    print(f"({result['seconds']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
