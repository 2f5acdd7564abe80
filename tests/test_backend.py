"""The declared backend: both implementations satisfy it, the module reaches the strategy only
through it, and the one update loop's loss is ``policy_loss`` itself in one process."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tclightning.backend import Backend, BackendProvider, BackendRequest
from tclightning.grpo.config import GRPOConfig
from tclightning.models.logprobs import completion_logps
from tclightning.grpo.loss import policy_loss
from tclightning.grpo.update import LossSettings, MicrobatchLoss
from tclightning.pipeline import CutSet, LocalBackend, PipelineConfig, PipelineStrategy
from tclightning.pipeline.backends import PipelineBackend
from tclightning.pipeline.multiprocess import MultiProcessPipelineStrategy

REPO = Path(__file__).resolve().parents[1]


def request(model: torch.nn.Module) -> BackendRequest:
    return BackendRequest(model, 1.0, completion_logps, lambda loss: loss.backward())


def test_both_backends_and_both_strategies_are_declared() -> None:
    from tests.test_distributed import tiny_llama

    model = tiny_llama()
    assert isinstance(LocalBackend(request(model)), Backend)
    with CutSet(model, PipelineConfig(stages=2, layout="all", k=5)) as cuts:
        assert isinstance(LocalBackend(request(model), cuts), Backend)
    # the multi-process backend needs a process group to run (tests/test_distributed.py checks it
    # there too); its surface is the protocol's whatever engine it wraps
    engine = SimpleNamespace(world_size=2, device=torch.device("cpu"), is_last=True, set_temperature=lambda t: None)
    assert isinstance(PipelineBackend(request(model), engine), Backend)  # type: ignore[arg-type]
    assert isinstance(PipelineStrategy(), BackendProvider)
    assert isinstance(MultiProcessPipelineStrategy(), BackendProvider)


@pytest.mark.parametrize("path", ["tclightning/grpo/module.py", "tclightning/callbacks/anchor_merge.py"])
def test_the_module_and_the_anchor_callback_do_not_reach_into_the_strategy(path: str) -> None:
    source = (REPO / path).read_text()
    assert not re.search(r"getattr\([^)]*strategy", source), path


def test_in_training_the_prf_step_is_set_only_by_backend_begin_step() -> None:
    """One setter of the cuts' (and the engine's) step: the backends' ``begin_step``. The probes
    and the link benchmark drive cuts of their own, outside any trainer."""
    setters = {
        str(path.relative_to(REPO))
        for path in (REPO / "tclightning").rglob("*.py")
        if path.parent.name not in ("probes", "bench") and re.search(r"\.set_step\(", path.read_text())
    }
    assert setters == {"tclightning/pipeline/backends.py"}


def test_the_strategy_steps_a_module_that_never_asks_and_leaves_one_that_asked_alone() -> None:
    from tests.test_pipeline import TinyPolicyModule, _trainer

    class AskingModule(TinyPolicyModule):
        """Takes its backend and steps it at 10 + batch_idx: the strategy must not set the step."""

        def on_fit_start(self) -> None:
            self.taken = self.trainer.strategy.backend(request(self.policy))

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            self.taken.begin_step(10 + batch_idx)
            return super().training_step(batch, batch_idx)

    plain, asking = TinyPolicyModule(), AskingModule()
    _trainer(PipelineStrategy(PipelineConfig(layout="all", k=8))).fit(plain)
    _trainer(PipelineStrategy(PipelineConfig(layout="all", k=8))).fit(asking)
    assert [s["step"] for s in plain.seen] == [0, 1]  # trainer.global_step, through the strategy's own backend
    assert [s["step"] for s in asking.seen] == [10, 11]


def batch(rows: int = 5, width: int = 6) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    mask = torch.ones(rows, width)
    mask[1, 3:] = mask[3, 1:] = 0
    return {
        "logp": (-torch.rand(rows, width, generator=gen) * mask).requires_grad_(),
        "old": -torch.rand(rows, width, generator=gen) * mask,
        "ref": -torch.rand(rows, width, generator=gen) * mask,
        "sampler": -torch.rand(rows, width, generator=gen) * mask,
        "advantages": torch.randn(rows, generator=gen),
        "mask": mask,
    }


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("case", ["plain", "kl", "tis", "mask", "mask-single-tick"])
def test_one_call_with_every_row_is_policy_loss_bit_for_bit(aggregation: str, case: str) -> None:
    """One process calls the loss once with every row: every share is exactly 1.0, so loss,
    gradient and statistics are ``policy_loss``'s, bit for bit (KL added in the same order)."""
    b = batch()
    cfg = GRPOConfig(loss_aggregation=aggregation, kl_coef=0.1 if case == "kl" else 0.0,
                     tis_cap=2.0 if case == "tis" else 0.0,
                     mask_ratio=[0.5, 1.5] if case.startswith("mask") else None)
    old = None if case == "mask-single-tick" else b["old"]
    ref = b["ref"] if case == "kl" else None
    expected = policy_loss(
        b["logp"], b["logp"].detach() if old is None else old, b["advantages"], b["mask"], clip_low=cfg.clip_low,
        clip_high=cfg.clip_high, aggregation=aggregation, norm_length=8, ref_logp=ref, kl_coef=cfg.kl_coef,
        logp_sampler=b["sampler"], tis_cap=cfg.tis_cap,
        mask_ratio=None if cfg.mask_ratio is None else tuple(cfg.mask_ratio),
    )
    (want,) = torch.autograd.grad(expected.loss, b["logp"])
    loss_fn = MicrobatchLoss(old_logp=old, advantages=b["advantages"], mask=b["mask"], logp_sampler=b["sampler"],
                             ref_logp=ref, settings=LossSettings.of(cfg), norm_length=8)
    loss = loss_fn(b["logp"], torch.arange(5))
    (got,) = torch.autograd.grad(loss, b["logp"])
    assert torch.equal(loss, expected.loss) and torch.equal(got, want)
    assert loss_fn.stats["loss/policy"] == float(expected.policy_loss)
    assert loss_fn.stats["loss/kl"] == float(expected.kl)
    assert loss_fn.stats["policy/clip_frac"] == float(expected.clip_frac)
    assert loss_fn.finite


def test_micro_batches_sum_to_the_whole_and_a_nan_is_seen() -> None:
    b = batch()
    cfg = GRPOConfig(kl_coef=0.1)
    whole = MicrobatchLoss(old_logp=b["old"], advantages=b["advantages"], mask=b["mask"], logp_sampler=b["sampler"],
                           ref_logp=b["ref"], settings=LossSettings.of(cfg), norm_length=8)
    parts = MicrobatchLoss(old_logp=b["old"], advantages=b["advantages"], mask=b["mask"], logp_sampler=b["sampler"],
                           ref_logp=b["ref"], settings=LossSettings.of(cfg), norm_length=8)
    total = sum(parts(b["logp"][rows], rows) for rows in torch.tensor_split(torch.arange(5), 3))
    torch.testing.assert_close(total, whole(b["logp"], torch.arange(5)))
    bad = b["logp"].detach().clone()
    bad[0, 0] = float("nan")
    assert whole.finite and parts.finite
    nan = MicrobatchLoss(old_logp=b["old"], advantages=b["advantages"], mask=b["mask"], logp_sampler=b["sampler"],
                         ref_logp=None, settings=LossSettings.of(cfg), norm_length=8)
    nan(bad, torch.arange(5))
    assert not nan.finite  # the update makes no optimizer step on any rank for this tick


def test_the_rank1_projector_across_processes_is_refused_before_the_run() -> None:
    from tclightning.errors import RecipeError
    from tclightning.recipes.loader import load_recipe

    settings = ["trainer.strategy=pipeline", "anchor.merger=signed_ema", "anchor.projector=rank1"]
    with pytest.raises(RecipeError, match=r"'rank1' is not supported across processes.*trainer.devices"):
        load_recipe("tiny", [*settings, "trainer.devices=2"])
    load_recipe("tiny", settings)  # one process: fine
