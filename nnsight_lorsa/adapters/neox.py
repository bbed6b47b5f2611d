"""GPT-NeoX adapter (``model_type == "gpt_neox"``: Pythia, GPT-NeoX-20B).

transformers layout (``GPTNeoXForCausalLM``): ``gpt_neox.layers[i].attention``
(``GPTNeoXAttention``) reads ``gpt_neox.layers[i].input_layernorm(hidden_states)``.

Fused QKV (``GPTNeoXAttention.forward`` in transformers 5)::

    qkv = query_key_value(x).view(*x.shape[:-1], n_heads, 3 * head_dim).transpose(1, 2)
    q, k, v = qkv.chunk(3, dim=-1)

so the ``3*d_model`` outputs of the ``nn.Linear`` (weight ``(3*d_model, d_model)``) are per-head
interleaved: output row ``h*3*head_dim + j*head_dim + e`` is component ``j`` (0=q, 1=k, 2=v)
of head ``h``. ``dense`` (``nn.Linear``, weight ``(d_model, d_model)``) is the output projection.
Biases on both when ``config.attention_bias`` (transformers 5; always in transformers 4).
``head_dim = hidden_size // num_attention_heads``; scaling ``head_dim ** -0.5``.

Partial rotary, half-split pairs: only the first ``rotary_dim = int(head_dim * pct)`` dims of each
head rotate. transformers 5 moves the ``rotary_pct`` / ``rotary_emb_base`` constructor arguments into
``config.rope_parameters["partial_rotary_factor"]`` / ``["rope_theta"]`` (default pct 0.25);
transformers 4 keeps ``config.rotary_pct`` / ``config.rotary_emb_base``.

Call (``GPTNeoXLayer.forward``): ``self.attention(input_layernorm(h), attention_mask=...,
position_ids=..., layer_past=..., use_cache=..., position_embeddings=(cos, sin), **kwargs)``:
hidden states are the first POSITIONAL argument; returns ``(attn_output, attn_weights)``.

The LM head is ``embed_out`` up to transformers 5.x (early) and ``lm_head`` later; :func:`get_adapter` takes
the path from the model's own ``get_output_embeddings()``, the version guess below is only the default
of an adapter built from a bare config.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from torch import nn

from ..errors import UnsupportedArchitectureError
from ..modules.rotary import RotaryConfig
from .base import ArchitectureAdapter, MHSAWeights, partial_rotary_dim


def _transformers_major() -> int:
    """The installed transformers' major version, read from its package metadata (importing transformers here
    would make loading a checkpoint need it: ``formats`` reads the adapter family names; 5 without it)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return int(version("transformers").split(".")[0])
    except (PackageNotFoundError, ValueError):  # pragma: no cover - not installed (light install), odd versions
        return 5


class GPTNeoXAdapter(ArchitectureAdapter):
    model_types: ClassVar[tuple[str, ...]] = ("gpt_neox",)
    family: ClassVar[str] = "gpt_neox"
    layers_path = "gpt_neox.layers"
    attention_name = "attention"
    mlp_name = "mlp"
    embed_path = "gpt_neox.embed_in"
    residual_start_name = "gpt_neox.emb_dropout"  # dropout(embed_in): the input of layer 0
    final_norm_path = "gpt_neox.final_layer_norm"
    #: default for an adapter built from a bare config; ``get_adapter(model)`` reads the model's own
    #: ``get_output_embeddings()`` (``embed_out`` in transformers 4 and 5.0, ``lm_head`` later).
    lm_head_path = "lm_head" if _transformers_major() >= 5 else "embed_out"
    attention_norm_name = "input_layernorm"
    mlp_norm_name = "post_attention_layernorm"

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads  # NeoX has no head_dim field

    def rotary_fraction(self) -> float:
        """Fraction of each head that rotates: ``rope_parameters["partial_rotary_factor"]``
        (transformers 5), else ``config.rotary_pct`` / ``config.partial_rotary_factor`` (transformers 4)."""
        c = self.config
        params = getattr(c, "rope_parameters", None)
        if isinstance(params, dict) and "partial_rotary_factor" in params:
            return float(params["partial_rotary_factor"])
        for name in ("rotary_pct", "partial_rotary_factor"):
            value = getattr(c, name, None)
            if value is not None:
                return float(value)
        return 1.0

    def rotary_config(self, layer: int | None = None) -> RotaryConfig:
        """Half-split partial RoPE on the first ``int(head_dim * rotary_fraction())`` dims of each head.

        Raises:
            UnsupportedArchitectureError: that size odd or zero (named, :func:`~.base.partial_rotary_dim`)."""
        rotary_dim = partial_rotary_dim(self, self.rotary_fraction())
        cfg = self._rotary_from_params(self.head_dim, rotary_dim, interleaved=False)
        params = getattr(self.config, "rope_parameters", None)
        has_theta = isinstance(params, dict) and "rope_theta" in params
        base = getattr(self.config, "rotary_emb_base", None)
        if not has_theta and getattr(self.config, "rope_theta", None) is None and base is not None:
            cfg = dataclasses.replace(cfg, base=float(base))  # transformers 4
        return cfg

    def mhsa_weights(self, root: nn.Module, layer: int) -> MHSAWeights:
        """Head-major weights from the per-head interleaved ``query_key_value`` and ``dense``.

        ``W_Q, W_K, W_V: (n_heads, d_model, head_dim)``, ``b_*: (n_heads, head_dim)`` (zeros
        without ``attention_bias``); ``W_O: (n_heads, head_dim, d_model)``, ``b_O: (d_model,)``.
        """
        attn: Any = self.attention_module(root, layer)
        n, e, d = self.n_heads, self.head_dim, self.d_model
        w = attn.query_key_value.weight.detach()  # (3*d_model, d_model)
        if w.shape != (3 * d, d):
            raise UnsupportedArchitectureError(
                f"{self.family}: query_key_value weight has shape {tuple(w.shape)}, expected {(3 * d, d)}"
            )
        Ws = w.view(n, 3, e, d).permute(1, 0, 3, 2)  # (3, n_heads, d_model, head_dim)
        qkv_bias = attn.query_key_value.bias
        bs = qkv_bias.detach().view(n, 3, e).transpose(0, 1) if qkv_bias is not None else w.new_zeros(3, n, e)
        o = attn.dense.weight.detach()  # (d_model, n_heads*head_dim)
        W_O = o.T.reshape(n, e, d)
        b_O = attn.dense.bias.detach() if attn.dense.bias is not None else o.new_zeros(d)
        return MHSAWeights(
            W_Q=Ws[0], b_Q=bs[0], W_K=Ws[1], b_K=bs[1], W_V=Ws[2], b_V=bs[2], W_O=W_O, b_O=b_O,
            rotary=self.model_rotary(root, layer, self.rotary_config()),
            scale=float(getattr(attn, "scaling", e ** -0.5)),
        )
