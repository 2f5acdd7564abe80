"""A real NaN in the GRPO path (tiny model, a few RL steps): the guard keeps it out of the weights
and the sampler, the health detector flags it, and rollback restores the last healthy state.

The NaN comes from test-only callbacks: a forward hook that poisons the training forward (the
loss) at one step, or one weight set to NaN at the start of a step.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import lightning as L
import pytest
import torch

from tclightning.callbacks.checkpointing import load_checkpoint
from tclightning.callbacks.collapse import CollapseDetector
from tclightning.callbacks.health_actions import HealthWarning
from tclightning.cli.main import main
from tclightning.grpo.summary import read_metrics
from tclightning.health.rules import NonFiniteRule
from tclightning.run import run
from tclightning.sampling.base import NonFiniteError
from tests.conftest import FAST, REPO


class PoisonForward(L.Callback):
    """At RL step ``step``, the policy's logits are NaN: in the training forward (the loss) with
    ``sampling=False``, in the sampler's forward (eval mode) with ``sampling=True``."""

    def __init__(self, step: int, sampling: bool = False) -> None:
        self.step, self.sampling = step, sampling
        self._handle = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if batch.step == self.step:
            head = pl_module.policy.get_output_embeddings()
            self._handle = head.register_forward_hook(
                lambda module, args, out: out * math.nan if module.training != self.sampling else out)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


class PoisonWeight(L.Callback):
    """At the start of RL step ``step``, one weight of the policy becomes NaN."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if batch.step == self.step:
            with torch.no_grad():
                next(pl_module.policy.parameters()).view(-1)[0] = math.nan


class AtStep(L.Callback):
    """Calls ``action()`` at the start of RL step ``step`` (before the step's other callbacks act)."""

    def __init__(self, step: int, action: Callable[[], None]) -> None:
        self.step, self.action = step, action

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if batch.step == self.step:
            self.action()


class AroundStep(L.Callback):
    """Weights and optimizer state just before and just after RL step ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.before: tuple[dict, dict] | None = None
        self.after: tuple[dict, dict] | None = None

    @staticmethod
    def _state(trainer, pl_module) -> tuple[dict, dict]:
        weights = {k: v.detach().clone() for k, v in pl_module.policy.state_dict().items()}
        optim = {pid: {k: torch.as_tensor(v).clone() for k, v in s.items()}
                 for pid, s in trainer.optimizers[0].state_dict()["state"].items()}
        return weights, optim

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if batch.step == self.step:
            self.before = self._state(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if batch.step == self.step:
            self.after = self._state(trainer, pl_module)


class RollbackSpy(L.Callback):
    """After the guard (placed after it): at its rollback, weights and optimizer state vs the file."""

    def __init__(self, monitor: CollapseDetector, lr_scale: float) -> None:
        self.monitor, self.lr_scale = monitor, lr_scale
        self.checked: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if self.monitor.rollbacks == len(self.checked):
            return
        ckpt = load_checkpoint(self.monitor.last_healthy_path)
        current = pl_module.state_dict()
        assert current.keys() == ckpt["state_dict"].keys()
        for key, value in ckpt["state_dict"].items():
            assert torch.equal(current[key], value), key
        restored, saved = trainer.optimizers[0].state_dict(), ckpt["optimizer_states"][0]
        assert restored["state"].keys() == saved["state"].keys()
        for pid, pstate in saved["state"].items():
            for key, value in pstate.items():
                assert torch.equal(torch.as_tensor(restored["state"][pid][key]), torch.as_tensor(value)), (pid, key)
        assert restored["param_groups"][0]["lr"] == pytest.approx(saved["param_groups"][0]["lr"] * self.lr_scale)
        self.checked.append(batch.step)


class Payload:
    """Pickles to a call of ``open(marker, "w")``: loading it with plain pickle creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def nan_monitor() -> CollapseDetector:
    """A log-only detector with just the non-finite rule (reward-based rules stay out of the verdict)."""
    return CollapseDetector(rules=[NonFiniteRule()], name="nan", actions=["log"])


def guard(every: int = 2) -> CollapseDetector:
    """The rollback guard: the non-finite rule, a healthy checkpoint every ``every`` steps."""
    return CollapseDetector(rules=[NonFiniteRule()], name="guard", actions=["log", "rollback"],
                            checkpoint_every=every, rollback_lr_scale=0.5, max_rollbacks=2)


def only_run_dir(root: Path) -> Path:
    (run_dir,) = [p for p in (root / "tiny").iterdir() if p.is_dir()]
    return run_dir


def all_finite(module_state: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(v).all()) for v in module_state.values() if v.is_floating_point())


def test_nan_loss_skips_the_update_logs_it_and_the_detector_flags_it(run_root: Path) -> None:
    monitor, around = nan_monitor(), AroundStep(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HealthWarning)
        summary = run("tiny", [*FAST, "trainer.steps=4"], quiet=True,
                      extra_callbacks=[PoisonForward(2), monitor, around])
    rows = read_metrics(Path(summary["run_dir"]) / "metrics.csv")
    assert sorted(rows) == [0, 1, 2, 3]  # training went on
    assert math.isnan(rows[2]["loss/policy"]) and rows[2]["policy/skipped_ticks"] == 1
    assert [rows[s]["policy/skipped_ticks"] for s in (0, 1, 3)] == [0, 0, 0]
    # no optimizer step: weights and Adam moments untouched, and the LR schedule waited a tick
    assert around.before is not None and around.after is not None
    for before, after in zip(around.before, around.after):
        assert before.keys() == after.keys()
    for key, value in around.before[0].items():
        assert torch.equal(value, around.after[0][key]), key
    for pid, state in around.before[1].items():
        for key, value in state.items():
            assert torch.equal(value, around.after[1][pid][key]), (pid, key)
    assert rows[2]["policy/lr"] == rows[1]["policy/lr"] != rows[3]["policy/lr"]
    # the detector saw it at that step (and the preset's collapse monitor logged it)
    assert monitor.detector.first_collapse_step == 2
    fired = {e.metric for e in monitor.detector.events if e.kind == "fired" and e.rule == "nonfinite"}
    assert "policy/skipped_ticks" in fired and "loss/policy" in fired
    assert rows[2]["health/collapse"] == 2
    assert all_finite(load_checkpoint(Path(summary["run_dir"]) / "checkpoints" / "last.ckpt")["state_dict"])


def test_nan_logits_while_sampling_skip_the_step_and_the_detector_flags_it(run_root: Path) -> None:
    monitor, around = nan_monitor(), AroundStep(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HealthWarning)
        summary = run("tiny", [*FAST, "trainer.steps=4"], quiet=True,
                      extra_callbacks=[PoisonForward(2, sampling=True), monitor, around])
    rows = read_metrics(Path(summary["run_dir"]) / "metrics.csv")
    assert sorted(rows) == [0, 1, 2, 3]  # a one-step NaN: the next step samples again
    assert [rows[s]["policy/skipped_step"] for s in range(4)] == [0, 0, 1, 0]
    assert math.isnan(rows[2]["reward/mean"]) and math.isfinite(rows[3]["reward/mean"])
    assert around.before is not None and around.after is not None
    for key, value in around.before[0].items():
        assert torch.equal(value, around.after[0][key]), key
    assert monitor.detector.first_collapse_step == 2
    (fired,) = [e for e in monitor.detector.events if e.kind == "fired"]
    assert (fired.rule, fired.metric) == ("nonfinite", "policy/skipped_step")  # one finding, not one per NaN


def test_nan_weight_is_caught_before_sampling_and_training_stops_cleanly(run_root: Path) -> None:
    monitor = nan_monitor()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HealthWarning)
        with pytest.raises(NonFiniteError) as caught:
            run("tiny", [*FAST, "trainer.steps=6"], quiet=True, extra_callbacks=[PoisonWeight(2), monitor])
    message = str(caught.value)
    assert "\n" not in message and caught.value.exit_code == 3
    assert message.startswith("training stopped at step 3: the policy's weights hold NaN or Inf (")
    assert "non-finite at step 2" in message
    rows = read_metrics(only_run_dir(run_root) / "metrics.csv")
    assert sorted(rows) == [0, 1, 2]  # step 3 sampled nothing and logged nothing
    assert rows[2]["policy/skipped_step"] == 1 and rows[1]["policy/skipped_step"] == 0
    assert math.isnan(rows[2]["reward/mean"])  # nothing sampled: not the previous step's value
    assert rows[2]["health/collapse"] == 2  # the preset's detector saw it before the stop
    assert monitor.detector.first_collapse_step == 2
    # the run ended on the error before its final checkpoint: no last.ckpt of the poisoned weights
    assert not (only_run_dir(run_root) / "checkpoints" / "last.ckpt").exists()


def test_nan_weight_from_the_cli_is_one_line_and_exit_3(run_root: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    recipe = tmp_path / "poisoned.yaml"
    recipe.write_text("defaults: [tiny]\ncallbacks:\n  - class_path: test_nan.PoisonWeight\n"
                      "    init_args: {step: 1}\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HealthWarning)
        code = main(["run", "--recipe", str(recipe), *FAST, "trainer.steps=4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 3
    assert err[-1].startswith("error: training stopped at step 2: the policy's weights hold NaN or Inf")
    assert not any("Traceback" in line for line in err)


def test_rollback_restores_the_healthy_weights_and_optimizer_exactly(run_root: Path) -> None:
    monitor = guard(every=2)
    spy = RollbackSpy(monitor, lr_scale=0.5)
    with pytest.warns(HealthWarning, match="rolled back to the healthy checkpoint of step 4"):
        summary = run("tiny", [*FAST, "trainer.steps=7"], quiet=True,
                      extra_callbacks=[PoisonWeight(5), monitor, spy])
    assert monitor.rollbacks == 1 and spy.checked == [5]
    rows = read_metrics(Path(summary["run_dir"]) / "metrics.csv")
    assert sorted(rows) == list(range(7))  # training continued after the rollback
    assert rows[5]["policy/skipped_step"] == 1 and rows[6]["policy/skipped_step"] == 0
    assert math.isfinite(rows[6]["reward/mean"]) and rows[6]["health/guard_rollbacks"] == 1  # logged before acting
    assert monitor.last_healthy_step == 6  # healthy again: checkpoints resumed
    assert all_finite(load_checkpoint(Path(summary["run_dir"]) / "checkpoints" / "last.ckpt")["state_dict"])


def test_rollback_path_outside_the_run_directory_is_refused(run_root: Path, tmp_path: Path) -> None:
    marker = tmp_path / "payload-ran"
    outside = tmp_path / "elsewhere" / "last-healthy.ckpt"
    outside.parent.mkdir()
    torch.save({"state_dict": Payload(marker)}, outside)
    monitor = guard(every=2)

    def point_outside() -> None:  # what a crafted checkpoint's callback state would restore
        monitor.last_healthy_path = str(outside)

    with pytest.warns(HealthWarning, match="refusing to roll back to .*outside the run directory"):
        with pytest.raises(NonFiniteError, match="training stopped at step 3"):
            run("tiny", [*FAST, "trainer.steps=6", "trainer.val_every=0"], quiet=True,
                extra_callbacks=[AtStep(3, point_outside), PoisonWeight(3), monitor])
    assert not marker.exists()
    assert monitor.rollbacks == 0 and monitor.stopped_at == 3
    (stopped,) = [e for e in monitor.detector.events if e.kind == "stopped"]
    assert "outside the run directory" in stopped.message


def test_crafted_pickle_as_the_healthy_checkpoint_is_not_executed(run_root: Path, tmp_path: Path) -> None:
    marker, control = tmp_path / "payload-ran", tmp_path / "control-ran"
    monitor = guard(every=2)

    def replace_healthy() -> None:  # the healthy checkpoint inside the run directory, swapped
        assert monitor.last_healthy_path is not None
        torch.save({"state_dict": Payload(marker)}, monitor.last_healthy_path)

    with pytest.warns(HealthWarning, match="cannot roll back: checkpoint .*refused"):
        with pytest.raises(NonFiniteError, match="training stopped at step 3"):
            run("tiny", [*FAST, "trainer.steps=6", "trainer.val_every=0"], quiet=True,
                extra_callbacks=[AtStep(3, replace_healthy), PoisonWeight(3), monitor])
    assert not marker.exists() and monitor.rollbacks == 0 and monitor.stopped_at == 3
    # control: the same kind of file does run its payload when loaded as a plain pickle
    crafted = tmp_path / "control.ckpt"
    torch.save({"state_dict": Payload(control)}, crafted)
    torch.load(crafted, weights_only=False)
    assert control.exists()


@pytest.mark.slow
def test_huge_lr_with_the_monitoring_preset_ends_without_a_traceback(tmp_path: Path) -> None:
    """The issue's case: the tiny recipe (monitoring preset) after a short warm-up, ``grpo.lr=1e3``.

    Whether and when it diverges depends on the float kernels; how it ends does not: exit 0 (it
    never produced a NaN) or exit 3 with one ``error:`` line, never a traceback."""
    cmd = [sys.executable, "-m", "tclightning", "run", "--recipe", "tiny", "model.warmup.steps=400",
           "trainer.num_threads=1", "trainer.steps=12", "trainer.val_every=0", "logging.progress=none",
           "grpo.lr=1e3", f"logging.root={tmp_path / 'runs'}"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path, env=env)
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.returncode in (0, 3), done.stderr[-3000:]
    if done.returncode == 3:
        assert done.stderr.strip().splitlines()[-1].startswith("error: training stopped at step")


@pytest.mark.parametrize("preset", ["monitoring", "collapse-guard"])
def test_huge_lr_ends_with_exit_3_and_one_line(run_root: Path, preset: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``grpo.lr=1e3`` with weight decay 1: each tick multiplies the weights by about -1000 whatever
    the gradients, so the policy diverges within a few steps on any machine. Monitoring only: the
    step after the flagged one stops; collapse-guard: two rollbacks, then the stop."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", HealthWarning)
        code = main(["run", "--recipe", "tiny", *FAST, "trainer.steps=30", "grpo.lr=1e3", "grpo.weight_decay=1",
                     f"callback_presets=[{preset}]"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 3 and err[-1].startswith("error: training stopped at step"), err[-3:]
    assert not any("Traceback" in line for line in err)
    messages = [str(w.message) for w in seen if issubclass(w.category, HealthWarning)]
    assert any("(nonfinite) policy/skipped" in m for m in messages), messages
    rolled = [m for m in messages if "rolled back to the healthy checkpoint" in m]
    assert len(rolled) == (2 if preset == "collapse-guard" else 0), messages

