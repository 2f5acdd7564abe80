"""Paths tclightning opens but did not create (a regular file, or a clear refusal), and folders it
replaces (swapped in one step, never deleted first).

Opening a FIFO for reading waits for a writer, and a device such as ``/dev/zero`` never ends:
either hangs a resume, an export or a replay. :func:`regular_file` looks with ``stat`` (which
never blocks) before anything opens the path.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import itertools
import os
import re
import shutil
import stat
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

from tclightning.errors import StorageError, TclightningError

STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EPERM})
"""The errors of storage that refuses a write (full, read-only, over quota, file too large, a file
or folder that may not be written: an immutable file, a root-squashed share): the machine's state,
not a bug; a run reports them in one line and keeps what it saved."""


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
    if isinstance(err, OSError):  # a file reached through a held folder by its folder's name (named)
        return f"{named(Path(os.fsdecode(err.filename)))}: {err.strerror}" if err.filename else str(err.strerror or err)
    return next(os.strerror(code) for code in STORAGE_ERRNOS if os.strerror(code) in str(err))


def regular_file(path: str | os.PathLike, what: str, max_bytes: int | None = None) -> Path:
    """``path`` as a ``Path`` if it names a regular file (links followed) of at most ``max_bytes``;
    ``TclightningError`` (one line: ``what``, the path and what it is instead) otherwise, including
    when it is missing."""
    path = Path(path)
    try:
        info = path.stat()
    except OSError as err:
        raise TclightningError(f"{what} {path}: {err.strerror or err}") from None
    mode = info.st_mode
    if not stat.S_ISREG(mode):
        kind = ("a directory" if stat.S_ISDIR(mode) else "a named pipe (FIFO)" if stat.S_ISFIFO(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "not a regular file")
        raise TclightningError(f"{what} {path}: is {kind}, not a regular file; nothing was read")
    real = path.resolve()
    if real.parts[1:2] in (("proc",), ("sys",)):  # kernel interfaces: S_ISREG, yet a read may block forever
        raise TclightningError(f"{what} {path}: is {real}, a kernel interface, not a file; nothing was read")
    if max_bytes is not None and info.st_size > max_bytes:
        raise TclightningError(f"{what} {path}: is {_size(info.st_size)}, more than the {_size(max_bytes)} such a "
                               "file may be; nothing was read")
    return path


def open_regular(path: str | os.PathLike, what: str, max_bytes: int | None = None) -> IO[bytes]:
    """``path`` (links followed) opened for reading only if the file opened is a regular one of at
    most ``max_bytes``: the check is on the descriptor, so a FIFO or a device swapped in after
    :func:`regular_file` looked is refused, never waited on. Read everything from the one file
    returned (``seek(0)`` for a second pass): opened again by name, it may be another.
    ``TclightningError`` (one line) otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as err:
        raise TclightningError(f"{what} {path}: {err.strerror or err}; nothing was read") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise TclightningError(f"{what} {path}: is no longer a regular file (something was put in its place); "
                               "nothing was read")
    if max_bytes is not None and info.st_size > max_bytes:
        os.close(fd)
        raise TclightningError(f"{what} {path}: is {_size(info.st_size)}, more than the {_size(max_bytes)} such a "
                               "file may be; nothing was read")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


@contextlib.contextmanager
def pinned_files(folder: Path, files: Iterable[Path], what: str, max_bytes: int | None = None, *,
                 copied_up_to: int = 0) -> Iterator[Path]:
    """A private view of ``files`` (below ``folder``) for another reader that opens them by name:
    a folder only this process can change, holding for each file a link to it as this process
    opened it once (``/proc/self/fd/N``: :func:`open_regular`). Whatever is renamed over one of
    them meanwhile (a FIFO, a crafted file), the reader reads the file checked. A file of at most
    ``copied_up_to`` bytes is first copied into memory (a ``memfd``), so bytes written into the
    file itself after the checks are not read either. Without ``/proc``, ``folder`` itself (each
    file still checked once)."""
    with contextlib.ExitStack() as opened:
        handles = [(file, opened.enter_context(open_regular(file, what, max_bytes))) for file in files]
        if not Path("/proc/self/fd").is_dir():
            yield folder
            return
        try:
            if hasattr(os, "memfd_create"):
                sizes = [os.fstat(handle.fileno()).st_size for _, handle in handles]
                handles = [(file, opened.enter_context(_memory_copy(handle, file.name, size))
                            if size <= copied_up_to else handle) for (file, handle), size in zip(handles, sizes)]
            view = Path(opened.enter_context(tempfile.TemporaryDirectory(prefix="tclightning-view-")))
            for file, handle in handles:
                link = view / file.relative_to(folder)
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(f"/proc/self/fd/{handle.fileno()}")
        except OSError as err:  # out of descriptors (a folder of thousands of files), of memory, of space
            raise TclightningError(f"{what} {folder}: cannot hold its files open to read them ({err.strerror or err}); "
                                   "nothing was read") from None
        yield view


def _memory_copy(handle: IO[bytes], name: str, size: int) -> IO[bytes]:
    """A copy of the first ``size`` bytes of the open file ``handle`` (the size it had when
    checked: one grown since is not copied past it) in memory (an anonymous ``memfd``), at its start."""
    copy = os.fdopen(os.memfd_create(f"tclightning-{name}"[:240]), "w+b")
    left = size
    while left > 0 and (chunk := handle.read(min(left, 1 << 24))):
        copy.write(chunk)
        left -= len(chunk)
    copy.seek(0)
    return copy


@contextlib.contextmanager
def pinned_file(path: Path, what: str, max_bytes: int | None = None) -> Iterator[Path]:
    """The path to read ``path`` by in a :func:`pinned_files` view."""
    with pinned_files(path.parent, [path], what, max_bytes) as view:
        yield view / path.name


def _size(n: int) -> str:
    return f"{n / 2**30:.3g} GiB" if n >= 2**30 else f"{n / 2**20:.3g} MiB" if n >= 2**20 else f"{n} bytes"


def tree(folder: Path) -> Iterator[Path]:
    """Every path below ``folder``, depth first, links listed and never followed. A loop with its
    own stack, unlike ``Path.rglob``, so a chain of thousands of nested folders is no
    ``RecursionError``; a folder that cannot be listed is skipped."""
    stack = [folder]
    while stack:
        with contextlib.suppress(OSError), os.scandir(stack.pop()) as listing:
            for entry in listing:
                yield Path(entry.path)
                with contextlib.suppress(OSError):
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(Path(entry.path))


def unused_name(path: Path) -> Path:
    """``path``, or ``<stem>-1<suffix>``, ``-2``... when a file of that name is there already (an
    earlier resume's record, or a file of the user's: never overwritten)."""
    candidate, n = path, 1
    while candidate.exists() or candidate.is_symlink():
        candidate, n = path.with_name(f"{path.stem}-{n}{path.suffix}"), n + 1
    return candidate


_OWN_FOLDERS: dict[Path, tuple[int, int]] = {}
"""The folders this process writes its records into (:func:`own_folder`), by absolute path: their
device and inode when it took them."""

_MADE_HERE: set[Path] = set()
"""The folders :func:`own_folder` was told this process made."""


def own_folder(folder: Path, identity: tuple[int, int] | None = None, *, made: bool = False) -> None:
    """Take ``folder`` (just made, or checked) as this process's to write into, as it is now (or as
    ``identity``, a :class:`HeldFolder`'s, says it is): every :class:`SameFolder` of it then tells
    its writers whether it is still that folder, not whichever was there when each first looked (a
    link put in place of a new run's folder at once was taken for it). ``made``: this process just
    made it (:func:`made_here`). ``TclightningError`` where it is a link or no folder already."""
    if made:
        _MADE_HERE.add(Path(folder).absolute())
    else:  # taken again as found (a resume in place, in the process that made it)
        _MADE_HERE.discard(Path(folder).absolute())
    if identity is not None:
        _OWN_FOLDERS[Path(folder).absolute()] = identity
        return
    try:
        info = os.lstat(folder)
    except OSError:
        info = None
    if info is None or not stat.S_ISDIR(info.st_mode):  # gone, or a link put in its place
        raise _replaced(folder)
    _OWN_FOLDERS[Path(folder).absolute()] = (info.st_dev, info.st_ino)


def made_here(folder: Path) -> bool:
    """Whether this process made ``folder`` (a new run's folder): anything found in it that the
    process did not write was put there by someone else."""
    return Path(folder).absolute() in _MADE_HERE


_MADE_FILES: dict[tuple[int, int, int | None], int] = {}
"""The files this process made (device, inode and the inode's generation), each with the record it
belongs to (:func:`forget_made_files` begins a new one in its thread): :func:`replace_file`'s,
:func:`own_file`'s that it created, and those :func:`note_made` was told of."""
_MADE_LOCK = threading.Lock()
_RECORD: contextvars.ContextVar[int] = contextvars.ContextVar("tclightning_made_files", default=0)
_NEXT_RECORD = itertools.count(1)

_FS_IOC_GETVERSION = 0x80087601  # Linux: an inode's generation, new each time its number is handed out again


def _made_identity(fd: int) -> tuple[int, int, int | None]:
    """The open file's device, inode and (where the filesystem tells it) the inode's generation: an
    inode number freed and handed out again to a file of someone else's has another generation."""
    import array
    import fcntl

    info = os.fstat(fd)
    generation = array.array("l", [0])
    try:
        fcntl.ioctl(fd, _FS_IOC_GETVERSION, generation, True)
    except OSError:  # a filesystem that keeps none (or no Linux): the device and inode alone
        return info.st_dev, info.st_ino, None
    return info.st_dev, info.st_ino, generation[0]


def note_made(fd: int) -> tuple[int, int, int | None]:
    """Record the file open at ``fd``, which this thread just created, as one of its own (of the run
    it works for); returns its identity as recorded."""
    made = _made_identity(fd)
    with _MADE_LOCK:
        _MADE_FILES[made] = _RECORD.get()
    return made


def _forget(identities: Callable[[tuple[int, int, int | None]], bool]) -> None:
    with _MADE_LOCK:
        for made in [made for made in _MADE_FILES if identities(made)]:
            del _MADE_FILES[made]


def forget_made_files() -> None:
    """A new run begins in this thread: the files this thread made so far are no longer taken for its
    own (one deleted since, whose inode number a file of someone else's got, or an earlier run's
    file moved into the new run's folder); a run going on in another thread keeps its record."""
    previous = _RECORD.get()
    _RECORD.set(next(_NEXT_RECORD))
    _forget(lambda made: _MADE_FILES.get(made) == previous)


def made_file(path: Path) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of the regular file at ``path`` (never through a link) when it is one
    this process made, else None: a file found where the process writes that it never made was put
    there by someone else (under any name and of any age), and is theirs."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        made = _made_identity(fd)
    finally:
        os.close(fd)
    return made[:2] if _MADE_FILES.get(made, -1) == _RECORD.get() else None


def owned_identity(folder: Path) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of ``folder`` as :func:`own_folder` took it, or None."""
    return _OWN_FOLDERS.get(Path(folder).absolute())


class SameFolder:
    """A folder as this process took it (:func:`own_folder`), or else as it was when first seen
    (its device and inode, not a link: a folder of yours reached through a link is taken as it
    is), so that a writer can tell, before each write by name, that no one has put another folder
    or a link in its place (writes would then land in another run, or in someone's folder)."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self._key = _OWN_FOLDERS.get(self.folder.absolute()) or self._identity()

    def _identity(self) -> tuple[int, int] | None:
        try:
            info = os.lstat(self.folder)
        except OSError:
            return None
        return None if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode) else (info.st_dev, info.st_ino)

    def check(self) -> None:
        """``TclightningError`` (one line) unless the folder is still the one first seen."""
        if self._key is None:
            self._key = self._identity()  # not made yet when first seen: the first folder there is it
        elif self._identity() != self._key:
            raise _replaced(self.folder)

    @contextlib.contextmanager
    def opened(self) -> Iterator[int]:
        """The folder as a descriptor (opened never through a link), for work by ``dir_fd`` that no
        name swapped meanwhile can redirect; ``TclightningError`` unless it is the one first seen
        (any folder, when none was there then), ``OSError`` when it cannot be opened."""
        fd = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            info = os.fstat(fd)
            if self._key is not None and (info.st_dev, info.st_ino) != self._key:
                raise _replaced(self.folder)
            yield fd
        finally:
            os.close(fd)



    @contextlib.contextmanager
    def held(self) -> Iterator[Path]:
        """:meth:`opened` as a path (:func:`by_descriptor`): files written or removed through it land
        in the folder checked, whatever is renamed or linked in place of its name meanwhile; a link
        (or nothing) in its place is the one ``replaced`` error."""
        try:
            with self.opened() as fd:
                yield by_descriptor(fd, self.folder)
        except OSError:
            if os.path.lexists(self.folder) and os.path.isdir(self.folder) and not os.path.islink(self.folder):
                raise
            raise _replaced(self.folder) from None


def _replaced(folder: Path) -> TclightningError:
    return TclightningError(f"{folder} was replaced during the run (removed, moved, or a link or another folder put "
                            "in its place); nothing more was written there")


def by_descriptor(fd: int, folder: Path) -> Path:
    """The folder open at ``fd`` as a path (``/proc/self/fd/N``) that leads to it whatever is renamed
    or linked in place of its name ``folder``; ``folder`` itself where the system has no such paths."""
    return Path(f"/proc/self/fd/{fd}") if Path("/proc/self/fd").is_dir() else Path(folder)


def entry_identity(path: str | os.PathLike, *, folder: bool = False) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of the regular file (or the ``folder``) at ``path``, never through a
    link; None when there is none: what a later look compares to tell it is still the same one."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    kind = stat.S_ISDIR if folder else stat.S_ISREG
    return (info.st_dev, info.st_ino) if kind(info.st_mode) else None


def named(path: Path) -> Path:
    """``path`` by its folder's name where it leads through a descriptor (:func:`by_descriptor`): what
    a message shows (``/proc/self/fd/5/point.pt`` told the user nothing)."""
    parts = Path(path).parts
    if parts[:4] != ("/", "proc", "self", "fd") or len(parts) < 5:
        return Path(path)
    try:
        return Path(os.readlink(Path(*parts[:5])), *parts[5:])
    except OSError:
        return Path(path)


class HeldFolder:
    """A folder held open by a descriptor (opened never through a link), for a writer that must
    write into the folder it made and nowhere else: its files, reached through :attr:`path`
    (``/proc/self/fd/N``), land in it whatever is renamed or linked in place of its name meanwhile,
    and :meth:`is_at` tells whether a name still leads to it. ``empty``: the folder was just made,
    so one holding anything is someone's put in its place (``FileExistsError``). A context manager
    closing it."""

    def __init__(self, folder: Path, *, empty: bool = False) -> None:
        self.fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        if empty and os.listdir(self.fd):  # just made: a folder with files was put in its place
            os.close(self.fd)
            raise FileExistsError(errno.ENOTEMPTY, "another folder was put in place of the one just made", str(folder))
        info = os.fstat(self.fd)
        self.identity = (info.st_dev, info.st_ino)
        self.path = by_descriptor(self.fd, folder)

    def is_at(self, name: Path) -> bool:
        """Whether ``name`` is this folder itself (not a link to it)."""
        try:
            info = os.lstat(name)
        except OSError:
            return False
        return stat.S_ISDIR(info.st_mode) and (info.st_dev, info.st_ino) == self.identity

    @property
    def mount_point(self) -> bool:
        """Whether the folder is a mount point (a bind mount of someone's folder put at its name)."""
        try:
            return os.readlink(f"/proc/self/fd/{self.fd}") in _mount_points()
        except OSError:  # no /proc: none known
            return False

    def close(self) -> None:
        os.close(self.fd)

    def remove_at(self, name: Path) -> None:
        """Remove the folder, empty by now, where ``name`` is still this folder."""
        if self.is_at(name):
            with contextlib.suppress(OSError):
                os.rmdir(name)

    def __enter__(self) -> HeldFolder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def own_file(path: Path, mode: str) -> IO[Any]:
    """``path`` opened as text (``mode`` ``r``, ``a`` or ``x``; ``rb``, ``ab``, ``wb`` or ``xb`` for bytes)
    only if it is still a regular file of the run's own: never through a link, never a FIFO or a
    device (which someone may have put in its place while the run went on). ``TclightningError``
    (one line) otherwise."""
    flags = {"r": os.O_RDONLY, "rb": os.O_RDONLY, "a": os.O_WRONLY | os.O_APPEND, "ab": os.O_WRONLY | os.O_APPEND,
             "wb": os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "x": os.O_WRONLY | os.O_CREAT | os.O_EXCL,
             "xb": os.O_WRONLY | os.O_CREAT | os.O_EXCL}[mode]
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as err:
        if err.errno not in (errno.ELOOP, errno.ENXIO, errno.EEXIST, errno.EISDIR):
            raise
        fd = -1
    if fd >= 0 and not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        fd = -1
    if fd < 0:
        raise TclightningError(f"{path}: is no longer the run's own file (a link, a folder, a FIFO or a device was "
                               "put in its place); nothing was written through it")
    os.set_blocking(fd, True)
    if flags & os.O_CREAT:
        note_made(fd)
    if mode.endswith("b"):
        return os.fdopen(fd, mode, buffering=0)
    return os.fdopen(fd, "r" if mode == "r" else "w", newline="")


def in_the_way(folder: Path) -> tuple[Path, str] | None:
    """What keeps ``folder`` from being a folder to write into, and why: ``folder`` itself or the
    nearest existing entry on the way to it, when that is a file or a link that leads nowhere (to
    itself, or to a missing place: creating a folder through it fails); ``None`` otherwise."""
    for candidate in (folder, *folder.absolute().parents):
        if candidate.exists():
            return None if candidate.is_dir() else (candidate, "is a file, not a folder")
        if candidate.is_symlink():
            return candidate, "is a link that leads nowhere (to itself, or to a missing place)"
    return None


def exchange(a: Path, b: Path) -> None:
    """Swap two folders atomically (Linux ``renameat2(RENAME_EXCHANGE)``); elsewhere, or where the
    filesystem cannot, move ``b`` aside, ``a`` into place and the old ``b`` to ``a``'s name, with
    Ctrl-C, SIGTERM and SIGHUP held until all three renames are done (one in between left ``b``
    missing)."""
    if _renameat2_exchange(a, b):
        return
    aside = a.with_name(a.name + "-old")
    from tclightning.console import interrupts_held

    with interrupts_held():
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
    over ``path``. Any failure (a full disk, a kill, a folder put at ``path``) leaves ``path`` as
    it was and removes the temporary file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    made = note_made(fd)
    try:
        os.fchmod(fd, 0o666 & ~current_umask())  # mkstemp's file is private; the file it replaces was not
        with (os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", newline="")) as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        try:
            replaced: os.stat_result | None = os.lstat(path)
        except OSError:
            replaced = None
        rename_over(tmp, path)
    except BaseException as err:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        _forget(lambda known: known == made)  # its inode number is free again
        if isinstance(err, OSError) and err.errno is not None and err.filename is None:  # a write's: name its file
            err.filename = str(named(path))
        raise
    if replaced is not None:  # the file replaced: its inode number is free, a file of someone else's may get it
        freed = (replaced.st_dev, replaced.st_ino)
        _forget(lambda known: known[:2] == freed)


def rename_over(new: str | Path, path: Path) -> None:
    """``os.replace(new, path)``; a folder someone put at ``path`` is left as it is, in one line."""
    try:
        os.replace(new, path)
    except IsADirectoryError:
        raise TclightningError(f"{path}: a folder is in its place; it was left as it is and nothing was written "
                               "there") from None


def copy_file(source: Path, target: Path) -> None:
    """``target`` replaced by a copy of ``source`` (the run's own regular file) by
    :func:`replace_file`: never written through a link or into a FIFO planted at ``target``."""
    with own_file(source, "rb") as original:
        replace_file(target, lambda handle: shutil.copyfileobj(original, handle, 2**20), binary=True)


def current_umask() -> int:
    """The process's umask (read by setting one and putting it back)."""
    mask = os.umask(0o22)
    os.umask(mask)
    return mask


def replace_text(path: Path, text: str) -> None:
    """:func:`replace_file` with ``text`` as the new content."""
    replace_file(path, lambda handle: handle.write(text))


def save_figure(figure: Any, path: Path, dpi: int) -> None:
    """``figure.savefig`` as a PNG by :func:`replace_file` (matplotlib's own open follows a link
    planted at ``path`` and waits forever on a FIFO there)."""
    replace_file(path, lambda handle: figure.savefig(handle, format="png", dpi=dpi), binary=True)


def remove_tree(folder: Path, identity: tuple[int, int] | None = None,
                only: Mapping[str, tuple[int, int]] | None = None) -> bool:
    """``shutil.rmtree`` that stays on ``folder``'s own filesystem: a mount point below it (a bind
    mount of someone's data) is left with everything in it, and links are removed, never followed,
    even one swapped in for a sub-folder while the removal runs (each folder is entered by a
    descriptor opened with ``O_NOFOLLOW`` relative to its parent's, as ``shutil.rmtree`` does).
    ``identity`` (``(st_dev, st_ino)``, a :class:`HeldFolder`'s): only that folder is emptied,
    checked on the descriptor it is emptied through, so a folder renamed to the name meanwhile is
    left whole. ``only``: the entries to remove, by path relative to ``folder`` (``"tb/hparams.yaml"``)
    with the identity each had when checked; anything else (an entry renamed in after the check, or
    in place of one) stays, and the folders holding it. Errors are ignored, as by
    ``rmtree(ignore_errors=True)``. Returns whether ``folder`` is gone."""
    try:
        device = folder.lstat().st_dev
    except OSError:
        return True
    if folder.is_symlink() or not folder.is_dir():
        return False
    mounts = _mount_points()
    opening = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW

    def entered(fd: int) -> bool:
        """Whether the folder open at ``fd`` is ours to empty: this filesystem, no mount point."""
        try:
            where = os.readlink(f"/proc/self/fd/{fd}")  # where the descriptor really is, not a name
        except OSError:
            where = None
        return os.fstat(fd).st_dev == device and where not in mounts

    def listing(fd: int) -> list[tuple[str, bool]]:
        with contextlib.suppress(OSError), os.scandir(fd) as entries:
            return [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in entries]
        return []

    def checked(fd: int, name: str, path: str) -> bool:
        """Whether the entry ``name`` of the folder open at ``fd`` (``path`` below ``folder``) is one
        of ``only``, as it is now."""
        if only is None:
            return True
        try:
            info = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except OSError:
            return False
        return only.get(path) == (info.st_dev, info.st_ino)

    def clear(root: int) -> None:
        """Empty the folder open at ``root``: a loop with its own stack of descriptors (one per
        level; a level past the descriptor limit is left), never a recursion."""
        stack: list[tuple[int, str, list[tuple[str, bool]]]] = [(root, "", listing(root))]
        try:
            while stack:
                fd, path, pending = stack[-1]
                if not pending:  # this folder is done: close it and remove it from its parent
                    stack.pop()
                    if stack:
                        os.close(fd)
                        with contextlib.suppress(OSError):
                            os.rmdir(path.rsplit("/", 1)[-1], dir_fd=stack[-1][0])
                    continue
                child, is_dir = pending.pop()
                inside = f"{path}/{child}" if path else child
                with contextlib.suppress(OSError):
                    if not is_dir:
                        if checked(fd, child, inside):
                            os.unlink(child, dir_fd=fd)  # a link is removed itself; a folder put here meanwhile stays
                        continue
                    inner = os.open(child, opening, dir_fd=fd)  # a link swapped in meanwhile is refused (ELOOP)
                    try:
                        info = os.fstat(inner)  # the folder as opened, whatever is renamed to its name next
                        ours = entered(inner) and (only is None or only.get(inside) == (info.st_dev, info.st_ino))
                    except OSError:
                        ours = False
                    if ours:  # not another filesystem, nor a bind mount of this one, nor a folder put here
                        stack.append((inner, inside, listing(inner)))
                    else:
                        os.close(inner)
        finally:
            for fd, _, _ in stack[1:]:  # interrupted part-way: the descriptors below the root
                os.close(fd)

    try:
        root = os.open(folder, opening)
    except OSError:
        return not folder.exists()
    try:
        info = os.fstat(root)
        if not entered(root) or (identity is not None and (info.st_dev, info.st_ino) != identity):
            return False
        clear(root)
    finally:
        os.close(root)
    with contextlib.suppress(OSError):
        folder.rmdir()
    return not folder.exists()


def _mount_points() -> frozenset[str]:
    """The mount points of this process (Linux ``/proc/self/mountinfo``; none known elsewhere)."""
    try:
        text = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return frozenset()
    points = (line.split(" ")[4] for line in text.splitlines() if len(line.split(" ")) > 4)
    # mountinfo escapes space, tab, newline and backslash as octal
    return frozenset(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), point) for point in points)


def require_writable(folder: Path, what: str, error: type[TclightningError] = StorageError) -> None:
    """Refuse, before anything is written, a ``folder`` whose storage takes no writes (read-only,
    full, over quota, ``/proc``; also for root, whom permissions never stop): a byte is written to a
    temporary file there, flushed and removed. ``error`` (one line, a :class:`StorageError` unless
    the folder is the user's choice of where to write) naming ``what``."""
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
        raise error(f"{what}: cannot write in {folder}: {err.strerror or err}; nothing was written") from None


def save_tensors(obj: object, path: Path) -> None:
    """``torch.save(obj, path)`` by :func:`replace_file`: serialised in memory first (torch's own
    file writer reports a full disk as a ``RuntimeError``; here the storage's ``OSError`` comes
    through), then written to a new temporary file and renamed over ``path``. A kill or a refused
    write leaves ``path`` as it was, and a link planted at any name is never written through."""
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    replace_file(path, lambda handle: handle.write(buffer.getbuffer()), binary=True)


def hold_lock(folder: Path, what: str) -> int:
    """Take ``folder``'s lock (an exclusive ``flock`` on the folder itself) for as long as this
    process lives or until the returned descriptor is closed; the system drops it when the process
    dies, a kill -9 included. A lock file could be deleted as "stale" under a run that is only
    stopped; the folder cannot. ``TclightningError`` (one line naming ``what``) when another
    process holds it."""
    import fcntl

    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise TclightningError(f"{what}: another process is writing {folder} (a run or a resume of it is still "
                               "going); wait for it to end, or start a new run") from None
    return fd
