"""Review 2026-11-27: a call that fails after some rows were stored (an fp16 ``NonFiniteError`` from
:meth:`.rows.SparseRows.append`, a CUDA OOM, an interrupt) must free the stored rows' device copies for the ranking
(``mirror_bytes``) too, not only a call that assembles its graph: the exception's traceback (kept by ``except ... as
e``, a notebook's ``sys.last_traceback``) holds ``compute_graph``'s frame and so the store — on a GPU up to the
whole slack of the memory plan, held while the user retries (e.g. with ``dtype=torch.float32``)."""

from __future__ import annotations

import sys

import pytest
import torch
from helpers import attribution_replacement_on, random_ids

import nnsight_lorsa.attribution.budget as budget
from nnsight_lorsa.attribution import attribute
from nnsight_lorsa.attribution.rows import RowScheduler, SparseRows

ROWS = sys.modules["nnsight_lorsa.attribution.rows"]


class Boom(RuntimeError):
    pass


@pytest.mark.parametrize("fail_at", [2, 3])
def test_a_failed_call_frees_the_kept_rows(monkeypatch, fail_at):
    """``attribute`` with a feature budget and a faked device copy, failing at the ``fail_at``-th stored batch:
    the copies kept by the batches before it are freed once the error leaves ``attribute``, while the error (and its
    traceback) is still held."""
    monkeypatch.setattr(ROWS, "DEVICE_ROW_ENTRIES", 1)
    monkeypatch.setattr(ROWS, "mirrors", lambda d: True)
    monkeypatch.setattr(budget, "mirrors", lambda d: True)
    monkeypatch.setattr(SparseRows, "pass_device", lambda self: torch.device("cpu", 0))
    stores: list[SparseRows] = []
    real = RowScheduler.record
    calls = [0]

    def record(self, rows, grads):
        calls[0] += 1
        if calls[0] == fail_at:
            raise Boom("a failure after some rows were stored")
        real(self, rows, grads)
        if isinstance(self.rows, SparseRows) and self.rows not in stores:
            stores.append(self.rows)

    monkeypatch.setattr(RowScheduler, "record", record)
    rep = attribution_replacement_on("cpu")
    ids = random_ids(1, 10, seed=3)[0]
    with pytest.raises(Boom) as info:
        attribute(rep, ids, batch_size=3, max_feature_nodes=12, max_memory=2**40)
    assert info.value.__traceback__ is not None  # the error, with its frames, is still alive here
    assert stores and stores[0].mirrored_bytes > 0  # a copy was kept before the failure
    assert all(not b.mirror and not b.mirror_starts for s in stores for b in s.blocks)
