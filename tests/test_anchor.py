"""The anchor circuit's pieces: mergers, projectors, schedule and circuit, and the AnchorMerge callback."""

from __future__ import annotations

import copy
import itertools
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from tclightning.anchor import (
    AnchorCircuit,
    AnchorSchedule,
    DampedLinearProjector,
    Rank1Projector,
    SignedEMAMerger,
    Stage,
    cpu_snapshot,
    ema_update,
    make_merger,
    make_projector,
    sign_agreement,
    signed_ema_merge,
    staleness_factor,
    top_direction,
)
from tclightning.callbacks.anchor_merge import AnchorDelivery, AnchorMerge, AnchorSource
from tclightning.errors import TclightningError


def t(*values: float) -> Tensor:
    return torch.tensor(values, dtype=torch.float32)


# ----------------------------------------------------------------------------- mergers
def test_signed_ema_formula_signs_and_magnitudes() -> None:
    g = [t(2.0, -3.0, 1.0, -1.0, 0.0), t(4.0)]
    m = [t(5.0, 7.0, -0.1, 0.0, 9.0), t(-1.0)]
    out = signed_ema_merge(g, m, alpha=0.25)
    # agree: 0.25*2 + 0.75*2 = 2; disagree: 0.25*-3 + 0.75*3 = 1.5; sign(M)=0: 0.25*g; G_comp=0: 0
    assert torch.allclose(out[0], t(2.0, 1.5, -0.5, -0.25, 0.0))
    assert torch.allclose(out[1], t(-2.0))  # 0.25*4 - 0.75*4
    # alpha=1 gives G_comp; alpha=0 gives |G_comp| sign(M)
    assert all(torch.equal(a, b) for a, b in zip(signed_ema_merge(g, m, 1.0), g))
    assert torch.allclose(signed_ema_merge(g, m, 0.0)[0], t(2.0, 3.0, -1.0, 0.0, 0.0))
    # magnitudes never grow
    assert all((o.abs() <= x.abs() + 1e-7).all() for o, x in zip(out, g))


def test_signed_ema_merger_first_m_and_beta_memory() -> None:
    merger = SignedEMAMerger(alpha=0.25, beta=0.5)
    g = [t(1.0, -2.0, 3.0)]
    # before any M: G = G_comp, no sign agreement
    assert torch.equal(merger.merge(g)[0], g[0])
    assert merger.sign_agreement(g) is None
    merger.observe([t(1.0, 1.0, -4.0)])
    assert torch.equal(merger.m_bar[0], t(1.0, 1.0, -4.0))  # first M initialises M_bar = M
    merger.observe([t(-3.0, 2.0, 2.0)])
    assert torch.allclose(merger.m_bar[0], t(-1.0, 1.5, -1.0))  # 0.5*M_bar + 0.5*M
    assert torch.allclose(merger.merge(g)[0], t(0.25 - 0.75, -0.5 + 1.5, 0.75 - 2.25))
    assert merger.sign_agreement(g) == pytest.approx(0.0)  # every sign differs
    # beta=0: M_bar is the newest M alone
    fresh = SignedEMAMerger(alpha=0.25, beta=0.0)
    fresh.observe([t(1.0, 1.0, 1.0)])
    fresh.observe([t(-1.0, 2.0, -3.0)])
    assert torch.equal(fresh.m_bar[0], t(-1.0, 2.0, -3.0))
    # in place equals out of place
    grads = [g[0].clone()]
    merger.merge_(grads)
    assert torch.allclose(grads[0], merger.merge(g)[0])


def test_ema_update_and_sign_agreement() -> None:
    assert torch.allclose(ema_update([t(2.0, 0.0)], [t(0.0, 4.0)], 0.25)[0], t(0.5, 3.0))
    assert sign_agreement([t(1.0, -1.0, 2.0, 0.0)], [t(3.0, 1.0, 5.0, 0.0)]) == pytest.approx(0.75)
    with pytest.raises(TclightningError):
        sign_agreement([t(1.0)], [t(1.0, 2.0)])


def test_none_merger() -> None:
    g = [t(1.0, -2.0)]
    none = make_merger("none")
    none.observe([t(5.0, 5.0)])
    assert torch.equal(none.merge(g)[0], g[0]) and not none.needs_anchor
    with pytest.raises(TclightningError):
        make_merger("median")
    with pytest.raises(TclightningError):
        SignedEMAMerger(alpha=1.5)


def test_merger_state_round_trip() -> None:
    a = make_merger("signed_ema", alpha=0.25, beta=0.9, projector="damped_linear", gamma=0.5)
    a.observe([t(1.0, -1.0)], snapshot_tick=0, tick=5)
    a.observe([t(-2.0, 3.0)], snapshot_tick=5, tick=10)
    b = make_merger("signed_ema", alpha=0.25, beta=0.9, projector="damped_linear", gamma=0.5)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    g = [t(0.3, 0.2)]
    for tick in (11, 12):
        assert torch.equal(a.merge(g, tick=tick)[0], b.merge(g, tick=tick)[0])


# ----------------------------------------------------------------------------- projectors
def test_damped_linear_projector_formula() -> None:
    assert staleness_factor(10, 5, 0) == pytest.approx(1.0)
    assert staleness_factor(12, 10, 5, max_factor=0.2) == pytest.approx(0.2)
    merger = make_merger("signed_ema", beta=0.0, projector="damped_linear", gamma=0.5)
    merger.observe([t(1.0, 1.0)], snapshot_tick=0, tick=5)
    assert torch.equal(merger.m_hat(tick=5)[0], t(1.0, 1.0))  # one anchor: nothing to extrapolate
    merger.observe([t(0.5, 2.0)], snapshot_tick=5, tick=10)
    # delta = (-0.5, 1); s(10) = (10-5)/(5-0) = 1; s(12) = 7/5
    assert torch.allclose(merger.m_hat(tick=10)[0], t(0.5 - 0.25, 2.0 + 0.5))
    assert torch.allclose(merger.m_hat(tick=12)[0], t(0.5 - 0.25 * 1.4, 2.0 + 0.5 * 1.4))
    # extrapolation can flip the sign the merger uses
    proj = DampedLinearProjector(gamma=1.0)
    proj.observe([t(0.1)], [t(1.0)], snapshot_tick=10, tick=10)
    proj.observe([t(0.1)], [t(1.0)], snapshot_tick=10, tick=10)  # t0_prev = t0: no interval
    assert torch.equal(proj.project([t(0.1)], tick=20)[0], t(0.1))


def test_rank1_projector_extrapolates_only_along_the_trajectory_line() -> None:
    proj = make_projector("rank1", gamma=1.0, window=4)
    assert isinstance(proj, Rank1Projector)
    # weights move along e0 (a line), so u = e0
    for tick in range(4):
        proj.observe_weights([t(float(tick), 0.0), t(0.0)], tick)
    u = proj.direction()
    assert u is not None and torch.allclose(u, t(1.0, 0.0, 0.0), atol=1e-6)
    m_prev, m_new = [t(1.0, 1.0), t(1.0)], [t(3.0, -2.0), t(5.0)]
    proj.observe(m_prev, None, snapshot_tick=0, tick=2)
    proj.observe(m_new, m_prev, snapshot_tick=2, tick=4)
    out = proj.project(m_new, tick=4)  # s = (4-2)/(2-0) = 1; delta = (2, -3, 4); u.delta = 2
    assert torch.allclose(out[0], t(5.0, -2.0)) and torch.allclose(out[1], t(5.0))
    # the window keeps the last `window` snapshots only
    for tick in range(4, 10):
        proj.observe_weights([t(float(tick), 0.0), t(0.0)], tick)
    assert proj.snapshot_ticks == [6, 7, 8, 9]
    assert torch.allclose(top_direction([t(0.0, 0.0), t(0.0, 2.0), t(0.0, 4.0)]), t(0.0, 1.0))


def test_projector_state_round_trip() -> None:
    a = Rank1Projector(gamma=0.5, window=3)
    for tick in range(3):
        a.observe_weights([t(float(tick), float(tick) ** 2)], tick)
    a.observe([t(1.0, 1.0)], None, snapshot_tick=0, tick=1)
    a.observe([t(2.0, -1.0)], [t(1.0, 1.0)], snapshot_tick=1, tick=2)
    b = Rank1Projector(gamma=0.5, window=3)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    assert torch.equal(a.project([t(2.0, -1.0)], tick=3)[0], b.project([t(2.0, -1.0)], tick=3)[0])
    with pytest.raises(TclightningError):
        make_projector("damped_linear", window=3)


# ----------------------------------------------------------------------------- schedule and circuit
def test_fixed_schedule() -> None:
    s = AnchorSchedule(latency=20, cadence=20)
    assert s.at(0) == (20, 20) and s.at(10_000) == (20, 20)
    assert s.memory_bound() == 2
    assert AnchorSchedule(latency=5, cadence=2).memory_bound() == 3
    assert AnchorSchedule(latency=0, cadence=1).memory_bound() == 1
    with pytest.raises(TclightningError):
        AnchorSchedule(latency=5, cadence=0)


def test_la_warmup_schedule_steps_up_geometrically() -> None:
    s = AnchorSchedule(latency=20, cadence=20, warmup="la_warmup", warmup_ticks=100)
    assert s.stages() == [Stage(0, 1, 1), Stage(20, 2, 2), Stage(40, 4, 4), Stage(60, 8, 8), Stage(80, 16, 16),
                          Stage(100, 20, 20)]
    assert s.at(0) == (1, 1) and s.at(19) == (1, 1) and s.at(20) == (2, 2) and s.at(99) == (16, 16)
    assert s.at(100) == (20, 20)
    # cadence keeps the final ratio, stage 0 is always 1/1
    assert AnchorSchedule(latency=20, cadence=5, warmup="la_warmup", warmup_ticks=50).stages()[0] == Stage(0, 1, 1)
    assert AnchorSchedule(latency=20, cadence=5, warmup="la_warmup", warmup_ticks=50).at(50) == (20, 5)


@pytest.mark.parametrize(
    "schedule",
    [
        AnchorSchedule(5, 5),
        AnchorSchedule(20, 20),
        AnchorSchedule(7, 3),
        AnchorSchedule(4, 1),
        AnchorSchedule(0, 2),
        AnchorSchedule(20, 20, "la_warmup", 100),
        AnchorSchedule(20, 5, "la_warmup", 60),
        AnchorSchedule(20, 20, "la_warmup", 30),
    ],
)
def test_circuit_cadence_latency_and_memory_bound(schedule: AnchorSchedule) -> None:
    circuit = AnchorCircuit(schedule)
    weights = torch.zeros(3)
    recorded: dict[int, Tensor] = {}
    delivered: list[tuple[int, int]] = []
    most = 0
    for tick in range(260):
        weights = weights + torch.randn(3)  # the update of each tick changes the weights
        job = circuit.maybe_record(tick, lambda weights=weights: [weights.clone()], payload={"rollouts_of": tick})
        if job is not None:
            recorded[tick] = weights.clone()
        most = max(most, len(circuit.pending))
        for job in circuit.due(tick):
            # instrumented: M for tick `tick` is computed at theta(tick - K) on the rollouts of theta(tick - K)
            assert job.due_tick == tick == job.tick + job.latency
            assert job.latency == schedule.latency_at(job.tick)
            assert torch.equal(job.snapshot[0], recorded[job.tick])
            assert job.payload == {"rollouts_of": job.tick}
            delivered.append((job.tick, tick))
        assert len(circuit.pending) <= max(math.ceil(st.latency / st.cadence) for st in schedule.stages())
    assert most <= circuit.memory_bound()
    ticks = sorted(recorded)
    assert ticks[0] == 0
    for a, b in itertools.pairwise(ticks):  # cadence respected: C(b) ticks between records
        assert b - a == schedule.cadence_at(b)
    assert circuit.recorded == len(ticks) and circuit.delivered == len(delivered)
    if schedule.warmup == "none":
        assert most == schedule.latency // schedule.cadence + 1 == circuit.memory_bound()  # the bound is tight


def test_circuit_state_round_trip_mid_flight() -> None:
    schedule = AnchorSchedule(5, 2)

    def drive(circuit: AnchorCircuit, ticks: range) -> list[tuple[int, int, list[Tensor], Any]]:
        out = []
        for tick in ticks:
            w = torch.full((2,), float(tick))
            circuit.maybe_record(tick, lambda w=w: [w, w * 2], payload={"ids": torch.arange(tick + 1)})
            out += [(job.tick, tick, job.snapshot, job.payload) for job in circuit.due(tick)]
        return out

    whole = drive(AnchorCircuit(schedule), range(30))
    first = AnchorCircuit(schedule)
    head = drive(first, range(13))
    assert first.pending  # mid-flight
    state = copy.deepcopy(first.state_dict())
    torch.save(state, buf := __import__("io").BytesIO())
    buf.seek(0)
    resumed = AnchorCircuit(schedule)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    tail = drive(resumed, range(13, 30))
    assert len(head + tail) == len(whole)
    for (t0a, ta, sa, pa), (t0b, tb, sb, pb) in zip(whole, head + tail):
        assert (t0a, ta) == (t0b, tb)
        assert all(torch.equal(x, y) for x, y in zip(sa, sb))
        assert torch.equal(pa["ids"], pb["ids"])
    assert resumed.recorded == AnchorCircuit(schedule).recorded + 15 and resumed.metrics(29) == {
        "anchor/latency": 5.0, "anchor/cadence": 2.0}
    assert cpu_snapshot([nn.Parameter(torch.ones(2))])[0].requires_grad is False


# ----------------------------------------------------------------------------- AnchorMerge on a plain module
class PlainModule(pl.LightningModule):
    """A Linear regression whose anchor is the dense gradient at a K-tick-old snapshot on that tick's batch.

    Its "fast circuit" gradient is the plain gradient on a noisy copy of the batch (a stand-in
    for a compressed forward). It implements the AnchorSource protocol.
    """

    def __init__(self, latency: int = 2, cadence: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 1)
        self.circuit = AnchorCircuit(AnchorSchedule(latency, cadence))
        self._new: AnchorDelivery | None = None
        self.seen_agreement: list[float] = []

    def anchor_parameters(self) -> list[nn.Parameter]:
        return list(self.layer.parameters())

    def pop_anchor_gradient(self) -> AnchorDelivery | None:
        new, self._new = self._new, None
        return new

    def anchor_metrics(self) -> dict[str, float]:
        return self.circuit.metrics(self.global_step)

    def _dense_gradient(self, snapshot: list[Tensor], batch: tuple[Tensor, Tensor]) -> list[Tensor]:
        clone = copy.deepcopy(self.layer)  # hook-free dense clone loaded with the snapshot
        with torch.no_grad():
            for p, w in zip(clone.parameters(), snapshot):
                p.copy_(w)
        x, y = batch
        loss = nn.functional.mse_loss(clone(x), y)
        return list(torch.autograd.grad(loss, list(clone.parameters())))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        tick = self.global_step
        batch = _batch(tick)  # by tick, not from the loader: resume must not depend on loader state
        self.circuit.maybe_record(tick, lambda: cpu_snapshot(self.anchor_parameters()), payload=batch)
        for job in self.circuit.due(tick):
            self._new = AnchorDelivery(self._dense_gradient(job.snapshot, job.payload), snapshot_tick=job.tick)
        x, y = batch
        noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(1000 + tick)) * 0.5
        return nn.functional.mse_loss(self.layer(x + noise), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["anchor_circuit"] = self.circuit.state_dict()
        checkpoint["anchor_new"] = self._new

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.circuit.load_state_dict(checkpoint["anchor_circuit"])
        self._new = checkpoint["anchor_new"]


def _batch(tick: int, size: int = 8) -> tuple[Tensor, Tensor]:
    x = torch.randn(size, 4, generator=torch.Generator().manual_seed(tick))
    return x, x @ t(1.0, -2.0, 0.5, 3.0).unsqueeze(1) + 0.1


def _data() -> DataLoader:
    x = torch.zeros(64, 1)  # placeholders: the modules draw their batch from the tick
    return DataLoader(TensorDataset(x, x), batch_size=8, shuffle=False)


def _trainer(root: Path, steps: int, callbacks: list[pl.Callback]) -> pl.Trainer:
    return pl.Trainer(
        default_root_dir=root, max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, num_sanity_val_steps=0,
    )


class Spy(pl.Callback):
    """Records the gradients the optimizer steps with (after AnchorMerge ran)."""

    def __init__(self) -> None:
        self.grads: list[list[Tensor]] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.grads.append([p.grad.clone() for p in pl_module.anchor_parameters()])


def test_anchor_merge_on_a_plain_module(tmp_path: Path) -> None:
    module = PlainModule(latency=2, cadence=2)
    assert isinstance(module, AnchorSource)
    merge, spy, none_spy = AnchorMerge("signed_ema", alpha=0.25, beta=0.0), Spy(), Spy()
    _trainer(tmp_path, 6, [merge, spy]).fit(module, _data())
    assert merge.ticks == 6 and merge.anchors == 2  # jobs of ticks 0 and 2 arrive at ticks 2 and 4
    assert 0.0 <= float(module.trainer.callback_metrics["anchor/sign_agreement"]) <= 1.0
    assert float(module.trainer.callback_metrics["anchor/latency"]) == 2.0
    # fast-only control: same module, merger none
    plain = PlainModule(latency=2, cadence=2)
    _trainer(tmp_path, 6, [AnchorMerge("none"), none_spy]).fit(plain, _data())
    # ticks 0-1: no M yet, G = G_comp; from tick 2 the merged gradient has |G| <= |G_comp| and differs
    assert all(torch.equal(a, b) for a, b in zip(spy.grads[0], none_spy.grads[0]))
    assert all(torch.equal(a, b) for a, b in zip(spy.grads[1], none_spy.grads[1]))
    assert not all(torch.equal(a, b) for a, b in zip(spy.grads[2], none_spy.grads[2]))


def test_anchor_merge_requires_the_protocol(tmp_path: Path) -> None:
    class NoAnchor(PlainModule):
        anchor_parameters = None  # type: ignore[assignment]

    with pytest.raises(TclightningError, match="anchor_parameters"):
        _trainer(tmp_path, 1, [AnchorMerge()]).fit(NoAnchor(), _data())


def test_anchor_merge_refuses_a_module_that_merges_its_own_anchor(tmp_path: Path) -> None:
    from tclightning.anchor import Anchor

    class OwnAnchor(PlainModule):  # as GRPOModule: its update loop merges self.anchor
        def __init__(self) -> None:
            super().__init__()
            self.anchor = Anchor(make_merger("signed_ema"))

    with pytest.raises(TclightningError, match="merges its own anchor.*remove the AnchorMerge callback"):
        _trainer(tmp_path, 1, [AnchorMerge()]).fit(OwnAnchor(), _data())


@pytest.mark.parametrize("projector", ["none", "damped_linear", "rank1"])
def test_anchor_merge_resume_matches_uninterrupted(tmp_path: Path, projector: str) -> None:
    options = {"gamma": 0.5} if projector != "none" else {}

    def callback() -> AnchorMerge:
        return AnchorMerge("signed_ema", alpha=0.25, beta=0.5, projector=projector, projector_options=options)

    whole = PlainModule(latency=3, cadence=2)
    whole_merge = callback()
    _trainer(tmp_path / "a", 8, [whole_merge]).fit(whole, _data())

    first = PlainModule(latency=3, cadence=2)
    trainer = _trainer(tmp_path / "b", 5, [callback()])
    trainer.fit(first, _data())
    assert first.circuit.pending  # killed with anchor work in flight
    ckpt = tmp_path / "mid.ckpt"
    trainer.save_checkpoint(ckpt)

    resumed = PlainModule(latency=3, cadence=2)
    resumed_merge = callback()
    _trainer(tmp_path / "b", 8, [resumed_merge]).fit(resumed, _data(), ckpt_path=ckpt)
    for a, b in zip(whole.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    assert resumed_merge.anchors == whole_merge.anchors
    assert all(torch.equal(a, b) for a, b in zip(resumed_merge.merger.m_bar, whole_merge.merger.m_bar))


class ManualModule(PlainModule):
    """Manual optimisation with two optimizer ticks per training step (as GRPO does)."""

    def __init__(self) -> None:
        super().__init__(latency=1, cadence=1)
        self.automatic_optimization = False

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        opt = self.optimizers()
        for _ in range(2):
            loss = super().training_step(batch, batch_idx)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()


class AgreementSpy(pl.Callback):
    def __init__(self, merge: AnchorMerge) -> None:
        self.merge = merge
        self.per_step: list[list[float]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.per_step.append(list(self.merge.anchor.agreement))  # runs before AnchorMerge's own hook


def test_sign_agreement_is_averaged_over_the_ticks_of_a_step(tmp_path: Path) -> None:
    merge = AnchorMerge("signed_ema")
    spy = AgreementSpy(merge)
    module = ManualModule()
    _trainer(tmp_path, 6, [spy, merge]).fit(module, _data())  # max_steps counts ticks
    assert merge.ticks == 6  # 3 RL steps x 2 ticks (global_step counts ticks)
    last = spy.per_step[-1]
    assert len(last) == 2
    assert float(module.trainer.callback_metrics["anchor/sign_agreement"]) == pytest.approx(sum(last) / 2)


@pytest.mark.parametrize("edit", [
    lambda state: state["pending"][0].__setitem__("due_tick", 10**30),
    lambda state: state["pending"][0].__setitem__("latency", -1),
    lambda state: state["pending"].append(copy.deepcopy(state["pending"][0])),
    lambda state: state.__setitem__("last_record_tick", 0),
], ids=["never-due", "negative-latency", "one-tick-twice", "recorded-after-the-last-record"])
def test_an_anchor_circuit_state_whose_schedule_no_run_writes_is_one_line(edit) -> None:  # noqa: ANN001
    """A pending job due at tick 10^30 was never delivered, one listed three times was delivered three
    times: each resumed without a word."""
    saved = AnchorCircuit(AnchorSchedule(latency=5, cadence=5))
    for tick in range(7):
        saved.maybe_record(tick, lambda: [torch.zeros(2)])
    state = copy.deepcopy(saved.state_dict())
    AnchorCircuit(AnchorSchedule(latency=5, cadence=5)).load_state_dict(copy.deepcopy(state))  # as saved: taken
    edit(state)
    with pytest.raises(TclightningError, match="anchor circuit state is not one tclightning writes"):
        AnchorCircuit(AnchorSchedule(latency=5, cadence=5)).load_state_dict(state)
