"""The GRPO LightningModule. One ``training_step`` is one RL step, and it reads top to bottom:

sample (dense) -> reward -> advantages -> trainer log-probs (through whatever cuts the strategy
installed) and the gap -> ``epochs x minibatches`` optimizer ticks of the clipped surrogate.

Non-finite guard (one process): a tick whose loss or gradient norm is NaN/Inf makes no optimizer
step (``policy/skipped_ticks``); a policy whose weights or sampling logits are NaN/Inf is never
sampled from: the step is skipped (``policy/skipped_step``). Either way the step's metrics say
so, the health monitors see it and may roll back; when the next step is non-finite again (every
tick skipped, or skipped whole), training ends with
:class:`~tclightning.sampling.base.NonFiniteError` (one line, exit 3).

Agentic tasks (``tclightning.agentic``) change only the first stage: ``collect`` plays
multi-turn conversations and returns one row per interaction, each row pointing at its
trajectory; rewards and advantages are per trajectory and broadcast to its rows.

Manual optimisation: ``trainer.global_step`` counts optimizer ticks, while the logged ``step``
(TensorBoard, ``metrics.csv``) is the RL step, Lightning's batch counter.
"""

from __future__ import annotations

import contextlib
import copy
import math
import random
import time
from dataclasses import asdict
from typing import Any

import lightning as L
import numpy as np
import torch
from torchmetrics import MeanMetric

from tclightning.agentic import build_agentic_task, is_agentic
from tclightning.agentic.rollout import ConversationFormatter, Episodes, MultiTurnRollout, gap_by_turn
from tclightning.anchor.circuit import AnchorCircuit, AnchorJob, AnchorSchedule, cpu_snapshot, rank_share
from tclightning.anchor.config import AnchorConfig
from tclightning.callbacks.anchor_merge import AnchorDelivery
from tclightning.callbacks.steps import completed_steps, rl_step
from tclightning.grpo.advantages import group_advantages, zero_variance_groups
from tclightning.grpo.config import GRPOConfig
from tclightning.grpo.data import EvalBatches, PromptBatch, PromptStream, minibatch_chunks
from tclightning.grpo.logprobs import completion_logps
from tclightning.grpo.loss import gap_metrics, policy_loss
from tclightning.models.config import ModelConfig
from tclightning.models.loading import load_model
from tclightning.models.warmup import supervised_warmup
from tclightning.sampling.base import NonFiniteError, PromptFormatter, Rollouts, nonfinite_parameters, sequence_seed
from tclightning.sampling.config import SamplerConfig
from tclightning.sampling.factory import build_sampler
from tclightning.tasks import Example, TaskConfig, build_task

PROGRESS_KEYS = {"reward/mean": "reward", "response/length_mean": "len", "throughput/tokens_per_s": "tok/s"}


class GRPOModule(L.LightningModule):
    """GRPO on a causal LM with verifiable rewards.

    The HF model is ``self.policy``; a pipeline Strategy may install codecs at its cuts (the
    sampler always runs dense, under ``cuts.bypassed()``). With ``grpo.kl_coef > 0`` a frozen
    copy of the initial policy is kept as ``self.reference`` (and checkpointed).

    With ``anchor.merger: signed_ema`` the module is an ``AnchorSource`` for the ``AnchorMerge``
    callback: every C ticks it records the weights that sampled the step and the step's rollouts,
    and K ticks later computes the dense gradient ``M`` of the same loss at those weights on those
    rollouts (paired replay) with a hook-free clone of the policy. With one pipeline stage per
    process the strategy does this per rank: each rank snapshots and merges its own stage, and
    ``M`` comes from a pipelined pass over the dense boundary (docs/distributed.md).
    """

    def __init__(
        self,
        model: ModelConfig | None = None,
        task: TaskConfig | None = None,
        sampler: SamplerConfig | None = None,
        grpo: GRPOConfig | None = None,
        anchor: AnchorConfig | None = None,
        total_steps: int = 100,
        seed: int = 0,
        val_batch_size: int = 32,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.model_cfg = model or ModelConfig()
        self.task_cfg = task or TaskConfig()
        self.sampler_cfg = sampler or SamplerConfig()
        self.cfg = grpo or GRPOConfig()
        self.anchor_cfg = anchor or AnchorConfig()
        self.total_steps = total_steps
        self.seed = seed
        self.val_batch_size = val_batch_size
        self.save_hyperparameters(
            {
                "model": asdict(self.model_cfg),
                "task": asdict(self.task_cfg),
                "sampler": asdict(self.sampler_cfg),
                "grpo": asdict(self.cfg),
                "anchor": asdict(self.anchor_cfg),
                "total_steps": total_steps,
                "seed": seed,
            }
        )
        self.policy, self.tokenizer = load_model(self.model_cfg, seed=seed)
        agentic = is_agentic(self.task_cfg.name)
        self.task = build_agentic_task(self.task_cfg) if agentic else build_task(self.task_cfg)
        self.train_examples: list[Example] = list(self.task.train_examples())
        self.eval_examples: list[Example] = list(self.task.eval_examples())
        # Agentic prompts are conversations (the history so far), rendered by the same chat template.
        formatter = ConversationFormatter if agentic else PromptFormatter
        self.formatter = formatter(self.tokenizer, self.task.system_prompt, self.model_cfg.chat_template)
        self.sampler = build_sampler(self.sampler_cfg, self.formatter)
        self.multi_turn = MultiTurnRollout(self.task, self.sampler, self.tokenizer.pad_token_id) if agentic else None
        self.reference: torch.nn.Module | None = None
        self.val_accuracy = MeanMetric()
        self.val_length = MeanMetric()
        self.warmup_stats: dict[str, float] = {}
        self._resume_step = 0  # set from the checkpoint; the prompt stream starts there
        self._pending_cut_state: dict[str, Any] | None = None
        # The anchor circuit (signed_ema only): snapshots + paired rollouts, delivered K ticks late.
        self.circuit: AnchorCircuit | None = None
        if self.anchor_cfg.merger == "signed_ema":
            a = self.anchor_cfg
            schedule = AnchorSchedule(a.latency, a.cadence, a.warmup, a.warmup_ticks, a.warmup_shape, a.warmup_stages)
            self.circuit = AnchorCircuit(schedule)
        self._anchor_new: AnchorDelivery | None = None
        # The dense clone that computes M; in a plain dict so it is not a submodule (not
        # checkpointed: the job's snapshot is what defines its weights).
        self._anchor_workspace: dict[str, torch.nn.Module] = {}
        self._anchor_step: dict[str, float] = {}
        # The last RL step that was non-finite (skipped whole, or every tick skipped); cleared by
        # the next clean step (after a rollback, say). Two in a row end training.
        self._nonfinite_step: int | None = None
        self._all_ticks_skipped = False
        self._step_metric_names: tuple[str, ...] = ()
        self._val_nonfinite = False  # this validation met a non-finite policy: its other batches are skipped

    # ----------------------------------------------------------------------------- setup
    def setup(self, stage: str) -> None:
        self.policy.train()  # from_pretrained returns eval mode; Lightning expects train mode
        fresh = self.trainer is None or self.trainer.ckpt_path is None
        if stage == "fit" and fresh and self.model_cfg.warmup.steps > 0:
            # Agentic: one (history, expert action) pair per interaction of each expert conversation.
            prompts, solutions = (self.multi_turn.demonstrations(self.train_examples) if self.multi_turn is not None
                                  else ([e.prompt for e in self.train_examples], [e.solution for e in self.train_examples]))
            self.warmup_stats = supervised_warmup(
                self.policy,
                self.formatter,
                prompts,
                solutions,
                self.model_cfg.warmup,
                progress=self.trainer is not None and self.trainer.progress_bar_callback is not None,
                accuracy=self._warmup_accuracy,
            )
        if self.cfg.kl_coef > 0 and self.reference is None:
            # Taken before the strategy installs cuts, so the reference forward is dense. On
            # resume this copy is overwritten by the checkpoint's reference weights.
            self.reference = copy.deepcopy(self.policy).requires_grad_(False).eval()

    def _warmup_accuracy(self) -> float:
        """Greedy accuracy on the first ``check_examples`` training prompts (never the eval split)."""
        examples = self.train_examples[: self.model_cfg.warmup.check_examples]
        _, rewards, _, _ = self.collect(examples, seed=self.seed, greedy=True, group_size=1)
        return float(rewards.mean())

    def train_dataloader(self) -> PromptStream:
        return PromptStream(
            len(self.train_examples), self.cfg.prompts_per_step, self.total_steps, self.seed, self._resume_step
        )

    def val_dataloader(self) -> EvalBatches:
        return EvalBatches(len(self.eval_examples), self.val_batch_size)

    def configure_optimizers(self) -> Any:
        params = [p for p in self.policy.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(
            params, lr=self.cfg.lr, betas=tuple(self.cfg.betas), weight_decay=self.cfg.weight_decay
        )
        warmup = max(self.cfg.warmup_steps, 0)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda tick: min(1.0, (tick + 1) / (warmup + 1)))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    # ----------------------------------------------------------------------------- pieces
    @property
    def cuts(self) -> Any:
        """The pipeline Strategy's cuts (``None`` when training dense in one piece)."""
        return getattr(self.trainer.strategy, "cuts", None) if self._trainer else None

    def _dense(self) -> contextlib.AbstractContextManager:
        """Codecs (if any) bypassed, as on a real inference engine."""
        cuts = self.cuts
        return cuts.bypassed() if cuts is not None else contextlib.nullcontext()

    def sample(self, examples: list[Example], seed: int, *, greedy: bool = False, group_size: int | None = None) -> Rollouts:
        """Dense sampling: codecs (if any) are bypassed, as on a real inference engine."""
        with self._dense():
            return self.sampler.generate(
                self.policy,
                [e.prompt for e in examples],
                group_size=group_size or self.sampler_cfg.group_size,
                seed=seed,
                greedy=greedy,
                max_new_tokens=(self.sampler_cfg.eval_max_new_tokens if greedy else None),
            )

    def score(self, rollouts: Rollouts, examples: list[Example]) -> torch.Tensor:
        expanded = [e for e in examples for _ in range(rollouts.group_size)]
        return torch.tensor(self.task.rewards(rollouts.texts, expanded), dtype=torch.float32)

    def collect(self, examples: list[Example], seed: int, *, greedy: bool = False, group_size: int | None = None
                ) -> tuple[Rollouts, torch.Tensor, torch.Tensor, Episodes | None]:
        """``(rows, rewards [P*G], trajectory of each row, episodes)``. Single-turn: a row is a
        trajectory. Agentic: a row is one interaction and ``episodes`` carries the conversations."""
        G = group_size or self.sampler_cfg.group_size
        self.require_finite_weights()
        if self.multi_turn is None:
            rollouts = self.sample(examples, seed, greedy=greedy, group_size=G)
            return rollouts, self.score(rollouts, examples), torch.arange(rollouts.num_sequences), None
        with self._dense():
            episodes = self.multi_turn.play(self.policy, examples, group_size=G, seed=seed, greedy=greedy,
                                            max_new_tokens=self.sampler_cfg.eval_max_new_tokens if greedy else None)
        return episodes.rows, episodes.rewards, episodes.trajectory, episodes

    def require_finite_weights(self) -> None:
        """Raise :class:`NonFiniteError` if any policy weight is NaN/Inf (nothing is sampled from it)."""
        bad = nonfinite_parameters(self.policy)
        if bad:
            more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
            raise NonFiniteError(f"the policy's weights hold NaN or Inf ({', '.join(bad[:3])}{more})")

    # ----------------------------------------------------------------------------- the step
    def training_step(self, batch: PromptBatch, batch_idx: int) -> None:
        cfg, G = self.cfg, self.sampler_cfg.group_size
        logged_step = rl_step(self.trainer)
        if batch.step != logged_step:  # would misalign metrics.csv/TensorBoard after a resume
            raise RuntimeError(f"prompt stream at step {batch.step} but Lightning logs step {logged_step}")
        started = time.perf_counter()
        examples = [self.train_examples[i] for i in batch.indices]
        seed = sequence_seed(self.sampler_cfg.seed + self.seed, batch.step)
        share = getattr(self.trainer.strategy, "share_rollouts", None)
        if share is None:
            try:
                rollouts, rewards, owner, episodes = self.collect(examples, seed)
            except NonFiniteError as err:
                self._flag_nonfinite(batch.step, str(err))
                # NaN for what this step did not measure: Lightning would repeat the last step's values
                metrics = dict.fromkeys(self._step_metric_names, math.nan)
                metrics.update({"policy/skipped_step": 1.0, "policy/lr": self.optimizers().param_groups[0]["lr"]})
                self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)
                return
        else:  # pipeline across processes: rank 0 samples and scores, every stage receives the result
            # (no skip here: a NonFiniteError on rank 0 ends every rank through the dead-rank check)
            rollouts, rewards, owner, episodes = share(lambda: self.collect(examples, seed))
        rollouts = _to_device(rollouts, self.device)
        # Per trajectory (a trajectory is truncated if any of its rows is); broadcast to rows by `owner`.
        truncated = torch.zeros(len(rewards)).index_add_(0, owner, rollouts.truncated.cpu().float()) > 0
        shaped = rewards - cfg.overlong_penalty * truncated.float() if cfg.overlong == "penalty" else rewards
        advantages = group_advantages(shaped, G, cfg.scale_rewards, cfg.eps)[owner]
        sampled = time.perf_counter()

        cuts = self.cuts
        if cuts is not None:
            # One PRF key per RL step: the "old" log-probs and every tick of the update see the
            # same coordinates, so the PPO ratio compares weights, not index draws.
            cuts.set_step(batch.step)
            cuts.reset_stats()
        rows = torch.arange(rollouts.num_sequences)
        if cfg.drop_zero_variance_groups:
            keep_groups = ~zero_variance_groups(shaped, G)
            rows = rows[keep_groups.repeat_interleave(G)[owner]]
        metrics = self._rollout_metrics(rewards, rollouts)  # lengths as sampled, before any masking
        if episodes is not None:
            metrics.update(episodes.metrics())
        if cfg.overlong == "mask":
            rollouts.completion_mask = rollouts.completion_mask * (~rollouts.truncated).float().unsqueeze(-1)
        turns = None if episodes is None else episodes.turn
        metrics.update(self._update(rollouts, advantages.to(self.device), rows, batch.step, turns))
        trained = time.perf_counter()
        if self._all_ticks_skipped:
            self._flag_nonfinite(batch.step, "every optimizer tick had a NaN or Inf loss or gradient")
        else:
            self._nonfinite_step = None
        if cuts is not None:
            metrics.update(cuts.metrics())

        tokens = float(rollouts.completion_mask.sum())
        metrics.update(
            {
                "time/sample_s": sampled - started,
                "time/train_s": trained - sampled,
                "throughput/tokens_per_s": tokens / max(trained - started, 1e-9),
                "policy/lr": self.optimizers().param_groups[0]["lr"],
                "policy/skipped_step": 0.0,
            }
        )
        self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=rollouts.num_sequences)
        self._step_metric_names = tuple(metrics)
        self.log_dict(
            {short: metrics[key] for key, short in PROGRESS_KEYS.items()},
            prog_bar=True, logger=False, on_step=True, on_epoch=False, batch_size=rollouts.num_sequences,
        )

    def _flag_nonfinite(self, step: int, why: str) -> None:
        """Record a non-finite RL step (its metrics say so and the health monitors act on them);
        raise :class:`NonFiniteError` if the previous step was one too: nothing restored the policy."""
        if self._nonfinite_step is not None:
            raise NonFiniteError(
                f"training stopped at step {step}: {why}; it was non-finite at step {self._nonfinite_step} already and "
                "nothing restored a healthy policy (lower grpo.lr; callback_presets: [collapse-guard] rolls back to "
                "the last healthy checkpoint)"
            )
        self._nonfinite_step = step

    def _rollout_metrics(self, rewards: torch.Tensor, rollouts: Rollouts) -> dict[str, float]:
        lengths = rollouts.lengths.float().cpu()
        return {
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
            "response/length_mean": float(lengths.mean()),
            "response/length_max": float(lengths.max()),
            "response/truncated_frac": float(rollouts.truncated.float().mean()),
        }

    def _update(self, rollouts: Rollouts, advantages: torch.Tensor, rows: torch.Tensor, step: int,
                turns: torch.Tensor | None = None) -> dict[str, float]:
        """``epochs x minibatches`` optimizer ticks; returns losses, gap and health metrics (with
        ``turns``, the interaction index of each row, also the gap per interaction index)."""
        self._anchor_step = {"anchor/bytes": 0.0, "time/anchor_s": 0.0}
        pipelined = getattr(self.trainer.strategy, "pipelined_update", None)
        if pipelined is not None:  # one stage per process: the same ticks over the pipeline
            return pipelined(self, rollouts, advantages, rows, step)
        cfg = self.cfg
        optimizer, schedule = self.optimizers(), self.lr_schedulers()
        temperature = self.sampler_cfg.temperature
        single_tick = cfg.epochs * cfg.minibatches == 1
        stats: dict[str, list[float]] = {}
        skipped = 0
        self._all_ticks_skipped = False

        # The trainer's own log-probs at the weights that sampled: the PPO "old" policy and
        # the trainer side of the gap. With a single tick they come from the update's forward.
        if single_tick:
            old_logp, entropy = None, None
        else:
            with torch.no_grad():
                old_logp, entropy = completion_logps(self.policy, rollouts, temperature, with_entropy=True)
        ref_logp = None
        if self.reference is not None:
            with torch.no_grad():
                ref_logp, _ = completion_logps(self.reference, rollouts, temperature)

        ticks = minibatch_chunks(rows, cfg.epochs, cfg.minibatches, sequence_seed(self.seed, step, salt=1))
        for tick, chunk in enumerate(ticks):
            if self.circuit is not None:
                self._anchor_tick(rollouts, advantages, rows, first_tick=tick == 0)
            part = rollouts.select(chunk.to(rollouts.completion_ids.device))
            width = part.completion_ids.shape[1]
            logp, tick_entropy = completion_logps(self.policy, part, temperature, with_entropy=single_tick)
            if single_tick:
                old_logp_part = logp.detach()
                old_logp, entropy = old_logp_part, tick_entropy
            else:
                old_logp_part = old_logp[chunk, :width]
            out = policy_loss(
                logp,
                old_logp_part,
                advantages[chunk],
                part.completion_mask,
                clip_low=cfg.clip_low,
                clip_high=cfg.clip_high,
                aggregation=cfg.loss_aggregation,
                norm_length=self.sampler_cfg.max_new_tokens,
                ref_logp=None if ref_logp is None else ref_logp[chunk, :width],
                kl_coef=cfg.kl_coef,
                logp_sampler=part.logp_sampler,
                tis_cap=cfg.tis_cap,
                mask_ratio=(cfg.mask_ratio_low, cfg.mask_ratio_high) if cfg.mask_ratio_high > 0 else None,
            )
            optimizer.zero_grad(set_to_none=True)
            self.manual_backward(out.loss)
            max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
            grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), max_norm)
            # A NaN/Inf loss or gradient must not reach the weights or Adam's moments: no step
            # (the LR schedule waits too). The values are still logged, so the detector sees them.
            if bool(torch.isfinite(out.loss.detach()) & torch.isfinite(grad_norm)):
                optimizer.step()
                schedule.step()
            else:
                optimizer.zero_grad(set_to_none=True)
                skipped += 1
            for key, value in (
                ("loss/policy", out.policy_loss),
                ("loss/kl", out.kl),
                ("policy/clip_frac", out.clip_frac),
                ("policy/grad_norm", grad_norm),
                ("policy/tis_clipped_frac", out.tis_frac),
                ("policy/masked_frac", out.masked_frac),
            ):
                stats.setdefault(key, []).append(float(value))

        metrics = {key: sum(values) / len(values) for key, values in stats.items()}
        if not stats:  # every group dropped: nothing to learn from this step
            metrics.update({"loss/policy": 0.0, "loss/kl": 0.0, "policy/clip_frac": 0.0, "policy/grad_norm": 0.0})
        mask = rollouts.completion_mask
        if old_logp is not None:
            sel_rows = rows if single_tick else slice(None)
            sel_mask = mask[sel_rows, : old_logp.shape[1]]
            metrics.update(gap_metrics(old_logp, rollouts.logp_sampler[sel_rows, : old_logp.shape[1]], sel_mask))
            if turns is not None:
                metrics.update(gap_by_turn(old_logp, rollouts.logp_sampler[sel_rows, : old_logp.shape[1]], sel_mask,
                                           turns[sel_rows]))
            if entropy is not None:
                metrics["policy/entropy"] = float((entropy * sel_mask).sum() / sel_mask.sum().clamp(min=1))
        metrics["policy/kept_frac"] = len(rows) / rollouts.num_sequences
        metrics["policy/skipped_ticks"] = float(skipped)
        self._all_ticks_skipped = skipped > 0 and skipped == len(stats["loss/policy"])
        return metrics

    # ----------------------------------------------------------------------------- anchor circuit
    def _anchor_tick(self, rollouts: Rollouts, advantages: torch.Tensor, rows: torch.Tensor, first_tick: bool) -> None:
        """Record this step's job (on its first tick: only then do the weights equal the ones
        that sampled) and compute ``M`` for every job due now."""
        assert self.circuit is not None
        tick = self.trainer.global_step
        if first_tick:
            payload = {"rollouts": _to_device(copy.copy(rollouts), torch.device("cpu")),
                       "advantages": advantages.cpu(), "rows": rows.cpu()}
            self.circuit.maybe_record(tick, lambda: cpu_snapshot(self.anchor_parameters()), payload)
        for job in self.circuit.due(tick):
            started = time.perf_counter()
            self._anchor_new = AnchorDelivery(self._anchor_gradient(job), snapshot_tick=job.tick)
            self._anchor_step["time/anchor_s"] += time.perf_counter() - started

    def _anchor_gradient(self, job: AnchorJob) -> list[torch.Tensor]:
        """Dense ``M``: the GRPO loss's gradient at the job's weights on the job's rollouts."""
        distributed = getattr(self.trainer.strategy, "anchor_gradient", None)
        if distributed is not None:  # one stage per process: this rank's M, over the dense pipeline
            grads, sent = distributed(self, job)
            self._anchor_step["anchor/bytes"] += sent
            return grads
        if "clone" not in self._anchor_workspace:
            from tclightning.pipeline.cuts import hook_free_copy

            self._anchor_workspace["clone"] = hook_free_copy(self.policy).train()
        clone = self._anchor_workspace["clone"]
        params = [p for p in clone.parameters() if p.requires_grad]
        with torch.no_grad():
            for param, weight in zip(params, job.snapshot, strict=True):
                param.copy_(weight)
        rows = job.payload["rows"]
        part = _to_device(job.payload["rollouts"].select(rows), self.device)
        clone.zero_grad(set_to_none=True)
        logp, _ = completion_logps(clone, part, self.sampler_cfg.temperature)
        # On-policy at the snapshot (these weights sampled these rollouts): ratio 1, no clipping.
        out = policy_loss(logp, logp.detach(), job.payload["advantages"][rows].to(self.device), part.completion_mask,
                          aggregation=self.cfg.loss_aggregation, norm_length=self.sampler_cfg.max_new_tokens)
        out.loss.backward()
        cuts = self.cuts
        if cuts is not None:  # dense boundary traffic, forward and backward, across every cut
            element = next(clone.parameters()).element_size()
            self._anchor_step["anchor/bytes"] += 2 * float(part.completion_mask.sum() + part.prompt_mask.sum()) * (
                cuts.dim * element * len(cuts.specs))
        return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in params]

    def anchor_parameters(self) -> list[torch.nn.Parameter]:
        """``AnchorSource``: the parameters ``G_comp`` and ``M`` cover (fixed order); with one
        pipeline stage per process, this rank's stage's."""
        owned = getattr(self.trainer.strategy, "owned_parameters", None) if self._trainer else None
        if owned is not None:
            return owned()
        return [p for p in self.policy.parameters() if p.requires_grad]

    def pop_anchor_gradient(self) -> AnchorDelivery | None:
        """``AnchorSource``: the ``M`` delivered at this tick, once."""
        delivered, self._anchor_new = self._anchor_new, None
        return delivered

    def anchor_metrics(self) -> dict[str, float]:
        """Logged by ``AnchorMerge`` once per RL step."""
        if self.circuit is None:
            return {}
        return {**self.circuit.metrics(self.trainer.global_step), **self._anchor_step}

    # ----------------------------------------------------------------------------- validation
    def evaluate_batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy completions for held-out examples: (rewards, lengths)."""
        examples = [self.eval_examples[i] for i in indices]
        rollouts, rewards, owner, _ = self.collect(examples, seed=self.seed, greedy=True, group_size=1)
        # Generated tokens per trajectory (agentic: summed over its interactions).
        return rewards, torch.zeros(len(rewards)).index_add_(0, owner, rollouts.lengths.float().cpu())

    def validation_step(self, batch: list[int], batch_idx: int) -> None:
        if self._val_nonfinite:
            return
        try:
            rewards, lengths = self.evaluate_batch(batch)
        except NonFiniteError as err:
            # As in training: flagged (NaN val metrics, for the health monitors) unless the last
            # step was non-finite already and nothing restored the policy since (then: stop).
            self._flag_nonfinite(rl_step(self.trainer), f"in validation, {err}")
            self._val_nonfinite = True
            return
        self.val_accuracy.update(rewards)
        self.val_length.update(lengths)

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:
            self.val_accuracy.reset()
            self.val_length.reset()
            return
        if self._val_nonfinite:
            accuracy, length = torch.tensor(math.nan), torch.tensor(math.nan)
        else:
            accuracy, length = self.val_accuracy.compute(), self.val_length.compute()
        self._val_nonfinite = False
        self.log("val/accuracy", accuracy, prog_bar=True)
        self.log("val/length_mean", length)
        self.val_accuracy.reset()
        self.val_length.reset()

    def on_train_epoch_end(self) -> None:
        # Training ends (its last step, or a health monitor's stop) on a non-finite step that
        # nothing undid: end with the one-line error (exit 3), before the final checkpoint saves it.
        if self._nonfinite_step is not None:
            raise NonFiniteError(
                f"training stopped at step {self._nonfinite_step}: the policy was non-finite there and nothing "
                "restored a healthy one (lower grpo.lr; callback_presets: [collapse-guard] rolls back to the last "
                "healthy checkpoint)"
            )

    # ----------------------------------------------------------------------------- checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["tclightning"] = {
            "rl_step": completed_steps(self.trainer),
            "rng": {
                "python": random.getstate(),
                "numpy": np.random.get_state(),
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            },
            # Sampling is seeded per step from this, so it is the whole sampler state.
            "sampler": {"seed": self.sampler_cfg.seed + self.seed, "backend": self.sampler_cfg.backend},
            "warmup": self.warmup_stats,
            "cuts": self.cuts.state_dict() if self.cuts is not None else None,
            "anchor": None if self.circuit is None else self._anchor_state(),
        }

    def _anchor_state(self) -> dict[str, Any] | None:
        """The circuit's pending snapshots + replay and an undelivered ``M``; across processes
        every rank's (its own stage's snapshots), gathered (collective)."""
        assert self.circuit is not None
        state = {
            "circuit": self.circuit.state_dict(),
            "new": None if self._anchor_new is None else (list(self._anchor_new.gradient), self._anchor_new.snapshot_tick),
        }
        gather = getattr(self.trainer.strategy, "gather_per_rank", None)
        return state if gather is None else gather(state, "gathering the anchor circuits")

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("tclightning", {})
        rng = state.get("rng")
        if rng:
            random.setstate(rng["python"])
            np.random.set_state(rng["numpy"])
            torch.set_rng_state(rng["torch"])
            if rng["cuda"] and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])
        self.warmup_stats = state.get("warmup", {})
        self._resume_step = int(state.get("rl_step", 0))
        # A checkpoint saved at a run's last step records that the prompt stream ended there;
        # restored as is, Lightning ends the resumed run before its first step. Where the stream
        # ends is this run's `trainer.steps` (the PromptStream built from it tells the fetcher).
        progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.batch_progress")
        if progress is not None:
            progress["is_last_batch"] = False
        # Cuts are installed by the strategy after checkpoint restore; applied in on_train_start.
        self._pending_cut_state = state.get("cuts")
        anchor = state.get("anchor")
        if anchor and self.circuit is not None:
            anchor = rank_share(anchor, self.trainer.global_rank, self.trainer.world_size)
            self.circuit.load_state_dict(anchor["circuit"])
            self._anchor_new = None if anchor["new"] is None else AnchorDelivery(*anchor["new"])

    def on_train_start(self) -> None:
        if self._pending_cut_state is not None and self.cuts is not None:
            self.cuts.load_state_dict(self._pending_cut_state)
        self._pending_cut_state = None
        if self._resume_step == 0 and self.trainer.limit_val_batches:
            self._log_start_accuracy()

    def _log_start_accuracy(self) -> None:
        """``val/accuracy`` before the first update, at step 0 (after any warm-up)."""
        try:
            results = [self.evaluate_batch(b) for b in EvalBatches(len(self.eval_examples), self.val_batch_size)]
        except NonFiniteError as err:
            raise NonFiniteError(f"training stopped before its first step: {err}") from None
        rewards = torch.cat([r for r, _ in results])
        lengths = torch.cat([n for _, n in results])
        metrics = {"val/accuracy": float(rewards.mean()), "val/length_mean": float(lengths.mean())}
        for logger in self.loggers:
            logger.log_metrics(metrics, step=0)


def _to_device(rollouts: Rollouts, device: torch.device) -> Rollouts:
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "logp_sampler", "truncated"):
        setattr(rollouts, name, getattr(rollouts, name).to(device))
    return rollouts
