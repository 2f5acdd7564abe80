"""Where a GRPO step's time goes for a recipe: sampling vs training, and tokens/s.

    python benchmarks/grpo_step.py                      # the default recipe, 40 RL steps
    python benchmarks/grpo_step.py --recipe tiny --steps 60 --json

Runs the recipe through the normal `run` path (its warm-up included, not timed) and reads the
per-step `time/sample_s`, `time/train_s` and `throughput/tokens_per_s` it logged; the first
`--skip` steps are dropped as warm-up of caches and allocators.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from tclightning.grpo.summary import read_metrics
from tclightning.run import run


def measure(recipe: str, steps: int, skip: int, overrides: list[str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as root:
        summary = run(
            recipe,
            [f"trainer.steps={steps}", "trainer.val_every=0", "trainer.checkpoint_every=0", "logging.progress=none",
             f"logging.root={root}", *overrides],
            quiet=True,
        )
        rows = [r for s, r in read_metrics(Path(summary["run_dir"]) / "metrics.csv").items() if s >= skip]
    sample = [r["time/sample_s"] for r in rows]
    train = [r["time/train_s"] for r in rows]
    tokens = [r["throughput/tokens_per_s"] for r in rows]
    return {
        "recipe": recipe,
        "steps_timed": len(rows),
        "sample_s_per_step": statistics.median(sample),
        "train_s_per_step": statistics.median(train),
        "step_s": statistics.median(s + t for s, t in zip(sample, train)),
        "sample_share": statistics.median(s / (s + t) for s, t in zip(sample, train)),
        "tokens_per_s": statistics.median(tokens),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="tiny")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--skip", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args()
    result = measure(args.recipe, args.steps, args.skip, args.overrides)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"| recipe | sample s/step | train s/step | step s | sampling share | completion tokens/s |")
    print("|---|---|---|---|---|---|")
    print(
        f"| {result['recipe']} | {result['sample_s_per_step']:.3f} | {result['train_s_per_step']:.3f} | "
        f"{result['step_s']:.3f} | {result['sample_share']:.0%} | {result['tokens_per_s']:.0f} |"
    )


if __name__ == "__main__":
    main()
