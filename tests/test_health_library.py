"""The health detector on the library of real runs (benchmarks/health_library/): every fall is
caught in time, healthy runs stay quiet. The runs are this project's recipes' own metrics.csv."""

from __future__ import annotations

import pytest

from benchmarks.health_library import LIBRARY, RUNS, fall_step, replay_run

#: The one healthy run that warns, and why: a 30-step dip at steps 690-720 (10-step reward mean
#: 0.94 -> 0.70, held-out accuracy 0.98 -> 0.805) that the run came back from on its own, and a
#: second at 800-810. No fall by the library's definition; the detector says warning, not collapsing.
KNOWN_WARNINGS = {"fast-only-lowrank-half-s1-1000": [704, 806, 849]}


@pytest.mark.parametrize("run", RUNS, ids=[r.name for r in RUNS])
def test_library_run(run):
    if not (LIBRARY / f"{run.file}.csv").is_file():
        pytest.fail(f"{run.file}.csv is missing from {LIBRARY}: regenerate with benchmarks/health_library.py --generate")
    result = replay_run(run)
    fall, warn, collapse = result["fall_step"], result["first_warning_step"], result["first_collapse_step"]
    if fall is not None:
        assert warn is not None and warn <= fall + 1, result
        assert collapse is not None and collapse <= fall + 3, result
    elif run.kind == "healthy" and run.name in KNOWN_WARNINGS:
        assert [w["step"] for w in result["other_warnings"]] == KNOWN_WARNINGS[run.name]
        assert collapse is None
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
