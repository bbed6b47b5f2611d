"""The graph of the forward pass a trace runs, interventions included: ``attribute(rm, tracer=tracer)``.

Inside one ``with model.trace(prompt) as tracer:`` a researcher splices the replacements, intervenes
(ablates, scales, steers or patches a Lorsa head or transcoder feature with :mod:`nnsight_lorsa.patching`)
and asks for the attribution graph **of that pass**::

    with model.trace(ids) as tracer:
        rm.replace()
        handle = attribute(rm, tracer=tracer)        # before the body reads anything
        ablate(rm(LorsaHead(2, 17)))
        logits = nnsight.save(model.lm_head.output)
    graph = handle.graph                             # built on first read, after the with block

How: :func:`start` spawns a recorder worker in the running trace (:func:`~..envoy.nnsight_internals.spawn_worker`)
that follows the model's forward and, served after every other worker at each location
(:func:`~..envoy.nnsight_internals.serve_last`: after the body's edits and the splices' output swaps),
keeps what the cached engine (:mod:`.cached`) takes from a pass — the residual stream's start, the
attention and MLP inputs and outputs, the last logits; where a transcoder's circuit-tracer hooks move it off the
MLP's call (:func:`~..formats.hook_sites.mlp_site_io`), the input of the module it reads instead of the MLP's and,
for a Gemma-2/3 ``hook_mlp_out`` writer, ``post_feedforward_layernorm``'s output (:func:`off_call_paths`) — plus
each spliced Lorsa's ``hook_z`` and each spliced transcoder's ``hook_sae_acts_post`` (a CLT's: ``model.clt``'s
``hook_sae_acts_post[layer]``) as the pass used them (edits included). The interventions
report their targets to the recorder's :class:`~..envoy.edit_log.EditLog`. After the trace,
:attr:`IntervenedAttribution.graph` runs the frozen-Jacobian attribution on those tensors (no model
forward), with :class:`~.layout.LiveNodes`:

* each node's value is the one the pass used; an edited node is a node whatever its value (an ablated
  head at 0), held at it as a fixed input — its row is not computed (``feature_rows`` False, ``values``
  NaN), nothing flows upstream through it — and marked (:attr:`.graph.NodeTable.intervened`, saved by
  :meth:`.graph.Graph.save`, ``"intervened": true`` in :func:`.export.to_neuronpedia`'s nodes);
* an edit made directly on an envoy (``hook_z.output[...] = ...``, a transcoder's ``hook_sae_acts_post``, a CLT's
  ``hook_sae_acts_post[layer]``) reports to no edit log: it is found by value when the graph is built
  (:meth:`.layout.LiveNodes.held`) — a non-zero node value that differs from the pre-activation its row would sum
  to (the encoder recomputed from the pass's recorded input) by more than :func:`.layout.direct_edit_bound` (8 ×
  ``finfo(dtype).eps`` of the coarser of the pass's and the recomputation's dtypes) times the layer's scale (its
  largest recomputed activation) — and held and marked the same way, listed in ``graph.meta["intervened"]`` as
  ``"... at positions [p] (direct edit)"`` (:func:`.layout.direct_edit_names`); an unedited pass marks nothing (no
  warning either way: direct edits are legitimate);
* the error nodes are the site's output in the pass minus the replacement's reconstruction from the
  nodes' values, so every computed row still sums to its node's value exactly and the graph's logits
  are the pass's logits (the spliced error term ``MHSA − Lorsa_clean`` is what the error node holds).

Edits the graph can hold: Lorsa heads and transcoder features, per-layer or a CLT's (marked nodes; a CLT's features
are no targets of :mod:`nnsight_lorsa.patching`: edited on its envoy, marked as direct edits); an MHSA head of
a layer with a Lorsa and an SAE feature at an MLP output or at a Lorsa layer's attention output (their
effect is carried by that site's error nodes; nothing to mark). Any other edit through
:mod:`nnsight_lorsa.patching` raises :class:`~..errors.ConfigMismatchError` at the edit. ``model.trace``, in a
``model.session()`` or not, local or remote (``remote=True``, after :func:`nnsight_lorsa.remote.register`): the
same call and handle; remotely the server records, the handle returns as plain data (:mod:`.intervened_record`,
:mod:`.remote_handles`) and the graph is built on the client. One prompt (batch 1). torch + nnsight; this module
travels to servers by value (with :func:`.attribute.attribute`, which calls :func:`attribute_traced`), so it names
the attribution engine (:mod:`.engine`) and the options (:mod:`.options`) only inside functions that run on the
client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import nnsight
import torch

from ..envoy.edit_log import EDIT_LOG_TAG, Edit, EditLog
from ..envoy.frozen_attention import frozen_in
from ..envoy.nnsight_internals import (
    current_worker,
    find_worker,
    held_module,
    park_or_end,
    ran_since_start,
    serve_last,
    spawn_worker,
    traced_method,
)
from ..envoy.targets import Feature, LorsaHead, MHSAHead, Target, positions_index
from ..errors import ArgumentError, ConfigMismatchError, ShapeError, TraceOrderError, UnsupportedGenerationError
from .graph import HOST, LORSA, TRANSCODER
from .intervened_record import KEY_ATTR, to_record
from .layout import LiveNodes
from .replacement import layer_modules, transcoder_sites
from .trace import AttributionCache

if TYPE_CHECKING:
    from .graph import Graph
    from .options import AttributionOptions


class IntervenedAttribution:
    """What ``attribute(rm, tracer=tracer)`` returns inside a trace body: the pass's recording, and its
    graph once the trace is over.

    Attributes:
        replacement: the :class:`~nnsight_lorsa.envoy.replacement_model.ReplacementModel`.
        edits: the interventions reported so far (:class:`~..envoy.edit_log.Edit`), in order.

    Source: ours (attribution of an intervened nnsight trace; no peer has it).
    """

    # Graph, AttributionOptions and the engine are named only in quoted annotations and function-local imports:
    # this class travels by value to a server (a remote attribute(rm, tracer=tracer)), where their modules' imports
    # (pathlib, _thread, gc, bisect, ...) are outside NDIF's unpickling whitelist; the graph is built on the client.
    def __init__(self, replacement: Any, options: "AttributionOptions | dict[str, Any]") -> None:
        self.replacement = replacement
        self._options = options  # a dict: recorded on a server, checked at .graph (check_traced_call)
        self._log = EditLog(self._check_edit)
        self._saved: dict[str, Any] | None = None
        self._problem: Exception | None = None
        self._graph: "Graph | None" = None
        self._interleaver: Any = None
        self._lorsa_layers = set(layer_modules(replacement)[0])

    def __repr__(self) -> str:
        state = "graph built" if self._graph is not None else "recorded" if self._saved is not None else "recording"
        return f"IntervenedAttribution({state}, {len(self.edits)} edits)"

    def __reduce__(self) -> Any:
        """On a server, as the result of a remote request: a plain ``dict`` (:mod:`.intervened_record`), turned
        back into a handle on the client. Anywhere else it refuses (:class:`~..errors.TraceOrderError`)."""
        key = getattr(self.replacement, KEY_ATTR, None)  # the client bundle's id: a copy of it is the server's
        running = self._interleaver is not None and self._interleaver.interleaving
        if key is None or key == id(self.replacement) or running or (self._saved is None and self._problem is None):
            raise TraceOrderError(
                "attribute(rm, tracer=tracer): the handle travels only as the result of a remote request (a "
                "model.trace(..., remote=True) or model.session(remote=True) after nnsight_lorsa.remote.register(), "
                "which marks the bundle it names), once the pass is recorded; it cannot be pickled or sent "
                "otherwise: read handle.graph and save the graph (Graph.save)")
        return (dict, (to_record(key, self._saved, self._log.edits, self._options, self._problem),))

    @property
    def edits(self) -> list[Edit]:
        """The interventions recorded in the pass, in order (a copy).

        Source: ours (attribution of an intervened nnsight trace; no peer has it).
        """
        return list(self._log.edits)

    # ------------------------------------------------------------ checks (in the trace body)
    def _check_edit(self, target: Target) -> None:
        """Refuse, at the edit, an intervention whose effect the graph cannot hold."""
        adapter = self.replacement.adapter
        if isinstance(target, MHSAHead) and target.layer not in self._lorsa_layers:
            raise ConfigMismatchError(
                f"{target}: layer {target.layer} keeps its MHSA in the attribution graph (frozen patterns, no error "
                "node), so an edit of one of its heads cannot enter the graph of this pass; give layer "
                f"{target.layer} a Lorsa, or intervene on a Lorsa head or transcoder feature")
        if isinstance(target, Feature) and target.kind == "sae":
            site = str(target.site)
            held = [adapter.mlp_path(layer) for layer in range(adapter.n_layers)]
            held += [adapter.attention_path(layer) for layer in sorted(self._lorsa_layers)]
            if site not in held:
                raise ConfigMismatchError(
                    f"{target}: an SAE at {site!r} writes where the attribution graph has no error node, so an edit "
                    "of its features cannot enter the graph of this pass; SAE edits are held at an MLP output or "
                    "at the attention output of a layer with a Lorsa (in that site's error nodes)")

    # ------------------------------------------------------------ recording (a worker of the trace)
    def _record(self) -> None:
        """The recorder's body: one read per location the cached engine needs, in forward order."""
        me = current_worker("attribute(rm, tracer=tracer)")
        rm = self.replacement
        model, adapter = rm.model, rm.adapter
        lor, tcs = layer_modules(rm)
        # where a transcoder reads / writes off the MLP's call (circuit-tracer hooks; paths: strings only)
        read_at, post_at = off_call_paths(rm, tcs)
        # a cross-layer transcoder's splice sits at the root (model.clt): its features as the pass used them (edits on
        # model.clt.hook_sae_acts_post[layer] included), read where each layer's step runs
        clt = getattr(rm.transcoders, "clt", None)
        name = getattr(rm.transcoders, "attach_name", None)
        clt_env = getattr(model, name) if clt is not None and name and held_module(model, name) is clt else None

        def value(envoy: Any, what: str) -> Any:
            serve_last(me)  # after the body's edits and the splices' swaps at this location
            return getattr(envoy, what)

        def keep(t: torch.Tensor) -> torch.Tensor:
            return t.detach().clone()

        embed = model.get(adapter.embed_path)
        ids = value(embed, "input")
        if ids.dim() != 2 or ids.shape[0] != 1:
            self._problem = ShapeError(
                f"attribute(rm, tracer=tracer) attributes one prompt: the trace runs a batch of shape "
                f"{tuple(ids.shape)} (several prompts or invokes); trace one prompt")
            return
        emb = keep(value(embed, "output"))
        pos_path = getattr(adapter, "pos_embed_path", None)
        if pos_path:
            emb = emb + keep(value(model.get(pos_path), "output"))
        saved: dict[str, Any] = {"attn_in": {}, "attn_out": {}, "mlp_in": {}, "mlp_out": {}, "mlp_post_out": {},
                                 "z": {}, "acts": {}}
        positions = None
        for layer in range(adapter.n_layers):
            attn = model.get(adapter.attention_path(layer))
            if layer == 0 or layer in lor:
                args, kwargs = value(attn, "inputs")
                x = adapter.attention_input(args, kwargs)
                if layer == 0:
                    positions = keep(adapter.attention_positions(args, kwargs, x))
                if layer in lor:
                    saved["attn_in"][layer] = keep(x)
                    if held_module(attn, "lorsa") is lor[layer]:  # spliced: z as the pass used it
                        saved["z"][layer] = keep(value(attn.lorsa.hook_z, "output")[0])
                    saved["attn_out"][layer] = keep(adapter.attention_output(value(attn, "output")))
            if layer in read_at:  # the pre-MLP norm's input (io.read is applied on the client, in .graph)
                args, kwargs = value(model.get(read_at[layer]), "inputs")
                saved["mlp_in"][layer] = keep(adapter.mlp_input(args, kwargs))
            mlp = model.get(adapter.mlp_path(layer))
            if clt_env is not None:  # a spliced CLT: layer `layer`'s features, at the root (model.clt)
                acts_hook = clt_env.hook_sae_acts_post[layer] if layer in tcs else None
            else:
                spliced = layer in tcs and held_module(mlp, "transcoder") is tcs[layer]
                acts_hook = mlp.transcoder.hook_sae_acts_post if spliced else None
            if layer in tcs and layer not in read_at:
                args, kwargs = value(mlp, "inputs")
                saved["mlp_in"][layer] = keep(adapter.mlp_input(args, kwargs))
            if acts_hook is not None and layer not in post_at:  # the features as used (run at the MLP's output)
                saved["acts"][layer] = keep(value(acts_hook, "output")[0])
            saved["mlp_out"][layer] = keep(adapter.mlp_output(value(mlp, "output")))
            if layer in post_at:  # it runs at the post-MLP norm's output, which it replaces: after the MLP
                if acts_hook is not None:
                    saved["acts"][layer] = keep(value(acts_hook, "output")[0])
                saved["mlp_post_out"][layer] = keep(value(model.get(post_at[layer]), "output"))
        saved["last"] = keep(value(model.get(adapter.lm_head_path), "output")[0, -1])
        saved.update(tokens=ids[0].detach().to(HOST, torch.long), embeddings=emb, positions=positions)
        self._saved = saved

    def _run(self) -> None:
        finished, _ = park_or_end(self._record)
        if not finished and self._problem is None:
            self._problem = TraceOrderError(
                "attribute(rm, tracer=tracer): the trace ended before the model reached its unembedding "
                "(tracer.stop(), or an error in the body), so there is no complete pass to attribute")

    # ------------------------------------------------------------ the graph
    @property
    def graph(self) -> "Graph":
        """The attribution graph of the traced pass (built on the first read, then kept).

        Read it after the ``with model.trace(...)`` block (after the ``model.session()`` block when the
        trace runs in one). Nodes, values and edges as :func:`.attribute.attribute`'s
        (:class:`~.graph.Graph`, on the host), with the edited nodes marked — through :mod:`nnsight_lorsa.patching`
        or directly on an envoy, found by value (module docstring).

        Raises:
            TraceOrderError: read inside the trace (the pass is not over), or the trace ended early.
            ShapeError: the trace ran more than one prompt.
            ConfigMismatchError: (an fp32/fp64 model, computed in fp32/fp64) the graph's logits differ from the
                trace's by more than :data:`LOGIT_GAP_BOUND` of their scale — the trace changed the model where
                the graph cannot hold it (``graph.meta["logit_gap"]`` records the gap in every dtype).
            ConfigMismatchError, MemoryBudgetError: as :func:`.attribute.attribute` for the options (of a pass
                recorded on a server, also the call's checks of them: :func:`check_traced_call`).
            TypeError, ArgumentError: (a pass recorded on a server) as :func:`check_traced_call`.

        Source: ours (attribution of an intervened nnsight trace; no peer has it).
        """
        if self._graph is not None:
            return self._graph
        if self._problem is not None:
            raise self._problem
        if self._saved is None or (self._interleaver is not None and self._interleaver.interleaving):
            raise TraceOrderError(
                "attribute(rm, tracer=tracer).graph is the graph of the whole traced pass: read it after the "
                "`with model.trace(...)` block (after `model.session()` when the trace runs inside one)")
        s, n_pos = self._saved, int(self._saved["tokens"].numel())
        sites = transcoder_sites(self.replacement, layer_modules(self.replacement)[1])
        adapter = self.replacement.adapter
        mlp_in = {layer: sites[layer].read(x) if layer in sites and sites[layer].input_path != adapter.mlp_path(layer)
                  else x for layer, x in s["mlp_in"].items()}  # what each transcoder reads (MLPSiteIO.read)
        cache = AttributionCache(tokens=s["tokens"], positions=s["positions"], last_logits=s["last"],
                                 embeddings=s["embeddings"], attn_in=s["attn_in"], attn_out=s["attn_out"],
                                 mlp_in=mlp_in, mlp_out=s["mlp_out"], mlp_post_out=s.get("mlp_post_out", {}))
        live = LiveNodes(lorsa_z=s["z"], tc_acts=s["acts"], marks=self._marks(n_pos))
        options = self._options
        if isinstance(options, dict):  # recorded on a server: the call's settings, checked here, on the client
            options = check_traced_call(None, options)
        from .engine import build_graph  # the client's (this class travels by value; the engine does not)
        from .layout import direct_edit_names

        graph = build_graph(self.replacement, cache, live=live, options=options)
        graph.meta["intervened"] = [f"{e.target} at positions {_positions_name(e.positions)}" for e in self.edits]
        graph.meta["intervened"] += direct_edit_names(live)  # (the client's: the handle travels by value)
        graph.meta["logit_gap"] = gap = logit_gap(graph, s["last"])
        wide = (torch.float32, torch.float64)  # a half-precision model or dtype= rounds the graph's logits itself
        if s["last"].dtype in wide and (options.dtype is None or options.dtype in wide) and gap > LOGIT_GAP_BOUND:
            raise ConfigMismatchError(
                f"attribute(rm, tracer=tracer): the graph's logits differ from the trace's by {gap:.2e} of their "
                "scale: the trace changed the model where the graph has neither a node nor an error node (an edit "
                "of a decoder layer's output, of a frozen MHSA layer, ...), so this graph would not be of that pass. "
                "Edit Lorsa heads and transcoder features with nnsight_lorsa.patching (docs/attribution.md, "
                "'Attributing an intervened pass')")
        self._graph = graph
        return graph

    def _marks(self, n_pos: int) -> dict[tuple[int, int], torch.Tensor]:
        """``{(kind, layer): (pos, width) bool}`` of the edited Lorsa heads and transcoder features."""
        rm = self.replacement
        marks: dict[tuple[int, int], torch.Tensor] = {}
        for e in self._log.edits:
            t = e.target
            if isinstance(t, LorsaHead):
                key, width, col = (LORSA, t.layer), rm.lorsas[t.layer].cfg.n_ov_heads, t.head
            elif isinstance(t, Feature) and t.kind == "transcoder" and isinstance(t.site, int):
                key, width, col = (TRANSCODER, t.site), rm.transcoders.feature_module(t).cfg.d_sae, t.index
            else:  # carried by an error node (_check_edit)
                continue
            if key not in marks:
                marks[key] = torch.zeros(n_pos, width, dtype=torch.bool, device=HOST)
            rows = torch.zeros(n_pos, dtype=torch.bool, device=HOST)
            rows[positions_index(e.positions)] = True
            marks[key][rows, col] = True
        return marks


#: the largest relative gap between an intervened graph's logits and its trace's (fp32/fp64 models) taken
#: as rounding (measured ~1e-7 on the tests' models); above it the trace changed what the graph cannot hold
LOGIT_GAP_BOUND = 1e-3


def off_call_paths(replacement: Any, transcoders: dict[int, Any]) -> tuple[dict[int, str], dict[int, str]]:
    """``({layer: path}, {layer: path})``: the module whose input each of ``transcoders`` (``{layer: transcoder or
    CLTLayer}``) reads where that is not the MLP (the pre-MLP norm: ``hook_resid_mid``, ``ln2.hook_normalized`` on a
    norm with a gain), and the module whose output it writes where that is not the MLP (Gemma-2/3
    ``post_feedforward_layernorm``: ``hook_mlp_out``) — :func:`~..formats.hook_sites.mlp_site_io`, the sites its
    splice uses."""
    adapter = replacement.adapter
    sites = transcoder_sites(replacement, transcoders)
    reads = {layer: io.input_path for layer, io in sites.items() if io.input_path != adapter.mlp_path(layer)}
    writes = {layer: io.output_path for layer, io in sites.items() if io.output_path != adapter.mlp_path(layer)}
    return reads, writes


def logit_gap(graph: "Graph", last: torch.Tensor) -> float:
    """``max |graph logit − trace logit| / max |trace logit|`` over the graph's logit nodes, both demeaned
    (``last``: the trace's ``(vocab,)`` logits at the last position)."""
    ids = graph.logit_ids
    want = last.detach().to(HOST, torch.float64)
    want = want[graph.nodes.index[ids]] - want.mean()
    return float((graph.values[ids].double() - want).abs().max() / want.abs().max().clamp_min(1e-30))


def _positions_name(positions: Any) -> str:
    return "all" if positions is None else str(positions.tolist() if isinstance(positions, torch.Tensor) else positions)


def check_traced_call(prompt: Any, settings: dict[str, Any]) -> "AttributionOptions":
    """The checks of ``attribute(rm, prompt, tracer=tracer, **settings)`` that need no trace, on the client: at the
    call of a local trace (:func:`attribute_traced`), before a remote request is sent
    (:func:`.remote_handles.check_block_calls`) and at ``.graph`` of a pass recorded on a server. Returns the
    options.

    Raises:
        TypeError: a name that is not a setting (as :func:`.attribute.attribute`'s call).
        ArgumentError: an old setting name, a wrongly typed option (:class:`~.options.AttributionOptions`); a
            ``prompt`` with the tracer.
        ConfigMismatchError: a bad option value; ``remote`` or ``qk_heads`` with the tracer.
    """
    from .options import AttributionOptions  # the client's (this module travels by value; the options do not)

    options = AttributionOptions.of(settings, "attribute")
    if prompt is not None:
        raise ArgumentError("attribute(rm, prompt) attributes a clean pass, attribute(rm, tracer=tracer) the "
                            "traced one: pass one of them, not both")
    if options.remote or options.qk_heads:
        raise ConfigMismatchError("attribute(rm, tracer=tracer) attributes the traced pass: no remote=, no "
                                  "qk_heads= (the trace's own remote= decides where it runs)")
    return options


def attribute_traced(replacement: Any, prompt: Any, tracer: Any, settings: dict[str, Any]) -> IntervenedAttribution:
    """:func:`.attribute.attribute` with a ``tracer``: check the call, then :func:`start`. It runs where the trace
    body runs. In a local trace, here: the call's checks first (:func:`check_traced_call`, the replacement's), so a
    bad option raises at the call. On a server (``replacement`` is the server's copy of a bundle the request named:
    its :data:`~.intervened_record.KEY_ATTR` is not its own ``id``), where this module travels by value and the
    options' modules do not: ``settings`` stay a plain ``dict``, checked on the client before the request was sent
    (those the block spells as literals or names: :func:`.remote_handles.check_block_calls`) and when ``.graph`` is
    read.

    Raises:
        as :func:`check_traced_call`, :func:`.engine.check_replacement` (``in_trace``) and :func:`start`.
    """
    options: "AttributionOptions | dict[str, Any]" = settings
    if getattr(replacement, KEY_ATTR, None) in (None, id(replacement)):  # not a server's copy: checked here
        options = check_traced_call(prompt, settings)
        from .engine import check_replacement  # the client's

        check_replacement(replacement, in_trace=True)
    return start(replacement, tracer, options)


def start(replacement: Any, tracer: Any, options: "AttributionOptions | dict[str, Any]") -> IntervenedAttribution:
    """Start recording the running trace for its graph (``attribute(rm, tracer=tracer)``; see the module
    docstring). Called at the top of the trace body, before it reads anything. ``options``: checked
    (:class:`~.options.AttributionOptions`), or the call's settings as a ``dict`` (on a server; checked at
    ``.graph``). The handle is saved (``nnsight.save``): ``handle = attribute(rm, tracer=tracer)`` is there after
    the ``with`` block.

    Raises:
        ArgumentError: ``tracer`` is None.
        TraceOrderError: not inside a trace body of ``replacement.model``; the model already ran (the body read
            something first); a second ``attribute(rm, tracer=tracer)`` in the same trace.
        UnsupportedGenerationError: inside ``model.generate`` (one forward pass is attributed).
    """
    if tracer is None:
        raise ArgumentError("attribute(rm, tracer=...) needs the tracer of the running trace: "
                            "`with model.trace(prompt) as tracer: handle = attribute(rm, tracer=tracer)`")
    me = current_worker("attribute(rm, tracer=tracer)")
    interleaver = me.interleaver
    if getattr(replacement.model, "interleaver", None) is not interleaver:
        raise TraceOrderError("attribute(rm, tracer=tracer) must be called inside a trace of rm.model (this trace "
                              "runs another model)")
    if traced_method(interleaver) == "generate":
        raise UnsupportedGenerationError(
            "attribute(rm, tracer=tracer) attributes one forward pass: not inside model.generate(...); "
            "use model.trace(prompt)")
    adapter = replacement.adapter
    embed = replacement.model.get(adapter.embed_path)
    if ran_since_start(me, embed.path) > 0:
        raise TraceOrderError(
            "attribute(rm, tracer=tracer) must come at the top of the trace body, before anything is read "
            "(right after rm.replace()): the model already ran past its embeddings, so the pass can no longer "
            "be recorded")
    if find_worker(interleaver, EDIT_LOG_TAG) is not None:
        raise TraceOrderError("attribute(rm, tracer=tracer) is already recording this trace: call it once per "
                              "trace and read .graph of the handle it returned")
    if frozen_in(interleaver) is not None:  # its graph would freeze the live pass's patterns, not the record's
        raise ArgumentError(
            "attribute(rm, tracer=tracer) in a trace with frozen attention (prepare(frozen=...)): the graph would "
            "be of the live pass's patterns, not of the record's. Attribute the intervened trace without frozen "
            "attention, or read the frozen trace's logits only")
    handle = IntervenedAttribution(replacement, options)
    handle._interleaver = interleaver
    spawn_worker(interleaver, handle._run, EDIT_LOG_TAG).spec = handle._log
    return nnsight.save(handle)  # handed back by the with block like any saved value

