"""``pipeline.basis.first_fit=ship``: the sender fits the basis on the first batch it encodes and ships
it, so no step crosses dense; one process and three processes agree on the loss, the gradients,
the bases and the bytes (across processes the first batch's payloads also cross the cuts before
the deepest fitted one, once)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tclightning.bench.launch import run_ranks
from tclightning.codecs import AdaptiveLowRankCodec, CodecKey
from tclightning.codecs.lowrank import FLAG_BYTES
from tclightning.errors import TclightningError
from tclightning.models.logprobs import completion_logps
from tclightning.pipeline import CutSet, PipelineConfig
from tests.test_distributed import DIM, rollouts, tiny_llama
from tests.test_quantised_basis import loss_fn_for

CONFIG = {"layout": "all", "stages": 3, "codec": "lowrank", "k": 5, "bits": 4, "bits_lead": True,
          "microbatches": 3, "basis": {"first_fit": "ship", "tokens": 8}}
RANK, TOKEN_BYTES = 33, 20  # 5 float32 values = 20 bytes buy 1 + (160 - 32) / 4 coefficients
CUTS = 2


def ship_bytes(codec: AdaptiveLowRankCodec) -> int:
    """The first fit as it crosses: length word, basis, mean, token ids and centres in float32."""
    assert codec.token_ids is not None
    return FLAG_BYTES + 4 * (DIM * RANK + DIM + codec.token_ids.numel() * (DIM + 1))


def test_a_shipped_first_fit_encodes_at_the_rank_from_the_start_and_refuses_one_token() -> None:
    codec = AdaptiveLowRankCodec(DIM, RANK, first_fit="ship", bits=4, lead=True, token_slots=4)
    assert codec.needs_calibration and not codec.crosses_dense and codec.width == RANK
    assert codec.plan_refresh(0) is None
    dense = AdaptiveLowRankCodec(DIM, RANK)
    assert not dense.needs_calibration and dense.crosses_dense and dense.width == DIM
    with pytest.raises(ValueError, match="at least 2 tokens"):
        codec.calibrate(torch.randn(1, DIM))
    with pytest.raises(ValueError, match="first_fit must be one of dense, ship"):
        AdaptiveLowRankCodec(DIM, RANK, first_fit="late")
    gen = torch.Generator().manual_seed(0)
    x, ids = torch.randn(40, DIM, generator=gen), torch.randint(0, 6, (40,), generator=gen)
    codec.calibrate(x, ids, step=3)
    assert codec.checked_step == 3 and not codec.needs_calibration and codec.token_ids is not None
    # the receiver installs exactly the sender's fit from the message
    receiver = AdaptiveLowRankCodec(DIM, RANK, first_fit="ship", bits=4, lead=True, token_slots=4)
    receiver.load_basis_message(codec.fit_message(), 3)
    key = CodecKey(seed=0, step=3, cut=0, row_offset=0)
    assert torch.equal(receiver.decode(codec.encode(x, key, token_ids=ids), key, token_ids=ids),
                       codec.decode(codec.encode(x, key, token_ids=ids), key, token_ids=ids))
    assert codec.setup_bytes(torch.float32) == FLAG_BYTES + codec.ship_bytes()


def test_the_recipe_key_takes_dense_or_ship_only() -> None:
    with pytest.raises(TclightningError, match="pipeline.basis: first_fit: expected one of dense, ship, got 'late'"):
        PipelineConfig(basis={"first_fit": "late"}).validate()


def one_process() -> dict[str, Any]:
    model, batch = tiny_llama(), rollouts()
    with CutSet(model, PipelineConfig(**CONFIG)) as cuts:
        cuts.set_step(0)
        cuts.reset_stats()
        logp, _ = completion_logps(model, batch)
        loss_fn = loss_fn_for(batch)
        loss_fn(logp, torch.arange(batch.num_sequences)).backward()
        wire = cuts.metrics()
        codecs = [b.codec for b in cuts.boundaries]
        state = cuts.state_dict()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss_fn.stats["loss/policy"], "grads": grads, "logp": logp.detach(), "wire": wire,
            "ships": [ship_bytes(c) for c in codecs], "state": state}


def stage_worker(rank: int, world_size: int, _: Any) -> dict[str, Any]:
    from tclightning.pipeline.engine import PipelineEngine, StageInputs, no_loss

    model = tiny_llama()
    names = {id(p): name for name, p in model.named_parameters()}
    engine = PipelineEngine(model, PipelineConfig(**CONFIG, timeout_s=30))
    batch = rollouts()
    engine.set_step(0)
    engine.reset_stats()
    loss_fn = loss_fn_for(batch) if engine.is_last else no_loss
    logp, _ = engine.run(StageInputs.from_rollouts(batch), loss_fn)
    engine.reduce_tied_gradients()
    grads = {names[id(p)]: p.grad.clone() for p in engine.owned_parameters() if p.grad is not None}
    return {"loss": loss_fn.stats["loss/policy"] if engine.is_last else None, "grads": grads, "logp": logp,
            "wire": engine.metrics(), "state": engine.cut_state_dict()}


def test_three_processes_match_one_process_and_no_step_crosses_dense() -> None:
    outcomes = run_ranks(stage_worker, CUTS + 1, None, timeout_s=60)
    for outcome in outcomes:
        assert outcome.error is None, outcome.trace
    first, last = outcomes[0].value, outcomes[-1].value
    ref = one_process()
    assert last["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-7)
    torch.testing.assert_close(last["logp"], ref["logp"], rtol=1e-5, atol=1e-6)
    got = {k: v for outcome in outcomes for k, v in outcome.value["grads"].items()}
    assert set(got) == set(ref["grads"])
    for name, grad in ref["grads"].items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    tokens = int(rollouts().attention_mask.sum())
    wire, one = first["wire"], ref["wire"]
    for cut in range(CUTS):
        # one process: the fit once, then the step's payload, compressed from the first step
        assert one[f"wire/cut{cut}/bytes_fwd"] == ref["ships"][cut] + tokens * TOKEN_BYTES
        assert one[f"wire/cut{cut}/bytes_bwd"] == tokens * TOKEN_BYTES
        assert one[f"wire/cut{cut}/basis_bytes"] == ref["ships"][cut]
        # processes: the same, and the first batch crossed cut 0 once more so that stage 1 fits
        # cut 1 on what it receives
        again = tokens * TOKEN_BYTES if cut < CUTS - 1 else 0
        assert wire[f"wire/cut{cut}/bytes_fwd"] == one[f"wire/cut{cut}/bytes_fwd"] + again
        assert wire[f"wire/cut{cut}/bytes_bwd"] == one[f"wire/cut{cut}/bytes_bwd"]
        assert wire[f"wire/cut{cut}/basis_bytes"] == ref["ships"][cut]
        # both sides hold the sender's fit, and it is the one process's
        state = first["state"]
        assert torch.equal(state["sender"][cut]["basis"], state["forward"][cut]["basis"])
        torch.testing.assert_close(state["forward"][cut]["basis"], ref["state"]["forward"][cut]["basis"],
                                   rtol=1e-5, atol=1e-6)
