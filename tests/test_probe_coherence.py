"""`tclightning probe coherence`: the measurement on cases with a known answer, the CLI's JSON, bad options."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tclightning.cli.main import main
from tclightning.errors import TclightningError
from tclightning.probes.coherence import (
    CoherenceMeter,
    StepGradients,
    affordable_lag,
    cosine,
    measure,
    merged,
    sign_agreement,
)

ALPHA = 0.25


def quadratic_step_fn():
    """Plain gradient descent on ``L = 1/2 theta^T H theta``, ``H = diag(1, 3)``, lr 0.5, from (1, 1):
    ``theta_{t+1} = (1 - 0.5 H) theta_t``, so ``g_t = H theta_t = 0.5^t (1, 3 (-1)^t)``. The second
    coordinate flips sign every step: at lag K the two gradients have the same signs (K even) or
    the second sign flipped (K odd). The twin is the same gradient scaled (a noise-free batch), the
    fast circuit keeps only the first coordinate."""
    theta = torch.nn.Parameter(torch.tensor([1.0, 1.0], dtype=torch.float64))
    h = torch.tensor([1.0, 3.0], dtype=torch.float64)
    optimizer = torch.optim.SGD([theta], lr=0.5)

    def step(t: int) -> StepGradients:
        optimizer.zero_grad()
        (0.5 * (h * theta * theta).sum()).backward()
        g = theta.grad.detach().clone()
        optimizer.step()
        return StepGradients(dense=g, twin=2.0 * g, fast=g * torch.tensor([1.0, 0.0], dtype=torch.float64))

    return step


def expected_quadratic(lag: int) -> tuple[float, float, float]:
    """(cosine, sign agreement, merged cosine) of the quadratic case at ``lag``, by hand.

    ``g_t ∝ (1, 3 s)``, ``s = ±1``; ``g_{t-K} ∝ (1, 3 s (-1)^K)``.
    cosine: ``(1 + 9 (-1)^K) / 10``; sign agreement 1 (K even) or 1/2 (K odd).
    merge ``alpha g + (1 - alpha) |g| sign(anchor)``: K even gives ``g``; K odd gives
    ``(1, 3 s (2 alpha - 1))``, whose cosine with ``g`` is ``(1 + 9 (2 alpha - 1)) / (sqrt(10) sqrt(1 + 9 (2 alpha - 1)^2))``.
    """
    if lag % 2 == 0:
        return 1.0, 1.0, 1.0
    c = 2 * ALPHA - 1
    return -0.8, 0.5, (1 + 9 * c) / (math.sqrt(10) * math.sqrt(1 + 9 * c * c))


def test_quadratic_gradient_descent_matches_the_hand_computation() -> None:
    report = measure(quadratic_step_fn(), steps=8, lags=[0, 1, 2, 3, 5], alpha=ALPHA)
    # fast = (g1, 0): cosine with (g1, 3 g1 s) is 1/sqrt(10); signs agree on the first coordinate only
    assert report["fast_cosine"] == pytest.approx(1 / math.sqrt(10), abs=1e-12)
    assert report["fast_sign_agreement"] == pytest.approx(0.5)
    assert report["steps"] == 8
    assert report["affordable_lag"] == 0  # lag 1 already points away (cosine -0.8)
    for row in report["lags"]:
        k = row["lag"]
        cos, agree, merged_cos = expected_quadratic(k)
        assert row["pairs"] == 8 - k
        assert row["cosine"] == pytest.approx(cos, abs=1e-12), k
        assert row["sign_agreement"] == pytest.approx(agree), k
        assert row["merged_cosine"] == pytest.approx(merged_cos, abs=1e-12), k
        assert row["fresh_cosine"] == pytest.approx(1.0, abs=1e-12)
        # merging into (g1, 0) keeps (g1, 0): |0| * sign(anything) = 0
        assert row["merged_fast_cosine"] == pytest.approx(1 / math.sqrt(10), abs=1e-12)
        assert row["cosine_std"] == pytest.approx(0.0, abs=1e-12)
    assert [r["lag"] for r in report["lags"]] == [0, 1, 2, 3, 5]


def test_rotating_gradient_cosine_is_cos_of_the_angle() -> None:
    """``g_t = (cos wt, sin wt)``: the lag-K cosine is ``cos(wK)`` at every step."""
    w = math.pi / 7
    meter = CoherenceMeter([0, 1, 3, 7], alpha=0.5)
    for t in range(12):
        g = torch.tensor([math.cos(w * t), math.sin(w * t)], dtype=torch.float64)
        meter.add(t, StepGradients(dense=g, twin=-g))
    report = meter.summary()
    assert report["fast_cosine"] is None and report["fast_sign_agreement"] is None
    by_lag = {r["lag"]: r for r in report["lags"]}
    assert by_lag[0]["cosine"] == pytest.approx(-1.0)  # the twin points the other way
    for k in (1, 3, 7):
        assert by_lag[k]["cosine"] == pytest.approx(math.cos(w * k), abs=1e-12)
    assert len(meter.history) <= 7  # only the last max(lags) gradients are kept


def test_pure_functions() -> None:
    a = torch.tensor([1.0, -2.0, 0.0, 3.0])
    b = torch.tensor([2.0, 1.0, 0.0, -1.0])
    assert cosine(a, b) == pytest.approx((2 - 2 + 0 - 3) / (math.sqrt(14) * math.sqrt(6)))
    assert cosine(a, torch.zeros(4)) is None
    assert sign_agreement(a, b) == pytest.approx(0.5)  # coordinates 0 and 2 (0 counts as a sign)
    assert sign_agreement(torch.zeros(4), b) is None
    assert torch.equal(merged(a, a, 0.3), a)  # an anchor with the gradient's own signs changes nothing
    assert torch.allclose(merged(a, b, 0.25), torch.tensor([1.0, 0.25 * -2 + 0.75 * 2, 0.0, 0.25 * 3 - 0.75 * 3]))
    rows = [{"lag": 0, "cosine": 0.4, "cosine_se": 0.05}, {"lag": 1, "cosine": 0.2, "cosine_se": 0.05},
            {"lag": 5, "cosine": 0.05, "cosine_se": 0.05}, {"lag": 20, "cosine": 0.3, "cosine_se": 0.05}]
    assert affordable_lag(rows) == 1  # lag 5 is within 2 standard errors of 0: lag 20 does not count
    assert affordable_lag(rows[2:]) is None
    with pytest.raises(TclightningError):
        CoherenceMeter([-1], 0.25)
    with pytest.raises(TclightningError):
        CoherenceMeter([0], 1.5)


FAST = ["model.warmup.steps=0", "grpo.prompts_per_step=4", "sampler.group_size=4", "trainer.num_threads=1"]


def test_cli_json_schema(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # overrides right after --lags reach the recipe (argparse hands them to --lags)
    assert main(["probe", "coherence", "--recipe", "shallow-compressed", "--lags", "0", "1", "2", *FAST,
                 "--steps", "4", "--json", "--out", str(tmp_path)]) == 0  # fmt: skip
    doc = json.loads(capsys.readouterr().out)  # stdout is the one document; progress went to stderr
    for key in ("fast_cosine", "fast_sign_agreement", "lags"):
        assert key in doc
    assert [r["lag"] for r in doc["lags"]] == [0, 1, 2]
    for row in doc["lags"]:
        assert {"lag", "cosine", "sign_agreement", "merged_cosine"} <= set(row)
        for key in ("cosine", "merged_cosine"):
            assert row[key] is None or -1.0 <= row[key] <= 1.0
        assert row["sign_agreement"] is None or 0.0 <= row["sign_agreement"] <= 1.0
    assert doc["affordable_lag"] in (None, 0, 1, 2)
    assert doc["lags"][0]["merged_cosine"] == doc["lags"][0]["cosine"]  # a lag-0 anchor leaves g_t as it is
    assert doc["cuts"]["codec"] == "prf" and doc["steps"] == 4 and doc["prompts_per_step"] == 4
    for name in ("coherence.json", "coherence.md", "coherence.png"):
        assert (tmp_path / name).stat().st_size > 0


@pytest.mark.parametrize("argv, needle", [
    (["--lags", "-1"], "--lags"),
    (["--lags", "0", "5", "--steps", "5"], "largest lag"),
    (["--steps", "0"], "--steps"),
    (["--alpha", "2"], "--alpha"),
    (["--checkpoint", "/nonexistent.ckpt"], "--checkpoint"),
])  # fmt: skip
def test_cli_bad_option_exits_2_with_one_line(argv: list[str], needle: str, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["probe", "coherence", "--recipe", "shallow-compressed", "--out", str(tmp_path), *argv, *FAST]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error:") and needle in err


def test_an_interrupted_warm_up_is_one_line_and_exit_130(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Ctrl-C or SIGTERM in the supervised warm-up: its WarmupInterrupted was a traceback (exit 1)."""
    from tclightning.grpo.module import GRPOModule
    from tclightning.models.warmup import WarmupInterrupted

    def interrupted(self: GRPOModule, stage: str) -> None:
        raise WarmupInterrupted("interrupted during the supervised warm-up (step 26 of at most 3000)")

    monkeypatch.setattr(GRPOModule, "setup", interrupted)
    capsys.readouterr()
    assert main(["probe", "coherence", "--recipe", "tiny", "--lags", "0", "1", "--out", str(tmp_path / "out"),
                 *FAST]) == 130
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["interrupted during the supervised warm-up (step 26 of at most 3000); nothing was written"]
    assert not (tmp_path / "out").exists()
