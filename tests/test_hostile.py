"""The hostile-input table (``tests/hostile_cases.py``, issue 13): every case must end in a named error of
ours or a correct result — no silent wrong result, raw third-party exception, data loss or state left
behind on the model.

The table runs once, in a fresh interpreter without the test-time type-checking hook (a user's view of
the package: wrongly typed arguments reach our own checks, not beartype's), and writes one record per
case; the tests below read them. ``PYTHONPATH=. python tests/hostile_cases.py`` prints the same table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("hostile") / "records.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)]),
           "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, str(TESTS / "hostile_cases.py"), "--json", str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert out.is_file(), done.stderr[-3000:]
    return json.loads(out.read_text())


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
