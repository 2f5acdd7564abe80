"""``tclightning recipes list`` and ``tclightning recipes show NAME [key=value ...]``."""

from __future__ import annotations

import argparse
import shutil
import textwrap
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the loader imports the recipe schema (torch): not for `--help`
    from tclightning.recipes.loader import RecipeInfo

MIN_WIDTH = 40  # below this a description column is useless; lines may then exceed the width


def recipe_lines(recipes: Sequence[RecipeInfo], width: int, long: bool = False) -> list[str]:
    """``recipes list`` as plain text lines of at most ``width`` characters (``width`` of at least
    :data:`MIN_WIDTH`): the name, padded to the longest name, then the description, shortened at a
    word to fit one line (``long``: the whole description, wrapped under the description column).
    Plain text, so a description's brackets (``pip install tclightning[vllm]``) print as written."""
    width = max(width, MIN_WIDTH)
    column = max((len(r.name) for r in recipes), default=0) + 2
    room = width - column
    lines = []
    for info in recipes:
        description = info.description or "(no description)"
        if long:
            wrapped = textwrap.wrap(description, room) or [""]
            lines.append(info.name.ljust(column) + wrapped[0])
            lines.extend(" " * column + rest for rest in wrapped[1:])
        else:
            lines.append(info.name.ljust(column) + textwrap.shorten(description, room, placeholder=" ..."))
    return [line.rstrip() for line in lines]


def handle_list(args: argparse.Namespace) -> int:
    from tclightning.recipes.loader import list_recipes

    width = shutil.get_terminal_size((80, 24)).columns  # COLUMNS, else the terminal, else 80
    print("\n".join(recipe_lines(list_recipes(), width, long=args.long)))
    return 0


def handle_show(args: argparse.Namespace) -> int:
    from tclightning.run import resolved_yaml

    print(resolved_yaml(args.name, args.overrides), end="")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("recipes", help="list and show recipes")
    sub = parser.add_subparsers(dest="recipes_command", metavar="ACTION", required=True)
    listing = sub.add_parser(
        "list", help="the recipes on the search path, one line each",
        description="The recipes on the search path, one line each: name and description, shortened to the "
        "terminal width. `tclightning recipes show NAME` prints one in full.",
    )
    listing.add_argument("--long", action="store_true", help="whole descriptions, wrapped")
    listing.set_defaults(func=handle_list)
    show = sub.add_parser("show", help="print a recipe fully resolved (defaults, presets and overrides applied)")
    show.add_argument("name", help="recipe name or YAML path")
    show.add_argument("overrides", nargs="*", metavar="key=value")
    show.set_defaults(func=handle_show)
