"""The GRPO objective and the sampler-trainer gap (pure functions over token tensors).

Shapes: every per-token tensor is ``[B, T]`` over completion tokens, with ``mask`` 1 on real
tokens. ``logp`` carries gradient; ``old_logp``, ``ref_logp``, ``logp_sampler`` do not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str, norm_length: int | None = None) -> torch.Tensor:
    """Reduce per-token values to a scalar.

    * ``token-mean``: ``sum(v * m) / sum(m)`` -- every token weighs the same (DAPO).
    * ``seq-mean-token-mean``: mean over sequences of each sequence's token mean (original GRPO).
    * ``seq-mean-token-sum-norm``: mean over sequences of ``sum_t v / norm_length`` (Dr.GRPO), with
      ``norm_length`` the generation limit (defaults to ``T``).
    """
    if mode == "token-mean":
        return (values * mask).sum() / mask.sum().clamp(min=1)
    if mode == "seq-mean-token-mean":
        per_seq = (values * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        return per_seq.mean()
    if mode == "seq-mean-token-sum-norm":
        return ((values * mask).sum(-1) / (norm_length or values.shape[-1])).mean()
    raise ValueError(f"loss aggregation must be one of {AGGREGATIONS}, got {mode!r}")


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || ref): ``exp(ref - logp) - (ref - logp) - 1`` (>= 0)."""
    diff = ref_logp - logp
    return torch.exp(diff) - diff - 1


@dataclass
class PolicyLossOutput:
    loss: torch.Tensor
    policy_loss: torch.Tensor
    kl: torch.Tensor
    clip_frac: torch.Tensor  # share of tokens whose ratio was clipped (and the clip was active)
    tis_frac: torch.Tensor  # share of tokens whose importance weight hit the TIS cap
    masked_frac: torch.Tensor  # share of tokens masked for a sampler ratio outside the band


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    aggregation: str = "token-mean",
    norm_length: int | None = None,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    logp_sampler: torch.Tensor | None = None,
    tis_cap: float = 0.0,
    mask_ratio: tuple[float, float] | None = None,
) -> PolicyLossOutput:
    """Clipped GRPO surrogate with optional k3 KL, truncated importance sampling and masking.

    With ``r = exp(logp - old_logp)`` and sequence advantage ``A`` broadcast over tokens:
    ``l_t = -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)``. ``old_logp`` is the trainer's
    own recompute before the update (not the sampler's: docs/concepts.md, "The gap").

    Against the sampler (``logp_sampler``), with ``w = exp(old_logp - logp_sampler)``:
    TIS multiplies ``l_t`` by ``min(w, tis_cap)`` (when ``tis_cap > 0``); masking drops tokens
    with ``w`` outside ``mask_ratio = (low, high)``. Loss = ``agg(l) + kl_coef * agg(k3)``.
    """
    advantages = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    clipped_active = (clipped < unclipped).float()

    effective_mask = mask
    tis_frac = masked_frac = torch.zeros((), device=logp.device)
    if logp_sampler is not None and (tis_cap > 0 or mask_ratio is not None):
        sampler_ratio = torch.exp(old_logp - logp_sampler).detach()
        denom = mask.sum().clamp(min=1)
        if tis_cap > 0:
            per_token = per_token * sampler_ratio.clamp(max=tis_cap)
            tis_frac = ((sampler_ratio > tis_cap).float() * mask).sum() / denom
        if mask_ratio is not None:
            low, high = mask_ratio
            inside = ((sampler_ratio >= low) & (sampler_ratio <= high)).float()
            masked_frac = ((1 - inside) * mask).sum() / denom
            effective_mask = mask * inside

    pg = aggregate(per_token, effective_mask, aggregation, norm_length)
    kl = aggregate(k3_kl(logp, ref_logp), mask, aggregation, norm_length) if ref_logp is not None else torch.zeros_like(pg)
    loss = pg + kl_coef * kl if ref_logp is not None else pg
    clip_frac = (clipped_active * mask).sum() / mask.sum().clamp(min=1)
    return PolicyLossOutput(loss, pg.detach(), kl.detach(), clip_frac.detach(), tis_frac, masked_frac)


def gap_metrics(logp_trainer: torch.Tensor, logp_sampler: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Sampler-trainer gap over sampled tokens, ``delta = logp_trainer - logp_sampler``.

    ``gap/abs_mean`` mean |delta|; ``gap/k3`` mean ``e^delta - 1 - delta`` (k3 estimate of
    KL(sampler || trainer)); ``gap/max`` max |delta|; ``gap/outside_5x_frac`` share of tokens with
    ``e^delta`` outside [1/5, 5]; ``gap/logp_corr`` Pearson correlation of the two log-probs;
    ``gap/prob_abs_mean`` mean |p_trainer - p_sampler| (verl's rollout_probs_diff_mean).
    """
    sel = mask.bool()
    trainer = logp_trainer.detach().float()[sel]
    sampler = logp_sampler.detach().float()[sel]
    if trainer.numel() == 0:
        return {}
    delta = trainer - sampler
    bound = float(torch.log(torch.tensor(5.0)))
    if trainer.numel() > 1 and trainer.std() > 0 and sampler.std() > 0:
        corr = float(torch.corrcoef(torch.stack([trainer, sampler]))[0, 1])
    else:
        corr = 1.0 if torch.equal(trainer, sampler) else 0.0
    return {
        "gap/abs_mean": float(delta.abs().mean()),
        "gap/k3": float((torch.exp(delta) - 1 - delta).mean()),
        "gap/max": float(delta.abs().max()),
        "gap/outside_5x_frac": float((delta.abs() > bound).float().mean()),
        "gap/logp_corr": corr,
        "gap/prob_abs_mean": float((trainer.exp() - sampler.exp()).abs().mean()),
    }


def gap_by_turn(logp_trainer: torch.Tensor, logp_sampler: torch.Tensor, mask: torch.Tensor,
                turn: torch.Tensor) -> dict[str, float]:
    """The sampler-trainer gap of each interaction index of agentic rows (``turn[b]``: which
    interaction row ``b`` is): ``agentic/gap_kl_turn{i}`` (k3 KL) and ``agentic/gap_abs_turn{i}``
    (mean |delta|) over the rows of turn ``i`` (:func:`gap_metrics`)."""
    out: dict[str, float] = {}
    turn = turn.to(mask.device)
    for i in turn.unique().tolist():
        gap = gap_metrics(logp_trainer, logp_sampler, mask * turn.eq(i).unsqueeze(-1).to(mask.dtype))
        if gap:
            out[f"agentic/gap_kl_turn{i}"] = gap["gap/k3"]
            out[f"agentic/gap_abs_turn{i}"] = gap["gap/abs_mean"]
    return out
