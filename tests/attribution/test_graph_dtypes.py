"""Graphs computed in bf16 / fp16 / fp64 (issue 21): ``Graph.save`` / ``Graph.load`` give back every tensor in
the dtype it was computed in with the same bits (NaN at the rows not computed, as saved), and the circuit-tracer
JSON export of the loaded graph equals the export of the graph in memory (finite link weights)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import attribution_setup
from helpers import rm as make_rm

from nnsight_lorsa.attribution import attribute, to_neuronpedia
from nnsight_lorsa.attribution.graph import Graph

FIELDS = ("values", "logit_probs", "residual", "tokens", "feature_rows", "layout_ids")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_a_graph_round_trips_in_the_dtype_it_was_computed_in(dtype, tmp_path):
    model, hf, lorsas, tcs = attribution_setup("llama")
    hf.to(dtype)
    for m in (*lorsas.values(), *tcs.values()):
        m.to(dtype)
    ids = torch.randint(2, 128, (8,), generator=torch.Generator().manual_seed(1))
    g = attribute(make_rm(model, lorsas, tcs), ids)
    assert g.meta["dtype"] == str(dtype)
    loaded = Graph.load(g.save(tmp_path / "g"))
    for name in FIELDS:
        a, b = getattr(g, name), getattr(loaded, name)
        assert a.dtype == b.dtype and a.device == b.device, name
        assert torch.equal(torch.isnan(a), torch.isnan(b)) if a.is_floating_point() else True, name
        assert torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0)) if a.is_floating_point() else torch.equal(a, b)
    dense, back = g.densify(), loaded.densify()
    assert dense.dtype == back.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert torch.equal(dense, back)
    assert torch.equal(g.nodes.activation, loaded.nodes.activation)
    mine, theirs = to_neuronpedia(g, slug="t"), to_neuronpedia(loaded, slug="t")
    mine["metadata"].pop("info", None)
    theirs["metadata"].pop("info", None)
    assert mine == theirs
    assert mine["links"] and all(math.isfinite(link["weight"]) for link in mine["links"])
