"""The anchor feature in one object: circuit, replay, delivery and merge state (pure logic).

:class:`Anchor` owns everything a run's anchor keeps between optimizer ticks:

* the **circuit** (:class:`~tclightning.anchor.circuit.AnchorCircuit`): when to snapshot the
  weights, the snapshots and the rollouts they generated (the paired replay), when each is due;
* the **delivery**: the newest ``M``, computed from a due job by a function the trainer passes
  in (the dense forward/backward at the snapshot) and held until the next merge;
* the **merge state**: the merger (``M_bar`` and its projector) and the per-tick sign agreement
  of the current RL step;
* the **staleness signals**, measured online at every merge: ``anchor/fast_cosine`` (the fresh
  ``G_comp`` against the merger's anchor direction, mean over the step's ticks) and
  ``anchor/consecutive_agreement`` (sign agreement of the newest ``M`` with the anchor direction
  before it was folded in: how far the policy's gradient turned between two anchors);
* the **fast circuit's signal** ``anchor/fast_signal``, when the fast circuit also ran on the
  anchor's job (the ``control_variate`` merger needs it; ``measure_fast`` asks for it): the cosine
  of that compressed gradient with ``M``, same batch, same weights: premise 1 of the two-circuit
  method, measured online (``fast_readings``: this step's; ``fast_signal``: the latest);
* the **strength** ``s`` in [0, 1] that an anchor controller turns:
  ``G = G_comp + s * (merge(G_comp) - G_comp)`` (1: the merger as is; 0: the anchor term off).
  ``strength`` and ``measure_fast`` are settings, not state: their owner (the controller, which
  checkpoints its own decisions) puts them in before every step, so :meth:`Anchor.state_dict`
  does not save them, nor the circuit its schedule.

Per optimizer tick the trainer calls :meth:`Anchor.tick` before its forward/backward and
:meth:`Anchor.merge_` after clipping, right before ``optimizer.step()``. :func:`build_anchor` is
the one translation of the recipe's ``anchor`` section. The Lightning callback
``AnchorMerge`` (for any module that computes ``M`` itself) drives only the merge side.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from tclightning.anchor.circuit import AnchorCircuit, AnchorJob, AnchorSchedule, cpu_snapshot
from tclightning.anchor.config import AnchorConfig
from tclightning.anchor.mergers import Merger, SignedEMAMerger, cosine, make_merger, sign_agreement
from tclightning.anchor.placement import SignRelay
from tclightning.errors import TclightningError
from tclightning.tensor_files import FLOAT_DTYPES

Reduce = Callable[[Tensor], Tensor]
"""Sums a tensor over the ranks that each hold part of the parameters (across processes)."""


@dataclass
class AnchorDelivery:
    """An anchor gradient with its timing: ``gradient`` (one tensor per anchor parameter) was
    computed at the weight snapshot of tick ``snapshot_tick`` (the projectors' clock)."""

    gradient: Sequence[Tensor]
    snapshot_tick: int | None = None
    fast: Sequence[Tensor] | None = None  # the fast circuit's gradient at the same snapshot (control_variate)
    signs: bool = False  # ``gradient`` is sign(M_bar), computed on the sampling rank (anchor.placement: sampler)


class Anchor:
    """A merger, and optionally the circuit that feeds it (see the module doc).

    ``merger``: the merge state (``M_bar``, projector). ``circuit``: None when ``M`` comes from
    elsewhere (a module that computes it itself hands it to :meth:`merge_`). ``relay``
    (``anchor.placement: sampler``): across processes, the sampling rank's ``M_bar`` of the other
    stages, whose signs it sends them (:mod:`tclightning.anchor.placement`); unused in one process.

    Counters: ``ticks`` (merged ticks) and ``anchors`` (``M`` received), all time;
    ``agreement`` / ``coordinates``: this RL step's per-tick sign agreement and the number of
    coordinates each was measured over (cleared by :meth:`step_agreement`).
    """

    def __init__(self, merger: Merger, circuit: AnchorCircuit | None = None, relay: SignRelay | None = None) -> None:
        self.merger = merger
        self.circuit = circuit
        self.relay = relay
        self.ticks = 0
        self.anchors = 0
        self.agreement: list[float] = []
        self.coordinates: list[int] = []
        self.step_metrics: dict[str, float] = {"anchor/bytes": 0.0, "time/anchor_s": 0.0}
        self._delivered: AnchorDelivery | None = None
        self._device: torch.device | None = None  # where the merger's state lives
        self.strength = 1.0  # weight of the anchor term (an anchor controller turns it)
        self.consecutive: float | None = None  # sign agreement of the last two anchors (all time)
        self.signals: dict[str, list[float]] = {}  # this step's per-tick figures (fast_cosine, merger's)
        self.measure_fast = False  # run the fast circuit on each job too, for anchor/fast_signal
        self.fast_signal: float | None = None  # the latest anchor's reading (all time)
        self.fast_readings: list[float] = []  # this step's readings
        self.vocab_size: int | None = None  # the model's token count: a replay's token ids lie below it

    # ----------------------------------------------------------------------------- the circuit
    def begin_step(self) -> None:
        """A new RL step: ``anchor/bytes``, ``time/anchor_s`` and the per-tick signals count from zero."""
        self.step_metrics = {"anchor/bytes": 0.0, "time/anchor_s": 0.0}
        self.signals = {}
        self.fast_readings = []

    def tick(
        self,
        tick: int,
        *,
        first: bool,
        parameters: Callable[[], Sequence[Tensor]],
        payload: Callable[[], Any],
        gradient: Callable[[AnchorJob], tuple[list[Tensor], float]],
        fast_gradient: Callable[[AnchorJob], tuple[list[Tensor], float]] | None = None,
        signs: bool = False,
    ) -> None:
        """The circuit's part of optimizer tick ``tick`` (before its forward/backward).

        On the step's ``first`` tick (only then do the weights equal the ones that sampled) a job
        is recorded if the cadence says so: a CPU snapshot of ``parameters()`` and ``payload()``
        (the rollouts those weights sampled). Then every job due now is computed with
        ``gradient(job) -> (M, boundary bytes)`` and delivered (the newest wins). A merger that
        :attr:`~tclightning.anchor.mergers.Merger.needs_fast` also gets
        ``fast_gradient(job) -> (G_hat, boundary bytes)``, the fast circuit on the same job; its
        bytes are the anchor's too. With :attr:`measure_fast` it runs whenever ``fast_gradient`` is
        given (None: the backend cannot run it), for ``anchor/fast_signal`` alone. ``signs``: what
        ``gradient`` returns is ``sign(M_bar)`` from the sampling rank (``anchor.placement:
        sampler`` off it), which the merge takes as ``M_bar`` instead of folding it in."""
        if self.circuit is None:
            raise TclightningError("this anchor has no circuit: its M is handed to merge_")
        if first and self.circuit.should_record(tick):
            self.circuit.maybe_record(tick, lambda: cpu_snapshot(parameters()), payload())
        required = getattr(self.merger, "needs_fast", False)
        if required and fast_gradient is None:
            raise TclightningError(f"merger {self.merger.name!r} needs the fast circuit at the anchor's snapshot: "
                                   "pass fast_gradient to Anchor.tick")
        needs_fast = required or (self.measure_fast and fast_gradient is not None)
        for job in self.circuit.due(tick):
            refuse_unfit_job(job, parameters(), self.vocab_size)  # restored from a checkpoint of another model
            started = time.perf_counter()
            grads, sent = gradient(job)
            fast = None
            if needs_fast:
                assert fast_gradient is not None
                fast, fast_sent = fast_gradient(job)
                sent += fast_sent
            self._delivered = AnchorDelivery(grads, snapshot_tick=job.tick, fast=fast, signs=signs)
            self.step_metrics["anchor/bytes"] += sent
            self.step_metrics["time/anchor_s"] += time.perf_counter() - started

    def pop_delivery(self) -> AnchorDelivery | None:
        """The ``M`` delivered since the last call, once (None when nothing new arrived)."""
        delivered, self._delivered = self._delivered, None
        return delivered

    # ----------------------------------------------------------------------------- the merge
    def merge_(
        self, params: Sequence[Tensor], tick: int, delivered: Sequence[Tensor] | AnchorDelivery | None
    ) -> None:
        """Merge at optimizer tick ``tick``, in place on the ``.grad`` of ``params`` (the anchor
        parameters, fixed order), just before the optimizer step:

        1. the projector sees the weights (``rank1`` keeps a trajectory of them);
        2. a ``delivered`` ``M`` (shaped like ``params``) is compared with the merger's anchor
           direction (``consecutive``) and, when it came with the fast circuit's gradient on the
           same job, with that (``anchor/fast_signal``); then folded into ``M_bar`` (a delivery of
           ``signs`` replaces ``M_bar``: the sampling rank folded it);
        3. ``sign(G_comp) == sign(M_bar)`` and ``cos(G_comp, anchor direction)`` are measured;
        4. each ``p.grad`` becomes ``G_comp + strength * (G - G_comp)`` with ``G`` the merged
           gradient (parameters without a gradient are left alone).
        """
        params = list(params)
        if not params:
            return
        self._place(params[0].device)
        projector = getattr(self.merger, "projector", None)
        if projector is not None:
            projector.observe_weights([p.detach() for p in params], tick)
        if delivered is not None:
            grads, snapshot_tick, fast, signs = (
                (delivered.gradient, delivered.snapshot_tick, delivered.fast, delivered.signs)
                if isinstance(delivered, AnchorDelivery) else (delivered, None, None, False)
            )
            if len(grads) != len(params):
                raise TclightningError(f"the anchor gradient has {len(grads)} tensors for {len(params)} anchor parameters")
            previous = self.merger.reference()
            with torch.no_grad():
                if previous is not None:
                    self.consecutive = sign_agreement(list(grads), previous)
                if fast is not None and _nonzero(fast) and _nonzero(grads):  # 0 = no batch signal, not no fast signal
                    self.fast_signal = cosine(list(fast), list(grads))
                    self.fast_readings.append(self.fast_signal)
            if signs:  # sign(M_bar) of the sampling rank's EMA: it *is* this stage's M_bar now
                if not isinstance(self.merger, SignedEMAMerger):
                    raise TclightningError(f"merger {self.merger.name!r} cannot merge the anchor's signs alone "
                                           "(anchor.placement: sampler works with signed_ema only)")
                self.merger.observe_signs(list(grads), snapshot_tick=snapshot_tick, tick=tick)
            else:
                self.merger.observe(list(grads), snapshot_tick=snapshot_tick, tick=tick,
                                    fast=None if fast is None else list(fast))
            self.merger.to(params[0].device)  # M may have been computed elsewhere (a CPU clone)
            self.anchors += 1
        index = [i for i, p in enumerate(params) if p.grad is not None]
        if not index:
            return
        g_comp = [params[i].grad for i in index]
        with torch.no_grad():
            agreement = self.merger.sign_agreement(g_comp, index=index)
            if agreement is not None:
                self.agreement.append(agreement)
                self.coordinates.append(sum(g.numel() for g in g_comp))
            reference = self.merger.reference()
            if reference is not None:
                self.signals.setdefault("anchor/fast_cosine", []).append(cosine(g_comp, [reference[i] for i in index]))
            if self.strength >= 1.0:
                self.merger.merge_(g_comp, tick=tick, index=index)
            else:  # G_comp + s (G - G_comp): the merger runs (its state and figures stay current), scaled back
                fresh = [g.clone() for g in g_comp]
                self.merger.merge_(g_comp, tick=tick, index=index)
                for g, f in zip(g_comp, fresh):
                    g.sub_(f).mul_(self.strength).add_(f)
            for key, value in self.merger.tick_metrics().items():
                self.signals.setdefault(key, []).append(value)
        self.ticks += 1

    def step_agreement(self, reduce: Reduce | None = None) -> float | None:
        """The RL step's ``anchor/sign_agreement`` (None before the first ``M``), and a fresh
        start for the next step. One process: the mean over the step's ticks. With ``reduce``
        (each rank merged its own parameters): per tick the coordinate-weighted mean over ranks
        (one ``reduce`` that every rank must call), then the mean over ticks."""
        agreement, coordinates = self.agreement, self.coordinates
        self.agreement, self.coordinates = [], []
        if reduce is None:
            return sum(agreement) / len(agreement) if agreement else None
        counts = torch.tensor([[a * n, n] for a, n in zip(agreement, coordinates)], dtype=torch.float64).reshape(-1, 2)
        counts = reduce(counts)
        if counts.numel() == 0:
            return None
        return float((counts[:, 0] / counts[:, 1].clamp(min=1)).mean())

    def metrics(self, tick: int) -> dict[str, float]:
        """``anchor/latency`` and ``anchor/cadence`` in force at ``tick``, this step's
        ``anchor/bytes`` and ``time/anchor_s`` (empty without a circuit), and the staleness
        signals: :meth:`signal_metrics`."""
        if self.circuit is None:
            return {}
        return {**self.circuit.metrics(tick), **self.step_metrics, **self.signal_metrics()}

    def signal_metrics(self) -> dict[str, float]:
        """This step's means of the per-tick signals (``anchor/fast_cosine`` and the merger's own,
        e.g. ``anchor/correction_ratio``), ``anchor/consecutive_agreement`` once two anchors have arrived,
        ``anchor/fast_signal`` (the latest reading) once one was measured, and ``anchor/strength``."""
        out = {key: sum(values) / len(values) for key, values in self.signals.items() if values}
        if self.consecutive is not None:
            out["anchor/consecutive_agreement"] = self.consecutive
        if self.fast_signal is not None:
            out["anchor/fast_signal"] = self.fast_signal
        out["anchor/strength"] = self.strength
        return out

    def _place(self, device: torch.device) -> None:
        if self._device != device:
            self._device = device
            self.merger.to(device)

    # ----------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Pending snapshots and replay, an undelivered ``M``, ``M_bar`` and the projector, the
        relay's ``M_bar`` of the other stages, the counters and this step's agreement so far
        (tensors on CPU: a run resumes on any device)."""
        return {
            "circuit": None if self.circuit is None else self.circuit.state_dict(),
            "new": None if self._delivered is None else (
                list(self._delivered.gradient), self._delivered.snapshot_tick,
                None if self._delivered.fast is None else list(self._delivered.fast), self._delivered.signs),
            "merger": _to_cpu(self.merger.state_dict()),
            "relay": None if self.relay is None else self.relay.state_dict(),
            "placement": self.placement,
            "ticks": self.ticks,
            "anchors": self.anchors,
            "agreement": list(self.agreement),
            "coordinates": list(self.coordinates),
            "fast_signal": self.fast_signal,
            "fast_readings": list(self.fast_readings),
            "consecutive": self.consecutive,
            "signals": {key: list(values) for key, values in self.signals.items()},
        }

    @property
    def placement(self) -> str:
        """``anchor.placement``: ``sampler`` with a relay, else ``pipeline``."""
        return "pipeline" if self.relay is None else "sampler"

    def load_state_dict(self, state: dict[str, Any], *, processes: int = 1) -> None:
        """Restore what :meth:`state_dict` returned (the schedule stays the constructor's). An older
        checkpoint's ``strength`` and ``measure_fast`` are ignored: the controller that set them
        saves its decisions itself and puts them back before the next step. ``processes`` > 1:
        the state is one rank's share, whose snapshots cover what its placement snapshots (the
        whole policy or nothing with ``sampler``, the rank's stage with ``pipeline``), so a
        checkpoint of the other placement is refused (in one process both hold the same)."""
        saved = state.get("placement", "pipeline")
        if processes > 1 and saved != self.placement:
            raise TclightningError(
                f"the checkpoint's anchor state was saved with anchor.placement={saved} across processes, and its "
                f"snapshots do not convert to {self.placement}'s: resume with anchor.placement={saved}")
        if self.circuit is not None and state.get("circuit") is not None:
            self.circuit.load_state_dict(state["circuit"])
        new = state.get("new")
        self._delivered = None if new is None else AnchorDelivery(*new)
        fast_signal = state.get("fast_signal")
        self.fast_signal = None if fast_signal is None else float(fast_signal)
        self.fast_readings = [float(r) for r in state.get("fast_readings", [])]
        consecutive = state.get("consecutive")
        self.consecutive = None if consecutive is None else float(consecutive)
        self.signals = {key: [float(v) for v in values] for key, values in state.get("signals", {}).items()}
        if "merger" in state:
            self.merger.load_state_dict(state["merger"])
        if self.relay is not None and state.get("relay") is not None:
            self.relay.load_state_dict(state["relay"])
        self.ticks = int(state.get("ticks", 0))
        self.anchors = int(state.get("anchors", 0))
        self.agreement = [float(a) for a in state.get("agreement", [])]
        self.coordinates = [int(n) for n in state.get("coordinates", [1] * len(self.agreement))]
        self._device = None  # the state is on CPU now; moved to the parameters' device at the next merge


def refuse_unfit_job(job: AnchorJob, params: Sequence[Tensor], vocab_size: int | None = None) -> None:
    """One line (``TclightningError``) for a job that cannot be computed here: its snapshot is not
    shaped like ``params`` (the weights the anchor snapshots), or its replay is not the rollouts,
    advantages and rows a step records (token ids below ``vocab_size``, when given). Jobs come
    back from checkpoints, which a recipe's checks never see."""
    where = f"the checkpoint's anchor job of tick {job.tick}"
    snapshot = job.snapshot if isinstance(job.snapshot, list) else None
    if snapshot is None or len(snapshot) != len(params) or any(
            not isinstance(t, Tensor) or t.shape != p.shape or t.dtype != p.dtype for t, p in zip(snapshot, params)):
        raise TclightningError(f"{where}: its snapshot is not shaped like this model's weights ({len(params)} "
                               "tensors); resume with the recipe that saved it")
    payload = job.payload
    if payload is None:
        return
    from tclightning.sampling.base import Rollouts

    rollouts = payload.get("rollouts") if isinstance(payload, dict) else None
    if not isinstance(rollouts, Rollouts) or not _rows_agree(rollouts, payload, vocab_size):
        raise TclightningError(f"{where}: its replay is not the rollouts, advantages and rows a step records; resume "
                               "with the recipe that saved it")


def _rows_agree(rollouts: Any, payload: dict[str, Any], vocab_size: int | None) -> bool:
    """Whether a replay's tensors are what a step records: token grids of one row per sequence
    (whole token ids in ``[0, vocab_size)``, masks of 0 and 1, finite log-probabilities), one
    advantage per sequence, row indices among them, one text each."""
    grids = (rollouts.prompt_ids, rollouts.prompt_mask, rollouts.completion_ids, rollouts.completion_mask,
             rollouts.logp_sampler)
    if not all(isinstance(t, Tensor) and t.dim() == 2 for t in grids):
        return False
    ids, masks = (rollouts.prompt_ids, rollouts.completion_ids), (rollouts.prompt_mask, rollouts.completion_mask)
    if any(t.is_floating_point() or t.is_complex() or bool((t < 0).any())
           or (vocab_size is not None and bool((t >= vocab_size).any())) for t in ids) \
            or not all(bool(((t == 0) | (t == 1)).all()) for t in masks) \
            or rollouts.logp_sampler.dtype not in FLOAT_DTYPES or not bool(torch.isfinite(rollouts.logp_sampler).all()):
        return False
    count = rollouts.completion_ids.shape[0]
    advantages, rows = payload.get("advantages"), payload.get("rows")
    return (all(t.shape[0] == count for t in grids) and grids[0].shape == grids[1].shape
            and grids[2].shape == grids[3].shape == grids[4].shape
            and isinstance(rollouts.truncated, Tensor) and rollouts.truncated.shape == (count,)
            and isinstance(rollouts.texts, list) and len(rollouts.texts) == count
            and all(isinstance(text, str) for text in rollouts.texts)
            and isinstance(rollouts.group_size, int) and rollouts.group_size >= 1
            and isinstance(advantages, Tensor) and advantages.shape == (count,)
            and isinstance(rows, Tensor) and rows.dim() == 1 and not rows.is_floating_point()
            and bool(((rows >= 0) & (rows < count)).all()))


def build_anchor(config: AnchorConfig) -> Anchor | None:
    """The run's anchor from the recipe's ``anchor`` section, or None when the merger needs no
    anchor (``none``)."""
    options: dict[str, Any] = {}
    projector, correction = config.projector_settings, config.control_variate_settings
    if config.projector != "none":
        options["gamma"] = projector.gamma
    if config.projector == "rank1":
        options["window"] = projector.window
    merger = make_merger(config.merger, alpha=config.alpha, beta=config.beta, projector=config.projector,
                         weight=correction.weight, clip=correction.clip, **options)
    if not merger.needs_anchor:
        return None
    warmup = "la_warmup" if config.warmup_ticks > 0 else "none"  # 0 ticks of la_warmup is no warm-up
    schedule = AnchorSchedule(config.latency, config.cadence, warmup, config.warmup_ticks)
    relay = SignRelay(config.beta) if config.placement == "sampler" else None
    return Anchor(merger, AnchorCircuit(schedule), relay)


def _nonzero(tensors: Sequence[Tensor]) -> bool:
    """Whether any of ``tensors`` has a nonzero entry (a batch whose advantages are all 0 has none)."""
    return any(bool(t.any()) for t in tensors)


def _to_cpu(value: Any) -> Any:
    """Checkpoint tensors on CPU so that a run resumes on any device."""
    if isinstance(value, Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


__all__ = ["Anchor", "AnchorDelivery", "build_anchor"]
