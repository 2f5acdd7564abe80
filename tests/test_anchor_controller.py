"""The anchor controller (``probe`` and ``switch``): its decisions on synthetic signals, exact
resume (and an earlier version's state), and the glue that puts its decisions into the anchor."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
import torch

from tclightning.anchor import Anchor, AnchorCircuit, AnchorSchedule, make_merger
from tclightning.callbacks.anchor_controller import ACTIONS, AnchorController, ControllerCore
from tclightning.errors import TclightningError


def test_a_fast_circuit_without_signal_is_switched_once_and_its_anchor_term_turned_off() -> None:
    core = ControllerCore(signal_floor=0.3, signal_patience=2)
    assert core.wants_signal and core.check_signal(5, 0.45, can_switch=True) is None  # one reading: no verdict
    action = core.check_signal(10, 0.05, can_switch=True)  # mean +0.25 < 0.30
    assert action is not None and action.kind == "switch" and "mean fast_signal +0.25 over 2 anchors" in action.reason
    assert (core.switched_to, core.strength, core.mode, core.wants_signal) == ("lowrank", 0.0, "off", False)
    assert core.check_signal(15, 0.0, can_switch=True) is None  # once per run


def test_a_late_first_anchor_gets_a_signal_probe_that_leaves_the_strength_alone() -> None:
    core = ControllerCore(signal_patience=2, start_strength=0.5)
    assert core.start_probe(0, can_switch=True, latency=1) is None  # anchors come every step anyway
    assert core.start_probe(0, can_switch=False, latency=20) is None
    probe = core.start_probe(0, can_switch=True, latency=20)
    assert probe is not None and probe.kind == "probe" and (core.mode, core.probe_left) == ("probe", 3)
    assert core.start_probe(0, can_switch=True, latency=20) is None  # once, before the first step
    assert core.check_signal(1, 0.6, can_switch=True) is None and core.check_signal(2, 0.5, can_switch=True) is None
    for _ in range(3):
        core.end_step()
    assert (core.mode, core.probe_left, core.strength, core.signal_found) == ("partial", 0, 0.5, True)
    assert [e.kind for e in core.events] == ["probe"]  # the probe ends without an action of its own
    core = ControllerCore(signal_patience=1)  # a switch ends the probe at once
    core.start_probe(0, can_switch=True, latency=5)
    assert core.check_signal(1, 0.0, can_switch=True).kind == "switch" and core.mode == "off" and core.probe_left == 0


def test_a_fast_circuit_with_signal_stops_the_measuring_and_nothing_switches_where_it_cannot() -> None:
    core = ControllerCore(signal_patience=2)
    assert core.check_signal(5, 0.6, can_switch=True) is None and core.check_signal(10, 0.1, can_switch=True) is None
    assert core.signal_found and not core.wants_signal and core.switched_to is None  # mean 0.35 >= 0.30
    core = ControllerCore(signal_patience=1)
    assert core.check_signal(5, -0.2, can_switch=False) is None and core.signal_readings == []
    assert core.check_signal(5, None, can_switch=True) is None and core.wants_signal
    assert core.check_signal(5, float("nan"), can_switch=True) is None and core.signal_readings == []
    assert not ControllerCore(fallback_codec=None).wants_signal


def test_the_start_strength_holds_for_the_run() -> None:
    assert (ControllerCore().strength, ControllerCore().mode) == (1.0, "full")
    core = ControllerCore(start_strength=0.0)
    for _ in range(50):
        core.end_step()
    assert (core.strength, core.mode, core.events) == (0.0, "off", [])
    assert ControllerCore(start_strength=0.5).mode == "partial"
    with pytest.raises(TclightningError, match="start_strength=2"):
        ControllerCore(start_strength=2)


def test_exact_resume_of_the_controller() -> None:
    core = ControllerCore(signal_patience=3, start_strength=0.5)
    core.start_probe(0, can_switch=True, latency=5)
    core.check_signal(0, 0.1, can_switch=True)
    core.end_step()  # a verdict half-way and the probe in force: the readings and the probe are state too
    buffer = io.BytesIO()
    torch.save(core.state_dict(), buffer)
    buffer.seek(0)
    resumed = ControllerCore(signal_patience=3, start_strength=0.5)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert core.state_dict() == resumed.state_dict() and resumed.mode == "probe"
    for c in (core, resumed):
        assert c.check_signal(1, 0.2, can_switch=True) is None
        c.end_step()
    a, b = (c.check_signal(2, 0.0, can_switch=True) for c in (core, resumed))
    assert a == b and a is not None and a.kind == "switch"
    assert core.state_dict() == resumed.state_dict()


def test_an_earlier_versions_state_loads_or_is_refused_with_the_reason() -> None:
    old = {"strength": 0.0, "mode": "suspended", "rewards": [0.4] * 10, "start": 0.4, "stale_streak": 1,
           "calm_streak": 3, "fresh_left": 0, "fresh_used": 0, "fresh_cadence": 1, "last_decline_step": None,
           "steps_seen": 60, "signal_readings": [], "signal_found": False, "switched_to": None, "probing": False,
           "events": [{"step": 12, "kind": "weaken", "strength": 0.5, "reason": "stale"}]}
    core = ControllerCore(start_strength=0.0)
    core.load_state_dict(old)  # what robust-5-5's checkpoints hold: the retired actions' counters are ignored
    assert (core.strength, core.mode, core.steps_seen, core.events[0].kind) == (0.0, "off", 60, "weaken")
    core.load_state_dict({**old, "strength": 1.0, "mode": "fresh", "fresh_left": 2, "probing": True})
    assert (core.mode, core.probe_left) == ("probe", 2)  # an earlier probe continues
    with pytest.raises(TclightningError, match="inside a 'fresh' anchor window"):
        core.load_state_dict({**old, "mode": "fresh", "fresh_left": 4})


def test_bad_thresholds_name_the_argument() -> None:
    with pytest.raises(TclightningError, match="signal_patience=0"):
        AnchorController(signal_patience=0)
    with pytest.raises(TclightningError, match="signal_floor=2"):
        ControllerCore(signal_floor=2)
    with pytest.raises(TypeError):
        AnchorController(weaken_factor=0.5)  # a retired action's threshold


def fake_trainer(metrics: dict[str, float], step: int) -> SimpleNamespace:
    return SimpleNamespace(callback_metrics={k: torch.tensor(v) for k, v in metrics.items()}, callbacks=[],
                           fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(_batches_that_stepped=step)),
                           global_step=step)


def test_the_callback_puts_its_decisions_into_the_anchor_and_puts_them_back_on_resume() -> None:
    from tclightning.pipeline import CutSet, PipelineConfig
    from tests.test_distributed import tiny_llama

    anchor = Anchor(make_merger("signed_ema"), AnchorCircuit(AnchorSchedule(5, 5)))
    logged: dict[str, float] = {}
    module = SimpleNamespace(anchor=anchor, log=lambda name, value, **kw: logged.__setitem__(name, value))
    callback = AnchorController(signal_patience=2, start_strength=0.5)
    with CutSet(tiny_llama(), PipelineConfig(layout="all", stages=2, codec="prf", k=5)) as cuts:
        def trainer(i: int) -> SimpleNamespace:
            t = fake_trainer({"reward/mean": 0.4}, i)
            t.strategy = SimpleNamespace(cuts=cuts)
            return t

        callback.on_train_batch_start(trainer(0), module, None, 0)
        assert (anchor.strength, anchor.measure_fast, anchor.circuit.schedule) == (0.5, True, AnchorSchedule(1, 1))
        callback.on_train_batch_end(trainer(0), module, None, None, 0)
        state = callback.state_dict()  # saved once, here: the anchor's own entry holds none of it
        # a resumed run: a fresh anchor object (the recipe's schedule, strength 1), the controller's state put back
        anchor2 = Anchor(make_merger("signed_ema"), AnchorCircuit(AnchorSchedule(5, 5)))
        anchor2.load_state_dict(anchor.state_dict())
        module2 = SimpleNamespace(anchor=anchor2, log=lambda *a, **k: None)
        resumed = AnchorController(signal_patience=2, start_strength=0.5)
        resumed.load_state_dict(state)
        resumed.on_train_batch_start(trainer(1), module2, None, 1)
        assert (anchor2.strength, anchor2.measure_fast, anchor2.circuit.schedule) == (0.5, True, AnchorSchedule(1, 1))
        for c, m in ((callback, module), (resumed, module2)):
            for i in (1, 2):
                c.on_train_batch_start(trainer(i), m, None, i)
                c.on_train_batch_end(trainer(i), m, None, None, i)
        assert anchor.circuit.schedule == anchor2.circuit.schedule == AnchorSchedule(5, 5)  # the probe is over
        assert logged["anchor/controller_mode"] == 1 and resumed.core.state_dict() == callback.core.state_dict()


def test_the_callback_measures_the_fast_signal_then_switches_the_cuts(recwarn: pytest.WarningsRecorder) -> None:
    from tclightning.codecs import AdaptiveLowRankCodec, PRFCodec
    from tclightning.pipeline import CutSet, PipelineConfig
    from tests.test_distributed import tiny_llama

    anchor = Anchor(make_merger("signed_ema"), AnchorCircuit(AnchorSchedule(5, 5)))
    logged: dict[str, float] = {}
    module = SimpleNamespace(anchor=anchor, log=lambda name, value, **kw: logged.__setitem__(name, value))
    callback = AnchorController(signal_patience=2, signal_floor=0.3)
    with CutSet(tiny_llama(), PipelineConfig(layout="all", stages=2, codec="prf", k=5)) as cuts:
        def step(i: int, readings: list[float]) -> None:
            trainer = fake_trainer({"reward/mean": 0.4}, i)
            trainer.strategy = SimpleNamespace(cuts=cuts)
            callback.on_train_batch_start(trainer, module, None, i)
            anchor.fast_readings = readings  # what this step's anchor measured
            callback.on_train_batch_end(trainer, module, None, None, i)

        step(0, [])
        assert callback.events[0].kind == "probe" and anchor.circuit.schedule == AnchorSchedule(1, 1)
        assert logged["anchor/controller_action"] == ACTIONS["probe"] == 7  # logged on the step it started
        assert anchor.measure_fast and isinstance(cuts.boundaries[0].codec, PRFCodec)
        step(1, [0.1])
        step(2, [0.0])
        assert isinstance(cuts.boundaries[0].codec, AdaptiveLowRankCodec)
        assert logged["anchor/controller_action"] == ACTIONS["switch"] == 6 and logged["anchor/controller_mode"] == 2
        assert not anchor.measure_fast and anchor.strength == 0.0 and anchor.circuit.schedule == AnchorSchedule(5, 5)
        assert any("switch (mean fast_signal +0.05 over 2 anchors" in str(w.message) for w in recwarn)
    # without cuts to switch (a dense strategy, or across processes) nothing is measured
    module.anchor = anchor2 = Anchor(make_merger("signed_ema"), AnchorCircuit(AnchorSchedule(5, 5)))
    AnchorController().on_train_batch_start(fake_trainer({}, 0), module, None, 0)
    assert not anchor2.measure_fast


def test_without_an_anchor_the_callback_does_nothing() -> None:
    module = SimpleNamespace(log=lambda *a, **k: pytest.fail("nothing to log"))
    callback = AnchorController()
    callback.on_train_batch_start(fake_trainer({}, 0), module, None, 0)
    callback.on_train_batch_end(fake_trainer({"reward/mean": 0.1}, 0), module, None, None, 0)
    assert callback.events == []


# ----------------------------------------------------------------------------- in a run
def assert_same_metrics(rows: dict, resumed: dict, steps: int) -> None:
    """Every logged metric but wall-clock ones equal, step by step (a resumed run against a whole one)."""
    wall = ("time/", "throughput/", "epoch")
    for step in range(steps):
        assert {k: v for k, v in resumed[step].items() if not k.startswith(wall)} == {
            k: v for k, v in rows[step].items() if not k.startswith(wall)}, step


def _train(root, steps: int, resume: str | None = None):  # noqa: ANN001, ANN202
    from tclightning.run import run
    from tests.conftest import FAST

    controller = AnchorController(start_strength=0.5)  # the anchor does not save it: the controller puts it back
    summary = run("robust-5-5", [*FAST, "pipeline.stages=2", "anchor.latency=1", "anchor.cadence=1", "callbacks=[]",
                                 "trainer.val_every=0", "trainer.checkpoint_every=3", f"logging.root={root}",
                                 f"trainer.steps={steps}"], resume=resume, quiet=True, extra_callbacks=(controller,))
    return summary, controller


def test_a_robust_run_logs_documented_metrics_and_resumes_exactly(tmp_path) -> None:  # noqa: ANN001
    from pathlib import Path

    from tclightning.grpo.summary import read_metrics
    from tests.test_docs import undocumented

    summary, whole = _train(tmp_path / "a", 6)
    rows = read_metrics(Path(summary["run_dir"]) / "metrics.csv")
    logged = set().union(*rows.values())
    assert undocumented(logged) == set()
    assert {"anchor/controller_action", "anchor/fast_cosine", "anchor/correction_ratio", "anchor/strength"} <= logged
    assert all(rows[step]["anchor/strength"] == 0.5 for step in range(6))
    interrupted, _ = _train(tmp_path / "b", 3)
    # the checkpoint the resume starts from holds the cuts' token centres, not only their bases
    from tclightning.callbacks.checkpointing import load_checkpoint

    cuts = load_checkpoint(Path(interrupted["run_dir"]) / "checkpoints" / "last.ckpt")["tclightning"]["cuts"]
    states = [state for state in cuts["forward"] if state]
    assert states and all(state["token_ids"].numel() > 0 for state in states)
    summary_b, resumed = _train(tmp_path / "b", 6, resume="last")
    assert_same_metrics(rows, read_metrics(Path(summary_b["run_dir"]) / "metrics.csv"), steps=6)
    assert resumed.core.state_dict() == whole.core.state_dict()


def _switching_run(root, steps: int, resume: str | None = None):  # noqa: ANN001, ANN202
    """shallow-compressed on a briefly warmed tiny model (one-digit sums, so rewards vary and the
    gradients are not 0), a fresh anchor every step; a signal floor no gradient reaches, so the
    controller switches the codec at the first anchor (step 1)."""
    from tclightning.run import run
    from tests.conftest import FAST

    controller = AnchorController(signal_patience=1, signal_floor=0.999)
    summary = run("shallow-compressed", [*FAST, "model.warmup.steps=150", "task.digits=1", "pipeline.stages=2",
                                         "anchor.latency=1", "anchor.cadence=1", "callback_presets=[]",
                                         "trainer.val_every=0", "trainer.checkpoint_every=3", f"logging.root={root}",
                                         f"trainer.steps={steps}"], resume=resume, quiet=True,
                  extra_callbacks=(controller,))
    return summary, controller


def test_a_switched_run_logs_the_switch_and_resumes_exactly(tmp_path) -> None:  # noqa: ANN001
    from pathlib import Path

    from tclightning.grpo.summary import read_metrics

    summary, whole = _switching_run(tmp_path / "a", 6)
    rows = read_metrics(Path(summary["run_dir"]) / "metrics.csv")
    assert [e.kind for e in whole.events] == ["switch"] and whole.events[0].step == 1
    assert rows[1]["anchor/controller_action"] == ACTIONS["switch"] and 0 < rows[1]["anchor/fast_signal"] < 0.999
    assert rows[4]["anchor/strength"] == 0.0
    _switching_run(tmp_path / "b", 3)
    summary_b, resumed = _switching_run(tmp_path / "b", 6, resume="last")  # the checkpoint holds the lowrank cuts
    assert_same_metrics(rows, read_metrics(Path(summary_b["run_dir"]) / "metrics.csv"), steps=6)
    assert resumed.core.state_dict() == whole.core.state_dict()
