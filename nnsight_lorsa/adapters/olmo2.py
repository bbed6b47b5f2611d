"""OLMo-2 adapter (``model_type == "olmo2"``, ``Olmo2ForCausalLM``, ``modeling_olmo2.py``).

Llama's attention (``model.layers[i].self_attn`` with ``q_proj``/``k_proj``/``v_proj``/``o_proj``, GQA,
half-split RoPE from ``config.rope_parameters``, scale ``head_dim ** -0.5``, called with keyword ``hidden_states``,
returning ``(attn_output, attn_weights)``) with two differences:

- QK-norm over the **whole** projection, before it is split into heads and before RoPE:
  ``q = q_norm(q_proj(x))`` with ``q_norm`` an RMSNorm of width ``n_heads * head_dim`` (``k_norm``:
  ``n_kv_heads * head_dim``), not one per head as Qwen3's (:attr:`MHSAWeights.qk_norm_per_head` ``False``;
  :func:`~nnsight_lorsa.adapters.base.mhsa_qk` computes it so). ``Olmo2RMSNorm`` applies its gain in fp32 before
  the cast back. A Lorsa's QK-norm is per head (its own): :meth:`~nnsight_lorsa.modules.lorsa.Lorsa.init_from_mhsa`
  gives each Lorsa QK head its MHSA head's slice of the gain, so an initialised QK head's pattern is *not* its MHSA
  head's (the normaliser differs) — the copy only seeds training (docs/adapters.md, "OLMo-2").
- No pre-norms: ``h = h + post_attention_layernorm(self_attn(h))``, then
  ``h = h + post_feedforward_layernorm(mlp(h))``. The attention and the MLP read the residual stream itself
  (:meth:`attention_norm_path` / :meth:`mlp_norm_path` are None); their outputs go through the post-norms before
  the residual adds (:meth:`attention_post_norm_path`, :meth:`mlp_post_norm_path`), as Gemma-2's do.

Path patching's MHSA receivers (``HeadInput``) patch a head's columns of ``q_norm`` / ``k_norm``'s output (the
normed projection, before RoPE), not of ``q_proj`` / ``k_proj``'s: patching a head's columns before the norm would
change every other head's query through the norm's shared denominator (:attr:`head_input_names`).

Sites: a Lorsa replaces ``self_attn`` (input: the residual stream; output: ``o_proj``'s, before
``post_attention_layernorm``); a transcoder replaces ``mlp`` (input: the residual stream after the attention's
post-normed add; output: ``down_proj``'s, before ``post_feedforward_layernorm``).
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from .base import MHSAWeights
from .llama import LlamaAdapter


class Olmo2Adapter(LlamaAdapter):
    model_types: ClassVar[tuple[str, ...]] = ("olmo2",)
    family: ClassVar[str] = "olmo2"
    attention_norm_name = ""
    mlp_norm_name = ""
    attention_post_norm_name = "post_attention_layernorm"
    mlp_post_norm_name = "post_feedforward_layernorm"
    #: a head's query / key is a slice of the normed projection (the norm mixes every head's projection)
    head_input_names: ClassVar[dict[str, str]] = {"q": "q_norm", "k": "k_norm", "v": "v_proj"}

    def mhsa_weights(self, root: nn.Module, layer: int) -> MHSAWeights:
        """As :meth:`LlamaAdapter.mhsa_weights`, with the whole-projection QK-norm gains ``q_norm.weight``
        ``(n_heads * head_dim,)``, ``k_norm.weight`` ``(n_kv_heads * head_dim,)`` (``qk_norm_per_head=False``)."""
        w = super().mhsa_weights(root, layer)
        w.qk_norm_per_head = False
        return w
