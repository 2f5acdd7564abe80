"""How warnings read on the console: one line, no file:line where that line says nothing.

Lightning installs a warning format that prefixes every warning raised through its rank-zero
helpers with the helper's own location (``.../rank_zero.py:42:``), whatever raised it; this
module replaces that prefix (and gives the health monitors' warnings a ``health:`` prefix).
"""

from __future__ import annotations

import warnings
from pathlib import Path


def _plain_warning_format(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                          line: str | None = None) -> str:
    """``category: message`` for warnings that reach the console through Lightning's rank-zero
    helpers (whose file:line is always ``rank_zero.py:42``, the helper's own line), ``health:
    message`` for the health monitors' warnings; the format installed before for everything else."""
    # by name: tclightning.callbacks imports this module, so importing it back here would be a cycle
    if any(c.__name__ == "HealthWarning" and c.__module__.startswith("tclightning.") for c in category.__mro__):
        return f"health: {message}\n"
    if Path(filename).name == "rank_zero.py":
        return f"{category.__name__}: {message}\n"
    return _previous_warning_format(message, category, filename, lineno, line)


_previous_warning_format = warnings.formatwarning
_installed = False


def install_warning_format() -> None:
    """Format warnings raised through Lightning's ``rank_zero_warn`` / ``rank_zero_only`` without
    the helper's file:line (``.../rank_zero.py:42:``), and health warnings as ``health: ...``.
    Once per process (a format installed on top of it later may call it, and must not be called
    back); other warnings keep the format installed before (Lightning's or Python's)."""
    global _previous_warning_format, _installed
    if not _installed:
        _installed = True
        _previous_warning_format = warnings.formatwarning
        warnings.formatwarning = _plain_warning_format
