"""Where an attribution's memory goes, term by term: RSS at the phases of one ``attribute`` call.

    python -m benchmarks.attribution_memory_terms [--lengths 64,128,256] [--batch 64] [--name attribution_memory_terms]
        [--modes dense,pruned,budget,sparse,budget_pruned|frozen] [--budget 64] [--keep-mass 0.9] [--node-threshold 0.8]
        [--model tc|bundle|random|tiny|vocab|mlp|heads|gemma2|gemma3] [--dtype float32|float64|model]
        [--model-dtype float32|bfloat16] [--patterns auto|sdpa] [--attn eager|sdpa] [--offset 20000]

``--modes frozen`` measures the frozen pass alone (:func:`frozen_pass_peaks`): its allocation-level peak
(``benchmarks._alloc_peak``) at batches 1, 2, 4 and 8 with one backward per target site (the logits, each Lorsa and
transcoder layer's first rows), against ``estimate_memory``'s ``frozen_per_copy · B + frozen_shared`` — on the
models above and on random Llamas of other shapes (``tiny``; ``vocab``: a vocabulary 16× ``L·d``; ``mlp``: an MLP
32× ``d``; ``heads``: 16 query heads of 16 over 2 KV heads; :data:`RANDOM_SHAPES`) and on a Gemma-2 and a Gemma-3
of the test suite's tiny shape (``gemma2``, ``gemma3``: post-norms, soft-capped attention, sliding layers; and
``olmo2``: post-norms without pre-norms; :data:`TINY_FAMILIES`; ``--attn``: the model's attention implementation,
eager or SDPA — transformers refuses SDPA for Gemma-2), built in ``--model-dtype``, computed in ``--dtype``
(``model``: the model's), with stored patterns or SDPA (``--patterns sdpa``, the GPU's path; Gemma-2's soft-capped
layers keep their patterns either way).

The embedded tinyshakespeare Llama with its packaged transcoders on all four MLPs (no Lorsa; ``--model tc``, the
default), or with its packaged Lorsa on layer 2 too (``bundle``), or a random Llama of ``benchmarks/gpu_scale.py``'s
``small`` shape (d 512, 4 layers) with a Lorsa of that benchmark on layer 1 and TopK transcoders on every MLP
(``random``: a random-token prompt); ``--dtype``: ``attribute``'s ``dtype=``; ``--offset``: where in the corpus the
prompt starts. One thread, a fresh process per length and mode (``dense``: the full graph; ``pruned``:
``prune=PruneConfig(0.8, 0.98)``, equal to dense pruning; ``budget``: ``max_feature_nodes=--budget``, unpruned, with
``estimate_memory``'s prediction and the bytes the graph's adjacency holds; the two modes pruned on sparse rows:
``sparse``: ``prune=PruneConfig(--node-threshold, 0.98, keep_mass=--keep-mass)``, ``budget_pruned``:
``max_feature_nodes=--budget`` with ``prune=PruneConfig(--node-threshold, 0.98)`` — these also record the entries among
the node-pruned nodes, ``among_entries``, which the edge scores cover, the kept graph's size, and the stored entries of
the feature rows and of the logit rows next to the memory model's bound on each,
:func:`nnsight_lorsa.attribution.budget.structural_entries`'s per row: ``entries``). The phases are read by wrapping the
engine's steps (``prepare``, the frozen pass ``attribute_in_trace``, each ``RowStore.record``, ``assemble`` /
``assemble_pruned``, the budget's ``RowScheduler.feature_influence``) and reading Linux's ``VmRSS`` / ``VmHWM`` (reset
before the call, and again — the call's peak so far kept — at the assembly and at each selection, whose own peaks are
then measured): *clean pass* (peak growth up to the layout), *frozen pass* (peak growth from there to the end of the
second batch: the forward over ``B`` copies and one backward), *rows* (RSS growth from then to the end of the frozen
pass: the stored rows, and the allocator's retention), *rows held* (the bytes the stored rows hold as the assembly
starts — blocks, or sparse entries + 16 B per row — plus, unpruned with a budget, the graph's blocks), *assembly* (peak
growth during assembly / pruning), *selection* (the largest peak growth of one influence estimate, the heap trimmed
first), the call's peak, and ``estimate_memory``'s prediction of each term (``predicted``). After the call the assembly
runs once more on the same stored rows under ``benchmarks._alloc_peak.allocation_peak``: ``assembly_alloc_mb``, the most
tensor memory it allocates at once — reproducible to the byte, where the resident-set peak moves by MBs with the heap's
state. Run against another checkout (its directory first on ``PYTHONPATH``) to compare versions; the numbers of this one
and of ``main`` before this round are in docs/attribution.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def _kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


#: random Llamas of ``--model``'s shapes: ``benchmarks/gpu_scale.py``'s ``small`` (``random``) and ``tiny``, and three
#: that pull the frozen pass's structures apart (``--mode frozen``): a vocabulary 16x ``L·d`` (Gemma-2-2B's is 4x, the
#: embedded model's 2x), an MLP 32x ``d_model``, and 16 query heads of width 16 (``heads × head_dim`` = 4 ``d_model``)
#: over 2 KV heads
RANDOM_SHAPES = {
    "random": "small", "tiny": "tiny",
    "vocab": dict(n_layers=2, d_model=64, n_heads=4, n_kv=2, d_mlp=128, vocab=2048, n_qk=8, n_ov=256, top_k=8,
                  d_tc=256, k_tc=8, layer=1, train_seq=32),
    "mlp": dict(n_layers=2, d_model=64, n_heads=4, n_kv=2, d_mlp=2048, vocab=256, n_qk=8, n_ov=256, top_k=8,
                d_tc=256, k_tc=8, layer=1, train_seq=32),
    "heads": dict(n_layers=3, d_model=64, n_heads=16, n_kv=2, head_dim=16, d_mlp=128, vocab=256, n_qk=16, n_ov=256,
                  top_k=8, d_tc=256, k_tc=8, layer=1, train_seq=32),
}
#: tiny Gemma-2 and Gemma-3 (``--model gemma2|gemma3``, :func:`tiny_gemma`): the test suite's shape (3 layers of d 64,
#: 4 heads of 16 over 2 KV heads, layers 0 and 2 sliding with a window of 4, Gemma-2's attention soft-capped at 1.5),
#: a Lorsa on layer 1, a TopK transcoder on layer 0 and a JumpReLU skip transcoder on layer 2 (its nodes per position
#: vary: the grids' padding) — the post-norms, soft-capped patterns and sliding-window masks of ``estimate_memory``;
#: and an OLMo-2 of that shape (no sliding layers, no pre-norms: only its post-norms and final norm frozen)
TINY_FAMILIES = ("gemma2", "gemma3", "olmo2")
MODELS = ("tc", "bundle", *RANDOM_SHAPES, *TINY_FAMILIES)


def replacement_model(which: str, model_dtype: str = "float32", attn: str = "eager"):
    """``(replacement model, tokenizer or None)`` of ``--model`` (module docstring), the random ones built in
    ``model_dtype``; the tiny Gemmas (:data:`TINY_FAMILIES`) with attention ``attn`` (``eager`` or ``sdpa``)."""
    import torch

    from nnsight_lorsa import LorsaSet, ReplacementModel, TranscoderSet
    from nnsight_lorsa.assets import default_lorsa_dir, default_transcoder_dir
    from nnsight_lorsa.envoy import load_model

    if which in ("tc", "bundle"):
        model = load_model()
        lorsas = LorsaSet.from_pretrained(model, default_lorsa_dir()) if which == "bundle" else None
        return ReplacementModel(model, lorsas=lorsas,
                                transcoders=TranscoderSet.from_pretrained(model, default_transcoder_dir())), model
    if which in TINY_FAMILIES:
        return tiny_gemma(which, attn, getattr(torch, model_dtype)), None
    from benchmarks.gpu_scale import SCALES, build, paper_lorsa
    from nnsight_lorsa import get_adapter
    from nnsight_lorsa.modules import Transcoder, TranscoderConfig

    shape = RANDOM_SHAPES[which]
    s, dev, dt = SCALES[shape] if isinstance(shape, str) else shape, torch.device("cpu"), getattr(torch, model_dtype)
    torch.manual_seed(0)
    model, hf = build(s, dev, dt)
    lorsas, tcs = LorsaSet(model), TranscoderSet(model)
    lorsas[s["layer"]] = paper_lorsa(s, get_adapter(model), hf, s["layer"], dev, dt)
    for layer in range(s["n_layers"]):
        tcs[layer] = Transcoder(TranscoderConfig(d_in=s["d_model"], d_sae=s["d_tc"], activation="topk",
                                                 activation_params={"k": s["k_tc"]}, layer=layer)).to(dt)
    return ReplacementModel(model, lorsas=lorsas, transcoders=tcs), None


def tiny_gemma(family: str, attn: str, dtype):
    """The replacement model of ``--model gemma2|gemma3|olmo2`` (:data:`TINY_FAMILIES`), random (seed 0), in
    ``dtype``."""
    import warnings

    import torch
    import transformers
    from nnsight import TransformersModel

    from benchmarks.gpu_scale import paper_lorsa
    from nnsight_lorsa import ReplacementModel, get_adapter
    from nnsight_lorsa.envoy.tokens import ids_only_tokenizer
    from nnsight_lorsa.modules import SkipTranscoder, Transcoder, TranscoderConfig

    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=4096,
                  query_pre_attn_scalar=24, sliding_window=4, initializer_range=0.1,
                  layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    if family == "olmo2":  # Olmo2Config takes no head_dim (d / heads = 16), window, scalar or layer types
        common = {k: v for k, v in common.items()
                  if k not in ("head_dim", "query_pre_attn_scalar", "sliding_window", "layer_types")}
    cfg = (transformers.Gemma2Config(**common, attn_logit_softcapping=1.5, final_logit_softcapping=3.0)
           if family == "gemma2" else transformers.Gemma3TextConfig(**common) if family == "gemma3"
           else transformers.Olmo2Config(**common, pad_token_id=1, eos_token_id=1))
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = TransformersModel(hf, task="text-generation", tokenizer=ids_only_tokenizer(128), device="cpu")
    shape = dict(n_ov=64, top_k=8, n_qk=8)
    lorsa = paper_lorsa(shape, get_adapter(model), hf, 1, torch.device("cpu"), dtype)
    g = torch.Generator().manual_seed(0)
    tcs = {0: Transcoder(TranscoderConfig(d_in=64, d_sae=192, activation="topk", activation_params={"k": 6}, layer=0)),
           2: SkipTranscoder(TranscoderConfig(d_in=64, d_sae=192, activation="jumprelu",
                                              activation_params={"threshold": 0.05}, layer=2))}
    with torch.no_grad():
        for tc in tcs.values():
            tc.b_enc.copy_(0.1 * torch.randn(192, generator=g))
    return ReplacementModel(model, lorsas={1: lorsa}, transcoders={k: v.to(dtype) for k, v in tcs.items()})


class _SiteRows:
    """A scheduler of one batch of target rows per target site — the logits (the backward through the whole model),
    then the first ``batch`` rows of each Lorsa and transcoder layer (each backward's own transient: through a
    Lorsa's values, a transcoder's encoder) — recording nothing: the frozen pass alone, at each kind of backward."""

    def __init__(self, layout) -> None:
        n = layout.n_features + layout.n_logits
        starts = [(lay.lorsa_start, lay.lorsa_pos.numel()) for lay in layout.layers]
        starts += [(lay.tc_start, lay.tc_pos.numel()) for lay in layout.layers]
        self.sites = [(layout.n_features, layout.n_logits), *((s, k) for s, k in starts if k)]
        self.n, self.done, self.rows = n, 0, None

    def next_rows(self, batch: int) -> list[int]:
        if not self.sites:
            return []
        start, count = self.sites.pop(0)
        return [start + i % count for i in range(batch)]

    def record(self, rows: list[int], grad) -> None:
        pass


def frozen_pass_peaks(rm, ids, *, dtype=None, patterns: str = "auto", batches=(1, 2, 4, 8)) -> dict:
    """The frozen pass's allocation-level peak (``benchmarks._alloc_peak``) at each batch size — ``attribute_in_trace``
    with one backward per target site (``_SiteRows``) — its slope over the batch (bytes per prompt copy,
    least squares) and intercept, and ``estimate_memory``'s per-copy and shared terms for the same settings."""
    import functools

    import torch

    from benchmarks._alloc_peak import allocation_peak
    from nnsight_lorsa.attribution.budget import estimate_info, estimate_layout
    from nnsight_lorsa.attribution.replacement import FrozenReplacement
    from nnsight_lorsa.attribution.trace import attribute_in_trace, prepare

    prepared = prepare(rm, ids, dtype=dtype)
    layout = prepared.layout
    make = functools.partial(FrozenReplacement, patterns=patterns, node_vectors="auto", dtype=dtype)

    def peak(ids_, b):
        p = prepared if ids_ is ids else prepare(rm, ids_, dtype=dtype)
        return allocation_peak(attribute_in_trace, rm.model, p.adapter, p.layout, p.mhsa,
                               _SiteRows(p.layout), b, make=make, dtype=dtype)[1]

    peak(ids[:8], 1)  # warm-up
    peaks = {b: peak(ids, b) for b in batches}
    x = torch.tensor(batches, dtype=torch.float64)
    y = torch.tensor([peaks[b] for b in batches], dtype=torch.float64)
    slope = float(((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum())
    info = estimate_info(rm, prepared, patterns, "auto", False, dtype)
    est = estimate_layout(layout, batch_size=1, **info)
    return {"peaks": peaks, "per_copy": slope, "intercept": float(y.mean() - slope * x.mean()),
            "predicted_per_copy": est.terms["frozen_per_copy"], "predicted_shared": est.terms["frozen_shared"],
            "predicted": {b: est.terms["frozen_per_copy"] * b + est.terms["frozen_shared"] for b in batches},
            "n_sources": layout.n_sources, "n_features": layout.n_features}


def frozen_child(seq: int, which: str, dtype_name: str, model_dtype: str, patterns: str, offset: int,
                 attn: str = "eager") -> None:
    """``--modes frozen``: :func:`frozen_pass_peaks` of one model, length and setting (a JSON line)."""
    import torch

    from nnsight_lorsa.assets import default_corpus_path
    from nnsight_lorsa.envoy.nnsight_internals import hf_module

    torch.set_num_threads(1)
    rm, model = replacement_model(which, model_dtype, attn)
    cfg = hf_module(rm.model).config
    if model is not None:
        text = Path(default_corpus_path()).read_text(encoding="utf-8")[offset:offset + 20_000]
        ids = model.tokenizer(text, return_tensors="pt")["input_ids"][0, :seq]
    else:
        ids = torch.randint(0, cfg.vocab_size, (seq,), generator=torch.Generator().manual_seed(offset + seq))
    dtype = None if dtype_name == "model" else getattr(torch, dtype_name)
    out = {"seq": seq, "mode": "frozen", "model": which, "dtype": dtype_name, "model_dtype": model_dtype,
           "patterns": patterns, "attn": cfg._attn_implementation,
           "shape": {"n_layers": cfg.num_hidden_layers, "d_model": cfg.hidden_size,
                     "n_heads": cfg.num_attention_heads, "n_kv": cfg.num_key_value_heads,
                     "head_dim": getattr(cfg, "head_dim", None), "d_mlp": cfg.intermediate_size,
                     "vocab": cfg.vocab_size},
           **frozen_pass_peaks(rm, ids, dtype=dtype, patterns=patterns)}
    out["measured_over_predicted"] = {b: out["peaks"][b] / out["predicted"][b] for b in out["peaks"]}
    out["per_copy_measured_over_predicted"] = out["per_copy"] / out["predicted_per_copy"]
    print(json.dumps(out))


def child(seq: int, batch: int, mode: str, budget: int = 64, keep_mass: float = 0.9,
          node_threshold: float = 0.8, which: str = "tc", dtype_name: str = "float32", offset: int = 20_000) -> None:
    import torch

    import nnsight_lorsa.attribution.rows as rows_module
    from benchmarks._alloc_peak import allocation_peak
    from nnsight_lorsa._memory import release_free_memory
    from nnsight_lorsa.assets import default_corpus_path
    from nnsight_lorsa.attribution import PruneConfig, attribute, estimate_memory
    from nnsight_lorsa.attribution.budget import kept_entries, row_reach
    from nnsight_lorsa.envoy.nnsight_internals import hf_module

    engine = sys.modules["nnsight_lorsa.attribution.engine"]
    torch.set_num_threads(1)
    dtype = getattr(torch, dtype_name)
    rm, model = replacement_model(which)
    if model is not None:
        text = Path(default_corpus_path()).read_text(encoding="utf-8")[offset:offset + 20_000]
        ids = model.tokenizer(text, return_tensors="pt")["input_ids"][0, :seq]
    else:
        vocab = min(4096, hf_module(rm.model).config.vocab_size)
        ids = torch.randint(0, vocab, (seq,), generator=torch.Generator().manual_seed(offset + seq))
    prune = {"pruned": PruneConfig(0.8, 0.98), "budget_pruned": PruneConfig(node_threshold, 0.98),
             "sparse": PruneConfig(node_threshold, 0.98, keep_mass=keep_mass)}.get(mode)
    mfn = budget if mode in ("budget", "budget_pruned") else None
    attribute(rm, ids[:8], batch_size=batch, prune=prune, max_feature_nodes=mfn, dtype=dtype)  # warm-up
    marks: dict[str, tuple[int, int]] = {}
    seen = {"hwm": 0, "selection": 0, "rows_held": 0, "assembly": 0}

    def mark(name: str) -> None:  # (RSS, the peak so far: across the resets below)
        marks[name] = (_kb("VmRSS"), max(_kb("VmHWM"), seen["hwm"]))

    def reset_peak() -> None:  # VmHWM := VmRSS, the call's peak so far kept
        seen["hwm"] = max(seen["hwm"], _kb("VmHWM"))
        Path("/proc/self/clear_refs").write_text("5")

    def held(store) -> int:  # bytes the stored rows hold: blocks, or sparse entries + per-row float64 vectors
        if isinstance(store, rows_module.SparseRows):
            return sum(b.fill * (b.col.element_size() + b.val.element_size()) for b in store.blocks) + 16 * store.n_rows
        return int(getattr(store, "nbytes", 0))

    for fn in ("prepare", "attribute_in_trace", "assemble", "assemble_pruned"):
        orig = getattr(engine, fn)

        def wrapped(*a, _orig=orig, _name=fn, **k):
            mark(f"start {_name}")
            if _name.startswith("assemble"):  # the assembly's own peak: VmHWM reset (the call's kept)
                seen["rows_held"] = held(a[1].rows)
                seen["layout"] = a[0]
                seen["assembly_call"] = (_orig, a, k)  # run again after the call, for its allocation-level peak
                reset_peak()
            out = _orig(*a, **k)
            if _name.startswith("assemble"):
                seen["assembly"] = _kb("VmHWM") - marks[f"start {_name}"][0]
            mark(f"end {_name}")
            return out

        setattr(engine, fn, wrapped)
    record = rows_module.RowStore.record
    calls = [0]

    def counted(self, rows, grads):
        calls[0] += 1
        if calls[0] <= 3:  # the frozen pass to its third batch (to the last one when there are fewer)
            mark("batch 2 done")
        return record(self, rows, grads)

    rows_module.RowStore.record = counted
    influence = rows_module.RowScheduler.feature_influence

    def selection(self):  # the influence-ordered selection's own peak (heap trimmed, VmHWM reset, the call's kept)
        release_free_memory()  # else the batch's freed temporaries, still in the heap, hide its allocations
        reset_peak()
        start = _kb("VmRSS")
        out = influence(self)
        seen["selection"] = max(seen["selection"], _kb("VmHWM") - start)
        return out

    rows_module.RowScheduler.feature_influence = selection
    pruned_on: list = []  # prune_rows's rows and masks (references), to count the entries it scored after the call
    prune_rows = rows_module.prune_rows

    def spied(rows, row_node, row_weight, node_mask, *a, **k):
        pruned_on[:] = [rows, row_node, node_mask]
        return prune_rows(rows, row_node, row_weight, node_mask, *a, **k)

    rows_module.prune_rows = spied
    mark("begin")
    Path("/proc/self/clear_refs").write_text("5")
    mark("begin")
    g = attribute(rm, ids, batch_size=batch, prune=prune, max_feature_nodes=mfn, dtype=dtype)
    mark("end")
    base = marks["begin"][0]
    asm = "assemble_pruned" if prune is not None else "assemble"
    mb = 1 / 1024
    out = {"seq": seq, "mode": mode, "batch": batch, "model": which, "dtype": dtype_name, "offset": offset,
           "clean_pass_mb": (marks["end prepare"][1] - base) * mb,
           "frozen_pass_mb": (marks["batch 2 done"][1] - marks["end prepare"][0]) * mb,
           "rows_mb": (marks["end attribute_in_trace"][0] - marks["batch 2 done"][0]) * mb,
           "assembly_mb": seen["assembly"] * mb,
           "peak_mb": (max(seen["hwm"], marks["end"][1], marks[f"start {asm}"][1]) - base) * mb, "n_nodes": g.n_nodes,
           "stored_entries": (g.meta.get("pruned") or {}).get("stored_entries"),
           "selection_mb": seen["selection"] * mb, "rows_held_mb": seen["rows_held"] / 2**20}
    assembly, a, k = seen.pop("assembly_call")
    out["assembly_alloc_mb"] = allocation_peak(assembly, *a, **k)[1] / 2**20
    del assembly, a, k
    if pruned_on:  # the stored entries among the node-pruned nodes (what the edge scores cover), the kept graph
        rows, row_node, node_mask = pruned_on
        ns = seen["layout"].n_sources  # (BlockAdjacency.n_cols is a method: --modes pruned failed here)
        out.update(among_entries=rows.count_edges(node_mask[:ns], node_mask[row_node]), keep_mass=prune.keep_mass,
                   node_threshold=prune.node_threshold,
                   kept_adjacency_mb=(g.block_adjacency.nbytes if g.block_adjacency is not None
                                      else g.n_nodes ** 2 * g.residual.element_size()) / 2**20)
        if hasattr(rows, "rows"):  # sparse rows: each row's stored entries, and the memory model's bound on them
            store, layout = rows.rows, seen["layout"]
            per_row = torch.cat([torch.tensor([0, *b.ends], dtype=torch.float64).diff() for b in store.blocks]
                                if store.blocks else [torch.zeros(0, dtype=torch.float64)])
            reach, per_logit = row_reach(layout)
            feature = row_node < layout.n_features
            bound = torch.full((row_node.numel(),), per_logit, dtype=torch.float64)
            bound[feature] = reach[row_node[feature]]
            bound = kept_entries(bound, prune.keep_mass)
            out["entries"] = {"feature_rows": int(feature.sum()), "stored_feature": int(per_row[feature].sum()),
                              "bound_feature": int(bound[feature].sum()),
                              "stored_logit": int(per_row[~feature].sum()), "bound_logit": int(bound[~feature].sum()),
                              "bound_any_rows": None}
        pruned_on.clear()
    # the memory model's prediction of each term, for every mode (MB; frozen = per copy × batch + shared)
    est = estimate_memory(rm, ids, batch_size=batch, prune=prune, max_feature_nodes=mfn, dtype=dtype)
    t = est.terms
    if "entries" in out:  # the bound on whichever rows the run stores (with a budget: the rows with the most)
        out["entries"]["bound_any_rows"] = t["stored_entries"]
    out["predicted"] = {"frozen_pass_mb": (t["frozen_per_copy"] * batch + t["frozen_shared"]) / 2**20,
                        "rows_mb": t["rows"] / 2**20, "pruning_mb": t["pruning"] / 2**20,
                        "selection_mb": t["selection"] / 2**20, "fixed_mb": t["fixed"] / 2**20,
                        "kept_graph_mb": t["kept_graph"] / 2**20, "edge_scores_mb": t["edge_scores"] / 2**20,
                        "host_mb": est.host_bytes / 2**20, "stored_entries": t["stored_entries"]}
    if mode == "budget":  # the adjacency the graph holds (blocks, or a dense matrix in older versions) and the estimate
        blocks = g.block_adjacency
        out["rows_held_mb"] += (blocks.nbytes if blocks is not None else 0) / 2**20  # the sparse rows + the blocks
        out.update(budget=mfn, feature_rows=int(g.feature_rows.sum()),
                   adjacency_mb=(blocks.nbytes if blocks is not None else g.densify().nbytes) / 2**20,
                   dense_adjacency_mb=g.n_nodes ** 2 * 4 / 2**20, estimate_host_mb=est.host_bytes / 2**20,
                   estimate_rows_mb=est.terms["rows"] / 2**20)
    print(json.dumps(out))


def main() -> None:
    from benchmarks._timing import arg, command, parser, write

    args = parser(__doc__, lengths="64,128,256", batch=64, modes="dense,pruned", budget=64,
                  name="attribution_memory_terms", child=arg("", argparse_suppress()),
                  keep_mass=0.9, node_threshold=0.8, seq=arg(0, argparse_suppress()),
                  model=arg("tc", choices=MODELS),
                  dtype=arg("float32", choices=("float32", "float64", "model")),
                  model_dtype=arg("float32", choices=("float32", "bfloat16")),
                  patterns=arg("auto", choices=("auto", "sdpa")), attn=arg("eager", choices=("eager", "sdpa")),
                  offset=20_000).parse_args()
    if args.child == "frozen":
        frozen_child(args.seq, args.model, args.dtype, args.model_dtype, args.patterns, args.offset, args.attn)
        return
    if args.child:
        child(args.seq, args.batch, args.child, args.budget, args.keep_mass, args.node_threshold, args.model,
              args.dtype, args.offset)
        return
    runs = []
    for seq in [int(s) for s in args.lengths.split(",") if s]:
        for mode in args.modes.split(","):
            res = subprocess.run([sys.executable, "-m", f"benchmarks.{Path(__file__).stem}", "--child", mode, "--seq",
                                  str(seq), "--batch", str(args.batch), "--budget", str(args.budget),
                                  "--keep-mass", str(args.keep_mass), "--node-threshold", str(args.node_threshold),
                                  "--model", args.model, "--dtype", args.dtype, "--offset", str(args.offset),
                                  "--model-dtype", args.model_dtype, "--patterns", args.patterns,
                                  "--attn", args.attn],
                                 capture_output=True, text=True,
                                 env=dict(os.environ), cwd=Path(__file__).resolve().parent.parent)
            if res.returncode != 0:
                raise RuntimeError(res.stderr[-3000:])
            runs.append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(json.dumps(runs[-1]), flush=True)
    print(f"-> {write(args.name, {'command': command(), 'runs': runs})}")


def argparse_suppress() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
