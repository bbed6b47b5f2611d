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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_lean_node_writes_do_not_depend_on_the_order_of_the_nodes(dtype):
    """``frozen.gather_write`` (the lean mode's node writes, and its reads' gradient) sums the nodes at one
    position in fp32 and rounds once: any order of the nodes gives the same bits on the CPU, as CUDA's atomic
    ``index_add_`` (whose order varies from run to run) needs. Summed in bf16 it depended on the order: the
    offloaded and resident lean bf16 graphs of the gpu suite differed by 9-14 % of max |A| on an H200, and a
    permutation of the nodes moved the CPU graph by 0.6-1.9 %."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from nnsight_lorsa.attribution.frozen import gather_write

    @settings(max_examples=30, deadline=None, derandomize=True)
    @given(st.integers(1, 3), st.integers(1, 6), st.integers(1, 80), st.integers(0, 2**31 - 1))
    def check(b: int, n_pos: int, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        W = torch.randn(12, 16, generator=g).to(dtype)
        coeff = (10 * torch.randn(b, n, generator=g)).to(dtype)
        idx, pos = torch.randint(0, 12, (n,), generator=g), torch.randint(0, n_pos, (n,), generator=g)
        out = gather_write(coeff, W, idx, pos, n_pos, dtype)
        perm = torch.randperm(n, generator=g)
        assert out.dtype == dtype
        assert torch.equal(out, gather_write(coeff[:, perm], W, idx[perm], pos[perm], n_pos, dtype))
        ref = torch.zeros(b, n_pos, 16, dtype=torch.float64)  # the exact sum, rounded once
        ref.index_add_(1, pos, coeff[:, :, None].double() * W[idx].double()[None])
        ulp = torch.finfo(dtype).eps * ref.abs()
        assert bool(((out.double() - ref).abs() <= ulp + 1e-30).all())

    check()
