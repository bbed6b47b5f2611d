"""The generated-input probe (``tests/probe_counts.py``, issue 23): hypothesis draws arguments for the public
entry points of the modules (configs, forwards, encode/decode, z-patterns), patching (targets, interventions,
metrics, experiments) and analysis; every call must end in a correct result or a named error of ours that
names the argument — no raw third-party exception, no silent wrong result, no refusal of valid arguments.

The probe runs once, in a fresh interpreter without the test-time type-checking hook (a user's view: wrongly
typed arguments reach our own checks, not beartype's), derandomized (the same draws on every run);
``PYTHONPATH=. python tests/probe_counts.py`` prints the same counts, ``--explore`` draws new examples.
"""

from __future__ import annotations

from collections import Counter

import pytest
from helpers import recorded_outcomes


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> list[dict]:
    return recorded_outcomes("probe_counts.py", tmp_path_factory.mktemp("probe"))


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
