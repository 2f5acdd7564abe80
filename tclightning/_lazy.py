"""Lazy package attributes: reading a recipe imports config dataclasses, not torch."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_attributes(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` that imports ``exports[name]`` (a module path) on first use."""

    def __getattr__(name: str) -> Any:
        if name in exports:
            return getattr(importlib.import_module(exports[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
