"""A long prompt's budgeted graph after attribution: ``prune`` + ``graph_scores`` + the Neuronpedia export +
``save`` at the Llama-3.1-8B shape of issue 21, from the causal blocks (no model, no GPU, no ``n_nodes²``).

    python -m benchmarks.graph_postprocess_scale [--tokens 256 512 1024 2048 4096] [--rows 64] [--threads 1]

The dense path it replaces (``dd1a9c4``), at lengths where it still runs, from a directory without a package
of its own (the JSON still lands in this folder's ``results/``)::

    git archive dd1a9c4 nnsight_lorsa | tar -x -C /tmp/base
    cd /tmp && PYTHONPATH=/tmp/base:<this repository> python -m benchmarks.graph_postprocess_scale \
        --tokens 256 512 --name graph_postprocess_scale_before

The graph is what ``attribute(rm, prompt, max_feature_nodes=rows)`` returns at that shape, with random edges:
the prompt's nodes as ``benchmarks/attribution_host_estimate_8b.py`` makes them (32 layers, TopK transcoders
k 64 on every MLP, a Lorsa with top-k 128 on layer 15, 10 logits), ``rows`` visited features chosen at random,
and their rows and the logits' stored as :class:`BlockAdjacency` blocks of Gaussian values (every entry that
can be non-zero is non-zero: the worst case for the sparse passes). For each length: the graph's nodes and
stored entries, the dense ``n_nodes²`` fp32 matrix the post-processing used to build, the wall time of each
step, and the host peak (``VmHWM``) above the graph itself (of ``prune`` alone, and of all the steps; before each
measured step the C heap is trimmed, so that free pages of an earlier step do not hide its allocations). Then
(``--full-tokens``) the embedded model's full graph — every feature row, many more edges per node — through
``prune`` (also with ``node_threshold=1``: every non-zero edge scored) and ``graph_scores``, each step's own peak
per non-zero edge.
"""

from __future__ import annotations

import gc
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from benchmarks._timing import RESULTS, arg, command, environment, parser, start, time_once, write_json
from benchmarks.attribution_host_estimate_8b import SHAPE, synthetic_layout
from benchmarks.gpu_scale import host_peak, host_peak_reset
from nnsight_lorsa.attribution import Graph, graph_scores, prune, to_neuronpedia
from nnsight_lorsa.attribution.blocks import BlockAdjacency
from nnsight_lorsa.attribution.graph import HOST


def synthetic_graph(P: int, rows: int = 64, s: dict = SHAPE, seed: int = 0) -> Graph:
    """A budgeted graph of a ``P``-token prompt at shape ``s`` (``synthetic_layout``): ``rows`` random
    visited features + the logits as targets, every block filled with N(0, 1) fp32 edges; ``values`` are the
    rows' sums (``edge_sum_error`` 0 up to rounding). No dense ``n_nodes²`` matrix is made."""
    g = torch.Generator().manual_seed(seed)
    layout = synthetic_layout(P, s)
    nf, ns, nl = layout.n_features, layout.n_sources, layout.n_logits
    visited = torch.randperm(nf, generator=g)[:rows].sort().values
    node_ids = torch.cat([visited, torch.arange(nf, ns), torch.arange(ns, ns + nl)])
    nodes = layout.nodes.select(node_ids)
    n_src = ns - nf + visited.numel()
    targets = torch.cat([torch.arange(visited.numel()), torch.arange(n_src, n_src + nl)])
    adjacency = BlockAdjacency(nodes.sites(), nodes.pos, n_src, targets, torch.float32)
    values = torch.full((node_ids.numel(),), float("nan"))
    for c, (cell_rows, n_cols) in enumerate(zip(adjacency.cell_rows, adjacency.n_cols().tolist(), strict=True)):
        block = torch.randn(cell_rows.numel(), n_cols, generator=g)
        adjacency.blocks[c] = block
        values[cell_rows] = block.sum(1, dtype=torch.float64).float()
    feature_rows = torch.zeros(node_ids.numel(), dtype=torch.bool, device=HOST)
    feature_rows[targets] = True
    return Graph(tokens=layout.tokens, nodes=nodes, adjacency=adjacency,  # type: ignore[arg-type]  # blocks
                 values=values, logit_probs=layout.logit_probs, feature_rows=feature_rows, layout_ids=node_ids,
                 meta={"model_type": "synthetic-llama-3.1-8b-shape"})


def measure(P: int, rows: int) -> dict:
    """One length: the synthetic graph's sizes, each step's wall time, the host peak over the steps."""
    graph = synthetic_graph(P, rows)
    blocks = graph.block_adjacency
    assert blocks is not None
    n = graph.n_nodes
    pruned, t_prune, prune_peak = step_peak(lambda: prune(graph))
    gc.collect()
    base = host_peak_reset()
    scores, t_scores = time_once(lambda: graph_scores(graph))
    with warnings.catch_warnings():  # the synthetic features all have index 0: ids shared with MLP errors
        warnings.simplefilter("ignore")
        export, t_export = time_once(lambda: to_neuronpedia(graph, pruned, slug="scale"))
    with tempfile.TemporaryDirectory() as tmp:
        _, t_save = time_once(lambda: graph.save(f"{tmp}/graph"))
    peak = host_peak()
    edges = pruned.edge_index.shape[1] if hasattr(pruned, "edge_index") else pruned.edge_mask.sum()  # before: a mask
    return {"tokens": P, "n_nodes": n, "target_rows": int(graph.feature_rows.sum()),
            "stored_entries": blocks.entries(), "blocks_bytes": blocks.nbytes, "dense_adjacency_bytes": 4 * n * n,
            "densified": graph.block_adjacency is None, "kept_nodes": int(pruned.node_mask.sum()),
            "kept_edges": int(edges),
            "links_exported": len(export["links"]), "replacement_score": scores[0], "completeness_score": scores[1],
            "prune_s": t_prune, "graph_scores_s": t_scores, "export_s": t_export, "save_s": t_save,
            "host_peak_above_graph_bytes": None if base is None or prune_peak is None else
            max(peak - base, prune_peak),
            "host_peak_bytes": peak, "prune_peak_above_graph_bytes": prune_peak,
            "prune_peak_bytes_per_entry": None if prune_peak is None else prune_peak / blocks.entries()}


def step_peak(fn: Any) -> tuple[Any, float, int | None]:
    """``(result, seconds, host peak above the start in bytes)`` of ``fn()`` alone: collected and the C heap
    trimmed first (``malloc_trim``: no free pages of an earlier step to hide this one's allocations), ``VmHWM``
    reset."""
    from nnsight_lorsa._memory import release_free_memory

    gc.collect()
    release_free_memory()
    base = host_peak_reset()
    out, t = time_once(fn)
    return out, t, None if base is None else host_peak() - base


def measure_full(P: int) -> dict:
    """The embedded model's full graph (every feature row) of ``P`` random tokens: ``prune`` (default thresholds,
    and ``node_threshold=1``: every node kept, every non-zero edge scored — the worst case), then ``graph_scores``;
    wall time and host peak above the graph of each step alone, and per non-zero edge."""
    from benchmarks._timing import embedded
    from nnsight_lorsa import ReplacementModel, TranscoderSet
    from nnsight_lorsa.assets import default_transcoder_dir
    from nnsight_lorsa.attribution import attribute

    model, lorsas = embedded()
    tcs = TranscoderSet.from_pretrained(model, default_transcoder_dir())
    rm = ReplacementModel(model, lorsas=lorsas, transcoders=tcs)
    graph = attribute(rm, torch.randint(1, 60, (P,), generator=torch.Generator().manual_seed(0)), batch_size=64)
    edges = graph.n_edges
    pruned, t_prune, peak_prune = step_peak(lambda: prune(graph))
    every, t_every, peak_every = step_peak(lambda: prune(graph, 1.0, 0.98))
    scores, t_scores, peak_scores = step_peak(lambda: graph_scores(graph))
    peaks = [p for p in (peak_prune, peak_scores) if p is not None]

    def per_edge(peak: int | None) -> float | None:
        return None if peak is None else peak / edges

    return {"tokens": P, "n_nodes": graph.n_nodes, "nonzero_edges": edges,
            "kept_nodes": int(pruned.node_mask.sum()), "kept_edges": int(pruned.edge_index.shape[1]),
            "replacement_score": scores[0], "completeness_score": scores[1], "prune_s": t_prune,
            "graph_scores_s": t_scores, "host_peak_above_graph_bytes": max(peaks) if peaks else None,
            "prune_peak_above_graph_bytes": peak_prune, "prune_peak_bytes_per_edge": per_edge(peak_prune),
            "prune_every_node_s": t_every, "prune_every_node_kept_edges": int(every.edge_index.shape[1]),
            "prune_every_node_peak_above_graph_bytes": peak_every,
            "prune_every_node_peak_bytes_per_edge": per_edge(peak_every),
            "graph_scores_peak_above_graph_bytes": peak_scores,
            "graph_scores_peak_bytes_per_edge": per_edge(peak_scores)}


def main() -> None:
    args = parser(__doc__, tokens=arg(nargs="+", type=int, default=[256, 512, 1024, 2048, 4096]), rows=64, threads=1,
                  full_tokens=arg(nargs="*", type=int, default=[128],
                                  help="lengths of the embedded model's full graph (prune + graph_scores)"),
                  name="graph_postprocess_scale").parse_args()
    start(args)
    runs = []
    for P in args.tokens:
        runs.append(measure(P, args.rows))
        print({k: (f"{v / 1e9:.2f} GB" if k.endswith("bytes") and v is not None else
                   f"{v:.1f} s" if k.endswith("_s") else v) for k, v in runs[-1].items()}, flush=True)
        gc.collect()
    full = []
    for P in args.full_tokens:
        full.append(measure_full(P))
        print("full graph:", full[-1], flush=True)
    import nnsight_lorsa

    out = write_json(RESULTS / f"{args.name}.json", {"command": command("OMP_NUM_THREADS=1"), "shape": SHAPE,
                                                       "package": str(Path(nnsight_lorsa.__file__).parent),
                                                       "rows": args.rows, "environment": environment(), "runs": runs,
                                                       "full_graph_embedded_model": full})
    print(f"-> {out}")


if __name__ == "__main__":
    main()
