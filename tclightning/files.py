"""Paths tclightning opens but did not create (a regular file, or a clear refusal), and folders it
replaces (swapped in one step, never deleted first).

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


def exchange(a: Path, b: Path) -> None:
    """Swap two folders atomically (Linux ``renameat2(RENAME_EXCHANGE)``); elsewhere, or where the
    filesystem cannot, move ``b`` aside, ``a`` into place and the old ``b`` to ``a``'s name."""
    if _renameat2_exchange(a, b):
        return
    aside = a.with_name(a.name + "-old")
    os.replace(b, aside)
    try:
        os.replace(a, b)
    except BaseException:
        os.replace(aside, b)
        raise
    os.replace(aside, a)


def _renameat2_exchange(a: Path, b: Path) -> bool:
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    result = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    return result == 0
