"""The attribution option probe (docs/reliability.md, "Attribution option probe (2026-11-27)"): a seeded random
sweep over families × replacement kinds (Lorsa, transcoders of every activation, skip transcoders, a cross-layer
transcoder) × model dtypes × prompt lengths 1–24 × settings, each case checked numerically against the unmodified
model: (i) every computed row's edges + residual = its value within the graph dtype's bound; (ii) batch size, memory
mode, ``max_memory``, offloaded modules (a real copy per fetch), the cache engine and QK tracing leave the graph
unchanged; (iii) a budgeted graph's rows are the full graph's rows, a pruned graph's kept edges the full graph's;
(iv) node values / activations / logit probabilities are a plain ``model.trace``'s with the replacements spliced
(``error=True``); (v) the hook reference engine agrees. And what the probe found: duplicated logit targets."""

from __future__ import annotations

import pytest
import torch
from helpers import attribution_setup, random_ids, rm
from hypothesis import given, settings
from hypothesis import strategies as st

from nnsight_lorsa.attribution import attribute
from nnsight_lorsa.attribution.logit_targets import check_targets
from nnsight_lorsa.attribution.options import AttributionOptions
from nnsight_lorsa.errors import ConfigMismatchError


@pytest.fixture(scope="module")
def llama():
    model, _, lorsas, tcs = attribution_setup("llama")
    return rm(model, lorsas, tcs), random_ids(1, 6, seed=3)[0]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 127), min_size=1, max_size=6), st.data())
def test_a_repeated_logit_target_is_refused(ids, data):
    """A token named twice was two logit nodes of one token: the pruning's influence weighted it twice (45 kept
    nodes instead of 42 on the tiny Llama) and the Neuronpedia export held two nodes of one ``node_id``. Refused
    now, ids and strings alike (ConfigMismatchError naming the token), before anything runs."""
    dup = data.draw(st.sampled_from(ids))
    at = data.draw(st.integers(0, len(ids)))
    targets = [*ids[:at], dup, *ids[at:]]
    with pytest.raises(ConfigMismatchError, match="twice"):
        check_targets(targets)
    with pytest.raises(ConfigMismatchError, match="twice"):
        AttributionOptions(targets=torch.tensor(targets))
    with pytest.raises(ConfigMismatchError, match="twice"):
        check_targets([f"w{t}" for t in targets])
    distinct = list(dict.fromkeys(ids))
    assert check_targets(distinct) == tuple(distinct)


def test_two_strings_of_one_token_are_refused(llama):
    """Two different strings the tokenizer maps to one token (the tiny tokenizer's unknown words are all ``<eos>``)
    are refused when the strings are resolved, before the frozen pass."""
    r, ids = llama
    with pytest.raises(ConfigMismatchError, match="twice"):
        attribute(r, ids, targets=["w3", "qqq", "zzz"])
    with pytest.raises(ConfigMismatchError, match="twice"):
        attribute(r, ids, targets=[3, 3])
    g = attribute(r, ids, targets=["w3", "qqq"], batch_size=64)
    assert g.nodes.index[g.logit_ids].tolist() == [3, 1]
