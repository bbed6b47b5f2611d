"""An error node's activation is the norm of its error vector: ``‖MHSA(x) − Lorsa(x)‖`` / ``‖MLP(x) − transcoder(x)‖``
(the whole MLP output where a layer has no transcoder), per position — as ``NodeTable`` and the Neuronpedia export
document it. Every error node had activation 0 until 2026-11-29 (the layout made the tables without one and nothing
set it later). Reference: plain forward hooks on the Hugging Face model, the modules called directly."""

from __future__ import annotations

import pytest
import torch
from helpers import LAYER, attribution_setup, random_ids, rm

from nnsight_lorsa import attribute, get_adapter
from nnsight_lorsa.attribution import cache_for_attribution
from nnsight_lorsa.attribution.nodes import ATTN_ERROR, MLP_ERROR


def _reference(hf, adapter, lorsas, tcs, ids) -> dict[tuple[int, int], torch.Tensor]:
    """``{(kind, layer): (pos,) error norms}`` from one hooked forward."""
    seen: dict = {}
    handles = []
    for layer in range(adapter.n_layers):
        attn, mlp = adapter.attention_module(hf, layer), hf.get_submodule(adapter.mlp_path(layer))
        handles.append(attn.register_forward_pre_hook(
            lambda m, a, k, layer=layer: seen.update({("ai", layer): adapter.attention_input(a, k)}), with_kwargs=True))
        handles.append(attn.register_forward_hook(
            lambda m, a, out, layer=layer: seen.update({("ao", layer): out[0] if isinstance(out, tuple) else out})))
        handles.append(mlp.register_forward_hook(
            lambda m, a, out, layer=layer: seen.update({("mi", layer): a[0], ("mo", layer): out})))
    try:
        with torch.no_grad():
            hf(ids[None])
    finally:
        for h in handles:
            h.remove()
    want = {}
    with torch.no_grad():
        for layer in range(adapter.n_layers):
            if layer in lorsas:
                err = seen[("ao", layer)] - lorsas[layer](seen[("ai", layer)], torch.arange(ids.numel()))
                want[(ATTN_ERROR, layer)] = err[0].norm(dim=-1)
            mo = seen[("mo", layer)]
            err = mo - tcs[layer](seen[("mi", layer)]) if layer in tcs else mo
            want[(MLP_ERROR, layer)] = err[0].norm(dim=-1)
    return want


@pytest.mark.parametrize("family", ["llama", "gpt2", "neox", "qwen3"])
@pytest.mark.parametrize("engine", ["trace", "cache"])
def test_error_nodes_carry_the_norm_of_their_error_vectors(family, engine):
    model, hf, lorsas, tcs = attribution_setup(family)
    adapter = get_adapter(model)
    ids = random_ids(1, 7, seed=5)[0]
    r = rm(model, lorsas, tcs)
    prompt = cache_for_attribution(r, ids) if engine == "cache" else ids
    graph = attribute(r, prompt, max_feature_nodes=8, batch_size=4, progress=False)
    want = _reference(hf, adapter, lorsas, tcs, ids)
    nodes = graph.nodes
    checked = 0
    for (kind, layer), norms in want.items():
        at = ((nodes.kind == kind) & (nodes.layer == layer)).nonzero().flatten()
        assert at.numel() == ids.numel(), (kind, layer)  # every position's error node is in the graph
        got = torch.zeros(ids.numel())
        got[nodes.pos[at]] = nodes.activation[at]
        assert torch.allclose(got, norms.float(), rtol=1e-4, atol=1e-5), (kind, layer, got, norms)
        checked += 1
    assert checked == 1 + adapter.n_layers and LAYER in lorsas  # the Lorsa's attention error and every MLP's
