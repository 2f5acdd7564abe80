"""``tclightning run --recipe NAME|PATH [--resume PATH|last] [key=value ...]``."""

from __future__ import annotations

import argparse

RUN_EPILOG = """\
examples:
  tclightning run --recipe tiny
  tclightning run --recipe recipes/tiny.yaml trainer.steps=20 grpo.lr=1e-4
  tclightning run --recipe tiny --resume last   # the newest run of 'tiny'
  tclightning run --recipe tiny --resume runs/tiny/20261130-101500
"""


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    # --config: what LightningCLI users type for a YAML file; here the recipe is that file
    parser.add_argument("--recipe", "--config", dest="recipe", required=True,
                        help="recipe name (see `tclightning recipes list`) or YAML path; --config FILE is the same")
    parser.add_argument(
        "--resume", metavar="PATH|last",
        help="continue from a checkpoint, a run directory, or 'last' (newest run of this recipe)",
    )
    parser.add_argument("--quiet", action="store_true", help="do not print the end-of-run summary")
    parser.add_argument(
        "--no-cache", action="store_true",
        help="train the supervised warm-up again instead of reusing a cached identical one "
        "(same as TCLIGHTNING_NO_CACHE=1)",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides, e.g. trainer.steps=50")


def handle_run(args: argparse.Namespace) -> int:
    """Train; exit 0, or 130 (one line on stderr) for a Ctrl-C before anything was saved."""
    import os
    import sys

    from tclightning.cache import NO_CACHE_ENV
    from tclightning.run import RunInterrupted, run

    if not sys.stdout.isatty() and hasattr(sys.stdout, "reconfigure"):  # a log file or pipe: each line
        sys.stdout.reconfigure(line_buffering=True)  # as it is printed, not at exit
    before = os.environ.get(NO_CACHE_ENV)
    if args.no_cache:  # for this run (and the processes it starts) only
        os.environ[NO_CACHE_ENV] = "1"
    try:
        run(args.recipe, args.overrides, resume=args.resume, quiet=args.quiet)
    except RunInterrupted as err:
        print(err, file=sys.stderr)  # "interrupted ...; removed <run dir> ..." in one line
        return 130
    finally:
        if args.no_cache and before is None:
            os.environ.pop(NO_CACHE_ENV, None)
        elif args.no_cache:
            os.environ[NO_CACHE_ENV] = before
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    from tclightning.cli.formatting import HelpFormatter

    parser = subparsers.add_parser(
        "run",
        help="train a recipe",
        description="Train a GRPO recipe with Lightning: TensorBoard events, metrics.csv and checkpoints go to "
        "<logging.root>/<name>/<timestamp>/. Ctrl-C stops after the current step with a checkpoint; "
        "during the supervised warm-up it exits 130 and removes the new run directory.",
        epilog=RUN_EPILOG,
        formatter_class=HelpFormatter,
    )
    add_run_arguments(parser)
    parser.set_defaults(func=handle_run)
