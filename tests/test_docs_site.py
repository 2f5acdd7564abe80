"""The documentation site builds with `mkdocs build --strict` (no warnings: no broken link or
anchor, no page left out of the nav), its generated reference pages cover the code, and the
examples on the callbacks page run."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


def _load_docs_gen() -> types.ModuleType:
    """``tools/docs_gen.py`` (the MkDocs hook) by path: build tooling, outside the package."""
    spec = importlib.util.spec_from_file_location("docs_gen", REPO / "tools" / "docs_gen.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


docs_gen = _load_docs_gen()

needs_mkdocs = pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
    reason="mkdocs / mkdocs-material not installed (pip install -e '.[docs]'; `make test` installs it)",
)


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's end-of-life banner
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], capture_output=True, text=True, env=env, timeout=600)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    result = mkdocs_build(REPO / "mkdocs.yml", out)
    problems = [line for line in result.stderr.splitlines() if "WARNING" in line or "ERROR" in line]
    assert result.returncode == 0 and not problems, result.stderr[-4000:]
    return out


def page_text(site: Path, uri: str) -> str:
    html = (site / uri / "index.html").read_text()
    return re.sub(r"<[^>]+>", "", html)


@needs_mkdocs
def test_every_docs_page_is_built(site: Path) -> None:
    pages = {p.relative_to(REPO / "docs").with_suffix("").as_posix() for p in (REPO / "docs").rglob("*.md")}
    built = {p.parent.relative_to(site).as_posix() for p in site.rglob("index.html")}
    assert pages - {"index"} <= built
    assert {"reference/recipe", "reference/cli", "reference/callbacks", "benchmarks"} <= built


@needs_mkdocs
def test_strict_build_fails_on_a_broken_link(tmp_path: Path) -> None:
    """The validation settings of mkdocs.yml turn broken links and anchors into build failures."""
    settings = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n[gone](missing.md) and [no anchor](other.md#nowhere)\n")
    (docs / "other.md").write_text("# Other\n")
    config = {"site_name": "t", "docs_dir": str(docs), "validation": settings["validation"],
              "nav": ["index.md", "other.md"]}
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    result = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert result.returncode != 0
    assert "missing.md" in result.stderr and "nowhere" in result.stderr


@needs_mkdocs
def test_recipe_reference_lists_every_schema_key(site: Path) -> None:
    text = page_text(site, "reference/recipe")
    missing = [key for key in docs_gen.schema_keys() if key not in text]
    assert not missing, missing
    assert "grpo.clip" in text and "0.28" in text  # a default is shown
    assert "P prompts per RL step" in text  # a declared help text (grpo.prompts_per_step)
    assert "which cuts are compressed" in text  # another (pipeline.layout)
    assert "import path of a lightning Callback" in text  # a trailing-comment help text (CallbackSpec)


@needs_mkdocs
def test_cli_reference_has_every_command(site: Path) -> None:
    text = page_text(site, "reference/cli")
    commands = docs_gen.cli_commands()
    assert {"tclightning run", "tclightning probe cuts", "lightning run"} <= set(commands)
    missing = [c for c in commands if f"usage: {c}" not in text]
    assert not missing, missing


@needs_mkdocs
def test_callback_reference_has_every_callback_and_argument(site: Path) -> None:
    import inspect

    text = page_text(site, "reference/callbacks")
    for cls in docs_gen.public_callbacks():
        assert cls.__name__ in text
        for name in inspect.signature(cls.__init__).parameters:
            if name not in ("self", "kwargs"):
                assert name in text, (cls.__name__, name)
    assert "collapse-guard" in text and "rollback_lr_scale: 0.5" in text  # the presets


def test_field_help_is_the_declared_setting_help_or_a_comment() -> None:
    from tclightning.grpo.config import GRPOConfig
    from tclightning.pipeline.config import PipelineConfig
    from tclightning.recipes.schema import CallbackSpec
    from tclightning.tasks.config import TaskConfig

    assert docs_gen.field_help(GRPOConfig)["tis_cap"].startswith("token-level truncated importance sampling")
    assert docs_gen.field_help(PipelineConfig)["k"] == "budget in values per token; overrides ``rate``"
    assert docs_gen.field_help(TaskConfig)["split"].startswith("split used for training.")
    assert docs_gen.field_help(CallbackSpec)["class_path"].startswith("import path of a lightning Callback")


def test_md_text_escapes_outside_code_only() -> None:
    assert docs_gen.md_text("a | b, 10**d, <root>, `x | y`") == "a \\| b, 10\\*\\*d, &lt;root>, `x | y`"
    assert docs_gen.md_text(":class:`~tclightning.health.rules.GapLevelRule`") == "`GapLevelRule`"


def test_optional_nav_pages_are_dropped_only_when_missing() -> None:
    nav = [{"Home": "index.md"}, {"Guides": [{"A": "a.md"}, {"B": "b.md"}]}, {"More": [{"C": "c.md"}]}]
    kept = docs_gen.drop_missing(nav, {"b.md", "c.md", "index.md"}, exists=lambda uri: uri == "index.md")
    assert kept == [{"Home": "index.md"}, {"Guides": [{"A": "a.md"}]}]


# ----------------------------------------------------------------------------- docs/callbacks.md
def code_blocks(language: str) -> list[str]:
    text = (REPO / "docs" / "callbacks.md").read_text()
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def test_callbacks_page_python_example_warns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tclightning.callbacks import HealthWarning

    example = next(block for block in code_blocks("python") if "trainer.fit(ToyRL())" in block)
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(example, "docs/callbacks.md", "exec"), {"__name__": "docs_example"})
    messages = [str(w.message) for w in caught if issubclass(w.category, HealthWarning)]
    assert any("length.feedback" in m for m in messages), messages


def test_callbacks_page_yaml_examples_instantiate(tmp_path: Path) -> None:
    from tclightning.recipes.loader import instantiate_callbacks, load_recipe, resolve_callback_class

    blocks = [yaml.safe_load(block) for block in code_blocks("yaml")]
    cli = next(b for b in blocks if isinstance(b, dict) and "trainer" in b)
    for spec in cli["trainer"]["callbacks"]:
        resolve_callback_class(spec["class_path"], "docs/callbacks.md", "class_path")(**spec.get("init_args", {}))
    recipe = next(b for b in blocks if isinstance(b, dict) and "callback_presets" in b)
    path = tmp_path / "my-run.yaml"
    path.write_text(yaml.safe_dump(recipe))
    callbacks = instantiate_callbacks(load_recipe(str(path)))
    names = [type(c).__name__ for c in callbacks]
    assert names == ["LengthFeedbackMonitor", "GapMonitor", "CollapseDetector", "TrajectoryRecorder"]
    for python in code_blocks("python"):  # every Python snippet at least compiles
        compile(python, "docs/callbacks.md", "exec")


def test_links_to_the_benchmarks_readme_point_at_its_site_copy() -> None:
    text = "see [numbers](../benchmarks/README.md#codec) and [x](other.md)"
    assert docs_gen.site_links(text, "codecs.md") == "see [numbers](benchmarks.md#codec) and [x](other.md)"
    assert docs_gen.site_links("[n](../../benchmarks/README.md)", "reference/cli.md") == "[n](../benchmarks.md)"


def test_readme_links_resolve() -> None:
    """README is read on GitHub, not on the site: its relative links must name files that exist."""
    readme = (REPO / "README.md").read_text()
    links = [target.split("#")[0] for target in re.findall(r"\]\(([^)\s]+)\)", readme)
             if not target.startswith(("http://", "https://", "#"))]
    assert "docs/concepts.md" in links and "docs/health.md" in links  # the comparison table's backing pages
    missing = [link for link in links if not (REPO / link).exists()]
    assert not missing, missing
