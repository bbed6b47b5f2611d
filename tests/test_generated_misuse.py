"""The generated-input probe (``tests/probe_counts.py``, issue 23): hypothesis draws arguments for the public
entry points of the modules (configs, forwards, encode/decode, z-patterns), patching (targets, interventions,
metrics, experiments) and analysis; every call must end in a correct result or a named error of ours that
names the argument — no raw third-party exception, no silent wrong result, no refusal of valid arguments.

The probe runs once, in a fresh interpreter without the test-time type-checking hook (a user's view: wrongly
typed arguments reach our own checks, not beartype's), derandomized (the same draws on every run);
``PYTHONPATH=. python tests/probe_counts.py`` prints the same counts, ``--explore`` draws new examples.
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
    out = tmp_path_factory.mktemp("probe") / "records.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)]),
           "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, str(TESTS / "probe_counts.py"), "--json", str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert out.is_file(), done.stderr[-3000:]
    return json.loads(out.read_text())


def test_every_area_is_probed(records):
    groups = Counter(r["group"] for r in records)
    probes = {r["probe"] for r in records}
    assert len(probes) >= 21, probes
    for group in ("config", "forward", "analysis", "patching"):
        assert groups[group] >= 20, groups


@pytest.mark.parametrize("outcome", ["raw_exception", "silent_wrong", "unclear_error", "false_refusal"])
def test_no_call_ends_in(records, outcome):
    bad = [f"{r['probe']} {r['args']}: {r['detail']}" for r in records if r["outcome"] == outcome]
    assert not bad, f"{len(bad)} {outcome}:\n" + "\n".join(bad[:30])


def test_both_passing_outcomes_occur_in_every_probe(records):
    """The generators reach valid and invalid arguments of every entry point (a probe that only ever drew
    junk, or only valid values, would pass without testing the property)."""
    for probe in {r["probe"] for r in records}:
        outcomes = Counter(r["outcome"] for r in records if r["probe"] == probe)
        assert outcomes["correct"] >= 1 and outcomes["named_error"] >= 1, (probe, outcomes)
