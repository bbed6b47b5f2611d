"""The hostile-input table (``tests/hostile_cases.py``, issue 13): every case must end in a named error of
ours or a correct result — no silent wrong result, raw third-party exception, data loss or state left
behind on the model.

The table runs once, in a fresh interpreter without the test-time type-checking hook (a user's view of
the package: wrongly typed arguments reach our own checks, not beartype's), and writes one record per
case; the tests below read them. ``PYTHONPATH=. python tests/hostile_cases.py`` prints the same table.
"""

from __future__ import annotations

from collections import Counter

import pytest
from helpers import recorded_outcomes


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> list[dict]:
    return recorded_outcomes("hostile_cases.py", tmp_path_factory.mktemp("hostile"))


def test_at_least_300_cases_over_every_input_class(records):
    groups = Counter(r["group"].split(":")[0] for r in records)
    assert len(records) >= 300, len(records)
    for group in ("config", "tensor", "file", "graph", "gates", "api", "save"):
        assert groups[group] >= 5, groups
    loaders = {r["group"].split(":")[1] for r in records if ":" in r["group"]}
    assert {"ours_lorsa", "ours_sae", "ours_clt", "saelens_topk", "sparsify_sae", "llamascopium_lorsa",
            "llamascopium_sae", "ct_transcoders", "ct_clt"} <= loaders, loaders


@pytest.mark.parametrize("outcome", ["silent_wrong", "unclear_error", "raw_exception", "state_left", "data_lost"])
def test_no_case_ends_in(records, outcome):
    bad = [f"{r['id']}: {r['detail']}" for r in records if r["outcome"] == outcome]
    assert not bad, f"{len(bad)} {outcome}:\n" + "\n".join(bad[:40])


def test_both_outcome_classes_occur(records):
    """The table can tell them apart: bad inputs are refused by name, harmless ones load the same module."""
    counts = Counter(r["outcome"] for r in records)
    assert counts["named_error"] > 1000 and counts["correct"] > 50, counts
