"""Model loading (tiny, local HF directory), the char tokenizer, and the HF sampler."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tclightning.errors import TclightningError
from tclightning.models.logprobs import completion_logps
from tclightning.models.config import ModelConfig, TinyModelConfig
from tclightning.models.loading import load_model
from tclightning.sampling import PromptFormatter, SamplerConfig, build_sampler

TINY = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)


@pytest.fixture(scope="module")
def tiny():
    return load_model(ModelConfig(source="tiny", tiny=TINY), seed=0)


def test_char_tokenizer_round_trips_and_pads_left(tiny) -> None:
    _, tok = tiny
    text = "37+48= 85"
    assert tok.decode(tok(text)["input_ids"]) == text
    batch = tok(["1+1=", "12+34="], padding=True, return_tensors="pt")
    assert batch["attention_mask"][0].tolist() == [0, 0, 1, 1, 1, 1]
    assert tok.pad_token_id != tok.eos_token_id


def test_tiny_model_is_seeded() -> None:
    a, _ = load_model(ModelConfig(source="tiny", tiny=TINY), seed=3)
    b, _ = load_model(ModelConfig(source="tiny", tiny=TINY), seed=3)
    c, _ = load_model(ModelConfig(source="tiny", tiny=TINY), seed=4)
    pa, pb, pc = (next(m.parameters()) for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)


def test_hf_source_loads_a_local_directory(tmp_path: Path, tiny) -> None:
    model, tok = tiny
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded, loaded_tok = load_model(ModelConfig(source="hf", name=str(tmp_path)))
    ids = torch.tensor([[5, 6, 7]])
    assert torch.allclose(loaded(ids).logits, model(ids).logits)
    assert loaded_tok.padding_side == "left" and loaded_tok.pad_token_id == tok.pad_token_id


def test_loading_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(TclightningError, match="model.name"):
        load_model(ModelConfig(source="hf"))
    with pytest.raises(TclightningError, match="no such file"):
        load_model(ModelConfig(source="gguf", gguf_file=str(tmp_path / "x.gguf")))
    with pytest.raises(TclightningError, match="not installed"):
        load_model(ModelConfig(source="gguf", gguf_file="no_such_pkg_xyz:model.gguf"))
    with pytest.raises(TclightningError, match="unknown source"):
        load_model(ModelConfig(source="onnx"))


def _sampler(tok, **kwargs):
    return build_sampler(SamplerConfig(max_new_tokens=6, **kwargs), PromptFormatter(tok, None, True))


def test_sampler_shapes_masks_and_groups(tiny) -> None:
    model, tok = tiny
    rollouts = _sampler(tok, batch_size=5).generate(model, ["1+2=", "33+44="], group_size=4, seed=1)
    assert rollouts.num_sequences == 8 and rollouts.group_size == 4
    assert rollouts.completion_ids.shape == rollouts.logp_sampler.shape == rollouts.completion_mask.shape
    # prompts of a group are identical and left padded
    assert torch.equal(rollouts.prompt_ids[0], rollouts.prompt_ids[3])
    assert rollouts.prompt_mask[0, 0] == 0 and rollouts.prompt_mask[4].all()
    # masks are a prefix; log-probs are <= 0 on real tokens and 0 on padding
    mask = rollouts.completion_mask
    assert torch.all(mask[:, 1:] <= mask[:, :-1])
    assert torch.all(rollouts.logp_sampler[mask.bool()] <= 0)
    assert torch.all(rollouts.logp_sampler[~mask.bool()] == 0)
    assert rollouts.truncated.tolist() == (mask.sum(-1) == 6).tolist() or not rollouts.truncated.any()


def test_sampler_is_seeded(tiny) -> None:
    model, tok = tiny
    sampler = _sampler(tok)
    a = sampler.generate(model, ["5+5="], group_size=6, seed=7)
    b = sampler.generate(model, ["5+5="], group_size=6, seed=7)
    c = sampler.generate(model, ["5+5="], group_size=6, seed=8)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert not torch.equal(a.completion_ids, c.completion_ids)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_dense_trainer_recompute_matches_sampler(tiny, temperature: float) -> None:
    """The trainer's log-probs (one forward, cumulative positions) equal generate's: gap ~ 0."""
    model, tok = tiny
    rollouts = _sampler(tok, temperature=temperature, batch_size=3).generate(
        model, ["1+2=", "33+44=", "7+80="], group_size=2, seed=3
    )
    with torch.no_grad():
        logp, entropy = completion_logps(model, rollouts, temperature, with_entropy=True)
    assert (logp - rollouts.logp_sampler).abs().max() < 1e-4
    assert entropy is not None and torch.all(entropy[rollouts.completion_mask.bool()] > 0)


def test_greedy_generation_is_deterministic(tiny) -> None:
    model, tok = tiny
    sampler = _sampler(tok)
    a = sampler.generate(model, ["9+9="], group_size=1, seed=1, greedy=True)
    b = sampler.generate(model, ["9+9="], group_size=1, seed=2, greedy=True)
    assert a.texts == b.texts
