"""The environment variables a block of code sets or removes, put back when the block ends
(:func:`own_writes_undone`), while what the program's other threads change meanwhile stays.

:func:`tclightning.run.run` trains inside such a block: the variables it, its libraries (MLflow's
tracking URI, Lightning's seed) and your callbacks set, in the run's thread or in a thread started
while it runs (a library's worker, a time limit's watcher), are the run's; a program of yours that
goes on working in a thread it had before the run keeps its own changes.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


_THEIRS = object()  # a name another thread wrote last: its value stays


@dataclass
class _Block:
    owner: threading.Thread  # the thread that opened the block
    before: frozenset[threading.Thread]  # the other threads alive then (objects: a number is handed out again)
    found: dict[str, str | None] = field(default_factory=dict)  # name -> its value before the block's first write
    last: dict[str, object] = field(default_factory=dict)  # name -> what the block's threads wrote last

    def writes(self, thread: threading.Thread) -> bool:
        return thread is self.owner or thread not in self.before


_lock = threading.Lock()
_blocks: list[_Block] = []
_ENVIRON = type(os.environ)
_plain: tuple[Any, Any] = (_ENVIRON.__setitem__, _ENVIRON.__delitem__)  # as found when the first block opened


def _name(mapping: object, key: object) -> str | None:
    if mapping is os.environ and isinstance(key, str):
        return key
    if mapping is getattr(os, "environb", None) and isinstance(key, bytes):  # the same variables, as bytes
        return os.fsdecode(key)
    return None


def _note(mapping: object, key: object, value: object) -> None:
    name = _name(mapping, key) if _blocks else None
    if name is None:
        return
    if isinstance(value, bytes):
        value = os.fsdecode(value)
    thread = threading.current_thread()
    for block in list(_blocks):  # each open block that counts this thread's writes keeps the value found first
        if block.writes(thread):
            block.found.setdefault(name, os.environ.get(name))
            block.last[name] = value
        elif name in block.found:  # the program's thread wrote it after the block did: its value stays
            block.last[name] = _THEIRS


def _setitem(self: object, key: object, value: object) -> None:
    _note(self, key, value)
    _plain[0](self, key, value)


def _delitem(self: object, key: object) -> None:
    _note(self, key, None)
    _plain[1](self, key)


@contextlib.contextmanager
def own_writes_undone() -> Iterator[None]:
    """Every variable set or removed through ``os.environ`` in the block, by this thread or by a
    thread started meanwhile, has its value from before (or none) again when the block ends, however
    it ends. Writes of the threads that were alive before (the program's) are not recorded; a write
    made with ``os.putenv`` directly is not seen (``os.environ`` does not see it either)."""
    global _plain
    owner = threading.current_thread()
    block = _Block(owner, frozenset(thread for thread in threading.enumerate() if thread is not owner))
    with _lock:
        if not _blocks:  # the methods as they are now (a hook of yours on them runs on, and stays)
            _plain = (_ENVIRON.__setitem__, _ENVIRON.__delitem__)
            _ENVIRON.__setitem__, _ENVIRON.__delitem__ = _setitem, _delitem  # type: ignore[method-assign]
        _blocks.append(block)
    try:
        yield
    finally:
        with _lock:
            del _blocks[next(i for i, open_block in enumerate(_blocks) if open_block is block)]
            if not _blocks and (_ENVIRON.__setitem__, _ENVIRON.__delitem__) == (_setitem, _delitem):
                _ENVIRON.__setitem__, _ENVIRON.__delitem__ = _plain  # type: ignore[method-assign]
        for name, value in block.found.items():  # an outer block of this thread sees these writes as its own too
            if block.last.get(name) is _THEIRS or os.environ.get(name) != block.last.get(name):
                continue  # written since by a thread of the program, or by a way os.environ does not see
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
