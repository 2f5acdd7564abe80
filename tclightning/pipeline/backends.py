"""The two implementations of :class:`tclightning.backend.Backend` (no Lightning here).

* :class:`LocalBackend` -- one process holds the whole policy. The cuts, when a one-process
  ``PipelineStrategy`` installed a :class:`~tclightning.pipeline.cuts.CutSet`, run in-graph as
  hooks; without one the policy is dense. The loss function is called once with every row. With
  ``sampler.dtype`` the sampler generates from a copy in that dtype, brought up to date by the
  same sparse sync a split sends (its bytes counted as what the split would send).
* :class:`PipelineBackend` -- one stage per process over a
  :class:`~tclightning.pipeline.engine.PipelineEngine`. Rank 0 also holds a dense copy of the whole
  policy and samples (from it, or with ``sampler.dtype`` from the sampler's copy in that dtype);
  the last rank computes the loss, per micro-batch. With ``pipeline.replicas``
  > 1 it is one of R replicas of the pipeline on a ``("dp", "pp")`` mesh
  (:mod:`~tclightning.pipeline.mesh`): each runs its share of the rows, gradients summed over them.

The only fork between the two is how a forward/backward (and the dense one at a snapshot) runs;
the update loop that uses them is written once (``tclightning.grpo.update``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import pickle
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import Tensor, nn

from tclightning.backend import BackendRequest, LossFn
from tclightning.errors import TclightningError
from tclightning.pipeline.cuts import CutSet, hook_free_copy, strip_cut_hooks
from tclightning.pipeline.engine import PipelineEngine, StageInputs
from tclightning.pipeline.mesh import ReplicaMesh
from tclightning.weight_sync import SamplerCopy, full_bytes, message_bytes

if TYPE_CHECKING:  # the pipeline imports nothing of the anchor: the sampling rank is handed its relay
    from tclightning.anchor.placement import SignRelay

T = TypeVar("T")


def backward_at(clone: nn.Module, params: Sequence[Tensor], snapshot: Sequence[Tensor], rollouts: Any,
                loss_fn: LossFn, logprobs: Callable[..., Any], temperature: float) -> None:
    """The loss's backward on ``clone`` at the weights ``snapshot`` (copied into ``params``, the
    clone's, in order): the anchor's dense pass on a hook-free copy; the gradients are left in
    ``params``' ``.grad``."""
    with torch.no_grad():
        for param, weight in zip(params, snapshot, strict=True):
            param.copy_(weight)
    clone.zero_grad(set_to_none=True)
    logp, _ = logprobs(clone, rollouts, temperature)
    loss_fn(logp, torch.arange(logp.shape[0])).backward()


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
        self._fast_clone: nn.Module | None = None  # the compressed copy for compressed_forward_backward
        self._fast_cuts: CutSet | None = None
        self.sampler_copy: SamplerCopy | None = None  # sampler_dtype: what the sampler generates with
        self._sync_bytes = 0  # what the syncs to the sampler's copy would have sent since wire_metrics
        if request.sampler_dtype is not None:
            self.sampler_copy = SamplerCopy(self.policy, request.sampler_dtype)
            strip_cut_hooks(self.sampler_copy.model)  # the copy of a policy with cuts has their hooks
            names, self._synced = zip(*self.policy.named_parameters())
            self._copy_mirror = self.sampler_copy.mirror(names)
            self._full_sync_bytes = full_bytes(self._synced, request.sampler_dtype)

    @property
    def device(self) -> torch.device:
        return next(self.policy.parameters()).device

    def begin_step(self, step: int) -> None:
        """The one place the cuts' PRF step is set in training (``Backend.begin_step``)."""
        if self.cuts is not None:  # counters first: a basis shipped at the step change is this step's
            self.cuts.reset_stats()
            self.cuts.set_step(step)

    def dense(self) -> contextlib.AbstractContextManager[None]:
        return self.cuts.bypassed() if self.cuts is not None else contextlib.nullcontext()

    def share_from_sampler(self, make: Callable[[], T], what: str) -> T:
        return make()

    def sampling_model(self) -> nn.Module:
        """The policy, or its copy in ``sampler_dtype``, current since the last update's sync
        (:meth:`after_update`) or load (:meth:`weights_loaded`): the only ways the weights change
        once the backend is taken, so no compare of every weight before each generate."""
        return self.policy if self.sampler_copy is None else self.sampler_copy.model

    def weights_loaded(self) -> None:
        if self.sampler_copy is not None:
            self._copy_mirror.reset(self._synced)

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
        # in a pipeline this dense pass is traffic the anchor sends anyway: codecs learn from it
        tap = self.cuts.observing_dense(clone, rollouts.attention_mask, rollouts.input_ids) if self.cuts else contextlib.nullcontext()
        with tap:
            logp, _ = self._logprobs(clone, rollouts, self.temperature)
        loss_fn(logp, torch.arange(logp.shape[0])).backward()
        sent = 0.0
        if self.cuts is not None:  # the dense boundary's traffic, forward and backward, across every cut
            element = next(clone.parameters()).element_size()
            sent = 2 * float(rollouts.completion_mask.sum() + rollouts.prompt_mask.sum()) * (
                self.cuts.dim * element * len(self.cuts.specs))
        return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in params], sent

    def compressed_forward_backward(
        self, snapshot: Sequence[Tensor], rollouts: Any, loss_fn: LossFn
    ) -> tuple[list[Tensor], float]:
        """The fast circuit at ``snapshot`` (``CompressedAnchorBackend``), for the ``control_variate``
        merger: a second hook-free copy of the policy carries cuts of its own (built once), loaded
        before every pass with a deep copy of the live cuts' receiver state (step key,
        bases), so it compresses exactly as the fast circuit would now. Whatever that pass changes
        in its codecs is thrown away at the next load; the live codecs and the step's ``wire/*``
        counters never see it. Its bytes (its own meter) are returned for ``anchor/bytes``."""
        if self._fast_clone is None:
            with torch.random.fork_rng(devices=[]):  # building codecs must not move the run's RNG
                self._fast_clone = hook_free_copy(self.policy).train()
                self._fast_cuts = CutSet(self._fast_clone, self.cuts.config) if self.cuts is not None else None
        clone, cuts = self._fast_clone, self._fast_cuts
        if cuts is not None and self.cuts is not None:
            cuts.load_state_dict(copy.deepcopy(self.cuts.state_dict()))
            cuts.reset_stats()
        params = [p for p in clone.parameters() if p.requires_grad]
        backward_at(clone, params, snapshot, rollouts, loss_fn, self._logprobs, self.temperature)
        sent = 0.0
        if cuts is not None:
            wire = cuts.meter.metrics()
            sent = wire["wire/bytes_fwd"] + wire["wire/bytes_bwd"]
        return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in params], sent

    def after_update(self) -> None:
        """The sampler samples from this very policy (nothing to send), or from its copy: the
        sparse sync a split would send to it (counted as the pipeline sends it: length, message)."""
        if self.sampler_copy is not None:
            self._sync_bytes += message_bytes(self._copy_mirror.advance(self._synced))

    def share_metrics(self, metrics: dict[str, float] | None) -> dict[str, float]:
        assert metrics is not None
        return metrics

    def wire_metrics(self) -> dict[str, float]:
        """The cuts' ``wire/*``, and with a sampler copy ``wire/sync_bytes`` and ``wire/sync_share``
        of its syncs since the last call."""
        metrics = {**self.cuts.metrics()} if self.cuts is not None else {}
        if self.sampler_copy is not None:
            sent, self._sync_bytes = self._sync_bytes, 0
            metrics.update({"wire/sync_bytes": float(sent), "wire/sync_share": sent / self._full_sync_bytes})
        return metrics

    def gather_per_rank(self, state: Any, what: str) -> Any:
        return state

    def codec_state(self) -> dict[str, Any] | None:
        return self.cuts.state_dict() if self.cuts is not None else None

    def load_codec_state(self, state: dict[str, Any]) -> None:
        if self.cuts is not None:
            self.cuts.load_state_dict(state)


class PipelineBackend:
    """This rank's stage over ``engine`` (see the module doc); ``request.policy`` is the model the
    engine was built on (rank 0's dense copy samples; every rank's stage shares its tensors).

    ``mesh`` (``pipeline.replicas`` = R > 1): the engine is one of R replicas of the pipeline
    (:mod:`~tclightning.pipeline.mesh`). Global rank 0 samples for all; every forward/backward
    runs this replica's contiguous share of the rows, with the loss of the share divided by the
    whole batch's denominators; the gradients (and the anchor's ``M``) are summed over the
    stage's replicas, and the last stage's log-probs and loss statistics assembled, so every
    replica computes what one pipeline would on the whole batch (``dp/*`` counts those bytes)."""

    microbatched = True

    def __init__(self, request: BackendRequest, engine: PipelineEngine, mesh: ReplicaMesh | None = None) -> None:
        self.engine = engine
        self.mesh = mesh
        self.world_size = engine.world_size if mesh is None else mesh.world_size
        self.temperature = request.temperature
        self._logprobs = request.logprobs  # the sampling rank's whole-model anchor pass (anchor.placement: sampler)
        self._whole_clone: nn.Module | None = None
        self._anchor_layout: tuple[list[str], list[list[int]]] | None = None
        engine.set_temperature(request.temperature)  # the last stage's log-probs use the sampler's
        self._rollout_bytes = 0  # what this rank broadcast from the sampler since the last wire_metrics
        if request.sampler_dtype is not None:  # only replica 0's stages send to the sampler
            engine.start_sparse_sync(request.sampler_dtype, syncs=mesh is None or mesh.replica == 0)

    @property
    def _world(self) -> Any:
        """The ``StageComm`` of every rank: the sampler's broadcast, the agreed verdicts."""
        return self.engine.comm if self.mesh is None else self.mesh.world

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def has_loss(self) -> bool:
        return self.engine.is_last

    def begin_step(self, step: int) -> None:
        """The one place the engine's PRF step is set in training (``Backend.begin_step``; collective:
        a basis refresh at the step change crosses the stages)."""
        self.engine.reset_stats()  # counters first: a basis shipped at the step change is this step's
        if self.mesh is not None:
            self.mesh.meter.reset()
        self.engine.set_step(step)

    @contextlib.contextmanager
    def dense(self) -> Iterator[None]:
        """Rank 0's dense copy has no codecs installed: sampling is dense as it is."""
        yield

    def sampling_model(self) -> nn.Module:
        """Rank 0's dense copy of the policy, or with ``sampler_dtype`` the sampler's copy (exact
        since the last update's sync). Other ranks hold no sampler copy: their policy."""
        sampler_copy = self.engine.sampler_copy
        return sampler_copy.model if sampler_copy is not None else self.engine.model

    def weights_loaded(self) -> None:
        self.engine.reset_sparse_sync()

    def share_from_sampler(self, make: Callable[[], T], what: str) -> T:
        """Global rank 0 runs ``make()``; the result travels to every rank (of every replica) as a
        CPU pickle (tensors and ``Rollouts``)."""
        payload = _to_cpu(make()) if self._world.rank == 0 else None
        if payload is not None:  # the pickle broadcast_object sends, once to every other rank
            self._rollout_bytes += len(pickle.dumps(payload)) * (self._world.world_size - 1)
        return self._world.broadcast_object(payload, 0, what)

    def logprobs(self, rollouts: Any, *, with_entropy: bool = False) -> tuple[Tensor | None, Tensor | None]:
        return self._run(rollouts, None, with_entropy)

    def forward_backward(
        self, rollouts: Any, loss_fn: LossFn, *, with_entropy: bool = False
    ) -> tuple[Tensor | None, Tensor | None]:
        # loss_fn is called on the last rank only; the schedule needs one on every rank to run backward
        out = self._run(rollouts, loss_fn, with_entropy)
        if self.mesh is not None:  # the replicas' shares sum to the batch's gradient
            self.mesh.sum_gradients_(self.engine.owned_parameters(), "grad", "summing the replicas' gradients")
        return out

    def _share(self, rollouts: Any) -> tuple[StageInputs, Tensor | None]:
        """The stage inputs this pipeline runs: every row, or this replica's share (widths kept,
        so the loss's per-row tensors line up) and the share's row indices."""
        inputs = StageInputs.from_rollouts(rollouts)
        if self.mesh is None:
            return inputs, None
        rows = self.mesh.rows(inputs.input_ids.shape[0])
        return StageInputs(*(getattr(inputs, f.name)[rows] for f in dataclasses.fields(StageInputs))), rows

    def _run(self, rollouts: Any, loss_fn: LossFn | None, with_entropy: bool) -> tuple[Tensor | None, Tensor | None]:
        inputs, rows = self._share(rollouts)
        if rows is None or self.mesh is None:
            return self.engine.run(inputs, loss_fn, with_entropy=with_entropy)
        mesh, last = self.mesh, self.engine.is_last
        stats = getattr(loss_fn, "stats", None) if last else None
        before = dict(stats) if isinstance(stats, dict) else None
        logp = entropy = None
        if len(rows):  # every rank of this replica agrees: the rows are the same everywhere
            # the batch's row indices: the PRF key of each row, and the rows loss_fn is given
            logp, entropy = self.engine.run(inputs, loss_fn, with_entropy=with_entropy, batch_rows=rows)
        if not last:
            return None, None
        if before is not None and isinstance(stats, dict):  # the loss statistics of every share
            keys = sorted(before)
            delta = torch.tensor([stats[k] - before[k] for k in keys], dtype=torch.float64)
            delta = mesh.all_reduce(delta, "aux", "summing the replicas' loss statistics")
            stats.update({k: before[k] + float(v) for k, v in zip(keys, delta.tolist())})
        batch, width = rollouts.completion_ids.shape
        parts = [torch.zeros(batch, width, device=self.device) for _ in range(2 if with_entropy else 1)]
        if logp is not None:
            parts[0][rows.to(self.device)] = logp.to(parts[0].dtype)
            if with_entropy and entropy is not None:
                parts[1][rows.to(self.device)] = entropy.to(parts[1].dtype)
        parts = mesh.sum_tensors(parts, "aux", "assembling the replicas' log-probs")
        return parts[0], parts[1] if with_entropy else None

    def clip_gradients(self, max_norm: float) -> Tensor:
        self.engine.reduce_tied_gradients()
        return self.engine.clip_gradients(max_norm)

    def reduce_sum(self, tensor: Tensor, what: str) -> Tensor:
        return self._world.all_reduce(tensor, what)

    def owned_parameters(self) -> list[nn.Parameter]:
        return self.engine.owned_parameters()

    def dense_forward_backward(
        self, snapshot: Sequence[Tensor], rollouts: Any, loss_fn: LossFn
    ) -> tuple[list[Tensor], float]:
        """Through the pipeline over the dense boundary (:meth:`PipelineEngine.dense_gradient`);
        with replicas, each runs its share and ``M`` and the bytes are summed over them."""
        if self.mesh is None:
            return self.engine.dense_gradient(list(snapshot), StageInputs.from_rollouts(rollouts), loss_fn)
        inputs, rows = self._share(rollouts)
        assert rows is not None

        def share_loss(logp: Tensor, part: Tensor) -> Tensor:
            return loss_fn(logp, rows.to(part.device)[part.long()])

        if len(rows):
            grads, sent = self.engine.dense_gradient(list(snapshot), inputs, share_loss)
        else:
            grads, sent = [torch.zeros_like(p) for p in self.engine.owned_parameters()], 0.0
        grads = self.mesh.sum_tensors(grads, "anchor", "summing the replicas' anchor gradients")
        total = self.mesh.all_reduce(torch.tensor([sent], dtype=torch.float64), "anchor",
                                     "summing the replicas' anchor bytes")
        return grads, float(total[0])

    # -- anchor.placement: sampler ------------------------------------------------------------------

    @property
    def samples(self) -> bool:
        """Whether this rank is the sampling rank (global rank 0), which holds the whole policy."""
        return self._world.rank == 0

    def _whole_layout(self) -> tuple[list[str], list[list[int]]]:
        """The whole policy's trained parameters as rank 0 names them, each once (the tied weight
        once), and for every stage rank the positions of its owned parameters in that list."""
        if self._anchor_layout is None:
            engine = self.engine
            names = {id(p): name for name, p in engine.model.named_parameters()}
            stages = [engine.anchor_stage_parameters(index) for index in range(engine.world_size)]
            whole: dict[int, str] = {}
            for params in stages:
                for p in params:
                    whole.setdefault(id(p), names[id(p)])
            position = {key: i for i, key in enumerate(whole)}
            self._anchor_layout = list(whole.values()), [[position[id(p)] for p in params] for params in stages]
        return self._anchor_layout

    def sampler_anchor_parameters(self) -> list[Tensor]:
        """What the anchor snapshots with ``anchor.placement: sampler``: on the sampling rank the
        whole policy's trained parameters (:meth:`_whole_layout`), its own stage from its live
        weights and every other stage from the model it samples with (exactly the trainer's
        weights after the dense sync; with ``sampler.dtype`` their cast to that dtype, exact since
        the last sparse sync); nothing on the other ranks."""
        if not self.samples:
            return []
        own = {id(p) for p in self.engine.owned_parameters()}
        live = dict(self.engine.model.named_parameters())
        sampling = dict(self.sampling_model().named_parameters())
        names, _ = self._whole_layout()
        return [live[name] if id(live[name]) in own else sampling[name] for name in names]

    def sampler_anchor_gradient(
        self, snapshot: Sequence[Tensor] | None, rollouts: Any, loss_fn: LossFn | None, relay: SignRelay,
    ) -> tuple[list[Tensor], float]:
        """``anchor.placement: sampler`` (all ranks call). The sampling rank computes ``M`` of the
        whole policy at ``snapshot`` (:meth:`sampler_anchor_parameters`'s order) on a hook-free
        dense clone of its copy (built once), folds every other stage's share into ``relay``'s
        ``M_bar`` and sends each its signs (:meth:`PipelineEngine.relay_anchor_signs`); it returns
        its own stage's ``M``. Every other rank (``snapshot``, ``rollouts``, ``loss_fn`` None)
        returns the ``sign(M_bar)`` it received. Both with the bytes the signs took (all ranks)."""
        if self.mesh is not None:
            raise TclightningError("anchor.placement=sampler does not run with pipeline.replicas > 1")
        if self.samples:
            assert snapshot is not None and loss_fn is not None
            names, stages = self._whole_layout()
            if self._whole_clone is None:
                self._whole_clone = hook_free_copy(self.engine.model).train()
            clone = self._whole_clone
            params = [clone.get_parameter(name) for name in names]
            backward_at(clone, params, snapshot, rollouts, loss_fn, self._logprobs, self.temperature)
            grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in params]
            clone.zero_grad(set_to_none=True)
            by_stage = [[grads[i] for i in index] for index in stages]
            m_bar = {index: relay.fold(index, by_stage[index]) for index in range(1, len(stages))}
            own, (_, sent) = by_stage[0], self.engine.relay_anchor_signs(m_bar)
        else:
            received, sent = self.engine.relay_anchor_signs(None)
            assert received is not None
            own = received
        total = self._world.all_reduce(torch.tensor([float(sent)], dtype=torch.float64), "summing the anchor's bytes")
        return own, float(total[0])

    def after_update(self) -> None:
        """Every stage's new weights to rank 0, whose dense copy samples the next step, or with
        ``sampler_dtype`` the entries that changed in it, into the sampler's copy (replica 0 only:
        the others' weights are the same and nobody samples from their copies)."""
        if self.engine.sampler_dtype is not None:
            self.engine.sparse_sync_to_sampler()
        elif self.mesh is None or self.mesh.replica == 0:
            self.engine.sync_to_sampler()

    def share_metrics(self, metrics: dict[str, float] | None) -> dict[str, float]:
        src = self.world_size - 1 if self.mesh is None else self.mesh.shape.rank(0, self.mesh.shape.stages - 1)
        return self._world.broadcast_object(metrics if self._world.rank == src else None, src,
                                            "sharing the step's metrics")

    def wire_metrics(self) -> dict[str, float]:
        """``wire/*`` of every rank's sends (with replicas: of every replica, so the bytes of the
        whole batch), plus ``dp/*`` with replicas."""
        rollouts, self._rollout_bytes = self._rollout_bytes, 0
        if self.mesh is None:
            return self.engine.metrics(rollouts)
        engine, meter = self.engine, self.engine.meter
        fields = ("bytes_fwd", "bytes_bwd", "dense_fwd", "dense_bwd", "messages_fwd", "messages_bwd")
        own = [[getattr(t, f) for f in fields] for t in meter.cuts]
        own_sync, own_tied = engine.sync_bytes, engine.tied_bytes
        counts = torch.tensor([*own, [own_sync, own_tied, rollouts, 0, 0, 0]], dtype=torch.float64)
        counts = self.mesh.dp.all_reduce(counts, "summing the replicas' wire counters")  # counters, not counted
        try:  # the engine's pipeline sum of the replica sums: every rank's sends
            for traffic, row in zip(meter.cuts, counts.tolist()):
                for name, value in zip(fields, row):
                    setattr(traffic, name, int(value))
            engine.sync_bytes, engine.tied_bytes = int(counts[-1, 0]), int(counts[-1, 1])
            wire = engine.metrics(int(counts[-1, 2]))
        finally:
            for traffic, row in zip(meter.cuts, own):
                for name, value in zip(fields, row):
                    setattr(traffic, name, value)
            engine.sync_bytes, engine.tied_bytes = own_sync, own_tied
        return {**wire, **self.mesh.metrics()}

    def gather_per_rank(self, state: Any, what: str) -> Any:
        """``{"per_rank": [...]}`` indexed by global rank on rank 0; with replicas, replica 0's
        stages only (the others hold the same state), each entry the one object of its stage, so
        a checkpoint stores it once (pickle keeps shared references)."""
        if self.mesh is not None and self.mesh.replica != 0:
            return None
        gathered = self.engine.comm.gather_objects(state, what)
        if gathered is None:
            return None
        if self.mesh is None:
            return {"per_rank": gathered}
        return {"per_rank": [gathered[self.mesh.shape.coords(rank)[1]] for rank in range(self.world_size)]}

    def codec_state(self) -> dict[str, Any] | None:
        if self.mesh is not None and self.mesh.replica != 0:  # replicas decode alike (stateless codecs)
            return None
        return self.engine.cut_state_dict()

    def load_codec_state(self, state: dict[str, Any]) -> None:
        self.engine.load_cut_state_dict(state)


def _to_cpu(value: Any) -> Any:
    """Tensors, and objects with a ``to`` method (``Rollouts``), on CPU; tuples item by item."""
    if isinstance(value, tuple):
        return tuple(_to_cpu(item) for item in value)
    to = getattr(value, "to", None)
    return to(torch.device("cpu")) if callable(to) else value
