"""``tclightning bench step-link``: whole RL steps, one stage per node, over a tc-shaped switch.

The fast tests check the arguments each configuration runs with, the summary of a run's metrics
and the refusals; the slow one runs the tiny model over the namespaces (needs root, ``ip`` and
``tc``) and checks what its counters say, never its timings (they depend on the machine's load).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tclightning.bench.step_link import CONFIGS, check_options, config_args, format_table, summarise
from tclightning.errors import TclightningError
from tests.conftest import FAST

REPO = Path(__file__).resolve().parents[1]


def test_each_configuration_runs_its_recipe_with_what_it_adds() -> None:
    dense, compressed, sparse = (config_args(c, "D", "C", 4, 3, ["grpo.lr=1e-6"]) for c in CONFIGS)
    assert dense[:2] == ["--recipe", "D"] and compressed[:2] == sparse[:2] == ["--recipe", "C"]
    for args in (dense, compressed, sparse):
        assert {"trainer.strategy=pipeline", "pipeline.stages=4", "trainer.steps=3"} <= set(args)
        assert args[-1] == "grpo.lr=1e-6"  # the user's overrides come last: they win
    assert set(sparse) - set(compressed) == {"sampler.dtype=bfloat16", "pipeline.tied_rows=true"}
    assert "sampler.dtype=bfloat16" not in dense


def test_the_summary_skips_the_first_step_and_sums_each_class() -> None:
    step = {"time/sample_s": 1.0, "time/train_s": 2.0, "wire/bytes_fwd": 10.0, "wire/bytes_bwd": 5.0,
            "wire/sync_bytes": 100.0, "wire/tied_bytes": 7.0, "wire/rollout_bytes": 3.0, "wire/total_bytes": 125.0}
    metrics = {0: {**step, "time/train_s": 50.0, "wire/sync_bytes": 1e9},  # the first full sync: not timed
               1: step, 2: {**step, "time/train_s": 4.0}, 3: {**step, "time/train_s": 3.0}}
    got = summarise(metrics)
    assert got["timed_steps"] == 3 and got["step_s"] == 4.0  # median of 3, 5, 4
    assert (got["boundary_bytes"], got["weight_sync_bytes"], got["tied_embedding_bytes"]) == (15.0, 100.0, 7.0)
    assert (got["rollouts_bytes"], got["anchor_bytes"], got["total_bytes"]) == (3.0, 0.0, 125.0)
    with pytest.raises(RuntimeError, match="--steps"):
        summarise({0: step})


@pytest.mark.parametrize(("options", "key"), [
    ({"stages": [1]}, "--stages"), ({"bandwidths": [0.0]}, "--bandwidth"), ({"configs": ["lora"]}, "--configs"),
    ({"steps": 1}, "--steps"),
])
def test_options_it_cannot_measure_are_refused_in_one_line(options: dict, key: str) -> None:
    given = {"stages": [2], "bandwidths": [200.0], "configs": list(CONFIGS), "steps": 3, **options}
    with pytest.raises(TclightningError, match=f"bench step-link {key}"):
        check_options(**given)


@pytest.mark.slow
def test_whole_steps_over_a_shaped_switch_count_every_class(tmp_path: Path) -> None:
    """The tiny model, 2 stages, unshaped and at 100 Mbit/s: every run finishes, its rows hold the
    run's own counters, and the sparse sync with tied rows sends fewer sync and tied bytes than the
    dense configuration, while the compressed boundary sends fewer boundary bytes."""
    from tclightning.bench.link import netns_problem
    from tclightning.bench.step_link import run_step_link_bench

    problem = netns_problem()
    if problem is not None:
        pytest.skip(f"network namespaces unavailable: {problem}")
    result = run_step_link_bench(
        dense_recipe="tiny", compressed_recipe="fast-only-lowrank", stages=[2], bandwidths=[100.0], steps=3,
        overrides=FAST, workdir=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)}, echo=lambda line: None,
    )
    rows = {(r["config"], r["mbit"]): r for r in result["rows"]}
    assert set(rows) == {(c, m) for c in CONFIGS for m in (None, 100.0)}
    for (config, mbit), row in rows.items():
        assert row["timed_steps"] == 2 and row["step_s"] > 0 and row["unshaped_s"] == rows[(config, None)]["step_s"]
        parts = sum(row[f"{c}_bytes"] for c in ("boundary", "weight_sync", "tied_embedding", "rollouts", "anchor"))
        assert row["total_bytes"] == pytest.approx(parts) and row["link_tx_bytes"] >= row["total_bytes"]
    dense, compressed, sparse = (rows[(c, 100.0)] for c in CONFIGS)
    assert compressed["boundary_bytes"] < dense["boundary_bytes"]
    assert compressed["weight_sync_bytes"] == dense["weight_sync_bytes"]  # the same dense sync of the same stage
    assert sparse["weight_sync_bytes"] < compressed["weight_sync_bytes"]
    assert sparse["tied_embedding_bytes"] < compressed["tied_embedding_bytes"]
    assert "| 2 | compressed+sparse-sync | 100 |" in format_table(result)
