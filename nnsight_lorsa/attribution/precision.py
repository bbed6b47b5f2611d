"""The frozen replacement model in another dtype than the model's (e.g. fp32 for a bf16 model).

Edge sums are exact to the rounding of the dtype the frozen model computes in; for a bf16 model
that is ~1 % of a row's mass. With ``dtype=torch.float32`` the Lorsas, transcoders and frozen MHSA
weights are used as fp32 *copies* (the user's modules are untouched), while the model's own modules
still run in bf16 on batch row 0 (:func:`.trace.first_row`) for the frozen constants. torch only.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

from .coders import LayerCoder


def copies_in(modules: dict[int, Any], dtype: torch.dtype) -> dict[int, Any]:
    """Copies of ``{layer: replacement module}`` in ``dtype`` (a cross-layer transcoder's per-layer
    views share one copy of it)."""
    clts: dict[int, Any] = {}
    out: dict[int, Any] = {}
    for layer, m in modules.items():
        if isinstance(m, LayerCoder):
            if id(m.clt) not in clts:
                clts[id(m.clt)] = copy.deepcopy(m.clt).to(dtype)
            out[layer] = LayerCoder(clts[id(m.clt)], m.layer)
        else:
            out[layer] = copy.deepcopy(m).to(dtype)
    return out


def weights_in(w: Any, dtype: torch.dtype) -> Any:
    """:class:`~nnsight_lorsa.adapters.base.MHSAWeights` with its floating tensors in ``dtype``."""
    return dataclasses.replace(w, **{f.name: getattr(w, f.name).to(dtype) for f in dataclasses.fields(w)
                                     if isinstance(getattr(w, f.name), torch.Tensor)
                                     and getattr(w, f.name).is_floating_point()})
