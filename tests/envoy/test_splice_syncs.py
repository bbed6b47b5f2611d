"""The splices inside ``model.trace`` / ``model.generate`` and the patching edits sync nothing with the host.

A trace over a tiny Llama held on ``meta`` under the dispatch-mode spy (``helpers.sync_spy``): every host-to-device
copy and every device-to-host read made in the trace is counted, and the trace with a set's replacement spliced
in (every kind, with and without ``error=True``) must count as many as the plain trace (nnsight's and
transformers' own: the input ids' copy), and none of ours. The refusal of modules held on ``meta`` is lifted for
the spy (``_placement.placement``). ``generate`` cannot run on ``meta`` (transformers reads token values): there
the model runs on the CPU and the spy records the device-to-host reads made by nnsight_lorsa's code.

The patching edits read their value on the host when it is there: a steering vector built on the CPU is checked
there and copied once (one copy per tensor-valued edit, the value the caller gave); before, it was copied first and
its finiteness read back from the model's device, a stall in the middle of the forward.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import ACTIVATION_PARAMS, make_lorsa, meta_placement, random_ids, sync_spy, tiny_nnsight

import nnsight_lorsa._placement as placement_module
from nnsight_lorsa import CLTSet, LorsaSet, ReplacementModel, SAESet, TranscoderSet, get_adapter
from nnsight_lorsa.envoy import Feature, LorsaHead, MHSAHead
from nnsight_lorsa.modules import (
    CLTConfig,
    CrossLayerTranscoder,
    SAEConfig,
    SkipTranscoder,
    SparseAutoencoder,
    Transcoder,
    TranscoderConfig,
)
from nnsight_lorsa.modules.activations import BatchTopK
from nnsight_lorsa.patching import ablate, scale, steer
from nnsight_lorsa.sparse_attention import install_gated_attention

PARAMS = ACTIVATION_PARAMS


@pytest.fixture
def meta_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let the splice run modules held on ``meta`` (it refuses them: their weights were never loaded)."""

    monkeypatch.setattr(placement_module, "placement", meta_placement)


def _coder(act: str, d: int, skip: bool = False) -> Transcoder:
    t = (SkipTranscoder if skip else Transcoder)(TranscoderConfig(d_in=d, d_sae=64, activation=act,
                                                                  activation_params=PARAMS[act]))
    return _thresholded(t)


def _thresholded(module: torch.nn.Module) -> torch.nn.Module:
    for m in module.modules():
        if isinstance(m, BatchTopK):
            m.set_threshold(0.1)
    return module.eval()


def _build(kind: str, model, hf, adapter):  # type: ignore[no-untyped-def]
    d = adapter.d_model
    if kind == "lorsa":
        s = LorsaSet(model, {1: make_lorsa(hf, adapter)})
        return s, lambda error: s.replace(layer=1, error=error), [s[1]]
    if kind.startswith("transcoder-"):
        t = _coder(kind.split("-")[1], d, skip=kind.endswith("jumprelu"))
        s = TranscoderSet(model, {0: t})
        return s, lambda error: s.replace(layer=0, error=error), [t]
    if kind.startswith("sae-"):
        sae = _thresholded(SparseAutoencoder(SAEConfig(d_in=d, d_sae=64, activation=kind.split("-")[1],
                                                       activation_params=PARAMS[kind.split("-")[1]])))
        s = SAESet(model, {"model.layers.1": sae})
        return s, lambda error: s.replace(error=error), [sae]
    clt = _thresholded(CrossLayerTranscoder(CLTConfig(d_in=d, d_sae=32, n_layers=adapter.n_layers,
                                                      activation=kind.split("-")[1],
                                                      activation_params=PARAMS[kind.split("-")[1]])))
    s = CLTSet(model, clt)
    return s, lambda error: s.replace(error=error), [clt]


KINDS = ["lorsa", *(f"transcoder-{a}" for a in PARAMS), "sae-jumprelu", "sae-batchtopk", "clt-jumprelu",
         "clt-batchtopk"]


def _meta_setup():  # type: ignore[no-untyped-def]
    model, hf = tiny_nnsight("llama")
    return model, hf, get_adapter(model)


def _plain(model, ids):  # type: ignore[no-untyped-def]
    with torch.no_grad(), sync_spy() as spy, model.trace(ids):
        model.output.save()
    return spy


@pytest.mark.usefixtures("meta_modules")
@pytest.mark.parametrize("error", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_splice_in_a_trace_syncs_nothing(kind: str, error: bool) -> None:
    model, hf, adapter = _meta_setup()
    _, replace, modules = _build(kind, model, hf, adapter)
    hf.to("meta")
    for m in modules:
        m.to("meta")
    ids = random_ids().to("meta")
    plain = _plain(model, ids)
    with torch.no_grad(), sync_spy() as spy, model.trace(ids):
        replace(error)
        model.output.save()
    assert spy.reads == plain.reads == [], f"device-to-host reads with {kind} spliced: {spy.reads}"
    assert len(spy.copies) == len(plain.copies), f"host-to-device copies with {kind} spliced: {spy.copies}"


@pytest.mark.parametrize("error", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_splice_in_generate_reads_nothing_back(kind: str, error: bool) -> None:
    model, hf, adapter = _meta_setup()
    _, replace, _ = _build(kind, model, hf, adapter)
    with torch.no_grad(), sync_spy(host_reads_anywhere=True) as spy, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with model.generate(random_ids(), max_new_tokens=3):
            replace(error)
    assert spy.reads == [], f"reads by nnsight_lorsa's code in generate with {kind} spliced: {spy.reads}"


@pytest.mark.usefixtures("meta_modules")
def test_replacement_model_and_edits_sync_only_the_given_value() -> None:
    """``ReplacementModel.replace`` (a Lorsa, a transcoder, an SAE, error terms) and ablate / scale / steer on every
    target kind: no read, and one copy, the steering vector the caller built on the host."""
    model, hf, adapter = _meta_setup()
    t = _coder("topk", adapter.d_model)
    sae = _thresholded(SparseAutoencoder(SAEConfig(d_in=adapter.d_model, d_sae=64, activation="jumprelu")))
    lorsas = LorsaSet(model, {1: make_lorsa(hf, adapter)})
    r = ReplacementModel(model, lorsas=lorsas, transcoders=TranscoderSet(model, {0: t}),
                         saes=SAESet(model, {"model.layers.1": sae}), error=True)
    hf.to("meta")
    for m in (t, sae, lorsas[1]):
        m.to("meta")
    ids = random_ids().to("meta")
    plain = _plain(model, ids)
    delta = torch.ones(adapter.head_dim)
    with torch.no_grad(), sync_spy() as spy, model.trace(ids):
        r.replace()
        ablate(r(MHSAHead(0, 2)))
        scale(r(MHSAHead(0, 0)), -2.0, positions=[1, 3])
        steer(r(MHSAHead(0, 1)), delta)
        steer(r(Feature(0, 7, kind="transcoder")), 1.5)
        ablate(r(LorsaHead(1, 3)))
        scale(r(LorsaHead(1, 5)), 3.0, positions=-1)
        steer(r(LorsaHead(1, 6)), 0.5)
        ablate(r(Feature("model.layers.1", 4)))
        model.output.save()
    assert spy.reads == [], f"device-to-host reads in the edited trace: {spy.reads}"
    ours = [c for c in spy.copies if "(not ours)" not in c]
    assert len(spy.copies) == len(plain.copies) + 1 and len(ours) == 1 and "[(16,)]" in ours[0], spy.copies


@pytest.mark.usefixtures("meta_modules")
@pytest.mark.parametrize("mode", ["gated", "dense", "topk"])
def test_gated_attention_in_a_trace_syncs_nothing(mode: str) -> None:
    model, hf, _ = _meta_setup()
    install_gated_attention(model, init_bias=1.0, mode=mode)
    hf.to("meta")
    ids = random_ids().to("meta")
    plain = _plain(model, ids)
    with torch.no_grad(), sync_spy() as spy, model.trace(ids):
        model.output.save()
    assert spy.reads == plain.reads == [] and len(spy.copies) == len(plain.copies), spy.copies


@pytest.mark.parametrize("edit", ["steer", "scale"])
def test_edit_of_an_fp16_model_checks_a_host_value_on_the_host(edit: str) -> None:
    """A narrowing value (fp32 on an fp16 model) is range-checked after its cast: on the host, not on the device."""
    model, hf = tiny_nnsight("llama", dtype=torch.float16)
    r = ReplacementModel(model)
    hf.to("meta")
    ids = random_ids().to("meta")
    plain = _plain(model, ids)
    value = torch.linspace(-2.0, 2.0, get_adapter(model).head_dim)
    with torch.no_grad(), sync_spy() as spy, model.trace(ids):
        (steer if edit == "steer" else scale)(r(MHSAHead(0, 1)), value)
        model.output.save()
    assert spy.reads == [], f"device-to-host reads in a {edit} of an fp16 model: {spy.reads}"
    assert len(spy.copies) == len(plain.copies) + 1, spy.copies


@pytest.mark.usefixtures("meta_modules")
@pytest.mark.parametrize("error", [False, True])
@pytest.mark.parametrize("seq", [3, 10])
def test_a_lorsa_on_a_sliding_layer_syncs_nothing(seq: int, error: bool) -> None:
    """Gemma-2 (eager: every layer's mask a tensor), Lorsas on sliding layers 0 and 2 and full layer 1, a prompt
    shorter / longer than the window: was one read per sliding layer per forward (``bool(tokens.all())``)."""
    model, hf = tiny_nnsight("gemma2")
    adapter = get_adapter(model)
    assert [adapter.sliding_window(layer) for layer in range(3)] == [4, None, 4]
    s = LorsaSet(model, {layer: make_lorsa(hf, adapter, layer) for layer in range(3)})
    hf.to("meta")
    for layer in range(3):
        s[layer].to("meta")
    ids = random_ids(seq=seq).to("meta")
    plain = _plain(model, ids)
    with torch.no_grad(), sync_spy() as spy, model.trace(ids):
        s.replace(error=error)
        model.output.save()
    assert spy.reads == plain.reads == [], f"device-to-host reads with Lorsas on sliding layers: {spy.reads}"
    assert len(spy.copies) == len(plain.copies), spy.copies


@pytest.mark.parametrize("padded", [False, True])
def test_a_lorsa_on_a_sliding_layer_reads_nothing_back_in_generate(padded: bool) -> None:
    model, hf = tiny_nnsight("gemma2")
    adapter = get_adapter(model)
    s = LorsaSet(model, {layer: make_lorsa(hf, adapter, layer) for layer in range(3)})
    ids = random_ids(seq=6)
    mask = torch.ones_like(ids)
    if padded:
        ids[0, :2], mask[0, :2] = 1, 0
    with torch.no_grad(), sync_spy(host_reads_anywhere=True) as spy, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with model.generate({"input_ids": ids, "attention_mask": mask}, max_new_tokens=5, do_sample=False,
                            pad_token_id=1):
            s.replace()
    assert spy.reads == [], f"reads by nnsight_lorsa's code in generate with Lorsas on sliding layers: {spy.reads}"
