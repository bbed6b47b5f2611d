"""Attribution with offloaded replacement modules (``ReplacementModel(offload=True)``: weights on the host,
each module copied to the model's device only while it computes; docs/attribution.md, "Offloaded
replacement modules").

On the CPU the copy is ``t.to("cpu")`` (``t`` itself), so the mechanics run with ``fetch`` replaced by a
real copy (``clone``): the graph is bit-identical to the resident modules' (several prompts; Lorsa +
transcoders and Lorsa + a cross-layer transcoder; every memory mode; QK tracing), every module's own
parameters are back after the call, and no copy outlives it — with the active rows on the device, on the host, or
partly on each (the blocks that fit). The memory model is checked on its terms, and the rule that picks the kept
blocks on synthetic and real estimates; the ``gpu`` case measures the device peak with the model on CUDA.
"""

from __future__ import annotations

import gc
import sys
import weakref

import pytest
import torch
from helpers import DEVICES, attribution_setup, random_ids, rm

import nnsight_lorsa._placement as placement
from nnsight_lorsa import ReplacementModel
from nnsight_lorsa._placement import fetched_bytes
from nnsight_lorsa.attribution import attribute, estimate_memory
from nnsight_lorsa.attribution.budget import MemoryEstimate, estimate_layout, layout_for_estimate
from nnsight_lorsa.attribution.offload import LORSA_OV, module_bytes
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
    # the frozen pass's own gathers of kept rows (replacement.fetch: the same function, imported by name)
    monkeypatch.setattr("nnsight_lorsa.attribution.replacement.fetch", fetch)
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


def left_on_another_device(monkeypatch) -> dict[str, int]:
    """Inside every ``resident(module, device, leave)`` block of an offloaded module, the tensors named in ``leave``
    are ``meta`` tensors (as on a GPU, where they stay on the host while the rest is on the device): a block that
    reads one, or that places its computation by every parameter rather than by those it copied, fails or differs.
    Returns ``{"blocks": how many blocks left something}``. Found on an H200 (2026-11-27): a transcoder site's
    ``to_module`` refused its own half-fetched module ("parameters on several devices")."""
    state = {"blocks": 0}
    enter, exit_ = placement.resident.__enter__, placement.resident.__exit__
    swapped: dict[int, list] = {}

    def leaving_enter(res):
        out = enter(res)
        if placement.offloaded(res.module) and res.leave:
            saved = []
            for prefix, sub in res.module.named_modules():
                for store in (sub._parameters, sub._buffers):
                    for name, t in list(store.items()):
                        if t is not None and (f"{prefix}.{name}" if prefix else name) in res.leave:
                            saved.append((store, name, t))
                            store[name] = torch.empty_like(t, device="meta")
            state["blocks"] += bool(saved)
            swapped[id(res)] = saved
        return out

    def leaving_exit(res, *exc):
        for store, name, t in swapped.pop(id(res), []):
            store[name] = t
        return exit_(res, *exc)

    monkeypatch.setattr(placement.resident, "__enter__", leaving_enter)
    monkeypatch.setattr(placement.resident, "__exit__", leaving_exit)
    return state


@pytest.mark.parametrize("kind", ["transcoders", "clt"])
@pytest.mark.parametrize("memory", ["fast", "lean"])
def test_offloaded_sites_compute_where_the_tensors_they_copied_are(kind, memory, monkeypatch):
    """The frozen pass's fetches of an offloaded Lorsa (q/k only, ``LORSA_OV`` left) and transcoder (skip path and
    encoder input, ``coder_site_leave``) compute on the copied tensors' device and never read a left one: with the
    left tensors on another device the graph (and a QK-traced one) is bit-identical to the resident modules'."""
    rep = bundle(kind)
    runs = [{"batch_size": 24, "memory": memory}, {"batch_size": 40, "memory": memory, "qk_heads": 2}]
    refs = [attribute(rep, PROMPTS[0], **kw) for kw in runs]
    off = ReplacementModel(rep.model, **dict(rep.sets()), offload=True)
    real_copies(monkeypatch)
    left = left_on_another_device(monkeypatch)
    for kw, ref in zip(runs, refs, strict=True):
        assert_identical(attribute(off, PROMPTS[0], **kw), ref, f"{kind} {sorted(kw)}")
    assert left["blocks"] > 0, "no block left a tensor: vacuous"


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
    # the largest fetch the frozen pass makes (a Lorsa without its OV circuit, a transcoder without its encoder and
    # decoders: test_offload_fetch_term_is_the_largest_copy_the_frozen_pass_makes), the whole module until 2026-11-27
    assert 0 < t["offload_fetch"] < max(sizes) and t["offload_rows"] > 0
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


def offloaded_on_cuda(device, memory):
    """``(resident graph, offloaded ReplacementModel, the offloaded modules' total bytes)``: the model on CUDA, two
    32 MB transcoders and a Lorsa, attributed resident first, then the same modules offloaded."""
    model, hf, lorsas, _ = attribution_setup("llama")
    hf.to(device)
    tcs = big_transcoders(2**16)
    ref_rep = rm(model, {k: v.to(device) for k, v in lorsas.items()}, {k: v.to(device) for k, v in tcs.items()})
    ref = attribute(ref_rep, PROMPTS[0], batch_size=24, memory=memory)
    rep = ReplacementModel(model, **dict(ref_rep.sets()), offload=True)
    return ref, rep, sum(module_bytes(m) for m in modules_of(rep))


def cuda_peak_above(run):
    """``(run(), bytes)``: its result and the device's allocation peak during it above what was allocated before."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = run()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - base


@pytest.mark.parametrize("device", [d for d in DEVICES if getattr(d, "values", ("cpu",))[0] == "cuda"])
@pytest.mark.parametrize("memory", ["fast", "lean"])
def test_offloaded_attribution_on_cuda_keeps_the_modules_off_the_device(device, memory):
    """The model on CUDA, two 32 MB transcoders and a Lorsa offloaded: the device peak above the model stays
    below the modules' total size (resident, they alone would exceed it), the modules stay on the host, and
    the graph equals the resident modules' (max |ΔA| ≤ 1e-5 of max |A|: same kernels, CUDA's atomics may
    reorder sums)."""
    ref, rep, total = offloaded_on_cuda(device, memory)
    assert all(p.device.type == "cpu" and p.is_pinned() for m in modules_of(rep) for p in m.parameters())
    g, above = cuda_peak_above(lambda: attribute(rep, PROMPTS[0], batch_size=24, memory=memory))
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


# ---------------------------------------------------------------- the active rows kept on the device, or not


def force_rows(monkeypatch, rows: str) -> None:
    """``offload.rows_placement`` made to answer ``rows`` wherever a module is offloaded (on the CPU the rule says
    ``"host"``): the frozen pass's two ways of keeping the rows, run on the CPU with ``fetch`` a real copy."""
    import nnsight_lorsa.attribution.budget as budget

    monkeypatch.setattr(budget, "rows_placement", lambda offloaded_any, *a, **k: rows if offloaded_any else None)


def frozen_instances(monkeypatch) -> list:
    """Every ``FrozenReplacement`` built from now on (the frozen passes' own)."""
    import nnsight_lorsa.attribution.replacement as replacement

    made: list = []
    init = replacement.FrozenReplacement.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(replacement.FrozenReplacement, "__init__", recording)
    return made


@pytest.mark.parametrize("kind", ["transcoders", "clt"])
@pytest.mark.parametrize("memory", ["fast", "lean"])
def test_offloaded_rows_kept_on_the_device_or_the_host_give_the_resident_graph(kind, memory, monkeypatch):
    """The offloaded modules' active rows gathered once on the device (``offload_rows="device"``: from one copy of
    each weight, ``fetch`` made a real copy) or kept on the host (``"host"``): both graphs equal the resident
    modules' bit for bit (two prompts; QK tracing too), ``graph.meta["offload_rows"]`` names the place, rows are
    kept on the device only in the first (gathering sites' ``w_o`` / ``W_dec`` / ``W_enc`` rows with
    ``memory="lean"``, every Lorsa layer's ``W_V`` rows in both modes), and no copy outlives the call."""
    rep = bundle(kind)
    prompts = PROMPTS[:2]
    refs = [attribute(rep, ids, batch_size=24, memory=memory, qk_heads=2) for ids in prompts]
    off = ReplacementModel(rep.model, **dict(rep.sets()), offload=True)
    copies = real_copies(monkeypatch)
    made = frozen_instances(monkeypatch)
    for rows in ("device", "host"):
        force_rows(monkeypatch, rows)
        for ids, ref in zip(prompts, refs, strict=True):
            made.clear()
            g = attribute(off, ids, batch_size=24, memory=memory, qk_heads=2)
            assert_identical(g, ref, f"{kind} {memory} {rows} {len(ids)}")
            assert set(g.qk) == set(ref.qk) and all(torch.equal(g.qk[k], ref.qk[k]) for k in g.qk)
            assert g.meta["offload_rows"] == rows and ref.meta["offload_rows"] is None
            assert len(made) == 2 and all(f.offload_rows == rows for f in made)  # the graph's pass, the QK pass
            kept = made[0].device_rows
            if rows == "host":
                assert kept == {}
            else:
                assert {k for k in kept if k.endswith("lorsa.w_v")} and all(kept.values())
                assert any(".tc." in k for k in kept) == (memory == "lean")
    gc.collect()
    assert copies and not any(r() is not None for r in copies), "a fetched copy outlived attribute()"
    assert refs[0].densify().abs().sum() > 0


@pytest.mark.parametrize("kind", ["transcoders", "clt"])
@pytest.mark.parametrize("memory", ["fast", "lean", "auto"])
@pytest.mark.parametrize("seq", [0, 1])
def test_kept_offload_rows_term_is_the_bytes_the_frozen_pass_keeps(kind, memory, seq, monkeypatch):
    """``offload_rows`` counted for rows kept on the device (``estimate_layout(..., offload_rows="device")``) equals,
    byte for byte, what the frozen pass keeps there (``FrozenReplacement.device_rows``: every Lorsa layer's distinct
    ``W_V`` rows, each gathering site's distinct ``w_o`` / ``W_enc`` rows and one block of ``W_dec`` rows per replaced
    MLP it writes into) plus the skip matrices; the host variant counts the largest block only (less with
    ``memory="lean"``, where every site gathers; the same where only one Lorsa layer's ``W_V`` rows are kept)."""
    rep = bundle(kind)
    ids = PROMPTS[seq]
    off = ReplacementModel(rep.model, **dict(rep.sets()), offload=True)
    force_rows(monkeypatch, "device")
    made = frozen_instances(monkeypatch)
    weights = kept_weight_copies(monkeypatch, off)
    attribute(off, ids, batch_size=8, memory=memory)
    (frozen,) = made
    layout, info = layout_for_estimate(off, ids, AttributionOptions(batch_size=8, memory=memory))
    terms = {rows: estimate_layout(layout, batch_size=8, offload_rows=rows, **{**info, "device": "cuda"}).terms
             for rows in ("device", "host")}
    skips = sum(m.W_skip.numel() * m.W_skip.element_size() for m in modules_of(off)
                if isinstance(getattr(m, "W_skip", None), torch.Tensor))
    assert skips > 0 and frozen.device_rows
    assert terms["device"]["offload_rows"] == sum(frozen.device_rows.values()) + skips
    host, kept = terms["host"]["offload_rows"], terms["device"]["offload_rows"]
    assert skips < host <= kept and (host < kept) == (memory == "lean")  # lean: every site's rows, not the largest
    # kept rows are gathered on the device from one transient copy of their whole weight: the fetch term is the
    # largest of those and of the resident blocks' copies (the host variant's term), byte for byte
    assert weights and terms["device"]["offload_fetch"] == max(terms["host"]["offload_fetch"], max(weights))
    assert terms["host"]["offload_fetch"] < max(map(module_bytes, modules_of(off)))


def kept_weight_copies(monkeypatch, replacement_model) -> list[int]:
    """Bytes of every whole offloaded weight (or a view of one) the frozen pass copies to gather kept rows from
    (``replacement.fetch`` of a tensor on an offloaded parameter's storage; a real copy)."""
    import nnsight_lorsa.attribution.replacement as replacement

    storages = {p.untyped_storage().data_ptr() for m in modules_of(replacement_model) for p in m.parameters()}
    copies: list[int] = []

    def fetch(t, device):
        if t.untyped_storage().data_ptr() in storages:
            copies.append(t.numel() * t.element_size())
        return t.to(device).clone()

    monkeypatch.setattr(replacement, "fetch", fetch)
    return copies


def fetch_blocks(monkeypatch, modules: list | None = None) -> list[tuple[str, int]]:
    """``fetch`` made a real copy; returns ``(file, bytes)`` of every ``resident`` block of an offloaded module: the
    file its ``with`` is in and the bytes its copies took (``modules``: each block's module appended to it)."""
    blocks: list[tuple[str, int]] = []
    current: list[int] = []
    enter = placement.resident.__enter__

    def fetch(t, device):
        c = t.to(device).clone()
        if current:
            current[-1] += c.numel() * c.element_size()
        return c

    def spying_enter(res):
        frame = sys._getframe(1)
        while frame.f_back is not None and frame.f_code.co_filename == __file__:  # under another spy of this file
            frame = frame.f_back
        caller = frame.f_code.co_filename
        current.append(0)
        try:
            return enter(res)
        finally:
            n = current.pop()
            if placement.offloaded(res.module):
                blocks.append((caller, n))
                if modules is not None:
                    modules.append(res.module)

    monkeypatch.setattr(placement, "fetch", fetch)
    monkeypatch.setattr("nnsight_lorsa.attribution.replacement.fetch", fetch)
    monkeypatch.setattr(placement.resident, "__enter__", spying_enter)
    return blocks


@pytest.mark.parametrize("kind", ["transcoders", "clt"])
@pytest.mark.parametrize("memory", ["fast", "lean"])
@pytest.mark.parametrize("qk", [False, True])
def test_offload_fetch_term_is_the_largest_copy_the_frozen_pass_makes(kind, memory, qk, monkeypatch):
    """``offload_fetch`` equals, byte for byte, the largest copy a ``resident`` block of the frozen pass makes (spied
    on ``fetch``): a Lorsa's queries and keys copy all but its OV circuit, a transcoder's MLP site all but its
    encoder and decoders — less than the largest module (copied whole until 2026-11-27; the clean pass's forwards,
    before the frozen pass, still copy what they read); the graph is the resident modules' bit for bit."""
    rep = bundle(kind)
    ids = PROMPTS[1]
    extra = {"qk_heads": 2} if qk else {}
    ref = attribute(rep, ids, batch_size=8, memory=memory, **extra)
    off = ReplacementModel(rep.model, **dict(rep.sets()), offload=True)
    blocks = fetch_blocks(monkeypatch)
    g = attribute(off, ids, batch_size=8, memory=memory, **extra)
    assert_identical(g, ref, f"{kind} {memory} qk={qk}")
    assert set(g.qk) == set(ref.qk) and all(torch.equal(g.qk[k], ref.qk[k]) for k in g.qk)
    frozen = [n for f, n in blocks if not f.endswith("layout.py")]
    layout, info = layout_for_estimate(off, ids, AttributionOptions(batch_size=8, memory=memory))
    t = estimate_layout(layout, batch_size=8, **{**info, "device": "cuda"}).terms
    assert frozen and t["offload_fetch"] == max(frozen), (t["offload_fetch"], blocks)
    assert t["offload_fetch"] < max(map(module_bytes, modules_of(off)))


def _estimate(per_copy: int, shared: int, batch: int) -> MemoryEstimate:
    terms = {"frozen_per_copy": per_copy, "frozen_shared": shared, "n_sources": 1, "n_rows": 1, "stored_entries": 0}
    return MemoryEstimate(0, per_copy * batch + shared, batch, terms)


# per copy 100 B, shared 1000 B with the rows on the host; three blocks of 30, 20 and 30 B (rows_cost: 30 B none
# kept, 80 B all: 50 B more; 30 B with "a" alone, 20 B more with "b" alone, 50 B with any two); batch 8 asked
RULE_BLOCKS = [("a", 30), ("b", 20), ("c", 30)]
ROWS_RULE = [
    # (offloaded, device, max_memory, free_bytes, expected)
    (False, "cuda", None, 10**9, None),  # nothing offloaded
    (False, "cuda", 10**9, None, None),
    (False, "cpu", None, None, None),
    (True, "cpu", None, None, "host"),  # a CPU model: the modules compute where they are stored
    (True, "cpu", 10**9, None, "host"),
    (True, "meta", None, None, "host"),  # a remote model's copy
    (True, "cuda", 10**9, None, "device"),  # a generous budget
    (True, "cuda", 1000 + 800 + 50, None, "device"),  # batch 8 either way, just
    (True, "cuda", 1000 + 800 + 49, None, frozenset("a")),  # all kept: batch 7 instead of 8; "a" alone fits
    (True, "cuda", 1000 + 800 + 29, None, frozenset("b")),  # "a" does not fit, "b" after it does
    (True, "cuda", 1000 + 800 + 19, None, "host"),  # no block fits the 19 B left
    (True, "cuda", 1000 + 400 + 50, None, "device"),  # batch 4 either way (the budget shrinks both alike)
    (True, "cuda", 1000 + 400 + 20, None, frozenset("b")),  # batch 4 on the host: 20 B left over it
    (True, "cuda", 1000 + 300 + 99, None, "device"),  # batch 3 on the host: 99 B left
    (True, "cuda", 1120, None, frozenset("b")),  # all kept: not even batch 1; on the host batch 1, "b" beside it
    (True, "cuda", None, int(1.1 * (1000 + 800 + 50)) + 1, "device"),  # free memory, with its 10 % margin
    (True, "cuda", None, int(1.1 * (1000 + 800 + 50)) - 2, frozenset("a")),
    (True, "cuda", None, int(1.1 * (1000 + 800 + 19)), "host"),
    (True, "cuda", None, None, "host"),  # no free-memory query
]


@pytest.mark.parametrize(("offloaded_any", "device", "max_memory", "free", "expected"), ROWS_RULE)
def test_rows_placement_rule(offloaded_any, device, max_memory, free, expected):
    """:func:`.offload.rows_placement`'s rule on synthetic estimates: None without an offloaded module, the host on
    a CPU (or remote) model; with ``max_memory`` every block kept iff the largest batch that fits with them is the
    one without, else the blocks that fit what that batch leaves (greedily, in order), the host where none does;
    without it, the same against the free memory over 1.1."""
    from nnsight_lorsa.attribution.offload import rows_placement

    asked: list[str] = []

    def estimate(rows, batch):
        asked.append(rows)
        return _estimate(100, 1000, batch)

    def blocks():
        asked.append("blocks")
        return RULE_BLOCKS

    got = rows_placement(offloaded_any, device, estimate, blocks, batch_size=8, max_memory=max_memory,
                         free_bytes=free)
    assert got == expected
    assert set(asked) <= {"host", "blocks"} and (offloaded_any and device == "cuda" or not asked)


def test_rows_placement_refuses_a_budget_the_host_rows_do_not_fit():
    from nnsight_lorsa.attribution.offload import rows_placement
    from nnsight_lorsa.errors import MemoryBudgetError

    with pytest.raises(MemoryBudgetError):
        rows_placement(True, "cuda", lambda rows, batch: _estimate(100, 1000, batch), lambda: RULE_BLOCKS, batch_size=8,
                       max_memory=1050, free_bytes=None)


# blocks of 40, 10, 30 and 20 B: none kept costs 40 B (the largest, copied per pass), all 100 B (60 more)
GREEDY_BLOCKS = [("a", 40), ("b", 10), ("c", 30), ("d", 20)]
GREEDY = [
    (-1, ""),  # not even the host rows fit
    (0, ""),  # keeping any block costs more than copying the largest
    (9, ""),
    (10, "b"),  # one block: "b" alone costs 10 + 40 (the largest still copied) = 10 more
    (29, "b"),  # "a" alone costs 30 more (30 is copied then), "b" with "c" or "d" 40 or 30
    (30, "a"),  # in order: "a" first, nothing fits beside it
    (59, "ab"),  # one byte short of all: leaving one block out costs as much as keeping it, so two stay out
    (60, "abcd"),
    (10**9, "abcd"),
]


@pytest.mark.parametrize(("slack", "expected"), GREEDY)
def test_kept_blocks_are_chosen_greedily_in_order(slack, expected):
    """:func:`.offload.kept_blocks` on a table of slacks: each block kept, in order, iff the kept set with it costs at
    most ``slack`` bytes more than none kept (:func:`.offload.rows_cost`: the kept blocks + the largest other)."""
    from nnsight_lorsa.attribution.offload import kept_blocks, rows_cost

    kept = kept_blocks(GREEDY_BLOCKS, slack)
    assert kept == frozenset(expected)
    assert rows_cost(GREEDY_BLOCKS, ()) == 40 and rows_cost(GREEDY_BLOCKS, "abcd") == 100
    assert rows_cost(GREEDY_BLOCKS, kept) - 40 <= max(slack, 0)
    for i, (key, _) in enumerate(GREEDY_BLOCKS):  # greedy: no block passed over fits with those kept before it
        before = {k for k, _ in GREEDY_BLOCKS[:i] if k in kept}
        assert key in kept or slack < 0 or rows_cost(GREEDY_BLOCKS, before | {key}) - 40 > slack, key


def test_plan_call_keeps_the_rows_where_they_never_shrink_the_batch():
    """On the prompt's real layout (``memory="lean"``: every site gathers; a device model, as estimated): a generous
    ``max_memory`` keeps the rows on the device at the asked batch; one that fits the asked batch only with the rows
    on the host keeps them there (same batch); resident modules: None, batch as before. And ``attribute`` on a CPU
    model records ``"host"`` for offloaded modules, None for resident ones."""
    from nnsight_lorsa.attribution.budget import largest_batch, plan_call

    rep = bundle("transcoders")
    ids = PROMPTS[0]
    cuda = torch.device("cuda")
    kw = {"batch_size": 8, "max_feature_nodes": None}
    res_layout, res_info = layout_for_estimate(rep, ids, AttributionOptions(batch_size=8, memory="lean"))
    batch, rows, estimate, *_ = plan_call(res_layout, lambda: {**res_info, "device": "cuda"}, cuda, max_memory=10**12,
                                      **kw)
    assert (batch, rows) == (8, None) and estimate("host", batch).offload_rows is None
    assert attribute(rep, ids, batch_size=8).meta["offload_rows"] is None
    off = ReplacementModel(rep.model, **dict(rep.sets()), offload=True)  # rep's sets, offloaded
    layout, info = layout_for_estimate(off, ids, AttributionOptions(batch_size=8, memory="lean"))
    info = {**info, "device": "cuda"}
    batch, rows, estimate, *_ = plan_call(layout, lambda: info, cuda, max_memory=10**12, **kw)
    assert (batch, rows) == (8, "device")
    host, kept = estimate("host", 8), estimate("device", 8)
    assert kept.device_bytes > host.device_bytes and kept.offload_rows == "device" and host.offload_rows == "host"
    budget = host.device_bytes + 1  # batch 8 on the host; the kept rows need more
    assert largest_batch(lambda b: estimate("device", b), budget, 8, "cuda") < 8
    assert plan_call(layout, lambda: info, cuda, max_memory=budget, **kw)[:2] == (8, "host")
    assert attribute(off, ids, batch_size=8).meta["offload_rows"] == "host"
    assert estimate_memory(off, ids, batch_size=8).offload_rows == "host"


def blocks_of(rep: ReplacementModel, ids, memory: str) -> list[tuple[str, int]]:
    """The offloaded row blocks of ``rep`` on prompt ``ids`` (:func:`.offload.offload_blocks`), as estimated."""
    from nnsight_lorsa.attribution.offload import offload_blocks

    layout, info = layout_for_estimate(rep, ids, AttributionOptions(batch_size=8, memory=memory))
    return offload_blocks(layout, d_model=info["d_model"], node_vectors=info["node_vectors"],
                          itemsize=info["model_itemsize"])


@pytest.mark.parametrize("kind", ["transcoders", "clt"])
@pytest.mark.parametrize("memory", ["fast", "lean"])
def test_offloaded_rows_partly_kept_give_the_resident_graph(kind, memory, monkeypatch):
    """Every other block of ``memory="lean"``'s (:func:`.offload.offload_blocks`: sites gathering, Lorsa ``W_V``) kept
    on the device, the rest on the host: the graph (QK tracing too) equals the resident modules' bit for bit — as
    with every block on the host and every block on the device —, ``graph.meta`` says ``"partial"`` and the kept
    bytes, the frozen pass keeps exactly the named blocks the call's sites have (``memory="fast"``: the grids'
    rows are no block; its one ``W_V`` block is among the named ones or not), and no copy outlives the call."""
    from nnsight_lorsa.attribution.offload import kept_keys

    rep = bundle(kind)
    ids = PROMPTS[1]
    ref = attribute(rep, ids, batch_size=24, memory=memory, qk_heads=2)
    off = ReplacementModel(rep.model, **dict(rep.sets()), offload=True)
    lean = [key for key, _ in blocks_of(off, ids, "lean")]
    blocks = blocks_of(off, ids, memory)
    copies = real_copies(monkeypatch)
    made = frozen_instances(monkeypatch)
    sizes: list[int] = []  # how many blocks each partial set kept
    for named in (lean[::2], lean[1::2]):
        partial = frozenset(named)
        for rows in (partial, "host", "device"):
            force_rows(monkeypatch, rows)
            made.clear()
            g = attribute(off, ids, batch_size=24, memory=memory, qk_heads=2)
            what = f"{kind} {memory} {rows}"
            assert_identical(g, ref, what)
            assert set(g.qk) == set(ref.qk) and all(torch.equal(g.qk[k], ref.qk[k]) for k in g.qk), what
            assert g.meta["offload_rows"] == ("partial" if rows is partial else rows), what
            assert len(made) == 2 and all(f.offload_rows == rows for f in made)  # the graph's pass, the QK pass
            kept = made[0].device_rows
            expected = kept_keys(blocks, rows)
            assert {k for k, v in kept.items() if v} == expected, what
            assert g.meta["offload_rows_kept_bytes"] == sum(kept.values()), what
            if rows is partial:
                sizes.append(len(expected))
    gc.collect()
    assert copies and not any(r() is not None for r in copies), "a fetched copy outlived attribute()"
    assert ref.densify().abs().sum() > 0 and len(ref.qk["score"]) > 0
    # not vacuous: lean, some blocks kept and some not each time; fast, its one W_V block kept once
    assert all(0 < n < len(blocks) for n in sizes) if memory == "lean" else sorted(sizes) == [0, 1]


@pytest.mark.parametrize("kind", ["transcoders", "clt"])
def test_partly_kept_offload_rows_term_is_the_bytes_the_frozen_pass_keeps(kind, monkeypatch):
    """``memory="lean"``: :func:`.offload.offload_blocks` lists, in order and byte for byte, the blocks the frozen pass
    keeps with every row on the device (``FrozenReplacement.device_rows``, in the order it made them); for a partial
    set the pass keeps just those, and ``offload_rows`` counted for it (``estimate_layout(offload_rows=set)``) is
    their bytes + the largest block not kept (copied per pass) + the skip matrices, between the host and the device
    terms; ``MemoryEstimate.offload_rows`` says ``"partial"`` and ``offload_rows_kept_bytes`` the kept bytes."""
    rep = bundle(kind)
    ids = PROMPTS[0]
    off = ReplacementModel(rep.model, **dict(rep.sets()), offload=True)
    made = frozen_instances(monkeypatch)
    force_rows(monkeypatch, "device")
    attribute(off, ids, batch_size=8, memory="lean")
    every = {k: v for k, v in made[0].device_rows.items() if v}
    blocks = blocks_of(off, ids, "lean")
    assert blocks == list(every.items()) and len(blocks) >= 4
    partial = frozenset(k for k, _ in blocks[1::2])
    made.clear()
    force_rows(monkeypatch, partial)
    attribute(off, ids, batch_size=8, memory="lean")
    kept = made[0].device_rows
    assert {k for k, v in kept.items() if v} == partial and all(kept[k] == every[k] for k in partial)
    layout, info = layout_for_estimate(off, ids, AttributionOptions(batch_size=8, memory="lean"))
    est = {rows: estimate_layout(layout, batch_size=8, offload_rows=rows, **{**info, "device": "cuda"})
           for rows in (partial, "host", "device")}
    skips = sum(m.W_skip.numel() * m.W_skip.element_size() for m in modules_of(off)
                if isinstance(getattr(m, "W_skip", None), torch.Tensor))
    largest_other = max(v for k, v in every.items() if k not in partial)
    assert est[partial].terms["offload_rows"] == sum(kept.values()) + largest_other + skips
    assert est["host"].terms["offload_rows"] < est[partial].terms["offload_rows"] < est["device"].terms["offload_rows"]
    assert est["host"].terms["offload_rows"] == max(every.values()) + skips
    assert (est[partial].offload_rows, est[partial].offload_rows_kept_bytes) == ("partial", sum(kept.values()))
    assert (est["device"].offload_rows_kept_bytes, est["host"].offload_rows_kept_bytes) == (sum(every.values()), 0)


def test_plan_call_keeps_the_blocks_that_fit_where_all_would_shrink_the_batch():
    """On the prompt's real layout (``memory="lean"``, a device model, as estimated): a ``max_memory`` one byte short of
    every block kept at the asked batch keeps some blocks — not all, the batch the one of the rows on the host —,
    within the budget; the same budget without the slack above the host rows keeps none."""
    from nnsight_lorsa.attribution.budget import largest_batch, plan_call
    from nnsight_lorsa.attribution.offload import rows_cost

    rep = bundle("transcoders")
    ids = PROMPTS[0]
    cuda = torch.device("cuda")
    off = ReplacementModel(rep.model, **dict(rep.sets()), offload=True)
    layout, info = layout_for_estimate(off, ids, AttributionOptions(batch_size=8, memory="lean"))
    info = {**info, "device": "cuda"}
    kw = {"batch_size": 8, "max_feature_nodes": None}
    _, _, estimate, *_ = plan_call(layout, lambda: info, cuda, max_memory=10**12, **kw)
    host, every = estimate("host", 8), estimate("device", 8)
    blocks = blocks_of(off, ids, "lean")
    assert every.device_bytes - host.device_bytes == rows_cost(blocks, [k for k, _ in blocks]) - rows_cost(blocks, ())
    budget = every.device_bytes - 1
    assert largest_batch(lambda b: estimate("device", b), budget, 8, "cuda") < 8 == largest_batch(
        lambda b: estimate("host", b), budget, 8, "cuda")
    batch, rows, estimate, *_ = plan_call(layout, lambda: info, cuda, max_memory=budget, **kw)
    assert batch == 8 and isinstance(rows, frozenset) and 0 < len(rows) < len(blocks)
    est = estimate(rows, 8)
    assert est.device_bytes <= budget and est.offload_rows == "partial" and est.offload_rows_kept_bytes > 0
    assert est.offload_rows_kept_bytes == sum(v for k, v in blocks if k in rows)
    assert plan_call(layout, lambda: info, cuda, max_memory=host.device_bytes, **kw)[:2] == (8, "host")


@pytest.mark.parametrize("device", [d for d in DEVICES if getattr(d, "values", ("cpu",))[0] == "cuda"])
@pytest.mark.parametrize("memory", ["fast", "lean"])
def test_offloaded_rows_kept_on_cuda_give_the_resident_graph(device, memory, monkeypatch):
    """The model on CUDA, two 32 MB transcoders and a Lorsa offloaded: the rule keeps the active rows on the device
    (``graph.meta["offload_rows"] == "device"``, plenty of free memory), the graph equals the resident modules'
    (max |ΔA| ≤ 1e-5 of max |A|: CUDA's atomics may reorder sums), as it does with the rows forced onto the host,
    and the device peak above the model stays below the modules' total bytes."""
    ref, rep, total = offloaded_on_cuda(device, memory)
    R = ref.densify()
    for forced in (None, "host"):
        if forced is not None:
            force_rows(monkeypatch, forced)
        g, above = cuda_peak_above(lambda: attribute(rep, PROMPTS[0], batch_size=24, memory=memory))
        assert g.meta["offload_rows"] == (forced or "device")
        assert above < total, (forced, above, total)
        assert all(p.device.type == "cpu" for m in modules_of(rep) for p in m.parameters())
        assert torch.equal(g.layout_ids, ref.layout_ids)
        assert float((g.densify() - R).abs().max()) <= 1e-5 * float(R.abs().max()), forced


@pytest.mark.parametrize("memory", ["fast", "lean"])
def test_offload_fetch_term_counts_the_whole_weight_a_kept_block_is_gathered_from(memory, monkeypatch):
    """With rows kept on the device, each kept block is gathered there from one transient copy of its whole weight
    (``offload.block_sources``): ``offload_fetch`` is at least the largest of those — with the resident blocks'
    copies made to count nothing, exactly that largest, and nothing with the rows on the host."""
    import nnsight_lorsa.attribution.offload as offload
    from nnsight_lorsa.attribution.offload import block_sources, kept_keys, offload_blocks

    rep = bundle("transcoders")
    off = ReplacementModel(rep.model, **dict(rep.sets()), offload=True)
    layout, info = layout_for_estimate(off, PROMPTS[1], AttributionOptions(batch_size=8, memory=memory))
    monkeypatch.setattr(offload, "fetched_bytes", lambda module, leave=(), parts=None: 0)
    terms = {rows: estimate_layout(layout, batch_size=8, offload_rows=rows, **{**info, "device": "cuda"}).terms
             for rows in ("device", "host")}
    blocks = offload_blocks(layout, d_model=info["d_model"], node_vectors=info["node_vectors"],
                            itemsize=info["model_itemsize"])
    sources = block_sources(layout)
    kept = kept_keys(blocks, "device")
    assert kept and terms["host"]["offload_fetch"] == 0
    assert terms["device"]["offload_fetch"] == max(sources[k] for k in kept) > 0


def _nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def spied_blocks(kind: str, monkeypatch) -> list[tuple[str, torch.nn.Module, int, bool]]:
    """``(where, module, bytes, is_lorsa)`` of every ``resident`` block of one offloaded attribution (spied on
    ``fetch``; ``where``: ``"clean"`` for :func:`.layout.build_layout`'s, ``"frozen"`` for the frozen pass's), run
    with every tensor a block leaves on another device: the graph bit-identical to the resident modules'."""
    rep = bundle(kind)
    ids = PROMPTS[1]
    ref = attribute(rep, ids, batch_size=8)
    off = ReplacementModel(rep.model, **dict(rep.sets()), offload=True)
    modules: list = []
    blocks = fetch_blocks(monkeypatch, modules)
    left = left_on_another_device(monkeypatch)
    assert_identical(attribute(off, ids, batch_size=8), ref, kind)
    assert left["blocks"] > 0
    lorsas = {id(m) for m in off.lorsas.values()}
    return [("clean" if f.endswith("layout.py") else "frozen", m, n, id(m) in lorsas)
            for (f, n), m in zip(blocks, modules, strict=True)]


@pytest.mark.parametrize("kind", ["transcoders", "clt"])
def test_offloaded_clean_pass_copies_only_what_it_reads(kind, monkeypatch):
    """The clean pass's fetches (:func:`.layout.build_layout`) copy what they read, byte for byte: a Lorsa's heads
    all but its output projection ``W_O`` / ``b_D`` (``layout.LORSA_OUT``), a transcoder's (or a cross-layer
    transcoder's) encoder all but its decoders ``W_dec…`` and ``W_skip`` (``layout.coder_decoders``), a CLT's only its
    own layer's ``W_enc[layer]`` / ``b_enc[layer]`` (``layout.coder_layer_parts`` of ``layout.ENCODER_PARTS``) — the
    whole module until 2026-11-27 — and never read what they left (on another device here)."""
    clean = [(m, n, lorsa) for where, m, n, lorsa in spied_blocks(kind, monkeypatch) if where == "clean"]
    assert any(lorsa for *_, lorsa in clean) and not all(lorsa for *_, lorsa in clean)
    for m, n, lorsa in clean:
        left = [m.W_O, m.b_D] if lorsa else \
            [t for name, t in m.named_parameters() if name.startswith("W_dec") or name == "W_skip"]
        # a cross-layer transcoder's layer encodes with its own layer's W_enc[layer] / b_enc[layer] alone
        sliced = _nbytes(m.W_enc, m.b_enc) - _nbytes(m.W_enc[0], m.b_enc[0]) if isinstance(m, CrossLayerTranscoder) \
            else 0
        assert n == module_bytes(m) - _nbytes(*left) - sliced < module_bytes(m), (type(m).__name__, n, module_bytes(m))


def test_a_clt_mlp_site_copies_its_own_layers_skip_matrix_only(monkeypatch):
    """A cross-layer transcoder's MLP site in the frozen pass copies its ``b_dec`` and its own layer's
    ``W_skip[layer]``, byte for byte — not every layer's (``(n_layers, d, d)``: ~1 GB at the 8B shape in bf16,
    copied at each of the 32 sites of a pass until 2026-11-27) — and reads no other (left on another device here:
    the graph is the resident modules' bit for bit); the estimate's ``offload_fetch`` is the largest such copy."""
    sites = [(m, n) for where, m, n, lorsa in spied_blocks("clt", monkeypatch) if where == "frozen" and not lorsa]
    assert sites
    for m, n in sites:
        assert isinstance(m, CrossLayerTranscoder)
        assert n == _nbytes(m.b_dec, m.W_skip[0]) < _nbytes(m.W_skip), (n, _nbytes(m.b_dec, m.W_skip[0]))
    rep = bundle("clt")
    rep.lorsas.offload = rep.transcoders.offload = True
    layout, info = layout_for_estimate(rep, PROMPTS[1], AttributionOptions(batch_size=8))
    lorsa = max(fetched_bytes(m, LORSA_OV) for m in rep.lorsas.values())
    assert estimate_layout(layout, batch_size=8, **{**info, "device": "cuda"}).terms["offload_fetch"] \
        == max(lorsa, *(n for _, n in sites))
