"""Mutation probe, round 11 (docs/reliability.md): attribution from a cache (``attribution/cached.py``), round 10's
unrun mutants and a few more; each test seen failing with the mutant it names and passing without.
"""

from __future__ import annotations

import pytest
from helpers import attribution_setup, random_ids, rm

from nnsight_lorsa.attribution import attribute, cache_for_attribution
from nnsight_lorsa.errors import ConfigMismatchError, ShapeError


@pytest.fixture(scope="module")
def llama():
    model, hf, lorsas, tcs = attribution_setup("llama")
    ids = random_ids(1, 8, seed=7)[0]
    return model, lorsas, tcs, cache_for_attribution(rm(model, lorsas, tcs), ids)


def _copy(cache):
    import dataclasses

    return dataclasses.replace(cache, **{f.name: dict(getattr(cache, f.name)) for f in dataclasses.fields(cache)
                                         if isinstance(getattr(cache, f.name), dict)})


@pytest.mark.parametrize("name", ["attn_in", "attn_out"])
def test_a_cache_without_a_lorsa_layers_attention_tensors_is_refused_by_name(llama, name):
    """``check_cache``'s rule: a tensor a replacement layer needs and the cache lacks is a ``ConfigMismatchError``
    naming it, before anything runs; a Lorsa layer needs its attention's input and its true output (its error node)
    (mutant C4: ``attn_out`` not required: the frozen pass took the attention's *input* as its true output and
    returned a graph with a wrong error node)."""
    model, lorsas, tcs, cache = llama
    (layer,) = lorsas
    bad = _copy(cache)
    del getattr(bad, name)[layer]
    with pytest.raises(ConfigMismatchError, match=rf"{name}\[{layer}\]"):
        attribute(rm(model, lorsas, tcs), bad, batch_size=40)


@pytest.mark.parametrize("name", ["embeddings", "attn_in", "attn_out", "mlp_out"])
def test_a_cache_of_two_prompts_is_refused_by_shape(llama, name):
    """``check_cache``'s rule: every tensor is ``(1, pos, d_model)`` — one prompt; a cache tensor with a batch of two
    is a ``ShapeError`` naming it, before anything runs (mutant C5: the shape checked on its last two dims only)."""
    model, lorsas, tcs, cache = llama
    (layer,) = lorsas
    bad = _copy(cache)
    if name == "embeddings":
        bad.embeddings = cache.embeddings.expand(2, -1, -1).clone()
    else:
        getattr(bad, name)[layer] = getattr(cache, name)[layer].expand(2, -1, -1).clone()
    with pytest.raises(ShapeError, match=rf"cache\.{name}.* must be \(1, "):
        attribute(rm(model, lorsas, tcs), bad, batch_size=40)
