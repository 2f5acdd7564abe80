"""``anchor.placement: sampler``: the sampling rank runs the anchor on its whole copy and sends each
stage only sign(M_bar) (tclightning/anchor/placement.py, tclightning/sign_message.py).

Multi-process runs (gloo ranks over the same tiny Llama as tests/test_distributed.py) against one
process: the same weights after every anchor delivery, the same signs of M_bar (up to coordinates
where M_bar is ~0 relative to its tensor), the anchor bytes equal to the sign-message formula, and a
resumed run equal to an uninterrupted one.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

from tclightning.bench.launch import run_ranks
from tclightning.errors import TclightningError
from tclightning.sign_message import pack_signs, sign_message_bytes, unpack_signs
from tests.test_distributed import ADVANTAGES, backend_request, rollouts, tiny_llama

STEPS, LR = 4, 0.05
SIGN_TOL = 1e-4  # a sign may differ only where |M_bar| <= SIGN_TOL * max |M_bar| of its tensor


# -- the sign message --------------------------------------------------------------------------


def test_the_sign_message_is_exact_with_zeros_and_counts_its_bytes() -> None:
    gen = torch.Generator().manual_seed(0)
    dense = torch.randn(5, 7, generator=gen)  # no zero: 1 bit a coordinate
    sparse = torch.randn(13, generator=gen)
    sparse[[0, 4, 12]] = 0.0  # zeros: a second bitmask for this tensor only
    tiny = torch.tensor([-0.0, 2.0, float("nan")])  # -0.0 is zero; NaN crosses as 0
    header, body = pack_signs([dense, sparse, tiny])
    assert header.numel() == 1 and header.numel() + body.numel() == sign_message_bytes([35, 13, 3], [False, True, True])
    assert body.numel() == 5 + 2 * 2 + 2 * 1
    got = unpack_signs(header, body, [dense.shape, sparse.shape, tiny.shape])
    for signs, want in zip(got, [torch.sign(dense), torch.sign(sparse), torch.tensor([0.0, 1.0, 0.0])]):
        assert torch.equal(signs, want)
    assert sign_message_bytes([8, 9] * 5) == 2 + 5 * (1 + 2)  # header: 10 tensors -> 2 bytes
    with pytest.raises(ValueError, match="body bytes"):
        unpack_signs(header, body[:-1], [dense.shape, sparse.shape, tiny.shape])


# -- the refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("overrides", "says"), [
    (["anchor.merger=control_variate"], "'sampler' sends each stage only sign(M_bar), but 'control_variate' needs M "
                                        "itself: use anchor.merger=signed_ema or anchor.placement=pipeline"),
    (["anchor.projector=damped_linear"], "'sampler' sends each stage only sign(M_bar), but the 'damped_linear' "
                                         "projector repairs M_bar's magnitudes"),
    (["pipeline.replicas=2", "pipeline.stages=2", "trainer.devices=4"], "'sampler' runs with one pipeline"),
])
def test_what_the_sampler_placement_cannot_do_exactly_is_refused_in_one_line(overrides: list[str], says: str) -> None:
    from tclightning.recipes.loader import load_recipe

    with pytest.raises(TclightningError) as err:
        load_recipe("tiny", ["trainer.strategy=pipeline", "pipeline.layout=all", "anchor.merger=signed_ema",
                             "anchor.placement=sampler", *overrides])
    message = str(err.value)
    assert says in message, message
    assert "\n" not in message  # one line


def test_merger_none_has_nothing_to_place_and_is_accepted() -> None:
    from tclightning.recipes.loader import load_recipe

    load_recipe("tiny", ["trainer.strategy=pipeline", "pipeline.layout=all", "anchor.placement=sampler"])


# -- the runs ------------------------------------------------------------------------------------


class CountingOptimizer:
    """SGD whose step count is the anchor's clock (``trainer.global_step`` in a run)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.opt = torch.optim.SGD(params, lr=LR)
        self.steps = 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        self.opt.step()
        self.steps += 1


def run_steps(backend: Any, model: torch.nn.Module, anchor: Any, optimizer: CountingOptimizer,
              steps: range) -> list[dict[str, Any]]:
    """``grpo_update`` (2 ticks a step) with the anchor over ``steps``: per step the anchor metrics,
    the sign agreement and the weights after, by parameter name."""
    from tclightning.grpo.config import GRPOConfig
    from tclightning.grpo.update import grpo_update

    names = {id(p): name for name, p in model.named_parameters()}
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer.opt, lambda tick: 1.0)
    cfg = GRPOConfig(minibatches=2, max_grad_norm=1.0)
    reduce = None if backend.world_size == 1 else (lambda counts: backend.reduce_sum(counts, "agreement"))
    out = []
    for step in steps:
        backend.begin_step(step)
        anchor.begin_step()
        grpo_update(backend, optimizer, schedule, rollouts(), ADVANTAGES * (1 + 0.3 * step), torch.arange(6), cfg=cfg,
                    norm_length=4, seed=0, step=step, anchor=anchor, clock=lambda: optimizer.steps)
        metrics = anchor.metrics(optimizer.steps)
        seconds = metrics.pop("time/anchor_s")  # a clock, not a result: kept apart
        out.append({"metrics": metrics, "seconds": seconds, "agreement": anchor.step_agreement(reduce),
                    "weights": {names[id(p)]: p.detach().clone() for p in backend.owned_parameters()}})
    return out


def anchor_config(placement: str) -> Any:
    from tclightning.anchor.config import AnchorConfig

    # K=1, C=2 over 2 ticks a step: a snapshot at every step's first tick, its M (or signs) at the second
    return AnchorConfig(merger="signed_ema", alpha=0.25, beta=0.5, latency=1, cadence=2, placement=placement)


def pipeline_config(world_size: int, tied_rows: bool) -> Any:
    from tclightning.pipeline import PipelineConfig

    return PipelineConfig(stages=world_size, microbatches=3, timeout_s=60, layout="all", k=5, tied_rows=tied_rows)


def m_bar_by_name(anchor: Any, backend: Any, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    names = {id(p): name for name, p in model.named_parameters()}
    return {names[id(p)]: m.detach().cpu().clone() for p, m in zip(backend.owned_parameters(), anchor.merger.m_bar)}


def policy(lora: bool) -> torch.nn.Module:
    """The tiny Llama, with ``lora`` rank-4 adapters on every projection (only they train)."""
    model = tiny_llama()
    if lora:
        from tclightning.models.config import LoraConfig
        from tclightning.models.lora import apply_lora

        apply_lora(model, LoraConfig(r=4), seed=0)
        with torch.no_grad():  # B starts at 0, so A's gradient would too: give both a value
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.05)
    return model


def placement_worker(rank: int, world_size: int, tied_rows: bool, resume: bool, lora: bool = False) -> dict[str, Any]:
    """One rank: STEPS steps with ``placement: sampler``; with ``resume`` also the same run stopped
    after step 1 and resumed from saved state on fresh objects; ``lora``: adapters only train."""
    from tclightning.anchor.anchor import build_anchor
    from tclightning.pipeline.backends import PipelineBackend
    from tclightning.pipeline.engine import PipelineEngine

    def fresh(state: dict[str, Any] | None = None) -> tuple[Any, ...]:
        model = policy(lora)
        if state is not None:
            model.load_state_dict(state["model"])
        backend = PipelineBackend(backend_request(model), PipelineEngine(model, pipeline_config(world_size, tied_rows)))
        anchor = build_anchor(anchor_config("sampler"))
        optimizer = CountingOptimizer(backend.owned_parameters())
        if state is not None:
            anchor.load_state_dict(state["anchor"], processes=world_size)
            optimizer.steps = state["steps"]
        return model, backend, anchor, optimizer

    model, backend, anchor, optimizer = fresh()
    steps = run_steps(backend, model, anchor, optimizer, range(STEPS))
    out: dict[str, Any] = {"steps": steps, "m_bar": m_bar_by_name(anchor, backend, model),
                           "sizes": [p.numel() for p in backend.owned_parameters()],
                           "relay_kept": sum(len(v) for v in anchor.relay.m_bar.values())}
    if resume:
        model, backend, anchor, optimizer = fresh()
        run_steps(backend, model, anchor, optimizer, range(2))
        buffer = io.BytesIO()  # what a checkpoint holds, through a file's bytes
        torch.save({"model": model.state_dict(), "anchor": anchor.state_dict(), "steps": optimizer.steps}, buffer)
        buffer.seek(0)
        state = torch.load(buffer, weights_only=False)
        model, backend, anchor, optimizer = fresh(state)
        out["resumed"] = run_steps(backend, model, anchor, optimizer, range(2, STEPS))
    return out


def one_process(placement: str, stages: int = 2, lora: bool = False) -> dict[str, Any]:
    """The same steps in one process: the model with the same cuts, the one-process backend."""
    from tclightning.anchor.anchor import build_anchor
    from tclightning.pipeline import CutSet
    from tclightning.pipeline.backends import LocalBackend

    model = policy(lora)
    with CutSet(model, pipeline_config(stages, False)) as cuts:  # the same cuts as the stage ranks' 
        backend = LocalBackend(backend_request(model), cuts)
        anchor = build_anchor(anchor_config(placement))
        optimizer = CountingOptimizer(backend.owned_parameters())
        steps = run_steps(backend, model, anchor, optimizer, range(STEPS))
        return {"steps": steps, "m_bar": m_bar_by_name(anchor, backend, model)}


def spawn(world_size: int, tied_rows: bool, resume: bool, lora: bool = False) -> list[dict[str, Any]]:
    outcomes = run_ranks(placement_worker, world_size, tied_rows, resume, lora, timeout_s=120)
    for outcome in outcomes:
        assert outcome.error is None, outcome.trace
    return [outcome.value for outcome in outcomes]


def check_against_one_process(ranks: list[dict[str, Any]], lora: bool = False) -> None:
    ref = one_process("pipeline", len(ranks), lora)
    same = one_process("sampler", len(ranks), lora)  # one process: the placement changes nothing, to the bit
    for want, got in zip(ref["steps"], same["steps"]):
        assert want["metrics"] == got["metrics"] and want["agreement"] == got["agreement"]
        for name, weight in want["weights"].items():
            assert torch.equal(got["weights"][name], weight), name
    # weights after every step (each step merged one anchor at its second tick)
    for step, want in enumerate(ref["steps"]):
        got = {name: w for rank in ranks for name, w in rank["steps"][step]["weights"].items()}
        assert set(got) == set(want["weights"])
        for name, weight in want["weights"].items():
            torch.testing.assert_close(got[name], weight, rtol=1e-4, atol=1e-6, msg=f"step {step} {name}")
        assert ranks[0]["steps"][step]["agreement"] == pytest.approx(want["agreement"], abs=0.01)
    # sign(M_bar) on every rank against the one-process M_bar: equal but where M_bar is ~0
    compared: set[str] = set()
    for rank in ranks:
        for name, got in rank["m_bar"].items():
            want = ref["m_bar"][name]
            assert bool((want != 0).all()), name  # no exact zero: the formula below has no zero masks
            differ = torch.sign(got) != torch.sign(want)
            scale = float(want.abs().max())
            assert bool((want.abs()[differ] <= SIGN_TOL * scale).all()), (name, int(differ.sum()))
            compared.add(name)
    assert compared == set(ref["m_bar"])  # every parameter (the tied weight on both of its ranks)
    # the stage ranks received signs (+-1); the sampling rank keeps its own stage's M_bar itself
    for rank in ranks[1:]:
        assert all(bool((m.abs() == 1).all()) for m in rank["m_bar"].values())
    # bytes: one sign message per delivery to every rank but the sampling one, nothing else
    per_delivery = sum(sign_message_bytes(rank["sizes"]) for rank in ranks[1:])
    for rank in ranks:
        assert [s["metrics"]["anchor/bytes"] for s in rank["steps"]] == [float(per_delivery)] * STEPS
    assert ranks[0]["relay_kept"] > 0  # beta 0.5: the sampling rank keeps the other stages' M_bar


def check_resumed(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        for want, got in zip(rank["steps"][2:], rank["resumed"]):
            assert got["metrics"] == want["metrics"] and got["agreement"] == want["agreement"]
            for name, weight in want["weights"].items():
                assert torch.equal(got["weights"][name], weight), name


def test_two_ranks_with_the_sampler_placement_match_one_process_and_resume_exactly() -> None:
    """2 stages, the tied embedding on both ranks (no tied rows): rank 1 gets the signs of its
    layers and of its copy of the tied weight; the run stopped after step 1 and resumed (pending
    snapshot on rank 0, M_bar of rank 1's stage in rank 0's relay) equals the uninterrupted one."""
    ranks = spawn(2, False, True)
    check_against_one_process(ranks)
    check_resumed(ranks)


@pytest.mark.slow
def test_three_ranks_with_tied_rows_and_the_sampler_placement_match_one_process() -> None:
    """3 stages with ``pipeline.tied_rows`` (the last rank owns the tied weight): a middle stage too."""
    check_against_one_process(spawn(3, True, False))


def test_two_ranks_with_lora_and_the_sampler_placement_match_one_process() -> None:
    """``model.lora``: the anchor covers the adapters only (the trained parameters), on the sampling
    rank's whole copy as on the stages; rank 1 gets its adapters' signs."""
    ranks = spawn(2, False, False, True)
    assert all("lora_" in name for rank in ranks for name in rank["m_bar"])
    check_against_one_process(ranks, lora=True)


def test_a_checkpoint_of_the_other_placement_is_refused() -> None:
    from tclightning.anchor.anchor import build_anchor

    saved = build_anchor(anchor_config("pipeline")).state_dict()
    build_anchor(anchor_config("sampler")).load_state_dict(saved)  # one process: the same state
    with pytest.raises(TclightningError, match="saved with anchor.placement=pipeline across processes"):
        build_anchor(anchor_config("sampler")).load_state_dict(saved, processes=2)
