"""The front door: ``attribute(replacement, prompt)`` → :class:`.graph.Graph`, and ``attribute(replacement,
tracer=tracer)`` inside a trace body → :class:`~.intervened.IntervenedAttribution` (the graph of that pass).

One entry point for a clean prompt, a cache and a traced (intervened) pass, local or remote. A function a
remote block names travels to the server by value (as source, with every global it names, recursively: nnsight's
``CustomCloudPickler`` after :func:`nnsight_lorsa.remote.register`), so :func:`attribute` names nothing but the
recorder (:func:`.intervened.attribute_traced`: torch, nnsight and this package's envoy code, inside NDIF's
unpickling whitelist); the engine (:mod:`.engine`, whose modules import ``gc``, ``bisect``, ``copy``,
``pathlib``, ...) is imported inside the function, on the client, for a prompt or a cache. Its annotations are
quoted for the same reason.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .intervened import attribute_traced

if TYPE_CHECKING:
    import torch

    from .graph import Graph
    from .intervened import IntervenedAttribution
    from .logit_targets import Targets
    from .scores import PruneConfig


def attribute(
    replacement: Any,
    prompt: Any = None,
    *,
    tracer: Any = None,
    max_feature_nodes: int | None = None,
    batch_size: int = 64,
    update_interval: int = 4,
    targets: "Targets" = None,
    memory: str = "auto",
    prune: "PruneConfig | tuple[float, float] | None" = None,
    dtype: "torch.dtype | None" = None,
    progress: bool | None = None,
    remote: Any = False,
    max_memory: int | None = None,
    zero_positions: int = 0,
    qk_heads: int = 0,
    **renamed: Any,
) -> "Graph | IntervenedAttribution":
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
            :func:`.engine.cache_for_attribution` — runs the cached engine (no model forward; the model's
            norms, attention weights and unembedding are used). Same graph either way. None with ``tracer``.
        tracer: the tracer of the running ``with model.trace(prompt) as tracer:`` (no ``prompt``): call
            ``handle = attribute(rm, tracer=tracer)`` at the top of the body (after ``rm.replace()``), intervene
            with :mod:`nnsight_lorsa.patching`, and read ``handle.graph`` after the block: the graph of the
            pass as it ran, edited nodes held at their edited values as fixed inputs and marked
            (:class:`~.intervened.IntervenedAttribution`; docs/attribution.md, "Attributing an intervened
            pass"). Takes the options below except ``remote`` and ``qk_heads``, checked at the call. In a remote
            trace or session (``model.trace(..., remote=True)``, ``model.session(remote=True)``, after
            :func:`nnsight_lorsa.remote.register`) the same call: the server records the pass, the handle comes
            back and ``.graph`` is built here (docs/remote.md, "The graph of an intervened pass, remotely"); its
            options are checked here before the request is sent (:func:`.remote_handles.check_block_calls`:
            those the block spells as literals or names, the rest when ``.graph`` is read).
        renamed: nothing: the old ``logit_tokens=``, ``desired_logit_prob=`` and ``max_n_logits=`` are refused
            with their ``targets=`` spelling (:func:`.options.refuse_renamed`).
        max_feature_nodes: compute at most this many feature rows, chosen by influence on the
            logits as circuit-tracer (None: all; then every target's incoming edges sum to its value).
        batch_size: prompt copies per frozen pass = target rows per backward pass.
        update_interval: with ``max_feature_nodes``: the features' influence ranking is recomputed (from the rows
            computed so far) every ``update_interval`` batches, and each ranking queues its
            ``update_interval · batch_size`` most influential unvisited features (circuit-tracer's
            ``update_interval``, same default: the same feature rows as circuit-tracer's
            ``attribute(..., batch_size=, max_feature_nodes=)``). ``1``: re-rank before every batch (one
            influence pass over every stored row per batch, host time: 0.76 s a batch at 4096 tokens of the
            Llama-3.1-8B shape, docs/benchmarks.md). Unused without ``max_feature_nodes``.
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
            ≤ 256 MiB (:data:`.frozen.GRID_BUDGET_BYTES`; a cross-layer transcoder layer's decoder grids, one per
            replaced MLP it writes into, together). Same graph up to rounding.
        prune: return the influence-pruned graph, built from sparse rows without a dense
            ``n_nodes²`` adjacency (for long prompts): a :class:`~.scores.PruneConfig`
            ``(node_threshold, edge_threshold, keep_mass)`` or a ``(node_threshold, edge_threshold)``
            pair (``keep_mass=1``). Each target's edges from pruned nodes and dropped entries go into
            ``graph.residual``. None (default): the full graph; prune later with :func:`.scores.prune`.
        dtype: the frozen model's compute dtype (default the model's, each Lorsa / transcoder computing in its
            own dtype: ``graph.meta["dtype"]`` names the least precise of them). ``torch.float32`` for a
            bf16/fp16 model makes the edge sums exact to fp32 rounding instead of ~1 % (fp32 copies of
            the Lorsas, transcoders and MHSA weights, whatever their dtype; the model's modules still run in
            their dtype on one prompt copy for the frozen constants); ``torch.float64`` stores fp64 edges.
        progress: show a tqdm bar over target rows; None (default): when stderr is a terminal.
        remote: for a prompt, where its clean pass runs (``True``: on NDIF after
            :func:`nnsight_lorsa.remote.register`; ``"local"``: nnsight's serializing simulation); the graph is then
            built here from that pass's cache (:func:`~.engine.cache_for_attribution`), with the model's weights
            here (docs/remote.md, "Patching and attribution remotely").
            The replacement modules travel by value; the edge rows come back as saved values.
        max_memory: a budget in bytes (host memory for a CPU model, device memory otherwise): the batch
            is the largest ``≤ batch_size`` that :func:`.budget.estimate_memory`'s model fits in it
            (after the clean pass; ``graph.meta["batch_size"]`` says which). None: ``batch_size``. With offloaded
            modules on a device it also decides where their active rows live: as many sites' blocks kept on the
            device as fit what the batch leaves of it (never a smaller batch), the rest copied per pass
            (:func:`.offload.rows_placement`; without ``max_memory``: what fits each device's free memory over 1.1,
            per the device of the layer a block's site is on;
            ``graph.meta["offload_rows"]``: ``"device"`` / ``"partial"`` / ``"host"``, and
            ``graph.meta["offload_rows_kept_bytes"]``).
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
        :class:`~.graph.Graph` (``adjacency[t, s]``: direct effect of ``s`` on ``t``; ``values[t]``: what
        row ``t`` sums to, with ``residual[t]``); with ``tracer``, an
        :class:`~.intervened.IntervenedAttribution` (its ``.graph`` such a graph, after the trace).

    Raises:
        ConfigMismatchError: a bad option (``batch_size < 1``, unknown ``memory``, a bad ``prune``, a
            ``zero_positions`` outside ``[0, pos)``, empty ``targets`` or a target token named twice),
            a logit target outside the vocabulary or a target string that is not one token, ``remote``
            with a cache, or a cache without the replacement layers' tensors.
        ShapeError: a prompt that is not one sequence, or cache tensors of the wrong shape.
        MemoryBudgetError: ``max_memory`` too small even for batch 1 (after the clean pass).
        ConfigMismatchError: ``qk_heads`` with a cache or ``remote``.
        ArgumentError: a wrongly typed argument, token ids that are not integers or outside the
            vocabulary (:class:`~.options.AttributionOptions`, :func:`.engine.check_replacement`); an old setting
            name (``logit_tokens``, ``desired_logit_prob``, ``max_n_logits``: the message says the ``targets=``).
        MissingTokenizerError: a text prompt or target strings for a model loaded without a tokenizer.
        ConcurrentTraceError: another thread is tracing the model now.
        TraceOrderError: called with a prompt inside a ``model.trace`` / ``generate`` body
            (:func:`.trace.refuse_inside_trace`: the message names ``tracer=``); with ``tracer``, outside a trace
            body or after the body read something (:func:`.intervened.start`).
        ArgumentError: neither ``prompt`` nor ``tracer``, or both.
        ConfigMismatchError: ``tracer`` with ``remote`` or ``qk_heads``.
        TypeError: a keyword that is not a setting (as Python refuses an unknown keyword).
        NotWhitelistedError: (before a remote request is sent) a call with a prompt inside the remote block.
        All before the frozen pass runs (bad layers are refused when the ``ReplacementModel`` is built); in a remote
        block, the errors of the call's checks before anything is sent.
        NonFiniteError: after the frozen pass, the model's logits at the attributed position hold NaN / inf (an
            fp16 model's logits past 65504 are inf): the graph would be NaN.

    Source: Ameisen et al. 2025, *Circuit Tracing*; circuit-tracer ``circuit_tracer/attribution/attribute.py``.
    """
    settings = {"max_feature_nodes": max_feature_nodes, "batch_size": batch_size,
                "update_interval": update_interval, "targets": targets,
                "memory": memory, "prune": prune, "dtype": dtype, "progress": progress, "remote": remote,
                "max_memory": max_memory, "zero_positions": zero_positions, "qk_heads": qk_heads, **renamed}
    if tracer is not None:  # runs where the trace body runs: here, or on the server (remote)
        return attribute_traced(replacement, prompt, tracer, settings)
    from .engine import attribute_prompt  # the engine, here only: never named by a function a remote block ships

    return attribute_prompt(replacement, prompt, settings)
