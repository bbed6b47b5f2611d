"""Recomputed Lorsa pattern rows (``frozen.PatternRows`` / ``frozen.z_pre``, the frozen pass without stored
patterns) run many QK heads per step: one ``bmm`` over a ``(heads, slots, d_qk)`` grid of the nodes' queries
instead of one small matmul per QK head (on a GPU ~10 kernel launches each, 256 heads per layer at the
Llama-3.1-8B Lorsa's shape). Checked against a per-node fp64 reference and against the per-head implementation it
replaced (kept here), on hypothesis-drawn layouts: empty and very unbalanced QK heads, any query positions, batch
1-4, fp32 / fp64 / bf16, step budgets from one slot to all; and the dispatched operators per forward+backward no
longer grow with the number of QK heads."""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from helpers import DEVICES
from hypothesis import given, settings
from hypothesis import strategies as st

import nnsight_lorsa.attribution.frozen as frozen
from benchmarks.zpre_batched_heads import OpCount
from nnsight_lorsa.attribution.frozen import PatternRows, z_pre


@contextmanager
def product(on: bool):
    """The head product (``frozen.HEAD_PRODUCT``, a GPU's default) or the gather (the CPU's) on the CPU."""
    old = dict(frozen.HEAD_PRODUCT)
    frozen.HEAD_PRODUCT["cpu"] = on
    try:
        yield
    finally:
        frozen.HEAD_PRODUCT.clear()
        frozen.HEAD_PRODUCT.update(old)


@contextmanager
def row_budget(elements: int):
    old = frozen.ROW_CHUNK_ELEMENTS
    frozen.ROW_CHUNK_ELEMENTS = elements
    try:
        yield
    finally:
        frozen.ROW_CHUNK_ELEMENTS = old


def reference(q, k, v, group, qpos, col, scale):
    """Per node, in fp64: its pattern row and ``z_pre``; and the rows ``(n, pos)``."""
    n, pos = group.numel(), k.shape[1]
    rows = torch.zeros(n, pos, dtype=torch.float64)
    for i in range(n):
        g, p = int(group[i]), int(qpos[i])
        s = (q[g, p].double() @ k[g, :p + 1].double().T) / scale
        rows[i, :p + 1] = s.softmax(-1)
    z = torch.einsum("np,bpn->bn", rows, v.double()[:, :, col])
    return z, rows


def old_z_pre(q, k, v, group, qpos, col, scale, elements):
    """The per-QK-head implementation this replaced (forward and the backward's ``grad_v`` for ``grad``)."""
    order = torch.argsort(group, stable=True)
    counts = torch.bincount(group, minlength=q.shape[0]).tolist()
    by_group = [(g, nodes) for g, nodes in enumerate(order.split(counts)) if nodes.numel()]
    step = max(1, elements // max(1, v.shape[0] * q.shape[1]))

    def rows(g, nodes, dtype):
        p = qpos[nodes]
        scores = (q[g, p].float() @ k[g].float().T) / scale
        future = torch.arange(k.shape[1])[None] > p[:, None]
        return scores.masked_fill(future, float("-inf")).softmax(-1).to(dtype)

    out = v.new_zeros(v.shape[0], col.numel())
    for g, nodes in by_group:
        for part in nodes.split(step):
            out[:, part] = torch.einsum("mp,bpm->bm", rows(g, part, v.dtype), v[:, :, col[part]])
    return out


@st.composite
def layouts(draw):
    n_qk = draw(st.integers(1, 6))
    pos = draw(st.integers(1, 12))
    n = draw(st.integers(0, 40))
    shape = draw(st.sampled_from(["uniform", "one_heavy", "single"]))
    if shape == "uniform":
        group = draw(st.lists(st.integers(0, n_qk - 1), min_size=n, max_size=n))
    elif shape == "one_heavy":  # nearly every node on one QK head, a few elsewhere
        heavy = draw(st.integers(0, n_qk - 1))
        group = [heavy if draw(st.integers(0, 9)) else draw(st.integers(0, n_qk - 1)) for _ in range(n)]
    else:
        group = [draw(st.integers(0, n_qk - 1))] * n
    qpos = draw(st.lists(st.integers(0, pos - 1), min_size=n, max_size=n))
    return {"n_qk": n_qk, "pos": pos, "group": group, "qpos": qpos, "batch": draw(st.integers(1, 4)),
            "d_qk": draw(st.integers(1, 8)), "group_size": draw(st.integers(1, 5)),
            "product": draw(st.booleans()),
            "dtype": draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16])),
            "elements": draw(st.sampled_from([1, 7, 64, 300, 2**22])), "seed": draw(st.integers(0, 2**16))}


def make(case: dict[str, Any]):
    gen = torch.Generator().manual_seed(case["seed"])
    n_qk, pos, d, dtype = case["n_qk"], case["pos"], case["d_qk"], case["dtype"]
    q = (torch.randn(n_qk, pos, d, generator=gen) * 2).to(dtype)
    k = (torch.randn(n_qk, pos, d, generator=gen) * 2).to(dtype)
    group = torch.tensor(case["group"], dtype=torch.long)
    qpos = torch.tensor(case["qpos"], dtype=torch.long)
    # each node's OV head, one of its QK head's group; the values' columns: the OV heads with nodes, in order
    heads = group * case["group_size"] + torch.randint(0, case["group_size"], (group.numel(),), generator=gen)
    uniq, col = torch.unique(heads, return_inverse=True)
    v = torch.randn(case["batch"], pos, max(1, uniq.numel()), generator=gen).to(dtype)
    grad = torch.randn(case["batch"], group.numel(), generator=gen).to(dtype)
    return q, k, v, group, qpos, col, grad, math.sqrt(d), heads


def pattern_rows(q, k, group, qpos, scale, heads, case):
    return PatternRows(q, k, group, qpos, scale, heads, case["group_size"])


def relative_bound(dtype: torch.dtype) -> float:
    # scores and softmax in fp32 whatever the inputs; bf16: rows and values rounded to 8 bits, summed in bf16
    return 2e-5 if dtype != torch.bfloat16 else 3 * 2.0**-7


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_z_pre_and_its_value_gradient_match_a_per_node_reference(case):
    """Either contraction (the head product, a GPU's; the gather, the CPU's)."""
    q, k, v, group, qpos, col, grad, scale, heads = make(case)
    ref, rows = reference(q, k, v, group, qpos, col, scale)
    vv = v.clone().requires_grad_(True)
    with row_budget(case["elements"]), product(case["product"]):
        pr = pattern_rows(q, k, group, qpos, scale, heads, case)
        out = z_pre(vv, pr, col)
        out.backward(grad)
    assert bool(pr.group_size) == case["product"]
    assert out.dtype == v.dtype and out.shape == (case["batch"], group.numel())
    assert torch.isfinite(out).all() and torch.isfinite(vv.grad).all()  # a padded slot's row adds no NaN
    tol = relative_bound(case["dtype"])
    mass = torch.einsum("np,bpn->bn", rows, v.double().abs()[:, :, col])  # Σ_j A_j |v_j|: the sum's scale
    assert ((out.double() - ref).abs() <= tol * mass + 1e-30).all()
    # grad_v[b, j, u] = Σ_{n: col_n = u} A_n[j] grad[b, n]
    want = torch.zeros(v.shape, dtype=torch.float64)
    scale_g = torch.zeros(v.shape, dtype=torch.float64)
    want.index_add_(2, col, rows.T[None] * grad.double()[:, None, :])
    scale_g.index_add_(2, col, rows.T[None] * grad.double().abs()[:, None, :])
    assert ((vv.grad.double() - want).abs() <= tol * scale_g + 1e-30).all()


@settings(max_examples=100, deadline=None)
@given(layouts())
def test_z_pre_matches_the_per_head_implementation_it_replaced(case):
    q, k, v, group, qpos, col, _, scale, heads = make(case)
    old = old_z_pre(q, k, v, group, qpos, col, scale, case["elements"])
    with row_budget(case["elements"]), product(case["product"]):
        new = z_pre(v, pattern_rows(q, k, group, qpos, scale, heads, case), col)
    _, rows = reference(q, k, v, group, qpos, col, scale)
    mass = torch.einsum("np,bpn->bn", rows, v.double().abs()[:, :, col])
    # fp32: the same fp32 scores up to the matmul's summation order
    tol = 2e-6 if case["dtype"] != torch.bfloat16 else 3 * 2.0**-8
    assert ((new.double() - old.double()).abs() <= tol * mass + 1e-30).all()


def _ops(n_qk: int, per_head: int = 3, pos: int = 16, batch: int = 4, head_product: bool = False) -> int:
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, n_qk, pos, 8, generator=gen)
    group = torch.arange(n_qk).repeat_interleave(per_head)
    qpos = torch.randint(0, pos, (group.numel(),), generator=gen)
    heads = group * 4 + torch.randint(0, 4, (group.numel(),), generator=gen)
    uniq, col = torch.unique(heads, return_inverse=True)
    v = torch.randn(batch, pos, uniq.numel(), generator=gen, requires_grad=True)
    with product(head_product):
        rows = PatternRows(q, k, group, qpos, math.sqrt(8), heads, 4)
        with OpCount() as ops:
            z_pre(v, rows, col).sum().backward()
    return ops.count


@pytest.mark.parametrize("head_product", [False, True])
def test_dispatched_ops_per_forward_and_backward_do_not_grow_with_the_qk_heads(head_product):
    """64 QK heads of 3 nodes each fit one step (of the CPU's budget): as many operators as 4 heads — the
    per-head loop dispatched ~10 per head and direction (~1300 here)."""
    few, many = _ops(4, head_product=head_product), _ops(64, head_product=head_product)
    assert many <= few + 8, (few, many)
    assert many < 120, many


def test_a_small_budget_still_splits_the_steps():
    """The knob the attribution tests use to force many steps (``frozen.ROW_CHUNK_ELEMENTS``) still does."""
    with row_budget(4 * 16 * 3):  # three slots per step
        small = _ops(64)
    assert small > 4 * _ops(64)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=1, max_size=64), st.integers(1, 64), st.integers(1, 4),
       st.integers(1, 16), st.integers(1, 2**14), st.sampled_from([0, 1, 3, 8]))
def test_the_plan_covers_every_node_once_in_few_steps(counts, pos, batch, d_qk, elements, group_size):
    """The gather's plan (``group_size`` 0) and the head product's (its slots held to ``elements // pos``, its heads'
    ``(group_size·batch, pos)`` values to ``elements``)."""
    pieces, steps = frozen.plan_rows(counts, pos, batch, d_qk, elements, group_size)
    per_slot = max(pos, group_size * batch) if group_size else batch * pos
    slots, most_heads = max(1, elements // per_slot), max(1, elements // (pos * max(d_qk, group_size * batch)))
    covered = {g: [] for g, c in enumerate(counts) if c}
    first = 0
    for s in steps:
        assert s.first == first and s.heads >= 1
        first += s.heads * s.width
        mine = pieces[s.piece:s.piece + s.heads]
        assert s.width == mine[0][0] == max(p[0] for p in mine)  # padded to its longest piece
        assert s.heads * s.width <= slots and s.heads <= most_heads
        assert s.heads * s.width <= 2 * sum(p[0] for p in mine)  # padding at most the nodes
        for length, g, c0 in mine:
            covered[g].append((c0, length))
    assert [s.piece for s in steps] == sorted(s.piece for s in steps) and sum(s.heads for s in steps) == len(pieces)
    for g, runs in covered.items():  # every node of every head once, in runs
        assert sum(n for _, n in runs) == counts[g]
        assert sorted(c0 for c0, _ in runs) == list(range(0, counts[g], slots))
    n = sum(counts)
    bound = 4 * per_slot * n / elements + len(pieces) / most_heads + math.log2(max(counts) or 1) + 2
    assert len(steps) <= bound


@pytest.mark.parametrize("group_size", [0, 8])  # the gather; the head product, 8 OV heads per QK head
@pytest.mark.parametrize(("n_qk", "pos", "d", "per_head", "batch", "u", "dtype", "qk_dtype", "elements"), [
    (16, 256, 32, 200, 1, 64, torch.float32, torch.float32, 2**22),  # one step: the scores dominate
    (16, 256, 32, 200, 4, 64, torch.float32, torch.float32, 2**22),  # the gathered values dominate
    (16, 256, 32, 200, 4, 64, torch.bfloat16, torch.bfloat16, 2**20),
    (16, 256, 32, 200, 2, 64, torch.float64, torch.float32, 2**21),
    (16, 256, 32, 200, 2, 64, torch.float64, torch.float64, 2**21),  # fp64 queries and keys: fp64 scores
    (64, 128, 16, 50, 3, 300, torch.float32, torch.bfloat16, 2**18)])  # several blocks and steps
def test_a_steps_transient_bytes_bound_the_allocation_peak(n_qk, pos, d, per_head, batch, u, dtype, qk_dtype,
                                                           elements, group_size):
    """``row_step_bytes`` (the ``row_chunks`` term of ``estimate_memory``) of the largest step, the kept slot
    indices, the output and ``grad_v`` bound what a ``z_pre`` forward + backward allocates (measured: 0.88-0.96 of
    it), on the CPU's allocation events."""
    from benchmarks._alloc_peak import allocation_peak

    gen = torch.Generator().manual_seed(0)
    group = torch.randint(0, n_qk, (per_head * n_qk,), generator=gen)
    qpos = torch.randint(0, pos, (group.numel(),), generator=gen)
    heads = None
    if group_size:  # the head product: the nodes' OV heads, the values' columns those with nodes
        heads = group * group_size + torch.randint(0, group_size, (group.numel(),), generator=gen)
        uniq, col = torch.unique(heads, return_inverse=True)
        u = uniq.numel()
    else:
        col = torch.randint(0, u, (group.numel(),), generator=gen)
    q, k = torch.randn(2, n_qk, pos, d, generator=gen).to(qk_dtype)
    v = torch.randn(batch, pos, u, generator=gen).to(dtype).requires_grad_(True)

    def call():
        out = z_pre(v, PatternRows(q, k, group, qpos, math.sqrt(d), heads, group_size), col)
        out.backward(torch.ones_like(out))

    with row_budget(elements), product(bool(group_size)):
        _, peak = allocation_peak(call)
    pieces, steps = frozen.plan_rows(torch.bincount(group, minlength=n_qk).tolist(), pos, batch, d, elements,
                                     group_size)
    size, qk_size = v.element_size(), q.element_size()
    step = max(frozen.row_step_bytes(s, pos, batch, d, size, qk_size, group_size, u) for s in steps)
    n = group.numel()
    kept = 8 * (sum(s.heads * s.width for s in steps) + len(pieces) + 3 * (n + 1))
    if group_size:  # each node's place; each step's heads' columns and places with nodes; the host's column map
        kept += 8 * ((n + 1) + 2 * sum(s.heads for s in steps) * group_size + n_qk * group_size)
    results = (2 * batch * (n + 1) + batch * n + batch * pos * u) * size  # z_pre (padded), its gradient, grad_v
    assert 0.75 * (step + kept + results) <= peak <= step + kept + results, (peak, step, kept, results)


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3", "neox", "gpt2", "olmo2", "phi3", "gemma"])
def test_a_graph_with_the_head_product_is_the_gathers(family, monkeypatch):
    """``attribute(memory="lean")`` (the recomputed rows: a GPU's path) with the head product (a device's default,
    forced on the CPU) gives the gather's graph within fp32 rounding, its edges summing to the node values as
    closely — through the real layout's OV heads and groups (``replacement.lorsa_z_pre``)."""
    from helpers import attribution_setup, random_ids, rm

    from nnsight_lorsa.attribution import attribute

    model, _, lorsas, tcs = attribution_setup(family)
    assert all(lorsa.cfg.group_size > 1 for lorsa in lorsas.values())
    ids = random_ids(1, 9, seed=3)[0]
    calls = {"product": 0}
    original = frozen._head_product_forward

    def counted(*a):
        calls["product"] += 1
        return original(*a)

    monkeypatch.setattr(frozen, "_head_product_forward", counted)
    graphs = {}
    for on in (False, True):
        with product(on):
            graphs[on] = attribute(rm(model, lorsas, tcs), ids, batch_size=5, memory="lean")
        assert bool(calls["product"]) == on  # the frozen forward's z_pre took the forced contraction
    a, b = graphs[False].densify(), graphs[True].densify()
    assert a.abs().max() > 0 and torch.allclose(a, b, rtol=0, atol=1e-5 * float(a.abs().max()))
    assert graphs[True].edge_sum_error("mass").max() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", [d for d in DEVICES if d != "cpu"])
def test_on_cuda_both_contractions_match_the_per_node_reference(device, dtype):
    """On the device (``gpu``): the head product (its default there) and the gather, forced, against the per-node
    fp64 reference, forward and ``grad_v`` — bf16 rows and values on tensor cores, fp32 scores by ``bmm_f32``."""
    case = {"n_qk": 6, "pos": 40, "group": [g % 6 for g in range(300)], "qpos": [(7 * i) % 40 for i in range(300)],
            "batch": 3, "d_qk": 16, "group_size": 8, "dtype": dtype, "elements": 2**12, "seed": 5}
    q, k, v, group, qpos, col, grad, scale, heads = make(case)
    ref, rows = reference(q, k, v, group, qpos, col, scale)
    mass = torch.einsum("np,bpn->bn", rows, v.double().abs()[:, :, col])
    want = torch.zeros(v.shape, dtype=torch.float64).index_add_(2, col, rows.T[None] * grad.double()[:, None, :])
    scale_g = torch.zeros(v.shape, dtype=torch.float64).index_add_(
        2, col, rows.T[None] * grad.double().abs()[:, None, :])
    tol = relative_bound(dtype)
    on = {name: t.to(device) for name, t in (("q", q), ("k", k), ("group", group), ("qpos", qpos), ("col", col),
                                              ("grad", grad), ("heads", heads))}
    old = dict(frozen.HEAD_PRODUCT)
    try:
        for head_product in (True, False):
            frozen.HEAD_PRODUCT[torch.device(device).type] = head_product
            vv = v.to(device).detach().clone().requires_grad_(True)
            pr = PatternRows(on["q"], on["k"], on["group"], on["qpos"], scale, on["heads"], case["group_size"])
            assert bool(pr.group_size) == head_product
            out = z_pre(vv, pr, on["col"])
            out.backward(on["grad"])
            assert ((out.double().cpu() - ref).abs() <= tol * mass + 1e-30).all(), head_product
            assert ((vv.grad.double().cpu() - want).abs() <= tol * scale_g + 1e-30).all(), head_product
    finally:
        frozen.HEAD_PRODUCT.clear()
        frozen.HEAD_PRODUCT.update(old)
