"""The largest attribution batch that fits a memory budget (``attribute(..., max_memory=...)``), from a
:class:`.budget.MemoryEstimate`'s terms: shared by :mod:`.budget` (the batch) and :mod:`.offload` (where the
offloaded rows live), apart from both so neither imports the other's decision. torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import MemoryBudgetError

if TYPE_CHECKING:
    from .budget import MemoryEstimate


def largest_batch(estimate: MemoryEstimate, max_memory: int, batch_size: int, device: str = "cpu") -> int:
    """The largest batch ``≤ batch_size`` whose estimate fits ``max_memory`` bytes (host memory on a
    CPU model, the device's otherwise).

    Raises:
        MemoryBudgetError: not even batch 1 fits; the message lists the terms.
    """
    t = estimate.terms
    per_copy, shared = t["frozen_per_copy"], t["frozen_shared"]
    if device == "cpu":  # rows + max(frozen pass + selection, pruning) + fixed
        rest = t["rows"] + t["fixed"]
        fits = max_memory >= rest + t["pruning"]
        b = (max_memory - rest - t["selection"] - shared) // max(1, per_copy) if fits else 0
    else:
        b = (max_memory - shared) // max(1, per_copy)
    b = min(batch_size, b)
    if b < 1:
        mib = {k: round(v / 2**20, 1) for k, v in t.items() if k not in ("n_sources", "n_rows", "stored_entries")}
        raise MemoryBudgetError(f"attribution needs more than max_memory={max_memory / 2**20:.0f} MiB even at batch 1 "
                                f"(terms in MiB: {mib}; {t['n_sources']} sources, {t['n_rows']} rows, "
                                f"{t['stored_entries']} stored entries): prune while building (prune=), a smaller "
                                "keep_mass, max_feature_nodes, or memory='lean'")
    return int(b)
