"""The GRPO update of ``GRPOModule._update`` on a pipeline split across processes.

Every rank runs the same loop (epochs x minibatches optimizer ticks); each tick is one pipelined
forward/backward (:meth:`PipelineEngine.run`), then the tied-embedding gradients are summed, the
global gradient norm is all-reduced and clipped, and every rank steps its own stage's parameters.
The loss lives on the last rank, per micro-batch: :class:`MicrobatchLoss` normalises each
micro-batch's terms by the *whole* minibatch's denominators, so the micro-batch losses sum to
the one-process loss and the gradients match it.

Why these data moves (the design, also in docs/distributed.md): rank 0 holds a dense copy of
the whole policy and samples (the sampler is an inference engine; a stage is not), scores and
computes advantages, and broadcasts token ids, masks, sampler log-probs and advantages -- a few
bytes per token, never the boundary. After the update every stage's new weights go to rank 0
(``wire/sync_bytes``, apart from the boundary bytes), so the next step samples from the weights
the trainer has, as in one process.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from tclightning.grpo.data import minibatch_chunks
from tclightning.grpo.loss import aggregate, gap_metrics, k3_kl, policy_loss
from tclightning.pipeline.distributed import PipelineEngine, StageInputs

STAT_KEYS = ("loss/policy", "loss/kl", "policy/clip_frac", "policy/tis_clipped_frac", "policy/masked_frac")


class MicrobatchLoss:
    """``loss_fn(logp_mb, rows_mb)`` for the schedule: the GRPO loss of a minibatch, split so that
    ``sum over micro-batches == policy_loss(whole minibatch).loss`` (see ``grpo.loss.policy_loss``).

    ``token-mean`` terms are divided by the minibatch's token count (for the policy term: its
    effective mask under ``mask_ratio``), the ``seq-mean-*`` ones by its row count; the logged
    statistics are split the same way and summed in ``stats``. ``old_logp=None`` means the ratio
    is taken against the forward's own detached log-probs (a single tick: ratio 1)."""

    def __init__(
        self,
        *,
        old_logp: Tensor | None,
        advantages: Tensor,
        mask: Tensor,
        logp_sampler: Tensor,
        ref_logp: Tensor | None,
        cfg: Any,
        norm_length: int,
    ) -> None:
        self.old_logp, self.advantages, self.mask = old_logp, advantages, mask
        self.logp_sampler, self.ref_logp, self.cfg, self.norm_length = logp_sampler, ref_logp, cfg, norm_length
        self.mask_ratio = (cfg.mask_ratio_low, cfg.mask_ratio_high) if cfg.mask_ratio_high > 0 else None
        self.policy_mask = mask
        if self.mask_ratio is not None:
            if old_logp is None:
                raise ValueError("mask_ratio needs the old log-probs of the whole minibatch up front")
            ratio = torch.exp(old_logp - logp_sampler)
            low, high = self.mask_ratio
            self.policy_mask = mask * ((ratio >= low) & (ratio <= high)).float()
        self.rows = mask.shape[0]
        self.stats = {key: 0.0 for key in STAT_KEYS}

    def _share(self, mask_rows: Tensor, mask_all: Tensor) -> Tensor:
        """Micro-batch weight: its share of the minibatch's denominator for ``aggregate``."""
        if self.cfg.loss_aggregation == "token-mean":
            return mask_rows.sum().clamp(min=1) / mask_all.sum().clamp(min=1)
        return torch.tensor(mask_rows.shape[0] / self.rows, device=mask_rows.device)

    def __call__(self, logp: Tensor, rows: Tensor) -> Tensor:
        rows = rows.long().to(self.mask.device)
        cfg, mask = self.cfg, self.mask[rows]
        old = logp.detach() if self.old_logp is None else self.old_logp[rows]
        out = policy_loss(
            logp, old, self.advantages[rows], mask,
            clip_low=cfg.clip_low, clip_high=cfg.clip_high, aggregation=cfg.loss_aggregation,
            norm_length=self.norm_length, logp_sampler=self.logp_sampler[rows], tis_cap=cfg.tis_cap,
            mask_ratio=self.mask_ratio,
        )
        pg_share = self._share(self.policy_mask[rows], self.policy_mask)
        loss = out.loss * pg_share
        kl = torch.zeros((), device=logp.device)
        if self.ref_logp is not None:
            kl = aggregate(k3_kl(logp, self.ref_logp[rows]), mask, cfg.loss_aggregation, self.norm_length)
            kl = kl * self._share(mask, self.mask)
            loss = loss + cfg.kl_coef * kl
        token_share = mask.sum().clamp(min=1) / self.mask.sum().clamp(min=1)
        for key, value in (
            ("loss/policy", out.policy_loss * pg_share),
            ("loss/kl", kl.detach()),
            ("policy/clip_frac", out.clip_frac * token_share),
            ("policy/tis_clipped_frac", out.tis_frac * token_share),
            ("policy/masked_frac", out.masked_frac * token_share),
        ):
            self.stats[key] += float(value)
        return loss


def pipelined_update(
    module: Any, engine: PipelineEngine, rollouts: Any, advantages: Tensor, rows: Tensor, step: int,
    ref_logp: Tensor | None,
) -> dict[str, float]:
    """``GRPOModule._update`` with the policy split over ranks; every rank calls it with the same
    (broadcast) rollouts. Returns the same metrics on every rank (sent from the last rank)."""
    from tclightning.sampling.base import sequence_seed

    cfg = module.cfg
    optimizer, schedule = module.optimizers(), module.lr_schedulers()
    single_tick = cfg.epochs * cfg.minibatches == 1
    needs_old = not single_tick or cfg.mask_ratio_high > 0  # mask_ratio needs the whole minibatch first
    stats: dict[str, list[float]] = {}
    old_logp = entropy = None
    if needs_old:
        old_logp, entropy = engine.run(StageInputs.from_rollouts(rollouts), with_entropy=True)

    ticks = minibatch_chunks(rows, cfg.epochs, cfg.minibatches, sequence_seed(module.seed, step, salt=1))
    for tick, chunk in enumerate(ticks):
        if getattr(module, "circuit", None) is not None:  # as in one process: record / deliver M first
            module._anchor_tick(rollouts, advantages, rows, first_tick=tick == 0)
        part = rollouts.select(chunk.to(rollouts.completion_ids.device))
        width = part.completion_ids.shape[1]
        loss_fn = None
        if engine.is_last:
            loss_fn = MicrobatchLoss(
                old_logp=None if old_logp is None else old_logp[chunk, :width].to(engine.device),
                advantages=advantages[chunk].to(engine.device),
                mask=part.completion_mask.to(engine.device),
                logp_sampler=part.logp_sampler.to(engine.device),
                ref_logp=None if ref_logp is None else ref_logp[chunk, :width].to(engine.device),
                cfg=cfg,
                norm_length=module.sampler_cfg.max_new_tokens,
            )
        optimizer.zero_grad(set_to_none=True)
        logp, tick_entropy = engine.run(
            StageInputs.from_rollouts(part), loss_fn or _no_loss, with_entropy=single_tick and not needs_old
        )
        if single_tick and not needs_old and engine.is_last:
            old_logp, entropy = logp, tick_entropy
        engine.reduce_tied_gradients()
        max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
        grad_norm = engine.clip_gradients(max_norm)
        optimizer.step()
        schedule.step()
        tick = dict(loss_fn.stats) if loss_fn is not None else {}
        tick["policy/grad_norm"] = float(grad_norm)
        for key, value in tick.items():
            stats.setdefault(key, []).append(value)

    metrics: dict[str, float] = {key: sum(values) / len(values) for key, values in stats.items()}
    if engine.is_last:
        if not stats:
            metrics.update({"loss/policy": 0.0, "loss/kl": 0.0, "policy/clip_frac": 0.0, "policy/grad_norm": 0.0})
        if old_logp is not None:
            mask = rollouts.completion_mask.to(old_logp.device)
            sel_rows = rows if single_tick and not needs_old else slice(None)
            sel_mask = mask[sel_rows, : old_logp.shape[1]]
            sampler = rollouts.logp_sampler.to(old_logp.device)[sel_rows, : old_logp.shape[1]]
            metrics.update(gap_metrics(old_logp, sampler, sel_mask))
            if entropy is not None:
                metrics["policy/entropy"] = float((entropy * sel_mask).sum() / sel_mask.sum().clamp(min=1))
        metrics["policy/kept_frac"] = len(rows) / rollouts.num_sequences
    engine.sync_to_sampler()
    return engine.broadcast_object(metrics if engine.is_last else None, engine.world_size - 1, "sharing the step's metrics")


ANCHOR_LOSS = SimpleNamespace(
    clip_low=0.2, clip_high=0.28, tis_cap=0.0, mask_ratio_low=0.0, mask_ratio_high=0.0, kl_coef=0.0,
)
"""The anchor's loss knobs, as ``GRPOModule._anchor_gradient``: on-policy at the snapshot (ratio 1,
so the clip range is inert), no TIS, no ratio mask, no KL; only the aggregation is the recipe's."""


def pipelined_anchor_gradient(
    engine: PipelineEngine, job: Any, *, aggregation: str, norm_length: int
) -> tuple[list[Tensor], float]:
    """``GRPOModule._anchor_gradient`` with the policy split over ranks: the job's rollouts (its
    kept rows) through the pipeline at this rank's snapshot ``job.snapshot``, over the *dense*
    boundary. Every rank calls it for the same job; returns this rank's stage's ``M`` and the
    boundary bytes of the pass (all ranks, both directions)."""
    rows = job.payload["rows"]
    part = job.payload["rollouts"].select(rows.to(job.payload["rollouts"].completion_ids.device))
    loss_fn = None
    if engine.is_last:
        loss_fn = MicrobatchLoss(
            old_logp=None, advantages=job.payload["advantages"][rows].to(engine.device),
            mask=part.completion_mask.to(engine.device), logp_sampler=part.logp_sampler.to(engine.device),
            ref_logp=None, cfg=SimpleNamespace(**vars(ANCHOR_LOSS), loss_aggregation=aggregation),
            norm_length=norm_length,
        )
    return engine.anchor_gradient(list(job.snapshot), StageInputs.from_rollouts(part), loss_fn or _no_loss)


def _no_loss(logp: Tensor, rows: Tensor) -> Tensor:  # pragma: no cover - only the last rank computes a loss
    raise AssertionError("the loss is computed on the last rank only")
