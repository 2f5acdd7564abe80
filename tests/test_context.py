"""Context keys: a token and the one before it, packed into one int64 for codec tables."""

from __future__ import annotations

import pytest
import torch

from tclightning.codecs.context import ID_LIMIT, context_keys, token_of


def test_a_key_holds_the_token_and_the_one_before_it() -> None:
    ids = torch.tensor([[5, 7, 5, 7], [7, 5, 7, 7]])
    keys = context_keys(ids)
    assert keys.dtype == torch.long and keys.shape == ids.shape
    assert torch.equal(token_of(keys), ids)
    assert int(keys[0, 1]) == 7 + (5 + 1) * 2**24
    assert keys[0, 1] == keys[0, 3] == keys[1, 2]  # (5, 7) wherever it occurs
    assert keys[0, 1] != keys[1, 3]  # (7, 7): the same token after another
    assert keys[0, 0] == 5 and keys[1, 0] == 7  # a row start is the plain id
    assert torch.equal(token_of(ids), ids)  # plain ids are keys without context


def test_ids_outside_the_key_range_are_refused() -> None:
    with pytest.raises(ValueError, match="token ids must be in"):
        context_keys(torch.tensor([[1, ID_LIMIT]]))
    with pytest.raises(ValueError, match="token ids must be in"):
        context_keys(torch.tensor([[-1, 2]]))

