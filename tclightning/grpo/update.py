"""The GRPO update of one RL step, written once for every process layout.

:func:`grpo_update` reads top to bottom: the trainer's old log-probs (and the reference's) ->
``epochs x minibatches`` optimizer ticks, each: the anchor's record/delivery -> the loss of the
tick's rows -> forward/backward through the :class:`~tclightning.backend.Backend` -> gradient
clipping -> the anchor merge -> ``optimizer.step()``; then the step's metrics (losses, gap, gap per
interaction, entropy, kept rows). Where the policy runs (one process with in-graph cuts, or one
pipeline stage per process) is the backend's business, and only its forward/backward differs.

The loss is :class:`MicrobatchLoss`: the GRPO loss of a minibatch, split so that the losses of
its parts sum to ``policy_loss`` of the whole (one process calls it once with every row, so it
*is* ``policy_loss``, bit for bit). Its knobs are one :class:`LossSettings`, built once from the
recipe's ``grpo`` section. The anchor's dense gradient ``M`` (:func:`anchor_gradient`) is the same
loss on-policy at a snapshot (:meth:`LossSettings.on_policy`), through the backend's dense
forward/backward.

Non-finite guard: a tick whose loss or gradient norm is NaN/Inf on any rank makes no optimizer
step on any rank (``policy/skipped_ticks``; the decision is summed over ranks, so all agree).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch import Tensor

from tclightning.anchor.anchor import Anchor
from tclightning.anchor.circuit import AnchorJob
from tclightning.anchor.placement import SignRelay
from tclightning.backend import Backend, CompressedAnchorBackend, SamplerAnchorBackend
from tclightning.errors import TclightningError
from tclightning.grpo.config import GRPOConfig
from tclightning.grpo.data import minibatch_chunks
from tclightning.grpo.loss import aggregate, gap_by_turn, gap_metrics, k3_kl, policy_loss
from tclightning.sampling.base import Rollouts, sequence_seed

STAT_KEYS = ("loss/policy", "loss/kl", "policy/clip_frac", "policy/tis_clipped_frac", "policy/masked_frac")


@dataclass(frozen=True)
class LossSettings:
    """Every knob :class:`MicrobatchLoss` reads, each named and typed as in
    :class:`~tclightning.grpo.config.GRPOConfig` (see it for their meaning): the recipe's
    (:meth:`of`), or the anchor's (:meth:`on_policy`)."""

    clip_low: float
    clip_high: float
    loss_aggregation: str
    tis_cap: float
    mask_ratio: tuple[float, float] | None  # null: no ratio mask
    kl_coef: float

    @classmethod
    def of(cls, cfg: GRPOConfig) -> LossSettings:
        """The recipe's: each field is the ``grpo`` field of the same name."""
        values = {f.name: getattr(cfg, f.name) for f in fields(cls)}
        band = values["mask_ratio"]
        return cls(**{**values, "mask_ratio": None if band is None else (float(band[0]), float(band[1]))})

    def on_policy(self) -> LossSettings:
        """The anchor's: this loss on-policy at a snapshot, so no TIS, no ratio mask, no KL (the
        ratio is 1, inside any clip range a recipe allows, so the clip range is inert); only the
        aggregation matters."""
        return replace(self, tis_cap=0.0, mask_ratio=None, kl_coef=0.0)


class MicrobatchLoss:
    """``loss_fn(logp, rows)`` for a backend: the GRPO loss of a minibatch, split so that
    ``sum over parts == policy_loss(whole minibatch).loss`` (see ``grpo.loss.policy_loss``).

    ``token-mean`` terms are divided by the minibatch's token count (for the policy term: its
    effective mask under ``mask_ratio``), the ``seq-mean-*`` ones by its row count; the logged
    statistics are split the same way and summed in ``stats``. Called once with every row, each
    share is exactly 1.0 and the loss is ``policy_loss``'s. ``old_logp=None`` means the ratio is
    taken against the forward's own detached log-probs (a single tick: ratio 1); with
    ``mask_ratio`` that needs the whole minibatch in one call. ``finite``: every part's loss was
    finite."""

    def __init__(
        self,
        *,
        old_logp: Tensor | None,
        advantages: Tensor,
        mask: Tensor,
        logp_sampler: Tensor,
        ref_logp: Tensor | None,
        settings: LossSettings,
        norm_length: int,
    ) -> None:
        self.old_logp, self.advantages, self.mask = old_logp, advantages, mask
        self.logp_sampler, self.ref_logp, self.norm_length = logp_sampler, ref_logp, norm_length
        self.settings = settings
        self.mask_ratio = settings.mask_ratio
        self.policy_mask: Tensor | None = mask
        if self.mask_ratio is not None:
            self.policy_mask = None if old_logp is None else self._ratio_mask(old_logp)
        self.rows = mask.shape[0]
        self.stats = {key: 0.0 for key in STAT_KEYS}
        self._losses: list[Tensor] = []

    def _ratio_mask(self, old_logp: Tensor) -> Tensor:
        """The policy term's mask: tokens whose sampler ratio is inside ``mask_ratio``."""
        assert self.mask_ratio is not None
        ratio = torch.exp(old_logp - self.logp_sampler)
        low, high = self.mask_ratio
        return self.mask * ((ratio >= low) & (ratio <= high)).float()

    def _share(self, mask_rows: Tensor, mask_all: Tensor) -> Tensor:
        """The part's weight: its share of the minibatch's denominator for ``aggregate``."""
        if self.settings.loss_aggregation == "token-mean":
            return mask_rows.sum().clamp(min=1) / mask_all.sum().clamp(min=1)
        return torch.tensor(mask_rows.shape[0] / self.rows, device=mask_rows.device)

    @property
    def finite(self) -> bool:
        """Whether the loss of every part so far was finite (no part: True)."""
        return all(bool(torch.isfinite(loss)) for loss in self._losses)

    def __call__(self, logp: Tensor, rows: Tensor) -> Tensor:
        rows = rows.long().to(self.mask.device)
        settings, mask = self.settings, self.mask[rows]
        old = logp.detach() if self.old_logp is None else self.old_logp[rows]
        out = policy_loss(
            logp, old, self.advantages[rows], mask,
            clip_low=settings.clip_low, clip_high=settings.clip_high, aggregation=settings.loss_aggregation,
            norm_length=self.norm_length, logp_sampler=self.logp_sampler[rows], tis_cap=settings.tis_cap,
            mask_ratio=self.mask_ratio,
        )
        policy_mask = self.policy_mask
        if policy_mask is None:
            if len(rows) != self.rows:
                raise ValueError("mask_ratio without old log-probs needs the whole minibatch in one call")
            policy_mask = self._ratio_mask(old)
        pg_share = self._share(policy_mask[rows], policy_mask)
        loss = out.loss * pg_share
        kl = torch.zeros((), device=logp.device)
        if self.ref_logp is not None:
            kl = aggregate(k3_kl(logp, self.ref_logp[rows]), mask, settings.loss_aggregation, self.norm_length)
            kl = kl * self._share(mask, self.mask)
            loss = loss + settings.kl_coef * kl
        token_share = mask.sum().clamp(min=1) / self.mask.sum().clamp(min=1)
        for key, value in (
            ("loss/policy", out.policy_loss * pg_share),
            ("loss/kl", kl.detach()),
            ("policy/clip_frac", out.clip_frac * token_share),
            ("policy/tis_clipped_frac", out.tis_frac * token_share),
            ("policy/masked_frac", out.masked_frac * token_share),
        ):
            self.stats[key] += float(value)
        self._losses.append(loss.detach())
        return loss


def anchor_gradient(
    backend: Backend, job: AnchorJob, *, settings: LossSettings, norm_length: int, compressed: bool = False,
) -> tuple[list[Tensor], float]:
    """The anchor's dense ``M`` of ``job``: the gradient of the run's GRPO loss (``settings``) taken
    on-policy (:meth:`LossSettings.on_policy`) at the job's weights (``job.snapshot``, this rank's
    owned parameters) on the job's kept rollout rows (paired replay), through
    :meth:`Backend.dense_forward_backward`. Returns ``(M, boundary bytes)``.
    ``compressed``: the same loss through the fast circuit instead (``G_hat`` of the
    ``control_variate`` merger, :meth:`CompressedAnchorBackend.compressed_forward_backward`)."""
    part, loss_fn = _anchor_loss(backend, job, settings=settings, norm_length=norm_length)
    if compressed:
        if not isinstance(backend, CompressedAnchorBackend):
            raise TclightningError(
                "anchor.merger=control_variate needs the fast circuit at the anchor's snapshot, which this backend "
                f"({type(backend).__name__}) cannot run: use one process (trainer.devices x trainer.num_nodes = 1) "
                "or anchor.merger=signed_ema")
        return backend.compressed_forward_backward(job.snapshot, part, loss_fn)
    return backend.dense_forward_backward(job.snapshot, part, loss_fn)


def _anchor_loss(backend: Backend, job: AnchorJob, *, settings: LossSettings, norm_length: int) -> tuple[Any, MicrobatchLoss]:
    """The job's kept rollout rows on the backend's device and the on-policy loss over them."""
    rollouts, rows = job.payload["rollouts"], job.payload["rows"]
    part = rollouts.select(rows.to(rollouts.completion_ids.device)).to(backend.device)
    loss_fn = MicrobatchLoss(
        old_logp=None, advantages=job.payload["advantages"][rows].to(backend.device), mask=part.completion_mask,
        logp_sampler=part.logp_sampler, ref_logp=None, settings=settings.on_policy(), norm_length=norm_length,
    )
    return part, loss_fn


def sampler_anchor_gradient(
    backend: SamplerAnchorBackend, job: AnchorJob, relay: SignRelay, *, settings: LossSettings, norm_length: int,
) -> tuple[list[Tensor], float]:
    """``anchor.placement: sampler`` across processes (every rank calls): the sampling rank computes
    the same loss as :func:`anchor_gradient` on the whole policy at the job's snapshot and sends
    every other rank ``sign(M_bar)`` of its stage (:meth:`SamplerAnchorBackend.sampler_anchor_gradient`).
    Returns this rank's anchor tensors (its own ``M`` on the sampling rank, the signs elsewhere)
    and the signs' bytes."""
    if not backend.samples:
        return backend.sampler_anchor_gradient(None, None, None, relay)
    part, loss_fn = _anchor_loss(backend, job, settings=settings, norm_length=norm_length)  # type: ignore[arg-type]
    return backend.sampler_anchor_gradient(job.snapshot, part, loss_fn, relay)


@dataclass
class UpdateResult:
    """What one update did: its metrics (the same on every rank), how many ticks it ran and how
    many of those made no optimizer step (non-finite loss or gradient)."""

    metrics: dict[str, float]
    ticks: int
    skipped: int

    @property
    def all_skipped(self) -> bool:
        return self.skipped > 0 and self.skipped == self.ticks


def grpo_update(
    backend: Backend,
    optimizer: Any,
    schedule: Any,
    rollouts: Rollouts,
    advantages: Tensor,
    rows: Tensor,
    *,
    cfg: GRPOConfig,
    norm_length: int,
    seed: int,
    step: int,
    reference: Callable[[], Tensor] | None = None,
    turns: Tensor | None = None,
    anchor: Anchor | None = None,
    clock: Callable[[], int] = lambda: 0,
) -> UpdateResult:
    """``epochs x minibatches`` optimizer ticks of the clipped surrogate on ``rows`` of ``rollouts``.

    ``optimizer`` / ``schedule``: the optimizer (``zero_grad``, ``step``) and its LR schedule.
    ``norm_length``: the generation limit (``seq-mean-token-sum-norm``). ``seed`` and ``step`` seed
    the minibatch shuffle. ``reference()``: the frozen reference's log-probs of ``rollouts``
    (computed on the sampling rank; with ``grpo.kl_coef > 0``). ``turns``: the interaction index
    of each row (agentic), for the gap per interaction. ``anchor``: records/delivers at each
    tick's start and merges before each step. ``clock()``: optimizer steps taken so far (the
    anchor's tick). Every rank calls it with the same (shared) arguments."""
    settings = LossSettings.of(cfg)
    single_tick = cfg.epochs * cfg.minibatches == 1
    mask_ratio = settings.mask_ratio is not None
    # The trainer's own log-probs at the weights that sampled: the PPO "old" policy and the
    # trainer side of the gap. With a single tick they come from the update's forward, unless a
    # ratio mask must see the whole minibatch before a micro-batched loss starts.
    from_forward = single_tick and not (mask_ratio and backend.microbatched)
    old_logp = entropy = None
    if not from_forward:
        old_logp, entropy = backend.logprobs(rollouts, with_entropy=True)
    ref_logp = None if reference is None else backend.share_from_sampler(reference, "receiving the reference log-probs")

    can_fast = isinstance(backend, CompressedAnchorBackend)
    # anchor.placement: sampler across processes: the sampling rank runs the anchor alone (one
    # process has nothing to place: its anchor already is a dense clone of the whole policy)
    relay = anchor.relay if anchor is not None and backend.world_size > 1 else None
    placed = backend if relay is not None and isinstance(backend, SamplerAnchorBackend) else None
    samples = placed is None or placed.samples

    def replay() -> dict[str, Tensor | Rollouts]:  # what the anchor replays at its snapshot
        return {"rollouts": rollouts.to("cpu"), "advantages": advantages.cpu(), "rows": rows.cpu()}

    stats: dict[str, list[float]] = {}
    ticks = skipped = 0
    for tick, chunk in enumerate(minibatch_chunks(rows, cfg.epochs, cfg.minibatches, sequence_seed(seed, step, salt=1))):
        if anchor is not None and placed is not None and relay is not None:  # the sampling rank's anchor
            anchor.tick(
                clock(), first=tick == 0, parameters=placed.sampler_anchor_parameters,
                # the replay stays where M is computed; the other ranks keep only the schedule
                payload=replay if samples else lambda: None,
                gradient=lambda job: sampler_anchor_gradient(placed, job, relay, settings=settings,
                                                             norm_length=norm_length),
                signs=not samples,
            )
        elif anchor is not None:  # record this step's snapshot + replay (first tick), deliver M when due
            anchor.tick(
                clock(), first=tick == 0, parameters=backend.owned_parameters, payload=replay,
                gradient=lambda job: anchor_gradient(backend, job, settings=settings, norm_length=norm_length),
                # None where the backend cannot run the fast circuit at a snapshot (across processes):
                # a merger that needs it still gets it, and anchor_gradient names the fix
                fast_gradient=(lambda job: anchor_gradient(backend, job, settings=settings, norm_length=norm_length,
                                                           compressed=True))
                if can_fast or anchor.merger.needs_fast else None,
            )
        part = rollouts.select(chunk.to(rollouts.completion_ids.device))
        width = part.completion_ids.shape[1]
        device = backend.device
        loss_fn = MicrobatchLoss(
            old_logp=None if old_logp is None else old_logp[chunk, :width].to(device),
            advantages=advantages[chunk].to(device),
            mask=part.completion_mask.to(device),
            logp_sampler=part.logp_sampler.to(device),
            ref_logp=None if ref_logp is None else ref_logp[chunk, :width].to(device),
            settings=settings,
            norm_length=norm_length,
        )
        optimizer.zero_grad(set_to_none=True)
        logp, tick_entropy = backend.forward_backward(part, loss_fn, with_entropy=from_forward)
        if from_forward:
            old_logp, entropy = logp, tick_entropy
        max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
        grad_norm = backend.clip_gradients(max_norm)
        # A NaN/Inf loss or gradient must not reach the weights or Adam's moments: no step on any
        # rank (the LR schedule waits too). The values are still logged, so the detector sees them.
        bad = torch.tensor(0.0 if loss_fn.finite and bool(torch.isfinite(grad_norm)) else 1.0)
        if float(backend.reduce_sum(bad, "agreeing on a finite update")) == 0:
            if anchor is not None:
                anchor.merge_(backend.owned_parameters(), clock(), anchor.pop_delivery())
            optimizer.step()
            schedule.step()
        else:
            optimizer.zero_grad(set_to_none=True)
            skipped += 1
        ticks += 1
        s = loss_fn.stats
        for key, value in (
            ("loss/policy", s["loss/policy"]),
            ("loss/kl", s["loss/kl"]),
            ("policy/clip_frac", s["policy/clip_frac"]),
            ("policy/grad_norm", float(grad_norm)),
            ("policy/tis_clipped_frac", s["policy/tis_clipped_frac"]),
            ("policy/masked_frac", s["policy/masked_frac"]),
        ):
            stats.setdefault(key, []).append(value)

    metrics: dict[str, float] | None = None
    if backend.has_loss:
        metrics = {key: sum(values) / len(values) for key, values in stats.items()}
        if not stats:  # every group dropped: nothing to learn from this step
            metrics.update({"loss/policy": 0.0, "loss/kl": 0.0, "policy/clip_frac": 0.0, "policy/grad_norm": 0.0})
        metrics.update(_gap(rollouts, rows if from_forward else slice(None), old_logp, entropy, turns))
        metrics["policy/kept_frac"] = len(rows) / rollouts.num_sequences
        metrics["policy/skipped_ticks"] = float(skipped)
    backend.after_update()
    return UpdateResult(backend.share_metrics(metrics), ticks, skipped)


def _gap(rollouts: Rollouts, sel_rows: Tensor | slice, old_logp: Tensor | None, entropy: Tensor | None,
         turns: Tensor | None) -> dict[str, float]:
    """Gap, gap per interaction and entropy of the rows the old log-probs cover (``sel_rows``)."""
    if old_logp is None:
        return {}
    width = old_logp.shape[1]
    mask = rollouts.completion_mask.to(old_logp.device)[sel_rows, :width]
    sampler = rollouts.logp_sampler.to(old_logp.device)[sel_rows, :width]
    metrics = gap_metrics(old_logp, sampler, mask)
    if turns is not None:
        metrics.update(gap_by_turn(old_logp, sampler, mask, turns[sel_rows]))
    if entropy is not None:
        metrics["policy/entropy"] = float((entropy * mask).sum() / mask.sum().clamp(min=1))
    return metrics


__all__ = ["STAT_KEYS", "LossSettings", "MicrobatchLoss", "UpdateResult", "anchor_gradient", "grpo_update"]
