"""The ``lightning`` command: ``lightning run --recipe ...`` (Lightning 2.6 ships only ``fabric``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tclightning.cli import run as run_cli
from tclightning.cli.main import dispatch


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning",
        description="Run tclightning recipes with PyTorch Lightning. For Fabric scripts use the `fabric` command; "
        "for everything else (recipes, probes, analysis) use `tclightning`.",
    )
    parser.add_argument("--debug", action="store_true", help="show full tracebacks for errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = sub.add_parser(
        "run",
        help="train a recipe (same as `tclightning run`)",
        epilog=run_cli.RUN_EPILOG.replace("tclightning run", "lightning run"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run_cli.add_run_arguments(run)
    run.set_defaults(func=run_cli.handle_run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return dispatch(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
