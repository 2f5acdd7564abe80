"""Boundary codecs: what crosses a pipeline cut (pure tensor math, no Lightning).

* ``prf``      -- exact-k per token, indices from a keyed hash, only values sent (:mod:`.prf`)
* ``identity`` -- the dense boundary (:mod:`.identity`)
* ``svd``      -- static rank-r basis from calibration activations (:mod:`.lowrank`)
* ``lowrank``  -- rank-r basis kept current during training (:mod:`.lowrank`)

``make_codec(name, dim, ...)`` builds one by name; see ``docs/codecs.md``.
"""

from __future__ import annotations

from tclightning.codecs.base import (
    FORWARD_STREAM,
    Codec,
    CodecKey,
    Payload,
    dense_bytes,
    payload_nbytes,
)
from tclightning.codecs.identity import IdentityCodec
from tclightning.codecs.lowrank import (
    FIRST_FITS,
    QUANT_BITS,
    AdaptiveLowRankCodec,
    SVDCodec,
    TokenMoments,
    entropy_rank,
    quantised_bytes,
    quantised_rank,
)
from tclightning.codecs.prf import PRFCodec, PRFIndexer

CODECS = ("prf", "identity", "svd", "lowrank")


def budget_k(dim: int, *, rate: float | None = None, k: int | None = None) -> int:
    """Values kept per token: ``k`` if given, else ``round(rate * d)`` (half up), clamped to [1, d].

    ``budget_k(1536, rate=0.05) == 77``; ``budget_k(576, rate=0.05) == 29``."""
    if k is not None:
        if not 1 <= k <= dim:
            raise ValueError(f"k must be in [1, d={dim}], got {k}")
        return k
    if rate is None or not 0.0 < rate <= 1.0:
        raise ValueError(f"rate must be in (0, 1], got {rate}")
    return min(dim, max(1, int(rate * dim + 0.5)))


def make_codec(
    name: str,
    dim: int,
    *,
    k: int | None = None,
    rate: float | None = 0.05,
    rescale: bool = False,
    rank: int | None = None,
    refresh_every: int = 10,
    refresh_tolerance: float = 0.02,
    basis_tokens: int = 1024,
    bits: int | None = None,
    bits_lead: bool = False,
    value_bytes: int = 4,
    first_fit: str = "dense",
    entropy_coding: bool = False,
) -> Codec:
    """Build codec ``name`` for ``dim`` channels; the budget is ``budget_k(dim, rate=rate, k=k)``
    values per token for ``prf``; the rank (default: that same budget) for ``svd``/``lowrank``;
    ``refresh_every`` / ``refresh_tolerance``: the basis refresh checks of ``lowrank``;
    ``basis_tokens``: how many token ids get their own centre there. ``bits`` (``lowrank`` only):
    quantised coefficients; the rank is then what ``rank`` (or the budget) values of
    ``value_bytes`` bytes each buy at ``bits`` bits beside a 16-bit scale (:func:`quantised_rank`;
    ``bits_lead``: the leading coefficient in 16 bits beside them); ``first_fit``: ``dense`` (the first
    step crosses dense and both sides fit on it) or ``ship`` (the sender fits and ships its basis)."""
    if name == "identity":
        if bits is not None:
            raise ValueError("bits: only the lowrank codec quantises its coefficients")
        return IdentityCodec(dim)
    if bits is not None and name != "lowrank":
        raise ValueError(f"bits: only the lowrank codec quantises its coefficients, not {name}")
    budget = budget_k(dim, rate=rate, k=k)
    if name == "prf":
        return PRFCodec(dim, budget, rescale=rescale)
    if name == "svd":
        return SVDCodec(dim, rank or budget)
    if name == "lowrank":
        rank = rank or budget
        if entropy_coding:
            budget_bytes = rank * value_bytes
            return AdaptiveLowRankCodec(dim, entropy_rank(dim, budget_bytes), refresh_every=refresh_every,
                                        refresh_tolerance=refresh_tolerance, token_slots=basis_tokens,
                                        first_fit=first_fit, entropy_budget=budget_bytes)
        if bits is not None:
            rank = quantised_rank(rank * value_bytes, bits, dim, bits_lead)
        return AdaptiveLowRankCodec(dim, rank, refresh_every=refresh_every, refresh_tolerance=refresh_tolerance,
                                    token_slots=basis_tokens, bits=bits, lead=bits_lead, first_fit=first_fit)
    raise ValueError(f"unknown codec '{name}'; choose one of {', '.join(CODECS)}")


__all__ = [
    "AdaptiveLowRankCodec",
    "TokenMoments",
    "CODECS",
    "FORWARD_STREAM",
    "Codec",
    "CodecKey",
    "IdentityCodec",
    "PRFCodec",
    "PRFIndexer",
    "Payload",
    "FIRST_FITS",
    "QUANT_BITS",
    "SVDCodec",
    "budget_k",
    "dense_bytes",
    "entropy_rank",
    "make_codec",
    "payload_nbytes",
    "quantised_bytes",
    "quantised_rank",
]
