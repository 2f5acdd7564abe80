"""``tclightning run --recipe NAME|PATH [--resume PATH|last] [key=value ...]``."""

from __future__ import annotations

import argparse

RUN_EPILOG = """\
examples:
  tclightning run --recipe tiny
  tclightning run --recipe recipes/tiny.yaml trainer.steps=20 grpo.lr=1e-4
  tclightning run --recipe tiny --resume last          # continue the newest run of 'tiny'
  tclightning run --recipe tiny --resume runs/tiny/20261130-101500/checkpoints/last.ckpt
"""


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", required=True, help="recipe name (see `tclightning recipes list`) or YAML path")
    parser.add_argument(
        "--resume", metavar="PATH|last",
        help="continue from a checkpoint, a run directory, or 'last' (newest run of this recipe)",
    )
    parser.add_argument("--quiet", action="store_true", help="do not print the end-of-run summary")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides, e.g. trainer.steps=50")


def handle_run(args: argparse.Namespace) -> int:
    from tclightning.run import run

    run(args.recipe, args.overrides, resume=args.resume, quiet=args.quiet)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run",
        help="train a recipe",
        description="Train a GRPO recipe with Lightning: TensorBoard events, metrics.csv and checkpoints go to "
        "<logging.root>/<name>/<timestamp>/. Ctrl-C stops after the current step with a checkpoint.",
        epilog=RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_run_arguments(parser)
    parser.set_defaults(func=handle_run)
