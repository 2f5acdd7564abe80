"""Context keys: what the two sides of a cut know about each token besides its activation.

Every stage of a GRPO trainer holds the batch's token ids, so a codec may centre each token on a
mean conditioned on them at zero bytes per token. The key of a token packs its own id and the id
of the token before it in its row into one int64:

    key = id + (previous id + 1) * 2^24        (previous id + 1 = 0 at a row's first position)

``token_of(key) == id``, so a key is also a valid plain token id to anything that reads only the
token, and a plain id is a key without context. Keys are computed from ``[B, L]`` ids *before*
real tokens are packed (``x[mask]`` drops the neighbours), by :func:`context_keys`, at every place
that hands ids to a codec: the previous position is the previous column whether it is a real
token or padding, so every side computes the same key from the same batch.
"""

from __future__ import annotations

import torch
from torch import Tensor

ID_BITS = 24
"""Token ids must be below ``2^24``: keys pack two of them, and tables ship them as float32."""
ID_LIMIT = 1 << ID_BITS
_ID_MASK = ID_LIMIT - 1


def context_keys(token_ids: Tensor) -> Tensor:
    """``[..., L]`` ids -> ``[..., L]`` int64 keys ``id + (previous id + 1) * 2^24`` along the last
    dimension (no previous token at position 0). Raises on ids outside ``[0, 2^24)``."""
    ids = token_ids.long()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= ID_LIMIT):
        raise ValueError(f"token ids must be in [0, 2^{ID_BITS}) to key a codec's centres, "
                         f"got [{int(ids.min())}, {int(ids.max())}]")
    previous = torch.zeros_like(ids)
    previous[..., 1:] = ids[..., :-1] + 1
    return ids + (previous << ID_BITS)


def token_of(keys: Tensor) -> Tensor:
    """The token id of each key (a plain id is returned as is)."""
    return keys.long() & _ID_MASK


def has_context(keys: Tensor) -> Tensor:
    """Whether each key carries a previous token (False for plain ids and row starts)."""
    return (keys.long() >> ID_BITS) > 0


def sorted_rows(table: Tensor, keys: Tensor, *, missing: int) -> Tensor:
    """The position of each of ``keys`` (any shape) in the ascending ``table`` [n], ``missing``
    where it is absent."""
    if not table.numel():
        return torch.full_like(keys, missing, dtype=torch.long)
    table = table.to(keys.device)
    position = torch.searchsorted(table, keys).clamp_max(table.numel() - 1)
    return torch.where(table[position] == keys, position, missing)


class KeySlots:
    """Rows of a table for int64 keys, given in order of first sight (ascending key within one
    call) up to ``capacity``; a full table gives no more. Deterministic: the same calls in the same
    order give the same slots on every side of a cut."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.keys = torch.zeros(0, dtype=torch.long)  # the key of each slot, in slot order
        self._sorted: tuple[Tensor, Tensor] | None = None  # (keys ascending, their slots), until a slot is given

    def __len__(self) -> int:
        return self.keys.numel()

    def lookup(self, keys: Tensor) -> Tensor:
        """The slot of each key (any shape), -1 for keys without one. Gives no slot."""
        keys = keys.long()
        if not len(self):
            return torch.full_like(keys, -1)
        if self._sorted is None:
            order = torch.argsort(self.keys)
            self._sorted = (self.keys[order], order)
        table, slots = self._sorted
        position = sorted_rows(table, keys, missing=-1)
        return torch.where(position >= 0, slots.to(keys.device)[position.clamp_min(0)], -1)

    def assign(self, keys: Tensor) -> Tensor:
        """The slot of each key (any shape), giving new keys the free slots first; -1 where none is left."""
        new = torch.unique(keys.reshape(-1).long().cpu())
        new = new[self.lookup(new) < 0][: self.capacity - len(self)]
        if new.numel():
            self.keys = torch.cat([self.keys, new])
            self._sorted = None
        return self.lookup(keys)

    def state_dict(self) -> Tensor:
        return self.keys.clone()

    def load_state_dict(self, keys: Tensor) -> None:
        self.keys, self._sorted = keys.long().cpu().clone(), None


__all__ = ["ID_BITS", "ID_LIMIT", "KeySlots", "context_keys", "has_context", "sorted_rows", "token_of"]
