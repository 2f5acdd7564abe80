"""Wall-clock limits on work whose cost the input decides (sympy on an answer, a model's chat
template on a prompt): a ``SIGALRM`` interval timer, main thread only. And the interrupt a
signal handler raises (:func:`interrupt`), which, like the alarm's, must never land where Python
drops it."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def can_use_alarm() -> bool:
    """Whether :func:`run_with_alarm` works here: POSIX, the main thread (signals reach no other),
    and SIGALRM not blocked in it (a program's ``pthread_sigmask``, or a mask inherited across
    ``exec``: the alarm never came, and the limit never fired)."""
    return (hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
            and signal.SIGALRM not in signal.pthread_sigmask(signal.SIG_BLOCK, ()))


class _Timeout(BaseException):
    """Raised by the alarm handler. A BaseException so that math-verify's and sympy's
    ``except Exception`` blocks cannot swallow it and carry on past the limit."""


# After the first expiry the alarm repeats this often until the call has unwound: a timeout
# swallowed by a bare ``except:`` (mpmath has some) is raised again instead of lost.
_ALARM_REPEAT_S = 0.1


def in_unraisable_context(frame: Any) -> bool:
    """Whether ``frame`` runs inside a finalizer (``__del__``) or ``sys.unraisablehook``, where an
    exception cannot propagate: Python prints it as "Exception ignored" and carries on (and a
    test runner's hook counts it as a failure). The alarm then waits for its next repeat."""
    hook = sys.unraisablehook
    hook_code = getattr(getattr(hook, "func", hook), "__code__", None)
    while frame is not None:
        if frame.f_code.co_name == "__del__" or frame.f_code is hook_code:
            return True
        frame = frame.f_back
    return False


_RESEND_S = 0.05


def interrupt(signum: int, frame: Any) -> None:
    """Raise ``KeyboardInterrupt`` from the handler of signal ``signum``, where it can propagate:
    inside a finalizer (a ``ZipFile.__del__`` the garbage collector runs), where Python would print
    it as "Exception ignored" and carry on, the signal is sent again ``_RESEND_S`` later instead."""
    if in_unraisable_context(frame):
        threading.Timer(_RESEND_S, os.kill, (os.getpid(), signum)).start()
        return
    raise KeyboardInterrupt


_UNTOUCHED_S = 1e7
"""The timer set while a program's own SIGALRM handler runs: still near it afterwards, the handler
left its timer alone (a repeating one repeats); otherwise it armed or cancelled it."""


def run_with_alarm(fn: Callable[[], T], timeout_s: float) -> T:
    """Run ``fn()`` (main thread only) under a SIGALRM interval timer; ``TimeoutError`` past it.

    Only ``TimeoutError`` (or what ``fn`` itself raises) leaves this function, wherever the
    alarm lands. The timer repeats every ``_ALARM_REPEAT_S`` past the limit until ``fn`` has
    unwound, so code that catches and drops the first timeout is interrupted again. Nests with
    a timer armed by someone else (a program's heartbeat, an enclosing limit): at its moments its
    own handler runs, as it would have (an enclosing limit's exception ends ``fn`` then; a
    heartbeat only counts), and it is re-armed afterwards with its remaining time and interval; a
    timer whose action is the default (ending the process) ends ``fn`` at its moment and fires
    just after. A signal cannot interrupt one long C-level operation: callers keep those out by
    capping inputs.
    """
    armed = [True]  # cleared before disarming, so a late repeat raises nothing
    ours = _Timeout()
    handler = [signal.getsignal(signal.SIGALRM)]  # theirs: the one found, or the one their handler put in its place
    outer_delay, outer_interval = signal.getitimer(signal.ITIMER_REAL)
    started = time.monotonic()
    deadline = started + timeout_s
    theirs = [started + outer_delay if outer_delay > 0 else None]  # the outer timer's next moment
    period = [outer_interval]

    def ends_fn() -> bool:  # their action is the default (ending the process), or set outside Python
        return not callable(handler[0]) and handler[0] != signal.SIG_IGN

    def next_alarm(now: float, after_timeout: bool = False) -> None:
        """Arm the timer for the next moment: the deadline (at once when past it), theirs if sooner;
        once the timeout is raised, its repeat (a timeout dropped by a bare ``except:``)."""
        due = now + _ALARM_REPEAT_S if after_timeout else deadline
        if theirs[0] is not None and theirs[0] > now:  # one past is being handled (or ends fn): not at once again
            due = min(due, theirs[0])
        signal.setitimer(signal.ITIMER_REAL, max(due - now, 1e-6), _ALARM_REPEAT_S)

    def on_alarm(signum: int, frame: Any) -> None:
        if not armed[0] or in_unraisable_context(frame):
            return  # the interval's repeat comes back
        now = time.monotonic()
        if theirs[0] is not None and now >= theirs[0]:  # their moment: their handler runs, as it would have
            if ends_fn():
                next_alarm(now, after_timeout=True)
                raise ours
            # A mark no handler sets: what their handler arms or cancels is theirs, the mark left is "as it was"
            signal.setitimer(signal.ITIMER_REAL, _UNTOUCHED_S)
            theirs[0] = None
            try:
                if callable(handler[0]):
                    handler[0](signum, frame)  # may raise: an enclosing limit ends fn here
            finally:
                installed = signal.getsignal(signal.SIGALRM)
                if installed is not on_alarm:  # their handler put itself (or another) back in: theirs from now
                    handler[0] = installed
                    signal.signal(signal.SIGALRM, on_alarm)
                delay, interval = signal.getitimer(signal.ITIMER_REAL)
                now = time.monotonic()
                if delay > _UNTOUCHED_S / 2 and interval == 0:  # left as it was: a repeating timer repeats
                    theirs[0] = now + period[0] if period[0] > 0 else None
                elif delay > 0:  # armed anew
                    theirs[0], period[0] = now + delay, interval
                else:  # cancelled: it stays off
                    period[0] = 0.0
                # ours stays armed when their exception leaves here (work that swallows it runs on)
                next_alarm(now)
        if now >= deadline:  # checked at every alarm, theirs too: a timer of theirs faster than ours
            next_alarm(now, after_timeout=True)
            raise ours
        next_alarm(now)

    try:
        try:
            # Both inside the try: an (outer) alarm landing between them is caught below.
            signal.signal(signal.SIGALRM, on_alarm)
            next_alarm(time.monotonic())
            return fn()
        finally:
            # If the alarm lands before this line, the except below still catches it.
            armed[0] = False
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _Timeout as timeout:
        armed[0] = False
        if timeout is not ours:  # an enclosing limit's
            raise
        raise TimeoutError(f"timed out after {timeout_s} s") from None
    finally:
        armed[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        if handler[0] is not None:  # None: set outside Python, cannot be restored
            signal.signal(signal.SIGALRM, handler[0])
        if theirs[0] is not None:
            left = theirs[0] - time.monotonic()
            signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3), period[0])


def waited_on(fn: Callable[[], T], timeout_s: float) -> T:
    """``fn()`` given ``timeout_s`` in any thread (a remote peer that stalls, or work only a crafted
    input makes slow: a chat template's loops): under the alarm in the main thread
    (:func:`run_with_alarm`), elsewhere in a daemon thread that this one stops waiting for past the
    limit (:func:`watched`; called from a thread of your program, such work was unbounded).
    ``TimeoutError`` past the limit; what ``fn`` raises otherwise."""
    if can_use_alarm():
        return run_with_alarm(fn, timeout_s)
    return watched(fn, lambda elapsed_s: timeout_s - elapsed_s)


_ABANDONED: list[str] = []
"""The names of the threads :func:`watched` gave up on in this process."""


def abandoned_work() -> bool:
    """Whether :func:`watched` gave up on a thread in this process: the threads that thread started
    (a library's thread pool) are joined by the interpreter at its exit, where they may wait for
    ever, so a command that gave up on one ends with ``os._exit`` once it is done."""
    return bool(_ABANDONED)


def watched(fn: Callable[[], T], keep_waiting: Callable[[float], float]) -> T:
    """``fn()`` in a daemon thread, waited for while ``keep_waiting(seconds since it started)``
    gives how long to wait before asking again (more than 0): ``TimeoutError`` once it gives 0 or
    less, the thread left to end with the process (a signal reaches no other thread, and a blocking
    read cannot be stopped from outside; see :func:`abandoned_work`). What ``fn`` returns or raises
    otherwise."""
    outcome: list[tuple[bool, Any]] = []

    def work() -> None:
        try:
            outcome.append((True, fn()))
        except BaseException as err:  # noqa: BLE001 - handed to the waiting thread as it is
            outcome.append((False, err))

    worker = threading.Thread(target=work, daemon=True, name=f"tclightning-watched-{threading.current_thread().name}")
    started = time.monotonic()
    worker.start()
    try:
        while not outcome:
            wait_s = keep_waiting(time.monotonic() - started)
            if wait_s <= 0:
                raise TimeoutError(f"timed out after {time.monotonic() - started:.0f} s")
            worker.join(wait_s)
    except BaseException:  # the limit, or a Ctrl-C or SIGTERM meanwhile: the work goes on unwatched
        _ABANDONED.append(worker.name)
        raise
    done, value = outcome[0]
    if not done:
        raise value
    return value
