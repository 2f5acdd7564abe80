"""`tclightning probe coherence`: the two premises of the two-circuit design for a recipe
(:mod:`tclightning.probes.coherence`). Writes ``coherence.json``, ``coherence.md``,
``coherence.png``; prints the table, or with ``--json`` one JSON document on stdout."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tclightning.cli.options import MAX_THREADS, output_folder, within
from tclightning.errors import TclightningError
from tclightning.files import replace_text


def register_coherence(tools: argparse._SubParsersAction) -> None:
    parser = tools.add_parser(
        "coherence",
        help="gradient coherence: fast vs dense gradient, and dense gradients K steps apart (docs/coherence.md)",
        description=(
            "From the recipe's warm start (or --checkpoint), follow a dense GRPO trajectory for --steps RL steps. "
            "At each step measure the fast (compressed) gradient against the dense one on the same batch and "
            "weights, and the dense gradient against the one K steps earlier for each lag K (K=0: an independent "
            "batch at the same weights, the noise floor), and the recipe's signed_ema merge of a K-late anchor "
            "with the fresh gradient. See docs/coherence.md for how to read it."
        ),
    )
    parser.add_argument("--recipe", required=True, help="recipe name or path (its pipeline section gives cuts and codec)")
    parser.add_argument("--lags", nargs="+", default=None, metavar="K",
                        help="lags in RL steps (default 0 1 2 5 10 20); key=value words after it are overrides")
    parser.add_argument("--steps", type=int, default=None,
                        help="RL steps of the dense trajectory (default: largest lag + 10)")
    parser.add_argument("--alpha", type=float, default=None, help="the merge's alpha (default: the recipe's anchor.alpha)")
    parser.add_argument("--checkpoint", default=None, help="start from this Lightning checkpoint's policy weights "
                        "instead of the recipe's warm start")
    parser.add_argument("--out", default=None, help="output folder (default runs/probes/<recipe>-coherence/)")
    parser.add_argument("--overwrite", action="store_true", help="replace the files of an earlier probe in --out")
    parser.add_argument("--json", action="store_true", help="print one JSON document on stdout (progress on stderr)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (default: the recipe's trainer.num_threads, else 1 on <= 4 cores)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides, e.g. grpo.lr=5e-5")
    parser.set_defaults(func=run_coherence)


def warm_start(module: Any) -> None:
    """The recipe's supervised warm-up exactly as a run's ``setup('fit')`` does it (so the cache
    entry a run wrote is reused), without a Trainer."""
    from tclightning.models.warmup import WarmupInterrupted

    module.trainer = SimpleNamespace(ckpt_path=None, progress_bar_callback=None)
    try:
        module.setup("fit")
    except WarmupInterrupted as err:  # Ctrl-C or SIGTERM: one line and exit 130, as for a run
        raise KeyboardInterrupt(f"{err}; nothing was written") from None
    finally:
        module.trainer = None


def load_checkpoint_weights(module: Any, path: str) -> None:
    """The checkpoint's weights into the recipe's module, as ``load_from_checkpoint`` loads them (a
    LoRA checkpoint's adapters onto the base the recipe rebuilds, checked against its record)."""
    from tclightning.callbacks.checkpointing import load_checkpoint

    try:
        ckpt = load_checkpoint(Path(path))  # data only; a FIFO, a damaged or a crafted file is one line
    except TclightningError as err:
        raise TclightningError(f"--checkpoint: {err}") from None
    weights = ckpt.get("state_dict") if isinstance(ckpt, dict) else None
    if not isinstance(weights, dict) or not any(isinstance(k, str) and k.startswith("policy.") for k in weights):
        raise TclightningError(f"--checkpoint {path}: no policy weights in its state_dict")
    module.load_weights(ckpt, path)


def run_coherence(args: argparse.Namespace) -> int:
    from tclightning.recipes.loader import load_recipe, to_dataclass

    lags = [0, 1, 2, 5, 10, 20]
    if args.lags:  # `--lags 0 1 key=value`: argparse hands the overrides to --lags
        args.overrides = list(args.overrides) + [w for w in args.lags if "=" in w]
        words = [w for w in args.lags if "=" not in w]
        try:
            lags = sorted({int(w) for w in words})
        except ValueError:
            raise TclightningError(f"--lags takes integers >= 0, got {' '.join(words)}") from None
        if not lags:
            raise TclightningError("--lags needs at least one lag")
    if lags[0] < 0:
        raise TclightningError(f"--lags must be >= 0, got {args.lags}")
    steps = args.steps if args.steps is not None else max(lags) + 10
    if steps < 1:
        raise TclightningError(f"--steps must be >= 1, got {steps}")
    if steps <= max(lags):
        raise TclightningError(f"--steps {steps} must exceed the largest lag {max(lags)}")
    within("probe coherence", "--threads", args.threads, 1, MAX_THREADS)
    within("probe coherence", "--steps", steps, 1, 10000)  # a step keeps its gradient for the later lags
    recipe = to_dataclass(load_recipe(args.recipe, args.overrides))
    alpha = recipe.anchor.alpha if args.alpha is None else args.alpha
    if not 0.0 <= alpha <= 1.0:
        raise TclightningError(f"--alpha must be in [0, 1], got {alpha}")
    out = output_folder("probe coherence", Path(args.out or Path("runs") / "probes" / f"{recipe.name}-coherence"),
                        ("coherence.json", "coherence.md", "coherence.png"), named=args.out is not None,
                        overwrite=args.overwrite)
    log = sys.stderr if args.json else sys.stdout

    import torch

    from tclightning.pipeline.cuts import install_cuts
    from tclightning.probes.coherence import GRPOTrajectory, lag_table, measure, plot
    from tclightning.run import build_module, intra_op_threads

    torch.set_num_threads(args.threads or intra_op_threads(recipe))
    torch.manual_seed(recipe.trainer.seed)
    started = time.perf_counter()
    module = build_module(recipe)
    if args.checkpoint:
        load_checkpoint_weights(module, args.checkpoint)
        module.policy.train()
    else:
        warm_start(module)
    warmed = time.perf_counter()
    cuts = install_cuts(module.policy, recipe.pipeline) if recipe.trainer.strategy == "pipeline" else None
    trajectory = GRPOTrajectory(module, cuts)

    def progress(t: int, grads: Any) -> None:
        print(f"step {t + 1}/{steps}: reward {trajectory.rewards[-1]:.3f}", file=log, flush=True)

    try:
        report = measure(trajectory, steps, lags, alpha, progress=progress)
    finally:
        if cuts is not None:
            cuts.remove()
    finished = time.perf_counter()
    report.update({
        "recipe": recipe.name,
        "overrides": list(args.overrides),
        "start": args.checkpoint or "warm start",
        "cuts": None if cuts is None else {"layout": recipe.pipeline.layout, "codec": recipe.pipeline.codec,
                                           "rate": recipe.pipeline.rate},
        "lr": recipe.grpo.lr,
        "prompts_per_step": recipe.grpo.prompts_per_step,
        "group_size": recipe.sampler.group_size,
        "reward_mean": sum(trajectory.rewards) / len(trajectory.rewards),
        "rewards": trajectory.rewards,
        "seconds": {"load": round(warmed - started, 1), "trajectory": round(finished - warmed, 1)},
    })
    out.mkdir(parents=True, exist_ok=True)
    document = json.dumps(report, indent=2, allow_nan=False)
    replace_text(out / "coherence.json", document + "\n")
    cut = "no cuts" if cuts is None else f"{recipe.pipeline.codec} rate {recipe.pipeline.rate}"
    header = (f"Gradient coherence, recipe `{' '.join([recipe.name, *args.overrides])}` ({cut}; lr {recipe.grpo.lr}, "
              f"{recipe.grpo.prompts_per_step} prompts x {recipe.sampler.group_size}, alpha {alpha}): {steps} dense RL "
              f"steps from {report['start']}, mean reward {report['reward_mean']:.3f}. load {warmed - started:.0f} s, "
              f"trajectory {finished - warmed:.0f} s.\n")
    table = lag_table(report)
    replace_text(out / "coherence.md", header + "\n" + table)
    plot(report, out / "coherence.png", title=f"{recipe.name} {' '.join(args.overrides)}".strip())
    if args.json:
        print(document)
    else:
        print(header)
        print(table)
    print(f"wrote {out / 'coherence.json'}, {out / 'coherence.md'}, {out / 'coherence.png'}", file=log)
    return 0
