"""GPT-2 adapter (``model_type == "gpt2"``).

transformers layout (``GPT2LMHeadModel``): ``transformer.h[i].attn`` (``GPT2Attention``) reads
the output of ``transformer.h[i].ln_1``. ``attn.c_attn`` is a transformers ``Conv1D`` with weight
``(d_model, 3*d_model)`` (``in, out``: ``y = x @ W + b``) whose output splits into
``[q | k | v]`` blocks of ``d_model`` columns, each head-major (column ``h*head_dim + e``);
``attn.c_proj`` is a ``Conv1D`` with weight ``(d_model, d_model)`` (rows ``h*head_dim + e``).
No rotary: positions enter through the learned position embeddings ``transformer.wpe`` added to
the token embeddings before the first layer.

Scale (``GPT2Attention.__init__``): ``head_dim ** -0.5`` if ``config.scale_attn_weights`` (else 1),
divided by ``layer_idx + 1`` if ``config.scale_attn_by_inverse_layer_idx``. Recent transformers keep it
as ``GPT2Attention.scaling`` and pass it to every attention implementation; older ones (4.x, without
``scaling``) apply both settings only in eager attention -- their SDPA uses ``head_dim ** -0.5``
whatever the config says -- so such a model under a non-eager implementation is refused
(``ConfigMismatchError``) rather than recomputed with a scale it does not run.
``reorder_and_upcast_attn`` changes only the order of fp operations (same function).

Call (transformers 5, ``GPT2Block.forward``): ``self.attn(hidden_states, past_key_values=...,
attention_mask=..., use_cache=..., **kwargs)`` -- hidden states are the first POSITIONAL argument
(no ``position_ids``/``position_embeddings``); returns ``(attn_output, attn_weights)``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from ..errors import ConfigMismatchError, UnsupportedArchitectureError
from ..modules.rotary import RotaryConfig
from .base import ArchitectureAdapter, MHSAWeights
from .transformers_internals import attn_implementation


class GPT2Adapter(ArchitectureAdapter):
    model_types: ClassVar[tuple[str, ...]] = ("gpt2",)
    family: ClassVar[str] = "gpt2"
    layers_path = "transformer.h"
    attention_name = "attn"
    mlp_name = "mlp"
    embed_path = "transformer.wte"
    #: learned absolute position embeddings ``(n_positions, d_model)``, added to ``wte`` output.
    pos_embed_path: ClassVar[str] = "transformer.wpe"
    residual_start_name: ClassVar[str] = "transformer.drop"  # dropout(wte + wpe): the input of layer 0
    final_norm_path = "transformer.ln_f"
    lm_head_path = "lm_head"
    attention_norm_name = "ln_1"
    mlp_norm_name = "ln_2"

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def attention_input(self, args: tuple, kwargs: dict) -> torch.Tensor:
        """``hidden_states (batch, pos, d_model)``; cross-attention calls are refused."""
        if kwargs.get("encoder_hidden_states") is not None:
            raise UnsupportedArchitectureError(f"{self.family}: cross-attention calls are not supported")
        return super(GPT2Adapter, self).attention_input(args, kwargs)

    def rotary_config(self, layer: int | None = None) -> RotaryConfig | None:
        """GPT-2 has no RoPE (learned absolute positions at ``transformer.wpe``)."""
        return None

    def attention_scale(self, layer: int) -> float:
        """Multiplier of the scores of layer ``layer`` (as ``GPT2Attention.scaling``)."""
        c = self.config
        scale = self.head_dim ** -0.5 if getattr(c, "scale_attn_weights", True) else 1.0
        if getattr(c, "scale_attn_by_inverse_layer_idx", False):
            scale /= float(self.check_layer(layer) + 1)
        return scale

    def _check_scale_applied(self, attn: Any, layer: int) -> None:
        """Refuse a config scale that the model's (pre-``scaling``) non-eager attention ignores."""
        impl = attn_implementation(getattr(attn, "config", self.config)) or "eager"
        c = self.config
        ignored = [name for name, set_ in (
            ("scale_attn_by_inverse_layer_idx=True", getattr(c, "scale_attn_by_inverse_layer_idx", False)),
            ("scale_attn_weights=False", not getattr(c, "scale_attn_weights", True))) if set_]
        if impl != "eager" and ignored:
            raise ConfigMismatchError(
                f"{self.family}: {self.attention_path(layer)} runs {impl!r} attention, which in this transformers "
                f"ignores {', '.join(ignored)} (its scale is head_dim ** -0.5 whatever the config says), so the "
                "model does not compute what its config describes. Load it with attn_implementation='eager' "
                "(or use a transformers whose GPT2Attention has `scaling`)."
            )

    def mhsa_weights(self, root: nn.Module, layer: int) -> MHSAWeights:
        """Head-major weights from ``c_attn``/``c_proj`` (Conv1D, weight ``(in, out)``).

        ``W_Q, W_K, W_V: (n_heads, d_model, head_dim)``; ``W_O: (n_heads, head_dim, d_model)``;
        ``b_O = c_proj.bias (d_model,)``.
        """
        attn: Any = self.attention_module(root, layer)
        if getattr(attn, "is_cross_attention", False):
            raise UnsupportedArchitectureError(
                f"{self.family}: {self.attention_path(layer)} is cross-attention"
            )
        n, e, d = self.n_heads, self.head_dim, self.d_model
        w = attn.c_attn.weight.detach()  # (d_model, 3*d_model)
        b = attn.c_attn.bias.detach()  # (3*d_model,)
        if w.shape != (d, 3 * d):
            raise UnsupportedArchitectureError(
                f"{self.family}: c_attn weight has shape {tuple(w.shape)}, expected Conv1D {(d, 3 * d)}"
            )
        Ws = w.view(d, 3, n, e).permute(1, 2, 0, 3)  # (3, n_heads, d_model, head_dim)
        bs = b.view(3, n, e)
        o = attn.c_proj.weight.detach()  # (n_heads*head_dim, d_model)
        W_O = o.view(n, e, d)
        b_O = attn.c_proj.bias.detach() if attn.c_proj.bias is not None else o.new_zeros(d)
        if hasattr(attn, "scaling"):  # the scale every attention implementation of this transformers uses
            scale = float(attn.scaling)
        else:
            self._check_scale_applied(attn, layer)
            scale = self.attention_scale(layer)
        return MHSAWeights(
            W_Q=Ws[0], b_Q=bs[0], W_K=Ws[1], b_K=bs[1], W_V=Ws[2], b_V=bs[2], W_O=W_O, b_O=b_O,
            rotary=None, scale=scale,
        )
