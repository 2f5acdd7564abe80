"""Side by side on the embedded task: what compression costs and what the anchor buys back.

    python benchmarks/two_circuits.py                 # the six recipes, 200 steps each
    python benchmarks/two_circuits.py --steps 100 --recipes dense shallow-compressed

The supervised warm-up (identical for every recipe: same seed) runs once and its weights are
loaded by every run (`model.source=hf`), so the runs differ only in layout and anchor. Each run
reports its reward gain (mean reward over the last 10% of steps minus the first 10%) and the
boundary bytes it sent (fast circuit + anchor) against what a dense trainer would have sent for
the same tokens. Writes `docs/two-circuits.md` (table) and `docs/img/two_circuits_reward.png`.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from pathlib import Path

from tclightning.grpo.summary import read_metrics
from tclightning.models.warmup import supervised_warmup
from tclightning.recipes.loader import load_recipe, to_dataclass
from tclightning.run import build_module, run

RECIPES = ["dense", "fast-only", "shallow-compressed", "all-compressed", "anchor-20-20", "LA-WARMUP-V2"]
REPO = Path(__file__).resolve().parents[1]


def warm_start(directory: Path, steps: int, seed: int, overrides: Sequence[str] = ()) -> dict[str, float]:
    """The `tiny` recipe's warm-up (``overrides`` applied), once, saved as a Hugging Face directory."""
    recipe = to_dataclass(load_recipe("tiny", [f"trainer.steps={steps}", f"trainer.seed={seed}", *overrides]))
    module = build_module(recipe)
    stats = supervised_warmup(
        module.policy, module.formatter, [e.prompt for e in module.train_examples],
        [e.solution for e in module.train_examples], recipe.model.warmup, accuracy=module._warmup_accuracy,
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


def bytes_sent(rows: dict[int, dict[str, float]]) -> tuple[float, float, float]:
    """(fast-circuit bytes, anchor bytes, dense-equivalent bytes) summed over the run."""
    fast = sum(r.get("wire/bytes_fwd", 0.0) + r.get("wire/bytes_bwd", 0.0) for r in rows.values())
    anchor = sum(r.get("anchor/bytes", 0.0) for r in rows.values())
    dense = sum(r.get("wire/dense_bytes_fwd", 0.0) + r.get("wire/dense_bytes_bwd", 0.0) for r in rows.values())
    return fast, anchor, dense


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="+", default=RECIPES)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "docs")
    args = parser.parse_args()

    results, curves = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        start = Path(tmp) / "warm"
        stats = warm_start(start, args.steps, args.seed)
        print(f"warm-up: {stats}")
        for name in args.recipes:
            summary = run(name, from_warm_start(start, args.steps, args.seed, f"{tmp}/runs"), quiet=True)
            rows = read_metrics(Path(summary["run_dir"]) / "metrics.csv")
            fast, anchor, dense = bytes_sent(rows)
            results.append({"recipe": name, "gain": summary["reward_gain"], "first": summary["reward_first_10pct"],
                            "last": summary["reward_last_10pct"], "gap": summary.get("gap/abs_mean", 0.0),
                            "bytes_share": (fast + anchor) / dense if dense else 1.0,
                            "fast_share": fast / dense if dense else 1.0, "anchor_share": anchor / dense if dense else 0.0,
                            "seconds": summary["wall_time_s"]})
            curves[name] = [r["reward/mean"] for _, r in sorted(rows.items())]
            print(results[-1], flush=True)

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
