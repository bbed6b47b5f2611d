"""Every entry point that takes a ``ReplacementModel`` refuses anything else with our ``ArgumentError`` naming the
function, before any other use of it: a set, the bare nnsight model or a module passed in its place was an
``AttributeError`` / ``TypeError`` from deep inside (``'LorsaSet' object has no attribute 'require'``), and
``head_swap(model, ...)`` read its arguments in the wrong places (torch's ``embedding()`` refusing a ``LorsaHead``).

The patching functions are annotated ``replacement: ReplacementModel``, which the tests' import hook (beartype)
checks first: they are called unwrapped here, as a researcher's code (no hook) calls them."""

from __future__ import annotations

import inspect

import pytest
from helpers import LAYER, make_lorsa, make_sae, make_transcoder, random_ids, tiny_nnsight

from nnsight_lorsa import LorsaSet, ReplacementModel, TranscoderSet, attribute, get_adapter
from nnsight_lorsa import analysis as A
from nnsight_lorsa import patching as P
from nnsight_lorsa.attribution import cache_for_attribution, circuit_metrics, estimate_memory, qk_attribution
from nnsight_lorsa.errors import ArgumentError
from nnsight_lorsa.patching import LorsaHead
from nnsight_lorsa.remote import for_remote, model_dtype
from nnsight_lorsa.viz import head_dashboard_data

ENTRY_POINTS = {
    "activation_patching": lambda r: P.activation_patching(r, None, None, []),
    "ablation_effect": lambda r: P.ablation_effect(r, None, []),
    "random_ablation_control": lambda r: P.random_ablation_control(r, None, [], 1),
    "head_swap": lambda r: P.head_swap(r, LAYER, 0, 1, None),
    "mean_activations": lambda r: P.mean_activations(r, [], None),
    "path_patching": lambda r: P.path_patching(r, None, []),
    "circuit_size": lambda r: P.circuit_size(r, None, []),
    "mhsa_correlation": lambda r: A.mhsa_correlation(r, LAYER, None),
    "ov_logit_lens": lambda r: A.ov_logit_lens(r, LAYER),
    "collect_top_activations": lambda r: A.collect_top_activations(r, LAYER, None),
    "qk_feature_impacts": lambda r: A.qk_feature_impacts(r, LAYER, 0, None, None),
    "attribute": lambda r: attribute(r, random_ids(1, 5)[0]),
    # 2026-11-29, fourth session: these read the argument's attributes first ("'LorsaSet' object has no attribute
    # 'lorsas'" / "'require'" / "'sets'")
    "estimate_memory": lambda r: inspect.unwrap(estimate_memory)(r, random_ids(1, 5)[0]),
    "cache_for_attribution": lambda r: inspect.unwrap(cache_for_attribution)(r, random_ids(1, 5)[0]),
    "qk_attribution": lambda r: inspect.unwrap(qk_attribution)(r, random_ids(1, 5)[0], layer=LAYER, head=0,
                                                               query_pos=3, key_pos=1),
    "circuit_metrics": lambda r: inspect.unwrap(circuit_metrics)(r, None, None),
    "head_dashboard_data": lambda r: inspect.unwrap(head_dashboard_data)(r, LAYER, 0, None, random_ids(2, 5)),
    "model_dtype": lambda r: inspect.unwrap(model_dtype)(r),
    "for_remote": lambda r: inspect.unwrap(for_remote)(r),
}


@pytest.fixture(scope="module")
def things():
    model, hf = tiny_nnsight("llama")
    lorsas = LorsaSet(model, {LAYER: make_lorsa(hf, get_adapter(model), LAYER)})
    transcoders = TranscoderSet(model, {0: make_transcoder()})
    return {"a LorsaSet": lorsas, "a TranscoderSet": transcoders, "the nnsight model": model,
            "a Lorsa module": lorsas[LAYER], "None": None}


@pytest.fixture(autouse=True)
def unwrapped(monkeypatch):
    """The package's functions without the tests' beartype wrapper (which would refuse the argument first)."""
    for mod, names in ((P, ["activation_patching", "ablation_effect", "random_ablation_control", "head_swap",
                            "mean_activations", "path_patching", "circuit_size"]),
                       (A, ["mhsa_correlation", "ov_logit_lens", "collect_top_activations", "qk_feature_impacts"])):
        for name in names:
            monkeypatch.setattr(mod, name, inspect.unwrap(getattr(mod, name)))


@pytest.mark.parametrize("what", ["a LorsaSet", "a TranscoderSet", "the nnsight model", "a Lorsa module", "None"])
@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_anything_but_a_replacement_model_is_an_argument_error_naming_the_function(things, name, what):
    with pytest.raises(ArgumentError, match=rf"^{name}\(replacement=\.\.\.\) must be a ReplacementModel") as e:
        ENTRY_POINTS[name](things[what])
    if what == "a LorsaSet":
        assert "ReplacementModel(model, lorsas=your_set)" in str(e.value)
    if what == "a TranscoderSet":
        assert "ReplacementModel(model, transcoders=your_set)" in str(e.value)


def test_a_replacement_model_passes_the_check(things):
    """The check lets a ReplacementModel through: the function runs (one Lorsa head ablated)."""
    rm = ReplacementModel(things["a LorsaSet"].model, lorsas=things["a LorsaSet"])
    result = P.ablation_effect(rm, random_ids(1, 5), [LorsaHead(LAYER, 0)], correct_ids=[1], incorrect_ids=[2])
    assert result.baseline.shape == result.ablated.shape == (1,)


@pytest.mark.parametrize("chunk", [0, -1, True])
def test_qk_feature_impacts_refuses_a_chunk_below_one(things, chunk):
    """``chunk`` bounds the elements of one ablated-score tensor; 0 or below ran (as 1: the slowest) without a word."""
    rm = ReplacementModel(things["a LorsaSet"].model, lorsas=things["a LorsaSet"])
    with pytest.raises(ArgumentError, match=r"chunk must be an int >= 1"):
        A.qk_feature_impacts(rm, LAYER, 0, make_sae(), random_ids(1, 6), chunk=chunk)
