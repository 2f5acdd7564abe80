"""Install a layout's cuts into a HF decoder-only model (Llama / Qwen2 style) with forward hooks.

A cut after layer i is a forward hook on ``layers[i]`` that replaces the layer's output hidden
state with what the receiving stage would see (:class:`~tclightning.pipeline.boundary.Boundary`).
``CutSet.remove()`` deletes every hook, leaving the model exactly as it was (hook-free).

Token identity for the PRF key: row = batch index (+ ``row_offset``), position = column in the
``[B, L]`` input (so left-padded prompts followed by right-padded completions are keyed by
column, independent of the padding). Bytes are counted for real tokens only: the mask is the
``attention_mask`` passed to the model's forward (2-D [B, L]) unless ``set_token_mask`` gave one
of the same shape; with neither, every token counts. The forward's ``input_ids`` reach the
decoders as side information (``Codec.decode(token_ids=)``): every stage holds the batch's tokens.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from tclightning.codecs import CODECS, CodecKey
from tclightning.codecs.context import context_keys
from tclightning.errors import TclightningError
from tclightning.pipeline.boundary import Boundary, LoopbackWire, Wire, WireMeter
from tclightning.pipeline.config import PipelineConfig
from tclightning.pipeline.layout import CutSpec, cut_codec, resolve_layout

_LAYER_PATHS = ("model.layers", "layers", "model.decoder.layers", "transformer.h")


def find_decoder_layers(model: nn.Module) -> tuple[nn.Module, nn.ModuleList]:
    """``(body, layers)``: the module that runs the decoder stack and its layer list
    (``model.model.layers`` for Llama/Qwen2 ``*ForCausalLM``)."""
    for path in _LAYER_PATHS:
        owner: Any = model
        parts = path.split(".")
        for part in parts:
            owner = getattr(owner, part, None)
            if owner is None:
                break
        if isinstance(owner, nn.ModuleList) and len(owner) > 0:
            body = model
            for part in parts[:-1]:
                body = getattr(body, part)
            return body, owner
    raise TclightningError(
        f"cannot find the decoder layers of {type(model).__name__} (looked for {', '.join(_LAYER_PATHS)})"
    )


def boundary_width(model: nn.Module) -> int:
    """The hidden size d that crosses a cut (``model.config.hidden_size``)."""
    config = getattr(model, "config", None)
    width = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    if not width:
        raise TclightningError(f"cannot read the hidden size of {type(model).__name__} (no config.hidden_size)")
    return int(width)


class CutSet:
    """The installed cuts of one model, and the knobs the training loop turns.

    * ``set_step(step)`` -- the PRF key's step, set only through ``Backend.begin_step`` (the GRPO
      module's backend once per RL step; for any other module the ``PipelineStrategy``'s own
      backend, at ``trainer.global_step``). A change runs each cut's refresh, so reconstruction is
      constant while the step holds;
    * ``bypassed()`` -- context under which the forward is dense and nothing is counted (the
      sampler and dense probes run under it);
    * ``metrics()`` / ``reset_stats()`` -- wire bytes since the last reset (``wire/*``);
    * ``set_token_mask(mask)`` -- override the real-token mask used for byte counting;
    * ``switch_codec(name)`` -- every compressed cut's codec becomes ``name`` at the same budget
      (an anchor controller's fallback when the recipe's codec carries no signal);
    * ``remove()`` -- delete the hooks (also on ``with CutSet(...)`` exit).
    """

    def __init__(
        self,
        model: nn.Module,
        config: PipelineConfig,
        *,
        wire: Wire | None = None,
        row_offset: int = 0,
    ) -> None:
        body, layers = find_decoder_layers(model)
        self.config = config
        self.dim = boundary_width(model)
        self.num_layers = len(layers)
        self.specs: list[CutSpec] = resolve_layout(config, self.num_layers, self.dim)
        self.wire: Wire = wire if wire is not None else LoopbackWire()
        self.meter = WireMeter([spec.layer for spec in self.specs])
        self.boundaries = [
            Boundary(spec.ordinal, cut_codec(self.config, spec, self.dim), self.wire, self.meter)
            for spec in self.specs
        ]
        self.step = 0
        self.row_offset = row_offset
        self._bypass_depth = 0
        self._token_mask: Tensor | None = None
        self._forward_mask: Tensor | None = None
        self._forward_ids: Tensor | None = None
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        if self.boundaries:
            capture = _tagged(lambda module, args, kwargs: self._capture_inputs(module, args, kwargs))
            release = _tagged(lambda module, args, output: self._release_inputs(module, args, output))
            self._handles.append(body.register_forward_pre_hook(capture, with_kwargs=True))
            self._handles.append(body.register_forward_hook(release, always_call=True))
            for boundary, spec in zip(self.boundaries, self.specs):
                hook = _tagged(self._cut_hook(boundary, spec))
                self._handles.append(layers[spec.layer].register_forward_hook(hook))

    # -- hooks -------------------------------------------------------------------------------

    def _capture_inputs(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        self._forward_mask = mask.bool() if isinstance(mask, Tensor) and mask.dim() == 2 else None
        ids = kwargs.get("input_ids", args[0] if args else None)
        is_ids = isinstance(ids, Tensor) and ids.dim() == 2 and not ids.is_floating_point()
        self._forward_ids = context_keys(ids) if is_ids else None  # once per forward, for every cut

    def _release_inputs(self, module: nn.Module, args: Any, output: Any) -> None:
        self._forward_mask = None
        self._forward_ids = None

    def _ids_for(self, hidden: Tensor) -> Tensor | None:
        ids = self._forward_ids
        return ids.to(hidden.device) if ids is not None and ids.shape == hidden.shape[:2] else None

    def _mask_for(self, hidden: Tensor) -> Tensor | None:
        shape = hidden.shape[:2]
        for mask in (self._token_mask, self._forward_mask):
            if mask is not None and mask.shape == shape:
                return mask.to(hidden.device)
        return None

    def _cut_hook(self, boundary: Boundary, spec: CutSpec) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if self._bypass_depth:
                return None  # None keeps the layer's own output
            hidden = output[0] if isinstance(output, tuple) else output
            if hidden.dim() == 2:  # unbatched [L, d]
                hidden_rows = hidden.unsqueeze(0)
            else:
                hidden_rows = hidden
            key = CodecKey(seed=self.config.seed, step=self.step, cut=spec.layer, row_offset=self.row_offset)
            received = boundary(hidden_rows, key, self._mask_for(hidden_rows), self._ids_for(hidden_rows))
            received = received.reshape(hidden.shape)
            return (received, *output[1:]) if isinstance(output, tuple) else received

        return hook

    # -- the loop's knobs --------------------------------------------------------------------

    @property
    def compressed(self) -> bool:
        """True when at least one cut is compressed."""
        return any(spec.compressed for spec in self.specs)

    def set_step(self, step: int) -> None:
        """Set the key's step. On a change of step, stateful codecs fold in what the last step saw."""
        if step != self.step:
            for boundary in self.boundaries:
                shipped = boundary.end.change_step(int(step))
                if shipped:
                    self.meter.record_setup(boundary.ordinal, shipped)
        self.step = int(step)

    def switch_codec(self, codec: str) -> None:
        """Rebuild every compressed cut's codecs as ``codec`` at the same k values per token (dense
        cuts stay dense); the hooks stay in place. The new codecs start with no state (a basis
        codec cold-starts at its next step). :meth:`state_dict` records the codec in force, and
        :meth:`load_state_dict` switches to it first, so a resumed run carries the switch."""
        if not self.compressed:
            raise TclightningError("switch_codec: no cut is compressed")
        cfg = self.config
        cut_codecs = None if cfg.cut_codecs is None else [c if c == "identity" else codec for c in cfg.cut_codecs]
        bits = cfg.bits if codec == "lowrank" else None  # only lowrank quantises its coefficients
        config = dataclasses.replace(cfg, codec=codec, cut_codecs=cut_codecs, bits=bits,
                                     bits_lead=cfg.bits_lead and bits is not None)
        specs = resolve_layout(config, self.num_layers, self.dim)  # validates before anything changes
        self.config, self.specs = config, specs
        for boundary, spec in zip(self.boundaries, specs):
            if spec.compressed:
                boundary.codec = cut_codec(self.config, spec, self.dim)

    @contextlib.contextmanager
    def observing_dense(self, model: nn.Module, attention_mask: Tensor, input_ids: Tensor | None = None,
                        sink: Callable[[int, Tensor, Tensor | None], None] | None = None) -> Iterator[None]:
        """While a dense forward of ``model`` runs (a hook-free copy of this model, or this model
        under :meth:`bypassed`), hand each cut's activations at real tokens (``attention_mask`` [B,
        L]), with their :func:`context_keys` from ``input_ids`` [B, L] if given, to :meth:`observe_dense`
        (or to ``sink(ordinal, tokens, ids)`` instead)."""
        sink = sink or self.observe_dense
        real = attention_mask.bool()
        ids = context_keys(input_ids)[real] if input_ids is not None else None
        _, layers = find_decoder_layers(model)

        def tap(ordinal: int) -> Any:
            def hook(module: nn.Module, args: Any, output: Any) -> None:
                hidden = output[0] if isinstance(output, tuple) else output
                if hidden.dim() == 3 and hidden.shape[:2] == real.shape:
                    sink(ordinal, hidden.detach()[real.to(hidden.device)],
                         ids.to(hidden.device) if ids is not None else None)
            return hook

        handles = [layers[spec.layer].register_forward_hook(tap(spec.ordinal)) for spec in self.specs]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def observe_dense(self, ordinal: int, tokens: Tensor, token_ids: Tensor | None = None) -> None:
        """Dense activations at cut ``ordinal`` (``[T, d]`` real tokens, e.g. from the anchor's
        dense pass, and their ``[T]`` ids if known): statistics for codecs that learn from them
        (lowrank bases). Nothing is counted: in a pipeline they
        crossed as the anchor's traffic."""
        self.boundaries[ordinal].codec.observe_dense(tokens.detach(), token_ids)

    @contextlib.contextmanager
    def bypassed(self) -> Iterator[None]:
        """Dense forward inside the block: no codec, no byte counted (sampling, dense probes)."""
        self._bypass_depth += 1
        try:
            yield
        finally:
            self._bypass_depth -= 1

    def set_token_mask(self, mask: Tensor | None) -> None:
        """Real-token mask [B, L] for byte counting, used while its shape
        matches the forward's; ``None`` returns to the forward's ``attention_mask``."""
        self._token_mask = None if mask is None else mask.bool()

    def metrics(self) -> dict[str, float]:
        """Wire bytes since the last :meth:`reset_stats` (see ``WireMeter.metrics`` for keys) and
        the codecs' own figures (:func:`codec_metrics`)."""
        return {**self.meter.metrics(), **codec_metrics([b.codec.step_metrics() for b in self.boundaries])}

    def reset_stats(self) -> None:
        self.meter.reset()
        for boundary in self.boundaries:
            boundary.codec.reset_metrics()

    def state_dict(self) -> dict[str, Any]:
        """Step, the codec in force (``switch_codec``) and receiver-side codec state (svd and
        lowrank bases)."""
        return {
            "step": self.step,
            "codec": self.config.codec,
            "forward": [b.codec.state_dict() for b in self.boundaries],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output. A state that is not one for these cuts (other
        keys, a codec unknown here, another count of cuts, a step that is not a whole number)
        raises ``ValueError`` before anything changes."""
        check_cut_state(state, len(self.boundaries))
        codec, step, forward = state.get("codec"), state.get("step", 0), state.get("forward", [])
        if codec is not None and codec != self.config.codec and self.compressed:  # saved after a switch_codec
            self.switch_codec(codec)
        self.step = step
        for boundary, fwd in zip(self.boundaries, forward):
            boundary.codec.load_state_dict(dict(fwd))

    def remove(self) -> None:
        """Delete every hook; the model is hook-free again. Idempotent."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> CutSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def check_cut_state(state: Any, cuts: int) -> None:
    """That ``state`` is a cut state for ``cuts`` cuts (:meth:`CutSet.state_dict`, or the
    multi-process form with each sender's state), else ``ValueError``: a state with other keys,
    a codec unknown here, another count of cuts or a step that is not a whole number would resume
    with the wrong bases, or none, without a word."""
    if not isinstance(state, Mapping) or set(state) - {"step", "codec", "forward", "sender"}:
        raise ValueError(f"cut state: expected step, codec and forward, got "
                         f"{sorted(map(str, state)) if isinstance(state, Mapping) else type(state).__name__}")
    codec, step = state.get("codec"), state.get("step", 0)
    if codec is not None and codec not in CODECS:
        raise ValueError(f"cut state: codec {codec!r} is none of {', '.join(CODECS)}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"cut state: step {step!r} is not a whole number >= 0")
    for key in ("forward", "sender"):
        entries = state.get(key, [] if key == "forward" else None)
        if entries is None:
            continue
        if not isinstance(entries, list) or len(entries) != cuts or not all(isinstance(e, Mapping) for e in entries):
            raise ValueError(f"cut state: expected one codec state per cut ({cuts}) in '{key}', got "
                             f"{len(entries) if isinstance(entries, list) else type(entries).__name__}")


def codec_metrics(per_cut: list[dict[str, float]]) -> dict[str, float]:
    """``wire/cut{i}/<name>`` for each cut's ``Codec.step_metrics()``, plus ``wire/energy_kept``
    (mean over the cuts that report it) and ``wire/basis_bytes`` (sum) when any cut reports them."""
    out: dict[str, float] = {}
    for ordinal, figures in enumerate(per_cut):
        for name, value in figures.items():
            out[f"wire/cut{ordinal}/{name}"] = value
    kept = [f["energy_kept"] for f in per_cut if "energy_kept" in f]
    if kept:
        out["wire/energy_kept"] = sum(kept) / len(kept)
    shipped = [f["basis_bytes"] for f in per_cut if "basis_bytes" in f]
    if shipped:
        out["wire/basis_bytes"] = sum(shipped)
    return out


_CUT_HOOK_TAG = "_tclightning_cut"


def _tagged(hook: Any) -> Any:
    """Mark a hook as a cut hook, so :func:`strip_cut_hooks` can find it on a copied model."""
    setattr(hook, _CUT_HOOK_TAG, True)
    return hook


def strip_cut_hooks(model: nn.Module) -> nn.Module:
    """Remove every cut hook from ``model`` in place and return it.

    ``copy.deepcopy`` of a model with installed cuts copies the hooks too (they would still
    compress the copy); use this, or :func:`hook_free_copy`, for dense clones such as the anchor."""
    for module in model.modules():
        for hooks in (module._forward_hooks, module._forward_pre_hooks):
            for hook_id, hook in list(hooks.items()):
                if getattr(hook, _CUT_HOOK_TAG, False):
                    del hooks[hook_id]
                    module._forward_hooks_with_kwargs.pop(hook_id, None)
                    module._forward_hooks_always_called.pop(hook_id, None)
                    module._forward_pre_hooks_with_kwargs.pop(hook_id, None)
    return model


def hook_free_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` without cut hooks (the original keeps its cuts)."""
    return strip_cut_hooks(copy.deepcopy(model))


def install_cuts(model: nn.Module, config: PipelineConfig, *, wire: Wire | None = None) -> CutSet:
    """Install ``config``'s cuts on ``model`` and return them (``cuts.remove()`` undoes it)."""
    return CutSet(model, config, wire=wire)
