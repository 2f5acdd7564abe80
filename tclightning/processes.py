"""The Python processes tclightning starts (a tokenizer measure, reward workers, benchmark ranks,
torchrun nodes) never import from the working folder: ``python -c`` and ``python -m`` put it first
on the import path, so a ``json.py`` in a cloned repository or a shared folder would run inside
them. ``PYTHONSAFEPATH`` (Python 3.11+) keeps it off; every child of the ``tclightning`` command
inherits it (:func:`keep_children_off_the_working_folder`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

SAFE_PATH = {"PYTHONSAFEPATH": "1"}


def child_environment(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """``base`` (``os.environ``) with ``PYTHONSAFEPATH=1`` and ``extra``: the environment for a
    process started by ``subprocess``."""
    return {**(os.environ if base is None else base), **SAFE_PATH, **extra}


@contextlib.contextmanager
def safe_import_path() -> Iterator[None]:
    """``PYTHONSAFEPATH=1`` in ``os.environ`` for the block: for ``multiprocessing``'s spawn, which
    starts its process with the environment as it is (and ``python -c``)."""
    before = os.environ.get("PYTHONSAFEPATH")
    os.environ.update(SAFE_PATH)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PYTHONSAFEPATH", None)
        else:
            os.environ["PYTHONSAFEPATH"] = before


def keep_children_off_the_working_folder() -> None:
    """For the ``tclightning`` command: every process it starts from now on, its own and those of
    Lightning, torch and multiprocessing, inherits ``PYTHONSAFEPATH=1``."""
    os.environ.update(SAFE_PATH)
