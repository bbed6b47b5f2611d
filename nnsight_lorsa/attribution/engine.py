"""The attribution engine behind :func:`.attribute.attribute`: ``build_graph(replacement, prompt)`` →
:class:`.graph.Graph`.

The replacement model (Ameisen et al. 2025, *Circuit Tracing*: frozen-Jacobian attribution with error nodes;
docs/attribution.md): transcoders for MLPs (a layer without one
contributes its whole MLP output as error nodes), Lorsa for attention (a layer without one keeps
its MHSA with frozen patterns), frozen norms. The engine follows from the input: a prompt (text or
token ids) runs two nnsight traces — a clean pass (which features and heads are active), then the
frozen pass with batched backward (:mod:`.trace`); an :class:`~.trace.AttributionCache` (from
:func:`cache_for_attribution`) runs the frozen model as plain tensor code, without a model forward
(:mod:`.cached`). Same arithmetic, same graph. The front door, :func:`.attribute.attribute`, reaches this
module only on the client (it travels by value inside remote requests; this module, whose imports NDIF's
unpickling whitelist refuses, never does).
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import Any

import torch
from tqdm.auto import tqdm

from .._checks import check_remote
from .._memory import release_free_memory
from .._progress import show_progress
from ..envoy.nnsight_internals import hf_module
from ..errors import ArgumentError, ConfigMismatchError
from .budget import estimate_info, layer_devices, plan_call
from .cached import attribute_cached, check_cache, in_dtype
from .graph import Graph
from .layout import Layout, LiveNodes
from .offload import rows_label
from .options import AttributionOptions
from .qk import qk_for_graph
from .replacement import FrozenReplacement, check_placement, layer_modules, transcoder_sites
from .rows import RowScheduler, SparseRows, assemble, assemble_pruned
from .scores import PruneConfig
from .trace import AttributionCache, Prepared, attribute_in_trace, clean_pass, prepare, refuse_inside_trace, tokenize

#: pair terms kept per traced Lorsa head (``attribute(..., qk_heads=)``; llamascopium's ``qk_topk`` default)
QK_TOP_PAIRS = 10
#: ``frozen_pass(prepared, scheduler, batch_size, make)`` → target values: fills the scheduler with edge rows
FrozenPass = Callable[[Prepared, RowScheduler, int, Callable[..., FrozenReplacement]], torch.Tensor]


def attribute_prompt(replacement: Any, prompt: Any, settings: dict[str, Any]) -> Graph:
    """:func:`.attribute.attribute` of a prompt or a cache (no ``tracer``): its checks, then :func:`build_graph`.
    ``settings``: the call's keyword arguments but ``tracer`` (the options, and any other name, refused).

    Raises:
        as :func:`.attribute.attribute` for a prompt.
    """
    options = AttributionOptions.of(settings, "attribute")
    if prompt is None:
        raise ArgumentError("attribute(rm, prompt) needs a prompt (text, token ids or an AttributionCache), "
                            "or tracer= inside a trace body")
    check_replacement(replacement)
    return build_graph(replacement, prompt, options=options)


def check_replacement(replacement: Any, *, in_trace: bool = False) -> None:
    """:func:`.attribute.attribute`'s checks of the call (its settings: :class:`~.options.AttributionOptions`), before
    anything runs (``in_trace``: for ``tracer=``, inside the trace body: no refusal of the running trace).

    Raises:
        TraceOrderError: (not ``in_trace``) called inside a trace body (:func:`.trace.refuse_inside_trace`).
        ArgumentError: ``replacement`` not a :class:`ReplacementModel`.
        ConcurrentTraceError: another thread is tracing the model now (nnsight traces are per-thread).
        ArgumentError: (not ``in_trace``) the model carries edits stored on it by ``model.edit()`` (nnsight replays
            them in every trace, the engine's passes included): the graph would be of neither the edited nor the
            unedited model; ``tracer=`` inside a trace of it attributes the edited pass.
    """
    from ..envoy.nnsight_internals import check_one_thread, stored_edits
    from ..envoy.replacement_model import check_replacement_model

    if not in_trace:
        refuse_inside_trace("attribute")
    check_replacement_model(replacement, "attribute")
    if not in_trace:  # inside its own trace the model's interleaver is this thread's
        check_one_thread(replacement.model, "attribute")
    if not in_trace and stored_edits(replacement.model):
        # nnsight replays them in every trace of the model, the engine's passes included (seen: a graph with the
        # unedited model's nodes whose edges differ from its graph's, and from the edited pass's graph)
        raise ArgumentError(
            f"attribute(rm, prompt): the model carries {stored_edits(replacement.model)} edit block(s) stored on it by "
            "model.edit(), which nnsight replays in every trace of it; the prompt engine's passes would mix the "
            "edited and the unedited model. Attribute the "
            "edited pass inside a trace of it — `with model.trace(prompt) as tracer: handle = attribute(rm, "
            "tracer=tracer)` (the stored edits run there like edits in the body) — or call model.clear_edits() first")


def narrowest(model_dtype: torch.dtype, *modules: dict[int, Any]) -> torch.dtype:
    """The least precise dtype (largest ``finfo.eps``) among ``model_dtype`` and the floating parameters of the
    replacement modules ``{layer: module}``: what a graph without ``dtype=`` is computed in, each module computing
    in its own dtype (the placement contract), its sums exact to that dtype's rounding (``Graph.meta["dtype"]``)."""
    dtypes = {p.dtype for group in modules for m in group.values() for p in m.parameters() if p.is_floating_point()}
    dtypes |= {model_dtype} if model_dtype.is_floating_point else set()
    return max(dtypes, key=lambda d: (torch.finfo(d).eps, str(d))) if dtypes else model_dtype


def build_graph(replacement: Any, prompt: Any, *, options: AttributionOptions | None = None,
                frozen_pass: FrozenPass | None = None, engine: str | None = None, live: LiveNodes | None = None,
                **settings: Any) -> Graph:
    """:func:`.attribute.attribute` with the internals open. Its settings come as ``options`` (an
    :class:`~.options.AttributionOptions`, as :func:`.attribute.attribute` passes them) or as
    :func:`.attribute.attribute`'s keyword arguments (``settings``, funnelled into one), not both; ``memory``
    may also be a ``(patterns, node_vectors)`` pair (:func:`.replacement.memory_modes`; the mixed combinations).
    ``frozen_pass`` replaces the nnsight engine's frozen pass for a prompt (the PyTorch-hook reference of the
    tests), its graph meta naming ``engine``. ``live`` (with a cache of a traced pass): that pass's node values
    and edited nodes (:class:`~.layout.LiveNodes`; :mod:`.intervened`).

    Raises:
        ArgumentError: both ``options`` and ``settings``; as :class:`~.options.AttributionOptions` and
            :func:`.attribute.attribute` otherwise.
    """
    if options is not None and settings:
        raise ArgumentError(f"build_graph takes options= or the settings {sorted(settings)} as keywords, not both")
    o = options if options is not None else AttributionOptions.of(settings)
    patterns, node_vectors = o.modes
    batch_size, dtype, remote, config = o.batch_size, o.dtype, o.remote, o.prune
    cached = isinstance(prompt, AttributionCache)
    if cached and remote:
        raise ConfigMismatchError("remote runs a prompt's clean pass on the server; a cache is attributed here")
    if o.qk_heads and (cached or remote):
        raise ConfigMismatchError("qk_heads traces a prompt locally: not with a cache or remote")
    text = prompt if isinstance(prompt, str) else ""
    if remote:
        # the clean pass on the server, saving what the frozen model takes from it; the frozen pass and its backward
        # passes here, from that cache (the engine stays on the client: its modules are outside NDIF's unpickling
        # whitelist), so the model's weights must be here: refused before the request is sent. Until 2026-11-29 the
        # frozen pass ran here as a second trace of the client's own model, though the docs said both traces ran
        # on the server.
        check_placement(hf_module(replacement.model), *layer_modules(replacement))
        prompt, cached = cache_for_attribution(replacement, prompt, remote=remote), True
    model, adapter = replacement.model, replacement.adapter
    root = hf_module(model)
    model_dtype = next(root.parameters()).dtype
    computed_in = dtype or narrowest(model_dtype, *layer_modules(replacement))
    layout_options: dict[str, Any] = {"targets": o.targets, "dtype": dtype, "zero_positions": o.zero_positions}
    make: Callable[..., FrozenReplacement]  # set below, once the offloaded rows' place is decided
    run: Callable[[RowScheduler], torch.Tensor]
    if cached:
        check_cache(prompt, adapter, *layer_modules(replacement))
        # the cache in the dtype the frozen model computes in (a cache kept from before the model was cast too)
        target = dtype or model_dtype
        cache = in_dtype(prompt, target) if target.is_floating_point and prompt.embeddings.dtype != target else prompt
        prepared = prepare(replacement, None, cache=cache, live=live, **layout_options)
        engine = "cache"

        def run(scheduler: RowScheduler) -> torch.Tensor:
            return attribute_cached(root, prepared, cache, scheduler, batch_size, make, dtype)
    else:
        prepared = prepare(replacement, prompt, **layout_options)
        trace_pass = frozen_pass

        def run(scheduler: RowScheduler) -> torch.Tensor:
            if trace_pass is not None:
                return trace_pass(prepared, scheduler, batch_size, make)
            return attribute_in_trace(model, prepared.adapter, prepared.layout, prepared.mhsa, scheduler, batch_size,
                                      make=make, dtype=dtype)
    # offloaded modules: their active rows kept on the device when they fit (offload.rows_placement); max_memory:
    # the largest batch that fits it
    info = functools.cache(lambda: estimate_info(replacement, prepared, patterns, node_vectors, config is not None,
                                                 dtype, config.keep_mass if config is not None else 1.0))
    plan = plan_call(prepared.layout, info, next(root.parameters()).device, batch_size=batch_size,
                     max_feature_nodes=o.max_feature_nodes, max_memory=o.max_memory,
                     devices=lambda: layer_devices(root, adapter))
    batch_size, offload_rows = plan.batch, plan.rows
    # (the keyword only where rows are kept)
    kept: dict[str, Any] = {} if offload_rows in (None, "host") else {"offload_rows": offload_rows}
    make = functools.partial(FrozenReplacement, patterns=patterns, node_vectors=node_vectors, dtype=dtype, **kept)
    meta = {"model_type": adapter.config.model_type, "lorsa_layers": sorted(prepared.lorsas),
            "transcoder_layers": sorted(prepared.transcoders), "batch_size": batch_size,
            "max_feature_nodes": o.max_feature_nodes,
            "update_interval": o.update_interval, "engine": engine or "nnsight",
            "memory": o.memory if isinstance(o.memory, str) else "custom", "patterns": patterns,
            "node_vectors": node_vectors, "dtype": str(computed_in),
            "dtype_option": None if dtype is None else str(dtype), "zero_positions": o.zero_positions,
            "offload_rows": rows_label(offload_rows), "offload_rows_kept_bytes": plan.kept_bytes}
    graph = compute_graph(prepared.layout, run, max_feature_nodes=o.max_feature_nodes,
                          update_interval=o.update_interval, zero_positions=o.zero_positions,
                          progress=show_progress(o.progress), prune=config,
                          prompt=text, meta=meta,
                          ranking_mirror=plan.ranking_mirror)
    if o.qk_heads:
        graph.qk = qk_for_graph(replacement, prepared, graph, o.qk_heads, QK_TOP_PAIRS, batch_size, dtype,
                                offload_rows or "host")
    return graph


@torch.no_grad()
def cache_for_attribution(replacement: Any, prompt: Any, *, remote: Any = False) -> AttributionCache:
    """One clean ``model.trace`` of ``prompt`` (text or ``(pos,)`` ids) saving, in full, everything
    the frozen replacement model takes from it (:class:`~.trace.AttributionCache`: the embeddings,
    positions, the replaced modules' inputs and outputs, the last logits), for
    ``attribute(replacement, cache)`` without a model forward — later, elsewhere, or from a remote
    trace (``remote`` as in :func:`.attribute.attribute`).

    Raises:
        LayerOutOfRangeError, ShapeError: bad layers or prompt. ArgumentError: ``remote`` not True, False or
            ``"local"``.

    Source: Ameisen et al. 2025, *Circuit Tracing*; circuit-tracer ``circuit_tracer/attribution/attribute.py``.
    """
    from ..envoy.replacement_model import check_replacement_model

    check_replacement_model(replacement, "cache_for_attribution")
    check_remote(remote, "cache_for_attribution")
    model, adapter = replacement.model, replacement.adapter
    lor, tcs = layer_modules(replacement)
    for layer in [*lor, *tcs]:
        adapter.check_layer(layer)
    return clean_pass(model, adapter, tokenize(model, prompt), list(lor), list(tcs), remote=remote, full=True,
                      tc_sites=transcoder_sites(replacement, tcs))


def compute_graph(layout: Layout, run: Callable[[RowScheduler], torch.Tensor], *, max_feature_nodes: int | None,
                  update_interval: int = 4, zero_positions: int = 0, progress: bool, prune: PruneConfig | None,
                  prompt: str, meta: dict[str, Any], ranking_mirror: int = 0) -> Graph:
    """Schedule the target rows, let ``run`` compute them (returning the target values), and
    assemble the dense or pruned :class:`Graph`. ``ranking_mirror``: device bytes the stored rows may keep a copy in
    for the ranking (:class:`.rows.SparseRows`' ``mirror_bytes``; what was kept: ``meta["ranking_mirror_bytes"]``),
    freed when the graph is assembled, or when the call fails (its traceback keeps this frame)."""
    bar = tqdm(total=layout.n_logits + min(max_feature_nodes or layout.n_features, layout.n_features),
               desc="attribution rows", disable=not progress)
    scheduler = RowScheduler(layout, max_feature_nodes, bar if progress else None,
                             keep_mass=None if prune is None else prune.keep_mass, update_interval=update_interval,
                             zero_positions=zero_positions, mirror_bytes=ranking_mirror)
    try:
        try:
            values = run(scheduler)
        finally:
            bar.close()
        stored = scheduler.rows if isinstance(scheduler.rows, SparseRows) else None
        meta["ranking_mirror_bytes"] = 0 if stored is None else stored.mirrored_bytes
        return _assembled(layout, scheduler, values, prune, prompt, meta)
    finally:
        # the device copies go with the call (pruning's influence read them), also with a call that failed: its
        # traceback (``except ... as e``, a notebook's ``sys.last_traceback``) holds this frame and the store
        if isinstance(scheduler.rows, SparseRows):
            scheduler.rows.drop_mirror()


def _assembled(layout: Layout, scheduler: RowScheduler, values: torch.Tensor, prune: PruneConfig | None, prompt: str,
               meta: dict[str, Any]) -> Graph:
    """:func:`compute_graph`'s assembly of the computed rows: the pruned or the full :class:`Graph`."""
    if prune is not None or isinstance(scheduler.rows, SparseRows):  # pruning allocates: first the frozen pass's
        # leftovers and their heap pages go. Its autograd graph is freed already (refcounts: the backward tracers'
        # cycles hold no graph, trace.nnsight_backward); the young generations hold the tracers' last cycles
        # (a full collection walks every object of the process: 0.2-0.3 s with transformers imported)
        gc.collect(1)
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
