"""``tclightning bench traffic``: bytes per RL step per class from a recipe and a config.json, checked
against what two stage processes measure for the same batch at toy size."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from tclightning.bench.launch import run_ranks
from tclightning.bench.traffic import CONFIGS, TrafficAssumptions, parse_links, read_model_config, step_traffic
from tclightning.cli.main import main
from tclightning.errors import TclightningError
from tclightning.recipes.loader import load_recipe, to_dataclass

ROWS, LENGTH, K = 6, 9, 5
TOY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
       "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 97, "tie_word_embeddings": True}


def toy_recipe(layout: str, anchor: tuple[str, ...] = ("anchor.merger=none",), stages: int = 2) -> Any:
    return to_dataclass(load_recipe("tiny", [
        "trainer.strategy=pipeline", f"pipeline.stages={stages}", f"pipeline.layout={layout}", f"pipeline.k={K}",
        "grpo.prompts_per_step=3", "sampler.group_size=2", *anchor]))


SAMPLER_ANCHOR = ("anchor.merger=signed_ema", "anchor.placement=sampler", "anchor.cadence=2", "grpo.minibatches=2",
                  "grpo.epochs=2")  # 4 ticks a step, an anchor pass every 2: 2 passes a step


def toy_model() -> transformers.PreTrainedModel:
    values = dict(TOY)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(values.pop("model_type"), **values))


def measured_worker(rank: int, world_size: int, layout: str) -> dict[str, float]:
    """One forward/backward of ROWS full rows of LENGTH tokens over two stage processes, then the
    weight sync: the bytes the engine counted from its actual sends."""
    from tclightning.pipeline.engine import PipelineEngine, StageInputs, no_loss

    engine = PipelineEngine(toy_model(), toy_recipe(layout).pipeline)
    ids = torch.randint(3, TOY["vocab_size"], (ROWS, LENGTH), generator=torch.Generator().manual_seed(1))
    inputs = StageInputs(ids, torch.ones(ROWS, LENGTH, dtype=torch.long), torch.arange(LENGTH).repeat(ROWS, 1),
                         ids[:, -4:], torch.ones(ROWS, 4))
    engine.run(inputs, (lambda logp, rows: logp.sum()) if engine.is_last else no_loss)
    sync = engine.sync_to_sampler()
    wire = engine.metrics()
    return {"boundary": wire["wire/bytes_fwd"] + wire["wire/bytes_bwd"], "sync": float(sync)}


def sign_worker(rank: int, world_size: int) -> dict[str, Any]:
    """One anchor pass with ``anchor.placement: sampler`` over ``world_size`` stage processes (the
    sampling rank's whole-model M, the signs to every other rank): the bytes counted from the
    actual sends, and whether a received tensor had an exact zero (the formula assumes none)."""
    from tclightning.anchor.placement import SignRelay
    from tclightning.backend import BackendRequest
    from tclightning.grpo.config import GRPOConfig
    from tclightning.grpo.update import LossSettings, MicrobatchLoss
    from tclightning.models.logprobs import completion_logps
    from tclightning.pipeline.backends import PipelineBackend
    from tclightning.pipeline.engine import PipelineEngine
    from tests.test_distributed import ADVANTAGES, rollouts

    model = toy_model()
    engine = PipelineEngine(model, toy_recipe("all", SAMPLER_ANCHOR, world_size).pipeline)
    backend = PipelineBackend(BackendRequest(model, 1.0, completion_logps, lambda loss: loss.backward()), engine)
    batch = rollouts()
    if backend.samples:
        snapshot = [p.detach().clone() for p in backend.sampler_anchor_parameters()]
        loss = MicrobatchLoss(old_logp=None, advantages=ADVANTAGES, mask=batch.completion_mask,
                              logp_sampler=batch.logp_sampler, ref_logp=None,
                              settings=LossSettings.of(GRPOConfig()).on_policy(), norm_length=4)
        own, sent = backend.sampler_anchor_gradient(snapshot, batch, loss, SignRelay(0.0))
    else:
        own, sent = backend.sampler_anchor_gradient(None, None, None, SignRelay(0.0))
    return {"anchor": sent, "zeros": any(bool((t == 0).any()) for t in own)}


@pytest.mark.parametrize("stages", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_the_sampler_placement_anchor_formula_equals_what_the_stage_processes_send(stages: int) -> None:
    """``anchor.placement: sampler``: the sign bits of stages 2..S's parameters (the tied embedding
    with the last stage) per pass, times the passes a step, to the byte."""
    outcomes = run_ranks(sign_worker, stages, timeout_s=60)
    for outcome in outcomes:
        assert outcome.error is None, outcome.trace
    assert len({outcome.value["anchor"] for outcome in outcomes}) == 1  # every rank counts the same
    assert not any(outcome.value["zeros"] for outcome in outcomes)
    recipe = toy_recipe("all", SAMPLER_ANCHOR, stages)
    rows = step_traffic(recipe, TOY, TrafficAssumptions(tokens_per_row=LENGTH, activation_dtype="float32",
                                                        sampler_dtype="float32"))
    passes = recipe.grpo.epochs * recipe.grpo.minibatches / recipe.anchor.cadence
    assert passes == 2
    for row in rows[1:3]:  # the compressed rows; LoRA's counts the adapters' signs instead
        assert row.classes["anchor"] == passes * outcomes[0].value["anchor"]
    dense = step_traffic(toy_recipe("all", SAMPLER_ANCHOR[:1] + SAMPLER_ANCHOR[2:], stages), TOY, TrafficAssumptions(
        tokens_per_row=LENGTH, activation_dtype="float32", sampler_dtype="float32"))
    assert 0 < rows[1].classes["anchor"] < dense[1].classes["anchor"]  # bits, not [T, d] activations


@pytest.mark.parametrize("layout", ["dense", "all"])
def test_the_formulas_equal_what_two_stage_processes_send(layout: str) -> None:
    outcomes = run_ranks(measured_worker, 2, layout, timeout_s=30)
    for outcome in outcomes:
        assert outcome.error is None, outcome.trace
    measured = outcomes[0].value
    rows = step_traffic(toy_recipe(layout), TOY, TrafficAssumptions(
        tokens_per_row=LENGTH, activation_dtype="float32", sampler_dtype="float32"))
    modeled = rows[0 if layout == "dense" else 1].classes
    assert modeled["boundary"] == measured["boundary"]
    assert modeled["weight_sync"] == measured["sync"]
    assert modeled["anchor"] == 0.0  # merger none


def test_the_json_lines_and_the_classes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TOY))
    code = main(["bench", "traffic", "--recipe", "tiny", "trainer.strategy=pipeline", "pipeline.stages=2",
                 "pipeline.layout=all", "--model-config", str(tmp_path), "--json", "--link", "100mbit"])
    assert code == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["config"] for line in lines] == list(CONFIGS)
    for line in lines:
        parts = sum(line[f"{name}_bytes"] for name in ("boundary", "anchor", "weight_sync", "tied_embedding", "rollouts"))
        assert line["total_bytes"] == pytest.approx(parts)
        assert line["seconds_at_100mbit"] == pytest.approx(line["total_bytes"] * 8 / 1e8)
    dense, compressed, sparse, lora = lines
    assert compressed["boundary_bytes"] < dense["boundary_bytes"]
    assert sparse["weight_sync_bytes"] < compressed["weight_sync_bytes"]
    assert lora["tied_embedding_bytes"] == 0 and lora["weight_sync_bytes"] < compressed["weight_sync_bytes"]


def test_the_shipped_configs_and_bad_input() -> None:
    qwen = read_model_config("Qwen/Qwen2.5-1.5B-Instruct")
    assert qwen["hidden_size"] == 1536 and qwen["vocab_size"] == 151936
    rows = step_traffic(to_dataclass(load_recipe("bigmath_shallow", ["pipeline.layout=all", "anchor.merger=none"])),
                        qwen, TrafficAssumptions())
    dense = rows[0].classes
    tokens = 32 * 8 * 640
    assert dense["boundary"] == 3 * 2 * tokens * 1536 * 2  # 3 cuts, both ways, bf16
    assert dense["tied_embedding"] == 2 * 151936 * 1536 * 4  # float32, each way, one tick
    with pytest.raises(TclightningError, match="no config.json"):
        read_model_config("no/such-model")
    with pytest.raises(TclightningError, match="--link 'fast'"):
        parse_links("1gbit,fast")


def test_the_default_tied_rows_follow_the_measured_distinct_ids() -> None:
    """Without ``--distinct-ids`` a tick's tied rows are Heaps' law at its tokens, which stays within
    6% of the counts measured on GSM8K with SmolLM2's tokenizer (docs/distributed.md), and at most
    the vocabulary."""
    from tclightning.bench.traffic import expected_distinct_ids

    for tokens, measured in ((20_000, 1511), (163_840, 5264), (655_360, 10045)):
        assert abs(expected_distinct_ids(tokens) - measured) <= 0.06 * measured
    assert expected_distinct_ids(10**12) > 151_936  # the law grows past a vocabulary: the caller caps it
