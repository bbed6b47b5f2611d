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


@pytest.mark.parametrize("memory", ["default", "lean"])
def test_an_fp16_lorsa_whose_raw_scores_leave_fp16s_range_is_attributed_in_every_memory_mode(memory):
    """The stored pattern rows (default memory mode) came from the Lorsa's attention_pattern, which formed q·k in
    fp16 before the scale: inf scores, NaN rows, and attribute() failed with a misleading "edge later than the
    target" error where the lean mode (fp32 pattern rows) and the Lorsa's forward were finite."""
    from helpers import make_lorsa, make_transcoders, tiny_nnsight

    from nnsight_lorsa import get_adapter

    model, hf = tiny_nnsight("llama", dtype=torch.float16)
    lorsa = make_lorsa(tiny_nnsight("llama")[1], get_adapter(hf))
    with torch.no_grad():
        lorsa.W_Q.mul_(700)
        lorsa.W_K.mul_(700)
    lorsa = lorsa.half()
    tcs = {k: v.half() for k, v in make_transcoders((0, 2)).items()}
    ids = torch.randint(2, 128, (8,), generator=torch.Generator().manual_seed(1))
    kwargs = {} if memory == "default" else {"memory": "lean"}
    g = attribute(make_rm(model, {1: lorsa}, tcs), ids, **kwargs)
    assert bool(torch.isfinite(g.densify()).all())


def test_logits_past_fp16s_range_are_a_named_error_not_a_nan_graph():
    """An fp16 model whose logits overflow (inf past 65504) gave a graph of NaN edges and NaN target probabilities
    with no word; it is a NonFiniteError naming the logits and their dtype. The same model in bf16 is attributed."""
    from helpers import make_transcoders, tiny_nnsight

    from nnsight_lorsa.errors import NonFiniteError

    ids = torch.randint(2, 128, (8,), generator=torch.Generator().manual_seed(1))
    for dtype in (torch.float16, torch.bfloat16):
        model, hf = tiny_nnsight("llama", dtype=dtype)
        with torch.no_grad():
            hf.lm_head.weight.mul_(1e5)
            hf.model.norm.weight.mul_(100)
        tcs = {k: v.to(dtype) for k, v in make_transcoders((0, 1, 2)).items()}
        if dtype == torch.float16:
            with torch.no_grad():
                assert not bool(torch.isfinite(hf(ids[None]).logits[0, -1]).all())  # not vacuous
            with pytest.raises(NonFiniteError, match=r"logits.*float16"):
                attribute(make_rm(model, None, tcs), ids)
        else:
            g = attribute(make_rm(model, None, tcs), ids)
            assert bool(torch.isfinite(g.logit_probs).all()) and bool(torch.isfinite(g.densify()).all())
