"""``attribute(model, prompt, lorsas=…, transcoders=…)`` → :class:`.graph.Graph`.

The replacement model (paper ``004_…`` §9.4; GUIDE §4): transcoders for MLPs (a layer without one
contributes its whole MLP output as error nodes), Lorsa for attention (a layer without one keeps
its MHSA with frozen patterns), frozen norms. Two nnsight traces: a clean pass (which features and
heads are active), then the frozen pass with batched backward (:mod:`.trace`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from tqdm.auto import tqdm

from ..adapters.base import ArchitectureAdapter
from ..adapters.registry import get_adapter
from ..errors import ConfigMismatchError, ShapeError
from .clean import clean_pass, layout_of
from .coders import as_layer_coders
from .graph import Graph
from .hooks import attribute_with_hooks
from .layout import Layout
from .precision import copies_in, weights_in
from .replacement import FrozenReplacement
from .schedule import RowScheduler
from .sparse_graph import assemble_pruned
from .sparse_rows import SparseRows
from .trace import attribute_in_trace


def _as_dict(modules: Any, what: str) -> dict[int, Any]:
    if modules is None:
        return {}
    layer_coders = as_layer_coders(modules) if what == "TranscoderSet" else None
    if layer_coders is not None:  # a cross-layer transcoder: one encoder view per layer
        return layer_coders
    if isinstance(modules, Mapping) or hasattr(modules, "layers"):  # a dict, a LorsaSet, a TranscoderSet
        return {int(k): modules[k] for k in modules}
    raise ConfigMismatchError(
        f"{what} must be a mapping {{layer: module}} or a {what} set, got {type(modules).__name__}")


def tokenize(model: Any, prompt: Any) -> torch.Tensor:
    """``(pos,)`` int64 ids of a prompt (a string, through the model's tokenizer, or ids)."""
    if isinstance(prompt, str):
        ids = model.tokenizer(prompt, return_tensors="pt")["input_ids"][0]
    else:
        ids = torch.as_tensor(prompt, dtype=torch.long)
        if ids.dim() == 2 and ids.shape[0] == 1:
            ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0:
        raise ShapeError(f"a prompt must be one sequence of token ids, got shape {tuple(ids.shape)}")
    return ids


def replacement_modules(model: Any, adapter: ArchitectureAdapter, lorsas: dict[int, Any],
                        transcoders: dict[int, Any]) -> tuple[dict[str, Any], dict[int, Any]]:
    """The modules :func:`.layout.build_layout` needs, and the frozen MHSA weights by layer (``model``:
    an nnsight model or the bare Hugging Face one)."""
    root = getattr(model, "_module", model)
    for layer in [*lorsas, *transcoders]:
        adapter.check_layer(layer)
    mhsa = {layer: adapter.mhsa_weights(root, layer) for layer in range(adapter.n_layers) if layer not in lorsas}
    def bias(path: str) -> Any:
        return getattr(adapter.get_module(root, path), "bias", None)

    norm_biases: dict[str, Any] = {"final_norm": bias(adapter.final_norm_path)}
    for layer in range(adapter.n_layers):
        norm_biases[f"L{layer}.attn_norm"] = bias(adapter.attention_norm_path(layer))
        norm_biases[f"L{layer}.mlp_norm"] = bias(adapter.mlp_norm_path(layer))
    modules = {"lorsas": lorsas, "transcoders": transcoders, "norm_biases": norm_biases,
               "attn_biases": {layer: (w.b_V, w.b_O) for layer, w in mhsa.items()},
               "lm_head_bias": bias(adapter.lm_head_path)}
    return modules, mhsa


def prepare(model: Any, prompt: Any, *, lorsas: Any = None, transcoders: Any = None, logit_tokens: Any = None,
            desired_logit_prob: float = 0.95, max_n_logits: int = 10,
            remote: Any = False) -> tuple[Layout, dict[int, Any], Any]:
    """The clean pass: ``(layout, mhsa weights, adapter)``."""
    adapter = get_adapter(model)
    lor, tcs = _as_dict(lorsas, "LorsaSet"), _as_dict(transcoders, "TranscoderSet")
    modules, mhsa = replacement_modules(model, adapter, lor, tcs)
    ids = tokenize(model, prompt)
    cache = clean_pass(model, adapter, ids, list(lor), list(tcs), remote=remote)
    layout = layout_of(cache, modules, adapter, logit_tokens=logit_tokens, desired_logit_prob=desired_logit_prob,
                       max_n_logits=max_n_logits)
    return layout, mhsa, adapter


def assemble(layout: Layout, scheduler: RowScheduler, values: torch.Tensor, prompt: str, meta: dict[str, Any]) -> Graph:
    """The :class:`Graph` over the visited features and every error/embedding/bias/logit node."""
    targets = torch.tensor(scheduler.done, dtype=torch.long)
    nf, ns = layout.n_features, layout.n_sources
    visited = torch.zeros(nf, dtype=torch.bool)
    visited[targets[targets < nf]] = True
    keep_src = torch.cat([visited, torch.ones(ns - nf, dtype=torch.bool)])
    src_ids = keep_src.nonzero().flatten()
    n_logits = layout.n_logits
    node_ids = torch.cat([src_ids, torch.arange(ns, ns + n_logits)])
    new_index = torch.full((ns + n_logits,), -1, dtype=torch.long)
    new_index[node_ids] = torch.arange(node_ids.numel())
    n, k = node_ids.numel(), src_ids.numel()
    row_at = new_index[torch.where(targets < nf, targets, ns + targets - nf)]
    first = scheduler.rows[0] if scheduler.rows else None
    dtype = values.dtype if first is None else (first.val if isinstance(first, SparseRows) else first).dtype
    adjacency = torch.zeros(n, n, dtype=dtype)
    start = 0
    for chunk in scheduler.rows:  # chunk by chunk: no (rows, sources) copy of all rows at once
        dense = chunk.dense() if isinstance(chunk, SparseRows) else chunk
        # the kept sources are the first columns, in order: a row scatter, no (rows × sources) index grid
        adjacency[row_at[start:start + dense.shape[0]], :k] = dense if k == ns else dense[:, src_ids]
        start += dense.shape[0]
    all_values = torch.full((ns + n_logits,), float("nan"), dtype=dtype)
    all_values[:nf] = values[:nf].cpu()
    all_values[ns:] = values[nf:].cpu()
    computed = torch.zeros(n, dtype=torch.bool)
    computed[row_at] = True
    return Graph(tokens=layout.tokens, nodes=layout.nodes.select(node_ids), adjacency=adjacency,
                 values=all_values[node_ids], logit_probs=layout.logit_probs, feature_rows=computed,
                 layout_ids=node_ids, prompt=prompt, meta=meta)


def attribute(
    model: Any,
    prompt: Any,
    *,
    lorsas: Any = None,
    transcoders: Any = None,
    max_feature_nodes: int | None = None,
    batch_size: int = 64,
    logit_tokens: Any = None,
    desired_logit_prob: float = 0.95,
    max_n_logits: int = 10,
    progress: bool = False,
    engine: str = "nnsight",
    patterns: str = "auto",
    node_vectors: str = "auto",
    remote: Any = False,
    prune_to: tuple[float, float] | None = None,
    keep_mass: float | None = None,
    dtype: torch.dtype | None = None,
) -> Graph:
    """The attribution graph of ``prompt`` over the replacement model, computed in nnsight traces.

    Args:
        model: an nnsight ``LanguageModel`` / ``TransformersModel`` of a supported family.
        prompt: text (tokenized by the model's tokenizer) or ``(pos,)`` token ids.
        lorsas: a :class:`~nnsight_lorsa.LorsaSet` or ``{layer: Lorsa}``; layers without one keep
            their MHSA with frozen patterns.
        transcoders: a :class:`~nnsight_lorsa.TranscoderSet` or ``{layer: Transcoder}`` (a layer
            without one contributes its MLP output as error nodes), or a cross-layer transcoder
            (:class:`~nnsight_lorsa.modules.clt.CrossLayerTranscoder` or a ``CLTSet``), whose
            features write into every later MLP output.
        max_feature_nodes: compute at most this many feature rows, chosen by influence on the
            logits (None: all; then every target's incoming edges sum to its value).
        batch_size: prompt copies per frozen pass = target rows per backward pass.
        logit_tokens: target token ids at the last position (default: top-p, ``desired_logit_prob``
            up to ``max_n_logits``, as circuit-tracer).
        progress: show a tqdm bar over target rows.
        engine: ``"nnsight"`` (both passes' frozen forward and backward inside ``model.trace``) or
            ``"hooks"`` (the frozen pass with PyTorch hooks on the underlying model — the reference
            the nnsight path is benchmarked against; same numbers).
        patterns: frozen attention from stored patterns (``"store"``, fastest: ``n_heads·pos²`` per MHSA
            layer, ``n·pos`` pattern rows per Lorsa layer) or from stored queries/keys (``"sdpa"``, for
            long prompts on GPU: SDPA for MHSA, Lorsa targets' pattern rows recomputed in chunks in every
            pass, :mod:`.lorsa_rows`); ``"auto"``: store on CPU, SDPA on GPU.
        node_vectors: the active nodes' decoder rows / ``w_o`` / encoder columns copied onto
            per-position grids (``"grid"``, fastest, ``n·d_model`` numbers kept per site) or gathered
            from the weights chunk by chunk in every pass (``"gather"``, nothing kept per node; for
            long prompts of large models); ``"auto"``: grid while a site's copy is ≤ 256 MiB.
        prune_to: ``(node_threshold, edge_threshold)``: return the influence-pruned graph, built from
            sparse rows without a dense ``n_nodes²`` adjacency (:mod:`.sparse_graph`; each target's
            edges from pruned nodes go into ``graph.residual``). For long prompts.
        keep_mass: with ``prune_to``, store each row's largest edges up to this fraction of its
            absolute mass (default 1: every non-zero edge) — the rest is summed exactly into the
            residual.
        dtype: the frozen model's compute dtype (default the model's). ``torch.float32`` for a
            bf16/fp16 model makes the edge sums exact to fp32 rounding instead of ~1 % (fp32 copies of
            the Lorsas, transcoders and MHSA weights; the model's modules still run in their dtype on
            one prompt copy for the frozen constants; :mod:`.precision`).
        remote: passed to both ``model.trace`` calls (``True``: run on NDIF after
            :func:`nnsight_lorsa.remote.register`; ``"local"``: nnsight's serializing simulation).
            The replacement modules travel by value; the edge rows come back as saved values.

    Returns:
        :class:`Graph` (``adjacency[t, s]``: direct effect of ``s`` on ``t``).

    Raises:
        UnsupportedArchitectureError, LayerOutOfRangeError, ConfigMismatchError, ShapeError: bad
            model, layers, modules or prompt — before the model runs.
    """
    check_options(batch_size=batch_size, patterns=patterns, node_vectors=node_vectors, prune_to=prune_to,
                  keep_mass=keep_mass)
    if engine not in ("nnsight", "hooks"):
        raise ConfigMismatchError(f"engine must be 'nnsight' or 'hooks', got {engine!r}")
    if remote and engine != "nnsight":
        raise ConfigMismatchError("remote attribution needs engine='nnsight'")
    make = functools.partial(FrozenReplacement, patterns=patterns, node_vectors=node_vectors, dtype=dtype)
    lor, tcs = _as_dict(lorsas, "LorsaSet"), _as_dict(transcoders, "TranscoderSet")
    if dtype is not None:
        lor, tcs = copies_in(lor, dtype), copies_in(tcs, dtype)
    layout, mhsa, adapter = prepare(model, prompt, lorsas=lor, transcoders=tcs, logit_tokens=logit_tokens,
                                    desired_logit_prob=desired_logit_prob, max_n_logits=max_n_logits, remote=remote)
    if dtype is not None:
        mhsa = {layer: weights_in(w, dtype) for layer, w in mhsa.items()}

    def run(scheduler: RowScheduler) -> torch.Tensor:
        if engine == "nnsight":
            return attribute_in_trace(model, adapter, layout, mhsa, scheduler, batch_size, make=make, remote=remote)
        return attribute_with_hooks(model._module, adapter, layout, mhsa, scheduler, batch_size, make=make)

    meta = {"model_type": adapter.config.model_type, "lorsa_layers": sorted(lor), "transcoder_layers": sorted(tcs),
            "batch_size": batch_size, "max_feature_nodes": max_feature_nodes, "engine": engine, "patterns": patterns,
            "node_vectors": node_vectors, "dtype": str(dtype or next(model._module.parameters()).dtype)}
    return compute_graph(layout, run, max_feature_nodes=max_feature_nodes, progress=progress and not remote,
                         prune_to=prune_to, keep_mass=keep_mass, prompt=prompt if isinstance(prompt, str) else "",
                         meta=meta)


def check_options(*, batch_size: int, patterns: str, node_vectors: str, prune_to: tuple[float, float] | None,
                  keep_mass: float | None) -> None:
    """Raise :class:`ConfigMismatchError` for a bad option of :func:`attribute` (before anything runs)."""
    if batch_size < 1:
        raise ConfigMismatchError(f"batch_size must be >= 1, got {batch_size}")
    if patterns not in ("auto", "store", "sdpa"):
        raise ConfigMismatchError(f"patterns must be 'auto', 'store' or 'sdpa', got {patterns!r}")
    if node_vectors not in ("auto", "grid", "gather"):
        raise ConfigMismatchError(f"node_vectors must be 'auto', 'grid' or 'gather', got {node_vectors!r}")
    if keep_mass is not None and prune_to is None:
        raise ConfigMismatchError("keep_mass needs prune_to=(node_threshold, edge_threshold)")
    if keep_mass is not None and not 0.0 < keep_mass <= 1.0:
        raise ConfigMismatchError(f"keep_mass must be in (0, 1], got {keep_mass}")


def compute_graph(layout: Layout, run: Callable[[RowScheduler], torch.Tensor], *, max_feature_nodes: int | None,
                  progress: bool, prune_to: tuple[float, float] | None, keep_mass: float | None, prompt: str,
                  meta: dict[str, Any]) -> Graph:
    """Schedule the target rows, let ``run(scheduler)`` compute them (returning the target values),
    and assemble the dense or pruned :class:`Graph`."""
    bar = tqdm(total=layout.n_logits + min(max_feature_nodes or layout.n_features, layout.n_features),
               desc="attribution rows", disable=not progress)
    sparse = prune_to is not None
    scheduler = RowScheduler(layout, max_feature_nodes, bar if progress else None,
                             keep_mass=(1.0 if keep_mass is None else keep_mass) if sparse else None)
    try:
        values = run(scheduler)
    finally:
        bar.close()
    if prune_to is not None:
        return assemble_pruned(layout, scheduler, values, node_threshold=prune_to[0], edge_threshold=prune_to[1],
                               prompt=prompt, meta=meta)
    return assemble(layout, scheduler, values, prompt, meta)
