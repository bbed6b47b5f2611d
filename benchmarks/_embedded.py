"""The embedded model's training setup shared by the training benchmarks: the model, its middle layer and that
layer's MHSA, and the training windows of the shipped corpus (the first 99 %; the rest held out)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nnsight_lorsa import get_adapter
from nnsight_lorsa.assets import default_corpus_path
from nnsight_lorsa.demo import load_model
from nnsight_lorsa.training import TokenDataset


def embedded_layer(seq_len: int) -> tuple[Any, Any, int, Any, TokenDataset]:
    """``(model, adapter, layer, mhsa, train)``: the embedded model (nnsight), its adapter, ``layer = n_layers // 2``,
    that layer's :class:`~nnsight_lorsa.adapters.base.MHSAWeights`, and the corpus cut into ``seq_len`` windows
    (99 %, the training part)."""
    model = load_model()
    adapter = get_adapter(model)
    layer = adapter.n_layers // 2
    mhsa = adapter.mhsa_weights(model._module, layer)
    text = Path(default_corpus_path()).read_text(encoding="utf-8")
    train, _ = TokenDataset.from_text(model.tokenizer, text, seq_len, config=model.config).split(0.01)
    return model, adapter, layer, mhsa, train
