"""Quantised coefficients in the ``lowrank`` codec (``pipeline.bits``): the rank the byte budget
buys, the exact bytes, the forward quantisation formula, the unbiased and keyed stochastic rounding
of the gradient message, float coefficients unchanged without bits, one process against two, and
resume."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tclightning.bench.launch import run_ranks
from tclightning.codecs import (
    QUANT_BITS,
    AdaptiveLowRankCodec,
    CodecKey,
    budget_k,
    make_codec,
    quantised_rank,
)
from tclightning.codecs.lowrank import (
    ceil_bfloat16,
    gradient_uniforms,
    levels,
    pack_quantised,
    quantise_coefficients,
    quantised_bytes,
    stochastic_quantise,
    unpack_quantised,
)
from tclightning.errors import TclightningError
from tclightning.models.logprobs import completion_logps
from tclightning.pipeline import CutSet, PipelineConfig
from tclightning.pipeline.layout import cut_codec, resolve_layout
from tests.test_distributed import ADVANTAGES, LOSS, rollouts, tiny_llama

KEY = CodecKey(seed=3, step=1, cut=2)


def fitted(dim: int = 32, rank: int = 4, bits: int | None = 4, tokens: int = 400, token_slots: int = 0,
           seed: int = 0, lead: bool = False) -> tuple[AdaptiveLowRankCodec, torch.Tensor]:
    """A codec fitted on ``tokens`` random activations (with a few heavy channels), and those activations."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, dim, generator=gen) * torch.linspace(0.1, 3.0, dim) + torch.randn(dim, generator=gen)
    codec = AdaptiveLowRankCodec(dim, rank, bits=bits, token_slots=token_slots, lead=lead)
    codec.observe_dense(x)
    codec.fit_shared(1)
    return codec, x


# ------------------------------------------------------------------ the budget and the bytes
@pytest.mark.parametrize("lead", [False, True], ids=["scale", "scale-and-lead"])
@pytest.mark.parametrize("bits", QUANT_BITS)
@pytest.mark.parametrize(("dim", "rate", "dtype"), [(576, 0.05, None), (576, 0.05, "bfloat16"),
                                                    (64, 0.08, None), (128, 0.05, "float16"), (32, 0.5, None)])
def test_the_rank_follows_from_the_budget_and_the_bytes_are_exact_and_within_it(
        bits: int, dim: int, rate: float, dtype: str | None, lead: bool) -> None:
    config = PipelineConfig(layout="all", stages=2, codec="lowrank", rate=rate, bits=bits, payload_dtype=dtype,
                            bits_lead=lead)
    spec = resolve_layout(config, 4, dim)[0]
    codec = cut_codec(config, spec, dim)
    assert isinstance(codec, AdaptiveLowRankCodec)
    value = 2 if dtype else 4
    k = budget_k(dim, rate=rate)
    budget = k * value
    rank = min(dim, 1 + (budget * 8 - 32) // bits) if lead else min(dim, (budget * 8 - 16) // bits)
    assert codec.rank == rank == quantised_rank(budget, bits, dim, lead) and codec.bits == bits
    assert codec.lead == lead
    assert codec.payload_bytes(7, torch.float32) == 7 * dim * 4  # the cold start crosses dense
    x = torch.randn(300, dim)
    codec.observe_dense(x)
    codec.fit_shared(1)
    assert codec.width == rank and codec.basis is not None and codec.basis.shape == (dim, rank)
    for tokens in (0, 1, 13, 1000):
        for dtype_seen in (torch.float32, torch.bfloat16):  # packed: whatever the float tensor's dtype
            got = codec.payload_bytes(tokens, dtype_seen)
            packed = math.ceil((rank - 1) * bits / 8) + 4 if lead else math.ceil(rank * bits / 8) + 2
            assert got == tokens * packed == tokens * quantised_bytes(rank, bits, lead)
            assert got <= tokens * budget
    assert codec.wire_dtype is None  # fitted and quantised: the payload is not cast


def test_bits_is_checked_by_name_and_only_lowrank_takes_it() -> None:
    for bad in (1, 5, 16, "4", True):
        with pytest.raises(TclightningError, match="pipeline.bits"):
            PipelineConfig(codec="lowrank", bits=bad).validate()  # type: ignore[arg-type]
    with pytest.raises(TclightningError, match="pipeline.bits=4 .*only codec 'lowrank'"):
        PipelineConfig(codec="prf", bits=4).validate()
    with pytest.raises(TclightningError, match="pipeline.bits=4 .*not 'svd'"):
        PipelineConfig(layout="explicit", cut_codecs=["lowrank", "svd"], stages=3, bits=4).validate()
    PipelineConfig(layout="explicit", cut_codecs=["lowrank", "identity"], bits=4).validate()
    with pytest.raises(ValueError, match="only the lowrank"):
        make_codec("prf", 64, k=4, bits=4)
    with pytest.raises(ValueError, match="buys no"):
        make_codec("lowrank", 64, k=1, bits=8, value_bytes=2)  # 16 bits: the scale alone
    with pytest.raises(ValueError, match="buys no"):
        make_codec("lowrank", 64, k=1, bits=8, bits_lead=True)  # 32 bits: the scale and the lead
    with pytest.raises(TclightningError, match="pipeline.bits_lead .*needs pipeline.bits"):
        PipelineConfig(codec="lowrank", bits_lead=True).validate()


# ------------------------------------------------------------------ the forward
@pytest.mark.parametrize("bits", QUANT_BITS)
def test_decode_of_encode_is_the_quantisation_formula(bits: int) -> None:
    codec, x = fitted(bits=bits)
    assert codec.basis is not None and codec.mean is not None
    fresh = x[:50] * 1.5
    fresh[3] = codec.mean  # a token on its centre: scale 0, all coefficients 0
    c = (fresh - codec.mean) @ codec.basis
    top = 2 ** (bits - 1) - 1
    scale = (c.abs().amax(-1, keepdim=True) / top).half().float()
    q = torch.round(c / torch.where(scale > 0, scale, 1.0)).clamp(-top, top)
    payload = codec.encode(fresh, KEY)
    assert torch.equal(payload, q * scale)
    # the payload holds integer multiples of a float16 scale per token, within the levels
    held = payload / torch.where(scale > 0, scale, 1.0)
    assert torch.equal(held, held.round()) and held.abs().max() <= top and held.abs().amax(-1).max() == top
    assert torch.equal(scale.half().float(), scale) and torch.equal(payload[3], torch.zeros(4))
    assert torch.equal(codec.decode(payload, KEY), codec.mean + payload @ codec.basis.T)
    # quantising again changes nothing: q s is on its own grid
    assert torch.equal(quantise_coefficients(payload, bits), payload)


@pytest.mark.parametrize("bits", QUANT_BITS)
def test_with_a_lead_the_first_coefficient_crosses_in_float16_and_the_rest_take_their_own_scale(bits: int) -> None:
    codec, x = fitted(bits=bits, rank=6, lead=True)
    assert codec.basis is not None and codec.mean is not None
    fresh = x[:40] * 3
    c = (fresh - codec.mean) @ codec.basis
    payload = codec.encode(fresh, KEY)
    assert torch.equal(payload[:, 0], c[:, 0].half().float())
    assert torch.equal(payload[:, 1:], quantise_coefficients(c[:, 1:], bits))
    assert torch.equal(quantise_coefficients(c, bits, lead=True), payload)
    assert torch.equal(codec.decode(payload, KEY), codec.mean + payload @ codec.basis.T)
    # a dominant first direction no longer sets the step of the others
    lopsided = c.clone()
    lopsided[:, 0] *= 1000
    plain = quantise_coefficients(lopsided, bits)
    led = quantise_coefficients(lopsided, bits, lead=True)
    assert (led[:, 1:] - lopsided[:, 1:]).abs().mean() < (plain[:, 1:] - lopsided[:, 1:]).abs().mean() / 2
    # backward: the lead's gradient rounded to bfloat16, the rest stochastically
    g = torch.randn(40, 6) * 1e-3
    u = gradient_uniforms(KEY, g.shape)
    sent = stochastic_quantise(g, bits, u, lead=True)
    assert torch.equal(sent[:, 0], g[:, 0].bfloat16().float())
    assert torch.equal(sent[:, 1:], stochastic_quantise(g[:, 1:], bits, u[:, 1:]))


def test_more_bits_reconstruct_better_and_the_token_centres_path_quantises_too() -> None:
    errors = []
    for bits in (2, 3, 4, 8, None):
        codec, x = fitted(bits=bits, rank=8)
        errors.append(float((codec.decode(codec.encode(x, KEY), KEY) - x).pow(2).mean()))
    assert errors == sorted(errors, reverse=True) and errors[-2] < errors[-1] * 1.01  # 8 bits ~ float
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 5, (600,), generator=gen)
    x = torch.randn(5, 32, generator=gen)[ids] * 4 + torch.randn(600, 32, generator=gen) * 0.1
    codec = AdaptiveLowRankCodec(32, 6, bits=4, token_slots=8)
    codec.observe_dense(x, ids)
    codec.fit_shared(1)
    assert codec.token_ids is not None and codec.basis is not None
    payload = codec.encode(x, KEY, token_ids=ids)
    c = codec.centred(x, ids) @ codec.basis
    torch.testing.assert_close(payload, quantise_coefficients(c, 4), rtol=0, atol=0)
    decoded = codec.decode(payload, KEY, token_ids=ids)
    torch.testing.assert_close(decoded, codec.centred(torch.zeros_like(x), ids).neg() + payload @ codec.basis.T)


# ------------------------------------------------------------------ the backward message
def test_the_bfloat16_scale_rounds_up_to_the_next_bfloat16() -> None:
    x = torch.tensor([0.0, 1.0, 1.0 + 2**-10, 3e-12, 1e30, 2.0**-130])
    up = ceil_bfloat16(x)
    assert torch.equal(up.bfloat16().float(), up) and bool((up >= x).all())
    assert up[1] == 1.0 and up[2] == 1.0 + 2**-7 and up[0] == 0.0


@pytest.mark.parametrize("bits", QUANT_BITS)
def test_stochastic_rounding_is_exactly_unbiased_on_a_grid_of_uniforms(bits: int) -> None:
    """The mean of ``q s`` over the uniforms ``(i + 1/2) / N`` is the gradient to within ``s / N``
    (the grid is a deterministic stand-in for the draws)."""
    gen = torch.Generator().manual_seed(bits)
    g = torch.randn(3, 16, generator=gen) * torch.tensor([[1e-7], [1.0], [300.0]])  # float16 could not hold 1e-7
    draws = 1000
    grid = ((torch.arange(draws) + 0.5) / draws)[:, None, None].expand(draws, 3, 16)
    q = stochastic_quantise(g.expand(draws, 3, 16), bits, grid)
    scale = ceil_bfloat16(g.abs().amax(-1, keepdim=True) / levels(bits))
    held = q / scale
    assert torch.equal(held, held.round()) and held.abs().max() <= levels(bits)
    assert bool(((q.mean(0) - g).abs() <= scale / draws * 1.01).all())


def test_the_keyed_draws_are_unbiased_and_the_same_key_gives_the_same_message() -> None:
    gen = torch.Generator().manual_seed(5)
    g = torch.randn(2, 3, 24, generator=gen) * torch.tensor([[[1e-6]], [[2.0]]])
    bits, draws = 4, 4000
    rng = torch.random.get_rng_state()
    total = torch.zeros_like(g)
    for step in range(draws):
        total += stochastic_quantise(g, bits, gradient_uniforms(CodecKey(seed=3, step=step, cut=2), g.shape))
    assert torch.equal(torch.random.get_rng_state(), rng)  # the global RNG is never touched
    scale = ceil_bfloat16(g.abs().amax(-1, keepdim=True) / levels(bits))
    # each draw lies in an interval of width s around g: Hoeffding puts a deviation of s / 8 of the
    # mean of 4000 draws at probability 2 exp(-2 * 4000 / 64) ~ 1e-54 per coefficient
    assert bool(((total / draws - g).abs() <= scale / 8).all())
    one = gradient_uniforms(KEY, torch.Size([5, 7, 3]))
    assert torch.equal(one, gradient_uniforms(KEY, torch.Size([5, 7, 3])))
    assert not torch.equal(one, gradient_uniforms(CodecKey(seed=3, step=2, cut=2), torch.Size([5, 7, 3])))
    assert not torch.equal(one, gradient_uniforms(CodecKey(seed=3, step=1, cut=3), torch.Size([5, 7, 3])))
    # keyed by the global row: a micro-batch of rows 2..4 draws what the whole batch drew there
    shifted = CodecKey(seed=3, step=1, cut=2, row_offset=2)
    assert torch.equal(gradient_uniforms(shifted, torch.Size([3, 7, 3])), one[2:5])
    assert bool((one >= 0).all() and (one < 1).all())


def test_the_gradient_message_is_quantised_where_it_leaves_the_receiver() -> None:
    codec, x = fitted(bits=4)
    assert codec.basis is not None
    messages = []
    for _ in range(2):
        leaf = x[:30].clone().requires_grad_(True)
        payload = codec.encode(leaf.view(3, 10, 32), KEY)
        payload.retain_grad()
        out = codec.decode(payload, KEY)
        upstream = torch.linspace(-1, 1, out.numel()).view_as(out)
        (out * upstream).sum().backward()
        assert payload.grad is not None and leaf.grad is not None
        exact = upstream @ codec.basis  # the float message
        expected = stochastic_quantise(exact, 4, gradient_uniforms(KEY, exact.shape))
        torch.testing.assert_close(payload.grad, expected, rtol=0, atol=1e-6)
        # straight through the forward rounding: the sender's gradient is the message times U^T
        torch.testing.assert_close(leaf.grad.view(3, 10, 32), payload.grad @ codec.basis.T)
        messages.append(payload.grad.clone())
    assert torch.equal(messages[0], messages[1])


# ------------------------------------------------------------------ the packed messages
@pytest.mark.parametrize("lead", [False, True], ids=["scale", "scale-and-lead"])
@pytest.mark.parametrize("bits", QUANT_BITS)
def test_both_messages_pack_into_exactly_the_bytes_counted_and_unpack_to_the_same_values(bits: int,
                                                                                       lead: bool) -> None:
    codec, x = fitted(bits=bits, rank=7, lead=lead)  # 7 coefficients: a row ends inside a byte
    assert codec.basis is not None and codec.mean is not None
    top = levels(bits)
    payload = codec.encode(x[:25] * 2, KEY)
    rest = payload[:, 1:] if lead else payload
    scale = (((x[:25] * 2 - codec.mean) @ codec.basis)[:, int(lead):].abs().amax(-1, keepdim=True) / top).half()
    q = (rest / scale.float()).round()
    assert torch.equal(q * scale.float(), rest)
    packed = pack_quantised(q, scale, bits, payload[:, :1] if lead else None)
    assert packed.dtype == torch.uint8 and packed.shape == (25, quantised_bytes(7, bits, lead))
    assert packed.numel() == codec.payload_bytes(25, torch.float32)
    q_back, scale_back, first = unpack_quantised(packed, 7, bits, torch.float16, lead)
    values = q_back * scale_back.float()
    assert torch.equal(torch.cat([first.float(), values], 1) if first is not None else values, payload)
    # the gradient message: bfloat16 scale (and lead), stochastic levels
    g = torch.randn(25, 7) * 1e-4
    sent = stochastic_quantise(g, bits, gradient_uniforms(KEY, g.shape), lead)
    g_rest, sent_rest = (g[:, 1:], sent[:, 1:]) if lead else (g, sent)
    g_scale = ceil_bfloat16(g_rest.abs().amax(-1, keepdim=True) / top).bfloat16()
    q = sent_rest / g_scale.float()
    assert torch.equal(q, q.round()) and q.abs().max() <= top
    packed = pack_quantised(q, g_scale, bits, sent[:, :1] if lead else None)
    assert packed.shape == (25, quantised_bytes(7, bits, lead))
    q_back, scale_back, first = unpack_quantised(packed, 7, bits, torch.bfloat16, lead)
    values = q_back * scale_back.float()
    assert torch.equal(torch.cat([first.float(), values], 1) if first is not None else values, sent)


# ------------------------------------------------------------------ without bits: as before
def test_without_bits_the_codec_computes_exactly_the_float_coefficients() -> None:
    """The float path's formula, written out: ``(x - c) U`` and ``c + payload U^T``, the
    gradient ``g U``; bytes ``r * 4`` a token; the wire dtype as set."""
    for slots in (0, 16):
        gen = torch.Generator().manual_seed(7)
        ids = torch.randint(0, 12, (400,), generator=gen)
        x = torch.randn(400, 32, generator=gen) * torch.linspace(0.1, 3.0, 32) + ids[:, None].float()
        codec = AdaptiveLowRankCodec(32, 5, token_slots=slots)
        assert codec.bits is None
        codec.observe_dense(x, ids)
        codec.fit_shared(1)
        assert codec.basis is not None and codec.mean is not None
        codec.wire_dtype = torch.bfloat16
        assert codec.wire_dtype == torch.bfloat16 and codec.width == 5
        assert codec.payload_bytes(9, torch.bfloat16) == 9 * 5 * 2
        leaf = x.clone().requires_grad_(True)
        payload = codec.encode(leaf, KEY, token_ids=ids)
        centres = codec.mean + (codec.offsets(ids, x) if slots else 0.0)
        assert torch.equal(payload, (x - centres) @ codec.basis) if not slots else \
            torch.equal(payload, ((-centres).add_(x)) @ codec.basis)
        payload.retain_grad()
        out = codec.decode(payload, KEY, token_ids=ids)
        if slots:
            assert torch.equal(out, torch.addmm(centres, payload, codec.basis.T))
        else:
            assert torch.equal(out, codec.mean + payload @ codec.basis.T)
        upstream = torch.randn(out.shape, generator=gen)
        (out * upstream).sum().backward()
        assert torch.equal(payload.grad, upstream @ codec.basis)  # type: ignore[arg-type]


# ------------------------------------------------------------------ one process, two processes, resume
CONFIG = {"layout": "all", "stages": 2, "codec": "lowrank", "k": 5, "bits": 4, "microbatches": 3}
# k = 5 float32 values = 20 bytes buy r = (160 - 16) / 4 = 36 at 4 bits (20 bytes a token), or, with
# the lead, r = 1 + (160 - 32) / 4 = 33 (ceil(32 * 4 / 8) + 4 = 20 bytes)
RANKS = {False: 36, True: 33}
TOKEN_BYTES = 20


def loss_fn_for(batch: Any) -> Any:
    from tclightning.grpo.update import MicrobatchLoss

    return MicrobatchLoss(old_logp=None, advantages=ADVANTAGES, mask=batch.completion_mask,
                          logp_sampler=batch.logp_sampler, ref_logp=None, settings=LOSS, norm_length=4)


def one_process_quantised(setup: dict[str, Any]) -> dict[str, Any]:
    """Step 0 (cold start, dense), step 1 (fitted, quantised): loss, grads by name, bytes.
    ``setup``: :class:`PipelineConfig` keys over :data:`CONFIG`'s."""
    model = tiny_llama()
    batch = rollouts()
    with CutSet(model, PipelineConfig(**{**CONFIG, **setup})) as cuts:
        cuts.set_step(0)
        completion_logps(model, batch)
        cold = cuts.metrics()
        cuts.set_step(1)
        cuts.reset_stats()
        logp, _ = completion_logps(model, batch)
        loss_fn = loss_fn_for(batch)
        loss_fn(logp, torch.arange(batch.num_sequences)).backward()
        metrics = cuts.metrics()
        rank = cuts.boundaries[0].codec.rank
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss_fn.stats["loss/policy"], "grads": grads, "logp": logp.detach(), "wire": metrics, "rank": rank,
            "cold": cold}


def quantised_worker(rank: int, world_size: int, setup: dict[str, Any]) -> dict[str, Any]:
    import tclightning.codecs.lowrank as lowrank
    from tclightning.pipeline.engine import PipelineEngine, StageInputs, no_loss

    # the test batch's 42 tokens are under the 8 d an entropy-coded first fit waits for (this
    # worker process only; the tests in-process monkeypatch it)
    lowrank.FIT_TOKENS_PER_CHANNEL = 0
    model = tiny_llama()
    names = {id(p): name for name, p in model.named_parameters()}
    engine = PipelineEngine(model, PipelineConfig(**{**CONFIG, **setup}, timeout_s=30))
    batch = rollouts()
    inputs = StageInputs.from_rollouts(batch)
    engine.set_step(0)
    engine.run(inputs)
    cold = engine.metrics()
    engine.set_step(1)
    engine.reset_stats()
    loss_fn = loss_fn_for(batch) if engine.is_last else no_loss
    logp, _ = engine.run(inputs, loss_fn)
    engine.reduce_tied_gradients()
    grads = {names[id(p)]: p.grad.clone() for p in engine.owned_parameters() if p.grad is not None}
    return {"loss": loss_fn.stats["loss/policy"] if engine.is_last else None, "grads": grads, "logp": logp,
            "wire": engine.metrics(), "state": engine.cut_state_dict(), "setup": setup,
            "cold": cold}


def assert_same_loss_and_gradients(first: dict[str, Any], last: dict[str, Any], ref: dict[str, Any]) -> None:
    """Two ranks' :func:`quantised_worker` results give the one process's loss, log-probs and every gradient."""
    assert last["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-7)
    torch.testing.assert_close(last["logp"], ref["logp"], rtol=1e-5, atol=1e-6)
    got = {**first["grads"], **last["grads"]}
    assert set(got) == set(ref["grads"])
    for name, grad in ref["grads"].items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.fixture(scope="module", params=[{}, {"bits_lead": True}, {"payload_dtype": "bfloat16"}],
                ids=["scale", "scale-and-lead", "bfloat16-budget"])
def two_ranks(request: pytest.FixtureRequest) -> tuple[dict[str, Any], dict[str, Any]]:
    outcomes = run_ranks(quantised_worker, 2, request.param, timeout_s=30)
    for outcome in outcomes:
        assert outcome.error is None, outcome.trace
    return outcomes[0].value, outcomes[1].value


def test_two_processes_match_one_process_loss_gradients_and_bytes_at_4_bits(two_ranks: Any) -> None:
    first, last = two_ranks
    setup = first["setup"]
    ref = one_process_quantised(setup)
    # a bfloat16 budget is half the bytes: 10 buy r = (80 - 16) / 4 = 16 (ceil(16 * 4 / 8) + 2 = 10 bytes)
    rank, token_bytes = (16, 10) if setup.get("payload_dtype") else (RANKS[bool(setup.get("bits_lead"))], TOKEN_BYTES)
    assert ref["rank"] == rank
    assert_same_loss_and_gradients(first, last, ref)
    tokens = int(rollouts().attention_mask.sum())
    for rank_result in (first, last):
        wire = rank_result["wire"]
        assert wire["wire/cut0/bytes_fwd"] == wire["wire/cut0/bytes_bwd"] == tokens * token_bytes
        assert wire["wire/cut0/bytes_fwd"] == ref["wire"]["wire/cut0/bytes_fwd"]
        assert wire["wire/cut0/bytes_bwd"] == ref["wire"]["wire/cut0/bytes_bwd"]
        assert wire["wire/dense_bytes_fwd"] == tokens * 64 * 4 == ref["wire"]["wire/dense_bytes_fwd"]
        # the cold start crossed dense, in the payload dtype
        dense_value = 2 if setup.get("payload_dtype") else 4
        assert rank_result["cold"]["wire/cut0/bytes_fwd"] == tokens * 64 * dense_value == ref["cold"]["wire/cut0/bytes_fwd"]
    state = first["state"]  # both sides of the cut, gathered on rank 0
    assert torch.equal(state["sender"][0]["basis"], state["forward"][0]["basis"])


def resumed_codec_matches(tmp_path: Path, config: PipelineConfig) -> Any:
    """Two steps, a checkpoint of the cuts, a third step; a fresh model and CutSet restored from the
    checkpoint must give the third step's log-probs and gradients bit for bit. Returns the
    restored first cut's codec."""
    batch = rollouts()
    model = tiny_llama()
    with CutSet(model, config) as cuts:
        for step in range(2):
            cuts.set_step(step)
            completion_logps(model, batch)
        torch.save(cuts.state_dict(), tmp_path / "cuts.pt")
        cuts.set_step(2)
        logp, _ = completion_logps(model, batch)
        logp.sum().backward()
        expected = logp.detach()
        expected_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    fresh = tiny_llama()
    with CutSet(fresh, config) as resumed:
        resumed.load_state_dict(torch.load(tmp_path / "cuts.pt", weights_only=True))
        codec = resumed.boundaries[0].codec
        resumed.set_step(2)
        logp, _ = completion_logps(fresh, batch)
        logp.sum().backward()
        assert torch.equal(logp.detach(), expected)
        for name, p in fresh.named_parameters():
            if p.grad is not None:
                assert torch.equal(p.grad, expected_grads[name]), name
    return codec


@pytest.mark.parametrize("lead", [False, True], ids=["scale", "scale-and-lead"])
def test_resume_restores_a_quantised_codec_exactly(tmp_path: Path, lead: bool) -> None:
    codec = resumed_codec_matches(tmp_path, PipelineConfig(**CONFIG, bits_lead=lead))
    assert isinstance(codec, AdaptiveLowRankCodec) and codec.bits == 4 and codec.rank == RANKS[lead]


def test_switch_codec_away_from_lowrank_drops_bits() -> None:
    model = tiny_llama()
    with CutSet(model, PipelineConfig(**CONFIG, bits_lead=True)) as cuts:
        cuts.switch_codec("prf")
        assert cuts.config.bits is None and not cuts.config.bits_lead and cuts.config.codec == "prf"
