"""``ArchitectureAdapter.layer_of_path``: every module inside decoder layer L's block names L, in every family;
paths outside every layer (the embedding, the final norm, the unembedding) and paths naming no layer of the model
name none. ``for_remote(layers=...)`` ships an SAE by it (tests/test_remote.py)."""

from __future__ import annotations

import pytest
from helpers import FAMILIES, tiny_hf_model

from nnsight_lorsa import get_adapter


@pytest.mark.parametrize("family", FAMILIES)
def test_every_module_of_a_layer_names_that_layer_and_no_other_module_names_one(family: str) -> None:
    hf = tiny_hf_model(family)
    adapter = get_adapter(hf)
    own = {}
    for layer in range(adapter.n_layers):
        prefix = adapter.layer_path(layer)
        for name, _ in hf.named_modules():
            if name == prefix or name.startswith(prefix + "."):
                own[name] = layer
    assert set(own.values()) == set(range(adapter.n_layers))
    for name, _ in hf.named_modules():
        assert adapter.layer_of_path(name) == own.get(name), name
    for layer in range(adapter.n_layers):
        for path in (adapter.attention_path(layer), adapter.mlp_path(layer)):
            assert adapter.layer_of_path(path) == layer
    base = adapter.layers_path
    for path in (f"{base}.{adapter.n_layers}", f"{base}.01", f"{base}.-1", f"{base}.x", f"{base}", f"{base}x.1",
                 f"{base}.\u0662", "", adapter.lm_head_path):
        assert adapter.layer_of_path(path) is None, path
