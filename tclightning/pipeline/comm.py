"""Communication between pipeline stage processes: collectives, the counted stage sends, failures.

No schedule here (that is :mod:`~tclightning.pipeline.engine`) and no Lightning.

* :class:`StageComm` -- this rank's view of the process group: small collectives (sums,
  broadcasts and gathers of Python objects, flat point-to-point tensors), each waited on under
  :meth:`StageComm.guard`, which turns a dead or hung peer into :class:`StageFailure` naming it.
* :func:`payload_stage` -- the ``PipelineStage`` the schedule drives: per-micro-batch receive
  buffers sized from the token mask every rank holds (only ``k`` values per token travel, no
  shapes), every send counted in a :class:`~tclightning.pipeline.boundary.WireMeter` (per cut,
  per direction: ``wire/*`` come from the actual sends) and optionally paced to a link rate.

gloo raises at once when a peer's socket closes; a hung peer is caught when the process group's
timeout (``pipeline.timeout_s``) expires.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from tclightning.errors import TclightningError
from tclightning.pipeline.boundary import BACKWARD, FORWARD, WireMeter
from tclightning.pipeline.stage import StageModule


class StageFailure(TclightningError):
    """A pipeline peer died, hung past the timeout, or its link failed; the message names the rank."""


class Watch:
    """Which peer this rank is waiting on, for the error message when the wait fails."""

    def __init__(self) -> None:
        self.peers: list[int] = []
        self.what = "start-up"

    def expect(self, peers: list[int], what: str) -> None:
        self.peers, self.what = peers, what


class StageComm:
    """This rank's collectives over ``group`` (the default group when None), on ``device``.

    Every wait names what it waits for (``what``) and whom; a failed wait raises
    :class:`StageFailure` naming the peer and ``timeout_s`` (the group's timeout)."""

    def __init__(self, group: Any, device: torch.device, timeout_s: float) -> None:
        if not dist.is_initialized():
            raise TclightningError("the multi-process pipeline needs torch.distributed initialised (launch with devices>1)")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device = device
        self.timeout_s = timeout_s
        self.watch = Watch()

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
        """Sum ``tensor`` over ranks (on the comm's device, returned on the input's)."""
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
            dist.broadcast_object_list(box, src=index_to_global(src, self.group), group=self.group, device=self.device)
        return box[0]

    def gather_objects(self, obj: Any, what: str) -> list[Any] | None:
        """``obj`` of every rank, on rank 0 (None elsewhere)."""
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        self.watch.expect([], what)
        with self.guard(what):
            dist.gather_object(obj, out, dst=index_to_global(0, self.group), group=self.group)
        return out

    def broadcast_tensors_(self, tensors: list[Tensor], src: int, what: str, waiting_for: str) -> None:
        """Every tensor of ``tensors`` (in place) from rank ``src`` on every rank."""
        self.watch.expect([src] if self.rank != src else [], waiting_for)
        with self.guard(what):
            for tensor in tensors:
                work = tensor.data.to(self.device)
                dist.broadcast(work, src=index_to_global(src, self.group), group=self.group)
                tensor.data.copy_(work)

    def send(self, tensor: Tensor, dst: int, what: str) -> None:
        """Point-to-point ``tensor`` to rank ``dst`` (paired with its :meth:`recv`)."""
        self.watch.expect([dst], what)
        with self.guard(what):
            dist.send(tensor.to(self.device), dst=index_to_global(dst, self.group), group=self.group)

    def recv(self, numel: int, dtype: torch.dtype, src: int, what: str) -> Tensor:
        """A flat tensor of ``numel`` values from rank ``src`` (paired with its :meth:`send`)."""
        flat = torch.empty(numel, dtype=dtype, device=self.device)
        self.watch.expect([src], what)
        with self.guard(what):
            dist.recv(flat, src=index_to_global(src, self.group), group=self.group)
        return flat


def payload_stage(
    module: StageModule,
    comm: StageComm,
    *,
    in_shapes: list[tuple[int, int]],
    out_shapes: list[tuple[int, int]],
    dtype: torch.dtype,
    meter: WireMeter,
    link_bits_per_s: float | None,
    in_dtype: torch.dtype | None = None,
    out_dtype: torch.dtype | None = None,
) -> Any:
    """A ``PipelineStage`` of ``module`` whose messages of micro-batch ``i`` are ``in_shapes[i]``
    (received, in ``in_dtype``) and ``out_shapes[i]`` (sent, in ``out_dtype``; both default to the
    model's ``dtype``), every send counted in ``meter`` against the dense boundary in ``dtype`` and
    paced to ``link_bits_per_s`` when given (the class is built on first use: importing pipelining
    is not free)."""
    global _PAYLOAD_STAGE
    if _PAYLOAD_STAGE is None:
        _PAYLOAD_STAGE = _make_payload_stage_class()
    return _PAYLOAD_STAGE(
        module, device=comm.device, group=comm.group, in_shapes=in_shapes, out_shapes=out_shapes, dtype=dtype,
        in_dtype=in_dtype or dtype, out_dtype=out_dtype or dtype, meter=meter, watch=comm.watch,
        link_bits_per_s=link_bits_per_s,
    )


_PAYLOAD_STAGE: type | None = None


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
            in_dtype: torch.dtype,
            out_dtype: torch.dtype,
            meter: WireMeter,
            watch: Watch,
            link_bits_per_s: float | None,
        ) -> None:
            example_in = (
                torch.zeros(1, 1, dtype=torch.long)
                if module.is_first
                else torch.zeros(1, 1, dtype=in_dtype, requires_grad=True)
            )
            example_out = (
                torch.zeros(1, 1, dtype=torch.float32, requires_grad=True)
                if module.is_last
                else torch.zeros(1, 1, dtype=out_dtype, requires_grad=True)
            )
            # Static metadata: no shape-inference forward (it would run the codecs on dummy data).
            super().__init__(
                module, module.index, module.num_stages, device,
                input_args=example_in, output_args=example_out, group=group,
            )
            self.in_shapes, self.out_shapes, self.dtype = in_shapes, out_shapes, dtype
            self.in_dtype, self.out_dtype = in_dtype, out_dtype
            self.meter, self.watch, self.link_bits_per_s = meter, watch, link_bits_per_s

        def _rank_of(self, stage: int) -> int:
            return self._resolve_peer_global_rank(stage)

        def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[Any]:
            if not self.is_first:
                info = self.args_recv_info[fwd_chunk_id][0]
                info.buffer = torch.empty(self.in_shapes[fwd_chunk_id], dtype=self.in_dtype, device=self.device)
                self.watch.expect([self._rank_of(self.stage_index - 1)], f"the forward message of micro-batch {fwd_chunk_id}")
            return super().get_fwd_recv_ops(fwd_chunk_id)

        def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[Any]:
            if self.has_backward and not self.is_last:
                info = self.grad_recv_info[bwd_chunk_id][0]
                info.buffer = torch.empty(self.out_shapes[bwd_chunk_id], dtype=self.out_dtype, device=self.device)
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
            # the bytes the message's codec counts for its [T, width] tokens (equal to the tensor's
            # bytes, except for a codec that counts its values packed: quantised coefficients)
            end = self.submod.send_end if direction == FORWARD else self.submod.recv_end
            for op in ops:
                tensor = op.tensor
                sent = tensor.numel() * tensor.element_size()
                if end is not None and tensor.dim() == 2:
                    sent = end.message_bytes(tensor.shape[0], tensor.dtype)
                self.meter.record(cut, direction, sent, tensor.shape[0] * dim * self.dtype.itemsize)
                self.watch.expect([op.peer], f"sending the {direction} message across cut {cut}")
                if self.link_bits_per_s:  # software-paced link: the serialisation delay of the message
                    time.sleep(sent * 8 / self.link_bits_per_s)

    return PayloadStage


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
