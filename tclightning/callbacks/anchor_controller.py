"""``AnchorController``: keep a two-circuit run in the region where its anchor helps.

A late anchor is delayed feedback: where the policy's gradient turns faster than the anchor's
latency, the anchor's direction arrives in anti-phase and pulls the run down. The controller
watches the signals that say so, once per RL step, and acts before the reward falls:

* **staleness** (read from the step's metrics): ``anchor/fast_cosine``, the fresh fast gradient
  against the held anchor direction (mean over the step's ticks), and
  ``anchor/consecutive_agreement``, the sign agreement of the last two anchors. A step is
  *stale* when the cosine is below ``cos_floor`` or the agreement below ``agree_floor``;
* **health**: ``reward/mean``. The run's start is the mean of its first ``window`` steps; a
  *decline* is the mean of the last ``window`` steps below the start by ``drop_warn`` or more.

Decisions (:class:`ControllerCore`, pure logic, tested on synthetic signals):

1. ``weaken``: after ``patience`` stale steps in a row, the anchor's strength ``s`` (the weight
   of its term, ``G = G_comp + s (G_merged - G_comp)``) is multiplied by ``weaken_factor``;
2. ``suspend``: when ``s`` would fall below ``min_strength``, ``s = 0``: the fast circuit alone
   (the anchor still runs, so its signals keep coming);
3. ``fresh``: on a decline, a fresh anchor (latency 1, ``s = 1``) for ``fresh_steps`` steps, at
   the smallest cadence of ``FRESH_CADENCES`` (then the recipe's own) whose projected run bytes
   at the window's end stay within ``byte_budget`` (share of a dense trainer's boundary bytes;
   projected from the shares so far, a fresh anchor at cadence ``C`` adding ``1/C`` of dense
   per step), if fewer than ``max_fresh`` windows were used; otherwise ``suspend``;
4. ``restore``: after a fresh window, the recipe's latency/cadence come back with ``s =
   min_strength``; after ``recover_after`` calm steps (an anchor signal measured, not stale, no
   decline) ``s`` doubles (up to 1, from ``min_strength`` when suspended): ``recover``;
5. ``switch``: the fast circuit itself carries no signal -- its gradient on an anchor's batch at
   the anchor's weights has a cosine with the anchor's dense ``M`` (``anchor/fast_signal``)
   whose mean over the first ``signal_patience`` anchors is below ``signal_floor`` -- so no merge
   can help: every compressed cut's codec becomes ``fallback_codec`` (default ``lowrank``, a
   learned basis at the same values per token), once per run, and the anchor's term is switched
   off (``s = 0``; it can come back through ``recover``) with no more fresh windows: a sign
   override, even a fresh one, holds a fast circuit that has signal flat or pulls it down. The
   signal is measured (the anchor also runs the fast circuit on its job: compute, and that
   pass's compressed bytes) for those first anchors only. One process only: across processes
   the fast circuit cannot run at a snapshot, so nothing is measured and nothing switched;
6. ``probe``: so that the verdict does not wait for a late first anchor, a run whose anchor
   latency is above 1 starts with a fresh anchor (latency 1, cadence 1) for ``signal_patience +
   1`` steps, with the strength unchanged; then ``restore`` gives back the recipe's schedule
   (the strength still unchanged). The probe's dense passes count in ``anchor/bytes``.

``start_strength`` (default 1: the recipe's anchor as is) below 1 starts the anchor's term weakened
(0: suspended), so it must earn its weight through ``recover``: an anchor that never hurts before
its signals show it points the way.

Each action is logged: ``anchor/controller_action`` (the step's action code, 0 for none; see
``ACTIONS``), ``anchor/controller_actions`` (how many so far), ``anchor/controller_mode`` (0
normal, 1 weakened, 2 suspended, 3 fresh), and one ``health:`` line on the console, e.g.::

    health: [anchor-controller] step 7: weaken (fast_cosine -0.21 < 0.00 for 2 steps): strength 1.00 -> 0.50

Works with any module whose anchor is an :class:`~tclightning.anchor.anchor.Anchor` at
``pl_module.anchor`` (the GRPO module) or in an :class:`~tclightning.callbacks.anchor_merge.AnchorMerge`
callback of the trainer; without one it does nothing. Its state (the decision state and every
action so far) is in ``state_dict()``, so a resumed run continues exactly; the anchor's strength
and schedule are re-applied from it before every step.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_only

from tclightning.anchor.anchor import Anchor
from tclightning.anchor.circuit import AnchorSchedule
from tclightning.callbacks.anchor_merge import AnchorMerge
from tclightning.callbacks.health_actions import HealthWarning, metric_scalar
from tclightning.callbacks.steps import rl_step
from tclightning.errors import TclightningError
from tclightning.pipeline.cuts import CutSet

ACTIONS = {"none": 0, "weaken": 1, "suspend": 2, "fresh": 3, "restore": 4, "recover": 5, "switch": 6, "probe": 7}
"""Action name -> the code logged as ``anchor/controller_action``."""

MODES = {"normal": 0, "weakened": 1, "suspended": 2, "fresh": 3}
"""Mode name -> the code logged as ``anchor/controller_mode``."""

FRESH_CADENCES = (1, 2, 5)
"""Cadences a fresh window tries, densest first (then the recipe's own)."""


def _mode_for(strength: float) -> str:
    """The mode a strength stands for outside a fresh window: 1 normal, 0 suspended, else weakened."""
    return "normal" if strength >= 1.0 else ("suspended" if strength == 0.0 else "weakened")


@dataclass
class ControllerAction:
    """One decision: at RL ``step``, ``kind`` (a key of ``ACTIONS``), the strength after it, and why."""

    step: int
    kind: str
    strength: float
    reason: str

    def line(self, before: float) -> str:
        """The console line (without the ``health:`` prefix)."""
        return f"[anchor-controller] step {self.step}: {self.kind} ({self.reason}): strength {before:.2f} -> {self.strength:.2f}"


@dataclass
class ControllerCore:
    """The controller's decisions, pure logic (see the module doc for the rules and defaults)."""

    window: int = 10
    drop_warn: float = 0.03
    cos_floor: float = 0.0
    agree_floor: float = 0.5
    patience: int = 2
    weaken_factor: float = 0.5
    min_strength: float = 0.2
    recover_after: int = 10
    fresh_steps: int = 10
    max_fresh: int = 2
    byte_budget: float = 0.5
    signal_floor: float = 0.3
    signal_patience: int = 2
    fallback_codec: str | None = "lowrank"
    start_strength: float = 1.0
    # state
    strength: float = 1.0
    mode: str = "normal"
    rewards: list[float] = field(default_factory=list)
    start: float | None = None
    stale_streak: int = 0
    calm_streak: int = 0
    fresh_left: int = 0
    fresh_used: int = 0
    fresh_cadence: int = 1
    last_decline_step: int | None = None
    steps_seen: int = 0
    signal_readings: list[float] = field(default_factory=list)  # anchor/fast_signal of the first anchors
    signal_found: bool = False  # their mean reached signal_floor: nothing to switch
    switched_to: str | None = None
    probing: bool = False  # the fresh window in force is the signal probe
    events: list[ControllerAction] = field(default_factory=list)

    def __post_init__(self) -> None:
        checks = {
            "window": self.window >= 1, "drop_warn": self.drop_warn > 0, "agree_floor": 0 <= self.agree_floor <= 1,
            "cos_floor": -1 <= self.cos_floor <= 1, "patience": self.patience >= 1,
            "weaken_factor": 0 < self.weaken_factor < 1, "min_strength": 0 < self.min_strength <= 1,
            "recover_after": self.recover_after >= 1, "fresh_steps": self.fresh_steps >= 0,
            "max_fresh": self.max_fresh >= 0, "byte_budget": self.byte_budget > 0,
            "signal_floor": -1 <= self.signal_floor <= 1, "signal_patience": self.signal_patience >= 1,
            "start_strength": 0 <= self.start_strength <= 1,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise TclightningError(
                f"AnchorController: out of range: {', '.join(f'{n}={getattr(self, n)!r}' for n in bad)} (window, "
                "patience, recover_after, signal_patience >= 1; fresh_steps, max_fresh >= 0; drop_warn, byte_budget "
                "> 0; 0 < weaken_factor < 1; 0 < min_strength <= 1; agree_floor, start_strength in [0, 1]; "
                "cos_floor, signal_floor in [-1, 1])")
        if self.steps_seen == 0 and not self.events:  # a new run: the anchor's term starts at start_strength
            self.strength = float(self.start_strength)
            self.mode = _mode_for(self.strength)

    # ------------------------------------------------------------------ signals
    def decline(self) -> float | None:
        """``start - mean(last window rewards)`` once ``window`` rewards are in (None before)."""
        if self.start is None or len(self.rewards) < self.window:
            return None
        return self.start - sum(self.rewards[-self.window:]) / self.window

    def _stale_reason(self, fast_cosine: float | None, consecutive: float | None) -> str | None:
        if fast_cosine is not None and math.isfinite(fast_cosine) and fast_cosine < self.cos_floor:
            return f"fast_cosine {fast_cosine:+.2f} < {self.cos_floor:+.2f}"
        if consecutive is not None and math.isfinite(consecutive) and consecutive < self.agree_floor:
            return f"consecutive_agreement {consecutive:.2f} < {self.agree_floor:.2f}"
        return None

    @property
    def wants_signal(self) -> bool:
        """Whether ``anchor/fast_signal`` is still needed: a fallback codec is set and no verdict yet."""
        return self.fallback_codec is not None and self.switched_to is None and not self.signal_found

    def start_probe(self, step: int, *, can_switch: bool, latency: int | None) -> ControllerAction | None:
        """Before a run's first step: ``probe`` (module doc) when a verdict is wanted, the cuts can
        be switched and the recipe's first anchor would come later than the next step."""
        if self.steps_seen or self.events or not (self.wants_signal and can_switch) or (latency or 0) <= 1:
            return None
        self.mode, self.fresh_left, self.fresh_cadence, self.probing = "fresh", self.signal_patience + 1, 1, True
        return self._act(step, "probe", self.strength,
                         f"measuring the fast circuit's signal: latency/cadence 1/1 for {self.fresh_left} steps")

    def check_signal(self, step: int, fast_signal: float | None, *, can_switch: bool) -> ControllerAction | None:
        """An anchor's ``fast_signal`` (None: none arrived this step) in. After ``signal_patience``
        readings: their mean below ``signal_floor`` gives ``switch`` (see the module doc), else
        the fast circuit has signal and measuring stops. Nothing happens unless ``can_switch``
        (the caller can rebuild the cuts with ``fallback_codec``)."""
        if not (self.wants_signal and can_switch) or fast_signal is None or not math.isfinite(fast_signal):
            return None
        self.signal_readings.append(float(fast_signal))
        if len(self.signal_readings) < self.signal_patience:
            return None
        mean = sum(self.signal_readings) / len(self.signal_readings)
        if mean >= self.signal_floor:
            self.signal_found = True
            return None
        assert self.fallback_codec is not None
        self.switched_to = self.fallback_codec
        self.mode, self.fresh_left, self.stale_streak, self.calm_streak = "suspended", 0, 0, 0
        self.probing = False
        return self._act(step, "switch", 0.0,
                         f"mean fast_signal {mean:+.2f} over {len(self.signal_readings)} anchors < "
                         f"{self.signal_floor:+.2f}: the fast circuit carries no signal; codec -> {self.fallback_codec}, "
                         "anchor term off")

    # ------------------------------------------------------------------ the decision
    def observe(
        self, step: int, *, reward: float | None, fast_cosine: float | None = None,
        consecutive: float | None = None, bytes_share: float | None = None, fast_share: float | None = None,
        cadence: int | None = None,
    ) -> ControllerAction | None:
        """One RL step's signals in; the action taken (also appended to ``events``), or None.

        ``bytes_share``: the run's boundary bytes so far (fast circuit and anchor) over a dense
        trainer's; ``fast_share``: the fast circuit's alone; ``cadence``: the recipe's anchor
        cadence (None: unknown, budget checks use ``bytes_share`` alone)."""
        self.steps_seen += 1
        if reward is not None and math.isfinite(reward):
            self.rewards = (self.rewards + [float(reward)])[-self.window:]
            if self.start is None and len(self.rewards) == self.window:
                self.start = sum(self.rewards) / self.window
        stale = self._stale_reason(fast_cosine, consecutive)
        self.stale_streak = self.stale_streak + 1 if stale else 0
        decline = self.decline()
        declining = decline is not None and decline >= self.drop_warn
        # calm needs evidence: a step before any anchor signal (None or NaN) is not one
        measured = any(x is not None and math.isfinite(x) for x in (fast_cosine, consecutive))
        self.calm_streak = 0 if (stale or declining) else self.calm_streak + int(measured)

        if self.mode == "fresh":
            self.fresh_left -= 1
            if self.fresh_left > 0:
                return None
            if self.probing:  # the probe leaves the strength as it found it
                self.probing = False
                self.mode = _mode_for(self.strength)
                return self._act(step, "restore", self.strength, "signal probe over: the recipe's latency/cadence")
            self.mode, self.calm_streak = "weakened", 0
            return self._act(step, "restore", self.min_strength, "fresh window over: the recipe's latency/cadence")

        if declining and (self.last_decline_step is None or step - self.last_decline_step >= self.window):
            # a decline acted on waits one window: the mean lags the action by that much
            assert self.start is not None and decline is not None
            why = f"{self.window}-step mean reward {self.start - decline:.3f} is {decline:.3f} below its start {self.start:.3f}"
            fresh = self._fresh_cadence(bytes_share, fast_share, cadence)
            if fresh is not None:
                self.mode, self.fresh_left, self.last_decline_step = "fresh", self.fresh_steps, step
                self.fresh_used += 1
                self.fresh_cadence = fresh
                self.stale_streak = 0
                return self._act(step, "fresh", 1.0, why + f"; latency/cadence 1/{fresh} for {self.fresh_steps} steps")
            if self.strength > 0:
                self.mode, self.last_decline_step = "suspended", step
                return self._act(step, "suspend", 0.0, why)

        if stale and self.stale_streak >= self.patience and self.strength > 0:
            self.stale_streak = 0
            weaker = self.strength * self.weaken_factor
            if weaker < self.min_strength:
                self.mode = "suspended"
                return self._act(step, "suspend", 0.0, f"{stale} for {self.patience} steps")
            self.mode = "weakened"
            return self._act(step, "weaken", weaker, f"{stale} for {self.patience} steps")

        if self.calm_streak >= self.recover_after and self.strength < 1.0:
            self.calm_streak = 0
            stronger = min(1.0, max(self.strength * 2.0, self.min_strength))
            self.mode = "normal" if stronger >= 1.0 else "weakened"
            return self._act(step, "recover", stronger, f"{self.recover_after} calm steps")
        return None

    def _fresh_cadence(self, bytes_share: float | None, fast_share: float | None, cadence: int | None) -> int | None:
        """The densest cadence a fresh window can afford (module doc), or None."""
        if self.fresh_steps == 0 or self.fresh_used >= self.max_fresh or self.switched_to is not None:
            return None
        if bytes_share is None:
            return FRESH_CADENCES[0]
        candidates = [c for c in FRESH_CADENCES if cadence is None or c < cadence] + ([cadence] if cadence else [])
        for c in candidates:
            per_step = (fast_share if fast_share is not None else 0.0) + 1.0 / c
            projected = (bytes_share * self.steps_seen + per_step * self.fresh_steps) / (self.steps_seen + self.fresh_steps)
            if projected <= self.byte_budget:
                return c
        return None

    def _act(self, step: int, kind: str, strength: float, reason: str) -> ControllerAction:
        self.strength = float(strength)
        action = ControllerAction(int(step), kind, self.strength, reason)
        self.events.append(action)
        return action

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        state = dataclasses.asdict(self)
        state["events"] = [dataclasses.asdict(e) for e in self.events]
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for name in ("strength", "mode", "rewards", "start", "stale_streak", "calm_streak", "fresh_left", "fresh_used",
                     "fresh_cadence", "last_decline_step", "steps_seen", "signal_readings", "signal_found",
                     "switched_to", "probing"):
            if name in state:
                setattr(self, name, state[name])
        self.rewards = [float(r) for r in self.rewards]
        self.signal_readings = [float(r) for r in self.signal_readings]
        self.events = [ControllerAction(**e) for e in state.get("events", [])]


class AnchorController(Callback):
    """Watch the anchor's staleness and the reward; weaken, suspend or refresh the anchor before a
    collapse (module doc). Arguments are :class:`ControllerCore`'s thresholds:

    Args:
        window: steps of the reward means (the start is the first ``window`` steps' mean).
        drop_warn: a decline of this much below the start triggers ``fresh`` (or ``suspend``).
        cos_floor: a step is stale when ``anchor/fast_cosine`` is below this.
        agree_floor: ... or when ``anchor/consecutive_agreement`` is below this.
        patience: stale steps in a row before ``weaken``.
        weaken_factor: the strength's factor at each ``weaken``.
        min_strength: below it the anchor is suspended; ``restore``/``recover`` start from it.
        recover_after: calm steps before the strength doubles.
        fresh_steps: steps of a fresh (1/1) anchor after a decline (0: never).
        max_fresh: fresh windows per run.
        byte_budget: a fresh window's cadence keeps the run's projected boundary bytes (``wire/*``
            plus ``anchor/bytes``) within this share of a dense trainer's; none fits: ``suspend``.
        signal_floor: a mean ``anchor/fast_signal`` below this over the first anchors: no signal.
        signal_patience: how many anchors that mean is taken over.
        fallback_codec: the codec ``switch`` gives every compressed cut (None: never switch).
        start_strength: the anchor term's strength before any evidence (1: the recipe's anchor).
        log: log ``anchor/controller_*`` each RL step.
    """

    def __init__(
        self,
        window: int = 10,
        drop_warn: float = 0.03,
        cos_floor: float = 0.0,
        agree_floor: float = 0.5,
        patience: int = 2,
        weaken_factor: float = 0.5,
        min_strength: float = 0.2,
        recover_after: int = 10,
        fresh_steps: int = 10,
        max_fresh: int = 2,
        byte_budget: float = 0.5,
        signal_floor: float = 0.3,
        signal_patience: int = 2,
        fallback_codec: str | None = "lowrank",
        start_strength: float = 1.0,
        log: bool = True,
    ) -> None:
        self.core = ControllerCore(
            window=window, drop_warn=drop_warn, cos_floor=cos_floor, agree_floor=agree_floor, patience=patience,
            weaken_factor=weaken_factor, min_strength=min_strength, recover_after=recover_after,
            fresh_steps=fresh_steps, max_fresh=max_fresh, byte_budget=byte_budget, signal_floor=signal_floor,
            signal_patience=signal_patience, fallback_codec=fallback_codec, start_strength=start_strength)
        self.log_metrics = log
        self._schedule: AnchorSchedule | None = None  # the recipe's, captured before the first change
        self._sent = self._fast = self._dense = 0.0  # boundary bytes of the run so far (this process's view)
        self._probe: ControllerAction | None = None  # a probe started before this step

    @property
    def state_key(self) -> str:
        return "AnchorController"

    @property
    def events(self) -> list[ControllerAction]:
        return self.core.events

    @staticmethod
    def find_anchor(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Anchor | None:
        """The module's ``anchor`` or an ``AnchorMerge`` callback's, else None."""
        anchor = getattr(pl_module, "anchor", None)
        if isinstance(anchor, Anchor):
            return anchor
        for callback in trainer.callbacks:
            if isinstance(callback, AnchorMerge):
                return callback.anchor
        return None

    @staticmethod
    def switchable_cuts(trainer: pl.Trainer) -> CutSet | None:
        """The one-process pipeline strategy's cuts when at least one is compressed, else None."""
        cuts = getattr(getattr(trainer, "strategy", None), "cuts", None)
        return cuts if isinstance(cuts, CutSet) and cuts.compressed else None

    def _can_switch(self, trainer: pl.Trainer) -> bool:
        cuts = self.switchable_cuts(trainer)
        return cuts is not None and self.core.fallback_codec not in (None, cuts.config.codec)

    def _apply(self, anchor: Anchor, trainer: pl.Trainer) -> None:
        """Put the decision state into the anchor: strength, whether to measure the fast circuit's
        signal, and the fresh schedule while in force."""
        anchor.strength = self.core.strength
        anchor.measure_fast = self.core.wants_signal and self._can_switch(trainer)
        if anchor.circuit is None:
            return
        if self._schedule is None:
            self._schedule = anchor.circuit.schedule
        anchor.circuit.schedule = AnchorSchedule(1, self.core.fresh_cadence) if self.core.mode == "fresh" else self._schedule

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.find_anchor(trainer, pl_module) is None:  # say so once, rather than idle silently
            self._warn("[anchor-controller] the module has no anchor (no `anchor` attribute and no AnchorMerge "
                       "callback): nothing to control, the controller stays idle")

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        anchor = self.find_anchor(trainer, pl_module)
        if anchor is None:
            return
        if anchor.circuit is not None and self._schedule is None:
            self._schedule = anchor.circuit.schedule
        latency = None if self._schedule is None else self._schedule.latency_at(trainer.global_step)
        before = self.core.strength
        self._probe = self.core.start_probe(rl_step(trainer), can_switch=self._can_switch(trainer), latency=latency)
        if self._probe is not None:
            self._warn(self._probe.line(before))
        self._apply(anchor, trainer)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        anchor = self.find_anchor(trainer, pl_module)
        if anchor is None:
            return
        metrics = trainer.callback_metrics
        get = lambda name: metric_scalar(metrics.get(name))  # noqa: E731
        fast = (get("wire/bytes_fwd") or 0.0) + (get("wire/bytes_bwd") or 0.0)
        self._fast += fast
        self._sent += fast + (get("anchor/bytes") or 0.0)
        self._dense += (get("wire/dense_bytes_fwd") or 0.0) + (get("wire/dense_bytes_bwd") or 0.0)
        share = self._sent / self._dense if self._dense > 0 else None
        fast_share = self._fast / self._dense if self._dense > 0 else None
        if self._schedule is None and anchor.circuit is not None:
            self._schedule = anchor.circuit.schedule
        cadence = None if self._schedule is None else self._schedule.cadence_at(trainer.global_step)
        before = self.core.strength
        step = rl_step(trainer)
        readings = anchor.fast_readings  # this step's only (anchor/fast_signal holds the latest)
        fast_signal = sum(readings) / len(readings) if readings else None
        switch = self.core.check_signal(step, fast_signal, can_switch=self._can_switch(trainer))
        if switch is not None:
            cuts = self.switchable_cuts(trainer)
            assert cuts is not None and switch.kind == "switch" and self.core.switched_to is not None
            cuts.switch_codec(self.core.switched_to)
            self._warn(switch.line(before))
        action = self.core.observe(step, reward=get("reward/mean"), fast_cosine=get("anchor/fast_cosine"),
                                   consecutive=get("anchor/consecutive_agreement"), bytes_share=share,
                                   fast_share=fast_share, cadence=cadence)
        if action is not None:
            self._warn(action.line(before))
        self._apply(anchor, trainer)
        self._probe = None
        if self.log_metrics:
            kwargs = {"on_step": True, "on_epoch": False, "batch_size": 1}
            last = action or switch or self._probe
            pl_module.log("anchor/controller_action", float(ACTIONS[last.kind] if last else 0), **kwargs)
            pl_module.log("anchor/controller_actions", float(len(self.core.events)), **kwargs)
            pl_module.log("anchor/controller_mode", float(MODES[self.core.mode]), **kwargs)

    @rank_zero_only
    def _warn(self, message: str) -> None:
        warnings.warn(message, HealthWarning, stacklevel=2)

    def state_dict(self) -> dict[str, Any]:
        return {"core": self.core.state_dict(), "sent": self._sent, "fast": self._fast, "dense": self._dense}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.core.load_state_dict(state_dict.get("core", {}))
        self._sent = float(state_dict.get("sent", 0.0))
        self._fast = float(state_dict.get("fast", 0.0))
        self._dense = float(state_dict.get("dense", 0.0))


__all__ = ["ACTIONS", "MODES", "AnchorController", "ControllerAction", "ControllerCore"]
