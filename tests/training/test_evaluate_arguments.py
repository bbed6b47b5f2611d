"""``evaluate``'s arguments: a batch size or batch count that cannot be, and windows with nothing to count, are named
errors of ours before the model runs (they were ``ZeroDivisionError`` from the CE and KL means, or from the batch
count)."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_training_setup

from nnsight_lorsa import TranscoderSet
from nnsight_lorsa.errors import ArgumentError, TooFewTokensError
from nnsight_lorsa.modules.transcoder import Transcoder, TranscoderConfig
from nnsight_lorsa.training import TokenDataset, evaluate


@pytest.fixture(scope="module")
def setup():
    model, hf, adapter, data = tiny_training_setup()
    torch.manual_seed(0)
    return TranscoderSet(model, {1: Transcoder(TranscoderConfig(d_in=adapter.d_model, d_sae=32)).eval()}), data, hf


class _Ran(Exception):
    pass


def _refuse_to_run(hf):
    """A forward pre-hook on the Hugging Face model: the error is raised before the model ran."""
    def hook(module, args, kwargs):
        raise _Ran("the model ran")
    return hf.register_forward_pre_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("kwargs", [{"batch_size": 0}, {"batch_size": -2}, {"batch_size": True},
                                    {"max_batches": 0}, {"max_batches": -1}, {"max_batches": False}])
def test_a_batch_size_or_count_below_one_is_an_argument_error_before_the_model_runs(setup, kwargs):
    rs, data, hf = setup
    name = next(iter(kwargs))
    handle = _refuse_to_run(hf)
    try:
        with pytest.raises(ArgumentError, match=rf"evaluate: {name} must be"):
            evaluate(rs, TokenDataset(data.tokens[:3]), at=1, progress=False, **kwargs)
    finally:
        handle.remove()


@pytest.mark.parametrize("first_only", [False, True])
def test_windows_with_no_counted_prediction_are_too_few_tokens_before_the_model_runs(setup, first_only):
    """A ``target_mask`` keeping nothing, or only each window's first token (which nothing predicts: CE, KL and FVU
    all leave it out), leaves CE and KL 0 / 0."""
    rs, data, hf = setup
    mask = torch.zeros_like(data.tokens[:3], dtype=torch.bool)
    mask[:, 0] = first_only
    handle = _refuse_to_run(hf)
    try:
        with pytest.raises(TooFewTokensError, match="3 windows evaluated hold no counted prediction"):
            evaluate(rs, TokenDataset(data.tokens[:3], mask), at=1, progress=False)
    finally:
        handle.remove()


def test_only_the_evaluated_windows_must_count_something(setup):
    """``max_batches`` limits the windows looked at: a later window's kept tokens do not make the first batch's count,
    and one counted prediction in the evaluated windows is enough (its CE is that token's)."""
    rs, data, hf = setup
    mask = torch.zeros_like(data.tokens[:4], dtype=torch.bool)
    mask[3, 5] = True  # in the second batch of 2 only
    with pytest.raises(TooFewTokensError, match="2 windows evaluated"):
        evaluate(rs, TokenDataset(data.tokens[:4], mask), at=1, batch_size=2, max_batches=1, progress=False)
    got = evaluate(rs, TokenDataset(data.tokens[:4], mask), at=1, batch_size=2, progress=False)
    assert got.n_tokens == 1
