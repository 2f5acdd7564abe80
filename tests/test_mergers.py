"""The correcting mergers (control_variate, masked, trust) on hand-made gradients, the anchor's
strength and staleness signals, exact resume, and the fast circuit at a snapshot leaving the
live codecs alone."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from tclightning.anchor import (
    Anchor,
    AnchorCircuit,
    AnchorDelivery,
    AnchorSchedule,
    ControlVariateMerger,
    MaskedMerger,
    TrustMerger,
    build_anchor,
    control_variate_merge_,
    cosine,
    make_merger,
    masked_merge_,
    trust_factor,
)
from tclightning.anchor.config import AnchorConfig
from tclightning.errors import TclightningError


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def roundtrip(state: dict) -> dict:
    """Through torch.save/torch.load, as a checkpoint would."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


# ----------------------------------------------------------------------------- control variate
def test_control_variate_is_the_dense_gradient_when_nothing_is_compressed() -> None:
    dense_now = [t(0.3, -1.2, 0.0), t(2.0, -0.5)]  # G_comp with no compression = dense gradient now
    m = [t(1.0, 1.0, -4.0), t(-3.0, 0.25)]  # the late anchor's dense gradient
    merger = ControlVariateMerger(weight=1.0, clip=0.0)
    merger.observe(m, fast=[x.clone() for x in m])  # no compression: G_hat = M on the anchor's batch
    merged = merger.merge(dense_now)
    assert all(torch.equal(a, b) for a, b in zip(merged, dense_now))


def test_control_variate_fresh_and_unbounded_steps_with_exactly_m() -> None:
    g_hat = [t(0.5, -0.25), t(1.0)]
    m = [t(2.0, 1.0), t(-1.0)]
    merger = ControlVariateMerger(weight=1.0, clip=0.0)
    merger.observe(m, fast=g_hat)
    merged = merger.merge(g_hat)  # K = 0: the fresh G_comp is the anchor's G_hat
    assert all(torch.allclose(a, b) for a, b in zip(merged, m))


def test_control_variate_bound_and_weight() -> None:
    g = [t(3.0, 4.0)]  # ||G_comp|| = 5
    c = [t(30.0, 0.0)]
    out = [x.clone() for x in g]
    ratio = control_variate_merge_(out, c, weight=1.0, clip=0.5)
    assert ratio == pytest.approx(0.5)
    assert torch.allclose(out[0], t(3.0 + 2.5, 4.0))  # correction scaled to 0.5 * 5
    out = [x.clone() for x in g]
    assert control_variate_merge_(out, [t(1.0, 0.0)], weight=0.5, clip=1.0) == pytest.approx(0.1)
    assert torch.allclose(out[0], t(3.5, 4.0))  # small corrections pass unscaled


def test_control_variate_ema_of_the_bias_and_missing_fast_gradient() -> None:
    merger = ControlVariateMerger(beta=0.5, clip=0.0)
    merger.observe([t(2.0)], fast=[t(0.0)])  # c = 2
    merger.observe([t(0.0)], fast=[t(0.0)])  # c = 0 -> c_bar = 1
    assert torch.allclose(merger.merge([t(0.0)])[0], t(1.0))
    assert merger.tick_metrics() == {"anchor/correction_ratio": 0.0}  # G_comp = 0: no ratio to report, 0
    with pytest.raises(TclightningError, match="fast circuit"):
        merger.observe([t(1.0)])


# ----------------------------------------------------------------------------- masked
def test_masked_changes_only_confident_disagreeing_coordinates() -> None:
    g = [t(1.0, -1.0, 2.0, -2.0)]
    m_bar = [t(5.0, 5.0, -0.1, -5.0)]  # rms 4.33: 0.1 is not confident; coordinate 1 disagrees
    out = [g[0].clone()]
    share = masked_merge_(out, m_bar, alpha=0.25, kappa=1.0)
    assert torch.allclose(out[0], t(1.0, 0.5, 2.0, -2.0))  # (2 alpha - 1) * -1 = 0.5 on the mask
    assert share == pytest.approx(0.25)
    merger = MaskedMerger(alpha=0.5, kappa=0.0)  # kappa 0: every disagreeing coordinate; alpha 0.5 zeroes it
    assert torch.equal(merger.merge(g)[0], g[0])  # before any M: G_comp
    merger.observe(m_bar)
    assert torch.allclose(merger.merge(g)[0], t(1.0, 0.0, 0.0, -2.0))
    assert merger.tick_metrics()["anchor/masked_frac"] == pytest.approx(0.5)


# ----------------------------------------------------------------------------- trust
def test_trust_factor() -> None:
    assert trust_factor(None, 1.0) == 0.0  # one anchor only: no trust yet
    assert trust_factor(1.0, 1.0) == 1.0
    assert trust_factor(0.75, 0.5, floor=0.5) == pytest.approx(0.25)
    assert trust_factor(0.9, -0.3) == 0.0  # a held sign against the fresh gradient gets nothing
    assert trust_factor(0.4, 0.9, floor=0.5) == 0.0


def test_trust_merger_follows_the_signals() -> None:
    g = [t(1.0, -2.0, 0.5)]
    merger = TrustMerger(alpha=0.25)
    merger.observe([t(1.0, -1.0, 1.0)])
    assert torch.equal(merger.merge(g)[0], g[0])  # first window: G_comp alone
    assert merger.tick_metrics() == {"anchor/trust": 0.0}
    merger.observe([t(1.0, -1.0, 1.0)])  # agrees with the last one: a = 1
    assert merger.consecutive == 1.0
    tau = cosine(g, [t(1.0, -1.0, 1.0)])
    expected = g[0] + tau * 0.75 * (g[0].abs() * torch.sign(t(1.0, -1.0, 1.0)) - g[0])
    assert torch.allclose(merger.merge(g)[0], expected)
    assert merger.tick_metrics()["anchor/trust"] == pytest.approx(tau)
    against = [-g[0]]  # the fresh gradient turned against the held anchor
    assert torch.equal(merger.merge(against)[0], against[0])


# ----------------------------------------------------------------------------- resume and errors
@pytest.mark.parametrize("name", ["control_variate", "masked", "trust"])
def test_exact_resume(name: str) -> None:
    gen = torch.Generator().manual_seed(0)
    shapes = [(3, 4), (5,)]

    def grads() -> list[torch.Tensor]:
        return [torch.randn(*s, generator=gen) for s in shapes]

    merger = make_merger(name, beta=0.3)
    for _ in range(3):
        merger.observe(grads(), fast=grads())
    resumed = make_merger(name, beta=0.3)
    resumed.load_state_dict(roundtrip(copy.deepcopy(merger.state_dict())))
    for _ in range(2):
        m, fast, g = grads(), grads(), grads()
        merger.observe(m, fast=fast)
        resumed.observe(m, fast=fast)
        a, b = merger.merge(g), resumed.merge(g)
        assert all(torch.equal(x, y) for x, y in zip(a, b))
        assert merger.tick_metrics() == resumed.tick_metrics()


def test_bad_merger_options_name_the_option() -> None:
    with pytest.raises(TclightningError, match="clip"):
        make_merger("control_variate", clip=-1.0)
    with pytest.raises(TclightningError, match="kappa"):
        make_merger("masked", kappa=-0.1)
    with pytest.raises(TclightningError, match="floor"):
        make_merger("trust", floor=1.0)
    with pytest.raises(TclightningError, match="control_variate, masked, trust"):
        make_merger("bogus")


def test_build_anchor_passes_the_recipe_options() -> None:
    anchor = build_anchor(AnchorConfig(merger="control_variate", cv_weight=0.5, cv_clip=0.25, beta=0.1))
    assert anchor is not None and isinstance(anchor.merger, ControlVariateMerger)
    assert (anchor.merger.weight, anchor.merger.clip, anchor.merger.beta) == (0.5, 0.25, 0.1)
    anchor = build_anchor(AnchorConfig(merger="masked", mask_kappa=2.0))
    assert anchor is not None and anchor.merger.kappa == 2.0
    anchor = build_anchor(AnchorConfig(merger="trust", trust_floor=0.6))
    assert anchor is not None and anchor.merger.floor == 0.6


# ----------------------------------------------------------------------------- the Anchor object
def params_with(grads: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    return params


def test_anchor_strength_scales_the_anchor_term() -> None:
    g, m = [t(1.0, -2.0)], [t(-1.0, -1.0)]
    full = make_merger("signed_ema", alpha=0.25)
    full.observe(m)
    merged = full.merge(g)[0]
    for strength, expected in ((0.0, g[0]), (0.5, (g[0] + merged) / 2), (1.0, merged)):
        anchor = Anchor(make_merger("signed_ema", alpha=0.25))
        anchor.strength = strength
        params = params_with(g)
        anchor.merge_(params, 0, m)
        assert torch.allclose(params[0].grad, expected)


def test_anchor_signals_and_fast_gradient() -> None:
    calls: list[str] = []

    def dense(job):  # noqa: ANN001, ANN202
        calls.append("dense")
        return [t(1.0, 1.0)], 10.0

    def fast(job):  # noqa: ANN001, ANN202
        calls.append("fast")
        return [t(1.0, 0.0)], 2.0

    anchor = Anchor(make_merger("control_variate", clip=0.0), AnchorCircuit(AnchorSchedule(1, 1)))
    with pytest.raises(TclightningError, match="fast_gradient"):
        anchor.tick(0, first=True, parameters=lambda: [torch.zeros(2)], payload=lambda: None, gradient=dense)
    anchor = Anchor(make_merger("control_variate", clip=0.0), AnchorCircuit(AnchorSchedule(1, 1)))
    anchor.begin_step()
    anchor.tick(0, first=True, parameters=lambda: [torch.zeros(2)], payload=lambda: None, gradient=dense,
                fast_gradient=fast)
    assert calls == []  # recorded, due next tick
    anchor.tick(1, first=True, parameters=lambda: [torch.zeros(2)], payload=lambda: None, gradient=dense,
                fast_gradient=fast)
    assert calls == ["dense", "fast"] and anchor.step_metrics["anchor/bytes"] == 12.0
    params = params_with([t(0.0, 2.0)])
    anchor.merge_(params, 1, anchor.pop_delivery())
    assert torch.allclose(params[0].grad, t(0.0, 3.0))  # G_comp + (M - G_hat)
    signals = anchor.signal_metrics()
    assert signals["anchor/fast_cosine"] == pytest.approx(cosine([t(0.0, 2.0)], [t(1.0, 1.0)]))
    assert "anchor/consecutive_agreement" not in signals and signals["anchor/strength"] == 1.0
    params = params_with([t(0.0, 2.0)])
    anchor.merge_(params, 2, AnchorDelivery([t(-1.0, 1.0)], snapshot_tick=1, fast=[t(0.0, 0.0)]))
    assert anchor.signal_metrics()["anchor/consecutive_agreement"] == 0.5  # (1, 1) vs (-1, 1)
    resumed = Anchor(make_merger("control_variate", clip=0.0), AnchorCircuit(AnchorSchedule(1, 1)))
    resumed.load_state_dict(roundtrip(anchor.state_dict()))
    assert resumed.signal_metrics() == anchor.signal_metrics()


# ----------------------------------------------------------------------------- the fast circuit at a snapshot
def _setup(layout: str, codec: str):  # noqa: ANN202
    from tests.test_distributed import rollouts, tiny_llama

    from tclightning.backend import BackendRequest
    from tclightning.grpo.logprobs import completion_logps
    from tclightning.pipeline import CutSet, LocalBackend, PipelineConfig

    model = tiny_llama()
    cuts = CutSet(model, PipelineConfig(stages=2, layout=layout, codec=codec, k=5, fill="mean"))
    backend = LocalBackend(BackendRequest(model, 1.0, completion_logps, lambda loss: loss.backward()), cuts)
    batch = rollouts()

    def loss_fn(logp: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return (logp * batch.completion_mask[rows]).sum() / batch.completion_mask.sum()

    return model, cuts, backend, batch, loss_fn


def test_the_fast_pass_at_a_snapshot_leaves_the_live_codecs_and_counters_alone() -> None:
    model, cuts, backend, batch, loss_fn = _setup("all", "prf")
    backend.begin_step(3)
    backend.forward_backward(batch, loss_fn)  # the live circuit: fills and counters move
    snapshot = [p.detach().clone() for p in backend.owned_parameters()]
    grads = [p.grad.clone() for p in backend.owned_parameters()]
    state, wire = copy.deepcopy(cuts.state_dict()), cuts.metrics()
    fast, sent = backend.compressed_forward_backward(snapshot, batch, loss_fn)
    assert sent > 0
    assert cuts.metrics() == wire
    after = cuts.state_dict()
    assert after["step"] == state["step"]
    for a, b in zip(after["forward"], state["forward"]):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]) if isinstance(a[key], torch.Tensor) else a[key] == b[key]
    assert all(torch.equal(p.grad, g) for p, g in zip(backend.owned_parameters(), grads))
    # it is the fast circuit's gradient: the live policy's own compressed pass at the same weights
    model.zero_grad(set_to_none=True)
    backend.forward_backward(batch, loss_fn)
    live = [p.grad for p in backend.owned_parameters()]
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(fast, live))
    dense, _ = backend.dense_forward_backward(snapshot, batch, loss_fn)
    assert cosine(fast, dense) < 0.999  # compression changes it


def test_the_fast_pass_without_compression_is_the_dense_pass() -> None:
    _, _, backend, batch, loss_fn = _setup("dense", "prf")
    snapshot = [p.detach().clone() for p in backend.owned_parameters()]
    fast, _ = backend.compressed_forward_backward(snapshot, batch, loss_fn)
    dense, _ = backend.dense_forward_backward(snapshot, batch, loss_fn)
    assert all(torch.equal(a, b) for a, b in zip(fast, dense))


def test_the_recipe_check_refuses_what_cannot_run() -> None:
    from tclightning.errors import RecipeError
    from tclightning.recipes.loader import load_recipe

    with pytest.raises(RecipeError, match=r"'control_variate' runs the compressed circuit.*trainer.devices"):
        load_recipe("robust-5-5", ["trainer.devices=2"])
    with pytest.raises(RecipeError, match=r"trust merges a compressed trainer's gradient"):
        load_recipe("tiny", ["anchor.merger=trust"])
    with pytest.raises(RecipeError, match="anchor.trust_floor"):
        load_recipe("robust-5-5", ["anchor.trust_floor=1.0"])
    load_recipe("robust-5-5", ["trainer.devices=2", "anchor.merger=trust"])  # per coordinate: fine across processes
