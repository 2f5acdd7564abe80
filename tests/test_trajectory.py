"""Rank-1 trajectory analysis: the sketch, the recorder callback, the metrics and `analyze trajectory`."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from tclightning.callbacks.trajectory import (
    TrajectoryRecorder,
    sketch,
    trajectory_point,
)
from tclightning.cli.main import main
from tclightning.probes.trajectory import analyze_points, analyze_run, load_trajectory


def _write(folder: Path, x: Tensor) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i, point in enumerate(x):
        torch.save({"step": i, "unit": "step", "point": point.float(), "method": "exact", "dim": point.numel(),
                    "seed": 0, "num_params": point.numel()}, folder / f"point-{i:08d}.pt")


def test_straight_line_is_rank1_and_projectable() -> None:
    torch.manual_seed(0)
    # float64 points: in float32 the rounding of each point alone gives op_ratio ~6e-7 (its value
    # varies with the CPU's normal sampler), too close to the bounds below; float64 leaves ~1e-15
    start, direction = torch.randn(64, dtype=torch.float64), torch.randn(64, dtype=torch.float64)
    x = torch.stack([start + 0.3 * k * direction for k in range(12)])
    r = analyze_points(x)
    assert r["evr1"] == pytest.approx(1.0, abs=1e-9)
    assert r["off_line_share"] == pytest.approx(0.0, abs=1e-9)
    assert r["off_line_share_path"] == pytest.approx(0.0, abs=1e-9)
    assert r["early_late_cos"] == pytest.approx(1.0, abs=1e-9)
    assert r["step_alignment"] == pytest.approx(1.0, abs=1e-9)
    assert r["op_ratio"] == pytest.approx(0.0, abs=1e-6)
    assert r["op_ratio_damped"] == pytest.approx(0.0, abs=1e-6) and r["gamma"] == pytest.approx(1.0)


def test_random_walk_is_neither_aligned_nor_projectable() -> None:
    torch.manual_seed(0)
    x = torch.cumsum(torch.randn(40, 512), dim=0)
    r = analyze_points(x)
    assert r["evr1"] < 0.8  # Brownian motion: ~0.61 in expectation
    assert r["step_alignment"] < 0.4
    assert r["off_line_share_path"] > 0.8
    assert r["op_ratio"] == pytest.approx(math.sqrt(2), rel=0.1)  # |d_t - d_{t-1}| / |d_t|
    assert r["op_ratio_damped"] == pytest.approx(1.0, abs=0.1) and r["gamma"] < 0.2  # do-nothing is best


def test_a_turn_rotates_the_direction() -> None:
    e0, e1 = torch.eye(8)[0], torch.eye(8)[1]
    x = torch.stack([k * e0 for k in range(6)] + [5 * e0 + k * e1 for k in range(1, 6)])
    r = analyze_points(x)
    assert r["early_late_cos"] < 0.3  # first half moves along e0, second along e1
    # by symmetry u is the diagonal: the net move (5, 5) lies on it, each unit step has half its energy off it
    assert r["off_line_share"] == pytest.approx(0.0, abs=1e-9)
    assert r["off_line_share_path"] == pytest.approx(0.5, abs=1e-9)
    assert r["step_alignment"] == pytest.approx(math.sqrt(0.5), abs=1e-9)
    few = analyze_points(x[:2])
    assert few["evr1"] == pytest.approx(1.0) and few["op_ratio"] is None and few["early_late_cos"] is None


def test_sketch_is_seeded_linear_and_preserves_geometry() -> None:
    torch.manual_seed(0)
    a, b = torch.randn(50_000), torch.randn(50_000)
    sa = sketch([a[:20_000], a[20_000:]], dim=4096, seed=3)
    assert torch.allclose(sa, sketch([a], dim=4096, seed=3), atol=1e-4)  # chunking/splitting does not matter
    assert torch.allclose(sketch([a + 2 * b], 4096, 3), sa + 2 * sketch([b], 4096, 3), atol=1e-3)  # linear
    assert not torch.allclose(sa, sketch([a], 4096, seed=4))
    assert float(sa.norm() / a.norm()) == pytest.approx(1.0, abs=0.05)
    point, method, num = trajectory_point([torch.ones(3, 2)], dim=16)
    assert method == "exact" and num == 6 and torch.equal(point, torch.ones(6))


class Regress(pl.LightningModule):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(width, 1)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _fit(root: Path, recorder: TrajectoryRecorder, steps: int = 9, width: int = 4) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, width, generator=g)
    y = x.sum(dim=1, keepdim=True)
    trainer = pl.Trainer(
        default_root_dir=root, max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[recorder],
    )
    trainer.fit(Regress(width), DataLoader(TensorDataset(x, y), batch_size=8))


def test_recorder_writes_points_every_n_steps(tmp_path: Path) -> None:
    _fit(tmp_path, TrajectoryRecorder(every=3))
    steps, x, meta = load_trajectory(tmp_path)
    assert steps == [0, 3, 6, 9] and x.shape == (4, 5) and meta["method"] == "exact"
    _fit(tmp_path / "ticks", TrajectoryRecorder(every=2, unit="tick", dim=3, dirpath=tmp_path / "ticks" / "pts"))
    steps, x, meta = load_trajectory(tmp_path / "ticks" / "pts")
    assert steps == [0, 2, 4, 6, 8] and x.shape == (5, 3) and meta["method"] == "count_sketch"
    with pytest.raises(ValueError, match="unit: expected one of step, tick"):
        TrajectoryRecorder(unit="epoch")


def test_cli_writes_json_markdown_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fit(tmp_path / "run", TrajectoryRecorder(every=1), steps=8)
    assert main(["analyze", "trajectory", str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert "EVR₁" in printed and "op ratio" in printed
    report = json.loads((tmp_path / "out" / "trajectory.json").read_text())
    assert report["points"] == 9 and 0.0 <= report["evr1"] <= 1.0
    assert (tmp_path / "out" / "trajectory.md").read_text().startswith("# Trajectory analysis")
    assert (tmp_path / "out" / "trajectory.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["analyze", "trajectory", str(tmp_path / "run"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["points"] == 9
    assert (tmp_path / "run" / "analysis" / "trajectory.png").exists()
    assert analyze_run(tmp_path / "run")["steps"] == list(range(9))
    # a line-shaped synthetic run through the CLI
    _write(tmp_path / "line" / "trajectory", torch.stack([k * torch.ones(5) for k in range(6)]))
    assert main(["analyze", "trajectory", str(tmp_path / "line"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["evr1"] == pytest.approx(1.0)


@pytest.mark.parametrize("field, other", [("seed", 1), ("unit", "tick"), ("num_params", 999), ("method", "sketch")])
def test_points_of_different_sketches_are_refused(field: str, other: object, tmp_path: Path) -> None:
    """Points of another seed lie in another random projection (another model's, in another space):
    they were analysed as one trajectory, with the first point's settings reported."""
    from tclightning.errors import TclightningError

    _write(tmp_path / "mixed", torch.stack([k * torch.ones(5) for k in range(4)]))
    point = torch.load(tmp_path / "mixed" / "point-00000002.pt")
    torch.save({**point, field: other}, tmp_path / "mixed" / "point-00000002.pt")
    with pytest.raises(TclightningError, match=f"points of different sketches \\(step 0 has {field} .*, step 2 has "
                                               f"{field} {other!r}\\)"):
        analyze_run(tmp_path / "mixed")


def test_cli_errors_and_health_still_registered(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["analyze", "trajectory", str(tmp_path)]) == 2  # no points: a user error
    assert "TrajectoryRecorder" in capsys.readouterr().err
    assert main(["analyze", "health", str(tmp_path / "nope")]) == 2


def test_a_link_put_at_the_run_s_trajectory_folder_before_its_first_point_is_never_written_through(
        tmp_path: Path) -> None:
    """The recorder took whatever was at ``trajectory/`` when it first looked: a link to another
    run's points there had them written over."""
    from tclightning.errors import TclightningError

    other = tmp_path / "other-run-points"
    other.mkdir()
    (other / "point-00000000.pt").write_text("theirs")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "trajectory").symlink_to(other)
    with pytest.raises(TclightningError, match="trajectory is a link, a file or no longer a folder; no point was written"):
        _fit(tmp_path / "run", TrajectoryRecorder(every=3))
    assert [(p.name, p.read_text()) for p in other.iterdir()] == [("point-00000000.pt", "theirs")]


def test_a_folder_put_at_the_run_s_trajectory_before_its_first_point_is_never_written_into(tmp_path: Path) -> None:
    """A new run makes its trajectory/: another run's points moved (or mounted) there before the
    first point were written over."""
    from tclightning.errors import TclightningError

    (tmp_path / "run" / "trajectory").mkdir(parents=True)
    (tmp_path / "run" / "trajectory" / "point-00000000.pt").write_text("theirs")
    with pytest.raises(TclightningError, match="holds files a new run did not write"):
        _fit(tmp_path / "run", TrajectoryRecorder(every=3))
    assert [(p.name, p.read_text()) for p in (tmp_path / "run" / "trajectory").iterdir()] == [
        ("point-00000000.pt", "theirs")]


def test_the_points_go_into_the_folder_held_whatever_its_name_leads_to(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Each point was written by name after the folder's check: a link swapped in while the point
    was serialised had another run's point written over (or the rename failed: a traceback)."""
    import tclightning.callbacks.trajectory as trajectory_module
    from tclightning.errors import TclightningError

    other = tmp_path / "other-run-points"
    other.mkdir()
    (other / "point-00000003.pt").write_text("theirs")
    run = tmp_path / "run"
    save = trajectory_module.save_tensors

    def swapped_while_written(record: Any, path: Path) -> None:
        if record["step"] == 3:  # after the check, as the point is written
            (run / "trajectory").rename(tmp_path / "moved-away")
            (run / "trajectory").symlink_to(other)
        save(record, path)

    monkeypatch.setattr(trajectory_module, "save_tensors", swapped_while_written)
    with pytest.raises(TclightningError, match="trajectory was replaced during the run"):
        _fit(run, TrajectoryRecorder(every=3))
    assert [(p.name, p.read_text()) for p in other.iterdir()] == [("point-00000003.pt", "theirs")]
    assert sorted(p.name for p in (tmp_path / "moved-away").iterdir())[-1] == "point-00000003.pt"


class PointMovedIn(pl.Callback):
    """Another run's point ``name``, moved into the run's trajectory/ once its run folder is made."""

    def __init__(self, name: str) -> None:
        self.name = name

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        folder = Path(trainer.default_root_dir) / "trajectory"
        folder.mkdir()
        (folder / self.name).write_text("theirs")


def test_another_run_s_points_moved_into_a_new_run_s_trajectory_are_kept_when_it_stops(tmp_path: Path) -> None:
    """The recorder refuses a new run's trajectory/ holding another run's points; the run, stopping
    before it logged anything, then removed its folder as its own, and those points with it."""
    from tclightning.errors import TclightningError
    from tclightning.run import run
    from tests.conftest import FAST

    with pytest.raises(TclightningError, match="holds files a new run did not write"):
        run("tiny", [*FAST, "trainer.steps=2", "trainer.val_every=0", f"logging.root={tmp_path}"], quiet=True,
            extra_callbacks=[PointMovedIn("point-00000000.pt"), TrajectoryRecorder()])
    (points,) = tmp_path.glob("tiny/*/trajectory/point-00000000.pt")
    assert points.read_text() == "theirs"


def test_a_resume_into_a_new_run_folder_refuses_points_moved_into_its_trajectory(tmp_path: Path) -> None:
    """A resume from a checkpoint copied out of its run starts a new run folder at a later step:
    only the first step's point made the recorder check that its trajectory/ was its own, so
    another run's points moved in there were taken, written beside and over."""
    import shutil

    from tclightning.errors import TclightningError
    from tclightning.run import run
    from tests.conftest import FAST

    settings = [*FAST, "trainer.val_every=0", "trainer.checkpoint_every=1"]
    first = run("tiny", [*settings, "trainer.steps=1", f"logging.root={tmp_path / 'first'}"], quiet=True)
    copied = tmp_path / "copied.ckpt"
    shutil.copyfile(Path(first["run_dir"]) / "checkpoints" / "last.ckpt", copied)

    with pytest.raises(TclightningError, match="holds files a new run did not write"):
        run("tiny", [*settings, "trainer.steps=3", f"logging.root={tmp_path / 'second'}"], resume=str(copied),
            quiet=True, extra_callbacks=[PointMovedIn("point-00000002.pt"), TrajectoryRecorder()])
    (points,) = tmp_path.glob("second/tiny/*/trajectory/point-00000002.pt")
    assert points.read_text() == "theirs"


def test_a_new_fit_never_writes_over_the_points_in_a_folder_you_named(tmp_path: Path) -> None:
    """``TrajectoryRecorder(dirpath=X)``: a second fit from step 0 wrote its points over the first
    fit's in X without a word."""
    from tclightning.errors import TclightningError

    points = tmp_path / "points"
    _fit(tmp_path / "first", TrajectoryRecorder(every=3, dirpath=points))
    before = {p.name: p.read_bytes() for p in points.iterdir()}
    with pytest.raises(TclightningError, match="holds files a new run did not write"):
        _fit(tmp_path / "second", TrajectoryRecorder(every=3, dirpath=points))
    assert {p.name: p.read_bytes() for p in points.iterdir()} == before


def test_a_resume_in_place_in_the_process_that_made_the_run_keeps_its_trajectory(tmp_path: Path) -> None:
    """A program that trains a run and then resumes it in place: the resume was taken for the new
    run folder the process had made, whose trajectory/ must be empty, and refused."""
    from tclightning.run import run
    from tests.conftest import FAST

    settings = [*FAST, "callback_presets=[trajectory]", "trainer.val_every=0", "trainer.checkpoint_every=1",
                f"logging.root={tmp_path}"]
    first = run("tiny", [*settings, "trainer.steps=2"], quiet=True)
    resumed = run("tiny", [*settings, "trainer.steps=5"], resume=str(first["run_dir"]), quiet=True)
    assert resumed["run_dir"] == first["run_dir"]
    steps, _, _ = load_trajectory(Path(first["run_dir"]) / "trajectory")
    assert steps == [0, 5]


def test_a_resume_from_an_earlier_step_keeps_one_history_of_points(tmp_path: Path) -> None:
    """Resumed from step 3 of a 7-step run: the first history's points 5 and 7 stayed in
    ``trajectory/`` beside the new ones, and the analysis read both histories as one run's."""
    from tclightning.run import run
    from tests.conftest import FAST

    settings = [*FAST, "trainer.val_every=0", "trainer.checkpoint_every=1", "trainer.keep_checkpoints=10",
                f"logging.root={tmp_path}"]
    recorder = TrajectoryRecorder(every=1)
    first = run("tiny", [*settings, "trainer.steps=7"], quiet=True, extra_callbacks=[recorder])
    points = Path(first["run_dir"]) / "trajectory"
    first_history = {p.name: p.read_bytes() for p in points.glob("point-*.pt")}
    assert len(first_history) == 8
    resume = Path(first["run_dir"]) / "checkpoints" / "step-000003.ckpt"
    (points / "point-7.pt").write_text("yours")  # no name the recorder writes: never moved

    class StopsAtOnce(pl.Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            raise RuntimeError("stopped before the first new step")

    with pytest.raises(Exception, match="stopped before"):  # the run as it was: nothing moved yet
        run("tiny", [*settings, "trainer.steps=5"], resume=str(resume), quiet=True,
            extra_callbacks=[TrajectoryRecorder(every=1), StopsAtOnce()])
    assert {p.name: p.read_bytes() for p in points.glob("point-*.pt")} == {**first_history, "point-7.pt": b"yours"}
    run("tiny", [*settings, "trainer.steps=5"], resume=str(resume), quiet=True,
        extra_callbacks=[TrajectoryRecorder(every=1)])
    (points / "point-7.pt").unlink()
    steps, _, _ = load_trajectory(points)
    assert steps == [0, 1, 2, 3, 4, 5]
    aside = points / "replaced-after-00000003"  # kept, out of the analysis' way
    assert {p.name: p.read_bytes() for p in aside.iterdir()} == {
        name: data for name, data in first_history.items() if int(name[6:14]) > 3}


def test_parameters_given_as_a_text_is_refused() -> None:
    """``parameters="layer"`` was read as the prefixes l, a, y, e, r: every parameter starting with
    one of those letters was recorded."""
    with pytest.raises(ValueError, match="TrajectoryRecorder: parameters: expected a list, got str 'layer'"):
        TrajectoryRecorder(parameters="layer")  # type: ignore[arg-type]
    assert TrajectoryRecorder(parameters=["layers.0"]).parameters == ["layers.0"]
    assert TrajectoryRecorder(parameters=(p for p in ["layers.0"])).parameters == ["layers.0"]  # checked, not used up


def test_two_fits_that_find_a_folder_empty_together_never_both_write_into_it(tmp_path: Path) -> None:
    """Two new fits of a sweep with one ``dirpath``, at their first point together: both found it
    empty, and each point file was whichever run wrote last."""
    from tclightning.errors import TclightningError

    points = tmp_path / "points"
    first, second = TrajectoryRecorder(dirpath=points), TrajectoryRecorder(dirpath=points)
    first._take(points, fresh=True)  # found empty, held: no point written yet
    with pytest.raises(TclightningError, match="another fit is writing its points into"):
        second._take(points, fresh=True)
    first.teardown()  # the first fit ended: the folder is free again (empty still, so a new fit may take it)
    second._take(points, fresh=True)
    second.teardown()


def test_a_failed_fit_lets_its_folder_go(tmp_path: Path) -> None:
    """Lightning calls no ``teardown`` on a failed fit: the folder stayed held (locked), and a resume
    in the same program was refused as "another fit is writing its points"."""
    points = tmp_path / "points"
    recorder = TrajectoryRecorder(dirpath=points)
    recorder._take(points, fresh=True)
    recorder.on_exception(None, None, RuntimeError("boom"))  # type: ignore[arg-type]
    TrajectoryRecorder(dirpath=points)._take(points, fresh=False)  # the resume takes it
