"""An allocation-level peak of the CPU memory that torch's tensors hold during a call: reproducible where the
resident set is not.

:func:`allocation_peak` runs a call under ``torch.profiler`` with ``profile_memory=True`` and walks its allocation
events (the profiler's event tree, ``experimental_event_tree``: each with its pointer and size) in time order: ``+size``
at each allocation, ``−size`` at the free of a block allocated in the call; the largest running sum is the most memory
the call's own tensors held at once. Frees of blocks allocated before the call are left out on purpose: the
profiler's CPU reporter knows their size only if an earlier profiled call made them (a size table that outlives the
session), so counting them would make the result depend on the process's history — the peak is an upper bound on
how far the call raises the tensors' memory above its start. The same call gives the same bytes run after run (the
tests check it), where the resident set (``VmHWM``) moves with the heap's state — what earlier calls left free,
glibc's trimming — by several MB. It counts what torch's CPU allocator hands out (every CPU tensor's storage), not
numpy's own buffers, Python objects or the allocator's page-level overhead. Used by
``tests/attribution/test_budget_rows.py`` and ``benchmarks/attribution_memory_terms.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.profiler import ProfilerActivity, profile


def allocation_peak(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, int]:
    """``(fn(*args, **kwargs), peak bytes)``: the largest running sum, in time order, of the sizes of the CPU blocks
    the call allocates, less those of them it frees (module docstring; ``0`` if it allocates nothing)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn(*args, **kwargs)
    series, _ = allocation_series(prof)
    return out, max((held for _, held in series), default=0)


def allocation_series(prof: Any, label: str | None = None) -> tuple[list[tuple[int, int]], list[tuple[str, int, int]]]:
    """``(series, windows)`` of a finished ``torch.profiler.profile(profile_memory=True)``: ``series`` the running
    sum after each CPU allocation event, ``(time ns, bytes held)`` in time order (a block allocated inside, ``+size``;
    its free, ``−size``; frees of earlier blocks left out: module docstring); ``windows`` the ``record_function``
    ranges whose names start with ``label`` (none when None), ``(name without the label, start ns, end ns)``."""
    events: list[tuple[int, int, int]] = []  # (time, pointer, ±bytes)
    windows: list[tuple[str, int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        fields = node.typed[1]
        if type(fields).__name__ == "_ExtraFields_Allocation" and fields.device.type == "cpu":
            events.append((node.start_time_ns, fields.ptr, fields.alloc_size))
        elif label is not None and node.name.startswith(label):
            windows.append((node.name[len(label):], node.start_time_ns, node.end_time_ns))
    held = 0
    live: dict[int, int] = {}  # pointer → bytes of the blocks allocated in the call, not yet freed
    series: list[tuple[int, int]] = []
    for t, ptr, size in sorted(events, key=lambda e: e[0]):
        if size > 0:
            live[ptr] = size
            held += size
        elif ptr in live:
            held -= live.pop(ptr)
        series.append((t, held))
    return series, windows
