"""`tclightning probe ...` (subcommands are added by the features that own them)."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("probe", help="probe tools")
    parser.add_subparsers(dest="probe_command", metavar="TOOL")
