"""Exact-k PRF codec: each token keeps exactly k of its d channels, chosen by a keyed hash.

Index construction (per token t with key (seed, step, cut, row, position)):

    h_t        = H(seed, step, cut, stream, row, position)        32-bit keyed integer hash
    slot_t     = h_t mod (S * d),  a_t = slot_t mod d,  s_t = slot_t div d
    idx_t      = sort{ perm[(a_t + b_{s_t} * j) mod d] : j = 0 .. k-1 }

``perm`` is a keyed permutation of [0, d) and ``b_0 .. b_{S-1}`` are S strides invertible mod d,
both fixed per (seed, cut); the S*d kept sets are tabulated once per (seed, cut, device), so
generating a message's indices is one hash per token plus one table-row gather.

Why this construction:
* exact-k and distinct by construction: j -> a + b*j is injective mod d when gcd(b, d) = 1 and
  k <= d, and ``perm`` is a bijection -- no rejection, no top-k at run time;
* O(T*k) work per message (the hash is O(T), the row gather O(T*k)); the table costs
  S*d*k int64 once (S = 16, d = 1536, k = 77: 15 MB);
* every channel is kept with probability exactly k/d per token: for each stride, the d offsets
  cover every channel exactly k times, and the slot is uniform over all offsets and strides (up to
  the 2**-32-level bias of the modulo) -- what makes the optional d/k rescale unbiased;
* ``perm`` scatters each progression over the channels, so kept sets do not follow the model's
  channel layout (heads, rotary halves, contiguous runs); the S strides are a keyed choice among all
  invertible ones, so different cuts and seeds see different families of sets;
* rows sorted ascending: the payload order is a convention both sides share, and sorted indices make
  the gather/scatter walk memory forwards (about 25% faster on CPU than a random order);
* deterministic across processes and devices: integer arithmetic on int64 tensors kept inside
  [0, 2**32) with products split so nothing overflows -- no torch RNG involved.

Only the k values per token cross the wire; the receiver regenerates the indices from the key.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from tclightning.codecs.base import Codec, CodecKey, as_rows

MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9  # 2**32 / golden ratio: separates hash rounds
_SALT_STRIDE = 0xB5297A4D
_SALT_PERM = 0x1B56C4E9

def _mul32(x: Any, c: int) -> Any:
    """``(x * c) mod 2**32`` for ``0 <= x < 2**32`` (int or int64 tensor) without int64 overflow.

    ``c`` is split into 16-bit halves so every partial product stays below 2**48."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & MASK32


def mix32(x: Any) -> Any:
    """A bijective 32-bit integer hash (Wellons' ``lowbias32``) on ints or int64 tensors in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def fold32(value: int) -> int:
    """Any Python int (negative, or wider than 32 bits) -> [0, 2**32), xor-folding the high word."""
    value &= (1 << 64) - 1
    return (value ^ (value >> 32)) & MASK32


def key_hash(key: CodecKey) -> int:
    """32-bit hash of the scalar key parts (seed, step, cut, stream); rows/positions are mixed in later."""
    h = mix32(fold32(key.seed) ^ _GOLDEN)
    for part in (key.step, key.cut, key.stream):
        h = mix32(((h + _GOLDEN) & MASK32) ^ fold32(part))
    return h


def units_mod(d: int) -> list[int]:
    """Strides invertible mod d: ``{b in [1, d) : gcd(b, d) = 1}`` (``[0]`` for d = 1)."""
    return [b for b in range(1, d) if math.gcd(b, d) == 1] or [0]


def keyed_permutation(seed: int, cut: int, d: int, device: torch.device | str = "cpu") -> Tensor:
    """The fixed permutation of [0, d) for (seed, cut): argsort of distinct 32-bit hashes (no ties, so
    the same on every device)."""
    base = mix32(mix32(fold32(seed) ^ _SALT_PERM) ^ fold32(cut))
    scores = mix32(torch.arange(d, dtype=torch.int64) ^ base)
    return torch.argsort(scores, stable=True).to(device)


class PRFIndexer:
    """Generates the k kept channels per token for a (d, k) budget from a table of ``S * d`` kept sets
    per (seed, cut) (see the module docstring); tables are cached per (seed, cut, device)."""

    def __init__(self, dim: int, k: int, *, strides: int = 16) -> None:
        if not 1 <= k <= dim:
            raise ValueError(f"k must be in [1, d={dim}], got {k}")
        if strides < 1:
            raise ValueError(f"strides must be >= 1, got {strides}")
        self.dim, self.k = dim, k
        self._units = units_mod(dim)
        self.strides = min(strides, len(self._units))
        self._tables: dict[tuple[int, int, torch.device], Tensor] = {}

    def keyed_strides(self, seed: int, cut: int) -> list[int]:
        """The S strides of (seed, cut): the invertible strides ordered by a keyed hash, first S."""
        base = mix32(mix32(fold32(seed) ^ _SALT_STRIDE) ^ fold32(cut))
        return sorted(self._units, key=lambda b: mix32(b ^ base))[: self.strides]

    def table(self, seed: int, cut: int, device: torch.device | str = "cpu") -> Tensor:
        """int64 ``[S * d, k]``: row ``s * d + a`` is ``sort(perm[(a + b_s * j) mod d])``."""
        slot = (seed, cut, torch.device(device))
        table = self._tables.get(slot)
        if table is None:
            perm = keyed_permutation(seed, cut, self.dim)
            strides = torch.tensor(self.keyed_strides(seed, cut), dtype=torch.int64)
            offsets = torch.arange(self.dim, dtype=torch.int64)
            j = torch.arange(self.k, dtype=torch.int64)
            positions = (offsets[None, :, None] + strides[:, None, None] * j[None, None, :]) % self.dim
            table = perm[positions].reshape(-1, self.k).sort(-1).values.to(slot[2])
            if len(self._tables) > 64:  # seeds/cuts are few; bound the cache anyway
                self._tables.clear()
            self._tables[slot] = table
        return table

    def indices(self, key: CodecKey, batch: int, length: int, device: torch.device | str = "cpu") -> Tensor:
        """int64 ``[batch, length, k]``: the kept channels of token (row_offset + b, position l)."""
        device = torch.device(device)
        rows = torch.arange(batch, dtype=torch.int64, device=device) + key.row_offset
        positions = torch.arange(length, dtype=torch.int64, device=device)
        row_hash = mix32((rows & MASK32) ^ key_hash(key))
        token_hash = mix32((row_hash[:, None] + _mul32(positions, _GOLDEN)[None, :]) & MASK32)
        table = self.table(key.seed, key.cut, device)
        slots = (token_hash % table.shape[0]).reshape(-1)
        # fresh, not a reused workspace: autograd keeps the indices for backward
        return table.index_select(0, slots).view(batch, length, self.k)


_SAME_WIDTH_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_bits(t: Tensor) -> Tensor:
    """Same-width integer view on CPU (bit-exact moves): torch's CPU scatter for bf16/f16 is ~9x
    slower than for int16, and integer gather/scatter is never slower."""
    if t.device.type == "cpu" and t.is_floating_point() and t.element_size() in _SAME_WIDTH_INT:
        return t.view(_SAME_WIDTH_INT[t.element_size()])
    return t


def gather_rows(x: Tensor, idx: Tensor) -> Tensor:
    """``x.gather(-1, idx)`` without autograd, through :func:`_as_bits`."""
    return _as_bits(x).gather(-1, idx).view(x.dtype)


def scatter_rows_(out: Tensor, idx: Tensor, values: Tensor) -> Tensor:
    """``out.scatter_(-1, idx, values)`` without autograd, through :func:`_as_bits`; returns ``out``."""
    _as_bits(out).scatter_(-1, idx, _as_bits(values.to(out.dtype)))
    return out


class _Gather(torch.autograd.Function):
    """Encode: ``v = x[idx]``; backward scatters ``dv`` into zeros (the sender's gradient lives on the
    kept coordinates only)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, idx: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(idx)
        ctx.shape = x.shape
        return gather_rows(x, idx)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        (idx,) = ctx.saved_tensors
        return scatter_rows_(grad.new_zeros(ctx.shape), idx, grad), None


class _ScatterOnto(torch.autograd.Function):
    """Decode: ``out = base; out[idx] = src`` for a fresh ``base`` (zeros); backward:
    ``dsrc = dout[idx]`` (``base`` is not differentiated)."""

    @staticmethod
    def forward(ctx: Any, src: Tensor, idx: Tensor, base: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(idx)
        ctx.mark_dirty(base)
        return scatter_rows_(base, idx, src)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        (idx,) = ctx.saved_tensors
        return gather_rows(grad, idx), None, None


class PRFCodec(Codec):
    """Exact-k PRF codec: payload = the k kept values per token, ``[B, L, k]`` in ``x``'s dtype.

    Decode: ``x_hat = 0``, then on kept channels ``x_hat[idx] = s * v`` with ``s = d/k`` when
    ``rescale`` else 1 (so without rescale the kept values are exact). Stateless: nothing is
    learned from traffic. Bytes: ``k * element_size`` per token, exactly (no indices, no padding).
    """

    name = "prf"

    def __init__(self, dim: int, k: int, *, rescale: bool = False) -> None:
        super().__init__(dim)
        self.k = k
        self.rescale = rescale
        self.indexer = PRFIndexer(dim, k)
        self._last: tuple[tuple[CodecKey, int, int, torch.device], Tensor] | None = None

    @property
    def scale(self) -> float:
        """``d/k`` under rescale, else 1."""
        return self.dim / self.k if self.rescale else 1.0

    def indices(self, key: CodecKey, batch: int, length: int, device: torch.device | str) -> Tensor:
        """Kept channels ``[batch, length, k]``; the last result is cached (encode and decode of the
        same message in one process generate them once)."""
        slot = (key, batch, length, torch.device(device))
        if self._last is not None and self._last[0] == slot:
            return self._last[1]
        idx = self.indexer.indices(key, batch, length, device)
        self._last = (slot, idx)
        return idx

    def clear_cache(self) -> None:
        """Forget cached indices (benchmarks time index generation on both sides)."""
        self._last = None

    def encode(self, x: Tensor, key: CodecKey, *, token_ids: Tensor | None = None,
               token_mask: Tensor | None = None) -> Tensor:
        rows = as_rows(x)
        self._check_dim(rows)
        idx = self.indices(key, rows.shape[0], rows.shape[1], rows.device)
        values = _Gather.apply(rows, idx)
        return values if x.dim() == 3 else values.squeeze(0)

    def decode(self, payload: Tensor, key: CodecKey, *, token_mask: Tensor | None = None,  # type: ignore[override]
               token_ids: Tensor | None = None) -> Tensor:
        values = as_rows(payload)
        batch, length, k = values.shape
        if k != self.k:
            raise ValueError(f"payload carries {k} values per token, codec expects k={self.k}")
        idx = self.indices(key, batch, length, values.device)
        src = values * self.scale if self.rescale else values
        out = _ScatterOnto.apply(src, idx, values.new_zeros(batch, length, self.dim))
        return out if payload.dim() == 3 else out.squeeze(0)

    @property
    def width(self) -> int:
        return self.k

    def payload_bytes(self, tokens: int, dtype: torch.dtype) -> int:
        return tokens * self.k * dtype.itemsize

    def _check_dim(self, rows: Tensor) -> None:
        if rows.shape[-1] != self.dim:
            raise ValueError(f"tensor has {rows.shape[-1]} channels, codec expects d={self.dim}")

    def __repr__(self) -> str:
        return f"PRFCodec(dim={self.dim}, k={self.k}, rescale={self.rescale})"
