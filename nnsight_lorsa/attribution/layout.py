"""Which nodes a prompt has, and where each one's multiplier sits: the clean pass.

One ordinary forward (through nnsight) reads the inputs of every replaced attention and MLP,
from which the Lorsa heads' ``z`` and the transcoders' feature activations on the prompt are
computed (with error terms the replacement model reproduces the model exactly, so the clean
pass *is* the unmodified model). Those activations, the top-k/threshold choices they embody, and
the token list are then frozen; :class:`Layout` numbers every source node, which is also its
column in the multiplier matrix ``M`` of :mod:`.frozen`. torch only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .._placement import resident, to_module
from .._repr import FieldsRepr
from ..envoy.targets import Feature, LorsaHead, Target
from ..errors import ArgumentError, ConfigMismatchError
from .graph import ATTN_ERROR, BIAS, EMBEDDING, HOST, LOGIT, LORSA, MLP_ERROR, TRANSCODER, NodeTable
from .logit_targets import TOP_LOGITS, LogitTargets, target_logits


@dataclass(repr=False)
class LayerLayout(FieldsRepr):
    """One decoder layer's nodes.

    ``lorsa_pos/lorsa_head/lorsa_z``: ``(n,)`` active Lorsa heads (position, OV head, ``z``);
    ``tc_pos/tc_feat/tc_act``: ``(m,)`` active transcoder features; ``lorsa_fixed`` / ``tc_fixed``:
    ``(n,)`` / ``(m,)`` bool, the nodes held at an intervened value (:class:`LiveNodes`: no incoming
    edges; empty when none is); ``*_start``: first column in
    ``M`` of each block (``attn_err_start``/``mlp_err_start`` span ``n_pos`` columns, one per
    position; ``attn_err_start`` is None where the attention is a frozen MHSA); ``bias``: column of
    each bias node of the layer by role (``attn_norm``, ``attn_v``, ``attn_o``, ``lorsa_v``,
    ``lorsa_d``, ``mlp_norm``, ``tc_dec``, ``tc_enc``); ``tc_reads`` / ``tc_writes``: where the transcoder reads
    and writes (:func:`.replacement.site_kinds`: ``"mlp"`` the MLP module's call; reads ``"norm_input"`` the pre-MLP
    norm's input, ``hook_resid_mid``, or ``"normalized"`` its ``x / rms(x)`` before the gain,
    ``ln2.hook_normalized``; writes ``"post_norm"`` the post-MLP norm's output, Gemma-2/3 ``hook_mlp_out``).
    """

    layer: int
    lorsa: Any = None
    lorsa_pos: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long, device=HOST))
    lorsa_head: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long, device=HOST))
    lorsa_z: torch.Tensor = field(default_factory=lambda: torch.zeros(0, device=HOST))
    lorsa_start: int = 0
    attn_err_start: int | None = None
    transcoder: Any = None
    tc_pos: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long, device=HOST))
    tc_feat: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long, device=HOST))
    tc_act: torch.Tensor = field(default_factory=lambda: torch.zeros(0, device=HOST))
    tc_start: int = 0
    tc_reads: str = "mlp"
    tc_writes: str = "mlp"
    lorsa_fixed: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool, device=HOST))
    tc_fixed: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool, device=HOST))
    mlp_err_start: int = 0
    bias: dict[str, int] = field(default_factory=dict)


@dataclass(repr=False)
class Layout(FieldsRepr):
    """All nodes of one prompt's graph and their multiplier columns. Its tensors (and its layers') live on
    the host (:data:`.graph.HOST`), whatever the model's device: the frozen pass copies what it needs.

    Attributes:
        tokens: ``(pos,)`` int64 input ids.
        layers: one :class:`LayerLayout` per decoder layer.
        emb_start: first embedding column (``n_pos`` of them).
        n_sources: columns of ``M`` (every node but the logits).
        n_features: number of feature nodes (Lorsa heads + transcoder features): columns
            ``[0, n_features)`` and target rows ``[0, n_features)``.
        bias: columns of the bias nodes after the last layer (``final_norm``, ``lm_head``).
        logit_tokens: ``(n_logits,)`` int64 target tokens at the last position.
        logit_probs: ``(n_logits,)`` their probabilities on the prompt.
        nodes: the :class:`NodeTable` of every node (sources then logits).
    """

    tokens: torch.Tensor
    layers: list[LayerLayout]
    emb_start: int
    n_sources: int
    n_features: int
    bias: dict[str, int]
    logit_tokens: torch.Tensor
    logit_probs: torch.Tensor
    nodes: NodeTable

    @property
    def n_pos(self) -> int:
        return int(self.tokens.numel())

    @property
    def n_logits(self) -> int:
        return int(self.logit_tokens.numel())

    @property
    def n_targets(self) -> int:
        """Rows an attribution can compute: every feature node, then every logit."""
        return self.n_features + self.n_logits

    def decoder_targets(self, layer: int) -> int:
        """How many replaced MLPs the transcoder at ``layer`` writes into: 1 for a per-layer transcoder, every
        replaced layer ``≥ layer`` for a cross-layer transcoder's layer (0 without a transcoder). Each is one
        set of node vectors in the frozen pass (one grid, or gathered: :func:`.frozen.choose`)."""
        tc = self.layers[layer].transcoder
        if tc is None:
            return 0
        decoders = getattr(tc, "decoders", None)
        if not callable(decoders):
            return 1
        return sum(1 for target in decoders(layer) if target < len(self.layers)
                   and self.layers[target].transcoder is not None)


#: rounding steps (``finfo(dtype).eps`` of the coarser of the pass's and the recomputation's dtypes) within which
#: a traced pass's node value counts as its encoder's: :meth:`LiveNodes.held`'s bound, relative to the layer's scale
#: (measured on the tests' models, unedited: 0 where both run in one dtype; ≤ 0.81 eps for a bf16 or fp16 pass
#: recomputed in fp32 or the reverse, ``dtype=``)
DIRECT_EDIT_STEPS = 8


def direct_edit_bound(*dtypes: torch.dtype) -> float:
    """:data:`DIRECT_EDIT_STEPS` × the largest ``finfo(dtype).eps`` of the floating ``dtypes``: the relative gap (to
    the layer's scale) above which a traced pass's node value is an edit, not rounding (fp32 ≈ 9.5e-7, bf16 0.0625,
    fp16 ≈ 0.0078)."""
    return DIRECT_EDIT_STEPS * max(torch.finfo(d).eps for d in dtypes if d.is_floating_point)


@dataclass(repr=False)
class LiveNodes(FieldsRepr):
    """The node values of one traced forward pass as it ran (edits included), which take the place of
    those :func:`build_layout` computes from the pass's inputs (``attribute(rm, tracer=tracer)``,
    :mod:`.intervened`). Tensors on any device.

    Attributes:
        lorsa_z: ``{layer: (pos, n_ov_heads)}`` each Lorsa's ``z`` (its ``hook_z`` output, after edits).
        tc_acts: ``{layer: (pos, d_sae)}`` each transcoder's features (``hook_sae_acts_post``, after edits).
        marks: ``{(kind, layer): (pos, width) bool}`` the nodes edited through :mod:`nnsight_lorsa.patching`
            (``kind`` :data:`.graph.LORSA` or :data:`.graph.TRANSCODER`): they are nodes whatever their value (an
            ablated one at 0), held at it as fixed inputs (no incoming edges) and marked
            :attr:`.graph.NodeTable.intervened`.
        direct: ``{(kind, layer): (pos, width) bool}`` on the host, filled by :func:`build_layout`
            (:meth:`held`): the nodes edited directly on an envoy (``hook_z``, ``hook_sae_acts_post``), found by
            their value; held and marked as ``marks``' (not repeated here when also in ``marks``).
    """

    lorsa_z: dict[int, torch.Tensor] = field(default_factory=dict)
    tc_acts: dict[int, torch.Tensor] = field(default_factory=dict)
    marks: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    direct: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)

    def mark(self, kind: int, layer: int, like: torch.Tensor) -> torch.Tensor:
        """``like``-shaped bool: the edited nodes of ``kind`` at ``layer``, on ``like``'s device."""
        m = self.marks.get((kind, layer))
        if m is None:
            return torch.zeros(like.shape, dtype=torch.bool, device=like.device)
        return m.to(like.device)

    def held(self, kind: int, layer: int, value: torch.Tensor, pre: torch.Tensor, active: torch.Tensor,
             kept: torch.Tensor) -> torch.Tensor:
        """``(pos, width)`` bool on ``value``'s device: the nodes of ``kind`` at ``layer`` held at the pass's value —
        those edited through :mod:`nnsight_lorsa.patching` (:attr:`marks`) and those edited directly on an envoy,
        recorded in :attr:`direct`.

        A node is edited directly where its value in the pass is non-zero and differs from ``pre`` — what its
        computed row would sum to: the encoder's pre-activation recomputed from the pass's recorded input (a
        Lorsa head's ``z_pre``, a transcoder feature's ``x·W_enc + b_enc``; an active node's value) — by more than
        :func:`direct_edit_bound` of ``value``'s and ``pre``'s dtypes times the layer's scale, the largest
        ``|active|`` (the recomputed, unedited activations) at the ``kept`` positions. So a steered or scaled
        node, and one an edit made active where the encoder had it inactive (its pre-activation not its value),
        are held; an unedited pass marks nothing (rounding stays far below the bound); a node zeroed by an edit
        is no node.

        Args:
            value: ``(pos, width)`` the pass's values (edits included).
            pre: ``(pos, width)`` the recomputed pre-activations.
            active: ``(pos, width)`` the recomputed activations (zeros where inactive).
            kept: ``(pos, 1)`` bool, the positions that have nodes (``zero_positions``).
        """
        marked = self.mark(kind, layer, value) & kept
        pre, active, kept = pre.to(value.device), active.to(value.device), kept.to(value.device)
        scale = float((active.double().abs() * kept).max()) if active.numel() else 0.0
        bound = direct_edit_bound(value.dtype, pre.dtype) * scale
        direct = (value != 0) & ((value.double() - pre.double()).abs() > bound) & kept & ~marked
        if bool(direct.any()):
            self.direct[(kind, layer)] = direct.to(HOST)
        else:
            self.direct.pop((kind, layer), None)
        return marked | direct


def direct_edit_names(live: LiveNodes) -> list[str]:
    """``graph.meta["intervened"]``'s entries of the nodes edited directly on an envoy
    (:attr:`LiveNodes.direct`, filled when the graph was built), one per head or feature, in layer order:
    ``"LorsaHead(layer=1, head=17) at positions [3] (direct edit)"``, a per-layer transcoder's or a CLT's feature as
    ``"Feature(site=layer, index=..., kind='transcoder') at positions [...] (direct edit)"``."""
    names = []
    for (kind, layer), mask in sorted(live.direct.items(), key=lambda kv: (kv[0][1], kv[0][0] != LORSA)):
        for col in mask.any(dim=0).nonzero().flatten().tolist():
            target: Target = LorsaHead(layer, col) if kind == LORSA else Feature(layer, col, kind="transcoder")
            names.append(f"{target} at positions {mask[:, col].nonzero().flatten().tolist()} (direct edit)")
    return names


LORSA_OUT: frozenset[str] = frozenset({"W_O", "b_D"})
"""A Lorsa's output projection: what its heads (:meth:`~nnsight_lorsa.modules.lorsa.Lorsa.heads`, the clean pass of
:func:`build_layout`) do not read — left on the host when an offloaded Lorsa is fetched for them
(``resident(lorsa, device, LORSA_OUT)``; with ``W_V`` / ``b_V`` its OV circuit, :data:`.offload.LORSA_OV`)."""


def coder_decoders(owner: torch.nn.Module) -> frozenset[str]:
    """The output side of a transcoder (or a cross-layer transcoder, ``owner``): every decoder ``W_dec…`` and the
    skip matrix ``W_skip`` — what its encoder (the clean pass of :func:`build_layout`) does not read, left on the
    host when an offloaded one is fetched for it (its ``b_dec`` is fetched: an SAE's encoder may subtract it)."""
    return frozenset(name for name, _ in owner.named_parameters() if name == "W_skip" or name.startswith("W_dec"))


LAYER_STACKS: dict[str, int] = {"W_enc": 3, "b_enc": 2, "W_skip": 3}
"""The tensors a cross-layer transcoder (:class:`~nnsight_lorsa.modules.clt.CrossLayerTranscoder`) stacks over its
layers, each with its dimension so stacked (``W_enc (n_layers, d, f)``, ``b_enc (n_layers, f)``, ``W_skip
(n_layers, d, d)``; a per-layer transcoder's have one fewer): what :func:`coder_layer_parts` may copy one layer of."""

ENCODER_PARTS: tuple[str, ...] = ("W_enc", "b_enc")
"""What a cross-layer transcoder layer's encoder (the clean pass of :func:`build_layout`) reads one layer of."""

SITE_PARTS: tuple[str, ...] = ("W_skip",)
"""What a cross-layer transcoder layer's MLP site in the frozen pass (:meth:`.replacement.FrozenReplacement.mlp`)
reads one layer of inside its ``resident`` block: :meth:`~nnsight_lorsa.modules.clt.CLTLayer.skip`'s ``W_skip``."""


def stacked(owner: Any, name: str) -> bool:
    """Whether ``owner``'s tensor ``name`` (a key of :data:`LAYER_STACKS`) is a cross-layer transcoder's stack of
    every layer's (a per-layer transcoder's, or none: False)."""
    t = getattr(owner, name, None)
    return isinstance(t, torch.Tensor) and t.dim() == LAYER_STACKS[name]


def coder_layer_parts(tc: Any, names: tuple[str, ...]) -> dict[str, int]:
    """``{name: index}`` of the tensors ``names`` (:data:`ENCODER_PARTS`, :data:`SITE_PARTS`) of ``tc``'s weights
    owner that a ``resident`` block for ``tc`` copies one index of (``resident``'s ``parts``): a cross-layer
    transcoder layer's (:class:`~nnsight_lorsa.modules.clt.CLTLayer`) ``name[layer]`` of each stacked one
    (:func:`stacked`), not the stacks of every layer; none for a per-layer transcoder or an SAE (its tensors are its
    layer's, copied whole)."""
    owner = tc.weights_owner
    return {} if owner is tc else {name: tc.layer for name in names if stacked(owner, name)}


def _nonzero(v: torch.Tensor | None) -> bool:
    return v is not None and bool((v != 0).any())


def build_layout(
    tokens: torch.Tensor,
    attn_inputs: dict[int, tuple[torch.Tensor, torch.Tensor]],
    mlp_inputs: dict[int, torch.Tensor],
    last_logits: torch.Tensor,
    modules: dict[str, Any],
    *,
    n_layers: int,
    targets: LogitTargets | tuple[int, ...] = TOP_LOGITS,
    zero_positions: int = 0,
    live: LiveNodes | None = None,
) -> Layout:
    """Number every node of the prompt.

    Args:
        tokens: ``(pos,)`` input ids.
        attn_inputs: ``{layer: (x, positions)}`` — the attention input ``(1, pos, d_model)`` and
            token positions of each layer that has a Lorsa.
        mlp_inputs: ``{layer: x (1, pos, d_model)}`` — what the transcoder of each layer with one reads (the MLP
            input, or the tensor its circuit-tracer hooks name: :func:`~..formats.hook_sites.mlp_site_io`).
        last_logits: ``(vocab,)`` logits at the last position.
        modules: ``lorsas`` / ``transcoders`` (``{layer: module}``), ``attn_biases``
            (``{layer: (b_V, b_O)}`` of the frozen MHSA layers), ``norm_biases``
            (``{name: tensor | None}`` for ``L{l}.attn_norm``, ``L{l}.mlp_norm``, ``final_norm``),
            ``lm_head_bias``, ``tc_sites`` (``{layer: (reads, writes)}``, :func:`.replacement.site_kinds`; a
            layer not in it: ``("mlp", "mlp")``).
        targets: the logit targets (:func:`.logit_targets.target_logits`: the top-logit policy, or token ids).
        zero_positions: the first this many positions get no feature / Lorsa-head nodes: their
            transcoder and Lorsa outputs are carried by those positions' error nodes (circuit-tracer
            zeroes position 0, the BOS token, in its graphs). Sums stay exact.
        live: the node values of the traced pass the graph is of (:class:`LiveNodes`), used instead of
            those computed from ``attn_inputs`` / ``mlp_inputs`` where given; its marked nodes are nodes
            whatever their value.

    Raises:
        ArgumentError: ``zero_positions`` not an int.
        ConfigMismatchError: ``zero_positions`` outside ``[0, pos)``, or a target id outside the vocabulary.
    """
    n_pos = int(tokens.numel())
    if not isinstance(zero_positions, int) or isinstance(zero_positions, bool):
        raise ArgumentError(f"zero_positions must be an int, got {zero_positions!r}")
    if not 0 <= zero_positions < n_pos:
        raise ConfigMismatchError(f"zero_positions must be an int in [0, {n_pos}) for this {n_pos}-token prompt, "
                                  f"got {zero_positions!r}")
    lorsas, transcoders = modules.get("lorsas", {}), modules.get("transcoders", {})
    norm_biases, attn_biases = modules.get("norm_biases", {}), modules.get("attn_biases", {})
    layers: list[LayerLayout] = []
    feats: list[NodeTable] = []
    col = 0
    with torch.no_grad():
        for layer in range(n_layers):
            lay = LayerLayout(layer)
            if layer in lorsas:
                lorsa = lorsas[layer]
                x, positions = attn_inputs[layer]
                # the Lorsa runs where its weights are (offloaded: copied to x's device for this call, all but
                # its output projection); its inputs go there, the nodes to the host
                with resident(lorsa, x.device, LORSA_OUT):
                    xm = to_module(x, lorsa)
                    # the heads' activations only: the Lorsa's output (a dense z W_O) is not needed here
                    z_pre, z_all, _ = lorsa.heads(xm, positions.to(xm.device))
                traced = live is not None and layer in live.lorsa_z
                z = live.lorsa_z[layer] if live is not None and traced else z_all[0]
                kept = (torch.arange(n_pos, device=z.device) >= zero_positions)[:, None]
                z = z * kept
                # a traced pass: its edited heads, through nnsight_lorsa.patching or directly on hook_z
                if live is None:
                    fixed = torch.zeros_like(z, dtype=torch.bool)
                else:
                    fixed = (live.held(LORSA, layer, z, z_pre[0], z_all[0], kept) if traced
                             else live.mark(LORSA, layer, z) & kept)
                pos, head = ((z > 0) | fixed).nonzero(as_tuple=True)
                lay.lorsa, lay.lorsa_pos, lay.lorsa_head = lorsa, pos.to(HOST), head.to(HOST)
                lay.lorsa_z = z[pos, head].to(HOST)
                lay.lorsa_fixed = fixed[pos, head].to(HOST)
                lay.lorsa_start = col
                col += pos.numel()
                feats.append(NodeTable.make(LORSA, layer, pos, head, lay.lorsa_z, intervened=lay.lorsa_fixed))
            if layer in transcoders:
                tc = transcoders[layer]
                owner = tc.weights_owner  # a CLT layer computes with its CLT's weights
                x = mlp_inputs[layer]
                traced = live is not None and layer in live.tc_acts
                # offloaded: its encoder copied (a CLT: this layer's), its decoders left on the host
                with resident(owner, x.device, coder_decoders(owner), coder_layer_parts(tc, ENCODER_PARTS)):
                    xm = to_module(x, owner)
                    if traced:  # also the pre-activations its nodes' rows sum to (FrozenReplacement.mlp's targets),
                        # from the same encoder matmul as the features
                        both = tc.encode_and_pre(xm)
                        encoded, pre = both[0][0], both[1][0]
                    else:
                        encoded, pre = tc.encode(xm)[0], None
                acts = live.tc_acts[layer] if live is not None and traced else encoded
                kept = (torch.arange(n_pos, device=acts.device) >= zero_positions)[:, None]
                acts = acts * kept
                # its edited features, through nnsight_lorsa.patching or directly on hook_sae_acts_post
                if live is None:
                    fixed = torch.zeros_like(acts, dtype=torch.bool)
                else:
                    fixed = (live.held(TRANSCODER, layer, acts, pre, encoded, kept) if pre is not None
                             else live.mark(TRANSCODER, layer, acts) & kept)
                pos, feat = ((acts != 0) | fixed).nonzero(as_tuple=True)
                lay.transcoder, lay.tc_pos, lay.tc_feat = tc, pos.to(HOST), feat.to(HOST)
                lay.tc_reads, lay.tc_writes = modules.get("tc_sites", {}).get(layer, ("mlp", "mlp"))
                lay.tc_act = acts[pos, feat].to(HOST)
                lay.tc_fixed = fixed[pos, feat].to(HOST)
                lay.tc_start = col
                col += pos.numel()
                feats.append(NodeTable.make(TRANSCODER, layer, pos, feat, lay.tc_act, intervened=lay.tc_fixed))
            layers.append(lay)
        n_features = col
        errors: list[NodeTable] = []
        ar = torch.arange(n_pos, device=HOST)
        for lay in layers:
            if lay.lorsa is not None:
                lay.attn_err_start = col
                col += n_pos
                errors.append(NodeTable.make(ATTN_ERROR, lay.layer, ar, -1))
            lay.mlp_err_start = col
            col += n_pos
            errors.append(NodeTable.make(MLP_ERROR, lay.layer, ar, -1))
        emb_start = col
        col += n_pos
        emb = NodeTable.make(EMBEDDING, -1, ar, tokens)
        # bias nodes: every non-zero bias the frozen replacement model adds
        names: list[str] = []
        bias_layers: list[int] = []

        def add(name: str, layer: int) -> int:
            nonlocal col
            names.append(name)
            bias_layers.append(layer)
            col += 1
            return col - 1

        for lay in layers:  # in forward order: (role, name, bias) of each bias the layer adds
            l_ = lay.layer
            biases = [("attn_norm", f"L{l_}.attn_norm.bias", norm_biases.get(f"L{l_}.attn_norm"))]
            if lay.lorsa is not None:
                lorsa = lay.lorsa
                biases += [("lorsa_v", f"L{l_}.lorsa.b_V", lorsa.b_V), ("lorsa_d", f"L{l_}.lorsa.b_D", lorsa.b_D)]
            else:
                b_v, b_o = attn_biases.get(l_, (None, None))
                biases += [("attn_v", f"L{l_}.attn.b_V", b_v), ("attn_o", f"L{l_}.attn.b_O", b_o)]
            biases.append(("mlp_norm", f"L{l_}.mlp_norm.bias", norm_biases.get(f"L{l_}.mlp_norm")))
            if lay.transcoder is not None:
                tc, name = lay.transcoder, f"L{l_}.transcoder"
                biases += [("tc_dec", f"{name}.b_dec", tc.b_dec), ("tc_enc", f"{name}.b_enc", tc.b_enc)]
            for role, name, bias in biases:
                if _nonzero(bias):
                    lay.bias[role] = add(name, l_)
        top: dict[str, int] = {}
        if _nonzero(norm_biases.get("final_norm")):
            top["final_norm"] = add("final_norm.bias", n_layers)
        if _nonzero(modules.get("lm_head_bias")):
            top["lm_head"] = add("lm_head.bias", n_layers)
        bias_nodes = NodeTable.make(BIAS, torch.tensor(bias_layers, dtype=torch.long, device=HOST),
                                    torch.full((len(names),), -1, device=HOST), torch.arange(len(names), device=HOST))
        ids, probs = target_logits(last_logits, targets, final=modules.get("final_logits"))
        logits = NodeTable.make(LOGIT, n_layers, torch.full((ids.numel(),), n_pos - 1, device=HOST), ids, probs)
        nodes = NodeTable.cat([*feats, *errors, emb, bias_nodes, logits])
        nodes.bias_names = names
    return Layout(tokens=tokens.to(HOST), layers=layers, emb_start=emb_start, n_sources=col, n_features=n_features,
                  bias=top, logit_tokens=ids, logit_probs=probs, nodes=nodes)
