"""The console: warnings on one line, no file:line where that line says nothing; and a standard
output that outlives its reader.

Lightning installs a warning format that prefixes every warning raised through its rank-zero
helpers with the helper's own location (``.../rank_zero.py:42:``), whatever raised it; this
module replaces that prefix (and gives the health monitors' warnings a ``health:`` prefix).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import warnings
from pathlib import Path
from collections.abc import Iterator
from typing import Any, TextIO

from tclightning.limits import interrupt


_INTERRUPTS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))
"""The signals that stop a command: Ctrl-C, SIGTERM, and SIGHUP (the terminal closed)."""


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Ctrl-C, SIGTERM and SIGHUP received in the block are raised again once it is done, to the
    handlers in force before (in the main thread, where Python runs handlers; a mask would not do:
    the kernel hands a process's signal to any thread that does not block it). Elsewhere, or where
    a handler was set from C (it cannot be put back), the block runs as it is."""
    import threading

    before = {signum: signal.getsignal(signum) for signum in _INTERRUPTS}
    if threading.current_thread() is not threading.main_thread() or None in before.values():
        yield
        return
    caught: list[int] = []
    for signum in _INTERRUPTS:
        signal.signal(signum, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(caught):
            signal.raise_signal(signum)


def ignore_interrupts_at_teardown() -> None:
    """Ctrl-C, SIGTERM and SIGHUP are ignored once Python tears the interpreter down, after every
    exit hook: its signal handlers are then reset to the default, so each would kill the finished
    command without a word (exit -2, -15, -1) instead of leaving its exit code. Call it first, so
    that it runs last (``atexit`` runs its hooks in reverse)."""
    for signum in _INTERRUPTS:
        atexit.register(signal.signal, signum, signal.SIG_IGN)


def sigterm_interrupts() -> None:
    """SIGTERM stops the command as Ctrl-C does (one line, exit 130), where nothing else holds it:
    while it starts, and after a run has finished (a run holds SIGTERM itself: before its first step
    it stops at once, then it finishes the step and checkpoints). The default would end the process
    by the signal without a word (exit -15). A SIGHUP (the terminal closed) is a SIGTERM: by default
    it would end a bench without removing its network namespaces. Leaves a handler someone else set
    alone (``nohup``'s ignored SIGHUP)."""
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, interrupt)
    hangup = getattr(signal, "SIGHUP", None)
    if hangup is not None and signal.getsignal(hangup) is signal.SIG_DFL:
        signal.signal(hangup, hangup_is_sigterm)


def hangup_is_sigterm(signum: int, frame: Any) -> None:
    """The SIGHUP handler: the SIGTERM handler in force then (a run's, or the command's) decides."""
    signal.raise_signal(signal.SIGTERM)


def exit_at_late_interrupt() -> None:
    """From now on, Ctrl-C, SIGTERM or SIGHUP (unless ignored: ``nohup``) ends the process at once
    with one line and exit 130: for the moment after a command has finished, when Python's own
    shutdown (flushing loggers, joining threads, atexit hooks) would otherwise print a traceback or
    die by the signal without a word."""

    def interrupted(signum: int, frame: Any) -> None:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.write("interrupted while exiting; the command had finished\n")
            sys.stderr.flush()
        os._exit(130)

    for signum in _INTERRUPTS:
        ignored_hangup = signum == getattr(signal, "SIGHUP", None) and signal.getsignal(signum) is signal.SIG_IGN
        if not ignored_hangup:  # nohup's choice stands
            signal.signal(signum, interrupted)


def shown(text: str) -> str:
    """``text`` with each character a terminal would act on (escapes, bells, bidi overrides,
    line breaks) written as its Python escape: a listing or an error shows a hostile name, never runs it."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


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


class _OutlivingStream:
    """``sys.stdout`` or ``sys.stderr`` for a command whose console may go away or refuse writes:
    once a write or flush fails (a closed pipe, ``tclightning run ... | head -1``; ``/dev/full``; a
    terminal gone), the stream becomes ``/dev/null`` (the stream and its file descriptor) and the
    command goes on: a run's record is in its run directory, and its exit code still says how it
    ended. ``refused`` keeps a failure other than a closed pipe (the output is then incomplete,
    which :func:`refused_output` reports)."""

    def __init__(self, stream: TextIO, fd: int) -> None:
        self._stream = stream
        self._fd = fd
        self.refused: OSError | None = None

    def _lost(self, err: OSError) -> None:
        if not isinstance(err, BrokenPipeError):
            self.refused = self.refused or err
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, self._fd)  # the original stream's own last flush at exit then succeeds too
        os.close(null)
        self._stream = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as err:
            self._lost(err)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as err:
            self._lost(err)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def outlive_console() -> None:
    """Give the process a standard output and error that never fail it: ``/dev/null`` for one it
    was started without (``>&-``), and streams that turn a failed write into ``/dev/null``."""
    for name, fd in (("stdout", 1), ("stderr", 2)):
        stream = getattr(sys, name)
        if stream is None:
            setattr(sys, name, open(os.devnull, "w"))  # noqa: SIM115 - lives as long as the process
        elif not isinstance(stream, _OutlivingStream):
            setattr(sys, name, _OutlivingStream(stream, fd))


def refused_output() -> str | None:
    """Why standard output refused a write this command made (``No space left on device`` for
    ``> /dev/full``), after flushing it; ``None`` when all of it was written or only a reader went
    away (``| head``: the reader chose to stop)."""
    stream = sys.stdout
    if not isinstance(stream, _OutlivingStream):
        return None
    stream.flush()
    return None if stream.refused is None else (stream.refused.strerror or str(stream.refused))
