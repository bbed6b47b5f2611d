"""``head_dashboard_data``'s head and counts, checked before any trace (2026-11-29, fourth session): a head past the
Lorsa's OV heads was torch's ``IndexError`` from ``top.values[head]`` (``-1`` an error from the pattern code, after the
contexts were built), a negative ``window`` sliced each context from the wrong end, and a ``TopActivations`` of
another Lorsa was read as this one's."""

from __future__ import annotations

import pytest
from helpers import LAYER, make_lorsa, random_ids, tiny_nnsight

from nnsight_lorsa import LorsaSet, ReplacementModel, get_adapter
from nnsight_lorsa.analysis import TopActivations, collect_top_activations
from nnsight_lorsa.errors import ArgumentError
from nnsight_lorsa.patching import TargetIndexError
from nnsight_lorsa.viz import head_dashboard_data


@pytest.fixture(scope="module")
def setup():
    model, hf = tiny_nnsight("llama")
    rm = ReplacementModel(model, lorsas=LorsaSet(model, {LAYER: make_lorsa(hf, get_adapter(model), LAYER)}))
    tokens = random_ids(4, 8)
    return rm, tokens, collect_top_activations(rm, LAYER, tokens, n_top=2)


def test_a_head_outside_the_lorsa_is_refused_by_name(setup):
    rm, tokens, top = setup
    n = rm.lorsas[LAYER].cfg.n_ov_heads
    for bad in (n, -1, 10**6):
        with pytest.raises(TargetIndexError, match=rf"OV head index {bad} is out of range \[0, {n}\)"):
            head_dashboard_data(rm, LAYER, bad, top, tokens)
    assert head_dashboard_data(rm, LAYER, n - 1, top, tokens, n_contexts=1)["layer"] == LAYER


@pytest.mark.parametrize("name", ["n_contexts", "window", "n_features"])
def test_a_negative_count_is_refused(setup, name):
    rm, tokens, top = setup
    with pytest.raises(ArgumentError, match=rf"head_dashboard_data: {name} must be an int >= 0, got -1"):
        head_dashboard_data(rm, LAYER, 0, top, tokens, **{name: -1})


def test_top_activations_of_another_lorsa_are_refused(setup):
    rm, tokens, top = setup
    other = TopActivations(top.values[:3], top.window[:3], top.position[:3], top.count[:3])
    with pytest.raises(ArgumentError, match="top must be collect_top_activations"):
        head_dashboard_data(rm, LAYER, 0, other, tokens)
