"""Every metric a run logs is documented in docs/metrics.md; README shows the two commands."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tclightning.grpo.summary import read_metrics
from tclightning.logging import SCALAR_LAYOUT
from tclightning.run import run
from tests.conftest import FAST

REPO = Path(__file__).resolve().parents[1]


def documented_tags() -> set[str]:
    return set(re.findall(r"`([a-z0-9_]+/[a-z0-9_/{}]+|epoch)`", (REPO / "docs" / "metrics.md").read_text()))


def undocumented(logged: set[str]) -> set[str]:
    """Logged names no documented name (``{i}`` = any cut number) matches."""
    patterns = [re.compile(re.escape(tag).replace(r"\{i\}", r"\d+") + "$") for tag in documented_tags()]
    return {name for name in logged if not any(p.match(name) for p in patterns)}


@pytest.mark.parametrize(("recipe", "cuts"), [("tiny", []), ("shallow-compressed", ["pipeline.stages=2"])])
def test_every_logged_metric_is_documented(run_root: Path, recipe: str, cuts: list[str]) -> None:
    summary = run(
        recipe, [*FAST, "trainer.steps=3", "trainer.val_every=1", *cuts, "anchor.latency=1", "anchor.cadence=1"],
        quiet=True,
    )
    logged = set().union(*read_metrics(Path(summary["run_dir"]) / "metrics.csv").values())
    assert undocumented(logged) == set()


def test_tensorboard_layout_uses_documented_names() -> None:
    tags = {tag for group in SCALAR_LAYOUT.values() for chart in group.values() for tag in chart[1]}
    assert undocumented(tags) == set()


def test_readme_shows_the_two_commands() -> None:
    readme = (REPO / "README.md").read_text()
    assert "make run" in readme and "make test" in readme
