"""Pipeline x data parallel: 4 gloo ranks (2 replicas x 2 stages) against the one-process reference.

One spawn runs every check (start-up dominates); the one-process references and helpers are
those of ``tests/test_distributed.py``, so the tolerances are the same.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tclightning.bench.launch import run_ranks
from tclightning.errors import TclightningError
from tclightning.pipeline import CutSet, PipelineConfig
from tests.test_distributed import (
    ADVANTAGES,
    ANCHOR_CASE,
    LOSS,
    STEP,
    TURNS,
    anchor_ticks,
    backend_request,
    config_for,
    rollouts,
    tiny_llama,
)

REPLICAS, STAGES = 2, 2
REPO = Path(__file__).resolve().parents[1]


def replicated(case: str = ANCHOR_CASE) -> PipelineConfig:
    config = config_for(case)
    config.replicas = REPLICAS
    return config


def make_backend(model: torch.nn.Module) -> Any:
    """This rank's backend: a ("dp", "pp") mesh, the engine on its replica's pipeline."""
    from tclightning.pipeline.backends import PipelineBackend
    from tclightning.pipeline.engine import PipelineEngine
    from tclightning.pipeline.mesh import ReplicaMesh

    config = replicated()
    mesh = ReplicaMesh(REPLICAS, timeout_s=config.timeout_s)
    engine = PipelineEngine(model, config, group=mesh.pp_group, tie_group=mesh.tie_group)
    mesh.broadcast_weights(model)
    return PipelineBackend(backend_request(model), engine, mesh)


def run_update(backend: Any, model: torch.nn.Module, advantages: torch.Tensor, minibatches: int) -> dict[str, Any]:
    """``grpo_update`` (SGD, clipping) over ``minibatches`` ticks of the 6 rows; 4 minibatches make
    1-row ticks, where one replica's share is empty."""
    from tclightning.grpo.config import GRPOConfig
    from tclightning.grpo.update import grpo_update

    names = {id(p): name for name, p in model.named_parameters()}
    owned = backend.owned_parameters()
    optimizer = torch.optim.SGD(owned, lr=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda tick: 1.0)
    cfg = GRPOConfig(minibatches=minibatches, max_grad_norm=1.0)
    backend.begin_step(STEP)
    result = grpo_update(backend, optimizer, schedule, rollouts(), advantages, torch.arange(6), cfg=cfg,
                         norm_length=4, seed=0, step=STEP, turns=TURNS)
    return {"metrics": result.metrics, "skipped": result.skipped, "wire": backend.wire_metrics(),
            "weights": {names[id(p)]: p.detach().clone() for p in owned}}


def worker(rank: int, world_size: int) -> dict[str, Any]:
    """One rank of the 2 x 2 mesh: one forward/backward (gradients, loss, bytes), the anchor
    circuit, the update loop (1 and 4 minibatches) and a NaN step."""
    from tclightning.grpo.update import MicrobatchLoss, anchor_gradient

    out: dict[str, Any] = {}
    model = tiny_llama(seed=rank)  # different on purpose: the mesh broadcasts rank 0's weights
    names = {id(p): name for name, p in model.named_parameters()}
    backend = make_backend(model)
    out["coords"] = (backend.mesh.replica, backend.mesh.stage)

    # 1. one forward/backward of the whole batch: loss, gradients, wire and dp bytes
    batch = rollouts()
    old_logp = torch.zeros(6, 4)
    if backend.has_loss:  # the reference's old log-probs (its own - 0.1, so ratios are not 1)
        shadow = tiny_llama()
        with CutSet(shadow, config_for(ANCHOR_CASE)) as cuts, torch.no_grad():
            cuts.set_step(STEP)
            from tclightning.models.logprobs import completion_logps

            old_logp = completion_logps(shadow, batch)[0] - 0.1
    loss_fn = MicrobatchLoss(old_logp=old_logp, advantages=ADVANTAGES, mask=batch.completion_mask,
                             logp_sampler=batch.logp_sampler, ref_logp=None, settings=LOSS, norm_length=4)
    backend.begin_step(STEP)
    logp, _ = backend.forward_backward(batch, loss_fn)
    backend.clip_gradients(float("inf"))
    out["grads"] = {names[id(p)]: p.grad.clone() for p in backend.owned_parameters() if p.grad is not None}
    out["loss"] = loss_fn.stats["loss/policy"] if backend.has_loss else None
    out["logp"] = logp
    out["wire"] = backend.wire_metrics()
    out["owned_numel"] = sum(p.numel() for p in backend.owned_parameters())
    out["owned_tensors"] = len(backend.owned_parameters())
    for p in backend.owned_parameters():
        p.grad = None

    # 2. the anchor circuit (signed_ema K=1/C=2), M through the replicated dense pass
    start = [p.detach().clone() for p in backend.owned_parameters()]

    def g_comp() -> None:
        fn = MicrobatchLoss(old_logp=None, advantages=ADVANTAGES, mask=batch.completion_mask,
                            logp_sampler=batch.logp_sampler, ref_logp=None, settings=LOSS, norm_length=4)
        backend.forward_backward(batch, fn)
        backend.engine.reduce_tied_gradients()

    out["anchor"] = anchor_ticks(backend.owned_parameters(), names, g_comp,
                                 lambda job: anchor_gradient(backend, job, settings=LOSS, norm_length=4))
    with torch.no_grad():
        for p, w in zip(backend.owned_parameters(), start):
            p.copy_(w)

    # 3. the update loop, then a NaN step (every rank of every replica skips)
    out["update"] = run_update(backend, model, ADVANTAGES, 2)
    for p, w in zip(backend.owned_parameters(), start):
        with torch.no_grad():
            p.copy_(w)
    out["update4"] = run_update(backend, model, ADVANTAGES, 4)
    out["poisoned"] = run_update(backend, model, torch.full((6,), float("nan")), 2)
    out["gathered"] = backend.gather_per_rank({"rank": rank}, "gathering a test state")
    return out


def update_reference(minibatches: int) -> dict[str, Any]:
    from tclightning.pipeline.backends import LocalBackend

    model = tiny_llama()
    with CutSet(model, config_for(ANCHOR_CASE)) as cuts:
        backend = LocalBackend(backend_request(model), cuts)
        return run_update(backend, model, ADVANTAGES, minibatches)


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    outcomes = run_ranks(worker, REPLICAS * STAGES, timeout_s=60, join_timeout_s=240)
    for outcome in outcomes:
        assert outcome.error is None, outcome.trace
    return [outcome.value for outcome in outcomes]


def test_mesh_places_a_stages_replicas_on_consecutive_ranks(ranks: list[dict[str, Any]]) -> None:
    from tclightning.pipeline.mesh import MeshShape, replica_rows

    assert [r["coords"] for r in ranks] == [(0, 0), (1, 0), (0, 1), (1, 1)]  # (replica, stage)
    assert MeshShape(2, 2).grid().tolist() == [[0, 2], [1, 3]]
    assert replica_rows(3, 2, 0).tolist() == [0, 1] and replica_rows(3, 2, 1).tolist() == [2]
    assert replica_rows(1, 2, 1).tolist() == []
    with pytest.raises(TclightningError, match="pipeline.stages x pipeline.replicas"):
        MeshShape.for_world(6, 4)


def test_two_replicas_of_two_stages_match_one_process(ranks: list[dict[str, Any]]) -> None:
    """Loss, log-probs and every gradient of one forward/backward equal one process's; both
    replicas hold the same gradients; wire bytes are those of the whole batch."""
    from tests.test_distributed import reference

    ref = reference(ANCHOR_CASE)
    by = {r["coords"]: r for r in ranks}
    for replica in range(REPLICAS):
        last, first = by[(replica, 1)], by[(replica, 0)]
        assert last["loss"] == pytest.approx(ref["loss"], rel=1e-6, abs=1e-7)
        torch.testing.assert_close(last["logp"], ref["logp"], rtol=1e-5, atol=1e-6)
        got = {**first["grads"], **last["grads"]}
        assert set(got) == set(ref["grads"])
        for name, grad in ref["grads"].items():
            torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6, msg=f"replica {replica} {name}")
    for stage in range(STAGES):  # replicas are bitwise equal after the dp sum
        a, b = by[(0, stage)]["grads"], by[(1, stage)]["grads"]
        assert all(torch.equal(a[name], b[name]) for name in a)
    for rank in ranks:
        wire = rank["wire"]
        for key, value in ref["wire"].items():
            assert wire[key] == value, key
        # dp: one flat gradient message per rank (its stage + one presence flag per tensor, float32)
        # and the last stage's assembly (loss statistics, float64; log-probs, float32)
        grad_bytes = sum((r["owned_numel"] + r["owned_tensors"]) * 4 for r in ranks)
        assert wire["dp/grad_bytes"] == grad_bytes
        assert wire["dp/anchor_bytes"] == 0
        assert wire["dp/bytes"] == grad_bytes + REPLICAS * (5 * 8 + 6 * 4 * 4)
        assert wire["dp/replicas"] == REPLICAS


def test_the_anchor_merges_after_the_dp_sum_as_one_process(ranks: list[dict[str, Any]]) -> None:
    from tests.test_distributed import anchor_reference

    ref = anchor_reference()
    by = {r["coords"]: r["anchor"] for r in ranks}
    for replica in range(REPLICAS):
        first, last = by[(replica, 0)], by[(replica, 1)]
        assert first["delivered"] == last["delivered"] == ref["delivered"] == 2
        for tick, expected in enumerate(ref["merged"]):
            got = {**first["merged"][tick], **last["merged"][tick]}
            for name, grad in expected.items():
                torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6, msg=f"tick {tick} {name}")
        assert first["changed"] == last["changed"] == ref["changed"]
        # the anchor's dense bytes, summed over the replicas: the one-process count
        assert first["bytes"] == last["bytes"] == ref["bytes"]


@pytest.mark.parametrize("minibatches", [2, 4])
def test_the_update_loop_on_a_mesh_matches_one_process(ranks: list[dict[str, Any]], minibatches: int) -> None:
    """``grpo_update`` through the replicated backend: the metrics (shared from replica 0's last
    stage) and the weights after equal one process's; with 4 minibatches two ticks have one row,
    so replica 1's share is empty there."""
    key = "update" if minibatches == 2 else "update4"
    ref = update_reference(minibatches)
    for rank in ranks:
        got = rank[key]["metrics"]
        assert set(got) == set(ref["metrics"])
        for name, value in ref["metrics"].items():
            assert got[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
        assert rank[key]["skipped"] == 0
    by = {r["coords"]: r[key]["weights"] for r in ranks}
    for replica in range(REPLICAS):
        weights = {**by[(replica, 0)], **by[(replica, 1)]}
        for name, weight in ref["weights"].items():
            torch.testing.assert_close(weights[name], weight, rtol=1e-4, atol=1e-6, msg=name)


def test_a_nan_on_one_replica_skips_every_rank_and_checkpoints_keep_one_copy(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        assert rank["poisoned"]["skipped"] == 2
        for name, weight in rank["poisoned"]["weights"].items():
            assert torch.equal(weight, rank["update4"]["weights"][name]), name
    # the anchor/state gather: replica 0's stages, indexed by global rank (rank g -> stage g // 2)
    assert ranks[0]["gathered"] == {"per_rank": [{"rank": 0}, {"rank": 0}, {"rank": 2}, {"rank": 2}]}
    assert all(r["gathered"] is None for r in ranks[1:])


def test_replicas_refuse_stateful_codecs_and_wrong_process_counts(run_root: Any) -> None:
    from tclightning.run import run

    with pytest.raises(TclightningError, match="pipeline.replicas=2 needs stateless codecs.*codec 'lowrank'"):
        PipelineConfig(layout="all", codec="lowrank", replicas=2).validate()
    PipelineConfig(layout="dense", codec="lowrank", replicas=2).validate()  # dense cuts hold no state
    with pytest.raises(TclightningError, match="replicas=2 x pipeline.stages=2 needs .* = 4 processes .got 2"):
        run("all-compressed", ["trainer.devices=2", "pipeline.stages=2", "pipeline.replicas=2"], quiet=True)
    assert not run_root.exists()


def test_all_compressed_trains_on_two_replicas_of_two_stages(tmp_path: Path) -> None:
    """The acceptance command: 4 processes Lightning starts itself, 3 steps, ``dp/*`` beside
    ``wire/*`` in the run's metrics."""
    from tclightning.grpo.summary import read_metrics
    from tests.conftest import FAST

    args = [sys.executable, "-m", "tclightning", "run", "--recipe", "all-compressed", "--quiet",
            "trainer.devices=4", "pipeline.stages=2", "pipeline.replicas=2", "trainer.steps=3",
            *FAST, "trainer.val_every=0", "trainer.accelerator=cpu"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(args, check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs" / "all-compressed").iterdir()
    rows = read_metrics(run_dir / "metrics.csv")
    assert sorted(rows) == [0, 1, 2]
    for values in rows.values():
        assert values["wire/bytes_fwd"] > 0 and values["wire/cut0/ratio"] > 1
        assert values["dp/grad_bytes"] > 0 and values["dp/replicas"] == 2
        assert values["dp/bytes"] >= values["dp/grad_bytes"]
