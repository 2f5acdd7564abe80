"""How much of a weight sync a sparse sync would send: the share of entries whose value *in the
sampler's dtype* changes in one optimizer step.

    python benchmarks/sparse_sync_share.py                 # SmolLM2-135M (make smollm2), AdamW lr 1e-6, 20 steps
    python benchmarks/sparse_sync_share.py --lr 1e-5 --steps 10 --dtype float16

float32 master weights take AdamW steps on the model's own next-token loss over GSM8K solutions
(``../shared/data/gsm8k/train.jsonl``, a different batch each step); after each step the weights
are cast to ``--dtype`` and compared with the previous step's cast. AdamW's step is about ``lr``
per coordinate whatever the loss, so the share mostly measures where ``lr`` crosses the dtype's
rounding grid -- a GRPO loss moves the weights by the same rule. Prints one line per step and
the mean; ``--json`` prints one JSON object.

    python benchmarks/sparse_sync_share.py --run RUN_DIR --plot docs/img/sparse_sync_smollm2.png

reads what a run with ``sampler.dtype`` logged instead (``wire/sync_share``, ``wire/sync_bytes``
per step, from its ``metrics.csv``), prints it as a table and plots the share.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="smollm2-gsm8k", help="recipe whose model is used (default smollm2-gsm8k)")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4, help="solutions per step (default 4)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--run", type=Path, help="a run directory: report its logged wire/sync_share instead")
    parser.add_argument("--plot", type=Path, help="with --run: write the share per step as a PNG here")
    args = parser.parse_args(argv)
    if args.run is not None:
        return report_run(args.run, args.plot)

    from tclightning.models.loading import load_model
    from tclightning.recipes.loader import load_recipe, to_dataclass

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    recipe = to_dataclass(load_recipe(args.recipe, ["model.dtype=float32"]))
    model, tokenizer = load_model(recipe.model)
    model.train()
    rows = [json.loads(line) for line in DATA.read_text().splitlines()[: args.steps * args.batch]]
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr)
    dtype = getattr(torch, args.dtype)
    before = [p.detach().to(dtype) for p in params]
    total = sum(p.numel() for p in params)
    shares = []
    for step in range(args.steps):
        batch = rows[step * args.batch : (step + 1) * args.batch]
        enc = tokenizer([r["question"] + "\n" + r["answer"] for r in batch], return_tensors="pt", padding=True)
        labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
        optimizer.zero_grad(set_to_none=True)
        model(**enc, labels=labels).loss.backward()
        optimizer.step()
        with torch.no_grad():
            after = [p.detach().to(dtype) for p in params]
            changed = sum(int((a != b).sum()) for a, b in zip(after, before))
        before = after
        shares.append(changed / total)
        if not args.json:
            print(f"step {step:2d}: {changed:,} of {total:,} entries changed in {args.dtype} ({changed / total:.4%})")
    mean = sum(shares) / len(shares)
    if args.json:
        print(json.dumps({"lr": args.lr, "dtype": args.dtype, "steps": args.steps, "entries": total,
                          "shares": shares, "mean_share": mean}))
    else:
        print(f"mean share over {args.steps} steps: {mean:.4%} (AdamW lr {args.lr:g}, float32 master, {args.dtype} copy)")
    return 0


def report_run(run_dir: Path, plot: Path | None) -> int:
    """The sparse sync a run sent, step by step: a Markdown table (and the share as a PNG)."""
    from tclightning.grpo.summary import read_metrics

    metrics = run_dir / "metrics.csv"
    if not metrics.is_file():
        print(f"error: --run: {metrics} does not exist", file=sys.stderr)
        return 2
    rows = [(step, r) for step, r in sorted(read_metrics(metrics).items()) if "wire/sync_share" in r]
    if not rows:
        print(f"error: --run: {metrics} logs no wire/sync_share (was sampler.dtype set?)", file=sys.stderr)
        return 2
    print("| step | wire/sync_bytes | wire/sync_share |\n| ---: | ---: | ---: |")
    for step, r in rows:
        print(f"| {step} | {r['wire/sync_bytes']:,.0f} | {r['wire/sync_share']:.4%} |")
    if plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.plot([s for s, _ in rows], [100 * r["wire/sync_share"] for _, r in rows], marker="o")
        ax.set_yscale("log")
        ax.set_xlabel("RL step")
        ax.set_ylabel("sync bytes, % of a full sync")
        ax.set_title(f"sparse weight sync to the sampler: {run_dir.parent.name}")
        ax.grid(True, which="both", alpha=0.3)
        plot.parent.mkdir(parents=True, exist_ok=True)
        fig.tight_layout()
        fig.savefig(plot, dpi=110)
        print(f"wrote {plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
