"""``benchmarks/gathered_nodes.py --chunks``: the chunked grid timed at each chunk size gives the default size's
bits (a position's nodes are summed within one chunk whatever its size), and the size is restored after."""

from __future__ import annotations

import torch

import nnsight_lorsa.attribution.frozen as frozen
from benchmarks.gathered_nodes import chunk_elements, measure


def test_every_chunk_size_gives_the_same_bits_and_the_default_is_restored():
    before = frozen.node_chunk_elements(torch.device("cpu"))
    row = measure(24, 8, 32, 64, 3, torch.float32, torch.device("cpu"), 1, chunks=[5, 8, 12])
    assert before == frozen.node_chunk_elements(torch.device("cpu"))
    assert set(row["chunked_grid_by_chunk"]) == {"5", "8", "12"}
    assert all(r["same_results"] and r["seconds"] > 0 for r in row["chunked_grid_by_chunk"].values())
    with chunk_elements(2**5):  # 32 numbers: one position of 8 nodes × 32 wide does not fit, one a chunk then
        assert frozen.node_chunk_elements(torch.device("cuda")) == 32
    assert frozen.node_chunk_elements(torch.device("cpu")) == before
