"""Two nodes on one machine: two network namespaces joined by a tc-shaped veth pair, one torchrun
node in each, training through the same Lightning launch path a cluster uses.

Node ``i`` is namespace ``tcl-node<i>-<pid>`` with address ``10.77.0.<i+1>`` on its end of the veth
pair; both ends are shaped with a token bucket (``tc qdisc add dev <veth> root tbf rate <R>mbit``),
so every byte between the nodes crosses an R Mbit/s link, while the processes of one node talk
over that node's own loopback. Each node runs

    torchrun --nnodes 2 --nproc_per_node P --node_rank i --master_addr 10.77.0.1 --master_port 29500 \\
        -m tclightning run --recipe ... trainer.devices=P trainer.num_nodes=2 ...

with ``TCLIGHTNING_RUN_DIR`` the same on both (one run directory) and ``GLOO_SOCKET_IFNAME`` its
veth (gloo binds there). Lightning detects torchrun's environment; nothing here is a test-only
path. The veth counters (``/sys/class/net/<veth>/statistics/{tx,rx}_bytes``) give the bytes that
crossed the link, headers included. The namespaces (and with them the veth pair) are deleted on
every exit path: success, failure, Ctrl-C and SIGTERM.

``tclightning bench two-node`` (``tclightning/cli/bench.py``) runs :func:`run_two_node`.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tclightning.bench.link import netns_problem

SUBNET = "10.77.0"
MASTER_PORT = 29500


def node_address(node: int) -> str:
    return f"{SUBNET}.{node + 1}"


def torchrun_command(node: int, per_node: int, run_args: Sequence[str], *, python: str = sys.executable) -> list[str]:
    """The command node ``node`` runs (what ``docs/distributed.md`` shows), ``run_args`` being the
    arguments of ``tclightning run`` (recipe, overrides; ``trainer.devices`` / ``num_nodes`` are
    added from ``per_node`` and the two nodes)."""
    torchrun = Path(python).parent / "torchrun"  # the venv's; else the same module by name
    launcher = [str(torchrun)] if torchrun.exists() else [python, "-m", "torch.distributed.run"]
    return [*launcher, "--nnodes", "2", "--nproc_per_node", str(per_node),
            "--node_rank", str(node), "--master_addr", node_address(0), "--master_port", str(MASTER_PORT),
            "-m", "tclightning", "run", *run_args, f"trainer.devices={per_node}", "trainer.num_nodes=2"]


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


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def run_two_node(
    run_args: Sequence[str],
    *,
    per_node: int = 1,
    mbit: float = 100.0,
    run_dir: Path,
    cwd: Path,
    timeout_s: float = 900.0,
    env: dict[str, str] | None = None,
    echo: Callable[[str], Any] = print,
) -> dict[str, Any]:
    """Run ``tclightning run <run_args>`` as 2 torchrun nodes x ``per_node`` processes across a
    veth link shaped to ``mbit``; the run writes into ``run_dir`` (working directory ``cwd``).

    Returns ``{"returncodes": [node 0, node 1], "commands": [argv per node], "stderr": [tail per
    node, also in ``cwd/node<i>.log``], "link": {"tx_bytes": [node 0, node 1], "rx_bytes": [...]},
    "seconds": wall time}``;
    ``link`` counts what each node's veth sent and received during the run (frames, headers
    included). Raises ``RuntimeError`` (saying why) where namespaces cannot be made."""
    problem = netns_problem()
    if problem is not None:
        raise RuntimeError(f"two-node launch needs network namespaces: {problem}")
    tag = os.getpid()
    spaces = [f"tcl-node{i}-{tag}" for i in range(2)]
    veths = [f"tclv{i}-{tag}"[:15] for i in range(2)]
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    procs: list[subprocess.Popen[bytes]] = []
    logs = [Path(cwd) / f"node{i}.log" for i in range(2)]
    try:
        for space in spaces:
            _sh("ip", "netns", "add", space)
        _sh("ip", "link", "add", veths[0], "type", "veth", "peer", "name", veths[1])
        burst = max(32 * 1024, int(mbit * 1e6 / 8 * 0.004))  # about 4 ms of traffic, as link.py
        for node, (space, veth) in enumerate(zip(spaces, veths)):
            _sh("ip", "link", "set", veth, "netns", space)
            _sh("ip", "-n", space, "addr", "add", f"{node_address(node)}/24", "dev", veth)
            _sh("ip", "-n", space, "link", "set", veth, "mtu", "1500", "up")
            _sh("ip", "-n", space, "link", "set", "lo", "up")
            _sh("ip", "netns", "exec", space, "tc", "qdisc", "add", "dev", veth, "root", "tbf",
                "rate", f"{mbit:g}mbit", "burst", str(burst), "latency", "200ms")
        before = {key: [_counter(s, v, key) for s, v in zip(spaces, veths)] for key in ("tx_bytes", "rx_bytes")}
        commands = [torchrun_command(node, per_node, run_args) for node in range(2)]
        started = time.perf_counter()
        for node, (space, veth) in enumerate(zip(spaces, veths)):
            node_env = {**(env or os.environ), "TCLIGHTNING_RUN_DIR": str(run_dir), "GLOO_SOCKET_IFNAME": veth,
                        "OMP_NUM_THREADS": "1"}
            echo(f"node {node} ({space}): {shlex.join(commands[node])}")
            with logs[node].open("wb") as log:  # a file, not a pipe: a chatty node never blocks
                procs.append(subprocess.Popen(["ip", "netns", "exec", space, *commands[node]], cwd=cwd, env=node_env,
                                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        deadline = started + timeout_s
        for proc in procs:
            try:
                proc.wait(timeout=max(1.0, deadline - time.perf_counter()))
            except subprocess.TimeoutExpired:
                _kill(proc)
        outputs = [log.read_text(errors="replace")[-4000:] for log in logs]
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
        for space in spaces:  # deleting a namespace deletes its end of the veth pair, and so the pair
            subprocess.run(["ip", "netns", "del", space], check=False, capture_output=True)
        subprocess.run(["ip", "link", "del", veths[0]], check=False, capture_output=True)  # if never moved
        signal.signal(signal.SIGTERM, previous)


__all__ = ["MASTER_PORT", "SUBNET", "node_address", "run_two_node", "torchrun_command"]
