"""The arguments of ``circuit_metrics`` and ``to_neuronpedia`` that no check read (probe of 2026-11-29, fourth
session): ``circuit_metrics(incorrect_token=-1)`` measured against the vocabulary's last logit (Python's negative
index), ``incorrect_token`` past the vocabulary was an ``IndexError`` after every ablation ran, ``chunk=0`` a
``range()`` error, ``min_effect`` NaN or negative a meaningless minimality; a prune result of another graph read
the wrong nodes; ``sparsity_threshold`` outside ``[0, 1]`` (or NaN, which strict JSON cannot even hold) was written
into the frontend's parameters. Each is now an ``ArgumentError`` naming the argument, before the model runs."""

from __future__ import annotations

import math

import pytest
from helpers import attribution_setup, random_ids, rm

from nnsight_lorsa.attribution import attribute, circuit_metrics, prune, to_neuronpedia
from nnsight_lorsa.errors import ArgumentError


@pytest.fixture(scope="module")
def setup():
    model, hf, lorsas, tcs = attribution_setup("llama")
    replacement = rm(model, lorsas, tcs)
    graph = attribute(replacement, random_ids(1, 6)[0], batch_size=16)
    other = attribute(replacement, random_ids(1, 4, seed=3)[0], batch_size=16)
    return hf, replacement, graph, prune(graph), prune(other)


@pytest.mark.parametrize(("kw", "name"), [
    ({"incorrect_token": -1}, "incorrect_token"), ({"incorrect_token": 10**6}, "incorrect_token"),
    ({"chunk": 0}, "chunk"), ({"chunk": -3}, "chunk"),
    ({"min_effect": -0.1}, "min_effect"), ({"min_effect": math.nan}, "min_effect"),
    ({"min_effect": math.inf}, "min_effect"),
])
def test_circuit_metrics_refuses_its_arguments_by_name_before_the_model_runs(setup, kw, name):
    hf, replacement, graph, pruned, _ = setup
    calls = []
    handle = hf.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ArgumentError, match=rf"circuit_metrics\({name}=\.\.\.\) must be"):
            circuit_metrics(replacement, graph, pruned, **kw)
    finally:
        handle.remove()
    assert calls == []


def test_circuit_metrics_refuses_a_prune_result_of_another_graph(setup):
    _, replacement, graph, _, other = setup
    assert other.node_mask.numel() != graph.n_nodes
    with pytest.raises(ArgumentError, match="PruneResult is over .* nodes, the graph has"):
        circuit_metrics(replacement, graph, other)


def test_the_last_vocabulary_id_is_still_an_incorrect_token(setup):
    hf, replacement, graph, pruned, _ = setup
    last = hf.get_input_embeddings().num_embeddings - 1
    cm = circuit_metrics(replacement, graph, pruned, incorrect_token=last, chunk=64)
    assert math.isfinite(cm.baseline)


@pytest.mark.parametrize("bad", [-0.1, 1.5, math.nan, math.inf])
def test_to_neuronpedia_refuses_a_sparsity_threshold_outside_zero_one(setup, bad):
    _, _, graph, pruned, _ = setup
    with pytest.raises(ArgumentError, match=r"sparsity_threshold=\.\.\.\) must be a number in \[0, 1\]"):
        to_neuronpedia(graph, pruned, slug="t", sparsity_threshold=bad)
    for ok in (0.0, 0.25, 1.0):
        assert to_neuronpedia(graph, pruned, slug="t", sparsity_threshold=ok)["qParams"]["sparsityThreshold"] == ok


@pytest.mark.parametrize("bad", [0, -1])
def test_qk_attribution_refuses_a_batch_size_below_one(setup, bad):
    """``batch_size=0`` ran as the default (``batch_size or 2·d_qk``), -1 reached the backward passes."""
    from nnsight_lorsa.attribution import qk_attribution

    _, replacement, _, _, _ = setup
    with pytest.raises(ArgumentError, match=r"qk_attribution\(batch_size=\.\.\.\) must be None or an int >= 1"):
        qk_attribution(replacement, random_ids(1, 6)[0], layer=1, head=0, query_pos=3, key_pos=1, batch_size=bad)
