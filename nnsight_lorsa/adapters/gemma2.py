"""Gemma-2 adapter (``model_type == "gemma2"``; Gemma-2-2B is circuit-tracer's flagship model) and Gemma-3's
text model (``"gemma3_text"``, :class:`Gemma3Adapter`).

transformers layout (``Gemma2ForCausalLM``, ``modeling_gemma2.py``): the attention is Llama's
(``model.layers[i].self_attn`` with ``q_proj``/``k_proj``/``v_proj``/``o_proj``, GQA, half-split default
RoPE, called with keyword ``hidden_states`` and returning ``(attn_output, attn_weights)``), with:

- scores multiplied by ``config.query_pre_attn_scalar ** -0.5`` (``Gemma2Attention.scaling``; not
  ``head_dim ** -0.5``), then soft-capped ``c · tanh(scores / c)`` with ``c = config.attn_logit_softcapping``
  (before the mask; :attr:`MHSAWeights.softcap`);
- sliding-window attention (``config.sliding_window``) on the layers whose ``config.layer_types[i]`` is
  ``"sliding_attention"`` (every other layer, from layer 0) — :meth:`LlamaAdapter.sliding_window`;
- four RMSNorms per decoder layer, each ``x / rms(x) · (1 + weight)`` computed in fp32 then cast back
  (``Gemma2RMSNorm``): ``h = h + post_attention_layernorm(attn(input_layernorm(h)))``, then
  ``h = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))`` (the residual adds come after
  the post-norms); the final ``model.norm`` is the same RMSNorm;
- token embeddings multiplied by ``sqrt(hidden_size)`` inside ``model.embed_tokens`` (the normaliser rounded
  to the embedding dtype), so ``embed_tokens``' output is the scaled embedding;
- final logits soft-capped ``c · tanh(logits / c)`` with ``c = config.final_logit_softcapping``, in
  ``Gemma2ForCausalLM.forward`` after ``lm_head`` (no module of its own).

Sites (what the replacement modules replace):

- **attention** (a Lorsa): ``self_attn``'s input (``input_layernorm``'s output) and output — the
  ``o_proj`` output, *before* ``post_attention_layernorm``; a Lorsa's output goes through the model's own
  post-attention norm, as the MHSA's did.
- **MLP** (a transcoder, CLT, MLP SAE): ``mlp``'s input (``pre_feedforward_layernorm``'s output) and output
  (the ``down_proj`` output, *before* ``post_feedforward_layernorm``). GemmaScope's / circuit-tracer's Gemma-2
  transcoders (``feature_input_hook: ln2.hook_normalized``, ``feature_output_hook: hook_mlp_out``; circuit-tracer's
  nnsight mapping ``pre_feedforward_layernorm``'s ``_norm`` output, i.e. before the ``(1 + weight)`` gain, and
  ``post_feedforward_layernorm``'s output) run where they were trained: ``TranscoderSet`` / ``CLTSet`` read
  ``x / rms(x)`` of ``pre_feedforward_layernorm``'s input (computed as the norm computes it, fp32) and replace
  ``post_feedforward_layernorm``'s output (:func:`~nnsight_lorsa.formats.hook_sites.mlp_site_io`); the
  attribution reads and writes them there too (:meth:`~nnsight_lorsa.attribution.replacement.FrozenReplacement.norm`:
  the frozen pre-MLP norm's ``x / rms(x)``, the post-MLP norm's output in place of the frozen post-norm).

Attribution (:mod:`nnsight_lorsa.attribution`): the frozen replacement model freezes the two post-norms like
the pre-norms (:meth:`Gemma2Adapter.attention_post_norm_path`, :meth:`Gemma2Adapter.mlp_post_norm_path`; their
``1 + weight`` gain: :func:`~nnsight_lorsa.adapters.base.norm_gain`), keeps the attention patterns of
soft-capped MHSA layers (SDPA cannot cap), and its logit nodes are the *uncapped* unembedding outputs, demeaned —
the final soft-cap is not part of the graph (circuit-tracer attributes Gemma-2 from the same place, the final
hidden state); the target tokens' probabilities are the capped logits' (:meth:`final_logit_softcap`).

Only the eager attention exists: transformers refuses ``attn_implementation="sdpa"`` for Gemma-2 (SDPA has no
soft-capping).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from ..errors import ConfigMismatchError
from ..modules.rotary import RotaryConfig
from .base import MHSAWeights
from .llama import LlamaAdapter


class Gemma2Adapter(LlamaAdapter):
    model_types: ClassVar[tuple[str, ...]] = ("gemma2",)
    family: ClassVar[str] = "gemma2"
    mlp_norm_name = "pre_feedforward_layernorm"
    attention_post_norm_name = "post_attention_layernorm"
    mlp_post_norm_name = "post_feedforward_layernorm"

    def _cap(self, name: str) -> float | None:
        cap = getattr(self.config, name, None)
        return None if cap is None else float(cap)

    def final_logit_softcap(self) -> float | None:
        """``config.final_logit_softcapping``: the logits are ``c · tanh(lm_head(x) / c)`` (None: plain)."""
        return self._cap("final_logit_softcapping")

    def mhsa_weights(self, root: nn.Module, layer: int) -> MHSAWeights:
        """As :meth:`LlamaAdapter.mhsa_weights` (``scale`` = ``Gemma2Attention.scaling`` =
        ``query_pre_attn_scalar ** -0.5``, the layer's sliding window), with ``softcap`` =
        ``attn_logit_softcapping``."""
        w = super().mhsa_weights(root, layer)
        w.softcap = self._cap("attn_logit_softcapping")
        return w


class Gemma3Adapter(Gemma2Adapter):
    """Gemma-3's text model (``Gemma3ForCausalLM``, ``model_type == "gemma3_text"``): Gemma-2's layer (four
    ``1 + weight`` RMSNorms, ``query_pre_attn_scalar`` scale, sliding layers from ``layer_types``, soft-caps where
    the config sets them — None in the released configs) with

    - QK-norm: ``self_attn.q_norm`` / ``k_norm``, ``Gemma3RMSNorm`` over ``head_dim`` before RoPE, gain
      ``1 + weight`` (:attr:`MHSAWeights.q_norm` holds the gain, ``1 + weight`` in fp32);
    - RoPE per layer type: ``config.rope_parameters[layer_types[i]]`` (``sliding_attention``: the local base,
      10k; ``full_attention``: 1M, ``linear`` scaling in the larger models), so :meth:`rotary_config` needs the
      layer.

    The multimodal ``Gemma3ForConditionalGeneration`` (``model_type == "gemma3"``, its text model under
    ``model.language_model``) is not served.
    """

    model_types: ClassVar[tuple[str, ...]] = ("gemma3_text",)
    family: ClassVar[str] = "gemma3"

    def rotary_config(self, layer: int | None = None) -> RotaryConfig:
        """The RoPE of layer ``layer``'s type (``config.rope_parameters[config.layer_types[layer]]``).

        Raises:
            ConfigMismatchError: no ``layer`` (the sliding and the full layers rotate differently).
            LayerOutOfRangeError: ``layer`` outside ``[0, n_layers)``.
        """
        if layer is None:
            raise ConfigMismatchError(
                f"{self.family}: RoPE differs by layer type ({sorted(self.rope_parameters(self.config))}); "
                "call rotary_config(layer) or read mhsa_weights(model, layer).rotary")
        params: dict[str, Any] = self.rope_parameters(self.config)
        kind = self.config.layer_types[self.check_layer(layer)]
        return self._rotary_from_params(self.head_dim, self.head_dim, interleaved=False,
                                        params=dict(params.get(kind, params)))

    def mhsa_weights(self, root: nn.Module, layer: int) -> MHSAWeights:
        """As :meth:`Gemma2Adapter.mhsa_weights` (the layer type's RoPE), with the QK-norm gains
        ``1 + q_norm.weight``, ``1 + k_norm.weight`` (fp32, ``(head_dim,)``)."""
        attn: Any = self.attention_module(root, layer)
        w = super().mhsa_weights(root, layer)
        w.q_norm, w.k_norm = (1.0 + norm.weight.detach().to(torch.float32) for norm in (attn.q_norm, attn.k_norm))
        w.qk_norm_eps = float(attn.q_norm.eps)
        return w

