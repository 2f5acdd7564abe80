"""The health detector on the library of real runs (benchmarks/health_library/): every fall is
caught in time, healthy runs stay quiet. The runs are this project's recipes' own metrics.csv."""

from __future__ import annotations

import pytest

from benchmarks.health_library import LIBRARY, RUNS, fall_step, read_rows, replay_run


@pytest.mark.parametrize("run", RUNS, ids=[r.name for r in RUNS])
def test_library_run(run):
    if not (LIBRARY / f"{run.file}.csv").is_file():
        pytest.fail(f"{run.file}.csv is missing from {LIBRARY}: regenerate with benchmarks/health_library.py --generate")
    result = replay_run(run)
    fall, warn, collapse = result["fall_step"], result["first_warning_step"], result["first_collapse_step"]
    if fall is not None:
        assert warn is not None and warn <= fall + 1, result
        assert collapse is not None and collapse <= fall + 3, result
    elif run.kind == "healthy":
        assert warn is None and collapse is None and result["standing_gap_warning_step"] is None, result
    else:
        assert collapse is None, result


def test_the_library_holds_real_collapses_and_healthy_runs():
    results = [replay_run(r) for r in RUNS]
    falls = [r for r in results if r["fall_step"] is not None]
    quiet = [r for r in results if r["fall_step"] is None and r["kind"] == "healthy"]
    assert len(falls) >= 10 and len(quiet) >= 8
    assert {r["recipe"] for r in falls} >= {"shallow-compressed", "all-compressed", "anchor-20-20", "la-warmup-v2", "tiny"}


def test_fall_step_definition():
    def rows(values):
        return [(step, {"reward/mean": v}) for step, v in enumerate(values)]

    # start = mean of the first 5 (0.4); the 3-step mean ending at step 7 is 0.2333 < 0.25
    assert fall_step(rows([0.4] * 5 + [0.3, 0.2, 0.2, 0.2])) == 7
    assert fall_step(rows([0.4] * 5 + [0.3, 0.3, 0.3, 0.3])) is None
    # a run that breaks at step 1 is judged against step 0: the window 1-3 is all zero
    assert fall_step(rows([0.34, 0.0, 0.0, 0.0, 0.0])) == 3


def test_a_dip_the_run_comes_back_from_is_quiet():
    """`fast-only-lowrank-half` seed 1 dips from 0.93 to 0.68 for 30 steps (held-out accuracy 1.0
    -> 0.805, later 0.88 and 0.875) and comes back: far above its start (0.48), no collapse is
    near, so no warning."""
    (run,) = [r for r in RUNS if r.name == "fast-only-lowrank-half-s1-1000"]
    rows = {s: m["reward/mean"] for s, m in read_rows(LIBRARY / f"{run.file}.csv") if "reward/mean" in m}
    assert max(rows[s] for s in range(697, 728)) < 0.95 and sum(rows[s] for s in range(697, 728)) / 31 < 0.72
    result = replay_run(run)
    assert result["fall_step"] is None and result["first_warning_step"] is None and result["first_collapse_step"] is None
