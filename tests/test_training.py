"""End to end: Trainer.fit on a tiny model, logging, checkpoints, and resume after a crash."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from tclightning.grpo.summary import read_metrics
from tclightning.run import run
from tests.conftest import FAST, CrashAt

CANONICAL_DENSE_TAGS = {
    "reward/mean", "reward/std", "reward/sem", "reward/count", "response/length_mean", "response/length_max", "response/truncated_frac",
    "policy/entropy", "policy/clip_frac", "policy/grad_norm", "loss/policy", "loss/kl",
    "gap/abs_mean", "gap/k3", "gap/max", "gap/outside_5x_frac", "gap/logp_corr", "gap/prob_abs_mean",
    "time/sample_s", "time/train_s", "throughput/tokens_per_s", "val/accuracy", "val/count",
}


def _run_dir(summary: dict) -> Path:
    return Path(summary["run_dir"])


def test_fit_logs_canonical_tags_to_csv_and_tensorboard(run_root: Path) -> None:
    summary = run("tiny", [*FAST, "trainer.steps=4", "trainer.val_every=2", "grpo.kl_coef=0.1"], quiet=True)
    run_dir = _run_dir(summary)
    rows = read_metrics(run_dir / "metrics.csv")
    assert sorted(rows) == [0, 1, 2, 3]
    logged = set().union(*rows.values())
    assert CANONICAL_DENSE_TAGS <= logged, CANONICAL_DENSE_TAGS - logged
    assert rows[3]["gap/abs_mean"] < 1e-4  # dense: trainer and sampler agree
    assert rows[1]["loss/kl"] >= 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tb")).Reload()
    assert CANONICAL_DENSE_TAGS <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("reward/mean")] == [0, 1, 2, 3]
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    assert summary["steps"] == 4 and "reward_gain" in summary


def _ckpt_state(path: Path) -> tuple[dict, dict]:
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    return ckpt["state_dict"], ckpt["optimizer_states"][0]


def test_crash_then_resume_matches_uninterrupted_run(run_root: Path) -> None:
    settings = [*FAST, "trainer.steps=6", "trainer.checkpoint_every=2", "grpo.epochs=2", "grpo.minibatches=2",
                "grpo.warmup_steps=3"]
    reference = _run_dir(run("tiny", [*settings, "logging.name=reference"], quiet=True))

    with pytest.raises(RuntimeError, match="simulated crash"):
        run("tiny", [*settings, "logging.name=crashed"], quiet=True, extra_callbacks=[CrashAt(5)])
    crashed_dir = next((run_root / "crashed").iterdir())
    assert sorted(read_metrics(crashed_dir / "metrics.csv")) == [0, 1, 2, 3, 4]  # step 4 logged after ckpt 4
    resumed = _run_dir(run("tiny", [*settings, "logging.name=crashed"], resume="last", quiet=True))
    assert resumed == crashed_dir

    # same step numbering, no duplicated or lost rows
    with (resumed / "metrics.csv").open() as handle:
        steps = [int(row["step"]) for row in csv.DictReader(handle) if row["reward/mean"]]
    assert steps == [0, 1, 2, 3, 4, 5]

    # step for step the same metrics as the run that never crashed
    expected, got = read_metrics(reference / "metrics.csv"), read_metrics(resumed / "metrics.csv")
    for step in range(6):
        for key in ("reward/mean", "loss/policy", "policy/grad_norm", "response/length_mean", "policy/lr"):
            assert got[step][key] == pytest.approx(expected[step][key], rel=1e-5, abs=1e-7), (step, key)

    # weights and optimizer state equal at the end
    ref_weights, ref_opt = _ckpt_state(reference / "checkpoints" / "last.ckpt")
    got_weights, got_opt = _ckpt_state(resumed / "checkpoints" / "last.ckpt")
    for name, tensor in ref_weights.items():
        assert torch.allclose(tensor, got_weights[name], atol=1e-6), name
    for idx, state in ref_opt["state"].items():
        assert state["step"] == got_opt["state"][idx]["step"]
        assert torch.allclose(state["exp_avg_sq"], got_opt["state"][idx]["exp_avg_sq"], rtol=1e-4, atol=1e-10)
    # 6 steps x 2 epochs x 2 minibatches optimizer ticks
    assert int(ref_opt["state"][0]["step"]) == 24


def test_dr_grpo_and_drop_zero_variance_run(run_root: Path) -> None:
    summary = run(
        "tiny",
        [*FAST, "trainer.steps=2", "grpo.scale_rewards=none", "grpo.drop_zero_variance_groups=true",
         "grpo.loss_aggregation=seq-mean-token-sum-norm", "grpo.overlong=mask"],
        quiet=True,
    )
    rows = read_metrics(_run_dir(summary) / "metrics.csv")
    assert all(0.0 <= r["policy/kept_frac"] <= 1.0 for r in rows.values())


def test_a_bf16_true_run_trains_validates_and_resumes(run_root: Path) -> None:
    """Lightning's ``bf16-true`` makes bfloat16 the default dtype: the step's own float32 sums
    (truncation, lengths) must not take it (a traceback in the first step)."""
    settings = [*FAST, "trainer.precision=bf16-true", "trainer.val_every=1", "trainer.checkpoint_every=1"]
    summary = run("tiny", [*settings, "trainer.steps=2"], quiet=True)
    run_dir = _run_dir(summary)
    resumed = run("tiny", [*settings, "trainer.steps=3"], resume=str(run_dir), quiet=True)
    rows = read_metrics(run_dir / "metrics.csv")
    assert resumed["steps"] == 3 and sorted(rows) == [0, 1, 2]
    assert all("val/accuracy" in row for row in rows.values())
    assert torch.isfinite(torch.tensor([row["loss/policy"] + row["policy/grad_norm"] for row in rows.values()])).all()
