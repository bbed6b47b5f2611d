"""A ``target_mask`` (or a token file's ``attention_mask``) is booleans or 0 / 1: any other value was cast with
``.bool()`` and counted as True (a soft mask of 0.5, a mask of 2 from a tokenizer's ``token_type_ids`` read by
mistake) — silently training and evaluating on positions the caller meant to weigh or leave out. Now an
``ArgumentError`` naming the mask and the value (probe of 2026-11-29, fourth session)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from nnsight_lorsa.errors import ArgumentError
from nnsight_lorsa.training import TokenDataset
from nnsight_lorsa.training.dataset import read_token_ids

TOKENS = torch.tensor([[0, 5, 6, 7], [0, 8, 9, 1]])
PREFIX = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])  # right padding on row 1


@pytest.mark.parametrize("dtype", [torch.bool, torch.int64, torch.int32, torch.uint8, torch.float32, torch.float16])
def test_a_zero_one_mask_of_any_dtype_is_the_bool_mask(dtype):
    ds = TokenDataset(TOKENS, PREFIX.to(dtype))
    assert ds.target_mask.dtype == torch.bool
    assert torch.equal(ds.target_mask, PREFIX.bool())


@settings(max_examples=30, deadline=None)
@given(odd=st.one_of(st.floats(allow_nan=True, allow_infinity=True).filter(lambda v: v not in (0.0, 1.0)),
                     st.integers(-5, 5).filter(lambda v: v not in (0, 1))))
def test_a_mask_value_other_than_zero_or_one_is_refused_by_name(odd):
    mask = PREFIX.to(torch.float64 if isinstance(odd, float) else torch.int64).clone()
    mask[0, 2] = odd
    with pytest.raises(ArgumentError, match="TokenDataset: target_mask must hold only 0 and 1"):
        TokenDataset(TOKENS, mask)
    with pytest.raises(ArgumentError, match="from_ids: target_mask must hold only 0 and 1"):
        TokenDataset.from_ids(TOKENS, 4, target_mask=mask, bos_token_id=0)


def test_a_token_files_attention_mask_of_other_values_is_refused_naming_the_file(tmp_path):
    good, bad = tmp_path / "good.safetensors", tmp_path / "bad.safetensors"
    save_file({"input_ids": TOKENS, "attention_mask": PREFIX}, str(good))
    ids, mask = read_token_ids(good)
    assert torch.equal(ids, TOKENS) and torch.equal(mask, PREFIX.bool())
    save_file({"input_ids": TOKENS, "attention_mask": PREFIX * 2}, str(bad))
    with pytest.raises(ArgumentError, match=r"bad\.safetensors: 'attention_mask' must hold only 0 and 1.*2"):
        read_token_ids(bad)
