"""The multi-process pipeline: 2 gloo ranks (one stage each) against the one-process reference.

Each test spawns its ranks once (imports dominate the time) and checks several layouts inside.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from tclightning.errors import TclightningError
from tclightning.models.logprobs import completion_logps
from tclightning.grpo.config import GRPOConfig
from tclightning.grpo.loss import policy_loss
from tclightning.grpo.update import LossSettings
from tclightning.pipeline import CutSet, PipelineConfig
from tclightning.bench.launch import run_ranks
from tclightning.pipeline.stage import StageModule, pack, unpack
from tclightning.sampling.base import Rollouts

DIM, LAYERS, VOCAB, STEP = 64, 4, 97, 7
DIM_TINY = 128  # the `tiny` recipe's hidden size
REPO = Path(__file__).resolve().parents[1]
LOSS = LossSettings.of(GRPOConfig())  # token-mean, clip 0.2/0.28, no TIS, no ratio mask, no KL
CASES = {
    "dense-gpipe": {"layout": "dense", "schedule": "gpipe"},
    "prf-1f1b": {"layout": "all", "k": 5, "schedule": "1f1b"},
    "prf-bfloat16": {"layout": "all", "k": 5, "payload_dtype": "bfloat16"},  # messages cross in bfloat16
}


def tiny_llama(seed: int = 0) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=DIM, intermediate_size=96, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, tie_word_embeddings=True,
    )
    return transformers.LlamaForCausalLM(config)


def rollouts() -> Rollouts:
    """6 rows: left-padded prompts, right-padded completions of varied length (so micro-batches
    carry different token counts)."""
    gen = torch.Generator().manual_seed(3)
    prompt_mask = torch.ones(6, 5, dtype=torch.long)
    prompt_mask[0, :2] = prompt_mask[3, :1] = prompt_mask[5, :3] = 0
    completion_mask = torch.ones(6, 4)
    completion_mask[1, 2:] = completion_mask[2, 1:] = completion_mask[4, 3:] = 0
    return Rollouts(
        prompt_ids=torch.randint(1, VOCAB, (6, 5), generator=gen) * prompt_mask,
        prompt_mask=prompt_mask,
        completion_ids=(torch.randint(1, VOCAB, (6, 4), generator=gen) * completion_mask).long(),
        completion_mask=completion_mask,
        logp_sampler=-torch.rand(6, 4, generator=gen) * completion_mask,
        texts=[""] * 6,
        truncated=torch.zeros(6, dtype=torch.bool),
        group_size=3,
    )


ADVANTAGES = torch.tensor([1.0, -0.5, -0.5, 0.7, 0.3, -1.0])


def config_for(case: str) -> PipelineConfig:
    return PipelineConfig(stages=2, microbatches=3, timeout_s=20, **CASES[case])


def reference(case: str) -> dict[str, Any]:
    """One process: cuts as hooks, the GRPO loss of the whole batch, grads by parameter name."""
    model = tiny_llama()
    batch = rollouts()
    with CutSet(model, config_for(case)) as cuts:
        cuts.set_step(STEP)
        logp, _ = completion_logps(model, batch)
        out = policy_loss(logp, logp.detach() - 0.1, ADVANTAGES, batch.completion_mask)
        out.loss.backward()
        metrics = cuts.metrics()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return {"loss": float(out.loss.detach()), "grads": grads, "logp": logp.detach(), "wire": metrics}


def stage_worker(rank: int, world_size: int, cases: list[str]) -> dict[str, Any]:
    """Every case in one spawn (start-up dominates): the equality cases, then the anchor circuit
    and the whole update loop."""
    from tclightning.grpo.update import MicrobatchLoss
    from tclightning.pipeline.engine import PipelineEngine, StageInputs, no_loss

    results: dict[str, Any] = {"anchor": anchor_worker(rank), "update": update_worker(rank)}
    for case in cases:
        model = tiny_llama()
        names = {id(p): name for name, p in model.named_parameters()}
        engine = PipelineEngine(model, config_for(case))
        engine.set_step(STEP)
        batch = rollouts()
        loss_fn = None
        if engine.is_last:
            # the reference's old log-probs (its own logp - 0.1, so ratios are not 1), in this process
            shadow = tiny_llama()
            with CutSet(shadow, config_for(case)) as cuts, torch.no_grad():
                cuts.set_step(STEP)
                old_logp = completion_logps(shadow, batch)[0] - 0.1
            loss_fn = MicrobatchLoss(
                old_logp=old_logp, advantages=ADVANTAGES, mask=batch.completion_mask,
                logp_sampler=batch.logp_sampler, ref_logp=None, settings=LOSS, norm_length=4,
            )
        logp, _ = engine.run(StageInputs.from_rollouts(batch), loss_fn or no_loss)
        engine.reduce_tied_gradients()
        grads = {names[id(p)]: p.grad.clone() for p in engine.owned_parameters() if p.grad is not None}
        results[case] = {
            "grads": grads,
            "loss": loss_fn.stats["loss/policy"] if loss_fn is not None else None,
            "logp": logp,
            "wire": engine.metrics(),
        }
    return results


# -- the anchor circuit (signed_ema, K=1, C=2) over TICKS optimizer ticks ------------------------

TICKS, ANCHOR_LR = 4, 0.05
ANCHOR_CASE = "prf-1f1b"


def anchor_ticks(owned: list[torch.nn.Parameter], names: dict[int, str], g_comp: Any, anchor_m: Any) -> dict[str, Any]:
    """The circuit as the GRPO update's ``Anchor`` runs it, over ``owned`` parameters:
    per tick record (every C) / deliver (K late) / fold ``M`` into ``M_bar`` / merge into ``G_comp``
    / SGD step. ``g_comp()`` fills the ``.grad``s, ``anchor_m(job)`` returns ``(M, bytes)``.
    Returns the merged gradient of every tick by parameter name and the anchor bytes."""
    from tclightning.anchor import (
        AnchorCircuit,
        AnchorSchedule,
        cpu_snapshot,
        make_merger,
    )

    circuit = AnchorCircuit(AnchorSchedule(latency=1, cadence=2))
    merger = make_merger("signed_ema", alpha=0.25, beta=0.5)
    payload = {"rollouts": rollouts(), "advantages": ADVANTAGES, "rows": torch.tensor([0, 2, 3, 4, 5])}
    merged, changed, sent = [], [], 0.0
    for tick in range(TICKS):
        circuit.maybe_record(tick, lambda: cpu_snapshot(owned), payload)
        for job in circuit.due(tick):
            m, nbytes = anchor_m(job)
            merger.observe(m, snapshot_tick=job.tick, tick=tick)
            sent += nbytes
        for p in owned:
            p.grad = None
        g_comp()
        index = [i for i, p in enumerate(owned) if p.grad is not None]
        with torch.no_grad():
            before = [owned[i].grad.clone() for i in index]
            merger.merge_([owned[i].grad for i in index], tick=tick, index=index)
            changed.append(any(not torch.equal(b, owned[i].grad) for b, i in zip(before, index)))
            merged.append({names[id(owned[i])]: owned[i].grad.clone() for i in index})
            for i in index:
                owned[i].sub_(ANCHOR_LR * owned[i].grad)
    return {"merged": merged, "changed": changed, "bytes": sent, "delivered": circuit.delivered}


def anchor_worker(rank: int, config: PipelineConfig | None = None) -> dict[str, Any]:
    """One rank of the 2-process circuit: its stage's snapshots, ``M`` from the update's
    ``anchor_gradient`` through the pipeline backend (a dense pipelined pass). ``config``: the
    pipeline's (default :data:`ANCHOR_CASE`'s)."""
    from tclightning.grpo.update import MicrobatchLoss, anchor_gradient
    from tclightning.pipeline.backends import PipelineBackend
    from tclightning.pipeline.engine import PipelineEngine, StageInputs, no_loss

    model = tiny_llama()
    names = {id(p): name for name, p in model.named_parameters()}
    engine = PipelineEngine(model, config if config is not None else config_for(ANCHOR_CASE))
    engine.set_step(STEP)
    backend = PipelineBackend(backend_request(model), engine)
    batch = rollouts()

    def g_comp() -> None:
        loss_fn = None
        if engine.is_last:
            loss_fn = MicrobatchLoss(old_logp=None, advantages=ADVANTAGES, mask=batch.completion_mask,
                                     logp_sampler=batch.logp_sampler, ref_logp=None, settings=LOSS, norm_length=4)
        engine.run(StageInputs.from_rollouts(batch), loss_fn or no_loss)
        engine.reduce_tied_gradients()

    def anchor_m(job: Any) -> tuple[list[torch.Tensor], float]:
        return anchor_gradient(backend, job, settings=LOSS, norm_length=4)

    from tclightning.backend import Backend

    return {**anchor_ticks(backend.owned_parameters(), names, g_comp, anchor_m), "declared": isinstance(backend, Backend)}


def backend_request(model: torch.nn.Module) -> Any:
    from tclightning.backend import BackendRequest

    return BackendRequest(model, 1.0, completion_logps, lambda loss: loss.backward())


def anchor_reference() -> dict[str, Any]:
    """One process: the model with cuts, ``M`` from the same ``anchor_gradient`` through the
    one-process backend (a hook-free dense clone)."""
    from tclightning.grpo.update import anchor_gradient
    from tclightning.pipeline.backends import LocalBackend

    model, batch = tiny_llama(), rollouts()
    names = {id(p): name for name, p in model.named_parameters()}
    with CutSet(model, config_for(ANCHOR_CASE)) as cuts:
        backend = LocalBackend(backend_request(model), cuts)
        backend.begin_step(STEP)

        def g_comp() -> None:
            logp, _ = completion_logps(model, batch)
            policy_loss(logp, logp.detach(), ADVANTAGES, batch.completion_mask, norm_length=4).loss.backward()

        def anchor_m(job: Any) -> tuple[list[torch.Tensor], float]:
            return anchor_gradient(backend, job, settings=LOSS, norm_length=4)

        return anchor_ticks(backend.owned_parameters(), names, g_comp, anchor_m)


# -- the one update loop on both backends ------------------------------------------------------

TURNS = torch.tensor([0, 1, 0, 1, 2, 0])  # an agentic batch's interaction index per row


def run_update(backend: Any, model: torch.nn.Module, advantages: torch.Tensor) -> dict[str, Any]:
    """``grpo_update`` over 2 ticks (2 minibatches) with SGD on ``backend``'s parameters; the
    metrics, the skipped ticks and the weights after, by parameter name."""
    from tclightning.grpo.config import GRPOConfig
    from tclightning.grpo.update import grpo_update

    names = {id(p): name for name, p in model.named_parameters()}
    owned = backend.owned_parameters()
    optimizer = torch.optim.SGD(owned, lr=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda tick: 1.0)
    cfg = GRPOConfig(minibatches=2, max_grad_norm=1.0)
    result = grpo_update(backend, optimizer, schedule, rollouts(), advantages, torch.arange(6), cfg=cfg,
                         norm_length=4, seed=0, step=STEP, turns=TURNS)
    return {"metrics": result.metrics, "skipped": result.skipped,
            "weights": {names[id(p)]: p.detach().clone() for p in owned}}


def update_worker(rank: int) -> dict[str, Any]:
    """One rank: the update loop through the pipeline backend, then once more with NaN advantages."""
    from tclightning.pipeline.backends import PipelineBackend
    from tclightning.pipeline.engine import PipelineEngine

    model = tiny_llama()
    backend = PipelineBackend(backend_request(model), PipelineEngine(model, config_for(ANCHOR_CASE)))
    backend.begin_step(STEP)
    clean = run_update(backend, model, ADVANTAGES)
    poisoned = run_update(backend, model, torch.full((6,), float("nan")))
    return {"clean": clean, "poisoned": poisoned}


def update_reference() -> dict[str, Any]:
    """One process: the same loop through the one-process backend with the same cuts."""
    from tclightning.pipeline.backends import LocalBackend

    model = tiny_llama()
    with CutSet(model, config_for(ANCHOR_CASE)) as cuts:
        backend = LocalBackend(backend_request(model), cuts)
        backend.begin_step(STEP)
        return run_update(backend, model, ADVANTAGES)


@pytest.fixture(scope="module")
def two_ranks() -> tuple[dict[str, Any], dict[str, Any]]:
    """One spawn of 2 gloo ranks running every case; (rank 0's results, rank 1's)."""
    outcomes = run_ranks(stage_worker, 2, list(CASES), timeout_s=30)
    for outcome in outcomes:
        assert outcome.error is None, outcome.trace
    return outcomes[0].value, outcomes[1].value


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_match_one_process_loss_gradients_and_bytes(two_ranks: Any, case: str) -> None:
    first, last = two_ranks
    ref = reference(case)
    assert last[case]["loss"] == pytest.approx(ref["loss"], rel=1e-6, abs=1e-7), case
    torch.testing.assert_close(last[case]["logp"], ref["logp"], rtol=1e-5, atol=1e-6)
    got = {**first[case]["grads"], **last[case]["grads"]}
    assert set(got) == set(ref["grads"]), case
    for name, grad in ref["grads"].items():
        # A gradient crossing in bfloat16 is rounded to 8 bits: a last-bit difference in the float
        # sums before it (kernels differ between CPUs) can flip one value's rounding, a 2**-8 step
        # that reaches every gradient before the cut; bounded by 1e-3 of the largest entry (a wrong
        # decode is off by the entries themselves).
        atol = 1e-3 * float(grad.abs().max()) if "bfloat16" in case else 1e-6
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=atol, msg=f"{case} {name}")
    # the tied embedding: both ranks hold the summed gradient
    torch.testing.assert_close(first[case]["grads"]["model.embed_tokens.weight"],
                               last[case]["grads"]["model.embed_tokens.weight"])
    # bytes from the actual sends == the one-process meter, per cut and direction, on every rank
    for rank_result in (first, last):
        wire = rank_result[case]["wire"]
        for key, value in ref["wire"].items():
            assert wire[key] == value, (case, key, wire[key], value)
    tokens = int(rollouts().attention_mask.sum())
    per_token = DIM * 4 if not case.startswith("prf") else 5 * (2 if "bfloat16" in case else 4)
    assert ref["wire"]["wire/bytes_fwd"] == ref["wire"]["wire/bytes_bwd"] == tokens * per_token


def test_the_anchor_circuit_across_two_ranks_merges_as_one_process(two_ranks: Any) -> None:
    """signed_ema, K=1/C=2, PRF cut, 4 ticks: every rank snapshots its own stage, gets its stage's
    ``M`` from a dense pipelined pass at the snapshot and merges locally; the merged gradients of
    every tick equal the one-process circuit's, and the anchor bytes (actual sends) its count.
    Both sides compute ``M`` with the same ``anchor_gradient``: only the backend differs."""
    first, last = (result["anchor"] for result in two_ranks)
    ref = anchor_reference()
    assert first["declared"] and last["declared"]  # the multi-process backend satisfies the protocol, live
    assert ref["delivered"] == first["delivered"] == last["delivered"] == 2  # ticks 0 and 2, due at 1 and 3
    for tick, expected in enumerate(ref["merged"]):
        got = {**first["merged"][tick], **last["merged"][tick]}
        assert set(got) == set(expected)
        for name, grad in expected.items():
            torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6, msg=f"tick {tick} {name}")
    # no M before tick 1; from then on the merge changes G_comp, on both ranks
    assert ref["changed"] == first["changed"] == last["changed"] == [False, True, True, True]
    # dense boundary, both directions, one cut, the 5 kept rows' real tokens: 2 jobs
    kept_tokens = int(rollouts().select(torch.tensor([0, 2, 3, 4, 5])).attention_mask.sum())
    assert ref["bytes"] == first["bytes"] == last["bytes"] == 2 * (2 * kept_tokens * DIM * 4)


def test_the_update_loop_on_two_ranks_matches_one_process_and_skips_together(two_ranks: Any) -> None:
    """``grpo_update`` (2 ticks, clipping, SGD) through the pipeline backend: the same metrics on
    every rank, equal to the one-process backend's (gap per interaction included), the same
    weights after; a NaN loss on the last rank makes every rank skip every tick."""
    first, last = (result["update"] for result in two_ranks)
    ref = update_reference()
    assert first["clean"]["metrics"] == last["clean"]["metrics"]  # the last rank's, shared
    got = first["clean"]["metrics"]
    assert set(got) == set(ref["metrics"])
    assert {"agentic/gap_kl_turn0", "agentic/gap_kl_turn2", "gap/k3", "policy/entropy"} <= set(got)
    for key, value in ref["metrics"].items():
        assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    weights = {**first["clean"]["weights"], **last["clean"]["weights"]}
    assert set(weights) == set(ref["weights"])
    for name, weight in ref["weights"].items():
        torch.testing.assert_close(weights[name], weight, rtol=1e-4, atol=1e-6, msg=name)
    assert first["clean"]["skipped"] == last["clean"]["skipped"] == 0
    # NaN advantages: the loss is NaN on the last rank; no rank steps, and the weights stay put
    assert first["poisoned"]["skipped"] == last["poisoned"]["skipped"] == 2
    assert first["poisoned"]["metrics"]["policy/skipped_ticks"] == 2.0
    for result in (first, last):
        for name, weight in result["poisoned"]["weights"].items():
            assert torch.equal(weight, result["clean"]["weights"][name]), name


def test_anchor_state_is_per_rank_and_a_process_count_change_is_refused() -> None:
    from tclightning.anchor.circuit import rank_share

    assert rank_share({"circuit": 1}, 0, 1) == {"circuit": 1}
    assert rank_share({"per_rank": ["a", "b"]}, 1, 2) == "b"
    with pytest.raises(TclightningError, match="saved by 2 process.*trainer.devices x trainer.num_nodes = 2"):
        rank_share({"per_rank": ["a", "b"]}, 0, 1)
    with pytest.raises(TclightningError, match="saved by 1 process"):
        rank_share({"circuit": 1}, 0, 2)


def test_a_stage_chain_in_one_process_equals_the_model_with_cuts() -> None:
    """Without any process group: stage modules called in order reproduce the hooked model."""
    from tclightning.codecs import make_codec
    from tclightning.pipeline.layout import resolve_layout

    model, batch = tiny_llama(), rollouts()
    config = PipelineConfig(stages=4, layout="shallow", k=6)
    specs = resolve_layout(config, LAYERS, DIM)
    codecs = [make_codec(s.codec, DIM, k=s.k) for s in specs]
    stages = [
        StageModule(model, i, specs, send_codec=codecs[i] if i < 3 else None,
                    recv_codec=codecs[i - 1] if i else None, seed=config.seed)
        for i in range(4)
    ]
    kwargs = {"attention_mask": batch.attention_mask, "position_ids": batch.position_ids, "rows": torch.arange(6),
              "completion_ids": batch.completion_ids, "completion_mask": batch.completion_mask}
    x = batch.input_ids
    with torch.no_grad():
        for stage in stages:
            x = stage(x, **kwargs)
            if not stage.is_last:
                assert x.shape == (int(batch.attention_mask.sum()), specs[stage.index].k if specs[stage.index].compressed else DIM)
        with CutSet(model, config):
            expected, _ = completion_logps(model, batch)
    torch.testing.assert_close(x, expected, rtol=1e-5, atol=1e-6)
    mask = batch.attention_mask
    values = torch.randn(*mask.shape, 3)
    assert torch.equal(unpack(pack(values, mask), mask), values * mask[..., None])


# -- faults ---------------------------------------------------------------------------------------


def fault_worker(rank: int, world_size: int, fault: str) -> str:
    from tclightning.pipeline.engine import PipelineEngine, StageInputs, no_loss

    model = tiny_llama()
    engine = PipelineEngine(model, PipelineConfig(stages=2, microbatches=2, timeout_s=3, layout="all", k=5))
    batch = StageInputs.from_rollouts(rollouts())

    def loss_fn(logp: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return logp.sum()

    for step in range(3):
        if rank == 1 and step == 1:
            if fault == "dies":
                os._exit(3)
            time.sleep(60)  # hangs
        engine.set_step(step)
        engine.run(batch, loss_fn if engine.is_last else no_loss)
    return "finished"


@pytest.mark.parametrize("fault", ["dies", pytest.param("hangs", marks=pytest.mark.slow)])
def test_a_dead_or_hung_stage_stops_the_other_within_the_timeout(fault: str) -> None:
    outcomes = run_ranks(fault_worker, 2, fault, timeout_s=3, join_timeout_s=90)
    survivor = outcomes[0]
    assert survivor.error is not None and survivor.error.startswith("StageFailure"), survivor
    assert "pipeline rank 1 " in survivor.error and "3 s" in survivor.error
    assert survivor.seconds < 3 + 15  # start-up + one step + the 3 s timeout, never the 60 s hang
    if fault == "dies":
        assert outcomes[1].exitcode == 3


def test_layouts_the_processes_cannot_run_are_refused_by_name() -> None:
    from tclightning.pipeline.engine import check_distributed_layout
    from tclightning.pipeline.layout import resolve_layout

    config = PipelineConfig(stages=4)
    with pytest.raises(TclightningError, match="pipeline.stages=2"):
        check_distributed_layout(config, resolve_layout(config, LAYERS, DIM), 2)
    config = PipelineConfig(stages=2, layout="all", codec="svd")
    with pytest.raises(TclightningError, match="'svd'"):
        check_distributed_layout(config, resolve_layout(config, LAYERS, DIM), 2)


def test_several_processes_need_the_pipeline_strategy(run_root: Any) -> None:
    from tclightning.run import run

    with pytest.raises(TclightningError, match="trainer.strategy=pipeline"):
        run("tiny", ["trainer.devices=2"], quiet=True)
    assert not run_root.exists()  # refused before anything was written


@pytest.mark.slow
def test_lightning_launches_two_stage_processes_and_resumes(tmp_path: Any) -> None:
    """``tclightning run ... trainer.devices=2``: Lightning starts rank 1; one run directory, the
    boundary bytes of a PRF cut, and a resume that continues the step numbering."""
    import subprocess
    import sys

    from tclightning.grpo.summary import read_metrics

    args = [sys.executable, "-m", "tclightning", "run", "--recipe", "tiny", "--quiet", "trainer.strategy=pipeline",
            "trainer.devices=2", "trainer.accelerator=cpu", "pipeline.stages=2", "pipeline.layout=all",
            "pipeline.k=8", "trainer.val_every=0", "trainer.checkpoint_every=1",
            "model.warmup.steps=0", "logging.progress=none", "trainer.num_threads=1"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    first = subprocess.run([*args, "trainer.steps=2"], check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs" / "tiny").iterdir()
    # resume from the step-1 checkpoint as if the run had died after it
    ckpt = run_dir / "checkpoints" / "step-000001.ckpt"
    second = subprocess.run([*args[:6], "--resume", str(ckpt), *args[6:], "trainer.steps=3"], check=False, cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    assert [p.name for p in (tmp_path / "runs" / "tiny").iterdir()] == [run_dir.name]
    rows = read_metrics(run_dir / "metrics.csv")
    assert sorted(rows) == [0, 1, 2]
    for values in rows.values():
        assert values["wire/cut0/ratio"] == pytest.approx(DIM_TINY / 8)
        assert values["wire/sync_bytes"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["pipeline", "sampler"])
def test_a_two_process_signed_ema_run_resumes_and_matches_one_process(tmp_path: Any, placement: str) -> None:
    """``anchor.merger=signed_ema`` K=1/C=2 (one tick per step: snapshots at steps 0 and 2, their
    ``M`` at steps 1 and 3), ``beta=0.5``: 2 processes, resumed from step 1 (a snapshot + replay
    pending on each rank) and again from step 2 (each rank's ``M_bar`` restored), against one
    uninterrupted process with the same cuts. Same losses and gradient norms (which depend on every
    earlier merged update), same final weights; the same anchor bytes every step with the pipeline
    placement, and with ``anchor.placement=sampler`` (rank 0 computes ``M``, stage 1 receives its
    signs) fewer: the sign bits of stage 1's parameters instead of the dense pass."""
    import subprocess
    import sys

    from tclightning.grpo.summary import read_metrics

    base = [sys.executable, "-m", "tclightning", "run", "--recipe", "tiny", "--quiet"]
    common = ["trainer.strategy=pipeline", "trainer.accelerator=cpu", "pipeline.stages=2", "pipeline.layout=all",
              "pipeline.k=8", "trainer.val_every=0", "trainer.checkpoint_every=1", "model.warmup.steps=0",
              "logging.progress=none", "trainer.num_threads=1", "grpo.prompts_per_step=4",
              "grpo.overlong=1.0",  # rewards vary (truncated or not) without a warm-up
              "anchor.merger=signed_ema", "anchor.latency=1", "anchor.cadence=2", "anchor.beta=0.5",
              f"anchor.placement={placement}"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def launch(where: Path, extra: list[str], resume: Path | None = None) -> None:
        where.mkdir(exist_ok=True)
        args = [*base, *(["--resume", str(resume)] if resume else []), *common, *extra]
        done = subprocess.run(args, check=False, cwd=where, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]

    import shutil

    split, single = tmp_path / "split", tmp_path / "single"
    launch(split, ["trainer.devices=2", "trainer.steps=3", "trainer.keep_checkpoints=3"])
    (run_dir,) = (split / "runs" / "tiny").iterdir()
    again = tmp_path / "again"
    shutil.copytree(split, again)
    (again_dir,) = (again / "runs" / "tiny").iterdir()
    launch(split, ["trainer.devices=2", "trainer.steps=4"], run_dir / "checkpoints" / "step-000001.ckpt")
    launch(again, ["trainer.devices=2", "trainer.steps=4"], again_dir / "checkpoints" / "step-000002.ckpt")
    launch(single, ["trainer.devices=1", "trainer.steps=4"])
    (one_dir,) = (single / "runs" / "tiny").iterdir()

    want = read_metrics(one_dir / "metrics.csv")
    one_weights = torch.load(one_dir / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    assert want[1]["anchor/sign_agreement"] < 1.0  # gradients are not all zero
    for resumed in (run_dir, again_dir):
        got = read_metrics(resumed / "metrics.csv")
        check_same_run(got, want, same_bytes=placement == "pipeline")
        if placement == "sampler":
            assert all(0 < got[step]["anchor/bytes"] < want[step]["anchor/bytes"] for step in (1, 3))
        split_weights = torch.load(resumed / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
        for name, weight in one_weights.items():
            torch.testing.assert_close(split_weights[name], weight, rtol=1e-4, atol=1e-5, msg=name)


def check_same_run(got: dict[int, dict[str, float]], want: dict[int, dict[str, float]], steps: int = 4,
                   same_bytes: bool = True) -> None:
    assert sorted(got) == sorted(want) == list(range(steps))
    for step in want:
        if same_bytes:
            assert got[step]["anchor/bytes"] == want[step]["anchor/bytes"], step
        for key in ("loss/policy", "policy/grad_norm", "reward/mean"):
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-4, abs=1e-6), (step, key)
        if step:  # the tied embedding is counted on both of its ranks: close, not equal
            assert got[step]["anchor/sign_agreement"] == pytest.approx(want[step]["anchor/sign_agreement"], abs=0.01)
    # M is computed (dense bytes sent) at odd steps only (snapshots at even ones, delivered a step late)
    assert all((want[step]["anchor/bytes"] > 0) == (step % 2 == 1) for step in want)


# -- resume chains: a run resumed from a checkpoint that a resumed run wrote ---------------------


def test_a_run_resumed_from_a_resumed_runs_last_step_keeps_training(run_root: Any) -> None:
    """One process, in-process (the cause is not per process count): a checkpoint saved at a run's
    last step (``is_last_batch`` recorded by Lightning) continues when resumed with more steps,
    and step files from before a resume are replaced by the resumed run's."""
    from tclightning.grpo.summary import read_metrics
    from tclightning.run import run
    from tests.conftest import FAST

    settings = [*FAST, "trainer.checkpoint_every=1", "trainer.keep_checkpoints=10", "trainer.val_every=0"]
    run_dir = Path(run("tiny", [*settings, "trainer.steps=2"], quiet=True)["run_dir"])
    ckpts = run_dir / "checkpoints"
    run("tiny", [*settings, "trainer.steps=3"], resume=str(ckpts / "step-000001.ckpt"), quiet=True)
    run("tiny", [*settings, "trainer.steps=4"], resume="last", quiet=True)  # the resumed run's last step
    steps = [int(row["step"]) for row in csv_rows(run_dir / "metrics.csv")]
    assert steps == [0, 1, 2, 3]
    # step 2 was first written by the 2-step run, then by the 3-step run resumed from step 1
    total = {p.name: torch.load(p, weights_only=False)["hyper_parameters"]["total_steps"] for p in ckpts.glob("step-*")}
    assert total == {"step-000001.ckpt": 2, "step-000002.ckpt": 3, "step-000003.ckpt": 3, "step-000004.ckpt": 4}
    reference = Path(run("tiny", [*settings, "trainer.steps=4", "logging.name=reference"], quiet=True)["run_dir"])
    want, got = read_metrics(reference / "metrics.csv"), read_metrics(run_dir / "metrics.csv")
    for step in range(4):
        for key in ("reward/mean", "loss/policy", "policy/grad_norm"):
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-5, abs=1e-7), (step, key)


def csv_rows(path: Path) -> list[dict[str, str]]:
    import csv

    with path.open(newline="") as handle:
        return [row for row in csv.DictReader(handle) if row.get("reward/mean")]


@pytest.mark.slow
def test_a_two_process_run_crashed_resumed_ended_and_resumed_again_matches_one_process(tmp_path: Any) -> None:
    """2 processes, signed_ema (K=1/C=2): crash at step 3 (the step-2 snapshot pending), resume to
    the end of a 5-step run, then resume that resumed run's last checkpoint with 6 steps. Every
    step is logged exactly once and the run equals one uninterrupted process."""
    import subprocess
    import sys

    from tclightning.grpo.summary import read_metrics
    from tests.conftest import FAST

    base = [sys.executable, "-m", "tclightning", "run", "--recipe", "tiny", "--quiet"]
    common = [*FAST, "trainer.strategy=pipeline", "trainer.accelerator=cpu", "pipeline.stages=2", "pipeline.layout=all",
              "pipeline.k=8", "trainer.val_every=0", "trainer.checkpoint_every=1", "grpo.overlong=1.0",
              "anchor.merger=signed_ema", "anchor.latency=1", "anchor.cadence=2", "anchor.beta=0.5"]
    crash = "callbacks=[{class_path: tests.conftest.CrashAt, init_args: {step: 3}}]"
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def launch(where: Path, extra: list[str], resume: Path | None = None) -> int:
        where.mkdir(exist_ok=True)
        args = [*base, *(["--resume", str(resume)] if resume else []), *common, *extra]
        return subprocess.run(args, check=False, cwd=where, env=env, capture_output=True, text=True, timeout=600).returncode

    split, single = tmp_path / "split", tmp_path / "single"
    assert launch(split, ["trainer.devices=2", "trainer.steps=6", crash]) != 0
    (run_dir,) = (split / "runs" / "tiny").iterdir()
    assert [int(row["step"]) for row in csv_rows(run_dir / "metrics.csv")] == [0, 1, 2]
    assert launch(split, ["trainer.devices=2", "trainer.steps=5"], run_dir) == 0
    assert launch(split, ["trainer.devices=2", "trainer.steps=6"], run_dir) == 0
    assert launch(single, ["trainer.devices=1", "trainer.steps=6"]) == 0
    (one_dir,) = (single / "runs" / "tiny").iterdir()

    assert [int(row["step"]) for row in csv_rows(run_dir / "metrics.csv")] == list(range(6))
    check_same_run(read_metrics(run_dir / "metrics.csv"), read_metrics(one_dir / "metrics.csv"), steps=6)
    one = torch.load(one_dir / "checkpoints" / "last.ckpt", weights_only=False)
    split_ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)
    assert split_ckpt["tclightning"]["rl_step"] == one["tclightning"]["rl_step"] == 6
    for name, weight in one["state_dict"].items():
        torch.testing.assert_close(split_ckpt["state_dict"][name], weight, rtol=1e-4, atol=1e-5, msg=name)
    # each stage's Adam state as its owner left it (not a rank's stale copy from the last resume)
    want_opt, got_opt = one["optimizer_states"][0]["state"], split_ckpt["optimizer_states"][0]["state"]
    assert sorted(got_opt) == sorted(want_opt)
    for index, state in want_opt.items():
        for key, value in state.items():
            torch.testing.assert_close(got_opt[index][key], value, rtol=1e-4, atol=1e-8, msg=f"{index} {key}")
