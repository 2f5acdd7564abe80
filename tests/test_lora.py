"""``model.lora``: PEFT LoRA adapters on the policy. Only the adapters train, the pipeline's weight
sync sends them alone, two stage processes train them as one process does, and ``tclightning
export`` writes the merged model (or, ``--adapter-only``, the adapters in PEFT's format)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tclightning.bench.launch import run_ranks
from tclightning.callbacks.checkpointing import load_checkpoint
from tclightning.cli.main import main
from tclightning.errors import TclightningError
from tclightning.export import export_policy
from tclightning.grpo.module import GRPOModule
from tclightning.models.config import LoraConfig
from tclightning.models.lora import ADAPTER_MARK, apply_lora
from tclightning.pipeline import CutSet
from tclightning.recipes.loader import load_recipe
from tclightning.run import run
from tests.conftest import FAST
from tests.test_distributed import (
    ADVANTAGES,
    ANCHOR_CASE,
    STEP,
    backend_request,
    config_for,
    run_update,
    tiny_llama,
)

LORA = LoraConfig(r=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])
UPDATES = 3


def lora_llama() -> torch.nn.Module:
    model = apply_lora(tiny_llama(), LORA, seed=1)
    with torch.no_grad():  # B starts at zero; nonzero, so A gets gradients from the first update on
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(len(name)))
    return model


def test_only_the_adapters_train_in_one_process() -> None:
    from tclightning.pipeline.backends import LocalBackend

    model = lora_llama()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with CutSet(model, config_for(ANCHOR_CASE)) as cuts:
        backend = LocalBackend(backend_request(model), cuts)
        assert all(p.requires_grad for p in backend.owned_parameters())
        backend.begin_step(STEP)
        result = run_update(backend, model, ADVANTAGES)
    assert result["weights"] and all(ADAPTER_MARK in name for name in result["weights"])
    for name, p in model.named_parameters():
        changed = not torch.equal(p, before[name])
        assert changed == (ADAPTER_MARK in name), name


def lora_worker(rank: int, world_size: int, _: Any) -> dict[str, Any]:
    from dataclasses import replace

    from tclightning.pipeline.backends import PipelineBackend
    from tclightning.pipeline.engine import PipelineEngine

    model = lora_llama()
    try:  # the frozen tied embedding has no rows to send: refused on every rank alike
        PipelineEngine(model, replace(config_for(ANCHOR_CASE), tied_rows=True))
        refused = ""
    except TclightningError as err:
        refused = str(err)
    engine = PipelineEngine(model, config_for(ANCHOR_CASE))
    backend = PipelineBackend(backend_request(model), engine)
    weights: dict[str, torch.Tensor] = {}
    for _ in range(UPDATES):  # grpo_update ends with the sync (after_update); begin_step resets the counters
        backend.begin_step(STEP)
        weights.update(run_update(backend, model, ADVANTAGES)["weights"])
    cut = engine.specs[0].layer  # stage 1 holds the layers after it
    stage1 = sum(p.numel() for name, p in model.named_parameters()
                 if ADAPTER_MARK in name and int(name.split(".")[2]) > cut)
    return {"weights": weights, "wire": backend.wire_metrics(), "stage1_adapter_numel": stage1, "refused": refused}


def test_two_stage_processes_train_the_adapters_as_one_process_and_sync_only_them() -> None:
    from tclightning.pipeline.backends import LocalBackend

    outcomes = run_ranks(lora_worker, 2, None, timeout_s=60)
    for outcome in outcomes:
        assert outcome.error is None, outcome.trace
    got = {**outcomes[0].value["weights"], **outcomes[1].value["weights"]}
    model = lora_llama()
    with CutSet(model, config_for(ANCHOR_CASE)) as cuts:
        backend = LocalBackend(backend_request(model), cuts)
        for _ in range(UPDATES):
            backend.begin_step(STEP)
            want = run_update(backend, model, ADVANTAGES)["weights"]
    assert set(got) == set(want) and all(ADAPTER_MARK in name for name in want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-7, msg=name)
    # the weight sync: stage 1's adapters in the trainer's dtype (float32), nothing frozen
    wire = outcomes[0].value["wire"]
    assert wire["wire/sync_bytes"] == outcomes[1].value["stage1_adapter_numel"] * 4 > 0
    assert all(o.value["refused"].startswith("pipeline.tied_rows") and "\n" not in o.value["refused"]
               for o in outcomes)
    assert wire["wire/tied_bytes"] == 0  # the tied embedding is frozen: no gradient sum crosses


def sparse_worker(rank: int, world_size: int, _: Any) -> dict[str, Any]:
    """``sampler.dtype=bfloat16``: the sparse sync keeps rank 0's sampler copy of the adapters exact."""
    from dataclasses import replace

    from tclightning.pipeline.backends import PipelineBackend
    from tclightning.pipeline.engine import PipelineEngine

    model = lora_llama()
    engine = PipelineEngine(model, config_for(ANCHOR_CASE))
    backend = PipelineBackend(replace(backend_request(model), sampler_dtype=torch.bfloat16), engine)
    for _ in range(UPDATES):
        backend.begin_step(STEP)
        run_update(backend, model, ADVANTAGES)
    if rank == 0:
        return {name: p.detach().clone() for name, p in engine.sampler_copy.model.named_parameters()}
    cut = engine.specs[0].layer  # rank 1 trains the adapters after it; every rank holds the frozen rest
    return {name: p.detach().to(torch.bfloat16) for name, p in model.named_parameters()
            if not p.requires_grad or int(name.split(".")[2]) > cut}


def test_the_sparse_sync_keeps_the_samplers_copy_of_the_adapters_exact() -> None:
    outcomes = run_ranks(sparse_worker, 2, None, timeout_s=60)
    for outcome in outcomes:
        assert outcome.error is None, outcome.trace
    copy, trained = outcomes[0].value, outcomes[1].value
    assert any(ADAPTER_MARK in name for name in trained)
    for name, value in trained.items():
        assert torch.equal(copy[name], value), name


def test_a_bad_lora_setting_is_refused_in_one_line() -> None:
    for bad in ("model.lora.r=-1", "model.lora.dropout=1.5", "model.lora.target_modules=[nope]"):
        with pytest.raises(TclightningError) as err:
            load_recipe("tiny", [bad])
        assert "model.lora" in str(err.value) and "\n" not in str(err.value), bad


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lora-run")
    # a short warm-up on 1-digit sums: the first step has reward variance (cached: run once)
    settings = [*FAST, "model.warmup.steps=150", "task.digits=1", "model.lora.r=4", "model.lora.target_modules=[q_proj,v_proj,up_proj]", "grpo.kl_coef=0.01",
                "grpo.lr=0.01", "trainer.val_every=0", "trainer.checkpoint_every=1", "trainer.keep_checkpoints=10",
                f"logging.root={root}"]
    summary = run("tiny", [*settings, "trainer.steps=3"], quiet=True)
    run_dir = Path(summary["run_dir"])
    resumed = run("tiny", [*settings, "trainer.steps=3", "logging.name=resumed"], quiet=True)
    run("tiny", [*settings, "trainer.steps=3"], resume=str(Path(resumed["run_dir"]) / "checkpoints" /
                                                          "step-000001.ckpt"), quiet=True)
    return run_dir, Path(resumed["run_dir"])


def test_a_lora_run_trains_the_adapters_keeps_the_base_reference_and_resumes_exactly(lora_run: Any) -> None:
    """One process, end to end: the checkpoint holds the whole state dict (frozen base, adapters, the
    reference: the base policy after the warm-up); resumed from step 1 (Adam's state with it) it ends
    on the same weights."""
    run_dir, resumed = lora_run
    state = load_checkpoint(run_dir / "checkpoints" / "last.ckpt")["state_dict"]
    adapters = [k for k in state if ADAPTER_MARK in k]
    assert adapters and all(k.startswith("policy.") for k in adapters)  # the reference is the base policy
    reference = {k[len("reference."):]: v for k, v in state.items() if k.startswith("reference.")}
    for key, value in reference.items():  # the frozen base weights are the reference's, unchanged
        base = key.replace("q_proj.", "q_proj.base_layer.").replace("v_proj.", "v_proj.base_layer.") \
            .replace("up_proj.", "up_proj.base_layer.")
        assert torch.equal(state[f"policy.{base}"], value), key
    assert any(state[k].abs().max() > 0 for k in adapters if "lora_B" in k)  # B starts at zero: they trained
    again = load_checkpoint(resumed / "checkpoints" / "last.ckpt")["state_dict"]
    assert set(again) == set(state)
    for key in state:
        assert torch.equal(again[key], state[key]), key


def test_export_merges_the_adapters_or_writes_them_alone(lora_run: Any, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run_dir, _ = lora_run
    module = GRPOModule.load_from_checkpoint(run_dir / "checkpoints" / "last.ckpt").eval()
    ids = torch.randint(1, len(module.tokenizer), (3, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = module.policy(ids).logits
    merged = AutoModelForCausalLM.from_pretrained(export_policy(run_dir, tmp_path / "merged")).eval()
    assert not any(ADAPTER_MARK in name for name, _ in merged.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, want, rtol=0, atol=1e-5)
    out = tmp_path / "adapter"
    assert main(["export", str(run_dir), str(out), "--adapter-only"]) == 0
    assert (out / "adapter_config.json").is_file() and not (out / "model.safetensors").exists()
    base = GRPOModule.load_from_checkpoint(run_dir / "checkpoints" / "last.ckpt").reference
    fresh = AutoModelForCausalLM.from_config(base.config)
    fresh.load_state_dict(base.state_dict())
    with torch.no_grad():
        loaded = PeftModel.from_pretrained(fresh, out).eval()
        torch.testing.assert_close(loaded(ids).logits, want, rtol=0, atol=1e-5)
