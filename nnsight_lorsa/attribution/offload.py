"""Device bytes of offloaded replacement modules during attribution (``ReplacementSet.offload``;
:mod:`nnsight_lorsa._placement`): the term :func:`.budget.estimate_layout` adds for them.

An offloaded module's weights stay on the host; on the model's device the frozen pass holds

* *fetch*: one module at a time, while it computes (its clean-pass forward, a Lorsa's frozen queries and
  keys or pattern rows, a transcoder's skip path and encoder input): the largest offloaded module's
  parameters and buffers (a cross-layer transcoder: all of it);
* *rows*: the active nodes' rows it reads — a Lorsa layer's ``W_V`` rows of the OV heads active somewhere
  (``u·d``; kept on the device in the frozen model's dtype), a gathering site's distinct ``w_o`` / ``W_dec`` /
  ``W_enc`` rows (grid sites are counted in the shared term already; a transcoder's decoder: one block per
  replaced MLP it writes into) — and every skip transcoder's ``W_skip`` (``d_in·d_out``: the skip path is
  linear in the residual stream, so the backward keeps it on the device). Where the rows live is decided per call
  (:func:`rows_placement`, ``Graph.meta["offload_rows"]``):

  - ``"device"``: each block gathered on the device once (from one ``non_blocking`` copy of the pinned weight,
    dropped after the gather: within *fetch*) and read in place by every pass: the **sum** of the blocks;
  - ``"host"``: gathered on the host, kept there pinned, and copied to the device for each pass of each site only
    (:func:`.frozen.streamed_linear`, :func:`.frozen.gather_write` / :func:`.frozen.gather_read`): the **largest**
    block.

The host keeps the modules themselves (pinned where CUDA is available). torch only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .._placement import offloaded
from ..errors import MemoryBudgetError
from .frozen import choose
from .layout import Layout

if TYPE_CHECKING:
    from .budget import MemoryEstimate


def _bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of ``module``'s parameters and buffers (what one fetch copies to the device)."""
    return sum(_bytes(t) for t in [*module.parameters(), *module.buffers()])


def _distinct(idx: torch.Tensor) -> int:
    return int(torch.unique(idx).numel()) if idx.numel() else 0


def any_offloaded(layout: Layout) -> bool:
    """Whether a Lorsa or transcoder of ``layout`` is offloaded (a cross-layer transcoder's layer: its CLT)."""
    return any(offloaded(lay.lorsa) or (lay.transcoder is not None and offloaded(lay.transcoder.weights_owner))
               for lay in layout.layers)


def offload_terms(layout: Layout, *, d_model: int, node_vectors: str, itemsize: int,
                  rows: str = "host") -> dict[str, int]:
    """``{"offload_fetch": bytes, "offload_rows": bytes}`` on the model's device for the offloaded modules of
    ``layout`` (module docstring); both 0 when none is offloaded. ``itemsize``: bytes per number of the
    frozen model (which site's node vectors gather: :func:`.frozen.choose`; the kept ``W_V`` rows are in it).
    ``rows``: where the frozen pass keeps the active rows (:class:`.replacement.FrozenReplacement`'s
    ``offload_rows``): ``"host"`` counts the largest block (one on the device at a time), ``"device"`` the sum
    of every block (all kept there for the whole call); the skip matrices either way."""
    dtype = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}.get(itemsize, torch.float32)
    fetch, block, total, skips = 0, 0, 0, 0
    seen: set[int] = set()
    for lay in layout.layers:
        lorsa = lay.lorsa
        if lorsa is not None and offloaded(lorsa):
            fetch = max(fetch, module_bytes(lorsa))
            heads = _distinct(lay.lorsa_head)
            block = max(block, heads * d_model * lorsa.W_V.element_size())  # W_V (and w_o) rows
            # kept: the W_V rows (in the frozen model's dtype) and, where the site gathers, the w_o rows
            total += heads * d_model * itemsize
            if choose(node_vectors, lay.lorsa_pos.numel(), d_model, dtype) == "gather":
                total += heads * d_model * lorsa.W_O.element_size()
        tc: Any = lay.transcoder
        owner = None if tc is None else tc.weights_owner  # a CLT layer: its CLT (counted once)
        if owner is None or not offloaded(owner):
            continue
        if id(owner) not in seen:
            seen.add(id(owner))
            fetch = max(fetch, module_bytes(owner))
        n = lay.tc_pos.numel()  # the encoder's nodes, or its decoders' (a CLT layer: one set per layer written)
        targets = layout.decoder_targets(lay.layer)
        enc, dec = choose(node_vectors, n, d_model, dtype), choose(node_vectors, n, d_model, dtype, targets)
        feats = _distinct(lay.tc_feat) if n else 0
        if "gather" in (enc, dec):
            block = max(block, feats * d_model * tc.W_enc.element_size())  # W_dec / W_enc rows
        # kept: the encoder's rows where it gathers, one block of decoder rows per replaced MLP written
        total += feats * d_model * tc.W_enc.element_size() if enc == "gather" else 0
        total += targets * feats * d_model * tc.W_enc.element_size() if dec == "gather" else 0  # one dtype
        skip = getattr(owner, "W_skip", None)
        if isinstance(skip, torch.Tensor):
            skips += _bytes(skip) // (skip.shape[0] if skip.dim() == 3 else 1)  # a CLT: one layer's
    return {"offload_fetch": fetch, "offload_rows": (total if rows == "device" else block) + skips}


def device_free_bytes(device: torch.device) -> int | None:
    """Bytes torch can still allocate on ``device``: the driver's free memory (``torch.cuda.mem_get_info``) plus
    what torch's caching allocator holds reserved but unallocated; None off CUDA (no such query)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


#: the margin of the free-memory rule of :func:`rows_placement`: the estimate times this must fit
FREE_MEMORY_MARGIN = 1.1


def rows_placement(offloaded_any: bool, device: str, estimate: Callable[[str], MemoryEstimate], *, batch_size: int,
                   max_memory: int | None, free_bytes: int | None) -> str | None:
    """Where one :func:`.attribute.attribute` call keeps the offloaded modules' active rows
    (:class:`.replacement.FrozenReplacement`'s ``offload_rows``; ``Graph.meta["offload_rows"]``).

    The rule: ``None`` when no module is offloaded (``offloaded_any`` false); ``"host"`` on a CPU (or ``meta``:
    a remote model's) ``device`` (an offloaded module computes where it is stored: nothing is copied). Otherwise,
    with ``max_memory`` (bytes of the device): ``"device"`` iff the largest batch that fits it with the rows kept
    equals the largest without (:func:`.budget.largest_batch`: keeping them never shrinks the batch; where the
    kept rows do not fit even at batch 1, ``"host"``); without it, ``"device"`` iff ``FREE_MEMORY_MARGIN`` (1.1)
    × the kept estimate's ``device_bytes`` at ``batch_size`` fits ``free_bytes`` (bytes torch can still allocate
    on the device, :func:`device_free_bytes`; None: ``"host"``).

    Args:
        offloaded_any: some Lorsa or transcoder is offloaded (:func:`any_offloaded`).
        device: the model's device type (``"cpu"``, ``"cuda"``, ...).
        estimate: ``rows`` (``"host"`` / ``"device"``) → the call's :class:`~.budget.MemoryEstimate` at
            ``batch_size`` with the rows kept there (:func:`offload_terms`); called only where the rule needs it.
        batch_size: the call's batch.

    Raises:
        MemoryBudgetError: with ``max_memory``, not even batch 1 fits with the rows on the host.
    """
    from .budget import largest_batch

    if not offloaded_any:
        return None
    if device in ("cpu", "meta"):
        return "host"
    if max_memory is not None:
        host = largest_batch(estimate("host"), max_memory, batch_size, device)
        try:
            kept = largest_batch(estimate("device"), max_memory, batch_size, device)
        except MemoryBudgetError:
            return "host"
        return "device" if kept == host else "host"
    if free_bytes is None:
        return "host"
    return "device" if FREE_MEMORY_MARGIN * estimate("device").device_bytes <= free_bytes else "host"
