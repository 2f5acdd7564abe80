"""Find, compose, override and validate recipes.

A recipe is a YAML file checked against :class:`RecipeConfig`. Composition order, lowest to
highest priority: schema defaults, each entry of ``defaults`` (recursively, in order), the file
itself, then ``key=value`` overrides from the command line. ``callback_presets`` entries are YAML
lists of ``class_path``/``init_args`` from the top-level ``callbacks/`` folder, placed before the
recipe's own ``callbacks``. Every error names the file and the key (:class:`RecipeError`); an
error in a command-line override names that override. Every value is checked against its range
(declared beside its field, :mod:`tclightning.settings`) and the cross checks
(:mod:`tclightning.recipes.ranges`) here, before a run creates anything.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.machinery
import importlib.util
import inspect
import os
import re
import sys
from urllib.parse import urlparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException
from omegaconf.nodes import BooleanNode, FloatNode, StringNode

from tclightning.console import shown
from tclightning.errors import RecipeError, TclightningError
from tclightning.files import open_regular, pinned_file, regular_file
from tclightning.recipes.ranges import problems
from tclightning.recipes.schema import LOGGERS, RETIRED_HINTS, RETIRED_KEYS, RecipeConfig, upgrade_sections
from tclightning.settings import leaves, refuse_interpolation, without_keys

PACKAGE_DIR = Path(__file__).resolve().parents[1]
REPO_DIR = PACKAGE_DIR.parent


def _search_path(env_var: str, folder: str) -> list[Path]:
    """User folders from ``env_var``, then the repo's top-level folder, then the packaged copy."""
    extra = [Path(p).expanduser() for p in os.environ.get(env_var, "").split(os.pathsep) if p]
    for entry in extra:  # a mistyped entry would hide the user's recipes without a word
        if not entry.is_dir():
            why = "is not a folder" if entry.exists() else "does not exist"
            raise RecipeError(f"environment variable {env_var}: {entry} {why} (it lists folders, "
                              f"separated by '{os.pathsep}')")
    candidates = [*extra, REPO_DIR / folder, PACKAGE_DIR / "hub" / folder]
    return [p for p in candidates if p.is_dir()]


def recipe_dirs() -> list[Path]:
    return _search_path("TCLIGHTNING_RECIPES", "recipes")


def preset_dirs() -> list[Path]:
    return _search_path("TCLIGHTNING_CALLBACKS", "callbacks")


@dataclass(frozen=True)
class RecipeInfo:
    name: str  # display name (the recipe's ``name:``, else the file stem)
    path: Path
    description: str


def list_recipes() -> list[RecipeInfo]:
    """Every recipe on the search path; earlier folders shadow later ones by file name.

    A file that cannot be read is listed under its file stem with the reason as its description,
    so one broken file never hides the others (loading it gives the full error)."""
    seen: dict[str, RecipeInfo] = {}
    for folder in recipe_dirs():
        for path in sorted(folder.glob("*.yaml")):
            if path.name in seen:
                continue
            try:
                data = _read_yaml(path)
            except RecipeError as err:
                seen[path.name] = RecipeInfo(path.stem, path, f"(unreadable: {err})")
                continue
            name = str(data.get("name") or path.stem) if isinstance(data, dict) else path.stem
            description = str(data.get("description", "")) if isinstance(data, dict) else ""
            seen[path.name] = RecipeInfo(shown(name), path, shown(" ".join(description.split())))
    infos = sorted(seen.values(), key=lambda r: r.name.lower())
    for i, info in enumerate(infos):  # listed under a name that selects it (a file's name is matched first)
        if _selected(infos, info.name) != info.path:
            listed = info.path.stem if _selected(infos, info.path.stem) == info.path else str(info.path)
            infos[i] = RecipeInfo(shown(listed), info.path,
                                  f"{info.description} (its name: {info.name} selects another recipe)".strip())
    return sorted(infos, key=lambda r: r.name.lower())


def _selected(recipes: Sequence[RecipeInfo], ref: str) -> Path | None:
    """The recipe ``--recipe ref`` selects among ``recipes`` (in :func:`list_recipes`' order): a
    file's name first, on the whole search path, then a recipe's ``name:``; case is ignored."""
    for key in (lambda info: info.path.stem, lambda info: info.name):
        found = next((info.path for info in recipes if key(info).lower() == ref.lower()), None)
        if found is not None:
            return found
    return None


def _names_a_path(ref: str) -> bool:
    """Whether a recipe or preset reference is a path (``x.yaml``, ``dir/x``, ``./x``, ``~/x``)
    rather than a name: a bare name is looked up on the search path only, so a file that happens
    to be called ``tiny`` or ``monitoring`` in the working folder never stands in for the shipped one."""
    return Path(ref).suffix in (".yaml", ".yml") or os.sep in ref or ref.startswith(("~", "."))


def find_recipe(ref: str, relative_to: Path | None = None) -> Path:
    """A recipe by path (absolute, cwd-relative, or relative to the including file) or by name."""
    as_path = Path(ref).expanduser()
    if _names_a_path(ref):
        for candidate in ([relative_to / as_path] if relative_to else []) + [as_path]:
            if candidate.exists() and not candidate.is_dir():  # a FIFO is named as one when it is read
                resolved = candidate.resolve()  # /dev/stdin of a pipe resolves to no path ("pipe:[N]")
                return resolved if resolved.exists() else candidate.absolute()
        hint = _installed_recipe_hint(as_path.stem, in_file=relative_to is not None)
        raise RecipeError(f"no such recipe file: {ref}{hint}", file=str(relative_to) if relative_to else None)
    recipes = list_recipes()
    found = _selected(recipes, ref)  # a file's name first: another file's `name:` never stands in for it
    if found is not None:
        return found
    names = [r.name for r in recipes]
    close = difflib.get_close_matches(ref, names, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise RecipeError(f"unknown recipe '{ref}'{hint}; known recipes: {', '.join(names)}")


def _installed_recipe_hint(stem: str, in_file: bool) -> str:
    """For a recipe path that does not exist: the recipe of that name on the search path (or the
    closest name), as the user would write it (``--recipe NAME``, or ``NAME`` in a recipe file)."""
    recipes = list_recipes()
    names = {r.path.stem.lower(): r.name for r in recipes} | {r.name.lower(): r.name for r in recipes}
    name = names.get(stem.lower())
    if name is None:
        close = difflib.get_close_matches(stem.lower(), list(names), n=1)
        if not close:
            return ""
        name = names[close[0]]
    use = f"'{name}'" if in_file else f"--recipe {name}"
    return f" (there is a recipe named {name}: use {use})" if name.lower() == stem.lower() else f" (did you mean {use}?)"


def find_preset(ref: str, relative_to: Path) -> Path:
    as_path = Path(ref)
    for candidate in (relative_to / as_path, as_path) if _names_a_path(ref) else ():
        if candidate.is_file():
            return candidate.resolve()
    for folder in preset_dirs():
        for name in (ref, f"{ref}.yaml"):
            if (folder / name).is_file():
                return (folder / name).resolve()
            if name.endswith(".yaml") and ((folder / name).exists() or (folder / name).is_symlink()):
                _read_text(folder / name, "callback preset")  # a FIFO, a device: named as what it is, never opened
    known = sorted({p.stem for d in preset_dirs() for p in d.glob("*.yaml") if p.is_file()})
    raise RecipeError(f"unknown callback preset '{ref}'; known presets: {', '.join(known)}", key="callback_presets")


class _StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (plain YAML keeps the last)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    first_line: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            hash(key)
        except TypeError:
            continue  # construct_mapping reports unhashable keys itself
        if key in first_line and key != "<<":
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key '{key}' (first given on line {first_line[key] + 1})", key_node.start_mark
            )
        first_line[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)

# YAML 1.1 (PyYAML's) reads `010` as the octal 8, `1:30` as the base-60 90 and `1_0` as 10; YAML 1.2
# reads 10 and the texts "1:30" and "1_0". None is what a recipe means, so all are refused (quote text).
_AMBIGUOUS_NUMBER_TAG = "tag:tclightning,2026:ambiguous-number"
_AMBIGUOUS_NUMBER = re.compile(r"^[-+]?(?:0[0-7_]+|[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?"
                               r"|(?=[0-9.]*_)(?=\.?[0-9])[0-9_]*(?:\.[0-9_]*)?(?:[eE][-+]?[0-9_]+)?"
                               r"|0b[01_]+|0x[0-9a-fA-F]*_[0-9a-fA-F_]*)$")
_StrictLoader.yaml_implicit_resolvers = {first: list(resolvers) for first, resolvers
                                         in yaml.SafeLoader.yaml_implicit_resolvers.items()}
for _first in "+-.0123456789":
    _StrictLoader.yaml_implicit_resolvers.setdefault(_first, []).insert(0, (_AMBIGUOUS_NUMBER_TAG, _AMBIGUOUS_NUMBER))


def _refuse_ambiguous_number(loader: _StrictLoader, node: yaml.ScalarNode) -> Any:
    value = loader.construct_scalar(node)
    if ":" in value:
        meaning = "a base-60 number in YAML 1.1 and text in YAML 1.2: quote it, or write the number"
    elif "0b" in value:
        meaning = "a binary number in YAML 1.1 and text in YAML 1.2: write the number in decimal, or quote text"
    elif "_" in value and not re.fullmatch(r"[-+]?0[0-7_]+", value):
        meaning = ("a number in YAML 1.1, its underscores skipped, and text in YAML 1.2: write the number without "
                   "them, or quote text")
    else:
        digits = value.replace("_", "")
        meaning = (f"the octal number {int(digits, 8)} in YAML 1.1, {int(digits)} in YAML 1.2: write it without the "
                   "leading zero")
    raise yaml.constructor.ConstructorError(None, None, f"'{value}' is {meaning}", node.start_mark)


_StrictLoader.add_constructor(_AMBIGUOUS_NUMBER_TAG, _refuse_ambiguous_number)


MAX_YAML_BYTES = 1 << 20
"""A recipe or callback preset file larger than this (1 MiB) is refused unread: recipes are ~1 KB."""

MAX_YAML_NODES = 20_000
"""Values a YAML document may hold once its aliases are expanded (an alias bomb of a few hundred
bytes expands to billions; a recipe holds a few hundred)."""

MAX_YAML_DEPTH = 32
"""Nesting a YAML document may have (a recipe nests four deep)."""


def _read_yaml(path: Path) -> Any:
    """The YAML document in ``path`` (None for an empty file); one-line :class:`RecipeError` otherwise.

    Bounded: only a regular file (a FIFO or a device named ``*.yaml`` is refused without opening
    it, so nothing waits on it) of at most :data:`MAX_YAML_BYTES`, at most :data:`MAX_YAML_NODES`
    values with aliases expanded and :data:`MAX_YAML_DEPTH` levels, and no OmegaConf
    interpolation (``${...}``: a recipe holds values)."""
    data = _parse_yaml(_read_text(path), str(path))
    refuse_interpolation(data, str(path))
    return data


def _read_text(path: Path, what: str = "recipe") -> str:
    """The text of ``path``, a regular file of at most :data:`MAX_YAML_BYTES` in UTF-8; one-line
    :class:`RecipeError` otherwise (a FIFO or a device is never opened)."""
    try:
        regular_file(path, what)
    except TclightningError as err:  # the path is named once, by the RecipeError
        raise RecipeError(str(err).replace(f"{what} {path}: ", "", 1), file=str(path)) from None
    try:
        with open_regular(path, what) as fh:  # the file checked: a FIFO renamed over it is never opened
            raw = fh.read(MAX_YAML_BYTES + 1)
    except TclightningError as err:
        raise RecipeError(str(err).replace(f"{what} {path}: ", "", 1), file=str(path)) from None
    except OSError as err:
        raise RecipeError(f"cannot read: {err.strerror or err}", file=str(path)) from None
    if len(raw) > MAX_YAML_BYTES:
        raise RecipeError(f"larger than a {what} can be ({MAX_YAML_BYTES} bytes)", file=str(path))
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise RecipeError(
            f"not UTF-8 text (byte 0x{raw[err.start]:02x} at offset {err.start}); save the file as UTF-8",
            file=str(path),
        ) from None


def bounded_yaml_data(loader: yaml.BaseLoader, source: str) -> Any:
    """What ``loader`` (another parser's PyYAML loader, jsonargparse's) reads, bounded as a recipe
    is before anything is expanded: at most :data:`MAX_YAML_NODES` values with its aliases
    expanded, :data:`MAX_YAML_DEPTH` levels, integers Python converts. One-line
    :class:`RecipeError` naming ``source`` otherwise (PyYAML's ``get_single_data``, checked)."""
    try:
        node = loader.get_single_node()
    except RecursionError:
        raise RecipeError(f"nested deeper than {MAX_YAML_DEPTH} levels", file=source) from None
    if node is None:
        return None
    _check_size(node, source)
    try:
        return loader.construct_document(node)
    except ValueError as err:  # a value PyYAML cannot construct (a date that does not exist, if dates are read)
        raise RecipeError(f"not a value a configuration holds: {(str(err).splitlines() or ['ValueError'])[0]}",
                          file=source) from None


def bounded_yaml_text(path: Path, what: str) -> str:
    """The text of a YAML file another parser reads (jsonargparse, for ``lightning fit``), bounded
    as a recipe file is, before that parser expands anything: a regular file of at most
    :data:`MAX_YAML_BYTES` in UTF-8, at most :data:`MAX_YAML_NODES` values with its aliases
    expanded and :data:`MAX_YAML_DEPTH` levels. Text that is not YAML is the other parser's to
    name. One-line :class:`RecipeError` otherwise."""
    text = _read_text(path, what)
    try:
        loader = yaml.SafeLoader(text)
        try:
            node = loader.get_single_node()
        finally:
            loader.dispose()
    except yaml.YAMLError:
        return text
    except RecursionError:
        raise RecipeError(f"nested deeper than {MAX_YAML_DEPTH} levels", file=str(path)) from None
    if node is not None:
        _check_size(node, str(path))
    return text


def _parse_yaml(text: str, source: str, override: str | None = None) -> Any:
    """``text`` as YAML, bounded (:data:`MAX_YAML_NODES`, :data:`MAX_YAML_DEPTH`), keys once each,
    no YAML 1.1 octal or base-60 number; one-line :class:`RecipeError` otherwise."""
    try:
        loader = _StrictLoader(text)
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            _check_size(node, source, override)
            return loader.construct_document(node)
        finally:
            loader.dispose()
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark and override is None else ""
        problem = getattr(err, "problem", None) or str(err)
        what = "the value is not valid YAML" if override is not None else f"not valid YAML{where}"
        raise RecipeError(f"{what}: {' '.join(str(problem).split())}", file=source, override=override) from None
    except RecursionError:
        raise RecipeError(f"nested deeper than {MAX_YAML_DEPTH} levels", file=source, override=override) from None
    except ValueError as err:  # a date that does not exist (2001-02-30)
        raise RecipeError(f"not a value a recipe holds: {(str(err).splitlines() or ['ValueError'])[0]}", file=source,
                          override=override) from None


def read_record(path: Path) -> dict | None:
    """A run's resolved ``recipe.yaml`` as plain data (bounded as any recipe file), or None when
    there is none or it cannot be read: the record is compared, never trusted to run."""
    if not (path.exists() or path.is_symlink()):
        return None
    try:
        data = _read_yaml(path)
    except RecipeError:
        return None
    return data if isinstance(data, dict) else None


MAX_NUMBER_CHARS = 1000
"""The longest number a YAML document may write (a hex integer of 4,000 digits converts, and then
has more decimal digits than Python prints)."""
_NUMBER_TAGS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")


def _check_size(root: yaml.Node, source: str, override: str | None = None) -> None:
    """Refuse a node graph that expands (aliases followed) past the node or depth bound, counted
    without expanding it: each distinct node's expanded size is computed once. A number longer
    than :data:`MAX_NUMBER_CHARS` is refused too."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()  # on the current path: met again, the document refers to itself
    stack: list[tuple[yaml.Node, int, bool]] = [(root, 1, False)]
    while stack:
        node, depth, done = stack.pop()
        if depth > MAX_YAML_DEPTH:
            raise RecipeError(f"nested deeper than {MAX_YAML_DEPTH} levels", file=source, override=override)
        children = ([c for pair in node.value for c in pair] if isinstance(node, yaml.MappingNode)
                    else list(node.value) if isinstance(node, yaml.SequenceNode) else [])
        if done:
            open_nodes.discard(id(node))
            sizes[id(node)] = 1 + sum(sizes[id(c)] for c in children)
            if sizes[id(node)] > MAX_YAML_NODES:
                raise RecipeError(f"holds more than {MAX_YAML_NODES} values once its aliases are expanded "
                                  "(a recipe holds a few hundred)", file=source, override=override)
            continue
        if id(node) in sizes:
            continue
        if isinstance(node, yaml.ScalarNode) and node.tag in _NUMBER_TAGS and len(node.value) > MAX_NUMBER_CHARS:
            raise RecipeError(f"a number of {len(node.value)} characters (at most {MAX_NUMBER_CHARS})", file=source,
                              override=override)
        if id(node) in open_nodes:
            raise RecipeError("an alias refers to a value that holds it (a recipe cannot contain itself)", file=source,
                              override=override)
        open_nodes.add(id(node))
        stack.append((node, depth, True))
        stack.extend((c, depth + 1, False) for c in children if id(c) not in sizes)


def _holds_interpolation(data: Any) -> bool:
    return any(isinstance(value, str) and "${" in value for _, value in leaves(data))


def _refuse_foreign_digits(data: Any, source: str, override: str | None) -> None:
    """A number written in another script's digits (``"\uff16"``, ``"\u0663"``) is refused: Python's
    ``int()`` and ``float()`` read them, so OmegaConf would take them as a number the user never typed."""
    for key, value in leaves(data):
        if not isinstance(value, str) or value.isascii() or not _reads_as_number(value):
            continue
        shown = value.encode("ascii", "backslashreplace").decode()
        raise RecipeError(f"'{shown}' is written with digits other than 0-9; write the number in ASCII digits",
                          file=source, key=key or None, override=override)


def _reads_as_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _known_keys(node: Any) -> list[str]:
    return [str(k) for k in node.keys()] if isinstance(node, DictConfig) else []


def _explain(err: OmegaConfBaseException, schema: DictConfig, source: str, override: str | None = None) -> RecipeError:
    """One line naming the source and the key, with a 'did you mean' for unknown keys."""
    key = str(getattr(err, "full_key", "") or "")
    msg = (str(getattr(err, "msg", None) or err).splitlines() or [type(err).__name__])[0]
    if isinstance(err, ConfigKeyError) and key in RETIRED_HINTS:  # a key an earlier version read
        return RecipeError(f"no longer a key: {RETIRED_HINTS[key]}", file=source, key=key, override=override)
    if isinstance(err, ConfigKeyError):
        parent_key, _, leaf = key.rpartition(".")
        parent = OmegaConf.select(schema, parent_key) if parent_key else schema
        options = _known_keys(parent)
        close = difflib.get_close_matches(leaf, options, n=1)
        hint = f" (did you mean '{(parent_key + '.' if parent_key else '') + close[0]}'?)" if close else ""
        expected = f"; keys here: {', '.join(options)}" if options and not close else ""
        return RecipeError(f"unknown key{hint}{expected}", file=source, key=key, override=override)
    if "is not a ListConfig" in msg:  # OmegaConf's words for a scalar where the schema has a list
        msg = "expected a list, e.g. [a, b]"
    return RecipeError(msg, file=source, key=key or None, override=override)


def _check_sections(schema: DictConfig, data: dict, prefix: str, source: str, override: str | None) -> None:
    """A section (``trainer``, ``model.tiny``, ...) given anything but a mapping: name it and what came."""
    for key, value in data.items():
        if not isinstance(key, str):
            raise RecipeError(f"keys must be names, got {key!r}", file=source, key=prefix.rstrip(".") or None,
                              override=override)
        if key not in schema:
            continue  # the merge reports unknown keys, with a suggestion
        node = schema._get_node(key)
        if isinstance(node, ListConfig) and isinstance(value, dict):  # OmegaConf's merge would raise a TypeError
            indexed = all(str(k).isdigit() for k in value)  # `a.b[0]=x` from the command line
            raise RecipeError("a list is set whole (key=[a, b]), not by index" if indexed else
                              "expected a list (- entry, or [a, b]), got a mapping", file=source, key=prefix + key,
                              override=override)
        if isinstance(node, DictConfig) and OmegaConf.get_type(node) not in (dict, None):
            if not isinstance(value, dict):
                shown = "nothing (an empty section needs {})" if value is None else f"{type(value).__name__} {value!r}"
                raise RecipeError(f"expected a mapping of {key} settings, got {shown}", file=source,
                                  key=prefix + key, override=override)
            _check_sections(node, value, f"{prefix}{key}.", source, override)


def _schema_node(cfg: DictConfig, key: str) -> Any:
    """The schema's node of ``key`` (dotted), or None where the schema has no such field."""
    node: Any = cfg
    for part in key.split("."):
        if not isinstance(node, DictConfig) or part not in node:
            return None
        node = node._get_node(part)
    return node


def _is_text_key(cfg: DictConfig, key: str) -> bool:
    """Whether ``key`` (dotted) is a text field of the schema (``logging.name``, ``task.system_prompt``)."""
    return isinstance(_schema_node(cfg, key), StringNode)


def _merge(base: DictConfig, data: Any, source: str, override: str | None = None) -> DictConfig:
    if not isinstance(data, dict):
        raise RecipeError(f"expected a mapping of sections at the top level, got {type(data).__name__}", file=source)
    _check_sections(base, data, "", source, override)
    _refuse_foreign_digits(data, source, override)
    for key, value in leaves(data):
        if isinstance(value, bool) and _is_text_key(base, key):  # OmegaConf would store "True"
            raise RecipeError(f"YAML reads this value as the boolean {str(value).lower()} (yes/no/on/off are booleans), "
                              "where the key is text: quote it ('no')", file=source, key=key, override=override)
        if value is not None and not isinstance(value, bool) and isinstance(_schema_node(base, key), BooleanNode):
            # OmegaConf would read "on", "yes", "1" or 1 as true: a switch (trust_remote_code!) is set by true or false
            raise RecipeError(f"expected true or false, got {value!r}", file=source, key=key, override=override)
        if isinstance(value, str) and "_" in value and _reads_as_number(value) and not _is_text_key(base, key):
            # Python's float() and int() skip an underscore between digits: 1e-4_0 would be 1e-40
            raise RecipeError(f"'{shown(value)}' has an underscore in a number; write it without one",
                              file=source, key=key, override=override)
        if (isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 2**1024
                and isinstance(_schema_node(base, key), FloatNode)):  # OmegaConf's float() would overflow
            raise RecipeError(f"expected a finite number, got an integer of {value.bit_length()} bits, past any float",
                              file=source, key=key, override=override)
    try:
        return OmegaConf.merge(base, data)
    except OmegaConfBaseException as err:
        raise _explain(err, base, source, override) from None


MAX_INCLUDES = 64
"""Recipe files one composition may read, repeats counted (a shipped recipe reads at most 4): a
few levels of ``defaults`` that each name the next twice already mean 2^levels reads."""


def _compose(path: Path, base: DictConfig, chain: tuple[Path, ...], reads: list[int] | None = None,
             found: dict[tuple[str, Path], Path] | None = None) -> DictConfig:
    """``path`` merged onto ``base`` after its defaults; ``reads`` counts the files read and
    ``found`` holds each include already looked up, across one recipe's whole tree."""
    found = found if found is not None else {}
    if path in chain:
        cycle = " -> ".join(p.name for p in (*chain, path))
        raise RecipeError(f"recipes include each other: {cycle}", file=str(path), key="defaults")
    reads = reads if reads is not None else [0]
    reads[0] += 1
    if reads[0] > MAX_INCLUDES:
        raise RecipeError(f"its defaults read more than {MAX_INCLUDES} recipe files (a file named twice counts "
                          "twice)", file=str(chain[0] if chain else path), key="defaults")
    data = _read_yaml(path)
    if not data:
        raise RecipeError("the file is empty: a recipe needs at least a description (and usually defaults)",
                          file=str(path))
    if not isinstance(data, dict):
        raise RecipeError(f"expected a mapping of sections at the top level, got {type(data).__name__}",
                          file=str(path))
    includes = data.get("defaults", [])
    if not isinstance(includes, list):
        raise RecipeError("expected a list of recipe names or paths", file=str(path), key="defaults")
    for ref in includes:
        if (str(ref), path.parent) not in found:  # a name is looked up among every recipe: once a tree
            try:
                found[str(ref), path.parent] = find_recipe(str(ref), relative_to=path.parent)
            except RecipeError as err:
                raise RecipeError(str(err), file=str(path), key="defaults") from None
        base = _compose(found[str(ref), path.parent], base, (*chain, path), reads, found)
    # Sections merge; `name`/`description` belong to the file itself, not its includes.
    own = {k: v for k, v in data.items() if k != "defaults"}
    own.setdefault("name", path.stem)
    own.setdefault("description", "")
    merged = _merge(base, own, str(path))
    merged.defaults = [str(r) for r in includes]
    return merged


COMMAND_LINE = "command line"


def parse_overrides(overrides: Sequence[str]) -> DictConfig:
    """``key=value`` strings -> a config; each must be UTF-8 text with a ``=``."""
    for override in overrides:
        try:
            override.encode("utf-8")
        except UnicodeEncodeError:
            raw = override.encode("utf-8", "surrogateescape")
            raise RecipeError(f"an override is not valid UTF-8: {raw!r}", file=COMMAND_LINE) from None
        if "=" not in override:
            raise RecipeError(f"overrides must look like key=value, got '{override}'", file=COMMAND_LINE)
        if "${" in override.partition("=")[2]:
            raise RecipeError("interpolations (${...}) are not taken from the command line; write the value itself",
                              file=COMMAND_LINE, override=override)
        _parse_yaml(override.partition("=")[2], COMMAND_LINE, override)  # the file's bounds and refusals
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except yaml.YAMLError as err:
        problem = " ".join(str(getattr(err, "problem", None) or err).split())
        raise RecipeError(f"the value is not valid YAML: {problem}", file=COMMAND_LINE,
                          override=overrides[0] if len(overrides) == 1 else None) from None
    except OmegaConfBaseException as err:
        message = (str(err).splitlines() or [type(err).__name__])[0]
        raise RecipeError(message, file=COMMAND_LINE, override=overrides[0] if len(overrides) == 1 else None) from None


def apply_overrides(cfg: DictConfig, overrides: Sequence[str]) -> tuple[DictConfig, dict[str, str]]:
    """Merge overrides one by one (so an error names the one at fault); returns the config and
    ``{key: override}`` of the keys the command line set (the last override of a key wins)."""
    credited: dict[str, str] = {}
    for override in overrides:
        if override.partition("=")[0].strip().split(".")[0].split("[")[0] == "defaults":
            raise RecipeError("a recipe's defaults are read when its file is composed, before any override: "
                              "write a recipe that lists them (defaults: [...])", file=COMMAND_LINE, override=override)
        if "\n" in override or "\r" in override:  # YAML folds a line break to a space: another folder, silently
            raise RecipeError("holds a line break; a value on the command line is one line (a recipe file can hold "
                              "several)", file=COMMAND_LINE,
                              override=override.replace("\n", "\\n").replace("\r", "\\r"))
        try:
            data = OmegaConf.to_container(parse_overrides([override]))
            key, _, text = (part.strip() for part in override.partition("="))
            if _is_text_key(cfg, key):  # `logging.name=no`, `=1e3`: the text as typed, not YAML's false or 1000.0
                given = OmegaConf.create(data)
                if isinstance(OmegaConf.select(given, key), (bool, int, float)):
                    OmegaConf.update(given, key, text, merge=False)
                    data = OmegaConf.to_container(given)
            if _holds_interpolation(data):  # one a YAML escape spells (\u0024{...}) too
                raise RecipeError("holds an interpolation (${...}); write the value itself", file=COMMAND_LINE,
                                  override=override)
            cfg = _merge(cfg, data, COMMAND_LINE, override=override)
        except RecursionError:
            raise RecipeError("the value is nested too deeply", file=COMMAND_LINE, override=override) from None
        except TypeError:  # OmegaConf: an indexed key (`a.b[0]=x`) against a list of the schema
            raise RecipeError("a list is set whole (key=[a, b]), not by index", file=COMMAND_LINE,
                              override=override) from None
        credited[override.partition("=")[0].strip()] = override
    return cfg, credited


def load_recipe(ref: str, overrides: Sequence[str] = ()) -> DictConfig:
    """The fully composed, validated recipe as a structured ``DictConfig``.

    Raises :class:`RecipeError` (one line naming the file or the override, and the key) for
    anything outside the schema or a value's range; reads the recipe, its includes and presets,
    imports the callback modules it names, and writes nothing."""
    path = find_recipe(ref)
    schema = OmegaConf.structured(RecipeConfig)
    cfg = _compose(path, schema, ())
    cfg, credited = apply_overrides(cfg, overrides)
    presets: list[Any] = []
    for ref_preset in cfg.callback_presets:
        preset_path = find_preset(str(ref_preset), path.parent)
        entries = _read_yaml(preset_path)
        if not isinstance(entries, list):
            raise RecipeError("a callback preset is a YAML list of class_path/init_args", file=str(preset_path))
        presets.extend(entries)
    if presets:  # expanded once: a run's recipe.yaml (this config) given back as --recipe holds them as callbacks
        cfg = _merge(cfg, {"callbacks": presets + OmegaConf.to_container(cfg.callbacks), "callback_presets": []},
                     "callback_presets")
    validate(cfg, str(path), credited)
    return cfg


def to_dataclass(cfg: DictConfig) -> RecipeConfig:
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


# --------------------------------------------------------------------------------- semantics
def _credit(keys: Sequence[str], credited: dict[str, str]) -> str | None:
    """The command-line override that set one of ``keys`` (or a section holding it), if any."""
    found = None
    for key, override in credited.items():  # in command-line order: the last match wins
        if any(k == key or k.startswith(key + ".") or key.startswith(k + ".") for k in keys):
            found = override
    return found


CHECKPOINT_SECTIONS = ("model", "task", "sampler", "grpo", "anchor")
"""The recipe sections a tclightning checkpoint stores as its hyper-parameters."""


def validate_checkpoint_hparams(hparams: Any, source: str) -> None:
    """A checkpoint's hyper-parameters checked as a recipe's: its :data:`CHECKPOINT_SECTIONS`
    (an earlier version's moved keys carried over, its retired keys left out) through the schema, every key of them in its
    range, and the cross checks that read only those sections (one that needs ``trainer``, which a
    checkpoint does not store, would judge the schema's default instead). Raises
    :class:`RecipeError` naming ``source`` and the key. (What a checkpoint may never ask for,
    remote code and a model larger than its weights, is
    :func:`~tclightning.models.loading.check_checkpoint_model`.)"""
    if not isinstance(hparams, Mapping):
        raise RecipeError("not a tclightning checkpoint (no hyper-parameters)", file=source)
    saved = upgrade_sections({name: hparams[name] for name in CHECKPOINT_SECTIONS if name in hparams})
    sections = without_keys(saved, RETIRED_KEYS)
    refuse_interpolation(sections, source)
    model = sections.get("model")
    if not isinstance(model, Mapping):
        raise RecipeError("not a tclightning checkpoint (no model hyper-parameters)", file=source)
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(RecipeConfig), sections)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or None
        raise RecipeError(" ".join(str(err).split("\n")[0].split())[:200], file=source, key=key) from None
    for problem in problems(cfg, sections):
        raise RecipeError(problem.message, file=source, key=problem.keys[0])


def validate(cfg: DictConfig, source: str, credited: dict[str, str] | None = None) -> None:
    """Every value in its range (:data:`tclightning.recipes.ranges.RULES`), the cross checks, and
    importable callback classes. The first problem raises :class:`RecipeError` naming the key and
    ``source``, or the override from ``credited`` (``{key: "key=value"}``) that set it."""
    credited = credited or {}
    for problem in problems(cfg):
        override = _credit(problem.keys, credited)
        raise RecipeError(problem.message, file=COMMAND_LINE if override else source, key=problem.keys[0],
                          override=override)
    for i, spec in enumerate(cfg.callbacks):
        key = f"callbacks[{i}].class_path"
        override = _credit(("callbacks",), credited)
        if OmegaConf.is_missing(spec, "class_path"):  # `callbacks: [{}]`: an entry with nothing to build
            raise RecipeError("a callback needs a class_path (a Lightning Callback's import path)",
                              file=COMMAND_LINE if override else source, key=key, override=override)
        try:
            resolve_callback_class(spec.class_path, source, key)
        except RecipeError as err:
            if override is None:
                raise
            raise RecipeError(str(err).split(f"key '{key}': ", 1)[-1], file=COMMAND_LINE, key=key,
                              override=override) from None
    for i, entry in enumerate(cfg.logging.loggers):
        key = f"logging.loggers[{i}]"
        override = _credit(("logging.loggers",), credited)
        try:
            class_path = entry if isinstance(entry, str) else entry.class_path
            if logger_kind(resolve_logger_class(class_path, source, key)) == "wandb":
                init_args = {} if isinstance(entry, str) else OmegaConf.to_container(entry.init_args or {})
                if not wandb_can_log(init_args):  # W&B would stop the run later, with a traceback
                    raise RecipeError("W&B has no API key here (set WANDB_API_KEY or run `wandb login`), and the "
                                      "logger is not offline (WANDB_MODE=offline, or init_args: {offline: true})",
                                      file=source, key=key)
        except RecipeError as err:
            if override is None:
                raise
            raise RecipeError(str(err).split(f"key '{key}': ", 1)[-1], file=COMMAND_LINE, key=key,
                              override=override) from None


def _find_module(name: str) -> bool:
    """Whether module ``name`` exists, found without running code where possible: each level is
    looked up in the folders of the package above, so no parent ``__init__`` is executed."""
    if name in sys.modules:
        return True
    parts = name.split(".")
    try:
        spec = importlib.util.find_spec(parts[0])  # top level: a lookup, no import
        for depth in range(2, len(parts) + 1):
            if spec is None or spec.submodule_search_locations is None:
                return False  # a plain module has no submodules
            dotted = ".".join(parts[:depth])
            if dotted in sys.modules:
                spec = sys.modules[dotted].__spec__
                continue
            parent = ".".join(parts[: depth - 1])
            found = importlib.machinery.PathFinder.find_spec(dotted, list(spec.submodule_search_locations))
            if found is None and parent in sys.modules:  # a package with its own finder, already imported
                found = importlib.util.find_spec(dotted)
            spec = found
    except (ImportError, ValueError):
        return False
    return spec is not None


def resolve_callback_class(class_path: str, source: str, key: str) -> type:
    """The Lightning ``Callback`` subclass ``class_path`` names (``package.module.ClassName``).

    The module must exist (checked without importing it or its parents); then only that module
    is imported (its code runs: a recipe is as trusted as code), and the attribute must be a
    ``Callback`` subclass (a Lightning logger gets a hint to ``logging.loggers``). Nothing is
    instantiated here."""
    from lightning.pytorch import Callback
    from lightning.pytorch.loggers import Logger

    cls = _import_class(class_path, source, key, "callback")
    if isinstance(cls, type) and issubclass(cls, Logger):
        raise RecipeError(f"'{class_path}' is a Lightning logger, not a callback: list it under logging.loggers",
                          file=source, key=key)
    if not (isinstance(cls, type) and issubclass(cls, Callback)):
        raise RecipeError(f"'{class_path}' is not a lightning Callback", file=source, key=key)
    return cls


def wandb_offline(init_args: Mapping[str, Any]) -> bool:
    """Whether a W&B logger with these ``init_args`` logs locally only (or not at all)."""
    return bool(init_args.get("offline")) or os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun")


def wandb_can_log(init_args: Mapping[str, Any]) -> bool:
    """Whether a W&B logger can start without asking for a key: offline or disabled, or a key in
    ``WANDB_API_KEY`` or the netrc ``wandb login`` writes (W&B itself would stop the run with a traceback)."""
    import netrc

    if wandb_offline(init_args):
        return True
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    path = os.environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    try:  # a FIFO or a device there would be waited on without end: only a small regular file holds a key
        regular_file(path, "netrc", NETRC_MAX_BYTES)
        with pinned_file(Path(path), "netrc", NETRC_MAX_BYTES) as pinned:  # the file checked, whatever is renamed
            return netrc.netrc(str(pinned)).authenticators(host) is not None
    except (TclightningError, OSError, netrc.NetrcParseError):
        return False


NETRC_MAX_BYTES = 1 << 20
"""The largest netrc file read for a W&B key (one holds a few lines per host)."""


def resolve_logger_class(class_path: str, source: str, key: str) -> type:
    """The Lightning ``Logger`` subclass an entry of ``logging.loggers`` names: a short name of
    :data:`~tclightning.recipes.schema.LOGGERS` (its package must be installed: the error names
    the ``pip install``) or an import path, checked as :func:`resolve_callback_class` does."""
    from lightning.pytorch.loggers import Logger

    from tclightning.recipes.schema import LOGGERS

    if class_path in LOGGERS:
        name, (class_path, package) = class_path, LOGGERS[class_path]
        if package is not None and not _find_module(package):
            raise RecipeError(f"logger '{name}' needs the '{package}' package: "
                              f"pip install {'mlflow-skinny' if package == 'mlflow' else package.replace('_', '-')}"
                              " (or pip install 'tclightning[loggers]' for wandb and mlflow)",
                              file=source, key=key)
    cls = _import_class(class_path, source, key, "logger")
    if not (isinstance(cls, type) and issubclass(cls, Logger)):
        raise RecipeError(f"'{class_path}' is not a Lightning logger (lightning.pytorch.loggers.Logger)",
                          file=source, key=key)
    return cls


def logger_kind(cls: type) -> str | None:
    """The :data:`~tclightning.recipes.schema.LOGGERS` short name of the logger class ``cls`` is or
    derives from, or None: the checks of a W&B or MLflow logger go by its class, whichever path
    names it (``lightning.pytorch.loggers.mlflow.MLFlowLogger`` is ``mlflow`` too)."""
    import lightning.pytorch.loggers as lightning_loggers

    for name, (path, _) in LOGGERS.items():
        known = getattr(lightning_loggers, path.rpartition(".")[2], None)
        if isinstance(known, type) and issubclass(cls, known):
            return name
    return None


def _import_class(class_path: str, source: str, key: str, what: str) -> Any:
    """The attribute ``class_path`` names, importing only its module (see :func:`resolve_callback_class`)."""
    module_name, _, attr = class_path.rpartition(".")
    if not module_name or not all(part.isidentifier() for part in class_path.split(".")):
        raise RecipeError(f"expected an import path like package.module.ClassName, got '{class_path}'",
                          file=source, key=key)
    if not _find_module(module_name):
        raise RecipeError(f"cannot import {what} class '{class_path}': no module '{module_name}'",
                          file=source, key=key)
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 - the module's own code failed: the recipe's error
        reason = (str(err).splitlines() or [""])[0]
        raise RecipeError(f"cannot import {what} class '{class_path}': {type(err).__name__}: {reason}",
                          file=source, key=key) from None
    cls = getattr(module, attr, None)
    if cls is None:
        raise RecipeError(f"cannot import {what} class '{class_path}': module '{module_name}' has no '{attr}'",
                          file=source, key=key)
    return cls


def instantiate_callbacks(cfg: DictConfig, source: str = "recipe", overrides: Sequence[str] = ()) -> list[Any]:
    """The recipe's callbacks, built; a constructor refusing its ``init_args`` (TypeError or
    ValueError) is a :class:`RecipeError` naming ``callbacks[i].init_args`` in ``source``, or the
    override among ``overrides`` (the command line :func:`load_recipe` took) that set the callbacks."""
    override = _credit(("callbacks",), {o.partition("=")[0].strip(): o for o in overrides})
    callbacks = []
    for i, spec in enumerate(cfg.callbacks):
        cls = resolve_callback_class(spec.class_path, source, f"callbacks[{i}].class_path")
        init_args = OmegaConf.to_container(spec.init_args, resolve=True)
        try:
            callbacks.append(cls(**init_args))
        except (TypeError, ValueError) as err:
            reason = (str(err).splitlines() or [type(err).__name__])[0]
            raise RecipeError(reason, file=COMMAND_LINE if override else source, key=f"callbacks[{i}].init_args",
                              override=override) from None
    clash = state_key_clash(callbacks)
    if clash is not None:
        first, second = clash
        raise RecipeError(f"{same_state_message(callbacks[second], f'callbacks[{first}]')} (the list counts the "
                          "callbacks its defaults and presets bring first)", file=COMMAND_LINE if override else source,
                          key=f"callbacks[{second}]", override=override)
    return callbacks


def state_key_clash(callbacks: Sequence[Any]) -> tuple[int, int] | None:
    """The first two stateful callbacks (a ``state_dict`` of their own) that share a ``state_key``,
    as indices: a checkpoint keeps one state per key, and Lightning refuses such a list with a
    traceback when the fit starts."""
    from lightning.pytorch import Callback
    from lightning.pytorch.utilities.model_helpers import is_overridden

    seen: dict[str, int] = {}
    for i, callback in enumerate(callbacks):
        if not isinstance(callback, Callback) or not is_overridden("state_dict", instance=callback, parent=Callback):
            continue
        if callback.state_key in seen:
            return seen[callback.state_key], i
        seen[callback.state_key] = i
    return None


def same_state_message(callback: Any, other: str) -> str:
    """What a user reads about ``callback`` sharing its checkpoint state with ``other``."""
    try:
        named = "name" in inspect.signature(type(callback)).parameters  # a health monitor's state is its name's
    except (TypeError, ValueError):
        named = False
    way = "remove one, or give it its own `name`" if named else "remove one"
    return f"a second {type(callback).__name__} with the same checkpoint state as {other}: {way}"


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg)


__all__ = ["RecipeInfo", "apply_overrides", "find_recipe", "instantiate_callbacks", "list_recipes", "load_recipe",
           "resolve_callback_class", "resolve_logger_class", "same_state_message", "state_key_clash", "to_dataclass",
           "to_yaml", "validate", "ListConfig"]
