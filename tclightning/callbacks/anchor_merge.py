"""``AnchorMerge``: fold the late dense anchor gradient into the parameter gradients before each step.

Works with any LightningModule that implements :class:`AnchorSource` (see ``docs/anchor.md``)::

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

The callback is glue over :class:`tclightning.anchor.anchor.Anchor` (the merge side of it). The
``GRPOModule`` does not need it: its update loop merges its own ``Anchor`` before each step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn

from tclightning.anchor.anchor import Anchor, AnchorDelivery, Reduce
from tclightning.anchor.mergers import Merger, make_merger
from tclightning.errors import TclightningError

__all__ = ["AnchorDelivery", "AnchorMerge", "AnchorSource"]


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
    """Apply the merger (``none``, ``signed_ema``) to the module's gradients before each step.

    Args:
        merger: a merger name or a :class:`~tclightning.anchor.mergers.Merger`.
        alpha: ``signed_ema`` correction weight: ``G = alpha G_comp + (1-alpha) |G_comp| sign(M_hat)``
            (0.25, stable in the original experiments; docs/anchor.md).
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
        merger = merger if isinstance(merger, Merger) else make_merger(
            merger, alpha=alpha, beta=beta, projector=projector, **dict(projector_options or {})
        )
        self.anchor = Anchor(merger)  # the merge state; the module computes and delivers M
        self.log_metrics = log

    @property
    def state_key(self) -> str:
        return "AnchorMerge"

    @property
    def merger(self) -> Merger:
        return self.anchor.merger

    @property
    def ticks(self) -> int:
        """Optimizer ticks merged (all time)."""
        return self.anchor.ticks

    @property
    def anchors(self) -> int:
        """Anchor gradients received (all time)."""
        return self.anchor.anchors

    # ----------------------------------------------------------------------------- hooks
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if isinstance(getattr(pl_module, "anchor", None), Anchor):
            raise TclightningError(
                f"{type(pl_module).__name__} merges its own anchor (the recipe's anchor section); "
                "remove the AnchorMerge callback"
            )
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
        if params:
            self.anchor.merge_(params, int(trainer.global_step), source.pop_anchor_gradient())

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self.log_metrics:
            self.anchor.step_agreement()  # a fresh start for the next step
            return
        metrics: dict[str, float] = {}
        agreement = self.anchor.step_agreement(_reducer(trainer))
        if agreement is not None:
            metrics["anchor/sign_agreement"] = agreement
        extra = getattr(pl_module, "anchor_metrics", None)
        if callable(extra):
            metrics.update({k: float(v) for k, v in extra().items()})
        if metrics:
            pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)

    # ----------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return self.anchor.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.anchor.load_state_dict(state_dict)


def _reducer(trainer: pl.Trainer) -> Reduce | None:
    """With several processes each rank measured its own parameters: sum over ranks."""
    if trainer.world_size == 1:
        return None
    strategy = trainer.strategy
    return lambda counts: strategy.reduce(counts.to(strategy.root_device), reduce_op="sum").cpu()
