"""One pipeline stage per process over ``torch.distributed.pipelining`` (no Lightning here).

:class:`PipelineEngine` is what each rank of an S-rank process group runs: the rank's
:class:`~tclightning.pipeline.stage.StageModule` wrapped in a ``PipelineStage`` and driven by a
``ScheduleGPipe`` / ``Schedule1F1B`` over micro-batches. At cut i, rank i's stage ends with the
codec's encode and rank i+1's starts with its decode, so the schedule's point-to-point messages
*are* the codec payloads: ``[T, k]`` forward (T = real tokens of the micro-batch) and the gradient
w.r.t. it backward -- nothing of size d crosses a compressed cut.

Messages have a different token count per micro-batch, which the stock stage (one shape per
pipeline) cannot receive. :class:`_PayloadStage` sizes each receive buffer from the token mask
that every rank holds (the receiver can compute T itself: only k values per token travel, no
shapes), counts every send it issues (per cut, per direction, into a :class:`WireMeter`, so
``wire/*`` come from the actual sends), optionally paces sends to a link rate, and remembers
which peer a rank is waiting for, so a dead or hung peer turns into :class:`StageFailure` naming
that rank once the process group's timeout expires (gloo raises at once when a peer's socket
closes).

Besides the boundary, the engine moves only small or dense-by-design things, each counted apart:
tied-embedding gradients between the first and last rank, the global gradient norm (a scalar),
and :meth:`PipelineEngine.sync_to_sampler` (stage weights to rank 0, whose dense copy samples).
The anchor circuit's dense pass (:meth:`PipelineEngine.anchor_gradient`) is a second pipelined
forward/backward over a dense copy of the stage: its ``[T, d]`` sends are counted apart
(``anchor/bytes``), never in ``wire/*``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tclightning.codecs import Codec, make_codec
from tclightning.errors import TclightningError
from tclightning.pipeline.boundary import BACKWARD, FORWARD, WireMeter
from tclightning.pipeline.config import PipelineConfig
from tclightning.pipeline.cuts import boundary_width, find_decoder_layers
from tclightning.pipeline.layout import CutSpec, resolve_layout
from tclightning.pipeline.stage import StageModule

SCHEDULES = ("gpipe", "1f1b")


class StageFailure(TclightningError):
    """A pipeline peer died, hung past the timeout, or its link failed; the message names the rank."""


@dataclass
class StageInputs:
    """What every stage needs for one pipelined forward of a batch (small: ids and masks).

    ``input_ids``, ``attention_mask``, ``position_ids``: ``[B, L]`` (prompt | completion);
    ``completion_ids``, ``completion_mask``: ``[B, Lc]`` (the last stage's log-prob targets)."""

    input_ids: Tensor
    attention_mask: Tensor
    position_ids: Tensor
    completion_ids: Tensor
    completion_mask: Tensor

    @classmethod
    def from_rollouts(cls, rollouts: Any) -> StageInputs:
        """From a :class:`~tclightning.sampling.base.Rollouts` (the same tensors ``completion_logps`` uses)."""
        return cls(
            rollouts.input_ids,
            rollouts.attention_mask,
            rollouts.position_ids,
            rollouts.completion_ids,
            rollouts.completion_mask,
        )

    def to(self, device: torch.device) -> StageInputs:
        return StageInputs(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))


def check_distributed_layout(config: PipelineConfig, specs: list[CutSpec], world_size: int) -> None:
    """Refuse what the multi-process mode does not run (yet), naming the setting."""
    if len(specs) + 1 != world_size:
        raise TclightningError(
            f"the pipeline has {len(specs) + 1} stages ({len(specs)} cuts) but {world_size} processes were "
            f"launched: one stage per process, so set pipeline.stages={world_size} (or give {world_size - 1} "
            "pipeline.cuts) or change trainer.devices x trainer.num_nodes"
        )
    for spec in specs:
        if spec.codec not in ("prf", "identity"):
            raise TclightningError(
                f"pipeline codec '{spec.codec}' at cut {spec.ordinal} is not supported across processes yet "
                "(prf and identity are); run it with trainer.devices=1"
            )
        if spec.backward_codec is not None:
            raise TclightningError(
                "pipeline.backward_codec is not supported across processes yet (the gradient message is the "
                "gradient w.r.t. the payload); run it with trainer.devices=1"
            )
    if config.schedule not in SCHEDULES:
        raise TclightningError(f"pipeline.schedule '{config.schedule}' is not one of {', '.join(SCHEDULES)}")
    if config.microbatches < 1:
        raise TclightningError(f"pipeline.microbatches must be >= 1, got {config.microbatches}")


class _Watch:
    """Which peer this rank is waiting on, for the error message when the wait fails."""

    def __init__(self) -> None:
        self.peers: list[int] = []
        self.what = "start-up"

    def expect(self, peers: list[int], what: str) -> None:
        self.peers, self.what = peers, what


class _PayloadStage:
    """Factory for a ``PipelineStage`` subclass (built lazily: importing pipelining is not free)."""

    cls: type | None = None

    @classmethod
    def build(cls, *args: Any, **kwargs: Any) -> Any:
        if cls.cls is None:
            cls.cls = _make_payload_stage_class()
        return cls.cls(*args, **kwargs)


def _make_payload_stage_class() -> type:
    from torch.distributed.pipelining import PipelineStage

    class PayloadStage(PipelineStage):
        """``PipelineStage`` with per-micro-batch message shapes, send accounting and pacing."""

        def __init__(
            self,
            module: StageModule,
            *,
            device: torch.device,
            group: Any,
            in_shapes: list[tuple[int, int]],
            out_shapes: list[tuple[int, int]],
            dtype: torch.dtype,
            meter: WireMeter,
            watch: _Watch,
            link_bits_per_s: float | None,
        ) -> None:
            example_in = (
                torch.zeros(1, 1, dtype=torch.long)
                if module.is_first
                else torch.zeros(1, 1, dtype=dtype, requires_grad=True)
            )
            example_out = (
                torch.zeros(1, 1, dtype=torch.float32, requires_grad=True)
                if module.is_last
                else torch.zeros(1, 1, dtype=dtype, requires_grad=True)
            )
            # Static metadata: no shape-inference forward (it would run the codecs on dummy data).
            super().__init__(
                module, module.index, module.num_stages, device,
                input_args=example_in, output_args=example_out, group=group,
            )
            self.in_shapes, self.out_shapes, self.dtype = in_shapes, out_shapes, dtype
            self.meter, self.watch, self.link_bits_per_s = meter, watch, link_bits_per_s

        def _rank_of(self, stage: int) -> int:
            return self._resolve_peer_global_rank(stage)

        def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[Any]:
            if not self.is_first:
                info = self.args_recv_info[fwd_chunk_id][0]
                info.buffer = torch.empty(self.in_shapes[fwd_chunk_id], dtype=self.dtype, device=self.device)
                self.watch.expect([self._rank_of(self.stage_index - 1)], f"the forward message of micro-batch {fwd_chunk_id}")
            return super().get_fwd_recv_ops(fwd_chunk_id)

        def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[Any]:
            if self.has_backward and not self.is_last:
                info = self.grad_recv_info[bwd_chunk_id][0]
                info.buffer = torch.empty(self.out_shapes[bwd_chunk_id], dtype=self.dtype, device=self.device)
                self.watch.expect([self._rank_of(self.stage_index + 1)], f"the gradient message of micro-batch {bwd_chunk_id}")
            return super().get_bwd_recv_ops(bwd_chunk_id)

        def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[Any]:
            ops = super().get_fwd_send_ops(fwd_chunk_id)
            self._account(ops, self.stage_index, FORWARD)
            return ops

        def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[Any]:
            ops = super().get_bwd_send_ops(bwd_chunk_id)
            self._account(ops, self.stage_index - 1, BACKWARD)
            return ops

        def _account(self, ops: list[Any], cut: int, direction: str) -> None:
            dim = self.submod.config.hidden_size
            for op in ops:
                tensor = op.tensor
                sent = tensor.numel() * tensor.element_size()
                self.meter.record(cut, direction, sent, tensor.shape[0] * dim * tensor.element_size())
                self.watch.expect([op.peer], f"sending the {direction} message across cut {cut}")
                if self.link_bits_per_s:  # software-paced link: the serialisation delay of the message
                    time.sleep(sent * 8 / self.link_bits_per_s)

    return PayloadStage


class PipelineEngine:
    """This rank's stage of ``model`` split by ``config``, run over the process group ``group``.

    ``run(inputs, loss_fn)`` is one pipelined forward (+ backward with ``loss_fn``) of a batch
    split into ``config.microbatches`` micro-batches; ``loss_fn(logp_mb, rows_mb)`` is called on
    the last rank per micro-batch and must return that micro-batch's share of the batch loss
    (micro-batch losses are summed, ``scale_grads=False``). Gradients accumulate into the stage's
    parameters, which are ``model``'s own.
    """

    def __init__(
        self,
        model: nn.Module,
        config: PipelineConfig,
        *,
        device: torch.device | str = "cpu",
        group: Any = None,
        temperature: float = 1.0,
        link_mbit: float | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise TclightningError("the multi-process pipeline needs torch.distributed initialised (launch with devices>1)")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device = torch.device(device)
        self.config = config
        body, layers = find_decoder_layers(model)
        self.dim = boundary_width(model)
        self.specs = resolve_layout(config, len(layers), self.dim)
        check_distributed_layout(config, self.specs, self.world_size)
        self.model = model
        self.dtype = next(model.parameters()).dtype
        is_last = self.rank == self.world_size - 1
        send_codec = None if is_last else self._codec(self.specs[self.rank])
        recv_codec = None if self.rank == 0 else self._codec(self.specs[self.rank - 1])
        self.module = StageModule(
            model, self.rank, self.specs, send_codec=send_codec, recv_codec=recv_codec,
            seed=config.seed, temperature=temperature,
        )
        self.meter = WireMeter([spec.layer for spec in self.specs])
        self.watch = _Watch()
        self.link_bits_per_s = link_mbit * 1e6 if link_mbit else None
        self.timeout_s = config.timeout_s
        output = model.get_output_embeddings()
        self.tied = self.world_size > 1 and output is not None and output.weight is body.embed_tokens.weight
        self._tie_group = None
        if self.tied and self.world_size > 2:  # every rank must call new_group
            self._tie_group = dist.new_group([0, self.world_size - 1])
        self.sync_bytes = 0
        self._anchor_stage: StageModule | None = None

    # -- construction ------------------------------------------------------------------------

    def _codec(self, spec: CutSpec) -> Codec:
        cfg = self.config
        return make_codec(spec.codec, self.dim, k=spec.k, fill=cfg.fill, rescale=cfg.rescale,
                          fill_momentum=cfg.fill_momentum, rank=spec.rank)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1

    def _width(self, spec: CutSpec | None) -> int:
        return self.dim if spec is None or spec.codec == "identity" else spec.k

    # -- the loop's knobs (the CutSet ones) ----------------------------------------------------

    def set_step(self, step: int) -> None:
        """The PRF key's step; on a change, the receiver's stateful fill folds in the last step."""
        if step != self.module.step and self.module.recv_codec is not None:
            self.module.recv_codec.commit_step()
        self.module.step = int(step)

    def reset_stats(self) -> None:
        self.meter.reset()
        self.sync_bytes = 0

    def metrics(self) -> dict[str, float]:
        """``WireMeter.metrics()`` of the sends of every rank (an all-reduce), plus ``wire/sync_bytes``."""
        counts = torch.tensor(
            [[t.bytes_fwd, t.bytes_bwd, t.dense_fwd, t.dense_bwd, t.messages_fwd, t.messages_bwd] for t in self.meter.cuts]
            + [[self.sync_bytes, 0, 0, 0, 0, 0]],
            dtype=torch.float64,
        )
        counts = self.all_reduce(counts, "summing the wire counters")
        total = WireMeter([t.layer for t in self.meter.cuts])
        for traffic, row in zip(total.cuts, counts.tolist()):
            (traffic.bytes_fwd, traffic.bytes_bwd, traffic.dense_fwd, traffic.dense_bwd,
             traffic.messages_fwd, traffic.messages_bwd) = (int(v) for v in row)
        return {**total.metrics(), "wire/sync_bytes": float(counts[-1, 0])}

    # -- failures ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Turn a failed wait on a peer into :class:`StageFailure` naming the rank waited for."""
        try:
            yield
        except StageFailure:
            raise
        except (RuntimeError, dist.DistError) as err:
            peers = self.watch.peers or [r for r in range(self.world_size) if r != self.rank]
            names = ", ".join(str(p) for p in peers)
            detail = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
            raise StageFailure(
                f"pipeline rank {names} died or did not answer within {self.timeout_s:g} s "
                f"(rank {self.rank} was {what}: {self.watch.what}); stopping. Cause: {detail}"
            ) from err

    def all_reduce(self, tensor: Tensor, what: str, group: Any = None) -> Tensor:
        """Sum ``tensor`` over ranks (on the engine's device, returned on the input's)."""
        work = tensor.to(self.device)
        self.watch.expect([], what)
        with self.guard(what):
            dist.all_reduce(work, group=group if group is not None else self.group)
        return work.to(tensor.device)

    def broadcast_object(self, obj: Any, src: int, what: str) -> Any:
        """``obj`` from rank ``src`` on every rank (small Python objects: rollouts, metrics)."""
        box = [obj if self.rank == src else None]
        self.watch.expect([src] if self.rank != src else [], what)
        with self.guard(what):
            dist.broadcast_object_list(box, src=src, group=self.group, device=self.device)
        return box[0]

    # -- the pipelined forward/backward --------------------------------------------------------

    def run(
        self,
        inputs: StageInputs,
        loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None,
        *,
        with_entropy: bool = False,
        module: StageModule | None = None,
        meter: WireMeter | None = None,
    ) -> tuple[Tensor | None, Tensor | None]:
        """One pipelined pass over ``inputs`` (B rows). With ``loss_fn``: forward + backward.

        ``module`` / ``meter``: another stage module of this rank and the meter its sends are
        counted in (the anchor's dense pass, :meth:`anchor_gradient`); default the engine's own.
        Returns ``(logp [B, Lc], entropy [B, Lc] or None)`` detached on the last rank, ``(None,
        None)`` elsewhere."""
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

        stage_module = module if module is not None else self.module
        inputs = inputs.to(self.device)
        rows = inputs.input_ids.shape[0]
        chunks = max(1, min(self.config.microbatches, rows))
        tokens = [int(part.sum()) for part in torch.tensor_split(inputs.attention_mask.sum(-1), chunks)]
        in_width = self._width(stage_module.recv_spec)
        out_width = self._width(stage_module.send_spec)
        stage = _PayloadStage.build(
            stage_module, device=self.device, group=self.group,
            in_shapes=[(t, in_width) for t in tokens], out_shapes=[(t, out_width) for t in tokens],
            dtype=self.dtype, meter=meter if meter is not None else self.meter, watch=self.watch,
            link_bits_per_s=self.link_bits_per_s,
        )
        schedule_cls = ScheduleGPipe if self.config.schedule == "gpipe" else Schedule1F1B
        schedule = schedule_cls(stage, n_microbatches=chunks, loss_fn=loss_fn, scale_grads=False)
        kwargs = {
            "attention_mask": inputs.attention_mask,
            "position_ids": inputs.position_ids,
            "rows": torch.arange(rows, device=self.device),
            "completion_ids": inputs.completion_ids,
            "completion_mask": inputs.completion_mask,
        }
        args = (inputs.input_ids,) if self.is_first else ()
        stage_module.want_entropy = with_entropy and self.is_last
        stage_module.last_entropy = []
        what = "in the pipelined forward/backward" if loss_fn is not None else "in the pipelined forward"
        with self.guard(what):
            if loss_fn is not None:
                target = kwargs["rows"] if self.is_last else None
                output = schedule.step(*args, target=target, **kwargs)
            else:
                with torch.no_grad():
                    output = schedule.eval(*args, **kwargs)
        stage_module.want_entropy = False
        if not self.is_last:
            return None, None
        entropy = torch.cat(stage_module.last_entropy) if with_entropy and stage_module.last_entropy else None
        stage_module.last_entropy = []
        return output.detach(), entropy

    # -- the anchor circuit's dense pass --------------------------------------------------------

    def anchor_stage(self) -> StageModule:
        """This rank's stage as a separate dense module (built once): a copy of the stage's own
        layers (never the whole model) with the ``identity`` codec at both cuts, into which
        :meth:`anchor_gradient` loads a snapshot. Its sends are the dense boundary."""
        if self._anchor_stage is None:
            clone = copy.deepcopy(self.module)
            dense = [dataclasses.replace(spec, codec="identity", compressed=False, backward_codec=None)
                     for spec in self.specs]
            clone.send_spec = None if self.is_last else dense[self.rank]
            clone.recv_spec = None if self.is_first else dense[self.rank - 1]
            clone.send_codec = None if self.is_last else make_codec("identity", self.dim)
            clone.recv_codec = None if self.is_first else make_codec("identity", self.dim)
            self._anchor_stage = clone.train()
        return self._anchor_stage

    def anchor_gradient(
        self, snapshot: list[Tensor], inputs: StageInputs, loss_fn: Callable[[Tensor, Tensor], Tensor] | None
    ) -> tuple[list[Tensor], float]:
        """The anchor's dense ``M`` for this rank's stage: load ``snapshot`` (this rank's
        :meth:`owned_parameters` at the job's tick, same order) into :meth:`anchor_stage`, run one
        pipelined forward/backward of ``inputs`` over the dense boundary (``loss_fn`` on the last
        rank), sum the tied-embedding halves. Returns ``(M, bytes)``: ``M`` shaped like
        ``owned_parameters()``, ``bytes`` the boundary bytes of the pass summed over all ranks
        and both directions, counted from the actual sends (``anchor/bytes``)."""
        stage = self.anchor_stage()
        params = [p for p in stage.parameters() if p.requires_grad]
        if len(params) != len(snapshot):
            raise TclightningError(f"anchor snapshot has {len(snapshot)} tensors for {len(params)} stage parameters")
        with torch.no_grad():
            for param, weight in zip(params, snapshot, strict=True):
                param.copy_(weight)
        stage.zero_grad(set_to_none=True)
        stage.step = self.module.step
        meter = WireMeter([spec.layer for spec in self.specs])
        self.run(inputs, loss_fn, module=stage, meter=meter)
        self.reduce_tied_gradients(stage)
        sent = sum(t.bytes_fwd + t.bytes_bwd for t in meter.cuts)
        total = self.all_reduce(torch.tensor(float(sent), dtype=torch.float64), "summing the anchor's bytes")
        grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in params]
        stage.zero_grad(set_to_none=True)
        return grads, float(total)

    # -- after backward ------------------------------------------------------------------------

    def owned_parameters(self) -> list[nn.Parameter]:
        """The parameters this rank trains (its stage's), in a fixed order."""
        return [p for p in self.module.parameters() if p.requires_grad]

    def reduce_tied_gradients(self, module: StageModule | None = None) -> None:
        """Tied input/output embeddings live on the first and last rank: sum their two gradients
        (what one process accumulates into the one shared tensor), so both copies step alike.
        ``module``: whose tied weight (default the engine's stage, which shares the model's)."""
        if not self.tied or not (self.is_first or self.is_last):
            return
        stage_module = module if module is not None else self.module
        embedding = stage_module.embed_tokens if self.is_first else stage_module.lm_head
        assert embedding is not None
        weight = embedding.weight
        grad = weight.grad if weight.grad is not None else torch.zeros_like(weight)
        weight.grad = self.all_reduce(grad, "summing the tied-embedding gradient", group=self._tie_group)

    def clip_gradients(self, max_norm: float) -> Tensor:
        """Global gradient norm over all stages (one all-reduced scalar) and ``clip_grad_norm_``'s
        scaling with it; returns the norm (the same on every rank)."""
        params = [p for p in self.owned_parameters() if p.grad is not None]
        tied = self.model.get_output_embeddings().weight if self.tied else None
        counted = [p for p in params if not (self.is_last and p is tied)]  # counted once, on rank 0
        local = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in counted:
            local += p.grad.detach().double().pow(2).sum()
        total = self.all_reduce(local, "summing the gradient norm").sqrt().float()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total.to(params[0].device) if params else total)
        return total

    def stage_parameters(self, index: int) -> list[nn.Parameter]:
        """Parameters of stage ``index`` as rank 0 sees them in its dense copy (tied ones once)."""
        view = StageModule(self.model, index, self.specs, send_codec=None, recv_codec=None, seed=0)
        first = {id(p) for p in StageModule(self.model, 0, self.specs, send_codec=None, recv_codec=None,
                                            seed=0).parameters()}
        return [p for p in view.parameters() if index == 0 or id(p) not in first]

    @torch.no_grad()
    def sync_to_sampler(self) -> int:
        """Send every stage's weights to rank 0 (its dense model samples the next step); returns
        the bytes this costs in total (counted as ``wire/sync_bytes``, never as boundary bytes)."""
        total = 0
        for index in range(1, self.world_size):
            params = self.stage_parameters(index)
            numel = sum(p.numel() for p in params)
            total += numel * self.dtype.itemsize
            if self.rank == index:  # the sender counts (metrics() sums over ranks)
                self.sync_bytes += numel * self.dtype.itemsize
            if self.rank not in (0, index):
                continue
            what = f"sending stage {index}'s weights to the sampler"
            self.watch.expect([index if self.rank == 0 else 0], what)
            with self.guard(what):
                if self.rank == index:
                    dist.send(torch.cat([p.detach().reshape(-1) for p in params]).to(self.device), dst=index_to_global(0, self.group), group=self.group)
                else:
                    flat = torch.empty(numel, dtype=self.dtype, device=self.device)
                    dist.recv(flat, src=index_to_global(index, self.group), group=self.group)
                    offset = 0
                    for p in params:
                        p.copy_(flat[offset : offset + p.numel()].view_as(p))
                        offset += p.numel()
        return total

    @torch.no_grad()
    def broadcast_weights(self) -> None:
        """Rank 0's weights to every rank (once at start-up: warm-ups or GPU kernels may differ)."""
        with self.guard("receiving the initial weights from rank 0"):
            self.watch.expect([0] if self.rank else [], "the initial weight broadcast")
            for tensor in [*self.model.parameters(), *self.model.buffers()]:
                if tensor.is_floating_point():
                    work = tensor.data.to(self.device)
                    dist.broadcast(work, src=index_to_global(0, self.group), group=self.group)
                    tensor.data.copy_(work)

    # -- checkpoints ---------------------------------------------------------------------------

    def codec_state(self) -> dict[str, Any]:
        """This rank's receiver-side codec state (the mean fill of the cut it decodes)."""
        codec = self.module.recv_codec
        return {"rank": self.rank, "state": codec.state_dict() if codec is not None else {}}

    def gather_objects(self, obj: Any, what: str) -> list[Any] | None:
        """``obj`` of every rank, on rank 0 (None elsewhere)."""
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        self.watch.expect([], what)
        with self.guard(what):
            dist.gather_object(obj, out, dst=index_to_global(0, self.group), group=self.group)
        return out

    def cut_state_dict(self) -> dict[str, Any] | None:
        """All ranks call; on rank 0 the ``CutSet.state_dict()`` layout (per cut: the state of the
        codec that decodes it, which lives on the cut's receiving rank)."""
        gathered = self.gather_objects(self.codec_state(), "gathering the codec states for a checkpoint")
        if gathered is None:
            return None
        by_rank = {entry["rank"]: entry["state"] for entry in gathered}
        return {
            "step": self.module.step,
            "forward": [by_rank.get(ordinal + 1, {}) for ordinal in range(len(self.specs))],
            "backward": [{} for _ in self.specs],
        }

    def load_cut_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's share of a ``CutSet.state_dict()`` (from one or many processes)."""
        self.module.step = int(state.get("step", 0))
        forward = state.get("forward", [])
        if self.module.recv_codec is not None and len(forward) >= self.rank:
            self.module.recv_codec.load_state_dict(forward[self.rank - 1])


def index_to_global(rank: int, group: Any) -> int:
    """Global rank of ``rank`` in ``group`` (identity for the default group)."""
    return rank if group is None else dist.get_global_rank(group, rank)


def init_process_group(
    rank: int, world_size: int, *, backend: str = "gloo", timeout_s: float = 60.0, init_method: str | None = None
) -> None:
    """``dist.init_process_group`` with the pipeline's timeout (tests and benchmarks; Lightning does
    this itself from its cluster environment)."""
    dist.init_process_group(
        backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s), init_method=init_method
    )
