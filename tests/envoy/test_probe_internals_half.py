"""Probe: reading and editing the replacements' internals in half precision, against plain PyTorch.

docs/reliability.md, "Half-precision internals probe (2026-11-27)". The fp32 probe
(``test_probe_internals_edits.py``) again on bf16 and fp16 models, with the modules in the model's dtype and in
another one (fp32 modules on a bf16 / fp16 model, bf16 modules on an fp32 model: docs/nnsight.md, "a module keeps
its dtype"). The references are plain forward hooks on the Hugging Face model doing what the splice documents, op
for op in the same dtypes: the site's input cast to the module's dtype, the module's own ops in its dtype, its
output cast back to the site's dtype, or with ``error=True`` the sum ``true + (out − clean) + (hook(e) − e)`` in
fp32 (``e`` in fp32) cast to the site's dtype. Direct writes past fp16's range end in ``PlacementError``, the
patching edits' values past it in ``ArgumentError``. Found and fixed here: ``patch`` wrote finite values past the
target dtype's range as ``inf``.
"""

from __future__ import annotations

import copy
import functools
from types import SimpleNamespace

import pytest
import torch
from helpers import PROBE_SETTINGS, generated, random_ids, tiny_nnsight
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from test_probe_internals_edits import (  # the fp32 probe's references, with the splice's casts (``w.mdt``)
    HOOKS,
    LORSA_LAYER,
    SAE_LAYER,
    TC_LAYER,
    edit_lists,
    generation_runs,
    invoke_runs,
    reference_logits,
    traced_logits,
)
from test_probe_internals_edits import world as fp32_world

from nnsight_lorsa import LorsaSet, SAESet, TranscoderSet, get_adapter
from nnsight_lorsa.errors import PlacementError

FAMILIES = ("llama", "qwen3", "gpt2", "gemma2", "neox")
#: (model dtype, modules' dtype)
DTYPES = ((torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16), (torch.bfloat16, torch.float32),
          (torch.float16, torch.float32), (torch.float32, torch.bfloat16), (torch.float32, torch.float16),
          (torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16))


@functools.cache
def world(family: str, model_dtype: torch.dtype, module_dtype: torch.dtype) -> SimpleNamespace:
    """The fp32 probe's setting (same weights) with the model in ``model_dtype`` and the modules in ``module_dtype``."""
    base = fp32_world(family)
    model, hf = tiny_nnsight(family, dtype=model_dtype)
    adapter = get_adapter(model)
    lorsa, tc, sae = (copy.deepcopy(m).to(module_dtype) for m in (base.lorsa, base.tc, base.sae))
    sae_site = adapter.layer_path(SAE_LAYER)
    return SimpleNamespace(
        model=model, hf=hf, adapter=adapter, lorsa=lorsa, tc=tc, sae=sae, sae_site=sae_site, mdt=module_dtype,
        sets={"l": LorsaSet(model, {LORSA_LAYER: lorsa}), "t": TranscoderSet(model, {TC_LAYER: tc}),
              "s": SAESet(model, {sae_site: sae})},
        widths=base.widths)


def gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def bound(w: SimpleNamespace, b: torch.Tensor) -> float:
    """The tolerance: 0 (the same ops on the same values, in the same dtypes) — see docs/reliability.md."""
    return 0.0


dtype_ids = st.sampled_from(range(len(DTYPES)))


@generated(15, 300, family=st.sampled_from(FAMILIES), dt=dtype_ids, batch=st.integers(1, 3), length=st.integers(2, 9),
           pads=st.lists(st.integers(0, 3), min_size=3, max_size=3), error=st.booleans(), seed=st.integers(0, 99))
def test_every_internal_read_in_half_precision_is_the_modules_own_value(family, dt, batch, length, pads, error, seed):
    """Every hook point of the three sets on a left-padded batch, in half precision: the trace's value (dtype and
    numbers) = the module's own ops on the cast site input, by hand; the logits too."""
    w = world(family, *DTYPES[dt])
    ids = random_ids(batch, length, seed=seed)
    mask = torch.ones(batch, length, dtype=torch.long)
    for row in range(batch):
        mask[row, :min(pads[row], length - 1)] = 0
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    hooks = [h for h in HOOKS if error or not h.endswith("hook_error")]
    reads = (*hooks, "l.input", "t.input", "s.input")
    logits, got = traced_logits(w, {"input_ids": ids, "attention_mask": mask}, [], error, "lts", reads)
    cap: dict = {}
    want = reference_logits(w, ids, [], error, "lts", mask, position_ids, cap)
    assert logits.dtype == want.dtype and gap(logits, want) <= bound(w, want), gap(logits, want)
    for hook in reads:
        assert got[hook].dtype == cap[hook].dtype and got[hook].shape == cap[hook].shape, hook
        assert gap(got[hook], cap[hook]) <= bound(w, cap[hook]), (hook, gap(got[hook], cap[hook]))
    lorsa, x = w.lorsa, got["l.input"]
    heads = list(range(0, lorsa.cfg.n_ov_heads, 7))
    zp = lorsa.z_pattern(x, heads, position_ids, mask.bool())
    # the z-pattern is a sum over keys in the module's dtype: its rounding differs from the attention's, so the bound
    # is the dtype's eps times the key count times the largest term
    tol = torch.finfo(zp.dtype).eps * length * max(float(zp.abs().max()), 1e-3) * 2
    assert gap(zp.sum(-1).transpose(1, 2), got["l.hook_z_pre"][..., heads]) <= tol
    pattern = lorsa.attention_pattern(x, None, position_ids, mask.bool())
    assert gap(pattern.sum(-1), torch.ones_like(pattern.sum(-1))) <= torch.finfo(pattern.dtype).eps * length * 2


@generated(40, 800, data=st.data(), family=st.sampled_from(FAMILIES), dt=dtype_ids, batch=st.integers(1, 3),
           length=st.integers(2, 8), error=st.booleans(), order=st.permutations("lts"), seed=st.integers(0, 99))
def test_drawn_half_precision_edits_on_three_sets_equal_the_same_edits_by_hand(data, family, dt, batch, length, error,
                                                                              order, seed):
    """1-4 drawn edits (set / scale / add at drawn units and positions, several sets at once in any order) in half
    precision: the logits = the same edits by hand with the splice's casts."""
    w = world(family, *DTYPES[dt])
    edits = data.draw(edit_lists("lts", error, length, w=w))
    ids = random_ids(batch, length, seed=seed)
    logits, _ = traced_logits(w, ids, edits, error, "".join(order))
    want = reference_logits(w, ids, edits, error)
    assert gap(logits, want) <= bound(w, want), (edits, gap(logits, want))


@generated(20, 300, data=st.data(), family=st.sampled_from(FAMILIES), dt=dtype_ids, error=st.booleans(),
           invokes=st.lists(st.tuples(st.integers(2, 7),
                                      st.text("lts", max_size=3).map(lambda s: "".join(sorted(set(s))))),
                            min_size=1, max_size=3), seed=st.integers(0, 99))
def test_half_precision_edits_per_invoke_stay_in_their_rows(data, family, dt, error, invokes, seed):
    """Invokes of different lengths (left-padded by nnsight), each with its own sets and edits, in half precision:
    each invoke's logits = its prompt alone with its sets and edits by hand. Padding changes the attention's
    reductions' lengths, so this one's bound is the dtype's rounding (docs/reliability.md)."""
    w = world(family, *DTYPES[dt])
    longest, runs = invoke_runs(w, data, error, invokes, seed)
    for got, want, sets, edits in runs:
        # a padded row against its prompt alone: the same ops except the masked keys' (zero-weight) terms
        assert gap(got, want) <= padded_bound(w, want, longest), (sets, edits, gap(got, want))


def padded_bound(w: SimpleNamespace, want: torch.Tensor, length: int) -> float:
    """A padded batch (or a cached decoding step) against the prompt alone in one forward: the same ops, but matmuls
    of other shapes (more rows, more keys) may sum in another order — the plain model differs the same way (fp32:
    1.8e-7 on the logits with no set spliced). Each reduction is then off by about ``eps`` of its scale, and where
    the module is narrower than the model (bf16 modules, fp32 model) such a change can flip the rounding of the
    module's input, an ``eps`` of the coarser dtype: ``4 eps(coarser dtype) max(|logits|, 1)`` (bf16's beside
    fp16: both have 16 bits, and picking by bits took fp16's for bf16 modules on an fp16 model). Measured
    (``-m slow``, 300 + 150 cases): at most 4.6 eps(fp32) (fp32 model, bf16 modules), 0.125 eps(fp16), 0 for bf16."""
    eps = max(torch.finfo(want.dtype).eps, torch.finfo(w.mdt).eps)  # the coarser: bf16's beside fp16 (same bits)
    return 4 * eps * max(float(want.abs().max()), 1.0)


@generated(10, 150, data=st.data(), family=st.sampled_from(FAMILIES), dt=dtype_ids, batch=st.integers(1, 2),
           length=st.integers(2, 6), error=st.booleans(), seed=st.integers(0, 99))
def test_half_precision_edits_at_generation_steps_equal_full_sequence_edits(data, family, dt, batch, length, error,
                                                                           seed):
    """``generate`` in half precision with edits at drawn steps: each step's logits = a full-sequence forward of the
    generated tokens with the edits at the positions of the steps that made them, by hand (the cached decode's
    reductions run in another order than the full forward's: the bound is the dtype's rounding)."""
    w = world(family, *DTYPES[dt])
    captures: list = []
    edits, runs = generation_runs(w, data, batch, length, error, "lts", seed, captures)
    for (step, got, want), cap in zip(runs, captures, strict=True):
        if gap(got, want) > padded_bound(w, want, length + step):
            # a selection at a near-tie may go either way under another summation order: not a wrong edit
            assume(not at_selection_boundary(w, cap))
        assert gap(got, want) <= padded_bound(w, want, length + step), (step, edits, gap(got, want))


def at_selection_boundary(w: SimpleNamespace, cap: dict, ulps: int = 8) -> bool:
    """Whether a selection went another way in ``generate`` than in the reference's full forward ``cap`` (a
    ``generation_runs`` capture) at a row where the reference is within ``ulps`` units of rounding (of the coarser of
    the model's and the modules' dtypes, at the row's scale) of a tie: the Lorsa's and the transcoder's top-k (the
    k-th against the (k+1)-th pre-activation) and the SAE's JumpReLU threshold. Decode and full forward sum in other
    orders, so such a selection may flip between them: not a wrong edit (docs/reliability.md, "Half-precision
    internals probe": Qwen3, an exact bf16 tie 2.078125 = 2.078125 at the transcoder's 8th / 9th feature)."""
    eps = max(torch.finfo(w.mdt).eps, torch.finfo(w.hf.dtype).eps) * ulps
    pre = {"l": cap["l.hook_z_pre"], "t": cap["t.hook_sae_acts_pre"], "s": cap["s.hook_sae_acts_pre"]}
    with torch.no_grad():
        chosen = {"l": w.lorsa.activation(pre["l"])[0], "t": w.tc.activation(pre["t"]), "s": w.sae.activation(pre["s"])}

    def margin(kind: str) -> torch.Tensor:  # (batch, pos): the distance to a flip, in the row's scale
        x = pre[kind].double()
        if kind == "s":
            gap = (x - w.sae.activation.threshold.double()).abs().amin(-1)
        else:
            k = w.lorsa.cfg.top_k if kind == "l" else w.tc.activation.k
            top = x.topk(k + 1, dim=-1).values
            gap = top[..., k - 1] - top[..., k]
        return gap / x.abs().amax(-1).clamp_min(1.0)

    return any(bool(((cap["decoded"][kind] != 0) != (chosen[kind] != 0)).any(-1).logical_and(margin(kind) <= eps)
                    .any()) for kind in pre)



#: hook points where an fp16-range-breaking write is possible, with the value written (finite in fp32)
BIG = 1e6


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dt", [1, 3, 6])  # fp16 model: fp16 / fp32 / bf16 modules
@pytest.mark.parametrize("hook", ["s.hook_sae_acts_post", "l.hook_z", "l.hook_out", "t.hook_sae_acts_post",
                                  "t.hook_error"])
@pytest.mark.parametrize("error", [False, True])
def test_an_edit_past_fp16_range_is_a_placement_error_naming_the_site(family, dt, hook, error):
    """``hook.output[...] = 1e6`` on an fp16 model (docs/nnsight.md, "Direct writes in a trace"): an fp16 module's
    ``inf`` output, or a wider module's output past fp16's range, is a ``PlacementError`` naming the site — not NaN
    logits."""
    if hook.endswith("hook_error") and not error:
        return
    w = world(family, *DTYPES[dt])
    ids = random_ids(1, 5, seed=3)
    site = {"s": w.sae_site, "l": w.adapter.attention_path(LORSA_LAYER), "t": w.adapter.mlp_path(TC_LAYER)}[hook[0]]
    with pytest.raises(PlacementError, match=site.replace(".", r"\.")):
        traced_logits(w, ids, [(hook, "set", 1, 2, BIG)], error, "lts")
    # within range the same edit runs and its logits are finite
    logits, _ = traced_logits(w, ids, [(hook, "set", 1, 2, 100.0)], error, "lts")
    assert bool(torch.isfinite(logits).all())


@functools.cache
def attribution_world(dtype: torch.dtype) -> tuple:
    """The attribution tests' tiny Llama (Lorsa at layer 1, transcoders) in ``dtype``, with its clean graph."""
    from helpers import attribution_setup, rm

    from nnsight_lorsa.attribution import attribute

    model, hf, lorsas, tcs = attribution_setup("llama")
    hf.to(dtype)
    for m in [*lorsas.values(), *tcs.values()]:
        m.to(dtype)
    bundle = rm(model, lorsas, tcs)
    ids = random_ids(1, 8, seed=7)[0]
    with model.trace(ids) as tracer:
        handle = attribute(bundle, tracer=tracer, batch_size=40)
    return model, bundle, ids, handle.graph


@settings(max_examples=6, **PROBE_SETTINGS)
@given(data=st.data(), dtype=st.sampled_from([torch.bfloat16, torch.float16]))
def test_the_edit_log_marks_exactly_the_edited_nodes_in_half_precision(data, dtype):
    """1-3 patching edits (ablate / scale / steer) of distinct active nodes (Lorsa heads, transcoder features) in a
    bf16 / fp16 trace with ``attribute(tracer=)``: the graph marks exactly those nodes, and lists each once."""
    from nnsight_lorsa.attribution import attribute
    from nnsight_lorsa.attribution.graph import LORSA, TRANSCODER
    from nnsight_lorsa.patching import Feature, LorsaHead, ablate, steer
    from nnsight_lorsa.patching import scale as scale_edit

    model, bundle, ids, clean = attribution_world(dtype)
    n = clean.nodes
    nodes = [(int(n.kind[i]), int(n.layer[i]), int(n.pos[i]), int(n.index[i])) for i in range(len(n.kind))
             if int(n.kind[i]) in (LORSA, TRANSCODER)]
    chosen = data.draw(st.lists(st.sampled_from(nodes), min_size=1, max_size=3, unique=True))
    ops = [data.draw(st.sampled_from(["ablate", "scale", "steer"])) for _ in chosen]
    with model.trace(ids) as tracer:
        bundle.replace()
        handle = attribute(bundle, tracer=tracer, batch_size=40)
        for (kind, layer, pos, index), op in sorted(zip(chosen, ops, strict=True), key=lambda c: c[0][1]):
            target = bundle(LorsaHead(layer, index) if kind == LORSA else Feature(layer, index, kind="transcoder"))
            if op == "ablate":
                ablate(target, positions=pos)
            elif op == "scale":
                scale_edit(target, 3.0, positions=pos)
            else:
                steer(target, 0.5, positions=pos)
    g = handle.graph.nodes
    marked = {(int(g.kind[i]), int(g.layer[i]), int(g.pos[i]), int(g.index[i]))
              for i in g.intervened.nonzero().flatten().tolist()}
    assert marked == set(chosen), (chosen, ops, marked)
    assert len(handle.graph.meta["intervened"]) == len(chosen)


@pytest.mark.parametrize("op", ["steer", "scale", "patch", "patch_mhsa"])
def test_a_patching_edit_past_fp16_range_is_an_argument_error(op):
    """``steer`` / ``scale`` / ``patch`` of an fp16 model's MHSA head or an fp16 module's head or feature with a
    finite value past fp16's range raise ``ArgumentError`` in the trace (docs/nnsight.md: they check the range),
    before anything is written. (``patch`` wrote a finite fp32 value past the range as ``inf``: on an MHSA head the
    logits then held NaN without a word.)"""
    from nnsight_lorsa.errors import ArgumentError
    from nnsight_lorsa.patching import Feature, LorsaHead, MHSAHead, patch, steer
    from nnsight_lorsa.patching import scale as scale_edit

    model, bundle, ids, _ = attribution_world(torch.float16)
    with pytest.raises(ArgumentError, match="range"), torch.no_grad(), model.trace(ids):
        bundle.replace()
        head, feature = bundle(LorsaHead(1, 0)), bundle(Feature(2, 0, kind="transcoder"))
        if op == "steer":
            steer(head, BIG, positions=3)
        elif op == "scale":
            scale_edit(feature, BIG, positions=3)
        elif op == "patch":
            patch(feature, torch.full((1, 8), BIG))
        else:
            cfg = model.config
            patch(bundle(MHSAHead(1, 0)), torch.full((1, 8, cfg.hidden_size // cfg.num_attention_heads), BIG))


def test_a_patch_of_non_finite_source_values_still_writes_them():
    """``patch`` writes a source run's values as they are, ``inf`` included (its contract): only finite values that
    the cast to the target's dtype would turn into ``inf`` are refused. On an fp16 Lorsa the ``inf`` then ends in
    the site's ``PlacementError``."""
    from nnsight_lorsa.patching import LorsaHead, patch

    model, bundle, ids, _ = attribution_world(torch.float16)
    with pytest.raises(PlacementError, match="inf or NaN"), torch.no_grad(), model.trace(ids):
        bundle.replace()
        patch(bundle(LorsaHead(1, 0)), torch.full((1, 8), float("inf"), dtype=torch.float16))
        model.lm_head.output.save()
