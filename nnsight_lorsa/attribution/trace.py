"""The nnsight engine: attribution inside ``model.trace(...)`` — the clean pass and the frozen pass
with batched backward (Ameisen et al. 2025, *Circuit Tracing*; circuit-tracer's
``circuit_tracer/attribution/attribute.py``
does the same with TransformerLens hooks).

Both passes are ordinary nnsight traces over the user's model. The *clean pass*
(:func:`clean_pass`) runs the unmodified model once and saves what the frozen replacement model
takes from the prompt as an :class:`AttributionCache`: lean for :func:`.attribute.attribute` on a
prompt (the inputs the layout needs, the last logits, the attention positions; the error nodes'
true outputs come from the frozen pass), full for :func:`.engine.cache_for_attribution` (the
residual stream's start and every replaced module's output too, so that the cached engine,
:mod:`.cached`, needs no model forward). The *frozen pass* (:func:`attribute_in_trace`) swaps
every norm, attention, MLP and the unembedding output for
:class:`.replacement.FrozenReplacement`'s and then, inside the same trace, runs one backward per
batch of targets through nnsight's backward context (``with obj.backward(): M.grad``), with the
gradients injected one target per batch row. Nothing is attached to the model and no parameter
gets a ``.grad`` (``backward(inputs=[M])``). torch + nnsight only (runs remotely).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import nnsight
import torch

from .._placement import is_index_dtype
from .._repr import FieldsRepr
from ..adapters.base import ArchitectureAdapter
from ..envoy.nnsight_internals import check_token_ids, hf_module
from ..envoy.tokens import tokenizer_of
from ..errors import ArgumentError, ShapeError, TraceOrderError
from ..formats.hook_sites import MLPSiteIO
from .layout import Layout, LiveNodes, build_layout
from .logit_targets import TOP_LOGITS, LogitTargets, Targets, check_targets, token_ids
from .replacement import (
    FrozenReplacement,
    check_placement,
    copies_in,
    layer_modules,
    replacement_modules,
    transcoder_sites,
    weights_in,
)


@dataclass(repr=False)
class AttributionCache(FieldsRepr):
    """What the frozen replacement model takes from one prompt (batch row 0 of a clean forward).

    Attributes:
        tokens: ``(pos,)`` int64 input ids.
        positions: token positions the attention was called with, ``(1, pos)`` or ``(pos,)``.
        last_logits: ``(vocab,)`` the logits at the last position (the logit targets).
        embeddings: ``(1, pos, d_model)`` the residual stream's start (token + position embeddings);
            None from a lean pass.
        attn_in: ``{layer: (1, pos, d_model)}`` attention input of each layer with a Lorsa (its
            active heads); ``attn_out`` its output (error nodes; empty from a lean pass).
        mlp_in: ``{layer: (1, pos, d_model)}`` what the transcoder of each layer with one reads: the MLP input, or
            (circuit-tracer hooks, :func:`~..formats.hook_sites.mlp_site_io`) the pre-MLP norm's input
            (``hook_resid_mid``) or its ``x / rms(x)`` before the gain (``ln2.hook_normalized``, fp32).
        mlp_out: ``{layer: (1, pos, d_model)}`` every layer's MLP output (error nodes; empty from a
            lean pass).
        mlp_post_out: ``{layer: (1, pos, d_model)}`` the post-MLP norm's output (Gemma-2/3
            ``post_feedforward_layernorm``) of each layer whose transcoder writes it (``hook_mlp_out``), as a traced
            pass ran it (:mod:`.intervened`: the splice's output, edits included), the reference of that layer's
            error nodes; a layer not in it (a clean pass): the frozen post-norm of ``mlp_out``.

    Source: Ameisen et al. 2025, *Circuit Tracing*; circuit-tracer ``circuit_tracer/attribution/attribute.py``.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    last_logits: torch.Tensor
    embeddings: torch.Tensor | None = None
    attn_in: dict[int, torch.Tensor] = field(default_factory=dict)
    attn_out: dict[int, torch.Tensor] = field(default_factory=dict)
    mlp_in: dict[int, torch.Tensor] = field(default_factory=dict)
    mlp_out: dict[int, torch.Tensor] = field(default_factory=dict)
    mlp_post_out: dict[int, torch.Tensor] = field(default_factory=dict)


@torch.no_grad()
def clean_pass(model: Any, adapter: ArchitectureAdapter, ids: torch.Tensor, lorsa_layers: list[int],
               tc_layers: list[int], *, remote: Any = False, full: bool = False,
               tc_sites: dict[int, MLPSiteIO] | None = None) -> AttributionCache:
    """One ``model.trace`` of the unmodified model on ``ids: (pos,)`` (``remote`` as in
    :func:`.attribute.attribute`); returns its :class:`AttributionCache`. ``full`` also saves the
    embeddings and the replaced modules' outputs (a lean pass downloads only what the layout needs).
    ``tc_sites``: ``{layer: MLPSiteIO}`` of the transcoders that read elsewhere than the MLP's input
    (:func:`.replacement.transcoder_sites`): their ``mlp_in`` is :meth:`MLPSiteIO.read
    <..formats.hook_sites.MLPSiteIO.read>` of that module's input (applied here, after the trace)."""
    sites = {layer: io for layer, io in (tc_sites or {}).items() if io.input_path != adapter.mlp_path(layer)}
    read_at = {layer: io.input_path for layer, io in sites.items()}  # strings in the body: nothing else travels
    pos_path = getattr(adapter, "pos_embed_path", None)
    with model.trace(ids[None], use_cache=False, remote=remote):
        emb = None
        if full:
            emb = model.get(adapter.embed_path).output
            if pos_path:
                emb = emb + model.get(pos_path).output
        attn_in: dict[int, Any] = {}
        attn_out: dict[int, Any] = {}
        mlp_in: dict[int, Any] = {}
        mlp_out: dict[int, Any] = {}
        positions = None
        for layer in range(adapter.n_layers):
            attn = model.get(adapter.attention_path(layer))
            if layer == 0 or layer in lorsa_layers:
                args, kwargs = attn.inputs
                x = adapter.attention_input(args, kwargs)
                if layer == 0:
                    positions = adapter.attention_positions(args, kwargs, x)
                if layer in lorsa_layers:
                    attn_in[layer] = x
                    if full:
                        attn_out[layer] = adapter.attention_output(attn.output)
            if layer in tc_layers and layer in read_at:  # the pre-MLP norm's input (before the MLP: forward order)
                args, kwargs = model.get(read_at[layer]).inputs
                mlp_in[layer] = adapter.mlp_input(args, kwargs)
            mlp = model.get(adapter.mlp_path(layer))
            if layer in tc_layers and layer not in read_at:
                args, kwargs = mlp.inputs
                mlp_in[layer] = adapter.mlp_input(args, kwargs)
            if full:
                mlp_out[layer] = adapter.mlp_output(mlp.output)
        last = model.get(adapter.lm_head_path).output[0, -1]
        # one saved value: on a remote server the dicts above are not the caller's
        saved = nnsight.save((emb, positions, attn_in, attn_out, mlp_in, mlp_out, last))
    emb, positions, attn_in, attn_out, mlp_in, mlp_out, last = saved
    return AttributionCache(tokens=ids.cpu(), positions=positions, last_logits=last, embeddings=emb,
                            attn_in=dict(attn_in), attn_out=dict(attn_out),
                            mlp_in={layer: sites[layer].read(x) if layer in sites else x
                                    for layer, x in mlp_in.items()},
                            mlp_out=dict(mlp_out))


def tokenize(model: Any, prompt: Any) -> torch.Tensor:
    """``(pos,)`` int64 ids of a prompt (a string, through the model's tokenizer, or ids).

    Raises:
        ShapeError: not one non-empty sequence.
        ArgumentError: ids that are not integers, or outside the model's vocabulary.
        MissingTokenizerError: a string prompt for a model loaded without a tokenizer.
    """
    if isinstance(prompt, str):
        ids = tokenizer_of(model, "attribute(prompt=<text>)")(prompt, return_tensors="pt")["input_ids"][0]
    elif isinstance(prompt, (list, tuple)) and prompt and (isinstance(prompt[0], str) or len(prompt) > 1 and any(
            isinstance(p, (str, list, tuple)) or getattr(p, "ndim", 0) >= 1 for p in prompt)):  # texts, id sequences
        raise ArgumentError(
            f"attribute takes one prompt (a text or a sequence of token ids) per graph, got a {type(prompt).__name__} "
            f"of {len(prompt)} prompts: attribute each one (a graph is of one prompt; batch_size batches its rows)")
    else:
        try:
            raw = torch.as_tensor(prompt, device="cpu")
        except (TypeError, ValueError, RuntimeError) as e:
            raise ArgumentError(f"a prompt must be text or token ids, got {type(prompt).__name__}: {e}") from e
        if not is_index_dtype(raw.dtype):
            raise ArgumentError(f"prompt token ids must be integers, got dtype {raw.dtype}")
        ids = raw.long()
        if ids.dim() == 2 and ids.shape[0] == 1:
            ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0:
        raise ShapeError(f"a prompt must be one sequence of token ids, got shape {tuple(ids.shape)}")
    check_token_ids(ids, model, "a prompt")
    return ids


@dataclass
class Prepared:
    """What every engine needs before its frozen pass: the prompt's :class:`~.layout.Layout`, the
    frozen MHSA weights ``{layer: MHSAWeights}`` of the layers without a Lorsa, the model's adapter,
    the replacement modules ``{layer: module}`` (copies in ``dtype`` where one was asked), and that ``dtype``
    (None: the model's; a frozen pass's multipliers follow it, :func:`multiplier_dtype`)."""

    layout: Layout
    mhsa: dict[int, Any]
    adapter: ArchitectureAdapter
    lorsas: dict[int, Any]
    transcoders: dict[int, Any]
    dtype: torch.dtype | None = None


def prepare(replacement: Any, prompt: Any, *, targets: Targets = None, dtype: torch.dtype | None = None,
            cache: AttributionCache | None = None, zero_positions: int = 0,
            live: LiveNodes | None = None) -> Prepared:
    """The clean pass over ``prompt`` (text or ids) and the layout of its nodes — or, with ``cache``
    (``prompt`` then ignored), the layout from that cache without running the model; ``live``: the node
    values of a traced pass (:class:`~.layout.LiveNodes`, with a cache of that pass); ``targets`` as
    :func:`.attribute.attribute`'s (strings through the model's tokenizer: :func:`.logit_targets.token_ids`).

    Raises:
        LayerOutOfRangeError, ShapeError: bad layers or prompt — before the model runs.
        ArgumentError, ConfigMismatchError, MissingTokenizerError: bad ``targets`` (an id outside the
            vocabulary only after the clean pass).
        PlacementError: a replacement module or the model with weights on the ``meta`` device
            (:func:`.replacement.check_placement`).
    """
    model, adapter = replacement.model, replacement.adapter
    ids = token_ids(check_targets(targets), model)
    lor, tcs = layer_modules(replacement)
    check_placement(hf_module(model), lor, tcs)
    if dtype is not None:  # the whole frozen model in dtype: modules in another dtype (even the model's) copied
        lor, tcs = copies_in(lor, dtype), copies_in(tcs, dtype)
    modules, mhsa = replacement_modules(model, adapter, lor, tcs)
    if dtype is not None:
        mhsa = {layer: weights_in(w, dtype) for layer, w in mhsa.items()}
    if cache is None:
        cache = clean_pass(model, adapter, tokenize(model, prompt), list(lor), list(tcs),
                           tc_sites=transcoder_sites(replacement, tcs))
    layout = layout_of(cache, modules, adapter, targets=ids, zero_positions=zero_positions, live=live)
    return Prepared(layout, mhsa, adapter, lor, tcs, dtype)


def layout_of(cache: AttributionCache, modules: dict[str, Any], adapter: ArchitectureAdapter, *,
              targets: LogitTargets | tuple[int, ...] = TOP_LOGITS, zero_positions: int = 0,
              live: LiveNodes | None = None) -> Layout:
    """The prompt's nodes (:func:`.layout.build_layout`) from a pass's cache."""
    return build_layout(cache.tokens, {layer: (x, cache.positions) for layer, x in cache.attn_in.items()},
                        cache.mlp_in, cache.last_logits, modules, n_layers=adapter.n_layers,
                        targets=targets, zero_positions=zero_positions, live=live)


def first_row(args: tuple, kwargs: dict, batch: int, dtype: torch.dtype) -> tuple[tuple, dict]:
    """A module call cut to batch row 0 in the model's dtype: every tensor of ≥ 2 dimensions with a
    leading ``batch`` dimension sliced to its first row (tuples of them too, e.g. RoPE's ``(cos, sin)``),
    every floating one cast to ``dtype``. The frozen pass runs the model's own modules on this: their
    row-0 output is all it needs (the errors' true outputs), and the frozen model may compute in
    another dtype than theirs."""
    def cut(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            if batch > 1 and v.dim() >= 2 and v.shape[0] == batch:
                v = v[:1]
            return v.to(dtype) if v.is_floating_point() else v
        return tuple(cut(t) for t in v) if isinstance(v, tuple) else v

    return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}


def last_position(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A module call with its first input (``(batch, pos, …)``, :func:`call_input`) cut to the last position."""
    if args:
        return (args[0][:, -1:], *args[1:]), kwargs
    name = next(iter(kwargs))
    return args, {**kwargs, name: kwargs[name][:, -1:]}


def call_input(args: tuple, kwargs: dict) -> torch.Tensor:
    """The first input of a module call (first positional, else first keyword)."""
    return args[0] if args else next(iter(kwargs.values()))


@dataclass(frozen=True)
class FrozenSite:
    """A module whose output the frozen pass replaces: ``kind`` ``"norm"`` (``role`` ``attn_norm`` /
    ``mlp_norm`` / ``final_norm``, Gemma-2's ``attn_post_norm`` / ``mlp_post_norm``), ``"attention"``, ``"mlp"``
    or ``"head"`` (the unembedding)."""

    path: str
    kind: str
    layer: int | None = None
    role: str = ""


def frozen_sites(adapter: ArchitectureAdapter) -> list[FrozenSite]:
    """The replaced modules in forward order (the embeddings are scaled in place, not replaced); Gemma-2's and
    OLMo-2's post-attention / post-feedforward norms after the attention / MLP they normalise; no pre-norm sites
    where the family has none (OLMo-2)."""
    sites = []

    def norm(path: str | None, layer: int, role: str) -> list[FrozenSite]:
        return [] if path is None else [FrozenSite(path, "norm", layer, role)]

    for layer in range(adapter.n_layers):
        sites += [*norm(adapter.attention_norm_path(layer), layer, "attn_norm"),
                  FrozenSite(adapter.attention_path(layer), "attention", layer),
                  *norm(adapter.attention_post_norm_path(layer), layer, "attn_post_norm"),
                  *norm(adapter.mlp_norm_path(layer), layer, "mlp_norm"),
                  FrozenSite(adapter.mlp_path(layer), "mlp", layer),
                  *norm(adapter.mlp_post_norm_path(layer), layer, "mlp_post_norm")]
    return [*sites, FrozenSite(adapter.final_norm_path, "norm", None, "final_norm"),
            FrozenSite(adapter.lm_head_path, "head")]


def frozen_output(frozen: FrozenReplacement, adapter: ArchitectureAdapter, site: FrozenSite, module: torch.nn.Module,
                  args: tuple, kwargs: dict, out: Any) -> Any:
    """What the frozen model returns at ``site``, from the module's full call ``(args, kwargs)`` and its
    (row-0) output ``out`` — shared by the nnsight driver here and the PyTorch-hook reference
    (``benchmarks/reference/attribution.py``)."""
    if site.kind == "norm":
        return frozen.norm(module, call_input(args, kwargs), site.layer, site.role)
    if site.kind == "head":
        return frozen.unembed(module, call_input(args, kwargs))
    assert site.layer is not None
    if site.kind == "attention":
        x = adapter.attention_input(args, kwargs)
        new = frozen.attention(site.layer, x, adapter.attention_positions(args, kwargs, x),
                               adapter.attention_output(out))
        return adapter.with_attention_output(out, new)
    new = frozen.mlp(site.layer, adapter.mlp_input(args, kwargs), adapter.mlp_output(out))
    return adapter.with_mlp_output(out, new)


def frozen_forward_body(model: Any, adapter: ArchitectureAdapter, frozen: FrozenReplacement) -> None:
    """Inside a trace over ``batch`` copies of the prompt: swap every site's output for the frozen
    replacement model's, in forward order. Every replaced module (norms, attention, MLPs, unembedding)
    runs on batch row 0 only, in the model's dtype (:func:`first_row`) — the unembedding, whose output no constant
    comes from, on its last position (:func:`last_position`) — so the ``batch`` copies cost the model's forward once
    plus the frozen model, which may compute in another dtype."""
    root = hf_module(model)
    batch, dtype = frozen.M.shape[0], next(root.parameters()).dtype
    for path in (adapter.embed_path, getattr(adapter, "pos_embed_path", None)):
        if path:
            emb = model.get(path)
            emb.output = frozen.embed(emb.output)
    for site in frozen_sites(adapter):
        envoy = model.get(site.path)
        args, kwargs = envoy.inputs
        cut = first_row(args, kwargs, batch, dtype)
        # the unembedding's own output is replaced whole (no constant comes from it): it runs on copy 0's last
        # position only, not the (P, vocab) logits (2·P·d_model·vocab FLOPs, benchmarks/attribution_flops.py)
        envoy.inputs = last_position(*cut) if site.kind == "head" else cut
        envoy.output = frozen_output(frozen, adapter, site, adapter.get_module(root, site.path), args, kwargs,
                                     envoy.output)


def multiplier_dtype(module: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.dtype:
    """The dtype of the multipliers ``M``, and so of the edges: fp64 for an fp64 model or a frozen model computed
    in fp64 (``dtype``, :func:`.attribute.attribute`'s), else fp32 (edges of a bf16/fp16 model still accumulate in
    fp32)."""
    base = torch.float64 if next(module.parameters()).dtype == torch.float64 else torch.float32
    return base if dtype is None else torch.promote_types(base, dtype)


def autograd_backward(obj: torch.Tensor, M: torch.Tensor, consume: Callable[[torch.Tensor], None]) -> None:
    """``consume(∂obj/∂M)`` with plain autograd (outside a trace), keeping the graph for the next batch."""
    consume(torch.autograd.grad(obj, M, retain_graph=True)[0])


def nnsight_backward(obj: torch.Tensor, M: torch.Tensor, consume: Callable[[torch.Tensor], None]) -> None:
    """``consume(∂obj/∂M)`` inside nnsight's backward context (``with obj.backward(): M.grad``): the
    gradient is used where it arrives, not saved (a saved value would live until the trace ends);
    the graph is kept for the next batch of targets and no parameter accumulates a ``.grad``."""
    with obj.backward(retain_graph=True, inputs=[M]):
        grad: torch.Tensor = M.grad  # type: ignore[assignment]  # served by nnsight as it arrives
        consume(grad.clone())  # a copy: autograd goes on accumulating into M.grad
    M.grad = None
    obj.detach_()  # nnsight's backward tracer keeps obj in a reference cycle: without its grad_fn it does not
    # keep the frozen pass's autograd graph alive until a full garbage collection


def backward_rows(frozen: FrozenReplacement, M: torch.Tensor, scheduler: Any, batch_size: int,
                  backward: Callable[[torch.Tensor, torch.Tensor, Callable[[torch.Tensor], None]], None]) -> None:
    """Inject one target per batch row (:meth:`FrozenReplacement.objective`), ``batch_size`` at a
    time, until ``scheduler`` has no more rows."""
    rows = scheduler.next_rows(batch_size)
    while rows:
        backward(frozen.objective(rows), M, functools.partial(_record, scheduler, rows))
        rows = scheduler.next_rows(batch_size)


def _record(scheduler: Any, rows: list[int], grad: torch.Tensor) -> None:
    scheduler.record(rows, grad[:len(rows)].detach())


def attribute_in_trace(model: Any, adapter: ArchitectureAdapter, layout: Layout, mhsa: dict[int, Any],
                       scheduler: Any, batch_size: int,
                       make: Callable[..., FrozenReplacement] = FrozenReplacement,
                       dtype: torch.dtype | None = None) -> torch.Tensor:
    """Run the frozen pass over ``batch_size`` copies of the prompt in one ``model.trace`` and fill
    ``scheduler`` (a :class:`RowScheduler`, or anything with ``next_rows``/``record``) with edge
    rows; returns the target values ``(n_targets,)`` of the frozen model. ``make(layout, M, mhsa)``
    builds the frozen forward (a subclass records other targets, e.g. :mod:`.qk`). Always a local trace: a remote
    prompt's graph is built here from the cache of its clean pass (:func:`.engine.build_graph`). ``dtype``: the
    dtype ``make``'s
    frozen model computes in (None: the model's), which the multipliers take where it is wider than fp32
    (:func:`multiplier_dtype`)."""
    ids = layout.tokens[None].expand(batch_size, -1).to(model.device)
    with model.trace(ids, use_cache=False):
        M = torch.ones(batch_size, layout.n_sources, device=model.device,
                       dtype=multiplier_dtype(hf_module(model), dtype), requires_grad=True)
        frozen = make(layout, M, mhsa)
        frozen_forward_body(model, adapter, frozen)
        T = frozen.targets()
        backward_rows(frozen, M, scheduler, batch_size, nnsight_backward)
        # the error nodes' activations, set in the frozen pass (FrozenReplacement.error_const)
        result = nnsight.save((T[0].detach(), scheduler.done, scheduler.rows, frozen.layout.nodes.activation))
    values, scheduler.done, scheduler.rows, activation = result
    if activation is not layout.nodes.activation:
        layout.nodes.activation.copy_(activation.to(layout.nodes.activation.device))
    return values


def frozen_logits(model: Any, adapter: ArchitectureAdapter, layout: Layout, mhsa: dict[int, Any],
                  M: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits (batch, pos, vocab), targets (batch, n_targets))`` of the frozen replacement model
    with multipliers ``M`` (default: ones, batch 1) — with every multiplier 1 it is the model itself
    (error nodes included); raising ``M[b, s]`` by 1 adds source ``s``'s contribution once more, the
    intervention that checks an edge. The frozen constants come from a first forward with ``M = 1``.
    ``dtype``: what the frozen model computes in (None: the model's; as :func:`attribute_in_trace`'s)."""
    constants: dict[str, torch.Tensor] = {}
    ones = torch.ones(1, layout.n_sources, dtype=multiplier_dtype(hf_module(model), dtype), device="cpu")
    for mult in (ones, ones if M is None else M):
        ids = layout.tokens[None].expand(mult.shape[0], -1).to(model.device)
        with torch.no_grad(), model.trace(ids, use_cache=False):
            frozen = FrozenReplacement(layout, mult.to(model.device, ones.dtype), mhsa, constants, dtype=dtype)
            frozen_forward_body(model, adapter, frozen)
            logits = nnsight.save(model.get(adapter.lm_head_path).output)
            T = nnsight.save(frozen.targets())
    return logits, T


def refuse_inside_trace(what: str) -> None:
    """Raise :class:`~..errors.TraceOrderError` when called inside a ``model.trace`` / ``generate`` body.

    ``attribute`` and ``estimate_memory`` run their own traces of the clean model; nnsight cannot open a
    trace inside a running one (it used to end in nnsight's ``AttributeError: 'NoneType' object has no
    attribute 'event'``). Inside ``model.session()`` they work. The graph of the traced (intervened) pass
    itself is ``attribute(rm, tracer=tracer)`` (:mod:`.intervened`).
    """
    from ..envoy.nnsight_internals import current_worker

    try:
        current_worker(what)
    except TraceOrderError:
        return  # not inside a trace body: fine
    raise TraceOrderError(
        f"{what}(replacement, prompt) runs its own traces of the clean model and cannot be called inside a "
        f"model.trace(...) / generate(...) body: call it before or after the trace (or inside model.session()). "
        "For the graph of this trace's own (intervened) forward pass, call handle = attribute(rm, tracer=tracer) "
        "at the top of the trace body and read handle.graph after the with block (docs/attribution.md, "
        "'Attributing an intervened pass')")
