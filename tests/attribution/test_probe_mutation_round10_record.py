"""Mutation probe, round 10 (``attribution/intervened_record.py``, the server's side of a remote intervened pass):
each test here was seen failing with a hand-made mutant and passing without (docs/reliability.md, "Mutation probe,
round 10: architecture adapters, SAELens releases and small helpers"). The reference is the round trip through the
client's ``decode``."""

from __future__ import annotations

from nnsight_lorsa.attribution.intervened_record import encode
from nnsight_lorsa.attribution.options import AttributionOptions
from nnsight_lorsa.attribution.remote_handles import decode


def test_options_with_a_memory_pair_come_back_as_they_were_sent():
    """``memory`` as a ``(patterns, node_vectors)`` pair is a tuple: the record keeps it a tuple (a list would not be
    a pair to ``memory_modes`` on the client), and tuples nested in lists and dicts likewise."""
    options = AttributionOptions(memory=("sdpa", "grid"), batch_size=8)
    back = decode(encode(options))
    assert back == options and back.modes == ("sdpa", "grid") and type(back.memory) is tuple
    nested = {"a": [(1, 2), options], "b": (3, [4, (5,)])}
    assert decode(encode(nested)) == nested
