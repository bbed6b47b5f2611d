"""The memory model of :func:`.attribute.attribute`: what one call will hold at its peak, before it runs,
and the batch size that keeps it under a budget (``attribute(..., max_memory=...)``).

The terms, from the prompt's nodes (its :class:`~.layout.Layout`: one clean forward, no attribution)
and the model's shapes — ``P`` tokens, ``L`` layers, ``d`` = ``d_model``, ``S`` sources, ``N = S +
n_logits`` nodes, batch ``B``, ``b`` bytes per number of the frozen model, 4 B (fp32) or 8 B (fp64)
per edge:

* *frozen pass, per prompt copy* (device): counted from the structure (:func:`frozen_per_copy_bytes`) — what the
  frozen forward keeps for the backward, ``(2L + 3)`` ``(P, d)`` tensors (every norm's input, the embeddings, the final
  norm's output) plus one per Lorsa and per skip transcoder and, with SDPA, ``2·H·d_head`` per frozen MHSA, the
  targets (``2·(n_features + n_logits)`` numbers), and the largest backward's transient (through a frozen MHSA
  ``2·d + 2·H·d_head + 2·H_kv·d_head``, with SDPA ``5·H·d_head`` for the middle term; through a Lorsa's values
  ``2·d + 2·u``; at least ``3·d``) — ``b`` bytes per number; on a GPU with SDPA attention
  ``c·L·d·P·b``, ``c`` = :data:`PER_COPY_NUMBERS_GPU_SDPA` (4.0, fitted on an H200: the GPU kernels' saved tensors
  were not taken apart) where some frozen MHSA layer is left — with none (a Lorsa on every attention: its frozen
  pass calls no SDPA) from the structure as on the CPU, the model's own parts included (measured on an
  H200 with the paper's Lorsa on all 32 layers, offloaded: 0.95–0.96× the estimate, 1024–4096 tokens; 0.72–0.89×
  with the coefficient, which counted MHSA layers that were not there); and the multipliers, their gradients and
  the per-batch row temporaries, :data:`ROW_BUFFERS` ``·S`` edges per copy. The vocabulary is not in it: the logits
  are row 0's, broadcast;
* *frozen pass, shared* (device): attention patterns ``H·P²`` per frozen MHSA layer (stored patterns, CPU; a
  soft-capped MHSA's always, Gemma-2's: SDPA cannot cap — :func:`.frozen.keeps_pattern`) and Lorsa pattern rows
  ``n_l·P`` (stored patterns) or a Lorsa's queries and keys (SDPA), error vectors ``P·d`` per replaced module, node
  vectors on grids ``P·w·d`` per site (``w``: the most nodes at one position; decoder rows, encoder columns, Lorsa
  ``w_o``) while a site's grid fits :data:`.frozen.GRID_BUDGET_BYTES` (else gathered: nothing kept); and, but on
  the fitted GPU path (inside its coefficient), the model's own parts (:func:`frozen_model_bytes`): the logits
  ``P·vocab`` once (the frozen model's row 0; a second in ``dtype=`` when it is not the model's) and the model's own
  unembedding's ``vocab`` (it runs on the last position only; its ``P·vocab`` was counted until 2026-11-27),
  the model's MLP on one copy (``4·P·d_mlp``), every frozen norm's ``scale·γ`` (``2L + 1`` norms, ``4L + 1`` with
  post-attention and post-feedforward norms: the adapter's frozen sites) and every MHSA's ``W_O`` copy, a Lorsa's
  pattern rows on their grid by OV head, and the largest transient of making a constant (a grid's gather, a
  pattern's scores — on the fitted path too for a kept soft-capped pattern). Per prompt copy besides, the model's
  own attention masks, ``(P, P)`` each (:func:`attention_mask_entry_bytes`: with eager attention one for the full
  and one for the sliding layers, in the frozen model's dtype; with SDPA the sliding one, bool). Frozen pass
  measured at the allocation level (``benchmarks/attribution_memory_terms.py
  --modes frozen``) on seven shapes — the embedded model with and without its Lorsa, random Llamas with a vocabulary
  16× ``L·d``, an MLP 32× ``d``, 16 query heads of ``H·d_head`` = 4 ``d`` over 2 KV heads —, fp32/fp64/bf16, stored
  patterns and the CPU's SDPA, 64–512 tokens, batches 1–8: 0.79–1.0× ``per copy · B + shared``; and on the tiny
  Gemma-2 / Gemma-3 (``--model gemma2|gemma3``), 128–512 tokens: see docs/attribution.md;
* *offloaded modules* (device; ``ReplacementSet.offload``): the largest one while it computes and the rows
  of them the frozen pass reads (:func:`.offload.offload_terms`: the blocks the call keeps on the device summed, plus
  the largest of those it copies per pass — :func:`plan_call` decides as ``attribute`` does, so the estimate is of
  the call's own choice); resident modules are not counted (the
  estimate is above the resident weights); a gathered site's chunk temporaries (``gather_chunks``: two
  fp32-sized, a chunk of positions' ``(positions, width, d)`` grid and ``(positions, batch, d)`` product, each of at
  most :func:`.frozen.node_chunk_elements` numbers, 32 MB on the CPU, 256 MB on a GPU); and without stored patterns
  the recomputed Lorsa pattern rows (``row_chunks``, :func:`lorsa_row_bytes`):
  every Lorsa layer's int64 slot indices, kept until the last backward, and the largest step of
  :func:`.frozen.plan_rows` (``row_step``: its QK heads' fp32 keys and its slots' queries, the larger of its fp32
  scores and softmax and of its rows and one ``(batch, P, slots)`` values-sized temporary; ``batch·P·slots`` at most
  :func:`.frozen.row_chunk_elements`, ``2**22`` on the CPU and ``2**25`` on a GPU), counted as the largest transient
  of making a constant is — the larger of the two: both run inside one site (:func:`frozen_model_bytes`);
* *rows* (host): every row with every entry — the full graph, and pruning while building with ``keep_mass=1`` — goes
  straight into the adjacency's causal blocks (:class:`.blocks.BlockAdjacency`: per target (site, position), the
  sources upstream of it — an edge each, counted exactly from the layout; ~0.2·``N²`` on the embedded model); a
  feature budget or ``keep_mass < 1`` stores the kept entries sparse, 4 B + an edge each (and 16 B per row) — their
  number bounded from the graph's structure (:func:`structural_entries`): each row's possible non-zero edges
  (:func:`row_reach`: a feature at layer ``l``, position ``p`` has an edge from every node written before the last
  frozen MHSA at or before layer ``l`` at a position ``≤ p`` — that attention mixes all of them; a Lorsa's heads and
  error are nodes, so a Lorsa layer mixes nothing past them —, from the nodes written after it at ``p`` itself, and
  from every bias node written before it; a Lorsa head from every node before its layer at a position ``≤ p`` (its own
  frozen pattern); a logit as a feature after the last layer: every counted edge is non-zero on the embedded model's
  full graph at 128 tokens, and row by row on the tiny test models), with a budget the ``rows`` feature rows with the
  most of them (the selection may pick any), and with ``keep_mass < 1`` each row's cut to ``⌊keep_mass · n⌋ + 1``
  (:func:`kept_entries`: reached when its magnitudes are equal). Both cuts are bounds because what they leave out
  depends on the values: which rows the influence picks (measured: the picked rows hold 0.43–0.52 of the bound's
  entries, 64–512 tokens, 64 rows, three models) and how concentrated a row's mass is (the rows keep 5–10 % of the
  bound at ``keep_mass=0.9`` on the embedded model, 38 % on a random Llama, 30–31 % at 0.99) — so on these paths the
  estimate is above the peak by the stored rows' share of it (1.3–4.5× at ``keep_mass=0.9``, 64–512 tokens)
  (measured below and in docs/attribution.md). Unpruned, the graph's adjacency over the visited features is then the
  computed rows' causal blocks (:func:`budget_blocks_bytes`: at most rows × sources, linear in ``P`` for a fixed
  budget — not ``N²``);
* *pruning* (host, after the frozen pass is freed): over sparse rows, :func:`.scores.prune_rows`'s steps on the stored
  rows in place (chunked passes that read only the rows each step needs; no entry copied out of the store),
  :data:`PRUNE_BYTES_PER_CHUNK_ENTRY` per entry of one chunk (:data:`.rows.CHUNK_ENTRIES`) — also when a budgeted
  graph's blocks are assembled from them —; over the full graph's blocks (``keep_mass=1``, no budget),
  :data:`PRUNE_BLOCK_BYTES_PER_ENTRY` per stored entry (measured: the passes' pieces and the heap around them); plus,
  whenever pruning, the larger of the edge scores (term ``edge_scores``: :data:`PRUNE_BYTES_PER_EDGE` per stored
  entry between graph nodes — with a budget at most the rows × the graph's sources, without one every stored entry —
  and the threshold's running sums, :data:`THRESHOLD_BYTES_PER_CHUNK_ENTRY` per entry of one chunk; the kept edges
  are not gathered while building, 48 B per entry counted until 2026-11-26) and the kept graph (term
  ``kept_graph``: its kept rows' causal blocks over its kept sources, :func:`budget_blocks_bytes` — with a budget
  every row over every source, without one at most the full graph's blocks, as a kept row's block columns are the
  kept ones among its full-graph block's; the kept nodes are mostly error and embedding nodes, whose rows are empty).
  Both are bounds: how many nodes and edges the pruning keeps depends on the influences; when it keeps everything it
  can (``node_threshold = edge_threshold = 1``) the assembly reaches 0.29–0.90 of the pruning term on the tiny
  test model (``tests/attribution/test_budget_sparse.py``), at the default thresholds a run stays far under it
  (docs/attribution.md, *The pruned graph without a feature budget*). Until 2026-11-26 the graph pruned without a
  budget held a dense ``k × k`` matrix (``k ≤ N``) and neither term was counted on that path: the assembly allocated
  up to 23× the pruning term on the tiny test model (40 tokens, both thresholds 1, the chunks cut to 97 entries) and
  17.9 / 55.6 MB against 24 MiB on a random Llama of ``benchmarks/gpu_scale.py``'s small shape at 64 / 128 tokens
  (the call's peak stayed under the estimate there only because the frozen pass was larger); a dense ``k × k`` with
  a budget was bounded only by ``(budget + n_logits + n_sources − n_features)²``, 78 GB at the Llama-3.1-8B shape
  with 4096 tokens;
* *selection* (host, a feature budget only, between two batches while the frozen pass is held): the
  influence estimate over the stored rows, in place in one float64 chunk buffer per step
  (:data:`SELECTION_BYTES_PER_CHUNK_ENTRY`) and :data:`SELECTION_VECTORS` float64 vectors over the ``S`` sources;
* *the ranking's device copy of the rows* (device, a feature budget on a CUDA model; term ``ranking_mirror``): what
  the memory plan leaves free on the model's device at the call's batch (:func:`plan_call`), at most the stored
  rows' entries (4 B + an edge each), held by the stored rows for the ranking pass (:class:`.rows.SparseRows`,
  ``mirror_bytes``) — added to ``device_bytes`` of the call's estimate (:meth:`CallPlan.call_estimate`), not to the
  estimates the batch is fitted with: it fills what the fitted batch leaves.

Peak = rows + max(frozen pass + selection, pruning) on a CPU model; host rows + max(selection, pruning)
on a GPU one. The remaining coefficients are measured on the embedded model
(``benchmarks/attribution_vs_circuit_tracer.py`` records predicted/measured for every run); on a GPU the
frozen pass is device memory and the rows host memory.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from .._repr import FieldsRepr
from ..adapters.transformers_internals import attn_implementation
from ..envoy.nnsight_internals import hf_module
from .batch_fit import largest_batch
from .frozen import (
    choose,
    head_product,
    keeps_pattern,
    node_chunk_elements,
    plan_rows,
    row_chunk_elements,
    row_step_bytes,
)
from .graph import HOST
from .layout import Layout
from .logit_targets import Targets
from .nodes import count_distinct
from .offload import (
    FREE_MEMORY_MARGIN,
    RowsPlace,
    any_offloaded,
    block_layer,
    device_free_bytes,
    kept_bytes,
    offload_blocks,
    offload_terms,
    rows_label,
    rows_placement,
)
from .options import AttributionOptions, refuse_renamed
from .rows import CHUNK_ENTRIES, DEVICE_CHUNK_ENTRIES, full_graph_blocks, mirrors
from .scores import CHUNK as SCORES_CHUNK
from .trace import AttributionCache, Prepared, frozen_sites, multiplier_dtype, prepare, refuse_inside_trace

#: ``(P, d_model)`` tensors of one prompt copy the frozen pass holds besides one per skip path
#: (:func:`frozen_per_copy_bytes`): the embeddings (kept by their multipliers' product) and the final norm's output
#: (held by the model's forward, inside whose unembedding the backward passes run)
RESIDUAL_EXTRA = 2
#: numbers per (layer, d_model, position) that one prompt copy of the frozen pass holds on a GPU with SDPA attention
#: (no stored patterns), fitted on an H200 at the Llama-3.1-8B shape in bf16, batch 4
#: (``benchmarks/results/gpu_scale_8b_NVIDIA_H200.json``, (d), 2026-11-27 on 6610067): the smallest coefficient whose
#: estimate bounds the measured peak at 512-4096 tokens (3.81, 3.93, 3.77, 3.33 each; measured / estimate 0.995,
#: 0.985, 0.952, 0.856). A fitted coefficient: what the GPU's SDPA kernels keep for the backward could not be taken
#: apart without a GPU (the CPU's SDPA path is counted from the structure). 4.5 from 2026-11-26 (fitted before a
#: frozen MHSA's q/k were computed once and the frozen pass's unembedding ran on the last position only: measured /
#: estimate 0.77-0.98 on 2026-11-27), 6.8 before, fitted while the frozen pass still kept every norm's input.
#: Fitted with 31 of 32 layers frozen SDPA MHSAs: used only where some frozen MHSA layer is left (with a Lorsa on
#: every attention the GPU path counts from the structure, :func:`estimate_layout`; since 2026-11-27)
PER_COPY_NUMBERS_GPU_SDPA = 4.0
#: source-sized buffers per prompt copy: multipliers, their gradient, its copy, and the row temporaries (measured:
#: up to 6 at once — the ones, five gradients of slices of them still being summed — on the CPU's SDPA path)
ROW_BUFFERS = 6
#: bytes per entry of one chunk of the pruning's passes (int64 rows/columns, float64 values, masks;
#: measured 92 MB at 2^20 entries)
PRUNE_BYTES_PER_CHUNK_ENTRY = 96
#: bytes per stored entry of pruning the full graph's causal blocks (``prune(graph)``'s passes on them, also while
#: building with ``keep_mass=1``): the passes' temporaries are pieces of :data:`.blocks.CHUNK` entries, one cell,
#: node-sized vectors and the edge scores among the node-pruned nodes (8 B each, a few thousand here), but the
#: host peak grows with the blocks around them (the heap between the pieces): measured 1.4-1.7 B per stored entry
#: (``benchmarks/attribution_memory_terms.py``, 128-256 tokens) and 1.0-1.5 B (``graph_postprocess_scale``'s full
#: graphs, 64-256 tokens) — not counted from the structure
PRUNE_BLOCK_BYTES_PER_ENTRY = 1.5
#: bytes per entry between graph nodes of :func:`.scores.prune_rows`'s edge scores (float64, sorted in place) while
#: pruning while building: it gathers no kept edges (``keep_edges=False``; each step of its dangling-node loop re-reads
#: them, one chunk at a time) — until 2026-11-26 it held them too (int64 target and source of each: the per-chunk
#: pieces, their concatenation and the stacked index, 48 B per entry counted)
PRUNE_BYTES_PER_EDGE = 8
#: bytes per entry of one chunk (:data:`.scores.CHUNK`) of :func:`.scores.find_threshold_`'s running sums over the
#: sorted edge scores, held beside them: the chunk with the carry, its cumulative sum and that divided by the total
#: (float64 each; measured on the tiny test model: the scores and these the pruning's peak)
THRESHOLD_BYTES_PER_CHUNK_ENTRY = 24
#: float64 source-sized vectors of the influence-ordered selection (its series' current and total influence,
#: the step's output, the feature scores and their copy, the next weights)
SELECTION_VECTORS = 6
#: bytes per entry of one chunk of the selection's influence steps: ``SparseRows.weighted_abs`` works in place in
#: one float64 buffer per step of :data:`.rows.CHUNK_ENTRIES` entries (at most the stored entries)
SELECTION_BYTES_PER_CHUNK_ENTRY = 8
#: fixed cost of a call (clean pass, layout, nnsight) in bytes (measured: the clean pass's growth, 3–22 MB at
#: 64–512 tokens, ``benchmarks/results/attribution_memory_terms.json``)
FIXED_BYTES = 8 * 2**20
#: on a CPU model, batches of per-copy frozen-pass memory the C heap keeps resident after they are freed: glibc's
#: dynamic mmap threshold rises to the size of the largest freed block (up to 32 MiB), so a batch's large freed
#: temporaries stay in the heap while the next batch allocates. Measured (2026-11-28, the embedded model with its
#: transcoders, batch 64, 256 tokens, ``benchmarks/attribution_memory_terms.py``): the frozen pass's resident-set
#: growth 197-229 MB against its allocation-level peak of 109 MB (``frozen_per_copy · B + frozen_shared`` = 119 MB,
#: of which 94 MB per copy); with ``MALLOC_MMAP_THRESHOLD_`` fixed, 113 MB (but 1.3x the CPU time). One batch's
#: per-copy bytes (``heap_retained``) brings the host total from 0.68-0.77x to about 0.9-1.1x the measured peak at
#: 64-256 tokens; other C libraries return freed blocks sooner (the term is then on the safe side)
HOST_HEAP_RETAINED_BATCHES = 1


@dataclass(repr=False)
class MemoryEstimate(FieldsRepr):
    """What one :func:`.attribute.attribute` call is predicted to hold at its peak.

    Attributes:
        host_bytes: peak host memory (on a CPU model: everything).
        device_bytes: peak memory of the frozen pass on the model's device (on a CPU model, part of
            ``host_bytes``).
        batch_size: the batch the estimate is for: with ``max_memory`` the one the call fits
            (``graph.meta["batch_size"]``), else the asked ``batch_size``.
        terms: the terms in bytes (``frozen_per_copy``, ``frozen_shared``, ``rows``, ``pruning``, ``selection``,
            ``fixed``; ``heap_retained``, on a CPU model the frozen pass's freed per-copy bytes the C heap keeps
            resident, :data:`HOST_HEAP_RETAINED_BATCHES` batches, in ``device_bytes`` there (0 on a device);
            ``kept_graph`` and ``edge_scores``, the pruned graph's adjacency and the pruning's edge scores and kept
            edges, of which ``pruning`` holds the larger (0 unpruned);
            on a device also ``offload_fetch`` and ``offload_rows``, the offloaded modules' (0 where none is;
            the rows as :attr:`offload_rows` places them), included in ``frozen_shared``; ``gather_chunks``, a
            gathered site's chunk temporaries,
            :func:`.frozen.node_chunk_elements`, and ``node_grids``, the node vectors kept on grids (a Lorsa's
            ``w_o``; a transcoder's encoder and one decoder grid per replaced MLP it writes into), both included
            in ``frozen_shared``; ``ranking_device``, a feature budget's ranking pass on the device,
            :meth:`.rows.SparseRows.weighted_abs`, also in ``frozen_shared``; in :func:`estimate_memory`'s estimate
            ``ranking_mirror``, the stored rows' device copy for that pass, :func:`ranking_mirror`, in
            ``device_bytes``)
            and counts (``n_sources``, ``n_rows``, ``stored_entries``).
        offload_rows: where the offloaded modules' active rows are counted: ``"device"`` (every block kept there
            for the whole call, ``offload_rows`` term), ``"host"`` (copied per pass: the largest block; on a CPU
            model nothing), ``"partial"`` (the blocks that fit kept, the largest other copied per pass), None where
            nothing is offloaded — as ``attribute`` decides (:func:`.offload.rows_placement`;
            ``Graph.meta["offload_rows"]``).
        offload_rows_kept_bytes: bytes of the offloaded rows kept on the device (the kept blocks,
            :func:`.offload.offload_blocks`; 0 with ``"host"``, None where nothing is offloaded;
            ``Graph.meta["offload_rows_kept_bytes"]``).

    Source: ours (memory model of this package's attribution engine; docs/attribution.md).
    """

    host_bytes: int
    device_bytes: int
    batch_size: int
    terms: dict[str, int] = field(default_factory=dict)
    offload_rows: str | None = None
    offload_rows_kept_bytes: int | None = None


def row_reach(layout: Layout) -> tuple[torch.Tensor, float]:
    """Each feature row's possible non-zero edges, from the graph's structure alone (module docstring):
    ``((n_features,) float64 by feature node, one logit row's)``. A transcoder feature at layer ``l``, position
    ``p`` has an edge from every node written before the last frozen MHSA at or before layer ``l`` (an attention no
    Lorsa replaces) at a position ``≤ p``, from those written after it at ``p``, and from every bias node written
    before it; a Lorsa head from every node written before its layer at a position ``≤ p``; a node held at an
    intervened value from none; a logit as a feature after the last layer (every bias node but the transcoders'
    ``b_enc``, which reaches only its own layer's features). Exact: every counted edge is non-zero on the embedded
    model's full graph (128 tokens) and, row by row, on the tiny test models
    (``tests/attribution/test_budget_sparse.py``)."""
    P = layout.n_pos
    n_layers = len(layout.layers)
    # sources per (site, position): site 0 the embeddings, 2l+1 layer l's attention, 2l+2 its MLP
    count = torch.zeros(2 * n_layers + 1, P, dtype=torch.float64, device=HOST)
    count[0] += 1
    for lay in layout.layers:
        a, m = 2 * lay.layer + 1, 2 * lay.layer + 2
        count[a].index_add_(0, lay.lorsa_pos, torch.ones(lay.lorsa_pos.numel(), dtype=torch.float64, device=HOST))
        if lay.attn_err_start is not None:
            count[a] += 1
        count[m].index_add_(0, lay.tc_pos, torch.ones(lay.tc_pos.numel(), dtype=torch.float64, device=HOST))
        count[m] += 1
    # [s, p]: sources at sites < s at position p (at), at positions ≤ p (upto); row 0: none
    at = torch.cat([torch.zeros(1, P, dtype=torch.float64, device=HOST), count.cumsum(0)])
    upto = at.cumsum(1)
    # the frozen attention that mixes positions last before each layer's MLP: site 2l+1 of the last layer ≤ l whose
    # attention is an MHSA (no Lorsa replaces it: a Lorsa's heads and error are nodes, which cut the paths through
    # it), 0 if there is none. A source at site s < mixer[l] reaches layer l's MLP from every position ≤ p; one at
    # a later site only at p.
    mixer, last_mhsa = [], 0
    for lay in layout.layers:
        if lay.attn_err_start is None:
            last_mhsa = 2 * lay.layer + 1
        mixer.append(last_mhsa)

    def reach_at(site: int, mix: int, pos: torch.Tensor | int) -> torch.Tensor:
        """Sources before ``site`` that reach position ``pos``: at sites before ``mix`` from positions ≤ pos, the
        rest at ``pos`` only."""
        return upto[mix, pos] + at[site, pos] - at[mix, pos]

    # bias nodes (one per bias vector, over all positions): an edge to every target downstream of it; a
    # transcoder's b_enc only to its own layer's features (the activations are frozen)
    downstream = [0] * (2 * n_layers + 2)  # biases reaching site s's targets: Lorsa 2l+1, transcoder 2l+2
    for lay in layout.layers:
        a, m = 2 * lay.layer + 1, 2 * lay.layer + 2
        for role in lay.bias:
            # read by layer l's attention, written at its output / read by the MLP, or written at the MLP's output
            first = a if role in ("attn_norm", "lorsa_v") else m + 1 if role == "tc_dec" else m
            last = m if role == "tc_enc" else 2 * n_layers + 1
            for site in range(first, last + 1):
                downstream[site] += 1
    every = torch.zeros(layout.n_features, dtype=torch.float64, device=HOST)  # by feature node (= its row)
    for lay in layout.layers:
        a, n_l, n_t = 2 * lay.layer + 1, lay.lorsa_pos.numel(), lay.tc_pos.numel()
        # a Lorsa head mixes positions itself (its frozen pattern); a transcoder feature through the last MHSA
        every[lay.lorsa_start:lay.lorsa_start + n_l] = upto[a, lay.lorsa_pos] + downstream[a]
        every[lay.tc_start:lay.tc_start + n_t] = reach_at(a + 1, mixer[lay.layer], lay.tc_pos) + downstream[a + 1]
        for start, fixed in ((lay.lorsa_start, lay.lorsa_fixed), (lay.tc_start, lay.tc_fixed)):
            every[start + fixed.nonzero().flatten()] = 0  # held at an intervened value: no incoming edges
    # a logit reads the last position after the last layer: everything written before the last MHSA at any
    # position, what is written after it only at the last position
    n_bias = sum(len(lay.bias) - ("tc_enc" in lay.bias) for lay in layout.layers) + len(layout.bias)
    per_logit = float(reach_at(2 * n_layers + 1, mixer[-1] if mixer else 0, P - 1)) + n_bias
    return every, per_logit


def kept_entries(reach: torch.Tensor, keep_mass: float) -> torch.Tensor:
    """``(r,)`` float64: the most entries rows of ``reach: (r,)`` float64 possible non-zero edges keep at
    ``keep_mass`` (:meth:`.rows.SparseRows.append`: a row's largest ``|edges|`` until their sum reaches that fraction
    of its absolute mass): ``⌊keep_mass · n⌋ + 1``, at most ``n`` (``keep_mass ≥ 1``: ``n``). A bound: the largest
    ``k`` of ``n`` entries hold at least ``k / n`` of the mass, so no row keeps more than ``⌈keep_mass · n⌉`` (one
    more allowed for the float64 sums' rounding); a row of equal magnitudes keeps that many. How many fewer a row
    keeps depends on its values (how concentrated its mass is), not on the structure: measured 5–10 % of the bound at
    ``keep_mass=0.9`` and 30–31 % at 0.99 on the embedded model (64–512 tokens), 38 % at 0.9 on a random Llama
    (``benchmarks/attribution_memory_terms.py``, docs/attribution.md)."""
    if keep_mass >= 1.0:
        return reach
    return torch.minimum(reach, torch.floor(keep_mass * reach) + 1)


def structural_entries(layout: Layout, rows: int | None = None, keep_mass: float = 1.0) -> int:
    """An upper bound on the entries the graph's stored rows hold, from its structure alone: every feature row's
    and every logit row's possible non-zero edges (:func:`row_reach`; with ``rows``, a feature budget, those of the
    ``rows`` feature rows with the most — whichever the selection picks, it stores no more), each row's cut to
    :func:`kept_entries` at ``keep_mass < 1``."""
    reach, per_logit = row_reach(layout)
    kept = kept_entries(reach, keep_mass)
    if rows is not None and rows < kept.numel():
        kept = kept.topk(rows).values
    logit = float(kept_entries(torch.tensor([per_logit], dtype=torch.float64, device=HOST), keep_mass)[0])
    return int(float(kept.sum()) + layout.n_logits * logit)


def budget_blocks_bytes(layout: Layout, n_rows: int, budget: int, edge_itemsize: int, entries: int | None = None
                        ) -> int:
    """Bytes of a budgeted or pruned graph's adjacency (:func:`.rows.assemble`: a :class:`.blocks.BlockAdjacency` of its
    ``n_rows`` computed rows over its ``n = S − (n_features − budget)`` sources; pruned while built,
    :func:`.rows.assemble_pruned`'s of its kept rows over its kept sources, fewer of each), an upper bound: every row
    over every source (exact for the logit rows, which read every position) — or, given ``entries`` (the full graph's
    block entries, :meth:`.blocks.BlockAdjacency.entries`: every feature and logit row over the sources upstream of
    it), at most those, as a kept row's block columns are the kept ones among its full-graph block's (the bound
    without a feature budget) — and the block index: one source list per target site (``8 B · n`` each, at most one
    per row) and two ``8 B · N`` row maps. Linear in ``P`` for a fixed budget."""
    n_src = layout.n_sources - (layout.n_features - budget)
    n_sites = count_distinct(layout.nodes.sites()[:layout.n_features]) + 1  # the feature sites, the logits'
    cells = n_rows * n_src if entries is None else min(entries, n_rows * n_src)
    return cells * edge_itemsize + min(n_rows, n_sites) * n_src * 8 + 2 * (n_src + layout.n_logits) * 8


def _has_skip(transcoder: Any) -> bool:
    """Whether a layer's transcoder writes a linear skip path (``x W_skipᵀ``: its input kept for the backward)."""
    return getattr(transcoder, "W_skip", None) is not None or bool(getattr(getattr(transcoder, "cfg", None), "skip",
                                                                          False))


def frozen_per_copy_bytes(layout: Layout, *, n_layers: int, d_model: int,
                          mhsa_widths: dict[int, tuple[int, int]] | None, store_patterns: bool, itemsize: int,
                          pattern_layers: Collection[int] = ()) -> int:
    """Bytes one prompt copy adds to the frozen pass's peak (less the multipliers' :data:`ROW_BUFFERS`), counted from
    the structure: what the frozen forward keeps for the backward, and the largest backward's transient gradients.

    Kept, ``(P, d_model)`` each: the embeddings and the final norm's output (:data:`RESIDUAL_EXTRA`) and one per skip
    transcoder (its input; ``W_skip`` enters detached since 2026-11-26, which freed 2 of 3 such tensors per copy on the
    tiny Llama with skip transcoders on its 3 MLPs — 156.9 → 132.3 kB per copy at 48 tokens — so the term stays a
    bound, not a count); not the frozen norms' inputs nor a Lorsa's (their
    weights enter the frozen pass detached since 2026-11-26 — :func:`.frozen.frozen_norm`, :func:`.replacement.on` —
    so no product keeps its input for a weight gradient never taken: ``2L + 2`` fewer ``(P, d)`` tensors per copy,
    the per-copy growth measured 2.0–2.3× smaller); with SDPA (no stored patterns) each frozen MHSA's values,
    repeated to every head, and its output (``2·H·d_head``); and the targets, ``2·(n_features + n_logits)`` numbers
    (each site's pre-activations and their concatenation) plus, with stored patterns, each Lorsa's read on its grid
    by OV head (``heads active × most nodes of one head``; without stored patterns the rows are recomputed in chunks,
    :func:`.frozen.z_pre`, and no grid is made: counted there until 2026-11-27, it was 5.1 of the 6.4 GB per copy the
    H200's offloaded all-layer run was estimated at, 4096 tokens, and made its estimate 1.5x the measured peak).

    Transient, the largest one backward holds (at least ``3·d``: a transcoder's encoder read and the residual
    gradients): through a frozen MHSA the residual's and the layer output's gradients (``2·d``), its heads' output
    gradient and a copy (``2·H·d_head``), its values' and a copy (``2·H_kv·d_head``) — with SDPA the queries', keys'
    and values' gradients, the output's and a contiguous copy instead (``5·H·d_head``); through a Lorsa's values
    ``2·d + 2·u`` (``u``: its OV heads active somewhere). ``mhsa_widths``: ``(H·d_head, H_kv·d_head)`` per frozen
    MHSA layer (None: ``d_model`` each). ``pattern_layers``: the frozen MHSA layers that keep their pattern whatever
    ``store_patterns`` (soft-capped, :func:`.frozen.keeps_pattern`): counted as stored patterns.

    Measured (``benchmarks/attribution_memory_terms.py --modes frozen``, allocation level: docs/attribution.md) on
    seven model shapes, fp32/fp64/bf16, stored patterns and the CPU's SDPA, 64–512 tokens: the peak's growth from
    batch 4 to 8 is 0.35–0.97× this term per copy. On a GPU with SDPA :func:`estimate_layout` uses the fitted
    :data:`PER_COPY_NUMBERS_GPU_SDPA` instead (the GPU kernels' saved tensors were not taken apart).

    Returns:
        bytes, ``itemsize`` per number (the frozen model's).
    """
    P, d = layout.n_pos, d_model
    kept = RESIDUAL_EXTRA * d
    transient = 3 * d
    for lay in layout.layers:
        if lay.lorsa is not None:
            u = count_distinct(lay.lorsa_head)
            transient = max(transient, 2 * d + 2 * u)
        elif lay.attn_err_start is None:  # a frozen MHSA
            h, g = (mhsa_widths or {}).get(lay.layer, (d, d))
            if store_patterns or lay.layer in pattern_layers:
                transient = max(transient, 2 * d + 2 * h + 2 * g)
            else:  # SDPA keeps its values (repeated to every head) and output; its backward's q, k, v gradients
                kept += 2 * h
                transient = max(transient, 2 * d + 5 * h + 2 * g)
        if lay.transcoder is not None and _has_skip(lay.transcoder):
            kept += d
    # the targets: each site's pre-activations and their concatenation; with stored patterns a Lorsa's read on its
    # grid by OV head (replacement.lorsa_z_pre's slots.read) — without, its pattern rows are recomputed in chunks
    # of frozen.ROW_CHUNK_ELEMENTS (frozen.z_pre): no grid, nothing per node and copy past its targets
    targets = 2 * (layout.n_features + layout.n_logits)
    for lay in layout.layers:
        if store_patterns and lay.lorsa is not None and lay.lorsa_head.numel():
            per_head = torch.bincount(lay.lorsa_head)
            targets += int((per_head > 0).sum()) * int(per_head.max())
    return ((kept + transient) * P + targets) * itemsize


def frozen_model_bytes(layout: Layout, *, n_layers: int, d_model: int, mhsa_heads: dict[int, int],
                       mhsa_widths: dict[int, tuple[int, int]] | None, store_patterns: bool, vocab: int, d_mlp: int,
                       itemsize: int, model_itemsize: int, grid: Callable[[torch.Tensor], int],
                       n_norms: int | None = None,
                       pattern_layers: Collection[int] = (), row_step: int = 0) -> int:
    """Bytes the frozen pass holds once, whatever the batch, besides its node vectors, patterns and error vectors: the
    model's own unembedding and MLP run on one prompt copy (the frozen constants) — the frozen model's ``(P, vocab)``
    logits (row 0's, in the model's dtype, and a copy in the frozen model's, ``itemsize``, where it is another),
    broadcast over the batch, and the model's own unembedding's ``(1, vocab)``: it runs on the last position only
    (:func:`.trace.last_position`; its ``(P, vocab)`` logits were counted until 2026-11-27); the MLP's four
    ``(P, d_mlp)`` activations while it runs (``model_itemsize``: the model's) —; each frozen norm's fused ``scale·γ``
    ``(P, d)``, kept by its product (``n_norms`` of them: the frozen sites' norms,
    ``4L + 1`` with Gemma-2/3's post-norms; None: ``2L + 1``); each frozen MHSA's ``W_O`` as one
    ``(H·d_head, d)`` matrix, kept by its einsum; with stored patterns each Lorsa's pattern rows on its grid by OV
    head (``(heads, most nodes of one head, P)``); and the largest transient of making a constant: a site's node
    vectors gathered and copied before its grid (``2·n·d`` where ``grid(pos)``, the bytes of the grid of the ``n``
    nodes at positions ``pos``, is not 0: 0 where gathered), a pattern's
    scores and softmax in at least fp32 (every frozen MHSA's with ``store_patterns``, else those of
    ``pattern_layers``), or ``row_step``, a step of the recomputed Lorsa pattern rows (:func:`lorsa_row_bytes`:
    like a constant's making it runs inside one site, while nothing else is made)."""
    P = layout.n_pos
    total = P * vocab * (model_itemsize + (itemsize if itemsize != model_itemsize else 0)) + vocab * model_itemsize
    norms = 2 * n_layers + 1 if n_norms is None else n_norms
    total += 4 * P * d_mlp * model_itemsize + norms * P * d_model * itemsize
    total += sum((mhsa_widths or {}).get(layer, (d_model, d_model))[0] * d_model * itemsize for layer in mhsa_heads)
    making = pattern_making(mhsa_heads, P, itemsize, store_patterns, pattern_layers)
    making += grid_making(layout, d_model, itemsize, grid) + [row_step]
    for lay in layout.layers:
        n_l = lay.lorsa_pos.numel()
        if store_patterns and n_l:
            per_head = torch.bincount(lay.lorsa_head)
            total += int((per_head > 0).sum()) * int(per_head.max()) * P * itemsize
    return total + max(making, default=0)


def grid_making(layout: Layout, d_model: int, itemsize: int, grid: Callable[[torch.Tensor], int]) -> list[int]:
    """Bytes of making each node grid (:meth:`.replacement.FrozenReplacement.nodes`): the site's ``n`` node vectors
    gathered (``n·d``) and copied to the site, both held while the grid (kept, counted in ``node_grids``) is
    filled: ``2·n·d`` numbers of ``itemsize`` bytes for each Lorsa and transcoder site whose nodes are on a grid
    (``grid(pos)``, the grid's bytes, not 0)."""
    return [2 * pos.numel() * d_model * itemsize for lay in layout.layers for pos in (lay.lorsa_pos, lay.tc_pos)
            if grid(pos)]


def pattern_making(mhsa_heads: dict[int, int], n_pos: int, itemsize: int, store_patterns: bool,
                   pattern_layers: Collection[int]) -> list[int]:
    """Bytes of making each kept MHSA pattern (:func:`~nnsight_lorsa.adapters.base.mhsa_pattern`: its scores and
    softmax, ``2·H·P²`` numbers in at least fp32), one per frozen MHSA layer that keeps its pattern — every one with
    ``store_patterns``, else those of ``pattern_layers``."""
    return [2 * h * n_pos * n_pos * max(itemsize, 4) for layer, h in mhsa_heads.items()
            if store_patterns or layer in pattern_layers]


def estimate_layout(layout: Layout, *, n_layers: int, d_model: int, mhsa_heads: dict[int, int], batch_size: int,
                    prune: bool, max_feature_nodes: int | None = None, keep_mass: float = 1.0,
                    store_patterns: bool = True,
                    node_vectors: str = "auto", model_itemsize: int = 4, edge_itemsize: int = 4,
                    device: str = "cpu", module_itemsize: int | None = None,
                    mhsa_widths: dict[int, tuple[int, int]] | None = None, vocab: int = 0,
                    d_mlp: int = 0, unembed_itemsize: int | None = None, n_norms: int | None = None,
                    pattern_layers: Collection[int] = (), mask_entry_bytes: int = 0,
                    offload_rows: RowsPlace = "host", blocks: list[tuple[str, int]] | None = None
                    ) -> MemoryEstimate:
    """:class:`MemoryEstimate` from a layout and the model's shapes (``mhsa_heads``: heads of each frozen
    MHSA layer; ``mhsa_widths``: its ``(n_heads · head_dim, n_kv_heads · head_dim)``, None: ``d_model`` each);
    see the module docstring for the terms. ``module_itemsize``: the bytes per number the Lorsas
    compute in (``attribute``'s ``dtype=``: copies in it); None: each Lorsa's own dtype's. ``vocab``, ``d_mlp``,
    ``unembed_itemsize`` (the model's bytes per number; None: ``model_itemsize``): the model's own unembedding and
    MLP, which run on one prompt copy (0: not counted). From the adapter (:func:`estimate_info`): ``n_norms``, the
    frozen norms (None: ``2L + 1``; ``4L + 1`` with post-attention and post-feedforward norms);
    ``pattern_layers``, the frozen MHSA layers that keep their pattern whatever ``store_patterns`` (soft-capped:
    :func:`.frozen.keeps_pattern`) — their ``H·P²`` pattern, its making and their stored-pattern backward counted
    also on the SDPA paths, the GPU's fitted one included; ``mask_entry_bytes``, the model's own attention masks per
    prompt copy and (query, key) pair (:func:`attention_mask_entry_bytes`; 0: none); ``offload_rows``: where the
    frozen pass keeps the offloaded modules' active rows (``"host"`` / ``"device"`` / the kept blocks' keys:
    :data:`.offload.RowsPlace`, :func:`.offload.offload_terms`; :func:`plan_call` decides it as ``attribute`` does);
    ``blocks``: the offloaded row blocks (:func:`.offload.offload_blocks` of this layout, ``node_vectors`` and
    ``model_itemsize``) where the caller has them — :func:`plan_call` computes them once per call; None: here."""
    P, S = layout.n_pos, layout.n_sources
    budget = layout.n_features if max_feature_nodes is None else min(max_feature_nodes, layout.n_features)
    n_rows = budget + layout.n_logits
    # a GPU's SDPA kernels: PER_COPY_NUMBERS_GPU_SDPA, fitted with frozen MHSA layers attending through SDPA — with a
    # Lorsa on every attention (no frozen MHSA: a Lorsa layer's frozen pass calls no SDPA, frozen.z_pre) nothing it
    # was fitted on runs, and the frozen pass is counted from the structure (measured on an H200: docs/attribution.md)
    fitted = device != "cpu" and not store_patterns and bool(mhsa_heads)
    if fitted:
        per_copy = int(PER_COPY_NUMBERS_GPU_SDPA * n_layers * d_model * P * model_itemsize)
    else:
        per_copy = frozen_per_copy_bytes(layout, n_layers=n_layers, d_model=d_model, mhsa_widths=mhsa_widths,
                                         store_patterns=store_patterns, itemsize=model_itemsize,
                                         pattern_layers=pattern_layers)
    per_copy += ROW_BUFFERS * S * edge_itemsize + mask_entry_bytes * P * P
    shared = 0

    def grid(pos: torch.Tensor, copies: int = 1) -> int:  # a site's node vectors on a grid, or gathered (nothing
        # kept): frozen.choose; the grid is (positions, the most nodes at one position, d) (frozen.PositionSlots):
        # its padding counted
        n = pos.numel()
        if not n or choose(node_vectors, n, d_model, dtype, copies) != "grid":
            return 0
        return P * int(torch.bincount(pos).max()) * d_model * model_itemsize

    dtype = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}.get(model_itemsize, torch.float32)
    # the recomputed Lorsa pattern rows (frozen.z_pre): indices kept; a step's transients, one site at a time like the
    # making of a constant: the larger of the two is counted
    row_kept, row_step = (0, 0) if store_patterns else lorsa_row_bytes(layout, batch_size, model_itemsize,
                                                                       module_itemsize, torch.device(device))
    # the grids kept; the largest gathered site's chunk bound, max(batch, its most nodes at one position) · P numbers
    node_grids = gathered = 0
    for lay in layout.layers:
        n_l, n_t = lay.lorsa_pos.numel(), lay.tc_pos.numel()
        shared += n_l * P * model_itemsize if store_patterns else 0
        # a transcoder's encoder grid and one decoder grid per replaced MLP it writes into (a CLT layer: its own and
        # every later one's, each kept under its own key by FrozenReplacement.mlp; one until 2026-11-26)
        n_dec = layout.decoder_targets(lay.layer)
        node_grids += grid(lay.lorsa_pos) + grid(lay.tc_pos) + n_dec * grid(lay.tc_pos, n_dec)
        for n, copies, site_pos in ((n_l, 1, lay.lorsa_pos), (n_t, 1, lay.tc_pos), (n_t, n_dec, lay.tc_pos)):
            if n and choose(node_vectors, n, d_model, dtype, copies) == "gather":
                gathered = max(gathered, max(batch_size, int(torch.bincount(site_pos).max())) * P)
        # error vectors (one per replaced module), and a Lorsa's frozen queries/keys without stored patterns
        shared += (2 if lay.lorsa is not None else 1) * P * d_model * model_itemsize
        if lay.lorsa is not None and not store_patterns:  # computed by the Lorsa, kept in its dtype
            qk_itemsize = module_itemsize or next(lay.lorsa.parameters()).element_size()
            shared += 2 * P * lay.lorsa.cfg.n_qk_heads * lay.lorsa.cfg.d_qk_head * qk_itemsize
    shared += node_grids
    shared += sum(h * P * P * model_itemsize for layer, h in mhsa_heads.items()
                  if store_patterns or layer in pattern_layers)
    if not fitted:  # the fitted coefficient was measured with these inside it
        shared += frozen_model_bytes(layout, n_layers=n_layers, d_model=d_model, mhsa_heads=mhsa_heads,
                                     mhsa_widths=mhsa_widths, store_patterns=store_patterns, vocab=vocab, d_mlp=d_mlp,
                                     itemsize=model_itemsize, model_itemsize=unembed_itemsize or model_itemsize,
                                     grid=grid, n_norms=n_norms, pattern_layers=pattern_layers, row_step=row_step)
    else:  # but not a kept pattern's making (measured on SDPA layers only: a soft-capped one keeps its pattern), nor
        # a node grid's (measured where every site gathers, 1024-4096 tokens; at 512, every transcoder site on its
        # grid, the H200's peak was 2 % above the estimate without it)
        shared += max(pattern_making(mhsa_heads, P, model_itemsize, False, pattern_layers)
                      + grid_making(layout, d_model, model_itemsize, grid) + [row_step])
    found: list[list[tuple[str, int]]] = [] if blocks is None else [blocks]

    def row_blocks() -> list[tuple[str, int]]:  # computed once, where needed
        if not found:
            found.append(offload_blocks(layout, d_model=d_model, node_vectors=node_vectors, itemsize=model_itemsize))
        return found[0]

    offload = offload_terms(layout, d_model=d_model, node_vectors=node_vectors, itemsize=model_itemsize,
                            rows=offload_rows, blocks=row_blocks()) if device != "cpu" else {}  # on the CPU:
    # computed where stored
    shared += sum(offload.values())
    # a gathered site's chunk temporaries (frozen.gather_write / gather_read, by chunks of positions): two fp32-sized,
    # the chunk's (positions, width, d) grid and its (positions, batch, d) product, each at most the chunk budget
    gather_chunks = 2 * 4 * min(node_chunk_elements(torch.device(device)), gathered * d_model)
    shared += gather_chunks
    shared += row_kept
    kept_graph = edge_scores = 0  # the pruning's value-sized parts: the kept graph, the edge scores and kept edges
    full = full_graph_blocks(layout, torch.float32).entries() if budget == layout.n_features else None
    if full is not None and (not prune or keep_mass >= 1.0):  # every entry: the causal blocks
        entries = full
        rows = entries * edge_itemsize
        pruning = int(PRUNE_BLOCK_BYTES_PER_ENTRY * entries) if prune else 0  # prune(graph)'s passes on the blocks
    else:  # sparse rows (keep_mass < 1 or a feature budget): the kept entries, 4 B column + value
        entries = structural_entries(layout, budget if budget < layout.n_features else None, keep_mass)
        rows = entries * (4 + edge_itemsize) + 16 * n_rows  # and each row's float64 residual and mass
        if not prune:  # then the graph over the visited features: the computed rows' causal blocks
            rows += budget_blocks_bytes(layout, n_rows, budget, edge_itemsize)
        # pruning, or assembling the budgeted graph's blocks: chunked passes over the stored entries
        pruning = PRUNE_BYTES_PER_CHUNK_ENTRY * min(CHUNK_ENTRIES, max(entries, 1))
    if prune:  # the edge scores and kept edges, then the kept rows' blocks (with a budget: its rows × sources at most)
        kept_graph = budget_blocks_bytes(layout, n_rows, budget, edge_itemsize, full)
        among = min(entries, n_rows * (S - layout.n_features + budget))  # stored entries between graph nodes
        edge_scores = edge_scores_bytes(among)
        pruning += max(edge_scores, kept_graph)
    # a feature budget: the influence-ordered selection between two batches (a chunked pass over the stored
    # rows, and float64 vectors over the sources), while the frozen pass is held
    selection = (SELECTION_BYTES_PER_CHUNK_ENTRY * min(CHUNK_ENTRIES, max(entries, 1)) + SELECTION_VECTORS * 8 * S
                 if budget < layout.n_features else 0)
    # the ranking pass on the device (SparseRows.weighted_abs with long rows): its float64 sums over the sources and one
    # step's entries (int32 column, the value, its float64 term), between two batches while the frozen pass is held
    ranking_device = (8 * S + DEVICE_CHUNK_ENTRIES * (4 + edge_itemsize + 8)
                      if budget < layout.n_features and device == "cuda" else 0)
    shared += ranking_device
    frozen = per_copy * batch_size + shared
    heap_retained = HOST_HEAP_RETAINED_BATCHES * per_copy * batch_size if device == "cpu" else 0
    terms = {"frozen_per_copy": per_copy, "frozen_shared": shared, "heap_retained": heap_retained,
             "rows": rows, "pruning": pruning,
             "ranking_device": ranking_device,
             "selection": selection, "kept_graph": kept_graph, "edge_scores": edge_scores, "fixed": FIXED_BYTES,
             "n_sources": S, "n_rows": n_rows, "stored_entries": entries, "gather_chunks": gather_chunks,
             "row_chunks": row_kept + row_step, "row_step": row_step,
             "node_grids": node_grids, **offload}
    place = None if not any_offloaded(layout) else "host" if device in ("cpu", "meta") else offload_rows
    # the blocks kept on the device, in bytes ("host": none, no block needed)
    kept = None if place is None else 0 if place == "host" else kept_bytes(row_blocks(), place)
    if device == "cpu":  # the frozen pass's resident set: its allocations and what the heap keeps of a batch's
        frozen += heap_retained
        host = rows + max(frozen + selection, pruning) + FIXED_BYTES
        return MemoryEstimate(host, frozen, batch_size, terms, rows_label(place), kept)
    return MemoryEstimate(rows + max(selection, pruning) + FIXED_BYTES, frozen, batch_size, terms, rows_label(place),
                          kept)


def lorsa_row_bytes(layout: Layout, batch: int, itemsize: int, module_itemsize: int | None,
                    device: torch.device) -> tuple[int, int]:
    """The recomputed Lorsa pattern rows' bytes without stored patterns (term ``row_chunks``, their sum;
    :func:`.frozen.z_pre`): ``(kept, step)`` — kept from the forward to the last backward, every layer's slot
    indices (int64: one per slot, and the padded query positions, node order and OV-head column, one per node); and
    the largest step's transients of any Lorsa layer (:func:`.frozen.row_step_bytes` of :func:`.frozen.plan_rows`'s
    steps, with :func:`.frozen.row_chunk_elements` of ``device``; on a device that runs the head product,
    :func:`.frozen.head_product`, its steps and transients, with its index vectors kept). ``itemsize``: the frozen
    model's bytes per number (the values'); ``module_itemsize``: the Lorsas' (their queries and keys; None: each
    Lorsa's own)."""
    kept = step = 0
    for lay in layout.layers:
        if lay.lorsa is None or not lay.lorsa_head.numel():
            continue
        cfg = lay.lorsa.cfg
        counts = torch.bincount(lay.lorsa_head // cfg.group_size, minlength=cfg.n_qk_heads).tolist()
        group_size = cfg.group_size if head_product(device) else 0
        order, steps = plan_rows(counts, layout.n_pos, batch, cfg.d_qk_head, row_chunk_elements(device), group_size)
        qk_itemsize = module_itemsize or next(lay.lorsa.parameters()).element_size()
        n_values = count_distinct(lay.lorsa_head) if group_size else 0
        step = max([step] + [row_step_bytes(s, layout.n_pos, batch, cfg.d_qk_head, itemsize, qk_itemsize,
                                            group_size, n_values) for s in steps])
        n = lay.lorsa_head.numel()
        kept += 8 * (sum(s.heads * s.width for s in steps) + len(order) + 3 * (n + 1))
        if group_size:  # each node's place in its group; each step's heads' columns and places with nodes
            kept += 8 * ((n + 1) + 2 * sum(s.heads for s in steps) * group_size)
    return kept, step


def edge_scores_bytes(scored: int) -> int:
    """The pruning's edge scores over ``scored`` entries, in bytes: their float64 scores
    (:data:`PRUNE_BYTES_PER_EDGE` each, sorted in place) and :func:`.scores.find_threshold_`'s running sums over one
    :data:`.scores.CHUNK` of them (:data:`THRESHOLD_BYTES_PER_CHUNK_ENTRY` each). :func:`.scores.prune_rows` scores
    the stored entries between the nodes the node threshold keeps; the estimate, before the rows exist, counts every
    stored entry between graph nodes (term ``edge_scores``). ``scored``: a count ``≥ 0`` (int)."""
    return PRUNE_BYTES_PER_EDGE * scored + THRESHOLD_BYTES_PER_CHUNK_ENTRY * min(SCORES_CHUNK, scored)


class CallPlan(NamedTuple):
    """What one :func:`.attribute.attribute` call settles before its frozen pass (:func:`plan_call`)."""

    #: the batch (the largest ``≤ batch_size`` that fits ``max_memory``; ``batch_size`` without it)
    batch: int
    #: where the offloaded modules' active rows live (:data:`.offload.RowsPlace`; None: nothing offloaded)
    rows: RowsPlace | None
    #: ``estimate(rows, batch)`` → :func:`estimate_layout` with ``offload_rows=rows`` (memoised; the call's own:
    #: ``estimate(rows or "host", batch)``)
    estimate: Callable[..., MemoryEstimate]
    #: bytes of the offloaded rows kept on the device (``Graph.meta["offload_rows_kept_bytes"]``: 0 with
    #: ``"host"``, None where nothing is offloaded)
    kept_bytes: int | None
    #: device bytes the feature budget's stored rows may keep a copy in for the ranking pass (:func:`ranking_mirror`;
    #: :class:`.rows.SparseRows`' ``mirror_bytes``): 0 without a budget or off CUDA
    ranking_mirror: int = 0

    def call_estimate(self) -> MemoryEstimate:
        """The call's own estimate: ``estimate(rows or "host", batch)`` with :attr:`ranking_mirror` in
        ``device_bytes`` and as the term ``ranking_mirror`` (what :func:`estimate_memory` returns)."""
        est = self.estimate(self.rows or "host", self.batch)
        return MemoryEstimate(est.host_bytes, est.device_bytes + self.ranking_mirror, est.batch_size,
                              {**est.terms, "ranking_mirror": self.ranking_mirror}, est.offload_rows,
                              est.offload_rows_kept_bytes)


def ranking_mirror(estimate: MemoryEstimate, device: torch.device, *, ranked: bool, max_memory: int | None,
                   edge_itemsize: int) -> int:
    """Device bytes a feature budget's stored rows may keep a copy in for the ranking pass (:class:`.rows.SparseRows`'
    ``mirror_bytes``): the call's slack on the model's ``device`` — ``max_memory`` (or, without it, the bytes torch
    can allocate there now over :data:`.offload.FREE_MEMORY_MARGIN`, :func:`.offload.device_free_bytes`) less the
    call's ``estimate.device_bytes`` (at its batch, with its offloaded rows) — at most the stored entries
    (``stored_entries`` × (4 B + ``edge_itemsize``)), never below 0. 0 unless ``ranked`` (a feature budget below the
    prompt's features) on a CUDA ``device`` (:func:`.rows.mirrors`)."""
    if not ranked or not mirrors(device):
        return 0
    room = max_memory
    if room is None:
        free = device_free_bytes(device)
        room = None if free is None else int(free / FREE_MEMORY_MARGIN)
    if room is None:
        return 0
    entries = estimate.terms.get("stored_entries", 0) * (4 + edge_itemsize)
    return max(0, min(room - estimate.device_bytes, entries))


def layer_devices(root: torch.nn.Module, adapter: Any) -> dict[int, torch.device]:
    """``{layer: device}`` where each decoder layer of the Hugging Face model ``root`` computes (its first
    parameter's device; a model split over several GPUs, ``device_map="auto"``, puts whole layers on each): where an
    offloaded module's rows for that layer's sites live (:func:`.offload.block_layer`). A layer without parameters:
    the model's first parameter's device."""
    first = next(root.parameters()).device
    out: dict[int, torch.device] = {}
    for layer in range(adapter.n_layers):
        param = next(adapter.get_module(root, adapter.layer_path(layer)).parameters(), None)
        out[layer] = first if param is None else param.device
    return out


def plan_call(layout: Layout, info: Callable[[], dict[str, Any]], device: torch.device, *, batch_size: int,
              max_feature_nodes: int | None, max_memory: int | None,
              devices: Callable[[], Mapping[int, torch.device]] | None = None) -> CallPlan:
    """What one :func:`.attribute.attribute` call settles before its frozen pass — the one plan of the call, made
    the same way by :func:`estimate_memory` (which returns its estimate): where it keeps the offloaded modules'
    active rows (:func:`.offload.rows_placement`: the rule, units; all, none or the blocks that fit the slack) and,
    with ``max_memory`` (bytes), the largest batch ``≤ batch_size`` that fits it (:func:`largest_batch`, with those
    rows: the one of the rows on the host). The offloaded row blocks (:func:`.offload.offload_blocks`) are computed
    once, where needed, and shared by the rule, every estimate and the kept bytes.

    Args:
        layout: the prompt's nodes.
        info: → :func:`estimate_info`'s shapes (called once, only where an estimate is needed).
        device: the model's device (its first parameter's; the rule's device type, and the device of every layer
            when ``devices`` is None).
        devices: → ``{layer: device}`` where each layer computes (:func:`layer_devices`; called only for the
            free-memory rule, whose free memory is read per device, :func:`.offload.device_free_bytes`); None: every
            layer on ``device``.

    Returns:
        :class:`CallPlan`: ``rows`` ``"device"`` / ``"host"`` / a frozenset of the kept blocks' keys
        (:data:`.offload.RowsPlace`; None: nothing offloaded), the batch, the memoised ``estimate(rows, batch)``
        and the kept rows' bytes.

    Raises:
        MemoryBudgetError: ``max_memory`` too small even for batch 1.
    """
    memo: dict[Any, Any] = {}

    def shapes() -> dict[str, Any]:
        if "info" not in memo:
            memo["info"] = info()
        return memo["info"]

    def blocks() -> list[tuple[str, int]]:  # once per call
        if "blocks" not in memo:
            s = shapes()
            memo["blocks"] = offload_blocks(layout, d_model=s["d_model"], node_vectors=s["node_vectors"],
                                            itemsize=s["model_itemsize"])
        return memo["blocks"]

    offloaded_any = any_offloaded(layout)

    def estimate(rows: RowsPlace, batch: int = batch_size) -> MemoryEstimate:
        s = shapes()
        if (rows, batch) not in memo:
            memo[rows, batch] = estimate_layout(layout, batch_size=batch, max_feature_nodes=max_feature_nodes,
                                                offload_rows=rows, blocks=blocks() if offloaded_any else [], **s)
        return memo[rows, batch]

    free: dict[torch.device, int | None] | None = None
    where: Callable[[str], torch.device] | None = None
    if offloaded_any and max_memory is None and device.type not in ("cpu", "meta"):
        by_layer = dict(devices()) if devices is not None else {}
        free = {d: device_free_bytes(d) for d in dict.fromkeys([device, *by_layer.values()])}

        def where(key: str) -> torch.device:
            return by_layer.get(block_layer(key), device)

    rows = rows_placement(offloaded_any, device.type, estimate, blocks, batch_size=batch_size, max_memory=max_memory,
                          free_bytes=free, block_device=where)
    batch = batch_size
    if max_memory is not None:
        batch = largest_batch(lambda b: estimate(rows or "host", b), max_memory, batch_size, device.type)
    kept = None if rows is None else 0 if rows == "host" else kept_bytes(blocks(), rows)
    ranked = max_feature_nodes is not None and max_feature_nodes < layout.n_features
    mirror = ranking_mirror(estimate(rows or "host", batch), device, ranked=ranked, max_memory=max_memory,
                            edge_itemsize=shapes()["edge_itemsize"]) if ranked and mirrors(device) else 0
    return CallPlan(batch, rows, estimate, kept, mirror)


def attention_mask_entry_bytes(adapter: Any, implementation: str | None, itemsize: int) -> int:
    """Bytes per prompt copy and (query, key) pair of the attention masks the model's own forward builds for the
    frozen pass's batch of prompt copies (transformers' ``masking_utils``: ``(batch, 1, P, P)`` each, held until the
    forward returns — the backward runs inside it): one for the full-attention layers and, where a layer attends in
    a sliding window (``adapter.sliding_window(layer)``: Gemma-2/3, Mistral, Qwen2's sliding layers), one for those.

    Args:
        adapter: the model's :class:`~nnsight_lorsa.adapters.base.ArchitectureAdapter`.
        implementation: the model's attention implementation (``config._attn_implementation``; None: eager).
        itemsize: the frozen model's bytes per number (``attribute``'s ``dtype=``, else the model's).

    Returns:
        eager (and any implementation but SDPA or flash attention): ``itemsize`` per mask (additive, in the frozen
        model's dtype); SDPA: 1 B for the sliding mask (bool; the causal one is SDPA's ``is_causal``, not built), 0
        without sliding layers; flash attention: 0. A bound: transformers skips a sliding mask whose window covers the
        prompt under SDPA. Measured on the tiny Gemma-2/3 at 512 tokens: two fp32 masks per copy with eager attention,
        the bool sliding one with SDPA (``tests/attribution/test_budget_frozen.py``)."""
    window = getattr(adapter, "sliding_window", None)
    sliding = window is not None and any(window(layer) is not None for layer in range(adapter.n_layers))
    if implementation is not None and implementation.startswith("flash"):
        return 0
    if implementation == "sdpa":
        return int(sliding)
    return (1 + int(sliding)) * itemsize


def estimate_info(replacement: Any, prepared: Prepared, patterns: str, node_vectors: str, prune: bool,
                  dtype: torch.dtype | None, keep_mass: float = 1.0) -> dict[str, Any]:
    """The shapes :func:`.budget.estimate_layout` takes, from a prepared prompt."""
    root = hf_module(replacement.model)
    param = next(root.parameters())
    device = param.device.type
    config = getattr(root, "config", None)
    adapter = prepared.adapter
    model_itemsize = (dtype or param.dtype).itemsize
    vocab = getattr(root.get_output_embeddings(), "out_features", 0) if hasattr(root, "get_output_embeddings") else 0
    return {"n_layers": prepared.adapter.n_layers, "d_model": prepared.adapter.d_model,
            "mhsa_heads": {layer: int(w.W_Q.shape[0]) for layer, w in prepared.mhsa.items()}, "prune": prune,
            "mhsa_widths": {layer: (int(w.W_Q.shape[0] * w.W_Q.shape[2]), int(w.W_V.shape[0] * w.W_V.shape[2]))
                            for layer, w in prepared.mhsa.items()},
            "vocab": int(vocab or getattr(config, "vocab_size", 0) or 0),
            "d_mlp": int(getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
                         or 4 * prepared.adapter.d_model),
            "unembed_itemsize": param.dtype.itemsize,
            "keep_mass": keep_mass,
            "store_patterns": patterns == "store" or (patterns == "auto" and device == "cpu"),
            "node_vectors": node_vectors,
            "model_itemsize": model_itemsize, "edge_itemsize": multiplier_dtype(root, dtype).itemsize,
            "module_itemsize": None if dtype is None else dtype.itemsize, "device": device,
            "n_norms": sum(site.kind == "norm" for site in frozen_sites(adapter)),
            "pattern_layers": sorted(layer for layer, w in prepared.mhsa.items() if keeps_pattern(w, False)),
            "mask_entry_bytes": attention_mask_entry_bytes(adapter, attn_implementation(root), model_itemsize)}


def layout_for_estimate(replacement: Any, prompt: Any, options: AttributionOptions) -> tuple[Layout, dict[str, Any]]:
    """The prompt's layout (one clean pass, or from a cache) and :func:`estimate_info` for
    :func:`.budget.estimate_memory`."""
    patterns, node_vectors = options.modes
    config = options.prune
    if isinstance(prompt, AttributionCache):
        prepared = prepare(replacement, None, cache=prompt, targets=options.targets,
                           zero_positions=options.zero_positions)
    else:
        prepared = prepare(replacement, prompt, targets=options.targets, zero_positions=options.zero_positions)
    return prepared.layout, estimate_info(replacement, prepared, patterns, node_vectors, config is not None,
                                          options.dtype, config.keep_mass if config is not None else 1.0)


def estimate_memory(replacement: Any, prompt: Any, *, batch_size: int = 64, memory: str = "auto",
                    prune: Any = None, max_feature_nodes: int | None = None,
                    dtype: torch.dtype | None = None, zero_positions: int = 0, targets: Targets = None,
                    max_memory: int | None = None, **renamed: Any) -> MemoryEstimate:
    """Predict the peak host and device memory of ``attribute(replacement, prompt, ...)`` with the same
    settings, from one clean forward (the prompt's active nodes) and the model's shapes — nothing is
    attributed. See the module docstring for the terms. Measured against it: the host total 0.88–1.11× the full
    graph's resident-set peak at 64–256 tokens, batch 64, on the embedded model (2026-11-28, with the C heap's retained
    batch, :data:`HOST_HEAP_RETAINED_BATCHES`; 0.68–0.77× without it:
    ``benchmarks/results/attribution_host_estimate_heap.json``, ``benchmarks/attribution_vs_circuit_tracer.py``),
    and, per mode at 128–512 tokens (``benchmarks/attribution_memory_terms.py``, re-measured 2026-11-28 with the heap
    term: ``results/attribution_memory_terms_estimate_heap.json``,
    ``attribution_memory_terms_budget_estimate_heap.json``), the full graph
    −12 % to −3 % of the call's peak, a feature budget of 64 (batch 16) −9 % to +39 %, ``prune=`` −3 % at 128 tokens
    and +66 / +95 % at 256 / 512 (its pruning term is a bound, below); single frozen passes vary by ~±25 % in the
    resident set between processes; the frozen pass's
    allocations 0.79–1.0× its terms (seven shapes, fp32/fp64/bf16, batches 1–8,
    ``results/attribution_memory_terms_frozen_*.json``; the tiny Gemma-2/3 — post-norms, soft-capped patterns,
    sliding-window masks — 0.72–0.96×, 128–512 tokens, ``results/attribution_memory_terms_frozen_gemma*.json``);
    the device peak on an H200 at the 8B shape 0.92–1.03 × the estimate with the Lorsa on one layer, 0.95–0.96 × with
    the paper's Lorsa on all 32 layers offloaded (``benchmarks/offload_estimate_8b.py``: the structural count, since
    no frozen MHSA layer is left). With
    ``keep_mass < 1`` the rows term is a bound the values decide how far the run stays under (the host total
    1.3–4.5× the measured call at ``keep_mass=0.9``, 64–512 tokens; docs/attribution.md, *The sparse-rows paths*).
    With ``prune=`` the pruning term's kept graph and edge scores are bounds too, with or without a feature budget
    (every stored entry scored, the kept graph at most the full graph's blocks): reached to 0.29–0.90 when the pruning
    keeps everything it can, far above a run at the default thresholds (docs/attribution.md, *The pruned graph
    without a feature budget*). On sparse rows the run scores only the stored entries between the nodes the node
    threshold keeps (:func:`edge_scores_bytes` of them; a feature the ``keep_mass`` cut left without a path to a
    logit goes even at ``node_threshold=1``): 0.06 of the pruning term at ``keep_mass=0.9`` on the tiny test model
    (24 tokens), 1.06 of the edge scores at the entries it scored.

    The estimate is of the call ``attribute`` would make with the same settings (:func:`plan_call`, the one plan
    both make): with ``max_memory`` the batch it fits (:attr:`MemoryEstimate.batch_size`: the largest
    ``≤ batch_size`` whose estimate fits) and the rows placement that batch leaves room for; offloaded modules on a
    device: their rows counted where ``attribute`` keeps them (:func:`.offload.rows_placement`: with
    ``max_memory`` the blocks that fit what the batch leaves of it, without it the blocks that fit each device's
    free memory now over 1.1, above the all-host estimate; :attr:`MemoryEstimate.offload_rows` says which,
    ``offload_rows_kept_bytes`` their bytes). Without ``max_memory`` the free memory is read now: a later
    ``attribute`` reads it again and may place the rows otherwise.

    Args:
        replacement, prompt, batch_size, memory, prune, max_feature_nodes, dtype, zero_positions, targets: as
            :func:`.attribute.attribute` (``targets`` sets the number of logit rows).
        max_memory: as :func:`.attribute.attribute`: a budget in bytes (host memory for a CPU model, device memory
            otherwise); the estimate is the fitted batch's, within it. None: ``batch_size``.
        renamed: nothing: the old logit-target names are refused with their ``targets=`` spelling.

    Returns:
        :class:`MemoryEstimate` (bytes).

    Raises:
        LayerOutOfRangeError, ShapeError: bad layers or prompt (from the clean pass).
        ConfigMismatchError, ArgumentError: a bad setting (:class:`~.options.AttributionOptions`, the one
            check :func:`.attribute.attribute` makes too; ``max_memory`` not an int ≥ 1 or None); an old setting
            name (:func:`.options.refuse_renamed`).
        MemoryBudgetError: ``max_memory`` too small even for batch 1 (as ``attribute`` refuses it).

    Source: ours (memory model of this package's attribution engine; docs/attribution.md).
    """
    from ..envoy.replacement_model import check_replacement_model

    check_replacement_model(replacement, "estimate_memory")
    refuse_inside_trace("estimate_memory")
    refuse_renamed(renamed, "estimate_memory")
    options = AttributionOptions(batch_size=batch_size, memory=memory, prune=prune, max_feature_nodes=max_feature_nodes,
                                 dtype=dtype, zero_positions=zero_positions, targets=targets, max_memory=max_memory)
    layout, info = layout_for_estimate(replacement, prompt, options)
    root = hf_module(replacement.model)
    plan = plan_call(layout, lambda: info, next(root.parameters()).device, batch_size=options.batch_size,
                     max_feature_nodes=options.max_feature_nodes, max_memory=options.max_memory,
                     devices=lambda: layer_devices(root, replacement.adapter))
    return plan.call_estimate()
