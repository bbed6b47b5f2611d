"""Attribution tests added by the fifth mutation probe (docs/reliability.md, "Mutation probe, round 5"): each kills
a mutant of the attribution engine (``engine.py``, ``cached.py``, ``nodes.py``, ``batch_fit.py``, ``frozen.py``,
``attribute.py``) that the existing tests let pass. References in plain torch (``torch.finfo``, the transcoder's own
``encode`` on a plain nnsight trace's MLP input) or the engine's stated contracts."""

from __future__ import annotations

import nnsight
import pytest
import torch
from helpers import attribution_setup, random_ids, rm
from hypothesis import given, settings
from hypothesis import strategies as st

from nnsight_lorsa.attribution import attribute, cache_for_attribution
from nnsight_lorsa.attribution.engine import narrowest
from nnsight_lorsa.attribution.graph import TRANSCODER
from nnsight_lorsa.errors import ConfigMismatchError

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@pytest.fixture(scope="module")
def llama():
    model, hf, lorsas, tcs = attribution_setup("llama")
    return model, hf, lorsas, tcs, random_ids(1, 8, seed=7)[0]


@settings(max_examples=20, deadline=None)
@given(model_dtype=st.sampled_from(FLOATS), module_dtypes=st.lists(st.sampled_from(FLOATS), max_size=3))
def test_a_graph_is_computed_in_the_least_precise_dtype(model_dtype, module_dtypes):
    """``narrowest`` (what ``Graph.meta["dtype"]`` reports for a call without ``dtype=``): the dtype of largest
    ``torch.finfo(...).eps`` among the model's and the replacement modules' parameters (mutant: the most precise)."""
    modules = {i: torch.nn.Linear(2, 2).to(d) for i, d in enumerate(module_dtypes)}
    want = max([model_dtype, *module_dtypes], key=lambda d: torch.finfo(d).eps)
    assert narrowest(model_dtype, modules) == want


def test_transcoder_node_activations_are_the_transcoders_own_encoding(llama):
    """Each transcoder node's ``activation`` is its feature's activation on the prompt to fp32 rounding: the
    transcoder's own ``encode`` of the MLP input saved in a plain nnsight trace (mutant: activations stored through
    fp16, 5e-4 relative)."""
    model, _, lorsas, tcs, ids = llama
    g = attribute(rm(model, lorsas, tcs), ids, batch_size=40)
    mlp_in = {}
    with model.trace(ids[None]):
        for layer in sorted(tcs):
            mlp_in[layer] = nnsight.save(model.model.layers[layer].mlp.input)
    n = g.nodes
    for layer, tc in tcs.items():
        acts = tc.encode(mlp_in[layer].detach()[0]).detach()
        at = (n.kind == TRANSCODER) & (n.layer == layer)
        assert int(at.sum()) == int((acts != 0).sum())
        torch.testing.assert_close(n.activation[at], acts[n.pos[at], n.index[at]], rtol=1e-6, atol=0.0)


def test_a_cache_without_the_last_layers_mlp_output_is_refused_by_name(llama):
    """A cache missing any layer's ``mlp_out`` — the last one too — is refused before anything runs with a
    ``ConfigMismatchError`` naming it, not a ``KeyError`` from inside the frozen pass (mutant: the check's range
    stops one layer short)."""
    model, _, lorsas, tcs, ids = llama
    cache = cache_for_attribution(rm(model, lorsas, tcs), ids)
    last = model.config.num_hidden_layers - 1
    del cache.mlp_out[last]
    with pytest.raises(ConfigMismatchError, match=rf"mlp_out\[{last}\]"):
        attribute(rm(model, lorsas, tcs), cache, batch_size=40)


def test_in_dtype_casts_every_floating_tensor_of_every_cache_field():
    """``cached.in_dtype`` (a traced pass attributed with ``dtype=`` other than the model's): every field of
    :class:`AttributionCache`, read from the dataclass here, comes back with its floating tensors in the dtype and its
    ids untouched (mutant 22: ``mlp_post_out`` left out of the fields it cast)."""
    import dataclasses

    from nnsight_lorsa.attribution.cached import in_dtype
    from nnsight_lorsa.attribution.trace import AttributionCache

    kw: dict = {}
    for f in dataclasses.fields(AttributionCache):
        if f.name == "tokens":
            kw[f.name] = torch.arange(4)
        elif f.name in ("positions", "last_logits", "embeddings"):
            kw[f.name] = torch.arange(4) if f.name == "positions" else torch.randn(4)
        else:
            kw[f.name] = {1: torch.randn(1, 4, 3), 2: torch.randn(1, 4, 3)}
    got = in_dtype(AttributionCache(**kw), torch.float64)
    for f in dataclasses.fields(AttributionCache):
        a, b = getattr(got, f.name), kw[f.name]
        pairs = list(zip(a.values(), b.values(), strict=True)) if isinstance(b, dict) else [(a, b)]
        for x, y in pairs:
            assert x.dtype == (torch.float64 if y.is_floating_point() else y.dtype), f.name
            assert torch.equal(x, y.to(x.dtype)), f.name
