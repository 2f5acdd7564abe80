"""``AnchorMerge``: fold the late dense anchor gradient into the parameter gradients before each step.

Works with any LightningModule that implements :class:`AnchorSource` (the GRPO module does; a
plain module can too, see ``docs/anchor.md``)::

    class MyModule(L.LightningModule):
        def anchor_parameters(self) -> list[nn.Parameter]:   # the parameters G_comp and M cover
            return list(self.parameters())
        def pop_anchor_gradient(self) -> list[Tensor] | AnchorDelivery | None:
            return self._new_m and self._new_m.pop()          # newest delivered M, else None

At every optimizer tick (``on_before_optimizer_step``, i.e. after backward and — with manual
optimisation — after your own clipping, just before ``optimizer.step()``) the callback:

1. hands the weights to the projector (``rank1`` keeps a trajectory of them);
2. pops the anchor gradient; a new one updates ``M_bar`` (``M_bar <- beta M_bar + (1-beta) M``);
3. measures ``sign(G_comp) == sign(M_bar)`` (the ``anchor/sign_agreement`` of this tick);
4. overwrites each ``p.grad`` of the anchor parameters with the merged ``G`` (parameters without a
   gradient this tick are left alone).

With automatic optimisation Lightning calls this hook *before* its own gradient clipping
(``gradient_clip_val``); the ``signed_ema`` merge never grows a coordinate, so either order is safe.

The tick is ``trainer.global_step`` at the hook (optimizer steps completed so far; several per RL
step in GRPO). ``AnchorDelivery.snapshot_tick`` must use the same clock.

Logging: a training step may run several optimizer ticks, and ``self.log`` from
``on_before_optimizer_step`` keeps only the last value of the step. So the callback collects the
per-tick sign agreement and logs its mean over the ticks of the RL step from
``on_train_batch_end`` (``on_step=True``): one value per row of metrics.csv. It is not logged
before the first ``M`` arrives. If the module has ``anchor_metrics() -> Mapping[str, float]``
(e.g. ``AnchorCircuit.metrics`` plus ``anchor/bytes``), those are logged at the same place.

State (``M_bar``, the projector's state, the pending per-step average) is in
``state_dict()``/``load_state_dict()``, which Lightning saves in checkpoints and restores on resume.

Across processes (one pipeline stage per rank, ``docs/distributed.md``) each rank merges its own
stage's parameters with its own ``M_bar`` (the merge is per coordinate: no communication), the
checkpoint holds every rank's state, and ``anchor/sign_agreement`` is weighted over the ranks'
coordinates (a tied embedding, held by the first and the last rank, counts twice).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn

from tclightning.anchor.circuit import rank_share
from tclightning.anchor.mergers import Merger, make_merger
from tclightning.errors import TclightningError


@dataclass
class AnchorDelivery:
    """An anchor gradient with its timing: ``gradient`` (one tensor per anchor parameter) was
    computed at the weight snapshot of tick ``snapshot_tick`` (the projectors' clock)."""

    gradient: Sequence[Tensor]
    snapshot_tick: int | None = None


@runtime_checkable
class AnchorSource(Protocol):
    """What :class:`AnchorMerge` needs from the LightningModule.

    * ``anchor_parameters()``: the parameters the merge applies to, in a fixed order (the order
      of the tensors of every anchor gradient).
    * ``pop_anchor_gradient()``: the newest anchor gradient ``M`` delivered since the last call —
      a list of tensors shaped like ``anchor_parameters()`` or an :class:`AnchorDelivery` — or
      None when nothing new arrived. Called exactly once per optimizer tick; "pop" because the
      same ``M`` must not be folded into ``M_bar`` twice.

    Optional: ``anchor_metrics() -> Mapping[str, float]``, logged once per RL step.
    """

    def anchor_parameters(self) -> list[nn.Parameter]: ...

    def pop_anchor_gradient(self) -> Sequence[Tensor] | AnchorDelivery | None: ...


class AnchorMerge(Callback):
    """Apply the merger (``none``, ``dense``, ``signed_ema``) to the module's gradients before each step.

    Args:
        merger: a merger name or a :class:`~tclightning.anchor.mergers.Merger`.
        alpha: ``signed_ema`` correction weight: ``G = alpha G_comp + (1-alpha) |G_comp| sign(M_hat)``
            (0.25, the hub's stable winner).
        beta: ``signed_ema`` anchor memory: ``M_bar <- beta M_bar + (1-beta) M`` (0 = freshest).
        projector: ``none``, ``damped_linear`` or ``rank1`` (``M_hat = P(M_bar)``; docs/anchor.md).
        projector_options: keyword options of the projector (``gamma``, ``window``, ``every``...).
        log: log ``anchor/sign_agreement`` (and the module's ``anchor_metrics()``) per RL step.
    """

    def __init__(
        self,
        merger: str | Merger = "signed_ema",
        alpha: float = 0.25,
        beta: float = 0.0,
        projector: str = "none",
        projector_options: Mapping[str, Any] | None = None,
        log: bool = True,
    ) -> None:
        self.merger = merger if isinstance(merger, Merger) else make_merger(
            merger, alpha=alpha, beta=beta, projector=projector, **dict(projector_options or {})
        )
        self.log_metrics = log
        self.ticks = 0  # optimizer ticks merged (all time)
        self.anchors = 0  # anchor gradients received (all time)
        self._agreement: list[float] = []  # this RL step's per-tick sign agreement
        self._coordinates: list[int] = []  # ... and over how many coordinates each was measured
        self._device: torch.device | None = None  # where the merger's state lives
        self._trainer: pl.Trainer | None = None  # for the rank (per-rank state across processes)

    @property
    def state_key(self) -> str:
        return "AnchorMerge"

    # ----------------------------------------------------------------------------- hooks
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer
        if not isinstance(pl_module, AnchorSource):
            raise TclightningError(
                f"AnchorMerge needs the LightningModule to implement anchor_parameters() and "
                f"pop_anchor_gradient() (tclightning.callbacks.anchor_merge.AnchorSource); "
                f"{type(pl_module).__name__} does not"
            )

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        source: Any = pl_module
        params = list(source.anchor_parameters())
        if not params:
            return
        tick = int(trainer.global_step)
        self._place(params[0].device)
        projector = getattr(self.merger, "projector", None)
        if projector is not None:
            projector.observe_weights([p.detach() for p in params], tick)

        delivered = source.pop_anchor_gradient()
        if delivered is not None:
            grads, snapshot_tick = (
                (delivered.gradient, delivered.snapshot_tick) if isinstance(delivered, AnchorDelivery) else (delivered, None)
            )
            if len(grads) != len(params):
                raise TclightningError(
                    f"pop_anchor_gradient returned {len(grads)} tensors for {len(params)} anchor parameters"
                )
            self.merger.observe(list(grads), snapshot_tick=snapshot_tick, tick=tick)
            self.merger.to(params[0].device)  # M may have been computed elsewhere (a CPU clone)
            self.anchors += 1

        index = [i for i, p in enumerate(params) if p.grad is not None]
        if not index:
            return
        g_comp = [params[i].grad for i in index]
        with torch.no_grad():
            agreement = self.merger.sign_agreement(g_comp, index=index)
            if agreement is not None:
                self._agreement.append(agreement)
                self._coordinates.append(sum(g.numel() for g in g_comp))
            self.merger.merge_(g_comp, tick=tick, index=index)
        self.ticks += 1

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self.log_metrics:
            self._agreement.clear()
            return
        metrics: dict[str, float] = {}
        agreement = self._step_agreement(trainer)
        if agreement is not None:
            metrics["anchor/sign_agreement"] = agreement
        extra = getattr(pl_module, "anchor_metrics", None)
        if callable(extra):
            metrics.update({k: float(v) for k, v in extra().items()})
        self._agreement.clear()
        self._coordinates.clear()
        if metrics:
            pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)

    def _step_agreement(self, trainer: pl.Trainer) -> float | None:
        """Mean over the step's ticks of the tick's agreement. With several processes each rank
        measured its own parameters (one pipeline stage each): a tick's agreement is then the
        coordinate-weighted mean over ranks (one all-reduce; every rank calls this)."""
        if trainer.world_size == 1:
            return sum(self._agreement) / len(self._agreement) if self._agreement else None
        counts = torch.tensor([[a * n, n] for a, n in zip(self._agreement, self._coordinates)],
                              dtype=torch.float64).reshape(-1, 2)
        counts = trainer.strategy.reduce(counts.to(trainer.strategy.root_device), reduce_op="sum").cpu()
        if counts.numel() == 0:
            return None
        return float((counts[:, 0] / counts[:, 1].clamp(min=1)).mean())

    def _place(self, device: torch.device) -> None:
        if self._device != device:
            self._device = device
            self.merger.to(device)

    # ----------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """With one pipeline stage per process (a strategy with ``gather_per_rank``), every rank's
        state (its stage's ``M_bar``) gathered: ``{"per_rank": [...]}`` (collective)."""
        state = {
            "merger": _to_cpu(self.merger.state_dict()),
            "ticks": self.ticks,
            "anchors": self.anchors,
            "agreement": list(self._agreement),
            "coordinates": list(self._coordinates),
        }
        gather = getattr(self._trainer.strategy, "gather_per_rank", None) if self._trainer is not None else None
        return state if gather is None else gather(state, "gathering the anchor merger states")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        trainer = self._trainer
        rank, world_size = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        state_dict = rank_share(state_dict, rank, world_size)
        self.merger.load_state_dict(state_dict["merger"])
        self.ticks = int(state_dict.get("ticks", 0))
        self.anchors = int(state_dict.get("anchors", 0))
        self._agreement = [float(a) for a in state_dict.get("agreement", [])]
        self._coordinates = [int(n) for n in state_dict.get("coordinates", [1] * len(self._agreement))]
        self._device = None  # the state is on CPU now; moved to the parameters' device at the next tick


def _to_cpu(value: Any) -> Any:
    """Checkpoint tensors on CPU so that a run resumes on any device."""
    if isinstance(value, Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value
