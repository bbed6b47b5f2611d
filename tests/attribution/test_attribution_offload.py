"""Attribution with offloaded replacement modules (``ReplacementModel(offload=True)``: weights on the host,
each module copied to the model's device only while it computes; docs/attribution.md, "Offloaded
replacement modules").

On the CPU the copy is ``t.to("cpu")`` (``t`` itself), so the mechanics run with ``fetch`` replaced by a
real copy (``clone``): the graph is bit-identical to the resident modules' (several prompts; Lorsa +
transcoders and Lorsa + a cross-layer transcoder; every memory mode; QK tracing), every module's own
parameters are back after the call, and no copy outlives it. The memory model is checked on its terms; the
``gpu`` case measures the device peak with the model on CUDA.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from helpers import DEVICES, attribution_setup, random_ids, rm

import nnsight_lorsa._placement as placement
from nnsight_lorsa import ReplacementModel
from nnsight_lorsa.attribution import attribute, estimate_memory
from nnsight_lorsa.attribution.budget import estimate_layout, layout_for_estimate
from nnsight_lorsa.attribution.offload import module_bytes
from nnsight_lorsa.attribution.options import AttributionOptions
from nnsight_lorsa.modules import TranscoderConfig
from nnsight_lorsa.modules.clt import CLTConfig, CrossLayerTranscoder
from nnsight_lorsa.modules.transcoder import Transcoder

PROMPTS = [random_ids(1, n, seed=s)[0] for n, s in ((8, 7), (11, 2), (6, 5))]


def clt_bundle(model, lorsas) -> ReplacementModel:
    clt = CrossLayerTranscoder(CLTConfig(d_in=64, d_sae=96, n_layers=3, activation="topk",
                                         activation_params={"k": 5}, skip=True))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for t in (clt.b_dec, clt.b_enc, clt.W_skip):
            t.copy_(0.05 * torch.randn(t.shape, generator=g))
    return rm(model, lorsas, clt)


def bundle(kind: str) -> ReplacementModel:
    model, _, lorsas, tcs = attribution_setup("llama")
    return rm(model, lorsas, tcs) if kind == "transcoders" else clt_bundle(model, lorsas)


def modules_of(rep: ReplacementModel) -> list[torch.nn.Module]:
    return [m for _, s in rep.sets() for m in s.values()]


def real_copies(monkeypatch) -> list[weakref.ref]:
    """``fetch`` made a real copy (as to another device); returns weak references to every copy."""
    copies: list[weakref.ref] = []

    def fetch(t, device):
        c = t.to(device).clone()
        copies.append(weakref.ref(c))
        return c

    monkeypatch.setattr(placement, "fetch", fetch)
    return copies


def one_at_a_time(monkeypatch) -> dict[str, int]:
    """Counts ``resident`` blocks: how many ran (``entered``) and the most open at once (``most``)."""
    state = {"open": 0, "most": 0, "entered": 0}
    enter, exit_ = placement.resident.__enter__, placement.resident.__exit__

    def counting_enter(res):
        if placement.offloaded(res.module):
            state["open"] += 1
            state["entered"] += 1
            state["most"] = max(state["most"], state["open"])
        return enter(res)

    def counting_exit(res, *exc):
        if placement.offloaded(res.module):
            state["open"] -= 1
        return exit_(res, *exc)

    monkeypatch.setattr(placement.resident, "__enter__", counting_enter)
    monkeypatch.setattr(placement.resident, "__exit__", counting_exit)
    return state


def assert_identical(g, ref, what: str) -> None:
    assert torch.equal(g.layout_ids, ref.layout_ids), what
    torch.testing.assert_close(g.values, ref.values, rtol=0, atol=0, equal_nan=True, msg=what)  # NaN: no value
    assert torch.equal(g.densify(), ref.densify()), what


@pytest.mark.parametrize("kind", ["transcoders", "clt"])
@pytest.mark.parametrize("memory", ["fast", "lean"])
def test_offloaded_attribution_is_bit_identical(kind, memory, monkeypatch):
    rep = bundle(kind)
    refs = [attribute(rep, ids, batch_size=24, memory=memory) for ids in PROMPTS]
    params = {id(m): [id(p) for p in m.parameters()] for m in modules_of(rep)}
    off = ReplacementModel(rep.model, **dict(rep.sets()), offload=True)
    copies = real_copies(monkeypatch)
    blocks = one_at_a_time(monkeypatch)
    for ids, ref in zip(PROMPTS, refs, strict=True):
        assert_identical(attribute(off, ids, batch_size=24, memory=memory), ref, f"{kind} {memory} {len(ids)}")
    assert copies, "nothing was fetched"
    assert blocks["entered"] >= len(PROMPTS) * len(modules_of(off)) and blocks["most"] == 1 and blocks["open"] == 0
    for m in modules_of(off):
        assert [id(p) for p in m.parameters()] == params[id(m)]
    gc.collect()
    assert not any(r() is not None for r in copies), "a fetched copy outlived attribute()"
    assert refs[0].densify().abs().sum() > 0


def test_offloaded_modules_are_fetched_per_forward_not_per_backward(monkeypatch):
    """The backward passes (one per batch of target rows) read only the rows kept apart: as many module
    fetches with batch 4 (many backward passes) as with batch 64 (one or two)."""
    rep = bundle("transcoders")
    off = ReplacementModel(rep.model, **dict(rep.sets()), offload=True)
    counts = []
    for batch in (4, 64):
        blocks = one_at_a_time(monkeypatch)
        g = attribute(off, PROMPTS[0], batch_size=batch)
        counts.append(blocks["entered"])
        monkeypatch.undo()
    assert counts[0] == counts[1] > 0, counts
    assert -(-int(g.feature_rows.sum() + len(g.logit_ids)) // 4) > 10  # batch 4: many backward passes


def test_offloaded_qk_tracing_and_pruning_are_identical(monkeypatch):
    from nnsight_lorsa.attribution import PruneConfig

    rep = bundle("transcoders")
    runs = [{"batch_size": 40, "qk_heads": 2},
            {"batch_size": 16, "prune": PruneConfig(0.8, 0.98, keep_mass=0.99), "max_feature_nodes": 30}]
    refs = [attribute(rep, PROMPTS[0], **kw) for kw in runs]
    real_copies(monkeypatch)
    off = ReplacementModel(rep.model, **dict(rep.sets()), offload=True)
    for kw, ref in zip(runs, refs, strict=True):
        g = attribute(off, PROMPTS[0], **kw)
        assert_identical(g, ref, str(sorted(kw)))
        assert set(g.qk) == set(ref.qk)
        for key in g.qk:
            assert torch.equal(g.qk[key], ref.qk[key]), key
    assert len(refs[0].qk["score"]) > 0


def test_offloaded_intervened_pass_graph_is_identical(monkeypatch):
    """``attribute(rm, tracer=tracer)`` of a traced pass with a zero-ablated Lorsa head: the same graph and
    logits with the modules offloaded."""
    import nnsight

    from nnsight_lorsa.patching import LorsaHead, ablate

    rep = bundle("transcoders")
    ids = PROMPTS[1]

    def traced(r):
        with rep.model.trace(ids[None]) as tracer:
            r.replace()
            handle = attribute(r, tracer=tracer, batch_size=40)
            ablate(r(LorsaHead(1, 3)))
            logits = nnsight.save(rep.model.lm_head.output)
        return handle.graph, logits

    ref, ref_logits = traced(rep)
    real_copies(monkeypatch)
    g, logits = traced(ReplacementModel(rep.model, **dict(rep.sets()), offload=True))
    assert_identical(g, ref, "intervened")
    assert torch.equal(logits, ref_logits)
    assert bool(g.nodes.intervened.any())  # not vacuous: the ablated head is a marked node


@pytest.mark.parametrize("kind", ["transcoders", "clt"])
def test_estimate_counts_one_offloaded_module_at_a_time_not_all(kind):
    """On a device, ``device_bytes`` with offloaded modules = the resident estimate (which excludes the
    resident weights) + the largest module (fetched while it computes) + the rows the frozen pass keeps of
    them (``W_V`` rows of the active OV heads, skip matrices); below the resident weights + that estimate.
    A cross-layer transcoder's per-layer views count as their CLT (their ``weights_owner``): fetched whole,
    once. On the CPU (the modules compute where they are stored) nothing is added."""
    rep = bundle(kind)
    options = AttributionOptions(batch_size=8)
    layout, info = layout_for_estimate(rep, PROMPTS[0], options)
    resident = estimate_layout(layout, batch_size=8, **{**info, "device": "cuda"})
    rep.lorsas.offload = rep.transcoders.offload = True
    layout, info = layout_for_estimate(rep, PROMPTS[0], options)
    off = estimate_layout(layout, batch_size=8, **{**info, "device": "cuda"})
    t = off.terms
    sizes = [module_bytes(m) for m in modules_of(rep)]
    assert t["offload_fetch"] == max(sizes) and t["offload_rows"] > 0
    assert off.device_bytes == resident.device_bytes + t["offload_fetch"] + t["offload_rows"]
    assert off.device_bytes < resident.device_bytes + sum(sizes)
    assert resident.terms["offload_fetch"] == resident.terms["offload_rows"] == 0
    if kind == "clt":
        clt = rep.transcoders.clt
        assert module_bytes(clt) == max(sizes)  # the CLT, not one layer's view of it, is what a fetch copies
        assert all(lay.transcoder.weights_owner is clt for lay in layout.layers if lay.transcoder is not None)
    cpu = estimate_memory(rep, PROMPTS[0], batch_size=8)
    assert "offload_fetch" not in cpu.terms


def big_transcoders(n_features: int) -> dict[int, Transcoder]:
    """TopK transcoders wide enough that their weights dwarf the tiny model's frozen pass."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for layer in (0, 2):
        tc = Transcoder(TranscoderConfig(d_in=64, d_sae=n_features, activation="topk", activation_params={"k": 6},
                                         layer=layer))
        with torch.no_grad():
            for p in tc.parameters():
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
        out[layer] = tc
    return out


@pytest.mark.parametrize("device", [d for d in DEVICES if getattr(d, "values", ("cpu",))[0] == "cuda"])
@pytest.mark.parametrize("memory", ["fast", "lean"])
def test_offloaded_attribution_on_cuda_keeps_the_modules_off_the_device(device, memory):
    """The model on CUDA, two 32 MB transcoders and a Lorsa offloaded: the device peak above the model stays
    below the modules' total size (resident, they alone would exceed it), the modules stay on the host, and
    the graph equals the resident modules' (max |ΔA| ≤ 1e-5 of max |A|: same kernels, CUDA's atomics may
    reorder sums)."""
    model, hf, lorsas, _ = attribution_setup("llama")
    hf.to(device)
    tcs = big_transcoders(2**16)
    ref_rep = rm(model, {k: v.to(device) for k, v in lorsas.items()}, {k: v.to(device) for k, v in tcs.items()})
    ref = attribute(ref_rep, PROMPTS[0], batch_size=24, memory=memory)
    rep = ReplacementModel(model, **dict(ref_rep.sets()), offload=True)
    total = sum(module_bytes(m) for m in modules_of(rep))
    assert all(p.device.type == "cpu" and p.is_pinned() for m in modules_of(rep) for p in m.parameters())
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    g = attribute(rep, PROMPTS[0], batch_size=24, memory=memory)
    torch.cuda.synchronize()
    above = torch.cuda.max_memory_allocated() - base
    assert above < total, (above, total)
    assert max(module_bytes(m) for m in modules_of(rep)) < total / 1.5  # not vacuous: no one module is all
    assert all(p.device.type == "cpu" for m in modules_of(rep) for p in m.parameters())
    assert torch.equal(g.layout_ids, ref.layout_ids)
    A, R = g.densify(), ref.densify()
    assert float((A - R).abs().max()) <= 1e-5 * float(R.abs().max())


def test_streamed_linear_has_the_linear_gradient():
    """The offloaded ``W_V`` rows' product (``frozen._StreamedLinear``: ``W`` copied for the forward and for
    each backward, never kept) against ``F.linear``: same values and input gradient (1e-6 relative), twice
    over one retained graph (one backward per batch of targets)."""
    from nnsight_lorsa.attribution.frozen import _StreamedLinear

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 16, generator=g, requires_grad=True)
    W = torch.randn(7, 16, generator=g)
    out, ref = _StreamedLinear.apply(x, W), torch.nn.functional.linear(x, W)
    assert torch.allclose(out, ref, rtol=1e-6, atol=1e-6)
    for seed in (1, 2):
        grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed))
        (a,) = torch.autograd.grad(out, x, grad, retain_graph=True)
        (b,) = torch.autograd.grad(ref, x, grad, retain_graph=True)
        assert float((a - b).abs().max()) <= 1e-6 * float(b.abs().max())


@pytest.mark.parametrize("kind", ["transcoders", "clt"])
@pytest.mark.parametrize("device", DEVICES)
def test_offloaded_bf16_attribution_on_device_equals_the_resident_graph(device, kind, monkeypatch):
    """A bf16 model on ``device`` with bf16 modules (per-layer transcoders, or a cross-layer transcoder whose
    per-layer views are fetched through their ``weights_owner``), offloaded: the modules stay on the host in bf16
    (pinned where CUDA is), the graph (both memory modes, and pruned while building) is on the host and equals
    the resident modules' — bit for bit on the CPU (``fetch`` made a real copy), on CUDA within the bf16 edge
    bound (2e-2 of max |A|: its atomics may reorder a gradient's sums, one bf16 ulp is 4e-3). The lean mode's
    node writes summed in bf16 failed this on an H200 (9-14 %) until they summed in fp32 (``frozen.gather_write``)."""
    from nnsight_lorsa.attribution import PruneConfig
    from nnsight_lorsa.envoy.nnsight_internals import hf_module

    rep = bundle(kind)
    hf_module(rep.model).to(device=device, dtype=torch.bfloat16)
    for m in modules_of(rep):
        m.to(device=device, dtype=torch.bfloat16)
    runs = {"fast": {"memory": "fast"}, "lean": {"memory": "lean"},
            "prune": {"prune": PruneConfig(0.8, 0.98, keep_mass=0.99)}}
    refs = {name: attribute(rep, PROMPTS[0], batch_size=24, **kw) for name, kw in runs.items()}
    off = ReplacementModel(rep.model, **dict(rep.sets()), offload=True)
    for m in modules_of(off):
        assert {(p.device.type, p.dtype) for p in m.parameters()} == {("cpu", torch.bfloat16)}
        assert device == "cpu" or all(p.is_pinned() for p in m.parameters())
    copies = real_copies(monkeypatch) if device == "cpu" else []
    for name, kw in runs.items():
        g, ref = attribute(off, PROMPTS[0], batch_size=24, **kw), refs[name]
        assert g.values.device.type == "cpu" and g.densify().device.type == "cpu", name
        assert torch.equal(g.layout_ids, ref.layout_ids), name
        if device == "cpu":
            assert_identical(g, ref, f"{kind} {name}")
        else:
            A, R = g.densify(), ref.densify()
            assert float((A - R).abs().max()) <= 2e-2 * float(R.abs().max()), name
    assert device != "cpu" or copies, "nothing was fetched"
    assert all(p.device.type == "cpu" for m in modules_of(off) for p in m.parameters())
