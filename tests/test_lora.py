"""``model.lora``: PEFT LoRA adapters on the policy. Only the adapters train, the pipeline's weight
sync sends them alone, two stage processes train them as one process does, checkpoints hold the
adapters alone (the base rebuilt from the recipe and checked against its fingerprint on resume and
export), and ``tclightning export`` writes the merged model (or, ``--adapter-only``, the adapters
in PEFT's format)."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
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
from tclightning.models.loading import load_model
from tclightning.models.lora import ADAPTER_MARK, apply_lora
from tclightning.pipeline import CutSet
from tclightning.recipes.loader import load_recipe
from tclightning.run import run
from tests.conftest import FAST, REPO
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


# The step metrics a resumed run must reproduce exactly (the rest are timings and counters).
SAME = ("reward/mean", "loss/policy", "loss/kl", "policy/grad_norm", "policy/entropy", "gap/abs_mean")


# a short warm-up on 1-digit sums: the first step has reward variance (cached: run once)
LORA_RUN = [*FAST, "model.warmup.steps=150", "task.digits=1", "model.lora.r=4",
            "model.lora.target_modules=[q_proj,v_proj,up_proj]", "grpo.kl_coef=0.01", "grpo.lr=0.01",
            "trainer.val_every=0", "trainer.checkpoint_every=1", "trainer.keep_checkpoints=10"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A 3-step LoRA run (after a short supervised warm-up: the base is not the built model), and
    another of the same 3 steps killed-free resumed from its step-1 checkpoint."""
    root = tmp_path_factory.mktemp("lora-run")
    settings = [*LORA_RUN, f"logging.root={root}"]
    summary = run("tiny", [*settings, "trainer.steps=3"], quiet=True)
    run_dir = Path(summary["run_dir"])
    resumed = run("tiny", [*settings, "trainer.steps=3", "logging.name=resumed"], quiet=True)
    run("tiny", [*settings, "trainer.steps=3"], resume=str(Path(resumed["run_dir"]) / "checkpoints" /
                                                          "step-000001.ckpt"), quiet=True)
    return run_dir, Path(resumed["run_dir"])


def assert_same_checkpoint(got: dict[str, Any], want: dict[str, Any]) -> None:
    """The same weights (every key, bit for bit) and the same Adam state."""
    assert set(got["state_dict"]) == set(want["state_dict"])
    for key, value in want["state_dict"].items():
        assert torch.equal(got["state_dict"][key], value), key
    got_opt, want_opt = got["optimizer_states"][0]["state"], want["optimizer_states"][0]["state"]
    assert sorted(got_opt) == sorted(want_opt)
    for index, state in want_opt.items():
        for key, value in state.items():
            assert torch.equal(got_opt[index][key], value), (index, key)


def assert_same_metrics(got: dict[int, dict[str, float]], want: dict[int, dict[str, float]], steps: int) -> None:
    assert sorted(got) == sorted(want) == list(range(steps))
    for step in want:
        for key in SAME:
            assert got[step][key] == want[step][key], (step, key)


def test_a_lora_checkpoint_holds_the_adapters_alone(lora_run: Any) -> None:
    """The state dict is the adapters (no frozen base, no KL reference), a small share of the
    model's bytes; the checkpoint records the fingerprint of the base, which is the reference (the
    policy after the warm-up) and not the freshly built model."""
    from tclightning.grpo.module import BASE_KEY
    from tclightning.models.lora import base_fingerprint

    run_dir, _ = lora_run
    path = run_dir / "checkpoints" / "last.ckpt"
    ckpt = load_checkpoint(path)
    state = ckpt["state_dict"]
    module = GRPOModule.load_from_checkpoint(path)
    adapters = {f"policy.{name}" for name, p in module.policy.named_parameters() if p.requires_grad}
    assert adapters and all(ADAPTER_MARK in key for key in adapters)
    assert set(state) == adapters  # 2 layers x (q, v, up) x (A, B)
    assert len(adapters) == 12
    assert len(ckpt["optimizer_states"][0]["state"]) == len(adapters)  # Adam holds the adapters alone
    stored = sum(v.numel() * v.element_size() for v in state.values())
    base = ckpt["tclightning"][BASE_KEY]
    full = sum(p.numel() for p in module.reference.parameters())  # the reference is the base, tied once
    assert base["parameters"] == full
    assert stored == sum(state[k].numel() for k in adapters) * 4  # float32
    assert stored < 0.1 * full * 4
    assert path.stat().st_size < full * 4  # one copy of the base alone would be larger than the whole file
    assert base["sha256"] == base_fingerprint(module.reference)["sha256"] == base_fingerprint(module.policy)["sha256"]
    fresh, _ = load_model(module.model_cfg, seed=module.seed)  # before the warm-up: another base
    assert base_fingerprint(fresh)["sha256"] != base["sha256"]
    assert any(state[k].abs().max() > 0 for k in adapters if "lora_B" in k)  # B starts at zero: they trained


def test_a_lora_run_resumed_from_its_adapters_equals_the_uninterrupted_run(lora_run: Any) -> None:
    """3 steps = 1 step + a resume (the base rebuilt: the warm-up's cache entry) to 3: the same
    adapters and Adam state bit for bit, and the same step metrics."""
    from tclightning.grpo.summary import read_metrics

    run_dir, resumed = lora_run
    assert_same_checkpoint(load_checkpoint(resumed / "checkpoints" / "last.ckpt"),
                           load_checkpoint(run_dir / "checkpoints" / "last.ckpt"))
    assert_same_metrics(read_metrics(resumed / "metrics.csv"), read_metrics(run_dir / "metrics.csv"), 3)


def test_the_adapters_alone_load_strictly_onto_the_module(lora_run: Any) -> None:
    """What a rollback (``collapse-guard``) does with a LoRA checkpoint: ``load_state_dict`` of the
    adapters alone puts them in place and keeps the rebuilt base; a missing adapter still fails."""
    run_dir, _ = lora_run
    ckpt = load_checkpoint(run_dir / "checkpoints" / "step-000001.ckpt")
    module = GRPOModule.load_from_checkpoint(run_dir / "checkpoints" / "last.ckpt")
    base = {k: v.clone() for k, v in module.state_dict().items() if k not in ckpt["state_dict"]}
    assert not all(torch.equal(module.state_dict()[k], v) for k, v in ckpt["state_dict"].items())  # step 3's
    module.load_state_dict(ckpt["state_dict"])
    state = module.state_dict()
    assert all(torch.equal(state[k], v) for k, v in ckpt["state_dict"].items())
    assert all(torch.equal(state[k], v) for k, v in base.items())
    missing = dict(ckpt["state_dict"])
    missing.pop(sorted(missing)[0])
    with pytest.raises(RuntimeError, match="Missing key"):
        module.load_state_dict(missing)


def test_a_checkpoint_without_its_base_is_checked_before_anything_is_built(lora_run: Any, tmp_path: Path) -> None:
    """The adapters' shapes stand for the missing base: a crafted size is refused before anything
    is allocated; and a state dict without the base and without its fingerprint is refused."""
    from tclightning.grpo.module import BASE_KEY

    run_dir, _ = lora_run
    ckpt = load_checkpoint(run_dir / "checkpoints" / "last.ckpt")
    huge = copy.deepcopy(ckpt)
    huge["hyper_parameters"]["model"]["tiny"].update(hidden_size=4096)  # within the tiny model's bound
    torch.save(huge, tmp_path / "huge.ckpt")
    for load in (lambda p: export_policy(p, tmp_path / "out"), GRPOModule.load_from_checkpoint):
        with pytest.raises(TclightningError, match="hidden_size=4096 but its weights have 32"):
            load(tmp_path / "huge.ckpt")
    del ckpt["tclightning"][BASE_KEY]
    torch.save(ckpt, tmp_path / "no-base.ckpt")
    with pytest.raises(TclightningError, match="holds none of the frozen base weights .* no fingerprint") as err:
        GRPOModule.load_from_checkpoint(tmp_path / "no-base.ckpt")
    assert "no-base.ckpt" in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()


def test_probe_coherence_starts_from_a_lora_checkpoint(lora_run: Any, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """``probe coherence --checkpoint`` takes the adapters onto the base the recipe rebuilds, as a
    load does (it refused every LoRA checkpoint: "39 missing, 16 unexpected tensors")."""
    from tclightning.cli.probe_coherence import load_checkpoint_weights
    from tclightning.recipes.loader import to_dataclass
    from tclightning.run import build_module

    run_dir, _ = lora_run
    path = run_dir / "checkpoints" / "step-000001.ckpt"
    module = build_module(to_dataclass(load_recipe("tiny", LORA_RUN)))
    load_checkpoint_weights(module, str(path))
    want = load_checkpoint(path)["state_dict"]
    state = module.state_dict()
    assert want and all(torch.equal(state[k], v) for k, v in want.items())
    assert sorted(f"policy.{n}" for n, p in module.policy.named_parameters() if p.requires_grad) == sorted(want)
    out = tmp_path / "probe"
    assert main(["probe", "coherence", "--recipe", "tiny", "--checkpoint", str(path), "--lags", "0", "1",
                 "--steps", "2", "--out", str(out), *LORA_RUN]) == 0
    assert (out / "coherence.json").is_file()
    capsys.readouterr()
    fresh = build_module(to_dataclass(load_recipe("tiny", [*LORA_RUN, "model.lora.r=0"])))
    with pytest.raises(TclightningError, match="holds LoRA adapters without their base, and this model has "
                                               "model.lora.r=0"):
        load_checkpoint_weights(fresh, str(path))


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


def test_a_base_that_changed_since_the_run_is_refused_in_one_line_and_nothing_is_written(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``model.source=hf`` from a local folder: after the folder's weights change, the base the
    recipe rebuilds is not the one the adapters were trained on. A resume, an export and a load
    each refuse in one line naming the checkpoint, and nothing is written; with the folder as it
    was, the same export goes through (so the refusal is the changed base's)."""
    from transformers import AutoModelForCausalLM

    base = export_policy(Path(run("tiny", [*FAST, "trainer.steps=1", "trainer.val_every=0",
                                           f"logging.root={tmp_path / 'built'}"], quiet=True)["run_dir"]),
                         tmp_path / "base")
    settings = [*FAST, "model.source=hf", f"model.name={base}", "model.lora.r=4", "trainer.val_every=0",
                "trainer.checkpoint_every=1", f"logging.root={tmp_path / 'runs'}"]
    run_dir = Path(run("tiny", [*settings, "trainer.steps=2"], quiet=True)["run_dir"])
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    weights = base / "model.safetensors"
    original = weights.read_bytes()
    model = AutoModelForCausalLM.from_pretrained(base)
    with torch.no_grad():
        model.model.norm.weight[0] += 0.5  # one weight of the base
    model.save_pretrained(base)
    assert weights.read_bytes() != original

    def files() -> dict[str, bytes]:
        return {p.relative_to(tmp_path).as_posix(): p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}

    before = files()
    out = tmp_path / "exported"
    capsys.readouterr()
    for argv in (["run", "--recipe", "tiny", *settings, "trainer.steps=3", "--resume", str(run_dir)],
                 ["export", str(run_dir), str(out)]):
        assert main(argv) == 2, argv
        # transformers draws its own bar while it loads the folder's weights (any hf run does)
        err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("Loading weights")]
        assert len(err) == 1 and f"checkpoint {ckpt}" in err[0] and "another base model" in err[0], err
        assert files() == before, argv
    with pytest.raises(TclightningError, match="another base model"):
        GRPOModule.load_from_checkpoint(ckpt)
    elsewhere = tmp_path / "elsewhere.ckpt"  # out of its run directory: checked against its own hyper-parameters
    shutil.copyfile(ckpt, elsewhere)
    with pytest.raises(TclightningError, match="key 'model.lora.r' was 4 for the 2 steps of .*elsewhere.ckpt"):
        run("tiny", [*settings, "model.lora.r=0", "trainer.steps=3"], resume=str(elsewhere), quiet=True)
    from tclightning.recipes.loader import load_recipe, to_dataclass
    from tclightning.run import resume_module  # and behind that check, the load itself refuses too

    with pytest.raises(TclightningError, match="holds LoRA adapters without their base, and the recipe has model.lora.r=0"):
        resume_module(to_dataclass(load_recipe("tiny", [*settings, "model.lora.r=0"])), elsewhere)
    elsewhere.unlink()
    assert files() == before
    # Trainer.fit's own load checks too (a fit that does not come through `tclightning run`)
    monkeypatch.setattr("tclightning.run.resume_module", lambda recipe, path: None)
    with pytest.raises(TclightningError, match=f"checkpoint {ckpt}: its LoRA adapters were trained on another base"):
        run("tiny", [*settings, "trainer.steps=3"], resume=str(run_dir), quiet=True)
    weights.write_bytes(original)
    assert main(["export", str(run_dir), str(out)]) == 0 and (out / "model.safetensors").is_file()


def launch(where: Path, args: list[str], resume: Path | None = None) -> None:
    """``python -m tclightning run`` in ``where`` (Lightning starts the second process)."""
    where.mkdir(exist_ok=True)
    command = [sys.executable, "-m", "tclightning", "run", "--recipe", "tiny", "--quiet",
               *(["--resume", str(resume)] if resume else []), *args]
    done = subprocess.run(command, check=False, cwd=where, env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
def test_two_stage_processes_checkpoint_the_adapters_alone_and_resume_exactly(tmp_path: Path) -> None:
    """``pipeline.stages=2`` on 2 processes, after a warm-up: the checkpoint (rank 0 writes it, every
    rank's share filtered) holds both stages' adapters and their Adam state alone; a copy of the run
    resumed from step 1 (each rank rebuilds the base) ends on the same adapters, Adam state and
    step metrics as the uninterrupted run."""
    from tclightning.grpo.summary import read_metrics

    args = [*FAST, "trainer.strategy=pipeline", "trainer.devices=2", "trainer.accelerator=cpu", "pipeline.stages=2",
            "model.warmup.steps=20", "model.lora.r=4", "model.lora.target_modules=[q_proj,v_proj,down_proj]",
            "grpo.kl_coef=0.01", "grpo.lr=0.01", "grpo.overlong=1.0", "trainer.val_every=0",
            "trainer.checkpoint_every=1", "trainer.keep_checkpoints=10", "trainer.steps=3"]
    launch(tmp_path / "split", args)
    (run_dir,) = (tmp_path / "split" / "runs" / "tiny").iterdir()
    shutil.copytree(tmp_path / "split", tmp_path / "again")
    again = tmp_path / "again" / "runs" / "tiny" / run_dir.name
    launch(tmp_path / "again", args, again / "checkpoints" / "step-000001.ckpt")

    want = load_checkpoint(run_dir / "checkpoints" / "last.ckpt")
    layers = {int(key.split(".")[3]) for key in want["state_dict"]}
    assert layers == {0, 1} and all(ADAPTER_MARK in key for key in want["state_dict"])  # both stages' adapters
    assert len(want["state_dict"]) == 12 == len(want["optimizer_states"][0]["state"])
    assert_same_checkpoint(load_checkpoint(again / "checkpoints" / "last.ckpt"), want)
    assert_same_metrics(read_metrics(again / "metrics.csv"), read_metrics(run_dir / "metrics.csv"), 3)


@pytest.mark.parametrize("record", ["abc", [1, 2], 0], ids=["a-str", "a-list", "an-int"])
def test_a_base_fingerprint_of_another_form_is_one_line_on_resume(lora_run: Any, tmp_path: Path, record: Any,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A LoRA checkpoint whose base fingerprint is not a dict was an AttributeError traceback on
    ``run --resume`` (export and load_from_checkpoint said one line)."""
    from tclightning.grpo.module import BASE_KEY

    run_dir, _ = lora_run
    ckpt = load_checkpoint(run_dir / "checkpoints" / "last.ckpt")
    ckpt["tclightning"][BASE_KEY] = record
    torch.save(ckpt, tmp_path / "crafted.ckpt")
    capsys.readouterr()
    assert main(["run", "--recipe", "tiny", *LORA_RUN, "trainer.steps=4", f"logging.root={tmp_path / 'runs'}",
                 "--quiet", "--resume", str(tmp_path / "crafted.ckpt")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:") or "Traceback" in line]
    assert len(err) == 1 and f"its fingerprint of the LoRA base ({BASE_KEY}) is a" in err[0], err
