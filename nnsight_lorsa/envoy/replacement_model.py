"""``ReplacementModel``: one nnsight model and the replacement modules that stand in for its parts.

The one argument that attribution, patching, analysis, dashboards and remote runs take (the
nnsight-native counterpart of circuit-tracer's ``ReplacementModel``,
``circuit_tracer/replacement_model.py``): Lorsas for attention layers, transcoders (per layer) or
a cross-layer transcoder for MLPs, and SAEs at hook sites, all bound to the same model::

    rm = ReplacementModel(model, lorsas=lorsa_set, transcoders=transcoder_set)
    with rm.trace(prompt):
        sites = rm.replace()                       # every replacement spliced, error terms on
        z = nnsight.save(sites["lorsas"][2].hook_z.output)

It also knows what can be pointed at in that model: ``rm(target)`` validates an
:class:`~.targets.MHSAHead`, :class:`~.targets.LorsaHead` or :class:`~.targets.Feature` before
anything runs and returns a :class:`~.targets.Bound` target for the interventions of
:mod:`nnsight_lorsa.patching`; inside a trace :meth:`ReplacementModel.location` finds the
tensor it lives in.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .._checks import check_flag
from .._placement import kept_on_failure, set_offload
from ..adapters.base import ArchitectureAdapter
from ..adapters.registry import adapter_for
from ..errors import ArgumentError, ConfigMismatchError, ShapeError
from .clt_set import CLTSet
from .frozen_attention import check_frozen, install
from .lorsa_set import LorsaSet
from .nnsight_internals import check_one_thread, hf_module
from .padding import arm_padding_check
from .replacement_set import ReplacementSet
from .sae_set import SAESet
from .splice_chain import refuse_discarded_edit
from .targets import Bound, Feature, LorsaHead, MHSAHead, Target, check_index
from .transcoder_set import TranscoderSet

#: names of the attention output projection, per family (its input is per-head, head-major)
OUTPUT_PROJECTIONS = ("o_proj", "dense", "c_proj", "out_proj")


#: The kind registry: each :class:`ReplacementModel` attribute (a set's ``slot``) and the set kinds it holds;
#: a mapping given for it becomes the first, a single module the kind whose set holds one (a CLT: ``CLTSet``).
SLOTS: dict[str, tuple[type[ReplacementSet], ...]] = {
    "lorsas": (LorsaSet,), "transcoders": (TranscoderSet, CLTSet), "saes": (SAESet,)}
_WHOLE: dict[str, type[CLTSet]] = {"transcoders": CLTSet}


def _bound_set(model: Any, adapter: ArchitectureAdapter, value: Any, slot: str) -> Any:
    """``value`` as a replacement set of ``model`` for ``slot``: a set of this model as it is, a mapping
    wrapped in the slot's set, a module that a one-module set holds (a CLT) bound in it."""
    kinds = SLOTS[slot]
    if value is None or isinstance(value, kinds):
        if value is not None and getattr(value, "model", model) is not model:
            raise ConfigMismatchError(f"the {slot} belong to another model than this ReplacementModel's")
        return value
    if isinstance(value, Mapping):
        return kinds[0](model, dict(value), adapter=adapter)
    whole = _WHOLE.get(slot)
    if whole is not None and whole.holds(value):
        return whole(model, value, adapter=adapter)
    raise ConfigMismatchError(f"{slot} must be a {kinds[0].__name__} or a mapping, got {type(value).__name__}")


def _slot_modules(value: Any) -> tuple[ReplacementSet | None, list[torch.nn.Module]]:
    """A slot's value as ``(set, its modules)`` when given as a set, else ``(None, the modules)`` of a mapping or a
    single module (not yet in a set; none for None)."""
    if isinstance(value, ReplacementSet):
        return value, list(value.values())
    items = [] if value is None else value.values() if isinstance(value, Mapping) else [value]
    return None, [m for m in items if isinstance(m, torch.nn.Module)]


class ReplacementModel:
    """An nnsight model and its replacement modules (see the module docstring).

    Args:
        model: the nnsight ``LanguageModel`` / ``TransformersModel`` (the root envoy).
        lorsas: a :class:`~.lorsa_set.LorsaSet` of ``model`` or ``{layer: Lorsa}``.
        transcoders: a :class:`~.transcoder_set.TranscoderSet` of ``model`` or ``{layer: Transcoder}``,
            or a :class:`~.clt_set.CLTSet` / :class:`~nnsight_lorsa.modules.clt.CrossLayerTranscoder`.
        saes: an :class:`~.sae_set.SAESet` of ``model`` or ``{site path: SAE}``.
        error: splice replacements with their error terms (default True), so that an unedited
            run reproduces the model and only an edit changes it (Ameisen et al. 2025, *Circuit Tracing*: error nodes).
        offload: True / False sets :attr:`~.replacement_set.ReplacementSet.offload` on every set held
            (weights stored on the host, each module copied to its site's device only while it computes);
            None (default) leaves the sets as they are. All or nothing: a switch that fails on some set (an
            out-of-memory move, ``Ctrl-C``) leaves every set's flag and every module's mark and tensors as before.
        adapter: the model family's adapter (default :func:`~nnsight_lorsa.adapters.registry.get_adapter`).

    Attributes:
        model, adapter, lorsas, transcoders, saes, error: as given (mappings wrapped in their sets).

    Raises:
        UnsupportedArchitectureError: the model family has no adapter.
        ConfigMismatchError: a set bound to another model, or a value of the wrong type.
        LayerOutOfRangeError: a module keyed by a layer the model does not have.
        ArgumentError: ``offload`` neither a bool nor None; ``error`` not a bool.

    Source: circuit-tracer ``circuit_tracer/replacement_model.py`` (its nnsight-native counterpart).
    """

    def __init__(self, model: Any, *, lorsas: Any = None, transcoders: Any = None, saes: Any = None,
                 error: Any = True, adapter: ArchitectureAdapter | None = None, offload: Any = None) -> None:
        # error: a bool, checked below (a named error, not bool("False") == True)
        self.model = model
        self.adapter = adapter_for(model, adapter, "ReplacementModel")
        if offload is not None:
            check_flag(offload, "offload", "ReplacementModel")
        slots = [_slot_modules(v) for v in (lorsas, transcoders, saes)]
        bare = [m for held, modules in slots if held is None for m in modules]
        flags = [(held, held._offload) for held, _ in slots if held is not None]
        kept = [m for _, modules in slots for m in modules] if offload is not None else []
        try:  # all or nothing: until 2026-11-28 a switch failing on the second set left the first switched
            with kept_on_failure(kept):  # every module's mark and tensors as before on a failure
                for m in bare if offload is not None else []:  # marked first: their sets never move them to the device
                    set_offload(m, offload)
                self.lorsas: Any = _bound_set(model, self.adapter, lorsas, "lorsas")
                self.transcoders: Any = _bound_set(model, self.adapter, transcoders, "transcoders")
                self.saes: Any = _bound_set(model, self.adapter, saes, "saes")
                self.error = check_flag(error, "error", "ReplacementModel")
                if offload is not None:
                    for _, held in self.sets():
                        held.offload = offload
        except BaseException:
            for held, flag in flags:  # the sets given switched before the failure: their flags back
                held._offload = flag
            raise

    def sets(self) -> list[tuple[str, ReplacementSet]]:
        """``[(slot, set)]`` for the sets this bundle holds, in the order ``lorsas``, ``transcoders``, ``saes``.

        Source: ours (target checks and trace ordering for interventions; circuit-tracer's ``ReplacementModel`` has
        none).
        """
        return [(slot, getattr(self, slot)) for slot in SLOTS if getattr(self, slot) is not None]

    def with_sets(self, transform: Any) -> ReplacementModel:
        """A bundle of the same model, error flag and adapter holding ``transform(set)`` for each set.

        Source: ours (target checks and trace ordering for interventions; circuit-tracer's ``ReplacementModel`` has
        none).
        """
        return ReplacementModel(self.model, **{slot: transform(s) for slot, s in self.sets()}, error=self.error,
                                adapter=self.adapter)

    def __repr__(self) -> str:
        parts = [f"{name}={value!r}" for name, value in self.sets()]
        return f"ReplacementModel({self.adapter.family}, {', '.join(parts) or 'no replacements'}, error={self.error})"

    # ------------------------------------------------------------ running
    def trace(self, *args: Any, **kwargs: Any) -> Any:
        """``model.trace(...)`` of the underlying nnsight model (nothing is spliced until :meth:`replace`).

        Raises:
            ConcurrentTraceError: another thread is running a trace of the same model (nnsight traces are
                per-thread; docs/nnsight.md).

        Source: circuit-tracer ``circuit_tracer/replacement_model.py`` (its nnsight-native counterpart).
        """
        check_one_thread(self.model, "ReplacementModel.trace")
        return self.model.trace(*args, **kwargs)

    def replace(self, *, error: bool | None = None) -> dict[str, Any]:
        """Inside a trace body: splice every replacement this bundle holds, in the order the model runs them.

        Returns ``{"lorsas": {layer: envoy}, "transcoders": {layer: envoy} | envoy (CLT),
        "saes": {site: envoy}}`` for the sets present. ``error`` defaults to :attr:`error`. Inside
        ``tracer.invoke(...)``: for that invoke's rows only (:func:`~.splice_chain.splice_chain`, *Rows*); so do
        :meth:`prepare` and :meth:`location`, which splice too.

        Raises:
            TraceOrderError: called after the model reached one of the sites in this forward pass.
            TraceOrderError: called outside a trace.
            InvokeRowsError: (in the run) a replacement's internals read or edited from an invoke that did not
                splice it.

        Source: circuit-tracer ``circuit_tracer/replacement_model.py`` (its nnsight-native counterpart).
        """
        err = self.error if error is None else check_flag(error, "error", "ReplacementModel.replace")
        held = self.sets()
        # by the module each splice runs at first (ties: lorsas, transcoders, saes; the sort is stable)
        keyed = [(self.order_path(s.site_path(key)), slot, key) for slot, s in held for key in s]
        out: dict[str, dict] = {slot: {} for slot, _ in held}
        for _, slot, key in sorted(keyed, key=lambda e: e[0]):
            out[slot][key] = getattr(self, slot).replace(key, error=err)
        return {slot: s.envoys(out[slot]) for slot, s in held}

    # ------------------------------------------------------------ targets
    def __call__(self, target: Target) -> Bound:
        """``target`` checked against this model (:meth:`check`) and bound to it, for the interventions."""
        self.check(target)
        return Bound(target, self)

    def bind_all(self, targets: Iterable[Target]) -> list[Bound]:
        """Each target bound to this model (``[self(t) for t in targets]``); raises as :meth:`__call__` does for an
        invalid target.

        Source: ours (target checks and trace ordering for interventions; circuit-tracer's ``ReplacementModel`` has
        none).
        """
        return [self(t) for t in targets]

    def output_projection_path(self, layer: int) -> str:
        """Module path of layer ``layer``'s attention output projection (its input is head-major).

        Raises:
            ConfigMismatchError: the attention module has none of the output projections the adapters know.

        Source: ours (target checks and trace ordering for interventions; circuit-tracer's ``ReplacementModel`` has
        none).
        """
        attn_path = self.adapter.attention_path(layer)
        attn = self.adapter.get_module(hf_module(self.model), attn_path)
        for name in OUTPUT_PROJECTIONS:
            if isinstance(getattr(attn, name, None), torch.nn.Module):
                return f"{attn_path}.{name}"
        raise ConfigMismatchError(f"{attn_path} has none of the output projections {OUTPUT_PROJECTIONS}")

    def require(self, kind: str, user: object) -> Any:
        """The held set of ``kind`` (``"lorsas"``, ``"transcoders"`` or ``"saes"``) for ``user``.

        Raises:
            ConfigMismatchError: this ReplacementModel holds no set of that kind (the message names
                ``user`` and the argument to pass).

        Source: ours (target checks and trace ordering for interventions; circuit-tracer's ``ReplacementModel`` has
        none).
        """
        value = getattr(self, kind)
        if value is None:
            set_name = {"lorsas": "a LorsaSet", "transcoders": "a TranscoderSet", "saes": "an SAESet"}[kind]
            raise ConfigMismatchError(f"{user} needs {set_name}: ReplacementModel(model, {kind}=...)")
        return value

    def check(self, target: Any) -> None:
        """Raise if ``target`` does not exist in this model / these sets (nothing runs).

        Raises:
            LayerOutOfRangeError: the layer is outside the model, or the set has no module there.
            TargetIndexError: the head/feature index is outside its range.
            ConfigMismatchError: unknown SAE site, no set for the target's kind, unknown target type.

        Source: ours (target checks and trace ordering for interventions; circuit-tracer's ``ReplacementModel`` has
        none).
        """
        if isinstance(target, MHSAHead):
            self.adapter.check_layer(target.layer)
            self.output_projection_path(target.layer)
            check_index(target.head, self.adapter.n_heads, f"MHSA head of layer {target.layer}")
        elif isinstance(target, LorsaHead):
            n = self.require("lorsas", target)[target.layer].cfg.n_ov_heads  # LayerOutOfRangeError when missing
            check_index(target.head, n, f"Lorsa head of layer {target.layer}")
        elif isinstance(target, Feature):
            n = self._coder(target).cfg.d_sae
            check_index(target.index, n, f"{target.kind} feature at {target.site!r}")
        else:
            raise ConfigMismatchError(f"not an intervention target: {target!r}")

    def _coder(self, target: Feature) -> Any:
        slot = {"sae": "saes", "transcoder": "transcoders"}.get(target.kind)
        if slot is None:
            raise ConfigMismatchError(f"Feature kind must be 'sae' or 'transcoder', got {target.kind!r}")
        return self.require(slot, target).feature_module(target)

    def width(self, target: Target) -> int | None:
        """Size of the last axis of one position's value: ``head_dim`` for MHSA heads, None (scalar) else.

        Source: ours (target checks and trace ordering for interventions; circuit-tracer's ``ReplacementModel`` has
        none).
        """
        return self.adapter.head_dim if isinstance(target, MHSAHead) else None

    def check_values(self, target: Target, values: torch.Tensor) -> None:
        """Raise :class:`ShapeError` if ``values`` cannot be one target's per-position value(s).

        Source: ours (target checks and trace ordering for interventions; circuit-tracer's ``ReplacementModel`` has
        none).
        """
        if not isinstance(values, torch.Tensor):
            return
        width = self.width(target)
        if width is None:
            if values.ndim > 2:
                raise ShapeError(f"values for {target} are scalars per (batch, pos): got shape {tuple(values.shape)}")
        elif values.ndim == 0 or values.shape[-1] != width or values.ndim > 3:
            raise ShapeError(f"values for {target} must end in head_dim={width}: got shape {tuple(values.shape)}")

    # ------------------------------------------------------------ ordering
    def order(self, target: Target) -> tuple[float, float]:
        """Where the model computes ``target`` (layer, step): interventions in one trace body must
        run in this order (nnsight serves module values in execution order).

        Source: ours (target checks and trace ordering for interventions; circuit-tracer's ``ReplacementModel`` has
        none).
        """
        if isinstance(target, MHSAHead):
            return (float(target.layer), 1.0)
        if isinstance(target, LorsaHead):
            return (float(target.layer), 1.5)
        if target.kind == "transcoder":  # computed once the module whose output it replaces has run
            layer = int(target.site)
            tcs = self.transcoders
            post = tcs is not None and tcs.feature_output_path(target) == self.adapter.mlp_post_norm_path(layer)
            return (float(layer), 2.65 if post else 2.5)  # 2.65: Gemma-2/3 hook_mlp_out, post_feedforward_layernorm
        return self.order_path(str(target.site))

    def order_path(self, path: str) -> tuple[float, float]:
        """Where the model runs the module at envoy path ``path`` (layer, step), as :meth:`order`.

        Source: ours (target checks and trace ordering for interventions; circuit-tracer's ``ReplacementModel`` has
        none).
        """
        a = self.adapter
        if path == a.embed_path:
            return (-1.0, 0.0)
        if path == a.residual_start_path:  # GPT-2's transformer.drop (wte + wpe), after the embeddings
            return (-1.0, 0.5)
        m = re.match(rf"{re.escape(a.layers_path)}\.([0-9]+)(\.(.*))?$", path)
        if m is None:
            return (float(a.n_layers), 0.0)
        layer, sub = int(m.group(1)), m.group(3) or ""
        if path == a.attention_norm_path(layer):  # computed before the layer's attention
            return (float(layer), 0.5)
        if path == a.attention_post_norm_path(layer):  # Gemma-2: the attention output's norm, before the residual add
            return (float(layer), 1.97)
        if path == a.mlp_norm_path(layer):  # between the attention and the MLP
            return (float(layer), 2.0)
        if path == a.mlp_post_norm_path(layer):  # Gemma-2: the MLP output's norm
            return (float(layer), 2.7)
        step = 1.6 if sub.startswith(a.attention_name) else 2.6 if a.mlp_name and sub.startswith(a.mlp_name) else 3.0
        return (float(layer), step)

    def sort(self, targets: Iterable[Target]) -> list[Target]:
        """``targets`` in the order the model computes them (:meth:`order`), the order interventions in one trace body
        must run in.

        Source: ours (target checks and trace ordering for interventions; circuit-tracer's ``ReplacementModel`` has
        none).
        """
        return sorted(targets, key=self.order)

    # ------------------------------------------------------------ in a trace
    def prepare(self, targets: Iterable[Target], *, frozen: Any = None) -> None:  # frozen: checked (check_frozen)
        """Inside a trace body, before any intervention: splice every Lorsa / SAE / transcoder the
        targets need. A Lorsa must be spliced before anything inside its attention is read (e.g. an
        MHSA head of the same layer); splicing is idempotent within one trace. Called first in the body
        (or invoke), it also reads the batch's padding mask (:func:`~.padding.arm_padding_check`): the
        body's interventions then refuse positions that are padding in some row (``ArgumentError``).

        ``frozen``: a :class:`~.frozen_attention.FrozenAttention` (:func:`nnsight_lorsa.patching.freeze_attention`
        on the same prompts): every attention pattern of the trace — each MHSA's and each Lorsa's spliced in it — is
        held at its value on the unedited prompt, so edits act through the OV circuits and the MLPs only
        (circuit-tracer's ``feature_intervention(..., freeze_attention=True)``; docs/patching.md, "Frozen
        attention"). Every row of the batch; one forward pass.

        Raises:
            LayerOutOfRangeError, TargetIndexError, ConfigMismatchError: as :meth:`check`, for each target, before
                anything is spliced.
            ArgumentError: ``frozen`` not a FrozenAttention; recorded on a model with other weights, on other
                prompts, with another ``error`` flag, or (``error`` False, where the replacements change the unedited
                pass) for other targets; given after a Lorsa was spliced in this trace, with gradients enabled, in a
                trace ``attribute(rm, tracer=tracer)`` records, or inside ``model.generate``.

        Source: ours (target checks and trace ordering for interventions; circuit-tracer's ``ReplacementModel`` has
        none).
        """
        targets = set(targets)
        for t in targets:  # named errors before anything is spliced (a wrong layer or index, a missing set)
            self.check(t)
        frozen = check_frozen(frozen, "ReplacementModel.prepare")
        if frozen is not None and (frozen.error != self.error or not self.error and frozen.targets != targets):
            raise ArgumentError(
                f"ReplacementModel.prepare(frozen=...): recorded with error={frozen.error} for "
                f"{len(frozen.targets)} targets, this trace splices error={self.error} for {len(targets)}: without "
                "error terms the replacements change the unedited pass, so record it (freeze_attention(replacement, "
                "prompts, targets)) with the same replacement model and targets")
        arm_padding_check(self.model)
        if frozen is not None:  # before any Lorsa is spliced: they read it when they are
            install(self.model, self.adapter, frozen, self.output_projection_path)
        for t in self.sort(targets):
            if isinstance(t, LorsaHead):
                self._set(t).replace(t.layer, error=self.error)
            elif isinstance(t, Feature):
                coders = self._set(t)
                coders.replace(coders.feature_key(t), error=self.error)

    def _set(self, target: LorsaHead | Feature) -> Any:
        return self.lorsas if isinstance(target, LorsaHead) else self.saes if target.kind == "sae" else self.transcoders

    def check_editable(self, target: Target) -> None:
        """Inside a trace body, before an edit of ``target``: raise if a replacement spliced in this trace would
        discard it — an MHSA head of a layer whose attention a Lorsa replaces without an error term, on rows the
        calling invoke edits (:func:`~.splice_chain.refuse_discarded_edit`: the edit would move nothing). Lorsa heads
        and features are the replacements' own values: always editable.

        Raises:
            ArgumentError: the edit would be discarded (names the target, the replacement and the ways out).

        Source: ours (target checks and trace ordering for interventions; circuit-tracer's ``ReplacementModel`` has
        none).
        """
        if isinstance(target, MHSAHead):
            refuse_discarded_edit(self.output_projection_path(target.layer), str(target))

    def location(self, target: Target) -> tuple[Any, tuple]:
        """Inside a trace body: ``(tensor, index)`` such that ``tensor[index]`` is the target's value.

        MHSA heads: the output projection's input ``(batch, pos, n_heads*head_dim)`` and the head's
        columns; Lorsa heads: ``hook_z`` output and the head; features: ``hook_sae_acts_post``.
        The index is ``(..., positions?, cols)`` without the position axis; see
        :func:`~.targets.index_at`.

        Source: ours (target checks and trace ordering for interventions; circuit-tracer's ``ReplacementModel`` has
        none).
        """
        if isinstance(target, MHSAHead):
            d = self.adapter.head_dim
            proj = self.model.get(self.output_projection_path(target.layer))
            return proj.input, (slice(target.head * d, (target.head + 1) * d),)
        if isinstance(target, LorsaHead):
            site = self._set(target).replace(target.layer, error=self.error)
            return site.hook_z.output, (target.head,)
        coders = self._set(target)
        site = coders.replace(coders.feature_key(target), error=self.error)
        return coders.feature_hook(site, target).output, (target.index,)


def check_replacement_model(value: Any, where: str) -> ReplacementModel:
    """``value`` when it is a :class:`ReplacementModel`; the one check of every entry point that takes one
    (``attribute``, the analysis and patching functions), so that a set, a bare model or a module passed in its
    place is a named error, not an ``AttributeError`` from deep inside (or, for ``head_swap``, arguments read
    in the wrong places).

    Raises:
        ArgumentError: ``value`` is not a ReplacementModel; the message names ``where`` and how to wrap a set.

    Source: ours (this package's entry points).
    """
    if isinstance(value, ReplacementModel):
        return value
    slot = getattr(value, "slot", None)  # a set's ReplacementModel attribute (ReplacementSet.slot)
    hint = f"; wrap the set: ReplacementModel(model, {slot}=your_set)" if isinstance(slot, str) and slot else ""
    raise ArgumentError(f"{where}(replacement=...) must be a ReplacementModel(model, lorsas=..., transcoders=..., "
                        f"saes=...), got a {type(value).__name__}{hint}")
