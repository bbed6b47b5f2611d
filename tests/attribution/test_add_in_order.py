"""``rows.add_in_order``: the stored rows' sequential float64 sums (residuals, masked row masses) by a host
``cumsum`` — bit for bit the ``index_add_`` to one place it replaced, and the left-to-right sum in Python floats."""

from __future__ import annotations

import struct

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from nnsight_lorsa.attribution.rows import add_in_order

FINITE = st.floats(allow_nan=False, allow_infinity=False, width=64)
#: values spread over many binades, with signed zeros, so that any other order of the additions changes bits
VALUES = st.one_of(FINITE, st.sampled_from([0.0, -0.0, 1e300, -1e300, 1e-300, 2.0**-1074]),
                   st.floats(-1.0, 1.0).map(lambda x: x * 2.0**40))


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


@settings(max_examples=200, deadline=None)
@example(start=-0.0, values=[-0.0, -0.0], spare=0, threads=1)  # a scan's sums start from +0.0: stays -0.0 here
@example(start=-0.0, values=[-0.0, 0.0, -0.0], spare=1, threads=1)  # and is +0.0 once a +0.0 is added
@given(start=VALUES, values=st.lists(VALUES, min_size=1, max_size=300), spare=st.integers(0, 3),
       threads=st.sampled_from([1, 2]))
def test_add_in_order_is_the_sequential_sum_bit_for_bit(start, values, spare, threads):
    n = len(values)
    entries = torch.tensor(values, dtype=torch.float64)
    expected = start
    for v in values:  # Python floats: IEEE double, one addition at a time, left to right
        expected += v
    reference = torch.tensor([start], dtype=torch.float64).index_add_(0, torch.zeros(n, dtype=torch.long), entries)

    total = torch.tensor([start], dtype=torch.float64)
    run = torch.full((n + 1 + spare,), float("nan"), dtype=torch.float64)  # a larger buffer, as a chunk's
    run[1:n + 1] = entries
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        add_in_order(total, run, n)
    finally:
        torch.set_num_threads(before)
    assert _bits(total.item()) == _bits(expected), (total.item(), expected)
    assert _bits(total.item()) == _bits(reference.item())

