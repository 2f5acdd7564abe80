"""Side by side on the embedded task: what compression costs and what the anchor buys back.

    python benchmarks/two_circuits.py                 # the nine recipes, 200 steps each
    python benchmarks/two_circuits.py --steps 100 --recipes dense shallow-compressed
    python benchmarks/two_circuits.py --recipes dense fast-only-lowrank --json   # JSON lines, no files
    python benchmarks/two_circuits.py --recipes dense fast-only-lowrank --set pipeline.rate=0.02
    python benchmarks/two_circuits.py --recipes dense "fast-only pipeline.codec=svd"   # per-recipe overrides

The supervised warm-up (identical for every recipe: same seed) runs once and its weights are
loaded by every run (`model.source=hf`), so the runs differ only in layout and anchor. Each run
reports its reward gain (mean reward over the last 10% of steps minus the first 10%) and the
boundary bytes it sent (fast circuit + anchor, shipped bases included) against what a dense
trainer would have sent for the same tokens, and its lowest 10-step mean reward. Writes
`docs/two-circuits-table.md` and `docs/img/two_circuits_reward.png`; with `--json` it prints one
JSON object per recipe per line instead (`recipe`, `gain`, `first`, `last`, `lowest`,
`bytes_share`: every byte between ranks, `wire/total_bytes`, against the dense boundary;
`fast_share`: the boundary alone; ...) and writes nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from tclightning.grpo.summary import read_metrics
from tclightning.models.warmup import cached_supervised_warmup
from tclightning.recipes.loader import load_recipe, to_dataclass
from tclightning.run import build_module, run

RECIPES = ["dense", "fast-only", "fast-only-lowrank", "shallow-compressed", "all-compressed", "anchor-20-20", "LA-WARMUP-V2",
           "robust-5-5", "robust-20-20"]
REPO = Path(__file__).resolve().parents[1]


def warm_start(directory: Path, steps: int, seed: int, overrides: Sequence[str] = ()) -> dict[str, float]:
    """The `tiny` recipe's warm-up (``overrides`` applied), once, saved as a Hugging Face directory."""
    recipe = to_dataclass(load_recipe("tiny", [f"trainer.steps={steps}", f"trainer.seed={seed}", *overrides]))
    module = build_module(recipe)
    # the warm-up cache (TCLIGHTNING_CACHE) makes a rerun with the same settings start at once
    stats = cached_supervised_warmup(
        module.policy, module.formatter, [e.prompt for e in module.train_examples],
        [e.solution for e in module.train_examples], recipe.model.warmup,
        {"benchmark": "two_circuits", "seed": seed, "overrides": list(overrides)}, accuracy=module._warmup_accuracy,
    )
    module.policy.save_pretrained(directory)
    module.tokenizer.save_pretrained(directory)
    return stats


def from_warm_start(model_dir: Path, steps: int, seed: int, root: str | Path, *extra: str) -> list[str]:
    """Recipe overrides that train from a saved warm start: no warm-up, no validation or checkpoints,
    no progress bar, runs under ``root``; ``extra`` overrides last."""
    return ["model.source=hf", f"model.name={model_dir}", "model.warmup.steps=0", f"trainer.steps={steps}",
            f"trainer.seed={seed}", "trainer.val_every=0", "trainer.checkpoint_every=0", "logging.progress=none",
            f"logging.root={root}", *extra]


def bytes_sent(rows: dict[int, dict[str, float]]) -> tuple[float, float, float, float]:
    """(fast-circuit boundary bytes, anchor bytes, every byte between ranks, dense-equivalent
    boundary bytes) summed over the run. Every byte is ``wire/total_bytes`` (across processes
    also the weight sync, the tied embedding and the rollouts; in one process the boundary and
    the anchor's pass)."""
    fast = sum(r.get("wire/bytes_fwd", 0.0) + r.get("wire/bytes_bwd", 0.0) for r in rows.values())
    anchor = sum(r.get("anchor/bytes", 0.0) for r in rows.values())
    total = sum(r.get("wire/total_bytes", 0.0) for r in rows.values()) or fast + anchor
    dense = sum(r.get("wire/dense_bytes_fwd", 0.0) + r.get("wire/dense_bytes_bwd", 0.0) for r in rows.values())
    return fast, anchor, total, dense


def lowest_mean(rows: dict[int, dict[str, float]], window: int = 10) -> float:
    """The lowest mean ``reward/mean`` over ``window`` consecutive steps (the whole run if shorter)."""
    curve = [r["reward/mean"] for _, r in sorted(rows.items()) if "reward/mean" in r]
    if not curve:
        return float("nan")
    width = min(window, len(curve))
    return min(sum(curve[i : i + width]) / width for i in range(len(curve) - width + 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="+", default=RECIPES)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "docs")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="recipe overrides applied to every run (after the recipe's own)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per recipe per line; write no files")
    args = parser.parse_args()
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else (lambda *a: print(*a, flush=True))

    results, curves = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        start = Path(tmp) / "warm"
        with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
            stats = warm_start(start, args.steps, args.seed)
        log(f"warm-up: {stats}")
        for name in args.recipes:
            recipe, *own = name.split()  # "fast-only pipeline.codec=svd": a recipe with its own overrides
            overrides = from_warm_start(start, args.steps, args.seed, f"{tmp}/runs", *args.set, *own)
            with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
                summary = run(recipe, overrides, quiet=True)  # the run's own lines stay off a JSON stdout
            rows = read_metrics(Path(summary["run_dir"]) / "metrics.csv")
            fast, anchor, total, dense = bytes_sent(rows)
            results.append({"recipe": name, "gain": summary["reward_gain"], "first": summary["reward_first_10pct"],
                            "last": summary["reward_last_10pct"], "gap": summary.get("gap/abs_mean", 0.0),
                            "bytes_share": total / dense if dense else 1.0,
                            "fast_share": fast / dense if dense else 1.0, "anchor_share": anchor / dense if dense else 0.0,
                            "lowest": lowest_mean(rows), "seconds": summary["wall_time_s"],
                            "overrides": list(args.set)})
            curves[name] = [r["reward/mean"] for _, r in sorted(rows.items())]
            if args.json:
                print(json.dumps(results[-1]), flush=True)
            else:
                print(results[-1], flush=True)
    if args.json:
        return

    dense_gain = next((r["gain"] for r in results if r["recipe"] == "dense"), None)
    lines = ["| recipe | reward first 10% | last 10% | gain | gain vs dense | mean gap/abs_mean | fast bytes | anchor bytes | total vs dense | wall s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        share = f"{r['gain'] / dense_gain:.0%}" if dense_gain else "n/a"
        lines.append(f"| {r['recipe']} | {r['first']:.3f} | {r['last']:.3f} | {r['gain']:+.3f} | {share} | {r['gap']:.3g} | "
                     f"{r['fast_share']:.1%} | {r['anchor_share']:.1%} | {r['bytes_share']:.1%} | {r['seconds']:.0f} |")
    table = "\n".join(lines)
    print(table)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    window = 10
    for name, curve in curves.items():
        smooth = [sum(curve[max(0, i - window + 1): i + 1]) / len(curve[max(0, i - window + 1): i + 1]) for i in range(len(curve))]
        ax.plot(smooth, label=name)
    ax.set_xlabel("RL step")
    ax.set_ylabel(f"reward/mean ({window}-step moving average)")
    ax.set_title("two circuits on the embedded task (same warm start, same seed)")
    ax.legend()
    (args.out / "img").mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out / "img" / "two_circuits_reward.png", dpi=120, bbox_inches="tight")
    (args.out / "two-circuits-table.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
