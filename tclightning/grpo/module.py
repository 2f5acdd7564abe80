"""The GRPO LightningModule. One ``training_step`` is one RL step, and it reads top to bottom:

sample (dense) -> reward -> advantages -> the update (:func:`tclightning.grpo.update.grpo_update`:
``epochs x minibatches`` optimizer ticks of the clipped surrogate through the backend, with the
anchor's merge before each step) -> the step's metrics.

Where the policy runs is the :class:`~tclightning.backend.Backend`: the strategy's when it is a
:class:`~tclightning.backend.BackendProvider` (``trainer.strategy: pipeline``, one process or one
stage per process), else the whole policy in this process. The module owns the PRF step key (the
RL step, set once per step through the backend) and the codec state saved in checkpoints.

Non-finite guard: a tick whose loss or gradient norm is NaN/Inf makes no optimizer step
(``policy/skipped_ticks``); a policy whose weights or sampling logits are NaN/Inf is never
sampled from: the step is skipped (``policy/skipped_step``; one process only: across processes a
non-finite sampler ends every rank). Either way the step's metrics say so, the health monitors see
it and may roll back; when the next step is non-finite again (every tick skipped, or skipped
whole), training ends with :class:`~tclightning.sampling.base.NonFiniteError` (one line, exit 3).

Agentic tasks (``tclightning.agentic``) change only the first stage: ``collect`` plays
multi-turn conversations and returns one row per interaction, each row pointing at its
trajectory; rewards and advantages are per trajectory and broadcast to its rows.

Manual optimisation: ``trainer.global_step`` counts optimizer ticks, while the logged ``step``
(TensorBoard, ``metrics.csv``) is the RL step, Lightning's batch counter.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import inspect
import math
import os
import random
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any, TypeVar

import lightning as L
import numpy as np
import torch
from torchmetrics import MeanMetric

from tclightning.agentic import build_agentic_task, is_agentic
from tclightning.agentic.rollout import ConversationFormatter, Episodes, MultiTurnRollout
from tclightning.anchor.anchor import build_anchor
from tclightning.anchor.circuit import rank_share
from tclightning.anchor.config import AnchorConfig
from tclightning.backend import Backend, BackendProvider, BackendRequest
from tclightning.callbacks.checkpointing import (
    checkpoint_allow_list,
    legacy_hparams,
    load_checkpoint,
    require_lightning_checkpoint,
)
from tclightning.callbacks.steps import completed_steps, rl_step
from tclightning.errors import TclightningError
from tclightning.files import open_regular, regular_file
from tclightning.grpo.advantages import group_advantages, reward_sem, zero_variance_groups
from tclightning.grpo.config import GRPOConfig
from tclightning.grpo.data import EvalBatches, PromptBatch, PromptStream
from tclightning.models.logprobs import completion_logps
from tclightning.grpo.update import UpdateResult, grpo_update
from tclightning.models.config import DTYPES, ModelConfig
from tclightning.models.loading import check_checkpoint_model, check_state_dict_form, check_weights, load_model
from tclightning.models.lora import apply_lora, base_fingerprint, frozen_parameter_names
from tclightning.models.warmup import cached_supervised_warmup
from tclightning.pipeline.backends import LocalBackend
from tclightning.pipeline.boundary import total_bytes
from tclightning.sampling.base import NonFiniteError, PromptFormatter, Rollouts, nonfinite_parameters, sequence_seed
from tclightning.sampling.config import SamplerConfig
from tclightning.sampling.factory import build_sampler
from tclightning.settings import MAX_STEPS, field_problems, positive, without_keys
from tclightning.settings import seed as seed_rule
from tclightning.tasks import Example, TaskConfig, build_task
from tclightning.tensor_files import first_reads

PROGRESS_KEYS = {"reward/mean": "reward", "response/length_mean": "len", "throughput/tokens_per_s": "tok/s"}

BASE_KEY = "lora_base"
"""``checkpoint["tclightning"][BASE_KEY]``: in a ``model.lora`` checkpoint, which holds the adapters
without the frozen base, the base's :func:`~tclightning.models.lora.base_fingerprint`
(``{"sha256": ..., "parameters": ...}``); a load rebuilds the base from the recipe and refuses one
whose fingerprint differs."""

# The file GRPOModule.load_from_checkpoint is reading, for on_load_checkpoint's one-line refusals
# (Lightning hands the hook the loaded dict, not its path).
_LOADING: contextvars.ContextVar[str] = contextvars.ContextVar("tclightning_loading", default="checkpoint")

C = TypeVar("C")


_SECTION_CONFIGS: dict[str, type] = {"model": ModelConfig, "task": TaskConfig, "sampler": SamplerConfig,
                                     "grpo": GRPOConfig, "anchor": AnchorConfig}
"""The config class of each section the module is built from (its module owns the section's
``upgrade``, ``RETIRED_KEYS`` and ``MOVED_KEYS``)."""


def _current(value: Any, section: str) -> Any:
    """A section as a checkpoint stored it in today's keys: an earlier version's moved keys carried
    over (its config module's ``upgrade``), the keys it saved that no option reads now left out
    (``RETIRED_KEYS``, ``MOVED_KEYS``); an instance or None passes unchanged."""
    if not isinstance(value, Mapping):
        return value
    module = sys.modules[_SECTION_CONFIGS[section].__module__]
    upgrade = getattr(module, "upgrade", None)
    section = upgrade(value) if upgrade is not None else dict(value)
    return without_keys(section, (*getattr(module, "RETIRED_KEYS", ()), *getattr(module, "MOVED_KEYS", {})))


def as_config(cls: type[C], value: C | Mapping[str, Any] | None, section: str = "") -> C:
    """``value`` as the config dataclass ``cls``: an instance is returned as is, ``None`` gives the
    defaults, and a mapping (the form checkpoints store hyper-parameters in) is validated against
    ``cls`` key by key: an unknown key, a wrong type or a value outside its range (named
    ``<section>.<key>``, as a recipe's would be) raises ``TclightningError``, one line."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise TclightningError(f"{cls.__name__}: expected a {cls.__name__} or a dict, got {type(value).__name__}")
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        config: C = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), dict(value)))  # type: ignore[assignment]
    except OmegaConfBaseException as err:
        raise TclightningError(f"{cls.__name__}: {' '.join(str(err).split())[:200]}") from None
    for problem in field_problems(config, section or cls.__name__):
        raise TclightningError(f"{problem.keys[0]}: {problem.message}")
    return config


@contextlib.contextmanager
def _global_rngs_untouched() -> Iterator[None]:
    """Python's, numpy's and torch's global RNG states as they were before the block."""
    python, numpy_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy_state)


def _rescale_learning_rate(checkpoint: dict[str, Any], lr: float) -> None:
    """A resume whose recipe sets another ``grpo.lr`` trains at it: the saved optimizer and
    schedule (restored after this hook) are scaled by new / old, so the schedule's position and
    any scaling a rollback applied are kept, and the new rate is what the run logs and uses."""
    old = ((checkpoint.get("hyper_parameters") or {}).get("grpo") or {}).get("lr")
    if not isinstance(old, (int, float)) or isinstance(old, bool) or old <= 0 or old == lr:
        return
    ratio = lr / old
    for optimizer in checkpoint.get("optimizer_states") or []:
        for group in optimizer.get("param_groups", []):
            for key in ("lr", "initial_lr"):
                if isinstance(group.get(key), (int, float)):
                    group[key] *= ratio
    for schedule in checkpoint.get("lr_schedulers") or []:
        for key in ("base_lrs", "_last_lr"):
            if isinstance(schedule.get(key), list):
                schedule[key] = [value * ratio for value in schedule[key]]


def _adopt_optimizer_settings(checkpoint: dict[str, Any], settings: Mapping[str, Any]) -> None:
    """A resume trains with AdamW as this run's recipe makes it: every setting of the saved parameter
    groups but their rates (``maximize``, ``amsgrad``, ``capturable``, ``eps``, ``weight_decay``,
    ``betas``...) is the one :meth:`GRPOModule.configure_optimizers` gives (a checkpoint's
    ``maximize`` trained by gradient ascent without a word; its ``amsgrad`` or ``capturable`` ended
    the first step in a traceback)."""
    made = torch.optim.AdamW([torch.zeros(1)], **settings).defaults
    for optimizer in checkpoint.get("optimizer_states") or []:
        for group in optimizer.get("param_groups", []) if isinstance(optimizer, Mapping) else []:
            if isinstance(group, dict):
                group.update({key: value for key, value in made.items() if key != "lr"})


def _check_training_state(checkpoint: Mapping[str, Any], params: list[torch.Tensor]) -> None:
    """That a checkpoint to resume holds the one optimizer and one schedule
    :meth:`GRPOModule.configure_optimizers` makes, for these trainable ``params``, else
    ``ValueError``: Lightning restores by zipping its optimizers with the saved states, so an empty
    list would restart AdamW's moments and the warm-up schedule without a word, and a moment of
    another shape or a learning rate that is not a number would fail only at the first step."""
    optimizers, schedules = checkpoint.get("optimizer_states"), checkpoint.get("lr_schedulers")
    if not (isinstance(optimizers, list) and len(optimizers) == 1 and isinstance(optimizers[0], Mapping)
            and {"state", "param_groups"} <= set(optimizers[0])):
        raise ValueError("optimizer_states: expected the state of the one AdamW optimizer, got "
                         f"{len(optimizers) if isinstance(optimizers, list) else type(optimizers).__name__}")
    if not (isinstance(schedules, list) and len(schedules) == 1 and isinstance(schedules[0], Mapping)):
        raise ValueError("lr_schedulers: expected the state of the one learning-rate schedule, got "
                         f"{len(schedules) if isinstance(schedules, list) else type(schedules).__name__}")
    groups, state = optimizers[0]["param_groups"], optimizers[0]["state"]

    def number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    if not (isinstance(groups, list) and all(isinstance(g, Mapping) for g in groups)
            and sum(len(g.get("params") or ()) for g in groups) == len(params)):
        raise ValueError(f"optimizer_states: its parameter groups are not for the {len(params)} trainable tensors")
    for group in groups:
        betas = group.get("betas")
        if not (all(number(group.get(k)) for k in ("lr", "eps", "weight_decay")) and isinstance(betas, (list, tuple))
                and len(betas) == 2 and all(number(b) and 0 <= b < 1 for b in betas)):
            raise ValueError("optimizer_states: a parameter group's lr, eps, weight_decay or betas are not numbers")
    _check_learning_rates(checkpoint, groups, schedules[0])
    ticks, at = checkpoint.get("global_step"), schedules[0].get("last_epoch")
    if not (isinstance(at, int) and not isinstance(at, bool) and at >= 0
            and (not isinstance(ticks, int) or at == ticks)):
        # the schedule steps with each optimizer step: another position is another rate (-100: a negative one)
        raise ValueError(f"lr_schedulers: the schedule is at tick {at!r}, not at the checkpoint's {ticks!r} "
                         "optimizer steps")
    if not isinstance(state, Mapping):
        raise ValueError("optimizer_states: its state is not a mapping of parameter to moments")
    for index, moments in state.items():
        if not (isinstance(index, int) and 0 <= index < len(params) and isinstance(moments, Mapping)):
            raise ValueError(f"optimizer_states: state of parameter {index!r}, which this model does not have")
        step = moments.get("step")
        step = step.item() if isinstance(step, torch.Tensor) and step.numel() == 1 else step
        if not (isinstance(step, (int, float)) and not isinstance(step, bool) and math.isfinite(step)
                and step >= 0 and step == int(step)):
            raise ValueError(f"optimizer_states: the step count of parameter {index} is {step!r}, not a whole "
                             "number of updates")
        for name in ("exp_avg", "exp_avg_sq"):
            moment = moments.get(name)
            if not (isinstance(moment, torch.Tensor) and moment.shape == params[index].shape
                    and bool(torch.isfinite(moment).all())):
                raise ValueError(f"optimizer_states: {name} of parameter {index} is not a finite tensor of its "
                                 f"shape {tuple(params[index].shape)}")


def _check_learning_rates(checkpoint: Mapping[str, Any], groups: list[Mapping[str, Any]],
                          schedule: Mapping[str, Any]) -> None:
    """That the saved learning rates are the ones the run's schedule gives: each group's base
    (``initial_lr``, the schedule's ``base_lrs``) is the recipe's ``grpo.lr`` times the factor a
    rollback applied (saved by the health actions, 1 without them), and its rate, current or
    last reported, lies between 0 and that base (the warm-up only ever lowers it). A rate that is
    finite but arbitrary (1e308) would train on, or be logged, without a word; ``ValueError`` instead."""
    recorded = ((checkpoint.get("hyper_parameters") or {}).get("grpo") or {}).get("lr")
    factors = [state["lr_factor"] for state in (checkpoint.get("callbacks") or {}).values()
               if isinstance(state, Mapping) and "lr_factor" in state]
    factor = factors[0] if len(factors) == 1 else 1.0
    bases, last = schedule.get("base_lrs"), schedule.get("_last_lr")
    if not (isinstance(bases, list) and isinstance(last, list) and len(bases) == len(last) == len(groups)):
        raise ValueError(f"lr_schedulers: expected a base and a last rate for each of the {len(groups)} parameter groups")

    def near(a: Any, b: float) -> bool:
        return isinstance(a, (int, float)) and not isinstance(a, bool) and math.isclose(a, b, rel_tol=1e-6)

    def within(rate: Any, base: float) -> bool:
        return (isinstance(rate, (int, float)) and not isinstance(rate, bool) and math.isfinite(rate)
                and 0 <= rate <= base * (1 + 1e-6))

    for group, base, shown in zip(groups, bases, last):
        initial = group.get("initial_lr")
        if not within(initial, math.inf) or initial == 0:
            raise ValueError(f"optimizer_states: a parameter group's base learning rate is {initial!r}, not a "
                             "positive number")
        if isinstance(recorded, (int, float)) and isinstance(factor, (int, float)) and recorded > 0:
            expected = recorded * factor
            if not (near(initial, expected) and near(base, expected)):
                raise ValueError(f"optimizer_states: a parameter group's base learning rate is {initial!r} (schedule: "
                                 f"{base!r}), not the recorded grpo.lr {recorded:g} x {factor:g}")
        if not (near(base, initial) and within(group["lr"], initial) and within(shown, initial)):
            raise ValueError(f"optimizer_states: a parameter group's learning rate {group['lr']!r} (last reported "
                             f"{shown!r}) is not between 0 and its base rate {initial!r}")


class GRPOModule(L.LightningModule):
    """GRPO on a causal LM with verifiable rewards.

    The HF model is ``self.policy``; the sampler always runs it dense (``backend.dense()``), or
    with ``sampler.dtype`` an exact copy of it in that dtype (:meth:`sampling_model`). With
    ``grpo.kl_coef > 0`` a frozen copy of the initial policy is kept as ``self.reference`` (and
    checkpointed; with ``model.lora`` it is the frozen base, which a checkpoint leaves out and a
    load rebuilds: :meth:`on_save_checkpoint`).

    With ``anchor.merger: signed_ema``, ``self.anchor`` (:class:`~tclightning.anchor.anchor.Anchor`)
    is the anchor circuit and its merge state: every C ticks it records the weights that sampled
    the step and the step's rollouts, K ticks later the update computes the dense gradient ``M``
    of the same loss at those weights on those rollouts (paired replay) through the backend's
    dense forward/backward, and merges it before each optimizer step. With one pipeline stage per
    process each rank snapshots, computes ``M`` for and merges its own stage (docs/distributed.md).
    """

    def __init__(
        self,
        model: ModelConfig | Mapping[str, Any] | None = None,
        task: TaskConfig | Mapping[str, Any] | None = None,
        sampler: SamplerConfig | Mapping[str, Any] | None = None,
        grpo: GRPOConfig | Mapping[str, Any] | None = None,
        anchor: AnchorConfig | Mapping[str, Any] | None = None,
        total_steps: int = 100,
        seed: int = 0,
        val_batch_size: int = 32,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        for name, value, rule in (("total_steps", total_steps, positive(MAX_STEPS)), ("seed", seed, seed_rule()),
                                  ("val_batch_size", val_batch_size, positive())):
            problem = rule(value)  # a checkpoint passes these back as it stored them
            if problem is not None:
                raise TclightningError(f"{name}: {problem}")
        # Dicts too: a checkpoint stores the configs as dicts (``load_from_checkpoint`` passes them).
        # a checkpoint's dicts may hold keys an earlier version saved (each section's RETIRED_KEYS)
        self.model_cfg = as_config(ModelConfig, _current(model, "model"), "model")
        self.task_cfg = as_config(TaskConfig, _current(task, "task"), "task")
        self.sampler_cfg = as_config(SamplerConfig, _current(sampler, "sampler"), "sampler")
        self.cfg = as_config(GRPOConfig, _current(grpo, "grpo"), "grpo")
        self.anchor_cfg = as_config(AnchorConfig, _current(anchor, "anchor"), "anchor")
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
        # The task first: its data is refused (missing, malformed) before any weights are loaded.
        agentic = is_agentic(self.task_cfg.name)
        self.task = build_agentic_task(self.task_cfg) if agentic else build_task(self.task_cfg)
        self.train_examples: list[Example] = list(self.task.train_examples())
        self.eval_examples: list[Example] = list(self.task.eval_examples())
        self.policy, self.tokenizer = load_model(self.model_cfg, seed=seed)
        # Agentic prompts are conversations (the history so far), rendered by the same chat template.
        formatter = ConversationFormatter if agentic else PromptFormatter
        self.formatter = formatter(self.tokenizer, self.task.system_prompt, self.model_cfg.chat_template)
        if not agentic:
            self.train_examples, self.eval_examples = self._fitting(self.train_examples, self.eval_examples)
        self.sampler = build_sampler(self.sampler_cfg, self.formatter)
        self.multi_turn = MultiTurnRollout(self.task, self.sampler, self.tokenizer.pad_token_id) if agentic else None
        self.reference: torch.nn.Module | None = None
        self.val_accuracy = MeanMetric()
        self.val_length = MeanMetric()
        self.warmup_stats: dict[str, float] = {}
        self._base_ready = False  # prepare_base ran: self.policy is the base (after any warm-up)
        self._base_record: dict[str, Any] | None = None  # model.lora: the base's fingerprint, taken once
        self._resume_step = 0  # set from the checkpoint; the prompt stream starts there
        # The checkpoint's codec state, from on_load_checkpoint to on_train_start: Lightning restores
        # the checkpoint before the strategy installs the cuts, so no backend can take it earlier.
        self._pending_cut_state: dict[str, Any] | None = None
        # The anchor (signed_ema only): circuit, replay, delivered M and merge state in one object.
        self.anchor = build_anchor(self.anchor_cfg)
        if self.anchor is not None:  # a checkpoint's replay holding other token ids is refused, not embedded
            self.anchor.vocab_size = self.policy.get_input_embeddings().num_embeddings
        self._backend: Backend | None = None  # taken from the strategy once it is set up
        # The last RL step that was non-finite (skipped whole, or every tick skipped); cleared by
        # the next clean step (after a rollback, say). Two in a row end training.
        self._nonfinite_step: int | None = None
        self._step_metric_names: tuple[str, ...] = ()
        self._val_nonfinite = False  # this validation met a non-finite policy: its other batches are skipped

    def _fitting(self, train: list[Example], evals: list[Example]) -> tuple[list[Example], list[Example]]:
        """The prompts that leave room for ``sampler.max_new_tokens`` within the model's positions
        (``max_position_embeddings``), as verl's ``filter_overlong_prompts``: a longer one would
        sample past what the model was built for, and one of 100k tokens would not finish. Says how
        many it left out; none left to train on is one line."""
        positions = getattr(self.policy.config, "max_position_embeddings", None)
        if not positions:
            return train, evals
        room = positions - self.sampler_cfg.max_new_tokens
        where = (f"longer than the model's {positions} positions less sampler.max_new_tokens="
                 f"{self.sampler_cfg.max_new_tokens}")
        # A system prompt of more characters than the room: what every prompt holds (it and the chat
        # template) is measured first; past the room no prompt fits, and measuring thousands of
        # them would only take long to say so.
        fixed = self.formatter.system_prompt or ""
        if len(fixed) > room and self.formatter.lengths([""])[0] > room:
            raise TclightningError(f"task: every training prompt is {where}: the system prompt and chat template "
                                   "alone are; lower sampler.max_new_tokens or shorten task.system_prompt")
        lengths = self.formatter.lengths([e.prompt for e in (*train, *evals)])  # one measuring process for both
        kept = [[e for e, n in zip(train, lengths) if n <= room],
                [e for e, n in zip(evals, lengths[len(train):]) if n <= room]]
        dropped = len(train) + len(evals) - len(kept[0]) - len(kept[1])
        if not kept[0]:
            raise TclightningError(f"task: every training prompt is {where}; lower sampler.max_new_tokens or use "
                                   "shorter prompts")
        if evals and not kept[1]:  # validation would have nothing to score
            raise TclightningError(f"task: every held-out prompt is {where}; lower sampler.max_new_tokens or use "
                                   "shorter prompts")
        if dropped:
            print(f"note: {dropped} of {len(train) + len(evals)} prompts are {where}: left out", file=sys.stderr,
                  flush=True)
        return kept[0], kept[1]

    # ----------------------------------------------------------------------------- setup
    def setup(self, stage: str) -> None:
        self.policy.train()  # from_pretrained returns eval mode; Lightning expects train mode
        fresh = self.trainer is None or self.trainer.ckpt_path is None
        # A model.lora checkpoint holds the adapters alone: a resume rebuilds the frozen base they
        # were trained on (checked in on_load_checkpoint). Note that Lightning sets trainer.ckpt_path
        # only after setup (Trainer.fit's resume_start), so `fresh` holds on a resume too.
        if (stage == "fit" and fresh) or self.model_cfg.lora_settings.r > 0:
            self.prepare_base(progress=self.trainer is not None and self.trainer.progress_bar_callback is not None)
        if self.cfg.kl_coef > 0 and self.reference is None:
            # Taken before the strategy installs cuts, so the reference forward is dense. On
            # resume a full checkpoint overwrites this copy; with model.lora it is the base, rebuilt.
            self.reference = copy.deepcopy(self.policy).requires_grad_(False).eval()
        # model.lora: after the warm-up (which trains the whole model) and the reference (the base
        # policy); before the strategy builds the optimizer from the trainable (adapter) parameters
        apply_lora(self.policy, self.model_cfg.lora_settings, seed=self.seed)

    def prepare_base(self, progress: bool = False) -> None:
        """Make ``self.policy`` the base the run trains on: the loaded model, after the supervised
        warm-up when the recipe has one (``model.warmup``: its cached result, or trained again,
        deterministically), whose fingerprint :meth:`base_record` takes when first asked.
        Runs once (later calls do nothing), before :func:`~tclightning.models.lora.apply_lora`: by
        ``setup`` for a fresh run and for a LoRA resume, by a LoRA load before the adapters load."""
        if self._base_ready:
            return
        if self.model_cfg.warmup.steps > 0:
            # Agentic: one (history, expert action) pair per interaction of each expert conversation.
            prompts, solutions = (self.multi_turn.demonstrations(self.train_examples) if self.multi_turn is not None
                                  else ([e.prompt for e in self.train_examples], [e.solution for e in self.train_examples]))
            self.warmup_stats = cached_supervised_warmup(
                self.policy,
                self.formatter,
                prompts,
                solutions,
                self.model_cfg.warmup,
                # What the accuracy check depends on besides the weights (the cache key's context).
                {"task": asdict(self.task_cfg), "sampler": asdict(self.sampler_cfg), "seed": self.seed,
                 "checked": [asdict(e) for e in self.train_examples[: self.model_cfg.warmup.check_examples]]},
                progress=progress,
                accuracy=self._warmup_accuracy,
            )
        self._base_ready = True

    def base_record(self) -> dict[str, Any]:
        """The frozen base's :func:`~tclightning.models.lora.base_fingerprint`, taken once when the
        base is final (:meth:`prepare_base`; the base never trains, so once is enough)."""
        if self._base_record is None:
            self._base_record = base_fingerprint(self.policy)
        return self._base_record

    def verify_base(self, record: Mapping[str, Any], source: str | os.PathLike) -> None:
        """Refuse (``TclightningError``, one line naming ``source``) a checkpoint whose recorded base
        fingerprint ``record`` is not the base this module rebuilt from the recipe."""
        if not isinstance(record, Mapping):  # (a str, a list: what no run writes)
            raise TclightningError(f"checkpoint {source}: its fingerprint of the LoRA base ({BASE_KEY}) is a "
                                   f"{type(record).__name__}, not one tclightning writes; nothing was loaded")
        got = self.base_record()
        if record.get("sha256") == got["sha256"]:
            return
        warmup = self.model_cfg.warmup
        cached = ("reused from the cache" if self.warmup_stats.get("warmup/cached") else "trained again")
        built = {"tiny": f"model.source=tiny with seed {self.seed}", "hf": f"model.source=hf {self.model_cfg.name}",
                 "gguf": f"model.source=gguf {self.model_cfg.gguf_file}"}.get(self.model_cfg.source, self.model_cfg.source)
        if warmup.steps > 0:
            built += f", then the supervised warm-up ({cached})"
        raise TclightningError(
            f"checkpoint {source}: its LoRA adapters were trained on another base model: the base this recipe "
            f"rebuilds ({built}) has fingerprint {got['sha256'][:16]}, the checkpoint records "
            f"{str(record.get('sha256'))[:16]}; a resume or export needs the same base (the same model files, and "
            "the warm-up's cache entry or the same machine and thread count to train it again); nothing was loaded")

    def frozen_state_keys(self) -> set[str]:
        """With ``model.lora``: the state-dict keys a checkpoint leaves out, because the recipe
        rebuilds them: the policy's frozen base weights and the KL reference (a copy of that base)."""
        if self.model_cfg.lora_settings.r <= 0:
            return set()
        keys = {f"policy.{name}" for name in frozen_parameter_names(self.policy)}
        if self.reference is not None:
            keys |= {f"reference.{name}" for name in self.reference.state_dict()}
        return keys

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

    def _optimizer_settings(self) -> dict[str, Any]:
        """The AdamW settings of :meth:`configure_optimizers`, as its parameter groups hold them."""
        return {"lr": self.cfg.lr, "betas": tuple(self.cfg.betas), "weight_decay": self.cfg.weight_decay}

    def configure_optimizers(self) -> Any:
        params = [p for p in self.policy.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, **self._optimizer_settings())
        warmup = max(self.cfg.warmup_steps, 0)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda tick: min(1.0, (tick + 1) / (warmup + 1)))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    # ----------------------------------------------------------------------------- pieces
    @property
    def backend(self) -> Backend:
        """Where the policy's forward/backward runs (see :meth:`take_backend`)."""
        return self._backend if self._backend is not None else self.take_backend()

    def take_backend(self) -> Backend:
        """The strategy's backend when it is a ``BackendProvider`` (the pipeline strategies), else
        the whole policy in this process; asked for once, after the strategy's setup."""
        if self._backend is None:
            dtype = None if self.sampler_cfg.dtype is None else DTYPES[self.sampler_cfg.dtype]
            request = BackendRequest(self.policy, self.sampler_cfg.temperature, completion_logps, self.manual_backward,
                                     sampler_dtype=dtype)
            strategy = self.trainer.strategy
            self._backend = strategy.backend(request) if isinstance(strategy, BackendProvider) else LocalBackend(request)
        return self._backend

    def _dense(self) -> contextlib.AbstractContextManager:
        """Codecs (if any) bypassed, as on a real inference engine (before the strategy is set
        up, as during the warm-up, nothing is installed yet)."""
        return self._backend.dense() if self._backend is not None else contextlib.nullcontext()

    def sampling_model(self) -> torch.nn.Module:
        """What the sampler generates with: the backend's (the policy, or with ``sampler.dtype`` its
        exact copy in that dtype); the policy before the strategy is set up (the warm-up's check)."""
        return self._backend.sampling_model() if self._backend is not None else self.policy

    def sample(self, examples: list[Example], seed: int, *, greedy: bool = False, group_size: int | None = None,
               model: torch.nn.Module | None = None) -> Rollouts:
        """Dense sampling: codecs (if any) are bypassed, as on a real inference engine. ``model``:
        the :meth:`sampling_model` (default: asked for here)."""
        with self._dense():
            return self.sampler.generate(
                model if model is not None else self.sampling_model(),
                [e.prompt for e in examples],
                group_size=group_size or self.sampler_cfg.group_size,
                seed=seed,
                greedy=greedy,
            )

    def score(self, rollouts: Rollouts, examples: list[Example]) -> torch.Tensor:
        expanded = [e for e in examples for _ in range(rollouts.group_size)]
        return torch.tensor(self.task.rewards(rollouts.texts, expanded), dtype=torch.float32)

    def collect(self, examples: list[Example], seed: int, *, greedy: bool = False, group_size: int | None = None
                ) -> tuple[Rollouts, torch.Tensor, torch.Tensor, Episodes | None]:
        """``(rows, rewards [P*G], trajectory of each row, episodes)``. Single-turn: a row is a
        trajectory. Agentic: a row is one interaction and ``episodes`` carries the conversations."""
        G = group_size or self.sampler_cfg.group_size
        model = self.sampling_model()
        self.require_finite_weights(model)
        if self.multi_turn is None:
            rollouts = self.sample(examples, seed, greedy=greedy, group_size=G, model=model)
            return rollouts, self.score(rollouts, examples), torch.arange(rollouts.num_sequences), None
        with self._dense():
            episodes = self.multi_turn.play(model, examples, group_size=G, seed=seed, greedy=greedy)
        return episodes.rows, episodes.rewards, episodes.trajectory, episodes

    def require_finite_weights(self, model: torch.nn.Module | None = None) -> None:
        """Raise :class:`NonFiniteError` if any weight of ``model`` (default the policy; the sampler
        checks the one it samples from) is NaN/Inf (nothing is sampled from it)."""
        bad = nonfinite_parameters(self.policy if model is None else model)
        if bad:
            more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
            raise NonFiniteError(f"the policy's weights hold NaN or Inf ({', '.join(bad[:3])}{more})")

    # ----------------------------------------------------------------------------- the step
    def training_step(self, batch: PromptBatch, batch_idx: int) -> None:
        cfg, G = self.cfg, self.sampler_cfg.group_size
        logged_step = rl_step(self.trainer)
        if batch.step != logged_step:  # would misalign metrics.csv/TensorBoard after a resume
            raise TclightningError(f"the prompt stream is at step {batch.step} but Lightning's loops at step {logged_step}: "
                                   "the checkpoint's loop counters disagree; resume from another checkpoint")
        started = time.perf_counter()
        examples = [self.train_examples[i] for i in batch.indices]
        seed = sequence_seed(self.sampler_cfg.seed + self.seed, batch.step)
        backend = self.backend
        try:  # across processes rank 0 samples and scores, and every stage receives the result
            rollouts, rewards, owner, episodes = backend.share_from_sampler(
                lambda: self.collect(examples, seed), "receiving the step's rollouts")
        except NonFiniteError as err:
            if backend.world_size > 1:  # the other ranks wait for these rollouts: every rank stops
                raise
            self._flag_nonfinite(batch.step, str(err))
            # NaN for what this step did not measure: Lightning would repeat the last step's values
            metrics = dict.fromkeys(self._step_metric_names, math.nan)
            metrics.update({"policy/skipped_step": 1.0, "policy/lr": self.optimizers().param_groups[0]["lr"]})
            self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)
            return
        rollouts = rollouts.to(self.device)
        # Per trajectory (a trajectory is truncated if any of its rows is); broadcast to rows by `owner`.
        truncated = torch.zeros(len(rewards), dtype=torch.float32).index_add_(0, owner, rollouts.truncated.cpu().float()) > 0
        shaped = rewards - cfg.overlong_penalty * truncated.float() if cfg.overlong_penalty else rewards
        advantages = group_advantages(shaped, G, cfg.scale_rewards, cfg.eps)[owner]
        sampled = time.perf_counter()

        # One PRF key per RL step: the "old" log-probs and every tick of the update see the same
        # coordinates, so the PPO ratio compares weights, not index draws.
        backend.begin_step(batch.step)
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
        result = self._update(rollouts, advantages.to(self.device), rows, batch.step, turns)
        metrics.update(result.metrics)
        trained = time.perf_counter()
        if result.all_skipped:
            self._flag_nonfinite(batch.step, "every optimizer tick had a NaN or Inf loss or gradient")
        else:
            self._nonfinite_step = None
        metrics.update(backend.wire_metrics())
        if self.anchor is not None:
            reduce = None if backend.world_size == 1 else (
                lambda counts: backend.reduce_sum(counts, "summing the anchor's sign agreement"))
            agreement = self.anchor.step_agreement(reduce)
            if agreement is not None:
                metrics["anchor/sign_agreement"] = agreement
            metrics.update(self.anchor.metrics(self.trainer.global_step))
        if "wire/bytes_fwd" in metrics:
            metrics["wire/total_bytes"] = total_bytes(metrics)

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
            "reward/sem": reward_sem(rewards, self.sampler_cfg.group_size),
            "reward/count": float(rewards.numel()),
            "response/length_mean": float(lengths.mean()),
            "response/length_max": float(lengths.max()),
            "response/truncated_frac": float(rollouts.truncated.float().mean()),
        }

    def _update(self, rollouts: Rollouts, advantages: torch.Tensor, rows: torch.Tensor, step: int,
                turns: torch.Tensor | None = None) -> UpdateResult:
        """``epochs x minibatches`` optimizer ticks (:func:`~tclightning.grpo.update.grpo_update`);
        returns what they did: losses, gap and health metrics (with ``turns``, the interaction index
        of each row, also the gap per interaction index) and whether every tick was skipped."""
        reference = None
        if self.reference is not None:
            def reference() -> torch.Tensor:  # on the sampling rank, which holds the whole reference
                with torch.no_grad():
                    return completion_logps(self.reference, rollouts, self.sampler_cfg.temperature)[0]
        if self.anchor is not None:
            self.anchor.begin_step()
        return grpo_update(
            self.backend, self.optimizers(), self.lr_schedulers(), rollouts, advantages, rows,
            cfg=self.cfg, norm_length=self.sampler_cfg.max_new_tokens, seed=self.seed, step=step,
            reference=reference, turns=turns, anchor=self.anchor, clock=lambda: self.trainer.global_step,
        )

    # ----------------------------------------------------------------------------- validation
    def evaluate_batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy completions for held-out examples: (rewards, lengths)."""
        examples = [self.eval_examples[i] for i in indices]
        rollouts, rewards, owner, _ = self.collect(examples, seed=self.seed, greedy=True, group_size=1)
        # Generated tokens per trajectory (agentic: summed over its interactions).
        return rewards, torch.zeros(len(rewards), dtype=torch.float32).index_add_(0, owner, rollouts.lengths.float().cpu())

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
        count = float(self.val_accuracy.weight)  # the problems scored (the accuracy's binomial error)
        self._val_nonfinite = False
        self.log("val/accuracy", accuracy, prog_bar=True)
        self.log("val/count", count)
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
    @classmethod
    def load_from_checkpoint(  # type: ignore[override]
        cls,
        checkpoint_path: str | Path | IO,
        map_location: Any = None,
        hparams_file: str | Path | None = None,
        strict: bool | None = None,
        weights_only: bool | None = True,
        **kwargs: Any,
    ) -> GRPOModule:
        """Lightning's ``load_from_checkpoint``, as data only: ``weights_only=True`` by default,
        with the checkpoint's few non-tensor objects allowed
        (:func:`~tclightning.callbacks.checkpointing.checkpoint_allow_list`: the numpy RNG state,
        the anchor's replay). The module is rebuilt from the checkpoint's hyper-parameters (the
        recipe's ``model``, ``task``, ``sampler``, ``grpo``, ``anchor`` sections) with the trained
        weights in ``self.policy``; the global RNGs are left as they are, and no warm-up runs but to
        rebuild the frozen base of a ``model.lora`` checkpoint (which holds the adapters alone; a base
        whose fingerprint differs from the checkpoint's is refused, one line).
        To take the policy out as a Hugging Face folder use :func:`tclightning.export.export_policy`."""
        if hparams_file is not None:  # its hyper-parameters would build the model unchecked
            raise TclightningError(f"load_from_checkpoint: hparams_file={hparams_file!s} is not taken: a tclightning "
                                   "checkpoint carries its own hyper-parameters (pass a section, e.g. model=..., to "
                                   "replace it)")
        named = isinstance(checkpoint_path, (str, os.PathLike))
        where = str(checkpoint_path) if named else "(an open file)"
        # Opened once, checked, then loaded from the same open file: Lightning would open a path
        # through fsspec (``file://x`` is then another file than the ``./file:/x`` checked here).
        # torch reads a checkpoint's parts where they lie, so a huge file is never read whole.
        with contextlib.ExitStack() as opened:
            if named:
                regular_file(Path(checkpoint_path), "checkpoint")  # what it is instead, named
                handle: IO = opened.enter_context(open_regular(Path(checkpoint_path), "checkpoint"))
            elif checkpoint_path.seekable():
                handle = checkpoint_path
            else:  # a pipe would be read whole into memory, and waited on until its writer closes it
                raise TclightningError("load_from_checkpoint: the file given is not seekable (a pipe?); give a path "
                                       "or a seekable file")
            handle = first_reads(handle)  # checked, loaded here, then by Lightning: the pickle checked each time
            start = handle.tell()
            return cls._load_checked(handle, start, where, map_location, strict, weights_only, kwargs)

    @classmethod
    def _load_checked(cls, handle: IO, start: int, where: str, map_location: Any, strict: bool | None,
                      weights_only: bool | None, kwargs: dict[str, Any]) -> GRPOModule:
        checkpoint = load_checkpoint(handle, name=where)
        hparams = checkpoint.get("hyper_parameters") or {}
        if "_instantiator" in hparams or "_class_path" in hparams:  # Lightning would import what they name
            raise TclightningError(f"load_from_checkpoint: checkpoint {where} asks Lightning to build classes by name "
                                   "(_instantiator), which could run code; nothing was loaded")
        legacy = legacy_hparams(checkpoint)
        if legacy is not None:  # Lightning would take arguments from there too, past every check here
            raise TclightningError(f"load_from_checkpoint: checkpoint {where} holds '{legacy}', where Lightning also "
                                   "reads a module's arguments; a tclightning checkpoint keeps them in "
                                   "hyper_parameters only, so nothing was loaded")
        require_lightning_checkpoint(checkpoint, f"load_from_checkpoint: checkpoint {where}")
        from tclightning.settings import refuse_interpolation

        # ${oc.env:...} would be resolved into the module's settings: values only, as in a recipe
        refuse_interpolation({key: value for key, value in hparams.items() if key not in kwargs}, f"checkpoint {where}")
        if "model" not in kwargs:
            # the hyper-parameters build the model: a checkpoint asks for no remote code and no model
            # larger than its weights or of a shape none can have (your own ``model=...`` argument
            # is yours to decide)
            check_checkpoint_model(checkpoint, f"checkpoint {where}")
        token = _LOADING.set(where)
        try:
            handle.seek(start)
            with checkpoint_allow_list():
                return super().load_from_checkpoint(  # type: ignore[return-value]
                    handle, map_location=map_location, strict=strict, weights_only=weights_only, **kwargs)
        except RuntimeError as err:  # torch's load_state_dict: weights missing, unexpected or not tensors
            if "state_dict" not in str(err) and "copying the parameter" not in str(err):
                raise
            raise TclightningError(f"checkpoint {where}: its weights are not this model's "
                                   f"({' '.join(str(err).split())[:200]})") from None
        finally:
            _LOADING.reset(token)

    @classmethod
    def from_checkpoint_data(cls, checkpoint: Mapping[str, Any], source: str | os.PathLike = "checkpoint") -> GRPOModule:
        """What :meth:`load_from_checkpoint` builds, from a checkpoint already loaded (a dict, as
        :func:`~tclightning.callbacks.checkpointing.load_checkpoint` returns it): the module of its
        hyper-parameters with its weights (a LoRA checkpoint's base rebuilt and checked). ``source``
        names the file in errors. The caller checks the hyper-parameters first
        (:func:`~tclightning.export.check_checkpoint_hparams`)."""
        hparams = checkpoint["hyper_parameters"]
        accepted = inspect.signature(cls.__init__).parameters
        module = cls(**{key: value for key, value in hparams.items() if key in accepted})
        module.load_weights(checkpoint, source)
        return module

    def load_weights(self, checkpoint: Mapping[str, Any], source: str | os.PathLike = "checkpoint") -> None:
        """Load a checkpoint's weights (a dict, as :func:`~tclightning.callbacks.checkpointing.load_checkpoint`
        returns it) into this module, which no Trainer holds: a LoRA checkpoint's base is rebuilt
        and checked and the adapters put on first, as :meth:`load_from_checkpoint` does. A
        checkpoint whose weights do not fit is one line naming ``source``."""
        token = _LOADING.set(str(source))
        try:
            self.on_load_checkpoint(dict(checkpoint))
        finally:
            _LOADING.reset(token)
        try:
            self.load_state_dict(checkpoint["state_dict"], strict=True)
        except RuntimeError as err:  # torch's message lists every key: the first line says it
            raise TclightningError(f"checkpoint {source}: its weights do not fit the model built for it: "
                                   f"{' '.join(str(err).split())[:200]}") from None

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Add tclightning's state (``checkpoint["tclightning"]``). With ``model.lora`` the state
        dict keeps the adapters (and anything else not rebuilt) only: the frozen base and the KL
        reference are left out, as PEFT's ``save_pretrained`` does, and :data:`BASE_KEY` records
        the base's fingerprint, which a load checks the rebuilt base against. Every rank filters
        its own state dict (Lightning takes one on each), so every rank's share is adapters only."""
        left_out = self.frozen_state_keys()
        if left_out:
            checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k not in left_out}
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
            # The backend owns the cuts: the PRF step and every cut's receiver codec state (collective).
            "cuts": None if self._backend is None else self._backend.codec_state(),
            # Snapshots + replay, an undelivered M, M_bar: across processes every rank's (collective).
            "anchor": None if self.anchor is None else self.backend.gather_per_rank(
                self.anchor.state_dict(), "gathering the anchor states"),
        }
        if left_out:
            checkpoint["tclightning"][BASE_KEY] = dict(self.base_record())

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("tclightning", {})
        source = _LOADING.get() if self._trainer is None else str(self.trainer.ckpt_path)
        check_state_dict_form(checkpoint.get("state_dict", {}), f"checkpoint {source}")  # read by name from here on
        if self._trainer is None:  # load_from_checkpoint: the weights only, no training state
            self._restore_frozen_reference(checkpoint.get("state_dict", {}))
            if BASE_KEY in state and self.model_cfg.lora_settings.r > 0:  # adapters alone: the base is rebuilt first
                with _global_rngs_untouched():  # a warm-up trained again must not move the caller's RNGs
                    self.prepare_base()
                if self.cfg.kl_coef > 0 and self.reference is None:
                    self.reference = copy.deepcopy(self.policy).requires_grad_(False).eval()
            apply_lora(self.policy, self.model_cfg.lora_settings, seed=self.seed)  # after the (base) reference
            check_weights(self.state_dict(), checkpoint.get("state_dict", {}), f"checkpoint {_LOADING.get()}")
            self._check_left_out(checkpoint, _LOADING.get(), verify=True)
            return
        # Rank 0 checks the base it rebuilt in setup; the other ranks take rank 0's weights once
        # the pipeline is built (their own rebuild may differ where GPU kernels do).
        self._check_left_out(checkpoint, str(self.trainer.ckpt_path), verify=self.trainer.global_rank == 0)
        _check_training_state(checkpoint, [p for p in self.policy.parameters() if p.requires_grad])
        check_weights(self.state_dict(), checkpoint.get("state_dict", {}), f"checkpoint {self.trainer.ckpt_path}")
        rng = state.get("rng")
        if rng:
            random.setstate(rng["python"])
            np.random.set_state(rng["numpy"])
            torch.set_rng_state(rng["torch"])
            if rng["cuda"] and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])
        warmup = state.get("warmup")
        self.warmup_stats = {k: float(v) for k, v in warmup.items() if isinstance(v, (int, float))} \
            if isinstance(warmup, dict) else {}
        self._resume_step = int(state.get("rl_step", 0))
        _rescale_learning_rate(checkpoint, self.cfg.lr)
        _adopt_optimizer_settings(checkpoint, self._optimizer_settings())
        # A checkpoint saved at a run's last step records that the prompt stream ended there;
        # restored as is, Lightning ends the resumed run before its first step. Where the stream
        # ends is this run's `trainer.steps` (the PromptStream built from it tells the fetcher).
        progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.batch_progress")
        if progress is not None:
            progress["is_last_batch"] = False
        self._pending_cut_state = state.get("cuts")
        anchor = state.get("anchor")
        if anchor and self.anchor is not None:
            self.anchor.load_state_dict(rank_share(anchor, self.trainer.global_rank, self.trainer.world_size),
                                        processes=self.trainer.world_size)

    def _check_left_out(self, checkpoint: Mapping[str, Any], source: str, *, verify: bool) -> None:
        """Before the weights load: a checkpoint that leaves out the frozen base (a LoRA one) must
        record the base's fingerprint, and (``verify``) the base this module rebuilt must match it;
        one line naming ``source`` otherwise. A checkpoint holding its whole state dict passes."""
        state, weights = checkpoint.get("tclightning") or {}, checkpoint.get("state_dict") or {}
        record = state.get(BASE_KEY)
        if record is not None and self.model_cfg.lora_settings.r <= 0:
            raise TclightningError(f"checkpoint {source}: holds LoRA adapters without their base, and this model has "
                                   "model.lora.r=0; nothing was loaded")
        left_out = sorted(self.frozen_state_keys() - set(weights))
        if not left_out:
            return
        if not isinstance(record, Mapping):
            raise TclightningError(f"checkpoint {source}: holds none of the frozen base weights ({left_out[0]} and "
                                   f"{len(left_out) - 1} more) and no fingerprint of the base; nothing was loaded")
        if verify:
            self.verify_base(record, source)

    def _restore_frozen_reference(self, state_dict: Mapping[str, Any]) -> None:
        """Give the module the ``reference`` a ``grpo.kl_coef > 0`` checkpoint holds (made in
        ``setup``, which a plain load never runs), so its ``reference.*`` weights load strictly."""
        if self.reference is None and any(key.startswith("reference.") for key in state_dict):
            self.reference = copy.deepcopy(self.policy).requires_grad_(False).eval()

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """``nn.Module.load_state_dict``; once the backend is taken (a rollback, which every rank
        loads alike) the sampler's copy is rebuilt from the loaded weights. A LoRA checkpoint's
        state dict (the adapters alone, :meth:`on_save_checkpoint`) loads strictly too: the entries
        it leaves out are this module's own frozen base, rebuilt from the recipe and checked against
        the checkpoint's fingerprint by :meth:`on_load_checkpoint`."""
        left_out = self.frozen_state_keys() - set(state_dict)
        if left_out:
            own = self.state_dict()
            state_dict = {**state_dict, **{key: own[key] for key in left_out}}
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        if self._backend is not None:
            self._backend.weights_loaded()
        return result

    def on_fit_start(self) -> None:
        self.take_backend()  # the strategy is set up: from here on sampling runs under its dense()

    def on_validation_start(self) -> None:
        self.take_backend()

    def teardown(self, stage: str) -> None:
        self._backend = None  # the strategy removes its cuts at teardown

    def on_train_start(self) -> None:
        cut_state, self._pending_cut_state = self._pending_cut_state, None
        if cut_state is not None:
            self.backend.load_codec_state(cut_state)
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
        metrics = {"val/accuracy": float(rewards.mean()), "val/count": float(rewards.numel()),
                   "val/length_mean": float(lengths.mean())}
        for logger in self.loggers:
            logger.log_metrics(metrics, step=0)

