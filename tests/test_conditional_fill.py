"""The ``conditional`` PRF fill: Gaussian conditional mean of the dropped channels (PPCA form)."""

from __future__ import annotations

import pytest
import torch

from tclightning.codecs import FILLS, CodecKey, PRFCodec
from tclightning.errors import TclightningError
from tclightning.pipeline.config import PipelineConfig
from tclightning.recipes.ranges import RANGES

D, K, R = 48, 12, 4


def low_rank_gaussian(n: int, *, noise: float = 0.0, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mu = torch.randn(D, generator=g)
    w = torch.randn(D, R, generator=g)
    x = mu + torch.randn(n, R, generator=g) @ w.T + noise * torch.randn(n, D, generator=g)
    return x, mu, w


def gaussian_conditional(x: torch.Tensor, idx: torch.Tensor, mu: torch.Tensor, cov: torch.Tensor) -> torch.Tensor:
    """Reference: per token, mu_U + Sigma_US Sigma_SS^-1 (x_S - mu_S), kept channels exact."""
    out = torch.empty_like(x, dtype=torch.float64)
    for t in range(x.shape[0]):
        s = idx[t]
        u = torch.tensor([c for c in range(D) if c not in set(s.tolist())])
        xs = x[t, s].double() - mu[s].double()
        out[t, s] = x[t, s].double()
        out[t, u] = mu[u].double() + cov[u][:, s].double() @ torch.linalg.solve(cov[s][:, s].double(), xs)
    return out


def test_conditional_is_a_fill_everywhere_it_is_named() -> None:
    assert "conditional" in FILLS
    assert RANGES["pipeline.fill"]("conditional") is None
    assert all(RANGES["pipeline.fill"](name) is None for name in FILLS)  # the rule mirrors FILLS
    assert RANGES["pipeline.fill"]("median") is not None
    PipelineConfig(layout="all", fill="conditional").validate()
    with pytest.raises(TclightningError, match="rescale"):
        PipelineConfig(layout="all", fill="conditional", rescale=True).validate()
    with pytest.raises(TclightningError, match="pipeline.fill_rank must be >= 1"):
        PipelineConfig(layout="all", fill="conditional", fill_rank=0).validate()
    assert RANGES["pipeline.fill_rank"](0) is not None and RANGES["pipeline.fill_rank"](31) is None


def test_exact_with_the_true_statistics() -> None:
    x, mu, w = low_rank_gaussian(32, noise=0.3)
    cov = w @ w.T + 0.09 * torch.eye(D)
    codec = PRFCodec(D, K, fill="conditional", cond_rank=R)
    codec.set_statistics(mu, factor=w, noise=0.09)
    key = CodecKey(seed=3, step=1, cut=2)
    payload = codec.encode(x, key)
    assert payload.shape == (32, K)  # still exactly k values per token
    assert codec.payload_bytes(32, torch.float32) == 32 * K * 4
    x_hat = codec.decode(payload, key).squeeze(0)
    idx = codec.indices(key, 1, 32, "cpu")[0]
    expected = gaussian_conditional(x, idx, mu, cov)
    torch.testing.assert_close(x_hat.double(), expected, atol=1e-4, rtol=1e-4)
    # the full covariance, fitted to rank R, gives the same
    fitted = PRFCodec(D, K, fill="conditional", cond_rank=R)
    fitted.set_statistics(mu, cov)
    torch.testing.assert_close(fitted.decode(payload, key).squeeze(0).double(), expected, atol=1e-4, rtol=1e-4)


def test_rank_r_data_is_reconstructed_from_estimated_dense_statistics() -> None:
    x, _, _ = low_rank_gaussian(4000)
    codec = PRFCodec(D, K, fill="conditional", cond_rank=R)
    codec.observe_dense(x[:2000])
    codec.commit_step()
    assert codec.cond is not None and codec.cond.active
    key = CodecKey(seed=0, step=5, cut=1)
    x_hat = codec.decode(codec.encode(x[2000:], key), key).squeeze(0)
    assert (x_hat - x[2000:]).abs().max() < 1e-3 * x.abs().max()  # k >= r: exact up to float error


def test_decoded_traffic_alone_learns_a_useful_model() -> None:
    """No dense data at all: pairwise moments of the decoded k values over steps."""
    x, _, _ = low_rank_gaussian(30000, noise=0.05, seed=1)
    codec = PRFCodec(D, K, fill="conditional", cond_rank=R, fill_momentum=0.5, cond_stat_tokens=2000)
    zero = PRFCodec(D, K)
    for step in range(10):
        key = CodecKey(seed=0, step=step, cut=1)
        codec.decode(codec.encode(x[step * 2000 : (step + 1) * 2000], key), key)
        codec.commit_step()
    key = CodecKey(seed=0, step=99, cut=1)
    test = x[-2000:]
    err = (codec.decode(codec.encode(test, key), key).squeeze(0) - test).pow(2).mean()
    err_zero = (zero.decode(zero.encode(test, key), key).squeeze(0) - test).pow(2).mean()
    assert err < 0.1 * err_zero


def test_diagonal_covariance_equals_the_mean_fill() -> None:
    g = torch.Generator().manual_seed(7)
    mu = torch.randn(D, generator=g)
    variances = torch.rand(D, generator=g) + 0.5
    conditional = PRFCodec(D, K, fill="conditional", cond_rank=8)
    conditional.set_statistics(mu, torch.diag(variances))
    mean = PRFCodec(D, K, fill="mean")
    mean.load_state_dict({"mean": mu, "seen": torch.ones(D, dtype=torch.bool)})
    x = torch.randn(3, 10, D, generator=g)
    key = CodecKey(seed=1, step=2, cut=0)
    torch.testing.assert_close(conditional.decode(conditional.encode(x, key), key), mean.decode(mean.encode(x, key), key))


def test_cold_start_is_the_running_mean_then_switches() -> None:
    x, _, _ = low_rank_gaussian(600, seed=2)
    codec = PRFCodec(D, K, fill="conditional", cond_rank=R, cond_min_pairs=4.0)
    key = CodecKey(seed=0, step=0, cut=1)
    first = codec.decode(codec.encode(x[:100], key), key).squeeze(0)
    idx = codec.indices(key, 1, 100, "cpu")[0]
    expected = torch.zeros(100, D).scatter(-1, idx, x[:100].gather(-1, idx))
    torch.testing.assert_close(first, expected)  # before any commit: zero fill
    codec.commit_step()  # 100 tokens: each pair seen ~100 * k(k-1)/(d(d-1)) = 5.9... times
    assert codec.cond is not None
    # a small batch: still cold while pair coverage < 4
    small = PRFCodec(D, K, fill="conditional", cond_rank=R, cond_min_pairs=4.0)
    small.decode(small.encode(x[:40], key), key)
    small.commit_step()
    assert small.cond is not None and not small.cond.active
    key2 = CodecKey(seed=0, step=1, cut=1)
    y = x[200:220]
    got = small.decode(small.encode(y, key2), key2).squeeze(0)
    idx2 = small.indices(key2, 1, 20, "cpu")[0]
    base = small.cond.mean.expand(20, D).clone()  # type: ignore[union-attr]
    torch.testing.assert_close(got, base.scatter(-1, idx2, y.gather(-1, idx2)))  # the running mean
    assert codec.cond.active  # the larger batch crossed the threshold


def test_state_round_trips_and_statistics_hold_within_a_step() -> None:
    x, _, _ = low_rank_gaussian(3000, noise=0.1, seed=3)
    codec = PRFCodec(D, K, fill="conditional", cond_rank=R)
    for step in range(3):
        key = CodecKey(seed=0, step=step, cut=1)
        codec.decode(codec.encode(x[step * 1000 : (step + 1) * 1000], key), key)
        codec.commit_step()
    key = CodecKey(seed=0, step=7, cut=1)
    payload = codec.encode(x[:50], key)
    before = codec.decode(payload, key)
    assert torch.equal(codec.decode(payload, key), before)  # constant until the next commit
    state = codec.state_dict()
    restored = PRFCodec(D, K, fill="conditional", cond_rank=R)
    restored.load_state_dict(state)
    assert torch.equal(restored.decode(payload, key), before)
    # and it keeps learning the same way after the restore
    for c in (codec, restored):
        c.cond.pending = None  # type: ignore[union-attr]
        c.decode(payload, key)
        c.commit_step()
    assert torch.equal(restored.decode(payload, key), codec.decode(payload, key))
    with pytest.raises(ValueError, match="conditional"):
        restored.load_state_dict(PRFCodec(D, K, fill="mean").state_dict() or {"mean": torch.zeros(D), "seen": torch.zeros(D)})


def test_backward_message_is_k_values_through_the_fill() -> None:
    x, mu, w = low_rank_gaussian(16, noise=0.2)
    codec = PRFCodec(D, K, fill="conditional", cond_rank=R)
    codec.set_statistics(mu, factor=w, noise=0.04)
    key = CodecKey(seed=0, step=1, cut=1)
    xr = x.clone().requires_grad_(True)
    payload = codec.encode(xr, key)
    payload.retain_grad()
    codec.decode(payload, key).sum().backward()
    assert payload.grad is not None and payload.grad.shape == (16, K)
    nonzero = (xr.grad != 0).sum(-1)  # type: ignore[operator]
    assert int(nonzero.max()) <= K


def test_micro_batches_fold_the_same_statistics_as_one_message() -> None:
    """What a receiving rank sees (micro-batches, global rows) folds like the one-process message."""
    x, _, _ = low_rank_gaussian(6 * 40, noise=0.1, seed=4)
    x = x.view(6, 40, D)
    whole = PRFCodec(D, K, fill="conditional", cond_rank=R, cond_min_pairs=0.5, cond_stat_tokens=200)
    parts = PRFCodec(D, K, fill="conditional", cond_rank=R, cond_min_pairs=0.5, cond_stat_tokens=200)
    key = CodecKey(seed=2, step=4, cut=1)
    whole.decode(whole.encode(x, key), key)
    for start in (0, 2, 4):  # three micro-batches of two rows
        mkey = CodecKey(seed=2, step=4, cut=1, row_offset=start)
        parts.decode(parts.encode(x[start : start + 2], mkey), mkey)
    whole.commit_step()
    parts.commit_step()
    assert whole.cond is not None and parts.cond is not None and whole.cond.active
    for name, value in whole.cond.moments.items():  # type: ignore[union-attr]
        torch.testing.assert_close(parts.cond.moments[name], value)  # type: ignore[index]
    torch.testing.assert_close(parts.cond.factor.abs(), whole.cond.factor.abs(), atol=1e-5, rtol=1e-4)  # type: ignore[union-attr]


def test_in_a_cut_set_state_round_trips(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import transformers

    from tclightning.pipeline import CutSet

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=50))
    ids = torch.randint(0, 50, (8, 30))
    config = PipelineConfig(stages=3, layout="all", k=8, fill="conditional", fill_rank=6)
    with torch.no_grad(), CutSet(model, config) as cuts:
        assert all(b.forward_codec.cond.rank == 6 for b in cuts.boundaries)  # pipeline.fill_rank reaches the fill
        for step in range(6):
            cuts.set_step(step)
            model(input_ids=ids)
        cuts.set_step(6)
        assert all(b.forward_codec.cond.active for b in cuts.boundaries)  # type: ignore[attr-defined]
        logits = model(input_ids=ids).logits
        state = cuts.state_dict()
    torch.save(state, tmp_path / "cuts.pt")
    with torch.no_grad(), CutSet(model, config) as fresh:
        fresh.load_state_dict(torch.load(tmp_path / "cuts.pt"))
        assert torch.equal(model(input_ids=ids).logits, logits)
    with torch.no_grad(), CutSet(model, PipelineConfig(stages=3, layout="all", k=8)) as zero:
        zero.set_step(6)
        zero_logits = model(input_ids=ids).logits
    with torch.no_grad(), CutSet(model, PipelineConfig(stages=3, layout="dense")) as dense:
        dense_logits = model(input_ids=ids).logits
    assert (logits - dense_logits).abs().mean() < (zero_logits - dense_logits).abs().mean()


def test_bench_codec_times_the_fill_side_by_side_with_zero() -> None:
    from tclightning.bench.codec import bench_codec

    result = bench_codec(tokens=64, dim=48, k=6, repeats=1, warmup=0, fill="conditional", fill_rank=4)
    assert result["fill"] == "conditional" and result["decode_over_zero_fill"] > 0
    assert result["payload_bytes_per_token"] == 6 * 4
    assert "zero_decode_ms" not in bench_codec(tokens=64, dim=48, k=6, repeats=1, warmup=0)
    for name in ("lowrank", "hybrid"):  # basis codecs are timed beside the zero-fill PRF decode too
        timed = bench_codec(tokens=64, dim=48, k=6, repeats=1, warmup=0, codec_name=name)
        assert timed["codec"] == name and timed["decode_over_zero_fill"] > 0
        assert timed["payload_bytes_per_token"] == 6 * 4


# -- conditioning on the token ---------------------------------------------------------------------


def token_mixture(n: int, tokens: int, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``x = mu_t + z W^T``: one mean per token id, one shared rank-R covariance."""
    g = torch.Generator().manual_seed(seed)
    means = 3 * torch.randn(tokens, D, generator=g)
    w = torch.randn(D, R, generator=g)
    ids = torch.randint(0, tokens, (n,), generator=g)
    return means[ids] + torch.randn(n, R, generator=g) @ w.T, ids


def test_token_means_make_a_token_mixture_exact() -> None:
    """The fill given the token is exact on ``x = mu_t + z W^T``; one mean for all tokens is not."""
    x, ids = token_mixture(3000, tokens=5)
    by_token = PRFCodec(D, K, fill="conditional", cond_rank=R, cond_stat_tokens=4000)
    by_token.cond.token_prior = 1e-9  # type: ignore[union-attr]  # no shrinkage: the raw token means
    pooled = PRFCodec(D, K, fill="conditional", cond_rank=R, cond_stat_tokens=4000, cond_token_slots=0)
    for codec in (by_token, pooled):
        codec.observe_dense(x[:2000], token_ids=ids[:2000])
        codec.commit_step()
    key = CodecKey(seed=0, step=3, cut=1)
    test, test_ids = x[2000:].unsqueeze(0), ids[2000:].unsqueeze(0)
    got = by_token.decode(by_token.encode(test, key), key, token_ids=test_ids)
    assert (got - test).abs().max() < 1e-3 * test.abs().max()
    pooled_error = (pooled.decode(pooled.encode(test, key), key, token_ids=test_ids) - test).abs().mean()
    assert pooled_error > 100 * (got - test).abs().mean()
    # without ids the same codec centres every token on the global mean
    blind = by_token.decode(by_token.encode(test, key), key)
    assert (blind - test).abs().mean() > 100 * (got - test).abs().mean()


def test_token_means_learn_from_decoded_values_and_shrink_to_the_mean() -> None:
    x, ids = token_mixture(8000, tokens=3, seed=1)
    codec = PRFCodec(D, K, fill="conditional", cond_rank=R, fill_momentum=0.5, cond_stat_tokens=2000)
    for step in range(4):
        key = CodecKey(seed=0, step=step, cut=1)
        part = slice(step * 2000, (step + 1) * 2000)
        codec.decode(codec.encode(x[part].unsqueeze(0), key), key, token_ids=ids[part].unsqueeze(0))
        codec.commit_step()
    cond = codec.cond
    assert cond is not None and cond.active and cond.token_means is not None
    assert len(cond.tokens) == 3
    for t in range(3):  # each token's mean from its decoded channels alone
        truth = x[ids == t].mean(0)
        assert (cond.token_means[int(cond.tokens.lookup(torch.tensor(t)))] - truth).abs().max() < 0.1 * truth.abs().max()
    # an id never seen, and the unused slots, sit on the global mean
    rows = cond._slots(torch.tensor([[0, 7]]))
    assert int(rows[0, 1]) == cond.token_slots
    torch.testing.assert_close(cond.token_means[cond.token_slots], cond.mean)
    torch.testing.assert_close(cond.token_means[3], cond.mean)


def test_ids_past_the_slot_budget_use_the_global_mean() -> None:
    x, ids = token_mixture(600, tokens=4, seed=2)
    codec = PRFCodec(D, K, fill="conditional", cond_rank=R, cond_token_slots=2)
    codec.observe_dense(x, token_ids=ids)
    codec.commit_step()
    cond = codec.cond
    assert cond is not None and len(cond.tokens) == 2
    assert cond.tokens.keys.tolist() == [0, 1]  # ascending ids first
    assert cond._slots(torch.tensor([2, 3])).tolist() == [2, 2]


def test_token_state_round_trips_exactly() -> None:
    x, ids = token_mixture(3000, tokens=6, seed=3)
    codec = PRFCodec(D, K, fill="conditional", cond_rank=R)
    for step in range(3):
        key = CodecKey(seed=0, step=step, cut=1)
        part = slice(step * 1000, (step + 1) * 1000)
        codec.decode(codec.encode(x[part].unsqueeze(0), key), key, token_ids=ids[part].unsqueeze(0))
        codec.commit_step()
    key = CodecKey(seed=0, step=9, cut=1)
    payload, test_ids = codec.encode(x[:40].unsqueeze(0), key), ids[:40].unsqueeze(0)
    before = codec.decode(payload, key, token_ids=test_ids)
    restored = PRFCodec(D, K, fill="conditional", cond_rank=R)
    restored.load_state_dict(codec.state_dict())
    assert torch.equal(restored.decode(payload, key, token_ids=test_ids), before)
    for c in (codec, restored):  # and both keep learning alike, new ids included
        c.cond.pending = None  # type: ignore[union-attr]
        c.decode(payload, key, token_ids=test_ids + 10)
        c.commit_step()
    assert len(restored.cond.tokens) == len(codec.cond.tokens) > 6  # type: ignore[union-attr]
    assert torch.equal(restored.decode(payload, key, token_ids=test_ids), codec.decode(payload, key, token_ids=test_ids))
    # an older checkpoint kept an id -> slot array: it loads to the same slots
    state = codec.state_dict()
    slot_of = torch.full((int(state["cond_token_keys"].max()) + 1,), -1, dtype=torch.long)
    slot_of[state.pop("cond_token_keys")] = torch.arange(len(codec.cond.tokens))  # type: ignore[union-attr]
    older = PRFCodec(D, K, fill="conditional", cond_rank=R)
    older.load_state_dict({**state, "cond_slot_of": slot_of})
    assert torch.equal(older.cond.tokens.keys, codec.cond.tokens.keys)  # type: ignore[union-attr]
    assert torch.equal(older.decode(payload, key, token_ids=test_ids), codec.decode(payload, key, token_ids=test_ids))
    with pytest.raises(ValueError, match="fill_tokens"):
        PRFCodec(D, K, fill="conditional", cond_rank=R).load_state_dict(
            PRFCodec(D, K, fill="conditional", cond_rank=R, cond_token_slots=0).state_dict()
            or _pooled_state(x))


def _pooled_state(x: torch.Tensor) -> dict:
    pooled = PRFCodec(D, K, fill="conditional", cond_rank=R, cond_token_slots=0)
    pooled.observe_dense(x[:200])
    pooled.commit_step()
    return pooled.state_dict()


def test_a_stage_chain_decodes_with_the_token_ids_like_the_cut_set() -> None:
    """The stages of a multi-process pipeline get the batch's ids as the hooked model does."""
    import copy

    import transformers

    from tclightning.pipeline import CutSet
    from tclightning.pipeline.layout import resolve_layout
    from tclightning.pipeline.stage import StageModule

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=20)).eval()
    ids = torch.randint(0, 20, (6, 12))
    mask = torch.ones_like(ids)
    config = PipelineConfig(stages=2, layout="all", k=4, fill="conditional", fill_rank=4)
    with torch.no_grad(), CutSet(model, config) as cuts:
        with cuts.bypassed(), cuts.observing_dense(model, mask, ids):
            model(input_ids=ids)
        cuts.set_step(1)
        codec = cuts.boundaries[0].forward_codec
        assert codec.cond.active and len(codec.cond.tokens) == len(ids.unique())  # type: ignore[attr-defined]
        expected = model(input_ids=ids).logits[:, -5:-1].log_softmax(-1)
        received = copy.deepcopy(codec)
    specs = resolve_layout(config, 2, 32)
    first = StageModule(model, 0, specs, send_codec=received, recv_codec=None, seed=config.seed)
    last = StageModule(model, 1, specs, send_codec=None, recv_codec=received, seed=config.seed)
    first.step = last.step = 1
    completion = ids[:, -4:]
    kwargs = {"attention_mask": mask, "position_ids": torch.arange(12).expand(6, 12), "rows": torch.arange(6),
              "completion_ids": completion, "completion_mask": torch.ones_like(completion, dtype=torch.float)}
    with torch.no_grad():
        logp = last(first(ids, **kwargs), **kwargs, input_ids=ids)
        blind = last(first(ids, **kwargs), **kwargs)
    torch.testing.assert_close(logp, expected.gather(-1, completion.unsqueeze(-1)).squeeze(-1), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(blind, logp)


def pair_mixture(rows: int, length: int, tokens: int, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``[rows, length]`` ids and ``x = mu_t + nu_(previous, t) + z W^T``: the token before shifts
    each token's mean (``nu`` row 0: no token before)."""
    g = torch.Generator().manual_seed(seed)
    means = 3 * torch.randn(tokens, D, generator=g)
    shifts = 2 * torch.randn(tokens + 1, tokens, D, generator=g)
    w = torch.randn(D, R, generator=g)
    ids = torch.randint(0, tokens, (rows, length), generator=g)
    previous = torch.cat([torch.zeros(rows, 1, dtype=torch.long), ids[:, :-1] + 1], 1)
    return means[ids] + shifts[previous, ids] + torch.randn(rows, length, R, generator=g) @ w.T, ids


def test_pair_means_fill_in_what_the_token_before_shifts() -> None:
    from tclightning.codecs.context import context_keys, token_of

    x, ids = pair_mixture(80, 40, tokens=4)
    keys = context_keys(ids)
    by_pair = PRFCodec(D, K, fill="conditional", cond_rank=R)
    by_token = PRFCodec(D, K, fill="conditional", cond_rank=R, cond_pair_slots=0)
    for codec in (by_pair, by_token):
        codec.cond.token_prior = 1e-9  # type: ignore[union-attr]  # no shrinkage: the raw means
        codec.observe_dense(x[:60], token_ids=keys[:60])
        codec.commit_step()
    assert len(by_pair.cond.pairs) == 4 * 4 and len(by_token.cond.pairs) == 0  # type: ignore[union-attr]
    key = CodecKey(seed=0, step=3, cut=1)
    test, test_keys = x[60:], keys[60:]
    payload = by_pair.encode(test, key)
    error = (by_pair.decode(payload, key, token_ids=test_keys) - test).abs().mean()
    token_error = (by_token.decode(payload, key, token_ids=test_keys) - test).abs().mean()
    assert token_error > 2 * error  # 3.0x here
    # plain ids (no token before) use the token means, as a codec without pairs does
    assert torch.equal(by_pair.decode(payload, key, token_ids=token_of(test_keys)),
                       by_token.decode(payload, key, token_ids=test_keys))
    # the pair table round-trips and keeps learning alike
    restored = PRFCodec(D, K, fill="conditional", cond_rank=R)
    restored.cond.token_prior = 1e-9  # type: ignore[union-attr]
    restored.load_state_dict(by_pair.state_dict())
    assert torch.equal(restored.decode(payload, key, token_ids=test_keys), by_pair.decode(payload, key, token_ids=test_keys))
    fresh = context_keys(ids[60:] + 4)  # new ids and pairs take new rows on both
    for codec in (by_pair, restored):
        codec.cond.pending = None  # type: ignore[union-attr]
        codec.observe_dense(test, token_ids=fresh)
        codec.commit_step()
    assert len(restored.cond.pairs) == len(by_pair.cond.pairs) > 16  # type: ignore[union-attr]
    assert torch.equal(restored.decode(payload, key, token_ids=fresh), by_pair.decode(payload, key, token_ids=fresh))
    with pytest.raises(ValueError, match="fill_pairs"):
        PRFCodec(D, K, fill="conditional", cond_rank=R).load_state_dict(by_token.state_dict())
