"""Device bytes of offloaded replacement modules during attribution (``ReplacementSet.offload``;
:mod:`nnsight_lorsa._placement`): the term :func:`.budget.estimate_layout` adds for them.

An offloaded module's weights stay on the host; on the model's device the frozen pass holds

* *fetch*: one module at a time, while it computes, only the tensors the frozen pass reads there: a Lorsa's queries
  and keys or pattern rows, all but its OV circuit (:data:`LORSA_OV`: half of a paper-scale Lorsa); a transcoder's
  skip path and encoder input, all but its encoder and decoders (:func:`coder_site_leave`; a cross-layer transcoder:
  its own layer's ``W_skip[layer]`` alone, :func:`.layout.coder_layer_parts`, every layer's until 2026-11-27) — the
  largest such copy (:func:`~nnsight_lorsa._placement.fetched_bytes`, the selection ``resident`` copies; the whole
  module until 2026-11-27), or the whole weight a kept row block is gathered from (:func:`block_sources`), whichever
  is larger. The clean pass's forwards (:func:`.layout.build_layout`: a Lorsa's heads without its output projection,
  :data:`.layout.LORSA_OUT`; an encoder without its decoders, :func:`.layout.coder_decoders`, a cross-layer
  transcoder's its own layer's, :func:`.layout.coder_layer_parts`) run before the frozen pass, not at its peak;
* *rows*: the active nodes' rows it reads — a Lorsa layer's ``W_V`` rows of the OV heads active somewhere
  (``u·d``; kept on the device in the frozen model's dtype), a gathering site's distinct ``w_o`` / ``W_dec`` /
  ``W_enc`` rows (grid sites are counted in the shared term already; a transcoder's decoder: one block per
  replaced MLP it writes into) — and every skip transcoder's ``W_skip`` (``d_in·d_out``: the skip path is
  linear in the residual stream, so the backward keeps it on the device). Where the rows live is decided per call,
  block by block (:func:`rows_placement`, :func:`offload_blocks`, ``Graph.meta["offload_rows"]``):

  - a *kept* block is gathered on the device once, from one ``non_blocking`` copy of the pinned weight, dropped
    after the gather (within *fetch*: :func:`block_sources`), and read in place by every pass;
  - any other is gathered on the host, kept there pinned, and copied to the device for each pass of its site only
    (:func:`.frozen.streamed_linear`, :func:`.frozen.gather_write` / :func:`.frozen.gather_read`);

  counted as the **sum** of the kept blocks plus the **largest** block not kept (:func:`rows_cost`): ``"device"``
  keeps every block, ``"host"`` none, ``"partial"`` (a set of keys) those that fit the memory left
  (:func:`kept_blocks`).

The host keeps the modules themselves (pinned where CUDA is available). torch only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any

import torch

from .._placement import fetched_bytes, offloaded
from ..errors import ArgumentError
from .batch_fit import largest_batch
from .frozen import choose
from .layout import LORSA_OUT, SITE_PARTS, Layout, coder_layer_parts, stacked
from .nodes import count_distinct

if TYPE_CHECKING:
    from .budget import MemoryEstimate


def _bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


LORSA_OV: frozenset[str] = frozenset({"W_V", "b_V"}) | LORSA_OUT
"""A Lorsa's OV circuit: what its queries and keys (:meth:`~nnsight_lorsa.modules.lorsa.Lorsa.qk`) do not read —
left on the host when an offloaded Lorsa is fetched for them (``resident(lorsa, device, LORSA_OV)``: half of a
paper-scale Lorsa; its ``W_V`` rows and ``W_O`` rows reach the device as row blocks, :func:`offload_blocks`)."""


def coder_site_leave(owner: torch.nn.Module) -> frozenset[str]:
    """The tensors of a transcoder (or a cross-layer transcoder, ``owner``) its MLP site in the frozen pass does not
    read whole inside its ``resident`` block (the skip path and the encoder's input read the rest): the encoder
    ``W_enc`` / ``b_enc``, every decoder ``W_dec…`` and the activation's parameters — their active rows reach the
    device as row blocks (:func:`offload_blocks`) or per-node constants — and a cross-layer transcoder's stacked
    ``W_skip`` (``(n_layers, d, d)``: the site copies its own layer's alone, :func:`.layout.coder_layer_parts` of
    :data:`.layout.SITE_PARTS`)."""
    return frozenset(name for name, _ in [*owner.named_parameters(), *owner.named_buffers()]
                     if name in ("W_enc", "b_enc") or name.startswith(("W_dec", "activation."))
                     or (name == "W_skip" and stacked(owner, name)))


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of ``module``'s parameters and buffers (what one fetch copies to the device)."""
    return sum(_bytes(t) for t in [*module.parameters(), *module.buffers()])


def any_offloaded(layout: Layout) -> bool:
    """Whether a Lorsa or transcoder of ``layout`` is offloaded (a cross-layer transcoder's layer: its CLT)."""
    return any(offloaded(lay.lorsa) or (lay.transcoder is not None and offloaded(lay.transcoder.weights_owner))
               for lay in layout.layers)


#: where one call keeps the offloaded modules' active rows (:class:`.replacement.FrozenReplacement`'s ``offload_rows``):
#: ``"host"`` (no block kept), ``"device"`` (every block) or the keys of the blocks kept (:func:`offload_blocks`; the
#: rest copied per pass: ``Graph.meta["offload_rows"] == "partial"``)
RowsPlace = str | frozenset[str]


def offload_blocks(layout: Layout, *, d_model: int, node_vectors: str, itemsize: int) -> list[tuple[str, int]]:
    """The offloaded modules' row blocks, ``[(key, bytes)]`` in the order the frozen forward makes them, keyed as
    :class:`.replacement.FrozenReplacement` names them (:attr:`~.replacement.FrozenReplacement.device_rows`): per
    layer, a Lorsa's ``L{l}.lorsa.w_o`` (its distinct ``w_o`` rows, where its site gathers) and ``L{l}.lorsa.w_v``
    (the active OV heads' ``W_V`` rows, in the frozen model's dtype: ``itemsize`` bytes per number), then a
    transcoder's ``L{l}.tc.w_enc`` (where its encoder site gathers) and ``L{src}.tc.w_dec->{l}`` for every
    gathering decoder writing into MLP ``l`` (a cross-layer transcoder's earlier layers too). ``bytes``: what the
    block takes on the device, kept there for the call or copied there for one pass of its site (the same). Sites
    on grids copy their rows once anyway and are no block; blocks of no row are left out. ``node_vectors`` and
    ``itemsize`` as :func:`offload_terms` (which site gathers: :func:`.frozen.choose`)."""
    dtype = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}.get(itemsize, torch.float32)
    blocks: list[tuple[str, int]] = []
    features: dict[int, int] = {}  # a layer's distinct active features, counted once (a CLT layer's decoders
    # write into every later MLP: one count for all its blocks, not one per target)

    def distinct_features(lay: Any) -> int:
        if lay.layer not in features:
            features[lay.layer] = count_distinct(lay.tc_feat)
        return features[lay.layer]

    def tc_owner(lay: Any) -> Any:
        tc = lay.transcoder
        owner = None if tc is None else tc.weights_owner
        return owner if owner is not None and offloaded(owner) else None

    for lay in layout.layers:
        lorsa = lay.lorsa
        if lorsa is not None and offloaded(lorsa):
            heads = count_distinct(lay.lorsa_head)
            if choose(node_vectors, lay.lorsa_pos.numel(), d_model, dtype) == "gather":
                blocks.append((f"L{lay.layer}.lorsa.w_o", heads * d_model * lorsa.W_O.element_size()))
            blocks.append((f"L{lay.layer}.lorsa.w_v", heads * d_model * itemsize))
        if lay.transcoder is None:
            continue
        n = lay.tc_pos.numel()
        if n and tc_owner(lay) is not None and choose(node_vectors, n, d_model, dtype) == "gather":
            size = distinct_features(lay) * d_model * lay.transcoder.W_enc.element_size()
            blocks.append((f"L{lay.layer}.tc.w_enc", size))
        for src in layout.layers[:lay.layer + 1]:  # FrozenReplacement.writes: every decoder into this MLP
            n = src.tc_pos.numel()
            if not n or tc_owner(src) is None:
                continue
            w_dec = src.transcoder.decoders(src.layer).get(lay.layer)
            if w_dec is None:
                continue
            if choose(node_vectors, n, d_model, dtype, layout.decoder_targets(src.layer)) == "gather":
                blocks.append((f"L{src.layer}.tc.w_dec->{lay.layer}",
                               distinct_features(src) * d_model * w_dec.element_size()))
    return [(key, size) for key, size in blocks if size]


def block_layer(key: str) -> int:
    """The layer whose site reads the block ``key`` (:func:`offload_blocks`' names): ``l`` of ``L{l}.lorsa.w_o``,
    ``L{l}.lorsa.w_v`` and ``L{l}.tc.w_enc``, the target ``l`` of ``L{src}.tc.w_dec->{l}`` (the decoder writes
    into MLP ``l``'s output). Its rows are kept, or copied per pass, on that layer's device (the frozen pass
    gathers them where its site computes, :meth:`.replacement.FrozenReplacement.nodes`).

    Raises:
        ArgumentError: ``key`` is not a block name."""
    head, arrow, target = key.partition("->")
    name = target if arrow else head.split(".", 1)[0][1:]
    if not (key.startswith("L") and name.isdigit()):
        raise ArgumentError(f"block_layer: {key!r} names no offloaded row block (L<layer>.lorsa.w_o, "
                            "L<layer>.tc.w_dec-><layer>, ...: the names of offload_blocks)")
    return int(name)


def rows_cost(blocks: list[tuple[str, int]], kept: Collection[str]) -> int:
    """Device bytes of the rows with the blocks ``kept`` (keys) kept on the device: their sum plus the largest block
    not kept (copied for one pass of its site: one on the device at a time)."""
    return (sum(size for key, size in blocks if key in kept)
            + max((size for key, size in blocks if key not in kept), default=0))


def kept_blocks(blocks: list[tuple[str, int]], slack: int) -> frozenset[str]:
    """The blocks to keep on the device within ``slack`` bytes above the all-host rows (:func:`rows_cost` of none
    kept: the largest block), chosen greedily in ``blocks``' order (the frozen forward's, :func:`offload_blocks`):
    each block is kept iff the set with it still costs at most ``slack`` bytes more than none kept (a block that
    does not fit is passed over, later ones still tried). Leaving one block out costs as much as keeping it (it is
    on the device while its site computes), so every set but all of them leaves at least two out. ``slack < 0``:
    none."""
    if slack < 0:
        return frozenset()
    limit = rows_cost(blocks, ()) + slack
    kept: set[str] = set()
    for key, _ in blocks:
        if rows_cost(blocks, kept | {key}) <= limit:
            kept.add(key)
    return frozenset(kept)


def kept_keys(blocks: list[tuple[str, int]], rows: RowsPlace) -> frozenset[str]:
    """The keys of ``blocks`` kept on the device under ``rows`` (:data:`RowsPlace`; a set's keys that name no block
    left out)."""
    keys = frozenset(key for key, _ in blocks)
    return keys if rows == "device" else frozenset() if isinstance(rows, str) else keys & frozenset(rows)


def kept_bytes(blocks: list[tuple[str, int]], rows: RowsPlace) -> int:
    """Bytes of the ``blocks`` kept on the device under ``rows`` (``Graph.meta["offload_rows_kept_bytes"]``)."""
    kept = kept_keys(blocks, rows)
    return sum(size for key, size in blocks if key in kept)


def rows_label(rows: RowsPlace | None) -> str | None:
    """``Graph.meta["offload_rows"]`` / :attr:`.budget.MemoryEstimate.offload_rows` of a placement: ``"host"``,
    ``"device"``, ``"partial"`` (a set of kept keys) or None (nothing offloaded)."""
    return rows if rows is None or isinstance(rows, str) else "partial"


def offload_terms(layout: Layout, *, d_model: int, node_vectors: str, itemsize: int,
                  rows: RowsPlace = "host", blocks: list[tuple[str, int]] | None = None) -> dict[str, int]:
    """``{"offload_fetch": bytes, "offload_rows": bytes}`` on the model's device for the offloaded modules of
    ``layout`` (module docstring); both 0 when none is offloaded. ``itemsize``: bytes per number of the
    frozen model (which site's node vectors gather: :func:`.frozen.choose`; the kept ``W_V`` rows are in it).
    ``rows``: where the frozen pass keeps the active rows (:data:`RowsPlace`, :class:`.replacement.FrozenReplacement`'s
    ``offload_rows``): the blocks kept (:func:`offload_blocks`; ``"device"``: all, ``"host"``: none) summed, plus
    the largest block not kept (copied per pass: one on the device at a time, :func:`rows_cost`), plus the skip
    matrices either way. ``blocks``: :func:`offload_blocks` of the same arguments where the caller has them (one
    list per call, :func:`.budget.plan_call`); None: computed here."""
    fetch, skips = 0, 0
    for lay in layout.layers:
        lorsa = lay.lorsa
        if lorsa is not None and offloaded(lorsa):
            fetch = max(fetch, fetched_bytes(lorsa, LORSA_OV))
        tc: Any = lay.transcoder
        owner = None if tc is None else tc.weights_owner  # a CLT layer: its CLT, with that layer's W_skip
        if owner is None or not offloaded(owner):
            continue
        fetch = max(fetch, fetched_bytes(owner, coder_site_leave(owner), coder_layer_parts(tc, SITE_PARTS)))
        skip = getattr(owner, "W_skip", None)
        if isinstance(skip, torch.Tensor):
            skips += _bytes(skip) // (skip.shape[0] if skip.dim() == 3 else 1)  # a CLT: one layer's
    if blocks is None:
        blocks = offload_blocks(layout, d_model=d_model, node_vectors=node_vectors, itemsize=itemsize)
    kept = kept_keys(blocks, rows)
    if kept:  # a kept block is gathered on the device from one transient copy of its whole weight
        sources = block_sources(layout)
        fetch = max([fetch, *(sources[key] for key in kept)])
    return {"offload_fetch": fetch, "offload_rows": rows_cost(blocks, kept) + skips}


def block_sources(layout: Layout) -> dict[str, int]:
    """``{block key: bytes}`` of the whole weight each offloaded row block of :func:`offload_blocks` is gathered from
    (a Lorsa's ``W_O`` / ``W_V``, a transcoder's ``W_enc``, each decoder): a kept block's rows are gathered on the
    device from one copy of it (:meth:`.replacement.FrozenReplacement.nodes`), there while the gather runs."""
    out: dict[str, int] = {}
    by_layer = {lay.layer: lay for lay in layout.layers}
    for lay in layout.layers:
        if lay.lorsa is not None:
            out[f"L{lay.layer}.lorsa.w_o"] = _bytes(lay.lorsa.W_O)
            out[f"L{lay.layer}.lorsa.w_v"] = _bytes(lay.lorsa.W_V)
        if lay.transcoder is not None:
            out[f"L{lay.layer}.tc.w_enc"] = _bytes(lay.transcoder.W_enc)
            for target, w_dec in lay.transcoder.decoders(lay.layer).items():
                if target in by_layer:
                    out[f"L{lay.layer}.tc.w_dec->{target}"] = _bytes(w_dec)
    return out


def device_free_bytes(device: torch.device) -> int | None:
    """Bytes torch can still allocate on ``device``: the driver's free memory (``torch.cuda.mem_get_info``) plus
    what torch's caching allocator holds reserved but unallocated; None off CUDA (no such query)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


#: the margin of the free-memory rule of :func:`rows_placement`: the estimate times this must fit
FREE_MEMORY_MARGIN = 1.1


def kept_per_device(placed: list[tuple[str, int, torch.device]], free: Mapping[torch.device, int | None],
                    device_bytes: int) -> RowsPlace:
    """The free-memory rule of :func:`rows_placement`, per device: the blocks each device keeps of its own.

    Each block's rows live on the device of the site that reads them (``placed``: ``(key, bytes, device)`` in the
    frozen forward's order, :func:`offload_blocks` with :func:`block_layer`'s layer's device): on a model split over
    several GPUs (``device_map="auto"``) a block is kept, or copied per pass, on its layer's GPU. Per device ``d``
    the *slack* is ``free[d] / FREE_MEMORY_MARGIN − device_bytes`` (bytes, rounded down; ``free[d]`` None — no
    query — or a device missing from ``free``: none kept there), and its blocks are kept greedily within it
    (:func:`kept_blocks` over that device's blocks alone). Conservative on several devices: ``device_bytes`` is the
    all-host estimate of the whole frozen pass (:attr:`.budget.MemoryEstimate.device_bytes`, a single-device model:
    it does not split the pass by layer), charged in full against every device's free memory.

    Args:
        placed: the offloaded row blocks with their devices.
        free: bytes torch can still allocate per device (:func:`device_free_bytes`); every device the model's
            layers use, also those without a block.
        device_bytes: the call's estimate with every row on the host, at its batch (bytes).

    Returns:
        ``"device"`` when every block is kept and every device of ``free`` has a slack ``≥ 0`` (no block at all:
        that alone), ``"host"`` when none is kept, else the kept keys (:data:`RowsPlace`). One device: exactly
        :func:`kept_blocks` of all blocks within that device's slack.
    """
    def slack(device: torch.device) -> int:
        f = free.get(device)
        return -1 if f is None else math.floor(f / FREE_MEMORY_MARGIN - device_bytes)

    kept: set[str] = set()
    for device in dict.fromkeys(d for _, _, d in placed):  # each device once, in the forward's order
        kept |= kept_blocks([(key, size) for key, size, d in placed if d == device], slack(device))
    if len(kept) == len(placed) and all(slack(d) >= 0 for d in {*free, *(d for _, _, d in placed)}):
        return "device"
    return frozenset(kept) if kept else "host"


def rows_placement(offloaded_any: bool, device: str, estimate: Callable[[RowsPlace, int], MemoryEstimate],
                   blocks: Callable[[], list[tuple[str, int]]], *, batch_size: int, max_memory: int | None,
                   free_bytes: int | Mapping[torch.device, int | None] | None,
                   block_device: Callable[[str], torch.device] | None = None) -> RowsPlace | None:
    """Where one :func:`.attribute.attribute` call keeps the offloaded modules' active rows
    (:data:`RowsPlace`: :class:`.replacement.FrozenReplacement`'s ``offload_rows``; ``Graph.meta["offload_rows"]``).

    The rule: ``None`` when no module is offloaded (``offloaded_any`` false); ``"host"`` on a CPU (or ``meta``:
    a remote model's) ``device`` (an offloaded module computes where it is stored: nothing is copied). Otherwise
    as many blocks as fit the *slack* (bytes), kept greedily in the frozen forward's order (:func:`kept_blocks`):
    with ``max_memory`` (bytes of the device) ``max_memory`` minus the all-host estimate's ``device_bytes`` at the
    largest batch that fits it with the rows on the host (:func:`.budget.largest_batch`: keeping rows never shrinks
    the batch); without it, per device (:func:`kept_per_device`), that device's ``free_bytes / FREE_MEMORY_MARGIN``
    (bytes torch can still allocate there, :func:`device_free_bytes`, over 1.1) minus that estimate's
    ``device_bytes`` at ``batch_size``, for the blocks whose site computes there (``block_device``; no free-memory
    query anywhere: ``"host"``). Every block kept: ``"device"``; none: ``"host"``; else the set of kept keys.

    Args:
        offloaded_any: some Lorsa or transcoder is offloaded (:func:`any_offloaded`).
        device: the model's device type (``"cpu"``, ``"cuda"``, ...).
        estimate: ``(rows, batch)`` → the call's :class:`~.budget.MemoryEstimate` at ``batch`` with the rows
            kept there (:func:`offload_terms`); called (with ``"host"``) only where the rule needs it.
        blocks: → the offloaded row blocks, ``[(key, bytes)]`` in the forward's order (:func:`offload_blocks`);
            called only where the rule needs it.
        batch_size: the call's batch.
        free_bytes: (without ``max_memory``) bytes free on the model's device (one device: every block there), or
            per device (``{torch.device: bytes or None}``: every device of the model's layers); None: no query.
        block_device: a block's key → the device its rows live on (its layer's, :func:`block_layer`); None: every
            block on the one device of ``free_bytes`` (an int, or the mapping's first).

    Raises:
        MemoryBudgetError: with ``max_memory``, not even batch 1 fits with the rows on the host.
    """
    if not offloaded_any:
        return None
    if device in ("cpu", "meta"):
        return "host"
    if isinstance(free_bytes, int):
        free_bytes = {torch.device(device): free_bytes}
    if max_memory is None and (free_bytes is None or all(f is None for f in free_bytes.values())):
        return "host"
    if max_memory is None and free_bytes is not None:
        first = next(iter(free_bytes))
        where = block_device or (lambda key: first)
        return kept_per_device([(key, size, where(key)) for key, size in blocks()], free_bytes,
                               estimate("host", batch_size).device_bytes)
    assert max_memory is not None  # (free_bytes None: "host" above)
    batch = largest_batch(lambda b: estimate("host", b), max_memory, batch_size, device)
    slack = max_memory - estimate("host", batch).device_bytes  # the rows on the host at that batch
    found = blocks()
    kept = kept_blocks(found, slack)
    if slack >= 0 and len(kept) == len(found):
        return "device"
    return kept if kept else "host"
