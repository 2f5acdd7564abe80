"""Low-rank codecs, the comparison point for PRF at equal budget (rank r = k values per token).

* ``svd`` (activations): a static rank-r basis ``U`` [d, r] and mean ``mu`` from calibration
  activations at the cut. ``payload = (x - mu) U`` ([B, L, r]), ``x_hat = mu + payload U^T``.
  Linear, so the gradient w.r.t. the payload ``g U`` is the [B, L, r] backward message.
* ``lowrank`` (activations): the same projection with the basis kept current during training
  (:class:`AdaptiveLowRankCodec`); optionally with its coefficients quantised to ``bits`` bits
  and a 16-bit scale per token (:func:`quantise_coefficients`, :func:`stochastic_quantise`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import Tensor

from tclightning.codecs.base import Codec, CodecKey, saved_count, saved_tensor
from tclightning.codecs.context import ID_LIMIT, sorted_rows, token_of
from tclightning.codecs.entropy import quantise_forward, quantise_gradient
from tclightning.codecs.prf import fold32, key_hash, mix32

TOKEN_PRIOR = 4.0
"""Pseudo-observations shrinking a token's centre towards the global mean: a token seen n times in
a window moves its centre by ``n / (n + 4)`` of the way to its own mean."""


def segment_sums(ids: Tensor, rows: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(distinct ids ascending [n], per-id row sums [n, d], per-id counts [n])`` of ``rows``
    ``[T, d]`` grouped by ``ids`` ``[T]``. A stable sort and a cumulative sum, not ``index_add_``:
    the same inputs give bit-identical sums on any device (GPU atomics would not), which the two
    sides of a cut rely on."""
    order = torch.argsort(ids, stable=True)
    distinct, counts = torch.unique_consecutive(ids[order], return_counts=True)
    running = rows[order].cumsum(0)
    ends = counts.cumsum(0) - 1
    sums = running[ends].clone()
    sums[1:] -= running[ends[:-1]]
    return distinct, sums, counts.to(rows.dtype)


class TokenMoments:
    """First and second moments of boundary tokens in float64: ``n``, ``sum x`` [d], ``sum x x^T`` [d, d],
    and, when every row came with its token id, per-id sums ``S_t`` and counts ``n_t`` (a context
    key counts as its token: :func:`~tclightning.codecs.context.token_of`).

    Adding the same tokens in the same order gives bit-identical moments, which is what lets the
    two sides of a cut fit the same basis from traffic they both saw without sending it.

    With token ids the covariance is the within-token one, about each token's shrunk mean
    ``m_t = (S_t + prior m) / (n_t + prior)`` (``m`` the global mean):
    ``W = sum x x^T / n - sum_t (S_t m_t^T + m_t S_t^T - n_t m_t m_t^T) / n`` -- exactly the second
    moment of ``x - m_t``, so its trailing eigenvalues are what a fresh basis around fresh token
    centres loses."""

    def __init__(self, dim: int, token_prior: float = TOKEN_PRIOR) -> None:
        self.dim = dim
        self.token_prior = token_prior
        self.count = 0
        self.total: Tensor | None = None
        self.outer: Tensor | None = None
        self.with_ids = 0  # rows that came with token ids
        self.ids: Tensor | None = None  # distinct ids seen, ascending [n]
        self.token_total: Tensor | None = None  # [n, d]
        self.token_count: Tensor | None = None  # [n]
        self._spectra: dict[bool, tuple[Tensor, Tensor, Tensor]] = {}  # by within_tokens, until the moments change

    @torch.no_grad()
    def add(self, tokens: Tensor, token_ids: Tensor | None = None) -> None:
        """Fold in ``tokens`` ([..., d], every row a token) and, optionally, their ids (one per row)."""
        rows = tokens.detach().reshape(-1, self.dim).double()
        if rows.shape[0] == 0:
            return
        if self.total is None or self.outer is None or self.total.device != rows.device:
            self.clear()
            self.total = rows.new_zeros(self.dim)
            self.outer = rows.new_zeros(self.dim, self.dim)
        self.count += rows.shape[0]
        self._spectra = {}
        self.total += rows.sum(0)
        self.outer += rows.T @ rows
        if token_ids is None or token_ids.numel() != rows.shape[0]:
            return
        ids = token_of(token_ids.reshape(-1).to(rows.device))
        weighted = torch.cat([rows, rows.new_ones(rows.shape[0], 1)], 1)  # the count as a last column
        if self.ids is not None and self.token_total is not None and self.token_count is not None:
            # merge: the earlier per-id sums are rows of their own, weighted by their counts
            ids = torch.cat([self.ids, ids])
            weighted = torch.cat([torch.cat([self.token_total, self.token_count[:, None]], 1), weighted])
        self.ids, sums, _ = segment_sums(ids, weighted)  # one sort for sums and counts
        self.token_total, self.token_count = sums[:, :-1].contiguous(), sums[:, -1].contiguous()
        self.with_ids += token_ids.numel()

    @property
    def by_token(self) -> bool:
        """Whether every row came with its token id (the within-token fit applies)."""
        return self.count > 0 and self.with_ids == self.count and self.ids is not None

    def clear(self) -> None:
        self.count, self.total, self.outer, self._spectra = 0, None, None, {}
        self.with_ids, self.ids, self.token_total, self.token_count = 0, None, None, None

    def token_means(self) -> tuple[Tensor, Tensor]:
        """``(ids [n], m_t [n, d])``: each seen token's mean shrunk towards the global mean."""
        assert self.by_token and self.total is not None
        assert self.ids is not None and self.token_total is not None and self.token_count is not None
        mean = self.total / self.count
        return self.ids, (self.token_total + self.token_prior * mean) / (self.token_count[:, None] + self.token_prior)

    def spectrum(self, within_tokens: bool | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """``(mean, eigenvalues ascending, eigenvectors)`` of the centred covariance
        ``sum x x^T / n - mean mean^T`` (float64), or of the within-token ``W`` (``within_tokens``;
        None: when :attr:`by_token`), computed once per set of moments and kind."""
        if self.count < 2 or self.total is None or self.outer is None:
            raise ValueError("a basis needs at least 2 tokens")
        within = self.by_token if within_tokens is None else within_tokens and self.by_token
        if within not in self._spectra:
            mean = self.total / self.count
            if within:
                assert self.token_total is not None and self.token_count is not None
                means = self.token_means()[1]
                cross = self.token_total.T @ means
                covariance = (self.outer - cross - cross.T + (means.T * self.token_count) @ means) / self.count
            else:
                covariance = self.outer / self.count - torch.outer(mean, mean)
            eigenvalues, eigenvectors = torch.linalg.eigh((covariance + covariance.T) / 2)
            self._spectra[within] = (mean, eigenvalues, eigenvectors)
        return self._spectra[within]

    @torch.no_grad()
    def principal_basis(self, rank: int) -> tuple[Tensor, Tensor, float]:
        """``(U [d, r], mu [d], energy kept)``: the mean and the top-``rank`` eigenvectors of the
        centred covariance ``sum x x^T / n - mu mu^T`` (float32 out), each direction's sign fixed
        (largest |entry| positive) so the basis is reproducible; energy kept = the top-r
        eigenvalues' share of the trace."""
        mean, eigenvalues, eigenvectors = self.spectrum()
        top = eigenvectors[:, -rank:].flip(-1)
        pivots = top.abs().argmax(0)
        top = top * torch.sign(top[pivots, torch.arange(rank, device=top.device)])
        total = eigenvalues.clamp_min(0).sum()
        kept = float(eigenvalues[-rank:].clamp_min(0).sum() / total) if total > 0 else 1.0
        return top.float(), mean.float(), kept

    @torch.no_grad()
    def refit_gain(self, basis: Tensor, mean: Tensor) -> float:
        """How much less of these tokens' energy a fresh rank-r fit would lose than ``(basis,
        mean)`` does, as a share of their energy about ``mean``:
        ``(lost(U, mu) - lost(fresh fit)) / sum ||x - mu||^2`` with ``lost(U, mu) = sum ||(x - mu)
        - (x - mu) U U^T||^2``; a fresh fit (its own mean, top-r eigenvectors of the plain
        covariance) loses the trailing eigenvalues. 0 when the current basis is as good as a refit
        (>= 0 up to rounding). With token ids the rows are already centred on the current token
        centres, and the fresh fit keeps them: fresh per-token means fitted in-sample would absorb
        the window's noise (a rare token's few rows) and ask for refits that do not pay, each of
        which moves the channel the layers around the cut have adapted to."""
        u = basis.to(self.outer)
        about_mu = self.second_moment_about(mean)
        energy = float(torch.trace(about_mu))
        if energy <= 0:
            return 0.0
        lost_now = energy - float(torch.trace(u.T @ about_mu @ u))
        eigenvalues = self.spectrum(within_tokens=False)[1].clamp_min(0)
        lost_fresh = float(eigenvalues[: max(0, self.dim - u.shape[1])].sum())
        return (lost_now - lost_fresh) / energy

    def second_moment_about(self, mean: Tensor) -> Tensor:
        """``sum (x - mu)(x - mu)^T / n`` (float64 [d, d]) of these rows about ``mean``."""
        assert self.total is not None and self.outer is not None and self.count > 0
        mu = mean.to(self.outer)
        centre = self.total / self.count
        return self.outer / self.count - torch.outer(centre, mu) - torch.outer(mu, centre) + torch.outer(mu, mu)

    @torch.no_grad()
    def coding_loss(self, basis: Tensor, mean: Tensor, variances: Tensor, budget_bits: float) -> tuple[float, float]:
        """``(decorrelation, mismatch)``: bits a token an entropy-coded basis ``(basis [d, r], mean,
        variances [r])`` would save on these rows by a fresh basis, and by a fresh model of its
        variances in the basis it keeps. High-rate estimate at the water
        level ``theta`` that ``budget_bits`` set on a fresh fit's eigenvalues ``e`` (both floored at
        ``theta``, below which a direction costs nothing): the stale basis's decorrelation loss
        ``1/2 sum log2(v_i / e_i)`` (``v`` the rows' variances in the current directions; >= 0,
        the diagonal of a covariance is majorised by its eigenvalues) plus the model's mismatch
        ``1/2 sum log2(lambda_i / v_i) + (v_i / lambda_i - 1) / ln 2`` (>= 0). The rows are centred
        on the current token centres, and the fresh fit keeps them (see :meth:`refit_gain`); a
        drift of the centres shows as variance the model does not expect."""
        about_mu = self.second_moment_about(mean)
        u = basis.to(about_mu)
        rank = u.shape[1]
        current = torch.diagonal(u.T @ about_mu @ u).clamp_min(0)
        fresh = torch.linalg.eigvalsh((about_mu + about_mu.T) / 2).flip(0)[:rank].clamp_min(0)
        theta = water_level(fresh, budget_bits)
        floor = lambda v: v.clamp_min(theta)  # noqa: E731
        decorrelation = 0.5 * float((floor(current).log2() - floor(fresh).log2()).sum())
        model, seen = floor(variances.to(about_mu)), floor(current)
        mismatch = 0.5 * float(((model / seen).log2() + (seen / model - 1) / math.log(2)).sum())
        return decorrelation, mismatch

    def state_dict(self) -> dict[str, Any]:
        if self.total is None:
            return {}
        state: dict[str, Any] = {"count": self.count, "total": self.total.cpu(), "outer": self.outer.cpu()}  # type: ignore[union-attr]
        if self.ids is not None:
            state.update(with_ids=self.with_ids, ids=self.ids.cpu(), token_total=self.token_total.cpu(),  # type: ignore[union-attr]
                         token_count=self.token_count.cpu())  # type: ignore[union-attr]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.clear()
        if state:
            count = saved_count(state, "count")
            total = saved_tensor(state, "total", (self.dim,))
            outer = saved_tensor(state, "outer", (self.dim, self.dim))
            if "ids" in state:
                ids = saved_tensor(state, "ids", (None,), floating=False)
                assert ids is not None
                self.with_ids, self.ids = saved_count(state, "with_ids"), ids
                self.token_total = saved_tensor(state, "token_total", (ids.numel(), self.dim))
                self.token_count = saved_tensor(state, "token_count", (ids.numel(),))
            self.count, self.total, self.outer = count, total, outer


def water_level(variances: Tensor, bits: float) -> float:
    """Reverse water-filling: the level ``theta`` at which Gaussian components of ``variances``
    cost ``bits`` in all, ``sum max(0, 1/2 log2(lambda_i / theta)) = bits`` (bisection in log2)."""
    positive = variances[variances > 0].double()
    if positive.numel() == 0:
        return 1.0
    low, high = float(positive.min().log2()) - 2 * bits - 1, float(positive.max().log2())
    for _ in range(60):
        middle = (low + high) / 2
        cost = 0.5 * float((positive.log2() - middle).clamp_min(0).sum())
        low, high = (middle, high) if cost > bits else (low, middle)
    return 2.0**high


class SVDCodec(Codec):
    """Static rank-r projection: ``r * element_size`` bytes per token, plus the basis once.

    Calibrate with :meth:`calibrate` (centred PCA of calibration activations, via the d x d
    covariance in float64); an uncalibrated codec calibrates on the first tensor it encodes.
    ``setup_bytes`` is the one-off cost of shipping ``U`` and ``mu`` to the receiver.
    """

    name = "svd"

    def __init__(self, dim: int, rank: int) -> None:
        super().__init__(dim)
        if not 1 <= rank <= dim:
            raise ValueError(f"rank must be in [1, d={dim}], got {rank}")
        self.rank = rank
        self.basis: Tensor | None = None  # [d, r] float32, orthonormal columns
        self.mean: Tensor | None = None  # [d] float32
        self.energy_kept: float | None = None  # share of centred variance the basis keeps

    @property
    def calibrated(self) -> bool:
        return self.basis is not None

    @property
    def needs_calibration(self) -> bool:
        return not self.calibrated

    @torch.no_grad()
    def calibrate(self, activations: Tensor, token_ids: Tensor | None = None, *, step: int = 0) -> None:
        """Fit ``mu`` and the top-r principal directions of ``activations`` ([..., d] tokens)."""
        stats = TokenMoments(self.dim)
        stats.add(activations)
        if stats.count < 2:
            raise ValueError("svd calibration needs at least 2 tokens")
        self.basis, self.mean, self.energy_kept = stats.principal_basis(self.rank)

    @property
    def width(self) -> int:
        return self.rank

    def setup_bytes(self, dtype: torch.dtype) -> int:
        """One-off bytes to ship the basis and mean: ``(d * r + d) * element_size``."""
        return (self.dim * self.rank + self.dim) * dtype.itemsize

    def encode(self, x: Tensor, key: CodecKey, *, token_ids: Tensor | None = None,
               token_mask: Tensor | None = None) -> Tensor:
        if not self.calibrated:
            self.calibrate(x)
        assert self.basis is not None and self.mean is not None
        basis, mean = self.basis.to(x.device, x.dtype), self.mean.to(x.device, x.dtype)
        return (x - mean) @ basis

    def decode(self, payload: Tensor, key: CodecKey, *, token_mask: Tensor | None = None,  # type: ignore[override]
               token_ids: Tensor | None = None) -> Tensor:
        if not self.calibrated:
            raise RuntimeError("svd codec: decode before calibration")
        assert self.basis is not None and self.mean is not None
        basis, mean = self.basis.to(payload.device, payload.dtype), self.mean.to(payload.device, payload.dtype)
        return mean + payload @ basis.T

    def payload_bytes(self, tokens: int, dtype: torch.dtype) -> int:
        return tokens * self.rank * dtype.itemsize

    def state_dict(self) -> dict[str, Any]:
        if self.basis is None:
            return {}
        return {"basis": self.basis.cpu(), "mean": self.mean.cpu(), "energy_kept": self.energy_kept}  # type: ignore[union-attr]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self.basis = saved_tensor(state, "basis", (self.dim, self.rank))
            self.mean = saved_tensor(state, "mean", (self.dim,))
            self.energy_kept = state.get("energy_kept")

    def __repr__(self) -> str:
        return f"SVDCodec(dim={self.dim}, rank={self.rank})"


# ------------------------------------------------------------------ quantised coefficients
QUANT_BITS = (2, 3, 4, 8)
"""Bits per coefficient a basis codec may send (``pipeline.bits``); None sends float coefficients."""

FIRST_FITS = ("dense", "ship")
"""How :class:`AdaptiveLowRankCodec` makes its first fit (``pipeline.first_fit``)."""

SCALE_BYTES = 2
"""The per-token scale of a quantised message: 16 bits (float16 forward, bfloat16 backward)."""

GRADIENT_STREAM = 1
"""``CodecKey.stream`` that keys the backward message's stochastic rounding."""

STEP_SEARCH_STREAM = 2
"""``CodecKey.stream`` of the draws an entropy-coded gradient message searches its step on."""

_FLOAT16_MAX = 65504.0
_ROW_SALT = 0x2545F491


def levels(bits: int) -> int:
    """Largest quantised magnitude at ``bits`` bits (symmetric, sign included): ``2^(bits-1) - 1``."""
    return 2 ** (bits - 1) - 1


LEAD_BYTES = 2
"""The leading coefficient of a ``lead`` message: 16 bits (float16 forward, bfloat16 backward)."""


def quantised_rank(budget_bytes: int, bits: int, dim: int, lead: bool = False) -> int:
    """Coefficients per token that ``budget_bytes`` buy at ``bits`` bits beside a 16-bit scale:
    ``floor((budget_bytes * 8 - 16) / bits)``, capped at ``dim``; with ``lead`` (the first
    coefficient in 16 bits) ``1 + floor((budget_bytes * 8 - 32) / bits)``. Raises ``ValueError``
    when the budget cannot buy one quantised coefficient."""
    if bits not in QUANT_BITS:
        raise ValueError(f"bits must be one of {', '.join(map(str, QUANT_BITS))}, got {bits}")
    quantised = (budget_bytes * 8 - 8 * SCALE_BYTES - (8 * LEAD_BYTES if lead else 0)) // bits
    if quantised < 1:
        raise ValueError(f"a budget of {budget_bytes} bytes per token buys no {bits}-bit coefficient "
                         f"beside its {SCALE_BYTES}-byte scale" + (" and the 16-bit lead" if lead else ""))
    return min(dim, quantised + int(lead))


def quantised_bytes(rank: int, bits: int, lead: bool = False) -> int:
    """Bytes per token of ``rank`` coefficients packed at ``bits`` bits, plus the scale:
    ``ceil(rank * bits / 8) + 2``; with ``lead``, ``ceil((rank - 1) * bits / 8) + 2 + 2``."""
    if lead:
        return math.ceil((rank - 1) * bits / 8) + SCALE_BYTES + LEAD_BYTES
    return math.ceil(rank * bits / 8) + SCALE_BYTES


def quantise_coefficients(c: Tensor, bits: int, lead: bool = False) -> Tensor:
    """Round-to-nearest quantisation of coefficients ``c`` ``[..., r]``, one scale per token:
    ``s = fp16(max |c| / L)`` (``L`` = :func:`levels`; the scale rounded to float16 as it would cross),
    ``q = clamp(round(c / s), -L, L)``, returns ``q s`` (0 for a token whose scale is 0), in ``c``'s
    dtype. Computed in float32, where ``q s`` is exact. ``lead``: the first coefficient is rounded
    to float16 instead (clamped to its range) and the rest quantised with their own scale."""
    if lead:
        first = c[..., :1].float().clamp(-_FLOAT16_MAX, _FLOAT16_MAX).half().to(c.dtype)
        return torch.cat([first, quantise_coefficients(c[..., 1:], bits)], -1)
    top = levels(bits)
    values = c.float()
    scale = (values.abs().amax(-1, keepdim=True) / top).clamp(max=_FLOAT16_MAX).half().float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(values / safe).clamp_(-top, top)
    return (q * scale).to(c.dtype)


def ceil_bfloat16(x: Tensor) -> Tensor:
    """The smallest bfloat16 value >= ``x`` (float32, finite, >= 0), as float32: the upper 16 bits
    of float32, rounded up."""
    bits = x.float().contiguous().view(torch.int32)
    return ((bits + 0xFFFF) & -0x10000).view(torch.float32)


def stochastic_quantise(g: Tensor, bits: int, uniforms: Tensor, lead: bool = False) -> Tensor:
    """Unbiased quantisation of ``g`` ``[..., r]``, one scale per token: ``s`` = ``max |g| / L``
    rounded *up* to bfloat16 (the gradient needs float32's exponent range; rounding up keeps
    ``|g / s| <= L``), ``q = floor(g / s + u)`` with ``u`` = ``uniforms`` in [0, 1) (``g``'s shape),
    returns ``q s`` in ``g``'s dtype. ``E[q s] = g`` for uniform ``u``. ``lead``: the first
    coefficient is rounded to the nearest bfloat16 instead (``uniforms[..., 0]`` unused)."""
    if lead:
        first = g[..., :1].float().bfloat16().to(g.dtype)
        return torch.cat([first, stochastic_quantise(g[..., 1:], bits, uniforms[..., 1:])], -1)
    top = levels(bits)
    values = g.float()
    scale = ceil_bfloat16(values.abs().amax(-1, keepdim=True) / top)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.floor(values / safe + uniforms.to(values.device, torch.float32)).clamp_(-top, top)
    return (q * scale).to(g.dtype)


def gradient_uniforms(key: CodecKey, shape: torch.Size, device: torch.device | str = "cpu",
                      stream: int = GRADIENT_STREAM) -> Tensor:
    """Uniforms in [0, 1) for the backward message of a payload of ``shape`` (``[B, L, r]``, or
    ``[T, r]`` = one row): row ``b`` draws ``[L, r]`` from a CPU ``torch.Generator`` seeded by the
    key (at ``stream``, :data:`GRADIENT_STREAM` unless told) and its global row ``key.row_offset + b``, so the same token of
    the same step gets the same draw in one process and in a micro-batch on another rank, and the
    global RNG is never touched."""
    if len(shape) not in (2, 3):
        raise ValueError(f"a payload must be [B, L, r] or [T, r], got shape {tuple(shape)}")
    rows, length, width = (1, *shape) if len(shape) == 2 else tuple(shape)
    base = key_hash(dataclasses.replace(key, stream=stream))
    generator = torch.Generator()
    out = torch.empty(rows, length, width)
    for b in range(rows):
        # 32 bits: the CPU generator (mt19937) reads only the low 32 bits of a seed
        generator.manual_seed(mix32(base ^ mix32(fold32(key.row_offset + b) ^ _ROW_SALT)))
        out[b] = torch.rand(length, width, generator=generator)
    return out.view(shape).to(device)


def pack_quantised(q: Tensor, scale: Tensor, bits: int, lead: Tensor | None = None) -> Tensor:
    """The packed message of ``T`` tokens: ``uint8 [T, quantised_bytes(r, bits, lead)]``, each
    row the token's 16-bit ``scale`` (``[T, 1]``, float16 forward, bfloat16 backward), its 16-bit
    ``lead`` coefficient if given (``[T, 1]``), then its ``r`` levels ``q`` (``[T, r]`` integers in
    ``[-L, L]``) as ``q + L`` in ``bits`` bits each, least significant bit first. What
    :meth:`AdaptiveLowRankCodec.payload_bytes` counts; the pipeline itself sends ``q s`` as floats."""
    rows, rank = q.shape
    unsigned = q.long().cpu() + levels(bits)
    flat = ((unsigned[..., None] >> torch.arange(bits)) & 1).reshape(rows, rank * bits)
    flat = torch.nn.functional.pad(flat, (0, -(rank * bits) % 8)).reshape(rows, -1, 8)
    body = (flat << torch.arange(8)).sum(-1).to(torch.uint8)
    head = [scale.reshape(rows, 1).cpu().contiguous().view(torch.uint8)]
    if lead is not None:
        head.append(lead.reshape(rows, 1).to(scale.dtype).cpu().contiguous().view(torch.uint8))
    return torch.cat([*head, body], 1)


def unpack_quantised(packed: Tensor, rank: int, bits: int, dtype: torch.dtype,
                     lead: bool = False) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(q [T, n] int64, scale [T, 1], lead [T, 1] or None)`` back from :func:`pack_quantised`
    (``rank``: the codec's ``r``, the lead included, so ``n = r - 1`` with ``lead``; ``dtype``: the
    16-bit dtype the scale and lead were packed in)."""
    rows, rank = packed.shape[0], rank - int(lead)
    head = 4 if lead else 2
    scale = packed[:, :2].contiguous().view(dtype)
    first = packed[:, 2:4].contiguous().view(dtype) if lead else None
    flat = ((packed[:, head:].long()[..., None] >> torch.arange(8)) & 1).reshape(rows, -1)
    levels_bits = flat[:, : rank * bits].reshape(rows, rank, bits)
    q = (levels_bits << torch.arange(bits)).sum(-1) - levels(bits)
    return q, scale, first


class QuantiseForward(torch.autograd.Function):
    """Sender side: coefficients -> :func:`quantise_coefficients`; the gradient passes straight
    through (it was quantised where it left the receiver, :class:`QuantiseGradient`)."""

    @staticmethod
    def forward(ctx: Any, c: Tensor, bits: int, lead: bool) -> Tensor:  # type: ignore[override]
        return quantise_coefficients(c, bits, lead)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        return grad, None, None


class QuantiseGradient(torch.autograd.Function):
    """Receiver side: the identity going forward (the payload is already quantised); going back,
    the gradient w.r.t. the coefficients -- the backward message -- is :func:`stochastic_quantise`d
    with the key's :func:`gradient_uniforms`."""

    @staticmethod
    def forward(ctx: Any, payload: Tensor, bits: int, lead: bool, key: CodecKey) -> Tensor:  # type: ignore[override]
        ctx.bits, ctx.lead, ctx.key = bits, lead, key
        return payload.view_as(payload)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        uniforms = gradient_uniforms(ctx.key, grad.shape, grad.device)
        return stochastic_quantise(grad, ctx.bits, uniforms, ctx.lead), None, None, None


def _real_rows(x: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """``x`` as ``[B, L, r]`` and its real-token mask ``[B, L]`` (None: every position)."""
    rows = x if x.dim() == 3 else x.reshape(1, -1, x.shape[-1])
    if mask is None:
        return rows, torch.ones(rows.shape[:2], dtype=torch.bool, device=x.device)
    return rows, mask.reshape(rows.shape[:2]).to(x.device).bool()


def _scatter_rows(like: Tensor, mask: Tensor, values: list[Tensor]) -> Tensor:
    """``[B, L, r]`` zeros of ``like``'s dtype with each row's real positions set to ``values[b]``."""
    out = torch.zeros_like(like)
    for b, row in enumerate(values):
        out[b][mask[b]] = row.to(out.dtype).to(out.device)
    return out


class EntropyForward(torch.autograd.Function):
    """Sender side of an entropy-coded message: coefficients -> ``q delta`` per row
    (:func:`~tclightning.codecs.entropy.quantise_forward`; padding positions 0); the gradient
    passes straight through (it was quantised where it left the receiver, :class:`EntropyGradient`)."""

    @staticmethod
    def forward(ctx: Any, c: Tensor, mask: Tensor | None, spread: Tensor, budget: int) -> Tensor:  # type: ignore[override]
        rows, real = _real_rows(c, mask)
        levels, steps = quantise_forward([rows[b][real[b]] for b in range(rows.shape[0])], spread, budget)
        return _scatter_rows(rows, real, [q.double() * step for q, step in zip(levels, steps)]).view_as(c)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        return grad, None, None, None


class EntropyGradient(torch.autograd.Function):
    """Receiver side of an entropy-coded message: the identity going forward; going back, the
    gradient w.r.t. the coefficients is stochastically rounded per row at the budget
    (:func:`~tclightning.codecs.entropy.quantise_gradient`, draws :func:`gradient_uniforms`)."""

    @staticmethod
    def forward(ctx: Any, payload: Tensor, mask: Tensor | None, budget: int, key: CodecKey) -> Tensor:  # type: ignore[override]
        ctx.mask, ctx.budget, ctx.key = mask, budget, key
        return payload.view_as(payload)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        rows, real = _real_rows(grad, ctx.mask)
        real_cpu = real.cpu()
        uniforms = gradient_uniforms(ctx.key, rows.shape)
        search = gradient_uniforms(ctx.key, rows.shape, stream=STEP_SEARCH_STREAM)
        picked = [rows[b][real[b]] for b in range(rows.shape[0])]
        levels, steps, _ = quantise_gradient(picked, [uniforms[b][real_cpu[b]] for b in range(rows.shape[0])],
                                             [search[b][real_cpu[b]] for b in range(rows.shape[0])], ctx.budget)
        out = _scatter_rows(rows, real, [q.double() * step for q, step in zip(levels, steps)])
        return out.view_as(grad), None, None, None


FIT_TOKENS_PER_CHANNEL = 8
"""An entropy-coded basis's first fit waits for ``8 d`` dense tokens (4,608 on SmolLM2's d = 576)."""

COEFFICIENTS_PER_BYTE = 8
"""An entropy-coded basis keeps ``min(d, 8 x budget bytes)`` directions: past one per bit of the
budget a direction's variance sits far below the water level and its levels are all zero."""


def entropy_rank(dim: int, budget_bytes: int) -> int:
    """Directions an entropy-coded basis of ``budget_bytes`` bytes a token keeps (:data:`COEFFICIENTS_PER_BYTE`)."""
    return max(1, min(dim, COEFFICIENTS_PER_BYTE * budget_bytes))


FLAG_BYTES = 4
"""A refresh check without shared traffic: the sender's flag, the refit message's length (one int32; 0 = kept)."""


class AdaptiveLowRankCodec(Codec):
    """Rank-r projection whose basis follows the activations: ``payload = (x - mu) U`` ([B, L, r]),
    ``x_hat = mu + payload U^T``; linear, so the backward message is ``g U`` (r values per token).

    Both sides hold the same ``U``, ``mu`` at every step. How they stay equal:

    * **the first fit** (``first_fit``): ``dense`` -- until the first fit the cut sends the dense
      boundary (``width = d``; those bytes are counted like any others), and both sides fold what
      crossed into ``shared`` (:meth:`observe_dense`); at the first step change both fit the basis
      from it -- the same tokens in the same order give the same basis, with nothing extra sent.
      ``ship`` -- the sender fits on the first batch it encodes (:meth:`calibrate`) and ships the
      fit before the first payload (:meth:`setup_bytes`, :meth:`fit_message`), so no step crosses
      dense: one basis instead of a dense step, which pays on a wide model with few steps;
    * **refresh check** every ``refresh_every`` steps (0: keep the first fit), on the tokens seen
      since the last check. The basis is refitted only when it has drifted: when a fresh fit
      would lose at least ``refresh_tolerance`` less of those tokens' energy
      (:meth:`TokenMoments.refit_gain`). A basis that still fits is kept, because every refit
      moves the channel the layers on both sides of the cut have adapted to (measured: refitting
      every 10 steps regardless cut the embedded task's 200-step gain from 93% to 23% of dense).
      :meth:`plan_refresh` says, from state both sides share, which tokens decide:

      - ``fit``: dense tokens both sides saw (the anchor's dense pass hands them to
        :meth:`observe_dense` at each cut) -> both decide and refit alike, zero extra bytes;
      - ``ship``: no shared dense traffic (no anchor) -> the sender decides on the tokens it
        encoded (:meth:`observe_sent`) and sends a 4-byte flag, then, if it refitted, ``U`` and
        ``mu``: ``(d r + d) * 4`` bytes, all counted on the wire (:meth:`basis_message`).

    **Token centres** (``token_slots > 0``): every stage of a GRPO trainer holds the batch's token
    ids, so both sides can centre each token on its own id's mean instead of one ``mu``:
    ``payload = (x - mu - tau_t) U``, ``x_hat = mu + tau_t + payload U^T`` with ``tau_t`` the
    token's offset (0 for ids without one), and ``U`` fitted to the within-token covariance
    (:class:`TokenMoments`). Zero extra bytes per token; the table (up to ``token_slots`` ids, the
    most frequent first) is fitted with the basis from the same tokens, so both sides build it
    alike, and a shipped refit carries it (``n (d + 1) * 4`` more bytes, counted). Statistics are
    gathered on ``x - tau_t``, so a refit moves each seen token's offset by its shrunk mean shift
    (``token_prior``, :data:`TOKEN_PRIOR`).

    ``step_metrics()``: ``energy_kept`` = ``sum ||(x - c) U||^2 / sum ||x - c||^2`` over the
    step's sent tokens, ``c`` each token's centre (the share of the batch's energy about its
    centres the basis keeps, so drift is visible), and ``basis_bytes`` shipped this step.

    **Quantised coefficients** (``bits`` in :data:`QUANT_BITS`; None = float coefficients): once
    fitted, the payload is ``c_hat = q s`` (:func:`quantise_coefficients`: round to nearest, a
    float16 scale per token) and the backward message, the gradient w.r.t. the coefficients, is
    quantised where the receiver sends it (:func:`stochastic_quantise`: unbiased stochastic
    rounding at the same bits, a bfloat16 scale per token, draws keyed by the :class:`CodecKey`).
    ``lead``: the first coefficient (the basis's leading direction) crosses in 16 bits beside the
    rest, which get their own scale. ``payload_bytes`` counts both messages packed,
    ``ceil(r bits / 8) + 2`` bytes per token (``ceil((r - 1) bits / 8) + 4`` with ``lead``;
    :func:`quantised_bytes`), while the tensors that cross in memory or between processes stay
    floats holding exactly those values (the payload is not cast to :attr:`wire_dtype` then).
    The cold start still crosses dense in :attr:`wire_dtype`.

    **Entropy-coded coefficients** (``entropy_budget``, bytes a token; ``bits`` None): the payload
    is ``q delta`` with one step per row (sequence), the smallest whose ANS-coded levels fit the
    row's budget under a Laplace model of the fit's eigenvalues ``variances``
    (:mod:`~tclightning.codecs.entropy`); the gradient message likewise, stochastically rounded.
    Exactly ``entropy_budget`` bytes a token are counted each way. The first dense fit waits for
    :attr:`first_fit_tokens`; a check refits the whole fit, or only the centres and variances
    (a model-only message without ``U``), when that saves ``refresh_tolerance`` of the budget's bits.
    """

    name = "lowrank"
    learns_from_traffic = True

    def __init__(self, dim: int, rank: int, *, refresh_every: int = 10, refresh_tolerance: float = 0.02,
                 token_slots: int = 0, token_prior: float = TOKEN_PRIOR, bits: int | None = None,
                 lead: bool = False, first_fit: str = "dense", entropy_budget: int | None = None) -> None:
        super().__init__(dim)
        if first_fit not in FIRST_FITS:
            raise ValueError(f"first_fit must be one of {', '.join(FIRST_FITS)}, got {first_fit!r}")
        self.first_fit = first_fit
        if not 1 <= rank <= dim:
            raise ValueError(f"rank must be in [1, d={dim}], got {rank}")
        if bits is not None and bits not in QUANT_BITS:
            raise ValueError(f"bits must be one of {', '.join(map(str, QUANT_BITS))} or None, got {bits}")
        if lead and (bits is None or rank < 2):
            raise ValueError("lead needs bits and a rank of at least 2 (the lead and one quantised coefficient)")
        self.bits, self.lead = bits, lead
        if entropy_budget is not None and (bits is not None or entropy_budget < 1):
            raise ValueError(f"entropy_budget needs bits=None and at least 1 byte a token, got {entropy_budget} "
                             f"(bits={bits})")
        self.entropy_budget = entropy_budget
        self.variances: Tensor | None = None  # [r] float32: the fit's eigenvalues, the coder's model
        self._wire_dtype: torch.dtype | None = None
        if refresh_every < 0:
            raise ValueError(f"refresh_every must be >= 0, got {refresh_every}")
        if not 0.0 <= refresh_tolerance <= 1.0:
            raise ValueError(f"refresh_tolerance must be in [0, 1], got {refresh_tolerance}")
        if token_slots < 0:
            raise ValueError(f"token_slots must be >= 0, got {token_slots}")
        self.rank = rank
        self.token_slots = token_slots
        self.token_ids: Tensor | None = None  # [n] long, ascending: the ids with an offset
        self.token_offsets: Tensor | None = None  # [n, d] float32: tau_t
        self._table_cache: dict[tuple[str, torch.device, torch.dtype], Tensor] = {}
        self.refresh_every = refresh_every
        self.refresh_tolerance = refresh_tolerance
        self.checked_step = -1  # the last refresh check (identical on both sides)
        self.basis: Tensor | None = None  # [d, r] float32, orthonormal columns
        self.mean: Tensor | None = None  # [d] float32
        self.version = 0  # fits so far (identical on both sides)
        self.shared = TokenMoments(dim, token_prior)  # dense tokens both sides saw since the last fit
        self.window = TokenMoments(dim, token_prior)  # sender only: tokens it encoded since the last fit
        self._kept = 0.0
        self._energy = 0.0
        self._shipped = 0

    # -- the message ---------------------------------------------------------------------------

    @property
    def calibrated(self) -> bool:
        return self.basis is not None

    @property
    def crosses_dense(self) -> bool:
        return self.basis is None and self.first_fit == "dense"

    @property
    def width(self) -> int:
        return self.dim if self.crosses_dense else self.rank

    @property
    def needs_calibration(self) -> bool:
        return self.basis is None and self.first_fit == "ship"

    @torch.no_grad()
    def calibrate(self, activations: Tensor, token_ids: Tensor | None = None, *, step: int = 0) -> None:
        """``first_fit="ship"``, sender: fit basis, mean and token centres on the real tokens
        ``[T, d]`` (with their ``[T]`` ids) of the first batch it encodes, at step ``step`` (the
        refresh clock starts there). The receiver installs the same fit from :meth:`fit_message`."""
        moments = TokenMoments(self.dim, self.shared.token_prior)
        moments.add(*self._statistics_rows(activations.float(), token_ids))
        if moments.count < 2:
            raise ValueError("lowrank first fit needs at least 2 tokens")
        self._refit(moments)
        self._checked(step)

    def setup_bytes(self, dtype: torch.dtype) -> int:
        """The first fit as it ships: its length word and :meth:`ship_bytes` (float32 whatever
        ``dtype``), what :meth:`refresh_bytes` counts for a refit; in :meth:`step_metrics` too."""
        shipped = FLAG_BYTES + self.ship_bytes()
        self._shipped += shipped
        return shipped

    @property
    def first_fit_tokens(self) -> int:
        """Dense tokens the first fit waits for: :data:`FIT_TOKENS_PER_CHANNEL` ``x d`` for an
        entropy-coded basis (it codes every direction the fit finds, so each must be well
        estimated), else 2. Until then the cut keeps crossing dense."""
        return FIT_TOKENS_PER_CHANNEL * self.dim if self.entropy_budget is not None else 2

    @property
    def quantised(self) -> bool:
        """Whether messages now carry quantised coefficients (``bits`` or an entropy budget set, and
        the basis fitted)."""
        return (self.bits is not None or self.entropy_budget is not None) and self.basis is not None

    @property  # type: ignore[override]
    def wire_dtype(self) -> torch.dtype | None:
        """The dtype set (``pipeline.payload_dtype``), except while :attr:`quantised`: the payload
        then holds ``q s`` exactly in the activations' dtype, and its bytes are counted packed."""
        return None if self.quantised else self._wire_dtype

    @wire_dtype.setter
    def wire_dtype(self, dtype: torch.dtype | None) -> None:
        self._wire_dtype = dtype

    def offsets(self, token_ids: Tensor | None, like: Tensor) -> Tensor | None:
        """``tau_t`` for each token of ``like`` (``[..., d]``, ids ``[...]``): zero rows for ids
        without an offset; None without a table or ids (every token then centres on ``mu``)."""
        slots = self._slots(token_ids, like.shape[:-1], like.device)
        if slots is None:
            return None
        return self._table("offsets", like.device, like.dtype).index_select(0, slots).view(like.shape)

    def _slots(self, token_ids: Tensor | None, shape: torch.Size, device: torch.device) -> Tensor | None:
        """Each token's row in :meth:`_table` (flat ``[N]``): its id's row, or ``n`` (the global
        mean) for ids without one; None without a table or ids. ``shape``: the tokens' shape."""
        if self.token_ids is None or token_ids is None or not self.token_ids.numel():
            return None
        if token_ids.shape != shape:
            raise ValueError(f"token ids of shape {tuple(token_ids.shape)} for tokens of shape {tuple(shape)}")
        return sorted_rows(self.token_ids, token_of(token_ids.to(device)).reshape(-1), missing=self.token_ids.numel())

    def _table(self, kind: str, device: torch.device, dtype: torch.dtype) -> Tensor:
        """``[n + 1, d]`` rows looked up by :meth:`_slots`, cached until the next fit: ``centres``
        (``mu + tau_t`` for each id of the table, then ``mu``) or ``offsets`` (``tau_t``, then 0)."""
        assert self.mean is not None and self.token_offsets is not None
        key = (kind, device, dtype)
        if key not in self._table_cache:
            if kind == "centres":
                table = torch.cat([self.mean + self.token_offsets, self.mean[None]])
            else:
                table = torch.cat([self.token_offsets, self.token_offsets.new_zeros(1, self.dim)])
            self._table_cache = {k: v for k, v in self._table_cache.items() if k[0] != kind}  # one device per kind
            self._table_cache[key] = table.to(device, dtype)
        return self._table_cache[key]

    def centred(self, x: Tensor, token_ids: Tensor | None) -> Tensor:
        """``x - c`` for tokens ``x`` ``[..., d]``, ``c`` each token's centre (differentiable in ``x``)."""
        assert self.mean is not None
        slots = self._slots(token_ids, x.shape[:-1], x.device)
        if slots is None:
            return x - self.mean.to(x.device, x.dtype)
        # one fresh gather, negated and added to in place: no [N, d] temporaries besides it
        base = self._table("centres", x.device, x.dtype).index_select(0, slots)
        return base.neg_().add_(x.reshape(-1, self.dim)).view(x.shape)

    def encode(self, x: Tensor, key: CodecKey, *, token_ids: Tensor | None = None,
               token_mask: Tensor | None = None) -> Tensor:
        if x.shape[-1] != self.dim:
            raise ValueError(f"tensor has {x.shape[-1]} channels, codec expects d={self.dim}")
        if self.basis is None or self.mean is None:
            return x
        coefficients = self.centred(x, token_ids) @ self.basis.to(x.device, x.dtype)
        if self.entropy_budget is not None:
            return EntropyForward.apply(coefficients, token_mask, self.spread(), self.entropy_budget)
        if self.bits is None:
            return coefficients
        return QuantiseForward.apply(coefficients, self.bits, self.lead)

    def spread(self) -> Tensor:
        """The entropy coder's Laplace scale per coefficient, ``sqrt(lambda_i / 2)`` (float64, [r])."""
        assert self.variances is not None
        return (self.variances.double().clamp_min(0) / 2).sqrt()

    def decode(self, payload: Tensor, key: CodecKey, *, token_mask: Tensor | None = None,  # type: ignore[override]
               token_ids: Tensor | None = None) -> Tensor:
        if self.basis is None or self.mean is None:
            return payload
        basis = self.basis.to(payload.device, payload.dtype)
        coefficients = payload[..., : self.rank]
        if self.entropy_budget is not None:
            coefficients = EntropyGradient.apply(coefficients, token_mask, self.entropy_budget, key)
        elif self.bits is not None:
            coefficients = QuantiseGradient.apply(coefficients, self.bits, self.lead, key)
        slots = self._slots(token_ids, payload.shape[:-1], payload.device)
        if slots is None:
            return self.mean.to(payload.device, payload.dtype) + coefficients @ basis.T
        # the centres gathered fresh, then ``coefficients U^T`` added in place
        base = self._table("centres", payload.device, payload.dtype).index_select(0, slots)
        return base.addmm_(coefficients.reshape(-1, self.rank), basis.T).view(*payload.shape[:-1], self.dim)

    def payload_bytes(self, tokens: int, dtype: torch.dtype) -> int:
        """``tokens * r * element_size``; quantised, ``tokens * (ceil(r bits / 8) + 2)`` whatever
        ``dtype``; dense (``d`` values) before the first fit."""
        if self.quantised:
            if self.entropy_budget is not None:
                return tokens * self.entropy_budget
            assert self.bits is not None
            return tokens * quantised_bytes(self.rank, self.bits, self.lead)
        return tokens * self.width * dtype.itemsize

    # -- what each side learns from -------------------------------------------------------------

    def _statistics_rows(self, tokens: Tensor, token_ids: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """What the moments gather: ``[T, d]`` rows less their token offsets, with their ids (None
        when the codec keeps no token centres, so those moments are the plain ones)."""
        rows = tokens.detach().reshape(-1, self.dim)
        if not self.token_slots or token_ids is None:
            return rows, None
        ids = token_ids.reshape(-1)
        offsets = self.offsets(ids, rows)
        return (rows if offsets is None else rows - offsets), ids

    def observe_dense(self, tokens: Tensor, token_ids: Tensor | None = None) -> None:
        self.shared.add(*self._statistics_rows(tokens, token_ids))

    @torch.no_grad()
    def observe_sent(self, tokens: Tensor, token_ids: Tensor | None = None) -> None:
        if self.basis is None or self.mean is None:
            return
        rows, ids = self._statistics_rows(tokens.float(), token_ids)
        self.window.add(rows, ids)
        centred = rows - self.mean.to(rows.device)
        self._kept += float((centred @ self.basis.to(rows.device)).pow(2).sum())
        self._energy += float(centred.pow(2).sum())

    # -- refresh protocol ------------------------------------------------------------------------

    def plan_refresh(self, step: int) -> str | None:
        """What both sides do as step ``step`` begins: ``fit`` (decide on shared dense tokens),
        ``ship`` (the sender decides and tells the receiver) or None. Reads only shared state."""
        if self.basis is None:  # a shipped first fit comes with the first payload, not here
            return "fit" if self.shared.count >= self.first_fit_tokens and self.first_fit == "dense" else None
        if self.refresh_every == 0 or step - self.checked_step < self.refresh_every:
            return None
        return "fit" if self.shared.count >= 2 else "ship"

    def _drift(self, moments: TokenMoments) -> str | None:
        """What a check on ``moments`` refits: ``basis`` (everything), ``model`` (an entropy-coded
        codec's centres and variances in the basis it keeps: what drifts first, and a fraction of
        the bytes to ship) or None. Against ``refresh_tolerance``: the energy a fresh basis would
        keep (:meth:`TokenMoments.refit_gain`), or, entropy-coded, the share of the budget's bits a
        fresh fit would save (:meth:`TokenMoments.coding_loss`: a fresh basis first, else the model)."""
        assert self.basis is not None and self.mean is not None
        if moments.count < 2:
            return None
        if self.refresh_tolerance == 0:
            return "basis"
        if self.entropy_budget is None or self.variances is None:
            return "basis" if moments.refit_gain(self.basis, self.mean) > self.refresh_tolerance else None
        budget = 8.0 * self.entropy_budget
        decorrelation, mismatch = moments.coding_loss(self.basis, self.mean, self.variances, budget)
        if decorrelation > self.refresh_tolerance * budget:
            return "basis"
        return "model" if decorrelation + mismatch > self.refresh_tolerance * budget else None

    def fit_shared(self, step: int) -> bool:
        """Both sides: the first fit, or a check on the dense tokens both saw; refit if drifted.
        Returns whether the codec changed (the same answer on both sides)."""
        drift = "basis" if self.basis is None else self._drift(self.shared)
        if drift is not None:
            self._refit(self.shared, keep_basis=drift == "model")
        self._checked(step)
        return drift is not None

    def basis_message(self, step: int) -> Tensor | None:
        """Sender: check the tokens it encoded since the last check; if the codec drifted, refit,
        install and return :meth:`fit_message` to ship, else None (keep)."""
        message = None
        drift = self._drift(self.window)
        if drift is not None:
            self._refit(self.window, keep_basis=drift == "model")
            message = self.fit_message(with_basis=drift == "basis")
        self._shipped += self.refresh_bytes(message)
        self._checked(step)
        return message

    def fit_message(self, with_basis: bool = True) -> Tensor:
        """``cat(U.flatten(), mu, ids, tau.flatten())`` (float32; ids are exact below 2^24). An
        entropy-coded codec's message starts with 1 (a whole fit) or 0 (a model-only refit, ``U``
        left out) and holds the variances ``lambda``, the coder's model, after ``mu``."""
        assert self.basis is not None and self.mean is not None
        parts = [self.basis.reshape(-1)] if with_basis else []
        if self.entropy_budget is not None:  # which of the two it is, first
            parts.insert(0, torch.tensor([float(with_basis)]))
        parts.append(self.mean)
        if self.entropy_budget is not None:
            assert self.variances is not None
            parts.append(self.variances)
        if self.token_ids is not None and self.token_offsets is not None:
            if self.token_ids.numel() and int(self.token_ids.max()) >= ID_LIMIT:
                raise ValueError(f"token id {int(self.token_ids.max())} cannot ship as float32 (ids must be < 2^24)")
            parts += [self.token_ids.float(), self.token_offsets.reshape(-1)]
        return torch.cat(parts).float()

    def load_basis_message(self, message: Tensor | None, step: int) -> None:
        """Receiver: install what :meth:`basis_message` sent (None: the sender kept its basis)."""
        if message is not None:
            flat = message.detach().float().cpu()
            size = self.dim * self.rank
            model_values = self._fit_values() - size
            basis_values = size
            if self.entropy_budget is not None:
                kind, flat = (float(flat[0]) if flat.numel() else -1.0), flat[1:]
                if kind not in (0.0, 1.0):
                    raise ValueError(f"basis message starts with {kind}, expected 1 (a whole fit) or 0 (model only)")
                basis_values = size if kind == 1.0 else 0
                model_values -= 1
            tokens, extra = divmod(flat.numel() - basis_values - model_values, self.dim + 1)
            if tokens < 0 or extra or (tokens and not self.token_slots):
                raise ValueError(f"basis message has {flat.numel()} values, expected {self._fit_values()} "
                                 f"plus (d + 1) per token centre")
            fitted = basis_values + model_values
            if tokens:
                table = flat[fitted:]
                self.token_ids = table[:tokens].round().long()
                self.token_offsets = table[tokens:].reshape(tokens, self.dim).clone()
            basis = flat[:size].reshape(self.dim, self.rank).clone() if basis_values else self.basis
            assert basis is not None
            mean = flat[basis_values : basis_values + self.dim].clone()
            variances = flat[basis_values + self.dim : fitted].clone() if self.entropy_budget is not None else None
            self._install(basis, mean, variances)
        self._checked(step)

    def refresh_bytes(self, message: Tensor | None) -> int:
        """The flag, and the basis if refitted: ``FLAG_BYTES + 4 * message.numel()``."""
        return FLAG_BYTES + (message.numel() * 4 if message is not None else 0)

    def _fit_values(self) -> int:
        """Values of a whole fit message before its token table: ``d r + d`` (``+ 1 + r``, its
        kind and the variances, when entropy-coded)."""
        return self.dim * self.rank + self.dim + (1 + self.rank if self.entropy_budget is not None else 0)

    def ship_bytes(self) -> int:
        """Bytes of the basis as it would ship now: ``(d r + d [+ r] + n (d + 1)) * 4`` (float32;
        ``n`` token centres; ``r`` eigenvalues when entropy-coded)."""
        tokens = 0 if self.token_ids is None else self.token_ids.numel()
        return (self._fit_values() + tokens * (self.dim + 1)) * 4

    def _refit(self, moments: TokenMoments, keep_basis: bool = False) -> None:
        """Fit basis, mean and (with token centres) the offsets from ``moments`` and install them;
        ``keep_basis``: the mean, offsets and an entropy-coded codec's variances only (these in the
        directions it keeps, ``diag(U^T W U)``)."""
        mean, eigenvalues, eigenvectors = moments.spectrum()
        if keep_basis:
            assert self.basis is not None
            basis = self.basis
            projection = basis.to(eigenvectors).T @ eigenvectors  # [r, d]
            variances = (projection.pow(2) * eigenvalues.clamp_min(0)).sum(1)
        else:
            basis, mean, _ = moments.principal_basis(self.rank)
            variances = eigenvalues[-self.rank:].flip(0).clamp_min(0)
        if self.entropy_budget is None:
            variances = None
        if self.token_slots and moments.by_token:
            ids, means = moments.token_means()
            assert moments.token_count is not None and moments.total is not None
            shift = means - moments.total / moments.count  # m_t - m
            self._move_offsets(ids.cpu(), shift.float().cpu(), moments.token_count.cpu())
        self._install(basis, mean, variances)

    def _move_offsets(self, ids: Tensor, shift: Tensor, counts: Tensor) -> None:
        """Add each seen id's mean shift ``m_t - m`` to its offset; new ids take free slots, the
        most frequent first (ties: the smaller id)."""
        table = self.token_ids if self.token_ids is not None else ids.new_zeros(0)
        offsets = self.token_offsets if self.token_offsets is not None else shift.new_zeros(0, self.dim)
        position = sorted_rows(table, ids, missing=-1)
        known = position >= 0
        offsets = offsets.clone()
        offsets.index_add_(0, position[known], shift[known])
        fresh = (~known).nonzero().squeeze(1)
        order = torch.argsort(-counts[fresh], stable=True)[: self.token_slots - table.numel()]
        fresh = fresh[order]
        merged = torch.cat([table, ids[fresh]])
        order = torch.argsort(merged)
        self.token_ids = merged[order]
        self.token_offsets = torch.cat([offsets, shift[fresh]])[order]

    def _install(self, basis: Tensor, mean: Tensor, variances: Tensor | None = None) -> None:
        self.basis, self.mean = basis.float().cpu(), mean.float().cpu()
        self.variances = None if variances is None else variances.float().cpu()
        self._table_cache = {}
        self.version += 1

    def _checked(self, step: int) -> None:
        """A check happened at ``step`` (both sides): the next window starts empty."""
        self.checked_step = step
        self.shared.clear()
        self.window.clear()

    # -- metrics and state -------------------------------------------------------------------------

    def step_metrics(self) -> dict[str, float]:
        out = {"basis_bytes": float(self._shipped)}
        if self._energy > 0:
            out["energy_kept"] = self._kept / self._energy
        return out

    def reset_metrics(self) -> None:
        self._kept = self._energy = 0.0
        self._shipped = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "basis": None if self.basis is None else self.basis.clone(),
            "mean": None if self.mean is None else self.mean.clone(),
            "token_ids": None if self.token_ids is None else self.token_ids.clone(),
            "token_offsets": None if self.token_offsets is None else self.token_offsets.clone(),
            "variances": None if self.variances is None else self.variances.clone(),
            "version": self.version,
            "checked_step": self.checked_step,
            "shared": self.shared.state_dict(),
            "window": self.window.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        basis, entropy = state.get("basis"), state.get("variances") is not None
        if isinstance(basis, Tensor) and basis.dim() == 2 and (
                basis.shape[1] != self.rank or entropy != (self.entropy_budget is not None)):
            raise ValueError(
                f"the saved basis has rank {basis.shape[1]} with {'entropy-coded' if entropy else 'other'} "
                f"coefficients; this cut's codec has rank {self.rank} with "
                f"{'entropy-coded' if self.entropy_budget is not None else 'other'} ones: resume with the run's "
                f"own pipeline settings (pipeline.entropy_coding={str(entropy).lower()})")
        self.basis = saved_tensor(state, "basis", (self.dim, self.rank), optional=True)
        self.mean = saved_tensor(state, "mean", (self.dim,), optional=self.basis is None)
        self.token_ids = saved_tensor(state, "token_ids", (None,), floating=False, optional=True)
        slots = None if self.token_ids is None else self.token_ids.numel()
        self.token_offsets = saved_tensor(state, "token_offsets", (slots, self.dim), optional=slots is None)
        self.variances = saved_tensor(state, "variances", (self.rank,), optional=True)
        self._table_cache = {}
        self.version, self.checked_step = saved_count(state, "version"), saved_count(state, "checked_step", low=-1)
        self.shared.load_state_dict(state.get("shared", {}))
        self.window.load_state_dict(state.get("window", {}))

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(dim={self.dim}, rank={self.rank}, refresh_every={self.refresh_every}, "
                f"refresh_tolerance={self.refresh_tolerance}, token_slots={self.token_slots}"
                + (f", bits={self.bits}" if self.bits is not None else "")
                + (f", entropy_budget={self.entropy_budget}" if self.entropy_budget is not None else "") + (", lead=True)" if self.lead else ")"))
