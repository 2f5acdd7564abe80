"""What a process holds of one cut: its codec and the sides it plays (pure torch, no Lightning).

In one process a cut is one :class:`CutEnd` that both sends and receives (one codec object is
both sides: the hooks of :mod:`~tclightning.pipeline.cuts`). Across processes the rank before the
cut holds a sending end and the rank after it a receiving end, each with its own codec that the
shared traffic keeps equal (:class:`~tclightning.pipeline.stage.StageModule`). Both run the same
code here: what the codecs learn from traffic, encode / decode and the step change (the codecs'
refresh protocol); what a checkpoint keeps is the codec's own ``state_dict``. The pipeline asks a
codec what it needs through :class:`~tclightning.codecs.Codec` methods, never its class.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from tclightning.codecs import Codec, CodecKey, Payload


class BasisChannel(Protocol):
    """Carries a codec's refresh message across a cut (processes only): ``send`` on the sending
    rank, ``receive`` on the receiving one; ``None`` means "kept"."""

    def send(self, message: Tensor | None) -> None: ...

    def receive(self) -> Tensor | None: ...


class CutEnd:
    """One process's end of a cut: ``codec``, which ``sends`` (encodes) and/or ``receives`` (decodes)."""

    def __init__(self, codec: Codec, *, sends: bool, receives: bool) -> None:
        self.codec, self.sends, self.receives = codec, sends, receives

    @property
    def learns(self) -> bool:
        """Whether the codec learns from the traffic (the caller gathers the real tokens only then)."""
        return self.codec.learns_from_traffic

    # -- what the codecs learn from the traffic ------------------------------------------------

    @torch.no_grad()
    def observe_sent(self, real: Tensor, real_ids: Tensor | None, tap: Codec | None = None) -> None:
        """Sender: the real tokens ``[T, d]`` about to be encoded and their ``[T]`` context keys.
        ``tap`` (the anchor's dense copy) hands dense traffic on to the trained stage's codec."""
        if tap is not None:
            tap.observe_dense(real, real_ids)
        codec = self.codec
        if not codec.learns_from_traffic:
            return
        if codec.crosses_dense:  # what the receiver will hold of it
            codec.observe_dense(codec.as_received(real), real_ids)
        codec.observe_sent(real, real_ids)

    @torch.no_grad()
    def observe_received(self, real: Tensor, real_ids: Tensor | None, tap: Codec | None = None) -> None:
        """Receiver across processes: the ``[T, d]`` tokens that crossed dense (the sender
        observed the same ones). In one process the sending side has already observed them."""
        if tap is not None:
            tap.observe_dense(real, real_ids)
        if not self.sends and self.codec.crosses_dense:
            self.codec.observe_dense(real, real_ids)

    def setup_bytes(self, tokens: Tensor, token_ids: Tensor | None = None, step: int = 0) -> int:
        """Before the first message: a codec fitted on the first traffic (svd, lowrank's shipped
        first fit) fits on ``tokens`` [T, d] (ids [T]) now, at step ``step``, and the bytes its fit
        costs to ship are returned (0 otherwise)."""
        if not self.codec.needs_calibration:
            return 0
        self.codec.calibrate(tokens, token_ids, step=step)
        return self.codec.setup_bytes(tokens.dtype)

    # -- the message -------------------------------------------------------------------------------

    def encode(self, hidden: Tensor, key: CodecKey, token_ids: Tensor | None,
               token_mask: Tensor | None = None) -> Payload:
        """``hidden`` [..., d] -> the payload as it crosses (the wire dtype); ``token_mask``: the real tokens."""
        return self.codec.to_wire(self.codec.encode(hidden, key, token_ids=token_ids, token_mask=token_mask))

    def decode(self, payload: Payload, key: CodecKey, *, token_mask: Tensor | None,
               token_ids: Tensor | None) -> Tensor:
        """A payload as it arrived (already in the model's dtype, :meth:`from_wire`) -> ``[..., d]``."""
        return self.codec.decode(payload, key, token_mask=token_mask, token_ids=token_ids)

    def from_wire(self, payload: Payload, dtype: torch.dtype) -> Payload:
        return self.codec.from_wire(payload, dtype)

    def message_bytes(self, tokens: int, dtype: torch.dtype) -> int:
        """Bytes of a message of ``tokens`` real tokens whose values cross in ``dtype``."""
        return self.codec.payload_bytes(tokens, dtype)

    # -- the step change ---------------------------------------------------------------------------

    def change_step(self, step: int, channel: BasisChannel | None = None) -> int:
        """Step ``step`` begins: both sides run the codec's refresh protocol -- ``fit`` (each side on the dense tokens both saw)
        or ``ship`` (the sender decides and sends its fit over ``channel``; in one process the one
        codec already holds it). Returns the bytes this end sent."""
        codec = self.codec
        action = codec.plan_refresh(step)
        if action == "fit":
            codec.fit_shared(step)
        elif action == "ship":
            if self.sends:
                message = codec.basis_message(step)
                if not self.receives:
                    assert channel is not None
                    channel.send(message)
                return codec.refresh_bytes(message)
            assert channel is not None
            codec.load_basis_message(channel.receive(), step)
        return 0

    def __repr__(self) -> str:
        return repr(self.codec)
