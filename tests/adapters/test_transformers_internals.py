"""The private transformers (and torch) names behind nnsight_lorsa/adapters/transformers_internals.py: each is
pinned here, so that a transformers release that renames one fails this test naming the version, not a
gated-attention install or a sparse-model save somewhere else."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers import tiny_hf_model

from nnsight_lorsa.adapters import transformers_internals as ti
from nnsight_lorsa.errors import UnsupportedArchitectureError

VERSION = f"transformers {transformers.__version__}"


def test_the_private_names_exist():
    config = transformers.LlamaConfig()
    assert hasattr(config, "_attn_implementation_internal"), \
        f"{VERSION}: no PretrainedConfig._attn_implementation_internal"
    assert isinstance(type(config).__dict__.get("_attn_implementation")
                      or transformers.PretrainedConfig.__dict__.get("_attn_implementation"), property), \
        f"{VERSION}: PretrainedConfig._attn_implementation is not a property"
    for name in ("set_attn_implementation", "_can_set_attn_implementation"):
        assert callable(getattr(transformers.PreTrainedModel, name, None)), f"{VERSION}: no PreTrainedModel.{name}"
    assert isinstance(torch.nn.Module()._modules, dict), f"torch {torch.__version__}: nn.Module._modules is not a dict"
    from transformers import AttentionInterface  # noqa: F401  (public, but the gated function relies on it)
    from transformers.masking_utils import AttentionMaskInterface, eager_mask  # noqa: F401


def test_switching_the_implementation_and_recording_another_for_a_save(tmp_path):
    hf = tiny_hf_model("llama")
    assert ti.attn_implementation(hf) == "eager" == ti.attn_implementation(hf.config)
    assert ti.attn_implementation(object()) is None
    ti.set_attn_implementation(hf, "sdpa")
    assert ti.attn_implementation(hf) == "sdpa" and hf.model.layers[0].self_attn.config._attn_implementation == "sdpa"
    with ti.saved_attn_implementation(hf, "eager"):
        assert hf.config._attn_implementation == "eager"  # what save_pretrained writes
        hf.config.save_pretrained(tmp_path)
    assert ti.attn_implementation(hf) == "sdpa"
    assert transformers.AutoConfig.from_pretrained(tmp_path)._attn_implementation in (None, "eager")
    with pytest.raises(RuntimeError), ti.saved_attn_implementation(hf, "eager"):
        raise RuntimeError("restored on error too")
    assert ti.attn_implementation(hf) == "sdpa"
    with pytest.raises(UnsupportedArchitectureError, match="not a transformers model"):
        ti.set_attn_implementation(torch.nn.Linear(2, 2), "eager")


def test_children_by_name():
    attn = [torch.nn.Module(), torch.nn.Module()]
    gate = torch.nn.Linear(1, 1)
    attn[0].add_module("gate", gate)
    attn[1].gate = "not a module"  # an attribute of the same name is not a child
    assert ti.child(attn[0], "gate") is gate and ti.child(attn[1], "gate") is None
    with ti.children_removed(attn, "gate"):
        assert ti.child(attn[0], "gate") is None and "gate" not in dict(attn[0].named_children())
    assert ti.child(attn[0], "gate") is gate
    assert ti.remove_child(attn[0], "gate") is gate and ti.child(attn[0], "gate") is None
    with pytest.raises(KeyError):
        ti.remove_child(attn[0], "gate")
