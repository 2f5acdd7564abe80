"""Two nodes for real: torchrun in two network namespaces over a tc-shaped veth link, and the
documented SLURM script under a fake two-node allocation. Both against one process.

Slow (each run starts 2-4 training processes); needs root, ``ip`` and ``tc`` for the namespaces.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from tests.conftest import FAST

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "distributed.md"
# the recipe and settings every run here shares: rewards vary without a warm-up (overlong
# penalty), and the anchor runs (K=1/C=2: snapshots at steps 0 and 2, M at step 1)
RUN = ["--recipe", "all-compressed", "--quiet", "pipeline.stages=2", "trainer.steps=3", *FAST,
       "trainer.val_every=0", "trainer.accelerator=cpu", "grpo.overlong=1.0", "anchor.latency=1",
       "anchor.cadence=2", "anchor.beta=0.5"]
MBIT = 100.0


class RecordCluster(L.Callback):
    """Writes the cluster environment Lightning detected, per rank, into the run directory."""

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        env = trainer.strategy.cluster_environment
        path = Path(os.environ["TCLIGHTNING_RUN_DIR"]) / f"cluster-{trainer.global_rank}.txt"
        path.write_text(f"{type(env).__name__} {env.global_rank()} {env.world_size()} {env.node_rank()}")


def one_process(tmp_path: Path) -> Path:
    where = tmp_path / "single"
    where.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "tclightning", "run", *RUN, "trainer.devices=1"], cwd=where, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    (run_dir,) = (where / "runs" / "all-compressed").iterdir()
    return run_dir


def same_run(got_dir: Path, want_dir: Path) -> dict[int, dict[str, float]]:
    """The losses, gradient norms, rewards, anchor and boundary bytes of every step, and the final
    weights, equal one process's (the tolerances of tests/test_distributed.py)."""
    from tclightning.grpo.summary import read_metrics

    got, want = read_metrics(got_dir / "metrics.csv"), read_metrics(want_dir / "metrics.csv")
    assert sorted(got) == sorted(want) == [0, 1, 2]
    assert any(abs(want[s]["loss/policy"]) > 0 for s in want)  # something to compare
    for step in want:
        for key in ("loss/policy", "policy/grad_norm", "reward/mean"):
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-4, abs=1e-6), (step, key)
        for key in ("anchor/bytes", "wire/bytes_fwd", "wire/bytes_bwd"):
            assert got[step][key] == want[step][key], (step, key)
    assert want[1]["anchor/bytes"] > 0
    ours = torch.load(got_dir / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    for name, weight in torch.load(want_dir / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"].items():
        torch.testing.assert_close(ours[name], weight, rtol=1e-4, atol=1e-5, msg=name)
    return got


def boundary_formula(metrics: dict[str, float], k: int, d: int) -> float:
    """The boundary bytes of a step, both directions: T real tokens x k values x 4 bytes each way
    (T from the dense count the meter keeps beside it, ``T x d x 4``)."""
    tokens = metrics["wire/dense_bytes_fwd"] / (d * 4)
    return 2 * tokens * k * 4


@pytest.mark.slow
def test_two_nodes_over_a_shaped_veth_link_match_one_process(tmp_path: Path) -> None:
    """2 nodes x 1 process (one stage per node) and 2 nodes x 2 processes (2 replicas x 2 stages,
    a stage's replicas on one node): torchrun in two namespaces, rendezvous over the veth
    addresses, the link shaped with tc tbf. Same run as one process; the boundary bytes counted
    from the sends equal the formula, and the veth carried at least what the nodes sent each other."""
    from tclightning.bench.link import netns_problem
    from tclightning.bench.nodes import run_nodes

    problem = netns_problem()
    if problem is not None:
        pytest.skip(f"network namespaces unavailable: {problem}")
    want = one_process(tmp_path)
    d, k = 32, round(0.05 * 32)  # FAST's hidden size; all-compressed's prf rate
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for per_node, extra in ((1, []), (2, ["pipeline.replicas=2"])):
        where = tmp_path / f"nodes-2x{per_node}"
        where.mkdir()
        result = run_nodes([*RUN, *extra], per_node=per_node, mbit=MBIT, run_dir=where / "run", cwd=where,
                              env=env, timeout_s=600, echo=lambda line: None)
        assert result["returncodes"] == [0, 0], "\n".join(result["stderr"])
        if per_node == 2:  # docs/distributed.md shows these very commands
            for command in result["commands"]:
                line = "torchrun " + shlex.join(command[command.index("--nnodes"):])
                assert line in DOC.read_text(), line
        got = same_run(where / "run", want)
        for values in got.values():
            assert values["wire/bytes_fwd"] + values["wire/bytes_bwd"] == boundary_formula(values, k, d)
            if per_node == 2:
                assert values["dp/replicas"] == 2 and values["dp/grad_bytes"] > 0
        # node 0 holds stage 0 (of every replica): the forward messages cross 0 -> 1; the
        # gradient messages and stage 1's weights for the sampler cross 1 -> 0
        forward = sum(v["wire/bytes_fwd"] for v in got.values())
        backward = sum(v["wire/bytes_bwd"] + v["wire/sync_bytes"] for v in got.values())
        tx = result["link"]["tx_bytes"]
        assert tx[0] >= forward and tx[1] >= backward, (tx, forward, backward)
        print(f"2 nodes x {per_node}: veth tx {tx} bytes; boundary fwd {forward:.0f}, bwd + sync {backward:.0f}")


TRAFFIC_RUN = ["--recipe", "tiny", "--quiet", "trainer.strategy=pipeline", "pipeline.stages=2", "model.warmup.steps=0",
               "trainer.val_every=0", "trainer.accelerator=cpu", "trainer.checkpoint_every=0", "logging.progress=none",
               "trainer.num_threads=1"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dense", "all"])
def test_the_link_carries_no_more_than_the_counted_total(tmp_path: Path, layout: str) -> None:
    """What the veth carries for two more steps (3 against 1: the rendezvous, the initial weight
    broadcast and the final checkpoint cancel) is at least ``wire/total_bytes`` of those steps and
    at most 1.2x it (TCP/IP headers, acknowledgements, the steps' scalars): nothing large crosses
    uncounted, dense or compressed."""
    from tclightning.bench.link import netns_problem
    from tclightning.bench.nodes import run_nodes
    from tclightning.grpo.summary import read_metrics

    problem = netns_problem()
    if problem is not None:
        pytest.skip(f"network namespaces unavailable: {problem}")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    link, counted = {}, {}
    for steps in (1, 3):
        where = tmp_path / f"steps-{steps}"
        where.mkdir()
        result = run_nodes([*TRAFFIC_RUN, f"pipeline.layout={layout}", f"trainer.steps={steps}"], per_node=1,
                              mbit=1000.0, run_dir=where / "run", cwd=where, env=env, timeout_s=600,
                              echo=lambda line: None)
        assert result["returncodes"] == [0, 0], "\n".join(result["stderr"])
        link[steps] = sum(result["link"]["tx_bytes"])
        counted[steps] = sum(v["wire/total_bytes"] for v in read_metrics(where / "run" / "metrics.csv").values())
    carried, total = link[3] - link[1], counted[3] - counted[1]
    print(f"{layout}: veth {carried} bytes for steps 1-2, counted {total:.0f} ({carried / total:.3f}x)")
    assert total <= carried <= 1.2 * total


def sbatch_script() -> str:
    """The SLURM script of docs/distributed.md, as shipped."""
    blocks = re.findall(r"```bash\n(#!/bin/bash\n#SBATCH.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 1, "docs/distributed.md must hold exactly one sbatch script"
    return blocks[0]


FAKE_SRUN = """#!{python}
# srun of a fake allocation: SLURM_NTASKS tasks on this machine, each with the variables srun sets
import os, subprocess, sys
ntasks, per_node = int(os.environ["SLURM_NTASKS"]), int(os.environ["SLURM_NTASKS_PER_NODE"])
procs = [subprocess.Popen(sys.argv[1:], env={{**os.environ, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r % per_node),
                                            "SLURM_NODEID": str(r // per_node)}}) for r in range(ntasks)]
sys.exit(max(p.wait() for p in procs))
"""


def free_job_id() -> int:
    """A job id whose port (Lightning: 15000 + its last 4 digits) is free here."""
    for job in range(4242, 9999):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", 15000 + job))
            except OSError:
                continue
            return job
    raise RuntimeError("no free port in 19242-24999")


@pytest.mark.slow
def test_the_documented_sbatch_script_runs_under_a_two_node_slurm_allocation(tmp_path: Path) -> None:
    """The script in docs/distributed.md, run by bash with the variables a 2-node x 2-task
    allocation sets and an ``srun`` that starts its 4 tasks here: Lightning detects SLURM (no
    process of its own started), the ranks are SLURM's, and the run trains with dp/* and wire/*."""
    from tclightning.grpo.summary import read_metrics

    script = tmp_path / "two-node.sbatch"
    script.write_text(sbatch_script())
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(FAKE_SRUN.format(python=sys.executable))
    srun.chmod(0o755)
    shim = bin_dir / "python"  # `python` in the script: this interpreter (a wrapper keeps its venv)
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    shim.chmod(0o755)
    job = free_job_id()
    env = {**os.environ, "PYTHONPATH": str(REPO), "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "SLURM_JOB_ID": str(job), "SLURM_JOB_NAME": "two-node", "SLURM_NNODES": "2", "SLURM_NTASKS": "4",
           "SLURM_NTASKS_PER_NODE": "2", "SLURM_NODELIST": "localhost"}
    env.pop("MASTER_ADDR", None)
    env.pop("MASTER_PORT", None)
    callback = "callbacks=[{class_path: tests.test_two_node.RecordCluster}]"
    done = subprocess.run(["bash", str(script), *FAST, "trainer.steps=2", "trainer.val_every=0", callback],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "runs" / "two-node" / str(job)
    seen = sorted((run_dir / f"cluster-{rank}.txt").read_text() for rank in range(4))
    assert seen == [f"SLURMEnvironment {rank} 4 {rank // 2}" for rank in range(4)]
    rows = read_metrics(run_dir / "metrics.csv")
    assert sorted(rows) == [0, 1]
    for values in rows.values():
        assert values["dp/replicas"] == 2 and values["wire/bytes_fwd"] > 0


@pytest.mark.parametrize("node_log, code, said", [
    ("Traceback (most recent call last):\nerror: trainer.devices x trainer.num_nodes = 2 needs trainer.strategy="
     "pipeline\ntorch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n", 2,
     "node 0 exited with 1: trainer.devices x trainer.num_nodes = 2 needs trainer.strategy=pipeline; "),
    ("Segmentation fault\n", 1, "node 0 exited with 1; the nodes' output is in "),
], ids=["the-run-refused-its-arguments", "the-run-crashed"])
def test_a_two_node_bench_whose_nodes_fail_says_why_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str], node_log: str,
                                                              code: int, said: str) -> None:
    """Every node refused its run arguments and the bench exited 1 with nothing on stderr: the
    reason was only in node*.log, under torchrun's traceback."""
    from tclightning.cli.main import main

    def failing_nodes(run_args: list[str], *, cwd: Path, **_: Any) -> dict[str, Any]:
        for node in range(2):
            (cwd / f"node{node}.log").write_text(node_log)
        return {"returncodes": [1, 1], "commands": [], "stderr": ["", ""], "link": {}, "seconds": 1.0, "mbit": 100}

    monkeypatch.setattr("tclightning.bench.nodes.run_nodes", failing_nodes)
    capsys.readouterr()
    assert main(["bench", "two-node", "--dir", str(tmp_path / "w"), "--", "--recipe", "tiny"]) == code
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: bench two-node: ") and said in err[0], err
    assert '"returncodes": [' in captured.out


@pytest.mark.parametrize("kept", ["node0.log", "node1.log", "node0.log-a-hard-link"])
def test_a_two_node_bench_never_writes_over_a_node_log_already_there(tmp_path: Path, kept: str,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """``node0.log`` and ``node1.log`` in ``--dir`` (yours, or an earlier run's; a hard link to a
    file elsewhere) were emptied and written over without a word: refused before anything starts."""
    from tclightning.cli.main import main

    mine = tmp_path / "mine.txt"
    mine.write_text("keep me\n")
    where = tmp_path / "w"
    where.mkdir()
    name = kept.removesuffix("-a-hard-link")
    if kept.endswith("hard-link"):
        os.link(mine, where / name)
    else:
        (where / name).write_text("keep me\n")
    capsys.readouterr()
    assert main(["bench", "two-node", "--dir", str(where), "--", "--recipe", "tiny"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{name}: already there" in err[0], err
    assert (where / name).read_text() == mine.read_text() == "keep me\n"
    assert sorted(p.name for p in where.iterdir()) == [name]
