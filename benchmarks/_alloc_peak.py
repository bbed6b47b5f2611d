"""An allocation-level peak of the CPU memory that torch's tensors hold during a call: reproducible where the
resident set is not.

:func:`allocation_peak` runs a call under ``torch.profiler`` with ``profile_memory=True`` and sums its
allocator events (``+bytes`` at each allocation, ``−bytes`` at each free) in time order: the largest running sum
is the most memory the call's own tensors held at once. The same call gives the
same bytes run after run (the tests check it), where the resident set (``VmHWM``) moves with the heap's state —
what earlier calls left free, glibc's trimming — by several MB. It counts what torch's CPU allocator hands out
(every CPU tensor's storage), not numpy's own buffers, Python objects or the
allocator's page-level overhead; a tensor allocated before the call and freed in it is not subtracted (the profiler
does not know its size), so the peak is that of the call's own allocations — an upper bound on how far the call
raises the tensors' memory above its start. Used by ``tests/attribution/test_budget_rows.py`` and
``benchmarks/attribution_memory_terms.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile


def allocation_peak(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, int]:
    """``(fn(*args, **kwargs), peak bytes)``: the largest running sum, in time order, of the CPU allocator events
    torch's profiler records during the call (module docstring: the call's own allocations, what it frees of them;
    ``0`` if it allocates nothing)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn(*args, **kwargs)
    cpu = torch._C._autograd.DeviceType.CPU
    events = sorted((e for e in prof.profiler.kineto_results.events()  # type: ignore[union-attr]
                     if e.name() == "[memory]" and e.device_type() == cpu), key=lambda e: e.start_ns())
    held = peak = 0
    for e in events:
        held += e.nbytes()
        peak = max(peak, held)
    return out, peak
