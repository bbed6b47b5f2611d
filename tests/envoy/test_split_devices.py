"""A model split over two devices (issue 21, goal 1: "models split over devices"): the test model on ``home``
with decoder layer 1 moved by hand to ``other`` (hooks move the layer's inputs there and its output back, as
accelerate's ``device_map`` dispatch does), CUDA and the CPU either way round.

* ``from_pretrained`` of every set kind (Lorsas, transcoders, SAEs, a CLT) and a module put in by item
  assignment each land on their own site's device (layer 1's on ``other``, the rest on ``home``; the CLT on its
  first MLP's, as ``CLTSet`` documents), in the model's dtype from files (the dtype kept on assignment);
* ``replace(error=True)`` with no edit gives the plain split model's logits bit for bit (fp32, bf16, fp16);
* without error terms (fp32) the logits equal those of the same replacements on the model wholly on ``home``
  within ``DEVICE_REL`` (1e-4 of max |logit|: layer 1's kernels run on the other device), and differ from the
  plain logits (not vacuous).

A split needs CUDA (two kinds of device), so the split cases are ``gpu`` cases, marked like ``helpers.DEVICES``'
CUDA one. The ``cpu-cpu`` case runs the same body with both halves on the CPU (no split: the device assertions
hold trivially there; it keeps the body, its hooks and its bounds exercised where no GPU is).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from helpers import (
    DEVICES,
    LAYER,
    make_clt,
    make_lorsa,
    make_sae,
    make_transcoders,
    tiny_hf_model,
    tiny_nnsight,
    unembed,
)

from nnsight_lorsa import CLTSet, LorsaSet, ReplacementModel, SAESet, TranscoderSet, get_adapter

GPU_ONLY = DEVICES[1].marks  # gpu-marked, skipped without CUDA
DEVICE_REL = 1e-4
SAE_SITES = ("model.layers.0", "model.layers.1")


def _move(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, tuple | list):
        return type(x)(_move(v, device) for v in x)
    if isinstance(x, dict):
        return {k: _move(v, device) for k, v in x.items()}
    return x  # a cache object: each layer keeps its own entries, on its own device


def split(hf: torch.nn.Module, layer: int, other: str) -> None:
    """Decoder layer ``layer`` of ``hf`` moved to ``other``, its inputs moved there and its output back."""
    home = next(hf.parameters()).device
    block = hf.model.layers[layer]
    block.to(other)
    block.register_forward_pre_hook(lambda m, args, kwargs: (_move(args, torch.device(other)),
                                                             _move(kwargs, torch.device(other))), with_kwargs=True)
    block.register_forward_hook(lambda m, args, out: _move(out, home))


def _modules() -> dict[str, Any]:
    """fp32 CPU modules of every kind, from the fp32 twin of the test model."""
    hf = tiny_hf_model("llama")
    adapter = get_adapter(hf)
    return {"lorsas": {layer: make_lorsa(hf, adapter, layer) for layer in range(adapter.n_layers)},
            "transcoders": make_transcoders(range(adapter.n_layers), skip_layer=1),
            "saes": {site: make_sae(seed=i) for i, site in enumerate(SAE_SITES)},
            "clt": make_clt(adapter.n_layers, skip=True)}


def _saved(tmp_path) -> dict[str, Any]:
    """Every kind saved as its set (the fp32 CPU model's), for ``from_pretrained``."""
    model, _ = tiny_nnsight("llama")
    m = _modules()
    sets = {"lorsas": LorsaSet(model, m["lorsas"]), "transcoders": TranscoderSet(model, m["transcoders"]),
            "saes": SAESet(model, m["saes"]), "clt": CLTSet(model, m["clt"])}
    for name, rset in sets.items():
        rset.save(tmp_path / name)
    return {name: tmp_path / name for name in ("lorsas", "transcoders", "saes", "clt")}


def _logits(model, ids, rm=None):
    with torch.no_grad(), model.trace(ids):
        if rm is not None:
            rm.replace()
        out = unembed(model).output.save()
    return out


def _rebound(model, kwargs: dict) -> dict:
    """Copies of the sets' modules in sets of ``model``."""
    out: dict[str, Any] = {}
    for slot, rset in kwargs.items():
        if isinstance(rset, CLTSet):
            out[slot] = CLTSet(model, copy.deepcopy(rset.clt))
        else:
            out[slot] = type(rset)(model, {k: copy.deepcopy(v) for k, v in rset.items()})
    return out


def _site_layer(key: Any) -> int:
    return key if isinstance(key, int) else int(str(key).split(".")[2])


def check_split(home: str, other: str, dtype: torch.dtype, tmp_path) -> None:
    """The checks of the module docstring for the test model on ``home`` with layer 1 on ``other``."""
    model, hf = tiny_nnsight("llama", device=home, dtype=dtype)
    split(hf, LAYER, other)
    where = {layer: torch.device(other if layer == LAYER else home).type for layer in range(3)}
    paths = _saved(tmp_path)
    sets = {"lorsas": LorsaSet.from_pretrained(model, paths["lorsas"]),
            "transcoders": TranscoderSet.from_pretrained(model, paths["transcoders"]),
            "saes": SAESet.from_pretrained(model, paths["saes"]),
            "clt": CLTSet.from_pretrained(model, paths["clt"])}
    for name in ("lorsas", "transcoders", "saes"):
        assert sorted(map(str, sets[name])) == sorted(map(str, _modules()[name])), name
        for key, module in sets[name].items():
            assert {(p.device.type, p.dtype) for p in module.parameters()} == {(where[_site_layer(key)], dtype)}, \
                (name, key)
    assert {(p.device.type, p.dtype) for p in sets["clt"].clt.parameters()} == {(where[0], dtype)}
    fresh = _modules()  # item assignment: placed on the site's device, the module's dtype (fp32) kept
    for name in ("lorsas", "transcoders", "saes"):
        for key in list(sets[name]):
            sets[name][key] = fresh[name][key]
            assert {(p.device.type, p.dtype) for p in fresh[name][key].parameters()} == \
                {(where[_site_layer(key)], torch.float32)}, (name, key)

    ids = torch.randint(2, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    plain = _logits(model, ids)
    assert plain.device.type == torch.device(home).type
    bundles = [{"lorsas": sets["lorsas"], "transcoders": sets["transcoders"], "saes": sets["saes"]},
               {"lorsas": sets["lorsas"], "transcoders": sets["clt"]}]
    for kwargs in bundles:
        rm = ReplacementModel(model, **kwargs, error=True)
        assert torch.equal(_logits(model, ids, rm), plain), sorted(kwargs)
        rm.error = False
        got = _logits(model, ids, rm)
        assert not torch.equal(got, plain), sorted(kwargs)
        if dtype == torch.float32:  # the same replacements on the model wholly on ``home``
            whole, _ = tiny_nnsight("llama", device=home, dtype=dtype)
            want = _logits(whole, ids, ReplacementModel(whole, **_rebound(whole, kwargs), error=False))
            err = float((got.double().cpu() - want.double().cpu()).abs().max() / want.double().abs().max())
            assert err <= DEVICE_REL, (sorted(kwargs), err)


@pytest.mark.parametrize(("home", "other"), [pytest.param("cuda", "cpu", marks=GPU_ONLY),
                                             pytest.param("cpu", "cuda", marks=GPU_ONLY),
                                             ("cpu", "cpu")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_a_model_split_over_two_devices_places_each_module_on_its_layers_device(home, other, dtype, tmp_path):
    check_split(home, other, dtype, tmp_path)
