"""``pipeline.tied_rows``: the last stage owns a tied embedding; the first receives only the rows
of each pass's token ids and sends back only their gradient. On 2 and 3 processes the weights
after every tick equal one process's and the dense gradient sum's, the bytes are the rows sent,
and rank 0's sampling copy holds the current tied weight after each sync."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tclightning.bench.launch import run_ranks
from tclightning.errors import TclightningError
from tclightning.pipeline import CutSet, PipelineConfig
from tests.test_distributed import (
    ADVANTAGES,
    DIM,
    STEP,
    TURNS,
    backend_request,
    rollouts,
    run_update,
    tiny_llama,
)

UPDATES = 3  # one tick each (minibatches=1), then run_update's two ticks
TIED = "model.embed_tokens.weight"


def config(stages: int, tied_rows: bool) -> PipelineConfig:
    return PipelineConfig(stages=stages, layout="all", k=5, schedule="1f1b", microbatches=3, timeout_s=20,
                          tied_rows=tied_rows)


def one_tick(backend: Any, optimizer: Any, step: int) -> None:
    from tclightning.grpo.config import GRPOConfig
    from tclightning.grpo.update import grpo_update

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda tick: 1.0)
    backend.begin_step(step)
    grpo_update(backend, optimizer, schedule, rollouts(), ADVANTAGES, torch.arange(6),
                cfg=GRPOConfig(minibatches=1, max_grad_norm=1.0), norm_length=4, seed=0, step=step, turns=TURNS)


def weights(model: torch.nn.Module, owned: list[torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    names = {id(p): name for name, p in model.named_parameters()}
    return {names[id(p)]: p.detach().clone() for p in owned}


def trace(backend: Any, model: torch.nn.Module, sampled: bool = False) -> list[dict[str, Any]]:
    """UPDATES one-tick SGD updates, then run_update's two SGD ticks: after each update the
    weights this rank trains, the step's wire metrics and what rank 0 samples with (its tied weight)."""
    optimizer = torch.optim.SGD(backend.owned_parameters(), lr=0.1)
    out = []
    for update in range(UPDATES + 1):
        if update < UPDATES:
            one_tick(backend, optimizer, STEP + update)
        else:
            backend.begin_step(STEP + update)
            run_update(backend, model, ADVANTAGES)  # its own SGD; grpo_update ends with the sync
        sampler = backend.sampling_model() if sampled else model
        out.append({"weights": weights(model, backend.owned_parameters()), "wire": backend.wire_metrics(),
                    "sampled": sampler.get_input_embeddings().weight.detach().clone().float()})
    return out


def rank_worker(rank: int, world_size: int, _: Any) -> dict[str, Any]:
    from tclightning.backend import BackendRequest
    from tclightning.models.logprobs import completion_logps
    from tclightning.pipeline.backends import PipelineBackend
    from tclightning.pipeline.engine import PipelineEngine

    results: dict[str, Any] = {}
    for name, tied_rows, dtype in (("rows", True, None), ("dense", False, None), ("rows-sparse", True, torch.bfloat16)):
        model = tiny_llama()
        engine = PipelineEngine(model, config(world_size, tied_rows))
        request = BackendRequest(model, 1.0, completion_logps, lambda loss: loss.backward(), sampler_dtype=dtype)
        results[name] = trace(PipelineBackend(request, engine), model, sampled=dtype is not None)
    return results


def reference(stages: int) -> list[dict[str, Any]]:
    from tclightning.pipeline.backends import LocalBackend

    model = tiny_llama()
    with CutSet(model, config(stages, False)) as cuts:
        return trace(LocalBackend(backend_request(model), cuts), model)


def distinct_ids() -> int:
    return int(torch.unique(rollouts().input_ids).numel())


@pytest.mark.parametrize("processes", [2, 3])
def test_tied_rows_train_as_one_process_and_send_only_the_rows(processes: int) -> None:
    outcomes = run_ranks(rank_worker, processes, None, timeout_s=120)
    for outcome in outcomes:
        assert outcome.error is None, outcome.trace
    want = reference(processes)
    first, last = outcomes[0].value, outcomes[-1].value
    row_bytes = distinct_ids() * DIM * 4
    for name in ("rows", "dense", "rows-sparse"):
        for update, expected in enumerate(want):
            got: dict[str, torch.Tensor] = {}
            dense: dict[str, torch.Tensor] = {}
            for outcome in outcomes:
                got.update(outcome.value[name][update]["weights"])
                dense.update(outcome.value["dense"][update]["weights"])
            assert sorted(got) == sorted(expected["weights"]), (name, update)
            for key, weight in expected["weights"].items():
                torch.testing.assert_close(got[key], weight, rtol=1e-6, atol=1e-6, msg=f"{name} {update} {key}")
                torch.testing.assert_close(got[key], dense[key], rtol=1e-6, atol=1e-6)
            current = last[name][update]["weights"][TIED]
            if name == "rows-sparse":  # the sampler's bfloat16 copy, brought up to date by the last stage
                assert torch.equal(first[name][update]["sampled"], current.to(torch.bfloat16).float())
            else:  # rank 0's dense copy samples (and is what a checkpoint saves)
                assert torch.equal(first[name][update]["sampled"], current)
    for update in range(UPDATES):
        tied = [first[name][update]["wire"]["wire/tied_bytes"] for name in ("rows", "dense", "rows-sparse")]
        # rank 0 holds the current tied weight at the start and after a dense sync: only the gradient
        # rows cross; after a sparse sync the rows cross down first
        assert tied == [row_bytes, 2 * 97 * DIM * 4, (2 if update else 1) * row_bytes], update
    assert TIED not in first["rows"][0]["weights"] and TIED in last["rows"][0]["weights"]


def anchor_worker(rank: int, world_size: int, _: Any) -> dict[str, Any]:
    """test_distributed's anchor circuit (signed_ema, K=1/C=2, 4 SGD ticks) with tied rows: the
    dense pass at a snapshot sends the snapshot's rows and returns their gradient too."""
    from tests.test_distributed import anchor_worker as dense_exchange_worker

    result = dense_exchange_worker(rank, config(world_size, True))
    result.pop("declared")
    return result


def test_the_anchor_dense_pass_with_tied_rows_merges_as_one_process() -> None:
    from tests.test_distributed import anchor_reference

    outcomes = run_ranks(anchor_worker, 2, None, timeout_s=120)
    for outcome in outcomes:
        assert outcome.error is None, outcome.trace
    ref = anchor_reference()  # the same cut (prf, k=5, 1f1b, 3 micro-batches) in one process
    first, last = (outcome.value for outcome in outcomes)
    assert ref["delivered"] == first["delivered"] == last["delivered"] == 2
    for tick, expected in enumerate(ref["merged"]):
        assert TIED not in first["merged"][tick]  # the last stage owns it
        got = {**first["merged"][tick], **last["merged"][tick]}
        assert set(got) == set(expected)
        for name, grad in expected.items():
            torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6, msg=f"tick {tick} {name}")
    assert ref["bytes"] == first["bytes"] == last["bytes"]


def test_tied_rows_with_replicas_are_refused_by_name() -> None:
    with pytest.raises(TclightningError, match="pipeline.tied_rows.*pipeline.replicas=2"):
        PipelineConfig(stages=2, replicas=2, tied_rows=True).validate()
