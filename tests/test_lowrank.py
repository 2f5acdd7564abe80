"""The adaptive low-rank codec: exact in its span, both sides of a cut always hold the same basis
(one process, two codec objects, two processes), the refresh's bytes, and exact resume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tclightning.bench.launch import run_ranks
from tclightning.codecs import AdaptiveLowRankCodec, CodecKey, TokenMoments
from tclightning.errors import TclightningError
from tclightning.models.logprobs import completion_logps
from tclightning.grpo.summary import read_metrics
from tclightning.pipeline import CutSet, PipelineConfig
from tclightning.pipeline.layout import resolve_layout
from tclightning.run import run
from tests.conftest import FAST
from tests.test_distributed import ADVANTAGES, LOSS, rollouts, tiny_llama

KEY = CodecKey(seed=3, step=1, cut=2)


def in_span(n: int, dim: int = 32, rank: int = 4, seed: int = 0) -> torch.Tensor:
    """``n`` tokens ``mu + z A`` with ``A`` of rank ``rank``: inside a rank-``rank`` affine span."""
    gen = torch.Generator().manual_seed(seed)
    mu = torch.randn(dim, generator=gen)
    directions = torch.randn(rank, dim, generator=gen)
    return mu + torch.randn(n, rank, generator=gen) @ directions


def test_exact_on_data_inside_its_span_and_the_gradient_message_is_r_values() -> None:
    codec = AdaptiveLowRankCodec(32, 4)
    x = in_span(400)
    assert codec.crosses_dense and codec.width == 32
    assert torch.equal(codec.decode(codec.encode(x, KEY), KEY), x)  # before the first fit: dense
    codec.observe_dense(x)
    assert codec.plan_refresh(1) == "fit"
    codec.fit_shared(1)
    fresh = in_span(50, seed=0)[:50] + 0.0
    payload = codec.encode(fresh, KEY)
    assert payload.shape == (50, 4) and codec.width == 4
    assert codec.payload_bytes(50, torch.float32) == 50 * 4 * 4
    torch.testing.assert_close(codec.decode(payload, KEY), fresh, rtol=1e-4, atol=1e-4)
    # off the span it is a projection: the error is what lies outside the basis
    off = fresh + torch.randn(50, 32)
    assert (codec.decode(codec.encode(off, KEY), KEY) - off).abs().mean() > 0.1
    # linear: the backward message is the gradient w.r.t. the [T, r] payload
    leaf = fresh.clone().requires_grad_(True)
    sent = codec.encode(leaf, KEY)
    sent.retain_grad()
    codec.decode(sent, KEY).pow(2).sum().backward()
    assert sent.grad is not None and sent.grad.shape == (50, 4)


def test_both_sides_hold_the_same_basis_through_cold_start_ship_and_shared_refresh() -> None:
    sender, receiver = (AdaptiveLowRankCodec(32, 4, refresh_every=2, refresh_tolerance=0.0) for _ in range(2))
    first = in_span(300, seed=1)
    for side in (sender, receiver):  # step 0 crossed dense: both saw the same tokens
        side.observe_dense(first)
    for side in (sender, receiver):
        assert side.plan_refresh(1) == "fit"
        side.fit_shared(1)
    assert torch.equal(sender.basis, receiver.basis) and torch.equal(sender.mean, receiver.mean)
    assert sender.plan_refresh(2) is None and receiver.plan_refresh(2) is None
    # no shared traffic: the sender fits what it sent (the data drifted) and ships it
    drifted = in_span(300, seed=2)
    sender.observe_sent(drifted)
    before = sender.basis.clone()
    assert sender.plan_refresh(3) == receiver.plan_refresh(3) == "ship"
    message = sender.basis_message(3)
    assert message is not None and message.numel() * 4 == sender.ship_bytes() == (32 * 4 + 32) * 4
    receiver.load_basis_message(message, 3)
    assert not torch.allclose(before, sender.basis)
    assert torch.equal(sender.basis, receiver.basis) and torch.equal(sender.mean, receiver.mean)
    torch.testing.assert_close(receiver.decode(sender.encode(drifted, KEY), KEY), drifted, rtol=1e-4, atol=1e-4)
    # the anchor's dense pass fed both sides: the next refresh is a free refit
    anchor_traffic = in_span(300, seed=4)
    for side in (sender, receiver):
        side.observe_dense(anchor_traffic)
    assert sender.plan_refresh(5) == receiver.plan_refresh(5) == "fit"
    for side in (sender, receiver):
        side.fit_shared(5)
    assert torch.equal(sender.basis, receiver.basis) and sender.version == receiver.version == 3
    # refresh_every=0: the first fit is kept
    static = AdaptiveLowRankCodec(32, 4, refresh_every=0)
    static.observe_dense(first)
    static.fit_shared(1)
    static.observe_dense(anchor_traffic)
    assert static.plan_refresh(1000) is None


def test_a_basis_that_still_fits_is_kept_and_a_drifted_one_is_refitted() -> None:
    """The refresh check refits only when a fresh fit would lose ``refresh_tolerance`` less energy."""
    sender, receiver = (AdaptiveLowRankCodec(32, 4, refresh_every=1, refresh_tolerance=0.02) for _ in range(2))
    for side in (sender, receiver):
        side.observe_dense(in_span(300, seed=1))
        side.fit_shared(1)
    same = in_span(300, seed=1)[:150] + 0.01 * torch.randn(150, 32)  # the same span: nothing to gain
    sender.observe_sent(same)
    assert sender.window.refit_gain(sender.basis, sender.mean) < 0.02
    message = sender.basis_message(2)
    assert message is None and sender.version == 1
    receiver.load_basis_message(message, 2)
    assert receiver.checked_step == sender.checked_step == 2 and sender._shipped == 4  # the flag only
    sender.observe_sent(in_span(300, seed=9))  # another span: a refit keeps much more
    assert sender.window.refit_gain(sender.basis, sender.mean) > 0.5
    message = sender.basis_message(3)
    receiver.load_basis_message(message, 3)
    assert message is not None and sender.version == receiver.version == 2
    assert torch.equal(sender.basis, receiver.basis)
    # shared traffic decides on both sides alike, with no message
    for side in (sender, receiver):
        side.observe_dense(in_span(300, seed=9))
        assert side.plan_refresh(4) == "fit"
        assert side.fit_shared(4) is False
    for side in (sender, receiver):
        side.observe_dense(in_span(300, seed=11))
        assert side.fit_shared(5) is True
    assert torch.equal(sender.basis, receiver.basis) and sender.version == receiver.version == 3


def token_mixture(n: int, tokens: int = 12, dim: int = 32, rank: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` rows ``m_t + z A`` (``A`` of rank ``rank``, one far-apart mean per token id) and their
    ids: inside a rank-``rank`` span around each token's mean, far from any one affine span."""
    gen = torch.Generator().manual_seed(seed)
    means = 5 * torch.randn(tokens, dim, generator=gen)
    directions = torch.randn(rank, dim, generator=gen)
    ids = torch.randint(0, tokens, (n,), generator=gen) * 7 + 3  # sparse, unordered ids
    return means[(ids - 3) // 7] + torch.randn(n, rank, generator=gen) @ directions, ids


def test_token_moments_group_by_id_deterministically_and_give_the_within_covariance() -> None:
    x, ids = token_mixture(500)
    whole, parts = TokenMoments(32, token_prior=1e-9), TokenMoments(32, token_prior=1e-9)
    whole.add(x, ids)
    for chunk in range(0, 500, 128):
        parts.add(x[chunk:chunk + 128], ids[chunk:chunk + 128])
    assert torch.equal(whole.ids, torch.unique(ids)) and torch.equal(parts.ids, whole.ids)
    torch.testing.assert_close(parts.token_total, whole.token_total)
    assert torch.equal(parts.token_count, whole.token_count) and whole.by_token
    # the within-token covariance: the second moment of x about each token's own mean
    _, means = whole.token_means()
    own = means[torch.searchsorted(whole.ids, ids)]
    expected = (x.double() - own).T @ (x.double() - own) / 500
    eigenvalues = whole.spectrum()[1]
    torch.testing.assert_close(eigenvalues, torch.linalg.eigvalsh(expected), rtol=1e-6, atol=1e-8)
    assert float(eigenvalues[:-3].abs().max()) < 1e-8  # rank 3 within each token
    # the same tokens in the same order: bit-identical moments (what the two sides of a cut rely on)
    again = TokenMoments(32)
    for chunk in range(0, 500, 128):
        again.add(x[chunk:chunk + 128], ids[chunk:chunk + 128])
    assert torch.equal(again.token_total, parts.token_total) and torch.equal(again.outer, parts.outer)
    # one row without its id: the plain covariance applies
    mixed = TokenMoments(32)
    mixed.add(x, ids)
    mixed.add(x[:1])
    assert not mixed.by_token


def test_token_centres_make_a_token_mixture_exact_at_rank_r() -> None:
    x, ids = token_mixture(600)
    for slots, exact in ((1024, True), (0, False)):
        codec = AdaptiveLowRankCodec(32, 3, token_slots=slots, token_prior=1e-9)  # unshrunk: exact centres
        codec.observe_dense(x, ids)
        codec.fit_shared(1)
        fresh, fresh_ids = token_mixture(60, seed=0)
        fresh, fresh_ids = fresh.reshape(3, 20, 32), fresh_ids.reshape(3, 20)
        payload = codec.encode(fresh, KEY, token_ids=fresh_ids)
        assert payload.shape == (3, 20, 3)  # r values per token, whatever the centres
        error = (codec.decode(payload, KEY, token_ids=fresh_ids) - fresh).abs().max()
        assert (error < 1e-3) == exact, (slots, float(error))
    assert codec.ship_bytes() == (32 * 3 + 32) * 4
    centred = AdaptiveLowRankCodec(32, 3, token_slots=1024, token_prior=1e-9)
    centred.observe_dense(x, ids)
    centred.fit_shared(1)
    assert centred.ship_bytes() == (32 * 3 + 32 + 12 * 33) * 4  # plus (d + 1) values per centre
    # an id without a centre falls back to the global mean; ids must match the tokens' shape
    unseen = centred.offsets(torch.tensor([[4, 3]]), torch.zeros(1, 2, 32))
    assert unseen is not None and unseen[0, 0].abs().sum() == 0 and unseen[0, 1].abs().sum() > 0
    with pytest.raises(ValueError, match="token ids of shape"):
        centred.encode(fresh, KEY, token_ids=fresh_ids[:, :5])


def test_token_centres_keep_the_most_frequent_ids_and_move_with_a_refit() -> None:
    x, ids = token_mixture(600)
    # 12 ids; room for 5
    codec = AdaptiveLowRankCodec(32, 3, token_slots=5, refresh_every=1, refresh_tolerance=0.0)
    codec.observe_dense(x, ids)
    codec.fit_shared(1)
    distinct, counts = torch.unique(ids, return_counts=True)
    order = torch.argsort(-counts, stable=True)[:5]
    assert torch.equal(codec.token_ids, torch.sort(distinct[order]).values)
    # the same tokens shifted by +1 everywhere: a shared refit moves mean and offsets, keeps the ids
    before = codec.token_ids.clone()
    codec.observe_dense(x + 1.0, ids)
    codec.fit_shared(2)
    assert torch.equal(codec.token_ids, before)
    restored = AdaptiveLowRankCodec(32, 3, token_slots=5)
    restored.load_state_dict(codec.state_dict())
    probe, probe_ids = x[:40].reshape(2, 20, 32) + 1.0, ids[:40].reshape(2, 20)
    assert torch.equal(restored.decode(restored.encode(probe, KEY, token_ids=probe_ids), KEY, token_ids=probe_ids),
                       codec.decode(codec.encode(probe, KEY, token_ids=probe_ids), KEY, token_ids=probe_ids))


def test_the_drift_check_does_not_count_what_fresh_token_means_absorb_in_sample() -> None:
    """A window from the same token mixture: fresh per-token means fitted on its few rows per token
    would 'gain' by absorbing its noise; the check keeps the current centres, so the basis is kept."""
    torch.manual_seed(0)
    x, ids = token_mixture(660)
    x = x + 0.3 * torch.randn(660, 32)
    codec = AdaptiveLowRankCodec(32, 3, token_slots=1024, refresh_every=1, refresh_tolerance=0.02)
    codec.observe_dense(x[:600], ids[:600])
    codec.fit_shared(1)
    codec.observe_sent(x[600:], ids[600:])
    window = codec.window
    rows = x[600:].double() - codec.offsets(ids[600:], x[600:]).double() - codec.mean.double()
    energy = float(rows.pow(2).sum()) / 60
    lost_now = energy - float((rows @ codec.basis.double()).pow(2).sum()) / 60
    in_sample = (lost_now - float(window.spectrum(within_tokens=True)[1].clamp_min(0)[:-3].sum())) / energy
    fair = window.refit_gain(codec.basis, codec.mean)
    assert fair < 0.01 < in_sample
    assert codec.basis_message(2) is None and codec.version == 1  # kept


def test_recipe_checks_name_the_setting() -> None:
    with pytest.raises(TclightningError, match="refresh_every"):
        PipelineConfig(basis={"refresh_every": -1}).validate()
    specs = resolve_layout(PipelineConfig(layout="all", stages=2, codec="lowrank", k=6), 4, 32)
    assert specs[0].rank == 6 and specs[0].k == 6  # the rank defaults to the budget: equal bytes per token


# ------------------------------------------------------------------ in a model, and across processes
CONFIG = {"layout": "all", "stages": 2, "codec": "lowrank", "k": 5, "basis": {"refresh_every": 2, "refresh_tolerance": 0.0},
          "entropy_coding": False,  # float coefficients: the refresh protocol itself
          "microbatches": 3}  # tolerance 0: every check refits, so the protocol's every path runs
SHIP_STEP, SHARED_STEP = 3, 5


def with_setup(setup: dict[str, Any]) -> dict[str, Any]:
    """:data:`CONFIG` with a case's settings, its basis options merged into CONFIG's."""
    return {**CONFIG, **setup, "basis": {**CONFIG["basis"], **setup.get("basis", {})}}


def dense_tokens(model: torch.nn.Module, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense boundary after ``layer`` at real tokens (what the anchor's pass sends), and their ids."""
    batch = rollouts()
    with torch.no_grad():
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                    position_ids=batch.position_ids, output_hidden_states=True)
    real = batch.attention_mask.bool()
    return out.hidden_states[layer + 1][real], batch.input_ids[real]


def one_process(setup: dict[str, Any]) -> dict[str, Any]:
    """Steps 0..5 with the cuts as hooks: cold start at 0, fit at 1, ship at 3, the anchor's dense
    traffic during step 3, shared refit at 5. ``setup``: more :class:`PipelineConfig` keys."""
    model = tiny_llama()
    batch = rollouts()
    bases, metrics = {}, {}
    with CutSet(model, PipelineConfig(**with_setup(setup))) as cuts:
        codec = cuts.boundaries[0].codec
        for step in range(6):
            cuts.reset_stats()
            cuts.set_step(step)
            logp, _ = completion_logps(model, batch)
            logp.sum().backward()
            if step == SHIP_STEP:
                with cuts.bypassed():
                    cuts.observe_dense(0, *dense_tokens(model, cuts.specs[0].layer))
            metrics[step] = cuts.metrics()
            bases[step] = (codec.basis.clone() if codec.basis is not None else None, codec.version)
        final = completion_logps(model, batch)[0].detach()
        table = codec.token_ids
    return {"bases": bases, "metrics": metrics, "logp": final, "centres": 0 if table is None else table.numel()}


def lowrank_worker(rank: int, world_size: int, setup: dict[str, Any]) -> dict[str, Any]:
    from tclightning.grpo.update import MicrobatchLoss
    from tclightning.pipeline.engine import PipelineEngine, StageInputs, no_loss

    model = tiny_llama()
    engine = PipelineEngine(model, PipelineConfig(**with_setup(setup), timeout_s=30))
    batch = rollouts()
    inputs = StageInputs.from_rollouts(batch)
    codec = engine.module.send_codec if rank == 0 else engine.module.recv_codec
    bases, metrics = {}, {}
    for step in range(6):
        engine.reset_stats()
        engine.set_step(step)
        loss_fn = no_loss
        if engine.is_last:
            loss_fn = MicrobatchLoss(old_logp=None, advantages=ADVANTAGES, mask=batch.completion_mask,
                                     logp_sampler=batch.logp_sampler, ref_logp=None, settings=LOSS, norm_length=4)
        engine.run(inputs, loss_fn)
        if step == SHIP_STEP:
            snapshot = [p.detach().clone() for p in engine.owned_parameters()]
            engine.dense_gradient(snapshot, inputs, loss_fn)
        metrics[step] = engine.metrics()
        bases[step] = (codec.basis.clone() if codec.basis is not None else None, codec.version)
        if codec.token_ids is not None:
            bases[step] += (codec.token_ids.clone(), codec.token_offsets.clone())
    logp, _ = engine.run(inputs)
    return {"bases": bases, "metrics": metrics, "logp": logp, "state": engine.cut_state_dict(), "setup": setup}


@pytest.fixture(scope="module", params=[{"basis": {"tokens": 0}}, {"basis": {"tokens": 1024}},
                                        {"basis": {"tokens": 1024}, "payload_dtype": "float16"}],
                ids=["one-centre", "token-centres", "float16-payload"])
def two_ranks(request: pytest.FixtureRequest) -> tuple[dict[str, Any], dict[str, Any]]:
    outcomes = run_ranks(lowrank_worker, 2, request.param, timeout_s=30)
    for outcome in outcomes:
        assert outcome.error is None, outcome.trace
    return outcomes[0].value, outcomes[1].value


def test_two_processes_refresh_identically_on_both_sides_and_match_one_process(two_ranks: Any) -> None:
    sender, receiver = two_ranks
    ref = one_process(sender["setup"])
    centres = sender["setup"]["basis"]["tokens"] > 0
    versions = {step: ref["bases"][step][1] for step in range(6)}
    assert versions == {0: 0, 1: 1, 2: 1, 3: 2, 4: 2, 5: 3}  # cold start, fit, -, ship, -, shared refit
    for step in range(6):
        basis_s, version_s = sender["bases"][step][:2]
        basis_r, version_r = receiver["bases"][step][:2]
        assert version_s == version_r == versions[step]
        if basis_s is None:
            assert basis_r is None and step == 0
            continue
        assert torch.equal(basis_s, basis_r), step  # the two sides: bit for bit
        assert len(sender["bases"][step]) == len(receiver["bases"][step]) == (4 if centres else 2)
        for table_s, table_r in zip(sender["bases"][step][2:], receiver["bases"][step][2:], strict=True):
            assert torch.equal(table_s, table_r), step  # the token centres too
        torch.testing.assert_close(basis_s, ref["bases"][step][0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(receiver["logp"], ref["logp"], rtol=1e-4, atol=1e-5)
    # bytes: dense at the cold start, r values per token after (each in the wire dtype, against the
    # dense boundary in float32), the shipped basis (float32) at step 3 only
    tokens = int(rollouts().attention_mask.sum())
    value = 2 if sender["setup"].get("payload_dtype") else 4
    for rank_result in (sender, receiver):
        m = rank_result["metrics"]
        assert m[0]["wire/cut0/bytes_fwd"] == tokens * 64 * value == ref["metrics"][0]["wire/cut0/bytes_fwd"]
        assert m[1]["wire/cut0/bytes_fwd"] == tokens * 5 * value == ref["metrics"][1]["wire/cut0/bytes_fwd"]
        assert m[1]["wire/cut0/bytes_bwd"] == tokens * 5 * value == ref["metrics"][1]["wire/cut0/bytes_bwd"]
        assert m[1]["wire/dense_bytes_fwd"] == tokens * 64 * 4 == ref["metrics"][1]["wire/dense_bytes_fwd"]
        shipped = 4 + (64 * 5 + 64 + ref["centres"] * 65) * 4  # the refit flag, the basis, the token centres
        assert m[SHIP_STEP]["wire/basis_bytes"] == shipped == ref["metrics"][SHIP_STEP]["wire/basis_bytes"]
        assert m[SHIP_STEP]["wire/cut0/bytes_fwd"] == tokens * 5 * value + shipped
        assert m[SHARED_STEP]["wire/basis_bytes"] == 0.0  # the anchor's traffic refreshed it for free
        assert 0.0 < m[2]["wire/energy_kept"] <= 1.0
        assert m[2]["wire/energy_kept"] == pytest.approx(ref["metrics"][2]["wire/energy_kept"], rel=1e-4)


def test_resume_restores_the_codec_state_exactly(two_ranks: Any, tmp_path: Path) -> None:
    """A one-process CutSet and a two-process checkpoint both restore the basis and its windows."""
    config = PipelineConfig(**with_setup(two_ranks[0]["setup"]))
    ref_model, batch = tiny_llama(), rollouts()
    with CutSet(ref_model, config) as cuts:
        for step in range(3):
            cuts.set_step(step)
            completion_logps(ref_model, batch)
        torch.save(cuts.state_dict(), tmp_path / "cuts.pt")
        cuts.set_step(3)
        expected = completion_logps(ref_model, batch)[0]
        expected_basis = cuts.boundaries[0].codec.basis.clone()
    model = tiny_llama()
    with CutSet(model, config) as resumed:
        resumed.load_state_dict(torch.load(tmp_path / "cuts.pt", weights_only=True))
        resumed.set_step(3)  # a shipped refit from the restored window
        assert torch.equal(resumed.boundaries[0].codec.basis, expected_basis)
        torch.testing.assert_close(completion_logps(model, batch)[0], expected, rtol=0, atol=0)
    # the two-process checkpoint holds both sides: the sender's window and the receiver's basis
    state = two_ranks[0]["state"]
    assert state["forward"][0]["version"] == 3 and state["sender"][0]["version"] == 3
    assert torch.equal(state["forward"][0]["basis"], state["sender"][0]["basis"])
    for name in ("token_ids", "token_offsets"):
        assert (state["forward"][0][name] is None) == (not two_ranks[0]["setup"]["basis"]["tokens"])
        if state["forward"][0][name] is not None:
            assert torch.equal(state["forward"][0][name], state["sender"][0][name])


def test_a_run_logs_energy_kept_and_refreshes_from_the_anchor_for_free(tmp_path: Path) -> None:
    common = [*FAST, "trainer.steps=6", "trainer.val_every=0", "trainer.checkpoint_every=0",
              "logging.progress=none", f"logging.root={tmp_path}", "pipeline.basis.refresh_every=2", "pipeline.stages=2"]
    alone = run("fast-only-lowrank", common, quiet=True)
    rows = read_metrics(Path(alone["run_dir"]) / "metrics.csv")
    assert all(0.0 < rows[s]["wire/energy_kept"] <= 1.0 for s in rows if s > 0)
    assert sum(rows[s]["wire/basis_bytes"] for s in rows) > 0  # no anchor: the sender ships
    anchored = run("all-compressed-lowrank", [*common, "anchor.latency=1", "anchor.cadence=1"], quiet=True)
    rows = read_metrics(Path(anchored["run_dir"]) / "metrics.csv")
    assert sum(rows[s]["wire/basis_bytes"] for s in rows) == 0  # the anchor's dense pass fed both sides
    assert rows[max(rows)]["wire/cut0/bytes_fwd"] < rows[min(rows)]["wire/cut0/bytes_fwd"] / 4  # dense, then r


# ------------------------------------------------------------------ switching the codec of a running CutSet
def test_switch_codec_rebuilds_the_compressed_cuts_and_a_resumed_cutset_follows() -> None:
    model, batch = tiny_llama(), rollouts()
    config = PipelineConfig(layout="shallow", stages=3, codec="prf", k=5, entropy_coding=False)
    with CutSet(model, config) as cuts:
        dense_cut = cuts.boundaries[1].codec
        cuts.switch_codec("lowrank")
        codec = cuts.boundaries[0].codec
        assert isinstance(codec, AdaptiveLowRankCodec) and codec.rank == 5 and codec.width == 64  # cold: dense
        assert cuts.boundaries[1].codec is dense_cut and cuts.config.codec == "lowrank"
        for step in range(3):  # cold start (dense) at step 0, then the fitted basis
            cuts.reset_stats()
            cuts.set_step(step)
            completion_logps(model, batch)
        assert codec.basis is not None and codec.width == 5 and cuts.metrics()["wire/bytes_fwd"] > 0
        state = cuts.state_dict()
        expected = completion_logps(model, batch)[0].detach()
    assert state["codec"] == "lowrank"
    with CutSet(model, config) as resumed:  # built from the recipe (prf), then the checkpoint
        resumed.load_state_dict(state)
        assert isinstance(resumed.boundaries[0].codec, AdaptiveLowRankCodec)
        assert torch.equal(completion_logps(model, batch)[0].detach(), expected)
    with CutSet(model, PipelineConfig(layout="dense", stages=3)) as dense, pytest.raises(TclightningError,
                                                                                         match="no cut is compressed"):
        dense.switch_codec("lowrank")
