"""User-facing errors: the CLI prints them as one line and exits 2 (``--debug`` shows the traceback)."""

from __future__ import annotations


class TclightningError(Exception):
    """Base class for errors caused by user input (recipes, paths, options), not by bugs."""

    exit_code: int = 2


class RecipeError(TclightningError):
    """A recipe that cannot be loaded or validated. The message names the file and the key."""

    def __init__(self, message: str, *, file: str | None = None, key: str | None = None) -> None:
        self.file = file
        self.key = key
        where = ": ".join(part for part in (file, f"key '{key}'" if key else None) if part)
        super().__init__(f"{where}: {message}" if where else message)
