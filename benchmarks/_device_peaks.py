"""Where an ``attribute`` call's device peak is: the peak reached inside each of its phases, and the live allocations
at the overall peak grouped by the code that made them (``benchmarks/gpu_scale.py`` (d), for the gap between
``estimate_memory`` and the measured peak; issue 21, goal 4(d)).

:class:`PhasePeaks` folds a peak counter that can be reset (CUDA: ``torch.cuda.max_memory_allocated`` and
``reset_peak_memory_stats``) at every phase boundary: at each entry and exit the peak since the last boundary is
credited to every phase open in between (a nested phase's peak counts for the phase around it too) or, with none
open, to ``between``, and the counter is reset — so each phase's peak is the most allocated while it ran, and the
overall peak is the largest of them all (:attr:`PhasePeaks.overall`), what one reading without resets gives.

:func:`snapshot_peak_summary` replays the trace of ``torch.cuda.memory._snapshot()`` (recorded with
``torch.cuda.memory._record_memory_history``): the running sum of the blocks allocated while recording (``alloc``
adds, ``free_completed`` removes; frees of blocks allocated before it are left out, as
:func:`benchmarks._alloc_peak.allocation_peak` does), its peak, and the blocks live at that moment grouped by the
innermost frame of their allocation's stack inside ``nnsight_lorsa`` (else the innermost frame), largest first.
Pure functions of plain values: the tests feed them synthetic counters and snapshots.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

#: the key of the peak reached outside every phase
BETWEEN = "between"


class PhasePeaks:
    """Per-phase peaks of a resettable peak counter, above ``base`` (module docstring).

    Args:
        read: → the counter's peak since its last reset (bytes).
        reset: resets the counter (its peak to what is held now).
        base: bytes subtracted from every reading (what was held before the measured call).
    """

    def __init__(self, read: Callable[[], int], reset: Callable[[], None], base: int = 0) -> None:
        self.read, self.reset, self.base = read, reset, base
        self.open: list[str] = []
        self.peaks: dict[str, int] = {}
        #: the peak before :meth:`start` (warm-up calls), above ``base``; None until started
        self.before: int | None = None

    def start(self) -> None:
        """Take what the counter holds so far as :attr:`before` and reset it."""
        self.before = self.read() - self.base
        self.reset()

    def _fold(self) -> None:
        value = self.read() - self.base
        for name in self.open or [BETWEEN]:
            self.peaks[name] = max(self.peaks.get(name, value), value)
        self.reset()

    def enter(self, name: str) -> None:
        self._fold()
        self.open.append(name)

    def exit(self, name: str) -> None:
        self._fold()
        # the innermost open entry of that name (phases of one name may nest: assemble_pruned calls assemble)
        del self.open[len(self.open) - 1 - self.open[::-1].index(name)]

    def finish(self) -> dict[str, int]:
        """The peaks after the last boundary folded in: ``{phase: bytes above base}`` (``between`` included)."""
        self._fold()
        return dict(self.peaks)

    @property
    def overall(self) -> int | None:
        """The largest peak since :meth:`start` (every phase's and ``between``'s, bytes above ``base``)."""
        return max(self.peaks.values(), default=None)


def _frame_key(frames: Iterable[dict[str, Any]], package: str) -> str:
    """The innermost frame of ``frames`` (innermost first, as the snapshot lists them) inside ``package``, as
    ``path-from-package:line:function``; else ``other: file:line:function`` of the innermost frame (``?`` if none)."""
    frames = list(frames)
    for f in frames:
        name = str(f.get("filename", ""))
        marker = f"/{package}/"
        if marker in name.replace("\\", "/"):
            rel = package + "/" + name.replace("\\", "/").split(marker, 1)[1]
            return f"{rel}:{f.get('line')}:{f.get('name')}"
    if not frames:
        return "?"
    f = frames[0]
    return f"other: {f.get('filename')}:{f.get('line')}:{f.get('name')}"


def snapshot_peak_summary(snapshot: dict[str, Any], top: int = 20, package: str = "nnsight_lorsa",
                          max_entries: int | None = None) -> dict[str, Any]:
    """The live allocations at the peak of a recorded CUDA memory trace, grouped by their innermost ``package`` frame.

    Args:
        snapshot: ``torch.cuda.memory._snapshot()`` (its ``device_traces``: per device a list of entries with
            ``action``, ``addr``, ``size`` and ``frames``, innermost first).
        top: how many groups to keep (largest first; the rest summed in ``rest_bytes``).
        package: the frames' package whose innermost frame names a group.
        max_entries: the ring buffer's size the trace was recorded with (``truncated`` when a device's trace is
            that long: its earliest entries may be lost).

    Returns:
        ``{"peak_bytes", "peak_index", "entries", "truncated", "groups": [{"where", "bytes", "count"}],
        "rest_bytes"}`` for the device whose trace reaches the highest peak (bytes above the start of recording).
    """
    def replay(trace: list[dict[str, Any]], stop: int) -> tuple[dict[Any, tuple[int, int]], int, int]:
        """(live blocks after entry ``stop`` — all of them with ``stop = -1`` —: addr → (bytes, index of their
        alloc); the peak; its entry's index)."""
        live: dict[Any, tuple[int, int]] = {}
        held = peak = 0
        peak_index = -1
        for i, e in enumerate(trace):
            action, addr, size = e.get("action"), e.get("addr"), int(e.get("size", 0))
            if action == "alloc":
                if addr in live:  # its free not recorded: the block was reused
                    held -= live.pop(addr)[0]
                live[addr] = (size, i)
                held += size
                if held > peak:
                    peak, peak_index = held, i
            elif action == "free_completed" and addr in live:
                held -= live.pop(addr)[0]
            if i == stop:
                break
        return live, peak, peak_index

    best: dict[str, Any] | None = None
    for device, trace in enumerate(snapshot.get("device_traces", [])):
        _, peak, peak_index = replay(trace, -1)
        if best is None or peak > best["peak_bytes"]:
            live, _, _ = replay(trace, peak_index) if peak_index >= 0 else ({}, 0, -1)
            best = {"device": device, "peak_bytes": peak, "peak_index": peak_index, "entries": len(trace),
                    "truncated": max_entries is not None and len(trace) >= max_entries,
                    "live": [(size, _frame_key(trace[i].get("frames", []), package)) for size, i in live.values()]}
    if best is None:
        return {"peak_bytes": 0, "peak_index": -1, "entries": 0, "truncated": False, "groups": [], "rest_bytes": 0}
    groups: dict[str, list[int]] = {}
    for size, where in best.pop("live"):
        g = groups.setdefault(where, [0, 0])
        g[0] += size
        g[1] += 1
    ranked = sorted(groups.items(), key=lambda kv: (-kv[1][0], kv[0]))
    return {**best, "groups": [{"where": k, "bytes": v[0], "count": v[1]} for k, v in ranked[:top]],
            "rest_bytes": sum(v[0] for _, v in ranked[top:])}
