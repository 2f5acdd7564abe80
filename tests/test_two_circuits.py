"""The anchor circuit inside the GRPO module: paired replay, latency, cadence, memory, resume."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch

from tclightning.grpo.summary import read_metrics
from tclightning.run import run
from tests.conftest import FAST, CrashAt

TWO_CIRCUITS = [*FAST, "pipeline.stages=2", "anchor.latency=2", "anchor.cadence=3", "trainer.steps=10",
                "model.warmup.steps=60", "model.warmup.lr=3e-3", "grpo.lr=1e-3", "task.digits=1"]


class Instrument(L.Callback):
    """Records the weights and the sampled completions at each RL step's first tick, and every
    anchor job the module computes (when, from which snapshot, on which rollouts)."""

    def __init__(self) -> None:
        self.weights: dict[int, list[torch.Tensor]] = {}
        self.samples: dict[int, torch.Tensor] = {}
        self.jobs: list[dict] = []
        self.pending: list[int] = []

    def setup(self, trainer: L.Trainer, pl_module, stage: str) -> None:
        sample, anchor = pl_module.sample, pl_module.anchor
        tick = anchor.tick

        def recording_sample(examples, seed, **kwargs):
            rollouts = sample(examples, seed, **kwargs)
            if not kwargs.get("greedy"):
                self.samples[trainer.global_step] = rollouts.completion_ids.clone()
            return rollouts

        def recording_tick(now, *, gradient, **kwargs):
            def recording_gradient(job):
                self.jobs.append({"tick": job.tick, "delivered_at": trainer.global_step, "snapshot": job.snapshot,
                                  "completions": job.payload["rollouts"].completion_ids.clone()})
                return gradient(job)

            return tick(now, gradient=recording_gradient, **kwargs)

        pl_module.sample, anchor.tick = recording_sample, recording_tick

    def on_train_batch_start(self, trainer: L.Trainer, pl_module, batch, batch_idx: int) -> None:
        self.weights[trainer.global_step] = [p.detach().clone() for p in pl_module.backend.owned_parameters()]

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, *args) -> None:
        self.pending.append(len(pl_module.anchor.circuit.pending))


def test_anchor_gradient_is_paired_replay_k_ticks_late(run_root: Path) -> None:
    probe = Instrument()
    run("shallow-compressed", TWO_CIRCUITS, quiet=True, extra_callbacks=[probe])
    assert [job["tick"] for job in probe.jobs] == [0, 3, 6]  # cadence C = 3 (ticks 9's job is still pending)
    for job in probe.jobs:
        assert job["delivered_at"] - job["tick"] == 2  # latency K = 2
        # the snapshot is the weights at the job's tick, the rollouts are the ones those weights sampled
        for snap, weight in zip(job["snapshot"], probe.weights[job["tick"]], strict=True):
            assert torch.equal(snap, weight)
        assert torch.equal(job["completions"], probe.samples[job["tick"]])
    # weights moved between snapshots, so "stale" is real
    assert any(not torch.equal(a, b) for a, b in zip(probe.jobs[0]["snapshot"], probe.jobs[-1]["snapshot"]))
    assert max(probe.pending) <= 2 // 3 + 1  # memory bound: floor(K / C) + 1 pending jobs


def test_anchor_metrics_and_bytes(run_root: Path) -> None:
    summary = run("shallow-compressed", TWO_CIRCUITS, quiet=True)
    rows = read_metrics(Path(summary["run_dir"]) / "metrics.csv")
    delivered = [s for s, r in rows.items() if r.get("anchor/bytes", 0) > 0]
    assert delivered == [2, 5, 8]
    first = rows[2]
    # dense traffic of one forward + backward over the replayed rows: 2 x tokens x d x 4 B x cuts
    assert first["anchor/latency"] == 2 and first["anchor/cadence"] == 3
    assert 0.0 <= rows[9]["anchor/sign_agreement"] <= 1.0
    assert "anchor/sign_agreement" not in rows[1]  # nothing to agree with before the first M


def test_signed_ema_needs_the_pipeline_strategy(run_root: Path) -> None:
    from tclightning.errors import RecipeError

    with pytest.raises(RecipeError, match="anchor.merger"):
        run("tiny", [*FAST, "anchor.merger=signed_ema"], quiet=True)


def test_resume_with_pending_anchor_work_matches_uninterrupted(run_root: Path) -> None:
    settings = [*TWO_CIRCUITS, "trainer.checkpoint_every=4", "anchor.latency=3", "anchor.cadence=2"]
    reference = Path(run("shallow-compressed", [*settings, "logging.name=ref"], quiet=True)["run_dir"])
    with pytest.raises(RuntimeError):
        run("shallow-compressed", [*settings, "logging.name=crash"], quiet=True, extra_callbacks=[CrashAt(6)])
    resumed = Path(run("shallow-compressed", [*settings, "logging.name=crash"], resume="last", quiet=True)["run_dir"])
    expected, got = read_metrics(reference / "metrics.csv"), read_metrics(resumed / "metrics.csv")
    assert sorted(got) == sorted(expected) == list(range(10))
    for step in range(10):
        for key in ("reward/mean", "loss/policy", "policy/grad_norm", "gap/abs_mean", "anchor/bytes"):
            assert got[step].get(key) == pytest.approx(expected[step].get(key), rel=1e-5, abs=1e-7), (step, key)
        assert got[step].get("anchor/sign_agreement") == pytest.approx(expected[step].get("anchor/sign_agreement"))
