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

from nnsight_lorsa import CLTSet, LorsaSet, ReplacementModel, SAESet, TranscoderSet, get_adapter
from nnsight_lorsa.envoy.replacement_set import ReplacementSet
from nnsight_lorsa.envoy.splice_chain import SpliceChain
from nnsight_lorsa.envoy.targets import Feature
from nnsight_lorsa.errors import ConfigMismatchError


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
    with pytest.raises(ConfigMismatchError, match="not intervention targets"):
        clt.feature_module(Feature(0, 0, kind="transcoder"))


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
