"""Remote-path tests added by the second mutation probe (docs/reliability.md, "Mutation probe, round 2"): each kills
a mutant of ``remote.py`` / ``ndif_rules.py`` that the remote tests let pass. Reference: what pickling ships."""

from __future__ import annotations

import pickle

import pytest
import torch

from nnsight_lorsa.remote import PayloadTooLargeError, check_payload, payload_report


def test_a_view_counts_its_whole_storage_once():
    """A view ships its base tensor's whole storage (pickle's size says so), and a storage two tensors share is
    counted once (mutants: a view counted as its own elements; a shared storage counted twice)."""
    base = torch.arange(1000, dtype=torch.float32)
    view = base[:10]
    assert len(pickle.dumps(view)) >= base.numel() * 4  # the reference: pickling a view ships the whole storage
    assert payload_report({"v": view}).total_tensor_bytes == 4000
    report = payload_report({"a": base, "v": view, "w": base[500:]})
    assert report.total_tensor_bytes == 4000
    assert sorted(t.nbytes for t in report.tensors) == [0, 0, 4000]
    other = torch.ones(3, dtype=torch.float64)
    assert payload_report([base, other, view]).total_tensor_bytes == 4000 + 24


def test_a_payload_exactly_at_the_cap_passes_and_one_byte_more_is_refused():
    """The cap is the largest payload allowed ("above the cap" refused; mutant: ``>=``)."""
    obj = {"w": torch.zeros(250, dtype=torch.float32)}
    assert check_payload(obj, cap_bytes=1000).total_tensor_bytes == 1000
    with pytest.raises(PayloadTooLargeError) as err:
        check_payload(obj, cap_bytes=999)
    assert err.value.cap_bytes == 999 and err.value.report.total_bytes == 1000
