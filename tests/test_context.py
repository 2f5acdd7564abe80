"""Context keys: a token and the one before it, packed into one int64 for codec tables."""

from __future__ import annotations

import pytest
import torch

from tclightning.codecs.context import ID_LIMIT, KeySlots, context_keys, has_context, token_of


def test_a_key_holds_the_token_and_the_one_before_it() -> None:
    ids = torch.tensor([[5, 7, 5, 7], [7, 5, 7, 7]])
    keys = context_keys(ids)
    assert keys.dtype == torch.long and keys.shape == ids.shape
    assert torch.equal(token_of(keys), ids)
    assert has_context(keys).tolist() == [[False, True, True, True], [False, True, True, True]]
    assert int(keys[0, 1]) == 7 + (5 + 1) * 2**24
    assert keys[0, 1] == keys[0, 3] == keys[1, 2]  # (5, 7) wherever it occurs
    assert keys[0, 1] != keys[1, 3]  # (7, 7): the same token after another
    assert keys[0, 0] == 5 and keys[1, 0] == 7  # a row start is the plain id
    assert torch.equal(token_of(ids), ids) and not has_context(ids).any()  # plain ids are keys without context


def test_ids_outside_the_key_range_are_refused() -> None:
    with pytest.raises(ValueError, match="token ids must be in"):
        context_keys(torch.tensor([[1, ID_LIMIT]]))
    with pytest.raises(ValueError, match="token ids must be in"):
        context_keys(torch.tensor([[-1, 2]]))


def test_slots_follow_first_sight_up_to_capacity() -> None:
    slots = KeySlots(3)
    assert slots.lookup(torch.tensor([4])).tolist() == [-1]
    assert slots.assign(torch.tensor([9, 4, 9])).tolist() == [1, 0, 1]  # ascending within a call
    assert slots.assign(torch.tensor([[2, 9], [7, 4]])).tolist() == [[2, 1], [-1, 0]]  # full after 2
    assert slots.keys.tolist() == [4, 9, 2] and len(slots) == 3
    restored = KeySlots(3)
    restored.load_state_dict(slots.state_dict())
    assert torch.equal(restored.lookup(torch.tensor([2, 4, 7, 9])), slots.lookup(torch.tensor([2, 4, 7, 9])))
