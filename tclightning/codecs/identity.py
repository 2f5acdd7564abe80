"""The identity codec: the dense boundary, sent as is (the control every codec is priced against)."""

from __future__ import annotations

import torch
from torch import Tensor

from tclightning.codecs.base import Codec, CodecKey


class IdentityCodec(Codec):
    """``payload = x``, ``decode(payload) = payload``; ``d * element_size`` bytes per token."""

    name = "identity"

    def encode(self, x: Tensor, key: CodecKey, *, token_ids: Tensor | None = None,
               token_mask: Tensor | None = None) -> Tensor:
        if x.shape[-1] != self.dim:
            raise ValueError(f"tensor has {x.shape[-1]} channels, codec expects d={self.dim}")
        return x

    def decode(self, payload: Tensor, key: CodecKey, *, token_mask: Tensor | None = None,  # type: ignore[override]
               token_ids: Tensor | None = None) -> Tensor:
        return payload

    def payload_bytes(self, tokens: int, dtype: torch.dtype) -> int:
        return tokens * self.dim * dtype.itemsize
