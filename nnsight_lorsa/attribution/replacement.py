"""The frozen replacement model: which modules replace which parts, and its forward with every
node's multiplier (Ameisen et al. 2025, *Circuit Tracing*: frozen-Jacobian attribution with error nodes;
docs/attribution.md).

:class:`FrozenReplacement` is called at each site of the model in forward order (by the nnsight
engine in :mod:`.trace`, by the cached engine in :mod:`.cached` — the same arithmetic): it returns
what the frozen model writes there and records the target pre-activations. Afterwards
``targets()`` is ``T: (batch, n_targets)``: the pre-activations of every feature node (a
transcoder feature's ``x·W_enc[:, f] + b_enc[f]``; a Lorsa head's ``z_pre = Σ_j A_ij v_j``,
Lorsa §3.1) followed by the demeaned logits of the target tokens.

The MLP replacements are seen per layer (a CLT as :class:`~nnsight_lorsa.modules.clt.CLTLayer` views): a
per-layer (skip) transcoder at layer ``l`` writes only into MLP output ``l``; a cross-layer transcoder's
layer-``l`` features write into every MLP output ``l' ≥ l`` (Ameisen et al. 2025, *Circuit Tracing*,
cross-layer transcoders), one node whose multiplier scales all its
writes. In another dtype than the model's (``dtype=torch.float32`` for a bf16 model) the Lorsas,
transcoders and frozen MHSA weights are used as copies (:func:`copies_in`, :func:`weights_in`; the
user's modules are untouched), while the model's own modules still run in bf16 on batch row 0 for
the frozen constants: edge sums are then exact to fp32 rounding instead of ~1 % of a row's mass.

torch only.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Collection
from typing import Any

import torch
import torch.nn.functional as F

from .._placement import HOST, fetch, offloaded, pinned, resident, to_module
from .._typing import Float
from ..adapters.base import ArchitectureAdapter, mhsa_pattern, mhsa_qk
from ..envoy.nnsight_internals import hf_module
from ..errors import ArgumentError, ConfigMismatchError, NotReadyError, PlacementError, UnsupportedArchitectureError
from ..formats.hook_sites import MLPSiteIO, has_resid_mid, hook_record, mlp_site_io
from .frozen import (
    GatheredNodes,
    GridNodes,
    PatternRows,
    PositionSlots,
    choose,
    column,
    frozen_mhsa,
    frozen_norm,
    keeps_pattern,
    norm_scale,
    normalized_input,
    per_position,
    scaled,
    streamed_linear,
    take_rows,
    z_pre,
)
from .layout import SITE_PARTS, Layout, coder_layer_parts
from .offload import LORSA_OV, coder_site_leave


def first(positions: torch.Tensor) -> torch.Tensor:
    """Positions of batch row 0 (``(pos,)`` positions are shared already)."""
    return positions[:1] if positions.dim() == 2 else positions


def on(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A constant of a replacement module (weight, bias) on ``like``'s device and in its dtype: the frozen
    model computes where the site's input is (a no-op where they agree). Detached: a parameter that requires grad
    would make its product keep the other factor (a prompt copy's input) for a gradient never taken."""
    return t.detach().to(device=like.device, dtype=like.dtype)


def into(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x`` moved to a module's boundary: the device and dtype of its ``weight`` (the module runs where it
    is; its result is moved back by the caller)."""
    return x.to(device=weight.device, dtype=weight.dtype)


def held(targets: torch.Tensor, fixed: torch.Tensor) -> torch.Tensor:
    """``(batch, n)`` targets with the ``fixed`` ones (``(n,)`` bool: nodes held at an intervened value,
    :class:`~.layout.LiveNodes`) cut from the multipliers: their rows come out zero, and no influence
    flows upstream through them (a fixed input, like an embedding)."""
    if not bool(fixed.any()):
        return targets
    return torch.where(fixed.to(targets.device), targets.detach(), targets)


class FrozenReplacement:
    """One frozen forward over ``batch`` copies of the prompt (see the module docstring).

    Args:
        layout: the prompt's nodes (:func:`.layout.build_layout`).
        M: ``(batch, layout.n_sources)`` multipliers, all ones, ``requires_grad=True``.
        mhsa: ``{layer: MHSAWeights}`` of the layers whose attention stays a frozen MHSA.
        constants: the frozen quantities (norm scales, attention patterns, error vectors) of an
            earlier forward over the same prompt, to run an intervened model with them (default: a
            new dict, filled by this forward).
        patterns: ``"auto"`` (store attention patterns on CPU, only queries/keys on GPU), ``"store"``
            or ``"sdpa"`` (see :func:`.frozen.frozen_mhsa`); the first half of :func:`memory_modes`.
        node_vectors: ``"grid"`` (decoder rows / ``w_o`` / encoder columns of the active nodes copied
            onto per-position grids: fastest, ``n·d_model`` kept per site), ``"gather"`` (gathered from
            the weights chunk by chunk in every pass: nothing kept per node) or ``"auto"`` (grid while a
            site's copy fits :data:`.frozen.GRID_BUDGET_BYTES`); see :mod:`.frozen`.
        dtype: what the frozen model computes and writes into the residual stream in (default: the
            model's); e.g. fp32 for a bf16 model, with the replacement modules and MHSA weights given
            in it (:func:`copies_in`, :func:`weights_in`).
        offload_rows: where the active nodes' rows of *offloaded* modules live (:data:`.offload.RowsPlace`;
            :func:`.offload.rows_placement` decides it per call): ``"host"`` (gathered on the host, kept there pinned
            and copied to the site's device for each pass only), ``"device"`` (gathered once where the pinned weight
            is, the rows alone copied to the site's device, and read in place by every pass; their bytes in
            :attr:`device_rows`), or a collection of block keys (:func:`.offload.offload_blocks`: e.g.
            ``"L3.lorsa.w_v"``, ``"L0.tc.w_dec->2"``): those kept on the device, the rest on the host. Modules that
            are not offloaded are read as they are either way.
    """

    def __init__(self, layout: Layout, M: torch.Tensor, mhsa: dict[int, Any],
                 constants: dict[str, torch.Tensor] | None = None, patterns: str = "auto",
                 node_vectors: str = "auto", dtype: torch.dtype | None = None,
                 offload_rows: str | Collection[str] = "host") -> None:
        if isinstance(offload_rows, str) and offload_rows not in ("host", "device"):
            raise ArgumentError(f"FrozenReplacement(offload_rows=...) must be 'host', 'device' or a collection of "
                                f"block keys, got {offload_rows!r}")
        self.layout = layout
        self.M = M
        self.mhsa = mhsa
        self.constants: dict[str, torch.Tensor] = {} if constants is None else constants
        self.patterns = patterns
        self.node_vectors = node_vectors
        self.dtype = dtype
        self.offload_rows: str | frozenset[str] = (offload_rows if isinstance(offload_rows, str)
                                                    else frozenset(offload_rows))
        #: ``{key: bytes}`` the offloaded modules' rows kept on the device (``offload_rows`` ``"device"`` or the key
        #: among the kept ones): each gathering site's distinct rows, each Lorsa layer's ``W_V`` rows
        #: (:func:`.offload.offload_terms`' kept term)
        self.device_rows: dict[str, int] = {}
        self._nodes: dict[str, GridNodes | GatheredNodes] = {}
        self._slots: dict[str, PositionSlots] = {}
        self._grids: dict[str, torch.Tensor] = {}
        self._features: list[torch.Tensor] = []
        self._logits: torch.Tensor | None = None
        self._M_on: dict[torch.device, torch.Tensor] = {M.device: M}
        self._mhsa_on: dict[int, Any] = {}
        self._reads: dict[int, torch.Tensor] = {}  # a transcoder's input kept from its pre-MLP norm site
        self._skips: dict[int, torch.Tensor | None] = {}  # a post-norm writer's skip path, from its MLP site
        #: ``{layer: (1, pos, d_model)}`` a post-norm writer's reference output (a traced pass's post-norm output,
        #: :attr:`.trace.AttributionCache.mlp_post_out`); a layer not in it: the frozen post-norm of the MLP output
        self.post_refs: dict[int, torch.Tensor] = {}

    def mult(self, device: torch.device) -> torch.Tensor:
        """The multipliers on ``device`` (a site's device: one copy per device of a model spread over several,
        made once; the gradient flows back to ``M``)."""
        if device not in self._M_on:
            self._M_on[device] = self.M.to(device)
        return self._M_on[device]

    def mhsa_on(self, layer: int, device: torch.device) -> Any:
        """The frozen MHSA weights of ``layer`` on ``device`` (copied once where they are elsewhere)."""
        if layer not in self._mhsa_on:
            self._mhsa_on[layer] = weights_in(self.mhsa[layer], device=device)
        return self._mhsa_on[layer]

    def store_patterns(self, x: torch.Tensor) -> bool:
        """Keep attention patterns (CPU: fastest backward) or only queries/keys (GPU: SDPA, no pattern
        stored); ``self.patterns`` overrides (``"store"`` / ``"sdpa"``)."""
        return self.patterns == "store" or (self.patterns == "auto" and x.device.type == "cpu")

    def slots(self, key: str, pos: torch.Tensor, n_groups: int | None = None) -> PositionSlots:
        """The :class:`~.frozen.PositionSlots` of one site's nodes (cached); groups: the prompt's
        positions, or ``n_groups`` other ids."""
        if key not in self._slots:
            self._slots[key] = PositionSlots(pos, self.layout.n_pos if n_groups is None else n_groups)
        return self._slots[key]

    def keeps(self, module: Any, key: str | None = None) -> bool:
        """Whether ``module``'s active rows of the block ``key`` (:func:`.offload.offload_blocks`) are kept on the
        device: ``module`` offloaded, with ``offload_rows="device"`` or ``key`` among the kept keys."""
        rows = self.offload_rows
        return (rows == "device" or (not isinstance(rows, str) and key in rows)) and offloaded(module)

    def nodes(self, key: str, slot_key: str, pos: torch.Tensor, W: torch.Tensor, idx: torch.Tensor,
              like: torch.Tensor, copies: int = 1, owner: Any = None) -> GridNodes | GatheredNodes:
        """Writer/reader of the nodes at positions ``pos`` whose vectors are ``W[idx]`` (cached per
        ``key``; ``slot_key`` names the position grid, shared by sites with the same nodes; ``copies``: how many
        such sets the same nodes keep, for :func:`.frozen.choose`; ``owner``: the module whose weight ``W`` is —
        offloaded, its rows are gathered on the device once where :meth:`keeps` says so)."""
        if key not in self._nodes:
            pos = pos.to(like.device)
            keep = self.keeps(owner, key)
            if choose(self.node_vectors, idx.numel(), W.shape[-1], like.dtype, copies) == "grid":
                slots = self.slots(slot_key, pos)
                with torch.no_grad():  # the active nodes' rows, gathered where W is, then moved to the site (kept,
                    # offloaded: only the rows copied — :func:`.offload.offload_terms`'s fetch, not the whole of W)
                    src = take_rows(W.detach(), idx.to(W.device))
                    self._nodes[key] = GridNodes(slots, slots.grid(on(fetch(src, like.device) if keep else src, like)))
            elif keep:  # offloaded, rows kept: the nodes' distinct rows gathered on the site's device from one
                # non_blocking copy of the (pinned) weight, once (a host gather of up to the whole weight, and its
                # unpinned copy, is what made the frozen forward slow on an H200: docs/attribution.md); every pass
                # reads them in place. The weight's copy is transient: :func:`.offload.offload_terms`'s fetch
                rows, at = torch.unique(idx.to(like.device), return_inverse=True)
                with torch.no_grad():
                    sub = take_rows(fetch(W.detach(), like.device), rows)
                self.device_rows[key] = sub.numel() * sub.element_size()
                self._nodes[key] = GatheredNodes(sub, at, self.slots(slot_key, pos), like.dtype)
            elif W.device == like.device:  # W is read in every pass, where it is
                self._nodes[key] = GatheredNodes(W.detach(), idx.to(like.device), self.slots(slot_key, pos), like.dtype)
            else:  # W elsewhere (an offloaded module: the host): the nodes' distinct rows, kept where W is
                # (pinned), are copied to the site for each pass only (frozen.gather_write / gather_read)
                rows, at = torch.unique(idx, return_inverse=True)
                with torch.no_grad():
                    sub = pinned(W.detach()[rows.to(W.device)])
                self._nodes[key] = GatheredNodes(sub, at.to(like.device), self.slots(slot_key, pos), like.dtype)
        return self._nodes[key]

    def grid(self, key: str, slots: PositionSlots, vectors: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Constant per-node vectors (e.g. pattern rows) on the slot grid (cached)."""
        if key not in self._grids:
            with torch.no_grad():
                self._grids[key] = slots.grid(vectors().detach())
        return self._grids[key]

    def const(self, key: str, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The frozen constant ``key``: computed (detached) on first use, reused afterwards.

        ``compute`` works on the first copy of the prompt (batch row 0; every row has the same values):
        one copy of each constant — attention patterns above all — is kept and broadcast over the batch.
        """
        if key not in self.constants:
            with torch.no_grad():
                self.constants[key] = compute().detach()[:1]
        return self.constants[key]

    def error_const(self, key: str, compute: Callable[[], torch.Tensor], start: int) -> torch.Tensor:
        """The frozen error vectors ``key`` ``(1, pos, d_model)`` (:meth:`const`); when first computed, each
        position's norm is the activation of its error node (layout columns ``start … start + pos − 1``): the
        graph's and the Neuronpedia export's error activations (0 before 2026-11-29, documented as the norm)."""
        new = key not in self.constants
        err = self.const(key, compute)
        if new:
            norms = err[0].detach().float().norm(dim=-1).to(HOST)
            self.layout.nodes.activation[start:start + norms.numel()] = norms
        return err

    # ------------------------------------------------------------------ sites
    def embed(self, e: Float[torch.Tensor, "batch pos d"]) -> torch.Tensor:
        """Token (and, for GPT-2, position) embeddings, one node per position."""
        lay = self.layout
        return (e * self.mult(e.device)[:, lay.emb_start:lay.emb_start + lay.n_pos, None]).to(self.dtype or e.dtype)

    def norm(self, module: torch.nn.Module, x: torch.Tensor, layer: int | None, role: str) -> torch.Tensor:
        """A frozen norm (``role``: ``attn_norm`` / ``mlp_norm``, Gemma-2's post-norms ``attn_post_norm`` /
        ``mlp_post_norm``; ``layer=None``: the final norm).

        Where the layer's transcoder reads the pre-MLP norm's input (:attr:`.layout.LayerLayout.tc_reads`
        ``"norm_input"``: ``hook_resid_mid``; ``"normalized"``: ``ln2.hook_normalized``, ``x / rms(x)`` — a
        LayerNorm's ``(x − mean x) / σ(x)`` — before the gain) the ``mlp_norm`` site keeps that input (``x``, or
        :func:`.frozen.normalized_input`, fp32 or wider) for the MLP site; where it writes the post-MLP norm's
        output (``tc_writes`` ``"post_norm"``: Gemma-2/3 ``hook_mlp_out``)
        the ``mlp_post_norm`` site returns the transcoder's writes (:meth:`mlp`) instead of the frozen norm."""
        lay = None if layer is None else self.layout.layers[layer]
        if lay is not None and role == "mlp_post_norm" and lay.transcoder is not None and lay.tc_writes == "post_norm":
            return self.post_norm_writes(module, x, layer)  # type: ignore[arg-type]
        bias = self.layout.bias if lay is None else lay.bias
        scale = self.const(f"L{layer}.{role}.scale", lambda: norm_scale(module, x[:1]))
        if lay is not None and role == "mlp_norm" and lay.transcoder is not None and lay.tc_reads != "mlp":
            # what the transcoder reads, linear in x: the residual itself, or x / rms(x) — a LayerNorm's
            # (x − mean x) / σ(x) — with the frozen scale
            self._reads[lay.layer] = x if lay.tc_reads == "norm_input" else normalized_input(module, x, scale)
        mult = column(self.mult(x.device), bias.get("final_norm" if layer is None else role))
        out = frozen_norm(module, x, scale, mult)
        return out.to(x.dtype)

    def attention(self, layer: int, x: torch.Tensor, positions: torch.Tensor, true_out: torch.Tensor) -> torch.Tensor:
        """The attention output: Lorsa heads + Lorsa error + ``b_D``, or a frozen-pattern MHSA."""
        lay = self.layout.layers[layer]
        M = self.mult(x.device)
        if lay.lorsa is None:
            w = self.mhsa_on(layer, x.device)
            frozen: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
            if keeps_pattern(w, self.store_patterns(x)):  # SDPA cannot soft-cap (Gemma-2): the pattern
                frozen = self.const(f"L{layer}.attn.pattern", lambda: mhsa_pattern(w, x[:1], first(positions)))
            else:  # q and k from one call (each constant computing both would run the projections twice)
                once: list[tuple[torch.Tensor, torch.Tensor]] = []

                def qk() -> tuple[torch.Tensor, torch.Tensor]:
                    if not once:
                        once.append(mhsa_qk(w, x[:1], first(positions)))
                    return once[0]

                frozen = (self.const(f"L{layer}.attn.q", lambda: qk()[0]),
                          self.const(f"L{layer}.attn.k", lambda: qk()[1]))
            out = frozen_mhsa(w, x, frozen, column(M, lay.bias.get("attn_v")), column(M, lay.bias.get("attn_o")))
            return out.to(self.dtype or true_out.dtype)
        lorsa = lay.lorsa
        n, p = lay.lorsa_pos.numel(), self.layout.n_pos
        z = lay.lorsa_z.to(x)
        io = self.nodes(f"L{layer}.lorsa.w_o", f"L{layer}.lorsa", lay.lorsa_pos, lorsa.W_O, lay.lorsa_head, x,
                        owner=lorsa)
        heads = io.write(z * M[:, lay.lorsa_start:lay.lorsa_start + n])
        b_d = on(lorsa.b_D, x) if lorsa.b_D is not None else None

        def error() -> torch.Tensor:
            clean = io.write(z[None])
            return true_out[:1] - (clean + (b_d if b_d is not None else 0.0))

        e0 = int(lay.attn_err_start or 0)  # set for every Lorsa layer
        err = self.error_const(f"L{layer}.attn.error", error, e0)
        out = heads + scaled(b_d, column(M, lay.bias.get("lorsa_d")))
        out = out + per_position(err, M[:, e0:e0 + p])
        # targets: z_pre of each active head through its frozen QK pattern
        if n:
            self._features.append(held(self.lorsa_z_pre(layer, x, positions, column(M, lay.bias.get("lorsa_v"))),
                                       lay.lorsa_fixed))
        return out.to(self.dtype or true_out.dtype)

    def lorsa_z_pre(self, layer: int, x: torch.Tensor, positions: torch.Tensor,
                    mult_v: torch.Tensor | None) -> Float[torch.Tensor, "batch n"]:
        """The active heads' ``z_pre[n] = Σ_j A^{g(h_n)}[i_n, j] v_j^{h_n}`` (Lorsa §3.1), with values
        only for the OV heads active somewhere. Stored patterns (CPU): every node's pattern row kept,
        one ``(heads, batch, pos) @ (heads, pos, width)`` matmul (``batch·n·pos`` work). Otherwise the
        rows are recomputed from the frozen queries/keys in every pass (:class:`.frozen.PatternRows`): nothing
        kept per node or per prompt copy."""
        lay = self.layout.layers[layer]
        lorsa = lay.lorsa
        heads, pos = lay.lorsa_head.to(x.device), lay.lorsa_pos.to(x.device)
        uniq, col = torch.unique(heads, return_inverse=True)
        W_V = lorsa.W_V
        at = uniq.to(W_V.device)
        b_v = on(lorsa.b_V[at], x)
        # the active OV heads' W_V rows: offloaded with the rows kept, gathered on the site's device once (from one
        # non_blocking copy of the pinned W_V, transient); else where W_V is, or elsewhere (offloaded): kept there
        # (pinned), copied per pass
        if self.keeps(lorsa, f"L{layer}.lorsa.w_v"):
            with torch.no_grad():
                w_v = on(take_rows(fetch(W_V.detach(), x.device), uniq), x)
            self.device_rows[f"L{layer}.lorsa.w_v"] = w_v.numel() * w_v.element_size()
        else:
            w_v = on(W_V[at], x) if W_V.device == x.device else pinned(W_V.detach()[at])
        # the bias term in the site's dtype: an fp32 multiplier would promote v (bf16/fp16 models)
        v = streamed_linear(x, w_v) + (b_v * mult_v.to(x.dtype) if mult_v is not None else b_v)  # (b, pos, u)
        group = heads // lorsa.cfg.group_size

        once: list[tuple[torch.Tensor, torch.Tensor]] = []

        def qk() -> tuple[torch.Tensor, torch.Tensor]:  # the Lorsa's own q, k: computed where it is, moved here
            if not once:  # q and k from one call (an offloaded Lorsa: one copy of its q/k weights)
                # offloaded: its q/k weights (not its OV circuit's) on the site's device for this call only
                with resident(lorsa, x.device, LORSA_OV):
                    xm = to_module(x[:1], lorsa)
                    q_, k_ = lorsa.qk(xm, first(positions).to(xm.device))
                once.append((q_.to(x.device), k_.to(x.device)))
            return once[0]

        if not self.store_patterns(x):
            q = self.const(f"L{layer}.lorsa.q", lambda: qk()[0])
            k = self.const(f"L{layer}.lorsa.k", lambda: qk()[1])
            return z_pre(v, PatternRows(q[0], k[0], group, pos, lorsa.cfg.scale, heads, lorsa.cfg.group_size), col)
        slots = self.slots(f"L{layer}.lorsa.by_head", col, uniq.numel())

        def rows() -> torch.Tensor:  # (1, n, pos): node n's pattern row, query i_n of its QK head
            with resident(lorsa, x.device, LORSA_OV):  # offloaded: its q/k weights on the site's device
                xm = to_module(x[:1], lorsa)
                pattern = lorsa.attention_pattern(xm, None, first(positions).to(xm.device))
            return pattern.to(x.device)[0, group, pos][None]

        grid = self.grid(f"L{layer}.lorsa.rows", slots,
                         lambda: self.const(f"L{layer}.lorsa.rows", rows)[0].to(x.dtype))
        return slots.read(v.transpose(1, 2), grid)

    def mlp(self, layer: int, x: torch.Tensor, true_out: torch.Tensor) -> torch.Tensor:
        """The MLP output: the writes of every transcoder feature that decodes into this layer (its own,
        and a CLT's earlier layers') + skip path + ``b_dec`` + error — or one error node per position
        holding the whole MLP output, where nothing replaces it. Records the layer's feature targets.

        The layer's transcoder reads ``x`` (the MLP input), or the pre-MLP norm's input kept by :meth:`norm`
        (:attr:`.layout.LayerLayout.tc_reads`). Where it writes the post-MLP norm's output (``tc_writes``
        ``"post_norm"``) this site returns the true MLP output of batch row 0 (a constant, broadcast: the post-norm
        site replaces its norm's output by the writes, :meth:`post_norm_writes`)."""
        lay = self.layout.layers[layer]
        M, p = self.mult(x.device), self.layout.n_pos
        tc = lay.transcoder
        if tc is None:
            err = self.error_const(f"L{layer}.mlp.error", lambda: true_out[:1], lay.mlp_err_start)
            return per_position(err, M[:, lay.mlp_err_start:lay.mlp_err_start + p]).to(self.dtype or true_out.dtype)
        read = x if lay.tc_reads == "mlp" else self._reads.pop(layer).to(x.device)
        n = lay.tc_pos.numel()
        owner = tc.weights_owner  # a CLT layer computes with its CLT's weights
        # offloaded: on the site's device for these calls, but its encoder and decoders (read by rows, self.nodes);
        # a CLT's W_skip: this layer's matrix alone (CLTLayer.skip reads that copy)
        with resident(owner, x.device, coder_site_leave(owner), coder_layer_parts(tc, SITE_PARTS)):
            xm = to_module(read, owner)  # run where the transcoder is, moved back to the site
            skip = tc.skip(xm, constant_weights=True)  # no copy of a prompt copy's input kept for W_skip's gradient
            skip = None if skip is None else skip.to(x)
            enc_in = tc.encoder_input(xm).to(x) if n else None
        if enc_in is not None:
            io = self.nodes(f"L{layer}.tc.w_enc", f"L{layer}.tc", lay.tc_pos, tc.W_enc.T, lay.tc_feat, x, owner=owner)
            pre = io.read(enc_in)
            mult = column(M, lay.bias.get("tc_enc"))
            b_enc = tc.b_enc[lay.tc_feat.to(tc.b_enc.device)][None].to(x.device)
            self._features.append(held((pre + (b_enc * mult[:, :, 0] if mult is not None else b_enc)).to(x.dtype),
                                       lay.tc_fixed))
        if lay.tc_writes == "post_norm":
            self._skips[layer] = skip
            return true_out[:1].to(self.dtype or true_out.dtype).expand(x.shape[0], *true_out.shape[1:])
        return self.writes(layer, x, lambda: true_out[:1], skip).to(self.dtype or true_out.dtype)

    def writes(self, layer: int, x: torch.Tensor, true_out: Callable[[], torch.Tensor],
               skip: torch.Tensor | None) -> torch.Tensor:
        """What the transcoders write at ``layer``'s output site: every feature that decodes into it (its own,
        and a CLT's earlier layers') + ``skip`` + ``b_dec`` + error, the error (a frozen constant) ``true_out()``
        (``(1, pos, d_model)``: the site's true output on batch row 0, called once) minus that reconstruction.
        ``x``: the site's tensor, for its device and dtype."""
        lay = self.layout.layers[layer]
        tc = lay.transcoder
        M, p = self.mult(x.device), self.layout.n_pos
        writes, clean = [], []
        for src in self.layout.layers[:layer + 1]:
            w_dec = None if src.transcoder is None else src.transcoder.decoders(src.layer).get(layer)
            if w_dec is None or not src.tc_pos.numel():
                continue
            io = self.nodes(f"L{src.layer}.tc.w_dec->{layer}", f"L{src.layer}.tc", src.tc_pos, w_dec, src.tc_feat, x,
                            copies=self.layout.decoder_targets(src.layer), owner=src.transcoder.weights_owner)
            act = src.tc_act.to(x)
            writes.append(io.write(act * M[:, src.tc_start:src.tc_start + src.tc_pos.numel()]))
            clean.append((io, act))
        b_dec = on(tc.b_dec, x)

        def error() -> torch.Tensor:
            ref = true_out()
            recon = sum((w.write(a[None]) for w, a in clean), torch.zeros_like(ref)) + b_dec
            return ref - (recon if skip is None else recon + skip[:1])

        err = self.error_const(f"L{layer}.mlp.error", error, lay.mlp_err_start)
        out = sum(writes, torch.zeros_like(x)) + scaled(b_dec, column(M, lay.bias.get("tc_dec")))
        out = out + per_position(err, M[:, lay.mlp_err_start:lay.mlp_err_start + p])
        return out if skip is None else out + skip

    def post_norm_writes(self, module: torch.nn.Module, x: torch.Tensor, layer: int) -> torch.Tensor:
        """The output of ``layer``'s post-MLP norm ``module`` (Gemma-2/3 ``post_feedforward_layernorm``) where the
        layer's transcoder writes it (``hook_mlp_out``): :meth:`writes` with the norm's true output on batch row 0
        as the error's reference — :func:`.frozen.frozen_norm` of ``x[:1]``, the true MLP output :meth:`mlp`
        returned, with its own scale — or, where :attr:`post_refs` has the layer (a traced pass), that output as the
        pass ran it. ``(batch, pos, d_model)`` in ``x``'s dtype."""
        ref = self.post_refs.get(layer)

        def true_out() -> torch.Tensor:
            if ref is not None:
                return ref[:1].to(device=x.device, dtype=x.dtype)
            t = x[:1]
            return frozen_norm(module, t, norm_scale(module, t), None).to(t.dtype)

        return self.writes(layer, x, true_out, self._skips.pop(layer)).to(x.dtype)

    def unembed(self, lm_head: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``x W_Uᵀ + b_U``; records the demeaned logits of the target tokens at the last position,
        ``x_last·(W_U[t] − mean_v W_U[v]) + (b_U[t] − mean b_U)``, from the last position alone (a
        backward from them never touches the ``(batch, pos, vocab)`` logits). While attributing
        (``M.requires_grad``: all multipliers 1, so every row has the same values) the returned logits
        are row 0's broadcast over the batch; with other multipliers (an intervention) each row's own."""
        bias = getattr(lm_head, "bias", None)
        weight: torch.Tensor = lm_head.weight  # type: ignore[assignment]
        key = self.layout.bias.get("lm_head")
        if self.M.requires_grad:  # attribution: every multiplier 1, every batch row the same prompt copy —
            # the output (nothing is differentiated through it) is row 0's, in the frozen model's dtype, broadcast:
            # no (batch, pos, vocab) tensor (cast after the broadcast, it would be one)
            with torch.no_grad():
                logits = F.linear(into(x[:1], weight), weight, bias).to(x.dtype).expand(x.shape[0], -1, -1)
        else:  # the output, in the model's dtype, where the unembedding is
            logits = F.linear(into(x, weight), weight) + scaled(bias, column(self.mult(weight.device), key))
        tokens = self.layout.logit_tokens.to(weight.device)
        # targets in the frozen model's dtype, on the site's device
        w = (weight[tokens].to(x.dtype) - weight.mean(0, dtype=x.dtype)).to(x.device)
        b = None if bias is None else (bias[tokens].to(x.dtype) - bias.mean(dtype=x.dtype)).to(x.device)
        mult = column(self.mult(x.device), key)
        self._logits = F.linear(x[:, -1], w) + scaled(b, None if mult is None else mult[:, 0])
        return logits.to(x.dtype)

    # ---------------------------------------------------------------- targets
    def target_pieces(self) -> list[torch.Tensor]:
        """The targets as recorded, in node order: ``(batch, n_i)`` per site, then the logits."""
        if self._logits is None:
            raise NotReadyError("FrozenReplacement.target_pieces(): the frozen forward has not reached the "
                                "unembedding yet: run the frozen forward (trace.frozen_forward_body) first")
        return [t.to(self.M.device) for t in (*self._features, self._logits)]  # sites on other devices: to M's

    def targets(self) -> Float[torch.Tensor, "batch n_targets"]:
        """``(batch, n_features + n_logits)``: feature pre-activations (node order), then demeaned logits."""
        return torch.cat(self.target_pieces(), dim=1)

    def objective(self, rows: list[int]) -> torch.Tensor:
        """``Σ_b T[b, rows[b]]`` — the scalar whose gradient injects target ``rows[b]`` into batch row
        ``b`` — built from the pieces of :meth:`target_pieces` that hold one of ``rows`` only: the
        backward then starts at the highest such site and never runs through the layers above it."""
        total: torch.Tensor | None = None
        start = 0
        for piece in self.target_pieces():
            end = start + piece.shape[1]
            at = [(i, t - start) for i, t in enumerate(rows) if start <= t < end]  # on the host: no tensor read
            if at:
                b, c = zip(*at, strict=True)
                term = piece[torch.tensor(b, device=piece.device), torch.tensor(c, device=piece.device)].sum()
                total = term if total is None else total + term
            start = end
        if total is None:
            raise IndexError(f"target rows {rows} out of range [0, {start})")
        return total


def copies_in(modules: dict[int, Any], dtype: torch.dtype) -> dict[int, Any]:
    """``{layer: replacement module}`` with every module in ``dtype``: the modules themselves where all their
    floating parameters are in it already, else copies in it (one deepcopy memo: a cross-layer transcoder's
    per-layer views, :class:`~nnsight_lorsa.modules.clt.CLTLayer`, share one copy of it). The user's modules are
    never cast: a bf16 Lorsa under ``dtype=torch.float32`` computes as an fp32 copy, not in bf16."""
    if all(p.dtype == dtype for m in modules.values() for p in m.parameters() if p.is_floating_point()):
        return dict(modules)
    memo: dict[int, Any] = {}
    return {layer: copy.deepcopy(m, memo).to(dtype) for layer, m in modules.items()}


def weights_in(w: Any, dtype: torch.dtype | None = None, device: torch.device | None = None) -> Any:
    """:class:`~nnsight_lorsa.adapters.base.MHSAWeights` with its floating tensors in ``dtype`` and every
    tensor on ``device`` (None: as they are)."""
    def move(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype if t.is_floating_point() else None)

    return dataclasses.replace(w, **{f.name: move(getattr(w, f.name)) for f in dataclasses.fields(w)
                                     if isinstance(getattr(w, f.name), torch.Tensor)})


#: the (patterns, node_vectors) pair of each ``memory`` setting of :func:`.attribute.attribute`
MEMORY_MODES = {"auto": ("auto", "auto"), "fast": ("store", "grid"), "lean": ("sdpa", "gather")}


def memory_modes(memory: str | tuple[str, str]) -> tuple[str, str]:
    """``(patterns, node_vectors)`` of :class:`FrozenReplacement` for a ``memory`` setting: ``"fast"``
    stored patterns + grid node vectors, ``"lean"`` SDPA from frozen queries/keys + gathered node
    vectors, ``"auto"`` each decided per device / site. A pair is passed through (checked): the mixed
    combinations, for tests and benchmarks only.

    Raises:
        ConfigMismatchError: an unknown setting.
    """
    if isinstance(memory, tuple):
        patterns, node_vectors = memory
        if patterns not in ("auto", "store", "sdpa") or node_vectors not in ("auto", "grid", "gather"):
            raise ConfigMismatchError("memory as a (patterns, node_vectors) pair must be (auto|store|sdpa, "
                                      f"auto|grid|gather), got {memory!r}")
        return patterns, node_vectors
    if not isinstance(memory, str) or memory not in MEMORY_MODES:
        raise ConfigMismatchError(f"memory must be 'auto', 'fast' or 'lean', got {memory!r}")
    return MEMORY_MODES[memory]


def site_kinds(io: MLPSiteIO, adapter: ArchitectureAdapter, layer: int) -> tuple[str, str]:
    """``(reads, writes)`` of a transcoder / CLT layer at ``layer`` whose circuit-tracer hooks map to ``io``
    (:func:`~nnsight_lorsa.formats.hook_sites.mlp_site_io`), in the frozen pass's terms: reads ``"mlp"`` (the MLP's
    input), ``"norm_input"`` (the pre-MLP norm's input, ``hook_resid_mid``) or ``"normalized"`` (its ``x / rms(x)``
    or a LayerNorm's ``(x − mean x) / σ(x)`` before the gain, ``ln2.hook_normalized`` on a norm with a gain); writes
    ``"mlp"`` (the MLP's output) or ``"post_norm"`` (the post-MLP norm's output, ``hook_mlp_out`` on Gemma-2/3).

    Raises:
        UnsupportedArchitectureError: any other input or output module (naming the layer and both paths).
    """
    mlp, norm, post = adapter.mlp_path(layer), adapter.mlp_norm_path(layer), adapter.mlp_post_norm_path(layer)
    reads = {(mlp, False): "mlp", (norm, False): "norm_input", (norm, True): "normalized"}.get(
        (io.input_path, io.eps is not None))
    writes = {mlp: "mlp", **({post: "post_norm"} if post else {})}.get(io.output_path)
    where = (f"the transcoder at layer {layer} reads {'the normalised ' if io.eps is not None else 'the '}input of "
             f"{io.input_path!r} and writes the output of {io.output_path!r}")
    if reads == "norm_input" and not has_resid_mid(adapter):
        raise UnsupportedArchitectureError(
            f"{where}: {adapter.family} with a parallel residual has no residual stream between the attention and "
            f"the MLP ({norm!r} reads the layer's input)")
    if reads is None or writes is None:
        outputs = f"{mlp!r}'s output" + (f" or {post!r}'s" if post else "")
        raise UnsupportedArchitectureError(
            f"{where}: the attribution's frozen pass reads a transcoder at {mlp!r}'s input or {norm!r}'s input and "
            f"writes {outputs}")
    return reads, writes


def transcoder_sites(replacement: Any, transcoders: dict[int, Any]) -> dict[int, MLPSiteIO]:
    """``{layer: MLPSiteIO}`` of the ``transcoders`` (``{layer: transcoder or CLTLayer}``) of a
    :class:`~nnsight_lorsa.envoy.replacement_model.ReplacementModel`: where each reads and writes
    (:func:`~nnsight_lorsa.formats.hook_sites.mlp_site_io`, from its circuit-tracer hooks)."""
    adapter, root = replacement.adapter, hf_module(replacement.model)
    return {layer: mlp_site_io(tc, adapter, root, layer) for layer, tc in transcoders.items()}


def layer_modules(replacement: Any) -> tuple[dict[int, Any], dict[int, Any]]:
    """``({layer: Lorsa}, {layer: transcoder or CLTLayer})`` of a
    :class:`~nnsight_lorsa.envoy.replacement_model.ReplacementModel`: its sets' per-layer views
    (:meth:`~nnsight_lorsa.envoy.replacement_set.ReplacementSet.by_layer`; a cross-layer transcoder as one
    :class:`~nnsight_lorsa.modules.clt.CLTLayer` per layer).

    A transcoder / CLT whose circuit-tracer hooks move its input or output off the MLP module's call
    (:func:`~nnsight_lorsa.formats.hook_sites.mlp_site_io`: ``hook_resid_mid``; ``ln2.hook_normalized`` on an
    RMSNorm with a gain; Gemma-2/3 ``hook_mlp_out``, after ``post_feedforward_layernorm``) is attributed where it
    reads and writes (:func:`site_kinds`, :meth:`FrozenReplacement.norm`) — in the graph of a traced pass too
    (:mod:`.intervened` records what it reads and, for a post-norm writer, the post-norm's output:
    :attr:`.trace.AttributionCache.mlp_post_out`).

    Raises:
        UnsupportedArchitectureError: a transcoder / CLT that reads or writes another module than those
            (:func:`site_kinds`) — naming the layer, its hooks and the modules.
    """
    lorsas, tcs = replacement.lorsas, replacement.transcoders
    by_layer = {} if tcs is None else tcs.by_layer()
    adapter = replacement.adapter
    for layer, io in transcoder_sites(replacement, by_layer).items():
        if io.is_mlp_call(adapter, layer):
            continue
        hooks = {k: v for k, v in hook_record(by_layer[layer]).items()
                 if k in ("feature_input_hook", "feature_output_hook")}
        try:
            site_kinds(io, adapter, layer)
        except UnsupportedArchitectureError as e:
            raise UnsupportedArchitectureError(f"{e} (trained with {hooks}, per its file's hooks); "
                                               "attribution of such a transcoder is not supported (replace() / "
                                               "evaluate run it where it was trained)") from None
    return ({} if lorsas is None else lorsas.by_layer()), by_layer


def replacement_modules(model: Any, adapter: ArchitectureAdapter, lorsas: dict[int, Any],
                        transcoders: dict[int, Any]) -> tuple[dict[str, Any], dict[int, Any]]:
    """The modules :func:`.layout.build_layout` needs, and the frozen MHSA weights by layer (``model``:
    an nnsight model or the bare Hugging Face one)."""
    root = hf_module(model)
    for layer in [*lorsas, *transcoders]:
        adapter.check_layer(layer)
    mhsa = {layer: adapter.mhsa_weights(root, layer) for layer in range(adapter.n_layers) if layer not in lorsas}

    def bias(path: str | None) -> Any:  # None: no such norm (OLMo-2 has no pre-norms)
        return None if path is None else getattr(adapter.get_module(root, path), "bias", None)

    norm_biases: dict[str, Any] = {"final_norm": bias(adapter.final_norm_path)}
    for layer in range(adapter.n_layers):
        norm_biases[f"L{layer}.attn_norm"] = bias(adapter.attention_norm_path(layer))
        norm_biases[f"L{layer}.mlp_norm"] = bias(adapter.mlp_norm_path(layer))
    sites = {layer: site_kinds(mlp_site_io(tc, adapter, root, layer), adapter, layer)
             for layer, tc in transcoders.items()}
    modules = {"lorsas": lorsas, "transcoders": transcoders, "norm_biases": norm_biases, "tc_sites": sites,
               "attn_biases": {layer: (w.b_V, w.b_O) for layer, w in mhsa.items()},
               "lm_head_bias": bias(adapter.lm_head_path), "final_logits": adapter.final_logits}
    return modules, mhsa


def _where(module: Any) -> str:
    devices = sorted({str(p.device) for p in module.parameters()}) if isinstance(module, torch.nn.Module) else []
    return ", ".join(devices) or "nowhere (no parameters)"


def check_placement(root: torch.nn.Module, lorsas: dict[int, Any], transcoders: dict[int, Any]) -> None:
    """Refuse a placement the frozen pass cannot run with, before anything runs. Replacement modules may sit
    on another device than their layer, and the model on several devices (``device_map="auto"``): every
    module's inputs are moved to its device and dtype, its results back. What cannot work is a module
    without weights to read: parameters on the ``meta`` device (never materialised, or offloaded by
    accelerate — the frozen pass reads the model's norm, attention and unembedding weights directly; a remote
    prompt's graph too, built here from its cache).

    Raises:
        PlacementError: naming the module and where its parameters are.
    """
    model_at = _where(root)
    for name, param in root.named_parameters():
        if param.device.type == "meta":
            raise PlacementError(f"the model's parameter {name!r} is on the meta device (offloaded or never loaded); "
                                 "attribution reads the model's weights directly: load the model onto real devices "
                                 "(device_map without disk/CPU offload)")
    for kind, modules in (("Lorsa", lorsas), ("transcoder", transcoders)):
        for layer, m in modules.items():
            if isinstance(m, torch.nn.Module) and any(p.device.type == "meta" for p in m.parameters()):
                raise PlacementError(f"the {kind} at layer {layer} is on {_where(m)} (its weights were never "
                                     f"materialised) while the model is on {model_at}: load its weights onto a "
                                     "real device")
