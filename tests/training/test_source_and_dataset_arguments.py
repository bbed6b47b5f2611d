"""The counts and kinds the training front door took as given (probe of 2026-11-29, fourth session): a batch size of
0 for an activation source (a ``ZeroDivisionError`` or an empty stack at the first batch), ``TokenDataset.from_ids``
with ``seq_len`` 0 (``ZeroDivisionError``) or 1 (windows with nothing to predict), ``split(1.5)`` (every window held
out, an empty training set) or a split of one window, ``batch(-1, …)`` (a negative index read from the end of the
stream), ``clt(n_layers=0)`` reported as "layer -1 is out of range", and a replacement set built on a bare Hugging
Face model, whose ``replace`` was "'LlamaForCausalLM' object has no attribute 'get'". Each is now our named error."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import LAYER, make_lorsa, random_ids, tiny_nnsight

from nnsight_lorsa import LorsaSet, TokenDataset, get_adapter
from nnsight_lorsa.envoy import Site
from nnsight_lorsa.errors import ArgumentError, LayerOutOfRangeError, TooFewTokensError
from nnsight_lorsa.training import ActivationSource

DATA = TokenDataset(random_ids(batch=6, seq=8, seed=3))


@pytest.fixture(scope="module")
def model():
    return tiny_nnsight("llama")


@pytest.mark.parametrize("batch_size", [0, -1])
def test_a_source_batch_size_below_one_is_refused_by_name(model, batch_size):
    m, _ = model
    a = get_adapter(m)
    for make in (lambda: ActivationSource.sae(m, Site.mlp_input(a, 1), DATA, batch_size=batch_size),
                 lambda: ActivationSource.transcoder(m, 1, DATA, batch_size=batch_size),
                 lambda: ActivationSource.attention(m, 1, DATA, batch_size),
                 lambda: ActivationSource.clt(m, DATA, batch_size=batch_size)):
        with pytest.raises(ArgumentError, match=r"ActivationSource\(batch_size=\.\.\.\) must be an int >= 1"):
            make()


def test_a_clt_of_no_layers_says_so(model):
    m, _ = model
    n = get_adapter(m).n_layers
    for bad in (0, -2):
        with pytest.raises(LayerOutOfRangeError, match=rf"clt\(n_layers=\.\.\.\) must be None or an int in \[1, {n}\]"):
            ActivationSource.clt(m, DATA, n_layers=bad)
    assert ActivationSource.clt(m, DATA, n_layers=1).n_layers == 1


@pytest.mark.parametrize("seq_len", [0, 1, -4])
def test_a_window_of_fewer_than_two_tokens_is_refused_by_name(seq_len):
    with pytest.raises(ArgumentError, match="from_ids: seq_len must be an int >= 2"):
        TokenDataset.from_ids(torch.arange(3, 60), seq_len, bos_token_id=0)
    two = TokenDataset.from_ids(torch.arange(3, 60), 2, bos_token_id=0)
    assert two.seq_len == 2 and bool((two.tokens[:, 0] == 0).all())


@pytest.mark.parametrize("fraction", [0.0, 1.0, 1.5, -0.2, math.nan, math.inf])
def test_a_holdout_fraction_outside_zero_one_is_refused(fraction):
    with pytest.raises(ArgumentError, match=r"split\(holdout_fraction=\.\.\.\) must be a number in \(0, 1\)"):
        DATA.split(fraction)


@pytest.mark.parametrize("fraction", [0.01, 0.5, 0.99])
def test_every_split_keeps_a_window_on_each_side_and_loses_none(fraction):
    train, held = DATA.split(fraction)
    assert len(train) >= 1 and len(held) >= 1
    assert torch.equal(torch.cat([train.tokens, held.tokens]), DATA.tokens)


def test_a_dataset_of_one_window_cannot_be_split():
    with pytest.raises(TooFewTokensError, match="a split needs at least 2"):
        TokenDataset(DATA.tokens[:1]).split(0.5)


@pytest.mark.parametrize(("index", "batch_size", "match"), [(-1, 2, "batch index must be an int >= 0"),
                                                            (0, 0, "batch_size must be an int >= 1"),
                                                            (3, -2, "batch_size must be an int >= 1")])
def test_a_batch_index_or_size_out_of_range_is_refused(index, batch_size, match):
    with pytest.raises(ArgumentError, match=match):
        DATA.batch(index, batch_size)
    masked = TokenDataset(DATA.tokens, torch.ones_like(DATA.tokens, dtype=torch.bool))
    with pytest.raises(ArgumentError, match=match):
        masked.batch_targets(index, batch_size)


def test_a_set_built_on_a_bare_model_refuses_to_splice_by_name(model):
    m, hf = model
    bare = LorsaSet(hf, {LAYER: make_lorsa(hf, get_adapter(m), LAYER)})  # a set of a bare model: cached attribution
    with pytest.raises(ArgumentError, match="a replacement set built on a LlamaForCausalLM cannot splice"), \
            m.trace(random_ids(1, 5)):
        bare.replace(LAYER)
