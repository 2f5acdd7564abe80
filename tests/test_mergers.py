"""The correcting merger (control_variate) on hand-made gradients, the anchor's
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
    build_anchor,
    control_variate_merge_,
    cosine,
    make_merger,
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


# ----------------------------------------------------------------------------- resume and errors
@pytest.mark.parametrize("name", ["control_variate", "signed_ema"])
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
    with pytest.raises(TclightningError, match="choose one of none, signed_ema, control_variate"):
        make_merger("bogus")
    for retired in ("dense", "masked", "trust"):
        with pytest.raises(TclightningError, match=f"{retired} was tried and retired"):
            make_merger(retired)


def test_build_anchor_passes_the_recipe_options() -> None:
    anchor = build_anchor(AnchorConfig(merger="control_variate", control_variate={"weight": 0.5, "clip": 0.25}, beta=0.1))
    assert anchor is not None and isinstance(anchor.merger, ControlVariateMerger)
    assert (anchor.merger.weight, anchor.merger.clip, anchor.merger.beta) == (0.5, 0.25, 0.1)


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


def test_the_anchor_saves_none_of_the_settings_its_controller_owns() -> None:
    anchor = Anchor(make_merger("signed_ema"), AnchorCircuit(AnchorSchedule(5, 5)))
    anchor.strength, anchor.measure_fast = 0.5, True  # what an anchor controller puts in before a step
    anchor.circuit.schedule = AnchorSchedule(1, 1)
    state = roundtrip(anchor.state_dict())
    assert not {"strength", "measure_fast"} & state.keys() and "schedule" not in state["circuit"]
    resumed = Anchor(make_merger("signed_ema"), AnchorCircuit(AnchorSchedule(5, 5)))
    resumed.load_state_dict({**state, "strength": 0.25, "measure_fast": True})  # an older checkpoint's keys
    assert (resumed.strength, resumed.measure_fast, resumed.circuit.schedule) == (1.0, False, AnchorSchedule(5, 5))


# ----------------------------------------------------------------------------- the fast circuit at a snapshot
def _setup(layout: str, codec: str):  # noqa: ANN202
    from tests.test_distributed import rollouts, tiny_llama

    from tclightning.backend import BackendRequest
    from tclightning.models.logprobs import completion_logps
    from tclightning.pipeline import CutSet, LocalBackend, PipelineConfig

    model = tiny_llama()
    cuts = CutSet(model, PipelineConfig(stages=2, layout=layout, codec=codec, k=5, entropy_coding=False))
    backend = LocalBackend(BackendRequest(model, 1.0, completion_logps, lambda loss: loss.backward()), cuts)
    batch = rollouts()

    def loss_fn(logp: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return (logp * batch.completion_mask[rows]).sum() / batch.completion_mask.sum()

    return model, cuts, backend, batch, loss_fn


def _same(a: object, b: object) -> bool:
    """Equal codec states: nested dicts and lists of tensors and plain values."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[key], b[key]) for key in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_the_fast_pass_at_a_snapshot_leaves_the_live_codecs_and_counters_alone() -> None:
    model, cuts, backend, batch, loss_fn = _setup("all", "lowrank")
    backend.begin_step(3)
    backend.forward_backward(batch, loss_fn)  # the cold start: dense, both sides fold it in
    backend.begin_step(4)  # fits the basis
    model.zero_grad(set_to_none=True)
    backend.forward_backward(batch, loss_fn)  # the live circuit: its basis statistics and counters move
    snapshot = [p.detach().clone() for p in backend.owned_parameters()]
    grads = [p.grad.clone() for p in backend.owned_parameters()]
    state, wire = copy.deepcopy(cuts.state_dict()), cuts.metrics()
    fast, sent = backend.compressed_forward_backward(snapshot, batch, loss_fn)
    assert sent > 0
    assert cuts.metrics() == wire
    after = cuts.state_dict()
    assert after["step"] == state["step"]
    assert after["forward"][0]["basis"] is not None and _same(after["forward"], state["forward"])
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
    with pytest.raises(RecipeError, match=r"signed_ema merges a compressed trainer's gradient"):
        load_recipe("tiny", ["anchor.merger=signed_ema"])
    with pytest.raises(RecipeError, match="anchor.merger"):
        load_recipe("robust-5-5", ["anchor.merger=trust"])  # retired
    with pytest.raises(RecipeError, match="anchor.trust_floor"):
        load_recipe("robust-5-5", ["anchor.trust_floor=0.6"])  # the retired merger's key is unknown now
    load_recipe("robust-5-5", ["trainer.devices=2", "anchor.merger=signed_ema"])  # per coordinate: fine across processes


def test_an_earlier_record_with_the_retired_mergers_keys_still_resumes_and_exports(tmp_path) -> None:  # noqa: ANN001
    import yaml
    from omegaconf import OmegaConf

    from tclightning.recipes.loader import load_recipe, validate_checkpoint_hparams
    from tclightning.run import resume_changes

    cfg = load_recipe("robust-5-5")
    record = OmegaConf.to_container(cfg)
    record["anchor"].update(mask_kappa=1.0, trust_floor=0.5)  # what an earlier version recorded
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(record))
    assert resume_changes(tmp_path, cfg, 5) == ()
    record["anchor"]["merger"] = "trust"  # a run of a retired merger cannot continue
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(record))
    with pytest.raises(TclightningError, match="key 'anchor.merger' was 'trust'"):
        resume_changes(tmp_path, cfg, 5)
    hparams = {name: record[name] for name in ("model", "task", "sampler", "grpo")}
    validate_checkpoint_hparams({**hparams, "anchor": {"merger": "none", "mask_kappa": 1.0, "trust_floor": 0.5}}, "ckpt")
