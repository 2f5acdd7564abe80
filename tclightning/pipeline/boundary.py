"""The autograd cut: what one boundary does to the activation going forward and the gradient coming back.

Forward, sender -> receiver:   payload = enc(x);  payload = wire.send_forward(payload);  x_hat = dec(payload)
Backward, receiver -> sender: the message is the gradient w.r.t. the payload, i.e. plain autograd
through ``dec`` then ``enc`` ([tokens, k] for prf: the same indices, for free).

Everything that crosses goes through a :class:`Wire`. In one process that is :class:`LoopbackWire`
(hands the payload back); the multi-process Strategy supplies a wire that sends it to the next
stage's rank. Byte accounting is separate (:class:`WireMeter`), so both count the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from tclightning.codecs import Codec, CodecKey, Payload
from tclightning.pipeline.endpoint import CutEnd

FORWARD = "fwd"
BACKWARD = "bwd"


class Wire(Protocol):
    """Transport for payloads between the two sides of cut ``ordinal``; returns what the receiver got."""

    def send_forward(self, ordinal: int, payload: Payload) -> Payload: ...

    def send_backward(self, ordinal: int, message: Payload) -> Payload: ...


class LoopbackWire:
    """One process: sender and receiver are the same process, so the payload is handed back as is."""

    def send_forward(self, ordinal: int, payload: Payload) -> Payload:
        return payload

    def send_backward(self, ordinal: int, message: Payload) -> Payload:
        return message


@dataclass
class CutTraffic:
    """Bytes across one cut since the last reset: sent, and what the dense boundary would have sent."""

    layer: int
    bytes_fwd: int = 0
    bytes_bwd: int = 0
    dense_fwd: int = 0
    dense_bwd: int = 0
    messages_fwd: int = 0
    messages_bwd: int = 0

    @property
    def ratio(self) -> float:
        """Dense bytes / sent bytes over both directions (1.0 when nothing was sent)."""
        sent = self.bytes_fwd + self.bytes_bwd
        return (self.dense_fwd + self.dense_bwd) / sent if sent else 1.0


class WireMeter:
    """Per-cut, per-direction byte counters."""

    def __init__(self, layers: list[int]) -> None:
        self.cuts = [CutTraffic(layer) for layer in layers]

    def record(self, ordinal: int, direction: str, sent: int, dense: int) -> None:
        traffic = self.cuts[ordinal]
        if direction == FORWARD:
            traffic.bytes_fwd += sent
            traffic.dense_fwd += dense
            traffic.messages_fwd += 1
        else:
            traffic.bytes_bwd += sent
            traffic.dense_bwd += dense
            traffic.messages_bwd += 1

    def record_setup(self, ordinal: int, sent: int) -> None:
        """Forward bytes outside the messages (an svd basis, or a refreshed lowrank basis, shipped
        to the receiver)."""
        self.cuts[ordinal].bytes_fwd += sent

    def reset(self) -> None:
        self.cuts = [CutTraffic(t.layer) for t in self.cuts]

    def metrics(self) -> dict[str, float]:
        """``wire/bytes_fwd``, ``wire/bytes_bwd``, ``wire/dense_bytes_fwd``, ``wire/dense_bytes_bwd``,
        ``wire/ratio`` (dense / sent, both directions, 1.0 if nothing sent) summed over cuts, and
        ``wire/cut{i}/bytes_fwd|bytes_bwd|ratio`` per cut (i = ordinal)."""
        total = CutTraffic(-1)
        out: dict[str, float] = {}
        for ordinal, t in enumerate(self.cuts):
            total.bytes_fwd += t.bytes_fwd
            total.bytes_bwd += t.bytes_bwd
            total.dense_fwd += t.dense_fwd
            total.dense_bwd += t.dense_bwd
            out[f"wire/cut{ordinal}/bytes_fwd"] = float(t.bytes_fwd)
            out[f"wire/cut{ordinal}/bytes_bwd"] = float(t.bytes_bwd)
            out[f"wire/cut{ordinal}/ratio"] = t.ratio
        out.update(
            {
                "wire/bytes_fwd": float(total.bytes_fwd),
                "wire/bytes_bwd": float(total.bytes_bwd),
                "wire/dense_bytes_fwd": float(total.dense_fwd),
                "wire/dense_bytes_bwd": float(total.dense_bwd),
                "wire/ratio": total.ratio,
            }
        )
        return out


TRAFFIC_METRICS = ("wire/bytes_fwd", "wire/bytes_bwd", "wire/sync_bytes", "wire/tied_bytes", "wire/rollout_bytes",
                   "anchor/bytes", "dp/bytes")
"""Every class of traffic between ranks a step logs; ``wire/total_bytes`` is their sum."""


def total_bytes(metrics: dict[str, float]) -> float:
    """``wire/total_bytes``: the sum of the :data:`TRAFFIC_METRICS` ``metrics`` holds (the step's
    bytes between ranks, every class; the boundary alone is ``wire/bytes_fwd + wire/bytes_bwd``)."""
    return float(sum(metrics.get(name, 0.0) for name in TRAFFIC_METRICS))


def count_tokens(x: Tensor, token_mask: Tensor | None) -> int:
    """Real tokens in a ``[B, L, d]`` boundary: ``token_mask.sum()`` if given, else ``B * L``."""
    if token_mask is not None:
        return int(token_mask.sum())
    return x.numel() // x.shape[-1]


class Boundary:
    """One cut in one process: its :class:`~tclightning.pipeline.endpoint.CutEnd` (both sides),
    its wire and its meter."""

    def __init__(self, ordinal: int, codec: Codec, wire: Wire, meter: WireMeter) -> None:
        self.ordinal = ordinal
        self.end = CutEnd(codec, sends=True, receives=True)
        self.wire = wire
        self.meter = meter

    @property
    def codec(self) -> Codec:
        return self.end.codec

    @codec.setter
    def codec(self, codec: Codec) -> None:
        self.end = CutEnd(codec, sends=True, receives=True)

    def __call__(self, x: Tensor, key: CodecKey, token_mask: Tensor | None = None,
                 token_ids: Tensor | None = None) -> Tensor:
        """``x`` [B, L, d] at the sender -> ``x_hat`` at the receiver, with the backward message
        routed through the wire and counted. ``token_mask`` [B, L] (True = real) scopes the count;
        ``token_ids`` [B, L] are the batch's tokens, which the receiver holds, as
        :func:`~tclightning.codecs.context.context_keys` (a codec may use them; plain ids are keys
        without context)."""
        tokens = count_tokens(x, token_mask)
        end = self.end
        if end.codec.needs_calibration or end.learns:
            with torch.no_grad():
                real = x[token_mask.bool()] if token_mask is not None else x.reshape(-1, x.shape[-1])
                real_ids = None
                if token_ids is not None and token_ids.shape == x.shape[:-1]:
                    real_ids = token_ids[token_mask.bool()] if token_mask is not None else token_ids.reshape(-1)
            shipped = end.setup_bytes(real, real_ids, key.step)
            if shipped:
                self.meter.record_setup(self.ordinal, shipped)
            end.observe_sent(real, real_ids)
        payload = self.wire.send_forward(self.ordinal, end.encode(x, key, token_ids, token_mask))
        self._record(FORWARD, payload, tokens, x.dtype)
        if isinstance(payload, Tensor) and payload.requires_grad:
            payload.register_hook(self._gradient_hook(tokens, x.dtype))
        return end.decode(end.from_wire(payload, x.dtype), key, token_mask=token_mask, token_ids=token_ids)

    def _gradient_hook(self, tokens: int, dense_dtype: torch.dtype) -> Callable[[Tensor], Tensor]:
        def send_gradient(grad: Tensor) -> Tensor:
            message = self.wire.send_backward(self.ordinal, grad)
            self._record(BACKWARD, message, tokens, dense_dtype)
            return message  # type: ignore[return-value]

        return send_gradient

    def _record(self, direction: str, message: Payload, tokens: int, dense_dtype: torch.dtype) -> None:
        """Count ``message`` (bytes at its own dtype) against the dense boundary in ``dense_dtype``
        (the activations')."""
        dtype = (message[0] if isinstance(message, tuple) else message).dtype
        dense = tokens * self.end.codec.dim * dense_dtype.itemsize
        self.meter.record(self.ordinal, direction, self.end.message_bytes(tokens, dtype), dense)
