"""Synthetic metric streams that imitate three measured collapses and healthy runs, for tests, docs and calibration.

Every generator is seeded and returns a :class:`Trace`: rows of ``(step, metrics)`` with the
canonical names (``val/accuracy`` only on evaluation steps, like a real run), the noise-free
held-out accuracy behind them, and ``collapse_step`` -- the first step after the accuracy peak
where that true accuracy is back below its starting level (None for stable runs). The
acceptance check of the detector is ``collapse_step - first_warning_step >= 10``.

The noise model follows what a GRPO batch produces: per-step reward is a batch mean of 0/1
rewards (binomial noise plus a prompt-difficulty term plus slow AR(1) wander); held-out
accuracy is binomial over the evaluation set; mean length carries ~4% multiplicative noise,
the per-step maximum more; the truncated share is a binomial count; entropy and grad norm are
log-normal around slowly moving levels (grad norm with occasional 2-3x bumps); the gap has a
few % noise around a level set by the codec (dense engines ~0.006, the agentic compressed
run 0.61, a 5% PRF codec ~10 nats).

Traces:

* :func:`late_length_collapse` -- the larger-model / 16k-generation run: accuracy +9 points by
  step ~150, then a length feedback loop (response length growing on itself, the gap growing
  with it) drives completions into the generation limit and accuracy falls below its start
  within ~20 steps.
* :func:`stale_anchor_ratchet` -- the K=20 anchor: each stale anchor arrival (every 20 steps)
  ratchets response length up a notch that never comes back, reward stays flat, held-out
  accuracy slides from ~0.6 to ~0.44 by step 100.
* :func:`agentic_gap` -- the agentic task: gap 0.61 from step 0 (dense: 0.006), task completion
  falls to zero by step 6.
* :func:`stable` -- a healthy run (dense or compressed gap) with randomised learning curve,
  drift and noise: the false-alarm benchmark.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tclightning.files import replace_file

Row = tuple[int, dict[str, float]]


@dataclass
class Trace:
    """A synthetic run: ``rows`` to feed the detector, plus the ground truth behind them."""

    name: str
    description: str
    rows: list[Row]
    accuracy_true: np.ndarray
    collapse_step: int | None
    val_every: int
    meta: dict[str, float] = field(default_factory=dict)

    @property
    def start_accuracy(self) -> float:
        return float(self.accuracy_true[0])

    def series(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """``(steps, values)`` of one metric."""
        pts = [(s, m[name]) for s, m in self.rows if name in m]
        return np.asarray([p[0] for p in pts]), np.asarray([p[1] for p in pts], dtype=float)

    def to_csv(self, path: str | Path) -> Path:
        """Write ``metrics.csv`` the way Lightning's CSVLogger does: a ``step`` column, one row for
        the train metrics of a step and a separate row for its validation metrics."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        names = sorted({k for _, m in self.rows for k in m})

        def write(fh: Any) -> None:
            writer = csv.DictWriter(fh, fieldnames=["epoch", "step", *names])
            writer.writeheader()
            for step, metrics in self.rows:
                train = {k: v for k, v in metrics.items() if not k.startswith("val/")}
                val = {k: v for k, v in metrics.items() if k.startswith("val/")}
                for part in (train, val):
                    if part:
                        writer.writerow({"epoch": 0, "step": step, **{k: repr(float(v)) for k, v in part.items()}})

        replace_file(path, write)
        return path


def _first_below_start(acc: np.ndarray) -> int | None:
    """First step after the peak where ``acc`` is below ``acc[0]`` (None if it never is)."""
    peak = int(np.argmax(acc))
    below = np.nonzero(acc[peak:] < acc[0])[0]
    return int(peak + below[0]) if below.size else None


def _ar1(rng: np.random.Generator, n: int, sigma: float, phi: float) -> np.ndarray:
    """AR(1) noise with stationary standard deviation ``sigma`` and lag-1 correlation ``phi``."""
    out = np.zeros(n)
    innov = rng.normal(0.0, sigma * math.sqrt(1 - phi * phi), n)
    out[0] = rng.normal(0.0, sigma)
    for t in range(1, n):
        out[t] = phi * out[t - 1] + innov[t]
    return out


def _norm_sf(z: np.ndarray) -> np.ndarray:
    """Gaussian survival function (vectorised, via erfc)."""
    return 0.5 * np.vectorize(math.erfc)(np.asarray(z, dtype=float) / math.sqrt(2.0))


def _assemble(
    rng: np.random.Generator,
    *,
    acc: np.ndarray,
    reward_true: np.ndarray,
    length: np.ndarray,
    max_length: float,
    entropy: np.ndarray,
    grad_norm: np.ndarray,
    gap: np.ndarray,
    batch: int,
    eval_size: int,
    val_every: int,
    reward_noise: float = 0.03,
    length_sigma: float = 0.5,
) -> list[Row]:
    """Turn noise-free curves into noisy per-step canonical metrics."""
    n = acc.size
    # share of completions whose (log-normal) length exceeds the generation limit
    trunc_p = _norm_sf((math.log(max_length) - np.log(length)) / length_sigma)
    slow = _ar1(rng, n, reward_noise / 2, 0.9)
    rows: list[Row] = []
    for t in range(n):
        p = float(np.clip(reward_true[t] + rng.normal(0.0, reward_noise) + slow[t], 0.0, 1.0))
        reward = rng.binomial(batch, p) / batch
        trunc = rng.binomial(batch, float(trunc_p[t])) / batch
        mean_len = min(length[t] * math.exp(rng.normal(0.0, 0.04)), max_length)
        max_len = min(max_length, length[t] * math.exp(2.2 * length_sigma + rng.normal(0.0, 0.08)))
        g = gap[t] * math.exp(rng.normal(0.0, 0.04))
        bump = math.exp(rng.normal(0.0, 0.35)) * (rng.uniform(2.0, 3.0) if rng.random() < 0.01 else 1.0)
        metrics = {
            "reward/mean": reward,
            "reward/std": math.sqrt(max(reward * (1 - reward), 0.0)),
            "response/length_mean": mean_len,
            "response/length_max": max_len,
            "response/truncated_frac": trunc,
            "policy/entropy": entropy[t] * math.exp(rng.normal(0.0, 0.05)),
            "policy/grad_norm": grad_norm[t] * bump,
            "gap/abs_mean": g,
            "gap/k3": math.pi / 4 * g * g,  # Gaussian per-token gap: E[d^2]/2
        }
        if t % val_every == 0 or t == n - 1:
            metrics["val/accuracy"] = rng.binomial(eval_size, float(np.clip(acc[t], 0, 1))) / eval_size
        rows.append((t, metrics))
    return rows


def late_length_collapse(
    seed: int = 0,
    steps: int = 220,
    onset: int = 145,
    tau: float = 16.0,
    gap0: float = 0.3,
    max_length: float = 16384.0,
    val_every: int = 5,
) -> Trace:
    """Gain, then a late collapse driven by generation length (a measured 16k-token run).

    Skill rises ~+9 points on a 0.40 start with a saturating curve; response length drifts
    slowly from 3000 tokens until ``onset``, then grows on itself (``1 + 0.6 (exp((t -
    onset)/tau) - 1)``); completions past the 16k limit score nothing, so accuracy = skill x
    (1 - truncated share) peaks +9 points at step ~147 and is back below its start at step ~170
    (the measured run: +9 points by step 150, below the start within 20 steps). The
    gap grows with length (``gap0 * sqrt(length / 3000)``, compressed but below the 0.5 band at
    the start), entropy rises with length. Batch 512 completions, evaluation on 500 questions.
    """
    rng = np.random.default_rng(seed)
    t = np.arange(steps, dtype=float)
    skill = 0.40 + 0.105 * (1 - np.exp(-t / 70.0))
    loop = np.exp(np.clip(t - onset, 0.0, None) / tau) - 1.0
    length = 3000.0 * (1 + 0.001 * t) * (1 + 0.6 * loop)
    trunc = _norm_sf((math.log(max_length) - np.log(length)) / 0.5)
    acc = skill * (1 - trunc)
    rows = _assemble(
        rng,
        acc=acc,
        reward_true=acc + 0.08,
        length=length,
        max_length=max_length,
        entropy=0.45 * (length / 3000.0) ** 0.35 * (1 - 0.15 * t / steps),
        grad_norm=0.3 * (length / 3000.0) ** 0.3 * np.ones(steps),
        gap=gap0 * np.sqrt(length / 3000.0),
        batch=512,
        eval_size=500,
        val_every=val_every,
    )
    return Trace(
        "late-collapse",
        "gain then late collapse driven by a length feedback loop amplified by the gap (16k-token run)",
        rows,
        acc,
        _first_below_start(acc),
        val_every,
        {"onset": float(onset), "peak_step": float(np.argmax(acc)), "seed": float(seed)},
    )


def stale_anchor_ratchet(
    seed: int = 0,
    steps: int = 140,
    cadence: int = 20,
    notch: float = 0.22,
    val_every: int = 5,
) -> Trace:
    """The K=20 stale-anchor length ratchet: reward flat, length up a notch per anchor arrival.

    Each stale anchor (every ``cadence`` steps from step ``cadence``) pushes mean length up by
    ``notch`` (smoothly over 4 steps) and it never comes back; the reward the rollouts earn
    stays flat; held-out accuracy rises a little from 0.60 with the early fresh gradients, then
    loses 4.5 points per notch, following the notches with an 8-step lag: below its start at
    step ~48, ~0.44 by step 100 (measured: 0.443 at K=20 vs 0.736 at K=5 and a 0.630 no-merger
    floor). Generation limit 1024, start length 250, batch 256, eval 1319 (GSM8K test).
    """
    rng = np.random.default_rng(seed)
    t = np.arange(steps, dtype=float)
    notches = np.zeros(steps)
    for arrival in range(cadence, steps, cadence):
        notches += np.clip((t - arrival) / 4.0, 0.0, 1.0)
    length = 250.0 * (1 + notch) ** notches
    # held-out accuracy answers the drift with a lag: damage follows the notches through an EMA
    damage = np.zeros(steps)
    for i in range(1, steps):
        damage[i] = damage[i - 1] + (0.045 * notches[i] - damage[i - 1]) / 8.0
    acc = 0.60 + 0.06 * (1 - np.exp(-t / 15.0)) - damage
    rows = _assemble(
        rng,
        acc=acc,
        reward_true=np.full(steps, 0.62) + 0.02 * (1 - np.exp(-t / 12.0)),
        length=length,
        max_length=1024.0,
        entropy=0.5 * (1 + 0.08 * notches),
        grad_norm=0.4 * np.ones(steps),
        gap=0.25 * (1 + 0.05 * notches),
        batch=256,
        eval_size=1319,
        val_every=val_every,
    )
    return Trace(
        "stale-anchor-ratchet",
        "K=20 anchor: reward-flat length ratchet, held-out accuracy 0.60 -> 0.44 by step 100",
        rows,
        acc,
        _first_below_start(acc),
        val_every,
        {"cadence": float(cadence), "seed": float(seed)},
    )


def agentic_gap(seed: int = 0, steps: int = 30, dense: bool = False) -> Trace:
    """The agentic run: gap 0.61 before the first update, tasks completed: 0.35 -> 0 by step 6.

    ``dense=True`` gives the dense control (gap 0.006, completion rate flat at 0.35). Each
    interaction is its own training row; batch 128 rows, evaluation every step on 200 tasks.
    """
    rng = np.random.default_rng(seed)
    t = np.arange(steps, dtype=float)
    if dense:
        acc = np.full(steps, 0.35)
        gap = np.full(steps, 0.006)
    else:
        acc = 0.35 * np.clip(1 - t / 6.0, 0.0, 1.0)
        gap = np.full(steps, 0.61)
    rows = _assemble(
        rng,
        acc=acc,
        reward_true=acc,
        length=np.full(steps, 400.0),
        max_length=4096.0,
        entropy=np.full(steps, 0.5) * (1 + (0 if dense else 0.5) * np.clip(t / 6.0, 0, 1)),
        grad_norm=np.full(steps, 0.5),
        gap=gap,
        batch=128,
        eval_size=200,
        val_every=1,
        reward_noise=0.0,
    )
    name = "agentic-dense" if dense else "agentic-gap"
    desc = "agentic dense control: gap 0.006, completion flat" if dense else (
        "agentic compressed: gap 0.61 from step 0, completes no task by step 6")
    return Trace(name, desc, rows, acc, None if dense else _first_below_start(acc), 1, {"seed": float(seed)})


def stable(seed: int = 0, steps: int = 300, gap: str = "dense", val_every: int = 10) -> Trace:
    """A healthy run with realistic noise; every shape parameter is drawn from the seed.

    Reward rises from 0.25-0.45 by 0.1-0.3 with a saturating curve (time constant 40-150 steps);
    length drifts by -15%..+25% over the run (healthy "longer reasoning" growth); truncation
    stays ~1-2%; entropy decays to 0.5-0.9 of its start; grad norm decays slowly; ``gap`` is
    ``"dense"`` (0.006), ``"compressed"`` (0.15-0.40, below the band) or ``"prf"`` (8-11 nats:
    a 5% PRF codec, above the band from step 0 by design). Batch 64-512, eval 300-1319.
    """
    rng = np.random.default_rng(seed)
    t = np.arange(steps, dtype=float)
    start = rng.uniform(0.25, 0.45)
    gain = rng.uniform(0.1, 0.3)
    acc = start + gain * (1 - np.exp(-t / rng.uniform(40.0, 150.0)))
    drift = rng.uniform(-0.15, 0.25)
    length = rng.uniform(200.0, 800.0) * (1 + drift * t / steps)
    levels = {"dense": (0.004, 0.008), "compressed": (0.15, 0.4), "prf": (8.0, 11.0)}
    if gap not in levels:
        raise ValueError(f"gap must be one of {sorted(levels)}")
    gap_level = rng.uniform(*levels[gap]) * (1 + rng.uniform(-0.1, 0.15) * t / steps)
    rows = _assemble(
        rng,
        acc=acc,
        reward_true=acc + rng.uniform(0.0, 0.1),
        length=length,
        max_length=float(length[0] * rng.uniform(3.5, 4.5)),
        entropy=rng.uniform(0.3, 0.8) * (1 - rng.uniform(0.1, 0.5) * t / steps),
        grad_norm=rng.uniform(0.2, 1.0) * (1 - 0.3 * t / steps),
        gap=gap_level,
        batch=int(rng.choice([64, 128, 256, 512])),
        eval_size=int(rng.choice([300, 500, 1319])),
        val_every=val_every,
        reward_noise=rng.uniform(0.02, 0.05),
    )
    return Trace(f"stable-{gap}", f"healthy run, {gap} gap", rows, acc, None, val_every, {"seed": float(seed)})


#: The named collapse traces (``name -> generator(seed)``).
COLLAPSE_TRACES: dict[str, Callable[[int], Trace]] = {
    "late-collapse": lambda seed: late_length_collapse(seed),
    "stale-anchor-ratchet": lambda seed: stale_anchor_ratchet(seed),
    "agentic-gap": lambda seed: agentic_gap(seed),
}

#: The named stable traces.
STABLE_TRACES: dict[str, Callable[[int], Trace]] = {
    "stable-dense": lambda seed: stable(seed, gap="dense"),
    "stable-compressed": lambda seed: stable(seed, gap="compressed"),
    "stable-prf": lambda seed: stable(seed, gap="prf"),
    "agentic-dense": lambda seed: agentic_gap(seed, dense=True),
}
