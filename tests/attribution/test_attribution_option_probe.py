"""The attribution option probe (docs/reliability.md, "Attribution option probe (2026-11-27)"): a seeded random
sweep over families × replacement kinds (Lorsa, transcoders of every activation, skip transcoders, a cross-layer
transcoder) × model dtypes × prompt lengths 1–24 × settings, each case checked numerically against the unmodified
model: (i) every computed row's edges + residual = its value within the graph dtype's bound; (ii) batch size, memory
mode, ``max_memory``, offloaded modules (a real copy per fetch), the cache engine and QK tracing leave the graph
unchanged; (iii) a budgeted graph's rows are the full graph's rows, a pruned graph's kept edges the full graph's;
(iv) node values / activations / logit probabilities are a plain ``model.trace``'s with the replacements spliced
(``error=True``); (v) the hook reference engine agrees. And what the probe found: duplicated logit targets."""

from __future__ import annotations

import random

import nnsight
import pytest
import torch
from helpers import (
    attribution_setup,
    head_logits,
    make_lorsa,
    make_transcoder,
    make_transcoders,
    random_ids,
    randomize_,
    rm,
    tiny_nnsight,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import nnsight_lorsa._placement as placement
import nnsight_lorsa.attribution.replacement as repl
from benchmarks.reference.attribution import attribute_with_hooks
from nnsight_lorsa import ReplacementModel, get_adapter
from nnsight_lorsa.attribution import (
    LogitTargets,
    PruneConfig,
    attribute,
    cache_for_attribution,
    estimate_memory,
    prune,
)
from nnsight_lorsa.attribution.engine import build_graph
from nnsight_lorsa.attribution.graph import LORSA, TRANSCODER
from nnsight_lorsa.attribution.logit_targets import check_targets
from nnsight_lorsa.attribution.options import AttributionOptions
from nnsight_lorsa.errors import ConfigMismatchError, NonFiniteError
from nnsight_lorsa.modules import SkipTranscoder, Transcoder, TranscoderConfig
from nnsight_lorsa.modules.clt import CLTConfig, CrossLayerTranscoder

FAMILIES = ("llama", "qwen2", "qwen3", "neox", "gpt2", "gemma2", "gemma3")
KINDS = ("tc", "lorsa_all", "clt", "skip_all", "tc_only", "acts", "acts")
DTYPES = (torch.float32, torch.float32, torch.bfloat16, torch.float16, torch.float64)
#: docs/attribution.md's bounds on Σ edges + residual − value, relative to the row's mass
MASS_BOUND = {torch.float32: 1e-6, torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float64: 1e-10}
#: ReLU / JumpReLU / GroupMax transcoders (every positive pre-activation a node: small features whose pre-activation
#: is a small difference of large terms) round past those: measured ≤ 1.6e-5 of the mass in fp32 (the same graphs
#: in fp64 hold to 1.1e-14: rounding inside the edges, not a missing term), and in bf16 / fp16 a few rows far past
#: (check_sums; docs/reliability.md, "Attribution option probe (2026-11-27)")
MASS_BOUND_MANY = {torch.float32: 5e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float64: 1e-10}
# the tolerance for "same graph up to rounding" (relative to the row mass)
#: fp16 2e-2: lean against fast memory differ by 1.03e-2 of the mass on case 1198 (Qwen3, fp16 transcoders, 18 tokens)
#: at every batch 1–8, and by 1.1e-5 with the same model under dtype=torch.float32: fp16 rounding (~10 eps), not a bug
SAME = {torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.float16: 2e-2, torch.float64: 1e-10}
#: the same for the setups of MASS_BOUND_MANY (their small rows round at the scale of the dot products inside them:
#: measured up to 6.4e-2 of the mass in bf16 between memory modes, 1.2e-2 in fp16, 2.2e-5 in fp32)
SAME_MANY = {**SAME, torch.float32: 5e-5, torch.bfloat16: 0.15, torch.float16: 0.05}
SAME_NOW = SAME

_models: dict = {}
STATS: dict = {}

def setup(family, kind, dtype, seed):
    key = (family, kind, dtype, seed)
    if key in _models:
        return _models[key]
    model, hf = tiny_nnsight(family, seed=seed)
    adapter = get_adapter(model)
    lorsas, tcs = None, None
    if kind == "tc":
        lorsas = {1: make_lorsa(hf, adapter, 1, seed=seed)}
        tcs = make_transcoders((0, 2), skip_layer=2, seed=seed)
    elif kind == "lorsa_all":
        lorsas = {ly: make_lorsa(hf, adapter, ly, seed=seed + ly) for ly in range(3)}
    elif kind == "tc_only":
        tcs = make_transcoders((0, 1, 2), skip_layer=1, seed=seed)
    elif kind == "skip_all":
        lorsas = {0: make_lorsa(hf, adapter, 0, seed=seed)}
        tcs = {ly: make_transcoder(skip=True, seed=seed + ly, layer=ly) for ly in (1, 2)}
    elif kind == "acts":  # per-layer transcoders in every activation, the dict in reverse order
        ACTS = [("relu", {}), ("batchtopk", {"k": 4}), ("abstopk", {"k": 4}), ("groupmax", {"k": 4}),
                ("jumprelu", {"threshold": 0.05}), ("topk", {"k": 3})]
        r = random.Random(seed * 7 + sum(map(ord, family)))
        tcs = {}
        for ly in (2, 1, 0):
            act, params = ACTS[r.randrange(len(ACTS))]
            cls = SkipTranscoder if r.random() < 0.5 else Transcoder
            tcs[ly] = randomize_(cls(TranscoderConfig(d_in=64, d_sae=64, activation=act, activation_params=params,
                                                     layer=ly)), seed + ly).eval()
        if r.random() < 0.5:
            lorsas = {r.randrange(3): make_lorsa(hf, adapter, r.randrange(3), seed=seed)}
            lorsas = {ly: make_lorsa(hf, adapter, ly, seed=seed) for ly in lorsas}
    elif kind == "clt":
        lorsas = {2: make_lorsa(hf, adapter, 2, seed=seed)}
        torch.manual_seed(seed)
        tcs = CrossLayerTranscoder(CLTConfig(d_in=64, d_sae=64, n_layers=3, activation="topk",
                                             activation_params={"k": 4}, skip=bool(seed % 2)))
        randomize_(tcs, seed)
    hf.to(dtype)
    coders = [*tcs.values()] if isinstance(tcs, dict) else [tcs] if tcs is not None else []
    for m in [*(lorsas or {}).values(), *coders]:
        m.to(dtype)
    _models[key] = (model, hf, lorsas, tcs)
    return _models[key]


def keyed(g):
    return {int(ly): i for i, ly in enumerate(g.layout_ids)}


def row_diff(a, b):
    """max over a's computed rows of Σ|a-b| / Σ|a| (nodes matched by layout id; b must hold a's nodes)."""
    kb = keyed(b)
    ib = torch.tensor([kb[int(ly)] for ly in a.layout_ids])
    rows = a.feature_rows.nonzero().flatten()
    A = a.densify()[rows].double()
    B = b.densify()[ib[rows]][:, ib].double()
    mass = A.abs().sum(1) + B.abs().sum(1)
    return float(((A - B).abs().sum(1) / mass.clamp_min(1e-30)).max()) if len(rows) else 0.0


PREC = {torch.float16: 1, torch.bfloat16: 0, torch.float32: 2, torch.float64: 3}


def tol_of(dt, mdt):
    """graphs that must agree: to the graph dtype's rounding; a model less precise than the graph's dtype gives
    its frozen constants at its own rounding of the fp32 stream (a bf16 cast of 1e-7 differences flips ulps)"""
    return SAME_NOW[dt] if PREC[mdt] >= PREC[dt] else max(SAME_NOW[dt], 1e-3)


def same_graph(a, b, dt, what, fails, exact=False):
    if not torch.equal(a.layout_ids, b.layout_ids) or not torch.equal(a.nodes.kind, b.nodes.kind):
        fails.append(f"{what}: node sets differ ({a.n_nodes} vs {b.n_nodes})")
        return
    if not torch.equal(a.feature_rows, b.feature_rows):
        fails.append(f"{what}: computed rows differ")
        return
    if exact:
        for name in ("values", "residual", "logit_probs"):
            x, y = getattr(a, name), getattr(b, name)
            if not torch.equal(torch.isnan(x), torch.isnan(y)) or not torch.equal(x.nan_to_num(), y.nan_to_num()):
                fails.append(f"{what}: {name} not bit-identical")
        if not torch.equal(a.densify(), b.densify()):
            fails.append(f"{what}: adjacency not bit-identical, max {float((a.densify()-b.densify()).abs().max()):.3g}")
        return
    d = row_diff(a, b)
    STATS.setdefault(what.split("=")[0].rstrip("0123456789"), []).append(d)
    if d > SAME_NOW[dt]:
        fails.append(f"{what}: rows differ by {d:.3g} of mass (> {SAME_NOW[dt]})")
    rows = a.feature_rows
    va, vb = a.values[rows].double(), b.values[rows].double()
    mass = a._row_sums(rows.nonzero().flatten(), True)
    dv = float(((va - vb).abs() / mass.clamp_min(1e-30)).max()) if rows.any() else 0
    if dv > SAME_NOW[dt]:
        fails.append(f"{what}: values differ by {dv:.3g} of mass")


def check_sums(g, dt, what, fails, bound=None):
    """(i): Σ edges + residual − value within ``bound[dt]`` of each row's mass. With ReLU-like coders in bf16 / fp16
    a few rows (a feature whose pre-activation is a small difference of large terms) round far past it: there at
    most 5 % of the rows may, each below its own mass (docs/reliability.md: measured up to 0.57 of the mass, on at
    most 2.2 % of a graph's rows)."""
    bound = bound or MASS_BOUND
    e = g.edge_sum_error("mass")
    if len(e) and not bool(torch.isfinite(e).all()):
        fails.append(f"{what}: non-finite edge-sum error")
    elif len(e) and bound is MASS_BOUND_MANY and dt in (torch.bfloat16, torch.float16):
        share = float((e > bound[dt]).double().mean())
        if share > 0.05 or float(e.max()) >= 1.0:
            fails.append(f"{what}: edge sum error over {bound[dt]} on {share:.1%} of rows, max {float(e.max()):.3g}")
    elif len(e) and float(e.max()) > bound[dt]:
        fails.append(f"{what}: edge sum error {float(e.max()):.3g} of mass > {bound[dt]}")
    if not bool(torch.isfinite(g.densify()).all()):
        fails.append(f"{what}: non-finite edges")


def graph_dtype(g):
    return {"torch.float32": torch.float32, "torch.bfloat16": torch.bfloat16, "torch.float16": torch.float16,
            "torch.float64": torch.float64}[g.meta["dtype"]]


def check_values_against_trace(model, hf, rep, lorsas, tcs, ids, g, zp, dt, mdt, fails):
    """(iv): node values = the plain trace's activations with the replacements spliced (error=True)."""
    acts = {}
    with torch.no_grad(), model.trace(ids[None]):
        env = rep.replace(error=True)
        reads = [(ly, 0, "L", e) for ly, e in env.get("lorsas", {}).items()]
        if isinstance(tcs, dict):
            reads += [(ly, 1, "T", e.hook_sae_acts_post) for ly, e in env["transcoders"].items()]
        elif tcs is not None:  # a cross-layer transcoder: one hook per layer
            reads += [(ly, 1, "T", env["transcoders"].hook_sae_acts_post[ly]) for ly in range(tcs.cfg.n_layers)]
        for ly, _, k, e in sorted(reads, key=lambda r: r[:2]):
            acts[(k, ly)] = nnsight.save(e.hook_z.output if k == "L" else e.output)
    T = {torch.float32: 1e-4, torch.float64: 1e-6, torch.bfloat16: 3e-2, torch.float16: 5e-3}
    tol = max(T[dt], T[mdt])
    for (k, ly), a in acts.items():
        a = a[0].float()  # (pos, n)
        kind = LORSA if k == "L" else TRANSCODER
        sel = ((g.nodes.kind == kind) & (g.nodes.layer == ly)).nonzero().flatten()
        got = torch.zeros_like(a)
        got[g.nodes.pos[sel], g.nodes.index[sel]] = g.nodes.activation[sel].float()
        exp = a.clone()
        exp[:zp] = 0
        scale = float(exp.abs().max()) + 1e-6
        # every active (non-zero) activation is a node and vice versa
        act_set = set(map(tuple, (exp != 0).nonzero().tolist()))
        node_set = set(zip(g.nodes.pos[sel].tolist(), g.nodes.index[sel].tolist(), strict=True))
        recast = g.meta["dtype_option"] not in (None, "None", str(mdt))
        if recast:  # the replacement recomputed in another dtype: ties at the top-k / threshold may flip
            common = act_set & node_set
            # (ReLU-like coders: every feature near 0 may flip, up to 4 here; top-k coders: ties, up to 2)
            if len(act_set ^ node_set) > max(4 if SAME_NOW is SAME_MANY else 2, 0.05 * len(act_set)):
                fails.append(f"values {k}{ly}: node set far from the trace's ({len(act_set ^ node_set)} differ)")
            keep = torch.zeros_like(exp, dtype=torch.bool)
            for p, i in common:
                keep[p, i] = True
            got, exp = got * keep, exp * keep
        elif act_set != node_set:
            fails.append(f"values {k}{ly}: node set != active set of the trace ({len(node_set)} vs {len(act_set)}, "
                         f"sym diff {len(act_set ^ node_set)})")
        err = float((got - exp).abs().max()) / scale
        if err > tol:
            fails.append(f"values {k}{ly}: activations differ from trace by {err:.3g} of max")
        # graph.values (the frozen model's) against the trace, relative to each row's mass (the documented scale)
        mass = g._row_sums(sel, True).float()
        ex = exp[g.nodes.pos[sel], g.nodes.index[sel]]
        on = ex != 0
        err = float(((g.values[sel].float() - ex).abs() / mass.clamp_min(1e-30))[on].max()) if bool(on.any()) else 0.0
        if err > max(SAME_NOW[dt], SAME_NOW[mdt], 1e-6):
            fails.append(f"values {k}{ly}: graph.values differ from trace activations by {err:.3g} of row mass")
    logits = head_logits(hf, ids[None])[0, -1].double()
    lid = g.logit_ids
    tok = g.nodes.index[lid]
    with torch.no_grad():
        full = hf(ids[None]).logits[0, -1].double()
    probs = full.softmax(-1)[tok]
    if float((probs - g.logit_probs.double()).abs().max()) > tol:
        fails.append(f"logit probs differ from model by {float((probs - g.logit_probs.double()).abs().max()):.3g}")
    dm = (logits - logits.mean())[tok]
    mass = g._row_sums(lid, True)
    err = float(((dm - g.values[lid].double()).abs() / mass.clamp_min(1e-30)).max())
    if err > max(SAME_NOW[dt], SAME_NOW[mdt], 1e-6):
        fails.append(f"logit values differ from demeaned logits by {err:.3g} of row mass")


def probe_case(rng, family=None):
    """One drawn case: ``(description, failures)``; every failure a string naming the check and the numbers.
    ``family`` forces the family (the draw from ``FAMILIES`` is still taken, so every other draw is the case's own)."""
    drawn = rng.choice(FAMILIES)
    family = family or drawn
    kind = rng.choice(KINDS)
    mdt = rng.choice(DTYPES)
    seed = rng.randrange(3)
    n = rng.randint(1, 24)
    pseed = rng.randrange(1000)
    model, hf, lorsas, tcs = setup(family, kind, mdt, seed)
    rep = rm(model, lorsas, tcs)
    ids = random_ids(1, n, seed=pseed)[0]
    if rng.random() < 0.3:
        ids[0] = 0  # BOS
    zp = rng.choice([0, 0, 0, 1, min(2, n - 1), n - 1]) if n > 1 else 0
    dtype_opt = rng.choice([None, None, None, torch.float32, torch.float64, torch.bfloat16, torch.float16])
    dtype_opt = None if dtype_opt == mdt else dtype_opt
    targets = rng.choice([None, None, [3, 7], [int(ids[-1])], [9, 3, 100], ["w5", "w17"],
                          LogitTargets(max_n=3, cumulative_prob=0.5)])
    base = dict(zero_positions=zp, dtype=dtype_opt, targets=targets)
    desc = dict(family=family, kind=kind, model_dtype=str(mdt), seed=seed, n=n, pseed=pseed, bos=int(ids[0]) == 0,
                **{k: str(v) for k, v in base.items()})
    fails = []
    try:
        g = attribute(rep, ids, batch_size=64, memory="fast", **base)
    except NonFiniteError as e:  # an fp16 frozen pass whose edges pass 65504 (random weights cancel ~1000x): named
        if (dtype_opt or mdt) == torch.float16:
            desc["named_error"] = "NonFiniteError"
            return desc, []
        return desc, [f"ERROR full: NonFiniteError outside fp16: {str(e)[:200]}"]
    except Exception as e:
        return desc, [f"ERROR full: {type(e).__name__}: {str(e)[:200]}"]
    dt = graph_dtype(g)
    B = MASS_BOUND_MANY if kind == "acts" else MASS_BOUND
    global SAME_NOW
    SAME_NOW = SAME_MANY if kind == "acts" else SAME
    TOL = dt if PREC[mdt] >= PREC[dt] else torch.bfloat16 if mdt == torch.bfloat16 else torch.float16
    check_sums(g, dt, "full", fails, B)
    if float(g.residual.abs().max()) != 0:
        fails.append(f"full: non-zero residual {float(g.residual.abs().max()):.3g}")
    nf = int(((g.nodes.kind == LORSA) | (g.nodes.kind == TRANSCODER)).sum())
    if int(g.feature_rows.sum()) != nf + len(g.logit_ids):
        fails.append("full: not every feature row computed")
    try:
        check_values_against_trace(model, hf, rep, lorsas, tcs, ids, g, zp, dt, mdt, fails)
    except Exception as e:
        fails.append(f"ERROR trace check: {type(e).__name__}: {str(e)[:300]}")
    # (ii) settings that must not change the graph
    variants = []
    b = rng.randint(1, 8)
    variants.append((f"batch{b}", dict(batch_size=b, memory="fast"), True))
    mem = rng.choice(["lean", "auto", ("store", "grid"), ("sdpa", "gather"), ("store", "gather"), ("sdpa", "grid")])
    variants.append((f"memory={mem}", dict(batch_size=rng.randint(1, 64), memory=mem), False))
    variants.append(("max_memory", dict(batch_size=64, memory="fast", max_memory=1 << 34), True))
    variants.append(("small_max_memory", dict(batch_size=64, memory="fast", _small=True), False))
    variants.append(("offload", dict(batch_size=64, memory="fast", _offload=True), True))
    variants.append(("offload-lean-b", dict(batch_size=b, memory="lean", _offload=True), False))
    for name, kw, exact in variants:
        kw = dict(kw)
        off = kw.pop("_offload", False)
        if kw.pop("_small", False):  # a budget that forces a batch below 64
            est = estimate_memory(rep, ids, batch_size=2, memory="fast", **base)
            kw["max_memory"] = int(est.host_bytes) + 1
        r = ReplacementModel(model, **dict(rep.sets()), offload=True) if off else rep
        saved = placement.fetch, repl.fetch
        if off:  # a real copy, as to another device (tests/attribution/test_attribution_offload.py)
            placement.fetch = repl.fetch = lambda t, device: t.to(device).clone()
        try:
            fn = build_graph if isinstance(kw.get("memory"), tuple) else attribute
            v = fn(r, ids, **kw, **base)
        except Exception as e:
            fails.append(f"ERROR {name}: {type(e).__name__}: {str(e)[:200]}")
            continue
        finally:
            placement.fetch, repl.fetch = saved
            if off:  # the sets are shared: resident again for the rest of the case (and the cached setup)
                ReplacementModel(model, **dict(rep.sets()), offload=False)
        # batch size: rows are computed by the same ops in other groupings; exactness not claimed -> tolerance
        same_graph(v, g, TOL, name, fails, exact=exact and name.startswith(("max_memory", "offload")))
        check_sums(v, dt, name, fails, B)
    # (v) the hook reference engine
    if rng.random() < 0.4:
        try:
            h = attribute_with_hooks(rep, ids, batch_size=rng.randint(1, 64), **base)
            same_graph(h, g, TOL, "hooks", fails)
        except Exception as e:
            fails.append(f"ERROR hooks: {type(e).__name__}: {str(e)[:200]}")
    # the cache engine: "same graph either way" (lower-precision models: linearised at the fp32 stream, documented)
    if rng.random() < 0.4:
        try:
            cache = cache_for_attribution(rep, ids)
            c = attribute(rep, cache, batch_size=rng.randint(1, 64), **base)
            check_sums(c, graph_dtype(c), "cache", fails, B)
            if PREC[mdt] >= 2 and dtype_opt in (None, mdt):
                # an fp64 model's RMSNorms compute in fp32 (Hugging Face's cast): the traced graph linearises there
                same_graph(c, g, torch.float32 if torch.float64 == TOL else TOL, "cache", fails)
        except Exception as e:
            fails.append(f"ERROR cache: {type(e).__name__}: {str(e)[:200]}")
    # QK tracing: must not change the graph; each decomposition sums to its score
    if lorsas and rng.random() < 0.5:
        h = rng.randint(1, 4)
        mem = rng.choice(["fast", "lean"])
        try:
            q = attribute(rep, ids, batch_size=rng.randint(1, 64), memory=mem, qk_heads=h, **base)
            same_graph(q, g, TOL, f"qk{h}-{mem}", fails)
            qk = q.qk
            if len(qk.get("score", [])):
                e = float(qk["pair_sum_error"].max())
                bound = {torch.float32: 1e-5, torch.float64: 1e-10, torch.bfloat16: 2e-2,
                         torch.float16: 3e-3}[graph_dtype(q)]
                if not e < bound:
                    fails.append(f"qk{h}-{mem}: pair sum error {e:.3g} > {bound}")
                q2 = attribute(rep, ids, batch_size=rng.randint(1, 64), memory="lean" if mem == "fast" else "fast",
                               qk_heads=h, **base)
                if not torch.equal(q2.qk["probe"], qk["probe"]):
                    fails.append(f"qk{h}: probes differ across memory/batch")
                else:
                    sc = qk["score"].double().abs().max()
                    d = float((q2.qk["score"].double() - qk["score"].double()).abs().max() / sc.clamp_min(1e-30))
                    # fp32: 3e-5 (the scores of two batchings measured 1.24e-5 apart on an AVX-512 CPU, case 1262)
                    if d > max(SAME_NOW[TOL], {torch.float32: 3e-5}.get(TOL, 1e-5)):
                        fails.append(f"qk{h}: scores differ across memory/batch by {d:.3g}")
        except Exception as e:
            fails.append(f"ERROR qk: {type(e).__name__}: {str(e)[:200]}")
    # (iii) budgets and pruning
    if nf > 1:
        k = rng.randint(1, nf - 1)
        bb = rng.randint(1, 8)
        try:
            gb = attribute(rep, ids, batch_size=bb, max_feature_nodes=k, update_interval=rng.randint(1, 4), **base)
            if len(gb.feature_ids) != k:
                fails.append(f"budget{k}: {len(gb.feature_ids)} feature rows, not {k}")
            if rng.random() < 0.5:  # a budget and pruning together: kept edges are the full graph's
                cfg = PruneConfig(0.8, 0.98, keep_mass=rng.choice([1.0, 0.9]))
                gbp = attribute(rep, ids, batch_size=bb, max_feature_nodes=k, prune=cfg, **base)
                check_sums(gbp, dt, f"budget{k}+prune", fails, B)
                check_pruned(gbp, g, TOL, 0.5, f"budget{k}+prune(0.8,0.98)", fails)
            if rng.random() < 0.3:  # a budget at least the features: the full graph
                gall = attribute(rep, ids, batch_size=bb, max_feature_nodes=nf + rng.randint(0, 3), **base)
                same_graph(gall, g, TOL, "budget>=all", fails)
            check_sums(gb, dt, f"budget{k}/b{bb}", fails, B)
            check_budget_rows(gb, g, TOL, f"budget{k}/b{bb}", fails)
        except Exception as e:
            fails.append(f"ERROR budget: {type(e).__name__}: {str(e)[:200]}")
    nt, et = rng.choice([(0.8, 0.98), (0.5, 0.9), (0.95, 0.99), (0.3, 0.5)])
    km = rng.choice([1.0, 1.0, 0.9, 0.99])
    try:
        gp = attribute(rep, ids, batch_size=rng.randint(1, 64), prune=PruneConfig(nt, et, keep_mass=km), **base)
        check_sums(gp, dt, f"prune({nt},{et},{km})", fails, B)
        check_pruned(gp, g, TOL, km, f"prune({nt},{et},{km})", fails)
    except Exception as e:
        fails.append(f"ERROR prune: {type(e).__name__}: {str(e)[:200]}")
    return desc, fails


def check_budget_rows(gb, g, dt, what, fails):
    """a budgeted graph's rows = the full graph's rows over its columns; residual = the rest of the row."""
    kf = keyed(g)
    ib = torch.tensor([kf[int(ly)] for ly in gb.layout_ids])
    rows = gb.feature_rows.nonzero().flatten()
    A = gb.densify()[rows].double()
    F = g.densify()[ib[rows]].double()
    Fin = F[:, ib]
    mass = F.abs().sum(1).clamp_min(1e-30)
    d = float(((A - Fin).abs().sum(1) / mass).max())
    if d > SAME_NOW[dt]:
        fails.append(f"{what}: budgeted rows differ from full rows by {d:.3g} of mass")
    rest = F.sum(1) - Fin.sum(1)
    dr = float(((gb.residual[rows].double() - rest).abs() / mass).max())
    if dr > SAME_NOW[dt]:
        fails.append(f"{what}: residual != full row's dropped edges by {dr:.3g} of mass")
    dv = float(((gb.values[rows].double() - g.values[ib[rows]].double()).abs() / mass).max())
    if dv > SAME_NOW[dt]:
        fails.append(f"{what}: values differ by {dv:.3g}")


def check_pruned(gp, g, dt, km, what, fails):
    kf = keyed(g)
    try:
        ib = torch.tensor([kf[int(ly)] for ly in gp.layout_ids])
    except KeyError:
        fails.append(f"{what}: pruned graph holds a node the full graph lacks")
        return
    rows = gp.feature_rows.nonzero().flatten()
    A = gp.densify()[rows].double()
    F = g.densify()[ib[rows]][:, ib].double()
    mass = g.densify()[ib[rows]].double().abs().sum(1).clamp_min(1e-30)
    nz = A != 0
    d = float((((A - F) * nz).abs().sum(1) / mass).max()) if len(rows) else 0
    if d > SAME_NOW[dt]:
        fails.append(f"{what}: kept edges differ from full edges by {d:.3g} of mass")
    if km == 1.0:
        pr = prune(g, node_threshold=float(what.split("(")[1].split(",")[0]), edge_threshold=float(what.split(",")[1]))
        if not torch.equal(gp.layout_ids, g.layout_ids[pr.node_mask]):
            fails.append(f"{what}: kept nodes != prune(full)'s ({gp.n_nodes} vs {int(pr.node_mask.sum())})")
        else:
            d2 = float((((A - F)).abs().sum(1) / mass).max()) if len(rows) else 0
            if d2 > SAME_NOW[dt]:
                fails.append(f"{what}: edges != full among kept nodes by {d2:.3g}")
    dv = float(((gp.values[rows].double() - g.values[ib[rows]].double()).abs() / mass).max()) if len(rows) else 0
    if dv > SAME_NOW[dt]:
        fails.append(f"{what}: values differ by {dv:.3g}")


#: cheap drawn cases (< 2 s each here) covering the families, replacement kinds, dtypes, n = 1, zero_positions = n - 1
FAST = [1041, 1022, 1019, 1016, 1042, 1014, 1010, 1033]


@pytest.mark.parametrize("case", FAST)
def test_attribution_option_probe(case):
    desc, fails = probe_case(random.Random(case))
    assert not fails, (desc, fails)


@pytest.mark.slow
@pytest.mark.parametrize("case", range(1000, 1400))
def test_attribution_option_probe_sweep(case):
    """The sweep of docs/reliability.md (400 cases, ~30 min on one core)."""
    desc, fails = probe_case(random.Random(case))
    assert not fails, (desc, fails)


#: the families added after the sweep (OLMo-2: no pre-norms, QK-norm over the whole projection, post-norms; Phi-3:
#: fused qkv, partial rotary, a window on every layer; Gemma-1): the same drawn cases with the family forced
#: (``probe_case(rng, family=…)``; ``FAMILIES`` unchanged, so the cases above draw as before)
NEW_FAMILIES = ("olmo2", "phi3", "gemma")
#: cheap forced-family cases (< 2 s each here): a cross-layer transcoder, mixed activations in bf16, skip transcoders
#: in fp64, a Lorsa with transcoders at n = 1 and n = 12
FAST_NEW = [("olmo2", 1011), ("phi3", 1013), ("phi3", 1022), ("gemma", 1006), ("gemma", 1025)]
#: failures of the sweep below that are rounding of the tiny random models, not wrong results (each case's other
#: checks pass; docs/reliability.md): ``(family, case)`` -> the prefix of the one failure it gives
#: - (Phi-3, 1017, fp16: a pruned row's 3.5e-3 sum error past fp16's 3e-3 — gone since 79b08c9, which gives the
#:   Lorsa the fp16 model's own rounded RoPE frequencies: the case now passes, so it is no longer listed.)
#: - Gemma-1, 1022 (fp64 model traced in bf16, 3 tokens): one QK probe (score 0.015) has a pair sum error of 0.060
#:   of its pairs' mass in bf16, 0.031 in fp16, 1.6e-5 in fp32, 1.5e-14 in fp64 (the model's dtype): rounding.
KNOWN_NEW = {("gemma", 1022): "qk4-lean: pair sum error"}


@pytest.mark.parametrize(("family", "case"), FAST_NEW)
def test_attribution_option_probe_new_families(family, case):
    desc, fails = probe_case(random.Random(case), family=family)
    assert desc["family"] == family
    assert not fails, (desc, fails)


@pytest.mark.slow
@pytest.mark.parametrize("family", NEW_FAMILIES)
@pytest.mark.parametrize("case", range(1000, 1040))
def test_attribution_option_probe_new_families_sweep(family, case):
    """The sweep of docs/reliability.md on the new families (40 cases each, ~7 min in all on one core); the known
    rounding failures (:data:`KNOWN_NEW`) must be the case's only failure, and still occur."""
    desc, fails = probe_case(random.Random(case), family=family)
    assert desc["family"] == family
    known = KNOWN_NEW.get((family, case))
    if known is not None:
        assert len(fails) == 1 and fails[0].startswith(known), (desc, fails)
        return
    assert not fails, (desc, fails)


@pytest.fixture(scope="module")
def llama():
    model, _, lorsas, tcs = attribution_setup("llama")
    return rm(model, lorsas, tcs), random_ids(1, 6, seed=3)[0]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 127), min_size=1, max_size=6), st.data())
def test_a_repeated_logit_target_is_refused(ids, data):
    """A token named twice was two logit nodes of one token: the pruning's influence weighted it twice (45 kept
    nodes instead of 42 on the tiny Llama) and the Neuronpedia export held two nodes of one ``node_id``. Refused
    now, ids and strings alike (ConfigMismatchError naming the token), before anything runs."""
    dup = data.draw(st.sampled_from(ids))
    at = data.draw(st.integers(0, len(ids)))
    targets = [*ids[:at], dup, *ids[at:]]
    with pytest.raises(ConfigMismatchError, match="twice"):
        check_targets(targets)
    with pytest.raises(ConfigMismatchError, match="twice"):
        AttributionOptions(targets=torch.tensor(targets))
    with pytest.raises(ConfigMismatchError, match="twice"):
        check_targets([f"w{t}" for t in targets])
    distinct = list(dict.fromkeys(ids))
    assert check_targets(distinct) == tuple(distinct)


def test_two_strings_of_one_token_are_refused(llama):
    """Two different strings the tokenizer maps to one token (the tiny tokenizer's unknown words are all ``<eos>``)
    are refused when the strings are resolved, before the frozen pass."""
    r, ids = llama
    with pytest.raises(ConfigMismatchError, match="twice"):
        attribute(r, ids, targets=["w3", "qqq", "zzz"])
    with pytest.raises(ConfigMismatchError, match="twice"):
        attribute(r, ids, targets=[3, 3])
    g = attribute(r, ids, targets=["w3", "qqq"], batch_size=64)
    assert g.nodes.index[g.logit_ids].tolist() == [3, 1]
