"""Paths tclightning opens but did not create (a regular file, or a clear refusal), and folders it
replaces (swapped in one step, never deleted first).

Opening a FIFO for reading waits for a writer, and a device such as ``/dev/zero`` never ends:
either hangs a resume, an export or a replay. :func:`regular_file` looks with ``stat`` (which
never blocks) before anything opens the path.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from tclightning.errors import StorageError, TclightningError

STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EFBIG})
"""The errors of storage that refuses a write (full, read-only, over quota, file too large): the
machine's state, not a bug; a run reports them in one line and keeps what it saved."""


def refused_by_storage(err: BaseException) -> bool:
    """Whether ``err`` is an ``OSError`` of :data:`STORAGE_ERRNOS`, or a writer's own error that
    carries one (safetensors reports a full disk as ``SafetensorError: ... code: 28 ...``)."""
    if isinstance(err, OSError):
        return err.errno in STORAGE_ERRNOS
    if isinstance(err, TclightningError):  # worded already (a StorageError names what it kept)
        return False
    text = str(err)
    return isinstance(err, Exception) and any(os.strerror(code) in text for code in STORAGE_ERRNOS)


def storage_reason(err: BaseException) -> str:
    """What the storage said, on one line: ``No space left on device``, with the file when known."""
    if isinstance(err, OSError):
        return f"{err.filename}: {err.strerror}" if err.filename else str(err.strerror or err)
    return next(os.strerror(code) for code in STORAGE_ERRNOS if os.strerror(code) in str(err))


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
    real = path.resolve()
    if real.parts[1:2] in (("proc",), ("sys",)):  # kernel interfaces: S_ISREG, yet a read may block forever
        raise TclightningError(f"{what} {path}: is {real}, a kernel interface, not a file; nothing was read")
    return path


def file_in_the_way(folder: Path) -> Path | None:
    """The file that keeps ``folder`` from being a folder to write into: ``folder`` itself, or the
    nearest existing folder on the way to it, when that is not a directory; ``None`` otherwise."""
    for candidate in (folder, *folder.absolute().parents):
        if candidate.exists():
            return None if candidate.is_dir() else candidate
    return None


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


def replace_file(path: Path, write: Callable[[IO[Any]], Any], *, binary: bool = False) -> None:
    """Replace ``path`` by what ``write`` writes into a text (or ``binary``) handle, in one atomic
    rename: the new content goes to a temporary file beside it, is flushed to disk, then renamed
    over ``path``. Any failure (a full disk, a kill) leaves ``path`` as it was and removes the
    temporary file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with (os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", newline="")) as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def replace_text(path: Path, text: str) -> None:
    """:func:`replace_file` with ``text`` as the new content."""
    replace_file(path, lambda handle: handle.write(text))


def require_writable(folder: Path, what: str) -> None:
    """Refuse, before anything is written, a ``folder`` whose storage takes no writes (read-only,
    full, over quota; also for root, whom permissions never stop): a byte is written to a temporary
    file there, flushed and removed. :class:`StorageError` (one line) naming ``what``."""
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".write-check.", suffix=".tmp")
        try:
            os.write(fd, b"\0")
            os.fsync(fd)
        finally:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    except OSError as err:
        raise StorageError(f"{what}: cannot write in {folder}: {err.strerror or err}; nothing was written") from None


def save_tensors(obj: object, path: Path) -> None:
    """``torch.save(obj, path)``, except that a write the storage refuses raises the storage's
    ``OSError`` (torch's own file writer reports a full disk as a ``RuntimeError``): the object is
    serialised in memory first, then written in one call. A failed write removes the partial file."""
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    try:
        with open(path, "wb") as handle:
            handle.write(buffer.getbuffer())
    except BaseException:
        if path.is_file():  # the partial file (never a device the path may name)
            path.unlink()
        raise


def hold_lock(folder: Path, what: str) -> int:
    """Take ``folder``'s lock file (``.lock``, an exclusive ``flock``) for as long as this process
    lives or until the returned descriptor is closed; the system drops it when the process dies, a
    kill -9 included. ``TclightningError`` (one line naming ``what``) when another process holds it."""
    import fcntl

    fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise TclightningError(f"{what}: another process is writing {folder} (a run or a resume of it is still "
                               "going); wait for it to end, or start a new run") from None
    return fd
