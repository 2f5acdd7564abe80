"""The boundary-codec protocol: what crosses a pipeline cut, and how many bytes it costs.

A codec turns a boundary tensor ``x`` of shape ``[B, L, d]`` (rows x positions x channels; a 2-D
``[T, d]`` tensor is one row of ``T`` positions) into a *payload* -- the only thing that crosses
the wire -- and back:

    payload = codec.encode(x, key)          # sender side
    x_hat   = codec.decode(payload, key)    # receiver side, same key => same reconstruction

The key is shared by both sides and never sent. Pure tensor math: no Lightning import here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from tclightning.tensor_files import FLOAT_DTYPES

Payload = Tensor | tuple[Tensor, ...]
"""What crosses a cut: one tensor (prf values, svd/lowrank coefficients, identity) or a tuple."""

FORWARD_STREAM = 0
"""``CodecKey.stream`` for boundary activations (forward)."""


@dataclass(frozen=True)
class CodecKey:
    """Everything sender and receiver share to agree on a message without sending indices.

    ``seed``: run-level secret; ``step``: optimizer tick; ``cut``: the cut's identity (the layer
    index it follows, so the same cut gets the same indices under any layout); ``row_offset``:
    global index of this tensor's first row (micro-batches / data-parallel shards keep global rows);
    ``stream``: 0 forward activations (the only stream sent; another value keys independent indices).
    """

    seed: int
    step: int
    cut: int
    row_offset: int = 0
    stream: int = FORWARD_STREAM


def as_rows(x: Tensor) -> Tensor:
    """View ``x`` as ``[B, L, d]``: a 2-D ``[T, d]`` tensor is one row of ``T`` positions."""
    if x.dim() == 3:
        return x
    if x.dim() == 2:
        return x.unsqueeze(0)
    raise ValueError(f"boundary tensors must be [B, L, d] or [T, d], got shape {tuple(x.shape)}")


def payload_nbytes(payload: Payload) -> int:
    """Bytes of a payload as it would be sent: sum of ``numel * element_size`` over its tensors."""
    tensors = payload if isinstance(payload, tuple) else (payload,)
    return sum(t.numel() * t.element_size() for t in tensors)


WIRE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
"""Narrower dtypes a payload may cross in (``pipeline.payload_dtype``)."""


def dense_bytes(tokens: int, dim: int, dtype: torch.dtype) -> int:
    """Bytes of the uncompressed boundary: ``tokens * d * element_size``."""
    return tokens * dim * dtype.itemsize


def saved_tensor(state: dict[str, Any], key: str, shape: tuple[int | None, ...], *, floating: bool = True,
                 optional: bool = False) -> Tensor | None:
    """``state[key]`` as a codec's :meth:`Codec.load_state_dict` may take it: a tensor of
    ``shape`` (None: any length there), floating (finite) or integer, or None with ``optional``.
    Anything else raises ``ValueError`` naming the key: a checkpoint written for another cut, or
    crafted, would otherwise resume and code with a basis of the wrong size or kind."""
    value = state.get(key)
    if value is None and optional:
        return None
    ok = (isinstance(value, Tensor) and value.dim() == len(shape)
          and all(want is None or got == want for got, want in zip(value.shape, shape))
          and (value.dtype in FLOAT_DTYPES if floating
               else not value.is_floating_point() and value.dtype != torch.bool))
    if ok and floating and not bool(torch.isfinite(value).all()):
        ok = False
    if not ok:
        kind = "finite float" if floating else "integer"
        got = (f"a {value.dtype} tensor of shape {tuple(value.shape)}" if isinstance(value, Tensor)
               else type(value).__name__)
        want = "x".join("n" if d is None else str(d) for d in shape)
        raise ValueError(f"codec state '{key}': expected a {kind} tensor of shape {want}, got {got}")
    return value


def saved_count(state: dict[str, Any], key: str, low: int = 0) -> int:
    """``state[key]`` as a whole number >= ``low`` (a version, a step, a count); else ``ValueError``."""
    value = state.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"codec state '{key}': expected a whole number >= {low}, got {value!r}")
    return value


class Codec(ABC):
    """A boundary codec for a ``d``-channel cut.

    Contract: ``decode(encode(x, key), key)`` has ``x``'s shape ``[B, L, d]``; the payload is all
    that crosses; ``payload_bytes(tokens, dtype)`` is exactly what ``tokens`` real tokens cost on
    the wire. Both maps are differentiable (every codec is linear in ``x``: prf, identity, svd,
    lowrank), so the gradient w.r.t. the payload is the backward message (chain rule through the codec).
    """

    name: str = "codec"
    learns_from_traffic: bool = False
    """True for codecs that want :meth:`observe_sent` / :meth:`observe_dense` calls (lowrank)."""
    wire_dtype: torch.dtype | None = None
    """The dtype the payload crosses in (None: the activations'). A narrower one (float16, bfloat16)
    halves a float32 model's payload bytes; the receiver decodes the rounded values, and the
    gradient message, the gradient w.r.t. the payload, crosses in it too."""

    def __init__(self, dim: int) -> None:
        if dim <= 0:
            raise ValueError(f"dim must be positive, got {dim}")
        self.dim = dim

    @abstractmethod
    def encode(self, x: Tensor, key: CodecKey, *, token_ids: Tensor | None = None,
               token_mask: Tensor | None = None) -> Payload:
        """Sender side: ``[B, L, d]`` (or ``[T, d]``) -> payload. ``token_ids`` (``x``'s shape
        without channels) is side information both sides hold; a codec that uses it is given the
        same ids by :meth:`decode`. ``token_mask`` (the same shape, True = real token) marks the
        positions whose bytes count; a codec that spends a byte budget per message spends it on
        those alone (None: every position is real)."""

    @abstractmethod
    def decode(self, payload: Payload, key: CodecKey, *, token_mask: Tensor | None = None,
               token_ids: Tensor | None = None) -> Tensor:
        """Receiver side: payload -> ``[B, L, d]``. ``token_mask`` ([B, L], True = real token) only
        marks the real tokens; ``token_ids`` ([B, L], the batch's input ids, which every stage
        holds) is side information a codec may condition on."""

    @abstractmethod
    def payload_bytes(self, tokens: int, dtype: torch.dtype) -> int:
        """Exact wire bytes of one message carrying ``tokens`` tokens of ``dtype``."""

    def payload_bytes_per_token(self, dtype: torch.dtype) -> float:
        """Wire bytes per token for a large message (per-message overheads amortised away)."""
        return float(self.payload_bytes(1, dtype))

    def to_wire(self, payload: Payload) -> Payload:
        """``payload`` as it crosses: cast to :attr:`wire_dtype` (differentiable, so the gradient
        message is cast back the same way); tuples pass as they are."""
        if self.wire_dtype is None or not isinstance(payload, Tensor):
            return payload
        return payload.to(self.wire_dtype)

    def from_wire(self, payload: Payload, dtype: torch.dtype) -> Payload:
        """The received ``payload`` back in the activations' ``dtype`` (a no-op without a wire dtype)."""
        if self.wire_dtype is None or not isinstance(payload, Tensor):
            return payload
        return payload.to(dtype)

    def as_received(self, tokens: Tensor) -> Tensor:
        """What the receiver holds of ``tokens`` sent as they are (a basis codec's cold start): the
        values rounded to :attr:`wire_dtype`, in their own dtype."""
        return tokens if self.wire_dtype is None else tokens.to(self.wire_dtype).to(tokens.dtype)

    @property
    def width(self) -> int:
        """Values per token of the forward message now (the multi-process schedule sizes its buffers
        with it; a stateful codec may change it between steps, never within one)."""
        return self.dim

    @property
    def crosses_dense(self) -> bool:
        """True while this cut sends the dense boundary (a basis codec before its first fit): both
        sides then hand what crossed to :meth:`observe_dense`."""
        return False

    def observe_dense(self, tokens: Tensor, token_ids: Tensor | None = None) -> None:
        """Dense boundary activations both sides of the cut hold (``[T, d]`` real tokens: the
        anchor's dense pass, or a step that crossed dense) and, if known, their ``[T]`` token ids.
        Called with identical tensors on the sender and the receiver, so state fitted from them
        agrees without a byte sent. No-op by default."""

    def observe_sent(self, tokens: Tensor, token_ids: Tensor | None = None) -> None:
        """Sender side only: the real tokens ``[T, d]`` this side just encoded (no grad) and, if
        known, their ``[T]`` token ids. No-op by default."""

    def step_metrics(self) -> dict[str, float]:
        """Codec-specific per-step figures (logged as ``wire/cut{i}/<name>``); empty by default."""
        return {}

    def reset_metrics(self) -> None:
        """Start :meth:`step_metrics` from zero (at every RL step)."""

    # -- what the pipeline asks a codec (never its class) ------------------------------------------

    @property
    def needs_calibration(self) -> bool:
        """True while the codec must fit on the first traffic before it can encode (svd): the
        pipeline then calls :meth:`calibrate` and counts :meth:`setup_bytes`."""
        return False

    def calibrate(self, activations: Tensor, token_ids: Tensor | None = None, *, step: int = 0) -> None:
        """Fit on the real tokens ``[T, d]`` (and their ``[T]`` ids, if known) of the first forward,
        at step ``step`` (only when :attr:`needs_calibration`)."""
        raise NotImplementedError(f"{type(self).__name__} does not calibrate")

    def setup_bytes(self, dtype: torch.dtype) -> int:
        """Bytes :meth:`calibrate`'s fit costs to ship to the receiver."""
        raise NotImplementedError(f"{type(self).__name__} does not calibrate")

    def plan_refresh(self, step: int) -> str | None:
        """What both sides do as step ``step`` begins, read from shared state only: ``"fit"``
        (each side :meth:`fit_shared`), ``"ship"`` (the sender's :meth:`basis_message` to the
        receiver's :meth:`load_basis_message`) or None (nothing; every codec without state)."""
        return None

    def fit_shared(self, step: int) -> bool:
        """Both sides: fit on the dense tokens both saw; whether the state changed."""
        raise NotImplementedError(f"{type(self).__name__} has no refresh")

    def basis_message(self, step: int) -> Tensor | None:
        """Sender: the refreshed state to ship, or None (kept)."""
        raise NotImplementedError(f"{type(self).__name__} has no refresh")

    def load_basis_message(self, message: Tensor | None, step: int) -> None:
        """Receiver: install what :meth:`basis_message` sent (None: kept)."""
        raise NotImplementedError(f"{type(self).__name__} has no refresh")

    def refresh_bytes(self, message: Tensor | None) -> int:
        """Bytes a ``ship`` of ``message`` costs on the wire (its flag included)."""
        raise NotImplementedError(f"{type(self).__name__} has no refresh")

    def state_dict(self) -> dict[str, Any]:
        """Receiver-side state to checkpoint (empty for stateless codecs)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(dim={self.dim})"
