"""The sampler's copy of the policy in its own dtype, and the sparse sync that keeps it exact.

Pure torch (no Lightning, nothing of the pipeline or the algorithm): the one-process backend and
the pipeline engine both use it.

With ``sampler.dtype`` the sampler generates from a copy of the policy whose parameters are in
that dtype (:class:`SamplerCopy`; buffers stay as they are). After an update only the entries
whose value *in that dtype* changed are sent, compared by bit pattern (a NaN that stays NaN is
unchanged, ``0.0 -> -0.0`` is a change), so the copy is always bit-identical to the trainer's
weights cast to the dtype, exactly as if every weight had been sent. Sender and receiver each
hold the tensors as last sent (a :class:`WeightMirror`; the receiver's are the copy's own) and
apply the same message to them.

A message (:func:`encode`) is one flat ``uint8`` tensor: a :data:`HEADER` per tensor (position
code, positions' byte length, changed entries), then per tensor its coded positions and its
changed values (their bytes in the sampler dtype). It is empty when nothing changed. Positions
are coded whichever way is shorter for that tensor:

* :data:`BITMASK`: ``ceil(n / 8)`` bytes, bit ``i % 8`` of byte ``i // 8`` set when entry ``i``
  changed -- wins when more than about one entry in 8 changed;
* :data:`GAPS`: the gaps between changed indices (the first index, then ``i_j - i_{j-1} - 1``)
  in LEB128 (7 bits a byte, the high bit set on every byte of a value but its last) -- a byte
  per change while changes are closer than 128 entries, two while closer than 16,384.

A message crosses as its length (int64) and then its bytes: :func:`message_bytes`.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor, nn

BITMASK, GAPS = 0, 1
"""The two position codes."""

HEADER = np.dtype([("code", "u1"), ("positions", "<u4"), ("count", "<u4")])
"""Per tensor, first in a message: its position code, its positions' bytes, its changed entries (9 bytes)."""

LENGTH_BYTES = 8
"""The message's length (int64), sent ahead of it."""

_SAME_WIDTH_INTEGER = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_pattern(tensor: Tensor) -> Tensor:
    """``tensor``'s bits as integers of its width (so NaN and -0.0 compare by their bits)."""
    return tensor.view(_SAME_WIDTH_INTEGER[tensor.element_size()])


def changed_positions(last: Tensor, now: Tensor) -> Tensor:
    """Flat indices (ascending, int64) where ``now`` differs from ``last`` bit for bit (same dtype)."""
    return torch.nonzero(bit_pattern(last).reshape(-1) != bit_pattern(now).reshape(-1)).reshape(-1)


# -- positions ------------------------------------------------------------------------------------


def pack_bitmask(positions: Tensor, numel: int) -> Tensor:
    """``ceil(numel / 8)`` bytes with bit ``i % 8`` of byte ``i // 8`` set for each ``i`` in ``positions``."""
    bits = torch.zeros(-(-numel // 8) * 8, dtype=torch.uint8, device=positions.device)
    bits[positions] = 1
    places = torch.arange(8, dtype=torch.uint8, device=bits.device)
    return (bits.view(-1, 8) << places).sum(1, dtype=torch.uint8)


def unpack_bitmask(packed: Tensor, numel: int) -> Tensor:
    """The set positions of :func:`pack_bitmask`'s bytes (ascending, int64)."""
    places = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed.unsqueeze(1) >> places) & 1
    return torch.nonzero(bits.reshape(-1)[:numel]).reshape(-1)


def leb128_lengths(values: Tensor) -> Tensor:
    """Bytes each non-negative int64 value takes in LEB128 (1 below 128, 2 below 16,384, ...)."""
    lengths = torch.ones_like(values)
    rest = values >> 7
    while bool(rest.any()):  # one round per byte place (at most 9), not per value
        lengths += rest > 0
        rest = rest >> 7
    return lengths


def leb128_encode(values: Tensor, lengths: Tensor | None = None) -> Tensor:
    """Non-negative int64 ``values`` as LEB128 bytes (``uint8``); ``lengths``: their
    :func:`leb128_lengths`, if already known."""
    lengths = leb128_lengths(values) if lengths is None else lengths
    starts = torch.cumsum(lengths, 0) - lengths
    out = torch.empty(int(lengths.sum()), dtype=torch.uint8, device=values.device)
    for place in range(int(lengths.max()) if len(values) else 0):
        has = lengths > place
        low = (values[has] >> (7 * place)) & 0x7F
        more = (lengths[has] > place + 1).long() << 7
        out[starts[has] + place] = (low | more).to(torch.uint8)
    return out


def leb128_decode(data: Tensor) -> Tensor:
    """The int64 values of LEB128 bytes ``data`` (the inverse of :func:`leb128_encode`)."""
    data = data.long()
    last = data < 0x80  # each value's final byte
    ends = torch.nonzero(last).reshape(-1)
    value_of = torch.cumsum(last.long(), 0) - last.long()  # which value each byte belongs to
    starts = torch.cat([ends.new_zeros(1), ends[:-1] + 1])
    shift = 7 * (torch.arange(len(data), device=data.device) - starts[value_of])
    return torch.zeros(len(ends), dtype=torch.long, device=data.device).index_add_(0, value_of, (data & 0x7F) << shift)


def encode_positions(positions: Tensor, numel: int) -> tuple[int, Tensor]:
    """``(code, bytes)``: the changed flat indices ``positions`` (ascending) of a tensor of ``numel``
    entries as LEB128 gaps or as a packed bitmask, whichever is shorter (the bitmask on a tie)."""
    gaps = torch.diff(positions, prepend=positions.new_full((1,), -1)) - 1
    lengths = leb128_lengths(gaps)
    if int(lengths.sum()) < -(-numel // 8):
        return GAPS, leb128_encode(gaps, lengths)
    return BITMASK, pack_bitmask(positions, numel)


def decode_positions(code: int, data: Tensor, numel: int) -> Tensor:
    """The flat indices :func:`encode_positions` coded as ``(code, data)``."""
    if code == GAPS:
        return torch.cumsum(leb128_decode(data) + 1, 0) - 1
    if code == BITMASK:
        return unpack_bitmask(data, numel)
    raise ValueError(f"unknown position code {code}")


# -- messages -------------------------------------------------------------------------------------


def encode(last: Sequence[Tensor], now: Sequence[Tensor]) -> Tensor:
    """The message that brings the tensors ``last`` (as the receiver holds them, in the sampler
    dtype) to ``now`` cast to their dtype: see the module doc. Empty when nothing changed."""
    headers = np.zeros(len(last), dtype=HEADER)
    parts: list[Tensor] = []
    for index, (held, current) in enumerate(zip(last, now, strict=True)):
        current = current.detach().to(held.device, held.dtype)
        positions = changed_positions(held, current)
        code, coded = encode_positions(positions, held.numel())
        headers[index] = (code, coded.numel(), positions.numel())
        parts += [coded, current.reshape(-1)[positions].view(torch.uint8)]
    device = last[0].device if last else torch.device("cpu")
    if not headers["count"].any():
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.cat([torch.from_numpy(headers.view(np.uint8)).to(device), *parts])


def decode(message: Tensor, sizes: Sequence[int], dtype: torch.dtype) -> list[tuple[Tensor, Tensor]]:
    """``(positions, values)`` of each tensor of :func:`encode`'s ``message``; ``sizes``: the
    tensors' numbers of entries, ``dtype``: the sampler dtype."""
    if message.numel() == 0:
        nothing = torch.empty(0, dtype=torch.long, device=message.device)
        return [(nothing, nothing.to(dtype))] * len(sizes)
    offset = len(sizes) * HEADER.itemsize
    headers = np.frombuffer(message[:offset].cpu().numpy().tobytes(), dtype=HEADER)
    out = []
    for numel, (code, length, count) in zip(sizes, headers.tolist(), strict=True):
        positions = decode_positions(code, message[offset : offset + length], numel)
        offset += length
        values = message[offset : offset + count * dtype.itemsize].clone().view(dtype)
        offset += count * dtype.itemsize
        if len(positions) != count:
            raise ValueError(f"a sync message's positions decode to {len(positions)} entries, its header says {count}")
        out.append((positions, values))
    if offset != message.numel():
        raise ValueError(f"a sync message has {message.numel()} bytes, its headers account for {offset}")
    return out


@torch.no_grad()
def apply_message(targets: Sequence[Tensor], message: Tensor) -> None:
    """Write :func:`encode`'s ``message`` into ``targets`` (in place; the tensors it was made for)."""
    if message.numel() == 0:
        return
    for target, (positions, values) in zip(targets, decode(message, [t.numel() for t in targets], targets[0].dtype)):
        target.view(-1)[positions] = values


def message_bytes(message: Tensor) -> int:
    """What sending ``message`` costs: its length (:data:`LENGTH_BYTES`), then its bytes."""
    return LENGTH_BYTES + message.numel()


def full_bytes(tensors: Sequence[Tensor], dtype: torch.dtype) -> int:
    """What sending every entry of ``tensors`` in ``dtype`` costs (the dense sync in that dtype)."""
    return sum(t.numel() for t in tensors) * dtype.itemsize


class WeightMirror:
    """Tensors as the receiver holds them, in the sampler dtype, updated in place: a sender keeps
    one to know what changed since it last sent; the sampler's copy applies messages through one
    over its own parameters."""

    def __init__(self, tensors: Sequence[Tensor]) -> None:
        self.tensors = list(tensors)

    @classmethod
    def of(cls, source: Sequence[Tensor], dtype: torch.dtype) -> WeightMirror:
        """A mirror holding ``source`` cast to ``dtype`` (copies)."""
        return cls([t.detach().to(dtype, copy=True) for t in source])

    def advance(self, now: Sequence[Tensor]) -> Tensor:
        """The message from what is held to ``now`` (cast), applied here too: both ends of a sync
        apply the same message."""
        message = encode(self.tensors, now)
        self.apply(message)
        return message

    def apply(self, message: Tensor) -> None:
        apply_message(self.tensors, message)

    @torch.no_grad()
    def reset(self, now: Sequence[Tensor]) -> None:
        """Hold ``now`` cast (no message: for when both ends were given the same weights)."""
        for held, current in zip(self.tensors, now, strict=True):
            held.copy_(current.detach().to(held.dtype))  # the same rounding as a sync's cast


def cast_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A deep copy of ``model`` whose parameters are frozen ``dtype`` copies (tied ones stay tied;
    buffers are copied as they are), made without a full-precision copy on the way; in eval mode."""
    memo: dict[int, object] = {id(p): nn.Parameter(p.detach().to(dtype, copy=True), requires_grad=False)
                               for p in model.parameters()}
    return copy.deepcopy(model, memo).eval()


class SamplerCopy:
    """The sampler's copy of ``policy`` (:func:`cast_copy` to ``dtype``): ``model`` generates;
    :meth:`mirror` hands out its parameters by name, for sync messages to be applied to."""

    def __init__(self, policy: nn.Module, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.model = cast_copy(policy, dtype)
        self._named = dict(self.model.named_parameters())

    def mirror(self, names: Sequence[str]) -> WeightMirror:
        """The copy's own parameters ``names`` (as the policy names them) as a mirror."""
        return WeightMirror([self._named[name].detach() for name in names])
