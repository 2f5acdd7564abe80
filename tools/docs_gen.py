"""Reference pages generated from the code, so the documentation site cannot drift from it.

* ``reference/recipe.md`` -- every recipe section, key, type, default and help text, read from
  the schema dataclasses (``tclightning/recipes/schema.py`` and the section dataclasses it
  composes). Help text is what the field declares with ``tclightning.settings.setting`` (its
  range and help); for a field declared otherwise (``CallbackSpec``), its trailing ``#`` comment,
  the ``#`` comment block right above it, or the string literal right below it.
* ``reference/cli.md`` -- ``--help`` of ``tclightning`` and ``lightning`` and of every
  subcommand, from the argparse parsers themselves.
* ``reference/callbacks.md`` -- constructor arguments of every public callback (from
  ``inspect.signature`` and the Google-style ``Args:`` of the docstrings) and the YAML presets
  in ``callbacks/``.
* ``benchmarks.md`` -- ``benchmarks/README.md``, with links rewritten for the site.

Used as an MkDocs hook (``hooks:`` in ``mkdocs.yml``: the pages are added to the build, never
written into ``docs/``), and as a script that writes them out for reading without MkDocs::

    python tools/docs_gen.py --out /tmp/reference

Build tooling, not part of the wheel: it reads the code through the installed ``tclightning``
(``make setup`` installs this checkout in editable mode) and the repository's files next to it.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import json
import os
import re
import textwrap
import tokenize
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CLI_COLUMNS = 100  # --help wraps at the terminal width; pin it so the page is stable


# ----------------------------------------------------------------------------- markdown helpers
def md_text(text: str) -> str:
    """Escape ``|``, ``*`` and ``<`` outside code spans, and turn reST roles and double-backtick literals into Markdown code spans.

    Help text is written for source readers (``10**digits``, ``<root>/<name>``, ``a | b``); in a
    Markdown table those would end a cell, start bold text or vanish as an HTML tag."""
    text = re.sub(r":(?:class|func|meth|mod|attr):`~?([\w.]+)`", lambda m: f"`{m.group(1).rsplit('.', 1)[-1]}`", text)
    text = text.replace("``", "`")
    parts = re.split(r"(`[^`]*`)", text)
    for i in range(0, len(parts), 2):  # even parts are outside code spans
        parts[i] = parts[i].replace("\\", "\\\\").replace("|", "\\|").replace("*", "\\*").replace("<", "&lt;")
    return "".join(parts)


def md_code(text: str) -> str:
    """A code span (the tables extension does not split cells at a ``|`` inside one)."""
    return f"`{text}`"


def yaml_value(value: Any) -> str:
    """A default as it would be written in a recipe."""
    if dataclasses.is_dataclass(value):
        return "(section)"
    if value is dataclasses.MISSING:
        return "required"
    return json.dumps(value)


# ----------------------------------------------------------------------------- recipe reference
def field_help(cls: type) -> dict[str, str]:
    """Help text of each dataclass field: its declared setting help, else its trailing comment,
    comment block above, or docstring below."""
    from tclightning.settings import help_text

    declared = {f.name: " ".join(text.split()) for f in dataclasses.fields(cls) if (text := help_text(f))}
    source = textwrap.dedent(inspect.getsource(cls))
    comments: dict[int, str] = {}  # 1-based line -> comment text
    code_lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            code_lines.add(tok.start[0])
    body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
    helps: dict[str, str] = {}
    for i, node in enumerate(body):
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        parts: list[str] = []
        above, line = [], node.lineno - 1
        while line >= 1 and line in comments and line not in code_lines:
            above.insert(0, comments[line])
            line -= 1
        parts.extend(above)
        if node.lineno in comments:
            parts.append(comments[node.lineno])
        nxt = body[i + 1] if i + 1 < len(body) else None
        if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
            parts.append(inspect.cleandoc(nxt.value.value))
        helps[node.target.id] = " ".join(" ".join(parts).split())
    return {**helps, **declared}


def field_types(cls: type) -> dict[str, str]:
    """Each field's annotation as written in the source."""
    source = textwrap.dedent(inspect.getsource(cls))
    body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
    return {n.target.id: ast.unparse(n.annotation) for n in body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return dataclasses.MISSING


def first_paragraph(doc: str | None) -> str:
    return inspect.cleandoc(doc or "").split("\n\n")[0].replace("\n", " ")


def doc_markdown(doc: str | None) -> str:
    """A docstring as Markdown: paragraphs escaped with :func:`md_text`; ``*``/``-`` bullet lines
    become list items (their indented continuation lines joined), with the blank line before the
    list that Markdown needs."""
    blocks: list[str] = []
    for paragraph in inspect.cleandoc(doc or "").split("\n\n"):
        text: list[str] = []
        items: list[str] = []
        for line in paragraph.splitlines():
            bullet = re.match(r"^\s*[*-]\s+(.*)$", line)
            if bullet:
                items.append(bullet.group(1).strip())
            elif items:
                items[-1] += " " + line.strip()
            else:
                text.append(line.strip())
        if text:
            blocks.append(md_text(" ".join(text)))
        if items:
            blocks.append("\n".join(f"* {md_text(item)}" for item in items))
    return "\n\n".join(blocks)


def section_doc(cls: type) -> str:
    """The class docstring as Markdown."""
    return doc_markdown(cls.__doc__)


def dataclass_table(cls: type, prefix: str) -> tuple[list[str], list[tuple[str, type]]]:
    """Rows for the scalar fields of ``cls`` and the nested dataclass sections it holds."""
    helps, types = field_help(cls), field_types(cls)
    hints = typing.get_type_hints(cls)
    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    nested: list[tuple[str, type]] = []
    for f in dataclasses.fields(cls):
        hint = hints.get(f.name)
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            nested.append((f"{prefix}{f.name}", hint))
            rows.append(f"| `{prefix}{f.name}` | `{hint.__name__}` | (section) | see [`{prefix}{f.name}`](#{anchor(prefix + f.name)}) |")
            continue
        default = field_default(f)
        rows.append(f"| `{prefix}{f.name}` | {md_code(types.get(f.name, '?'))} | {md_code(yaml_value(default))} | "
                    f"{md_text(helps.get(f.name, ''))} |")
    return rows, nested


def anchor(key: str) -> str:
    """The heading id MkDocs' toc extension gives a heading ``key`` (dots dropped)."""
    return re.sub(r"[^\w-]", "", key.replace(" ", "-")).lower()


def recipe_reference() -> str:
    """The ``reference/recipe.md`` page."""
    from tclightning.recipes.schema import CallbackSpec, RecipeConfig

    out = [
        "# Recipe reference",
        "",
        "Generated from the schema dataclasses (`tclightning/recipes/schema.py` and the section",
        "dataclasses it composes) by `tools/docs_gen.py` at every site build, so it always",
        "matches the code. How recipes are found, composed and overridden: [Recipes](../recipes.md).",
        "Types are as the code annotates them; defaults are YAML (`null` = unset).",
        "",
        "## Top level",
        "",
        section_doc(RecipeConfig),
        "",
    ]
    hints = typing.get_type_hints(RecipeConfig)
    helps, types = field_help(RecipeConfig), field_types(RecipeConfig)
    top = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    sections: list[tuple[str, type]] = []
    for f in dataclasses.fields(RecipeConfig):
        hint = hints[f.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            sections.append((f.name, hint))
            top.append(f"| `{f.name}` | `{hint.__name__}` | (section) | [{f.name}](#{anchor(f.name)}): "
                       f"{md_text(first_paragraph(hint.__doc__))} |")
        elif f.name == "callbacks":
            top.append(f"| `callbacks` | {md_code(types[f.name])} | `[]` | Lightning callbacks, "
                       f"see [callbacks](#callbacks) |")
        else:
            top.append(f"| `{f.name}` | {md_code(types[f.name])} | {md_code(yaml_value(field_default(f)))} | "
                       f"{md_text(helps.get(f.name, ''))} |")
    out += top + [""]
    queue = list(sections)
    while queue:
        key, cls = queue.pop(0)
        rows, nested = dataclass_table(cls, f"{key}.")
        out += [f"## {key}", "", f"`{cls.__module__}.{cls.__name__}`", "", section_doc(cls), "", *rows, ""]
        queue[0:0] = nested  # sub-sections right after their parent
    rows, _ = dataclass_table(CallbackSpec, "callbacks[].")
    out += ["## callbacks", "", section_doc(CallbackSpec), "", *rows, "",
            "The [callback reference](callbacks.md) lists every callback tclightning ships and its arguments.", ""]
    return "\n".join(out)


def schema_keys() -> list[str]:
    """Every dotted key the schema accepts (sections recursed), for tests."""
    from tclightning.recipes.schema import RecipeConfig

    def walk(cls: type, prefix: str) -> Iterator[str]:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            hint = hints[f.name]
            if isinstance(hint, type) and dataclasses.is_dataclass(hint):
                yield from walk(hint, f"{prefix}{f.name}.")
            else:
                yield f"{prefix}{f.name}"

    return list(walk(RecipeConfig, ""))


# ----------------------------------------------------------------------------- CLI reference
@contextmanager
def terminal_columns(columns: int) -> Iterator[None]:
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(columns)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = previous


def walk_parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """``parser`` and every subcommand parser below it, depth first, in declaration order."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            seen: set[int] = set()
            for sub in action.choices.values():
                if id(sub) not in seen:  # aliases share a parser
                    seen.add(id(sub))
                    yield from walk_parsers(sub)


def cli_commands() -> list[str]:
    """``prog`` of every command and subcommand (``tclightning analyze health``, ...)."""
    from tclightning.cli.lightning import build_parser as lightning_parser
    from tclightning.cli.main import build_parser

    return [p.prog for root in (build_parser(), lightning_parser()) for p in walk_parsers(root)]


def cli_reference() -> str:
    """The ``reference/cli.md`` page: every command's ``--help``."""
    from tclightning.cli.lightning import build_parser as lightning_parser
    from tclightning.cli.main import build_parser

    out = ["# Command-line reference", "",
           "Generated at every site build from the argparse parsers (`tclightning/cli/`), so it is exactly",
           "what `--help` prints. Recipe overrides (`key=value`) use the keys of the",
           "[recipe reference](recipe.md).", ""]
    with terminal_columns(CLI_COLUMNS):
        for root in (build_parser(), lightning_parser()):
            for parser in walk_parsers(root):
                out += [f"## `{parser.prog}`", "", "```text", parser.format_help().rstrip(), "```", ""]
    return "\n".join(out)


# ----------------------------------------------------------------------------- callback reference
def google_args(doc: str) -> dict[str, str]:
    """``name -> description`` from a Google-style ``Args:`` block."""
    doc = inspect.cleandoc(doc or "")
    match = re.search(r"^Args:\n((?:[ \t]+.*\n?|\n)+)", doc, flags=re.M)
    if not match:
        return {}
    args: dict[str, str] = {}
    current = None
    for line in match.group(1).splitlines():
        item = re.match(r"^\s{4}(\w+)(?: \([^)]*\))?:\s*(.*)$", line)
        if item:
            current = item.group(1)
            args[current] = item.group(2)
        elif current and line.strip():
            args[current] += " " + line.strip()
    return args


def public_callbacks() -> list[type]:
    """The Lightning callbacks ``tclightning.callbacks`` exports."""
    import lightning as L

    import tclightning.callbacks as cb

    return [obj for name in cb.__all__ if isinstance(obj := getattr(cb, name), type)
            and issubclass(obj, L.Callback)]


def callback_reference() -> str:
    """The ``reference/callbacks.md`` page."""
    out = ["# Callback reference", "",
           "Generated at every site build from the callback classes (`tclightning/callbacks/`) and the",
           "presets (`callbacks/*.yaml`). How to add them to a project: [Callbacks](../callbacks.md).", ""]
    for cls in public_callbacks():
        doc = inspect.cleandoc(cls.__doc__ or "")
        intro = re.split(r"^Args:$", doc, flags=re.M)[0].strip()
        described = {}
        for klass in reversed(cls.__mro__):  # a subclass's Args win over its base's
            described.update(google_args(klass.__doc__ or ""))
        out += [f"## {cls.__name__}", "", f"`{cls.__module__}.{cls.__name__}`", "", doc_markdown(intro), ""]
        params = [p for p in inspect.signature(cls.__init__).parameters.values() if p.name != "self"]
        if any(p.kind is p.VAR_KEYWORD for p in params):
            base = next(b for b in cls.__mro__[1:] if "__init__" in vars(b))
            params += [p for p in inspect.signature(base.__init__).parameters.values()
                       if p.name not in {"self", *(q.name for q in params)} and p.kind is not p.VAR_KEYWORD]
        params = [p for p in params if p.kind is not p.VAR_KEYWORD]
        if not params:
            out += ["No arguments.", ""]
            continue
        out += ["| argument | type | default | meaning |", "| --- | --- | --- | --- |"]
        for p in params:
            annotation = p.annotation if isinstance(p.annotation, str) else inspect.formatannotation(p.annotation)
            default = "required" if p.default is p.empty else repr(p.default)
            out.append(f"| `{p.name}` | {md_code(str(annotation))} | {md_code(default)} | {md_text(described.get(p.name, ''))} |")
        out.append("")
    out += ["## Presets", "",
            "YAML lists of `class_path` / `init_args`, read by recipes (`callback_presets: [NAME]`) and by",
            "LightningCLI (`--trainer.callbacks=callbacks/NAME.yaml`).", ""]
    for path in sorted((REPO / "callbacks").glob("*.yaml")):
        out += [f"### {path.stem}", "", f"`callbacks/{path.name}`", "", "```yaml", path.read_text().rstrip(), "```", ""]
    return "\n".join(out)


# ----------------------------------------------------------------------------- benchmarks page
def benchmarks_page() -> str:
    """``benchmarks/README.md`` for the site: links into ``docs/`` made site-relative."""
    text = (REPO / "benchmarks" / "README.md").read_text()
    text = re.sub(r"\]\(\.\./docs/", "](", text)
    return ("<!-- generated from benchmarks/README.md by tools/docs_gen.py; edit that file -->\n\n" + text)


PAGES: dict[str, Callable[[], str]] = {
    "reference/recipe.md": recipe_reference,
    "reference/cli.md": cli_reference,
    "reference/callbacks.md": callback_reference,
    "benchmarks.md": benchmarks_page,
}


# ----------------------------------------------------------------------------- MkDocs hook
def drop_missing(nav: list[Any], optional: set[str], exists: Callable[[str], bool]) -> list[Any]:
    """``nav`` without the entries whose page is in ``optional`` and does not exist (recursively;
    a section left empty goes too)."""
    kept: list[Any] = []
    for entry in nav:
        if isinstance(entry, dict):
            (title, value), = entry.items()
            if isinstance(value, list):
                value = drop_missing(value, optional, exists)
                if value:
                    kept.append({title: value})
            elif not (value in optional and not exists(value)):
                kept.append(entry)
        elif not (entry in optional and not exists(entry)):
            kept.append(entry)
    return kept


def on_config(config: Any) -> Any:
    """MkDocs hook: nav entries listed in ``extra.optional_pages`` are dropped while their page is missing."""
    optional = set(config.extra.get("optional_pages", []))
    docs = Path(config.docs_dir)
    if config.nav and optional:
        config.nav = drop_missing(config.nav, optional, lambda uri: (docs / uri).is_file())
    return config


def site_links(markdown: str, src_uri: str) -> str:
    """Links a page in ``docs/`` makes to ``../benchmarks/README.md`` (right on GitHub) pointed at
    its copy on the site, ``benchmarks.md``, relative to the page's own folder."""
    depth = src_uri.count("/")
    source = "../" * (depth + 1) + "benchmarks/README.md"
    target = "../" * depth + "benchmarks.md"
    return markdown.replace(f"]({source}", f"]({target}")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """MkDocs hook: see :func:`site_links`."""
    return site_links(markdown, page.file.src_uri)


def on_files(files: Any, config: Any) -> Any:
    """MkDocs hook: add the generated pages to the build (they are never written into ``docs/``)."""
    from mkdocs.structure.files import File

    for uri, build in PAGES.items():
        files.append(File.generated(config, uri, content=build()))
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description="Write the generated reference pages to a directory.")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    for uri, build in PAGES.items():
        path = args.out / uri
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(build())
        print(path)


if __name__ == "__main__":
    main()
