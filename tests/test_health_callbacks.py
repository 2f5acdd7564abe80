"""The health callbacks on a plain LightningModule (a Linear layer) that logs canonical names."""

from __future__ import annotations

import csv
import math
import warnings
from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch.utils.data import DataLoader, TensorDataset

from tclightning.callbacks.collapse import CollapseDetector
from tclightning.callbacks.gap_monitor import GapMonitor
from tclightning.callbacks.health_actions import HealthWarning, rl_step
from tclightning.callbacks.length_feedback import LengthFeedbackMonitor
from tclightning.health.rules import HealthState

Schedule = Callable[[int], dict[str, float]]


def healthy(step: int) -> dict[str, float]:
    return {
        "reward/mean": 0.5 + 0.03 * math.sin(step * 1.7),
        "response/length_mean": 300.0 * (1 + 0.02 * math.sin(step * 2.3)),
        "response/truncated_frac": 0.01,
        "policy/entropy": 0.6,
        "policy/grad_norm": 1.0 + 0.1 * math.cos(step),
        "gap/abs_mean": 0.01,
    }


class TinyModule(pl.LightningModule):
    """A Linear layer trained on random data; logs metrics from ``schedule(rl_step)`` via self.log.

    ``names`` renames canonical metrics (to test the name mapping); with ``manual=True`` each
    training step makes two optimizer steps (like the GRPO module)."""

    def __init__(self, schedule: Schedule, names: dict[str, str] | None = None, manual: bool = False) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.schedule = schedule
        self.names = names or {}
        self.automatic_optimization = not manual

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        if not self.automatic_optimization:
            opt = self.optimizers()
            for _ in range(2):
                opt.zero_grad()
                self.manual_backward(torch.nn.functional.mse_loss(self.layer(x), y))
                opt.step()
        for name, value in self.schedule(rl_step(self.trainer)).items():
            self.log(self.names.get(name, name), value, on_step=True, on_epoch=False, batch_size=1)
        return loss if self.automatic_optimization else None

    def validation_step(self, batch, batch_idx):
        self.log("val/accuracy", 0.5, batch_size=1)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def loader(n: int = 16) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)), batch_size=1)


def trainer(tmp_path: Path, callbacks: list, max_steps: int, **kwargs) -> pl.Trainer:
    kwargs.setdefault("logger", CSVLogger(tmp_path, name="run"))
    return pl.Trainer(
        max_steps=max_steps,
        callbacks=callbacks,
        default_root_dir=tmp_path,
        accelerator="cpu",
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        limit_val_batches=0,
        **kwargs,
    )


def logged(tmp_path: Path, name: str) -> dict[int, float]:
    """``{step: value}`` of one column of the CSVLogger's metrics.csv."""
    (path,) = tmp_path.rglob("metrics.csv")
    with path.open() as fh:
        return {int(r["step"]): float(r[name]) for r in csv.DictReader(fh) if r.get(name)}


def test_length_feedback_monitor_warns_from_logged_names(tmp_path):
    def schedule(step: int) -> dict[str, float]:
        metrics = healthy(step)
        if step >= 30:
            metrics["response/length_mean"] = 300.0 * 1.04 ** (step - 30)
        return metrics

    monitor = LengthFeedbackMonitor()
    with pytest.warns(HealthWarning, match="length.feedback"):
        trainer(tmp_path, [monitor], 60).fit(TinyModule(schedule), loader())
    assert monitor.state == HealthState.WARNING
    assert 30 < monitor.detector.first_warning_step < 45
    state = logged(tmp_path, "health/length")
    overall = logged(tmp_path, "health/state")
    assert state[20] == 0 and state[59] == 1 and overall[59] == 1


def test_gap_monitor_warns_at_step_zero_and_writes_tensorboard_text(tmp_path):
    def schedule(step: int) -> dict[str, float]:
        return {**healthy(step), "gap/abs_mean": 0.61}

    monitor = GapMonitor()
    logger = TensorBoardLogger(tmp_path, name="tb")
    with pytest.warns(HealthWarning, match="before any update"):
        trainer(tmp_path, [monitor], 5, logger=logger).fit(TinyModule(schedule), loader())
    assert monitor.detector.first_warning_step == 0
    from tensorboard.backend.event_processing import event_accumulator

    (event_file,) = Path(logger.log_dir).glob("events.out.tfevents.*")
    acc = event_accumulator.EventAccumulator(str(event_file))
    acc.Reload()
    assert "health/gap/events/text_summary" in acc.Tags()["tensors"]
    assert [e.step for e in acc.Scalars("health/state")][:1] == [0]


def test_a_rising_gap_is_information_in_the_timeline_not_a_console_warning(tmp_path):
    def schedule(step: int) -> dict[str, float]:
        return {**healthy(step), "gap/abs_mean": 0.16 if step < 10 else 0.30}

    monitor = GapMonitor(actions=["log", "warn"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", HealthWarning)  # any console warning fails the test
        trainer(tmp_path, [monitor], 30).fit(TinyModule(schedule), loader(32))
    assert [(e.rule, e.severity) for e in monitor.detector.events if e.kind == "fired"] == [("gap.trend", "info")]
    assert set(logged(tmp_path, "health/gap").values()) == {0.0}


def test_name_mapping_and_rl_steps_under_manual_optimisation(tmp_path):
    names = {"reward/mean": "train/reward"}
    monitor = CollapseDetector(metric_names=names)
    t = trainer(tmp_path, [monitor], 10)
    t.fit(TinyModule(healthy, names=names, manual=True), loader())
    # two optimizer steps per RL step: global_step runs ahead, the detector counts RL steps
    assert t.global_step == 10 and rl_step(t) == 5
    assert list(monitor.detector.history.steps("reward/mean")) == [0, 1, 2, 3, 4]
    assert not monitor.detector.history.has("train/reward")


def test_stop_ends_fit_cleanly_on_nan(tmp_path):
    def schedule(step: int) -> dict[str, float]:
        return {**healthy(step), "policy/grad_norm": float("nan") if step >= 7 else 1.0}

    monitor = CollapseDetector(actions=["log", "stop"])
    t = trainer(tmp_path, [monitor], 50)
    t.fit(TinyModule(schedule), loader())
    assert t.state.finished and t.should_stop
    assert monitor.stopped_at == 7 and rl_step(t) == 8
    assert monitor.detector.first_collapse_step == 7
    assert any(e.kind == "stopped" for e in monitor.detector.events)


class RollbackSpy(pl.Callback):
    """Runs after the detector: at each rollback, compares weights and optimizer state to the file."""

    def __init__(self, monitor: CollapseDetector) -> None:
        self.monitor = monitor
        self.checked = 0
        self.seen = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.monitor.rollbacks == self.seen:
            return
        self.seen = self.monitor.rollbacks
        ckpt = torch.load(self.monitor.last_healthy_path, map_location="cpu", weights_only=False)
        for key, value in pl_module.state_dict().items():
            assert torch.equal(value, ckpt["state_dict"][key]), key
        restored = trainer.optimizers[0].state_dict()
        saved = ckpt["optimizer_states"][0]
        for pid, pstate in saved["state"].items():
            for key, value in pstate.items():
                assert torch.equal(torch.as_tensor(restored["state"][pid][key]), torch.as_tensor(value)), key
        assert restored["param_groups"][0]["lr"] == pytest.approx(saved["param_groups"][0]["lr"] * 0.5**self.seen)
        self.checked += 1


def test_rollback_restores_last_healthy_checkpoint_and_training_continues(tmp_path):
    def schedule(step: int) -> dict[str, float]:
        metrics = healthy(step)
        if 34 <= step < 37:
            metrics["reward/mean"] = 0.0  # no rollout earns reward: reward.dead -> collapsing
        return metrics

    monitor = CollapseDetector(actions=["log", "rollback"], checkpoint_every=10, rollback_lr_scale=0.5, max_rollbacks=3)
    spy = RollbackSpy(monitor)
    t = trainer(tmp_path, [monitor, spy], 50)
    with pytest.warns(HealthWarning, match="rolled back to the healthy checkpoint of step 30"):
        t.fit(TinyModule(schedule), loader())
    assert monitor.rollbacks == 1 and spy.checked == 1
    assert t.global_step == 50 and not t.should_stop  # training continued to max_steps
    assert monitor.last_healthy_step == 40  # healthy again after the rollback: new checkpoints
    assert t.optimizers[0].param_groups[0]["lr"] == pytest.approx(5e-3)
    assert [e.kind for e in monitor.detector.events if e.kind == "rollback"] == ["rollback"]


class SaveAt(pl.Callback):
    """Saves the trainer's checkpoint to ``path`` at RL step ``step`` (a periodic checkpoint)."""

    def __init__(self, path: Path, step: int) -> None:
        self.path, self.step = path, step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if rl_step(trainer) == self.step:
            trainer.save_checkpoint(self.path)


def test_a_rollback_never_loads_a_healthy_state_a_later_history_wrote(tmp_path: Path) -> None:
    """Resumed from an earlier step's checkpoint, whose state names the healthy checkpoint of step 4:
    the fit it came from had gone on writing step 8's and 12's over that file, and the rollback
    restored step 12's weights and optimizer state while it said step 4."""
    resume = tmp_path / "step-6.ckpt"
    first = CollapseDetector(actions=["log", "checkpoint"], checkpoint_every=4)
    trainer(tmp_path, [first, SaveAt(resume, 6)], 14, logger=False).fit(TinyModule(healthy), loader())
    assert first.last_healthy_step == 12 and resume.is_file()

    def collapse_at_8(step: int) -> dict[str, float]:
        return {**healthy(step), "reward/mean": 0.0} if step >= 8 else healthy(step)

    resumed = CollapseDetector(actions=["log", "rollback"], checkpoint_every=100)
    fit = trainer(tmp_path, [resumed], 20, logger=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HealthWarning)
        fit.fit(TinyModule(collapse_at_8), loader(), ckpt_path=resume)
    assert resumed.rollbacks == 0 and fit.should_stop and rl_step(fit) < 20
    stopped = next(e for e in resumed.detector.events if e.kind == "stopped")
    assert "holds the healthy state of step 12, not of step 4" in stopped.message


def test_rollback_gives_up_after_max_rollbacks(tmp_path):
    def schedule(step: int) -> dict[str, float]:
        metrics = healthy(step)
        if step >= 14:
            metrics["reward/mean"] = 0.0
        return metrics

    monitor = CollapseDetector(actions=["log", "rollback"], checkpoint_every=5, max_rollbacks=2)
    t = trainer(tmp_path, [monitor], 60)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HealthWarning)
        t.fit(TinyModule(schedule), loader())
    assert monitor.rollbacks == 2 and t.should_stop and rl_step(t) < 60
    stopped = next(e for e in monitor.detector.events if e.kind == "stopped")
    assert "gave up after 2 rollbacks" in stopped.message


def test_state_survives_checkpoint_and_resume(tmp_path):
    def schedule(step: int) -> dict[str, float]:
        return {**healthy(step), "gap/abs_mean": 0.61}

    first = GapMonitor(actions=["log"])
    t = trainer(tmp_path, [first], 6)
    t.fit(TinyModule(schedule), loader())
    path = tmp_path / "resume.ckpt"
    t.save_checkpoint(path)

    second = GapMonitor(actions=["log"])
    t2 = trainer(tmp_path, [second], 10)
    t2.fit(TinyModule(schedule), loader(), ckpt_path=path)
    assert second.detector.first_warning_step == 0  # from the first run
    assert second.detector.history.count("gap/abs_mean") == 10
    assert list(second.detector.history.steps("gap/abs_mean")) == list(range(10))
    assert len([e for e in second.detector.events if e.kind == "fired"]) == 1  # no second warning


def test_validation_metrics_are_read_at_validation_end(tmp_path):
    monitor = CollapseDetector()
    t = trainer(tmp_path, [monitor], 6)
    t.limit_val_batches = 1
    t.val_check_interval = 2
    t.fit(TinyModule(healthy), loader(), loader())
    # the same steps the logger gives the validation rows of metrics.csv
    assert list(monitor.detector.history.steps("val/accuracy")) == sorted(logged(tmp_path, "val/accuracy")) == [1, 3, 5]
    assert not monitor.detector.history.has("health/state")


def test_bad_action_is_a_user_error():
    with pytest.raises(ValueError, match="CollapseDetector: actions: entry 1: expected one of log, warn"):
        CollapseDetector(actions=["log", "explode"])


@pytest.mark.parametrize("argument", ["actions", "tolerated_rules", "validation_metrics"])
def test_a_list_argument_given_a_text_is_refused_and_a_generator_is_read_once(argument: str) -> None:
    """``validation_metrics="val/accuracy"`` was read as twelve one-letter metric names (and
    ``tolerated_rules="gap.level"`` said it named 'g'); a generator was used up by the check."""
    given = {"actions": "warn", "tolerated_rules": "gap.level", "validation_metrics": "val/accuracy"}[argument]
    with pytest.raises(ValueError, match=f"CollapseDetector: {argument}: expected a list, got str '{given}'"):
        CollapseDetector(**{argument: given})
    monitor = CollapseDetector(**{argument: (name for name in [given])})
    assert getattr(monitor, argument) == ({"log", "warn"} if argument == "actions" else (given,))


def test_monitors_build_their_rules_from_the_families():
    from tclightning.health.rules import default_rules, gap_rules, length_rules

    def reprs(rules):
        return [repr(r) for r in rules]

    assert reprs(LengthFeedbackMonitor().detector.rules) == reprs(length_rules(nonfinite=True))
    assert reprs(GapMonitor().detector.rules) == reprs(gap_rules(nonfinite=True, coupling=True))
    assert reprs(CollapseDetector().detector.rules) == reprs(default_rules())
    length = LengthFeedbackMonitor(window=12, growth_warn=0.1, drift_growth_warn=0.3, truncation_rise_warn=0.07,
                                   truncation_collapse=0.4)
    assert reprs(length.detector.rules) == reprs(length_rules(12, 0.1, 0.3, 0.07, 0.4, nonfinite=True))
    gap = GapMonitor(abs_mean_band=0.3, k3_band=0.1, rise_warn=0.4, window=12)
    assert reprs(gap.detector.rules) == reprs(gap_rules(0.3, 0.1, 0.4, 12, nonfinite=True, coupling=True))


def test_a_tolerated_rule_no_rule_has_is_refused() -> None:
    """``tolerated_rules=["gap.levle"]`` (a typo of ``gap.level``) tolerated nothing, without a word."""
    from tclightning.errors import TclightningError

    with pytest.raises(TclightningError, match=r"CollapseDetector: tolerated_rules names 'gap.levle', which no rule has"):
        CollapseDetector(tolerated_rules=["gap.levle"])
    assert CollapseDetector(tolerated_rules=["gap.level"]).tolerated_rules == ("gap.level",)


def test_a_metric_name_mapped_from_a_name_no_rule_reads_is_refused() -> None:
    """``metric_names={"reward/mena": "train/reward"}`` (a typo of ``reward/mean``) left the reward
    rules without data: a reward collapse was trained through without a word."""
    from tclightning.errors import TclightningError

    with pytest.raises(TclightningError, match=r"CollapseDetector: metric_names maps 'reward/mena', which no health "
                                               "rule reads"):
        CollapseDetector(metric_names={"reward/mena": "train/reward"})
    assert LengthFeedbackMonitor(metric_names={"reward/mean": "train/reward"})  # one mapping serves every monitor
    assert GapMonitor(metric_names="trl")


def test_a_second_fit_in_one_folder_never_writes_over_the_first_s_healthy_checkpoint(tmp_path: Path) -> None:
    """Two fits with one ``default_root_dir`` (``logger=False``): the second wrote its
    ``last-healthy.ckpt`` over the first's, which the first's own checkpoint names to roll back to."""
    paths = []
    for _ in range(2):
        monitor = CollapseDetector(actions=["log", "checkpoint"], checkpoint_every=5)
        trainer(tmp_path, [monitor], 12, logger=False).fit(TinyModule(healthy), loader())
        paths.append(monitor.last_healthy_path)
    assert paths[0] != paths[1] and all(Path(p).is_file() for p in paths), paths
    assert Path(paths[1]).name == "last-healthy-1.ckpt"


def test_a_monitor_used_for_a_second_fit_never_writes_over_the_first_fit_s_healthy_checkpoint(tmp_path: Path) -> None:
    """One monitor object for two fits in one folder (a loop over seeds): the second fit wrote over the
    first's ``last-healthy.ckpt``, the path the monitor kept from it."""
    monitor = CollapseDetector(actions=["log", "checkpoint"], checkpoint_every=5)
    paths, written = [], []
    for _ in range(2):
        trainer(tmp_path, [monitor], 12, logger=False).fit(TinyModule(healthy), loader())
        paths.append(monitor.last_healthy_path)
        written.append(Path(paths[-1]).read_bytes())
    assert [Path(p).name for p in paths] == ["last-healthy.ckpt", "last-healthy-1.ckpt"]
    assert Path(paths[0]).read_bytes() == written[0]  # the first fit's, as it wrote it


@pytest.mark.parametrize("named", ["a-file-of-yours", "another-fit-s"])
def test_a_resumed_fit_never_writes_over_the_file_its_checkpoint_s_state_names(named: str, tmp_path: Path) -> None:
    """A resumed fit wrote its healthy checkpoint over whatever file of its folder the checkpoint's
    saved ``last_healthy_path`` named: a file of yours, or the healthy checkpoint a later fit wrote
    at a name the first had given up."""
    first = CollapseDetector(actions=["log", "checkpoint"], checkpoint_every=5)
    fit = trainer(tmp_path, [first], 6, logger=False)
    fit.fit(TinyModule(healthy), loader())
    resume = tmp_path / "resume.ckpt"
    fit.save_checkpoint(resume)
    checkpoints = tmp_path / "checkpoints"
    if named == "a-file-of-yours":
        state = torch.load(resume, weights_only=False)
        (key,) = [k for k in state["callbacks"] if "CollapseDetector" in k]
        state["callbacks"][key]["last_healthy_path"] = str(checkpoints / "best-model.ckpt")
        torch.save(state, resume)
        mine = checkpoints / "best-model.ckpt"
    else:  # the first fit's healthy checkpoint moved away, a new fit wrote its own at that name
        (checkpoints / "last-healthy.ckpt").rename(tmp_path / "moved.ckpt")
        trainer(tmp_path, [CollapseDetector(actions=["log", "checkpoint"], checkpoint_every=5)], 6,
                logger=False).fit(TinyModule(healthy), loader())
        mine = checkpoints / "last-healthy.ckpt"
    if not mine.exists():
        mine.write_bytes(b"mine")
    before = mine.read_bytes()
    resumed = CollapseDetector(actions=["log", "checkpoint"], checkpoint_every=5)
    trainer(tmp_path, [resumed], 12, logger=False).fit(TinyModule(healthy), loader(), ckpt_path=resume)
    assert mine.read_bytes() == before
    assert resumed.last_healthy_path is not None and Path(resumed.last_healthy_path) != mine


def test_a_monitor_with_no_data_writes_no_healthy_checkpoint(tmp_path: Path) -> None:
    """A module that logs none of the monitor's metrics got a "healthy" checkpoint every
    ``checkpoint_every`` steps, which a rollback would return to, never judged."""
    monitor = CollapseDetector(actions=["log", "checkpoint"], checkpoint_every=2)
    trainer(tmp_path, [monitor], 8, logger=False, enable_checkpointing=False).fit(TinyModule(lambda step: {}), loader())
    assert monitor.last_healthy_path is None and not (tmp_path / "checkpoints").exists()



def test_two_fits_that_find_the_healthy_name_free_together_each_take_their_own(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Two fits started together in one folder both found ``last-healthy.ckpt`` free (Lightning makes
    the file only once the checkpoint is serialised) and wrote over each other's: the name is taken
    by a file made at once, and one found taken meanwhile is passed over."""
    from tclightning import files
    from tclightning.callbacks import health_actions

    here = tmp_path / "checkpoints" / "last-healthy.ckpt"
    found = iter([here, here])  # both looked before either made the file
    monkeypatch.setattr(health_actions, "unused_name", lambda path: next(found, None) or files.unused_name(path))
    first, second = health_actions._claim_free_name(here), health_actions._claim_free_name(here)
    assert (first.name, second.name) == ("last-healthy.ckpt", "last-healthy-1.ckpt")
    assert first.is_file() and second.is_file()
