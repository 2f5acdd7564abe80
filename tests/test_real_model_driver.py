"""The SmolLM2 side-by-side driver (benchmarks/real_model.py): a run that was cut off continues
from its newest checkpoint with --resume, a finished one is left alone, and the report reads
what the runs logged."""

from __future__ import annotations

import csv
from pathlib import Path

from benchmarks.real_model import RUNS, SideBySideRun, command, latest_run_dir, steps_done, summarise

DENSE = SideBySideRun("smollm2-dense", "smollm2-dense")


def write_run(root: Path, label: str, stamp: str, steps: int, checkpoint: bool = True) -> Path:
    """A run directory as `tclightning run` leaves it: metrics.csv (train and val rows) and checkpoints."""
    run_dir = root / label / stamp
    (run_dir / "checkpoints").mkdir(parents=True)
    if checkpoint:
        (run_dir / "checkpoints" / "last.ckpt").write_bytes(b"")
    with (run_dir / "metrics.csv").open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["step", "reward/mean", "val/accuracy", "wire/bytes_fwd", "wire/bytes_bwd",
                         "wire/dense_bytes_fwd", "wire/dense_bytes_bwd", "time/sample_s", "time/train_s"])
        writer.writerow([0, "", 0.25, "", "", "", "", "", ""])
        for step in range(steps):
            writer.writerow([step, 0.1 * step, "", 10, 10, 200, 200, 1.0, 2.0])
        writer.writerow([steps - 1, "", 0.75, "", "", "", "", "", ""])
    return run_dir


def test_a_fresh_run_starts_and_an_interrupted_one_resumes_from_its_newest(tmp_path: Path) -> None:
    fresh = command(DENSE, tmp_path, steps=60, val_every=20)
    assert "--resume" not in fresh and "trainer.steps=60" in fresh and "logging.name=smollm2-dense" in fresh
    write_run(tmp_path, DENSE.label, "20261201-100000", steps=10)
    newest = write_run(tmp_path, DENSE.label, "20261201-120000", steps=25)
    resumed = command(DENSE, tmp_path, steps=60, val_every=20)
    assert resumed[resumed.index("--resume") + 1] == str(newest)
    assert latest_run_dir(tmp_path, DENSE.label) == newest and steps_done(newest) == 25


def test_a_run_without_a_checkpoint_starts_again(tmp_path: Path) -> None:
    write_run(tmp_path, DENSE.label, "20261201-100000", steps=3, checkpoint=False)
    assert "--resume" not in command(DENSE, tmp_path, steps=60, val_every=20)


def test_the_report_numbers_come_from_the_logged_rows(tmp_path: Path) -> None:
    stats = summarise(write_run(tmp_path, DENSE.label, "20261201-100000", steps=20))
    assert stats["steps"] == 20 and stats["acc_start"] == 0.25 and stats["acc_end"] == 0.75
    assert abs(stats["fast_share"] - 0.05) < 1e-12 and stats["train_minutes"] == 1.0
    assert abs(stats["reward_first"] - 0.05) < 1e-9 and abs(stats["reward_last"] - 1.85) < 1e-9


def test_every_side_by_side_run_names_a_recipe_that_exists() -> None:
    recipes = Path(__file__).resolve().parents[1] / "recipes"
    assert len({r.label for r in RUNS}) == len(RUNS)
    assert all((recipes / f"{r.recipe}.yaml").is_file() for r in RUNS)
