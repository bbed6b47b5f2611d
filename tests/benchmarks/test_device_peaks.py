"""``benchmarks/_device_peaks.py``: the per-phase device peaks ``benchmarks/gpu_scale.py`` (d) records
(``phase_peaks``) and the summary of a CUDA memory snapshot at the peak (``--memory-snapshot``), checked without a
GPU on synthetic counters and snapshots; and ``gpu_scale.phase_times`` telling a tracker each phase of a real
(CPU) ``attribute`` call, nested phases included."""

from __future__ import annotations

import torch
from helpers import ROOT, attribution_setup, load_script, random_ids, rm
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks._device_peaks import BETWEEN, PhasePeaks, snapshot_peak_summary


class Counter:
    """A peak counter as CUDA's allocator keeps one: what is held, and its peak since the last reset."""

    def __init__(self) -> None:
        self.held = self.peak = 0

    def add(self, n: int) -> None:
        self.held += n
        self.peak = max(self.peak, self.held)

    def reset(self) -> None:
        self.peak = self.held


# a program: ("alloc", n), ("free", n) (at most what is held), ("enter", name), ("exit",) (the innermost open)
programs = st.lists(st.one_of(st.tuples(st.just("alloc"), st.integers(0, 100)),
                              st.tuples(st.just("free"), st.integers(0, 100)),
                              st.tuples(st.just("enter"), st.sampled_from(["a", "b", "c"])),
                              st.tuples(st.just("exit"))), max_size=40)


@settings(max_examples=200, deadline=None)
@given(programs, st.integers(0, 50), st.integers(0, 30))
def test_phase_peaks_are_the_most_held_inside_each_phase_and_overall(program, warmup, base):
    """Each phase's peak is the most held at any moment from its entry to its exit (nested phases count for the
    phases around them; a phase run twice: the larger), ``between`` the most held outside every phase, the overall
    peak the most held since the start; the warm-up's peak is kept apart — all above ``base``."""
    c = Counter()
    c.add(base)
    c.add(warmup)
    c.add(-warmup)
    t = PhasePeaks(lambda: c.peak, c.reset, base=base)
    t.start()
    assert t.before == warmup
    truth: dict[str, int] = {}
    stack: list[str] = []

    def credit() -> None:
        for name in stack or [BETWEEN]:
            truth[name] = max(truth.get(name, 0), c.held - base)

    credit()
    for step in program:
        if step[0] == "alloc":
            c.add(step[1])
        elif step[0] == "free":
            c.add(-min(step[1], c.held - base))
        elif step[0] == "enter":
            credit()
            t.enter(step[1])
            stack.append(step[1])
        elif stack:
            t.exit(stack[-1])
            stack.pop()
            # the exit's own moment counts for the phase just left
        credit()
    while stack:
        t.exit(stack[-1])
        stack.pop()
        credit()
    peaks = t.finish()
    assert peaks == truth
    assert t.overall == max(truth.values())


def test_phase_peaks_of_one_name_nested():
    """``assemble_pruned`` calls ``assemble`` (both recorded as ``assemble``): the inner exit closes the inner one."""
    c = Counter()
    t = PhasePeaks(lambda: c.peak, c.reset)
    t.start()
    t.enter("assemble")
    c.add(5)
    t.enter("assemble")
    c.add(10)
    c.add(-10)
    t.exit("assemble")
    c.add(-5)
    t.exit("assemble")
    c.add(3)
    assert t.finish() == {BETWEEN: 3, "assemble": 15}


def _frames(*where: tuple[str, int, str]) -> list[dict]:
    return [{"filename": f, "line": line, "name": name} for f, line, name in where]


def test_snapshot_summary_groups_the_live_blocks_at_the_peak_by_innermost_package_frame():
    """A synthetic ``torch.cuda.memory._snapshot()``: the peak is where the running sum of the blocks allocated
    while recording is largest (a free of a block from before recording is not counted); the blocks live then are
    grouped by their innermost ``nnsight_lorsa`` frame (else the innermost frame), largest first, the rest summed."""
    pkg = "/site/nnsight_lorsa/attribution/"
    rows = _frames(("/usr/torch/functional.py", 10, "mm"), (pkg + "rows.py", 40, "record"),
                   (pkg + "engine.py", 5, "run"))
    frozen = _frames((pkg + "frozen.py", 77, "gather"), (pkg + "engine.py", 5, "run"))
    other = _frames(("/usr/torch/nn/modules/linear.py", 3, "forward"))
    trace = [
        {"action": "free_completed", "addr": 999, "size": 1000, "frames": []},  # allocated before recording
        {"action": "alloc", "addr": 1, "size": 100, "frames": rows},
        {"action": "alloc", "addr": 2, "size": 300, "frames": frozen},
        {"action": "alloc", "addr": 3, "size": 50, "frames": other},
        {"action": "alloc", "addr": 4, "size": 120, "frames": rows},  # the peak: 570
        {"action": "free_requested", "addr": 2, "size": 300, "frames": frozen},
        {"action": "free_completed", "addr": 2, "size": 300, "frames": frozen},
        {"action": "alloc", "addr": 5, "size": 400, "frames": frozen},  # 670 > 570: the new peak
        {"action": "free_completed", "addr": 5, "size": 400, "frames": frozen},
        {"action": "alloc", "addr": 6, "size": 10, "frames": other},
    ]
    small = [{"action": "alloc", "addr": 1, "size": 30, "frames": rows}]
    out = snapshot_peak_summary({"device_traces": [small, trace], "segments": []}, top=2, max_entries=10)
    assert out["device"] == 1 and out["peak_bytes"] == 670 and out["peak_index"] == 7
    assert out["entries"] == 10 and out["truncated"] is True
    assert out["groups"] == [
        {"where": "nnsight_lorsa/attribution/frozen.py:77:gather", "bytes": 400, "count": 1},
        {"where": "nnsight_lorsa/attribution/rows.py:40:record", "bytes": 220, "count": 2}]
    assert out["rest_bytes"] == 50  # the torch frame's block
    full = snapshot_peak_summary({"device_traces": [trace]}, max_entries=100)
    assert full["truncated"] is False and {g["where"] for g in full["groups"]} >= {
        "other: /usr/torch/nn/modules/linear.py:3:forward"}
    assert snapshot_peak_summary({"device_traces": []})["groups"] == []


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 7), st.integers(1, 50)), max_size=60))
@settings(max_examples=100, deadline=None)
def test_snapshot_summary_peak_is_the_largest_running_sum(events):
    """Generated alloc/free traces: the peak is the largest running sum of the blocks allocated and not yet freed,
    and the groups at it sum to it."""
    trace, live, held, peak = [], {}, 0, 0
    for is_alloc, addr, size in events:
        if is_alloc:
            held -= live.pop(addr, 0)
            live[addr] = size
            held += size
            peak = max(peak, held)
            trace.append({"action": "alloc", "addr": addr, "size": size,
                          "frames": _frames((f"/x/nnsight_lorsa/m{addr % 3}.py", 1, "f"))})
        elif addr in live:
            held -= live.pop(addr)
            trace.append({"action": "free_completed", "addr": addr, "size": 0})
    out = snapshot_peak_summary({"device_traces": [trace]})
    assert out["peak_bytes"] == peak
    assert sum(g["bytes"] for g in out["groups"]) + out["rest_bytes"] == peak


def test_phase_times_tells_the_tracker_every_phase_of_an_attribute_call():
    """``gpu_scale.phase_times`` with a tracker around a real CPU ``attribute`` call: every phase entered is exited
    (``record_rows`` inside ``backward``), nothing left open, and the phases the call ran have a peak."""
    from nnsight_lorsa.attribution import attribute

    gpu_scale = load_script(ROOT / "benchmarks" / "gpu_scale.py", "gpu_scale_for_peaks_test")
    model, _, lorsas, tcs = attribution_setup("llama")
    replacement = rm(model, lorsas, tcs)
    c = Counter()
    seen: list[tuple[str, str]] = []

    class Recording(PhasePeaks):
        def enter(self, name: str) -> None:
            seen.append(("enter", name))
            c.add(1)
            super().enter(name)

        def exit(self, name: str) -> None:
            seen.append(("exit", name))
            super().exit(name)

    tracker = Recording(lambda: c.peak, c.reset)
    tracker.start()
    with gpu_scale.phase_times(torch.device("cpu"), tracker):
        attribute(replacement, random_ids(1, 8, seed=3)[0], batch_size=4, max_feature_nodes=6)
    assert not tracker.open
    peaks = tracker.finish()
    entered = {name for kind, name in seen if kind == "enter"}
    assert {"clean_pass_and_layout", "frozen_forward", "backward", "record_rows"} <= entered
    assert entered <= set(peaks) and sum(k == "enter" for k, _ in seen) == sum(k == "exit" for k, _ in seen)
    assert tracker.overall == max(peaks.values()) > 0
