"""Pure detector logic (no Lightning): rules, episodes, state, and the acceptance figures on traces."""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import numpy as np
import pytest

from tclightning.health import (
    EntropyRule,
    GapLevelRule,
    GapTrendRule,
    GradNormSpikeRule,
    HealthDetector,
    HealthState,
    LengthFeedbackRule,
    RewardDeadRule,
    RewardDropRule,
    replay,
)
from tclightning.health.history import MetricHistory, robust_sigma, window_mean_noise
from tclightning.health.traces import COLLAPSE_TRACES, agentic_gap, stable


def test_detector_module_has_no_lightning_import():
    from tclightning.health import detector, history, rules, traces

    for module in (detector, history, rules, traces):
        source = Path(module.__file__).read_text()
        assert "lightning" not in source.replace("tclightning", ""), module.__name__



def test_no_module_of_the_health_package_imports_lightning():
    import tclightning.health

    root = Path(tclightning.health.__file__).parent
    sources = sorted(root.rglob("*.py"))
    assert root / "rules" / "gap.py" in sources  # the rules package is walked too
    for path in sources:
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
        assert not imported & {"lightning", "pytorch_lightning", "lightning_utilities"}, path


def test_families_take_thresholds_and_default_rules_holds_each_rule_once():
    from tclightning.health.rules import (
        GAP_METRICS,
        LENGTH_METRICS,
        NonFiniteRule,
        default_rules,
        gap_rules,
        length_rules,
        outcome_rules,
    )

    everything = [repr(r) for r in default_rules()]
    assert everything == [repr(r) for r in (*outcome_rules(), *length_rules(), *gap_rules())]
    assert len(set(everything)) == len(everything)
    length = length_rules(12, 0.1, 0.3, 0.07, 0.4, nonfinite=True)
    assert isinstance(length[0], NonFiniteRule) and length[0].metrics == LENGTH_METRICS
    assert [r.name for r in length[1:]] == [r.name for r in length_rules()]
    feedback, drift, truncation, coupling = length[1:]
    assert (feedback.window, feedback.growth_warn, drift.growth_warn) == (12, 0.1, 0.3)
    assert (truncation.rise_warn, truncation.level_collapse, coupling.window) == (0.07, 0.4, 12)
    gap = gap_rules(0.3, 0.1, 0.4, 12, nonfinite=True, coupling=True)
    assert isinstance(gap[0], NonFiniteRule) and gap[0].metrics == GAP_METRICS
    assert [(r.name, r.inputs) for r in gap[1:]] == [
        ("gap.level", ("gap/abs_mean",)),
        ("gap.level", ("gap/k3",)),
        ("gap.trend", ("gap/abs_mean",)),
        ("length.gap_coupling", ("response/length_mean", "gap/abs_mean")),
    ]
    assert (gap[1].band, gap[2].band, gap[3].rise_warn, gap[3].window, gap[4].window) == (0.3, 0.1, 0.4, 12, 12)

def test_history_merges_same_step_and_keeps_head():
    h = MetricHistory(max_points=8, head_points=3)
    h.add(0, {"a": 1.0})
    h.add(0, {"b": 5.0})
    h.add(0, {"a": 2.0})  # replaces step 0's value
    for step in range(1, 40):
        h.add(step, {"a": float(step), "x": float("nan")})
    assert h.count("a") == 40 and list(h.head("a")) == [2.0, 1.0, 2.0]
    assert h.values("a").size <= 16 and h.latest("a") == 39.0
    assert not h.has("x") and math.isnan(h.last_update["x"])  # NaN never enters a series
    steps, both = h.aligned(["a", "b"], 10)
    assert steps.size == 0 and both.shape == (0, 2)


def test_noise_estimates_match_white_noise():
    rng = np.random.default_rng(0)
    x = rng.normal(0, 2.0, 4000)
    assert robust_sigma(x) == pytest.approx(2.0, rel=0.05)
    assert window_mean_noise(x, 10) == pytest.approx(2.0 / math.sqrt(10), rel=0.1)


def test_nonfinite_is_collapsing_at_once():
    d = HealthDetector()
    assert d.update(0, {"loss/policy": 1.0}).state == HealthState.HEALTHY
    v = d.update(1, {"loss/policy": float("inf")})
    assert v.state == HealthState.COLLAPSING and v.findings[0].rule == "nonfinite"
    assert d.first_collapse_step == 1 and d.first_warning_step == 1
    json.dumps(d.summary(), allow_nan=False)  # the NaN/Inf value becomes null


def test_nonfinite_guard_counters_collapse_and_a_skipped_step_is_one_finding():
    from tclightning.health.rules import NonFiniteRule

    d = HealthDetector([NonFiniteRule()])
    assert d.update(0, {"policy/skipped_ticks": 0.0, "policy/skipped_step": 0.0}).state == HealthState.HEALTHY
    v = d.update(1, {"policy/skipped_ticks": 2.0, "policy/skipped_step": 0.0})
    assert v.state == HealthState.COLLAPSING and [f.metric for f in v.findings] == ["policy/skipped_ticks"]
    # a step skipped whole logs NaN for what it did not measure: one finding, on the counter
    skipped = {"policy/skipped_step": 1.0, "reward/mean": math.nan, "loss/policy": math.nan}
    v = HealthDetector([NonFiniteRule()]).update(5, skipped)
    assert [(f.metric, f.severity) for f in v.findings] == [("policy/skipped_step", HealthState.COLLAPSING)]
    # a rule restricted to other metrics (the length and gap monitors) stays quiet on that step
    assert HealthDetector([NonFiniteRule(["reward/mean"])]).update(5, skipped).state == HealthState.HEALTHY


def test_length_growth_with_flat_reward_warns_but_paid_growth_does_not():
    rng = np.random.default_rng(1)
    rule = LengthFeedbackRule()
    flat, paid = HealthDetector([rule]), HealthDetector([LengthFeedbackRule()])
    for t in range(40):
        length = 500 * (1.02 ** max(0, t - 10))
        noise = rng.normal(0, 0.02)
        flat.update(t, {"response/length_mean": length, "reward/mean": 0.5 + noise})
        paid.update(t, {"response/length_mean": length, "reward/mean": 0.3 + 0.01 * t + noise})
    assert flat.state == HealthState.WARNING and flat.findings[0].rule == "length.feedback"
    assert "stays flat" in flat.findings[0].message
    assert paid.state == HealthState.HEALTHY


def test_reward_drop_needs_more_than_noise_and_escalates_below_start():
    rng = np.random.default_rng(2)
    d = HealthDetector([RewardDropRule()])
    states = []
    for t in range(120):
        level = 0.4 + 0.2 * min(t, 60) / 60 - (0.012 * (t - 80) if t > 80 else 0.0)
        states.append(d.update(t, {"reward/mean": level + rng.normal(0, 0.03)}).state)
    assert max(states[:80]) == HealthState.HEALTHY
    # a fall from the peak must last peak_steps=5 steps (healthy real runs dip for 4-6): 95 here
    assert d.first_warning_step is not None and 80 < d.first_warning_step <= 95
    assert d.first_collapse_step is not None and d.first_collapse_step > d.first_warning_step


def _batches(values, sem=0.045):
    """Per-step rows as the GRPO module logs them: the batch mean and its own standard error."""
    return [{"reward/mean": v, "reward/sem": sem} for v in values]


def test_reward_fall_at_the_batch_error_decides_in_two_steps():
    """A fall of 0.2 at se 0.045 is over 4 se a step: warned on the second low step, called
    collapsing once the 3-step mean is 0.15 below the start (the fall the library scores)."""
    d = HealthDetector([RewardDropRule()])
    rows = _batches([0.40, 0.38, 0.42, 0.40, 0.39, 0.41, 0.40, 0.20, 0.18, 0.20, 0.19])
    states = [d.update(t, m).state for t, m in enumerate(rows)]
    assert max(states[:8]) == HealthState.HEALTHY
    assert states[8] == HealthState.WARNING and states[9] == HealthState.COLLAPSING
    finding = d.findings[0]
    assert "below its start 0.398" in finding.message and "standard error" in finding.message
    assert finding.values["evidence"] >= 8.0


def test_one_bad_batch_never_warns_alone():
    """A heavy tail of single bad batches (seen near the ceiling in healthy runs) does not decide:
    one step's evidence is capped at what a step exactly at the fallen level gives."""
    d = HealthDetector([RewardDropRule()])
    values = [0.40] * 10 + [0.0] + [0.40] * 10 + [0.05] + [0.40] * 10
    assert all(d.update(t, m).state == HealthState.HEALTHY for t, m in enumerate(_batches(values)))


def test_reward_error_from_std_and_count_when_no_sem():
    """A trainer that logs reward/std and reward/count: the error is std / sqrt(count) from step 1."""
    d = HealthDetector([RewardDropRule()])
    rows = [{"reward/mean": v, "reward/std": 0.5, "reward/count": 128.0}
            for v in [0.4, 0.4, 0.4, 0.4, 0.4, 0.15, 0.15, 0.15]]
    states = [d.update(t, m).state for t, m in enumerate(rows)]
    assert states[5] == HealthState.HEALTHY and states[6] >= HealthState.WARNING
    assert states[7] == HealthState.COLLAPSING


def test_a_run_that_breaks_at_once_collapses_by_its_fall():
    """Reward 0.34 then nothing (grpo.lr=1e3): the fall of the library's definition is step 3."""
    d = HealthDetector()
    states = [d.update(t, m).state for t, m in enumerate(_batches([0.34, 0.0, 0.0, 0.0], sem=0.046))]
    assert states[3] == HealthState.COLLAPSING


def test_accuracy_drop_uses_the_binomial_error_and_needs_two_evaluations():
    rule = RewardDropRule.for_accuracy()
    d = HealthDetector([rule])
    assert d.update(0, {"val/accuracy": 0.92, "val/count": 128.0}).state == HealthState.HEALTHY
    # one evaluation far below never decides alone (held-out accuracy wanders between evaluations)
    assert d.update(50, {"val/accuracy": 0.05, "val/count": 128.0}).state == HealthState.HEALTHY
    v = d.update(100, {"val/accuracy": 0.04, "val/count": 128.0})
    assert v.state == HealthState.COLLAPSING and v.findings[0].rule == "accuracy.drop"


def test_state_dict_of_the_drop_rule_resumes_exactly():
    values = [0.4, 0.42, 0.38, 0.41, 0.4, 0.39, 0.3, 0.25, 0.22, 0.2, 0.4, 0.41]
    whole = HealthDetector([RewardDropRule()])
    for t, m in enumerate(_batches(values)):
        whole.update(t, m)
    first = HealthDetector([RewardDropRule()])
    for t, m in enumerate(_batches(values[:7])):
        first.update(t, m)
    second = HealthDetector([RewardDropRule()])
    second.load_state_dict(json.loads(json.dumps(first.state_dict())))
    for t, m in enumerate(_batches(values[7:]), start=7):
        second.update(t, m)
    assert second.summary() == whole.summary()


def test_information_findings_are_reported_and_leave_the_state_alone():
    """A rising gap is information: an ``info`` event in the timeline, never a warning state."""
    d = HealthDetector([GapTrendRule()])
    for t in range(30):
        v = d.update(t, {"gap/abs_mean": 0.16 if t < 10 else 0.30})
    assert d.state == HealthState.HEALTHY and d.first_warning_step is None
    fired = [e for e in d.events if e.kind == "fired"]
    assert [(e.rule, e.severity) for e in fired] == [("gap.trend", "info")]
    assert v.reasons.startswith("[info] gap.trend:")


def test_gap_above_the_band_warns_only_when_it_was_there_from_the_start():
    later = HealthDetector([GapLevelRule()])
    for t in range(20):
        later.update(t, {"gap/abs_mean": 0.2 if t < 10 else 0.7})
    assert later.state == HealthState.HEALTHY and later.findings[0].severity == HealthState.HEALTHY
    # a compressed run whose first step is a dense cold start (gap 0), then at full size
    early = HealthDetector([GapLevelRule()])
    states = [early.update(t, {"gap/abs_mean": g}).state for t, g in enumerate([0.0, 0.7, 0.7, 0.7])]
    assert states[-1] == HealthState.WARNING and "since the start" in early.findings[0].message


def test_entropy_collapse_paid_by_reward_is_learning_not_collapse():
    def run(reward_gain):
        d = HealthDetector([EntropyRule()])
        for t in range(60):
            d.update(t, {"policy/entropy": 0.9 if t < 10 else 0.02,
                         "reward/mean": 0.4 + (reward_gain if t >= 10 else 0.0) + 0.01 * (-1) ** t})
        return d.state
    assert run(reward_gain=0.5) == HealthState.HEALTHY  # deterministic and right: learned
    assert run(reward_gain=0.0) == HealthState.COLLAPSING  # deterministic for nothing


def test_reward_dead_and_grad_spikes_collapse():
    d = HealthDetector([RewardDeadRule(), GradNormSpikeRule()])
    for t in range(10):
        d.update(t, {"reward/mean": 0.3, "policy/grad_norm": 1.0})
    assert d.update(10, {"reward/mean": 0.0, "policy/grad_norm": 30.0}).state == HealthState.WARNING
    d.update(11, {"reward/mean": 0.0, "policy/grad_norm": 1.0})
    v = d.update(12, {"reward/mean": 0.0, "policy/grad_norm": 1.0})
    assert v.state == HealthState.COLLAPSING and "reward.dead" in v.reasons


def test_gap_full_size_before_first_update():
    d = HealthDetector([GapLevelRule()])
    v = d.update(0, {"gap/abs_mean": 0.61})
    assert v.state == HealthState.WARNING and "before any update" in v.findings[0].message
    assert [e.kind for e in v.events] == ["fired"]
    assert HealthDetector([GapLevelRule()]).update(0, {"gap/abs_mean": 0.006}).state == HealthState.HEALTHY


def test_episodes_warn_once_and_clear_with_hysteresis():
    d = HealthDetector([GapLevelRule(window=1)], clear_after=3)
    kinds = []
    for t, gap in enumerate([0.6, 0.6, 0.1, 0.6, 0.1, 0.1, 0.1, 0.1]):
        kinds += [(t, e.kind) for e in d.update(t, {"gap/abs_mean": gap}).events]
    assert kinds == [(0, "fired"), (6, "cleared"), (6, "recovered")]
    assert d.state == HealthState.HEALTHY


def test_state_dict_round_trip_resumes_identically():
    trace = COLLAPSE_TRACES["late-collapse"](3)
    whole = replay(trace.rows)
    first = HealthDetector()
    for step, metrics in trace.rows[:150]:
        first.update(step, metrics)
    state = json.loads(json.dumps(first.state_dict()))  # plain types only
    second = HealthDetector()
    second.load_state_dict(state)
    for step, metrics in trace.rows[150:]:
        second.update(step, metrics)
    assert second.summary() == whole.summary()


@pytest.mark.parametrize("name", ["late-collapse", "stale-anchor-ratchet"])
def test_acceptance_warning_at_least_10_steps_before_accuracy_below_start(name):
    for seed in range(8):
        trace = COLLAPSE_TRACES[name](seed)
        result = replay(trace.rows)
        assert result.first_warning_step is not None and trace.collapse_step is not None
        assert trace.collapse_step - result.first_warning_step >= 10, (seed, result.first_warning_step)
        assert result.first_collapse_step is not None  # and it does call the collapse


def test_agentic_trace_warns_at_step_zero_and_dense_control_stays_healthy():
    for seed in range(5):
        result = replay(agentic_gap(seed).rows)
        assert result.first_warning_step == 0 and result.first_collapse_step is not None
        assert replay(agentic_gap(seed, dense=True).rows).first_warning_step is None


def test_stable_traces_never_collapse_and_rarely_warn():
    warned = 0
    for seed in range(20):
        for gap in ("dense", "prf"):
            result = replay(stable(10_000 + seed, gap=gap).rows)
            assert result.first_collapse_step is None
            fired = {e.rule for e in result.events if e.kind == "fired"} - {"gap.level"}
            warned += bool(fired)
    assert warned <= 2  # measured on 200 seeds: see docs/health.md


def test_length_message_names_only_what_grew_with_token_counts():
    """Only the longest answers grow: the message says so with the counts, no "+0%" beside it."""
    from tclightning.health.rules import LengthFeedbackRule

    detector = HealthDetector([LengthFeedbackRule()])
    for step in range(20):
        detector.update(step, {"response/length_mean": 100.0, "response/length_max": 200.0 if step < 10 else 270.0,
                               "reward/mean": 0.5})
    (finding,) = detector.findings
    assert "longest response 200 -> 270 tokens (+35%)" in finding.message
    assert "+0%" not in finding.message and "mean response length" not in finding.message
    assert "last 10 steps with the 10 before" in finding.message


def test_reward_dead_asks_whether_chance_explains_the_zero_steps():
    """A run at a mean reward of 0.04 with 32 completions a step loses whole batches by chance (a
    quarter of them): three zero steps there are not a collapse. At 0.34 with 128 they are."""
    def rows(values, count):
        return [{"reward/mean": v, "reward/count": count, "reward/sem": 0.035} for v in values]

    low = HealthDetector([RewardDeadRule()])
    states = [low.update(t, m).state for t, m in enumerate(rows([0.0, 0.031, 0.031, 0.062, 0.031, 0.0, 0.0, 0.0], 32.0))]
    assert max(states) == HealthState.HEALTHY
    high = HealthDetector([RewardDeadRule()])
    states = [high.update(t, m).state for t, m in enumerate(rows([0.34, 0.30, 0.0, 0.0, 0.0], 128.0))]
    assert states[3] == HealthState.HEALTHY and states[4] == HealthState.COLLAPSING
    assert "chance" in high.findings[0].message
    # a trainer that logs no count: the plain rule, three zero steps after a reward
    plain = HealthDetector([RewardDeadRule()])
    states = [plain.update(t, {"reward/mean": v}).state for t, v in enumerate([0.03, 0.0, 0.0, 0.0])]
    assert states[3] == HealthState.COLLAPSING


def test_reward_dead_resumes_with_its_level():
    rule = RewardDeadRule()
    d = HealthDetector([rule])
    for t, v in enumerate([0.34, 0.30, 0.0]):
        d.update(t, {"reward/mean": v, "reward/count": 128.0})
    resumed = RewardDeadRule()
    resumed.load_state_dict(rule.state_dict())
    assert resumed.state_dict() == rule.state_dict()
