"""The pipeline split runs each family's own forward: one process (cuts as hooks) against 2 and 4
processes (one stage each) for tiny random configs of Llama, Qwen2, Qwen3, Gemma 3 and Phi-3.

Loss, every gradient and the boundary bytes must agree; each world size is one spawn over every
family (start-up dominates the time).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers

from tclightning.bench.launch import run_ranks
from tclightning.errors import TclightningError
from tclightning.models.logprobs import completion_logps
from tclightning.pipeline import CutSet, PipelineConfig
from tclightning.pipeline.stage import StageModule, split_model
from tests.test_distributed import rollouts

DIM, LAYERS, VOCAB, STEP = 64, 4, 97, 3
ADVANTAGES = torch.tensor([1.0, -0.5, -0.5, 0.7, 0.3, -1.0])
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    # sliding and full layers mixed, a window shorter than the rows: each stage must read its own layers' types
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "head_dim": 16, "sliding_window": 3,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
}


def tiny_model(family: str) -> transformers.PreTrainedModel:
    config_name, model_name, extra = FAMILIES[family]
    config = getattr(transformers, config_name)(
        hidden_size=DIM, intermediate_size=96, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2, **extra)
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config)


def config_for(stages: int) -> PipelineConfig:
    return PipelineConfig(stages=stages, layout="all", k=5, microbatches=3, timeout_s=30,
                          schedule="1f1b" if stages > 2 else "gpipe")


def policy_gradient_loss(logp: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return -(logp * ADVANTAGES[rows.cpu(), None]).sum()


def reference(family: str, stages: int) -> dict[str, Any]:
    """One process: the whole model with the same cuts as forward hooks."""
    model, batch = tiny_model(family), rollouts()
    with CutSet(model, config_for(stages)) as cuts:
        cuts.set_step(STEP)
        logp, _ = completion_logps(model, batch)
        loss = policy_gradient_loss(logp, torch.arange(6))
        loss.backward()
        wire = cuts.metrics()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return {"loss": float(loss), "logp": logp.detach(), "grads": grads, "wire": wire}


def split_worker(rank: int, world_size: int, families: list[str]) -> dict[str, Any]:
    from tclightning.pipeline.engine import PipelineEngine, StageInputs, no_loss

    results = {}
    for family in families:
        model = tiny_model(family)
        names = {id(p): name for name, p in model.named_parameters()}
        engine = PipelineEngine(model, config_for(world_size))
        engine.set_step(STEP)
        losses: list[float] = []

        def loss_fn(logp: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
            loss = policy_gradient_loss(logp, rows)
            losses.append(float(loss.detach()))
            return loss

        logp, _ = engine.run(StageInputs.from_rollouts(rollouts()), loss_fn if engine.is_last else no_loss)
        engine.reduce_tied_gradients()
        results[family] = {
            "loss": sum(losses) if engine.is_last else None, "logp": logp, "wire": engine.metrics(),
            "grads": {names[id(p)]: p.grad for p in engine.owned_parameters() if p.grad is not None},
        }
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=["2-processes", "4-processes"])
def ranks(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    outcomes = run_ranks(split_worker, request.param, list(FAMILIES), timeout_s=60)
    for outcome in outcomes:
        assert outcome.error is None, outcome.trace
    return request.param, [outcome.value for outcome in outcomes]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_stages_on_processes_match_one_process(ranks: tuple[int, list[dict[str, Any]]], family: str) -> None:
    world_size, results = ranks
    ref = reference(family, world_size)
    last = results[-1][family]
    assert last["loss"] == pytest.approx(ref["loss"], rel=1e-6, abs=1e-6)
    torch.testing.assert_close(last["logp"], ref["logp"], rtol=1e-5, atol=1e-6)
    got: dict[str, torch.Tensor] = {}
    for result in results:
        got.update(result[family]["grads"])
    assert set(got) == set(ref["grads"])
    for name, grad in ref["grads"].items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6, msg=f"{family} {name}")
    for result in results:  # bytes from the actual sends == the one-process meter, on every rank
        for key, value in ref["wire"].items():
            assert result[family]["wire"][key] == value, (family, key)
    assert ref["wire"]["wire/bytes_fwd"] == (world_size - 1) * int(rollouts().attention_mask.sum()) * 5 * 4


def test_a_stage_keeps_only_its_slice_and_shares_the_models_parameters() -> None:
    model = tiny_model("gemma3")
    config = config_for(4)
    from tclightning.pipeline.layout import resolve_layout

    specs = resolve_layout(config, LAYERS, DIM)
    stages = [StageModule(model, i, specs, send_codec=None, recv_codec=None, seed=0) for i in range(4)]
    owned = [{id(p) for p in stage.parameters()} for stage in stages]
    embedding = id(model.model.embed_tokens.weight)
    assert embedding in owned[0] and embedding in owned[3]  # tied: the head is the embedding
    assert all(embedding not in o for o in owned[1:3])
    for index, stage in enumerate(stages):
        layers = stage.body.layers
        assert len(layers) == 1 and layers[0] is model.model.layers[index]
        assert stage.body.config.layer_types == [model.config.layer_types[index]]
    assert model.config.num_hidden_layers == LAYERS and len(model.model.layers) == LAYERS  # untouched
    union = set().union(*owned)
    assert union == {id(p) for p in model.parameters()}


def test_a_model_the_split_does_not_know_is_refused_in_one_line() -> None:
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=50))
    with pytest.raises(TclightningError, match=r"cannot split GPT2LMHeadModel into pipeline stages") as caught:
        split_model(gpt2, 0, 1)
    assert "\n" not in str(caught.value)
    model = tiny_model("llama")
    model.model.add_module("adapter", torch.nn.Linear(2, 2))
    with pytest.raises(TclightningError, match=r"it also has \['adapter'\]"):
        split_model(model, 1, 2)
