"""Entropy-coded scalar quantisation of basis coefficients: the last two steps of a transform coder.

A basis codec decorrelates a token into coefficients ``c`` ``[R]`` whose variances both sides
know (the fit's eigenvalues ``lambda_i``). This module quantises them with one step ``delta``
per row (sequence) -- ``q = round(c / delta)`` -- and codes the integer levels with an ANS coder
(`constriction <https://bamler-lab.github.io/constriction/>`_) under a discretised Laplace model
of scale ``b_i = sqrt(lambda_i / 2)`` per component. One step for every component is the
classic answer to bit allocation (reverse water-filling): a component's levels cost about
``log2(2 e b_i / delta)`` bits while ``b_i`` is well above ``delta``, and nearly nothing once it is
below, so the bytes go to the leading directions by themselves and the trailing ones are zero.

**Rate control.** A row of ``T`` real tokens may use ``budget * T`` bytes; its step is the
smallest (to 1/1024 of an octave) whose code fits, with :data:`STEP_BYTES` of header (the step as
float32). A row too short to hold its header is sent empty (it decodes to its tokens' centres). The fit is checked with the real coder, so every message is at most its budget, and the
budget is what is counted: messages are exact to the byte budget.

**The gradient message** (the gradient w.r.t. the coefficients) is quantised with stochastic
rounding, ``q = floor(g / delta + u)`` (unbiased for ``u ~ U[0, 1)``), under a Laplace model of one
scale per row that the row's header carries beside its step (:data:`GRADIENT_HEADER_BYTES`), and
is rate-controlled the same way.

Pure torch and numpy; no Lightning.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

MAX_LEVEL = 2**15 - 1
"""Levels are clamped to ``[-MAX_LEVEL, MAX_LEVEL]``, the coder's alphabet."""

PRECISION = 24
"""The coder's probability precision in bits: every level of the alphabet gets at least
``2^-24`` of the mass (constriction's leaky quantisation), so no value is uncodable."""

STEP_BYTES = 4
"""Header of a forward row: its step, float32."""

GRADIENT_HEADER_BYTES = 8
"""Header of a gradient row: its step and its Laplace scale, float32 each."""

_LEAK = (2 * MAX_LEVEL + 1) * 2.0**-PRECISION
_LEAK_BITS = -math.log2(1 - _LEAK)
_LOG2E = 1 / math.log(2)
_MIN_SPREAD = 1e-6  # in steps: a component this narrow is all zeros, at the leak's cost
_MIN_STEP = float(np.finfo(np.float32).tiny)  # the header's float32 step stays nonzero
_BRACKET_WIDENINGS = 8  # 8 octaves each way at a time, at most 64 from the first guess
_SEARCH_ITERATIONS = 14  # bisection in log2(step) over a 16-octave bracket: 1/1024 of an octave
GRADIENT_MARGIN = 0.01
"""Share of a gradient row's budget its step search leaves free (see :func:`quantise_gradient`)."""
_FIT_RETRY = 1.01  # step growth when the real coder overshoots the bound (its probabilities are rounded)


def laplace_bits(levels: Tensor, spread: Tensor) -> Tensor:
    """Code length in bits of integer ``levels`` under a Laplace of scale ``spread`` (in steps,
    ``b / delta``; broadcast against ``levels``) quantised to unit bins, with the coder's leak:
    ``-log2((1 - leak) P(q) + 2^-24)``, ``P(0) = 1 - e^(-a/2)``, ``P(q) = e^(-(|q| - 1/2) a)
    (1 - e^(-a)) / 2`` otherwise, ``a = 1 / spread``. Within rounding of what the coder spends."""
    a = 1.0 / spread.double().clamp_min(_MIN_SPREAD)
    magnitude = levels.double().abs()
    zero = torch.log(-torch.expm1(-a / 2))
    other = math.log(0.5) - (magnitude - 0.5) * a + torch.log(-torch.expm1(-a))
    log_p = torch.where(magnitude == 0, zero, other)
    return -torch.log2((1 - _LEAK) * torch.exp(log_p) + 2.0**-PRECISION)


def _bits_bound(levels: Tensor, spread: Tensor) -> float:
    """An upper bound on :func:`laplace_bits` summed over one row's levels ``[T, R]`` (spread
    ``[R]`` or a scalar, in steps), from per-component counts: the Laplace code length is linear in
    ``|q|`` away from 0, and the leak adds at most ``-log2(1 - leak)`` a level."""
    a = 1.0 / spread.double().clamp_min(_MIN_SPREAD)
    tokens = levels.shape[0]
    zeros = (levels == 0).sum(0).double()
    magnitudes = levels.abs().sum(0).double()
    zero_bits = -torch.log2(-torch.expm1(-a / 2))
    other_bits = 1 - torch.log2(-torch.expm1(-a)) - 0.5 * a * _LOG2E
    total = zeros * zero_bits + (tokens - zeros) * other_bits + magnitudes * a * _LOG2E
    if total.dim() == 0:  # one spread for every component
        total = total * levels.shape[1]
    return float(total.sum()) + levels.numel() * _LEAK_BITS


def _search_step(quantise, spread_of, start: float, target: float) -> float:
    """The smallest step (float32, to 1/1024 of an octave) whose levels ``quantise(step)`` fit
    ``target`` bits by :func:`_bits_bound`, bracketed from ``start``."""
    def fits(log_step: float) -> bool:
        step = 2.0**log_step
        return _bits_bound(quantise(step), spread_of(step)) <= target

    low, high = math.log2(start) - 8, math.log2(start) + 8
    for _ in range(_BRACKET_WIDENINGS):  # a start the high-rate guess misjudged
        if fits(high):
            break
        low, high = high, high + 8
    for _ in range(_BRACKET_WIDENINGS):  # bounded: a row of zero-variance directions fits at any step
        if not fits(low):
            break
        low, high = low - 8, low
    for _ in range(_SEARCH_ITERATIONS):
        middle = (low + high) / 2
        low, high = (low, middle) if fits(middle) else (middle, high)
    return max(float(np.float32(2.0**high)), _MIN_STEP)


def _grown_to_fit(quantise, spread_of, step: float, target: float) -> float:
    """``step``, grown until the real coder's stream of ``quantise(step)`` fits ``target`` bits
    (rare: the coder rounds its probabilities)."""
    while coded_bits(quantise(step), spread_of(step)) > target:
        step = float(np.float32(step * _FIT_RETRY))
    return step


def _high_rate_step(tokens: int, spread_bits: Tensor, target: float) -> float:
    """A first guess of a row's step from the high-rate approximation ``bits = T sum_i
    log2(2 e b_i / delta)`` (``spread_bits`` = ``log2(2 e b_i)``)."""
    return max(2.0 ** float((spread_bits.sum() - target / tokens) / spread_bits.numel()), _MIN_STEP)


def row_budget(tokens: int, budget: int, header: int) -> float:
    """Bits a row of ``tokens`` real tokens may spend on its levels: ``8 (budget * T - header)``."""
    return 8.0 * (budget * tokens - header)


def quantise_forward(rows: list[Tensor], spread: Tensor, budget: int) -> tuple[list[Tensor], list[float]]:
    """Round-to-nearest levels of each row's coefficients (``rows``: ``[T_b, R]``, real tokens
    only), one step per row, the smallest that fits ``budget`` bytes per token beside
    :data:`STEP_BYTES` under Laplace scales ``spread`` ``[R]`` (coefficient units). Row by row, so
    a row's step is the same whichever rows share its message. Returns ``(levels, steps)``."""
    spread = spread.detach().double().cpu()
    spread_bits = (spread.clamp_min(1e-30)).log2() + math.log2(2 * math.e)
    levels, steps = [], []
    for row in rows:
        values = row.detach().double().cpu()
        target = row_budget(values.shape[0], budget, STEP_BYTES)
        if target <= 0 or not bool(values.any()):  # no room for the header, or nothing to send: an empty row
            levels.append(torch.zeros_like(values, dtype=torch.long)), steps.append(0.0)
            continue

        def quantise(step: float, values: Tensor = values) -> Tensor:
            return torch.round(values / step).clamp_(-MAX_LEVEL, MAX_LEVEL)

        spread_of = lambda step: spread / step  # noqa: E731
        step = _search_step(quantise, spread_of, _high_rate_step(values.shape[0], spread_bits, target), target)
        step = _grown_to_fit(quantise, spread_of, step, target)
        levels.append(quantise(step).long()), steps.append(step)
    return levels, steps


def quantise_gradient(rows: list[Tensor], uniforms: list[Tensor], search_uniforms: list[Tensor],
                      budget: int) -> tuple[list[Tensor], list[float], list[float]]:
    """Stochastically rounded levels ``floor(g / step + u)`` of each row's gradient (``rows``:
    ``[T_b, R]``; ``uniforms``: the same shapes, in [0, 1)), one step per row fitting ``budget``
    bytes per token beside :data:`GRADIENT_HEADER_BYTES`, coded under one Laplace scale per row
    (the mean ``|g|`` of the row, float32 as the header carries it). Returns ``(levels, steps,
    scales)``.

    The step is searched on other draws, ``search_uniforms`` (independent of ``uniforms``), for
    :data:`GRADIENT_MARGIN` less than the budget, so it does not depend on the draws that round:
    ``E[q step] = g`` exactly. Only a row whose own stream would still overflow its budget (one
    draw against another differs by about ``1 / sqrt(T R)`` of the bits) grows its step, and that
    row alone loses the guarantee."""
    levels, steps, scales = [], [], []
    for row, noise, search in zip(rows, uniforms, search_uniforms):
        values, noise = row.detach().double().cpu(), noise.double().cpu()
        scale = float(np.float32(float(values.abs().mean()))) if values.numel() else 0.0
        target = row_budget(values.shape[0], budget, GRADIENT_HEADER_BYTES)
        if target <= 0 or scale == 0.0:  # no room for the header, or nothing to send: an empty row
            levels.append(torch.zeros_like(values, dtype=torch.long)), steps.append(0.0), scales.append(scale)
            continue

        def rounded(noise: Tensor, values: Tensor = values):
            return lambda step: torch.floor(values / step + noise).clamp_(-MAX_LEVEL, MAX_LEVEL)

        spread_bits = torch.full((values.shape[1],), math.log2(2 * math.e * scale))
        spread_of = lambda step, scale=scale: torch.tensor(scale / step)  # noqa: E731
        step = _search_step(rounded(search.double().cpu()), spread_of,
                            _high_rate_step(values.shape[0], spread_bits, target), target * (1 - GRADIENT_MARGIN))
        quantise = rounded(noise)
        step = _grown_to_fit(quantise, spread_of, step, target)
        levels.append(quantise(step).long()), steps.append(step), scales.append(scale)
    return levels, steps, scales


def _model(spread: Tensor, shape: tuple[int, ...]) -> tuple[object, np.ndarray, np.ndarray]:
    """The coder's Laplace model of levels of ``shape`` with scales ``spread`` (in steps,
    broadcast), as ``(model, means, scales)``."""
    import constriction

    scales = spread.double().clamp_min(_MIN_SPREAD).expand(shape).reshape(-1).cpu().numpy()
    return constriction.stream.model.QuantizedLaplace(-MAX_LEVEL, MAX_LEVEL), np.zeros_like(scales), scales


def encode_levels(levels: Tensor, spread: Tensor) -> np.ndarray:
    """The ANS stream (``uint32`` words) of one row's levels ``[T, R]`` under Laplace scales
    ``spread`` (in steps; ``[R]`` or ``[T, R]``)."""
    import constriction

    flat = levels.reshape(-1).cpu().numpy().astype(np.int32)
    if flat.size == 0:
        return np.zeros(0, dtype=np.uint32)
    model, means, scales = _model(spread, tuple(levels.shape))
    coder = constriction.stream.stack.AnsCoder()
    coder.encode_reverse(flat, model, means, scales)
    return coder.get_compressed()


def decode_levels(words: np.ndarray, shape: tuple[int, int], spread: Tensor) -> Tensor:
    """Levels ``[T, R]`` back from :func:`encode_levels`'s stream."""
    import constriction

    if shape[0] * shape[1] == 0:
        return torch.zeros(shape, dtype=torch.long)
    model, means, scales = _model(spread, shape)
    decoded = constriction.stream.stack.AnsCoder(words).decode(model, means, scales)
    return torch.from_numpy(np.asarray(decoded, dtype=np.int64)).reshape(shape)


def coded_bits(levels: Tensor, spread: Tensor) -> int:
    """Bits of :func:`encode_levels`'s stream for one row (whole 32-bit words)."""
    return 32 * int(encode_levels(levels, spread).size)


__all__ = [
    "GRADIENT_HEADER_BYTES",
    "MAX_LEVEL",
    "STEP_BYTES",
    "coded_bits",
    "decode_levels",
    "encode_levels",
    "laplace_bits",
    "quantise_forward",
    "quantise_gradient",
    "row_budget",
]
