"""Gradient coherence: the two premises of the two-circuit design, measured along a dense trajectory.

1. *Does the fast circuit carry signal?* ``fast_cosine`` / ``fast_sign_agreement``: the compressed
   gradient (the recipe's cuts and codec) against the dense gradient, same batch, same weights.
2. *Does a late anchor still point the way?* For each lag ``K``: the dense gradient ``g_t`` at
   ``theta(t)`` on batch ``b(t)`` against ``g_{t-K}`` at ``theta(t-K)`` on ``b(t-K)`` (cosine and
   per-coordinate sign agreement). Lag 0 compares ``g_t`` with ``g'_t``, the dense gradient at the
   same weights on an independent batch ``b'(t)``: the noise floor. ``merged_cosine``: the cosine
   between ``signed_ema_merge(g_t, g_{t-K}, alpha)`` (the merger of ``tclightning.anchor.mergers``
   with a K-late anchor, ``beta = 0``, no projector) and ``g'_t``, the held-out dense gradient at the
   current weights; at lag 0 the anchor is ``g_t`` itself and the merge is ``g_t``, so
   ``merged_cosine(0) == cosine(0)``. ``merged_fast_cosine``: the same with the fast gradient in
   place of ``g_t`` (the update a run of the recipe would step with).

Every number is a mean over the trajectory's steps ``t`` (for lag ``K`` the steps with ``t >= K``);
a step whose gradient is exactly zero (every group dropped) gives no value. Pure logic here: the
trajectory itself comes from a ``step_fn`` (the CLI plugs in GRPO, the tests a quadratic).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from tclightning.anchor.mergers import signed_ema_merge
from tclightning.anchor.mergers import sign_agreement as _sign_agreement
from tclightning.errors import TclightningError
from tclightning.files import save_figure

DEFAULT_LAGS = (0, 1, 2, 5, 10, 20)


def flatten(grads: Sequence[Tensor]) -> Tensor:
    """One float32 CPU vector of a list of gradient tensors (parameter order)."""
    return torch.cat([g.detach().reshape(-1).float().cpu() for g in grads]) if grads else torch.zeros(0)


def cosine(a: Tensor, b: Tensor) -> float | None:
    """``a . b / (|a| |b|)`` in float64; None when either is zero."""
    a, b = a.double(), b.double()
    na, nb = float(a.norm()), float(b.norm())
    if na == 0 or nb == 0:
        return None
    return float(a @ b) / (na * nb)


def sign_agreement(a: Tensor, b: Tensor) -> float | None:
    """Share of coordinates with ``sign(a) == sign(b)`` (0 counts as a sign, as the merger's metric);
    None when either vector is zero."""
    if not bool(a.any()) or not bool(b.any()):
        return None
    return _sign_agreement([a], [b])


def merged(fresh: Tensor, anchor: Tensor, alpha: float) -> Tensor:
    """The signed_ema merge of a fresh gradient with an anchor (``beta = 0``: the anchor is ``M_hat``)."""
    return signed_ema_merge([fresh], [anchor], alpha)[0]


@dataclass
class StepGradients:
    """What one trajectory step hands the meter: the dense gradient on ``b(t)``, the dense gradient
    at the same weights on an independent batch (``twin``), and the fast (compressed) gradient on
    ``b(t)`` (None: no fast circuit measured)."""

    dense: Tensor
    twin: Tensor
    fast: Tensor | None = None


def _mean(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None and not math.isnan(v)]
    return sum(kept) / len(kept) if kept else None


def _std(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None and not math.isnan(v)]
    if len(kept) < 2:
        return None
    m = sum(kept) / len(kept)
    return math.sqrt(sum((v - m) ** 2 for v in kept) / (len(kept) - 1))


class CoherenceMeter:
    """Accumulates the per-step values of the module doc; keeps only the last ``max(lags)`` dense
    gradients (a large model does not hold the whole trajectory)."""

    def __init__(self, lags: Sequence[int], alpha: float) -> None:
        lags = sorted(set(int(k) for k in lags))
        if not lags or lags[0] < 0:
            raise TclightningError(f"--lags must be integers >= 0, got {list(lags)}")
        if not 0.0 <= alpha <= 1.0:
            raise TclightningError(f"alpha must be in [0, 1], got {alpha}")
        self.lags, self.alpha = lags, alpha
        self.history: dict[int, Tensor] = {}
        self.fast: dict[str, list[float | None]] = {"cosine": [], "sign_agreement": []}
        self.series: dict[int, dict[str, list[float | None]]] = {
            k: {"cosine": [], "sign_agreement": [], "merged_cosine": [], "merged_fast_cosine": [], "fresh_cosine": []}
            for k in lags
        }
        self.steps = 0

    def add(self, t: int, grads: StepGradients) -> None:
        """Record step ``t`` (steps must come in increasing order)."""
        dense, twin = grads.dense, grads.twin
        if grads.fast is not None:
            self.fast["cosine"].append(cosine(grads.fast, dense))
            self.fast["sign_agreement"].append(sign_agreement(grads.fast, dense))
        self.history[t] = dense
        fresh = cosine(dense, twin)
        for k in self.lags:
            old = dense if k == 0 else self.history.get(t - k)
            if old is None:
                continue
            s = self.series[k]
            other = twin if k == 0 else old
            s["cosine"].append(cosine(dense, other))
            s["sign_agreement"].append(sign_agreement(dense, other))
            s["merged_cosine"].append(None if not old.any() else cosine(merged(dense, old, self.alpha), twin))
            if grads.fast is not None:
                s["merged_fast_cosine"].append(
                    None if not old.any() else cosine(merged(grads.fast, old, self.alpha), twin))
            s["fresh_cosine"].append(fresh)
        for old_t in [s for s in self.history if s <= t - max(self.lags)]:
            del self.history[old_t]
        self.steps += 1

    def summary(self) -> dict[str, Any]:
        """``fast_cosine``, ``fast_sign_agreement`` and ``lags`` (one object per lag: ``lag``, ``pairs``,
        ``cosine``, ``cosine_std``, ``sign_agreement``, ``merged_cosine``, ``merged_fast_cosine``,
        ``fresh_cosine``: the mean of ``cos(g_t, g'_t)`` over the same steps, ``cosine_se``: std / sqrt(pairs)),
        and ``affordable_lag`` (:func:`affordable_lag`)."""
        rows = []
        for k in self.lags:
            s = self.series[k]
            rows.append({
                "lag": k,
                "pairs": sum(v is not None for v in s["cosine"]),
                "cosine": _mean(s["cosine"]),
                "cosine_std": _std(s["cosine"]),
                "sign_agreement": _mean(s["sign_agreement"]),
                "merged_cosine": _mean(s["merged_cosine"]),
                "merged_fast_cosine": _mean(s["merged_fast_cosine"]),
                "fresh_cosine": _mean(s["fresh_cosine"]),
            })
        for row in rows:
            row["cosine_se"] = None if row["cosine_std"] is None else row["cosine_std"] / math.sqrt(row["pairs"])
        return {
            "affordable_lag": affordable_lag(rows),
            "fast_cosine": _mean(self.fast["cosine"]),
            "fast_sign_agreement": _mean(self.fast["sign_agreement"]),
            "steps": self.steps,
            "alpha": self.alpha,
            "lags": rows,
        }


def affordable_lag(rows: Sequence[dict[str, Any]], z: float = 2.0) -> int | None:
    """The largest lag ``K`` of ``rows`` such that at every listed lag up to ``K`` the mean cosine is
    more than ``z`` standard errors above 0 (``cosine > z * cosine_se``); None when even the first
    fails. A rough guide: the pairs of one trajectory overlap, so the standard error is optimistic."""
    best = None
    for row in sorted(rows, key=lambda r: r["lag"]):
        c, se = row["cosine"], row.get("cosine_se")
        if c is None or se is None or c <= z * se:
            break
        best = row["lag"]
    return best


def measure(step_fn: Callable[[int], StepGradients], steps: int, lags: Sequence[int], alpha: float,
            progress: Callable[[int, StepGradients], None] | None = None) -> dict[str, Any]:
    """Run ``step_fn(t)`` for ``t = 0 .. steps-1`` (each call measures the gradients at the current
    weights and then moves the weights one step) and return :meth:`CoherenceMeter.summary`."""
    if steps < 1:
        raise TclightningError(f"--steps must be >= 1, got {steps}")
    meter = CoherenceMeter(lags, alpha)
    for t in range(steps):
        grads = step_fn(t)
        meter.add(t, grads)
        if progress is not None:
            progress(t, grads)
    return meter.summary()


# ------------------------------------------------------------------------------- GRPO trajectory
class GRPOTrajectory:
    """The dense GRPO trajectory of a recipe, as a ``step_fn`` for :func:`measure`.

    ``module``: a :class:`~tclightning.grpo.module.GRPOModule` already warmed up; ``cuts``: the
    recipe's :class:`~tclightning.pipeline.cuts.CutSet` installed on its policy (None: no fast
    circuit). Step ``t`` samples ``b(t)`` (the prompts and seed a run's step ``t`` would use) and an
    independent ``b'(t)`` (another prompt stream and sampler seed) with the dense policy, computes
    the GRPO loss (``MicrobatchLoss``, one tick over the step's kept rows, ratio 1) and its gradient
    dense on both and through the cuts on ``b(t)``, then steps the recipe's optimizer (AdamW, LR
    warm-up, gradient clipping) with the dense gradient of ``b(t)``.
    """

    def __init__(self, module: Any, cuts: Any | None) -> None:
        from tclightning.grpo.data import PromptStream
        from tclightning.pipeline.backends import LocalBackend
        from tclightning.backend import BackendRequest
        from tclightning.models.logprobs import completion_logps

        self.module, self.cuts = module, cuts
        self.cfg = module.cfg
        request = BackendRequest(module.policy, module.sampler_cfg.temperature, completion_logps,
                                 lambda loss: loss.backward())
        self.backend = LocalBackend(request, cuts)
        module._backend = self.backend  # the module samples dense through it (codecs bypassed)
        n = len(module.train_examples)
        big = 1_000_000
        self.stream = PromptStream(n, self.cfg.prompts_per_step, big, module.seed)
        self.twin_stream = PromptStream(n, self.cfg.prompts_per_step, big, module.seed + 7919)
        optim = module.configure_optimizers()
        self.optimizer, self.schedule = optim["optimizer"], optim["lr_scheduler"]["scheduler"]
        self.rewards: list[float] = []

    def _batch(self, indices: list[int], seed: int) -> tuple[Any, Tensor, Tensor]:
        """``(rollouts, advantages, kept rows)`` as ``GRPOModule.training_step`` builds them."""
        from tclightning.grpo.advantages import group_advantages, zero_variance_groups

        cfg, module = self.cfg, self.module
        G = module.sampler_cfg.group_size
        examples = [module.train_examples[i] for i in indices]
        rollouts, rewards, owner, _ = module.collect(examples, seed)
        truncated = torch.zeros(len(rewards), dtype=torch.float32).index_add_(0, owner, rollouts.truncated.cpu().float()) > 0
        shaped = rewards - cfg.overlong_penalty * truncated.float() if cfg.overlong_penalty else rewards
        advantages = group_advantages(shaped, G, cfg.scale_rewards, cfg.eps)[owner]
        rows = torch.arange(rollouts.num_sequences)
        if cfg.drop_zero_variance_groups:
            keep = ~zero_variance_groups(shaped, G)
            rows = rows[keep.repeat_interleave(G)[owner]]
        if cfg.overlong == "mask":
            rollouts.completion_mask = rollouts.completion_mask * (~rollouts.truncated).float().unsqueeze(-1)
        self.rewards.append(float(rewards.mean()))
        return rollouts, advantages, rows

    def _gradient(self, rollouts: Any, advantages: Tensor, rows: Tensor, *, dense: bool) -> Tensor:
        """The GRPO loss's gradient on ``rows`` (flattened), dense or through the cuts."""
        import contextlib

        from tclightning.grpo.update import LossSettings, MicrobatchLoss

        params = self.backend.owned_parameters()
        for p in params:
            p.grad = None
        if len(rows) == 0:
            return torch.zeros(sum(p.numel() for p in params))
        part = rollouts.select(rows)
        loss_fn = MicrobatchLoss(
            old_logp=None, advantages=advantages[rows], mask=part.completion_mask, logp_sampler=part.logp_sampler,
            ref_logp=None, settings=LossSettings.of(self.cfg), norm_length=self.module.sampler_cfg.max_new_tokens,
        )
        with self.backend.dense() if dense else contextlib.nullcontext():
            self.backend.forward_backward(part, loss_fn)
        return flatten([p.grad if p.grad is not None else torch.zeros_like(p) for p in params])

    def __call__(self, t: int) -> StepGradients:
        from tclightning.sampling.base import sequence_seed

        module = self.module
        self.backend.begin_step(t)
        seed = sequence_seed(module.sampler_cfg.seed + module.seed, t)
        rollouts, advantages, rows = self._batch(self.stream.batch(t).indices, seed)
        twin = self._batch(self.twin_stream.batch(t).indices, sequence_seed(module.sampler_cfg.seed + module.seed + 7919, t))
        self.rewards.pop()  # the trajectory's reward is b(t)'s
        # a basis codec's cold start sends the dense boundary: that step measures nothing compressed
        cold = self.cuts is not None and any(b.codec.crosses_dense for b in self.cuts.boundaries)
        fast = None if self.cuts is None else self._gradient(rollouts, advantages, rows, dense=False)
        if cold:
            fast = None
        twin_grad = self._gradient(*twin, dense=True)
        dense = self._gradient(rollouts, advantages, rows, dense=True)
        # step with the dense gradient just left in .grad
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm > 0 else float("inf")
        self.backend.clip_gradients(max_norm)
        if bool(dense.any()) and bool(torch.isfinite(dense).all()):  # no rows kept: no step, the schedule waits
            self.optimizer.step()
            self.schedule.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepGradients(dense=dense, twin=twin_grad, fast=fast)


def lag_table(report: dict[str, Any]) -> str:
    """The markdown table of a :func:`measure` report."""

    def f(v: float | None) -> str:
        return "-" if v is None else f"{v:+.3f}"

    fast_agree = report["fast_sign_agreement"]
    afford = report.get("affordable_lag")
    lines = [
        f"fast circuit vs dense, same batch and weights: cosine {f(report['fast_cosine'])}, "
        f"sign agreement {'-' if fast_agree is None else format(fast_agree, '.3f')}",
        "",
        f"largest lag whose cosine stays > 2 standard errors above 0 at every lag up to it: "
        f"{'none' if afford is None else afford}",
        "",
        "| lag K | pairs | cosine | ± std | sign agreement | merged cosine | merged (fast) cosine | fresh cosine |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in report["lags"]:
        std = "-" if r["cosine_std"] is None else f"{r['cosine_std']:.3f}"
        agree = "-" if r["sign_agreement"] is None else f"{r['sign_agreement']:.3f}"
        lines.append(
            f"| {r['lag']} | {r['pairs']} | {f(r['cosine'])} | {std} | {agree} | {f(r['merged_cosine'])} "
            f"| {f(r['merged_fast_cosine'])} | {f(r['fresh_cosine'])} |"
        )
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Any, title: str = "") -> None:
    """Two panels against the lag K: cosine (dense vs K-late dense, merged, merged fast) and sign
    agreement, with the lag-0 noise floor and the fast circuit's level dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["lags"] if r["cosine"] is not None]
    ks = [r["lag"] for r in rows]

    def col(key: str) -> list[float]:
        return [float("nan") if r[key] is None else r[key] for r in rows]

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), constrained_layout=True)
    ax = axes[0]
    ax.plot(ks, col("cosine"), "o-", label="cos(g_t, g_{t-K}) (K=0: independent batch)")
    ax.plot(ks, col("merged_cosine"), "s--", label="merged(g_t, g_{t-K}) vs held-out g'_t")
    if report["fast_cosine"] is not None:
        ax.plot(ks, col("merged_fast_cosine"), "^:", label="merged(fast_t, g_{t-K}) vs held-out g'_t")
        ax.axhline(report["fast_cosine"], color="red", linestyle=":", label=f"fast vs dense ({report['fast_cosine']:+.2f})")
    floor = next((r for r in rows if r["lag"] == 0), None)
    if floor is not None:
        ax.axhline(floor["cosine"], color="grey", linestyle="--", label=f"noise floor, K=0 ({floor['cosine']:+.2f})")
    ax.axhline(0.0, color="black", linewidth=0.5)
    ax.set(xlabel="lag K (RL steps)", ylabel="cosine")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    ax = axes[1]
    ax.plot(ks, col("sign_agreement"), "o-", label="sign agreement g_t vs g_{t-K}")
    if floor is not None:
        ax.axhline(floor["sign_agreement"], color="grey", linestyle="--", label="noise floor, K=0")
    if report["fast_sign_agreement"] is not None:
        ax.axhline(report["fast_sign_agreement"], color="red", linestyle=":", label="fast vs dense")
    ax.axhline(0.5, color="black", linewidth=0.5)
    ax.set(xlabel="lag K (RL steps)", ylabel="share of coordinates with the same sign")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    if title:
        fig.suptitle(title)
    save_figure(fig, path, dpi=120)
    plt.close(fig)


__all__ = [
    "DEFAULT_LAGS", "CoherenceMeter", "affordable_lag", "GRPOTrajectory", "StepGradients", "cosine", "flatten", "lag_table",
    "measure", "merged", "plot", "sign_agreement",
]
