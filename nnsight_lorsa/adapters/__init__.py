"""Architecture adapters: where a model family keeps its attention, MLP, norms and unembedding, and
its MHSA as plain tensors (Llama 3.1, Mistral, Qwen2, Qwen3, GPT-NeoX, GPT-2, Gemma, Gemma-2,
Gemma-3 text, OLMo-2, Phi-3; docs/adapters.md).

:func:`get_adapter` picks the adapter of an nnsight or Hugging Face model; an
:class:`ArchitectureAdapter` gives module paths (``attention_path(layer)`` …) and the
:class:`MHSAWeights` of a layer, which :func:`mhsa_forward` runs (the reference a Lorsa is
initialised from and compared with).
"""

from .base import ArchitectureAdapter, MHSAWeights, mhsa_forward
from .registry import get_adapter

__all__ = ["ArchitectureAdapter", "MHSAWeights", "get_adapter", "mhsa_forward"]
