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
from tclightning.codecs.context import KeySlots, has_context, token_of

MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9  # 2**32 / golden ratio: separates hash rounds
_SALT_STRIDE = 0xB5297A4D
_SALT_PERM = 0x1B56C4E9

FILLS = ("zero", "mean", "conditional")


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
    """Decode: ``out = base; out[idx] = src`` for a fresh ``base`` (zeros, or the fill broadcast);
    backward: ``dsrc = dout[idx]`` (``base`` is receiver state, not differentiated)."""

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

    Decode: ``x_hat = fill``, then on kept channels ``x_hat[idx] = fill[idx] + s * (v - fill[idx])``
    with ``s = d/k`` when ``rescale`` else 1 (so without rescale the kept values are exact).
    Fills: ``zero``; ``mean`` -- a per-channel running mean of the *decoded* values only (receiver
    state, so it needs nothing extra on the wire), EMA with ``fill_momentum``, folded in by
    :meth:`commit_step` when the key's step changes and constant within a step; ``conditional`` --
    the Gaussian conditional mean of the dropped channels given the kept ones under a rank-r PPCA
    model ``Sigma = W W^T + s2 I`` (:class:`ConditionalStats`):
    ``x_U = mu_U + W_U (W_S^T W_S + (s2 + ridge) I)^-1 W_S^T (v - mu_S)``, one r x r solve per token.
    Its statistics are receiver state too (nothing extra on the wire): pairwise moments of the
    decoded values (and of any dense activations given to :meth:`observe_dense`), decayed by
    ``1 - fill_momentum`` per step and refitted by :meth:`commit_step`. Cold start: until the
    channel pairs have been seen together ``cond_min_pairs`` times on average, it fills the
    per-channel mean of the decoded values (zero before the first commit). Given the token ids of
    the message (``decode(..., token_ids=)``, which every GRPO stage holds), the fill centres each
    token on its own id's mean (``cond_token_slots`` ids; 0: one mean for all), and, given context
    keys, on its pair's mean (``cond_pair_slots`` pairs of a token and the one before it; 0: none).
    Bytes: ``k * element_size`` per token, exactly (no indices, no padding).
    """

    name = "prf"

    def __init__(
        self,
        dim: int,
        k: int,
        *,
        fill: str = "zero",
        rescale: bool = False,
        fill_momentum: float = 0.1,
        cond_rank: int = 16,
        cond_min_pairs: float = 4.0,
        cond_ridge: float = 0.0,
        cond_stat_tokens: int = 1024,
        cond_token_slots: int = 1024,
        cond_pair_slots: int = 4096,
    ) -> None:
        super().__init__(dim)
        if fill not in FILLS:
            raise ValueError(f"unknown fill '{fill}'; choose one of {', '.join(FILLS)}")
        if fill == "conditional" and rescale:
            raise ValueError("fill 'conditional' does not combine with rescale (the kept values are exact)")
        if not 0.0 < fill_momentum <= 1.0:
            raise ValueError(f"fill_momentum must be in (0, 1], got {fill_momentum}")
        self.k = k
        self.fill = fill
        self.rescale = rescale
        self.fill_momentum = fill_momentum
        self.indexer = PRFIndexer(dim, k)
        self._last: tuple[tuple[CodecKey, int, int, torch.device], Tensor] | None = None
        # receiver-side running-mean state (fill="mean"); float32 whatever the activation dtype
        self._mean: Tensor | None = None
        self._seen: Tensor | None = None
        self._pending_sum: Tensor | None = None
        self._pending_count: Tensor | None = None
        # receiver-side PPCA statistics (fill="conditional")
        self.cond: ConditionalStats | None = (
            ConditionalStats(dim, rank=cond_rank, decay=1.0 - fill_momentum, min_pairs=cond_min_pairs,
                             ridge=cond_ridge, stat_tokens=cond_stat_tokens, token_slots=cond_token_slots,
                             pair_slots=cond_pair_slots)
            if fill == "conditional" else None
        )

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

    def encode(self, x: Tensor, key: CodecKey, *, token_ids: Tensor | None = None) -> Tensor:
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
        if self.fill == "zero":
            src = values * self.scale if self.rescale else values
            out = _ScatterOnto.apply(src, idx, values.new_zeros(batch, length, self.dim))
        elif self.fill == "conditional":
            assert self.cond is not None
            out = self.cond.fill(values, idx, token_ids)
            self.cond.observe(idx, values, token_mask, token_ids)
        else:
            fill = self._fill_vector(values)
            out = fill.expand(batch, length, self.dim).clone()
            src = values
            if self.rescale:
                kept_fill = fill[idx]
                src = kept_fill + self.scale * (values - kept_fill)
            out = _ScatterOnto.apply(src, idx, out)
            self._observe(idx, values, token_mask)
        return out if payload.dim() == 3 else out.squeeze(0)

    @property
    def width(self) -> int:
        return self.k

    def payload_bytes(self, tokens: int, dtype: torch.dtype) -> int:
        return tokens * self.k * dtype.itemsize

    # -- running-mean fill -------------------------------------------------------------------

    def _fill_vector(self, like: Tensor) -> Tensor:
        if self._mean is None or self._mean.device != like.device:
            self._reset_state(like.device)
        assert self._mean is not None
        return self._mean.to(like.dtype)

    def _reset_state(self, device: torch.device) -> None:
        zeros = torch.zeros(self.dim, dtype=torch.float32, device=device)
        if self._mean is not None:  # moved device: keep what was learned
            self._mean, self._seen = self._mean.to(device), self._seen.to(device)  # type: ignore[union-attr]
        else:
            self._mean, self._seen = zeros.clone(), torch.zeros(self.dim, dtype=torch.bool, device=device)
        self._pending_sum, self._pending_count = zeros.clone(), zeros.clone()

    @torch.no_grad()
    def _observe(self, idx: Tensor, values: Tensor, token_mask: Tensor | None) -> None:
        """Accumulate decoded values per channel (only real tokens when a mask is known)."""
        assert self._pending_sum is not None and self._pending_count is not None
        if token_mask is not None and token_mask.shape == idx.shape[:2]:
            keep = token_mask.to(torch.bool)
            idx, values = idx[keep], values[keep]
        flat_idx = idx.reshape(-1)
        self._pending_sum.index_add_(0, flat_idx, values.detach().reshape(-1).float())
        self._pending_count.index_add_(0, flat_idx, torch.ones_like(flat_idx, dtype=torch.float32))

    def observe_dense(self, x: Tensor, token_ids: Tensor | None = None, token_mask: Tensor | None = None) -> None:
        """Conditional fill: fold dense activations the receiver holds (``[B, L, d]`` or ``[T, d]``,
        with their token ids if known) into the pending statistics (every channel pair observed);
        used at the next commit. The other fills ignore them."""
        if self.cond is not None:  # the other fills learn from decoded values only
            self.cond.observe_dense(x, token_ids, token_mask)

    def set_statistics(self, mean: Tensor, cov: Tensor | None = None, *, factor: Tensor | None = None,
                       noise: float = 0.0) -> None:
        """Conditional fill: use the given ``mean`` and ``cov`` (fitted to rank r) or PPCA ``factor``
        ``[d, r]`` + ``noise`` at once (no cold start) until the next commit with observed data."""
        if self.cond is None:
            raise ValueError("set_statistics needs fill 'conditional'")
        self.cond.set_statistics(mean, cov, factor=factor, noise=noise)

    @torch.no_grad()
    def commit_step(self) -> None:
        """``mean_c <- (1 - m) mean_c + m * (batch mean of decoded values on c)`` for observed
        channels (``mean_c <- batch mean`` the first time a channel is seen); the conditional fill
        refits its PPCA model (:meth:`ConditionalStats.commit`)."""
        if self.cond is not None:
            self.cond.commit()
            return
        if self.fill != "mean" or self._pending_count is None:
            return
        assert self._mean is not None and self._seen is not None and self._pending_sum is not None
        observed = self._pending_count > 0
        batch_mean = self._pending_sum / self._pending_count.clamp_min(1.0)
        blended = torch.where(
            self._seen, (1 - self.fill_momentum) * self._mean + self.fill_momentum * batch_mean, batch_mean
        )
        self._mean = torch.where(observed, blended, self._mean)
        self._seen = self._seen | observed
        self._pending_sum.zero_()
        self._pending_count.zero_()

    def state_dict(self) -> dict[str, Any]:
        if self.cond is not None:
            return self.cond.state_dict()
        if self._mean is None:
            return {}
        return {"mean": self._mean.cpu(), "seen": self._seen.cpu()}  # type: ignore[union-attr]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        if self.cond is not None:
            self.cond.load_state_dict(state)
            return
        self._mean, self._seen = state["mean"].float(), state["seen"].bool()
        self._pending_sum = torch.zeros(self.dim, dtype=torch.float32)
        self._pending_count = torch.zeros(self.dim, dtype=torch.float32)

    def _check_dim(self, rows: Tensor) -> None:
        if rows.shape[-1] != self.dim:
            raise ValueError(f"tensor has {rows.shape[-1]} channels, codec expects d={self.dim}")

    def __repr__(self) -> str:
        return f"PRFCodec(dim={self.dim}, k={self.k}, fill={self.fill!r}, rescale={self.rescale})"


class ConditionalStats:
    """Receiver-side statistics and the decode of the ``conditional`` PRF fill (pure tensor math).

    Model: ``x ~ N(mu, W W^T + s2 I)`` with ``W`` ``[d, r]`` (probabilistic PCA). For a token with
    kept channels ``S`` (values ``v``) and dropped ``U`` the Gaussian conditional mean
    ``mu_U + Sigma_US (Sigma_SS + ridge I)^-1 (v - mu_S)`` equals, by the push-through identity,

        x_U = mu_U + W_U z,   z = (W_S^T W_S + (s2 + ridge) I)^-1 W_S^T (v - mu_S)

    -- one batched r x r solve per token instead of a k x k one. The kept channels carry ``v``
    exactly; the map ``v -> x_hat`` is linear, so autograd gives the backward message (still
    ``[tokens, k]``) through it.

    Estimation (zero bytes on the wire): available-case pairwise moments. Each decoded token adds
    its k values to the per-channel sums and ``v v^T`` to the k x k pairs it covers (counts
    likewise, ``O(tokens * k^2)`` index-adds); a dense token given to :meth:`observe_dense` covers
    every pair. At most ``stat_tokens`` (1024) decoded and ``dense_stat_tokens`` (8192) dense real
    tokens per step are used (the first ones, so micro-batches in row order see the same tokens as
    one whole-batch message; a dense token costs one ``d x d`` rank-one update, a decoded one
    ``k^2`` scattered adds, slower per value on a CPU).
    :meth:`commit` decays the committed moments by ``decay`` (= 1 - fill_momentum), adds the
    pending ones, and refits:
    ``mu_i = sum_i / n_i``, ``Sigma_ij = E[x_i x_j] - mu_i mu_j`` over the tokens that saw both (0 for
    pairs never seen together), then the top ``r`` eigenpairs ``(lam, V)`` of ``Sigma``:
    ``s2 = mean of the other eigenvalues`` (floored at 1e-6 x the mean variance) and
    ``W = V sqrt(max(lam - s2, 0))``.

    Cold start: the conditional mean is used once the mean co-observation count of the channel
    pairs (decayed like the moments) reaches ``min_pairs`` -- about ``min_pairs * d(d-1) / (k(k-1))``
    decoded tokens, 2,170 at d = 128, k = 6 and 1,610 at d = 1536, k = 77; before that the fill is
    the per-channel mean of the decoded values (the ``mean`` fill's estimate; zero before the
    first commit). Statistics given by :meth:`set_statistics` are used at once.

    Token means (``token_slots > 0``): every stage of a GRPO trainer holds the batch's token ids
    (the rollouts reach every rank before the step), so the receiver conditions on the token too.
    The model becomes a Gaussian mixture with one component per token id ``t`` and a shared
    covariance: ``x | t ~ N(mu_t, Sigma_w)``, and the fill is the formula above with ``mu_t`` in
    place of ``mu``. ``mu_t`` is shrunk towards the global mean by ``token_prior`` pseudo-tokens,
    ``mu_t = (sum_t + prior mu) / (n_t + prior)`` per channel, so a rare token falls back to ``mu``;
    ``Sigma_w`` is the pooled within-token covariance, ``Sigma - sum_t w_t (m_t - mu)(m_t - mu)^T``
    with ``m_t`` the token's raw mean and ``w_t`` its share of the observations (exact for dense
    observations: the law of total covariance). Up to ``token_slots`` distinct ids get a mean, in
    order of first sight; other ids, and a decode without ids, use ``mu``.

    Pair means (``pair_slots > 0``): given :func:`~tclightning.codecs.context.context_keys` (the
    token and the one before it), a token is centred on its pair's mean, shrunk towards its token's:
    ``mu_p = (sum_p + prior mu_t) / (n_p + prior)`` per channel. Up to ``pair_slots`` pairs get one,
    in order of first sight; other pairs use ``mu_t``. ``Sigma_w`` stays the within-token covariance.
    """

    def __init__(self, dim: int, *, rank: int = 16, decay: float = 0.9, min_pairs: float = 4.0,
                 ridge: float = 0.0, stat_tokens: int = 1024, dense_stat_tokens: int = 8192,
                 token_slots: int = 1024, token_prior: float = 4.0, pair_slots: int = 0) -> None:
        if not 1 <= rank <= dim:
            raise ValueError(f"conditional fill rank must be in [1, d={dim}], got {rank}")
        if ridge < 0 or min_pairs < 0 or min(stat_tokens, dense_stat_tokens) < 1 or not 0.0 <= decay < 1.0:
            raise ValueError("conditional fill: need ridge >= 0, min_pairs >= 0, stat_tokens >= 1, "
                             "dense_stat_tokens >= 1, 0 <= decay < 1")
        if token_slots < 0 or pair_slots < 0 or token_prior <= 0:
            raise ValueError("conditional fill: need token_slots >= 0, pair_slots >= 0 and token_prior > 0")
        self.dim, self.rank, self.decay = dim, rank, decay
        self.min_pairs, self.ridge = min_pairs, ridge
        self.stat_tokens, self.dense_stat_tokens = stat_tokens, dense_stat_tokens
        self.token_slots, self.token_prior = token_slots, token_prior
        self.pair_slots = pair_slots if token_slots else 0  # a pair's mean shrinks towards its token's
        # committed: sum [d], count [d], outer [d,d], pairs [d,d] (+ token_sum, token_count [slots, d],
        # pair_sum, pair_count [pair slots, d])
        self.moments: dict[str, Tensor] | None = None
        self.pending: dict[str, Tensor] | None = None
        self.pending_tokens = {"decoded": 0, "dense": 0}  # tokens in ``pending`` by kind (budgets per step)
        self.tokens = KeySlots(token_slots)  # token id -> row of the token tables
        self.pairs = KeySlots(self.pair_slots)  # context key -> row of the pair tables
        self.mean: Tensor | None = None  # [d]
        self.token_means: Tensor | None = None  # [slots + 1 + pairs given a row, d]: tokens, ``mean``, pairs
        self.factor: Tensor | None = None  # W [d, r]
        self.noise = 0.0  # s2
        self.active = False

    # -- statistics ----------------------------------------------------------------------------

    def _zeros(self, device: torch.device, dtype: torch.dtype = torch.float64) -> dict[str, Tensor]:
        """Moment buffers: float64 when committed, float32 while pending (float32 index-adds are ~5x
        faster on CPU; one message's sums are small)."""
        d = self.dim
        buffers = {
            "sum": torch.zeros(d, dtype=dtype, device=device),
            "count": torch.zeros(d, dtype=dtype, device=device),
            "outer": torch.zeros(d, d, dtype=dtype, device=device),
            "pairs": torch.zeros(d, d, dtype=dtype, device=device),
        }
        for level, slots in (("token", self.token_slots), ("pair", self.pair_slots)):
            if slots:
                buffers[f"{level}_sum"] = torch.zeros(slots, d, dtype=dtype, device=device)
                buffers[f"{level}_count"] = torch.zeros(slots, d, dtype=dtype, device=device)
        return buffers

    def _pending(self, device: torch.device) -> dict[str, Tensor]:
        if self.pending is None or self.pending["sum"].device != device:
            self.pending = self._zeros(device, torch.float32)
            self.pending_tokens = {"decoded": 0, "dense": 0}
        return self.pending

    def _budget(self, tokens: int, kind: str) -> int:
        """How many of the next ``tokens`` tokens of ``kind`` (``decoded`` | ``dense``) still fit in
        this step's budget."""
        used = self.pending_tokens[kind] if self.pending is not None else 0
        limit = self.stat_tokens if kind == "decoded" else self.dense_stat_tokens
        return max(0, min(tokens, limit - used))

    def _assign_slots(self, keys: Tensor) -> tuple[Tensor, Tensor]:
        """``(token rows, pair rows)`` of ``keys`` ``[N]`` (token ids or context keys), giving new
        ids and pairs the free rows in order of first sight (ascending within one call); -1 where
        none is left (and for every pair row without pair slots or context)."""
        if keys.numel() and int(keys.min()) < 0:
            raise ValueError("token ids must be non-negative")
        token_rows = self.tokens.assign(token_of(keys))
        pair_rows = torch.full_like(token_rows, -1)
        if self.pair_slots:
            context = has_context(keys)
            pair_rows[context] = self.pairs.assign(keys[context])
        return token_rows, pair_rows

    def _slots(self, keys: Tensor) -> Tensor:
        """Rows of :attr:`token_means` for decoding ``keys`` (any shape): the pair's row, else the
        token's, else the global mean's (``token_slots``). Assigns no slot."""
        rows = self.tokens.lookup(token_of(keys))
        rows = rows.masked_fill_(rows < 0, self.token_slots)
        if self.pair_slots and len(self.pairs):
            pair = self.pairs.lookup(keys.long())
            rows = torch.where(pair >= 0, pair + self.token_slots + 1, rows)
        return rows

    def _add_to_levels(self, p: dict[str, Tensor], keys: Tensor, rows: Tensor, seen: Tensor,
                       channels: Tensor | None = None) -> None:
        """Per-token and per-pair sums and counts of ``rows`` ``[N, c]`` (``seen`` alike) into ``p``:
        at every channel (``channels`` None) or at ``channels`` ``[N, c]``."""
        for level, slots in zip(("token", "pair"), self._assign_slots(keys.reshape(-1))):
            slots = slots.to(rows.device)
            has = slots >= 0
            if f"{level}_sum" not in p or not bool(has.any()):
                continue
            if channels is None:
                p[f"{level}_sum"].index_add_(0, slots[has], rows[has])
                p[f"{level}_count"].index_add_(0, slots[has], seen[has])
            else:
                cell = (slots[has, None] * self.dim + channels[has]).reshape(-1)
                p[f"{level}_sum"].view(-1).index_add_(0, cell, rows[has].reshape(-1))
                p[f"{level}_count"].view(-1).index_add_(0, cell, seen[has].reshape(-1))

    def _add(self, dense: Tensor, seen: Tensor, token_ids: Tensor | None = None) -> None:
        """Add ``[N, d]`` values (zero where unseen), their ``[N, d]`` 0/1 mask and (optionally) their
        ``[N]`` token ids to the pending moments."""
        take = self._budget(dense.shape[0], "dense")
        if take == 0:
            return
        p = self._pending(dense.device)
        self.pending_tokens["dense"] += take
        dense, seen = dense[:take].float(), seen[:take].float()
        p["sum"] += dense.sum(0)
        p["count"] += seen.sum(0)
        p["outer"] += dense.T @ dense
        p["pairs"] += seen.T @ seen
        if self.token_slots and token_ids is not None:
            self._add_to_levels(p, token_ids.reshape(-1)[:take], dense, seen)

    @torch.no_grad()
    def observe(self, idx: Tensor, values: Tensor, token_mask: Tensor | None,
                token_ids: Tensor | None = None) -> None:
        """Decoded tokens: ``idx``/``values`` ``[B, L, k]`` and their token ids ``[B, L]`` if known
        (only real tokens when a mask is known)."""
        if token_ids is not None and token_ids.shape != idx.shape[:2]:
            token_ids = None
        if token_mask is not None and token_mask.shape == idx.shape[:2]:
            keep = token_mask.to(torch.bool)
            idx, values = idx[keep], values[keep]
            token_ids = token_ids[keep] if token_ids is not None else None
        k = idx.shape[-1]
        take = self._budget(idx.numel() // k, "decoded")
        if take == 0:
            return
        idx = idx.reshape(-1, k)[:take]
        values = values.detach().reshape(-1, k)[:take].float()
        p, flat = self._pending(values.device), idx.reshape(-1)
        self.pending_tokens["decoded"] += take
        ones = torch.ones_like(flat, dtype=torch.float32)
        p["sum"].index_add_(0, flat, values.reshape(-1))
        p["count"].index_add_(0, flat, ones)
        # the k x k pairs of each token: O(tokens * k^2) index-adds, not a [tokens, d] x [d, tokens] product
        pair = (idx[:, :, None] * self.dim + idx[:, None, :]).reshape(-1)
        p["outer"].view(-1).index_add_(0, pair, (values[:, :, None] * values[:, None, :]).reshape(-1))
        p["pairs"].view(-1).index_add_(0, pair, torch.ones_like(pair, dtype=torch.float32))
        if self.token_slots and token_ids is not None:
            self._add_to_levels(p, token_ids.reshape(-1)[:take], values, ones.view(-1, k), channels=idx)

    @torch.no_grad()
    def observe_dense(self, x: Tensor, token_ids: Tensor | None = None, token_mask: Tensor | None = None) -> None:
        """Dense activations ``[B, L, d]`` or ``[T, d]`` and, if known, their token ids (``[B, L]`` or
        ``[T]``, the shape of ``x`` without channels)."""
        rows = as_rows(x.detach())
        ids = None if token_ids is None or token_ids.numel() != rows.numel() // self.dim else token_ids.reshape(rows.shape[:2])
        if token_mask is not None and token_mask.shape == rows.shape[:2]:
            keep = token_mask.to(torch.bool)
            flat, ids = rows[keep], (ids[keep] if ids is not None else None)
        else:
            flat = rows.reshape(-1, self.dim)
        self._add(flat, torch.ones_like(flat, dtype=torch.float32), ids)

    @torch.no_grad()
    def commit(self) -> None:
        """Fold the pending moments in (committed = decay * committed + pending) and refit."""
        if self.pending is None or float(self.pending["count"].sum()) == 0.0:
            return
        if self.moments is None or self.moments["sum"].device != self.pending["sum"].device:
            self.moments = self._zeros(self.pending["sum"].device)
        for name, value in self.pending.items():
            self.moments[name].mul_(self.decay).add_(value.double())
            value.zero_()
        self.pending_tokens = {"decoded": 0, "dense": 0}
        self._refit()

    def _refit(self) -> None:
        assert self.moments is not None
        m = self.moments
        mean = torch.where(m["count"] > 0, m["sum"] / m["count"].clamp_min(1e-12), torch.zeros_like(m["sum"]))
        pairs = m["pairs"]
        cov = torch.where(pairs > 0, m["outer"] / pairs.clamp_min(1e-12) - torch.outer(mean, mean),
                          torch.zeros_like(pairs))
        off = pairs.sum() - pairs.diagonal().sum()
        coverage = float(off / (self.dim * (self.dim - 1))) if self.dim > 1 else float(pairs.sum())
        self.mean = mean.float()
        if "token_sum" in m:
            cov = cov - self._between_tokens(mean)
            count = m["token_count"]
            shrunk = torch.cat([(m["token_sum"] + self.token_prior * mean) / (count + self.token_prior), mean[None]])
            if "pair_sum" in m:  # each pair's mean shrunk towards its token's (the pairs given a row)
                # a pair's token got its row (or none, for good) in the call that gave the pair its row
                parent = shrunk[self._slots(token_of(self.pairs.keys)).to(shrunk.device)]
                used = len(self.pairs)
                pairs = (m["pair_sum"][:used] + self.token_prior * parent) / (m["pair_count"][:used] + self.token_prior)
                shrunk = torch.cat([shrunk, pairs])
            self.token_means = shrunk.float()
        self._fit((cov + cov.T) / 2)
        self.active = coverage >= self.min_pairs

    def _between_tokens(self, mean: Tensor) -> Tensor:
        """``sum_t w_t (m_t - mu)(m_t - mu)^T``: the covariance the token means explain (``m_t`` the
        raw per-channel token means, ``w_t`` each token's share of the observations)."""
        assert self.moments is not None
        count = self.moments["token_count"]
        seen = count > 0
        deviation = torch.where(seen, self.moments["token_sum"] / count.clamp_min(1e-12) - mean, torch.zeros_like(count))
        weight = count.mean(1)
        total = float(weight.sum())
        if total == 0.0:
            return torch.zeros_like(self.moments["outer"])
        return (deviation.T * (weight / total)) @ deviation

    def _fit(self, cov: Tensor) -> None:
        """``W`` and ``s2`` of the rank-r PPCA fit of a symmetric ``[d, d]`` covariance."""
        cov = cov.double()
        eigvals, eigvecs = torch.linalg.eigh(cov)  # ascending
        top = eigvals[-self.rank:]
        rest = eigvals[: -self.rank] if self.rank < self.dim else eigvals.new_zeros(1)
        floor = 1e-6 * max(float(cov.diagonal().clamp_min(0).mean()), 1e-12)
        self.noise = max(float(rest.mean()), floor)
        self.factor = (eigvecs[:, -self.rank:] * (top - self.noise).clamp_min(0).sqrt()).float()

    def set_statistics(self, mean: Tensor, cov: Tensor | None = None, *, factor: Tensor | None = None,
                       noise: float = 0.0) -> None:
        if (cov is None) == (factor is None):
            raise ValueError("give exactly one of cov and factor")
        self.mean = mean.detach().float().reshape(self.dim)
        self.token_means = None  # one mean for every token until the next commit with observed data
        if cov is not None:
            self._fit(cov.detach())
        else:
            assert factor is not None
            self.factor, self.noise = factor.detach().float().reshape(self.dim, -1), float(noise)
        self.active = True

    # -- decode --------------------------------------------------------------------------------

    def _base(self, batch: int, length: int, device: torch.device, token_ids: Tensor | None) -> Tensor | None:
        """The mean each token is filled around, ``[B*L, d]`` float32: its token's mean when ids are
        given and token means are fitted, else the global mean (None before the first commit)."""
        if self.mean is None:
            return None
        if self.token_means is not None and token_ids is not None and token_ids.shape == (batch, length):
            return self.token_means.to(device).index_select(0, self._slots(token_ids.to(device)).reshape(-1))
        return self.mean.to(device).expand(batch * length, self.dim)

    def fill(self, values: Tensor, idx: Tensor, token_ids: Tensor | None = None) -> Tensor:
        """``x_hat`` ``[B, L, d]``: ``values`` at ``idx``, the conditional mean (or, in the cold start,
        the mean) elsewhere, around each token's mean when ``token_ids`` ``[B, L]`` are given;
        differentiable in ``values``."""
        batch, length, k = values.shape
        base = self._base(batch, length, values.device, token_ids)
        if not self.active or self.factor is None or base is None:
            if base is None:
                start = values.new_zeros(batch, length, self.dim)
            else:
                start = base.to(values.dtype).reshape(batch, length, self.dim).clone()
            return _ScatterOnto.apply(values, idx, start)
        factor = self.factor.to(values.device)
        rank = factor.shape[1]
        flat_idx = idx.reshape(-1, k)
        w_s = factor.index_select(0, flat_idx.reshape(-1)).view(batch, length, k, rank)
        centred = values.float() - base.gather(-1, flat_idx).view(batch, length, k)
        gram = w_s.transpose(-1, -2) @ w_s
        gram = gram + (self.noise + self.ridge) * torch.eye(rank, device=values.device)
        rhs = (w_s.transpose(-1, -2) @ centred.unsqueeze(-1))
        z = torch.linalg.solve(gram, rhs).squeeze(-1)  # [B, L, r]
        # in place where base is a fresh gather: a new [B*L, d] output costs more than the product
        if base.is_contiguous():
            full = base.addmm_(z.reshape(-1, rank), factor.T)
        else:
            full = torch.addmm(base, z.reshape(-1, rank), factor.T)
        full = full.view(batch, length, self.dim).scatter_(-1, idx, values.float())
        return full.to(values.dtype)

    # -- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        if self.mean is None and self.moments is None:
            return {}
        state: dict[str, Any] = {"fill": "conditional", "active": self.active, "noise": self.noise}
        if self.mean is not None:
            state["cond_mean"] = self.mean.cpu()
        if self.token_means is not None:
            state["cond_token_means"] = self.token_means.cpu().clone()
        if self.token_slots:
            state["cond_token_keys"] = self.tokens.state_dict()
        if self.pair_slots:
            state["cond_pair_keys"] = self.pairs.state_dict()
        if self.factor is not None:
            state["cond_factor"] = self.factor.cpu()
        if self.moments is not None:
            # copies: commit updates the moments in place, so a checkpoint must not alias them
            state.update({f"moment_{name}": value.detach().cpu().clone() for name, value in self.moments.items()})
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("fill") != "conditional":
            raise ValueError("codec state is not a conditional-fill state (was the fill changed on resume?)")
        self.active, self.noise = bool(state["active"]), float(state["noise"])
        self.mean = state["cond_mean"].float() if "cond_mean" in state else None
        self.factor = state["cond_factor"].float() if "cond_factor" in state else None
        self.token_means = state["cond_token_means"].float().clone() if "cond_token_means" in state else None
        if "cond_slot_of" in state:  # an id -> slot array (older checkpoints): the ids in slot order
            slot_of = state["cond_slot_of"].long()
            ids = torch.nonzero(slot_of >= 0).squeeze(1)
            state = {**state, "cond_token_keys": ids[torch.argsort(slot_of[ids])]}
        for level, slots in (("token", self.token_slots), ("pair", self.pair_slots)):
            if slots and f"cond_{level}_keys" not in state and "moment_sum" in state:
                raise ValueError(f"codec state has no {level} means (saved with pipeline.fill_{level}s=0?)")
        self.tokens.load_state_dict(state.get("cond_token_keys", torch.zeros(0, dtype=torch.long)))
        self.pairs.load_state_dict(state.get("cond_pair_keys", torch.zeros(0, dtype=torch.long)))
        names = ("sum", "count", "outer", "pairs") + (("token_sum", "token_count") if self.token_slots else ())
        names += ("pair_sum", "pair_count") if self.pair_slots else ()
        if all(f"moment_{name}" in state for name in names):
            self.moments = {name: state[f"moment_{name}"].double().clone() for name in names}
        else:
            self.moments = None
        self.pending = None
        self.pending_tokens = {"decoded": 0, "dense": 0}
