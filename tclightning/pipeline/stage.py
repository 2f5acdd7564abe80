"""One pipeline stage of a HF decoder as its own ``nn.Module``: what one rank runs.

Stage ``s`` of ``S`` (cuts after layers ``c_0 < ... < c_{S-2}``) holds decoder layers
``(c_{s-1}, c_s]`` (the first stage also the embedding, the last the final norm and the LM head)
and the codec ends of its two cuts:

    first stage:  input_ids -> embed -> layers -> enc_s -> pack          (payload [T, k])
    middle:       payload -> unpack -> dec_{s-1} -> layers -> enc_s -> pack
    last stage:   payload -> unpack -> dec_{s-1} -> layers -> norm -> lm_head -> log p(completion)

``pack`` keeps the real tokens only (``attention_mask == 1``), so a message is exactly
``T_real x k`` values -- the bytes the one-process ``WireMeter`` counts -- and nothing of size d
crosses a compressed cut. ``unpack`` scatters them back into ``[B, L, k]`` (zeros at padding,
which no real token attends to), and the decoder rebuilds ``[B, L, d]``. The gradient w.r.t. the
packed payload is the backward message, ``[T, k]`` as well.

The forward mirrors ``LlamaModel.forward`` / ``completion_logps`` (same masks, rotary positions
and tempered log-softmax), so a stage chain computes what the one-process model with cuts
computes. Pure torch + transformers: no Lightning, no process group.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tclightning.codecs import Codec, CodecKey
from tclightning.codecs.context import context_keys
from tclightning.errors import TclightningError
from tclightning.pipeline.cuts import find_decoder_layers
from tclightning.pipeline.layout import CutSpec


def stage_bounds(specs: list[CutSpec], num_layers: int) -> list[tuple[int, int]]:
    """``[(first_layer, end_layer), ...]`` per stage: a cut after layer ``c`` ends a stage at ``c + 1``."""
    edges = [0, *(spec.layer + 1 for spec in specs), num_layers]
    return list(itertools.pairwise(edges))


def pack(x: Tensor, mask: Tensor) -> Tensor:
    """``[B, L, c]`` -> ``[T, c]``: the rows of real tokens (``mask`` [B, L], nonzero = real), in order."""
    return x[mask.bool()]


def unpack(payload: Tensor, mask: Tensor) -> Tensor:
    """Inverse of :func:`pack`: ``[T, c]`` -> ``[B, L, c]`` with zeros at padding (differentiable)."""
    keep = mask.bool()
    out = payload.new_zeros(*keep.shape, payload.shape[-1])
    return out.index_put((keep,), payload)


class StageModule(nn.Module):
    """Stage ``index`` of a HF decoder split at ``specs`` (see the module docstring).

    ``send_codec`` encodes this stage's output cut (None on the last stage), ``recv_codec``
    decodes its input cut (None on the first). The modules are shared with ``model`` (no copy):
    an optimizer step on the stage updates the model it was cut from.

    ``forward(x, *, attention_mask, position_ids, rows, completion_ids, completion_mask, input_ids)``:
    ``x`` is ``input_ids`` [B, L] on the first stage, else the packed payload [T, k_in]; ``rows``
    [B] are the global row indices of this micro-batch (the PRF key's rows); ``input_ids`` [B, L]
    (every rank holds the batch) are the decoder's side information. Returns the packed payload
    [T, k_out], or on the last stage the completion log-probs [B, Lc] (0 on padding).
    """

    def __init__(
        self,
        model: nn.Module,
        index: int,
        specs: list[CutSpec],
        *,
        send_codec: Codec | None,
        recv_codec: Codec | None,
        seed: int,
        temperature: float = 1.0,
    ) -> None:
        super().__init__()
        body, layers = find_decoder_layers(model)
        bounds = stage_bounds(specs, len(layers))
        if not 0 <= index < len(bounds):
            raise TclightningError(f"stage index {index} out of range for {len(bounds)} stages")
        self.index, self.num_stages = index, len(bounds)
        self.is_first, self.is_last = index == 0, index == len(bounds) - 1
        self.first_layer, end = bounds[index]
        self.layers = nn.ModuleList(layers[self.first_layer : end])
        self.config = model.config
        self.rotary_emb = body.rotary_emb
        self.embed_tokens = body.embed_tokens if self.is_first else None
        self.norm = body.norm if self.is_last else None
        self.lm_head = model.get_output_embeddings() if self.is_last else None
        self.send_spec = None if self.is_last else specs[index]
        self.recv_spec = None if self.is_first else specs[index - 1]
        self.send_codec, self.recv_codec = send_codec, recv_codec
        self.send_tap: Codec | None = None
        self.recv_tap: Codec | None = None
        """Codecs to hand this stage's dense boundary traffic to (``observe_dense``): set on the
        anchor's dense copy, so the trained stage's bases and fills learn from that traffic."""
        self.seed = seed
        self.temperature = temperature
        self.step = 0
        self.last_entropy: list[Tensor] = []
        """Per micro-batch entropy [B, Lc] (no grad) of the last stage's forwards, when asked for."""
        self.want_entropy = False

    def _key(self, spec: CutSpec, rows: Tensor) -> CodecKey:
        return CodecKey(seed=self.seed, step=self.step, cut=spec.layer, row_offset=int(rows[0]) if len(rows) else 0)

    def _masks(self, hidden: Tensor, attention_mask: Tensor, position_ids: Tensor) -> dict[str, Any]:
        from transformers.masking_utils import (
            create_causal_mask,
            create_sliding_window_causal_mask,
        )

        kwargs = {
            "config": self.config,
            "inputs_embeds": hidden,
            "attention_mask": attention_mask,
            "cache": None,
            "position_ids": position_ids,
        }
        masks = {"full_attention": create_causal_mask(**kwargs)}
        if "sliding_attention" in (getattr(self.config, "layer_types", None) or []):
            masks["sliding_attention"] = create_sliding_window_causal_mask(**kwargs)
        return masks

    def forward(
        self,
        x: Tensor,
        *,
        attention_mask: Tensor,
        position_ids: Tensor,
        rows: Tensor,
        completion_ids: Tensor,
        completion_mask: Tensor,
        input_ids: Tensor | None = None,
    ) -> Tensor:
        ids = x if self.is_first else input_ids  # the batch's tokens, which every stage holds
        keys = context_keys(ids) if ids is not None else None  # the codecs' side information, keyed before packing
        if self.is_first:
            assert self.embed_tokens is not None
            hidden = self.embed_tokens(x)
        else:
            assert self.recv_codec is not None and self.recv_spec is not None
            x = self.recv_codec.from_wire(x, next(self.layers.parameters()).dtype)
            real_keys = pack(keys, attention_mask) if keys is not None else None
            for codec in (self.recv_tap, self.recv_codec if self.recv_codec.crosses_dense else None):
                if codec is not None:  # the same [T, d] tokens the sender observed
                    codec.observe_dense(x.detach(), real_keys)
            received = unpack(x, attention_mask)
            hidden = self.recv_codec.decode(received, self._key(self.recv_spec, rows),
                                            token_mask=attention_mask.bool(), token_ids=keys)
        masks = self._masks(hidden, attention_mask, position_ids)
        position_embeddings = self.rotary_emb(hidden, position_ids=position_ids)
        layer_types = getattr(self.config, "layer_types", None)
        for offset, layer in enumerate(self.layers):
            kind = layer_types[self.first_layer + offset] if layer_types else "full_attention"
            hidden = layer(
                hidden,
                attention_mask=masks[kind],
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                use_cache=False,
            )
            hidden = hidden[0] if isinstance(hidden, tuple) else hidden
        if not self.is_last:
            assert self.send_codec is not None and self.send_spec is not None
            self._observe_sent(hidden, attention_mask, keys)
            payload = self.send_codec.encode(hidden, self._key(self.send_spec, rows), token_ids=keys)
            return self.send_codec.to_wire(pack(payload, attention_mask))
        return self._completion_logps(hidden, completion_ids, completion_mask)

    @torch.no_grad()
    def _observe_sent(self, hidden: Tensor, attention_mask: Tensor, keys: Tensor | None) -> None:
        """The sender's side of what codecs learn from: real tokens ``[T, d]`` (``pack`` order) and
        their context keys (what the receiver's side observes with them)."""
        codec = self.send_codec
        assert codec is not None
        if self.send_tap is None and not codec.learns_from_traffic:
            return
        real = pack(hidden.detach(), attention_mask)
        real_ids = pack(keys, attention_mask) if keys is not None else None
        if self.send_tap is not None:
            self.send_tap.observe_dense(real, real_ids)
        if codec.crosses_dense:  # what the receiver will hold of it
            codec.observe_dense(codec.as_received(real), real_ids)
        codec.observe_sent(real, real_ids)

    def _completion_logps(self, hidden: Tensor, completion_ids: Tensor, completion_mask: Tensor) -> Tensor:
        """``completion_logps`` on the last stage: tempered log-softmax at each completion token."""
        assert self.norm is not None and self.lm_head is not None
        width = completion_ids.shape[1]
        hidden = self.norm(hidden)[:, -(width + 1) :]
        logits = self.lm_head(hidden)[:, :-1].float() / self.temperature
        log_probs = F.log_softmax(logits, dim=-1)
        logp = torch.gather(log_probs, 2, completion_ids.unsqueeze(-1)).squeeze(-1) * completion_mask
        if self.want_entropy:
            with torch.no_grad():
                self.last_entropy.append(-(log_probs.exp() * log_probs).sum(-1) * completion_mask)
        return logp
