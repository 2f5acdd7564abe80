"""The Python processes tclightning starts (a tokenizer measure, reward workers, benchmark ranks,
torchrun nodes) never import from the working folder: ``python -c`` and ``python -m`` put it first
on the import path, so a ``json.py`` in a cloned repository or a shared folder would run inside
them. ``PYTHONSAFEPATH`` (Python 3.11+) keeps it off; every child of the ``tclightning`` command
inherits it (:func:`keep_children_off_the_working_folder`). The ranks a run or a benchmark starts
never outlive the process that started them (:func:`die_with_parent`)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Mapping

SAFE_PATH = {"PYTHONSAFEPATH": "1"}


def process_running(pid: int) -> bool:
    """Whether a process ``pid`` is running (someone else's counts): a folder named after a process
    that is not is one a killed writer left."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # no such process (or no pid at all: a folder of someone's)
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def child_environment(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """``base`` (``os.environ``) with ``PYTHONSAFEPATH=1`` and ``extra``: the environment for a
    process started by ``subprocess``."""
    return {**(os.environ if base is None else base), **SAFE_PATH, **extra}


@contextlib.contextmanager
def safe_import_path() -> Iterator[None]:
    """``PYTHONSAFEPATH=1`` in ``os.environ`` for the block: for ``multiprocessing``'s spawn, which
    starts its process with the environment as it is (and ``python -c``)."""
    before = os.environ.get("PYTHONSAFEPATH")
    os.environ.update(SAFE_PATH)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PYTHONSAFEPATH", None)
        else:
            os.environ["PYTHONSAFEPATH"] = before


def keep_children_off_the_working_folder() -> None:
    """For the ``tclightning`` command: every process it starts from now on, its own and those of
    Lightning, torch and multiprocessing, inherits ``PYTHONSAFEPATH=1``."""
    os.environ.update(SAFE_PATH)


LAUNCHER_PID_ENV = "TCLIGHTNING_LAUNCHER_PID"
"""Set for the ranks a run starts itself (``trainer.devices`` > 1): the pid of the process that
started them, which they must not outlive (:func:`follow_launcher`); ``parent``: whichever process
started this one (a launcher in between, as torchrun is, whose pid is not known beforehand)."""

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """Linux: this process is killed (SIGKILL) when ``parent``, the process that started it, ends
    in any way, kill -9 included, so a rank never waits on for a launcher that is gone; if
    ``parent`` has ended already, this process exits at once. Elsewhere nothing."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent:  # it ended before the signal was armed
        _launcher_gone(parent)


def _launcher_gone(parent: int) -> None:
    """Exit 1 at once, saying why: a rank whose launcher is gone has nobody to work for."""
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(f"error: the process that started this one ({LAUNCHER_PID_ENV}={parent}) is no longer its "
                         "parent; exiting\n")
        sys.stderr.flush()
    os._exit(1)


def follow_launcher() -> None:
    """For a rank a tclightning run started: die with that run's process (:func:`die_with_parent`).
    The variable is taken out of the environment, so this process's own children do not read it."""
    parent = os.environ.pop(LAUNCHER_PID_ENV, "")
    if parent == "parent":
        parent = str(os.getppid())
        if parent == "1":  # it has ended already
            _launcher_gone(1)
    if parent.isdigit():
        die_with_parent(int(parent))
