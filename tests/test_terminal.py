"""What a user reads in a terminal: `recipes list` one line each, help within 80 columns,
warnings without Lightning's file:line prefix, and a hint for a recipe path that does not exist."""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import pytest

from tclightning.cli import lightning as lightning_cli
from tclightning.cli import main as cli
from tclightning.cli.recipes import recipe_lines
from tclightning.errors import RecipeError
from tclightning.recipes.loader import RecipeInfo, find_recipe, list_recipes


def test_recipes_list_is_one_line_per_recipe_at_80_columns(monkeypatch, capsys) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    assert cli.main(["recipes", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    recipes = list_recipes()
    assert len(lines) == len(recipes)
    assert all(len(line) <= 80 for line in lines), max(lines, key=len)
    assert [line.split()[0] for line in lines] == [r.name for r in recipes]


def test_recipes_list_prints_brackets_as_written(monkeypatch, capsys) -> None:
    info = RecipeInfo("gpu", Path("gpu.yaml"), "needs a GPU and `pip install tclightning[vllm]` first")
    assert recipe_lines([info], 200) == ["gpu  needs a GPU and `pip install tclightning[vllm]` first"]
    long = recipe_lines([info], 40, long=True)
    assert all(len(line) <= 40 for line in long) and "tclightning[vllm]`" in " ".join(long)
    monkeypatch.setenv("COLUMNS", "400")  # through the command, on the shipped recipes
    cli.main(["recipes", "list", "--long"])
    out = capsys.readouterr().out
    for recipe in list_recipes():
        if "[" in recipe.description:
            assert recipe.description[:60] in " ".join(out.split())


def _parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


@pytest.mark.parametrize("build", [cli.build_parser, lightning_cli.build_parser], ids=["tclightning", "lightning"])
def test_every_help_page_fits_80_columns(build, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    for parser in _parsers(build()):
        lines = parser.format_help().splitlines()
        assert max(map(len, lines)) <= 80, (parser.prog, max(lines, key=len))


def test_warnings_through_lightning_rank_zero_helpers_have_no_file_line() -> None:
    import tclightning.callbacks  # noqa: F401  (installs the format, as in any project using the callbacks)
    from lightning.pytorch.utilities import rank_zero_only

    from tclightning.callbacks import GapMonitor

    @rank_zero_only
    def lightning_style(message: str) -> None:
        warnings.warn(message, UserWarning, stacklevel=2)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        GapMonitor()._warn("gap rising")
        lightning_style("something from Lightning")
    assert [Path(w.filename).name for w in caught] == ["rank_zero.py", "rank_zero.py"]  # where the prefix came from
    shown = [warnings.formatwarning(w.message, w.category, w.filename, w.lineno) for w in caught]
    assert shown == ["health: gap rising\n", "UserWarning: something from Lightning\n"]


def test_missing_recipe_file_suggests_the_installed_recipe(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # no recipes/ folder here: the user is outside the checkout
    with pytest.raises(RecipeError, match=r"no such recipe file: recipes/tiny.yaml .*use --recipe tiny\)"):
        find_recipe("recipes/tiny.yaml")
    with pytest.raises(RecipeError, match=r"did you mean --recipe shallow-compressed\?"):
        find_recipe("shalow-compressed.yaml")
    with pytest.raises(RecipeError) as err:
        find_recipe("recipes/zzzz-qqqq.yaml")
    assert "(" not in str(err.value).split("zzzz-qqqq.yaml", 1)[1]
    with pytest.raises(RecipeError, match=r"use 'tiny'"):  # a recipe's `defaults:` entry names it as 'tiny'
        find_recipe("../tiny.yaml", relative_to=tmp_path)
