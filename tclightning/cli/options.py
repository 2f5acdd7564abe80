"""Bounds of the subcommands' numeric options, checked before anything is loaded or allocated: a
value past them would hang the command or exhaust the machine, never measure anything."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
from collections.abc import Iterator
from pathlib import Path

from tclightning.errors import TclightningError
from tclightning.files import in_the_way, require_writable

MAX_THREADS = 4096
"""The most intra-op threads any command takes (as ``trainer.num_threads``)."""


def within(command: str, flag: str, value: int | float | None, low: int | float, high: int | float) -> None:
    """Refuse (one line naming ``command`` and ``flag``) a ``value`` outside ``[low, high]``; ``None``
    (the option's default) passes."""
    if value is not None and not low <= value <= high:
        raise TclightningError(f"{command}: {flag} must be in [{low}, {high}], got {value}")


def refuse_url(what: str, folder: str) -> None:
    """A folder given as a URL (``s3://b/r``, ``webhdfs://h/x``, which ``Path`` makes ``s3:/b/r``) or
    an fsspec chain is refused: the command writes on this machine, and would make a local folder
    named ``s3:``."""
    if re.match(r"[A-Za-z][A-Za-z0-9+.-]+:/", folder) or "::" in folder:
        raise TclightningError(f"{what} {folder}: a folder on this machine is written, not a URL")


def output_folder(command: str, path: Path, writes: tuple[str, ...] = (), *, named: bool = False,
                  overwrite: bool = False) -> Path:
    """``path`` as the folder a probe writes its files (``writes``) to, refused up front (before
    anything is measured) when it, or a folder on the way to it, is a file; or, for a folder the
    user ``named`` with ``--out``, when it holds a file of those names and not ``overwrite`` (it
    may be theirs: the command's own default folder is its to replace)."""
    refuse_url(f"{command}: --out", str(path))
    if ".." in path.parts:  # `yours/new/..` is yours: the checks are of where the files land
        path = Path(os.path.realpath(path))
    blocking = in_the_way(path)
    if blocking is not None:
        raise TclightningError(f"{command}: --out {path}: {blocking[0]} {blocking[1]}")
    nearest = next(p for p in (path.absolute(), *path.absolute().parents) if p.is_dir())
    require_writable(nearest, f"{command}: --out {path}", TclightningError)  # /proc, a read-only mount
    if not named and path.is_symlink():  # the default folder, not one the user named: never followed
        raise TclightningError(f"{command}: {path} is a symbolic link; name the folder to write to with --out")
    there = [name for name in writes if os.path.lexists(path / name)]
    folder = next((name for name in there if (path / name).is_dir() and not (path / name).is_symlink()), None)
    if folder is not None:  # never replaced, so nothing is written beside it either
        raise TclightningError(f"{command}: --out {path} holds a folder {folder}, where this command writes a file; "
                               "nothing was written: move it, or choose a new folder")
    if named and there and not overwrite:
        raise TclightningError(f"{command}: --out {path} already holds {there[0]}"
                               f"{f' (and {len(there) - 1} more)' if len(there) > 1 else ''}, which this command "
                               "writes; nothing was written: --overwrite replaces them, or choose a new folder")
    return path


@contextlib.contextmanager
def output_claimed(command: str, path: Path, writes: tuple[str, ...] = (), *, named: bool = False,
                   overwrite: bool = False) -> Iterator[Path]:
    """For the block that writes the files: the folder :func:`output_folder` accepted, made if
    missing, held (a ``flock``) and checked again while held: two commands given one ``--out`` and
    started together both found it empty and both wrote, one report silently replacing the other;
    now the second is refused in one line, nothing written. The folders it made are removed again,
    where still empty, when the block fails."""
    made = [folder for folder in (path.absolute(), *path.absolute().parents) if not os.path.lexists(folder)]
    path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise TclightningError(f"{command}: --out {path}: another command is writing into it now; nothing was "
                                   "written: wait for it, or choose another folder") from None
        output_folder(command, path, writes, named=named, overwrite=overwrite)
        yield path
    except BaseException:
        for folder in made:  # deepest first; one holding anything (another command's files) stays
            with contextlib.suppress(OSError):
                os.rmdir(folder)
        raise
    finally:
        os.close(fd)

