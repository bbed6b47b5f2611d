"""Architecture adapters: where a model family keeps what the replacement modules need.

An adapter answers, for one model family: where the decoder layers are; where a layer's
attention reads its input hidden states (after the pre-attention norm) and writes its output
(after the output projection); how it rotates queries and keys (:class:`RotaryConfig`); its
attention scale, GQA layout and QK-norm; and the MHSA weights in the head-major layout of the
transformer-circuits framework (Elhage et al. 2021, *A Mathematical Framework for Transformer Circuits*: ``W_Q^h,
W_K^h, W_V^h: (d_model, d_head)``,
``W_O^h: (d_head, d_model)``).

Adapters need torch and transformers only (no nnsight), so they also run on an NDIF server.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from .._checks import check_flag
from .._placement import bmm_f32
from .._repr import FieldsRepr
from .._typing import Float
from ..errors import ArgumentError, ConfigMismatchError, LayerOutOfRangeError, UnsupportedArchitectureError
from ..modules.rotary import RotaryConfig, apply_rotary, rotary_cos_sin, rotary_inv_freq
from ..modules.sparse_coder import check_last_dim


def check_rope_read(config: Any, transformers_major: int | None = None) -> None:
    """Refuse a config whose RoPE settings the installed transformers does not apply.

    transformers 5 keeps RoPE in ``config.rope_parameters`` (``rope_type``, ``rope_theta``, scaling
    keys); transformers 4 reads ``config.rope_scaling`` and ``config.rope_theta`` and keeps an unknown
    ``rope_parameters`` key (from a ``config.json`` written by transformers 5) as an inert attribute, so
    its model runs with default, unscaled RoPE — e.g. the embedded model's llama3 scaling dropped
    (cross-entropy 4.69 instead of 3.43 nats). ``transformers_major``: default the installed one.

    Raises:
        ConfigMismatchError: transformers < 5 and ``rope_parameters`` names a ``rope_type`` /
            ``rope_theta`` that ``rope_scaling`` / ``rope_theta`` do not (naming both and the fix).
    """
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict) or not params:
        return
    if transformers_major is None:
        import transformers

        transformers_major = int(transformers.__version__.split(".")[0])
    if transformers_major >= 5:
        return
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    want_type = params.get("rope_type", params.get("type", "default"))
    read_type = scaling.get("rope_type", scaling.get("type", "default"))
    want_theta, read_theta = params.get("rope_theta"), getattr(config, "rope_theta", None)
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    same = (want_type == read_type and (want_theta is None or read_theta == want_theta)
            and all(scaling.get(k) == params[k] for k in keys if k in params))
    if not same:
        raise ConfigMismatchError(
            f"{type(config).__name__}: config.json has rope_parameters={params} (the transformers-5 key), which "
            f"transformers {transformers_major}.x ignores: its model would run rope_scaling="
            f"{getattr(config, 'rope_scaling', None)}, rope_theta={read_theta} (RoPE scaling silently dropped). "
            "Add the same settings as 'rope_scaling' and 'rope_theta' to config.json, or install transformers>=5")


def partial_rotary_dim(adapter: Any, fraction: float) -> int:
    """``int(head_dim * fraction)``: the dims of each head that a partial-rotary family (GPT-NeoX, Phi-3) rotates.

    Raises:
        UnsupportedArchitectureError: that size is odd (transformers' rotary module then rotates the next even
            number of dims with frequencies ``base ** (-2i / odd)``, which no :class:`RotaryConfig` describes) or zero
            (naming the family, ``head_dim`` and ``partial_rotary_factor``); was a ``CheckpointError`` about
            ``rotary_dim`` from the config's constructor, naming no config field.
    """
    head_dim = int(adapter.head_dim)
    rotary_dim = int(head_dim * fraction)
    if rotary_dim <= 0 or rotary_dim % 2:
        raise UnsupportedArchitectureError(
            f"{adapter.family}: partial_rotary_factor={fraction} of head_dim={head_dim} rotates int({head_dim} * "
            f"{fraction}) = {rotary_dim} dims per head; only an even, non-zero number of rotary dims is supported "
            "(the model's rotary module rounds an odd one up with other frequencies)")
    return rotary_dim


@dataclass(repr=False)
class MHSAWeights(FieldsRepr):
    """One layer's multi-head self-attention in head-major form.

    Attributes:
        W_Q: ``(n_heads, d_model, head_dim)``; ``b_Q: (n_heads, head_dim)``.
        W_K, W_V: ``(n_kv_heads, d_model, head_dim)``; ``b_K, b_V: (n_kv_heads, head_dim)``
            (``n_kv_heads < n_heads`` under GQA: query head ``h`` reads KV head ``h // (n_heads/n_kv)``).
        W_O: ``(n_heads, head_dim, d_model)``; ``b_O: (d_model,)``.
        q_norm, k_norm: QK-norm weights ``(head_dim,)`` (Qwen3, Gemma-3: an RMSNorm over each head) or None;
            ``qk_norm_eps`` their eps. With ``qk_norm_per_head=False`` (OLMo-2) one RMSNorm over the whole
            projection, before it is split into heads: ``q_norm (n_heads * head_dim,)``,
            ``k_norm (n_kv_heads * head_dim,)`` (head ``h``'s gain is ``q_norm[h*head_dim:(h+1)*head_dim]``).
        rotary: RoPE of the layer, None without rotary (GPT-2).
        scale: scores are multiplied by this (``1/sqrt(head_dim)`` for most supported families;
            GPT-2 with ``scale_attn_by_inverse_layer_idx`` also divides by ``layer + 1``; Gemma-2
            ``query_pre_attn_scalar ** -0.5``).
        sliding_window: if set, query ``i`` attends only to keys ``j`` with ``i - window < j <= i``
            (transformers' ``sliding_window_overlay``: Mistral, Qwen2/Qwen3, Gemma-2 ``sliding_attention`` layers).
        softcap: attention-logit soft-capping (Gemma-2 ``attn_logit_softcapping``): the scaled scores become
            ``softcap · tanh(scores / softcap)`` before the mask and softmax; None: no capping.

    Source: Elhage et al. 2021, *A Mathematical Framework for Transformer Circuits* (head-major MHSA weights).
    """

    W_Q: torch.Tensor
    b_Q: torch.Tensor
    W_K: torch.Tensor
    b_K: torch.Tensor
    W_V: torch.Tensor
    b_V: torch.Tensor
    W_O: torch.Tensor
    b_O: torch.Tensor
    rotary: RotaryConfig | None
    scale: float
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    qk_norm_eps: float = 1e-6
    sliding_window: int | None = None
    softcap: float | None = None
    qk_norm_per_head: bool = True

    @property
    def n_heads(self) -> int:
        """Number of query heads (``W_Q.shape[0]``).

        Source: Elhage et al. 2021, *A Mathematical Framework for Transformer Circuits* (head-major MHSA weights).
        """
        return self.W_Q.shape[0]

    @property
    def n_kv_heads(self) -> int:
        """Number of key/value heads (``W_K.shape[0]``; fewer than :attr:`n_heads` under GQA).

        Source: Elhage et al. 2021, *A Mathematical Framework for Transformer Circuits* (head-major MHSA weights).
        """
        return self.W_K.shape[0]

    @property
    def head_dim(self) -> int:
        """Width of one head (``W_Q.shape[2]``).

        Source: Elhage et al. 2021, *A Mathematical Framework for Transformer Circuits* (head-major MHSA weights).
        """
        return self.W_Q.shape[2]

    @property
    def d_model(self) -> int:
        """Width of the residual stream (``W_Q.shape[1]``).

        Source: Elhage et al. 2021, *A Mathematical Framework for Transformer Circuits* (head-major MHSA weights).
        """
        return self.W_Q.shape[1]


#: RMSNorm classes whose gain is ``1 + weight`` (transformers' Gemma family: ``x / rms(x) · (1 + weight)``, in fp32)
UNIT_OFFSET_NORMS = frozenset({"GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm"})


def norm_gain(norm: nn.Module) -> torch.Tensor | None:
    """The norm's elementwise gain, detached: ``weight``, or ``1 + weight`` for a Gemma RMSNorm
    (:data:`UNIT_OFFSET_NORMS`); None without a weight."""
    w = getattr(norm, "weight", None)
    if w is None:
        return None
    w = w.detach()
    return 1.0 + w.float() if type(norm).__name__ in UNIT_OFFSET_NORMS else w


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float, gain_in_fp32: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim as transformers computes it: normalised in fp32, then the gain applied after the
    cast back (Llama, Qwen3) or, ``gain_in_fp32``, before it (``Olmo2RMSNorm``)."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (w * x).to(dtype) if gain_in_fp32 else w * x.to(dtype)


def mhsa_qk(
    w: MHSAWeights, x: Float[torch.Tensor, "batch pos d_model"], positions: torch.Tensor | None = None
) -> tuple[Float[torch.Tensor, "batch n_heads pos head_dim"], Float[torch.Tensor, "batch n_heads pos head_dim"]]:
    """Queries and keys of every query head (KV heads repeated under GQA), after QK-norm and RoPE,
    as transformers' ``eager_attention_forward`` computes them. ``positions``: ``(pos,)`` or
    ``(batch, pos)`` (default ``arange(pos)``)."""
    s = x.shape[1]
    q = torch.einsum("bsd,hde->bhse", x, w.W_Q) + w.b_Q[None, :, None]
    k = torch.einsum("bsd,hde->bhse", x, w.W_K) + w.b_K[None, :, None]
    if w.q_norm is not None and w.k_norm is not None:
        if w.qk_norm_per_head:
            q, k = _rms(q, w.q_norm, w.qk_norm_eps), _rms(k, w.k_norm, w.qk_norm_eps)
        else:  # OLMo-2: over all heads of the projection at once
            q, k = (_rms(t.transpose(1, 2).flatten(2), n, w.qk_norm_eps, gain_in_fp32=True)
                    .unflatten(2, t.shape[1::2]).transpose(1, 2) for t, n in ((q, w.q_norm), (k, w.k_norm)))
    if w.rotary is not None:
        pos = torch.arange(s, device=x.device) if positions is None else positions
        cos, sin = rotary_cos_sin(w.rotary, pos)
        q = apply_rotary(q, cos, sin, w.rotary.interleaved)
        k = apply_rotary(k, cos, sin, w.rotary.interleaved)
    return q, k.repeat_interleave(w.n_heads // w.n_kv_heads, 1)


def mhsa_mask(w: MHSAWeights, s: int, device: torch.device) -> torch.Tensor:
    """``(pos, pos)`` bool, True where query ``i`` may attend key ``j`` (causal, sliding window)."""
    causal = torch.ones(s, s, dtype=torch.bool, device=device).tril()
    if w.sliding_window is not None:
        causal = causal.triu(-(w.sliding_window - 1))  # key j > query i - window
    return causal


def mhsa_pattern(
    w: MHSAWeights, x: Float[torch.Tensor, "batch pos d_model"], positions: torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None,
) -> Float[torch.Tensor, "batch n_heads pos pos"]:
    """Causal attention patterns ``A[b, h, i, j]`` of every query head (rows sum to 1), in ``x``'s dtype: scores
    ``q·k * scale`` from :func:`mhsa_qk`, soft-capped (``softcap · tanh(scores / softcap)``) where
    ``w.softcap`` is set (Gemma-2, as transformers' ``eager_attention_forward``), causal (and
    sliding-window) mask, softmax. The scores and the softmax
    run in at least fp32 (:func:`~nnsight_lorsa._placement.bmm_f32`: bf16 / fp16 q, k upcast on the CPU, multiplied
    with an fp32 result on an accelerator; eager's softmax is fp32 too): an fp16 model's unscaled ``q·k`` past 65504
    would be ``inf`` (the pattern NaN) where the model (SDPA) is finite; rounded once to ``q``'s dtype.

    ``key_mask``: optional ``(batch, pos)`` bool, True = token: padded keys are masked too (a query always keeps
    itself, so a padded query's row is finite — and meaningless)."""
    q, k = mhsa_qk(w, x, positions)
    allowed = mhsa_mask(w, x.shape[1], x.device)
    if key_mask is not None:
        eye = torch.eye(x.shape[1], dtype=torch.bool, device=x.device)
        allowed = allowed & (key_mask.to(x.device).bool()[:, None, None, :] | eye)  # (batch, 1, pos, pos)
    return qk_pattern(w, q, k, allowed).to(q.dtype)


def qk_pattern(
    w: MHSAWeights, q: Float[torch.Tensor, "batch n_heads pos head_dim"],
    k: Float[torch.Tensor, "batch n_heads keys head_dim"], allowed: torch.Tensor,
) -> Float[torch.Tensor, "batch n_heads pos keys"]:
    """Attention patterns from queries and keys (:func:`mhsa_qk`), in fp32 (fp64 kept): scores ``q·k * scale`` in at
    least fp32 (:func:`~nnsight_lorsa._placement.bmm_f32`), soft-capped where ``w.softcap`` is set, ``-inf`` where
    ``allowed`` (bool, broadcastable to the scores: True = may attend) is False, softmax over the keys. A query that
    may attend nowhere gives a NaN row: the caller keeps one key allowed per query (:func:`mhsa_pattern` keeps the
    query itself).

    Source: transformers ``eager_attention_forward`` (scores, soft cap, mask, fp32 softmax)."""
    scores = bmm_f32(q, k.transpose(-1, -2)) * w.scale
    if w.softcap is not None:
        scores = torch.tanh(scores / w.softcap) * w.softcap
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1)


def mhsa_values(
    w: MHSAWeights, x: Float[torch.Tensor, "batch pos d_model"], b_V: torch.Tensor | None = None,
    *, repeat_kv: bool = True,
) -> Float[torch.Tensor, "batch n_heads pos head_dim"]:
    """Per-query-head values ``v = x W_V + b_V`` (KV heads repeated under GQA; with ``repeat_kv=False``
    one per KV head, ``(batch, n_kv_heads, pos, head_dim)``); ``b_V`` overrides ``w.b_V`` (e.g. scaled
    by an attribution multiplier, broadcastable to ``(batch, n_kv, 1, head_dim)``)."""
    bias = w.b_V[None, :, None] if b_V is None else b_V
    v = torch.einsum("bsd,hde->bhse", x, w.W_V) + bias
    return v.repeat_interleave(w.n_heads // w.n_kv_heads, 1) if repeat_kv else v


def mhsa_forward(
    w: MHSAWeights,
    x: Float[torch.Tensor, "batch pos d_model"],
    positions: torch.Tensor | None = None,
    *,
    per_head: bool = False,
    key_mask: torch.Tensor | None = None,
) -> Float[torch.Tensor, "batch pos d_model"] | Float[torch.Tensor, "batch pos n_heads d_model"]:
    """Recompute causal MHSA from its pieces (eager; no padding mask unless ``key_mask``).

    ``x``: the attention's input ``(batch, pos, d_model)``; ``positions``: ``(pos,)`` or
    ``(batch, pos)`` token positions for RoPE (default ``arange(pos)``); ``key_mask``: optional ``(batch, pos)``
    bool, True = token (padded keys masked; padded queries' rows are meaningless). Pattern as
    :func:`mhsa_pattern`, then ``z = A v``, ``z @ W_O + b_O``.

    Returns the attention output ``(batch, pos, d_model)`` including ``b_O``, or with
    ``per_head=True`` each head's contribution ``(batch, pos, n_heads, d_model)`` (without
    ``b_O``; they sum to the output minus ``b_O``).

    Raises:
        ArgumentError: ``per_head`` not a bool, ``w`` not an :class:`MHSAWeights`, ``x`` not a 3-D tensor,
            ``positions`` / ``key_mask`` not None or a tensor.
        ShapeError: ``x`` of another width than the weights' ``d_model`` or in another dtype (a matmul's raw
            ``RuntimeError`` before).

    Source: *From Tokenization to Attribution Graphs* §3.3 (multi-head self-attention); transformers
    ``eager_attention_forward``.
    """
    check_flag(per_head, "per_head", "mhsa_forward")
    if not isinstance(w, MHSAWeights):
        raise ArgumentError(f"mhsa_forward(w=...) must be an MHSAWeights (adapter.mhsa_weights(model, layer)), got a "
                            f"{type(w).__name__}")
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        got = f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else f"a {type(x).__name__}"
        raise ArgumentError(f"mhsa_forward(x=...) must be a (batch, pos, d_model) tensor, got {got}")
    for name, value in (("positions", positions), ("key_mask", key_mask)):
        if value is not None and not isinstance(value, torch.Tensor):
            raise ArgumentError(f"mhsa_forward({name}=...) must be None or a tensor, got a {type(value).__name__}")
    check_last_dim(x, w.W_Q.shape[1], "mhsa_forward", "x", w.W_Q)  # the width and dtype of the weights
    z = mhsa_pattern(w, x, positions, key_mask) @ mhsa_values(w, x)  # (b, h, s, e)
    if per_head:
        return torch.einsum("bhse,hed->bshd", z, w.W_O)
    return torch.einsum("bhse,hed->bsd", z, w.W_O) + w.b_O


class ArchitectureAdapter:
    """Where one model family keeps its attention (and the rest of a decoder layer).

    Subclasses implement :meth:`rotary_config` and :meth:`mhsa_weights` (a plain base class, not an
    ``abc.ABC``: adapters travel by value to NDIF servers, whose unpickler does not allow ``abc``).

    Paths are dotted module paths from the Hugging Face ``*ForCausalLM`` root (the same paths
    nnsight envoys use below the wrapper: ``model.<path>``).

    Source: transformers ``models/<family>/modeling_<family>.py`` (where each family keeps its layers, attention, MLP,
    norms and RoPE).
    """

    #: transformers ``config.model_type`` values this adapter serves.
    model_types: ClassVar[tuple[str, ...]] = ()
    #: short family name stored in checkpoints.
    family: ClassVar[str] = ""

    # ---- structure ------------------------------------------------------
    layers_path: ClassVar[str] = ""
    attention_name: ClassVar[str] = ""
    mlp_name: ClassVar[str] = ""
    embed_path: ClassVar[str] = ""
    #: the module whose output is the residual stream before layer 0 (TransformerLens ``blocks.0.hook_resid_pre``),
    #: where that is not the token embedding's own output ("": it is): GPT-2's ``transformer.drop`` (``wte + wpe``)
    residual_start_name: ClassVar[str] = ""
    #: learned absolute position embeddings ``(n_positions, d_model)`` added to the token embeddings (GPT-2's
    #: ``transformer.wpe``; "": none, positions enter through RoPE): a prompt longer than its rows cannot run
    pos_embed_path: ClassVar[str] = ""
    final_norm_path: ClassVar[str] = ""
    #: the unembedding; :func:`~nnsight_lorsa.adapters.get_adapter` sets it per model from the model's
    #: ``get_output_embeddings()`` (the class value is the default for an adapter built from a config).
    lm_head_path: str = "lm_head"
    #: names (inside a decoder layer) of the norms before the attention and before the MLP ("": none, OLMo-2)
    attention_norm_name: ClassVar[str] = ""
    mlp_norm_name: ClassVar[str] = ""
    #: the modules (inside the attention) whose outputs hold each head's query / key / value input, split into heads
    #: by column and not mixed across heads afterwards (path patching's MHSA receivers): the projections, or
    #: OLMo-2's ``q_norm`` / ``k_norm``, which mix all heads' projections
    head_input_names: ClassVar[dict[str, str]] = {"q": "q_proj", "k": "k_proj", "v": "v_proj"}
    #: names of the norms after the attention and after the MLP, applied before each residual add (Gemma-2/3,
    #: OLMo-2; "": none)
    attention_post_norm_name: ClassVar[str] = ""
    mlp_post_norm_name: ClassVar[str] = ""

    def __init__(self, config: Any) -> None:
        self.config = config
        check_rope_read(config)

    @property
    def n_layers(self) -> int:
        """Number of decoder layers (``config.num_hidden_layers``).

        Source: transformers ``models/<family>/modeling_<family>.py`` (where each family keeps its layers, attention,
        MLP, norms and RoPE).
        """
        return int(self.config.num_hidden_layers)

    @property
    def d_model(self) -> int:
        """Width of the residual stream (``config.hidden_size``).

        Source: transformers ``models/<family>/modeling_<family>.py`` (where each family keeps its layers, attention,
        MLP, norms and RoPE).
        """
        return int(self.config.hidden_size)

    def check_layer(self, layer: Any) -> int:
        """Return ``layer`` as an ``int`` if in ``[0, n_layers)``; else raise :class:`LayerOutOfRangeError`.

        Integer-likes (``numpy.int64``, 0-d integer tensors) are accepted; bools, floats and
        negative indices are not.

        Source: transformers ``models/<family>/modeling_<family>.py`` (where each family keeps its layers, attention,
        MLP, norms and RoPE).
        """
        try:
            index = None if isinstance(layer, bool) else operator.index(layer)
        except TypeError:
            index = None
        if index is None:  # a str, float, bool … is no layer (said "out of range" for "1" until 2026-11-30)
            raise LayerOutOfRangeError(
                f"layer {layer!r} must be an int in 0..{self.n_layers - 1} for a {self.n_layers}-layer {self.family} "
                f"model, got a {type(layer).__name__}")
        if not 0 <= index < self.n_layers:
            raise LayerOutOfRangeError(
                f"layer {layer!r} is out of range for a {self.n_layers}-layer {self.family} model"
                f" (valid: 0..{self.n_layers - 1})"
            )
        return index

    def layer_path(self, layer: int) -> str:
        """Module path of decoder layer ``layer``. Raises :class:`~nnsight_lorsa.errors.LayerOutOfRangeError` outside
        ``[0, n_layers)``.

        Source: transformers ``models/<family>/modeling_<family>.py`` (where each family keeps its layers, attention,
        MLP, norms and RoPE).
        """
        return f"{self.layers_path}.{self.check_layer(layer)}"

    def layer_of_path(self, path: str) -> int | None:
        """The decoder layer whose block holds module ``path`` (:meth:`layer_path` itself or a module inside it,
        e.g. an SAE's site ``model.layers.3.mlp`` → 3); None for a path outside every layer (the embedding, the
        final norm, the unembedding) or naming no layer of this model.

        Source: transformers ``models/<family>/modeling_<family>.py`` (where each family keeps its layers, attention,
        MLP, norms and RoPE).
        """
        prefix = self.layers_path + "."
        if not path.startswith(prefix):
            return None
        head = path[len(prefix):].split(".", 1)[0]
        if not (head.isascii() and head.isdigit()) or str(int(head)) != head or int(head) >= self.n_layers:
            return None  # "01", "٢", a layer past the model's: no module of this model
        return int(head)

    def attention_path(self, layer: int) -> str:
        """Module path of layer ``layer``'s attention (as :meth:`layer_path`).

        Source: transformers ``models/<family>/modeling_<family>.py`` (where each family keeps its layers, attention,
        MLP, norms and RoPE).
        """
        return f"{self.layer_path(layer)}.{self.attention_name}"

    def mlp_path(self, layer: int) -> str:
        """Module path of layer ``layer``'s MLP (as :meth:`layer_path`).

        Source: transformers ``models/<family>/modeling_<family>.py`` (where each family keeps its layers, attention,
        MLP, norms and RoPE).
        """
        return f"{self.layer_path(layer)}.{self.mlp_name}"

    @property
    def residual_start_path(self) -> str:
        """The module whose output is the residual stream entering layer 0 (TransformerLens
        ``blocks.0.hook_resid_pre``): :attr:`embed_path`, or where the model adds more to the token embedding
        (GPT-2's position embedding) the module after that add (:attr:`residual_start_name`).

        Source: transformers ``models/<family>/modeling_<family>.py`` (where each family keeps its layers, attention,
        MLP, norms and RoPE).
        """
        return self.residual_start_name or self.embed_path

    def _sub_path(self, layer: int, name: str) -> str | None:
        path = self.layer_path(layer)
        return f"{path}.{name}" if name else None

    def attention_norm_path(self, layer: int) -> str | None:
        """The norm whose output the attention reads (``input_layernorm``, GPT-2 ``ln_1``), or None: a family
        without pre-norms (OLMo-2), whose attention reads the residual stream itself.

        Source: transformers ``models/<family>/modeling_<family>.py`` (where each family keeps its layers, attention,
        MLP, norms and RoPE).
        """
        return self._sub_path(layer, self.attention_norm_name)

    def mlp_norm_path(self, layer: int) -> str | None:
        """The norm whose output the MLP reads (``post_attention_layernorm``, GPT-2 ``ln_2``), or None (OLMo-2:
        the MLP reads the residual stream).

        Source: transformers ``models/<family>/modeling_<family>.py`` (where each family keeps its layers, attention,
        MLP, norms and RoPE).
        """
        return self._sub_path(layer, self.mlp_norm_name)

    def attention_post_norm_path(self, layer: int) -> str | None:
        """The norm the attention output goes through before the residual add (Gemma-2's and OLMo-2's
        ``post_attention_layernorm``), or None: the families without post-norms add it as it is.

        Source: transformers ``models/<family>/modeling_<family>.py`` (where each family keeps its layers, attention,
        MLP, norms and RoPE).
        """
        return self._sub_path(layer, self.attention_post_norm_name)

    def mlp_post_norm_path(self, layer: int) -> str | None:
        """The norm the MLP output goes through before the residual add (Gemma-2's and OLMo-2's
        ``post_feedforward_layernorm``), or None.

        Source: transformers ``models/<family>/modeling_<family>.py`` (where each family keeps its layers, attention,
        MLP, norms and RoPE).
        """
        return self._sub_path(layer, self.mlp_post_norm_name)

    def sliding_window(self, layer: int) -> int | None:
        """The sliding-window size of layer ``layer``'s attention, or None (full causal; the families without
        sliding layers).

        Raises:
            LayerOutOfRangeError: ``layer`` outside ``[0, n_layers)``.

        Source: transformers ``models/<family>/modeling_<family>.py`` (where each family keeps its layers, attention,
        MLP, norms and RoPE).
        """
        self.check_layer(layer)
        return None

    def final_logit_softcap(self) -> float | None:
        """The cap ``c`` of the model's final logits, ``c · tanh(lm_head(x) / c)`` after the unembedding
        (Gemma-2's ``final_logit_softcapping``), or None: the logits are the unembedding's output.

        Source: transformers ``models/<family>/modeling_<family>.py`` (where each family keeps its layers, attention,
        MLP, norms and RoPE).
        """
        return None

    def final_logits(self, head_out: torch.Tensor) -> torch.Tensor:
        """The model's logits from its unembedding's output ``(..., vocab)`` (same shape, dtype, device): soft-capped
        where :meth:`final_logit_softcap` is set, ``c · tanh(head_out / c)`` computed as transformers' Gemma-2 does,
        in ``head_out``'s dtype (each step rounded to bf16 / fp16 for such a model: its logits bit for bit; an fp32
        upcast first gave a third of a bf16 model's logits one ulp off), else ``head_out`` itself. Pass the
        unembedding's output in the model's dtype, not upcast.

        Source: transformers ``models/<family>/modeling_<family>.py`` (where each family keeps its layers, attention,
        MLP, norms and RoPE).
        """
        cap = self.final_logit_softcap()
        if cap is None:
            return head_out
        return torch.tanh(head_out / cap) * cap

    @staticmethod
    def get_module(root: nn.Module, path: str) -> nn.Module:
        """``root.get_submodule(path)`` with a clear error naming the missing piece.

        Raises:
            UnsupportedArchitectureError: ``root`` has no module at ``path``.

        Source: transformers ``models/<family>/modeling_<family>.py`` (where each family keeps its layers, attention,
        MLP, norms and RoPE).
        """
        try:
            return root.get_submodule(path)
        except AttributeError as e:
            raise UnsupportedArchitectureError(
                f"{type(root).__name__} has no module at {path!r}: {e}"
            ) from e

    def attention_module(self, root: nn.Module, layer: int) -> nn.Module:
        """Layer ``layer``'s attention module under ``root`` (at :meth:`attention_path`).

        Source: transformers ``models/<family>/modeling_<family>.py`` (where each family keeps its layers, attention,
        MLP, norms and RoPE).
        """
        return self.get_module(root, self.attention_path(layer))

    # ---- the attention module's call --------------------------------------
    @property
    def n_heads(self) -> int:
        """Number of query heads (``config.num_attention_heads``).

        Source: transformers ``models/<family>/modeling_<family>.py`` (where each family keeps its layers, attention,
        MLP, norms and RoPE).
        """
        return int(self.config.num_attention_heads)

    @property
    def head_dim(self) -> int:
        """Head size: ``config.head_dim`` where the family has one, else ``d_model // n_heads``.

        Source: transformers ``models/<family>/modeling_<family>.py`` (where each family keeps its layers, attention,
        MLP, norms and RoPE).
        """
        return int(getattr(self.config, "head_dim", None) or self.d_model // self.n_heads)

    def attention_input(self, args: tuple, kwargs: dict) -> torch.Tensor:
        """The hidden states ``(batch, pos, d_model)`` the attention module was called with
        (keyword ``hidden_states`` as Llama's decoder layer passes it, or the first positional
        argument as GPT-2's and GPT-NeoX's do).

        Raises:
            UnsupportedArchitectureError: the attention was called without a hidden-states tensor (first argument or
                ``hidden_states=``).

        Source: transformers ``models/<family>/modeling_<family>.py`` (where each family keeps its layers, attention,
        MLP, norms and RoPE).
        """
        x = kwargs.get("hidden_states", args[0] if args else None)
        if not isinstance(x, torch.Tensor):
            raise UnsupportedArchitectureError(f"{self.family}: attention was called without hidden_states")
        return x

    def attention_positions(self, args: tuple, kwargs: dict, x: torch.Tensor) -> torch.Tensor:
        """Token positions of the call, ``(batch, pos)`` or ``(pos,)`` (default ``arange(pos)``).

        Source: transformers ``models/<family>/modeling_<family>.py`` (where each family keeps its layers, attention,
        MLP, norms and RoPE).
        """
        pos = kwargs.get("position_ids")
        if pos is None:
            pos = kwargs.get("cache_position")
        return torch.arange(x.shape[1], device=x.device) if pos is None else pos

    def attention_mask(self, args: tuple, kwargs: dict) -> torch.Tensor | None:
        """The ``(batch, 1, pos, pos)`` mask the attention was called with, or None (plain causal).

        Source: transformers ``models/<family>/modeling_<family>.py`` (where each family keeps its layers, attention,
        MLP, norms and RoPE).
        """
        mask = kwargs.get("attention_mask")
        return mask if isinstance(mask, torch.Tensor) and mask.dim() == 4 else None

    def attention_output(self, output: Any) -> torch.Tensor:
        """The attention output ``(batch, pos, d_model)`` inside the module's return value.

        Source: transformers ``models/<family>/modeling_<family>.py`` (where each family keeps its layers, attention,
        MLP, norms and RoPE).
        """
        return output[0] if isinstance(output, tuple) else output

    def with_attention_output(self, output: Any, new: torch.Tensor) -> Any:
        """The module's return value with its attention output replaced by ``new``.

        Source: transformers ``models/<family>/modeling_<family>.py`` (where each family keeps its layers, attention,
        MLP, norms and RoPE).
        """
        return (new, *output[1:]) if isinstance(output, tuple) else new

    # ---- the MLP module's call ----------------------------------------------
    def mlp_module(self, root: nn.Module, layer: int) -> nn.Module:
        """Layer ``layer``'s MLP module under ``root`` (at :meth:`mlp_path`).

        Source: transformers ``models/<family>/modeling_<family>.py`` (where each family keeps its layers, attention,
        MLP, norms and RoPE).
        """
        return self.get_module(root, self.mlp_path(layer))

    def mlp_input(self, args: tuple, kwargs: dict) -> torch.Tensor:
        """The hidden states ``(batch, pos, d_model)`` the MLP was called with: the output of the
        pre-MLP norm, passed as the first positional argument by every supported family
        (transformers 5: ``LlamaDecoderLayer``/Qwen2/Qwen3 ``self.mlp(hidden_states)`` after
        ``post_attention_layernorm``; ``GPT2Block`` ``self.mlp(ln_2(h))``; ``GPTNeoXLayer``
        ``self.mlp(post_attention_layernorm(·))``, of the layer input under parallel residual).

        Raises:
            UnsupportedArchitectureError: the MLP was called without a hidden-states tensor.

        Source: transformers ``models/<family>/modeling_<family>.py`` (where each family keeps its layers, attention,
        MLP, norms and RoPE).
        """
        x = args[0] if args else kwargs.get("hidden_states", kwargs.get("x"))
        if not isinstance(x, torch.Tensor):
            raise UnsupportedArchitectureError(f"{self.family}: the MLP was called without hidden states")
        return x

    def mlp_output(self, output: Any) -> torch.Tensor:
        """The MLP output ``(batch, pos, d_model)`` inside the module's return value (a tensor in
        the supported families; the first element of a tuple otherwise, e.g. MoE blocks).

        Source: transformers ``models/<family>/modeling_<family>.py`` (where each family keeps its layers, attention,
        MLP, norms and RoPE).
        """
        return output[0] if isinstance(output, tuple) else output

    def with_mlp_output(self, output: Any, new: torch.Tensor) -> Any:
        """The MLP's return value with its output replaced by ``new``.

        Source: transformers ``models/<family>/modeling_<family>.py`` (where each family keeps its layers, attention,
        MLP, norms and RoPE).
        """
        return (new, *output[1:]) if isinstance(output, tuple) else new

    # ---- weights -----------------------------------------------------------
    def rotary_config(self, layer: int | None = None) -> RotaryConfig | None:
        """The model's RoPE, derived from its config (None without rotary); ``layer``: the layer whose RoPE,
        for a family whose layers rotate differently (Gemma-3), ignored by the others.

        Raises:
            UnsupportedArchitectureError: the adapter does not implement it (the base class).

        Source: Lorsa paper (He et al. 2025) App. A (RoPE as the target model applies it); transformers
        ``modeling_rope_utils.py``.
        """
        raise UnsupportedArchitectureError(f"{type(self).__name__} must implement rotary_config (the adapter of "
                                           f"{self.family!r} gives no rotary embedding)")

    def rotary_buffers(self, root: nn.Module, layer: int) -> list[tuple[str, torch.Tensor]]:
        """``[(name, buffer)]``: the model's inverse-frequency buffers that may rotate layer ``layer``'s queries and
        keys — buffers named ``inv_freq`` or ``{layer_type}_inv_freq`` (Gemma-3 in transformers 5: one per
        ``config.layer_types`` entry; ``*original_inv_freq``, the copy dynamic RoPE restores, is not one), held by a
        module inside the layer (a per-attention rotary module) or else outside every layer (transformers 5's one
        ``model.rotary_emb``). Empty for a model without such buffers (GPT-2, a custom rotary).

        Source: Lorsa paper (He et al. 2025) App. A (RoPE as the target model applies it); transformers
        ``modeling_rope_utils.py``.
        """
        layer = self.check_layer(layer)
        layer_types = getattr(self.config, "layer_types", None)
        kind = layer_types[layer] if isinstance(layer_types, (list, tuple)) and len(layer_types) > layer else None
        names = {"inv_freq"} | ({f"{kind}_inv_freq"} if isinstance(kind, str) else set())
        inside, outside = [], []
        own, layers = self.layer_path(layer) + ".", self.layers_path + "."
        for name, buf in root.named_buffers():
            if name.rpartition(".")[2] not in names:
                continue
            if name.startswith(own):
                inside.append((name, buf))
            elif not name.startswith(layers):
                outside.append((name, buf))
        return inside or outside

    def model_rotary(self, root: nn.Module, layer: int, cfg: RotaryConfig | None) -> RotaryConfig | None:
        """``cfg`` (the RoPE :meth:`rotary_config` derives from the config) as the model ``root`` computes it, read
        from its rotary buffer (:meth:`rotary_buffers`): :attr:`RotaryConfig.inv_freq_dtype` set where the buffer's
        values are the frequencies rounded to bf16 / fp16 — a model cast after loading (``.to(torch.bfloat16)``,
        ``.half()``; also one cast back to fp32 / fp64 after that, which keeps the rounded values), whose forward
        upcasts the buffer to fp32. Where the buffer holds values (not on ``meta``) :func:`rotary_inv_freq` of the
        returned config, computed on the CPU as transformers computes the buffer at its init (or on the buffer's
        device, for a model built there), equals the buffer upcast to fp32 bit for bit (tried: the rounding of the
        buffer's own dtype, none, bf16, fp16; several candidate buffers: the first that matches); on ``meta`` the
        buffer's dtype decides. One small copy of each candidate buffer to the host per call.

        Raises:
            ConfigMismatchError: no candidate buffer equals the frequencies derived from the config under any of
                these roundings (naming the layer, the buffer, the largest difference): a RoPE this package derives
                wrongly is refused, never attributed silently; or a buffer of another dtype than fp64 / fp32 / bf16 /
                fp16.

        Source: Lorsa paper (He et al. 2025) App. A (RoPE as the target model applies it); transformers
        ``modeling_rope_utils.py``.
        """
        if cfg is None:
            return None
        found = self.rotary_buffers(root, layer)
        if not found:
            return cfg
        rounding = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: None, torch.float64: None}
        failures = []
        for name, buf in found:
            if buf.dtype not in rounding:
                failures.append(f"{name} is {buf.dtype} (expected float32, float64, bfloat16 or float16)")
                continue
            own = rounding[buf.dtype]
            if buf.device.type == "meta":
                return dataclasses.replace(cfg, inv_freq_dtype=own)
            theirs = buf.detach().to(device="cpu", dtype=torch.float32)
            gap: float | str | None = None
            # computed on the CPU (transformers' init), else on the buffer's device (a model built under
            # ``torch.device("cuda")``: its kernels' roundings)
            devices = dict.fromkeys((torch.device("cpu"), buf.device))
            roundings = dict.fromkeys((own, None, "bfloat16", "float16"))
            for dtype, device in ((r, d) for r in roundings for d in devices):
                out = dataclasses.replace(cfg, inv_freq_dtype=dtype)
                ours = rotary_inv_freq(out, device=device).cpu()
                if theirs.shape != ours.shape:
                    gap = f"shape {tuple(theirs.shape)} != {tuple(ours.shape)}"
                    break
                if torch.equal(theirs, ours):
                    return out
                if dtype == own and gap is None:
                    gap = float((theirs - ours).abs().max())
            failures.append(f"{name} ({buf.dtype}) differs from the config's by {gap}")
        raise ConfigMismatchError(
            f"{self.family} layer {layer}: the model's rotary inverse frequencies are not those derived from its "
            f"config ({cfg}): {'; '.join(failures)}. Its queries and keys rotate differently from the frozen MHSA's; "
            "refused rather than attributed with another RoPE")

    def mhsa_weights(self, root: nn.Module, layer: int) -> MHSAWeights:
        """Layer ``layer``'s MHSA weights (detached views/copies of the live parameters).

        Raises:
            UnsupportedArchitectureError: the adapter does not implement it (the base class).

        Source: Elhage et al. 2021, *A Mathematical Framework for Transformer Circuits* (head-major MHSA weights).
        """
        raise UnsupportedArchitectureError(f"{type(self).__name__} must implement mhsa_weights (the adapter of "
                                           f"{self.family!r} gives no attention weights)")

    @staticmethod
    def rope_parameters(config: Any) -> dict[str, Any]:
        """transformers-5 ``rope_parameters`` (or transformers-4 ``rope_theta``/``rope_scaling``).

        Source: Lorsa paper (He et al. 2025) App. A (RoPE as the target model applies it); transformers
        ``modeling_rope_utils.py``.
        """
        params = getattr(config, "rope_parameters", None)
        if isinstance(params, dict) and params:
            return dict(params)
        scaling = dict(getattr(config, "rope_scaling", None) or {})
        scaling.setdefault("rope_type", scaling.pop("type", "default"))
        scaling.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
        return scaling

    def _rotary_from_params(self, head_dim: int, rotary_dim: int, interleaved: bool,
                            params: dict[str, Any] | None = None) -> RotaryConfig:
        """The :class:`RotaryConfig` of ``params`` (default the config's :meth:`rope_parameters`; Gemma-3: one layer
        type's), its scaling keys resolved as transformers 5 resolves them (``standardize_rope_params`` and the
        ``ROPE_INIT_FUNCTIONS``): llama3 / yarn ``original_max_position_embeddings`` from ``config`` where it has the
        attribute (Phi-3's priority, one global dict), else the parameters', else ``max_position_embeddings``; yarn's
        ``factor`` None as ``max_position_embeddings / original_max_position_embeddings``, ``beta_fast`` /
        ``beta_slow`` falsy as 32 / 1, ``truncate`` read from the *global* ``rope_parameters`` (as transformers does,
        so never from a layer type's dict), ``attention_factor`` given or derived from ``factor``, ``mscale``,
        ``mscale_all_dim`` (into :attr:`RotaryConfig.attention_scaling`).

        Raises:
            UnsupportedArchitectureError: a rope type :class:`RotaryConfig` does not describe (``dynamic`` /
                ``longrope``: sequence-length-dependent frequencies, said so).
            CheckpointError: parameters out of range (from :class:`RotaryConfig`).
        """
        top = self.rope_parameters(self.config)
        nested = any(isinstance(v, dict) for v in top.values())  # one dict per layer type (Gemma-3)
        params = top if params is None else params
        rope_type = params.get("rope_type", params.get("type", "default"))
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        scaling = {k: float(v) for k, v in params.items() if k in keys and v is not None}
        attention_scaling = 1.0
        if rope_type in ("llama3", "yarn"):
            c = self.config
            if not nested and hasattr(c, "original_max_position_embeddings"):
                scaling["original_max_position_embeddings"] = float(c.original_max_position_embeddings)
            elif params.get("original_max_position_embeddings") is None:
                scaling["original_max_position_embeddings"] = float(c.max_position_embeddings)
        if rope_type == "yarn":
            attention_scaling = self._yarn_scaling(params, top, scaling)
        return RotaryConfig(
            head_dim=head_dim, rotary_dim=rotary_dim, base=float(params.get("rope_theta", 10000.0)),
            interleaved=interleaved, rope_type=rope_type, scaling=scaling, attention_scaling=attention_scaling,
        )

    def _yarn_scaling(self, params: dict[str, Any], top: dict[str, Any], scaling: dict[str, float]) -> float:
        """Fill ``scaling`` with yarn's ``factor``, ``beta_fast``, ``beta_slow``, ``truncate`` and return its
        attention factor, as transformers' ``_compute_yarn_parameters`` (Python floats)."""
        factor = params.get("factor")
        if factor is None:
            factor = self.config.max_position_embeddings / scaling["original_max_position_embeddings"]
        scaling["factor"] = float(factor)
        scaling["beta_fast"] = float(params.get("beta_fast") or 32)
        scaling["beta_slow"] = float(params.get("beta_slow") or 1)
        scaling["truncate"] = 1.0 if top.get("truncate", True) else 0.0

        def get_mscale(scale: Any, mscale: Any = 1) -> float:  # ints as the config gives them
            if scale <= 1:
                return 1.0
            return 0.1 * mscale * math.log(scale) + 1.0

        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
            if mscale and mscale_all_dim:
                attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
            else:
                attention_factor = get_mscale(factor)
        return float(attention_factor)
