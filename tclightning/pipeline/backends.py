"""The two implementations of :class:`tclightning.backend.Backend` (no Lightning here).

* :class:`LocalBackend` -- one process holds the whole policy. The cuts, when a one-process
  ``PipelineStrategy`` installed a :class:`~tclightning.pipeline.cuts.CutSet`, run in-graph as
  hooks; without one the policy is dense. The loss function is called once with every row.
* :class:`PipelineBackend` -- one stage per process over a
  :class:`~tclightning.pipeline.engine.PipelineEngine`. Rank 0 also holds a dense copy of the whole
  policy and samples; the last rank computes the loss, per micro-batch.

The only fork between the two is how a forward/backward (and the dense one at a snapshot) runs;
the update loop that uses them is written once (``tclightning.grpo.update``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from tclightning.backend import BackendRequest, LossFn
from tclightning.pipeline.cuts import CutSet, hook_free_copy
from tclightning.pipeline.engine import PipelineEngine, StageInputs

T = TypeVar("T")


class LocalBackend:
    """The whole policy in this process (see the module doc); ``cuts``: the installed cuts, if any."""

    world_size = 1
    has_loss = True
    microbatched = False

    def __init__(self, request: BackendRequest, cuts: CutSet | None = None) -> None:
        self.policy = request.policy
        self.temperature = request.temperature
        self._logprobs = request.logprobs
        self._backward = request.backward
        self.cuts = cuts
        self._clone: nn.Module | None = None  # the dense copy for dense_forward_backward, built once

    @property
    def device(self) -> torch.device:
        return next(self.policy.parameters()).device

    def begin_step(self, step: int) -> None:
        if self.cuts is not None:
            self.cuts.set_step(step)
            self.cuts.reset_stats()

    def dense(self) -> contextlib.AbstractContextManager[None]:
        return self.cuts.bypassed() if self.cuts is not None else contextlib.nullcontext()

    def share_from_sampler(self, make: Callable[[], T], what: str) -> T:
        return make()

    def logprobs(self, rollouts: Any, *, with_entropy: bool = False) -> tuple[Tensor | None, Tensor | None]:
        with torch.no_grad():
            return self._logprobs(self.policy, rollouts, self.temperature, with_entropy=with_entropy)

    def forward_backward(
        self, rollouts: Any, loss_fn: LossFn, *, with_entropy: bool = False
    ) -> tuple[Tensor | None, Tensor | None]:
        logp, entropy = self._logprobs(self.policy, rollouts, self.temperature, with_entropy=with_entropy)
        self._backward(loss_fn(logp, torch.arange(logp.shape[0])))
        return logp.detach(), entropy

    def clip_gradients(self, max_norm: float) -> Tensor:
        return torch.nn.utils.clip_grad_norm_(self.policy.parameters(), max_norm)

    def reduce_sum(self, tensor: Tensor, what: str) -> Tensor:
        return tensor

    def owned_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.policy.parameters() if p.requires_grad]

    def dense_forward_backward(
        self, snapshot: Sequence[Tensor], rollouts: Any, loss_fn: LossFn
    ) -> tuple[list[Tensor], float]:
        """On a hook-free copy of the policy (built once; the snapshot defines its weights)."""
        if self._clone is None:
            self._clone = hook_free_copy(self.policy).train()
        clone = self._clone
        params = [p for p in clone.parameters() if p.requires_grad]
        with torch.no_grad():
            for param, weight in zip(params, snapshot, strict=True):
                param.copy_(weight)
        clone.zero_grad(set_to_none=True)
        logp, _ = self._logprobs(clone, rollouts, self.temperature)
        loss_fn(logp, torch.arange(logp.shape[0])).backward()
        sent = 0.0
        if self.cuts is not None:  # the dense boundary's traffic, forward and backward, across every cut
            element = next(clone.parameters()).element_size()
            sent = 2 * float(rollouts.completion_mask.sum() + rollouts.prompt_mask.sum()) * (
                self.cuts.dim * element * len(self.cuts.specs))
        return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in params], sent

    def after_update(self) -> None:
        """The sampler samples from this very policy: nothing to send."""

    def share_metrics(self, metrics: dict[str, float] | None) -> dict[str, float]:
        assert metrics is not None
        return metrics

    def wire_metrics(self) -> dict[str, float]:
        return self.cuts.metrics() if self.cuts is not None else {}

    def gather_per_rank(self, state: Any, what: str) -> Any:
        return state

    def codec_state(self) -> dict[str, Any] | None:
        return self.cuts.state_dict() if self.cuts is not None else None

    def load_codec_state(self, state: dict[str, Any]) -> None:
        if self.cuts is not None:
            self.cuts.load_state_dict(state)


class PipelineBackend:
    """This rank's stage over ``engine`` (see the module doc); ``request.policy`` is the model the
    engine was built on (rank 0's dense copy samples; every rank's stage shares its tensors)."""

    microbatched = True

    def __init__(self, request: BackendRequest, engine: PipelineEngine) -> None:
        self.engine = engine
        self.world_size = engine.world_size
        engine.set_temperature(request.temperature)  # the last stage's log-probs use the sampler's

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def has_loss(self) -> bool:
        return self.engine.is_last

    def begin_step(self, step: int) -> None:
        self.engine.set_step(step)
        self.engine.reset_stats()

    @contextlib.contextmanager
    def dense(self) -> Iterator[None]:
        """Rank 0's dense copy has no codecs installed: sampling is dense as it is."""
        yield

    def share_from_sampler(self, make: Callable[[], T], what: str) -> T:
        """Rank 0 runs ``make()``; the result travels as a CPU pickle (tensors and ``Rollouts``)."""
        payload = _to_cpu(make()) if self.engine.is_first else None
        return self.engine.comm.broadcast_object(payload, 0, what)

    def logprobs(self, rollouts: Any, *, with_entropy: bool = False) -> tuple[Tensor | None, Tensor | None]:
        return self.engine.run(StageInputs.from_rollouts(rollouts), with_entropy=with_entropy)

    def forward_backward(
        self, rollouts: Any, loss_fn: LossFn, *, with_entropy: bool = False
    ) -> tuple[Tensor | None, Tensor | None]:
        # loss_fn is called on the last rank only; the schedule needs one on every rank to run backward
        return self.engine.run(StageInputs.from_rollouts(rollouts), loss_fn, with_entropy=with_entropy)

    def clip_gradients(self, max_norm: float) -> Tensor:
        self.engine.reduce_tied_gradients()
        return self.engine.clip_gradients(max_norm)

    def reduce_sum(self, tensor: Tensor, what: str) -> Tensor:
        return self.engine.comm.all_reduce(tensor, what)

    def owned_parameters(self) -> list[nn.Parameter]:
        return self.engine.owned_parameters()

    def dense_forward_backward(
        self, snapshot: Sequence[Tensor], rollouts: Any, loss_fn: LossFn
    ) -> tuple[list[Tensor], float]:
        """Through the pipeline over the dense boundary (:meth:`PipelineEngine.dense_gradient`)."""
        return self.engine.dense_gradient(list(snapshot), StageInputs.from_rollouts(rollouts), loss_fn)

    def after_update(self) -> None:
        """Every stage's new weights to rank 0, whose dense copy samples the next step."""
        self.engine.sync_to_sampler()

    def share_metrics(self, metrics: dict[str, float] | None) -> dict[str, float]:
        return self.engine.comm.broadcast_object(metrics if self.engine.is_last else None, self.world_size - 1,
                                                 "sharing the step's metrics")

    def wire_metrics(self) -> dict[str, float]:
        return self.engine.metrics()

    def gather_per_rank(self, state: Any, what: str) -> Any:
        gathered = self.engine.comm.gather_objects(state, what)
        return None if gathered is None else {"per_rank": gathered}

    def codec_state(self) -> dict[str, Any] | None:
        return self.engine.cut_state_dict()

    def load_codec_state(self, state: dict[str, Any]) -> None:
        self.engine.load_cut_state_dict(state)


def _to_cpu(value: Any) -> Any:
    """Tensors, and objects with a ``to`` method (``Rollouts``), on CPU; tuples item by item."""
    if isinstance(value, tuple):
        return tuple(_to_cpu(item) for item in value)
    to = getattr(value, "to", None)
    return to(torch.device("cpu")) if callable(to) else value
