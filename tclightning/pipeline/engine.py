"""One pipeline stage per process over ``torch.distributed.pipelining``: the schedule (no Lightning).

:class:`PipelineEngine` is what each rank of an S-rank process group runs: the rank's
:class:`~tclightning.pipeline.stage.StageModule` in a counted ``PipelineStage``
(:func:`~tclightning.pipeline.comm.payload_stage`) driven by a ``ScheduleGPipe`` /
``Schedule1F1B`` over micro-batches. At cut i, rank i's stage ends with the codec's encode and
rank i+1's starts with its decode, so the schedule's point-to-point messages *are* the codec
payloads: ``[T, k]`` forward (T = real tokens of the micro-batch) and the gradient w.r.t. it
backward -- nothing of size d crosses a compressed cut.

Besides the boundary, the engine moves only small or dense-by-design things, each counted apart:
tied-embedding gradients between the first and last rank (with ``pipeline.tied_rows`` the tied weight's
rows of a pass's token ids and their gradients), the global gradient norm (a scalar),
and the weight sync to rank 0, which samples: every stage's weights
(:meth:`PipelineEngine.sync_to_sampler`, rank 0's dense copy samples), or with ``sampler.dtype``
only the entries that changed in that dtype (:meth:`PipelineEngine.sparse_sync_to_sampler`, into
the sampler's copy; :mod:`tclightning.weight_sync`).
The dense pass at a snapshot (:meth:`PipelineEngine.dense_gradient`, the anchor's ``M``) is a
second pipelined forward/backward over a dense copy of the stage: its ``[T, d]`` sends are counted
apart (``anchor/bytes``), never in ``wire/*``. Collectives and failure handling live in
:mod:`~tclightning.pipeline.comm`.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tclightning.codecs import Codec, make_codec
from tclightning.errors import TclightningError
from tclightning.pipeline.boundary import WireMeter
from tclightning.pipeline.comm import StageComm, StageFailure, payload_stage
from tclightning.pipeline.config import PipelineConfig
from tclightning.pipeline.endpoint import CutEnd
from tclightning.pipeline.cuts import boundary_width, check_cut_state, codec_metrics
from tclightning.pipeline.layout import CutSpec, cut_codec, resolve_layout
from tclightning.pipeline.stage import StageInputs, StageModule, splittable_layers
from tclightning.weight_sync import SamplerCopy, WeightMirror, full_bytes, message_bytes

__all__ = ["PipelineEngine", "StageFailure", "StageInputs", "check_distributed_layout", "no_loss"]


def no_loss(logp: Tensor, rows: Tensor) -> Tensor:  # pragma: no cover - only the last rank computes a loss
    """The ``loss_fn`` of ranks other than the last in a forward/backward: never called there."""
    raise AssertionError("the loss is computed on the last rank only")


def check_distributed_layout(config: PipelineConfig, specs: list[CutSpec], world_size: int) -> None:
    """Refuse what the multi-process mode does not run (yet), naming the setting."""
    if len(specs) + 1 != world_size:
        raise TclightningError(
            f"the pipeline has {len(specs) + 1} stages ({len(specs)} cuts) but {world_size} processes were "
            f"launched: one stage per process, so set pipeline.stages={world_size} (or give {world_size - 1} "
            "pipeline.cuts) or change trainer.devices x trainer.num_nodes"
        )
    for spec in specs:
        if spec.codec not in ("prf", "identity", "lowrank"):
            raise TclightningError(
                f"pipeline codec '{spec.codec}' at cut {spec.ordinal} is not supported across processes yet "
                "(prf, lowrank and identity are); run it with trainer.devices=1"
            )


class RefreshChannel:
    """A codec's refresh message over the cut ``cut`` to or from rank ``peer``: its length (int32,
    0 = kept), then its float32 values."""

    def __init__(self, comm: StageComm, peer: int, cut: int) -> None:
        self.comm, self.peer, self.cut = comm, peer, cut

    def send(self, message: Tensor | None) -> None:
        what = f"sending the basis refresh of cut {self.cut}"
        size = 0 if message is None else message.numel()
        self.comm.send(torch.tensor([size], dtype=torch.int32, device=self.comm.device), self.peer, what)
        if message is not None:
            self.comm.send(message.float().to(self.comm.device), self.peer, what)

    def receive(self) -> Tensor | None:
        what = f"receiving the basis refresh of cut {self.cut}"
        size = int(self.comm.recv(1, torch.int32, self.peer, what)[0])
        return self.comm.recv(size, torch.float32, self.peer, what) if size else None


class PipelineEngine:
    """This rank's stage of ``model`` split by ``config``, run over the process group ``group``.

    ``run(inputs, loss_fn)`` is one pipelined forward (+ backward with ``loss_fn``) of a batch
    split into ``config.microbatches`` micro-batches; ``loss_fn(logp_mb, rows_mb)`` is called on
    the last rank per micro-batch and must return that micro-batch's share of the batch loss
    (micro-batch losses are summed, ``scale_grads=False``); other ranks pass :func:`no_loss`.
    Gradients accumulate into the stage's parameters, which are ``model``'s own.
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
        tie_group: Any = None,
    ) -> None:
        self.comm = StageComm(group, torch.device(device), config.timeout_s)
        self.rank, self.world_size, self.device = self.comm.rank, self.comm.world_size, self.comm.device
        self.config = config
        body, layers = splittable_layers(model)  # refuses a model the split does not know, in one line
        self.dim = boundary_width(model)
        self.specs = resolve_layout(config, len(layers), self.dim)
        check_distributed_layout(config, self.specs, self.world_size)
        self.model = model
        self.dtype = next(model.parameters()).dtype
        is_last = self.rank == self.world_size - 1
        send_codec = None if is_last else cut_codec(self.config, self.specs[self.rank], self.dim)
        recv_codec = None if self.rank == 0 else cut_codec(self.config, self.specs[self.rank - 1], self.dim)
        self.module = StageModule(
            model, self.rank, self.specs, send_codec=send_codec, recv_codec=recv_codec,
            seed=config.seed, temperature=temperature,
        )
        self.meter = WireMeter([spec.layer for spec in self.specs])
        self.link_bits_per_s = link_mbit * 1e6 if link_mbit else None
        output = model.get_output_embeddings()
        self.tied = self.world_size > 1 and output is not None and output.weight is body.embed_tokens.weight
        self._tie_group = None
        if self.tied and self.world_size > 2:  # every rank must call new_group
            # a replicated pipeline (pipeline.mesh) made one [first, last] group per replica
            self._tie_group = tie_group if tie_group is not None else dist.new_group([0, self.world_size - 1])
        # pipeline.tied_rows: the last rank owns the tied weight; rows and their gradients cross
        self.tied_rows = self.tied and config.tied_rows
        if self.tied_rows and not body.embed_tokens.weight.requires_grad:
            raise TclightningError("pipeline.tied_rows: the tied embedding is frozen (model.lora trains the adapters "
                                   "only), so it has no rows to send; set pipeline.tied_rows=false")
        self._rows_current = True  # rank 0's copy of the tied weight is the owner's (every rank starts equal)
        self._tied_ids: dict[int, Tensor] = {}  # by stage module: the token ids of its passes since the last reduce
        self.sync_bytes = 0
        self.tied_bytes = 0  # the tied embedding's gradient (sum, or rows and their gradients) first <-> last rank
        # sampler.dtype (start_sparse_sync): the sampler's copy (rank 0) and the tensors as last sent
        self.sampler_dtype: torch.dtype | None = None
        self.sampler_copy: SamplerCopy | None = None
        self._mirrors: dict[int, WeightMirror] = {}  # by stage: rank 0 all (the copy's), others their own
        self._synced: dict[int, list[nn.Parameter]] = {}  # the parameters each mirror follows
        self._full_sync_bytes = 0  # every synced entry in the sampler dtype: wire/sync_share's unit
        self._carried_sync_bytes = 0  # a checkpoint's full sync, counted in the next step
        self._dense_stage: StageModule | None = None
        # a shipped first fit is still to come (identical on every rank: from the config alone)
        self._first_fits_pending = config.first_fit == "ship" and any(spec.codec == "lowrank" for spec in self.specs)

    # -- construction ------------------------------------------------------------------------

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1

    def _width(self, codec: Codec | None) -> int:
        """Values per token of a message at a cut (a basis codec sends d until its first fit)."""
        return self.dim if codec is None else codec.width

    def _wire_dtype(self, codec: Codec | None) -> torch.dtype:
        """The dtype a message at a cut crosses in (the model's unless the codec narrows it)."""
        return self.dtype if codec is None or codec.wire_dtype is None else codec.wire_dtype

    # -- the loop's knobs (the CutSet ones) ----------------------------------------------------

    def set_step(self, step: int) -> None:
        """The PRF key's step; on a change, both ends of each cut run their codec's refresh (both fit
        on the dense tokens they shared, or the sender ships its fit, counted in ``wire/bytes_fwd``).
        Receive first, then send, so a chain of stages never waits in a circle."""
        if step != self.module.step:
            if self.module.recv_end is not None:
                self.module.recv_end.change_step(int(step), RefreshChannel(self.comm, self.rank - 1, self.rank - 1))
            if self.module.send_end is not None:
                shipped = self.module.send_end.change_step(int(step), RefreshChannel(self.comm, self.rank + 1, self.rank))
                if shipped:
                    self.meter.record_setup(self.rank, shipped)
        self.module.step = int(step)

    def set_temperature(self, temperature: float) -> None:
        """The sampler's temperature, for the last stage's log-probs (before any forward)."""
        self.module.temperature = temperature
        if self._dense_stage is not None:
            self._dense_stage.temperature = temperature

    def reset_stats(self) -> None:
        self.meter.reset()
        self.tied_bytes = 0
        self.sync_bytes, self._carried_sync_bytes = self._carried_sync_bytes, 0
        for codec in (self.module.send_codec, self.module.recv_codec):
            if codec is not None:
                codec.reset_metrics()

    def metrics(self, rollout_bytes: int = 0) -> dict[str, float]:
        """``WireMeter.metrics()`` of the sends of every rank (an all-reduce), plus the other
        traffic between the ranks: ``wire/sync_bytes``, ``wire/tied_bytes`` and ``wire/rollout_bytes``
        (this rank's share of the rollout broadcast, given by the caller, which makes it); with
        ``sampler.dtype`` also ``wire/sync_share``, the sync bytes over a full sync in that dtype."""
        counts = torch.tensor(
            [[t.bytes_fwd, t.bytes_bwd, t.dense_fwd, t.dense_bwd, t.messages_fwd, t.messages_bwd] for t in self.meter.cuts]
            + [[self.sync_bytes, self.tied_bytes, rollout_bytes, 0, 0, 0]],
            dtype=torch.float64,
        )
        counts = self.comm.all_reduce(counts, "summing the wire counters")
        total = WireMeter([t.layer for t in self.meter.cuts])
        for traffic, row in zip(total.cuts, counts.tolist()):
            (traffic.bytes_fwd, traffic.bytes_bwd, traffic.dense_fwd, traffic.dense_bwd,
             traffic.messages_fwd, traffic.messages_bwd) = (int(v) for v in row)
        sync, tied, rollouts = (float(v) for v in counts[-1, :3])
        share = {} if self.sampler_dtype is None else {"wire/sync_share": sync / self._full_sync_bytes}
        return {**total.metrics(), **self._codec_metrics(), "wire/sync_bytes": sync, **share, "wire/tied_bytes": tied,
                "wire/rollout_bytes": rollouts}

    def _codec_metrics(self) -> dict[str, float]:
        """The senders' ``Codec.step_metrics()`` (energy kept, basis bytes), gathered from the rank
        that encodes each cut (one small all-reduce), named as in one process (``codec_metrics``)."""
        names = ("energy_kept", "basis_bytes")
        table = torch.zeros(len(self.specs), 2 * len(names), dtype=torch.float64)
        if self.module.send_codec is not None:
            figures = self.module.send_codec.step_metrics()
            for column, name in enumerate(names):
                if name in figures:
                    table[self.rank, 2 * column : 2 * column + 2] = torch.tensor([1.0, figures[name]])
        table = self.comm.all_reduce(table, "summing the codec figures")
        per_cut = [{name: float(row[2 * c + 1]) for c, name in enumerate(names) if row[2 * c] > 0} for row in table]
        return codec_metrics(per_cut)

    # -- the pipelined forward/backward --------------------------------------------------------

    def run(
        self,
        inputs: StageInputs,
        loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None,
        *,
        with_entropy: bool = False,
        module: StageModule | None = None,
        meter: WireMeter | None = None,
        batch_rows: Tensor | None = None,
    ) -> tuple[Tensor | None, Tensor | None]:
        """One pipelined pass over ``inputs`` (B rows). With ``loss_fn``: forward + backward.

        ``module`` / ``meter``: another stage module of this rank and the meter its sends are
        counted in (the dense pass, :meth:`dense_gradient`); default the engine's own. ``batch_rows``:
        the inputs' contiguous row indices in the whole batch (a data-parallel replica's share: the
        PRF key's rows and what ``loss_fn`` gets); default ``0..B-1``.
        Returns ``(logp [B, Lc], entropy [B, Lc] or None)`` detached on the last rank, ``(None,
        None)`` elsewhere."""
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

        stage_module = module if module is not None else self.module
        inputs = inputs.to(self.device)
        rows = inputs.input_ids.shape[0]
        if self.tied_rows:
            self._send_tied_rows(stage_module, inputs.input_ids, backward=loss_fn is not None)
        if stage_module is self.module and self._first_fits_pending:
            self._ship_first_fits(inputs, torch.arange(rows) if batch_rows is None else batch_rows)
        chunks = max(1, min(self.config.microbatches, rows))
        tokens = [int(part.sum()) for part in torch.tensor_split(inputs.attention_mask.sum(-1), chunks)]
        in_width = self._width(stage_module.recv_codec)
        out_width = self._width(stage_module.send_codec)
        stage = payload_stage(
            stage_module, self.comm,
            in_shapes=[(t, in_width) for t in tokens], out_shapes=[(t, out_width) for t in tokens],
            dtype=self.dtype, in_dtype=self._wire_dtype(stage_module.recv_codec),
            out_dtype=self._wire_dtype(stage_module.send_codec), meter=meter if meter is not None else self.meter,
            link_bits_per_s=self.link_bits_per_s,
        )
        # 1F1B needs a micro-batch per stage; a smaller batch (a replica's share) runs as GPipe
        schedule_cls = ScheduleGPipe if self.config.schedule == "gpipe" or chunks < self.world_size else Schedule1F1B
        schedule = schedule_cls(stage, n_microbatches=chunks, loss_fn=loss_fn, scale_grads=False)
        kwargs = {
            "attention_mask": inputs.attention_mask,
            "position_ids": inputs.position_ids,
            "rows": torch.arange(rows, device=self.device) if batch_rows is None else batch_rows.to(self.device),
            "completion_ids": inputs.completion_ids,
            "completion_mask": inputs.completion_mask,
            **({} if self.is_first else {"input_ids": inputs.input_ids}),
        }
        args = (inputs.input_ids,) if self.is_first else ()
        stage_module.want_entropy = with_entropy and self.is_last
        stage_module.last_entropy = []
        what = "in the pipelined forward/backward" if loss_fn is not None else "in the pipelined forward"
        with self.comm.guard(what):
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

    def _ship_first_fits(self, inputs: StageInputs, rows: Tensor) -> None:
        """``pipeline.first_fit=ship``, before the first pass (all ranks call): each cut whose
        codec has no basis yet is fitted by its sender on this batch as it arrives there, in stage
        order, and the fit crosses to the receiver before anything else (counted, as in one
        process). A stage whose output cut still needs a fit must see the batch as it will in
        training, so the batch's payloads cross the cuts before the deepest such cut once (no
        grad, counted in ``wire/bytes_fwd``): the price of fitting on the far side of a cut."""
        self._first_fits_pending = False
        needs = torch.zeros(len(self.specs), dtype=torch.float64)
        send = self.module.send_end
        if send is not None and send.codec.needs_calibration:
            needs[self.rank] = 1.0
        needs = self.comm.all_reduce(needs, "agreeing which cuts fit first")
        fitted = [cut for cut in range(len(self.specs)) if needs[cut] > 0]
        if not fitted or self.rank > fitted[-1] + 1:
            return
        deepest = fitted[-1]  # ranks 0..deepest compute; rank deepest + 1 only receives its basis
        mask = inputs.attention_mask
        tokens = int(mask.sum())
        kwargs = {"attention_mask": mask, "position_ids": inputs.position_ids, "rows": rows.to(self.device),
                  "completion_ids": inputs.completion_ids, "completion_mask": inputs.completion_mask}
        with torch.no_grad():
            if self.is_first:
                x = inputs.input_ids
            else:
                recv = self.module.recv_end
                assert recv is not None
                if needs[self.rank - 1] > 0:
                    recv.codec.load_basis_message(RefreshChannel(self.comm, self.rank - 1, self.rank - 1).receive(),
                                                  self.module.step)
                if self.rank > deepest:
                    return
                width, dtype = recv.codec.width, self._wire_dtype(recv.codec)
                x = self.comm.recv(tokens * width, dtype, self.rank - 1, "receiving the first fit's batch")
                x = x.view(tokens, width)
                kwargs["input_ids"] = inputs.input_ids
            payload = self.module.forward(x, first_fit=True, **kwargs)
            assert send is not None
            shipped = 0
            if needs[self.rank] > 0:
                message = send.codec.fit_message()
                RefreshChannel(self.comm, self.rank + 1, self.rank).send(message)
                shipped += send.codec.refresh_bytes(message)
            if self.rank < deepest:  # the next stage fits on what it receives
                self.comm.send(payload, self.rank + 1, "sending the first fit's batch")
                shipped += send.message_bytes(tokens, payload.dtype)
            self.meter.record_setup(self.rank, shipped)

    # -- pipeline.tied_rows: the tied embedding's rows -------------------------------------------

    def _tied_weight(self, module: StageModule) -> nn.Parameter | None:
        """``module``'s copy of the tied weight on the first or last rank (None elsewhere)."""
        if not self.tied or not (self.is_first or self.is_last):
            return None
        embedding = module.embed_tokens if self.is_first else module.lm_head
        assert embedding is not None
        return embedding.weight

    @torch.no_grad()
    def _send_tied_rows(self, module: StageModule, input_ids: Tensor, *, backward: bool) -> None:
        """Before a pass of ``module`` (all ranks call; only the first and last act): the last rank
        sends the rows of the batch's distinct ids (``torch.unique``: both sides know them without
        a message) and the first writes them into its copy, the only rows its forward reads; skipped
        while the first holds the current weight (the engine's own stage after a dense sync).
        ``backward``: the pass accumulates gradients, whose rows :meth:`reduce_tied_gradients` returns."""
        weight = self._tied_weight(module)
        if weight is None:
            return
        ids = torch.unique(input_ids)
        own = module is self.module
        if not (own and self._rows_current):
            what = "sending the tied embedding's rows to the first stage"
            if self.is_last:
                rows = weight.detach()[ids].contiguous()
                self.comm.send(rows, 0, what)
                self.tied_bytes += rows.numel() * rows.element_size()
            else:
                weight.index_copy_(0, ids, self.comm.recv(ids.numel() * weight.shape[1], weight.dtype, self.world_size - 1,
                                                          what).view(-1, weight.shape[1]))
        if backward:
            if own:
                self._rows_current = False  # the owner may step before the next pass
            seen = self._tied_ids.get(id(module))
            self._tied_ids[id(module)] = ids if seen is None else torch.unique(torch.cat([seen, ids]))

    def _return_tied_rows(self, module: StageModule) -> None:
        """After backward: the first rank sends the gradient rows of the ids its passes saw and drops
        its gradient (it never steps the tied weight); the last rank adds them into its dense one."""
        weight = self._tied_weight(module)
        ids = self._tied_ids.pop(id(module), None)
        if weight is None or ids is None:
            return
        what = "sending the tied embedding's gradient rows to the last stage"
        if self.is_first:
            grad = weight.grad[ids] if weight.grad is not None else weight.new_zeros(ids.numel(), weight.shape[1])
            self.comm.send(grad.contiguous(), self.world_size - 1, what)
            self.tied_bytes += grad.numel() * grad.element_size()
            weight.grad = None
        else:
            rows = self.comm.recv(ids.numel() * weight.shape[1], weight.dtype, 0, what).view(-1, weight.shape[1])
            if weight.grad is None:
                weight.grad = torch.zeros_like(weight)
            weight.grad.index_add_(0, ids, rows)

    def _trained(self, module: StageModule) -> list[nn.Parameter]:
        """``module``'s parameters this rank trains: with tied rows not the first rank's tied copy."""
        tied = self._tied_weight(module) if self.tied_rows and self.is_first else None
        return [p for p in module.parameters() if p.requires_grad and p is not tied]

    # -- the dense pass at a snapshot (the anchor's M) ------------------------------------------

    def dense_stage(self) -> StageModule:
        """This rank's stage as a separate dense module (built once): a copy of the stage's own
        layers (never the whole model) with the ``identity`` codec at both cuts, into which
        :meth:`dense_gradient` loads a snapshot. Its sends are the dense boundary."""
        if self._dense_stage is None:
            clone = copy.deepcopy(self.module)
            dense = [dataclasses.replace(spec, codec="identity", compressed=False) for spec in self.specs]
            clone.send_spec = None if self.is_last else dense[self.rank]
            clone.recv_spec = None if self.is_first else dense[self.rank - 1]
            clone.send_end = None if self.is_last else CutEnd(make_codec("identity", self.dim), sends=True, receives=False)
            clone.recv_end = None if self.is_first else CutEnd(make_codec("identity", self.dim), sends=False, receives=True)
            clone.send_tap, clone.recv_tap = self.module.send_codec, self.module.recv_codec
            self._dense_stage = clone.train()
        return self._dense_stage

    def dense_gradient(
        self, snapshot: list[Tensor], inputs: StageInputs, loss_fn: Callable[[Tensor, Tensor], Tensor]
    ) -> tuple[list[Tensor], float]:
        """The dense gradient for this rank's stage at ``snapshot`` (this rank's
        :meth:`owned_parameters` at some earlier tick, same order): loaded into :meth:`dense_stage`,
        one pipelined forward/backward of ``inputs`` over the dense boundary (``loss_fn`` on the
        last rank, :func:`no_loss` elsewhere), tied-embedding halves summed. Returns ``(grads,
        bytes)``: ``grads`` shaped like ``owned_parameters()``, ``bytes`` the boundary bytes of
        the pass summed over all ranks and both directions, counted from the actual sends."""
        stage = self.dense_stage()
        params = self._trained(stage)
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
        total = self.comm.all_reduce(torch.tensor(float(sent), dtype=torch.float64), "summing the anchor's bytes")
        grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in params]
        stage.zero_grad(set_to_none=True)
        return grads, float(total)

    # -- anchor.placement: sampler (the anchor on the sampling rank, signs to the stages) --------

    def anchor_stage_parameters(self, index: int) -> list[nn.Parameter]:
        """Rank ``index``'s :meth:`owned_parameters` as rank 0's whole copy holds them, in that
        rank's order (the order of its anchor tensors): its stage's trained parameters, the tied
        weight on the last stage (and on the first unless ``pipeline.tied_rows``)."""
        if index == self.rank:
            return self.owned_parameters()
        view = StageModule(self.model, index, self.specs, send_codec=None, recv_codec=None, seed=0)
        tied = self.model.get_output_embeddings().weight if self.tied_rows and index == 0 else None
        return [p for p in view.parameters() if p.requires_grad and p is not tied]

    def relay_anchor_signs(self, m_bar: dict[int, list[Tensor]] | None) -> tuple[list[Tensor] | None, int]:
        """All ranks call. Rank 0 sends rank ``r`` the sign message of ``m_bar[r]`` (every ``r > 0``;
        :func:`~tclightning.anchor.placement.pack_signs`: its header, then its body) and returns
        ``(None, bytes sent)``; every other rank returns ``(sign(M_bar) of its owned parameters, 0)``,
        on its device."""
        from tclightning.sign_message import body_bytes, header_bytes, pack_signs, unpack_signs

        if self.is_first:
            assert m_bar is not None
            sent = 0
            for index in range(1, self.world_size):
                header, body = pack_signs(m_bar[index])
                what = f"sending the anchor's signs to stage {index}"
                self.comm.send(header.to(self.device), index, what)
                if body.numel():
                    self.comm.send(body.to(self.device), index, what)
                sent += header.numel() + body.numel()
            return None, sent
        params = self.owned_parameters()
        sizes = [p.numel() for p in params]
        what = "receiving the anchor's signs from the sampling rank"
        header = self.comm.recv(header_bytes(len(params)), torch.uint8, 0, what)
        length = body_bytes(header, sizes)
        body = (self.comm.recv(length, torch.uint8, 0, what) if length
                else torch.zeros(0, dtype=torch.uint8, device=self.device))
        return unpack_signs(header, body, [p.shape for p in params]), 0

    # -- after backward ------------------------------------------------------------------------

    def owned_parameters(self) -> list[nn.Parameter]:
        """The parameters this rank trains (its stage's), in a fixed order; with ``pipeline.tied_rows``
        the tied weight is the last rank's only."""
        return self._trained(self.module)

    def reduce_tied_gradients(self, module: StageModule | None = None) -> None:
        """Tied input/output embeddings live on the first and last rank: sum their two gradients
        (what one process accumulates into the one shared tensor), so both copies step alike; with
        ``pipeline.tied_rows`` the first rank's gradient rows go to the last, which alone steps it.
        ``module``: whose tied weight (default the engine's stage, which shares the model's)."""
        if not self.tied or not (self.is_first or self.is_last):
            return
        stage_module = module if module is not None else self.module
        if self.tied_rows:
            self._return_tied_rows(stage_module)
            return
        embedding = stage_module.embed_tokens if self.is_first else stage_module.lm_head
        assert embedding is not None
        weight = embedding.weight
        if not weight.requires_grad:  # frozen (model.lora) on both ranks alike: nothing to sum
            return
        grad = weight.grad if weight.grad is not None else torch.zeros_like(weight)
        self.tied_bytes += grad.numel() * grad.element_size()  # each of the two ranks sends its half
        weight.grad = self.comm.all_reduce(grad, "summing the tied-embedding gradient", group=self._tie_group)

    def clip_gradients(self, max_norm: float) -> Tensor:
        """Global gradient norm over all stages (one all-reduced scalar) and ``clip_grad_norm_``'s
        scaling with it; returns the norm (the same on every rank)."""
        params = [p for p in self.owned_parameters() if p.grad is not None]
        tied = self.model.get_output_embeddings().weight if self.tied else None
        # counted once: on rank 0, or with tied rows on its owner (rank 0 has none)
        counted = params if self.tied_rows else [p for p in params if not (self.is_last and p is tied)]
        local = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in counted:
            local += p.grad.detach().double().pow(2).sum()
        total = self.comm.all_reduce(local, "summing the gradient norm").sqrt().float()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total.to(params[0].device) if params else total)
        return total

    def stage_parameters(self, index: int) -> list[nn.Parameter]:
        """Parameters of stage ``index`` as rank 0 sees them in its dense copy (tied ones once: on the
        first stage, or with ``pipeline.tied_rows`` on the last, which owns them)."""
        view = StageModule(self.model, index, self.specs, send_codec=None, recv_codec=None, seed=0)
        first = {id(p) for p in StageModule(self.model, 0, self.specs, send_codec=None, recv_codec=None,
                                            seed=0).parameters()}
        # frozen weights (model.lora: all but the adapters) never change, so no sync sends them
        trained = [p for p in view.parameters() if p.requires_grad]
        if not self.tied_rows:
            return [p for p in trained if index == 0 or id(p) not in first]
        tied = self.model.get_output_embeddings().weight
        if index == 0:
            return [p for p in trained if p is not tied]
        return [p for p in trained if id(p) not in first or (p is tied and index == self.world_size - 1)]

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
            what = f"sending stage {index}'s weights to the sampler"
            if self.rank == index:
                self.comm.send(torch.cat([p.detach().reshape(-1) for p in params]), 0, what)
            elif self.rank == 0:
                flat = self.comm.recv(numel, self.dtype, index, what)
                offset = 0
                for p in params:
                    p.copy_(flat[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
        self._rows_current = True  # rank 0 holds every stage's weights, the tied one too
        return total

    def start_sparse_sync(self, dtype: torch.dtype, *, syncs: bool = True) -> None:
        """``sampler.dtype``: from now on an update is followed by :meth:`sparse_sync_to_sampler`.
        Rank 0 builds the sampler's copy of the whole policy in ``dtype``, every other rank a mirror
        of its stage in ``dtype``, all from the weights every rank holds now (the initial broadcast,
        or the same checkpoint), so they start equal without a message. ``syncs``: this pipeline
        syncs (with replicas replica 0's; the others only count). Once: a later call keeps them."""
        if self.sampler_dtype is not None:
            return
        self.sampler_dtype = dtype
        self._full_sync_bytes = sum(full_bytes(self.stage_parameters(i), dtype) for i in range(1, self.world_size))
        if not syncs:
            return
        held = range(self.world_size) if self.is_first else [self.rank]
        self._synced = {index: self.stage_parameters(index) for index in held}
        if self.is_first:
            self.sampler_copy = SamplerCopy(self.model, dtype)
            names = {id(p): name for name, p in self.model.named_parameters()}
            self._mirrors = {index: self.sampler_copy.mirror([names[id(p)] for p in params])
                             for index, params in self._synced.items()}
        else:
            self._mirrors = {self.rank: WeightMirror.of(self._synced[self.rank], dtype)}

    @torch.no_grad()
    def sparse_sync_to_sampler(self) -> None:
        """After an update (with :meth:`start_sparse_sync`): rank 0's own stage brings the copy up
        to date in place; every other rank sends rank 0 the entries of its stage that changed in
        the sampler dtype (the message's length, int64, then the message), which rank 0 applies to
        the copy. The sender counts the bytes in ``sync_bytes``."""
        if not self._mirrors:  # a replica other than 0: nobody samples from it
            return
        if self.is_first:
            self._mirrors[0].advance(self._synced[0])
        for index in range(1, self.world_size):
            what = f"sending stage {index}'s changed weights to the sampler"
            if self.rank == index:
                message = self._mirrors[index].advance(self._synced[index])
                self.comm.send(torch.tensor([message.numel()], dtype=torch.int64), 0, what)
                if message.numel():
                    self.comm.send(message, 0, what)
                self.sync_bytes += message_bytes(message)
            elif self.is_first:
                size = int(self.comm.recv(1, torch.int64, index, what)[0])
                if size:
                    self._mirrors[index].apply(self.comm.recv(size, torch.uint8, index, what))

    def reset_sparse_sync(self) -> None:
        """Every rank loaded the same whole policy (a rollback): the copy and the mirrors take it
        again, cast, without a message (rank 0's dense copy is whole again too)."""
        for index, mirror in self._mirrors.items():
            mirror.reset(self._synced[index])

    def sync_before_checkpoint(self) -> None:
        """Collective, before a checkpoint is taken from rank 0's policy: with the sparse sync rank
        0's dense copy of the other stages is stale, so the full sync (:meth:`sync_to_sampler`, in
        the trainer's dtype) brings it up to date. Its bytes count in the next step's ``wire/sync_bytes`` (Lightning
        saves after the step's metrics were taken). Without the sparse sync: nothing to do."""
        if not self._mirrors:
            return
        before = self.sync_bytes
        self.sync_to_sampler()
        self._carried_sync_bytes += self.sync_bytes - before
        self.sync_bytes = before

    @torch.no_grad()
    def broadcast_weights(self) -> None:
        """Rank 0's weights to every rank (once at start-up: warm-ups or GPU kernels may differ)."""
        tensors = [t for t in [*self.model.parameters(), *self.model.buffers()] if t.is_floating_point()]
        self.comm.broadcast_tensors_(tensors, 0, "receiving the initial weights from rank 0", "the initial weight broadcast")

    # -- checkpoints ---------------------------------------------------------------------------

    def codec_state(self) -> dict[str, Any]:
        """This rank's codec state: the receiver side of the cut it decodes (bases) and the
        sender side of the cut it encodes (a basis codec's fit window)."""
        recv, send = self.module.recv_codec, self.module.send_codec
        return {"rank": self.rank, "state": recv.state_dict() if recv is not None else {},
                "send": send.state_dict() if send is not None else {}}

    def cut_state_dict(self) -> dict[str, Any] | None:
        """All ranks call; on rank 0 the ``CutSet.state_dict()`` layout (per cut: the state of the
        codec that decodes it, which lives on the cut's receiving rank)."""
        gathered = self.comm.gather_objects(self.codec_state(), "gathering the codec states for a checkpoint")
        if gathered is None:
            return None
        by_rank = {entry["rank"]: entry["state"] for entry in gathered}
        return {
            "step": self.module.step,
            "forward": [by_rank.get(ordinal + 1, {}) for ordinal in range(len(self.specs))],
            "sender": [entry["send"] for entry in sorted(gathered, key=lambda e: e["rank"])][: len(self.specs)],
        }

    def load_cut_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's share of a ``CutSet.state_dict()`` (from one or many processes)."""
        check_cut_state(state, len(self.specs))
        self.module.step = int(state.get("step", 0))
        forward = state.get("forward", [])
        if self.module.recv_codec is not None and len(forward) >= self.rank:
            self.module.recv_codec.load_state_dict(forward[self.rank - 1])
        # the sender's own state if the checkpoint has it (multi-process), else the cut's state
        # from one process, where one codec object was both sides
        sender = state.get("sender") or forward
        if self.module.send_codec is not None and len(sender) > self.rank:
            self.module.send_codec.load_state_dict(sender[self.rank])
