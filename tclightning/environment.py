"""The environment variables a block of code sets or removes in its own thread, put back when the
block ends (:func:`own_writes_undone`), while what other threads change meanwhile stays.

:func:`tclightning.run.run` trains inside such a block: the variables it, its libraries (MLflow's
tracking URI, Lightning's seed) and your callbacks set in the run's thread are the run's, and a
program of yours that goes on working in another thread keeps its own changes.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_records: dict[int, list[dict[str, str | None]]] = {}  # thread -> one record per open block: name -> value before
_ENVIRON = type(os.environ)
_SET, _DELETE = _ENVIRON.__setitem__, _ENVIRON.__delitem__  # its own, put back when the last block ends


def _name(mapping: object, key: object) -> str | None:
    if mapping is os.environ and isinstance(key, str):
        return key
    if mapping is getattr(os, "environb", None) and isinstance(key, bytes):  # the same variables, as bytes
        return os.fsdecode(key)
    return None


def _note(mapping: object, key: object) -> None:
    records = _records.get(threading.get_ident())
    name = _name(mapping, key) if records else None
    if name is None:
        return
    for record in records:  # each open block of this thread remembers the value it found first
        if name not in record:
            record[name] = os.environ.get(name)


def _setitem(self: object, key: object, value: object) -> None:
    _note(self, key)
    _SET(self, key, value)


def _delitem(self: object, key: object) -> None:
    _note(self, key)
    _DELETE(self, key)


@contextlib.contextmanager
def own_writes_undone() -> Iterator[None]:
    """Every variable this thread sets or removes through ``os.environ`` in the block has its value
    from before (or none) again when the block ends, however it ends. Writes of other threads are
    not recorded (nor those of threads this one starts), and a write made with ``os.putenv``
    directly is not seen (``os.environ`` does not see it either)."""
    record: dict[str, str | None] = {}
    with _lock:
        if not _records:
            _ENVIRON.__setitem__, _ENVIRON.__delitem__ = _setitem, _delitem  # type: ignore[method-assign]
        _records.setdefault(threading.get_ident(), []).append(record)
    try:
        yield
    finally:
        with _lock:
            mine = _records[threading.get_ident()]
            del mine[next(i for i, open_record in enumerate(mine) if open_record is record)]
            if not mine:
                del _records[threading.get_ident()]
            if not _records:
                _ENVIRON.__setitem__, _ENVIRON.__delitem__ = _SET, _DELETE  # type: ignore[method-assign]
        for name, value in record.items():  # outer blocks of this thread see these writes as theirs too
            if value is None:
                os.environ.pop(name, None)
            elif os.environ.get(name) != value:
                os.environ[name] = value
