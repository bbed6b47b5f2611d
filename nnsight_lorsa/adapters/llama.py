"""Llama-family adapter: Llama (2, 3, 3.1), Mistral, Qwen2 (QKV biases) and Qwen3 (QK-norm).

transformers layout: ``model.layers[i].self_attn`` with ``q_proj``/``k_proj``/``v_proj``/``o_proj``
(``nn.Linear``, weight ``(out, in)``), optional ``q_norm``/``k_norm`` (RMSNorm over head_dim,
applied before RoPE), half-split RoPE from ``config.rope_parameters`` (``default``, ``linear``,
``llama3``, ``yarn``), scaling ``head_dim ** -0.5``, GQA (``num_key_value_heads``; query head ``h`` reads
KV head ``h // (n_heads / n_kv_heads)``, as ``repeat_kv``). The attention is called with keyword
``hidden_states`` (after ``input_layernorm``), ``position_ids`` and ``position_embeddings``
(cos, sin), and returns ``(attn_output, attn_weights)``.

Sliding-window attention: Mistral applies ``config.sliding_window`` on every layer; Qwen2/Qwen3
on the layers whose ``config.layer_types[i] == "sliding_attention"`` (``use_sliding_window``).
:meth:`LlamaAdapter.sliding_window` reports it and :class:`MHSAWeights` carries it.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from ..modules.rotary import RotaryConfig
from .base import ArchitectureAdapter, MHSAWeights, partial_rotary_dim

#: families with one sliding window on every layer (``config.sliding_window``, no ``layer_types``)
EVERY_LAYER_WINDOW = ("mistral", "phi3")


def _heads(w: torch.Tensor, bias: torch.Tensor | None, n: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An ``nn.Linear(d_model -> n*head_dim)``'s weight ``(n*head_dim, d_model)`` and bias (or a slice of a fused
    projection's) as ``W: (n, d_model, head_dim)``, ``b: (n, head_dim)`` (zeros without a bias)."""
    w = w.detach()
    W = w.view(n, head_dim, w.shape[1]).transpose(1, 2)
    b = bias.detach().view(n, head_dim) if bias is not None else w.new_zeros(n, head_dim)
    return W, b


class LlamaAdapter(ArchitectureAdapter):
    model_types: ClassVar[tuple[str, ...]] = ("llama", "mistral", "qwen2", "qwen3")
    family: ClassVar[str] = "llama"
    layers_path = "model.layers"
    attention_name = "self_attn"
    mlp_name = "mlp"
    embed_path = "model.embed_tokens"
    final_norm_path = "model.norm"
    attention_norm_name = "input_layernorm"
    mlp_norm_name = "post_attention_layernorm"

    def sliding_window(self, layer: int) -> int | None:
        """The sliding-window size of layer ``layer``'s attention, or None (full causal).

        Raises:
            LayerOutOfRangeError: ``layer`` not a layer of the model (checked whether or not the family has sliding
                layers: a wrong layer was None, full causal, on a model without).

        Source: transformers ``models/{mistral,qwen2,qwen3}/modeling_*.py`` (``sliding_window``, ``layer_types``).
        """
        layer = self.check_layer(layer)
        c = self.config
        window = getattr(c, "sliding_window", None)
        if window is None:
            return None
        layer_types = getattr(c, "layer_types", None)
        if layer_types is not None:
            return int(window) if layer_types[self.check_layer(layer)] == "sliding_attention" else None
        if c.model_type in EVERY_LAYER_WINDOW:
            return int(window)
        if getattr(c, "use_sliding_window", False):  # transformers-4 Qwen2: layers >= max_window_layers
            return int(window) if self.check_layer(layer) >= int(getattr(c, "max_window_layers", 0)) else None
        return None

    #: whether the family's attention rotates only the first ``partial_rotary_factor`` of each head (Phi-3); the
    #: Llama, Mistral, Qwen2/3, Gemma and OLMo-2 models of transformers rotate the whole head whatever the config says
    partial_rotary: ClassVar[bool] = False

    def rotary_config(self, layer: int | None = None) -> RotaryConfig:
        """Half-split RoPE on each whole head, or (:attr:`partial_rotary`, Phi-3) on its first
        ``int(head_dim * partial_rotary_factor)`` dims: the factor from ``rope_parameters`` (transformers 5), else
        ``config.partial_rotary_factor`` (transformers 4's Phi-3), else 1.

        Raises:
            UnsupportedArchitectureError: a partial rotary size that is odd or zero (named,
                :func:`~.base.partial_rotary_dim`)."""
        if not self.partial_rotary:
            return self._rotary_from_params(self.head_dim, self.head_dim, interleaved=False)
        fallback = getattr(self.config, "partial_rotary_factor", None) or 1.0
        partial = float(self.rope_parameters(self.config).get("partial_rotary_factor", fallback))
        return self._rotary_from_params(self.head_dim, partial_rotary_dim(self, partial), interleaved=False)

    def qkv_projections(self, attn: Any) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """``[(weight, bias)]`` of the query, key and value projections (``q_proj``, ``k_proj``, ``v_proj``; bias
        None where there is none), each weight ``(heads * head_dim, d_model)``."""
        return [(p.weight, p.bias) for p in (attn.q_proj, attn.k_proj, attn.v_proj)]

    def mhsa_weights(self, root: nn.Module, layer: int) -> MHSAWeights:
        """``W_Q: (n_heads, d_model, head_dim)``, ``W_K/W_V: (n_kv_heads, d_model, head_dim)``,
        ``W_O: (n_heads, head_dim, d_model)`` from ``q_proj``/``k_proj``/``v_proj``/``o_proj``
        (missing biases as zeros), Qwen3 ``q_norm``/``k_norm`` weights ``(head_dim,)``; ``rotary`` as the model
        computes it (:meth:`~.base.ArchitectureAdapter.model_rotary`: the rounding of a cast model's buffer).

        Raises:
            ConfigMismatchError: the model's rotary buffer differs from the frequencies its config gives.
        """
        attn: Any = self.attention_module(root, layer)
        c, e = self.config, self.head_dim
        n_kv = int(getattr(c, "num_key_value_heads", None) or c.num_attention_heads)
        (W_Q, b_Q), (W_K, b_K), (W_V, b_V) = (
            _heads(w, b, n, e) for (w, b), n in zip(self.qkv_projections(attn), (c.num_attention_heads, n_kv, n_kv),
                                                    strict=True))
        o = attn.o_proj.weight.detach()  # (d_model, n_heads*e)
        W_O = o.T.reshape(c.num_attention_heads, e, o.shape[0])
        b_O = attn.o_proj.bias.detach() if attn.o_proj.bias is not None else o.new_zeros(o.shape[0])
        q_norm = getattr(attn, "q_norm", None)
        k_norm = getattr(attn, "k_norm", None)
        return MHSAWeights(
            W_Q=W_Q, b_Q=b_Q, W_K=W_K, b_K=b_K, W_V=W_V, b_V=b_V, W_O=W_O, b_O=b_O,
            rotary=self.model_rotary(root, layer, self.rotary_config(layer)),
            scale=float(getattr(attn, "scaling", e ** -0.5)),
            q_norm=None if q_norm is None else q_norm.weight.detach(),
            k_norm=None if k_norm is None else k_norm.weight.detach(),
            qk_norm_eps=float(getattr(q_norm, "variance_epsilon", getattr(c, "rms_norm_eps", 1e-6))),
            sliding_window=self.sliding_window(layer),
        )
