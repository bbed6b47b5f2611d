"""A generated probe of the front door: every public callable given None (or a str, an empty list, NaN) for each
required argument ends in a named error of ours (a ``LorsaError`` saying what was expected), not an ``AttributeError`` /
``TypeError`` from deep inside — the kind of failure the suite's beartype hook hides, since it refuses them by
annotation first. The callables are read from the subpackages' ``__all__``: a new entry point is probed as soon as it
is exported. On the code of 2026-11-29's fourth session start (aff6069) it lists 30 raw errors for None alone
(docs/reliability.md, "Config fields and mask values")."""

from __future__ import annotations

import pytest
from helpers import recorded_outcomes

#: dataclasses that hold what they are given (results, targets: checked when bound) are not front doors; these
#: classes are exported for typing and reached through our functions, never built by a researcher
INTERNAL = {
    "nnsight_lorsa.Graph", "nnsight_lorsa.attribution.BlockAdjacency",
    "nnsight_lorsa.attribution.IntervenedAttribution", "nnsight_lorsa.modules.JumpReLU",
    "nnsight_lorsa.adapters.mhsa_forward", "nnsight_lorsa.formats.PartialLoadWarning",
    "nnsight_lorsa.adapters.ArchitectureAdapter",
}
#: ``(callable, value)`` that run, the value being one it takes: the measures of any object (None, a str, a list are
#: objects a request may carry, of 0 or a few bytes) and a backend's model key (any str names a model)
VALID = {*{(name, value) for name in ("nnsight_lorsa.remote.payload_report", "nnsight_lorsa.remote.check_payload",
                                      "nnsight_lorsa.remote.serialized_size")
           for value in ("None", "'x'", "[]", "nan")},
         ("nnsight_lorsa.remote.MeasuredRemoteBackend", "'x'")}


@pytest.fixture(scope="module")
def outcome(tmp_path_factory) -> dict:
    return recorded_outcomes("none_argument_cases.py", tmp_path_factory.mktemp("none"))  # type: ignore[return-value]


@pytest.fixture(scope="module")
def records(outcome) -> list[dict]:
    return outcome["records"]


def test_the_probe_wrote_nothing(outcome):
    assert outcome["written"] == []


def test_the_probe_reaches_the_front_door(records):
    names = {r["name"] for r in records}
    assert {"nnsight_lorsa.attribute", "nnsight_lorsa.load", "nnsight_lorsa.Trainer", "nnsight_lorsa.LorsaSet",
            "nnsight_lorsa.patching.ioi_task", "nnsight_lorsa.viz.plot_graph"} <= names
    assert len([r for r in records if r["kind"] == "entry" and r["value"] == "None"]) >= 80
    assert {r["value"] for r in records} == {"None", "'x'", "[]", "nan"}


def test_every_entry_point_refuses_a_wrong_value_with_a_named_error(records):
    raw = [f"{r['name']}({r['value']}): {r['error']}: {r['message'][:120]}" for r in records
           if r["kind"] == "entry" and r["name"] not in INTERNAL and not r["ours"]
           and not ((r["name"], r["value"]) in VALID and r["error"] is None)]
    assert raw == [], "\n".join(raw)
