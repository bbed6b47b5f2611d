"""Mutation probe, round 10 (adapters, the registry, transformers internals, small helpers): each test here was
seen failing with a hand-made mutant of the code it names and passing without (docs/reliability.md, "Mutation
probe, round 10: architecture adapters, SAELens releases and small helpers")."""

from __future__ import annotations

import types

import pytest
import torch
import transformers
from helpers import tiny_hf_model

from nnsight_lorsa.adapters import transformers_internals as ti
from nnsight_lorsa.adapters.gpt2 import GPT2Adapter
from nnsight_lorsa.adapters.registry import ADAPTERS, get_adapter
from nnsight_lorsa.errors import ConfigMismatchError, LayerOutOfRangeError


def test_get_adapter_takes_the_unembedding_path_from_the_models_own_get_output_embeddings():
    """transformers 4 and early 5 keep GPT-NeoX's unembedding at ``embed_out``, later ones at ``lm_head``: the
    adapter of a model names the module ``get_output_embeddings()`` returns, whatever the installed version's
    default (``registry.py``: the path read from the model)."""
    hf = tiny_hf_model("neox")
    head = hf._modules.pop("lm_head")
    hf.add_module("embed_out", head)
    hf.get_output_embeddings = lambda: hf.embed_out  # as GPTNeoXForCausalLM of transformers 4
    adapter = get_adapter(hf)
    assert adapter.lm_head_path == "embed_out"
    assert adapter.get_module(hf, adapter.lm_head_path) is head
    x = torch.randn(2, hf.config.hidden_size)
    torch.testing.assert_close(adapter.get_module(hf, adapter.lm_head_path)(x), x @ head.weight.T)


def test_family_names_are_distinct_and_each_model_types_own():
    """A checkpoint's ``architecture`` is an adapter's ``family`` (``formats/validate.adapter_families``): two adapters
    sharing one would make a Gemma-1 Lorsa read as Gemma-2's, and a Gemma-1 file saying ``"gemma"`` refused."""
    families = [a.family for a in ADAPTERS]
    assert len(set(families)) == len(families), families
    expected = {"llama": "llama", "gpt_neox": "gpt_neox", "gpt2": "gpt2", "gemma": "gemma", "gemma2": "gemma2",
                "gemma3_text": "gemma3", "olmo2": "olmo2", "phi3": "phi3"}  # what Lorsa files' `architecture` holds
    for model_type, family in expected.items():
        assert get_adapter(types.SimpleNamespace(model_type=model_type, num_hidden_layers=1)).family == family


def test_children_removed_puts_back_every_modules_child():
    """Saving a gated model takes the gate off every attention module (``children_removed``): all come back, not
    only the first module's."""
    mods = [torch.nn.Module() for _ in range(3)]
    gates = [torch.nn.Linear(1, 1) for _ in range(3)]
    for m, g in zip(mods, gates, strict=True):
        m.add_module("gate", g)
    with ti.children_removed(mods, "gate"):
        assert all(ti.child(m, "gate") is None for m in mods)
    assert [ti.child(m, "gate") for m in mods] == gates


def test_remove_child_refuses_a_name_that_holds_no_module():
    """``register_module(name, None)`` keeps the name with no module: ``remove_child`` raises ``KeyError`` as
    documented (not return None to a caller that then puts None back or calls it)."""
    m = torch.nn.Module()
    m.register_module("gate", None)
    with pytest.raises(KeyError):
        ti.remove_child(m, "gate")


def _gpt2_without_scaling(**config: bool) -> tuple[torch.nn.Module, list[float]]:
    """A tiny GPT-2 whose attention modules lack ``scaling`` (as transformers 4's), and the scale each layer's
    ``GPT2Attention.__init__`` of this transformers computed from the same config (the reference)."""
    cfg = transformers.GPT2Config(n_embd=32, n_head=4, n_layer=3, vocab_size=50, n_positions=16, bos_token_id=0,
                                  eos_token_id=0, **config)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    scales = []
    for block in hf.transformer.h:
        scales.append(float(block.attn.scaling))
        del block.attn.scaling
    return hf, scales


@pytest.mark.parametrize("weights", [True, False])
@pytest.mark.parametrize("inverse", [False, True])
def test_a_gpt2_without_scaling_gets_the_scale_transformers_computes_from_its_config(weights, inverse):
    """Without ``GPT2Attention.scaling`` (transformers 4) the adapter computes the scale from the config:
    ``head_dim ** -0.5`` only if ``scale_attn_weights``, divided by ``layer + 1`` if
    ``scale_attn_by_inverse_layer_idx`` — what ``GPT2Attention.__init__`` sets as ``scaling`` here."""
    hf, scales = _gpt2_without_scaling(scale_attn_weights=weights, scale_attn_by_inverse_layer_idx=inverse)
    adapter = get_adapter(hf)
    for layer, expected in enumerate(scales):
        assert adapter.mhsa_weights(hf, layer).scale == pytest.approx(expected, rel=1e-12)
        assert adapter.attention_scale(layer) == pytest.approx(expected, rel=1e-12)


def test_attention_scale_refuses_a_layer_the_model_does_not_have():
    adapter = GPT2Adapter(transformers.GPT2Config(n_embd=32, n_head=4, n_layer=3, scale_attn_by_inverse_layer_idx=True))
    for layer in (3, -1):
        with pytest.raises(LayerOutOfRangeError):
            adapter.attention_scale(layer)


@pytest.mark.parametrize("impl", ["sdpa", "flex_attention", "flash_attention_2"])
def test_a_gpt2_without_scaling_under_any_non_eager_attention_is_refused_when_it_ignores_the_config(impl):
    """transformers 4's non-eager GPT-2 attention (SDPA, flash, flex) uses ``head_dim ** -0.5`` whatever the
    config says: a config whose scale differs is refused under every one of them, accepted under eager."""
    hf, _ = _gpt2_without_scaling(scale_attn_by_inverse_layer_idx=True)
    adapter = get_adapter(hf)
    adapter.mhsa_weights(hf, 1)  # eager: the config's scale is the one applied
    hf.config._attn_implementation_internal = impl
    with pytest.raises(ConfigMismatchError, match=impl):
        adapter.mhsa_weights(hf, 1)
