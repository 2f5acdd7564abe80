"""User-facing errors: the CLI prints them as one line and exits 2 (``--debug`` shows the traceback)."""

from __future__ import annotations


class TclightningError(Exception):
    """Base class for errors caused by user input (recipes, paths, options), not by bugs."""

    exit_code: int = 2


class RecipeError(TclightningError):
    """A recipe that cannot be loaded or validated. The message names the file (or the command-line
    override) and the key: ``recipes/x.yaml: key 'grpo.lr': ...`` or ``command line: override
    'grpo.lr=-1': ...`` (the key is repeated only when it is not the one the override sets)."""

    def __init__(self, message: str, *, file: str | None = None, key: str | None = None,
                 override: str | None = None) -> None:
        self.file = file
        self.key = key
        self.override = override
        overridden = override.partition("=")[0].strip() if override is not None else None
        parts = (
            file,
            f"override '{_shortened(override)}'" if override is not None else None,
            f"key '{key}'" if key and key != overridden else None,
        )
        where = ": ".join(part for part in parts if part)
        super().__init__(f"{where}: {message}" if where else message)


SHOWN_OVERRIDE_CHARS = 200
"""An override longer than this is shown by its start and end in an error line."""


def _shortened(override: str) -> str:
    if len(override) <= SHOWN_OVERRIDE_CHARS:
        return override
    half = SHOWN_OVERRIDE_CHARS // 2
    return f"{override[:half]}...({len(override) - 2 * half} characters)...{override[-half:]}"


class StorageError(TclightningError):
    """A write the machine's storage refused (disk full, read-only, quota): one line, exit 1; what
    was saved before is kept and the run resumes from it once the storage takes writes again."""

    exit_code = 1


def one_line(err: BaseException) -> str:
    """The first sentence of an error, on one line (library messages, torch's and MLflow's, run to paragraphs)."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text.split(". ", 1)[0][:160]
