"""Device bytes of offloaded replacement modules during attribution (``ReplacementSet.offload``;
:mod:`nnsight_lorsa._placement`): the term :func:`.budget.estimate_layout` adds for them.

An offloaded module's weights stay on the host; on the model's device the frozen pass holds

* *fetch*: one module at a time, while it computes (its clean-pass forward, a Lorsa's frozen queries and
  keys or pattern rows, a transcoder's skip path and encoder input): the largest offloaded module's
  parameters and buffers (a cross-layer transcoder: all of it);
* *rows*: what it keeps of them for the backward: the distinct ``W_V`` rows of the OV heads active
  somewhere (``u·d`` per Lorsa layer); the gathered node-vector rows of the sites that gather
  (``w_o`` / ``W_dec`` / ``W_enc`` rows of the active nodes; grid sites are counted in the shared term
  already); a skip transcoder's ``W_skip`` (``d_in·d_out``: the skip path is linear in the residual stream
  and stays in the graph).

The host keeps the modules themselves (pinned where CUDA is available). torch only.
"""

from __future__ import annotations

from typing import Any

import torch

from .._placement import offloaded
from .frozen import choose
from .layout import Layout


def _bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of ``module``'s parameters and buffers (what one fetch copies to the device)."""
    return sum(_bytes(t) for t in [*module.parameters(), *module.buffers()])


def _distinct(idx: torch.Tensor) -> int:
    return int(torch.unique(idx).numel()) if idx.numel() else 0


def offload_terms(layout: Layout, *, d_model: int, node_vectors: str, itemsize: int) -> dict[str, int]:
    """``{"offload_fetch": bytes, "offload_rows": bytes}`` on the model's device for the offloaded modules of
    ``layout`` (module docstring); both 0 when none is offloaded. ``itemsize``: bytes per number of the
    frozen model (which site's node vectors gather: :func:`.frozen.choose`)."""
    dtype = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}.get(itemsize, torch.float32)
    fetch, rows = 0, 0
    seen: set[int] = set()
    for lay in layout.layers:
        lorsa = lay.lorsa
        if lorsa is not None and offloaded(lorsa):
            fetch = max(fetch, module_bytes(lorsa))
            size = lorsa.W_V.element_size()
            rows += _distinct(lay.lorsa_head) * d_model * size
            if choose(node_vectors, lay.lorsa_pos.numel(), d_model, dtype) == "gather":
                rows += _distinct(lay.lorsa_head) * d_model * size
        tc: Any = lay.transcoder
        owner = getattr(tc, "clt", tc)
        if tc is None or not offloaded(owner):
            continue
        if id(owner) not in seen:
            seen.add(id(owner))
            fetch = max(fetch, module_bytes(owner))
        size = tc.W_enc.element_size()
        if choose(node_vectors, lay.tc_pos.numel(), d_model, dtype) == "gather":
            rows += 2 * _distinct(lay.tc_feat) * d_model * size  # W_dec rows and W_enc columns
        skip = getattr(owner, "W_skip", None)
        if isinstance(skip, torch.Tensor):
            rows += _bytes(skip) // (skip.shape[0] if skip.dim() == 3 else 1)  # a CLT: one layer's
    return {"offload_fetch": fetch, "offload_rows": rows}
