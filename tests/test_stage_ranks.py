"""The ranks a run starts itself (``trainer.devices`` > 1): none outlives the run, and a rank that
fails stops it in one line naming the rank (``tclightning/pipeline/launch.py``)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tclightning.callbacks.checkpointing import load_checkpoint
from tests.conftest import FAST

REPO = Path(__file__).resolve().parents[1]
TWO_STAGES = [*FAST, "trainer.steps=4", "trainer.val_every=0", "trainer.strategy=pipeline", "trainer.devices=2",
              "pipeline.stages=2", "logging.root=runs"]


@contextlib.contextmanager
def _start(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[str]]:
    """A two-stage run, killed at the end of the block if it is still going (its rank 1 dies with it)."""
    environment = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO), **(env or {})}
    environment.pop("TCLIGHTNING_RUN_DIR", None)
    with subprocess.Popen([sys.executable, "-m", "tclightning", "run", "--recipe", "tiny", *TWO_STAGES, *args],
                          cwd=tmp_path, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as run:
        try:
            yield run
        finally:
            if run.poll() is None:
                run.kill()


def _descendants(pid: int) -> set[int]:
    """Every living process below ``pid``, from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        try:
            parents[int(entry.name)] = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
        except (ValueError, OSError):
            continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.add(pid)
    return alive


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _gone_within(pids: set[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _alive(pids)


def _wait_for_rank_1(run: subprocess.Popen[str]) -> set[int]:
    """The processes below rank 0 once rank 1 (a ``tclightning run`` of its own) is among them."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and run.poll() is None:
        below = _descendants(run.pid)
        if any(b"tclightning" in _cmdline(pid) and b"run" in _cmdline(pid) for pid in below):
            return below
        time.sleep(0.2)
    raise AssertionError(f"rank 1 never started (exit {run.poll()})")


pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads processes from /proc")


def test_a_rank_that_fails_while_rank_0_computes_stops_the_run_in_one_line(tmp_path: Path) -> None:
    """Rank 0 is busy for 600 s where it waits on no rank; rank 1 fails meanwhile. Lightning's watcher
    SIGKILLed rank 0 (exit 137, nothing said); the run now stops at once, naming rank 1."""
    callbacks = ("callbacks=[{class_path: tests.conftest.FailOnRankAt, init_args: {rank: 1, step: 2}}, "
                 "{class_path: tests.conftest.BusyOnRankAt, init_args: {rank: 0, step: 2, seconds: 600}}]")
    with _start(tmp_path, callbacks) as run:
        ranks = _wait_for_rank_1(run)
        started = time.monotonic()
        _, err = run.communicate(timeout=300)
    lines = err.strip().splitlines()
    assert run.returncode == 1, (run.returncode, err[-3000:])
    assert lines[-1].startswith("error: rank 1 (pid ") and "stopped with exit code 1" in lines[-1], err[-3000:]
    assert "simulated failure of rank 1 at step 2" in err  # rank 1's own traceback says why
    assert not any(line.startswith("[rank0]") for line in lines), err[-3000:]
    assert time.monotonic() - started < 120 and _gone_within(ranks, 10)
    (run_dir,) = (tmp_path / "runs" / "tiny").iterdir()
    assert (run_dir / "metrics.csv").is_file()  # its logged steps are kept


SLOW_RANK_1_EXIT = "{class_path: tests.conftest.SlowExitAfterClosingLinks, init_args: {rank: 1, seconds: 8}}"


@pytest.mark.parametrize("extra", ["", f", {SLOW_RANK_1_EXIT}"], ids=["exits-at-once", "exits-8-s-after-closing-its-links"])
def test_a_rank_that_fails_in_setup_is_named_and_its_run_folder_removed(tmp_path: Path, extra: str) -> None:
    """Rank 0 meets rank 1's absence in a collective first: the error is rank 1's, not the
    collective's traceback, also when rank 1 takes seconds to exit once its links are closed
    (it was killed after 3 s and rank 0's collective error shown)."""
    with _start(tmp_path, f"callbacks=[{{class_path: tests.conftest.FailOnRankAt, init_args: {{rank: 1}}}}{extra}]") as run:
        _, err = run.communicate(timeout=300)
    lines = err.strip().splitlines()
    assert run.returncode == 1 and lines[-1].startswith("error: rank 1 (pid "), (run.returncode, err[-3000:])
    assert not any(line.startswith("[rank0]") for line in lines), err[-3000:]
    assert not any((tmp_path / "runs" / "tiny").iterdir())


def test_rank_0_that_cannot_take_its_port_leaves_no_rank_behind(tmp_path: Path) -> None:
    """The rank it started would wait at the occupant's port (and make the run folder again)."""
    with socket.socket() as occupant:
        occupant.bind(("127.0.0.1", 0))
        occupant.listen(16)
        port = occupant.getsockname()[1]
        with _start(tmp_path, "pipeline.timeout_s=60", env={"MASTER_PORT": str(port)}) as run:
            ranks = _wait_for_rank_1(run)
            _, err = run.communicate(timeout=300)
    lines = err.strip().splitlines()
    assert run.returncode == 2 and lines[-1].startswith(f"error: MASTER_PORT={port}: the port is in use"), err[-3000:]
    assert "Traceback" not in err and _gone_within(ranks, 10)
    assert not any((tmp_path / "runs" / "tiny").iterdir())


def test_the_ranks_of_a_killed_run_end_with_it(tmp_path: Path) -> None:
    """kill -9 leaves rank 0 no time to stop anything: the kernel ends the rank it started."""
    busy = "callbacks=[{class_path: tests.conftest.BusyOnRankAt, init_args: {rank: 0, step: 1, seconds: 600}}]"
    with _start(tmp_path, busy) as run:
        ranks = _wait_for_rank_1(run)
        time.sleep(2)
        run.kill()
        run.communicate(timeout=60)
    assert _gone_within(ranks, 10), _alive(ranks)


def test_a_signal_to_bench_link_in_a_namespace_leaves_no_process(tmp_path: Path) -> None:
    from tclightning.bench.link import netns_problem

    problem = netns_problem()
    if problem is not None:
        pytest.skip(problem)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "tclightning", "bench", "link", "--link", "netns", "--bandwidth", "0.05",
               "--layouts", "dense", "--steps", "3", "--warmup", "0"]
    with subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as bench:
        deadline = time.monotonic() + 180
        inside: set[int] = set()
        while not inside and time.monotonic() < deadline and bench.poll() is None:
            below = _descendants(bench.pid)
            inside = {pid for pid in below if b"--inside" in _cmdline(pid)}
            time.sleep(0.2)
        assert inside, "the benchmark never entered its namespace"
        time.sleep(2)
        below = _descendants(bench.pid)  # the namespace's process and the ranks it started
        bench.send_signal(signal.SIGTERM)
        bench.communicate(timeout=60)
    assert bench.returncode == 130 and _gone_within(below, 10), (bench.returncode, _alive(below))
    listed = subprocess.run(["ip", "netns", "list"], check=False, capture_output=True, text=True).stdout
    assert f"tcl-link-{bench.pid}" not in listed


SLOW_RANK_1_STOP = ("callbacks=[{class_path: tests.conftest.SlowStopOnRank, "
                    "init_args: {rank: 1, seconds: 8, done: rank-1-ended}}]")


@pytest.mark.parametrize("signum, rank, extra", [(signal.SIGINT, 0, ()), (signal.SIGINT, 1, ()), (signal.SIGTERM, 0, ()),
                                                 (signal.SIGTERM, 0, (SLOW_RANK_1_STOP,))],
                         ids=["ctrl-c-to-rank-0", "ctrl-c-to-rank-1", "sigterm-to-rank-0", "sigterm-rank-1-ends-slowly"])
def test_a_stop_one_rank_alone_takes_stops_every_rank_after_the_same_step(tmp_path: Path, signum: int, rank: int,
                                                                          extra: tuple[str, ...]) -> None:
    """``kill -INT`` or ``kill -TERM`` of one rank (a terminal's Ctrl-C reaches every rank): the
    others waited in the next step for one that had stopped, until pipeline.timeout_s (and
    Lightning's SIGTERM handler broadcast from inside the handler, a collective no other rank was in).
    A rank slow to end after the agreed stop was killed after 3 s (and, if the rank watcher saw
    it first, its SIGKILL reported as its failure)."""
    with _start(tmp_path, "trainer.steps=2000", "trainer.checkpoint_every=1000", "pipeline.timeout_s=600",
                *extra) as run:
        ranks = _wait_for_rank_1(run)
        metrics = tmp_path / "runs" / "tiny"
        deadline = time.monotonic() + 180
        while not any(metrics.glob("*/metrics.csv")) and time.monotonic() < deadline:
            time.sleep(0.2)
        os.kill(run.pid if rank == 0 else next(pid for pid in ranks if b"tclightning" in _cmdline(pid)), signum)
        _, err = run.communicate(timeout=600)
    assert _gone_within(ranks, 10), err[-3000:]
    assert run.returncode == (0 if signum == signal.SIGINT else 130), (run.returncode, err[-3000:])
    assert "no checkpoint was saved" not in err  # rank 1 speaks for no run directory
    (run_dir,) = (tmp_path / "runs" / "tiny").iterdir()
    # stopped within steps of the signal, not at the run's end or pipeline.timeout_s (a signal rank 1
    # took while it waited in the step's agreement was lost: the run trained on to step 2000)
    assert not (run_dir / "checkpoints" / "step-001000.ckpt").exists(), err[-3000:]
    assert load_checkpoint(run_dir / "checkpoints" / "last.ckpt")["tclightning"]["rl_step"] < 1000
    if extra:  # the slow rank was let end its stop
        assert (tmp_path / "rank-1-ended").is_file(), err[-3000:]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_signal_to_bench_step_link_leaves_no_node_behind(tmp_path: Path, signum: int) -> None:
    """torchrun starts each node's worker in a session of its own: a signal to the benchmark left
    both training on under init (and its temporary folder, after a SIGTERM)."""
    from tclightning.bench.link import netns_problem
    from tclightning.bench.nodes import remove_orphaned_links

    problem = netns_problem()
    if problem is not None:
        pytest.skip(problem)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path)}
    command = [sys.executable, "-m", "tclightning", "bench", "step-link", "--recipe", "tiny", "--compressed-recipe",
               "fast-only-lowrank", "--stages", "2", "--bandwidth", "100", "--steps", "2", "--timeout", "120"]
    with subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as bench:
        deadline = time.monotonic() + 180
        workers: set[int] = set()
        while len(workers) < 2 and time.monotonic() < deadline and bench.poll() is None:
            below = _descendants(bench.pid)
            workers = {pid for pid in below if b"-u\x00-m\x00tclightning\x00run" in _cmdline(pid)}  # not torchrun
            time.sleep(0.2)
        assert len(workers) == 2, "the nodes never started"
        below = _descendants(bench.pid)
        bench.send_signal(signum)
        bench.communicate(timeout=60)
    assert _gone_within(below, 15), _alive(below)
    # A SIGKILL leaves the bench no time to delete its namespaces and bridge: the next launch
    # deletes those of launches no longer running, as here (so the suite leaves none either).
    remove_orphaned_links()
    listed = subprocess.run(["ip", "netns", "list"], check=False, capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], check=False, capture_output=True, text=True).stdout
    assert f"-{bench.pid}" not in listed and f"tclb-{bench.pid}" not in links, (listed, links)
    if signum == signal.SIGTERM:
        assert bench.returncode == 130 and not list(tmp_path.glob("tcl-step-link-*"))
