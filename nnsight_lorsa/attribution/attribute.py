"""The front door: ``attribute(replacement, prompt)`` → :class:`.graph.Graph`.

The replacement model (Ameisen et al. 2025, *Circuit Tracing*: frozen-Jacobian attribution with error nodes;
docs/attribution.md): transcoders for MLPs (a layer without one
contributes its whole MLP output as error nodes), Lorsa for attention (a layer without one keeps
its MHSA with frozen patterns), frozen norms. The engine follows from the input: a prompt (text or
token ids) runs two nnsight traces — a clean pass (which features and heads are active), then the
frozen pass with batched backward (:mod:`.trace`); an :class:`~.trace.AttributionCache` (from
:func:`cache_for_attribution`) runs the frozen model as plain tensor code, without a model forward
(:mod:`.cached`). Same arithmetic, same graph.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import Any

import torch
from tqdm.auto import tqdm

from .._memory import release_free_memory
from .._progress import show_progress
from ..envoy.nnsight_internals import hf_module
from ..errors import ArgumentError, ConfigMismatchError
from .budget import estimate_info, estimate_layout, largest_batch
from .cached import attribute_cached, check_cache, in_dtype
from .graph import Graph
from .intervened import IntervenedAttribution, start
from .layout import Layout, LiveNodes
from .logit_targets import Targets
from .options import AttributionOptions, refuse_renamed
from .qk import qk_for_graph
from .replacement import FrozenReplacement, layer_modules
from .rows import RowScheduler, SparseRows, assemble, assemble_pruned
from .scores import PruneConfig
from .trace import AttributionCache, Prepared, attribute_in_trace, clean_pass, prepare, refuse_inside_trace, tokenize

#: pair terms kept per traced Lorsa head (``attribute(..., qk_heads=)``; llamascopium's ``qk_topk`` default)
QK_TOP_PAIRS = 10
#: ``frozen_pass(prepared, scheduler, batch_size, make)`` → target values: fills the scheduler with edge rows
FrozenPass = Callable[[Prepared, RowScheduler, int, Callable[..., FrozenReplacement]], torch.Tensor]


def attribute(
    replacement: Any,
    prompt: Any = None,
    *,
    tracer: Any = None,
    max_feature_nodes: int | None = None,
    batch_size: int = 64,
    targets: Targets = None,
    memory: str = "auto",
    prune: PruneConfig | tuple[float, float] | None = None,
    dtype: torch.dtype | None = None,
    progress: bool | None = None,
    remote: Any = False,
    max_memory: int | None = None,
    zero_positions: int = 0,
    qk_heads: int = 0,
    **renamed: Any,
) -> Graph | IntervenedAttribution:
    """The attribution graph of ``prompt`` over the replacement model — or, with ``tracer`` inside a trace
    body, a handle whose ``.graph`` is the graph of that trace's own (intervened) forward pass.

    Args:
        replacement: a :class:`~nnsight_lorsa.envoy.replacement_model.ReplacementModel`: the nnsight
            ``LanguageModel`` / ``TransformersModel`` of a supported family with its Lorsas (layers
            without one keep their MHSA with frozen patterns) and transcoders (per-layer, a layer
            without one contributing its MLP output as error nodes, or a cross-layer transcoder whose
            features write into every later MLP output). SAEs are not part of the graph.
        prompt: text (tokenized by the model's tokenizer) or ``(pos,)`` token ids — runs the nnsight
            engine (both passes inside ``model.trace``) — or an :class:`~.trace.AttributionCache` from
            :func:`cache_for_attribution` — runs the cached engine (no model forward; the model's
            norms, attention weights and unembedding are used). Same graph either way. None with ``tracer``.
        tracer: the tracer of the running ``with model.trace(prompt) as tracer:`` (no ``prompt``): call
            ``handle = attribute(rm, tracer=tracer)`` at the top of the body (after ``rm.replace()``), intervene
            with :mod:`nnsight_lorsa.patching`, and read ``handle.graph`` after the block: the graph of the
            pass as it ran, edited nodes held at their edited values as fixed inputs and marked
            (:class:`~.intervened.IntervenedAttribution`; docs/attribution.md, "Attributing an intervened
            pass"). Takes the options below except ``remote`` and ``qk_heads``.
        renamed: nothing: the old ``logit_tokens=``, ``desired_logit_prob=`` and ``max_n_logits=`` are refused
            with their ``targets=`` spelling (:func:`.options.refuse_renamed`).
        max_feature_nodes: compute at most this many feature rows, chosen by influence on the
            logits as circuit-tracer (None: all; then every target's incoming edges sum to its value).
        batch_size: prompt copies per frozen pass = target rows per backward pass.
        targets: the logits at the last position the graph is attributed from, in one value
            (:mod:`.logit_targets`; circuit-tracer's ``attribution_targets``): None (default) — the most likely
            tokens until their cumulative probability reaches 0.95, at most 10 (circuit-tracer's defaults);
            ``LogitTargets(max_n=..., cumulative_prob=...)`` — that policy with other bounds; token ids
            (a sequence, or an integer tensor / numpy array of at most one dimension) or token strings (each
            one token of the model's tokenizer) — those tokens, in that order.
        memory: how the frozen model keeps its per-prompt constants. ``"fast"``: attention patterns
            stored (``n_heads·pos²`` per MHSA layer, ``n·pos`` pattern rows per Lorsa layer) and the
            active nodes' decoder rows / ``w_o`` / encoder columns copied onto per-position grids
            (``n·d_model`` per site). ``"lean"``: for long prompts — attention by SDPA from stored
            queries/keys (Lorsa targets' pattern rows recomputed in chunks in every pass) and node
            vectors gathered from the weights chunk by chunk (nothing kept per node); slower on CPU.
            ``"auto"`` (default): stored patterns on CPU, SDPA on GPU; grids while a site's copy is
            ≤ 256 MiB (:data:`.frozen.GRID_BUDGET_BYTES`). Same graph up to rounding.
        prune: return the influence-pruned graph, built from sparse rows without a dense
            ``n_nodes²`` adjacency (for long prompts): a :class:`~.scores.PruneConfig`
            ``(node_threshold, edge_threshold, keep_mass)`` or a ``(node_threshold, edge_threshold)``
            pair (``keep_mass=1``). Each target's edges from pruned nodes and dropped entries go into
            ``graph.residual``. None (default): the full graph; prune later with :func:`.scores.prune`.
        dtype: the frozen model's compute dtype (default the model's). ``torch.float32`` for a
            bf16/fp16 model makes the edge sums exact to fp32 rounding instead of ~1 % (fp32 copies of
            the Lorsas, transcoders and MHSA weights; the model's modules still run in their dtype on
            one prompt copy for the frozen constants).
        progress: show a tqdm bar over target rows; None (default): when stderr is a terminal.
        remote: for a prompt, passed to both ``model.trace`` calls (``True``: run on NDIF after
            :func:`nnsight_lorsa.remote.register`; ``"local"``: nnsight's serializing simulation).
            The replacement modules travel by value; the edge rows come back as saved values.
        max_memory: a budget in bytes (host memory for a CPU model, device memory otherwise): the batch
            is the largest ``≤ batch_size`` that :func:`.budget.estimate_memory`'s model fits in it
            (after the clean pass; ``graph.meta["batch_size"]`` says which). None: ``batch_size``.
        zero_positions: the first this many positions get no feature or Lorsa-head nodes; their
            transcoder / Lorsa outputs are carried by those positions' error nodes, so sums stay exact.
            Default 0: every position has its features (BOS included). ``1`` matches circuit-tracer's
            graphs node for node (it zeroes the features at position 0, the BOS token; its error
            nodes there carry nothing, ours the position's whole MLP / attention output).
        qk_heads: QK tracing of the graph's this many most influential Lorsa heads (distinct QK head
            and query; each at the key it attends to most), batched in one more frozen pass: their
            attention scores decomposed into (query-side node, key-side node) pairs, stored in
            ``graph.qk`` (:func:`.qk.qk_for_graph`: top 10 pairs, both marginals, and each score's
            ``|Σ pairs − score| / Σ |pairs|``), saved with the graph and exported. A prompt only.

    Returns:
        :class:`Graph` (``adjacency[t, s]``: direct effect of ``s`` on ``t``; ``values[t]``: what
        row ``t`` sums to, with ``residual[t]``); with ``tracer``, an
        :class:`~.intervened.IntervenedAttribution` (its ``.graph`` such a graph, after the trace).

    Raises:
        ConfigMismatchError: a bad option (``batch_size < 1``, unknown ``memory``, a bad ``prune``, a
            ``zero_positions`` outside ``[0, pos)``, empty ``targets``),
            a logit target outside the vocabulary or a target string that is not one token, ``remote``
            with a cache, or a cache without the replacement layers' tensors.
        ShapeError: a prompt that is not one sequence, or cache tensors of the wrong shape.
        MemoryBudgetError: ``max_memory`` too small even for batch 1 (after the clean pass).
        ConfigMismatchError: ``qk_heads`` with a cache or ``remote``.
        ArgumentError: a wrongly typed argument, token ids that are not integers or outside the
            vocabulary (:class:`~.options.AttributionOptions`, :func:`check_replacement`); an old setting
            name (``logit_tokens``, ``desired_logit_prob``, ``max_n_logits``: the message says the ``targets=``).
        MissingTokenizerError: a text prompt or target strings for a model loaded without a tokenizer.
        ConcurrentTraceError: another thread is tracing the model now.
        TraceOrderError: called with a prompt inside a ``model.trace`` / ``generate`` body
            (:func:`refuse_inside_trace`: the message names ``tracer=``); with ``tracer``, outside a trace
            body or after the body read something (:func:`.intervened.start`).
        ArgumentError: neither ``prompt`` nor ``tracer``, or both.
        ConfigMismatchError: ``tracer`` with ``remote`` or ``qk_heads``.
        All before the frozen pass runs (bad layers are refused when the ``ReplacementModel`` is built).
    """
    refuse_renamed(renamed, "attribute")
    options = AttributionOptions(
        max_feature_nodes=max_feature_nodes, batch_size=batch_size, targets=targets, memory=memory, prune=prune,
        dtype=dtype, progress=progress, remote=remote, max_memory=max_memory, zero_positions=zero_positions,
        qk_heads=qk_heads)
    if tracer is not None:
        if prompt is not None:
            raise ArgumentError("attribute(rm, prompt) attributes a clean pass, attribute(rm, tracer=tracer) the "
                                "traced one: pass one of them, not both")
        if remote or qk_heads:
            raise ConfigMismatchError("attribute(rm, tracer=tracer) attributes a local trace: no remote=, no qk_heads=")
        check_replacement(replacement, in_trace=True)
        return start(replacement, tracer, options, build_graph)
    if prompt is None:
        raise ArgumentError("attribute(rm, prompt) needs a prompt (text, token ids or an AttributionCache), "
                            "or tracer= inside a trace body")
    check_replacement(replacement)
    return build_graph(replacement, prompt, options=options)


def check_replacement(replacement: Any, *, in_trace: bool = False) -> None:
    """:func:`attribute`'s checks of the call (its settings: :class:`~.options.AttributionOptions`), before
    anything runs (``in_trace``: for ``tracer=``, inside the trace body: no refusal of the running trace).

    Raises:
        TraceOrderError: (not ``in_trace``) called inside a trace body (:func:`.trace.refuse_inside_trace`).
        ArgumentError: ``replacement`` not a :class:`ReplacementModel`.
        ConcurrentTraceError: another thread is tracing the model now (nnsight traces are per-thread).
    """
    from ..envoy import ReplacementModel
    from ..envoy.nnsight_internals import check_one_thread

    if not in_trace:
        refuse_inside_trace("attribute")
    if not isinstance(replacement, ReplacementModel):
        raise ArgumentError(f"attribute(replacement=...) must be a ReplacementModel(model, lorsas=..., "
                            f"transcoders=...), got a {type(replacement).__name__}")
    if not in_trace:  # inside its own trace the model's interleaver is this thread's
        check_one_thread(replacement.model, "attribute")


def build_graph(replacement: Any, prompt: Any, *, options: AttributionOptions | None = None,
                frozen_pass: FrozenPass | None = None, engine: str | None = None, live: LiveNodes | None = None,
                **settings: Any) -> Graph:
    """:func:`attribute` with the internals open. Its settings come as ``options`` (an
    :class:`~.options.AttributionOptions`, as :func:`attribute` passes them) or as :func:`attribute`'s
    keyword arguments (``settings``, funnelled into one), not both; ``memory`` may also be a
    ``(patterns, node_vectors)`` pair (:func:`.replacement.memory_modes`; the mixed combinations).
    ``frozen_pass`` replaces the nnsight engine's frozen pass for a prompt (the PyTorch-hook reference of the
    tests), its graph meta naming ``engine``. ``live`` (with a cache of a traced pass): that pass's node values
    and edited nodes (:class:`~.layout.LiveNodes`; :mod:`.intervened`).

    Raises:
        ArgumentError: both ``options`` and ``settings``; as :class:`~.options.AttributionOptions` and
            :func:`attribute` otherwise.
    """
    if options is not None and settings:
        raise ArgumentError(f"build_graph takes options= or the settings {sorted(settings)} as keywords, not both")
    o = options if options is not None else AttributionOptions.of(settings)
    patterns, node_vectors = o.modes
    batch_size, dtype, remote, config = o.batch_size, o.dtype, o.remote, o.prune
    cached = isinstance(prompt, AttributionCache)
    if cached and remote:
        raise ConfigMismatchError("remote runs a prompt's traces on the server; a cache is attributed here")
    if o.qk_heads and (cached or remote):
        raise ConfigMismatchError("qk_heads traces a prompt locally: not with a cache or remote")
    model, adapter = replacement.model, replacement.adapter
    root = hf_module(model)
    model_dtype = next(root.parameters()).dtype
    layout_options: dict[str, Any] = {"targets": o.targets, "dtype": dtype, "zero_positions": o.zero_positions}
    make = functools.partial(FrozenReplacement, patterns=patterns, node_vectors=node_vectors, dtype=dtype)
    run: Callable[[RowScheduler], torch.Tensor]
    if cached:
        check_cache(prompt, adapter, *layer_modules(replacement))
        cache = in_dtype(prompt, dtype) if dtype is not None and dtype != model_dtype else prompt
        prepared = prepare(replacement, None, cache=cache, live=live, **layout_options)
        engine = "cache"

        def run(scheduler: RowScheduler) -> torch.Tensor:
            return attribute_cached(root, prepared, cache, scheduler, batch_size, make, dtype)
    else:
        prepared = prepare(replacement, prompt, remote=remote, **layout_options)
        trace_pass = frozen_pass

        def run(scheduler: RowScheduler) -> torch.Tensor:
            if trace_pass is not None:
                return trace_pass(prepared, scheduler, batch_size, make)
            return attribute_in_trace(model, prepared.adapter, prepared.layout, prepared.mhsa, scheduler, batch_size,
                                      make=make, remote=remote)
    if o.max_memory is not None:
        info = estimate_info(replacement, prepared, patterns, node_vectors, config is not None, dtype,
                             config.keep_mass if config is not None else 1.0)
        est = estimate_layout(prepared.layout, batch_size=batch_size, max_feature_nodes=o.max_feature_nodes, **info)
        batch_size = largest_batch(est, o.max_memory, batch_size, info["device"])
    meta = {"model_type": adapter.config.model_type, "lorsa_layers": sorted(prepared.lorsas),
            "transcoder_layers": sorted(prepared.transcoders), "batch_size": batch_size,
            "max_feature_nodes": o.max_feature_nodes, "engine": engine or "nnsight",
            "memory": o.memory if isinstance(o.memory, str) else "custom", "patterns": patterns,
            "node_vectors": node_vectors, "dtype": str(dtype or model_dtype), "zero_positions": o.zero_positions}
    graph = compute_graph(prepared.layout, run, max_feature_nodes=o.max_feature_nodes,
                          progress=show_progress(o.progress) and not remote, prune=config,
                          prompt=prompt if isinstance(prompt, str) else "", meta=meta)
    if o.qk_heads:
        graph.qk = qk_for_graph(replacement, prepared, graph, o.qk_heads, QK_TOP_PAIRS, batch_size)
    return graph


@torch.no_grad()
def cache_for_attribution(replacement: Any, prompt: Any, *, remote: Any = False) -> AttributionCache:
    """One clean ``model.trace`` of ``prompt`` (text or ``(pos,)`` ids) saving, in full, everything
    the frozen replacement model takes from it (:class:`~.trace.AttributionCache`: the embeddings,
    positions, the replaced modules' inputs and outputs, the last logits), for
    ``attribute(replacement, cache)`` without a model forward — later, elsewhere, or from a remote
    trace (``remote`` as in :func:`attribute`).

    Raises:
        LayerOutOfRangeError, ShapeError: bad layers or prompt.
    """
    model, adapter = replacement.model, replacement.adapter
    lor, tcs = layer_modules(replacement)
    for layer in [*lor, *tcs]:
        adapter.check_layer(layer)
    return clean_pass(model, adapter, tokenize(model, prompt), list(lor), list(tcs), remote=remote, full=True)


def compute_graph(layout: Layout, run: Callable[[RowScheduler], torch.Tensor], *, max_feature_nodes: int | None,
                  progress: bool, prune: PruneConfig | None, prompt: str, meta: dict[str, Any]) -> Graph:
    """Schedule the target rows, let ``run`` compute them (returning the target values), and
    assemble the dense or pruned :class:`Graph`."""
    bar = tqdm(total=layout.n_logits + min(max_feature_nodes or layout.n_features, layout.n_features),
               desc="attribution rows", disable=not progress)
    scheduler = RowScheduler(layout, max_feature_nodes, bar if progress else None,
                             keep_mass=None if prune is None else prune.keep_mass)
    try:
        values = run(scheduler)
    finally:
        bar.close()
    if prune is not None or isinstance(scheduler.rows, SparseRows):  # pruning allocates: first the frozen
        gc.collect()  # pass's graph (reference cycles through the trace) and its heap pages go
        release_free_memory()
    if prune is not None:
        graph = assemble_pruned(layout, scheduler, values, node_threshold=prune.node_threshold,
                                edge_threshold=prune.edge_threshold, prompt=prompt, meta=meta)
    else:
        graph = assemble(layout, scheduler, values, prompt, meta)
    fixed = graph.nodes.intervened  # held at an edited value: sources only (their rows were computed as zeros)
    if bool(fixed.any()):
        graph.feature_rows[fixed] = False
        graph.values[fixed] = float("nan")
    return graph
