"""A small on-disk cache of computed results, keyed by a hash of everything that determines them.

Entries live in ``<cache root>/<kind>/<key>/``. The root is ``$TCLIGHTNING_CACHE`` when set, else
``$XDG_CACHE_HOME/tclightning``, else ``~/.cache/tclightning``. An entry is written into a
temporary directory beside it and renamed into place, so a reader never sees half an entry and two
processes that compute the same entry at once both end with one complete copy.
``TCLIGHTNING_NO_CACHE=1`` turns every lookup and store off.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from collections.abc import Callable, Mapping
from glob import escape as glob_escape
from pathlib import Path
from typing import Any

import torch

from tclightning.files import HeldFolder, remove_tree
from tclightning.processes import process_running

CACHE_ENV = "TCLIGHTNING_CACHE"
NO_CACHE_ENV = "TCLIGHTNING_NO_CACHE"


def cache_root() -> Path:
    """The cache's root directory (see the module docstring); not created here."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "tclightning"


def cache_disabled_by_env() -> bool:
    """True when ``TCLIGHTNING_NO_CACHE`` is set to anything but empty, ``0``, ``false``, ``no`` or
    ``off`` (any case)."""
    return os.environ.get(NO_CACHE_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def _canonical(value: Any, hasher: Any) -> None:
    """Feed ``value`` to ``hasher`` unambiguously: tensors by dtype, shape and raw bytes; mappings
    with sorted keys; everything else by its JSON (or ``repr`` when JSON cannot hold it)."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        hasher.update(f"tensor:{t.dtype}:{tuple(t.shape)}:".encode())
        hasher.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(value, Mapping):
        hasher.update(b"{")
        for key in sorted(value, key=str):
            hasher.update(json.dumps(str(key)).encode() + b":")
            _canonical(value[key], hasher)
            hasher.update(b",")
        hasher.update(b"}")
    elif isinstance(value, (list, tuple)):
        hasher.update(b"[")
        for item in value:
            _canonical(item, hasher)
            hasher.update(b",")
        hasher.update(b"]")
    else:
        try:
            hasher.update(json.dumps(value).encode())
        except TypeError:
            hasher.update(repr(value).encode())


def digest(material: Any) -> str:
    """A hex SHA-256 of ``material`` (nested mappings, sequences, scalars, strings and tensors);
    equal material gives an equal digest in any process, and a changed value a different one."""
    hasher = hashlib.sha256()
    _canonical(material, hasher)
    return hasher.hexdigest()


class DirectoryCache:
    """Entries of one ``kind`` under ``root/kind/<key>/``: :meth:`get` a complete entry or ``None``,
    :meth:`put` one atomically (temporary directory + rename)."""

    COMPLETE = "complete"  # the last file written into an entry

    def __init__(self, kind: str, root: Path | None = None) -> None:
        self.directory = (root or cache_root()) / kind

    def path(self, key: str) -> Path:
        return self.directory / key

    def get(self, key: str) -> Path | None:
        """The entry's directory when it exists and was written completely, else ``None``."""
        entry = self.path(key)
        return entry if (entry / self.COMPLETE).is_file() else None

    def put(self, key: str, write: Callable[[Path], None]) -> str | None:
        """Call ``write(tmp_dir)`` to fill a new entry, then move it into place. Returns ``None``
        once the entry is in place (an entry another process finished first is kept), or why the
        cache could not be written (a read-only or full disk, say: caching is a saving, never a
        reason for a run to fail)."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._clear_abandoned(key)
            # named after this process: one a killed writer left is found, and removed, by the next
            tmp = Path(tempfile.mkdtemp(prefix=f".{key}.{os.getpid()}-", dir=self.directory))
        except OSError as err:
            return err.strerror or str(err)
        why = None
        try:
            # written through its descriptor, moved into place only while its name still leads to it,
            # and removed only so: a link or a folder put at that name meanwhile is never written
            # through, made the entry or removed
            with HeldFolder(tmp, empty=True) as staged:
                try:
                    write(staged.path)
                    (staged.path / self.COMPLETE).write_text("ok\n")
                    if not staged.is_at(tmp):
                        why = "its folder was replaced while written"
                    elif not self.path(key).exists():
                        os.replace(tmp, self.path(key))
                        if not staged.is_at(self.path(key)):  # someone's renamed to tmp as it moved: put back
                            self.put_back(key, tmp)
                            why = "its folder was replaced while written"
                finally:  # (this folder alone: one renamed to its name meanwhile is someone's)
                    remove_tree(tmp, identity=staged.identity)
        except OSError as err:  # the disk is full, or another process renamed its copy into place first
            why = err.strerror or str(err)
        return None if self.get(key) is not None else why or "the entry did not appear"

    def _clear_abandoned(self, key: str) -> None:
        """Remove the folders a writer of ``key`` killed part-way left (a full copy of the weights
        each): named as :meth:`put` names them, after a process that is no longer running."""
        staged = re.compile(re.escape(f".{key}.") + r"([0-9]+)-[a-z0-9_]+")
        for folder in self.directory.glob(f".{glob_escape(key)}.*"):
            named = staged.fullmatch(folder.name)
            if named and folder.is_dir() and not folder.is_symlink() and not process_running(int(named[1])):
                remove_tree(folder)

    def put_back(self, key: str, tmp: Path) -> None:
        """Move the folder at the entry (someone's, renamed to the temporary name ``tmp`` as that
        moved into place) back out: to ``tmp``, or, where that name is taken again, to a new hidden
        name beside it; never left at the entry, where the next warm-up would take it for a damaged
        entry of the cache's own."""
        try:
            os.replace(self.path(key), tmp)
        except OSError:
            os.replace(self.path(key), tempfile.mkdtemp(prefix=f".{key}.", dir=self.directory))
