"""Entropy-coded basis coefficients (``pipeline.entropy_coding``): the coder's model against the real
ANS stream, every row within its byte budget and the budget counted exactly, the step the smallest
that fits, rows independent of the rows beside them, the reconstruction formula, the unbiased
gradient message, one process against two, the shipped fit, resume and the refusals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tclightning.bench.launch import run_ranks
from tclightning.codecs import AdaptiveLowRankCodec, CodecKey, budget_k, entropy_rank
from tclightning.codecs.entropy import (
    GRADIENT_HEADER_BYTES,
    GRADIENT_MARGIN,
    STEP_BYTES,
    coded_bits,
    decode_levels,
    encode_levels,
    laplace_bits,
    quantise_forward,
    quantise_gradient,
    row_budget,
)
from tclightning.codecs.lowrank import STEP_SEARCH_STREAM, gradient_uniforms
from tclightning.errors import TclightningError
from tclightning.pipeline import PipelineConfig
from tclightning.pipeline.layout import cut_codec, resolve_layout
from tests.test_distributed import rollouts
from tests.test_quantised_basis import (
    assert_same_loss_and_gradients,
    one_process_quantised,
    quantised_worker,
    resumed_codec_matches,
)

KEY = CodecKey(seed=3, step=1, cut=2)


def spectrum_rows(rows: int, tokens: int, dim: int, seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Rows of coefficients with a decaying spectrum (four decades), and their Laplace scales."""
    gen = torch.Generator().manual_seed(seed)
    variances = torch.logspace(3, -1, dim, dtype=torch.float64)
    values = [torch.randn(tokens - 3 * b, dim, generator=gen, dtype=torch.float64) * variances.sqrt()
              for b in range(rows)]
    return values, (variances / 2).sqrt()


# ------------------------------------------------------------------ the coder
@pytest.mark.parametrize("spread", [0.05, 0.7, 3.0, 40.0])
def test_the_model_code_length_is_what_the_coder_spends_and_decodes_back_exactly(spread: float) -> None:
    gen = torch.Generator().manual_seed(1)
    scales = torch.full((24,), spread, dtype=torch.float64) * torch.linspace(0.5, 2.0, 24, dtype=torch.float64)
    levels = torch.round(torch.distributions.Laplace(0.0, scales).sample((300,)) + 0 * torch.rand(300, 24, generator=gen))
    ideal = float(laplace_bits(levels, scales).sum())
    words = encode_levels(levels, scales)
    assert ideal <= 32 * words.size <= ideal * 1.002 + 64
    assert torch.equal(decode_levels(words, tuple(levels.shape), scales), levels.long())


def test_forward_rows_fit_their_budget_and_a_smaller_step_would_not() -> None:
    rows, spread = spectrum_rows(4, 120, 48)
    budget = 40
    levels, steps = quantise_forward([r.float() for r in rows], spread, budget)
    for row, q, step in zip(rows, levels, steps):
        assert torch.equal(q, torch.round(row.float().double() / step).long())
        bits = coded_bits(q, spread / step)
        assert bits <= row_budget(row.shape[0], budget, STEP_BYTES)
        # the budget is used: a step 1% smaller costs more than the row may spend
        finer = torch.round(row.float().double() / (step / 1.01))
        assert float(laplace_bits(finer, spread / (step / 1.01)).sum()) > 0.98 * row_budget(row.shape[0], budget, STEP_BYTES)


def test_a_row_is_coded_the_same_alone_and_among_other_rows() -> None:
    rows, spread = spectrum_rows(3, 60, 32, seed=4)
    together_levels, together_steps = quantise_forward([r.float() for r in rows], spread, 30)
    for b, row in enumerate(rows):
        alone_levels, alone_steps = quantise_forward([row.float()], spread, 30)
        assert alone_steps[0] == together_steps[b]
        assert torch.equal(alone_levels[0], together_levels[b])


def test_a_row_without_room_for_its_header_is_sent_empty() -> None:
    rows, spread = spectrum_rows(1, 10, 8)
    short = rows[0][:1].float()  # one token: 4 bytes of budget, no room for the 4-byte step
    levels, steps = quantise_forward([short, rows[0].float()], spread, STEP_BYTES)
    assert steps[0] == 0.0 and not levels[0].any() and steps[1] > 0 and levels[1].any()
    levels, steps, _ = quantise_gradient([short], [torch.rand(1, 8)], [torch.rand(1, 8)], GRADIENT_HEADER_BYTES)
    assert steps == [0.0] and not levels[0].any()


def test_the_gradient_step_ignores_the_rounding_draws_so_the_message_is_unbiased() -> None:
    gen = torch.Generator().manual_seed(2)
    g = torch.randn(80, 16, generator=gen, dtype=torch.float64) * torch.linspace(0.1, 2.0, 16, dtype=torch.float64)
    search = torch.rand(80, 16, generator=gen)
    budget = 12
    draws, means = 64, torch.zeros_like(g)
    steps = set()
    for j in range(draws):  # a grid of uniforms: the rounding draws only
        uniforms = torch.full_like(g, (j + 0.5) / draws).float()
        levels, step, scale = quantise_gradient([g.float()], [uniforms], [search], budget)
        steps.add(step[0])
        assert torch.equal(levels[0], torch.floor(g.float().double() / step[0] + uniforms.double()).long())
        assert coded_bits(levels[0], torch.tensor(scale[0] / step[0])) <= row_budget(80, budget, GRADIENT_HEADER_BYTES)
        means += levels[0].double() * step[0] / draws
    assert len(steps) == 1  # the step did not follow the draws
    assert torch.allclose(means, g.float().double(), atol=steps.pop() / draws)


def test_the_search_draws_are_not_the_rounding_draws() -> None:
    shape = torch.Size([2, 5, 3])
    assert not torch.equal(gradient_uniforms(KEY, shape), gradient_uniforms(KEY, shape, stream=STEP_SEARCH_STREAM))
    assert GRADIENT_MARGIN < 0.05


# ------------------------------------------------------------------ the codec
def fitted(dim: int = 32, budget: int = 24, tokens: int = 600, slots: int = 8) -> tuple[AdaptiveLowRankCodec, Any]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, dim, generator=gen) * torch.logspace(1, -1, dim) + torch.randn(dim, generator=gen)
    ids = torch.randint(0, 20, (tokens,), generator=gen)
    codec = AdaptiveLowRankCodec(dim, entropy_rank(dim, budget), token_slots=slots, entropy_budget=budget)
    codec.observe_dense(x, ids)
    codec.fit_shared(1)
    return codec, (x, ids)


def test_the_budget_is_what_k_values_cost_and_the_bytes_counted_are_exactly_it() -> None:
    for dim, rate, dtype in [(576, 0.05, "bfloat16"), (576, 0.05, None), (128, 0.05, None), (64, 0.1, "float16")]:
        config = PipelineConfig(layout="all", stages=2, codec="lowrank", rate=rate, entropy_coding=True, payload_dtype=dtype)
        codec = cut_codec(config, resolve_layout(config, 4, dim)[0], dim)
        assert isinstance(codec, AdaptiveLowRankCodec)
        budget = budget_k(dim, rate=rate) * (2 if dtype else 4)
        assert codec.entropy_budget == budget and codec.rank == min(dim, 8 * budget)
        assert codec.payload_bytes(5, torch.float32) == 5 * dim * 4  # the cold start crosses dense
        codec.observe_dense(torch.randn(400, dim))
        codec.fit_shared(1)
        for tokens in (0, 1, 77):
            assert codec.payload_bytes(tokens, torch.float32) == codec.payload_bytes(tokens, torch.bfloat16) == tokens * budget
    assert (576, 58) == (576, budget_k(576, rate=0.05) * 2)  # SmolLM2 at 5% of its bfloat16 boundary


def test_decode_of_encode_is_the_centre_plus_the_quantised_coefficients_in_the_basis() -> None:
    codec, (x, ids) = fitted()
    rows, row_ids = x[:300].reshape(3, 100, -1), ids[:300].reshape(3, 100)
    mask = torch.ones(3, 100, dtype=torch.bool)
    mask[1, 70:] = False  # padding: not coded, not counted
    payload = codec.encode(rows, KEY, token_ids=row_ids, token_mask=mask)
    centred = codec.centred(rows, row_ids) @ codec.basis
    levels, steps = quantise_forward([centred[b][mask[b]] for b in range(3)], codec.spread(), codec.entropy_budget)
    for b in range(3):
        assert torch.equal(payload[b][mask[b]], (levels[b].double() * steps[b]).float())
    assert torch.equal(payload[1][~mask[1]], torch.zeros(30, codec.rank))
    out = codec.decode(payload, KEY, token_mask=mask, token_ids=row_ids)
    centres = codec.centred(torch.zeros_like(rows), row_ids).neg()
    torch.testing.assert_close(out, centres + payload @ codec.basis.T, rtol=0, atol=1e-5)
    error = (out - rows)[mask].pow(2).sum() / (rows - centres)[mask].pow(2).sum()
    assert error < 0.05


def test_the_gradient_message_is_rounded_where_it_leaves_the_receiver() -> None:
    codec, (x, ids) = fitted()
    rows, row_ids = x[:200].reshape(2, 100, -1), ids[:200].reshape(2, 100)
    payload = codec.encode(rows, KEY, token_ids=row_ids).detach().requires_grad_(True)
    out = codec.decode(payload, KEY, token_ids=row_ids)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    (out * upstream).sum().backward()
    exact = upstream @ codec.basis
    uniforms = gradient_uniforms(KEY, exact.shape)
    search = gradient_uniforms(KEY, exact.shape, stream=STEP_SEARCH_STREAM)
    levels, steps, _ = quantise_gradient(list(exact), list(uniforms), list(search), codec.entropy_budget)
    for b in range(2):
        assert torch.equal(payload.grad[b], (levels[b].double() * steps[b]).float())  # type: ignore[index]


def test_a_shipped_fit_carries_the_coders_model_and_the_receiver_installs_it() -> None:
    sender, _ = fitted()
    receiver = AdaptiveLowRankCodec(32, sender.rank, token_slots=8, entropy_budget=24)
    message = sender.fit_message()
    assert message.numel() * 4 == sender.ship_bytes()
    receiver.load_basis_message(message, 1)
    for name in ("basis", "mean", "variances", "token_ids", "token_offsets"):
        assert torch.equal(getattr(receiver, name), getattr(sender, name)), name
    with pytest.raises(ValueError, match="basis message has"):
        receiver.load_basis_message(message[:-1], 2)


def test_a_drifted_model_alone_ships_without_the_basis_and_a_rotated_one_ships_whole() -> None:
    sender, (x, ids) = fitted(slots=0)
    receiver = AdaptiveLowRankCodec(32, sender.rank, entropy_budget=24)
    receiver.load_basis_message(sender.fit_message(), 1)
    basis = sender.basis.clone()
    sender.observe_sent(sender.mean + 1.5 * (x - sender.mean), ids)  # the same directions, other variances
    message = sender.basis_message(11)
    assert message is not None and message.numel() == sender.ship_bytes() // 4 - 32 * sender.rank and message[0] == 0
    assert torch.equal(sender.basis, basis) and not torch.equal(sender.variances, receiver.variances)
    receiver.load_basis_message(message, 11)
    rotation = torch.linalg.qr(torch.randn(32, 32, generator=torch.Generator().manual_seed(9)))[0]
    sender.observe_sent(x @ rotation, ids)
    whole = sender.basis_message(21)
    assert whole is not None and whole.numel() == sender.ship_bytes() // 4 and not torch.equal(sender.basis, basis)
    for state, step in ((message, 11), (whole, 21)):
        receiver.load_basis_message(state, step)
    for name in ("basis", "mean", "variances"):
        assert torch.equal(getattr(receiver, name), getattr(sender, name)), name
    assert sender.basis_message(31) is None  # nothing seen since: kept


def test_entropy_coding_is_the_default_bits_replace_it_and_other_codecs_ignore_it() -> None:
    dim = 64

    def codec_for(**keys: Any) -> Any:
        config = PipelineConfig(layout="all", stages=2, rate=0.1, **keys)
        config.validate()
        return cut_codec(config, resolve_layout(config, 4, dim)[0], dim)

    assert PipelineConfig().entropy_coding is True
    assert codec_for(codec="lowrank").entropy_budget == 6 * 4
    fixed = codec_for(codec="lowrank", bits=4)
    assert fixed.entropy_budget is None and fixed.bits == 4
    assert codec_for(codec="lowrank", entropy_coding=False).entropy_budget is None  # float coefficients
    assert codec_for(codec="prf").name == "prf"
    with pytest.raises(ValueError, match="entropy_budget"):
        AdaptiveLowRankCodec(32, 32, entropy_budget=4, bits=4)


def test_a_checkpointed_basis_of_another_coding_is_refused_in_one_line() -> None:
    float_codec = AdaptiveLowRankCodec(32, 4)
    float_codec.observe_dense(torch.randn(100, 32))
    float_codec.fit_shared(1)
    entropy_codec = AdaptiveLowRankCodec(32, 32, entropy_budget=16)
    with pytest.raises(ValueError, match="pipeline.entropy_coding"):
        entropy_codec.load_state_dict(float_codec.state_dict())
    with pytest.raises(ValueError, match="pipeline.entropy_coding"):
        AdaptiveLowRankCodec(32, 4).load_state_dict(fitted(dim=32, budget=16)[0].state_dict())


# ------------------------------------------------------------------ one process, two processes, resume
CONFIG = {"layout": "all", "stages": 2, "codec": "lowrank", "k": 5, "entropy_coding": True, "microbatches": 1}
ENTROPY = {"bits": None, "entropy_coding": True, "microbatches": 1}  # over the fixed-bit tests' CONFIG
TOKEN_BYTES = 20  # k = 5 float32 values
# One micro-batch, so that both processes see bit-identical activations: a row's levels are
# rounded values, and a last-bit difference from another micro-batch shape can move one across a
# rounding boundary. That a row is coded the same among any rows is tested on the codec above.


@pytest.mark.parametrize("setup", [{}, {"basis": {"tokens": 0}}], ids=["token-centres", "one-mean"])
def test_two_processes_match_one_process_loss_gradients_and_bytes(setup: dict[str, Any],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tclightning.codecs.lowrank.FIT_TOKENS_PER_CHANNEL", 0)
    setup = {**ENTROPY, **setup}
    outcomes = run_ranks(quantised_worker, 2, setup, timeout_s=60)
    for outcome in outcomes:
        assert outcome.error is None, outcome.trace
    first, last = outcomes[0].value, outcomes[1].value
    ref = one_process_quantised(setup)
    assert_same_loss_and_gradients(first, last, ref)
    tokens = int(rollouts().attention_mask.sum())
    for result in (first, last):
        wire = result["wire"]
        assert wire["wire/cut0/bytes_fwd"] == wire["wire/cut0/bytes_bwd"] == tokens * TOKEN_BYTES
        assert wire["wire/cut0/bytes_fwd"] == ref["wire"]["wire/cut0/bytes_fwd"]


def test_the_first_fit_waits_for_8_tokens_a_channel_and_the_cut_crosses_dense_until_then() -> None:
    codec = AdaptiveLowRankCodec(16, 16, entropy_budget=12)
    assert codec.first_fit_tokens == 8 * 16
    gen = torch.Generator().manual_seed(3)
    for step in range(1, 4):
        assert codec.plan_refresh(step) is None and codec.crosses_dense
        codec.observe_dense(torch.randn(50, 16, generator=gen))  # 50, 100, 150 tokens
    assert codec.plan_refresh(4) == "fit"
    codec.fit_shared(4)
    assert not codec.crosses_dense and codec.payload_bytes(10, torch.float32) == 120
    assert AdaptiveLowRankCodec(16, 4).first_fit_tokens == 2  # float coefficients fit on any traffic


def test_resume_restores_an_entropy_coded_codec_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tclightning.codecs.lowrank.FIT_TOKENS_PER_CHANNEL", 0)
    codec = resumed_codec_matches(tmp_path, PipelineConfig(**CONFIG))
    assert isinstance(codec, AdaptiveLowRankCodec) and codec.entropy_budget == TOKEN_BYTES
    assert codec.variances is not None and codec.variances.shape == (codec.rank,)


def test_a_silent_row_and_a_model_without_variance_still_fit_their_budget() -> None:
    gen = torch.Generator().manual_seed(6)
    row = torch.randn(10, 4, generator=gen)
    levels, steps = quantise_forward([torch.zeros(10, 4), row], torch.zeros(4), 8)
    assert steps[0] == 0.0 and not levels[0].any()  # nothing to send
    assert steps[1] > 0 and coded_bits(levels[1], torch.zeros(4) / steps[1]) <= row_budget(10, 8, STEP_BYTES)
