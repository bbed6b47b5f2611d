"""Phi-3 adapter (``model_type == "phi3"``, ``Phi3ForCausalLM``, ``modeling_phi3.py``: Phi-3, Phi-3.5, Phi-4-mini).

Llama's decoder layer (``input_layernorm`` → ``self_attn`` → residual add; ``post_attention_layernorm`` → ``mlp`` →
residual add; the residual dropouts are identities in eval), with

- one fused projection ``self_attn.qkv_proj`` (``nn.Linear``, weight ``(n_heads*e + 2*n_kv*e, d_model)``): output
  rows ``[0, n_heads*e)`` are the queries, the next ``n_kv*e`` the keys, the rest the values, each head-major as
  Llama's separate projections (:meth:`Phi3Adapter.qkv_projections` slices them);
- the MLP's fused ``gate_up_proj`` (the transcoder site is the ``mlp`` module's input and output: nothing reads it);
- partial rotary (``rope_parameters["partial_rotary_factor"]``: the first ``int(head_dim * factor)`` dims of each
  head rotate, half-split), read as Llama's;
- one sliding window (``config.sliding_window``, e.g. 2047 in Phi-3-mini-4k) on every layer, as Mistral's.

RoPE: ``default`` only. The long-context checkpoints' ``longrope`` (Phi-3-*-128k, Phi-3.5, Phi-4-mini: short / long
factors per frequency, switched at ``original_max_position_embeddings``) is not a :class:`RotaryConfig` type:
:meth:`rotary_config` and :meth:`mhsa_weights` raise :class:`UnsupportedArchitectureError` naming it, never a
different RoPE. Path patching's MHSA receivers need separate q/k/v projections: refused on Phi-3.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from .llama import LlamaAdapter


class Phi3Adapter(LlamaAdapter):
    model_types: ClassVar[tuple[str, ...]] = ("phi3",)
    family: ClassVar[str] = "phi3"
    partial_rotary: ClassVar[bool] = True

    def qkv_projections(self, attn: Any) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """The query, key and value rows of the fused ``qkv_proj`` (``[q | k | v]``), with its bias's slices."""
        c, e = self.config, self.head_dim
        n_kv = int(getattr(c, "num_key_value_heads", None) or c.num_attention_heads)
        sizes = [c.num_attention_heads * e, n_kv * e, n_kv * e]
        bias = attn.qkv_proj.bias
        biases = [None] * 3 if bias is None else list(bias.split(sizes))
        return list(zip(attn.qkv_proj.weight.split(sizes), biases, strict=True))
