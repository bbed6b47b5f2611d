"""``LorsaSet``: the per-layer Lorsas of one nnsight model, spliced in with ``replace``.

>>> lorsa = LorsaSet(model, {2: lorsa_layer2})           # doctest: +SKIP
>>> with model.trace(prompt):                              # doctest: +SKIP
...     site = lorsa.replace(layer=2)                      # MHSA output -> Lorsa output
...     z = site.hook_z.output.save()                      # (batch, pos, n_ov_heads)
...     site.hook_z.output[:, :, 7] = 0                    # ablate head 7
...     logits = model.lm_head.output.save()
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .._checks import check_flag
from .._placement import to_module
from ..adapters.base import ArchitectureAdapter
from ..errors import ConfigMismatchError, LayerOutOfRangeError, LorsaError, UnsupportedGenerationError
from ..formats.hook_sites import check_lorsa_hooks, fold_attention_norm_
from ..modules.lorsa import Lorsa, LorsaKV
from .frozen_attention import FrozenAttention, frozen_in
from .nnsight_internals import current_worker, hf_module, run_kwargs, traced_method
from .replacement_set import ReplacementSet, load_keyed, replace_keys
from .splice_chain import SpliceChain, splice_chain

#: ``generate`` settings under which the decoder rearranges or rolls back its KV cache in ways a
#: Lorsa's own cache cannot follow (beams are reordered between steps; contrastive search and
#: prompt-lookup / assisted decoding re-run candidate tokens)
_UNSUPPORTED_GENERATION = {
    "num_beams": "beam search (num_beams > 1) reorders the KV cache between steps",
    "num_beam_groups": "group beam search reorders the KV cache between steps",
    "penalty_alpha": "contrastive search re-runs candidate tokens against the KV cache",
    "assistant_model": "assisted decoding verifies draft tokens and rolls the KV cache back",
    "prompt_lookup_num_tokens": "prompt-lookup decoding verifies draft tokens and rolls the KV cache back",
}


def check_generation(kwargs: Mapping[str, Any], config: Any = None) -> None:
    """Raise :class:`UnsupportedGenerationError` for ``generate`` settings a Lorsa cannot follow.

    ``kwargs``: the traced call's keyword arguments; ``config``: the model's own
    ``generation_config`` (consulted for what ``kwargs`` leave unset).
    """
    given = kwargs.get("generation_config")
    for name, why in _UNSUPPORTED_GENERATION.items():
        value = kwargs.get(name)
        if value is None and given is not None:
            value = getattr(given, name, None)
        if value is None and config is not None:
            value = getattr(config, name, None)
        if not value or (name in ("num_beams", "num_beam_groups") and value == 1):
            continue
        raise UnsupportedGenerationError(
            f"LorsaSet.replace cannot follow {name}={value!r} in generate(): {why}, and a Lorsa keeps its "
            "own keys and values of the earlier tokens. Use greedy or sampled decoding (num_beams=1, no "
            "assistant / prompt lookup / contrastive search), or run model.trace on each full sequence; "
            "transcoders and SAEs (per token) work with every decoding strategy")


def _cache_length(kwargs: dict, layer: int) -> int | None:
    """Length of the model's KV cache for ``layer`` (None: the call has no cache). The attention's
    cache argument is ``cache`` from transformers 5.24 (``past_key_values`` before; GPT-2 on 4.x:
    ``layer_past``)."""
    cache = next((kwargs[k] for k in ("cache", "past_key_values", "layer_past") if kwargs.get(k) is not None), None)
    if cache is None or not hasattr(cache, "get_seq_length"):
        return None
    return int(cache.get_seq_length(layer))


def _cache_capacity(kwargs: dict, layer: int) -> int | None:
    """The fixed number of key slots of the model's KV cache for ``layer`` (a static cache's ``max_cache_len``:
    ``generate(cache_implementation="static")``, whose masks span every slot, slot ``i`` holding position ``i``);
    None for a cache that grows (dynamic) or no cache. Host-only (no tensor read)."""
    cache = next((kwargs[k] for k in ("cache", "past_key_values", "layer_past") if kwargs.get(k) is not None), None)
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, (list, tuple)) or not 0 <= layer < len(layers):
        return None
    size = getattr(layers[layer], "get_max_length", lambda: -1)()
    return int(size) if isinstance(size, int) and size > 0 else None


def _own_tokens(mask: torch.Tensor | None, batch: int, new: int, device: torch.device) -> torch.Tensor:
    """Which of an attention call's own ``new`` positions are tokens (not padding): ``(batch, new)`` bool on
    ``device``, read from the model's 4-D mask ``(batch|1, 1, new, keys)`` (bool, True = may attend, or additive
    float, ``finfo.min`` = masked), whose last ``new`` keys are the call's positions (transformers' masks, a
    sliding cache's too): query ``i`` may attend its own key unless it is padding, and no key after it (a fully
    masked row that masking code unmasks attends everywhere, later keys included). None: every position."""
    if mask is None:
        return torch.ones(batch, new, dtype=torch.bool, device=device)
    allowed = (mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2)[:, 0].to(device)
    keys = allowed.shape[-1]
    own = torch.arange(new, device=device) + (keys - new)  # (new,) each query's own key
    later = torch.arange(keys, device=device)[None, :] > own[:, None]  # (new, keys)
    tokens = allowed[:, torch.arange(new, device=device), own] & ~(allowed & later).any(-1)
    return tokens.expand(batch, new)


class LorsaSet(ReplacementSet[int, Lorsa]):
    """The Lorsas of one model, keyed by layer; ``replace(layer=L)`` splices them into a trace.

    Source: Lorsa paper (He et al. 2025) §3 (one Lorsa replaces one layer's attention); docs/lorsa.md.

    Args:
        model: an nnsight ``TransformersModel``/``LanguageModel`` (the root envoy).
        lorsas: ``{layer: Lorsa}``; each must fit the model (``d_model``; ``cfg.layer`` if set). Each is
            moved (in place) to the device of its layer's attention once the model's weights are loaded
            (:meth:`~.replacement_set.ReplacementSet.place`); its dtype is kept.

    Raises:
        UnsupportedArchitectureError: the model family has no adapter.
        LayerOutOfRangeError: a layer outside ``[0, n_layers)``.
        ConfigMismatchError: a Lorsa whose ``d_model`` (or recorded layer) differs from the model's.
        PlacementError: a Lorsa on the meta device (never materialised) for a model whose weights are loaded.
    """

    key_type = int
    what = "Lorsa"
    module_type = Lorsa
    slot = "lorsas"

    def __init__(self, model: Any, lorsas: Mapping[int, Lorsa] | None = None,
                 adapter: ArchitectureAdapter | None = None) -> None:
        super(LorsaSet, self).__init__(model, lorsas, adapter)

    def wrong_kind(self, key: Any, module: Any) -> str:
        return (f"LorsaSet holds Lorsa modules; got a {type(module).__name__} for layer {key!r} (transcoders go "
                "in a TranscoderSet, SAEs in an SAESet)")

    def check(self, key: Any, module: Lorsa) -> int:
        """Validate ``(key, module)`` for this model and return the normalised key.

        Raises:
            ConfigMismatchError: a Lorsa whose ``d_model`` differs from the model's, or trained for another layer
                (``cfg.layer``); a Llamascopium Lorsa reading TransformerLens's ``ln1.hook_normalized`` (before the
                norm's gain) not folded (:func:`~..formats.hook_sites.check_lorsa_hooks`: load it with
                :meth:`from_pretrained`).
            UnsupportedArchitectureError: a Llamascopium Lorsa whose hooks name another tensor than the attention's
                input and output (``hook_attn_out`` after Gemma-2/3's and OLMo-2's post-attention norm).
            LayerOutOfRangeError: ``key`` not a layer in ``[0, n_layers)``.

        Source: ours (the shared contract of this package's replacement sets).
        """
        layer = self.adapter.check_layer(key)
        cfg = module.cfg
        if cfg.d_model != self.adapter.d_model:
            raise ConfigMismatchError(
                f"Lorsa for layer {layer} has d_model={cfg.d_model}, the model has {self.adapter.d_model}"
            )
        if cfg.layer is not None and cfg.layer != layer:
            raise ConfigMismatchError(f"Lorsa was trained for layer {cfg.layer}, not layer {layer}")
        check_lorsa_hooks(module, self.adapter, hf_module(self.model), layer)
        return layer

    def missing(self, key: Any) -> Exception:
        return LayerOutOfRangeError(f"no Lorsa for layer {key!r}; this set has layers {self.layers}")

    def site_path(self, key: int) -> str:
        return self.adapter.attention_path(key)

    def n_latents(self, key: int) -> int:
        return self[key].cfg.n_ov_heads

    def latents_and_output(self, envoy: Any) -> tuple[Any, Any]:
        return envoy.hook_z.output, envoy.hook_out.output

    @property
    def layers(self) -> list[int]:
        """The layers that have a Lorsa, in key order.

        Source: Lorsa paper (He et al. 2025) §3 (one Lorsa replaces one layer's attention); docs/lorsa.md.
        """
        return list(self)

    def __repr__(self) -> str:
        parts = ", ".join(f"{layer}: {self[layer].cfg.n_ov_heads} heads" for layer in self.layers)
        return f"LorsaSet({self.adapter.family}, {{{parts}}})"

    # ------------------------------------------------------------------- io
    @classmethod
    def from_pretrained(cls, model: Any, sources: Any, *, format: str = "auto", adapter: Any = None,
                        **kwargs: Any) -> LorsaSet:
        """Load Lorsas from checkpoints (through ``formats.load``) and attach each at its layer.

        ``sources``: a directory written by :meth:`~.replacement_set.ReplacementSet.save` (one ``layer_<L>/``
        per layer), one Lorsa
        checkpoint (local directory or hub repo id, e.g. ``"org/repo:name"`` for Llamascopium),
        several, or ``{layer: source}``. A Hugging Face repo id (``"owner/name"``, ``"owner/name:folder"``; a
        string that is no local path) is downloaded first — a set published by
        :meth:`~.replacement_set.ReplacementSet.push_to_hub` or a single checkpoint — with ``revision=``,
        ``subfolder=``, ``local_files_only=`` (docs/hub.md).
        ``format``: ``"auto"`` (from the files), ``"nnsight_lorsa"``
        or ``"llamascopium"``; ``kwargs`` go to the reader (``device``, ``dtype``, ``weights_folded``,
        ``revision``, …). The layer is the folder's ``layer_<L>`` name, else the checkpoint's ``cfg.layer``.

        A Lorsa of the authors' (Llamascopium) reads TransformerLens's ``ln1.hook_normalized`` — the pre-attention
        norm **before** its gain and bias, which TransformerLens folds into the attention's weights — and the
        attention reads the norm's output: the layer's gain and bias are folded into its ``W_Q``, ``W_K``, ``W_V``
        here (:func:`~..formats.hook_sites.fold_attention_norm_`; ``W ← diag(1/g) W``), so that it computes on the
        attention's input what it computed on theirs. Its ``hook_attn_out`` must be the attention module's output:
        on Gemma-2/3 and OLMo-2 TransformerLens takes it after the post-attention norm, refused.

        Raises:
            CheckpointError: no recognisable checkpoint (``FormatDetectionError``), a malformed one.
            ConfigMismatchError: a checkpoint that holds no Lorsa, names no layer, or a second one
                for a layer; a Lorsa that does not fit the model.

        Source: Lorsa paper (He et al. 2025) §3 (one Lorsa replaces one layer's attention); docs/lorsa.md.
        """
        out = cls(model, {}, adapter)

        def layer_of(name: str, module: Lorsa) -> int | None:
            named = out.key_of_folder(name)
            return named if named is not None else module.cfg.layer

        loaded = load_keyed(model, sources, Lorsa, layer_of, format=format, noun="a Lorsa", key_name="layer", **kwargs)
        for layer, lorsa in loaded.items():  # a Llamascopium Lorsa reads the norm before its gain: folded in
            if isinstance(layer, int) and 0 <= layer < out.adapter.n_layers:
                fold_attention_norm_(lorsa, out.adapter, hf_module(model), layer)
        out.update(loaded)
        return out

    # -------------------------------------------------------------- splicing
    def site(self, layer: int, generation: Mapping[str, Any] | None = None,
             frozen: FrozenAttention | None = None) -> SpliceChain:
        """How layer ``layer``'s attention is spliced (its path, input and output handling).

        The step runs the Lorsa on the positions the attention is called with, attending to the
        earlier positions of the run through a :class:`~..modules.lorsa.LorsaKV` kept in the
        splice's per-trace state (``state["kv"]``): the prompt's forward starts it, each cached
        generation step extends it. Its length follows the model's own KV cache for the layer
        (reset when that is empty, cropped when the model rolled its cache back). On a sliding-window
        layer (``adapter.sliding_window(layer)``) the model's mask carries the window: only which
        positions are tokens is read from it (:func:`_own_tokens`, kept in ``state["tokens"]``), and the
        Lorsa attends to all earlier tokens.
        ``generation``: the traced call's keyword arguments (checked at the first cached step
        together with the model's ``generation_config``, :func:`check_generation`). ``frozen``: the trace's
        :class:`~.frozen_attention.FrozenAttention` — the Lorsa's queries and keys are computed from the recorded
        input of the layer (``Lorsa.forward(..., qk_input=...)``), its values from the live one.

        Raises (when the trace runs):
            UnsupportedGenerationError: a cached step under a decoding strategy it cannot follow.
            LorsaError: the model's KV cache holds positions this Lorsa did not see (a generation
                continued from a ``past_key_values`` made outside the trace), or the trace skipped the Lorsa's forward
                (``site.skip(value)``: the site returns ``value``) in an earlier forward pass of the generation, whose
                keys and values a cached step would attend to.

        Source: Lorsa paper (He et al. 2025) §3 (one Lorsa replaces one layer's attention); docs/lorsa.md.
        """
        adapter = self.adapter
        hf_config = getattr(hf_module(self.model), "generation_config", None)
        run_kwargs = dict(generation or {})
        sliding = adapter.sliding_window(layer) is not None

        def step(module: torch.nn.Module, i: int, args: tuple, kwargs: dict, true_out: torch.Tensor,
                 state: dict) -> torch.Tensor:
            x = to_module(adapter.attention_input(args, kwargs), module)  # the Lorsa's device and dtype
            qk_input = None if frozen is None else frozen.input_of(layer, x, f"at {adapter.attention_path(layer)}")
            positions = adapter.attention_positions(args, kwargs, x).to(x.device)
            mask = adapter.attention_mask(args, kwargs)
            mask = None if mask is None else mask.to(x.device)
            cached = _cache_length(kwargs, layer)
            # the model's cache is updated by the attention call, which ran before this step
            past_len = 0 if cached is None else max(cached - x.shape[1], 0)
            past: LorsaKV | None = state.get("kv")
            if past_len == 0:
                past = None
            else:
                if not state.get("checked"):
                    check_generation(run_kwargs, hf_config)
                    state["checked"] = True
                if state.get("skipped"):
                    raise LorsaError(
                        f"layer {layer}: the Lorsa's forward was skipped (site.skip(...)) in an earlier forward pass "
                        "of this generation, so its keys and values of those positions were never computed and this "
                        "cached step cannot attend to them. Edit the Lorsa's output instead (site.output[...] = value, "
                        "or its hook_out), which keeps them, or skip it in a model.trace of the full sequence")
                if past is None or past.length < past_len or past.v.shape[0] != x.shape[0]:
                    have = 0 if past is None else past.length
                    raise LorsaError(
                        f"layer {layer}: the model's KV cache holds {past_len} earlier positions, the Lorsa saw "
                        f"{have} (batch {x.shape[0]}); replace() must see every forward pass of a generation "
                        "from its prompt on (do not pass past_key_values made outside the trace)")
                if past.length > past_len:  # the model rolled its cache back
                    past = past.crop(past_len)
            if sliding:
                # a Lorsa is global (causal over every earlier token, as trained and as attribution runs it):
                # the layer's window is the MHSA's, not the Lorsa's. The model's mask carries the window (and, in
                # a generation, covers only the sliding cache's keys), so only which positions are tokens is
                # read from it, each call's own positions, kept for the later steps in state["tokens"]
                # whether to pass the tokens is decided on the host (reading them would stall the host on a
                # GPU, once per forward per sliding layer): plain causal while the model's own masks were None (no
                # padding, the SDPA / flash-attention paths: known on the host), else the (batch, keys) tokens as a
                # key-padding mask, padding or not (an eager model's mask is always a tensor; on full-attention
                # layers the Lorsa takes that mask likewise). An all-True key-padding mask is plain causal: the same
                # SDPA outputs bit for bit on the CPU (tests/modules/test_lorsa_mask_paths.py), docs/nnsight.md
                plain = mask is None and (past_len == 0 or state.get("plain", False))
                state["plain"] = plain
                tokens = _own_tokens(mask, x.shape[0], x.shape[1], x.device)
                if past_len:  # the checks above: the earlier calls of this run set state["tokens"] (>= past_len)
                    tokens = torch.cat([state["tokens"][:, :past_len], tokens], 1)
                state["tokens"] = tokens
                mask = None if plain else tokens  # plain causal, or (batch, keys) key padding
            if mask is not None and mask.shape[-1] > past_len + x.shape[1] \
                    and mask.shape[-1] == _cache_capacity(kwargs, layer):
                # a static cache: the mask spans every slot, the slots past these positions empty (masked); the
                # Lorsa's own keys are the positions so far
                mask = mask[..., :past_len + x.shape[1]]
            if mask is not None and mask.shape[-1] != past_len + x.shape[1]:
                raise LorsaError(f"layer {layer}: attention mask over {mask.shape[-1]} keys, expected "
                                 f"{past_len} cached + {x.shape[1]} new positions")
            holder: dict = {}
            # the module itself (not forward_step): its envoy's .input / .output are served in the trace
            out = module(x, positions, mask, past=past, kv_out=holder, qk_input=qk_input)
            # no "kv": the trace skipped the Lorsa's forward (``site.skip(value)``: nnsight returns ``value`` without
            # running it), so the keys and values of these positions were never computed; a later cached step of a
            # generation, which would attend to them, is refused above (state["skipped"])
            state["kv"] = holder.get("kv")
            if state["kv"] is None:
                state["skipped"] = True
            return out  # the splice casts it to the attention's device and dtype

        return SpliceChain(
            site_paths=(adapter.attention_path(layer),),
            attach_path=adapter.attention_path(layer),
            attach_name="lorsa",
            step=step,
            get_output=adapter.attention_output,
            set_output=adapter.with_attention_output,
            error_hook=lambda module, i: module.get_submodule("hook_error"),
        )

    def replace(self, layer: Any = None, *, error: bool = False) -> Any:  # checked by replace_keys
        """Replace the MHSA output of ``layer`` by its Lorsa's output, in the current trace only.

        Inside ``tracer.invoke(...)``: for that invoke's rows only (other invokes keep the site's own output;
        :func:`~.splice_chain.splice_chain`, *Rows*).

        Call inside ``model.trace(...)`` or ``model.generate(...)`` before anything at or after that
        layer is read; in a generation it replaces the output for every token (the Lorsa keeps a
        :class:`~..modules.lorsa.LorsaKV` of the earlier positions for the trace). The Lorsa attends
        causally to every earlier token of its row (padding masked) — on a sliding-window layer too: the
        window is the MHSA's, not the Lorsa's (as it is trained and as attribution runs it). Returns
        the Lorsa's envoy (a dict ``{layer: envoy}`` for several layers; all layers of the set
        when ``layer`` is None), whose children ``hook_q, hook_k`` ``(batch, n_qk_heads, pos,
        d_qk_head)``, ``hook_v, hook_z_pre, hook_z`` ``(batch, pos, n_ov_heads)``, ``hook_out``
        ``(batch, pos, d_model)`` and ``hook_error`` can be read and edited in the same trace.

        Args:
            layer: layer index, several, or None for every layer of the set.
            error: add the exact error term ``MHSA − Lorsa`` (through ``hook_error``): the
                model's outputs are then those of the unmodified model (bit for bit,
                every dtype), while
                edits to the Lorsa's internals still change them (the error is held fixed).

        Raises:
            LayerOutOfRangeError: no Lorsa for ``layer`` / outside the model.
            TraceOrderError: the model already ran that layer's attention in this pass (also: called
                inside ``tracer.iter[...]`` at a step after the first).
            TraceOrderError: called outside a trace.
            InvokeRowsError: (in the run) its internals read or edited from an invoke that did not call it.
            UnsupportedGenerationError: inside ``model.generate`` with beam search, contrastive search,
                assisted or prompt-lookup decoding — here, before the model runs, also when the setting
                comes from the model's ``generation_config`` (where the traced method cannot be told,
                e.g. on a server, at the first cached step).
            ArgumentError: a key of the wrong type (``2.0``, ``"2"`` for a layer) or an empty list.

        Source: Lorsa paper (He et al. 2025) §3 (one Lorsa replaces one layer's attention); docs/lorsa.md.
        """
        check_flag(error, "error", "LorsaSet.replace")
        layers, single = replace_keys(layer, int, self.layers, "LorsaSet.replace(layer=...)")
        interleaver = current_worker("LorsaSet.replace").interleaver
        generation = run_kwargs(interleaver)
        # a generate() takes what its kwargs leave unset from the model's generation_config: check both
        # now, before the first token (in a plain trace the generation_config plays no part)
        hf_config = getattr(hf_module(self.model), "generation_config", None)
        check_generation(generation, hf_config if traced_method(interleaver) == "generate" else None)
        frozen = frozen_in(interleaver)  # a trace with frozen attention (ReplacementModel.prepare(frozen=...))
        envoys = {}
        for L in layers:
            module = self[L]
            envoys[L] = splice_chain(self.model, self.site(L, generation, frozen), module, error=error)
        return envoys[layers[0]] if single else envoys
