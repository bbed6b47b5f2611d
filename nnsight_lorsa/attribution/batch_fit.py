"""The largest attribution batch that fits a memory budget (``attribute(..., max_memory=...)``), from a
:class:`.budget.MemoryEstimate` at each batch tried: shared by :mod:`.budget` (the batch) and :mod:`.offload` (where the
offloaded rows live), apart from both so neither imports the other's decision. torch-free.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..errors import MemoryBudgetError

if TYPE_CHECKING:
    from .budget import MemoryEstimate


def largest_batch(estimate_at: Callable[[int], MemoryEstimate], max_memory: int, batch_size: int,
                  device: str = "cpu") -> int:
    """The largest batch ``≤ batch_size`` whose estimate fits ``max_memory`` bytes (its ``host_bytes`` on a CPU
    model, its ``device_bytes`` otherwise), each batch checked against its *own* estimate: besides the per-copy
    term, shared terms grow with the batch (a gathered site's chunk temporaries, the recomputed Lorsa rows' step:
    :func:`.budget.estimate_layout`), so the asked batch's terms over-count a smaller batch. A bisection over
    ``[1, batch_size]`` (about ``log2(batch_size)`` estimates; the caller memoises them): the batch returned always
    fits; it is the largest where the estimate grows with the batch, as it does.

    Args:
        estimate_at: batch → the call's :class:`~.budget.MemoryEstimate` at that batch.
        max_memory: the budget, bytes (> 0).
        batch_size: the asked batch (≥ 1).
        device: the model's device type (``"cpu"``: host bytes).

    Raises:
        MemoryBudgetError: not even batch 1 fits; the message lists batch 1's terms.
    """
    def fits(batch: int) -> bool:
        e = estimate_at(batch)
        return (e.host_bytes if device == "cpu" else e.device_bytes) <= max_memory

    if fits(batch_size):
        return batch_size
    if not fits(1):
        t = estimate_at(1).terms
        mib = {k: round(v / 2**20, 1) for k, v in t.items() if k not in ("n_sources", "n_rows", "stored_entries")}
        raise MemoryBudgetError(f"attribution needs more than max_memory={max_memory / 2**20:.0f} MiB even at batch 1 "
                                f"(terms in MiB: {mib}; {t['n_sources']} sources, {t['n_rows']} rows, "
                                f"{t['stored_entries']} stored entries): prune while building (prune=), a smaller "
                                "keep_mass, max_feature_nodes, or memory='lean'")
    lo, hi = 1, batch_size  # lo fits, hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
