"""The memory plan's node arithmetic, made cheap (issue 21: the 8B-shaped all-layer plan, ~0.8 s of a call's fixed
part): :meth:`NodeTable.sites` by one gather per kind's ``mult · layer + offset`` (was a mask per kind), and
:func:`count_distinct` by ``bincount`` (was ``unique``'s sort) — the same integers, on generated node tables."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nnsight_lorsa.attribution.nodes import (
    ATTN_ERROR,
    BIAS,
    EMBEDDING,
    LOGIT,
    LORSA,
    MLP_ERROR,
    TRANSCODER,
    NodeTable,
    count_distinct,
)


def masked_sites(kind: torch.Tensor, layer: torch.Tensor) -> torch.Tensor:
    """The former :meth:`NodeTable.sites`: a mask per kind."""
    site = torch.full_like(layer, -1)
    site[kind == EMBEDDING] = 0
    attn = (kind == LORSA) | (kind == ATTN_ERROR)
    mlp = (kind == TRANSCODER) | (kind == MLP_ERROR)
    site[attn] = 2 * layer[attn] + 1
    site[mlp] = 2 * layer[mlp] + 2
    site[kind == LOGIT] = 2 * layer[kind == LOGIT] + 3
    return site


@settings(max_examples=60, deadline=None)
@given(kinds=st.lists(st.sampled_from([TRANSCODER, LORSA, MLP_ERROR, ATTN_ERROR, EMBEDDING, BIAS, LOGIT]),
                      max_size=60),
       layers=st.lists(st.integers(-1, 40), min_size=60, max_size=60))
def test_sites_are_the_masked_formula(kinds, layers):
    kind = torch.tensor(kinds, dtype=torch.long)
    layer = torch.tensor(layers[:len(kinds)], dtype=torch.long)
    zeros = torch.zeros_like(kind)
    table = NodeTable(kind, layer, zeros, zeros, zeros.float(), [])
    assert torch.equal(table.sites(), masked_sites(kind, layer))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-5, 300), max_size=200))
def test_count_distinct_is_uniques_count(values):
    idx = torch.tensor(values, dtype=torch.long)
    assert count_distinct(idx) == int(torch.unique(idx).numel())


def test_position_slots_refuse_a_group_past_the_last():
    """A node at a position past ``n_pos`` would be in no chunk of the gathered writes and reads (its read left
    unwritten): a named error, read from the counts' length on the host."""
    import pytest

    from nnsight_lorsa.attribution.frozen import PositionSlots, gather_read
    from nnsight_lorsa.errors import ShapeError

    with pytest.raises(ShapeError, match="past the 4 groups"):
        PositionSlots(torch.tensor([0, 1, 5]), 4)
    with pytest.raises(ShapeError):
        gather_read(torch.randn(2, 4, 3), torch.randn(6, 3), torch.tensor([0, 1, 2]), torch.tensor([0, 3, 4]))
    assert PositionSlots(torch.tensor([0, 3]), 4).width == 1
