"""Run a function on S local ranks (one process each, gloo over 127.0.0.1), without Lightning.

For tests and benchmarks of :mod:`tclightning.pipeline.engine`; training launches through
Lightning (``trainer.devices``, torchrun, SLURM). Unlike ``torch.multiprocessing.spawn``, a rank
that dies does not take the others down: each rank's outcome (its return value or the error it
raised) is reported separately, with its exit code and wall time, which is what a fault test needs.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tclightning.processes import die_with_parent, safe_import_path


@dataclass
class RankOutcome:
    """What one rank did: ``value`` (returned), or ``error`` (``"Type: message"``) and ``trace``."""

    rank: int
    exitcode: int | None
    seconds: float
    value: Any = None
    error: str | None = None
    trace: str | None = None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the ranks' rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _entry(rank: int, world_size: int, port: int, timeout_s: float, fn: Callable[..., Any], args: tuple, out: str,
           parent: int) -> None:
    die_with_parent(parent)
    import torch

    from tclightning.pipeline.comm import init_process_group

    torch.set_num_threads(1)
    started = time.perf_counter()
    result: dict[str, Any] = {}
    try:
        init_process_group(rank, world_size, timeout_s=timeout_s, init_method=f"tcp://127.0.0.1:{port}")
        result["value"] = fn(rank, world_size, *args)
    except BaseException as err:  # noqa: BLE001 - reported to the parent, whatever it is
        result["error"] = f"{type(err).__name__}: {err}"
        result["trace"] = traceback.format_exc()
    result["seconds"] = time.perf_counter() - started
    Path(out).write_bytes(pickle.dumps(result))
    # Skip interpreter teardown: a process group whose peer died can block in its destructors.
    os._exit(0 if "error" not in result else 1)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 60.0,
    join_timeout_s: float = 300.0,
    linger_s: float = 10.0,
) -> list[RankOutcome]:
    """``fn(rank, world_size, *args)`` on ``world_size`` spawned processes joined by a gloo process
    group with ``timeout_s``; ``fn`` must be importable (module level). Processes still alive
    after ``join_timeout_s``, or ``linger_s`` after another rank failed, are killed and reported
    with ``exitcode None``."""
    context = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="tcl-ranks-") as tmp:
        outputs = [os.path.join(tmp, f"rank{r}.pkl") for r in range(world_size)]
        procs = [
            context.Process(target=_entry, args=(r, world_size, port, timeout_s, fn, args, outputs[r], os.getpid()),
                            daemon=True)
            for r in range(world_size)
        ]
        started = time.perf_counter()
        try:
            with safe_import_path():  # the spawned python -c never imports from the working folder
                for proc in procs:
                    proc.start()
            deadline = started + join_timeout_s
            while any(proc.is_alive() for proc in procs) and time.perf_counter() < deadline:
                if any(proc.exitcode not in (None, 0) for proc in procs):
                    deadline = min(deadline, time.perf_counter() + linger_s)
                time.sleep(0.05)
        except BaseException:  # a Ctrl-C or SIGTERM here: no rank is left running
            for proc in procs:
                if proc.pid is not None and proc.is_alive():
                    proc.kill()
                    proc.join()
            raise
        outcomes = []
        for rank, proc in enumerate(procs):
            if proc.is_alive():
                proc.kill()
                proc.join()
                outcomes.append(RankOutcome(rank, None, time.perf_counter() - started, error="killed: did not finish"))
                continue
            path = Path(outputs[rank])
            if not path.exists():
                outcomes.append(RankOutcome(rank, proc.exitcode, time.perf_counter() - started, error="died"))
                continue
            result = pickle.loads(path.read_bytes())
            outcomes.append(
                RankOutcome(rank, proc.exitcode, result["seconds"], result.get("value"), result.get("error"), result.get("trace"))
            )
        return outcomes
