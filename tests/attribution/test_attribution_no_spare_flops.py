"""``attribute`` computes no matmul twice and none whose result it drops (benchmarks/attribution_flops.py,
docs/attribution.md "FLOPs against the floor"): the frozen pass runs the model's own unembedding on one position
(its output is replaced whole), computes a frozen MHSA's queries and keys once for both constants, and the layout
reads each Lorsa's head activations without decoding its output."""

from __future__ import annotations

import functools

import torch
from helpers import attribution_setup, random_ids, rm
from hypothesis import given, settings
from hypothesis import strategies as st

import nnsight_lorsa.attribution.replacement as replacement_module
from nnsight_lorsa import LorsaSet, TranscoderSet, attribute


@functools.cache
def setup():
    return attribution_setup("llama")


def bundle():
    model, _, lorsas, tcs = setup()
    return rm(model, LorsaSet(model, dict(lorsas)), TranscoderSet(model, dict(tcs)))


@settings(max_examples=3, deadline=None)
@given(seq=st.integers(2, 12), seed=st.integers(0, 2**16))
def test_the_frozen_pass_runs_the_models_unembedding_on_one_position(seq, seed):
    _, hf, _, _ = setup()
    seen: list[tuple[int, ...]] = []
    original = torch.nn.functional.linear

    def spying(x, weight, bias=None):  # the unembedding's product, as the module computes it
        if weight is hf.lm_head.weight:
            seen.append(tuple(x.shape))
        return original(x, weight, bias)

    torch.nn.functional.linear = spying
    try:
        attribute(bundle(), random_ids(1, seq, seed)[0], batch_size=3, max_feature_nodes=4)
    finally:
        torch.nn.functional.linear = original
    d = hf.config.hidden_size
    # the clean pass reads every position's logits (its last row the targets); the frozen pass: the model's own
    # unembedding on one position, and the frozen model's logits of copy 0 (the output it returns)
    assert seen == [(1, seq, d), (1, 1, d), (1, seq, d)]


@settings(max_examples=2, deadline=None)
@given(seq=st.integers(2, 12), seed=st.integers(0, 2**16))
def test_a_frozen_mhsa_computes_its_queries_and_keys_once(seq, seed):
    calls: list[int] = []
    original = replacement_module.mhsa_qk

    def counting(w, x, positions=None):
        calls.append(x.shape[1])
        return original(w, x, positions)

    replacement_module.mhsa_qk = counting
    try:
        attribute(bundle(), random_ids(1, seq, seed)[0], batch_size=3, max_feature_nodes=4, memory="lean")
    finally:
        replacement_module.mhsa_qk = original
    model, _, lorsas, _ = setup()
    n_mhsa = model.config.num_hidden_layers - len(lorsas)
    assert calls == [seq] * n_mhsa


def test_the_layout_does_not_decode_the_lorsa_output():
    _, _, lorsas, _ = setup()
    (lorsa,) = lorsas.values()
    decoded: list[int] = []
    handle = lorsa.hook_out.register_forward_hook(lambda *a: decoded.append(1))
    try:
        graph = attribute(bundle(), random_ids(1, 8, 3)[0], batch_size=3, max_feature_nodes=4)
    finally:
        handle.remove()
    assert decoded == []
    assert float(graph.edge_sum_error("mass").max()) < 1e-4
    assert torch.isfinite(graph.values[graph.feature_rows]).all()
