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
    args = parser.parse_args(argv)

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


if __name__ == "__main__":
    sys.exit(main())
