"""A recipe key's range and help, declared once, beside its dataclass field (litgpt style).

    steps: int = setting(100, positive(MAX_STEPS), "RL steps (one = P prompts x G completions, then the update)")

:func:`setting` is ``dataclasses.field`` with the rule and the help as its metadata. A rule takes
the value and returns ``None`` when it is acceptable, else what was expected (``"expected a
finite number > 0, got -1.0"``). :func:`settings` walks a config dataclass, and the config
dataclasses it holds, into its keys; :func:`field_problems` checks an instance against them. The
recipe loader checks a recipe with the same rules (``tclightning/recipes/ranges.py``, which also
holds the cross checks: what one value cannot say alone).

Every section's config module imports this one and nothing here imports a subpackage, so no
import circle can pass through it. Everything is pure and cheap.
"""

from __future__ import annotations

import re

import copy
import difflib
import json
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from functools import cache
from typing import Any, TypeVar

C = TypeVar("C")

Rule = Callable[[Any], "str | None"]

SEED_MAX = 2**32 - 1  # numpy and Lightning seed with unsigned 32-bit integers
MAX_STEPS = 10**9  # RL steps: far beyond any run, far below the int64 arithmetic of the prompt stream
MAX_TOKENS = 2**20  # a completion or context length no decoder in reach has
MAX_WIDTH = 2**16  # tiny-model sizes (hidden, intermediate, heads, layers)

_RULE, _HELP = "tclightning.rule", "tclightning.help"


@dataclass(frozen=True)
class Problem:
    """A value outside its range: the keys involved (first = the one reported) and what was expected."""

    keys: tuple[str, ...]
    message: str


# ------------------------------------------------------------------------------------ rules
def _show(bound: float) -> str:
    return str(bound) if isinstance(bound, int) else f"{bound:g}"


def _interval(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{_show(low)}, {_show(high)}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {_show(low)}"
    if high is not None:
        return f"{'<' if high_open else '<='} {_show(high)}"
    return ""


def _bounded(kind: str, accepts: Callable[[Any], bool], low: float | None, high: float | None,
             low_open: bool, high_open: bool, optional: bool) -> Rule:
    """A value ``accepts`` takes, within the bounds (``*_open``: the bound itself is excluded)."""
    expected = " ".join(p for p in (kind, _interval(low, high, low_open, high_open)) if p)
    if optional:
        expected += " or null"

    def rule(value: Any) -> str | None:
        if value is None:
            return None if optional else f"expected {expected}, got null"
        ok = (accepts(value) and (low is None or (value > low if low_open else value >= low))
              and (high is None or (value < high if high_open else value <= high)))
        return None if ok else f"expected {expected}, got {value!r}"

    return rule


def number(low: float | None = None, high: float | None = None, *, low_open: bool = False,
           high_open: bool = False, optional: bool = False) -> Rule:
    """A finite float within the bounds (``*_open``: the bound itself is excluded)."""

    def finite(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    return _bounded("a finite number", finite, low, high, low_open, high_open, optional)


def integer(low: int | None = None, high: int | None = None, *, optional: bool = False) -> Rule:
    """An int within ``[low, high]``."""

    def whole(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    return _bounded("an integer", whole, low, high, False, False, optional)


def positive(high: int | None = None, *, optional: bool = False) -> Rule:
    """An int in ``[1, high]``."""
    return integer(1, high, optional=optional)


def seed() -> Rule:
    """A seed numpy and Lightning accept."""
    return integer(0, SEED_MAX)


def share() -> Rule:
    """A fraction in [0, 1]."""
    return number(0.0, 1.0)


def one_of(options: Iterable[str], *, optional: bool = False) -> Rule:
    """One of ``options`` (pass the owner's own names: a tuple, or a dict's keys); null only with ``optional``."""
    names = tuple(options)

    def rule(value: Any) -> str | None:
        if value is None and optional:
            return None
        return None if value in names else f"expected one of {', '.join(names)}, got {value!r}"

    return rule


def text(*, nonempty: bool = False, optional: bool = False, printable: bool = False, lines: bool = False,
         max_chars: int | None = None) -> Rule:
    """A string (non-blank with ``nonempty``; with ``printable``, no control or format characters,
    which a terminal or a folder name would act on, and no line breaks or tabs unless ``lines``; at
    most ``max_chars`` characters); null only with ``optional``."""

    def rule(value: Any) -> str | None:
        if value is None:
            return None if optional else "expected a string, got null"
        if not isinstance(value, str):
            return f"expected a string, got {value!r}"
        if max_chars is not None and len(value) > max_chars:
            return f"expected at most {max_chars} characters, got {len(value)}"
        if nonempty and not value.strip():
            return "expected a non-empty string"
        shown = value.replace("\n", "").replace("\t", "") if lines else value
        if printable and not shown.isprintable():
            bad = next(c for c in shown if not c.isprintable())
            return f"expected printable text, got {value!r} (it holds U+{ord(bad):04X})"
        return None

    return rule


def local_folder(value: Any) -> str | None:
    """A folder on this machine: printable text that is no URL (``s3://b/r`` would be taken as the
    relative folder ``s3:/b/r``); a logger may still write to a store of its own (its ``save_dir``)."""
    problem = text(nonempty=True, printable=True)(value)
    if problem is None and (re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", value) or "::" in value):
        problem = (f"expected a folder on this machine, got the URL {value!r} (the run folder holds its checkpoints; "
                   "a logger can write to a store: give it a save_dir there)")
    return problem


def flag(value: Any) -> str | None:
    """true or false (the schema's type already guarantees it; listed so every key has a rule)."""
    return None if isinstance(value, bool) else f"expected true or false, got {value!r}"


def anything(value: Any) -> str | None:
    """Free-form (names, descriptions, lists checked elsewhere)."""
    return None


def list_of(item: Rule, length: int | None = None, *, optional: bool = False, nonempty: bool = False) -> Rule:
    """A list of ``length`` values (any length when None; at least one with ``nonempty``), each passing ``item``."""

    def rule(value: Any) -> str | None:
        if value is None:
            return None if optional else "expected a list, got null"
        if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):  # a text is no list of its letters
            return f"expected a list, got {type(value).__name__} {value!r}"[:200]
        items = list(value)
        if nonempty and not items:
            return "expected at least one value, got []"
        if length is not None and len(items) != length:
            return f"expected a list of {length} values, got {len(items)}: {items}"
        for i, entry in enumerate(items):
            problem = item(entry)
            if problem is not None:
                return f"entry {i}: {problem}"
        return None

    return rule


def read_once(value: Any) -> Any:
    """A list argument read into a tuple once, so that its check and its use see the same values (a
    generator checked first would be used up); a text, a mapping or a value that is no iterable is
    given back as it is, for :func:`list_of` to refuse (``list("gap.level")`` is its letters)."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        return value
    return tuple(value)


# --------------------------------------------------------------------------- fields and walks
def setting(default: Any, rule: Rule, help: str) -> Any:  # noqa: A002 - the word the docs use
    """A dataclass field with its range and its help. A list or dict default is copied per
    instance (``dataclasses`` refuses a shared mutable default)."""
    metadata = {_RULE: rule, _HELP: help}
    if isinstance(default, (list, dict, set)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def help_text(f: Any) -> str | None:
    """The help a :func:`setting` field declares (None for a field declared otherwise)."""
    return f.metadata.get(_HELP)


@dataclass(frozen=True)
class Setting:
    """One key of a config: its dotted name (from the walked class), range and help."""

    key: str
    rule: Rule
    help: str


def _section(f: Any) -> type | None:
    """The config dataclass a field holds whole (``tiny: TinyModelConfig = field(default_factory=...)``)."""
    factory = f.default_factory
    return factory if factory is not MISSING and isinstance(factory, type) and is_dataclass(factory) else None


@cache
def settings(cls: type, prefix: str = "") -> tuple[Setting, ...]:
    """Every key of config dataclass ``cls`` in field order, sections recursed into. Raises
    ``TypeError`` for a field declared without :func:`setting` (a key without a range)."""
    found: list[Setting] = []
    for f in fields(cls):
        section = _section(f)
        if section is not None:
            found.extend(settings(section, f"{prefix}{f.name}."))
        elif _RULE in f.metadata:
            found.append(Setting(prefix + f.name, f.metadata[_RULE], f.metadata[_HELP]))
        else:
            raise TypeError(f"{cls.__qualname__}.{f.name} has no range: declare it with tclightning.settings.setting")
    return tuple(found)


def field_problems(config: Any, prefix: str) -> Iterator[Problem]:
    """Each value of the config dataclass instance ``config`` outside its range, named
    ``<prefix>.<key>`` (what a recipe's loader reports for the same value)."""
    for s in settings(type(config)):
        value = config
        for part in s.key.split("."):
            value = getattr(value, part)
        message = s.rule(value)
        if message is not None:
            yield Problem((f"{prefix}.{s.key}",), message)


def without_keys(section: Mapping[str, Any], keys: Iterable[str]) -> dict[str, Any]:
    """``section`` (a config section as a mapping: a checkpoint's hyper-parameters, a run's record)
    less the dotted ``keys``, nested mappings copied: how an earlier version's record of a retired
    key is read (each config module lists its section's as ``RETIRED_KEYS``)."""
    out = dict(section)
    for key in keys:
        head, _, rest = key.partition(".")
        if not rest:
            out.pop(head, None)
        elif isinstance(out.get(head), Mapping):
            out[head] = without_keys(out[head], [rest])
    return out


def options(cls: type) -> Rule:
    """A mapping of some of the options the dataclass ``cls`` declares (with :func:`setting`), each
    in its own range: the rule of a key that holds a small group of related options (``sampler.vllm``).
    An option it does not name keeps its default (:func:`options_of`)."""
    known = {s.key: s.rule for s in settings(cls)}
    names = ", ".join(known)

    def rule(value: Any) -> str | None:
        if not isinstance(value, Mapping):
            return f"expected a mapping of {names}, got {value!r}"
        for key, item in value.items():
            if key not in known:
                close = difflib.get_close_matches(str(key), list(known), n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                return f"unknown option '{key}'{hint}; it takes {names}"
            problem = known[key](item)
            if problem is not None:
                return f"{key}: {problem}"
        return None

    return rule


def grouped(cls: type, help: str) -> Any:  # noqa: A002 - the word the docs use
    """A field holding options of ``cls`` as one mapping (rule :func:`options`), every option at its
    default; its help names each option with its default and help, so the reference lists them."""
    defaults = cls()
    listed = "; ".join(f"``{s.key}`` ({json.dumps(getattr(defaults, s.key))}): {s.help}" for s in settings(cls))
    return setting({s.key: getattr(defaults, s.key) for s in settings(cls)}, options(cls), f"{help}. {listed}")


def options_of(cls: type[C], value: Mapping[str, Any] | C) -> C:
    """``value`` (a mapping :func:`options` accepted, or already a ``cls``) as ``cls``: an option it
    does not name keeps its default."""
    return value if isinstance(value, cls) else cls(**dict(value))


def moved_keys(section: Mapping[str, Any], moves: Mapping[str, str]) -> dict[str, Any]:
    """``section`` as an earlier version saved it (a checkpoint's hyper-parameters, a run's record),
    each old key of ``moves`` carried to the option of a mapping key that holds it now (``{"vllm_sleep":
    "vllm.sleep"}``); a section without the old keys is returned as it was (copied)."""
    out = dict(section)
    for old, new in moves.items():
        if old in out:
            head, _, option = new.partition(".")
            value = out.pop(old)
            out[head] = {**dict(out.get(head) or {}), option: value}
    return out


def check_arguments(owner: str, arguments: Mapping[str, tuple[Any, Rule]]) -> None:
    """Constructor arguments checked by the same rules as recipe keys (``{name: (value, rule)}``):
    the first out of its range raises ``ValueError("owner: name: ...")``, which a recipe's
    ``callbacks[i].init_args`` reports as that key's error."""
    for name, (value, rule) in arguments.items():
        problem = rule(value)
        if problem is not None:
            raise ValueError(f"{owner}: {name}: {problem}")


def leaves(data: Any, key: str = "") -> Iterator[tuple[str, Any]]:
    """Every scalar of a recipe's plain data with the key it sits at (``grpo.lr``, ``callbacks[0]``)."""
    if isinstance(data, dict):
        for k, v in data.items():
            yield from leaves(v, f"{key}.{k}" if key else str(k))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            yield from leaves(v, f"{key}[{i}]")
    else:
        yield key, data


def refuse_interpolation(data: Any, source: str) -> None:
    """A recipe, or a checkpoint's hyper-parameters, holds values: an OmegaConf interpolation
    (``${...}``, which resolves environment variables and other keys) is a
    :class:`~tclightning.errors.RecipeError` naming its key."""
    from tclightning.errors import RecipeError

    for key, value in leaves(data):
        if isinstance(value, str) and "${" in value:
            raise RecipeError(f"holds an interpolation ({value!r}); recipes hold values, write the value itself",
                              file=source, key=key or None)


__all__ = ["MAX_STEPS", "MAX_TOKENS", "MAX_WIDTH", "SEED_MAX", "Problem", "Rule", "Setting", "anything",
           "check_arguments", "field_problems", "flag", "grouped", "help_text", "integer", "leaves", "list_of",
           "moved_keys", "number", "one_of", "options", "options_of", "positive", "refuse_interpolation", "seed",
           "setting", "settings", "share", "text", "without_keys"]
