"""Gemma-1 adapter (``model_type == "gemma"``, ``GemmaForCausalLM``, ``modeling_gemma.py``: Gemma-2B / 7B, CodeGemma).

Llama's decoder layer and attention (``input_layernorm`` → ``self_attn`` → residual add; ``post_attention_layernorm``
→ ``mlp`` → residual add; ``q_proj``/``k_proj``/``v_proj``/``o_proj``, MQA / GQA, half-split default RoPE, scale
``head_dim ** -0.5`` with ``head_dim`` from the config: 256), with Gemma's pieces, as Gemma-2 has them:

- every RMSNorm is ``x / rms(x) · (1 + weight)`` in fp32, then cast (``GemmaRMSNorm``, in
  :data:`~nnsight_lorsa.adapters.base.UNIT_OFFSET_NORMS`: :func:`~nnsight_lorsa.adapters.base.norm_gain` gives
  ``1 + weight``, the attribution's frozen norms compute it so);
- token embeddings multiplied by ``sqrt(hidden_size)`` inside ``model.embed_tokens`` (its output is the scaled
  embedding, what the attribution's embedding nodes take).

No post-norms, no soft-caps, no sliding window (those came with Gemma-2: :class:`~.gemma2.Gemma2Adapter`).
"""

from __future__ import annotations

from typing import ClassVar

from .llama import LlamaAdapter


class GemmaAdapter(LlamaAdapter):
    model_types: ClassVar[tuple[str, ...]] = ("gemma",)
    family: ClassVar[str] = "gemma"
