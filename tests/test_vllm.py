"""The vllm sampler backend.

CPU (always): selecting it without CUDA / without vllm / with an old vllm fails with one clear
line; the adapter around the engine (prompts in as token ids, per-row seeds, processed log-probs
out, eos handling, weight pushes after optimizer steps) against a stand-in engine that generates
with the HF model it was started from. GPU (``-m gpu``, skipped without CUDA and vllm): the real
engine, via benchmarks/vllm_check.py's ``run_check``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from tclightning.cli.main import main
from tclightning.errors import TclightningError
from tclightning.models.config import ModelConfig, TinyModelConfig
from tclightning.models.loading import load_model
from tclightning.sampling import PromptFormatter, build_sampler
from tclightning.sampling import vllm as vllm_backend
from tclightning.sampling.config import SamplerConfig
from tclightning.sampling.hf import HFSampler
from tests.conftest import FAST

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["12+34=", "5+6=", "70+8="]


# ------------------------------------------------------------------------------- clear refusals
def test_no_cuda_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _, tokenizer = load_model(ModelConfig(source="tiny", tiny=TinyModelConfig(hidden_size=16, num_layers=1)))
    with pytest.raises(TclightningError, match="needs a CUDA GPU"):
        build_sampler(SamplerConfig(backend="vllm"), PromptFormatter(tokenizer))


def test_missing_or_old_vllm_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError, installed or not
    with pytest.raises(TclightningError, match=r"pip install 'tclightning\[vllm\]'"):
        vllm_backend.require_vllm()
    old = ModuleType("vllm")
    old.__version__ = "0.8.5"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", old)
    with pytest.raises(TclightningError, match=r"too old.*>= 0\.10\.2"):
        vllm_backend.require_vllm()
    new = ModuleType("vllm")
    new.__version__ = "0.11.0+cu128"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", new)
    assert vllm_backend.require_vllm() is new


def test_cli_run_with_vllm_on_cpu_is_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--recipe", "tiny", *FAST, "sampler.backend=vllm"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "sampler.backend=vllm" in err[0]
    assert "Traceback" not in "\n".join(err) and not (tmp_path / "runs").exists()


# ------------------------------------------------------------------------- a stand-in engine
class FakeSamplingParams:
    def __init__(self, **kwargs: Any) -> None:
        self.__dict__.update(kwargs)


class FakeLLM:
    """Mimics the parts of ``vllm.LLM`` the sampler uses: started from the saved checkpoint, it
    generates with that HF model (one request at a time, vLLM's output shape, stop token kept,
    processed log-probs = log_softmax(logits / T)) and loads weights through the worker extension."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.model = AutoModelForCausalLM.from_pretrained(kwargs["model"]).eval()
        self.rpc: list[str] = []
        self.seen_params: list[FakeSamplingParams] = []

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        self.rpc.append(method)
        worker = type("Worker", (vllm_backend.WeightSyncExtension,), {})()
        worker.model_runner = SimpleNamespace(model=SimpleNamespace(load_weights=self._load_weights))
        return [getattr(worker, method)(*args)]

    def _load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in weights:
                params[name].copy_(tensor)

    @torch.no_grad()
    def generate(self, prompts: list[dict], params: list[FakeSamplingParams], use_tqdm: bool = False) -> list[Any]:
        outputs = []
        for prompt, p in zip(prompts, params, strict=True):
            self.seen_params.append(p)
            ids = torch.tensor([prompt["prompt_token_ids"]])
            greedy = p.temperature == 0
            torch.manual_seed(p.seed)
            out = self.model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=not greedy, max_new_tokens=p.max_tokens,
                temperature=None if greedy else p.temperature, top_p=None, top_k=None if greedy else 0,
                eos_token_id=p.stop_token_ids, pad_token_id=p.stop_token_ids[0],
                output_logits=True, return_dict_in_generate=True,
            )  # fmt: skip
            tokens = out.sequences[0, ids.shape[1] :].tolist()
            if p.stop_token_ids[0] in tokens:  # vLLM stops at (and keeps) the stop token
                tokens = tokens[: tokens.index(p.stop_token_ids[0]) + 1]
            logits = torch.stack(out.logits, 1)[0, : len(tokens)].float() / (1.0 if greedy else p.temperature)
            logp = F.log_softmax(logits, -1)[torch.arange(len(tokens)), tokens].tolist()
            steps = [{t: SimpleNamespace(logprob=v)} for t, v in zip(tokens, logp)]
            outputs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens, logprobs=steps)]))
        return outputs


@pytest.fixture()
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    module = SimpleNamespace(LLM=FakeLLM, SamplingParams=FakeSamplingParams, __version__="0.11.0")
    monkeypatch.setattr(vllm_backend, "require_vllm", lambda: module)
    return module


@pytest.fixture()
def tiny() -> tuple[Any, PromptFormatter]:
    model, tokenizer = load_model(ModelConfig(source="tiny", tiny=TinyModelConfig(hidden_size=32, num_layers=2)), seed=0)
    return model.eval(), PromptFormatter(tokenizer, None, True)


def test_greedy_rollouts_match_the_hf_backend(fake_vllm: SimpleNamespace, tiny: tuple) -> None:
    model, formatter = tiny
    cfg = SamplerConfig(backend="vllm", max_new_tokens=8, vllm={"gpu_memory_utilization": 0.25})
    sampler = build_sampler(cfg, formatter)
    assert isinstance(sampler, vllm_backend.VLLMSampler)
    ours = sampler.generate(model, PROMPTS, group_size=2, seed=5, greedy=True)
    ref = HFSampler(cfg, formatter).generate(model, PROMPTS, group_size=2, seed=5, greedy=True)
    for name in ("prompt_ids", "prompt_mask", "completion_mask", "truncated"):
        assert torch.equal(getattr(ours, name), getattr(ref, name)), name
    width = ref.completion_ids.shape[1]
    assert torch.equal(ours.completion_ids[:, :width] * ours.completion_mask.long(), ref.completion_ids * ref.completion_mask.long())
    torch.testing.assert_close(ours.logp_sampler, ref.logp_sampler, atol=1e-5, rtol=0)
    assert ours.texts == ref.texts and ours.group_size == 2
    engine = sampler.llm
    assert engine.kwargs["logprobs_mode"] == "processed_logprobs"
    assert engine.kwargs["gpu_memory_utilization"] == 0.25 and engine.kwargs["skip_tokenizer_init"]
    module, cls = engine.kwargs["worker_extension_cls"].rsplit(".", 1)
    assert hasattr(getattr(importlib.import_module(module), cls), vllm_backend._LOAD_METHOD)
    params = engine.seen_params
    assert all(p.logprobs == 0 and p.temperature == 0.0 and p.stop_token_ids == [formatter.tokenizer.eos_token_id] for p in params)
    sampler.close()


def test_seeds_are_per_row_and_reproducible(fake_vllm: SimpleNamespace, tiny: tuple) -> None:
    model, formatter = tiny
    sampler = build_sampler(SamplerConfig(backend="vllm", max_new_tokens=6, temperature=0.7), formatter)
    first = sampler.generate(model, PROMPTS, group_size=3, seed=11)
    again = sampler.generate(model, PROMPTS, group_size=3, seed=11)
    other = sampler.generate(model, PROMPTS, group_size=3, seed=12)
    seeds = [p.seed for p in sampler.llm.seen_params]
    n = len(PROMPTS) * 3
    assert len(set(seeds[:n])) == n and seeds[:n] == seeds[n : 2 * n] and set(seeds[:n]).isdisjoint(seeds[2 * n :])
    assert torch.equal(first.completion_ids, again.completion_ids) and first.texts == again.texts
    assert first.texts != other.texts
    # sampled log-probs are the tempered ones: re-scoring the tokens at T = 0.7 reproduces them
    from tclightning.models.logprobs import completion_logps

    logp, _ = completion_logps(model, first, 0.7)
    torch.testing.assert_close(logp, first.logp_sampler, atol=1e-4, rtol=0)
    sampler.close()


def test_weights_are_pushed_after_an_optimizer_step_only(fake_vllm: SimpleNamespace, tiny: tuple) -> None:
    model, formatter = tiny
    sampler = build_sampler(SamplerConfig(backend="vllm", max_new_tokens=6), formatter)
    sampler.generate(model, PROMPTS, group_size=1, seed=0, greedy=True)  # starts the engine
    sampler.generate(model, PROMPTS, group_size=1, seed=0, greedy=True)
    assert sampler.weight_syncs == 0 and sampler.llm.rpc == []  # unchanged weights: nothing sent

    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    model(input_ids=torch.tensor([[3, 4, 5, 6]]), labels=torch.tensor([[3, 4, 5, 6]])).loss.backward()
    optimizer.step()
    ours = sampler.generate(model, PROMPTS, group_size=1, seed=0, greedy=True)
    assert sampler.weight_syncs == 1 and sampler.llm.rpc == [vllm_backend._LOAD_METHOD]
    engine_params = dict(sampler.llm.model.named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(engine_params[name], param.detach()), name
    ref = HFSampler(sampler.cfg, formatter).generate(model, PROMPTS, group_size=1, seed=0, greedy=True)
    torch.testing.assert_close(ours.logp_sampler, ref.logp_sampler, atol=1e-5, rtol=0)  # the new weights sample
    sampler.close()
    assert sampler.llm is None


# ----------------------------------------------------------------------------------- real GPU
def _vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not _vllm_installed(), reason="needs a CUDA GPU and vllm")
def test_real_engine_matches_hf_and_follows_weight_updates() -> None:
    spec = importlib.util.spec_from_file_location("vllm_check", REPO / "benchmarks" / "vllm_check.py")
    check = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(check)  # type: ignore[union-attr]
    model, formatter, prompts, _ = check.load(SimpleNamespace(model="tiny", dtype="bfloat16"))
    result = check.run_check(model, formatter, prompts, group_size=4, max_new_tokens=16)
    failed = [name for name, ok in result["checks"].items() if not ok]
    assert not failed, check.report(result, "vllm check")
