"""Bytes per RL step per traffic class, from a recipe and a model's ``config.json`` alone.

No weights are loaded: the model is built on the ``meta`` device from its config, split into the
recipe's stages by the same code a run uses (:func:`~tclightning.pipeline.stage.split_model`),
and every count comes from the real parameter shapes and the real layout (cuts, codec budget).
One stage per node: every class below crosses between nodes.

Classes (per RL step: ``P x G`` rows of ``tokens_per_row`` tokens, ``epochs x minibatches`` ticks):

* ``boundary`` -- activations forward and gradients backward at every cut, every tick (a
  compressed cut sends its budget, ``k`` values per token; a dense one ``d``), plus the forward
  of the old log-probs when the update has more than one tick;
* ``anchor`` -- the anchor's dense forward/backward every ``cadence`` ticks (dense at every cut),
  averaged per step; with ``anchor.placement: sampler`` the sampling node runs it alone and sends
  each other stage the sign message of its trained parameters instead
  (:func:`~tclightning.sign_message.sign_message_bytes`: a bit a coordinate plus a bit a tensor,
  counted with no exact zero in ``M_bar``; the last stage's include the tied embedding, which it
  holds in both tied modes), per anchor pass, averaged per step; with LoRA the adapters' alone;
* ``weight_sync`` -- stages 2..S's weights to the sampler on the first stage's node, in the
  sampler's dtype (``sparse``: only the entries whose value in that dtype changed, at
  ``sync_density``, coded as the run's sparse sync codes them: :func:`sparse_sync_bytes`);
* ``tied_embedding`` -- a tied input/output embedding's gradient between the first and the last
  stage, each way, every tick, in float32 (``rows``: the step's distinct token rows each way, what a
  run with ``pipeline.tied_rows`` sends, at most: after a dense sync the first tick sends only the
  gradient rows);
* ``rollouts`` -- the sampled batch (ids, masks, sampler log-probs) from the sampler to every other stage.

With LoRA only the adapters train: the weight sync carries adapter weights and the tied embedding
is frozen. The figures are formulas over the shapes; ``tests/test_bench_traffic.py`` checks the
boundary, weight-sync and (sampler placement) anchor figures against what a toy run measures.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tclightning.codecs.base import WIRE_DTYPES
from tclightning.errors import TclightningError
from tclightning.files import open_regular, regular_file
from tclightning.sign_message import sign_message_bytes
from tclightning.weight_sync import HEADER, LENGTH_BYTES

CONFIGS = ("dense", "compressed", "compressed+sparse-sync", "compressed+sparse-sync+lora")
CLASSES = ("boundary", "anchor", "weight_sync", "tied_embedding", "rollouts")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LINK_UNITS = {"gbit": 1000.0, "mbit": 1.0, "kbit": 1e-3}
SHIPPED = Path(__file__).with_name("model_configs")
"""``config.json`` files shipped for use offline, by Hugging Face name (``/`` as ``--``)."""


@dataclass
class TrafficAssumptions:
    """What the formulas cannot read from the recipe or the model config."""

    tokens_per_row: int = 640  # prompt + completion tokens of one sampled row
    activation_dtype: str = "bfloat16"  # the boundary's dtype on a GPU
    sampler_dtype: str = "bfloat16"  # the sampler's copy of the weights
    sync_density: float = 0.0076  # share of entries whose sampler-dtype value changes in a step (measured, docs)
    distinct_ids: int | None = None  # distinct token ids per tick (None: :func:`expected_distinct_ids`)
    lora_rank: int = 16


@dataclass
class Traffic:
    """One configuration's bytes per RL step by class, and their sum."""

    config: str
    classes: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return float(sum(self.classes.values()))

    def as_dict(self) -> dict[str, Any]:
        return {"config": self.config, "total_bytes": self.total, **{f"{k}_bytes": v for k, v in self.classes.items()}}


SIZE_KEYS = ("hidden_size", "intermediate_size", "vocab_size", "num_attention_heads", "num_key_value_heads")
"""A config's sizes the byte counts read; each a whole number in [1, :data:`MAX_SIZE`]."""
MAX_SIZE = 1 << 24
"""Larger than any model's width or vocabulary (a 16M-wide layer would not be built on the meta device either)."""


def read_model_config(name_or_path: str) -> dict[str, Any]:
    """A model's ``config.json`` as a dict: a file, a folder holding one, or a Hugging Face name of a
    shipped config (``SHIPPED``). Refuses anything else in one line."""
    # here, not at the top: the CLI builds this command's options on every call, and the loader's
    # transformers import costs two seconds
    from tclightning.models.loading import CONFIG_MAX_BYTES, MAX_LAYERS

    path = Path(name_or_path)
    for candidate in (path, path / "config.json", SHIPPED / f"{name_or_path.replace('/', '--')}.json"):
        if candidate.is_file():
            try:  # a regular file of config size: never /proc/kmsg, a FIFO or a gigabyte of JSON
                regular_file(candidate, "model config", CONFIG_MAX_BYTES)
                with open_regular(candidate, "model config", CONFIG_MAX_BYTES) as handle:
                    data = json.loads(handle.read().decode())
            except (OSError, ValueError, RecursionError) as err:  # ValueError: bad JSON, text or a 5000-digit integer
                raise TclightningError(f"{candidate}: not a readable config.json ({type(err).__name__})") from None
            if not isinstance(data, dict) or "model_type" not in data:
                raise TclightningError(f"{candidate}: not a model config.json (no model_type)")
            if "hidden_size" not in data:  # what the traffic at a cut is counted from
                raise TclightningError(f"{candidate}: no hidden_size, the width every cut's traffic is counted from")
            layers = data.get("num_hidden_layers", 0)
            if not isinstance(layers, int) or not 0 <= layers <= MAX_LAYERS:
                raise TclightningError(f"{candidate}: num_hidden_layers {layers!r} is not a layer count in [0, {MAX_LAYERS}]")
            for key in SIZE_KEYS:
                size = data.get(key, 1)
                if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_SIZE:
                    raise TclightningError(f"{candidate}: {key} {size!r} is not a size in [1, {MAX_SIZE}]")
            return data
    shipped = ", ".join(sorted(p.stem.replace("--", "/") for p in SHIPPED.glob("*.json")))
    raise TclightningError(f"no config.json at {name_or_path!r}; give a file or folder (shipped: {shipped})")


def meta_model(config: dict[str, Any]) -> torch.nn.Module:
    """The ``*ForCausalLM`` of ``config`` on the meta device (shapes only, no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    values = dict(config)
    model_type = values.pop("model_type")
    try:
        hf_config = AutoConfig.for_model(model_type, **values)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(hf_config)
    except Exception as err:  # noqa: BLE001 -- transformers refusing the config's values (its own error classes)
        lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [type(err).__name__]
        reason = " ".join(lines[-1].split())[:160]
        raise TclightningError(f"model config ({model_type}): no model can be built from it ({reason})") from None


HEAPS_K, HEAPS_BETA = 7.44, 0.542
"""Heaps' law ``distinct ids = K n^beta`` of ``n`` tokens of text, fitted on GSM8K questions and
solutions tokenized with SmolLM2-135M's tokenizer from 20k to 655k tokens (within 6% of the
measured counts there: 1,511 distinct ids in 20k tokens, 5,264 in 164k, 10,045 in 655k)."""


def expected_distinct_ids(tokens: float) -> int:
    """Distinct token ids expected in ``tokens`` tokens of math text (:data:`HEAPS_K`,
    :data:`HEAPS_BETA`); the rows a tick's tied-rows exchange sends, when ``--distinct-ids`` does not
    say. Another tokenizer or corpus gives another count: measure yours and pass it."""
    return max(1, round(HEAPS_K * max(tokens, 1.0) ** HEAPS_BETA))


def sparse_sync_bytes(sizes: list[int], density: float, value_bytes: int) -> float:
    """Expected bytes of the sparse sync's message (:mod:`tclightning.weight_sync`) for tensors of
    ``sizes`` entries when each entry changes with probability ``density``: per tensor a
    :data:`~tclightning.weight_sync.HEADER`, the changed values, and the shorter of the bitmask
    and the LEB128 gaps. A gap of at least ``128^j`` takes a ``j + 1``-th byte, and gaps between
    independent changes are geometric: ``P(gap >= m) = (1 - density)^m``."""
    per_gap = 1.0 + sum((1.0 - density) ** (128**j) for j in range(1, 5))
    total = 0.0
    for numel in sizes:
        changed = numel * density
        total += HEADER.itemsize + changed * value_bytes + min(-(-numel // 8), changed * per_gap)
    return total


def _numel(params: Any) -> int:
    return sum(p.numel() for p in params)


def _lora_sizes(module: torch.nn.Module, rank: int) -> list[int]:
    """Sizes of the rank-``rank`` adapter tensors (``A``: rank x in, ``B``: out x rank) on the
    module's attention and MLP projections."""
    sizes = []
    for name, child in module.named_modules():
        if name.rsplit(".", 1)[-1] in LORA_TARGETS and isinstance(child, torch.nn.Linear):
            sizes += [rank * child.in_features, child.out_features * rank]
    return sizes


def _lora_numel(module: torch.nn.Module, rank: int) -> int:
    """Parameters of rank-``rank`` adapters on the module's attention and MLP projections."""
    return sum(_lora_sizes(module, rank))


def step_traffic(recipe: Any, model_config: dict[str, Any], assumptions: TrafficAssumptions) -> list[Traffic]:
    """Bytes per RL step by class for each of :data:`CONFIGS` (``recipe`` a ``RecipeConfig``)."""
    from tclightning.pipeline.layout import resolve_layout
    from tclightning.pipeline.stage import split_model, splittable_layers, stage_bounds

    model = meta_model(model_config)
    _, layers = splittable_layers(model)
    dim = int(model_config["hidden_size"])
    vocab = int(model_config["vocab_size"])
    cfg = recipe.pipeline
    specs = resolve_layout(cfg, len(layers), dim)
    if not specs:
        raise TclightningError("bench traffic: the recipe's pipeline has one stage, so nothing crosses between nodes "
                               "(set pipeline.stages)")
    dense_specs = resolve_layout(dataclasses.replace(cfg, layout="dense", cut_codecs=None), len(layers), dim)
    bounds = stage_bounds(specs, len(layers))
    stages = [split_model(model, first, end) for first, end in bounds]
    first_ids = {id(p) for p in stages[0].parameters()}
    synced = [p for stage in stages[1:] for p in stage.parameters() if id(p) not in first_ids]
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    tied_weight = [model.get_output_embeddings().weight] if tied else []

    act = WIRE_DTYPES.get(assumptions.activation_dtype, torch.float32).itemsize
    value = WIRE_DTYPES[cfg.payload_dtype].itemsize if cfg.payload_dtype else act
    sampler = WIRE_DTYPES.get(assumptions.sampler_dtype, torch.float32).itemsize
    rows = recipe.grpo.prompts_per_step * recipe.sampler.group_size
    tokens = rows * assumptions.tokens_per_row  # per forward of the whole batch
    ticks = recipe.grpo.epochs * recipe.grpo.minibatches
    tokens_per_tick = tokens / recipe.grpo.minibatches
    trained_tokens = tokens * recipe.grpo.epochs
    old_logp_forward = ticks > 1
    anchor_passes = 0.0 if recipe.anchor.merger == "none" else ticks / recipe.anchor.cadence  # on average

    def boundary(cut_specs: list[Any]) -> float:
        per_token = sum((s.k * value if s.compressed else dim * act) for s in cut_specs)  # one direction
        return per_token * (2 * trained_tokens + (tokens if old_logp_forward else 0))

    if recipe.anchor.placement == "sampler":  # signs of every stage but the sampling one's, per pass
        signs = sum(sign_message_bytes([p.numel() for p in stage.parameters()]) for stage in stages[1:])
        lora_signs = sum(sign_message_bytes(_lora_sizes(stage, assumptions.lora_rank)) for stage in stages[1:])
        anchor, lora_anchor = anchor_passes * signs, anchor_passes * lora_signs
    else:  # the dense pass across every cut, forward and backward
        anchor = lora_anchor = anchor_passes * tokens_per_tick * 2 * dim * act * len(specs)
    ids = min(vocab, assumptions.distinct_ids if assumptions.distinct_ids is not None
              else expected_distinct_ids(tokens_per_tick))
    tied_dense = (2 * vocab * dim * 4 * ticks) if tied else 0.0
    tied_rows = (2 * ids * dim * 4 * ticks) if tied else 0.0
    rollouts = (len(stages) - 1) * tokens * (8 + 8 + 4)  # ids, attention mask (int64), sampler log-probs

    def sync(params: list[Any], sparse: bool) -> float:
        numel = _numel(params)
        if not sparse:
            return numel * sampler
        return sparse_sync_bytes([p.numel() for p in params], assumptions.sync_density, sampler) + LENGTH_BYTES * (
            len(stages) - 1)

    lora = _lora_numel(torch.nn.ModuleList(stages[1:]), assumptions.lora_rank)
    out = []
    for name in CONFIGS:
        compressed = name != "dense"
        sparse = "sparse-sync" in name
        use_lora = name.endswith("lora")
        classes = {
            "boundary": boundary(specs if compressed else dense_specs),
            "anchor": (lora_anchor if use_lora else anchor) if compressed else 0.0,
            # with tied rows the last stage owns the tied weight, so it syncs it too
            "weight_sync": lora * sampler if use_lora else sync(synced + (tied_weight if sparse else []), sparse),
            "tied_embedding": 0.0 if use_lora else (tied_rows if sparse else tied_dense),
            "rollouts": float(rollouts),
        }
        out.append(Traffic(name, {k: float(v) for k, v in classes.items()}))
    return out


def link_seconds(nbytes: float, mbit_per_s: float) -> float:
    """Seconds ``nbytes`` take on a link of ``mbit_per_s`` megabit/s."""
    return nbytes * 8 / (mbit_per_s * 1e6)


def parse_links(text: str) -> list[tuple[str, float]]:
    """``"1gbit,100mbit"`` -> ``[("1gbit", 1000.0), ("100mbit", 100.0)]`` (megabit/s)."""
    out = []
    for part in filter(None, (p.strip().lower() for p in text.split(","))):
        match = re.fullmatch(r"(\d+(?:\.\d+)?)(gbit|mbit|kbit)", part)
        if match is None or float(match[1]) <= 0:
            raise TclightningError(f"--link {part!r}: expected a positive speed such as 1gbit or 100mbit")
        out.append((part, float(match[1]) * LINK_UNITS[match[2]]))
    return out
