"""``tclightning recipes list`` and ``tclightning recipes show NAME [key=value ...]``."""

from __future__ import annotations

import argparse


def handle_list(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from tclightning.recipes.loader import list_recipes

    table = Table(title="recipes")
    table.add_column("name", style="bold")
    table.add_column("file")
    table.add_column("description")
    for info in list_recipes():
        table.add_row(info.name, info.path.name, info.description)
    Console().print(table)
    return 0


def handle_show(args: argparse.Namespace) -> int:
    from tclightning.run import resolved_yaml

    print(resolved_yaml(args.name, args.overrides), end="")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("recipes", help="list and show recipes")
    sub = parser.add_subparsers(dest="recipes_command", metavar="ACTION", required=True)
    sub.add_parser("list", help="the recipes on the search path, with a one-line description").set_defaults(
        func=handle_list
    )
    show = sub.add_parser("show", help="print a recipe fully resolved (defaults, presets and overrides applied)")
    show.add_argument("name", help="recipe name or YAML path")
    show.add_argument("overrides", nargs="*", metavar="key=value")
    show.set_defaults(func=handle_show)
