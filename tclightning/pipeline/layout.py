"""Resolve a :class:`PipelineConfig` against a model's depth into concrete cuts (pure logic).

A cut sits after decoder layer ``layer`` (0-based); ``ordinal`` is its place in cut order
(``solo:i`` and the ``explicit`` lists index by ordinal). Uncompressed cuts carry the
``identity`` codec, so every cut is priced on the wire, dense ones included.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from tclightning.codecs import Codec, budget_k, make_codec
from tclightning.codecs.base import WIRE_DTYPES
from tclightning.errors import TclightningError
from tclightning.pipeline.config import PipelineConfig


@dataclass(frozen=True)
class CutSpec:
    """One resolved cut: where it is and what crosses it.

    ``codec``: forward codec name (``identity`` when not compressed); ``k``: values per token for
    prf; ``rank``: for svd / lowrank (the budget k; with ``pipeline.bits`` the lowrank codec's
    rank is what k values' bytes buy at those bits, :func:`cut_codec`)."""

    ordinal: int
    layer: int
    compressed: bool
    codec: str
    k: int
    rank: int


def even_split_cuts(num_layers: int, stages: int) -> list[int]:
    """Cut layers of an even ``stages``-way split: after layer ``round(n * i / S) - 1`` (half up).

    28 layers / 4 stages -> [6, 13, 20]; 30 / 4 -> [7, 14, 22]; 4 / 2 -> [1]."""
    if stages < 1:
        raise TclightningError(f"pipeline.stages must be >= 1, got {stages}")
    if stages > num_layers:
        raise TclightningError(f"pipeline.stages={stages} exceeds the model's {num_layers} decoder layers")
    return [(2 * num_layers * i + stages) // (2 * stages) - 1 for i in range(1, stages)]


def cut_layers(config: PipelineConfig, num_layers: int) -> list[int]:
    """The cut layers: ``config.cuts`` if given (validated), else the even split of ``config.stages``."""
    if config.cuts is None:
        return even_split_cuts(num_layers, config.stages)
    layers = list(config.cuts)
    if any(not 0 <= layer <= num_layers - 2 for layer in layers):
        raise TclightningError(
            f"pipeline.cuts {layers}: each cut must follow a layer in [0, {num_layers - 2}] "
            f"(the model has {num_layers} decoder layers; a cut after the last one splits nothing)"
        )
    if any(b <= a for a, b in itertools.pairwise(layers)):
        raise TclightningError(f"pipeline.cuts {layers} must be strictly increasing")
    return layers


def compressed_flags(config: PipelineConfig, n_cuts: int) -> list[bool]:
    """Which cuts are compressed under ``config.layout`` (``explicit``: those whose ``cut_codecs``
    entry is not ``identity``)."""
    layout = config.layout
    if layout == "dense":
        return [False] * n_cuts
    if n_cuts == 0:
        raise TclightningError(f"pipeline.layout '{layout}' needs at least one cut (stages >= 2 or explicit cuts)")
    if layout == "all":
        return [True] * n_cuts
    if layout == "shallow" or layout.startswith("shallow:"):
        count = int(layout[8:] or 1)
        if count > n_cuts:
            raise TclightningError(f"pipeline.layout '{layout}': {count} cuts compressed, but there are {n_cuts}")
        return [i < count for i in range(n_cuts)]
    if layout.startswith("solo:"):
        index = int(layout[5:])
        if not 0 <= index < n_cuts:
            raise TclightningError(f"pipeline.layout '{layout}': cut index must be in [0, {n_cuts - 1}] (0-based)")
        return [i == index for i in range(n_cuts)]
    if layout == "explicit":
        codecs = config.cut_codecs or []
        if len(codecs) != n_cuts:
            raise TclightningError(f"pipeline.cut_codecs has {len(codecs)} entries for {n_cuts} cuts")
        return [name != "identity" for name in codecs]
    raise TclightningError(f"pipeline.layout '{layout}' is unknown")


def resolve_layout(config: PipelineConfig, num_layers: int, dim: int) -> list[CutSpec]:
    """Config + model shape (``num_layers`` decoder layers of width ``dim``) -> cuts in depth order.

    Raises ``TclightningError`` for layouts the model cannot carry."""
    config.validate()
    layers = cut_layers(config, num_layers)
    if config.cut_codecs is not None and len(config.cut_codecs) != len(layers):
        raise TclightningError(f"pipeline.cut_codecs has {len(config.cut_codecs)} entries for {len(layers)} cuts")
    flags = compressed_flags(config, len(layers))
    try:
        k = budget_k(dim, rate=config.rate, k=config.k)
    except ValueError as err:
        raise TclightningError(f"pipeline budget: {err}") from None
    cuts = []
    for ordinal, (layer, flag) in enumerate(zip(layers, flags)):
        codec = config.cut_codecs[ordinal] if config.cut_codecs is not None else (config.codec if flag else "identity")
        compressed = codec != "identity"
        cuts.append(
            CutSpec(
                ordinal=ordinal,
                layer=layer,
                compressed=compressed,
                codec=codec,
                k=k,
                rank=k,  # the budget: equal bytes per token
            )
        )
    return cuts


def cut_codec(config: PipelineConfig, spec: CutSpec, dim: int) -> Codec:
    """The forward codec of cut ``spec`` (``spec.codec`` at ``spec.k`` / ``spec.rank``), with the
    basis-refresh settings of ``config``. With ``pipeline.bits`` a ``lowrank`` cut spends what its
    ``spec.rank`` values cost in the payload dtype (float32 unless ``pipeline.payload_dtype``) on
    quantised coefficients (:func:`~tclightning.codecs.quantised_rank`)."""
    bits = config.bits if spec.codec == "lowrank" else None
    value_bytes = WIRE_DTYPES[config.payload_dtype].itemsize if config.payload_dtype is not None else 4
    codec = make_codec(
        spec.codec, dim, k=spec.k, rank=spec.rank, refresh_every=config.refresh_every,
        refresh_tolerance=config.refresh_tolerance, basis_tokens=config.basis_tokens,
        bits=bits, bits_lead=config.bits_lead and bits is not None, value_bytes=value_bytes,
        first_fit=config.first_fit, entropy_coding=config.entropy_coding and spec.codec == "lowrank" and bits is None,
    )
    if config.payload_dtype is not None and spec.codec != "identity":
        codec.wire_dtype = WIRE_DTYPES[config.payload_dtype]
    return codec
