"""Find, compose, override and validate recipes.

A recipe is a YAML file checked against :class:`RecipeConfig`. Composition order, lowest to
highest priority: schema defaults, each entry of ``defaults`` (recursively, in order), the file
itself, then ``key=value`` overrides from the command line. ``callback_presets`` entries are YAML
lists of ``class_path``/``init_args`` from the top-level ``callbacks/`` folder, placed before the
recipe's own ``callbacks``. Every error names the file and the key (:class:`RecipeError`).
"""

from __future__ import annotations

import difflib
import importlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from tclightning.errors import RecipeError
from tclightning.recipes.schema import RecipeConfig

PACKAGE_DIR = Path(__file__).resolve().parents[1]
REPO_DIR = PACKAGE_DIR.parent


def _search_path(env_var: str, folder: str) -> list[Path]:
    """User folders from ``env_var``, then the repo's top-level folder, then the packaged copy."""
    extra = [Path(p) for p in os.environ.get(env_var, "").split(os.pathsep) if p]
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
    """Every recipe on the search path; earlier folders shadow later ones by file name."""
    seen: dict[str, RecipeInfo] = {}
    for folder in recipe_dirs():
        for path in sorted(folder.glob("*.yaml")):
            if path.name in seen:
                continue
            data = _read_yaml(path)
            name = str(data.get("name") or path.stem) if isinstance(data, dict) else path.stem
            description = str(data.get("description", "")) if isinstance(data, dict) else ""
            seen[path.name] = RecipeInfo(name, path, " ".join(description.split()))
    return sorted(seen.values(), key=lambda r: r.name.lower())


def find_recipe(ref: str, relative_to: Path | None = None) -> Path:
    """A recipe by path (absolute, cwd-relative, or relative to the including file) or by name."""
    as_path = Path(ref).expanduser()
    for candidate in ([relative_to / as_path] if relative_to else []) + [as_path]:
        if candidate.is_file():
            return candidate.resolve()
    if as_path.suffix in (".yaml", ".yml") or os.sep in ref:
        raise RecipeError(f"no such recipe file: {ref}", file=str(relative_to) if relative_to else None)
    recipes = list_recipes()
    for info in recipes:
        if ref.lower() in (info.name.lower(), info.path.stem.lower()):
            return info.path
    names = [r.name for r in recipes]
    close = difflib.get_close_matches(ref, names, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise RecipeError(f"unknown recipe '{ref}'{hint}; known recipes: {', '.join(names)}")


def find_preset(ref: str, relative_to: Path) -> Path:
    as_path = Path(ref)
    for candidate in (relative_to / as_path, as_path):
        if candidate.is_file():
            return candidate.resolve()
    for folder in preset_dirs():
        for name in (ref, f"{ref}.yaml"):
            if (folder / name).is_file():
                return (folder / name).resolve()
    known = sorted({p.stem for d in preset_dirs() for p in d.glob("*.yaml")})
    raise RecipeError(f"unknown callback preset '{ref}'; known presets: {', '.join(known)}", key="callback_presets")


def _read_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise RecipeError(f"not valid YAML{where}: {getattr(err, 'problem', err)}", file=str(path)) from None
    except OSError as err:
        raise RecipeError(f"cannot read: {err.strerror}", file=str(path)) from None


def _known_keys(node: Any) -> list[str]:
    return [str(k) for k in node.keys()] if isinstance(node, DictConfig) else []


def _explain(err: OmegaConfBaseException, schema: DictConfig, source: str) -> RecipeError:
    """One line naming the source and the key, with a 'did you mean' for unknown keys."""
    key = str(getattr(err, "full_key", "") or "")
    msg = str(getattr(err, "msg", err)).splitlines()[0]
    if isinstance(err, ConfigKeyError):
        parent_key, _, leaf = key.rpartition(".")
        parent = OmegaConf.select(schema, parent_key) if parent_key else schema
        options = _known_keys(parent)
        close = difflib.get_close_matches(leaf, options, n=1)
        hint = f" (did you mean '{(parent_key + '.' if parent_key else '') + close[0]}'?)" if close else ""
        expected = f"; keys here: {', '.join(options)}" if options and not close else ""
        return RecipeError(f"unknown key{hint}{expected}", file=source, key=key)
    return RecipeError(msg, file=source, key=key or None)


def _merge(base: DictConfig, data: Any, source: str) -> DictConfig:
    if not isinstance(data, dict):
        raise RecipeError(f"expected a mapping of sections at the top level, got {type(data).__name__}", file=source)
    try:
        return OmegaConf.merge(base, data)
    except OmegaConfBaseException as err:
        raise _explain(err, base, source) from None


def _compose(path: Path, base: DictConfig, chain: tuple[Path, ...]) -> DictConfig:
    if path in chain:
        cycle = " -> ".join(p.name for p in (*chain, path))
        raise RecipeError(f"recipes include each other: {cycle}", file=str(path), key="defaults")
    data = _read_yaml(path)
    if not isinstance(data, dict):
        raise RecipeError("expected a mapping of sections at the top level", file=str(path))
    includes = data.get("defaults", [])
    if not isinstance(includes, list):
        raise RecipeError("expected a list of recipe names or paths", file=str(path), key="defaults")
    for ref in includes:
        try:
            included = find_recipe(str(ref), relative_to=path.parent)
        except RecipeError as err:
            raise RecipeError(str(err), file=str(path), key="defaults") from None
        base = _compose(included, base, (*chain, path))
    # Sections merge; `name`/`description` belong to the file itself, not its includes.
    own = {k: v for k, v in data.items() if k != "defaults"}
    own.setdefault("name", path.stem)
    own.setdefault("description", "")
    merged = _merge(base, own, str(path))
    merged.defaults = [str(r) for r in includes]
    return merged


def parse_overrides(overrides: Sequence[str]) -> DictConfig:
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise RecipeError(f"overrides must look like key=value, got '{bad[0]}'", file="command line")
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as err:
        raise RecipeError(str(err).splitlines()[0], file="command line") from None


def load_recipe(ref: str, overrides: Sequence[str] = ()) -> DictConfig:
    """The fully composed, validated recipe as a structured ``DictConfig``."""
    path = find_recipe(ref)
    schema = OmegaConf.structured(RecipeConfig)
    cfg = _compose(path, schema, ())
    if overrides:
        cfg = _merge(cfg, OmegaConf.to_container(parse_overrides(overrides)), "command line")
    presets: list[Any] = []
    for ref_preset in cfg.callback_presets:
        preset_path = find_preset(str(ref_preset), path.parent)
        entries = _read_yaml(preset_path)
        if not isinstance(entries, list):
            raise RecipeError("a callback preset is a YAML list of class_path/init_args", file=str(preset_path))
        presets.extend(entries)
    if presets:
        cfg = _merge(cfg, {"callbacks": presets + OmegaConf.to_container(cfg.callbacks)}, "callback_presets")
    validate(cfg, str(path))
    return cfg


def to_dataclass(cfg: DictConfig) -> RecipeConfig:
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


# --------------------------------------------------------------------------------- semantics
CHOICES = {
    "model.source": ("tiny", "hf", "gguf"),
    "sampler.backend": ("hf", "vllm"),
    "grpo.loss_aggregation": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
    "grpo.scale_rewards": ("group", "none"),
    "grpo.overlong": ("none", "mask", "penalty"),
    "trainer.precision": ("32-true", "32", "bf16-mixed", "bf16-true", "16-mixed"),
    "logging.progress": ("rich", "tqdm", "none"),
    "anchor.merger": ("none", "signed_ema", "dense"),
    "anchor.projector": ("none", "damped_linear", "rank1"),
    "anchor.warmup": ("none", "la_warmup"),
}
POSITIVE = ("trainer.steps", "sampler.group_size", "sampler.max_new_tokens", "sampler.batch_size",
            "grpo.prompts_per_step", "grpo.epochs", "grpo.minibatches")


def validate(cfg: DictConfig, source: str) -> None:
    """Checks types cannot express: enumerations, positivity, importable callback classes."""
    for key, options in CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in options:
            raise RecipeError(f"expected one of {', '.join(options)}, got '{value}'", file=source, key=key)
    for key in POSITIVE:
        if OmegaConf.select(cfg, key) < 1:
            raise RecipeError(f"expected a positive integer, got {OmegaConf.select(cfg, key)}", file=source, key=key)
    if cfg.sampler.group_size < 2:
        raise RecipeError("GRPO needs at least 2 completions per prompt", file=source, key="sampler.group_size")
    if cfg.anchor.merger == "signed_ema" and cfg.trainer.strategy != "pipeline":
        raise RecipeError(
            "signed_ema merges a compressed trainer's gradient with the dense anchor's: set "
            "trainer.strategy: pipeline with a compressed pipeline.layout",
            file=source, key="anchor.merger",
        )
    for i, spec in enumerate(cfg.callbacks):
        resolve_callback_class(spec.class_path, source, f"callbacks[{i}].class_path")


def resolve_callback_class(class_path: str, source: str, key: str) -> type:
    """Import ``class_path`` and check it is a Lightning ``Callback``."""
    from lightning.pytorch import Callback

    module_name, _, attr = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), attr) if module_name else None
    except (ImportError, AttributeError):
        cls = None
    if cls is None:
        raise RecipeError(f"cannot import callback class '{class_path}'", file=source, key=key)
    if not (isinstance(cls, type) and issubclass(cls, Callback)):
        raise RecipeError(f"'{class_path}' is not a lightning Callback", file=source, key=key)
    return cls


def instantiate_callbacks(cfg: DictConfig) -> list[Any]:
    callbacks = []
    for i, spec in enumerate(cfg.callbacks):
        cls = resolve_callback_class(spec.class_path, "recipe", f"callbacks[{i}].class_path")
        init_args = OmegaConf.to_container(spec.init_args, resolve=True)
        try:
            callbacks.append(cls(**init_args))
        except TypeError as err:
            raise RecipeError(str(err), file="recipe", key=f"callbacks[{i}].init_args") from None
    return callbacks


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg)


__all__ = ["RecipeInfo", "find_recipe", "instantiate_callbacks", "list_recipes", "load_recipe", "to_dataclass",
           "to_yaml", "validate", "ListConfig"]
