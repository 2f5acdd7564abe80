"""Pipeline x data parallel: R replicas of an S-stage pipeline on a ``("dp", "pp")`` DeviceMesh.

No Lightning here. ``W = R x S`` processes (``trainer.devices x trainer.num_nodes = pipeline.stages
x pipeline.replicas``). Global rank ``g`` runs stage ``p = g // R`` of replica ``d = g % R``
(:class:`MeshShape`): the R copies of a stage are consecutive ranks. torchrun and SLURM number
ranks node by node, so with R processes per node each node holds one stage of every replica:
the gradient all-reduce of a stage (the ``dp`` dimension) stays inside a node, and the link
between nodes carries the pipeline boundary (the ``pp`` dimension, ``wire/*``), which is the
traffic the codecs shrink.

What a replicated step does (:class:`~tclightning.pipeline.backends.PipelineBackend` with a
:class:`ReplicaMesh`; the update loop is still ``tclightning.grpo.update``):

* rank 0 samples every rollout of the step (one sampler, the one-process seed: the same rows as
  one process) and broadcasts them to all W ranks;
* each forward/backward's B rows are split into R contiguous shares (:func:`replica_rows`);
  replica d runs share d through its own pipeline. The loss of a share is divided by the whole
  minibatch's denominators (``MicrobatchLoss``), so the replicas' gradients *sum* to the
  one-process gradient of the minibatch: the ``dp`` all-reduce (a sum, i.e. the mean of R
  gradients each scaled by R) makes every replica's gradient that one gradient;
* the last stage's log-probs and loss statistics are assembled the same way (small sums over the
  last stage's ``dp`` group), so every last-stage rank computes the same metrics;
* the anchor's dense ``M`` is split and summed alike, so the merge, applied after the ``dp``
  sum, sees the same ``M`` and gradient on every replica; replicas stay bitwise equal, and
  checkpoints take replica 0's state only.

Every byte handed to a ``dp`` collective is counted (:class:`DpMeter`, ``dp/*`` metrics).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tclightning.errors import TclightningError
from tclightning.pipeline.comm import StageComm

DP_KINDS = ("grad", "anchor", "aux")
"""What a ``dp`` collective carries: the update's gradients, the anchor's ``M``, or log-probs and
loss statistics of the last stage (``aux``)."""


@dataclass(frozen=True)
class MeshShape:
    """``replicas`` x ``stages`` ranks; rank ``g`` is stage ``g // replicas`` of replica ``g % replicas``."""

    replicas: int
    stages: int

    @property
    def world_size(self) -> int:
        return self.replicas * self.stages

    def rank(self, replica: int, stage: int) -> int:
        """Global rank of ``stage`` in ``replica``."""
        return stage * self.replicas + replica

    def coords(self, rank: int) -> tuple[int, int]:
        """``(replica, stage)`` of global rank ``rank``."""
        return rank % self.replicas, rank // self.replicas

    def grid(self) -> Tensor:
        """The DeviceMesh's rank grid, ``[replicas, stages]`` (``grid[d, p] = rank(d, p)``)."""
        return torch.arange(self.world_size).reshape(self.stages, self.replicas).T.contiguous()

    @classmethod
    def for_world(cls, world_size: int, replicas: int) -> MeshShape:
        """The shape of ``world_size`` processes with ``replicas`` copies of each stage (raises
        ``TclightningError`` naming the keys when they do not divide)."""
        if replicas < 1:
            raise TclightningError(f"pipeline.replicas must be >= 1, got {replicas}")
        if world_size % replicas or world_size // replicas < 2:
            raise TclightningError(
                f"pipeline.replicas={replicas} with trainer.devices x trainer.num_nodes = {world_size}: the processes "
                "must be pipeline.stages x pipeline.replicas with at least 2 stages (e.g. 4 processes = 2 stages "
                "x 2 replicas)"
            )
        return cls(replicas, world_size // replicas)


def replica_rows(rows: int, replicas: int, replica: int) -> Tensor:
    """Row indices of ``replica``'s share of a batch of ``rows`` rows: R contiguous, near-equal
    parts (``torch.tensor_split``; a share is empty when ``rows < replicas``)."""
    return torch.tensor_split(torch.arange(rows), replicas)[replica]


@dataclass
class DpMeter:
    """Bytes this rank handed to ``dp`` collectives since the last :meth:`reset`, by kind."""

    sent: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DP_KINDS, 0))
    calls: int = 0

    def record(self, kind: str, nbytes: int) -> None:
        self.sent[kind] += int(nbytes)
        self.calls += 1

    def reset(self) -> None:
        self.sent = dict.fromkeys(DP_KINDS, 0)
        self.calls = 0


def dp_metrics(sent: dict[str, float], calls: float, replicas: int) -> dict[str, float]:
    """``dp/*`` from the meters of every rank, summed: ``dp/bytes`` (all), ``dp/grad_bytes``,
    ``dp/anchor_bytes``, ``dp/messages`` and ``dp/replicas``."""
    return {
        "dp/bytes": float(sum(sent.values())),
        "dp/grad_bytes": float(sent["grad"]),
        "dp/anchor_bytes": float(sent["anchor"]),
        "dp/messages": float(calls),
        "dp/replicas": float(replicas),
    }


class ReplicaMesh:
    """This rank's place in the ``("dp", "pp")`` DeviceMesh of the default process group.

    ``pp_group``: this replica's pipeline (the engine's group); ``dp``: the ``StageComm`` of this
    stage's replicas; ``world``: the default group (the sampler's broadcast, agreed verdicts);
    ``tie_group``: this replica's ``[first, last]`` ranks for a tied embedding (None with 2 stages,
    where it is the pipeline's own group). Every rank must build it at the same point."""

    def __init__(self, replicas: int, *, device: torch.device | str = "cpu", timeout_s: float = 300.0) -> None:
        from torch.distributed.device_mesh import DeviceMesh

        if not dist.is_initialized():
            raise TclightningError("pipeline.replicas needs torch.distributed initialised (launch with devices > 1)")
        device = torch.device(device)
        self.shape = MeshShape.for_world(dist.get_world_size(), replicas)
        self.replica, self.stage = self.shape.coords(dist.get_rank())
        self.device_mesh = DeviceMesh(device.type, self.shape.grid(), mesh_dim_names=("dp", "pp"))
        self.pp_group = self.device_mesh.get_group("pp")
        self.dp = StageComm(self.device_mesh.get_group("dp"), device, timeout_s)
        self.world = StageComm(None, device, timeout_s)
        self.tie_group = None
        if self.shape.stages > 2:  # dist.new_group is collective: every rank makes every replica's
            for replica in range(replicas):
                ranks = [self.shape.rank(replica, 0), self.shape.rank(replica, self.shape.stages - 1)]
                group = dist.new_group(ranks)
                if replica == self.replica:
                    self.tie_group = group
        self.meter = DpMeter()

    @property
    def replicas(self) -> int:
        return self.shape.replicas

    @property
    def world_size(self) -> int:
        return self.shape.world_size

    def rows(self, count: int) -> Tensor:
        """This replica's share of ``count`` rows (:func:`replica_rows`)."""
        return replica_rows(count, self.replicas, self.replica)

    def all_reduce(self, tensor: Tensor, kind: str, what: str) -> Tensor:
        """``tensor`` summed over this stage's replicas; its bytes counted as ``kind``."""
        self.meter.record(kind, tensor.numel() * tensor.element_size())
        return self.dp.all_reduce(tensor, what)

    def sum_gradients_(self, params: list[nn.Parameter], kind: str, what: str) -> None:
        """Every ``param.grad`` summed over the replicas, in place, in one flat message (a
        parameter keeps ``grad=None`` only when no replica produced one, as one process would)."""
        if not params:
            return
        present = torch.tensor([p.grad is not None for p in params], dtype=params[0].dtype, device=params[0].device)
        *grads, flags = self.sum_tensors(
            [p.grad if p.grad is not None else torch.zeros_like(p) for p in params] + [present], kind, what)
        for param, grad, flag in zip(params, grads, flags.tolist(), strict=True):
            if flag > 0:
                param.grad = grad

    def sum_tensors(self, tensors: list[Tensor], kind: str, what: str) -> list[Tensor]:
        """Each tensor summed over the replicas (one flat message); new tensors, same shapes."""
        if not tensors:
            return []
        flat = self.all_reduce(torch.cat([t.reshape(-1) for t in tensors]), kind, what)
        out, offset = [], 0
        for tensor in tensors:
            out.append(flat[offset : offset + tensor.numel()].view_as(tensor).clone())
            offset += tensor.numel()
        return out

    def metrics(self) -> dict[str, float]:
        """``dp/*`` of this step, summed over every rank (one small all-reduce of the world)."""
        counts = torch.tensor([*(self.meter.sent[k] for k in DP_KINDS), self.meter.calls], dtype=torch.float64)
        counts = self.world.all_reduce(counts, "summing the dp counters")
        return dp_metrics(dict(zip(DP_KINDS, counts.tolist())), float(counts[-1]), self.replicas)

    @torch.no_grad()
    def broadcast_weights(self, model: nn.Module) -> None:
        """Global rank 0's weights to every rank of every replica (once at start-up)."""
        tensors = [t for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()]
        self.world.broadcast_tensors_(tensors, 0, "receiving the initial weights from rank 0",
                                      "the initial weight broadcast")


__all__ = ["DP_KINDS", "DpMeter", "MeshShape", "ReplicaMesh", "dp_metrics", "replica_rows"]
