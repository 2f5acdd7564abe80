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


def sorted_rows(table: Tensor, keys: Tensor, *, missing: int) -> Tensor:
    """The position of each of ``keys`` (any shape) in the ascending ``table`` [n], ``missing``
    where it is absent."""
    if not table.numel():
        return torch.full_like(keys, missing, dtype=torch.long)
    table = table.to(keys.device)
    position = torch.searchsorted(table, keys).clamp_max(table.numel() - 1)
    return torch.where(table[position] == keys, position, missing)


__all__ = ["ID_BITS", "ID_LIMIT", "context_keys", "sorted_rows", "token_of"]
