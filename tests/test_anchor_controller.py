"""The adaptive anchor controller: its decisions on synthetic signals, exact resume, and the
glue that puts its decisions into the anchor."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
import torch

from tclightning.anchor import Anchor, AnchorCircuit, AnchorSchedule, make_merger
from tclightning.callbacks.anchor_controller import ACTIONS, AnchorController, ControllerCore
from tclightning.errors import TclightningError


def drive(core: ControllerCore, signals: list[tuple[float, float | None, float | None]], start: int = 0) -> list:
    """Feed (reward, fast_cosine, consecutive) per step; return the actions (None for none)."""
    return [core.observe(start + i, reward=r, fast_cosine=c, consecutive=a) for i, (r, c, a) in enumerate(signals)]


def test_healthy_signals_take_no_action() -> None:
    core = ControllerCore()
    actions = drive(core, [(0.4 + 0.001 * i, 0.3, 0.7) for i in range(60)])
    assert actions == [None] * 60 and core.strength == 1.0 and core.mode == "normal"


def test_stale_anchor_is_weakened_then_suspended_before_the_reward_moves() -> None:
    core = ControllerCore(patience=2, weaken_factor=0.5, min_strength=0.2)
    actions = drive(core, [(0.4, -0.2, 0.45)] * 8)
    kinds = [(i, a.kind, a.strength) for i, a in enumerate(actions) if a is not None]
    assert kinds == [(1, "weaken", 0.5), (3, "weaken", 0.25), (5, "suspend", 0.0)]
    assert core.mode == "suspended" and "fast_cosine -0.20" in core.events[0].reason
    # only the consecutive agreement is low: stale too
    core = ControllerCore(patience=3)
    actions = drive(core, [(0.4, 0.2, 0.3)] * 3)
    assert actions[2] is not None and "consecutive_agreement 0.30" in actions[2].reason


def test_a_decline_starts_a_fresh_window_then_restores() -> None:
    core = ControllerCore(window=5, drop_warn=0.05, fresh_steps=3, min_strength=0.2)
    rewards = [0.5] * 5 + [0.4] * 5  # the 5-step mean falls 0.1 below the start by step 9
    actions = drive(core, [(r, 0.1, 0.6) for r in rewards])
    fresh = [a for a in actions if a is not None]
    assert [a.kind for a in fresh] == ["fresh"] and fresh[0].step == 7  # mean 0.44: 0.06 below 0.5
    assert core.mode == "fresh" and core.strength == 1.0
    assert actions[8:] == [None, None]  # steps 8, 9 and 10 train with the fresh anchor
    more = drive(core, [(0.5, 0.1, 0.6)] * 3, start=10)
    assert [a.kind if a else None for a in more] == ["restore", None, None]
    assert core.strength == 0.2 and core.mode == "weakened"


def test_no_budget_means_suspend_and_calm_steps_recover() -> None:
    core = ControllerCore(window=5, drop_warn=0.05, recover_after=4, min_strength=0.25)
    drive(core, [(0.5, 0.1, 0.6)] * 5)
    action = core.observe(5, reward=0.0, fast_cosine=0.1, consecutive=0.6, bytes_share=2.0)  # far over the 0.5 budget
    assert action is not None and action.kind == "suspend" and core.strength == 0.0
    # a decline already acted on waits one window before acting again
    assert core.observe(6, reward=0.0, fast_cosine=0.1, consecutive=0.6, bytes_share=2.0) is None
    core.rewards = [0.6] * 5  # the reward is back: calm steps from here
    actions = [core.observe(7 + i, reward=0.6, fast_cosine=0.1, consecutive=0.6) for i in range(12)]
    kinds = [(a.kind, a.strength) for a in actions if a is not None]
    assert kinds == [("recover", 0.25), ("recover", 0.5), ("recover", 1.0)]
    assert core.mode == "normal"


def test_a_fresh_window_takes_the_densest_cadence_the_budget_affords() -> None:
    core = ControllerCore(window=5, drop_warn=0.05, fresh_steps=10, byte_budget=0.3)
    drive(core, [(0.5, 0.1, 0.6)] * 99)
    # 100 steps at 25% of dense (5% fast): a 1/1 window would end at (25 + 10 * 1.05) / 110 = 32%
    action = core.observe(99, reward=0.0, fast_cosine=0.1, consecutive=0.6, bytes_share=0.25, fast_share=0.05,
                          cadence=5)
    assert action is not None and action.kind == "fresh" and core.fresh_cadence == 2
    assert "latency/cadence 1/2" in action.reason
    core = ControllerCore(window=5, drop_warn=0.05, byte_budget=0.3)
    drive(core, [(0.5, 0.1, 0.6)] * 99)
    action = core.observe(99, reward=0.0, fast_cosine=0.1, consecutive=0.6, bytes_share=0.31, fast_share=0.05,
                          cadence=5)
    assert action is not None and action.kind == "suspend"  # even latency 1 at the recipe's cadence would pass 30%


def test_a_fast_circuit_without_signal_is_switched_once_and_its_anchor_term_turned_off() -> None:
    core = ControllerCore(window=3, drop_warn=0.05, signal_floor=0.3, signal_patience=2)
    assert core.wants_signal and core.check_signal(5, 0.45, can_switch=True) is None  # one reading: no verdict
    action = core.check_signal(10, 0.05, can_switch=True)  # mean +0.25 < 0.30
    assert action is not None and action.kind == "switch" and "mean fast_signal +0.25 over 2 anchors" in action.reason
    assert (core.switched_to, core.strength, core.mode, core.wants_signal) == ("lowrank", 0.0, "suspended", False)
    assert core.check_signal(15, 0.0, can_switch=True) is None  # once per run
    # after a switch a decline gets no fresh window (a sign override would hold the new circuit flat)
    drive(core, [(0.5, 0.1, 0.6)] * 3, start=11)
    assert drive(core, [(0.0, 0.1, 0.6)] * 3, start=14) == [None] * 3 and core.mode == "suspended"


def test_a_late_first_anchor_gets_a_signal_probe_that_leaves_the_strength_alone() -> None:
    core = ControllerCore(signal_patience=2, start_strength=0.5)
    assert core.start_probe(0, can_switch=True, latency=1) is None  # anchors come every step anyway
    assert core.start_probe(0, can_switch=False, latency=20) is None
    probe = core.start_probe(0, can_switch=True, latency=20)
    assert probe is not None and probe.kind == "probe" and (core.mode, core.fresh_left, core.fresh_cadence) == ("fresh", 3, 1)
    assert core.start_probe(0, can_switch=True, latency=20) is None  # once, before the first step
    assert core.check_signal(1, 0.6, can_switch=True) is None and core.check_signal(2, 0.5, can_switch=True) is None
    actions = drive(core, [(0.4, None, None)] * 3)
    assert [(a.kind, a.strength) for a in actions if a] == [("restore", 0.5)]
    assert (core.mode, core.probing, core.fresh_used) == ("weakened", False, 0) and core.signal_found
    core = ControllerCore(signal_patience=1)  # a switch ends the probe at once
    core.start_probe(0, can_switch=True, latency=5)
    assert core.check_signal(1, 0.0, can_switch=True).kind == "switch" and core.mode == "suspended"
    assert not core.probing and drive(core, [(0.4, None, None)] * 3) == [None] * 3


def test_a_fast_circuit_with_signal_stops_the_measuring_and_nothing_switches_where_it_cannot() -> None:
    core = ControllerCore(signal_patience=2)
    assert core.check_signal(5, 0.6, can_switch=True) is None and core.check_signal(10, 0.1, can_switch=True) is None
    assert core.signal_found and not core.wants_signal and core.switched_to is None  # mean 0.35 >= 0.30
    core = ControllerCore(signal_patience=1)
    assert core.check_signal(5, -0.2, can_switch=False) is None and core.signal_readings == []
    assert core.check_signal(5, None, can_switch=True) is None and core.wants_signal
    assert not ControllerCore(fallback_codec=None).wants_signal


def test_an_anchor_that_starts_off_earns_its_weight_through_calm_steps() -> None:
    core = ControllerCore(start_strength=0.0, recover_after=3, min_strength=0.25)
    assert (core.strength, core.mode) == (0.0, "suspended")
    actions = drive(core, [(0.4, 0.2, 0.6)] * 6)
    assert [(a.kind, a.strength) for a in actions if a] == [("recover", 0.25), ("recover", 0.5)]
    assert ControllerCore(start_strength=0.5).mode == "weakened"
    core = ControllerCore(start_strength=0.0, recover_after=3)  # steps before any anchor signal are not calm
    assert drive(core, [(0.4, None, None)] * 6) == [None] * 6 and core.strength == 0.0
    with pytest.raises(TclightningError, match="start_strength=2"):
        ControllerCore(start_strength=2)


def test_missing_or_nan_signals_are_not_stale() -> None:
    core = ControllerCore(patience=1)
    assert drive(core, [(0.4, None, None), (float("nan"), float("nan"), None)]) == [None, None]


def test_exact_resume_of_the_controller() -> None:
    gen = torch.Generator().manual_seed(1)
    signals = [(float(torch.rand(1, generator=gen)), float(torch.randn(1, generator=gen)) * 0.3, 0.5)
               for _ in range(80)]
    core = ControllerCore(window=5, drop_warn=0.05, signal_patience=3)
    drive(core, signals[:40])
    core.check_signal(20, 0.1, can_switch=True)  # a verdict half-way: the readings are state too
    buffer = io.BytesIO()
    torch.save(core.state_dict(), buffer)
    buffer.seek(0)
    resumed = ControllerCore(window=5, drop_warn=0.05, signal_patience=3)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    a, b = drive(core, signals[40:], start=40), drive(resumed, signals[40:], start=40)
    assert a == b and core.state_dict() == resumed.state_dict()
    a, b = (c.check_signal(80, 0.0, can_switch=True) for c in (core, resumed))
    assert a is None and b is None and core.state_dict() == resumed.state_dict()
    a, b = (c.check_signal(85, 0.0, can_switch=True) for c in (core, resumed))
    assert a == b and a is not None and a.kind == "switch"
    assert core.events  # the test exercised some decisions


def test_bad_thresholds_name_the_argument() -> None:
    with pytest.raises(TclightningError, match="weaken_factor=1.5"):
        AnchorController(weaken_factor=1.5)
    with pytest.raises(TclightningError, match="window=0"):
        ControllerCore(window=0)


def fake_trainer(metrics: dict[str, float], step: int) -> SimpleNamespace:
    return SimpleNamespace(callback_metrics={k: torch.tensor(v) for k, v in metrics.items()}, callbacks=[],
                           fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(_batches_that_stepped=step)),
                           global_step=step)


def test_the_callback_puts_its_decisions_into_the_anchor(recwarn: pytest.WarningsRecorder) -> None:
    anchor = Anchor(make_merger("signed_ema"), AnchorCircuit(AnchorSchedule(5, 5)))
    logged: dict[str, float] = {}
    module = SimpleNamespace(anchor=anchor, log=lambda name, value, **kw: logged.__setitem__(name, value))
    callback = AnchorController(window=2, drop_warn=0.05, fresh_steps=2, patience=1, byte_budget=0.6)
    stale = {"reward/mean": 0.5, "anchor/fast_cosine": -0.5, "anchor/consecutive_agreement": 0.6}
    callback.on_train_batch_start(fake_trainer(stale, 0), module, None, 0)
    callback.on_train_batch_end(fake_trainer(stale, 0), module, None, None, 0)
    assert anchor.strength == 0.5 and logged["anchor/controller_action"] == ACTIONS["weaken"]
    assert any("[anchor-controller] step 0: weaken" in str(w.message) for w in recwarn)
    callback.on_train_batch_end(fake_trainer({"reward/mean": 0.5}, 1), module, None, None, 1)  # start: 0.5
    falling = {"reward/mean": 0.1, "anchor/fast_cosine": 0.2, "wire/bytes_fwd": 1.0, "wire/dense_bytes_fwd": 10.0}
    callback.on_train_batch_end(fake_trainer(falling, 2), module, None, None, 2)
    assert logged["anchor/controller_action"] == ACTIONS["fresh"] and logged["anchor/controller_mode"] == 3
    assert anchor.strength == 1.0 and anchor.circuit.schedule == AnchorSchedule(1, 1)
    state = callback.state_dict()
    for step in (3, 4):
        callback.on_train_batch_end(fake_trainer({"reward/mean": 0.5}, step), module, None, None, step)
    assert anchor.circuit.schedule == AnchorSchedule(5, 5) and anchor.strength == callback.core.min_strength
    # a resumed run: a fresh anchor object (the recipe's schedule), the controller state re-applied
    anchor2 = Anchor(make_merger("signed_ema"), AnchorCircuit(AnchorSchedule(5, 5)))
    module2 = SimpleNamespace(anchor=anchor2, log=lambda *a, **k: None)
    resumed = AnchorController(window=2, drop_warn=0.05, fresh_steps=2, patience=1, byte_budget=0.6)
    resumed.load_state_dict(state)
    resumed.on_train_batch_start(fake_trainer({}, 3), module2, None, 3)
    assert anchor2.circuit.schedule == AnchorSchedule(1, 1) and anchor2.strength == 1.0
    for step in (3, 4):
        resumed.on_train_batch_end(fake_trainer({"reward/mean": 0.5}, step), module2, None, None, step)
    assert anchor2.circuit.schedule == AnchorSchedule(5, 5)
    assert resumed.core.state_dict() == callback.core.state_dict()


def test_the_callback_measures_the_fast_signal_then_switches_the_cuts(recwarn: pytest.WarningsRecorder) -> None:
    from tclightning.codecs import AdaptiveLowRankCodec, PRFCodec
    from tclightning.pipeline import CutSet, PipelineConfig
    from tests.test_distributed import tiny_llama

    anchor = Anchor(make_merger("signed_ema"), AnchorCircuit(AnchorSchedule(5, 5)))
    module = SimpleNamespace(anchor=anchor, log=lambda *a, **k: None)
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
        assert anchor.measure_fast and isinstance(cuts.boundaries[0].forward_codec, PRFCodec)
        step(1, [0.1])
        step(2, [0.0])
        assert isinstance(cuts.boundaries[0].forward_codec, AdaptiveLowRankCodec)
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

    controller = AnchorController(window=2, drop_warn=0.01, patience=1, fresh_steps=2, recover_after=2)
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
