"""The Lightning glue shared by the health callbacks: read metrics, run the detector, act.

:class:`HealthMonitor` is a thin :class:`~lightning.pytorch.callbacks.Callback` over a
:class:`~tclightning.health.HealthDetector` (the pure logic). It reads
``trainer.callback_metrics`` by canonical names (``metric_names`` maps canonical -> your own
name, or names a preset: ``"trl"``, ``"verl"``; one given to any monitor of the trainer, or set
once with :func:`~tclightning.health.names.set_metric_names`, serves every monitor given none),
feeds the detector once per RL step, and carries out the configured actions:

* ``log`` (always): the scalar ``health/<name>`` (0/1/2, or -1 while none of the monitor's
  metrics has arrived) for this monitor and ``health/state`` (the worst over every health
  monitor of the trainer that has data) through ``pl_module.log``; the reason text of each new
  event through ``add_text`` on a TensorBoard logger. After ``no_data_after`` steps without any
  of its metrics, one :class:`HealthWarning` names what it reads and the closest names logged.
* ``warn``: a console :class:`HealthWarning` once per episode (when a rule starts firing or
  escalates to collapsing), on rank zero, in your metric names. A finding that another monitor
  of the trainer already reported (the same rule on the same metric, still open there) is
  recorded in this monitor's events and TensorBoard text but not printed again.
* ``checkpoint``: every ``checkpoint_every`` RL steps, if the verdict is healthy (ignoring
  ``tolerated_rules``) on every rank, ``trainer.save_checkpoint`` to ``last-healthy.ckpt``.
* ``stop``: at ``act_on`` (default collapsing) on any rank, every rank sets
  ``trainer.should_stop`` (agreed through ``strategy.reduce_boolean_decision``).
* ``rollback``: at ``act_on``, restore the weights and optimizer states of the last healthy
  checkpoint (and this monitor's detector state from it), scale the learning rates by
  ``rollback_lr_scale``, continue; after ``max_rollbacks`` rollbacks (or with no healthy
  checkpoint yet), stop instead. Implies ``checkpoint``. The checkpoint is read as data only
  (:func:`~tclightning.callbacks.checkpointing.load_checkpoint`), and only from the run directory
  (``trainer.default_root_dir``) or this monitor's ``checkpoint_dir``: its path comes back from
  checkpointed state, so a path anywhere else, or a file that is not a plain checkpoint, stops
  training with one warning and nothing loaded.

Steps are RL steps: ``trainer.fit_loop.epoch_loop._batches_that_stepped`` (the ``step`` of
metrics.csv and TensorBoard), not ``trainer.global_step``, which counts optimizer steps and runs
ahead when a training step makes several optimizer steps (the GRPO module does).
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_only

from tclightning.callbacks.checkpointing import load_checkpoint
from tclightning.callbacks.steps import rl_step
from tclightning.console import shown as printable
from tclightning.errors import TclightningError
from tclightning.files import entry_identity, unused_name
from tclightning.health.detector import HealthDetector, HealthEvent, Verdict
from tclightning.health.names import (
    MetricNames,
    default_metric_names,
    missing_inputs_message,
    resolve_metric_names,
    to_user_names,
)
from tclightning.health.rules import HealthState, Rule, default_rules
from tclightning.health.rules.base import INFO, parse_severity
from tclightning.settings import check_arguments, flag, integer, list_of, number, one_of, positive, read_once, text

ACTIONS = ("log", "warn", "checkpoint", "stop", "rollback")

NO_DATA = -1.0
"""The value of ``health/<name>`` (and ``health/state``) while no monitor has seen its metrics."""


class HealthWarning(UserWarning):
    """Console warning raised by the health monitors (filter it with the ``warnings`` module)."""


def metric_scalar(value: Any) -> float | None:
    """A logged metric as a float: a one-element tensor or a number, else None."""
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().item()) if value.numel() == 1 else None
    if isinstance(value, (int, float)):
        return float(value)
    return None


class HealthMonitor(Callback):
    """Base health callback: a detector over ``rules`` plus the actions listed in the module doc.

    Args:
        rules: the detector's rules (subclasses pass their own family by default).
        name: names the logged scalar ``health/<name>``, the checkpoint state key and warnings.
        metric_names: canonical name -> the name your module logs (``{"reward/mean": "train/reward"}``),
            or a preset name: ``"trl"``, ``"verl"`` (docs/metrics.md has the tables). None: the
            mapping another monitor of the trainer was given, else the one set with
            :func:`~tclightning.health.names.set_metric_names`, else the canonical names.
        actions: any of ``log``, ``warn``, ``checkpoint``, ``stop``, ``rollback`` (``log`` is implied).
        act_on: ``"collapsing"`` (default) or ``"warning"``: the state that triggers stop/rollback.
        checkpoint_every: RL steps between "last healthy" checkpoints (10: the length loop takes
            ~20 steps from onset to damage, so the last healthy point is at most half of that old).
        checkpoint_dir: where ``<checkpoint_name>.ckpt`` goes (default ``<log_dir>/checkpoints``).
        checkpoint_name: file stem of the healthy checkpoint (default ``last-healthy``).
        max_rollbacks: rollbacks before giving up and stopping (2: a third collapse from the
            same healthy point means lowering the LR did not help).
        rollback_lr_scale: multiply every learning rate by this at each rollback (1.0 keeps it).
        tolerated_rules: rules whose warnings do not block a healthy checkpoint (default
            ``gap.level``: a standing gap is a property of the codec, not a decline).
        validation_metrics: canonical names read at ``on_validation_end`` instead of per batch
            (plus every name starting with ``val/``).
        clear_after: detector hysteresis, see :class:`~tclightning.health.HealthDetector`.
        no_data_after: RL steps without any of this monitor's metrics before its one warning
            saying so (5: every step logs them in a run that has them).
    """

    def __init__(
        self,
        rules: Sequence[Rule] | None = None,
        name: str = "health",
        metric_names: MetricNames = None,
        actions: Sequence[str] = ("log", "warn"),
        act_on: str = "collapsing",
        checkpoint_every: int = 10,
        checkpoint_dir: str | None = None,
        checkpoint_name: str = "last-healthy",
        max_rollbacks: int = 2,
        rollback_lr_scale: float = 1.0,
        tolerated_rules: Sequence[str] = ("gap.level",),
        validation_metrics: Sequence[str] = ("val/accuracy",),
        clear_after: int = 5,
        no_data_after: int = 5,
    ) -> None:
        rules, actions, tolerated_rules = read_once(rules), read_once(actions), read_once(tolerated_rules)
        validation_metrics = read_once(validation_metrics)
        if act_on not in ("warning", "collapsing"):
            raise TclightningError(f"{type(self).__name__}: act_on must be 'warning' or 'collapsing', got {act_on!r}")
        if rules is not None and not all(isinstance(rule, Rule) for rule in rules):
            raise ValueError(f"{type(self).__name__}: rules: expected health Rule objects (built in Python, "
                             f"tclightning.health.rules), got {rules!r}; a recipe sets the thresholds instead")
        check_arguments(type(self).__name__, {
            "checkpoint_every": (checkpoint_every, positive()),
            "max_rollbacks": (max_rollbacks, integer(0)),
            "rollback_lr_scale": (rollback_lr_scale, number(0.0, low_open=True)),
            "clear_after": (clear_after, positive()),
            "no_data_after": (no_data_after, positive()),
            "actions": (actions, list_of(one_of(ACTIONS))),
            "tolerated_rules": (tolerated_rules, list_of(text())),
            "validation_metrics": (validation_metrics, list_of(text(nonempty=True))),
        })
        self.name = name
        self.detector = HealthDetector(rules, clear_after=clear_after)
        known = {rule.name for rule in (*default_rules(), *self.detector.rules)}
        unknown = next((rule for rule in tolerated_rules if rule not in known), None)
        if unknown is not None:  # a typo would tolerate nothing, without a word
            raise TclightningError(f"{type(self).__name__}: tolerated_rules names {printable(repr(unknown))[:80]}, "
                                   f"which no rule has (rules: {', '.join(sorted(known))})")
        self._explicit_names = metric_names is not None
        names = (resolve_metric_names(metric_names, f"{type(self).__name__}: metric_names")
                 if metric_names is not None else default_metric_names())
        read = self.detector.metrics_read() | HealthDetector().metrics_read()  # (one mapping serves every monitor)
        unread = next((canonical for canonical in names if canonical not in read), None)
        if isinstance(metric_names, Mapping) and unread is not None:  # a typo would leave its rule without data
            raise TclightningError(f"{type(self).__name__}: metric_names maps {printable(repr(unread))[:80]}, which no "
                                   f"health rule reads (they read {', '.join(sorted(read))})")
        self._set_names(names)
        self.no_data_after = no_data_after
        self._steps_seen = 0
        self._logged_names: set[str] = set()
        self._no_data_warned = False
        self.actions = {"log", *actions}
        if "rollback" in self.actions:
            self.actions.add("checkpoint")
        self.act_on = HealthState.WARNING if act_on == "warning" else HealthState.COLLAPSING
        self.checkpoint_every = checkpoint_every
        self.checkpoint_dir = checkpoint_dir
        self.checkpoint_name = checkpoint_name
        self.max_rollbacks = max_rollbacks
        self.rollback_lr_scale = rollback_lr_scale
        self.tolerated_rules = tuple(tolerated_rules)
        self.validation_metrics = tuple(validation_metrics)
        self.rollbacks = 0
        self.last_healthy_path: str | None = None
        self.last_healthy_step: int | None = None
        self.stopped_at: int | None = None
        self._lr_factor = 1.0
        self._written: tuple[str, tuple[int, int] | None] | None = None  # this fit's healthy checkpoint, as written

    def _set_names(self, names: Mapping[str, str]) -> None:
        self.metric_names = dict(names)
        self._canonical = {user: canonical for canonical, user in self.metric_names.items()}

    # ------------------------------------------------------------------ identity and state
    @property
    def inputs(self) -> tuple[str, ...]:
        """The canonical metrics this monitor's rules read (sorted)."""
        return tuple(sorted({name for rule in self.detector.rules for name in rule.inputs}))

    @property
    def has_data(self) -> bool:
        """Whether any of :attr:`inputs` has arrived, or any metric for a rule that reads them all
        (the non-finite one); a monitor without data claims no verdict."""
        if any(not rule.inputs for rule in self.detector.rules):
            return not self.detector.history.empty
        return any(self.detector.history.has(name) for name in self.inputs)

    @property
    def state_key(self) -> str:
        return self._generate_state_key(name=self.name)

    @property
    def state_metric(self) -> str:
        """The scalar this monitor logs: ``health/<name>``."""
        return f"health/{self.name}"

    @property
    def state(self) -> HealthState:
        return self.detector.state

    def state_dict(self) -> dict[str, Any]:
        return {
            "detector": self.detector.state_dict(),
            "rollbacks": self.rollbacks,
            "last_healthy_path": self.last_healthy_path,
            "last_healthy_step": self.last_healthy_step,
            "stopped_at": self.stopped_at,
            "lr_factor": self._lr_factor,
            "no_data_warned": self._no_data_warned,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; a value out of its range (a negative rollback
        count, a learning-rate factor that is not a finite number > 0, a path that is not text)
        raises ``ValueError`` before anything changes."""
        check_arguments(f"{type(self).__name__} state", {
            "rollbacks": (state_dict.get("rollbacks", 0), integer(0)),
            "last_healthy_path": (state_dict.get("last_healthy_path"), text(optional=True)),
            "last_healthy_step": (state_dict.get("last_healthy_step"), integer(0, optional=True)),
            "stopped_at": (state_dict.get("stopped_at"), integer(0, optional=True)),
            "lr_factor": (state_dict.get("lr_factor", 1.0), number(0.0, low_open=True)),
            "no_data_warned": (state_dict.get("no_data_warned", False), flag),
        })
        self.detector.load_state_dict(state_dict["detector"])
        self.rollbacks = state_dict.get("rollbacks", 0)
        self.last_healthy_path = state_dict.get("last_healthy_path")
        self.last_healthy_step = state_dict.get("last_healthy_step")
        self.stopped_at = state_dict.get("stopped_at")
        self._lr_factor = float(state_dict.get("lr_factor", 1.0))
        self._no_data_warned = state_dict.get("no_data_warned", False)

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """A monitor given no ``metric_names`` reads with the mappings the trainer's other monitors
        were given, merged (one mapping serves all), else the one set with ``set_metric_names``.
        Two of them renaming one canonical name differently is a user error."""
        if stage == "fit":  # a monitor used for a second fit writes no file of the first's
            self._written = None
        if self._explicit_names:
            return
        merged: dict[str, str] = {}
        for other in self._monitors(trainer):
            if not other._explicit_names:
                continue
            for canonical, yours in other.metric_names.items():
                if merged.setdefault(canonical, yours) != yours:
                    raise TclightningError(
                        f"health monitors: metric_names maps {canonical} to both {merged[canonical]} and {yours}; "
                        f"give {type(self).__name__} its own metric_names or make them agree")
        self._set_names(merged or default_metric_names())

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.sanity_checking:
            return
        step = rl_step(trainer)
        metrics = self.read_metrics(trainer, validation=False)
        verdict = self.detector.update(step, metrics) if metrics else self.detector.verdict()
        self._check_inputs_arrived(trainer)
        self._log(trainer, pl_module, verdict, step)
        self._act(trainer, pl_module, verdict, step, allow_checkpoint=True)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        metrics = self.read_metrics(trainer, validation=True)
        if not metrics:
            return
        step = rl_step(trainer)
        verdict = self.detector.update(step, metrics)
        self._log_text(trainer, verdict, step)  # the scalar follows with the next training batch
        self._act(trainer, pl_module, verdict, step, allow_checkpoint=False)

    def _check_inputs_arrived(self, trainer: pl.Trainer) -> None:
        """Once, after ``no_data_after`` steps with none of :attr:`inputs`: warn with the names."""
        self._steps_seen += 1
        self._logged_names.update(k for k in trainer.callback_metrics if not k.startswith("health/"))
        if self._no_data_warned or self._steps_seen < self.no_data_after or self.has_data:
            return
        self._no_data_warned = True
        self._warn(missing_inputs_message(self.name, self._steps_seen, self.inputs, self._logged_names, self.metric_names))

    # ------------------------------------------------------------------ reading
    def _is_validation(self, canonical: str) -> bool:
        return canonical in self.validation_metrics or canonical.startswith("val/")

    def read_metrics(self, trainer: pl.Trainer, validation: bool) -> dict[str, float]:
        """Scalars of ``trainer.callback_metrics`` under canonical names, train or validation ones."""
        out: dict[str, float] = {}
        for key, value in trainer.callback_metrics.items():
            if key.startswith("health/"):
                continue
            canonical = self._canonical.get(key, key)
            if self._is_validation(canonical) != validation:
                continue
            scalar = metric_scalar(value)
            if scalar is not None:
                out[canonical] = scalar
        return out

    # ------------------------------------------------------------------ actions
    def _monitors(self, trainer: pl.Trainer) -> list[HealthMonitor]:
        return [cb for cb in trainer.callbacks if isinstance(cb, HealthMonitor)]  # type: ignore[attr-defined]

    def _log(self, trainer: pl.Trainer, pl_module: pl.LightningModule, verdict: Verdict, step: int) -> None:
        kwargs: dict[str, Any] = {"on_step": True, "on_epoch": False, "batch_size": 1, "logger": True}
        # no input seen yet: -1 (no data), never a "healthy" it cannot know
        pl_module.log(self.state_metric, float(verdict.state) if self.has_data else NO_DATA, **kwargs)
        if "rollback" in self.actions:
            pl_module.log(f"health/{self.name}_rollbacks", float(self.rollbacks), **kwargs)
        monitors = self._monitors(trainer)
        if monitors and monitors[-1] is self:
            judged = [float(m.state) for m in monitors if m.has_data]
            pl_module.log("health/state", max(judged, default=NO_DATA), **kwargs)
        self._log_text(trainer, verdict, step)

    def _reported_elsewhere(self, trainer: pl.Trainer, event: HealthEvent) -> bool:
        """Whether another warning monitor of the trainer holds this finding open at least as
        severe: it printed it (or one before it did), so this one records it silently."""
        key = f"{event.rule}:{event.metric}"
        severity = parse_severity(event.severity)
        for other in self._monitors(trainer):
            if other is self or "warn" not in other.actions:
                continue
            episode = other.detector._episodes.get(key)
            if episode is not None and episode.worst >= severity:
                return True
        return False

    def _user(self, text: str) -> str:
        return to_user_names(text, self.metric_names)

    def _log_text(self, trainer: pl.Trainer, verdict: Verdict, step: int) -> None:
        events = [e for e in verdict.events if e.kind != "cleared"]
        if "warn" in self.actions:
            for event in events:
                # information (a rising gap) goes to the timeline and TensorBoard text, not the console
                if (event.kind in ("fired", "escalated") and event.severity != INFO
                        and not self._reported_elsewhere(trainer, event)):
                    self._warn(f"[{self.name}] step {step}: {event.severity} ({event.rule}) {self._user(event.message)}")
        if not verdict.events:
            return
        text = "\n\n".join(f"**{e.kind} {e.severity}** `{e.rule}` {self._user(e.metric)}: {self._user(e.message)}"
                           for e in verdict.events)
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_text(f"{self.state_metric}/events", text, global_step=step)

    @rank_zero_only
    def _warn(self, message: str) -> None:
        warnings.warn(message, HealthWarning, stacklevel=2)

    def _act(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, verdict: Verdict, step: int, allow_checkpoint: bool
    ) -> None:
        strategy = trainer.strategy
        if "checkpoint" in self.actions and allow_checkpoint and step % self.checkpoint_every == 0:
            # a monitor that has seen none of its metrics calls nothing healthy (a rollback would return to it)
            healthy = self.has_data and verdict.state_ignoring(self.tolerated_rules) == HealthState.HEALTHY
            if strategy.reduce_boolean_decision(healthy, all=True):
                self._save_healthy(trainer, step)
        if "rollback" in self.actions or "stop" in self.actions:
            bad = strategy.reduce_boolean_decision(verdict.state >= self.act_on, all=False)
            if not bad:
                return
            if "rollback" in self.actions:
                if self.rollbacks < self.max_rollbacks and self.last_healthy_path:
                    refused = self._rollback_refusal(trainer, self.last_healthy_path)
                    if refused is not None:
                        self._stop(trainer, verdict, step, refused)
                        return
                if self.rollbacks < self.max_rollbacks and self.last_healthy_path and os.path.isfile(self.last_healthy_path):
                    self._rollback(trainer, pl_module, verdict, step)
                    return
                why = (f"gave up after {self.rollbacks} rollbacks" if self.rollbacks >= self.max_rollbacks
                       else "no healthy checkpoint to roll back to")
                self._stop(trainer, verdict, step, why)
            else:
                self._stop(trainer, verdict, step, f"state {verdict.state.label}")

    def _checkpoint_path(self, trainer: pl.Trainer) -> str:
        root = self.checkpoint_dir or os.path.join(trainer.log_dir or trainer.default_root_dir, "checkpoints")
        return os.path.join(root, f"{self.checkpoint_name}.ckpt")

    def _rollback_refusal(self, trainer: pl.Trainer, path: str) -> str | None:
        """Why ``path`` may not be rolled back to, or None. Allowed: inside the run directory
        (``trainer.default_root_dir``) or the directory this monitor writes its checkpoint to."""
        real = os.path.realpath(path)
        roots = [trainer.default_root_dir, os.path.dirname(self._checkpoint_path(trainer))]
        for root in (os.path.realpath(r) for r in roots):
            if os.path.commonpath([real, root]) == root:
                return None
        return (f"refusing to roll back to {path}: it is outside the run directory {trainer.default_root_dir}; "
                "nothing was loaded")

    def _save_healthy(self, trainer: pl.Trainer, step: int) -> None:
        """Write this fit's healthy checkpoint: over the one it wrote before while that file is still
        the one it wrote, else at the next free name beside :meth:`_checkpoint_path`. A file this fit
        did not write is never written over: an earlier fit's (this monitor's too), one a resumed
        checkpoint's state names, one put at the name."""
        path = None
        if trainer.is_global_zero:  # one name for every rank: rank 0's
            if self._written is not None and entry_identity(self._written[0]) == self._written[1]:
                path = self._written[0]
            else:
                path = str(_claim_free_name(Path(self._checkpoint_path(trainer)).absolute()))
        path = trainer.strategy.broadcast(path, src=0)
        self.last_healthy_path, self.last_healthy_step = path, step
        trainer.save_checkpoint(path, weights_only=False)
        self._written = (path, entry_identity(path))

    def _stop(self, trainer: pl.Trainer, verdict: Verdict, step: int, why: str) -> None:
        if not trainer.should_stop:
            self._record(step, "stopped", why, verdict)
            self._warn(f"[{self.name}] step {step}: stopping training ({why}): {self._user(verdict.reasons)}")
        trainer.should_stop = True
        self.stopped_at = step

    def _record(self, step: int, kind: str, message: str, verdict: Verdict) -> None:
        event = HealthEvent(step, kind, self.name, "", verdict.state.label, verdict.state.label, message)
        self.detector.events.append(event)

    def _rollback(self, trainer: pl.Trainer, pl_module: pl.LightningModule, verdict: Verdict, step: int) -> None:
        """Restore weights + optimizer states (+ this monitor's detector) from the healthy checkpoint."""
        assert self.last_healthy_path is not None
        try:
            ckpt = load_checkpoint(self.last_healthy_path)  # data only: a crafted file runs no code
            if not isinstance(ckpt.get("state_dict"), Mapping):
                raise TclightningError(f"checkpoint {self.last_healthy_path}: holds no model weights (state_dict)")
            saved = ckpt.get("callbacks", {}).get(self.state_key)
            saved_step = saved.get("last_healthy_step") if isinstance(saved, Mapping) else None
            if saved_step is not None and saved_step != self.last_healthy_step:
                # a resume from an earlier step: the fit it left went on writing over the file
                raise TclightningError(f"{self.last_healthy_path} holds the healthy state of step {saved_step}, not "
                                       f"of step {self.last_healthy_step} (a later history wrote over it); nothing "
                                       "was loaded")
            pl_module.load_state_dict(ckpt["state_dict"])
        except (TclightningError, RuntimeError) as err:  # RuntimeError: weights of another model
            self._stop(trainer, verdict, step, f"cannot roll back: {err}")
            return
        for optimizer, opt_state in zip(trainer.optimizers, ckpt.get("optimizer_states", [])):
            optimizer.load_state_dict(opt_state)
        saved_factor = float(saved.get("lr_factor", 1.0)) if saved else 1.0
        target = self._lr_factor * self.rollback_lr_scale
        self._scale_lr(trainer, target / saved_factor)
        reasons = verdict.reasons
        events = list(self.detector.events)
        if saved:
            self.detector.load_state_dict(saved["detector"])
            self.detector.events = events  # keep the full timeline, not the checkpoint's
        self.rollbacks += 1
        self._lr_factor = target
        message = (f"rolled back to the healthy checkpoint of step {self.last_healthy_step} "
                   f"(rollback {self.rollbacks}/{self.max_rollbacks}, lr x{target:g})")
        self._record(step, "rollback", message, verdict)
        self._warn(f"[{self.name}] step {step}: {message}; because: {self._user(reasons)}")

    @staticmethod
    def _scale_lr(trainer: pl.Trainer, factor: float) -> None:
        if math.isclose(factor, 1.0):
            return
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                group["lr"] *= factor
                if "initial_lr" in group:
                    group["initial_lr"] *= factor
        for config in trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            if hasattr(scheduler, "base_lrs"):
                scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]


def _claim_free_name(path: Path) -> Path:
    """The first free name of :func:`~tclightning.files.unused_name` for ``path``, taken at once by an
    empty file made there (never through a link): two fits starting together in one folder each get
    their own (both found ``last-healthy.ckpt`` free and wrote over each other's)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        free = unused_name(path)
        try:
            os.close(os.open(free, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666))
        except FileExistsError:  # taken since it was found free: the next one
            continue
        return free

