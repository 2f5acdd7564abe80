"""The launcher of a node's stage processes (``trainer.devices`` > 1; Lightning glue): no rank
outlives the run, and a rank that fails is named.

Lightning's own launcher starts ranks 1..S-1 as copies of the command and watches them: when one
fails it SIGKILLs every process, this one included (exit 137, nothing said, the run folder left as
it was), and when this process fails the ranks it started stay behind, waiting for it. Here, as
Lightning's subclass:

* a rank that fails stops the run: the other ranks are killed (they would wait on it in a
  collective), and this process stops with :class:`RankFailed` at once, wherever it is, and tidies
  its run as for any failure; the run then ends in one line naming the rank (its own output says why);
* this process failing (an address in use, an error in a step) kills the ranks it started;
* a started rank is killed by the kernel when this process ends in any way, kill -9 too
  (:func:`~tclightning.processes.die_with_parent`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.utilities.exceptions import SIGTERMException

from tclightning.processes import LAUNCHER_PID_ENV, follow_launcher

_WATCH_PERIOD_S = 0.2
_EXIT_WAIT_S = 3.0
"""How long an error of this process waits for a rank to end, to tell whether its failure caused it."""
_AGREED_STOP_WAIT_S = 60.0
"""How long a stop every rank agreed on (SIGTERM) waits for the ranks to end on their own."""
_PEER_EXIT_WAIT_S = 30.0
"""How long a link a rank closed waits for that rank to exit (a loaded machine takes seconds to
tear a large process down): its failure, not the closed link, is what the run reports."""
_STOP_GRACE_S = 30.0
"""How long this process has to stop once a rank failed before it is ended where it is."""


@dataclass(frozen=True)
class RankExit:
    """A rank this process started that ended with a non-zero ``code`` (negative: the signal that
    killed it)."""

    rank: int
    pid: int
    code: int

    @property
    def interrupted(self) -> bool:
        """Ended by Ctrl-C (a second one stops a rank at once: exit 130); this process has it too."""
        return self.code in (130, -signal.SIGINT)

    def describe(self) -> str:
        how = (f"was killed by {signal.Signals(-self.code).name}" if self.code < 0 and -self.code in signal.valid_signals()
               else f"stopped with exit code {self.code}")
        return f"rank {self.rank} (pid {self.pid}) {how}; what it printed says why. The run's other ranks were stopped"


class RankFailed(BaseException):
    """Raised in this process's main thread when a rank it started has failed: a BaseException,
    so that no ``except Exception`` on the way mistakes it for an error of its own."""


class StageLauncher(_SubprocessScriptLauncher):
    """Lightning's subprocess launcher with this module's guarantees. ``exited``: the rank whose
    failure stopped the run, if one did."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.exited: RankExit | None = None
        self._done = threading.Event()
        self._stopping = False  # this process stops its ranks: how they end is not a failure of theirs
        self._ending = threading.Lock()  # the main thread's stop is raised only while launch() runs

    def launch(self, function: Callable[..., Any], *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        _set_num_threads_if_needed(num_processes=self.num_processes)
        if self.cluster_environment.creates_processes_externally:  # a started rank, or torchrun's
            follow_launcher()  # a run started from Python: the command line's main() has not
            return function(*args, **kwargs)
        os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
        try:
            self._call_children_scripts()
        finally:
            os.environ.pop(LAUNCHER_PID_ENV, None)
        main_thread = threading.get_ident()
        threading.Thread(target=self._watch, args=(main_thread,), name="tclightning-rank-watcher", daemon=True).start()
        try:
            return function(*args, **kwargs)
        except BaseException as err:
            with self._ending:  # from here the watcher neither records nor raises anything
                self._stopping = True
            if self.exited is None:
                self._await_exit(_exit_wait_s(err))
            self._stop_ranks()  # never leave a rank waiting for this process
            raise
        finally:
            with self._ending:
                self._done.set()

    def _failed_rank(self) -> RankExit | None:
        failed = next((proc for proc in self.procs if proc.poll() not in (None, 0)), None)
        if failed is None:
            return None
        first_rank = self.cluster_environment.node_rank() * self.num_processes
        return RankExit(first_rank + 1 + self.procs.index(failed), failed.pid, failed.returncode)

    def _await_exit(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while self.exited is None and time.monotonic() < deadline:
            self.exited = self._failed_rank()
            if self.exited is None and all(proc.poll() is None for proc in self.procs):
                time.sleep(0.02)
            elif self.exited is None:  # one ended well: this process's error is its own
                return

    def _watch(self, main_thread: int) -> None:
        while not self._done.wait(_WATCH_PERIOD_S):
            exited = self._failed_rank()
            if exited is None:
                continue
            with self._ending:
                if self._stopping:  # the main thread stops the ranks and tells what ended them
                    return
                self.exited = exited
            self._stop_ranks()
            if self.exited.interrupted:  # this process was interrupted too, and stops as it does
                return
            with self._ending:  # at the main thread's next bytecode; a collective waiting on a killed rank fails at once
                if self._done.is_set() or self._stopping:
                    return
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(main_thread), ctypes.py_object(RankFailed))
            if not self._done.wait(_STOP_GRACE_S):  # stuck where no bytecode runs: ended here
                print(f"error: {self.exited.describe()}; this process did not stop within {_STOP_GRACE_S:g} s and "
                      "was ended", file=sys.stderr, flush=True)
                os._exit(1)
            return

    def _stop_ranks(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()  # SIGKILL: a rank waiting in a collective takes no other signal
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def _exit_wait_s(err: BaseException) -> float:
    """How long this process's ``err`` waits for a started rank to end before the ranks are killed."""
    if isinstance(err, SIGTERMException):  # every rank stops after the same step and ends on its own
        return _AGREED_STOP_WAIT_S
    if isinstance(err, torch.distributed.DistError) or "/gloo/" in str(err) or "NCCL" in str(err):
        return _PEER_EXIT_WAIT_S  # a link a rank closed: that rank is on its way out
    return _EXIT_WAIT_S  # a rank that fails closes its links before it exits: this may be its absence


def rank_exit(trainer: Any) -> RankExit | None:
    """The started rank whose failure stopped ``trainer``'s run, if one did."""
    launcher = getattr(getattr(trainer, "strategy", None), "launcher", None)
    return getattr(launcher, "exited", None)
