"""The anchor circuit's bookkeeping: when to snapshot, what to keep, when to deliver.

Pure logic (no Lightning, no model): the module that owns the policy does the compute.
Ticks are optimizer ticks (``epochs x minibatches`` per RL step in GRPO), numbered from 0.

* :class:`AnchorSchedule` gives the latency ``K`` and cadence ``C`` in force at each tick: fixed
  ``K/C`` or the ``la_warmup`` ramp of the ``LA-WARMUP-V2`` recipe.
* :class:`AnchorCircuit` records a job every ``C`` ticks — the tick ``t0``, the weight snapshot
  ``theta(t0)`` and the rollouts those weights generated (opaque payload) — and hands it back at
  tick ``t0 + K`` (``K`` and ``C`` as scheduled at ``t0``). The caller computes the dense anchor
  gradient ``M`` of the job (a hook-free dense clone loaded with the snapshot, on the job's
  rollouts: paired replay) and gives it to the merger.

Per tick the caller does, in this order::

    circuit.maybe_record(tick, snapshot_fn, payload)   # before the tick's update
    for job in circuit.due(tick): ...                  # compute M(job), hand it over

**Memory bound.** A job is pending from its record tick ``t0`` until ``due(t0 + K)``. With a fixed
schedule, records are ``C`` ticks apart, so between ``maybe_record`` and ``due`` of one tick the
pending jobs are those with ``t0`` in ``[t - K, t]``: at most ``floor(K / C) + 1`` (snapshots +
payloads; ``<= ceil(K / C) + 1``), and at most ``ceil(K / C)`` after ``due``. 5/5 and 20/20 hold
2 snapshots, 7/3 holds 3, K=0 holds 1 (delivered on its own tick). Under ``la_warmup`` the bound is
the largest ``floor(K_j / C_j) + 1`` over the stages (``memory_bound()``): ``K`` and ``C`` only grow,
so a job of an earlier stage is due no later than the jobs recorded after it.
Nothing else is kept: a delivered job is forgotten by the circuit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from tclightning.errors import TclightningError

WARMUPS = ("none", "la_warmup")


@dataclass(frozen=True)
class Stage:
    """From tick ``start`` on (until the next stage), latency ``latency`` and cadence ``cadence``."""

    start: int
    latency: int
    cadence: int


@dataclass(frozen=True)
class AnchorSchedule:
    """Latency ``K`` and cadence ``C`` per optimizer tick.

    ``warmup="none"``: ``K = latency``, ``C = cadence`` at every tick ("5/5", "20/20").

    ``warmup="la_warmup"`` (``LA-WARMUP-V2``): the anchor starts fresh and steps up to the final
    ``latency/cadence`` over ``warmup_ticks`` ticks, in stages:

    * stage latencies ``K_j = min(2**j, K)`` for ``j = 0, 1, ...`` until ``K`` is reached
      (20 → 1, 2, 4, 8, 16, 20);
    * cadence keeps the final ratio: ``C_j = max(1, round(K_j * C / K))``; stage 0 is always
      ``K=1, C=1`` (one tick late, every tick).
    * the ``n - 1`` warm-up stages split ``[0, warmup_ticks)`` evenly: stage ``j`` starts at tick
      ``floor(j * warmup_ticks / (n - 1))``; the final stage ``K/C`` starts at ``warmup_ticks``.

    So 20/20 over 100 ticks: K/C = 1/1 on ticks 0-19, 2/2 on 20-39, 4/4 on 40-59, 8/8 on 60-79,
    16/16 on 80-99, 20/20 from 100 on.
    """

    latency: int = 5
    cadence: int = 5
    warmup: str = "none"
    warmup_ticks: int = 100

    def __post_init__(self) -> None:
        if self.latency < 0:
            raise TclightningError(f"anchor latency K must be >= 0 ticks, got {self.latency}")
        if self.cadence < 1:
            raise TclightningError(f"anchor cadence C must be >= 1 tick, got {self.cadence}")
        if self.warmup not in WARMUPS:
            raise TclightningError(f"unknown anchor warm-up {self.warmup!r}; choose one of {', '.join(WARMUPS)}")
        if self.warmup == "la_warmup":
            if self.warmup_ticks < 0:
                raise TclightningError(f"la_warmup: warmup_ticks must be >= 0, got {self.warmup_ticks}")

    def stages(self) -> list[Stage]:
        """The stages in order (one stage without warm-up); the last one is the final ``K/C``."""
        final = Stage(0, self.latency, self.cadence)
        if self.warmup == "none" or self.warmup_ticks == 0 or self.latency <= 1:
            return [final]
        lats = [1]
        while lats[-1] < self.latency:
            lats.append(min(2 * lats[-1], self.latency))
        ramp = lats[:-1]  # the final latency is the last stage
        stages = []
        for j, k in enumerate(ramp):
            cadence = 1 if j == 0 else max(1, round(k * self.cadence / self.latency))
            stages.append(Stage(j * self.warmup_ticks // len(ramp), k, cadence))
        stages.append(Stage(self.warmup_ticks, self.latency, self.cadence))
        return stages

    def at(self, tick: int) -> tuple[int, int]:
        """``(K, C)`` in force at ``tick``."""
        current = None
        for stage in self.stages():
            if stage.start <= tick:
                current = stage
        assert current is not None
        return current.latency, current.cadence

    def latency_at(self, tick: int) -> int:
        return self.at(tick)[0]

    def cadence_at(self, tick: int) -> int:
        return self.at(tick)[1]

    def memory_bound(self) -> int:
        """Most jobs ever pending: ``max_j floor(K_j / C_j) + 1`` over the stages (module doc)."""
        return max(s.latency // s.cadence + 1 for s in self.stages())


@dataclass
class AnchorJob:
    """One unit of anchor work: the snapshot ``theta(tick)`` and the rollouts it generated.

    ``due_tick = tick + latency``: the tick whose update first uses this job's ``M``.
    """

    tick: int
    due_tick: int
    latency: int
    cadence: int
    snapshot: list[Tensor]
    payload: Any = None

    def to_state(self) -> dict[str, Any]:
        # Not dataclasses.asdict: it deep-copies the payload, which is the caller's business.
        return {
            "tick": self.tick, "due_tick": self.due_tick, "latency": self.latency, "cadence": self.cadence,
            "snapshot": [t.detach().clone() for t in self.snapshot], "payload": self.payload,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> AnchorJob:
        return cls(
            tick=int(state["tick"]), due_tick=int(state["due_tick"]), latency=int(state["latency"]),
            cadence=int(state["cadence"]), snapshot=[t.clone() for t in state["snapshot"]], payload=state.get("payload"),
        )


def cpu_snapshot(params: Sequence[Tensor]) -> list[Tensor]:
    """Detached CPU copies of ``params`` (what a job's snapshot usually is)."""
    return [p.detach().to("cpu", copy=True) for p in params]


@dataclass
class AnchorCircuit:
    """Records anchor jobs every ``C`` ticks and delivers each ``K`` ticks later (see the module doc).

    Counters: ``recorded``, ``delivered``, ``len(pending)``; ``metrics(tick)`` gives the canonical
    ``anchor/latency`` and ``anchor/cadence`` in force at ``tick``.
    """

    schedule: AnchorSchedule = field(default_factory=AnchorSchedule)
    pending: list[AnchorJob] = field(default_factory=list)
    last_record_tick: int | None = None
    recorded: int = 0
    delivered: int = 0

    def should_record(self, tick: int) -> bool:
        """True when ``tick`` starts a new job: the first tick, then ``C(tick)`` ticks after the last record."""
        if self.last_record_tick is None:
            return True
        return tick - self.last_record_tick >= self.schedule.cadence_at(tick)

    def maybe_record(
        self, tick: int, snapshot_fn: Callable[[], Sequence[Tensor]], payload: Any = None,
    ) -> AnchorJob | None:
        """Record a job at ``tick`` if the cadence says so (``snapshot_fn`` is only called then).

        ``snapshot_fn()`` returns the weights that generated ``payload`` (e.g. :func:`cpu_snapshot`
        of the policy's parameters at the start of the tick); the circuit stores what it returns.
        """
        if not self.should_record(tick):
            return None
        latency, cadence = self.schedule.at(tick)
        job = AnchorJob(tick, tick + latency, latency, cadence, list(snapshot_fn()), payload)
        self.pending.append(job)
        self.last_record_tick = tick
        self.recorded += 1
        return job

    def due(self, tick: int) -> list[AnchorJob]:
        """Pop and return the jobs with ``due_tick <= tick`` (oldest first); normally ``due_tick == tick``."""
        ready = [job for job in self.pending if job.due_tick <= tick]
        if ready:
            self.pending = [job for job in self.pending if job.due_tick > tick]
            self.delivered += len(ready)
        return sorted(ready, key=lambda job: job.tick)

    def memory_bound(self) -> int:
        """The most jobs that can be pending at once (``AnchorSchedule.memory_bound``)."""
        return self.schedule.memory_bound()

    def metrics(self, tick: int) -> dict[str, float]:
        """``anchor/latency`` and ``anchor/cadence`` in force at ``tick``."""
        latency, cadence = self.schedule.at(tick)
        return {"anchor/latency": float(latency), "anchor/cadence": float(cadence)}

    def state_dict(self) -> dict[str, Any]:
        """Pending jobs (snapshot tensors and payloads included), the last record tick, the counters
        (not the schedule: the recipe's, or an anchor controller's, which saves its own decisions)."""
        return {
            "pending": [job.to_state() for job in self.pending],
            "last_record_tick": self.last_record_tick,
            "recorded": self.recorded,
            "delivered": self.delivered,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the pending work exactly; the schedule stays the constructor's (a recipe may change it).
        ``TclightningError`` (one line) for a state that is not one :meth:`state_dict` writes; whether
        each job fits the model is checked when it is due (:func:`~tclightning.anchor.anchor.refuse_unfit_job`)."""
        try:
            pending = [AnchorJob.from_state(job) for job in state.get("pending", [])]
            last = state.get("last_record_tick")
            last_record_tick = None if last is None else int(last)
            recorded, delivered = int(state.get("recorded", 0)), int(state.get("delivered", 0))
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise TclightningError(f"the checkpoint's anchor circuit state is not one tclightning writes "
                                   f"({type(err).__name__}: {' '.join(str(err).split())[:120]}); resume with the "
                                   "recipe that saved it") from None
        problem = _schedule_problem(pending, last_record_tick)
        if problem is not None:
            raise TclightningError(f"the checkpoint's anchor circuit state is not one tclightning writes ({problem}); "
                                   "resume with the recipe that saved it")
        self.pending, self.last_record_tick, self.recorded, self.delivered = pending, last_record_tick, recorded, delivered


def _schedule_problem(pending: Sequence[AnchorJob], last_record_tick: int | None) -> str | None:
    """What no run writes in ``pending`` jobs: a job due other than ``latency`` ticks after it was
    recorded (never delivered, or delivered at once), a negative latency or a cadence below 1, two
    jobs of one tick (delivered twice), or a job recorded after the last record tick."""
    ticks = [job.tick for job in pending]
    for job in pending:
        if job.latency < 0 or job.cadence < 1 or job.tick < 0 or job.due_tick != job.tick + job.latency:
            return (f"the job of tick {job.tick} has latency {job.latency}, cadence {job.cadence} and is due at tick "
                    f"{job.due_tick}")
        if last_record_tick is None or job.tick > last_record_tick:
            return f"the job of tick {job.tick} was recorded after the last record tick {last_record_tick}"
    if len(set(ticks)) < len(ticks):
        return "two pending jobs of one tick"
    return None


def rank_share(state: Any, rank: int, world_size: int) -> Any:
    """This rank's part of a checkpointed anchor state (circuit or merger).

    With one pipeline stage per process each rank keeps the anchor state of its own stage, and
    the checkpoint holds ``{"per_rank": [state of rank 0, rank 1, ...]}``; one process keeps the
    plain state. The two do not convert into each other (their tensors cover different
    parameters), so a mismatch is refused, naming what to change."""
    shares = state.get("per_rank") if isinstance(state, dict) else None
    if shares is None and world_size == 1:
        return state
    saved = 1 if shares is None else len(shares)
    if saved != world_size:
        raise TclightningError(
            f"the checkpoint's anchor state was saved by {saved} process(es) but this run has {world_size}: "
            f"resume with trainer.devices x trainer.num_nodes = {saved} (each rank holds its own stage's "
            "anchor snapshots and M_bar)"
        )
    return shares[rank]


__all__ = ["WARMUPS", "AnchorCircuit", "AnchorJob", "AnchorSchedule", "Stage", "cpu_snapshot", "rank_share"]
