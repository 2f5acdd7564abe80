"""The contract between the GRPO update and whatever runs the policy's forward and backward.

The update loop (:mod:`tclightning.grpo.update`) is written once; where the policy lives is a
:class:`Backend`. Two implement it (:mod:`tclightning.pipeline.backends`):

* ``LocalBackend``: one process, the whole policy here; the cuts (if a one-process
  ``PipelineStrategy`` installed them) run in-graph as hooks.
* ``PipelineBackend``: one pipeline stage per process over ``torch.distributed.pipelining``.

A LightningModule gets its backend from the strategy when the strategy is a
:class:`BackendProvider` (both pipeline strategies are), else it uses a ``LocalBackend`` with no
cuts. Nothing here imports Lightning, the pipeline or the algorithm: both sides import this.

Losses are passed in, torchtitan style: ``loss_fn(logp, rows) -> loss`` gets the completion
log-probs ``[b, Lc]`` of ``b`` rows of the batch and their indices ``rows`` ``[b]`` in it, and
returns that part's share of the batch loss (the shares sum to the batch loss). One process
calls it once with every row; the pipeline calls it per micro-batch on the last stage.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch
from torch import Tensor, nn

T = TypeVar("T")

LossFn = Callable[[Tensor, Tensor], Tensor]
"""``loss_fn(logp [b, Lc], rows [b]) -> scalar``: the loss share of rows ``rows`` of the batch."""

LogprobsFn = Callable[..., tuple[Tensor, Tensor | None]]
"""``logprobs(model, rollouts, temperature, with_entropy=False) -> (logp [B, Lc], entropy or None)``
(``tclightning.models.logprobs.completion_logps``)."""


@dataclass(frozen=True)
class BackendRequest:
    """What a module hands over to get its backend.

    ``policy``: the HF decoder being trained (the backend's parameters are its own).
    ``temperature``: the sampler's, for every log-prob (trainer and sampler see the same distribution).
    ``logprobs``: how the one-process backend computes completion log-probs (the pipeline's last
    stage mirrors it). ``backward``: ``loss -> None``, the trainer's backward (Lightning's
    ``manual_backward``, so precision plugins apply); used where the backward is not the
    pipeline schedule's own. ``sampler_dtype``: ``sampler.dtype`` -- the sampler generates from a
    copy of the policy in this dtype, kept exact by a sparse sync (``tclightning.weight_sync``);
    None: from the policy itself.
    """

    policy: nn.Module
    temperature: float
    logprobs: LogprobsFn
    backward: Callable[[Tensor], None]
    sampler_dtype: torch.dtype | None = None


@runtime_checkable
class Backend(Protocol):
    """The operations one GRPO update needs from where the policy runs.

    Collective operations (every rank calls them at the same point, in the same order) are
    marked so; with one process every operation is local. Rows are ``Rollouts`` batches
    (``tclightning.sampling.base``): anything with ``input_ids``, ``attention_mask``,
    ``position_ids``, ``completion_ids``, ``completion_mask``.
    """

    world_size: int
    """Processes that hold a part of the policy (1: the one-process backend)."""

    @property
    def device(self) -> torch.device:
        """Where this rank's loss inputs go (the last stage's device, or the policy's)."""
        ...

    @property
    def has_loss(self) -> bool:
        """This rank computes the loss, its statistics and the step's metrics (the last stage)."""
        ...

    @property
    def microbatched(self) -> bool:
        """``loss_fn`` sees the batch in micro-batches, one after the other (the pipeline), rather
        than once whole (one process): a loss term that needs the whole batch first must get it
        from a forward of its own."""
        ...

    def begin_step(self, step: int) -> None:
        """Start RL step ``step``: it is the PRF key's step at every cut for every forward of
        the step (stateful codecs fold in the last step's statistics on a change), and the wire
        counters start from zero. It is the only setter of the key: the module calls it once per
        RL step (for a module that never asks for a backend, the one-process ``PipelineStrategy``
        calls it on one of its own, once per optimizer tick)."""
        ...

    def dense(self) -> AbstractContextManager[None]:
        """Context in which the policy's own forward is dense (no codec): sampling runs in it."""
        ...

    def sampling_model(self) -> nn.Module:
        """The model the sampler generates with (on the sampling rank): the policy, or with
        ``sampler_dtype`` its copy in that dtype, bit-identical to the current weights cast to it."""
        ...

    def weights_loaded(self) -> None:
        """The policy's weights were replaced outside an update, the same on every rank (a
        rollback loads a checkpoint everywhere): the sampler's copy is rebuilt from them."""
        ...

    def share_from_sampler(self, make: Callable[[], T], what: str) -> T:
        """Collective: the sampling rank (rank 0) runs ``make()``; every rank gets its result
        (tensors, and objects with a ``to`` method such as ``Rollouts``, on CPU across processes).
        An exception in ``make`` ends the other ranks (they stop waiting, naming rank 0)."""
        ...

    def logprobs(self, rollouts: Any, *, with_entropy: bool = False) -> tuple[Tensor | None, Tensor | None]:
        """Collective, no grad: ``(logp [B, Lc], entropy [B, Lc] or None)`` through the cuts,
        on the rank that :attr:`has_loss` (``(None, None)`` elsewhere)."""
        ...

    def forward_backward(
        self, rollouts: Any, loss_fn: LossFn, *, with_entropy: bool = False
    ) -> tuple[Tensor | None, Tensor | None]:
        """Collective: forward through the cuts, ``loss_fn`` (see the module doc), backward;
        gradients accumulate into :meth:`owned_parameters`. Returns the detached ``logp`` and
        the entropy (if asked) on the rank that :attr:`has_loss`, ``(None, None)`` elsewhere."""
        ...

    def clip_gradients(self, max_norm: float) -> Tensor:
        """Collective: the global gradient norm (tied weights counted once, their gradient
        halves summed first) and ``clip_grad_norm_``'s scaling by it; the same on every rank."""
        ...

    def reduce_sum(self, tensor: Tensor, what: str) -> Tensor:
        """Collective: ``tensor`` summed over ranks (itself with one process)."""
        ...

    def owned_parameters(self) -> list[nn.Parameter]:
        """The parameters this rank trains, in a fixed order (the anchor's snapshots, ``M`` and merge cover them)."""
        ...

    def dense_forward_backward(
        self, snapshot: Sequence[Tensor], rollouts: Any, loss_fn: LossFn
    ) -> tuple[list[Tensor], float]:
        """Collective: the gradient of ``loss_fn`` at the weights ``snapshot`` (shaped like
        :meth:`owned_parameters`) on ``rollouts``, over a *dense* copy (no codec; the policy and
        its gradients are untouched). Returns ``(gradient per owned parameter, boundary bytes
        of the pass over every cut, both directions)``."""
        ...

    def after_update(self) -> None:
        """Collective: the step's updates are done; the sampler gets the new weights (with
        ``sampler_dtype``: only the entries that changed in that dtype)."""
        ...

    def share_metrics(self, metrics: dict[str, float] | None) -> dict[str, float]:
        """Collective: the metrics of the rank that :attr:`has_loss`, on every rank."""
        ...

    def wire_metrics(self) -> dict[str, float]:
        """Collective: ``wire/*`` of the sends since :meth:`begin_step` (empty without cuts or a
        sampler copy; in one process, what a split would send)."""
        ...

    def gather_per_rank(self, state: Any, what: str) -> Any:
        """Collective, for checkpoints: ``state`` with one process; across processes
        ``{"per_rank": [state of rank 0, rank 1, ...]}`` on rank 0 (None elsewhere)."""
        ...

    def codec_state(self) -> dict[str, Any] | None:
        """Collective, for checkpoints: the PRF step and every cut's receiver codec state
        (``CutSet.state_dict()`` layout; None without cuts, or on ranks other than 0)."""
        ...

    def load_codec_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`codec_state` returned (this rank's share of it)."""
        ...


@runtime_checkable
class CompressedAnchorBackend(Protocol):
    """A backend that can also run the *fast* (compressed) circuit at an anchor snapshot, which
    the ``control_variate`` merger needs. Optional: ``LocalBackend`` implements it; across
    processes the recipe check refuses ``control_variate``."""

    def compressed_forward_backward(
        self, snapshot: Sequence[Tensor], rollouts: Any, loss_fn: LossFn
    ) -> tuple[list[Tensor], float]:
        """The gradient of ``loss_fn`` at the weights ``snapshot`` through the cuts' codecs, as the
        fast circuit would compute it, without touching the policy, its gradients, the codecs'
        receiver statistics or the step's ``wire/*`` counters. Returns ``(gradient per owned
        parameter, the pass's boundary bytes)``: the caller counts them as the anchor's."""
        ...


@runtime_checkable
class SamplerAnchorBackend(Protocol):
    """A backend whose sampling rank can run the anchor alone (``anchor.placement: sampler``):
    ``PipelineBackend``. One process has no such split: the one-process anchor is already a dense
    clone of the whole policy, so ``LocalBackend`` needs nothing of this."""

    @property
    def samples(self) -> bool:
        """Whether this rank samples (holds the whole policy)."""
        ...

    def sampler_anchor_parameters(self) -> list[Tensor]:
        """The tensors the anchor snapshots on this rank: the whole policy on the sampling rank, none elsewhere."""
        ...

    def sampler_anchor_gradient(
        self, snapshot: Sequence[Tensor] | None, rollouts: Any, loss_fn: LossFn | None, relay: Any,
    ) -> tuple[list[Tensor], float]:
        """This rank's anchor tensors of a due job (all ranks call): ``M`` of the sampling rank's
        own stage there, the received ``sign(M_bar)`` elsewhere; and the signs' bytes."""
        ...


@runtime_checkable
class BackendProvider(Protocol):
    """A strategy that runs the policy its own way (cuts in-graph, or one stage per process)."""

    def backend(self, request: BackendRequest) -> Backend:
        """The backend for ``request``'s policy. A module that asks steps it from then on
        (:meth:`Backend.begin_step`, the one setter of the PRF key's step)."""
        ...
