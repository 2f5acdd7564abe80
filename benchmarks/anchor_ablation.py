"""Where the two-circuit collapse on the embedded task comes from: the merger with and without compression.

    python benchmarks/anchor_ablation.py                  # about 10 minutes on the 2-core CI machine
    python benchmarks/anchor_ablation.py --steps 100 --only dense-layout-5-5
    python benchmarks/anchor_ablation.py --only "robust-5-5" "lowrank control_variate 5/5"
    python benchmarks/anchor_ablation.py --only robust-5-5 --set pipeline.bits=null pipeline.bits_lead=false pipeline.entropy_coding=false

Every run starts from the same supervised warm-up (the `tiny` recipe's, run once, one thread, as in
`benchmarks/two_circuits.py`) and trains `--steps` RL steps of the `shallow-compressed` recipe with one
change each. The rows with `pipeline.layout=dense` keep the signed_ema merger and its anchor but
compress nothing, so `G_comp` *is* the fresh dense gradient: whatever they lose is the merger's, not
the codec's. The rows after `dense P=64` measure the merger that corrects instead of overriding
(`control_variate`) and the anchor controller, on the PRF recipe and on the low-rank fast circuit
(`fast-only-lowrank`, whose gradient carries signal); `callbacks=[]` runs `robust-5-5`'s merger
without its controller. (The retired `masked` and `trust` mergers' results are in
docs/anchor-ablation-table.md.) Prints one JSON line per run and a markdown table;
`--out FILE` writes the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch
from two_circuits import bytes_sent, from_warm_start, warm_start

from tclightning.grpo.summary import read_metrics
from tclightning.run import run

# (label, recipe, overrides)
ABLATION: list[tuple[str, str, list[str]]] = [
    ("dense (control)", "dense", []),
    ("shallow-compressed 5/5", "shallow-compressed", []),
    ("dense-layout-5-5", "shallow-compressed", ["pipeline.layout=dense"]),
    ("dense-layout K=5 C=1", "shallow-compressed", ["pipeline.layout=dense", "anchor.latency=5", "anchor.cadence=1"]),
    ("dense-layout K=0 C=5", "shallow-compressed", ["pipeline.layout=dense", "anchor.latency=0", "anchor.cadence=5"]),
    ("dense-layout K=1 C=1", "shallow-compressed", ["pipeline.layout=dense", "anchor.latency=1", "anchor.cadence=1"]),
    ("shallow beta=0.5", "shallow-compressed", ["anchor.beta=0.5"]),
    ("shallow P=64", "shallow-compressed", ["grpo.prompts_per_step=64"]),
    ("dense P=64", "dense", ["grpo.prompts_per_step=64"]),
    # mergers that correct instead of override, and the anchor controller (docs/two-circuits.md)
    ("shallow control_variate 5/5", "shallow-compressed", ["anchor.merger=control_variate", "anchor.beta=0.5",
                                                           "anchor.control_variate.clip=0.25"]),
    ("shallow 5/5 + controller", "shallow-compressed", ["callback_presets=[monitoring,anchor-controller]"]),
    ("fast-only-lowrank", "fast-only-lowrank", []),
    ("lowrank signed_ema 5/5", "all-compressed-lowrank", []),
    ("lowrank control_variate 5/5", "robust-5-5", ["callbacks=[]"]),
    ("lowrank control_variate weight 0", "robust-5-5", ["callbacks=[]", "anchor.control_variate.weight=0"]),
    ("robust-5-5", "robust-5-5", []),
    ("robust-20-20", "robust-20-20", []),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="+", help="labels to run (default: all)")
    parser.add_argument("--out", type=Path, help="write the markdown table here")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="recipe overrides applied to every run (after the row's own), e.g. pipeline.bits=null "
                             "pipeline.bits_lead=false pipeline.entropy_coding=false for the float-coefficient rows")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one thread: results do not depend on the machine's load

    lines = ["| run | overrides | reward first 10% | last 10% | gain | lowest 10-step mean | sign agreement | bytes vs dense |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    with tempfile.TemporaryDirectory() as tmp:
        start = Path(tmp) / "warm"
        print("warm-up:", warm_start(start, 200, args.seed), flush=True)
        for label, recipe, overrides in ABLATION:
            if args.only and label not in args.only:
                continue
            summary = run(recipe, from_warm_start(start, args.steps, args.seed, f"{tmp}/runs", "trainer.num_threads=1",
                                                  *overrides, *args.set), quiet=True)
            rows = read_metrics(Path(summary["run_dir"]) / "metrics.csv")
            curve = [r["reward/mean"] for _, r in sorted(rows.items())]
            tenth = max(1, len(curve) // 10)
            lowest = min(statistics.mean(curve[i:i + tenth]) for i in range(len(curve) - tenth + 1))
            agreement = [r["anchor/sign_agreement"] for r in rows.values() if "anchor/sign_agreement" in r]
            _, _, total, dense = bytes_sent(rows)
            result = {"run": label, "overrides": overrides, "first": summary["reward_first_10pct"],
                      "last": summary["reward_last_10pct"], "gain": summary["reward_gain"], "lowest": lowest,
                      "agreement": statistics.mean(agreement) if agreement else None,
                      "bytes": total / dense if dense else 1.0}
            print(json.dumps(result), flush=True)
            agree = f"{result['agreement']:.3f}" if agreement else "-"
            lines.append(f"| {label} | `{' '.join(overrides) or recipe}` | {result['first']:.3f} | {result['last']:.3f} | "
                         f"{result['gain']:+.3f} | {lowest:.3f} | {agree} | {result['bytes']:.0%} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
