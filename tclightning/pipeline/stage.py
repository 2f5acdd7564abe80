"""One pipeline stage of a HF decoder as its own ``nn.Module``: what one rank runs.

Stage ``s`` of ``S`` (cuts after layers ``c_0 < ... < c_{S-2}``) holds decoder layers
``(c_{s-1}, c_s]`` (the first stage also the embedding, the last the final norm and the LM head)
and the codec ends of its two cuts:

    first stage:  input_ids -> model's forward over its layers -> enc_s -> pack      (payload [T, k])
    middle:       payload -> unpack -> dec_{s-1} -> model's forward -> enc_s -> pack
    last stage:   payload -> unpack -> dec_{s-1} -> model's forward -> log p(completion)

The split is torchtitan's: a stage is a view of the model (:func:`split_model`) that shares its
parameters, keeps only its slice of ``layers`` (the embedding on the first stage, ``norm`` and
the head on the last; elsewhere removed or made the identity) and runs the model's *own*
``forward`` with ``inputs_embeds`` -- masks, rotary positions, sliding windows, soft-capping and
whatever else a family does stay transformers' code. The last stage's log-probs are
:func:`~tclightning.models.logprobs.completion_logps`, the one-process function.

``pack`` keeps the real tokens only (``attention_mask == 1``), so a message is exactly
``T_real x k`` values -- the bytes the one-process ``WireMeter`` counts -- and nothing of size d
crosses a compressed cut. ``unpack`` scatters them back into ``[B, L, k]`` (zeros at padding,
which no real token attends to), and the decoder rebuilds ``[B, L, d]``. The gradient w.r.t. the
packed payload is the backward message, ``[T, k]`` as well. Pure torch + transformers: no
Lightning, no process group.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor, nn

from tclightning.codecs import Codec, CodecKey
from tclightning.codecs.context import context_keys
from tclightning.errors import TclightningError
from tclightning.models.logprobs import completion_logps
from tclightning.pipeline.endpoint import CutEnd
from tclightning.pipeline.layout import CutSpec

BODY_PARTS = ("embed_tokens", "layers", "norm", "rotary_emb")
"""The decoder body's children the split knows (every Llama-style ``*Model`` of transformers)."""
HEAD_PARTS = ("model", "lm_head")
"""The ``*ForCausalLM``'s children the split knows."""
INPUT_SCALES = ("embedding_multiplier",)
"""Body attributes that scale ``inputs_embeds`` inside the forward (Granite): a later stage's
input was scaled on the first stage already, so its view multiplies by 1."""


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
        return cls(*(getattr(rollouts, f.name) for f in fields(cls)))

    def to(self, device: torch.device) -> StageInputs:
        return StageInputs(*(getattr(self, f.name).to(device) for f in fields(self)))


def _view(module: nn.Module, children: dict[str, nn.Module | None], **attributes: Any) -> nn.Module:
    """A shallow copy of ``module`` (same class, same parameters, no hooks) whose child modules
    are ``children`` in that order, with ``attributes`` set."""
    view = type(module).__new__(type(module))
    nn.Module.__init__(view)  # fresh hook and child tables
    for name, value in module.__dict__.items():
        if name not in view.__dict__:
            view.__dict__[name] = value
    view._parameters = dict(module._parameters)
    view._buffers = dict(module._buffers)
    view._non_persistent_buffers_set = set(module._non_persistent_buffers_set)
    view.training = module.training
    view._modules = dict(children)
    view.__dict__.update(attributes)
    return view


def splittable_layers(model: nn.Module) -> tuple[nn.Module, nn.ModuleList]:
    """``(body, layers)`` of a model :func:`split_model` can split; refuses any other in one line,
    naming the part it does not know."""
    name = type(model).__name__
    body = getattr(model, "model", None)
    unknown = sorted(set(model._modules) - set(HEAD_PARTS))
    if not isinstance(body, nn.Module) or model.get_output_embeddings() is None or unknown:
        raise TclightningError(
            f"cannot split {name} into pipeline stages: the split needs a *ForCausalLM made of .model and "
            f".lm_head{f' (it also has {unknown})' if unknown else ''}; run it in one process (trainer.devices=1)")
    layers = getattr(body, "layers", None)
    unknown = sorted(set(body._modules) - set(BODY_PARTS))
    if not isinstance(layers, nn.ModuleList) or unknown or not hasattr(body, "embed_tokens"):
        raise TclightningError(
            f"cannot split {name} into pipeline stages: its decoder {type(body).__name__} must consist of "
            f"{', '.join(BODY_PARTS)}{f' (it also has {unknown})' if unknown else ''}; run it in one process "
            "(trainer.devices=1)")
    return body, layers


def split_model(model: nn.Module, first: int, end: int) -> nn.Module:
    """Layers ``[first, end)`` of a HF ``*ForCausalLM`` as a module running the model's own forward.

    The result shares ``model``'s parameters. Not the first stage: no embedding (call it with
    ``inputs_embeds``). Not the last: ``norm`` is the identity and the result is the decoder body
    (``last_hidden_state`` out); the last stage is the whole ``*ForCausalLM`` view (logits out).
    A model whose structure the split does not know is refused (:func:`splittable_layers`)."""
    body, layers = splittable_layers(model)
    is_first, is_last = first == 0, end == len(layers)
    config = copy.copy(body.config)  # the loop reads num_hidden_layers and layer_types[i] of its own slice
    config.num_hidden_layers = end - first
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types[first:end])
    # the stage's layers first, so parameters come in the order a stage always listed them
    children: dict[str, nn.Module | None] = {"layers": nn.ModuleList(layers[first:end])}
    children.update({part: child for part, child in body._modules.items() if part not in children})
    children["embed_tokens"] = body.embed_tokens if is_first else None
    children["norm"] = body.norm if is_last else nn.Identity()
    scales = {} if is_first else {attr: 1.0 for attr in INPUT_SCALES if hasattr(body, attr)}
    stage_body = _view(body, children, config=config, **scales)
    if not is_last:
        return stage_body
    return _view(model, {"model": stage_body, "lm_head": model.get_output_embeddings()})


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
    decodes its input cut (None on the first); each is held as a
    :class:`~tclightning.pipeline.endpoint.CutEnd` (``send_end`` / ``recv_end``), the same cut end
    the one-process hooks use. The modules are shared with ``model`` (no copy):
    an optimizer step on the stage updates the model it was cut from.

    ``forward(x, *, attention_mask, position_ids, rows, completion_ids, completion_mask, input_ids)``:
    ``x`` is ``input_ids`` [B, L] on the first stage, else the packed payload [T, k_in]; ``rows``
    [B] are the global row indices of this micro-batch (the PRF key's rows); ``input_ids`` [B, L]
    (every rank holds the batch) are the decoder's side information; ``first_fit``: the sending
    codec first fits on this batch (:meth:`CutEnd.setup_bytes`; the engine ships the fit). Returns
    the packed payload [T, k_out], or on the last stage the completion log-probs [B, Lc] (0 on padding).
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
        bounds = stage_bounds(specs, len(splittable_layers(model)[1]))
        if not 0 <= index < len(bounds):
            raise TclightningError(f"stage index {index} out of range for {len(bounds)} stages")
        self.index, self.num_stages = index, len(bounds)
        self.is_first, self.is_last = index == 0, index == len(bounds) - 1
        self.first_layer, end = bounds[index]
        self.split = split_model(model, self.first_layer, end)
        self.send_spec = None if self.is_last else specs[index]
        self.recv_spec = None if self.is_first else specs[index - 1]
        self.send_end = None if send_codec is None else CutEnd(send_codec, sends=True, receives=False)
        self.recv_end = None if recv_codec is None else CutEnd(recv_codec, sends=False, receives=True)
        self.send_tap: Codec | None = None
        self.recv_tap: Codec | None = None
        """Codecs to hand this stage's dense boundary traffic to (``observe_dense``): set on the
        anchor's dense copy, so the trained stage's bases learn from that traffic."""
        self.seed = seed
        self.temperature = temperature
        self.step = 0
        self.last_entropy: list[Tensor] = []
        """Per micro-batch entropy [B, Lc] (no grad) of the last stage's forwards, when asked for."""
        self.want_entropy = False

    @property
    def send_codec(self) -> Codec | None:
        return None if self.send_end is None else self.send_end.codec

    @property
    def recv_codec(self) -> Codec | None:
        return None if self.recv_end is None else self.recv_end.codec

    @property
    def body(self) -> nn.Module:
        """The stage's decoder body (its layers; the embedding / final norm where it has them)."""
        return self.split.model if self.is_last else self.split

    @property
    def config(self) -> Any:
        """The model's config (the stage's own view reads its slice of ``layer_types``)."""
        return self.body.config

    @property
    def embed_tokens(self) -> nn.Module | None:
        return self.body.embed_tokens

    @property
    def lm_head(self) -> nn.Module | None:
        return self.split.lm_head if self.is_last else None

    def _key(self, spec: CutSpec, rows: Tensor) -> CodecKey:
        return CodecKey(seed=self.seed, step=self.step, cut=spec.layer, row_offset=int(rows[0]) if len(rows) else 0)

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
        first_fit: bool = False,
    ) -> Tensor:
        ids = x if self.is_first else input_ids  # the batch's tokens, which every stage holds
        keys = context_keys(ids) if ids is not None else None  # the codecs' side information, keyed before packing
        if self.is_first:
            tokens = {"input_ids": x}
        else:
            end, spec = self.recv_end, self.recv_spec
            assert end is not None and spec is not None
            x = end.from_wire(x, next(self.split.parameters()).dtype)
            end.observe_received(x.detach(), pack(keys, attention_mask) if keys is not None else None, self.recv_tap)
            tokens = {"inputs_embeds": end.decode(unpack(x, attention_mask), self._key(spec, rows),
                                                  token_mask=attention_mask.bool(), token_ids=keys)}
        if self.is_last:
            # ids may be None: with inputs_embeds, completion_logps reads the other tensors only
            batch = StageInputs(ids, attention_mask, position_ids, completion_ids, completion_mask)  # type: ignore[arg-type]
            logp, entropy = completion_logps(self.split, batch, self.temperature, self.want_entropy,
                                             inputs_embeds=tokens.get("inputs_embeds"))
            if entropy is not None:
                self.last_entropy.append(entropy)
            return logp
        hidden = self.split(**tokens, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=False).last_hidden_state
        end, spec = self.send_end, self.send_spec
        assert end is not None and spec is not None
        if first_fit or self.send_tap is not None or end.learns:  # the real tokens [T, d] in pack order, and their keys
            with torch.no_grad():
                real, real_ids = pack(hidden.detach(), attention_mask), pack(keys, attention_mask) if keys is not None else None
                if first_fit:  # the engine ships the fit; the batch is observed when it trains
                    end.setup_bytes(real, real_ids, self.step)
                else:
                    end.observe_sent(real, real_ids, self.send_tap)
        return pack(end.encode(hidden, self._key(spec, rows), keys, attention_mask.bool()), attention_mask)
