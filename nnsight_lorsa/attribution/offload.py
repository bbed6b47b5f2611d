"""Device bytes of offloaded replacement modules during attribution (``ReplacementSet.offload``;
:mod:`nnsight_lorsa._placement`): the term :func:`.budget.estimate_layout` adds for them.

An offloaded module's weights stay on the host; on the model's device the frozen pass holds

* *fetch*: one module at a time, while it computes (its clean-pass forward, a Lorsa's frozen queries and
  keys or pattern rows, a transcoder's skip path and encoder input): the largest offloaded module's
  parameters and buffers (a cross-layer transcoder: all of it);
* *rows*: the active nodes' rows it reads, kept on the host (pinned) and copied to the device for each
  pass of each site only (:func:`.frozen.streamed_linear`, :func:`.frozen.gather_write` /
  :func:`.frozen.gather_read`): the largest such block — a Lorsa layer's ``W_V`` rows of the OV heads active
  somewhere (``u·d``), or a gathering site's distinct ``w_o`` / ``W_dec`` / ``W_enc`` rows (grid sites are
  counted in the shared term already) — and every skip transcoder's ``W_skip`` (``d_in·d_out``: the skip
  path is linear in the residual stream, so the backward keeps it on the device).

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
    fetch, block, skips = 0, 0, 0
    seen: set[int] = set()
    for lay in layout.layers:
        lorsa = lay.lorsa
        if lorsa is not None and offloaded(lorsa):
            fetch = max(fetch, module_bytes(lorsa))
            block = max(block, _distinct(lay.lorsa_head) * d_model * lorsa.W_V.element_size())  # W_V (and w_o) rows
        tc: Any = lay.transcoder
        owner = None if tc is None else tc.weights_owner  # a CLT layer: its CLT (counted once)
        if owner is None or not offloaded(owner):
            continue
        if id(owner) not in seen:
            seen.add(id(owner))
            fetch = max(fetch, module_bytes(owner))
        n = lay.tc_pos.numel()  # the encoder's nodes, or its decoders' (a CLT layer: one set per layer written)
        if "gather" in (choose(node_vectors, n, d_model, dtype),
                        choose(node_vectors, n, d_model, dtype, layout.decoder_targets(lay.layer))):
            block = max(block, _distinct(lay.tc_feat) * d_model * tc.W_enc.element_size())  # W_dec / W_enc rows
        skip = getattr(owner, "W_skip", None)
        if isinstance(skip, torch.Tensor):
            skips += _bytes(skip) // (skip.shape[0] if skip.dim() == 3 else 1)  # a CLT: one layer's
    return {"offload_fetch": fetch, "offload_rows": block + skips}
