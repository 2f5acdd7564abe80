"""Several nodes on one machine: one network namespace per node, the nodes joined by a switch (a
bridge) whose ports are tc-shaped, one torchrun node in each, training through the same Lightning
launch path a cluster uses.

Node ``i`` is namespace ``tcl-node<i>-<pid>`` with address ``10.77.0.<i+1>`` on its end of a veth
pair whose other end is a port of the bridge ``tclb-<pid>``. Both ends are shaped with a token
bucket (``tc qdisc add dev <veth> root tbf rate <R>mbit``): each node's uplink and downlink carry
R Mbit/s, as a host on a switch, while the processes of one node talk over that node's own
loopback. Each node runs

    torchrun --nnodes N --nproc_per_node P --node_rank i --master_addr 10.77.0.1 --master_port 29500 \\
        -m tclightning run --recipe ... trainer.devices=P trainer.num_nodes=N ...

with ``TCLIGHTNING_RUN_DIR`` the same on all (one run directory) and ``GLOO_SOCKET_IFNAME`` its
veth (gloo binds there). Lightning detects torchrun's environment; nothing here is a test-only
path. The veth counters (``/sys/class/net/<veth>/statistics/{tx,rx}_bytes``) give the bytes that
crossed each node's link, headers included. The namespaces, the veth pairs and the bridge are
deleted on every exit path: success, failure, Ctrl-C and SIGTERM.

``tclightning bench two-node`` (``tclightning/cli/bench.py``) runs :func:`run_nodes` with two
nodes; ``tclightning bench step-link`` (:mod:`tclightning.bench.step_link`) one node per stage.
"""

from __future__ import annotations

import functools
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tclightning.bench.link import netns_problem, remove_orphaned_namespaces
from tclightning.errors import TclightningError
from tclightning.files import own_file
from tclightning.processes import LAUNCHER_PID_ENV, child_environment, die_with_parent

SUBNET = "10.77.0"
MASTER_PORT = 29500


def node_address(node: int) -> str:
    return f"{SUBNET}.{node + 1}"


def torchrun_command(node: int, per_node: int, run_args: Sequence[str], *, nodes: int = 2,
                     python: str = sys.executable) -> list[str]:
    """The command node ``node`` runs (what ``docs/distributed.md`` shows), ``run_args`` being the
    arguments of ``tclightning run`` (recipe, overrides; ``trainer.devices`` / ``num_nodes`` are
    added from ``per_node`` and the two nodes)."""
    torchrun = Path(python).parent / "torchrun"  # the venv's; else the same module by name
    launcher = [str(torchrun)] if torchrun.exists() else [python, "-m", "torch.distributed.run"]
    return [*launcher, "--nnodes", str(nodes), "--nproc_per_node", str(per_node),
            "--node_rank", str(node), "--master_addr", node_address(0), "--master_port", str(MASTER_PORT),
            "-m", "tclightning", "run", *run_args, f"trainer.devices={per_node}", f"trainer.num_nodes={nodes}"]


def _sh(*argv: str) -> None:
    done = subprocess.run(list(argv), check=False, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")


def _counter(namespace: str, device: str, name: str) -> int:
    out = subprocess.run(["ip", "netns", "exec", namespace, "cat", f"/sys/class/net/{device}/statistics/{name}"],
                         check=True, capture_output=True, text=True)
    return int(out.stdout.strip())


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """End a node's torchrun and its workers: the session it leads (started here), by its id."""
    try:  # also when torchrun itself has ended: workers it left would still be in its group
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _tail(log: Path, size: int = 4000) -> str:
    """The last ``size`` bytes of a node's log, as text."""
    with own_file(log, "rb") as handle:
        handle.seek(max(0, os.fstat(handle.fileno()).st_size - size))
        return handle.read(size).decode(errors="replace")


def first_error_line(log: Path, size: int = 1 << 16) -> str | None:
    """The first ``error:`` line a node's run printed in the last ``size`` bytes of its log (its
    refusal, above torchrun's traceback about the failed child), or None."""
    return next((line for line in _tail(log, size).splitlines() if line.startswith("error: ")), None)


def remove_orphaned_links() -> None:
    """Delete the namespaces and bridges of launches whose process no longer runs (killed with -9,
    which leaves no time to delete them): ``tcl-node<i>-<pid>``, ``tclb-<pid>``."""
    remove_orphaned_namespaces("tcl-node")
    links = subprocess.run(["ip", "-o", "link", "show", "type", "bridge"], check=False, capture_output=True, text=True)
    for line in links.stdout.splitlines():
        name = line.split(":")[1].strip() if line.count(":") >= 2 else ""
        owner = name.removeprefix("tclb-")
        if name.startswith("tclb-") and owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
            subprocess.run(["ip", "link", "del", name], check=False, capture_output=True)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def run_nodes(
    run_args: Sequence[str],
    *,
    nodes: int = 2,
    per_node: int = 1,
    mbit: float | None = 100.0,
    run_dir: Path,
    cwd: Path,
    timeout_s: float = 900.0,
    env: dict[str, str] | None = None,
    echo: Callable[[str], Any] = print,
) -> dict[str, Any]:
    """Run ``tclightning run <run_args>`` as ``nodes`` torchrun nodes x ``per_node`` processes, each
    node in its own namespace on a switch (a bridge) whose every port is shaped to ``mbit`` each way
    (``None``: not shaped); the run writes into ``run_dir`` (working directory ``cwd``).

    Returns ``{"returncodes": [per node], "commands": [argv per node], "stderr": [tail per node,
    also in ``cwd/node<i>.log``], "link": {"tx_bytes": [per node], "rx_bytes": [...]}, "seconds":
    wall time, "mbit": mbit}``; ``link`` counts what each node's veth sent and received during the
    run (frames, headers included). Raises ``RuntimeError`` (saying why) where namespaces cannot
    be made."""
    if run_dir.is_symlink() or (run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir()))):
        # every node writes into run_dir as a launched rank (TCLIGHTNING_RUN_DIR), without the
        # marker and lock checks a run makes of its own folder
        raise TclightningError(f"{run_dir}: already holds something (an earlier run?); the nodes' run goes into a "
                               "new or empty folder: give another --dir")
    logs = [Path(cwd) / f"node{i}.log" for i in range(nodes)]
    kept = next((log for log in logs if os.path.lexists(log)), None)
    if kept is not None:  # a file of yours, or an earlier run's log: never written over
        raise TclightningError(f"{kept}: already there (an earlier run's log?); each node's output goes into a new "
                               "file: give another --dir")
    problem = netns_problem()
    if problem is not None:
        raise RuntimeError(f"a multi-node launch needs network namespaces: {problem}")
    if nodes < 2:
        raise ValueError(f"nodes must be at least 2, got {nodes}")
    tag = os.getpid()
    spaces = [f"tcl-node{i}-{tag}" for i in range(nodes)]
    veths = [f"tclv{i}-{tag}"[:15] for i in range(nodes)]  # each node's end
    ports = [f"tclp{i}-{tag}"[:15] for i in range(nodes)]  # the switch's end
    bridge = f"tclb-{tag}"[:15]
    remove_orphaned_links()
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        _sh("ip", "link", "add", bridge, "type", "bridge")
        _sh("ip", "link", "set", bridge, "up")
        burst = None if mbit is None else max(32 * 1024, int(mbit * 1e6 / 8 * 0.004))  # about 4 ms, as link.py
        for node, (space, veth, port) in enumerate(zip(spaces, veths, ports)):
            _sh("ip", "netns", "add", space)
            _sh("ip", "link", "add", veth, "type", "veth", "peer", "name", port)
            _sh("ip", "link", "set", veth, "netns", space)
            _sh("ip", "link", "set", port, "master", bridge)
            _sh("ip", "link", "set", port, "mtu", "1500", "up")
            _sh("ip", "-n", space, "addr", "add", f"{node_address(node)}/24", "dev", veth)
            _sh("ip", "-n", space, "link", "set", veth, "mtu", "1500", "up")
            _sh("ip", "-n", space, "link", "set", "lo", "up")
            if mbit is not None:  # the node's uplink (what it sends) and downlink (what the switch sends it)
                shape = ["root", "tbf", "rate", f"{mbit:g}mbit", "burst", str(burst), "latency", "200ms"]
                _sh("ip", "netns", "exec", space, "tc", "qdisc", "add", "dev", veth, *shape)
                _sh("tc", "qdisc", "add", "dev", port, *shape)
        before = {key: [_counter(s, v, key) for s, v in zip(spaces, veths)] for key in ("tx_bytes", "rx_bytes")}
        commands = [torchrun_command(node, per_node, run_args, nodes=nodes) for node in range(nodes)]
        started = time.perf_counter()
        for node, (space, veth) in enumerate(zip(spaces, veths)):
            node_env = {**child_environment(env), "TCLIGHTNING_RUN_DIR": str(run_dir), "GLOO_SOCKET_IFNAME": veth,
                        "OMP_NUM_THREADS": "1",
                        LAUNCHER_PID_ENV: "parent"}  # torchrun starts its workers in sessions of their own
            echo(f"node {node} ({space}): {shlex.join(commands[node])}")
            with own_file(logs[node], "xb") as log:  # a new file, not a pipe: a chatty node never blocks
                procs.append(subprocess.Popen(["ip", "netns", "exec", space, *commands[node]], cwd=cwd, env=node_env,
                                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                              preexec_fn=functools.partial(die_with_parent, os.getpid())))
        deadline = started + timeout_s
        for proc in procs:
            try:
                proc.wait(timeout=max(1.0, deadline - time.perf_counter()))
            except subprocess.TimeoutExpired:
                _kill(proc)
        outputs = [_tail(log) for log in logs]
        after = {key: [_counter(s, v, key) for s, v in zip(spaces, veths)] for key in ("tx_bytes", "rx_bytes")}
        return {
            "returncodes": [proc.returncode for proc in procs],
            "commands": commands,
            "stderr": outputs,
            "link": {key: [a - b for a, b in zip(after[key], before[key])] for key in after},
            "seconds": time.perf_counter() - started,
            "mbit": mbit,
        }
    finally:
        for proc in procs:  # only the process groups started here (torchrun and its workers)
            _kill(proc)
        for space in spaces:  # deleting a namespace deletes its end of each veth pair, and so the pair
            subprocess.run(["ip", "netns", "del", space], check=False, capture_output=True)
        for port in ports:  # a pair whose node end was never moved
            subprocess.run(["ip", "link", "del", port], check=False, capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], check=False, capture_output=True)
        signal.signal(signal.SIGTERM, previous)


__all__ = ["MASTER_PORT", "SUBNET", "node_address", "run_nodes", "torchrun_command"]
