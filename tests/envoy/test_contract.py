"""One replacement contract (issue 22): every kind's set is a ``ReplacementSet``, the bundle iterates its sets.

Lorsa, transcoder, SAE and cross-layer transcoder sets share the mapping, the kind check on insertion,
the splice chain (``site``), the width (``n_latents``), copy (``subset``) and the bundle's hooks
(``slot``, ``envoys``, ``feature_module``); ``ReplacementModel.replace`` splices whatever it holds in
model order, and ``remote.payload_report`` walks any set.
"""

from __future__ import annotations

import pytest
import torch
from helpers import make_clt, make_lorsa, make_sae, make_transcoder, tiny_nnsight, unembed

import nnsight_lorsa._placement as placement
from nnsight_lorsa import CLTSet, LorsaSet, ReplacementModel, SAESet, TranscoderSet, get_adapter
from nnsight_lorsa._placement import offloaded, set_offload
from nnsight_lorsa.envoy.replacement_set import ReplacementSet
from nnsight_lorsa.envoy.splice_chain import SpliceChain
from nnsight_lorsa.envoy.targets import Feature
from nnsight_lorsa.errors import ConfigMismatchError, LayerOutOfRangeError
from nnsight_lorsa.modules import ReplacementModule


@pytest.fixture(scope="module")
def tiny():
    model, hf = tiny_nnsight("llama")
    return model, hf, get_adapter(model)


def _sets(model, hf, adapter):
    return {
        "lorsas": LorsaSet(model, {1: make_lorsa(hf, adapter, 1)}),
        "transcoders": TranscoderSet(model, {0: make_transcoder(skip=False)}),
        "saes": SAESet(model, {"model.layers.0": make_sae()}),
        "clt": CLTSet(model, make_clt()),
    }


def test_every_kind_is_a_replacement_set_with_the_same_contract(tiny):
    model, hf, adapter = tiny
    sets = _sets(model, hf, adapter)
    for name, s in sets.items():
        assert isinstance(s, ReplacementSet), name
        for key in s:
            assert isinstance(s.site(key), SpliceChain), name
            assert s.n_latents(key) > 0
            assert s.holds(s[key]) and s.subset()[key] is s[key]
    clt = sets["clt"]
    assert list(clt) == ["clt"] and clt["clt"] is clt.clt and clt.slot == "transcoders"
    assert clt.n_latents("clt") == clt.clt.n_layers * clt.clt.cfg.d_sae
    assert [s.slot for s in sets.values()] == ["lorsas", "transcoders", "saes", "transcoders"]
    # a CLT's features are intervention targets: its layer's features (tests/patching/test_clt_feature_targets.py)
    assert clt.feature_module(Feature(0, 0, kind="transcoder")) is clt.clt and clt.feature_key(Feature(2, 0)) == "clt"
    with pytest.raises(LayerOutOfRangeError):  # named before anything is spliced
        ReplacementModel(model, transcoders=clt).prepare([Feature(clt.clt.n_layers, 3, kind="transcoder")])



def test_every_module_owns_its_weights_and_a_clt_layer_view_its_clts(tiny):
    """The module side of the contract: every kind is a ``ReplacementModule`` whose ``weights_owner`` (what
    placement and offload act on) is itself; a cross-layer transcoder's per-layer view (``CLTLayer``, what
    attribution reads per layer) computes with its CLT's weights, so its owner is that CLT."""
    model, hf, adapter = tiny
    sets = _sets(model, hf, adapter)
    for name, s in sets.items():
        for key in s:
            assert isinstance(s[key], ReplacementModule) and s[key].weights_owner is s[key], name
    skip = make_transcoder(skip=True)
    assert isinstance(skip, ReplacementModule) and skip.weights_owner is skip
    clt = sets["clt"].clt
    views = sets["clt"].by_layer()
    assert sorted(views) == list(range(clt.n_layers))
    for layer, view in views.items():
        assert isinstance(view, ReplacementModule) and view.layer == layer
        assert view.weights_owner is clt and view.weights_owner is not view
    for layer, tc in sets["transcoders"].by_layer().items():
        assert tc.weights_owner is tc is sets["transcoders"][layer]


@torch.no_grad()
def test_resident_owner_of_an_offloaded_clt_layer_moves_the_clts_weights(monkeypatch):
    """``resident(view.weights_owner, device)`` swaps the offloaded CLT's tensors for copies (``fetch`` made a
    real copy, as to another device) that the view computes with, and puts the CLT's host tensors back after;
    the view itself carries no offload marker, so ``resident`` of the view would move nothing."""
    clt = make_clt(n_layers=3, skip=True)
    set_offload(clt, True)
    view = clt.by_layer()[1]
    assert offloaded(view.weights_owner) and not offloaded(view)
    copies = []

    def fetch(t, device):
        copies.append(t.to(device).clone())
        return copies[-1]

    monkeypatch.setattr(placement, "fetch", fetch)
    host = dict(clt.named_parameters())
    x = torch.randn(2, 5, clt.cfg.d_in)
    expected, expected_skip = view.encode(x), view.skip(x)
    with placement.resident(view, torch.device("cpu")):  # the view: not offloaded, nothing moves
        assert not copies and view.W_enc.data_ptr() == host["W_enc"][1].data_ptr()
    with placement.resident(view.weights_owner, torch.device("cpu")):
        assert len(copies) == len(host)  # every parameter of the CLT, once
        moved = dict(clt.named_parameters())
        assert all(moved[name] is not t for name, t in host.items())
        assert view.W_enc.data_ptr() == moved["W_enc"][1].data_ptr() != host["W_enc"][1].data_ptr()
        assert torch.equal(view.encode(x), expected) and torch.equal(view.skip(x), expected_skip)
    assert all(p is host[name] for name, p in clt.named_parameters())  # the host tensors are back


@pytest.mark.parametrize(("set_type", "key", "make", "needle"), [
    (TranscoderSet, 0, make_sae, "TranscoderSet holds Transcoder"),
    (SAESet, "model.layers.0", lambda: make_transcoder(skip=False), "SAESet holds SparseAutoencoder"),
    (LorsaSet, 1, make_sae, "LorsaSet holds Lorsa"),
])
def test_a_set_refuses_a_module_of_another_kind_by_name(tiny, set_type, key, make, needle):
    model, _, _ = tiny
    s = set_type(model)
    with pytest.raises(ConfigMismatchError, match=needle):
        s[key] = make()
    assert key not in s


def test_a_bundle_of_lorsas_and_a_clt_splices_in_model_order_and_reproduces_the_model(tiny):
    """The bundle no longer splices a CLT first by kind: every set's modules go in model order; with error
    terms an unedited run is the model's bit for bit, an edit of the CLT's features changes it."""
    model, hf, adapter = tiny
    lorsas = {layer: make_lorsa(hf, adapter, layer) for layer in range(adapter.n_layers)}
    rm = ReplacementModel(model, lorsas=lorsas, transcoders=make_clt(n_layers=adapter.n_layers), error=True)
    assert isinstance(rm.transcoders, CLTSet) and [slot for slot, _ in rm.sets()] == ["lorsas", "transcoders"]
    ids = torch.randint(2, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), model.trace(ids):
        plain = unembed(model).output.save()
    with torch.no_grad(), model.trace(ids):
        sites = rm.replace()
        assert sorted(sites["lorsas"]) == list(range(adapter.n_layers))
        same = unembed(model).output.save()
    assert torch.equal(same, plain)
    with torch.no_grad(), model.trace(ids):
        sites = rm.replace()
        sites["transcoders"].hook_sae_acts_post[0].output[:] = 0  # the CLT's one envoy, not a dict
        edited = unembed(model).output.save()
    assert not torch.equal(edited, plain)


def test_payload_report_cuts_any_set_to_layers(tiny):
    from nnsight_lorsa.remote import payload_report

    model, _, _ = tiny
    tcs = TranscoderSet(model, {0: make_transcoder(skip=False), 1: make_transcoder(skip=False, seed=1)})
    report = payload_report(tcs, layers=[1])
    assert report.by_layer.keys() == {1}
    assert all(t.name.startswith("transcoders[1].") for t in report.tensors)


@pytest.mark.parametrize("error", ["False", "no", 0, 1, None, 0.0])
def test_a_bundles_error_flag_must_be_a_bool(error):
    """``ReplacementModel(..., error=...)`` is checked as ``replace(error=...)`` is: ``bool("False")`` is
    True, so a string silently spliced error terms the caller had turned off."""
    from nnsight_lorsa.errors import ArgumentError

    model, hf = tiny_nnsight("llama")
    with pytest.raises(ArgumentError, match=r"ReplacementModel\(error=.*must be True or False"):
        ReplacementModel(model, saes={"model.layers.1": make_sae()}, error=error)
    assert ReplacementModel(model, saes={"model.layers.1": make_sae()}, error=False).error is False
