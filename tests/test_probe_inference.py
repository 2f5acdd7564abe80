"""The inference-time compression sweep: rate 1.0 is the dense output exactly; accuracy and the
reference log-likelihood fall as the budget shrinks (on a tiny model trained to answer); the model
is left as found; the CLI writes its report.

The trained weights are not the same on every CPU: 250 AdamW steps amplify the last-bit
differences of the float kernels (AVX-512, AVX2, plain C++, MKL paths) into a different model.
Assertions on that model are therefore coarse, with margins measured over kernel variants and
training seeds; exact assertions are kept for what holds by construction (rate 1.0 is dense)."""

from __future__ import annotations

import csv
import itertools
from pathlib import Path

import pytest
import torch

from tclightning.cli.main import main
from tclightning.errors import TclightningError
from tclightning.models.config import ModelConfig, TinyModelConfig, WarmupConfig
from tclightning.models.loading import load_model
from tclightning.models.warmup import supervised_warmup
from tclightning.pipeline import PipelineConfig
from tclightning.pipeline.cuts import find_decoder_layers
from tclightning.probes.inference import (
    SweepPoint,
    compressed,
    inference_sweep,
    point_pipeline,
    reference_batch,
    reference_loglik,
    sweep_points,
)
from tclightning.sampling import PromptFormatter
from tclightning.tasks import TaskConfig, build_task
from tests.conftest import FAST

BASE = PipelineConfig(stages=4)  # 4 layers: cuts after layers 0, 1, 2
RATES = [1.0, 0.5, 0.25, 0.05, 0.02]  # d = 64: k = 64, 32, 16, 3, 1


@pytest.fixture(scope="module")
def trained():
    """A tiny model taught single-digit sums (~8 s): the dense forward knows the answers, so
    destroying boundary information must cost accuracy and likelihood. Which model comes out
    depends on the CPU's float kernels (see the module docstring)."""
    torch.set_num_threads(1)  # module fixtures run before the autouse single-thread one
    torch.manual_seed(0)
    model, tokenizer = load_model(ModelConfig(source="tiny", tiny=TinyModelConfig(hidden_size=64, num_layers=4,
                                                                                  intermediate_size=128)), seed=0)
    task = build_task(TaskConfig(name="arithmetic", digits=1, eval_size=16, num_train=84))
    formatter = PromptFormatter(tokenizer, None, True)
    train = list(task.train_examples())
    supervised_warmup(model, formatter, [e.prompt for e in train], [e.solution for e in train],
                      WarmupConfig(steps=250, batch_size=32, lr=3e-3))
    return model.eval(), formatter, task, train


@pytest.fixture(scope="module")
def result(trained):
    model, formatter, task, train = trained
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    out = inference_sweep(model, formatter, task, list(task.eval_examples()), BASE, sweep_points(["prf", "svd"], RATES),
                          calibration_examples=train[:32], max_new_tokens=4)
    return out, before


def rows_of(result, codec: str) -> list[dict]:
    return [r for r in result.rows if r["codec"] == codec]


def test_rate_one_reproduces_dense_exactly(result) -> None:
    out, _ = result
    dense = out.rows[0]
    assert dense["point"] == "dense" and dense["exact_match"] == 1.0
    for name in ("prf@1", "svd@1"):
        row = next(r for r in out.rows if r["point"] == name)
        assert row["texts"] == dense["texts"] and row["exact_match"] == 1.0 and row["prefix_agree"] == 1.0
        assert row["ref_loglik"] == dense["ref_loglik"] and row["accuracy"] == dense["accuracy"]
    assert out.continuations["prf@1"] == out.continuations["dense"]


def test_prf_at_full_budget_is_bitwise_dense(trained) -> None:
    model, formatter, _, train = trained
    batch = reference_batch(formatter, [e.prompt for e in train[:5]], [e.solution for e in train[:5]])
    kwargs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, "position_ids": batch.position_ids}
    dense = model(**kwargs).logits
    with compressed(model, point_pipeline(BASE, SweepPoint("prf", 1.0), "all")) as cuts:
        assert all(spec.compressed and spec.k == 64 for spec in cuts.specs)
        assert torch.equal(model(**kwargs).logits, dense)
    with compressed(model, point_pipeline(BASE, SweepPoint("prf", 0.5), "all")):
        assert not torch.equal(model(**kwargs).logits, dense)


def test_accuracy_and_loglik_fall_as_the_budget_shrinks(result) -> None:
    """Monotone over a coarse grid (dense, 50 %, 25 %, <= 5 %), each step with a margin.

    Margins: ``measured ...`` beside each bound is the smallest gap seen on 12 models: this fixture
    under ATEN_CPU_CAPABILITY default/avx2/avx512 and MKL_CBWR=COMPATIBLE, and with 8 other
    training seeds (bounds without the 50 % point also held for the fixture trained in float64).
    Not asserted: the order of k = 3 and k = 1 (both leave the model next to nothing, and which is
    worse follows the trained weights: -4.21 vs -3.95 nats on one CPU, -3.11 vs -3.72 on another)."""
    out, _ = result
    dense = out.rows[0]
    assert dense["accuracy"] >= 0.4  # the model learned something to lose (measured 0.56-0.94)
    prf = {r["rate"]: r for r in rows_of(out, "prf")}
    assert list(prf) == RATES
    ll = {rate: row["ref_loglik"] for rate, row in prf.items()}
    assert ll[1.0] == dense["ref_loglik"]  # full budget is the dense forward (exact, by construction)
    assert ll[0.5] < dense["ref_loglik"], ll  # half the channels costs likelihood (measured >= 0.32 nats)
    assert ll[0.25] < ll[0.5] - 0.5, ll  # a quarter costs clearly more than half (measured >= 1.2 nats)
    assert ll[0.25] < dense["ref_loglik"] - 1.0, ll  # (measured >= 1.8 nats)
    for rate in (0.05, 0.02):  # 5 % and 2 % cost clearly more than 50 % (measured >= 1.6 nats)
        assert ll[rate] < ll[0.5] - 1.0, (rate, ll)
    # greedy answers: almost none survive k = 1 (measured accuracy <= 0.07, exact match <= 0.07)
    assert prf[0.02]["accuracy"] <= dense["accuracy"] - 0.3 and prf[0.02]["exact_match"] < 0.5
    svd = {r["rate"]: r for r in rows_of(out, "svd")}
    # rank 1 of 64 costs clearly more than rank 3 (measured >= 2.3 nats) and than dense (>= 2.5);
    # rank 3 vs dense is not asserted: it keeps ~90 % of the energy and costs 0.1-1.7 nats
    assert svd[0.02]["ref_loglik"] < svd[0.05]["ref_loglik"] - 1.0
    assert svd[0.02]["ref_loglik"] < dense["ref_loglik"] - 1.5
    assert svd[0.02]["accuracy"] < dense["accuracy"]  # (measured <= 0.07 against >= 0.56)
    # a larger rank keeps more of the calibration energy: a theorem (nested top eigenvectors)
    energy = [svd[rate]["energy_kept"] for rate in (0.02, 0.05, 0.25, 0.5)]
    assert all(0 < a < b <= 1 for a, b in itertools.pairwise(energy)), energy
    assert [r["wire/ratio"] for r in prf.values()] == pytest.approx([1.0, 2.0, 4.0, 64 / 3, 64.0])


def test_model_left_as_found(trained, result) -> None:
    model, *_ = trained
    _, before = result
    assert not model.training
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    _, layers = find_decoder_layers(model)
    assert not model._forward_pre_hooks and all(not layer._forward_hooks for layer in layers)


def test_generated_tokens_get_their_own_prf_key(trained) -> None:
    model, formatter, _, _ = trained
    steps: list[int] = []
    with compressed(model, point_pipeline(BASE, SweepPoint("prf", 0.5), "all"), step=7) as cuts:
        _, layers = find_decoder_layers(model)
        handle = layers[0].register_forward_pre_hook(lambda module, args: steps.append(cuts.step))
        encoded = formatter.encode(["3+4="])
        model.generate(**encoded, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                       pad_token_id=formatter.tokenizer.pad_token_id)
        handle.remove()
    prompt_len = encoded["input_ids"].shape[1]
    assert steps == [7, 7 + prompt_len, 7 + prompt_len + 1, 7 + prompt_len + 2]


def test_reference_loglik_is_teacher_forced_likelihood(trained) -> None:
    model, formatter, _, train = trained
    batch = reference_batch(formatter, [train[0].prompt], [train[0].solution])
    mean, per_example = reference_loglik(model, batch, batch_size=4)
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)
    logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1], -1)
    width = batch.completion_ids.shape[1]
    expected = logp[-width:].gather(1, batch.completion_ids[0, :, None]).mean()
    assert mean == pytest.approx(float(expected), abs=1e-5) and per_example == [pytest.approx(mean)]


def test_sweep_points_and_errors(trained) -> None:
    assert [p.name for p in sweep_points(["prf", "svd"], [0.5, 0.1, 0.5])] == ["dense", "prf@0.5", "prf@0.1", "svd@0.5", "svd@0.1"]
    with pytest.raises(TclightningError, match="--codec"):
        sweep_points(["topk"], [0.5])
    with pytest.raises(TclightningError, match="rate"):
        sweep_points(["prf"], [1.5])
    model, formatter, task, _ = trained
    with pytest.raises(TclightningError, match="calibration"):
        inference_sweep(model, formatter, task, list(task.eval_examples())[:2], BASE, sweep_points(["svd"], [0.5]))


@pytest.mark.parametrize("layout", ["shallow:99", "solo:3"])
def test_a_layout_past_the_cuts_is_refused_before_the_dense_pass(trained, monkeypatch: pytest.MonkeyPatch,
                                                                  layout: str) -> None:
    """BASE has 3 cuts: the sweep used to generate the dense reference first and fail after it."""
    from tclightning.sampling.hf import HFSampler

    def no_pass(*args, **kwargs):
        raise AssertionError("a pass ran before the layout was checked")

    monkeypatch.setattr(HFSampler, "generate", no_pass)
    model, formatter, task, _ = trained
    with pytest.raises(TclightningError, match=f"pipeline.layout '{layout}'"):
        inference_sweep(model, formatter, task, list(task.eval_examples())[:2], BASE, sweep_points(["prf"], [0.5]),
                        layout=layout)


def test_cli_writes_the_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sweep"
    code = main(["probe", "inference", "--recipe", "tiny", "--model", "tiny", "--task", "arithmetic", "--limit", "3",
                 "--max-new-tokens", "3", "--rates", "1,0.5", "--calibration", "8", "--out", str(out), *FAST,
                 "pipeline.stages=2"])
    assert code == 0
    with (out / "inference.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [r["point"] for r in rows] == ["dense", "prf@1", "prf@0.5", "svd@1", "svd@0.5"]
    report = (out / "inference.md").read_text()
    assert "| prf@0.5 |" in report and "Shared prompt" in report and "**svd@0.5**" in report
    assert (out / "inference.png").stat().st_size > 0
    assert len((out / "generations.jsonl").read_text().splitlines()) == 5 * 3
    assert main(["probe", "inference", "--recipe", "tiny", "--codec", "topk", "--out", str(out)]) == 2
    assert "--codec" in capsys.readouterr().err
