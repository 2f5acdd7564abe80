"""Paths tclightning opens but did not create: a regular file, or a clear refusal.

Opening a FIFO for reading waits for a writer, and a device such as ``/dev/zero`` never ends:
either hangs a resume, an export or a replay. :func:`regular_file` looks with ``stat`` (which
never blocks) before anything opens the path.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from tclightning.errors import TclightningError


def regular_file(path: str | os.PathLike, what: str) -> Path:
    """``path`` as a ``Path`` if it names a regular file (links followed); ``TclightningError``
    (one line: ``what``, the path and what it is instead) otherwise, including when it is missing."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except OSError as err:
        raise TclightningError(f"{what} {path}: {err.strerror or err}") from None
    if not stat.S_ISREG(mode):
        kind = ("a directory" if stat.S_ISDIR(mode) else "a named pipe (FIFO)" if stat.S_ISFIFO(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "not a regular file")
        raise TclightningError(f"{what} {path}: is {kind}, not a regular file; nothing was read")
    return path
