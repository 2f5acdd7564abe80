"""The anchor's sign message: ``sign(M_bar)`` of one stage's parameters in about 1 bit a coordinate.

Pure torch (nothing of the pipeline or the algorithm): with ``anchor.placement: sampler`` the
sampling rank sends it to every other stage rank (:mod:`tclightning.anchor.placement`), and
``tclightning bench traffic`` counts it (:func:`sign_message_bytes`).

**The sign message** of one stage (tensors ``t = 0..T-1`` of ``n_t`` coordinates, in the stage's
parameter order), one flat ``uint8`` tensor:

* a header of ``ceil(T / 8)`` bytes: bit ``t % 8`` of byte ``t // 8`` set when tensor ``t`` has a
  coordinate where ``M_bar`` is exactly 0 (``sign(0) = 0`` matters: the merge gives ``alpha *
  G_comp`` there, not ``G_comp`` or ``(1 - 2 alpha) G_comp``);
* per tensor, ``ceil(n_t / 8)`` bytes of sign bits (bit set: negative), then, only for a tensor with
  a zero, ``ceil(n_t / 8)`` bytes of nonzero bits (bit set: nonzero).

Bytes: ``ceil(T/8) + sum_t ceil(n_t/8) * (1 + z_t)``, ``z_t`` = 1 for a tensor with a zero. The
header crosses first, so the receiver knows the body's length without a length field. A NaN in
``M_bar`` (a non-finite anchor) crosses as sign 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

def _bytes(numel: int) -> int:
    return -(-numel // 8)


def _places(device: torch.device) -> Tensor:
    return torch.arange(8, dtype=torch.uint8, device=device)


def pack_bits(bits: Tensor) -> Tensor:
    """``ceil(n / 8)`` bytes (``uint8``, on ``bits``' device): bit ``i % 8`` of byte ``i // 8`` is
    ``bits[i]`` (flattened bool). Bit ``i`` of each byte is distinct, so the sum is their OR."""
    flat = bits.reshape(-1).to(torch.uint8)
    padded = torch.zeros(_bytes(flat.numel()) * 8, dtype=torch.uint8, device=flat.device)
    padded[: flat.numel()] = flat
    return (padded.view(-1, 8) << _places(flat.device)).sum(1, dtype=torch.uint8)


def unpack_bits(packed: Tensor, numel: int) -> Tensor:
    """The ``numel`` bools :func:`pack_bits` packed (on ``packed``'s device)."""
    bits = (packed.to(torch.uint8).unsqueeze(1) >> _places(packed.device)) & 1
    return bits.reshape(-1)[:numel].bool()


def header_bytes(tensors: int) -> int:
    """The sign message's header for ``tensors`` tensors: one bit each."""
    return _bytes(tensors)


def sign_message_bytes(sizes: Sequence[int], with_zeros: Sequence[bool] | None = None) -> int:
    """Bytes of the sign message of tensors of ``sizes`` coordinates; ``with_zeros[t]``: tensor ``t``
    has an exact zero (None: none has, the case of a real gradient)."""
    zeros = with_zeros if with_zeros is not None else [False] * len(sizes)
    return header_bytes(len(sizes)) + sum(_bytes(n) * (2 if z else 1) for n, z in zip(sizes, zeros, strict=True))


def pack_signs(m_bar: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """``(header, body)`` of the sign message of ``m_bar`` (module doc), both ``uint8`` on the first
    tensor's device (CPU for none)."""
    has_zero = [bool((m == 0).any() or m.isnan().any()) for m in m_bar]
    parts = []
    for m, zero in zip(m_bar, has_zero):
        parts.append(pack_bits(m < 0))
        if zero:
            parts.append(pack_bits((m != 0) & ~m.isnan()))
    device = m_bar[0].device if m_bar else torch.device("cpu")
    body = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8, device=device)
    return pack_bits(torch.tensor(has_zero, dtype=torch.bool, device=device)), body


def body_bytes(header: Tensor, sizes: Sequence[int]) -> int:
    """The body's length that ``header`` announces for tensors of ``sizes`` coordinates."""
    zeros = unpack_bits(header, len(sizes)).tolist()
    return sign_message_bytes(sizes, zeros) - header_bytes(len(sizes))


def unpack_signs(header: Tensor, body: Tensor, shapes: Sequence[torch.Size]) -> list[Tensor]:
    """``sign(M_bar)`` per tensor (float32 -1 / 0 / +1, on ``body``'s device) from :func:`pack_signs`'s
    message."""
    zeros = unpack_bits(header, len(shapes)).tolist()
    sizes = [int(torch.Size(shape).numel()) for shape in shapes]
    need = sign_message_bytes(sizes, zeros) - header_bytes(len(shapes))
    if need != body.numel():
        raise ValueError(f"sign message: {body.numel()} body bytes for tensors needing {need}")
    out, offset = [], 0
    for shape, zero in zip(shapes, zeros):
        numel = int(torch.Size(shape).numel())
        size = _bytes(numel)
        negative = unpack_bits(body[offset : offset + size], numel)
        offset += size
        signs = 1.0 - 2.0 * negative.float()
        if zero:
            signs = signs * unpack_bits(body[offset : offset + size], numel).float()
            offset += size
        out.append(signs.view(shape))
    return out


__all__ = ["body_bytes", "header_bytes", "pack_bits", "pack_signs", "sign_message_bytes", "unpack_bits", "unpack_signs"]
