"""Pick the adapter for a model: by ``config.model_type``, with a clear error otherwise."""

from __future__ import annotations

from typing import Any

from torch import nn

from .._placement import torch_module
from ..errors import ArgumentError, UnsupportedArchitectureError
from .base import ArchitectureAdapter
from .gemma import GemmaAdapter
from .gemma2 import Gemma2Adapter, Gemma3Adapter
from .gpt2 import GPT2Adapter
from .llama import LlamaAdapter
from .neox import GPTNeoXAdapter
from .olmo2 import Olmo2Adapter
from .phi3 import Phi3Adapter

ADAPTERS: tuple[type[ArchitectureAdapter], ...] = (LlamaAdapter, GPTNeoXAdapter, GPT2Adapter, Gemma2Adapter,
                                                    Gemma3Adapter, Olmo2Adapter, Phi3Adapter, GemmaAdapter)


def _config_of(model: Any) -> Any:
    config = getattr(model, "config", None)
    if config is None:
        config = getattr(torch_module(model), "config", None)
    return config


def _unembedding_path(model: Any) -> str | None:
    """Dotted path of ``model.get_output_embeddings()`` (Hugging Face or nnsight-wrapped), else None."""
    module = torch_module(model)
    get = getattr(module, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not isinstance(head, nn.Module):
        return None
    return next((name for name, m in module.named_modules() if m is head and name), None)


def get_adapter(model_or_config: Any) -> ArchitectureAdapter:
    """The adapter for a Hugging Face model, an nnsight-wrapped model, or a transformers config.

    Given a model, ``lm_head_path`` is where the model's ``get_output_embeddings()`` lives (GPT-NeoX:
    ``embed_out`` or ``lm_head`` depending on the transformers version); given a config, the adapter's
    default.

    Raises:
        UnsupportedArchitectureError: no adapter serves the model's ``model_type`` (the message
            lists the supported ones), or the object has no transformers config.

    Source: ours (dispatch on ``config.model_type`` over this package's adapters).
    """
    config = model_or_config if hasattr(model_or_config, "model_type") else _config_of(model_or_config)
    model_type = getattr(config, "model_type", None)
    if model_type is None:
        raise UnsupportedArchitectureError(
            f"{type(model_or_config).__name__} has no transformers config with a model_type"
        )
    for adapter in ADAPTERS:
        if model_type in adapter.model_types:
            found = adapter(config)
            path = _unembedding_path(model_or_config)
            if path is not None:
                found.lm_head_path = path
            return found
    supported = sorted(t for a in ADAPTERS for t in a.model_types)
    raise UnsupportedArchitectureError(
        f"no adapter for model_type {model_type!r}; supported: {supported}. An adapter says where the "
        "attention reads its input and writes its output, and how it applies RoPE (see docs/adapters.md)."
    )


def adapter_for(model: Any, adapter: Any, where: str) -> ArchitectureAdapter:
    """``adapter`` when given (an :class:`ArchitectureAdapter`), else :func:`get_adapter` of ``model``: the
    ``adapter=`` argument of the sets and of ``ReplacementModel``.

    Raises:
        ArgumentError: ``adapter`` neither None nor an :class:`ArchitectureAdapter`, naming ``where`` (a falsy
            one, ``0`` or ``[]``, was silently replaced by the model's own).
        UnsupportedArchitectureError: no adapter serves the model (:func:`get_adapter`).

    Source: ours.
    """
    if adapter is None:
        return get_adapter(model)
    if not isinstance(adapter, ArchitectureAdapter):
        raise ArgumentError(f"{where}(adapter=...) must be None (the model's own, get_adapter(model)) or an "
                            f"ArchitectureAdapter, got a {type(adapter).__name__}")
    return adapter
