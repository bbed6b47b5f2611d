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

from .._progress import show_progress
from ..envoy.nnsight_internals import hf_module
from ..errors import ArgumentError, ConfigMismatchError
from .budget import estimate_info, estimate_layout, largest_batch
from .cached import attribute_cached, check_cache, in_dtype
from .graph import Graph
from .layout import Layout
from .qk import qk_for_graph
from .replacement import FrozenReplacement, layer_modules, memory_modes
from .rows import RowScheduler, SparseRows, assemble, assemble_pruned, release_free_memory
from .scores import PruneConfig
from .trace import AttributionCache, Prepared, attribute_in_trace, clean_pass, prepare, refuse_inside_trace, tokenize

#: pair terms kept per traced Lorsa head (``attribute(..., qk_heads=)``; llamascopium's ``qk_topk`` default)
QK_TOP_PAIRS = 10
#: ``frozen_pass(prepared, scheduler, batch_size, make)`` → target values: fills the scheduler with edge rows
FrozenPass = Callable[[Prepared, RowScheduler, int, Callable[..., FrozenReplacement]], torch.Tensor]


def attribute(
    replacement: Any,
    prompt: Any,
    *,
    max_feature_nodes: int | None = None,
    batch_size: int = 64,
    logit_tokens: Any = None,
    desired_logit_prob: float = 0.95,
    max_n_logits: int = 10,
    memory: str = "auto",
    prune: PruneConfig | tuple[float, float] | None = None,
    dtype: torch.dtype | None = None,
    progress: bool | None = None,
    remote: Any = False,
    max_memory: int | None = None,
    zero_positions: int = 0,
    qk_heads: int = 0,
) -> Graph:
    """The attribution graph of ``prompt`` over the replacement model.

    Args:
        replacement: a :class:`~nnsight_lorsa.envoy.replacement_model.ReplacementModel`: the nnsight
            ``LanguageModel`` / ``TransformersModel`` of a supported family with its Lorsas (layers
            without one keep their MHSA with frozen patterns) and transcoders (per-layer, a layer
            without one contributing its MLP output as error nodes, or a cross-layer transcoder whose
            features write into every later MLP output). SAEs are not part of the graph.
        prompt: text (tokenized by the model's tokenizer) or ``(pos,)`` token ids — runs the nnsight
            engine (both passes inside ``model.trace``) — or an :class:`~.trace.AttributionCache` from
            :func:`cache_for_attribution` — runs the cached engine (no model forward; the model's
            norms, attention weights and unembedding are used). Same graph either way.
        max_feature_nodes: compute at most this many feature rows, chosen by influence on the
            logits as circuit-tracer (None: all; then every target's incoming edges sum to its value).
        batch_size: prompt copies per frozen pass = target rows per backward pass.
        logit_tokens: target token ids at the last position (default: top-p, ``desired_logit_prob``
            up to ``max_n_logits``, as circuit-tracer).
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
        row ``t`` sums to, with ``residual[t]``).

    Raises:
        ConfigMismatchError: a bad option (``batch_size < 1``, unknown ``memory``, a bad ``prune``, a
            ``zero_positions`` outside ``[0, pos)``),
            a logit token outside the vocabulary, ``remote`` with a cache, or a cache without the
            replacement layers' tensors.
        ShapeError: a prompt that is not one sequence, or cache tensors of the wrong shape.
        MemoryBudgetError: ``max_memory`` too small even for batch 1 (after the clean pass).
        ConfigMismatchError: ``qk_heads`` with a cache or ``remote``.
        ArgumentError: a wrongly typed argument, token ids that are not integers or outside the
            vocabulary (:func:`check_arguments`).
        MissingTokenizerError: a text prompt for a model loaded without a tokenizer.
        ConcurrentTraceError: another thread is tracing the model now.
        TraceOrderError: called inside a ``model.trace`` / ``generate`` body (:func:`refuse_inside_trace`).
        All before the frozen pass runs (bad layers are refused when the ``ReplacementModel`` is built).
    """
    check_arguments(replacement, max_feature_nodes=max_feature_nodes, batch_size=batch_size,
                    desired_logit_prob=desired_logit_prob, max_n_logits=max_n_logits, dtype=dtype, remote=remote)
    return build_graph(replacement, prompt, max_feature_nodes=max_feature_nodes, batch_size=batch_size,
                       logit_tokens=logit_tokens, desired_logit_prob=desired_logit_prob, max_n_logits=max_n_logits,
                       memory=memory, prune=prune, dtype=dtype, progress=progress, remote=remote,
                       max_memory=max_memory, zero_positions=zero_positions, qk_heads=qk_heads)


def _count(value: Any, name: str, none_ok: bool = False) -> None:
    if none_ok and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise ArgumentError(f"attribute({name}=...) must be an int{' or None' if none_ok else ''}, got {value!r}")
    if value < 1:
        raise ConfigMismatchError(f"attribute({name}=...) must be >= 1, got {value}")


def check_arguments(replacement: Any, *, max_feature_nodes: Any, batch_size: Any, desired_logit_prob: Any,
                    max_n_logits: Any, dtype: Any, remote: Any) -> None:
    """:func:`attribute`'s argument checks, before anything runs.

    Raises:
        ArgumentError: ``replacement`` not a :class:`ReplacementModel`; a count that is not an int
            (``batch_size``, ``max_n_logits``, ``max_feature_nodes`` unless None), ``desired_logit_prob``
            not a number; a non-floating ``dtype``; ``remote`` other than a bool or ``"local"``.
        ConfigMismatchError: a count below 1, ``desired_logit_prob`` outside ``(0, 1]``.
        ConcurrentTraceError: another thread is tracing the model now (nnsight traces are per-thread).
    """
    from ..envoy import ReplacementModel
    from ..envoy.nnsight_internals import check_one_thread

    refuse_inside_trace("attribute")
    if not isinstance(replacement, ReplacementModel):
        raise ArgumentError(f"attribute(replacement=...) must be a ReplacementModel(model, lorsas=..., "
                            f"transcoders=...), got a {type(replacement).__name__}")
    _count(batch_size, "batch_size")
    _count(max_n_logits, "max_n_logits")
    _count(max_feature_nodes, "max_feature_nodes", none_ok=True)
    if not isinstance(desired_logit_prob, (int, float)) or isinstance(desired_logit_prob, bool):
        raise ArgumentError(f"attribute(desired_logit_prob=...) must be a number, got {desired_logit_prob!r}")
    if not 0.0 < desired_logit_prob <= 1.0:
        raise ConfigMismatchError(f"attribute(desired_logit_prob=...) must be in (0, 1], got {desired_logit_prob!r}")
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise ArgumentError(f"attribute(dtype=...) must be a floating torch dtype or None, got {dtype!r}")
    if not (isinstance(remote, bool) or remote == "local"):
        raise ArgumentError(f"attribute(remote=...) must be True, False or 'local', got {remote!r}")
    check_one_thread(replacement.model, "attribute")


def build_graph(replacement: Any, prompt: Any, *, max_feature_nodes: int | None = None, batch_size: int = 64,
                logit_tokens: Any = None, desired_logit_prob: float = 0.95, max_n_logits: int = 10,
                memory: str | tuple[str, str] = "auto", prune: PruneConfig | tuple[float, float] | None = None,
                dtype: torch.dtype | None = None, progress: bool | None = None, remote: Any = False,
                frozen_pass: FrozenPass | None = None, engine: str | None = None,
                max_memory: int | None = None, zero_positions: int = 0, qk_heads: int = 0) -> Graph:
    """:func:`attribute` with the internals open: ``memory`` may also be a ``(patterns, node_vectors)``
    pair (:func:`.replacement.memory_modes`; the mixed combinations), and ``frozen_pass`` replaces
    the nnsight engine's frozen pass for a prompt (the PyTorch-hook reference of the tests), its graph
    meta naming ``engine``."""
    patterns, node_vectors = memory_modes(memory)
    if batch_size < 1:
        raise ConfigMismatchError(f"batch_size must be >= 1, got {batch_size}")
    config = PruneConfig.of(prune)
    cached = isinstance(prompt, AttributionCache)
    if cached and remote:
        raise ConfigMismatchError("remote runs a prompt's traces on the server; a cache is attributed here")
    if qk_heads and (cached or remote):
        raise ConfigMismatchError("qk_heads traces a prompt locally: not with a cache or remote")
    model, adapter = replacement.model, replacement.adapter
    root = hf_module(model)
    model_dtype = next(root.parameters()).dtype
    options = {"logit_tokens": logit_tokens, "desired_logit_prob": desired_logit_prob, "max_n_logits": max_n_logits,
               "dtype": dtype, "zero_positions": zero_positions}
    make = functools.partial(FrozenReplacement, patterns=patterns, node_vectors=node_vectors, dtype=dtype)
    run: Callable[[RowScheduler], torch.Tensor]
    if cached:
        check_cache(prompt, adapter, *layer_modules(replacement))
        cache = in_dtype(prompt, dtype) if dtype is not None and dtype != model_dtype else prompt
        prepared = prepare(replacement, None, cache=cache, **options)
        engine = "cache"

        def run(scheduler: RowScheduler) -> torch.Tensor:
            return attribute_cached(root, prepared, cache, scheduler, batch_size, make, dtype)
    else:
        prepared = prepare(replacement, prompt, remote=remote, **options)
        trace_pass = frozen_pass

        def run(scheduler: RowScheduler) -> torch.Tensor:
            if trace_pass is not None:
                return trace_pass(prepared, scheduler, batch_size, make)
            return attribute_in_trace(model, prepared.adapter, prepared.layout, prepared.mhsa, scheduler, batch_size,
                                      make=make, remote=remote)
    if max_memory is not None:
        info = estimate_info(replacement, prepared, patterns, node_vectors, config is not None, dtype,
                             config.keep_mass if config is not None else 1.0)
        est = estimate_layout(prepared.layout, batch_size=batch_size, max_feature_nodes=max_feature_nodes, **info)
        batch_size = largest_batch(est, max_memory, batch_size, info["device"])
    meta = {"model_type": adapter.config.model_type, "lorsa_layers": sorted(prepared.lorsas),
            "transcoder_layers": sorted(prepared.transcoders), "batch_size": batch_size,
            "max_feature_nodes": max_feature_nodes, "engine": engine or "nnsight",
            "memory": memory if isinstance(memory, str) else "custom", "patterns": patterns,
            "node_vectors": node_vectors, "dtype": str(dtype or model_dtype), "zero_positions": zero_positions}
    graph = compute_graph(prepared.layout, run, max_feature_nodes=max_feature_nodes,
                          progress=show_progress(progress) and not remote, prune=config,
                          prompt=prompt if isinstance(prompt, str) else "", meta=meta)
    if qk_heads:
        graph.qk = qk_for_graph(replacement, prepared, graph, qk_heads, QK_TOP_PAIRS, batch_size)
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
        return assemble_pruned(layout, scheduler, values, node_threshold=prune.node_threshold,
                               edge_threshold=prune.edge_threshold, prompt=prompt, meta=meta)
    return assemble(layout, scheduler, values, prompt, meta)
