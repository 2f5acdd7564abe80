"""``AnchorController``: replace a fast circuit that carries no signal.

No merger can repair a fast gradient without signal (PRF at 5% on the embedded task), so the
controller measures that signal on the run's first anchors and, where it is missing, swaps the
codec. Its actions (:class:`ControllerCore`, pure logic, tested on synthetic signals):

* ``switch``: the fast circuit itself carries no signal -- its gradient on an anchor's batch at
  the anchor's weights has a cosine with the anchor's dense ``M`` (``anchor/fast_signal``)
  whose mean over the first ``signal_patience`` anchors is below ``signal_floor`` -- so no merge
  can help: every compressed cut's codec becomes ``fallback_codec`` (default ``lowrank``, a
  learned basis at the same values per token), once per run, and the anchor's term is switched
  off (``s = 0``): a sign override, even a fresh one, holds a fast circuit that has signal flat
  or pulls it down. The signal is measured (the anchor also runs the fast circuit on its job:
  compute, and that pass's compressed bytes) for those first anchors only. One process only:
  across processes the fast circuit cannot run at a snapshot, so nothing is measured and nothing
  switched; nor where the cuts already use ``fallback_codec``;
* ``probe``: so that the verdict does not wait for a late first anchor, a run whose anchor
  latency is above 1 starts with a fresh anchor (latency 1, cadence 1) for ``signal_patience +
  1`` steps, with the strength unchanged; then the recipe's schedule comes back (a switch ends
  the probe at once). The probe's dense passes count in ``anchor/bytes``.

``start_strength`` (default 1: the recipe's anchor as is) is the anchor term's strength for the
run (0: the anchor runs and measures, its term adds nothing), until a ``switch`` sets it to 0.

Tried and retired (docs/two-circuits.md has the runs): ``weaken`` and ``suspend`` on stale
signals, ``fresh`` anchor windows on a reward decline (``restore`` after them) and ``recover``
after calm steps; in ``robust-5-5`` and ``robust-20-20`` (seed 0, 200 steps) none of them fired.

Each action is logged: ``anchor/controller_action`` (the step's action code, 0 for none; see
``ACTIONS``: 6 switch, 7 probe, the codes they always had; 1-5 were the retired actions' and are
not reused), ``anchor/controller_actions`` (how many so far), ``anchor/controller_mode`` (0 the
anchor term at full strength, 1 partial, 2 off, 3 probe), and one ``health:`` line on the
console, e.g.::

    health: [anchor-controller] step 2: switch (mean fast_signal +0.03 over 2 anchors < +0.30: ...): strength 1.00 -> 0.00

Works with any module whose anchor is an :class:`~tclightning.anchor.anchor.Anchor` at
``pl_module.anchor`` (the GRPO module) or in an :class:`~tclightning.callbacks.anchor_merge.AnchorMerge`
callback of the trainer; without one it does nothing. The controller owns the anchor's strength,
its ``measure_fast`` and, during a probe, its schedule: they are saved once, in the controller's
``state_dict()`` (the decision state and every action so far; the anchor's own checkpoint entry
holds none of them), and put into the anchor before every step, so a resumed run continues exactly.
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
from tclightning.callbacks.health_actions import HealthWarning
from tclightning.callbacks.steps import rl_step
from tclightning.errors import TclightningError
from tclightning.pipeline.cuts import CutSet

ACTIONS = {"none": 0, "switch": 6, "probe": 7}
"""Action name -> the code logged as ``anchor/controller_action``. 1-5 were the retired weaken,
suspend, fresh, restore and recover (module doc): not reused, and an older checkpoint's events
may still name them."""

MODES = {"full": 0, "partial": 1, "off": 2, "probe": 3}
"""Mode name -> the code logged as ``anchor/controller_mode`` (the codes of earlier versions'
normal, weakened, suspended and fresh)."""


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

    signal_floor: float = 0.3
    signal_patience: int = 2
    fallback_codec: str | None = "lowrank"
    start_strength: float = 1.0
    # state
    strength: float = 1.0
    probe_left: int = 0  # steps of the signal probe still to run (0: no probe in force)
    steps_seen: int = 0
    signal_readings: list[float] = field(default_factory=list)  # anchor/fast_signal of the first anchors
    signal_found: bool = False  # their mean reached signal_floor: nothing to switch
    switched_to: str | None = None
    events: list[ControllerAction] = field(default_factory=list)

    def __post_init__(self) -> None:
        checks = {
            "signal_floor": -1 <= self.signal_floor <= 1, "signal_patience": self.signal_patience >= 1,
            "start_strength": 0 <= self.start_strength <= 1,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise TclightningError(
                f"AnchorController: out of range: {', '.join(f'{n}={getattr(self, n)!r}' for n in bad)} "
                "(signal_patience >= 1; start_strength in [0, 1]; signal_floor in [-1, 1])")
        if self.steps_seen == 0 and not self.events:  # a new run: the anchor's term starts at start_strength
            self.strength = float(self.start_strength)

    @property
    def mode(self) -> str:
        """``probe`` while the probe is in force, else the anchor term's level: ``full`` (strength
        1), ``partial`` or ``off`` (0)."""
        if self.probe_left > 0:
            return "probe"
        return "full" if self.strength >= 1.0 else ("off" if self.strength == 0.0 else "partial")

    @property
    def wants_signal(self) -> bool:
        """Whether ``anchor/fast_signal`` is still needed: a fallback codec is set and no verdict yet."""
        return self.fallback_codec is not None and self.switched_to is None and not self.signal_found

    def start_probe(self, step: int, *, can_switch: bool, latency: int | None) -> ControllerAction | None:
        """Before a run's first step: ``probe`` (module doc) when a verdict is wanted, the cuts can
        be switched and the recipe's first anchor would come later than the next step."""
        if self.steps_seen or self.events or not (self.wants_signal and can_switch) or (latency or 0) <= 1:
            return None
        self.probe_left = self.signal_patience + 1
        return self._act(step, "probe", self.strength,
                         f"measuring the fast circuit's signal: latency/cadence 1/1 for {self.probe_left} steps")

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
        self.probe_left = 0
        return self._act(step, "switch", 0.0,
                         f"mean fast_signal {mean:+.2f} over {len(self.signal_readings)} anchors < "
                         f"{self.signal_floor:+.2f}: the fast circuit carries no signal; codec -> {self.fallback_codec}, "
                         "anchor term off")

    def end_step(self) -> None:
        """One RL step done: the probe, if in force, has one step less to run."""
        self.steps_seen += 1
        if self.probe_left > 0:
            self.probe_left -= 1

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
        """Restore :meth:`state_dict`. An earlier version's state loads too: its probe (``fresh_left``
        with ``probing``) continues, and the keys only its retired actions read (``rewards``,
        ``start``, ``stale_streak``, ``calm_streak``, ``fresh_used``, ``fresh_cadence``,
        ``last_decline_step``, ``mode``) are ignored, as nothing reads them now; one saved inside a
        ``fresh`` window (retired: it cannot continue as it was) is refused."""
        if "probe_left" not in state and state.get("mode") == "fresh":
            if not state.get("probing"):
                raise TclightningError(
                    "the checkpoint's AnchorController is inside a 'fresh' anchor window, an action this version no "
                    "longer has (retired, docs/anchor.md): resume with the version that wrote it, or start a new run")
            state = {**state, "probe_left": int(state.get("fresh_left", 0))}
        for name in ("strength", "probe_left", "steps_seen", "signal_readings", "signal_found", "switched_to"):
            if name in state:
                setattr(self, name, state[name])
        self.strength = float(self.strength)
        self.probe_left = int(self.probe_left)
        self.signal_readings = [float(r) for r in self.signal_readings]
        self.events = [ControllerAction(**e) for e in state.get("events", [])]


class AnchorController(Callback):
    """Measure the fast circuit's signal on the first anchors and switch its codec when there is
    none (module doc). Arguments are :class:`ControllerCore`'s thresholds:

    Args:
        signal_floor: a mean ``anchor/fast_signal`` below this over the first anchors: no signal.
        signal_patience: how many anchors that mean is taken over.
        fallback_codec: the codec ``switch`` gives every compressed cut (None: never switch).
        start_strength: the anchor term's strength for the run (1: the recipe's anchor; 0: off).
        log: log ``anchor/controller_*`` each RL step.
    """

    def __init__(
        self,
        signal_floor: float = 0.3,
        signal_patience: int = 2,
        fallback_codec: str | None = "lowrank",
        start_strength: float = 1.0,
        log: bool = True,
    ) -> None:
        self.core = ControllerCore(signal_floor=signal_floor, signal_patience=signal_patience,
                                   fallback_codec=fallback_codec, start_strength=start_strength)
        self.log_metrics = log
        self._schedule: AnchorSchedule | None = None  # the recipe's, captured before the first change
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
        """Put the decision state into the anchor (its one owner): strength, whether to measure
        the fast circuit's signal, and the probe's schedule while in force."""
        anchor.strength = self.core.strength
        anchor.measure_fast = self.core.wants_signal and self._can_switch(trainer)
        if anchor.circuit is None:
            return
        if self._schedule is None:
            self._schedule = anchor.circuit.schedule
        anchor.circuit.schedule = AnchorSchedule(1, 1) if self.core.probe_left > 0 else self._schedule

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
        self.core.end_step()
        self._apply(anchor, trainer)
        last, self._probe = switch or self._probe, None  # this step's action: read before the probe is cleared
        if self.log_metrics:
            kwargs = {"on_step": True, "on_epoch": False, "batch_size": 1}
            pl_module.log("anchor/controller_action", float(ACTIONS[last.kind] if last else 0), **kwargs)
            pl_module.log("anchor/controller_actions", float(len(self.core.events)), **kwargs)
            pl_module.log("anchor/controller_mode", float(MODES[self.core.mode]), **kwargs)

    @rank_zero_only
    def _warn(self, message: str) -> None:
        warnings.warn(message, HealthWarning, stacklevel=2)

    def state_dict(self) -> dict[str, Any]:
        return {"core": self.core.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; an earlier version's byte counters (``sent``, ``fast``,
        ``dense``: the retired ``fresh`` window's budget) are ignored."""
        self.core.load_state_dict(state_dict.get("core", {}))


__all__ = ["ACTIONS", "MODES", "AnchorController", "ControllerAction", "ControllerCore"]
