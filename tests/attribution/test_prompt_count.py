"""``attribute`` takes one prompt per graph: several (texts, id sequences) are refused by name — until 2026-11-30 it
said "got list: too many dimensions 'str'" (a researcher's probe, tenth session)."""

from __future__ import annotations

import pytest
from helpers import make_lorsa, tiny_nnsight

from nnsight_lorsa import ReplacementModel, attribute, get_adapter
from nnsight_lorsa.errors import ArgumentError


def test_attribute_of_several_prompts_says_one_prompt_per_graph():
    """``attribute(rm, [p1, p2])`` said "got list: too many dimensions 'str'"; one prompt per graph."""
    model, hf = tiny_nnsight("llama")
    rm = ReplacementModel(model, lorsas={1: make_lorsa(hf, get_adapter(model), layer=1)})
    for prompts in (["a b", "c d"], ["a b"], [[0, 5, 6], [0, 7, 8]]):
        with pytest.raises(ArgumentError, match="one prompt"):
            attribute(rm, prompts)
    assert attribute(rm, [[0, 5, 6, 7]]).summary()["logits"] > 0  # one row of ids: one prompt


def test_a_list_of_0d_tensors_is_one_prompt():
    """``[tensor(5), tensor(6), tensor(7)]`` is one prompt of ids (refused as "3 prompts" by the first version of the
    several-prompts check; the session's mutation review)."""
    import torch

    model, hf = tiny_nnsight("llama")
    rm = ReplacementModel(model, lorsas={1: make_lorsa(hf, get_adapter(model), layer=1)})
    one = attribute(rm, [torch.tensor(0), torch.tensor(5), torch.tensor(6)])
    same = attribute(rm, [0, 5, 6])
    assert torch.equal(one.tokens, same.tokens)
