"""Every class of traffic between two stage processes is counted: the boundary, the tied
embedding's gradient sum, the rollout broadcast and the weight sync, and ``wire/total_bytes`` is
their sum (docs/metrics.md)."""

from __future__ import annotations

import pickle
from typing import Any

from tclightning.bench.launch import run_ranks
from tclightning.pipeline.boundary import TRAFFIC_METRICS, total_bytes
from tclightning.sampling.base import TENSOR_FIELDS
from tests.test_distributed import ADVANTAGES, ANCHOR_CASE, DIM, STEP, VOCAB, backend_request, config_for, \
    rollouts, run_update, tiny_llama

TICKS = 2  # run_update's minibatches


def counting_worker(rank: int, world_size: int, _: Any) -> dict[str, Any]:
    from tclightning.pipeline.backends import PipelineBackend
    from tclightning.pipeline.engine import PipelineEngine

    model = tiny_llama()
    engine = PipelineEngine(model, config_for(ANCHOR_CASE))
    backend = PipelineBackend(backend_request(model), engine)
    batch = backend.share_from_sampler(rollouts, "sharing the test's rollouts")  # before the step, as in a run
    backend.begin_step(STEP)
    run_update(backend, model, ADVANTAGES)
    backend.after_update()
    first = backend.wire_metrics()
    return {"first": first, "again": backend.wire_metrics(), "rows": batch.num_sequences}


def test_two_stage_processes_count_every_class_of_traffic() -> None:
    outcomes = run_ranks(counting_worker, 2, None, timeout_s=60)
    for outcome in outcomes:
        assert outcome.error is None, outcome.trace
    wire = outcomes[0].value["first"]
    assert wire == outcomes[1].value["first"]  # summed over the ranks: every rank reads the same
    # the tied embedding's gradient, [vocabulary, d] float32, sent by each of the two ranks each tick
    assert wire["wire/tied_bytes"] == TICKS * 2 * VOCAB * DIM * 4
    # the rollouts' pickle, once to the one other rank; counted once, then not again
    # a tensor pickles its storage in torch's legacy format, keyed by its address in decimal: the
    # same rollouts pickled in another process differ by a digit a key (two keys a tensor)
    keys = 2 * len(TENSOR_FIELDS)
    assert abs(wire["wire/rollout_bytes"] - len(pickle.dumps(rollouts().to("cpu")))) <= keys
    assert outcomes[0].value["again"]["wire/rollout_bytes"] == 0
    assert wire["wire/sync_bytes"] > 0 and wire["wire/bytes_fwd"] > 0
    assert total_bytes(wire) == sum(wire.get(name, 0.0) for name in TRAFFIC_METRICS)
    assert total_bytes(wire) == (wire["wire/bytes_fwd"] + wire["wire/bytes_bwd"] + wire["wire/sync_bytes"]
                                 + wire["wire/tied_bytes"] + wire["wire/rollout_bytes"])


def test_the_total_sums_only_what_the_step_logged() -> None:
    assert total_bytes({"wire/bytes_fwd": 10.0, "wire/bytes_bwd": 5.0, "anchor/bytes": 2.0, "loss/policy": 9.0}) == 17.0
