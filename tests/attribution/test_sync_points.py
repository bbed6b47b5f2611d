"""Attribution's per-batch loop reads few tensor values on the host (issue 21): on a GPU each such read
(``.item()``, ``.tolist()``, ``bool(t)``, ``nonzero``, …) is a device→host synchronisation. Counted on CPU
with the proxy of ``benchmarks/_sync_points.py`` (calls that would be one, any device, inside the loop only)."""

from __future__ import annotations

import pytest
from helpers import attribution_setup, random_ids, rm

from benchmarks._sync_points import count_syncs
from nnsight_lorsa.attribution import PruneConfig, attribute

#: measured (Lorsa + transcoders, 10 tokens, batch 8): the highest count of a batch after the first (the first
#: also builds the full graph's block layout, once per prompt). Full graph: the batch's cells read once
#: (``tolist``), the kept-entry check (one ``bool``; two ``int`` before 2026-11-27) and the edge rows' finiteness
#: check (one ``bool`` of their per-row max copied to the host, ``rows.refuse_non_finite_rows``); a budget: the
#: sparse rows' keep (``nonzero``, counts) and the influence re-estimate over the stored rows.
MAX_SYNCS = {"default": 3, "lean": 3, "budget": 25, "prune": 3}


@pytest.fixture(scope="module")
def setup():
    model, _, lorsas, tcs = attribution_setup("llama")
    return rm(model, lorsas, tcs), random_ids(1, 10, seed=3)[0]


@pytest.mark.parametrize("mode", sorted(MAX_SYNCS))
def test_host_reads_per_batch_stay_few(setup, mode):
    r, ids = setup
    kw = {"default": {}, "lean": {"memory": "lean"}, "budget": {"max_feature_nodes": 12},
          "prune": {"prune": PruneConfig()}}[mode]
    with count_syncs() as counts:
        attribute(r, ids, batch_size=8, **kw)
    assert len(counts.per_batch) >= 4
    later = max(counts.per_batch[1:])
    assert later <= MAX_SYNCS[mode], (counts.per_batch, counts.top())


def test_the_proxy_counts_a_host_read_in_the_loop(setup, monkeypatch):
    """The count can fail: one ``.item()`` more per batch in the loop is seen in every batch."""
    from nnsight_lorsa.attribution import rows

    r, ids = setup
    record = rows.RowStore.record

    def record_and_read(self, rows_, grads):
        grads.sum().item()
        record(self, rows_, grads)

    monkeypatch.setattr(rows.RowStore, "record", record_and_read)
    with count_syncs() as counts:
        attribute(r, ids, batch_size=8)
    assert max(counts.per_batch[1:]) > MAX_SYNCS["default"]
    items = sum(n for (kind, _), n in counts.sites.items() if kind == "Tensor.item")
    assert items == len(counts.per_batch)
