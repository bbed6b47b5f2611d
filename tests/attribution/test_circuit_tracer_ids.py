"""Our graph export and circuit-tracer's give the same node ids for the same model, transcoders and
prompt. The reference is circuit-tracer 0.5.0's own JSON (``attribute`` + ``create_graph_files``,
TransformerLens backend) for a tiny GPT-2 + per-layer transcoders, committed with the model and
transcoders under ``tests/fixtures/peers/circuit_tracer/graph/`` by ``scripts/peer_fixtures/circuit_tracer.py``.
We build the same graph from those files (Hugging Face + nnsight) and compare. No circuit-tracer here."""

from __future__ import annotations

import json
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch

from nnsight_lorsa import ReplacementModel, TranscoderSet
from nnsight_lorsa.attribution import LogitTargets, attribute, prune, to_neuronpedia

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "peers" / "circuit_tracer" / "graph"
FIELDS = ("node_id", "layer", "feature", "ctx_idx", "feature_type", "jsNodeId")


@pytest.fixture(scope="module")
def both():
    from nnsight import LanguageModel

    p = json.loads((FIX / "prompt.json").read_text())
    s = p["settings"]
    model = LanguageModel(str(FIX / "model"), dispatch=True)
    ids = torch.tensor(p["token_ids"])
    with torch.no_grad():  # the model circuit-tracer ran (through TransformerLens) is the one we load
        logits = model._module(ids[None]).logits[0, -1]
    assert torch.allclose(logits, torch.tensor(p["logits_last"]), rtol=1e-4, atol=1e-5)
    rm = ReplacementModel(model, transcoders=TranscoderSet.from_pretrained(model, FIX / "transcoders"))
    g = attribute(rm, ids, targets=LogitTargets(max_n=s["max_n_logits"], cumulative_prob=s["desired_logit_prob"]),
                  batch_size=s["batch_size"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = to_neuronpedia(g, prune(g, s["node_threshold"], s["edge_threshold"]), slug="tiny-gpt2-graph",
                              scan="tiny-gpt2", tokenizer=model.tokenizer, node_threshold=s["node_threshold"])
    theirs = json.loads((FIX / "circuit_tracer_graph.json").read_text())
    return ours, theirs, caught


def _key(n: dict) -> tuple:
    return tuple(n[f] for f in FIELDS)


def test_same_ids_as_circuit_tracer(both) -> None:
    ours, theirs, _ = both
    # circuit-tracer drops features at position 0 (its zero_positions=slice(0, 1)); we keep them, so
    # the comparison covers positions >= 1 plus every embedding and logit node
    def comparable(nodes):
        return Counter(_key(n) for n in nodes if n["feature_type"] != "bias"
                       and (n["ctx_idx"] > 0 or n["feature_type"] in ("embedding", "logit")))
    mine, ref = comparable(ours["nodes"]), comparable(theirs["nodes"])
    assert sum(ref.values()) > 100 and {k[4] for k in ref} == {"cross layer transcoder", "mlp reconstruction error",
                                                               "embedding", "logit"}
    assert mine == ref, (sorted(set(mine) - set(ref))[:10], sorted(set(ref) - set(mine))[:10])
    # the only nodes circuit-tracer has no counterpart for: our bias nodes (documented extension)
    ref_ids = {n["node_id"] for n in theirs["nodes"]}
    extra = {n["feature_type"] for n in ours["nodes"] if n["node_id"] not in ref_ids and n["ctx_idx"] > 0}
    assert extra <= {"bias"}, extra


def test_same_values_and_metadata(both) -> None:
    ours, theirs, _ = both
    ref = {_key(n): n for n in theirs["nodes"]}
    common = [n for n in ours["nodes"] if _key(n) in ref and n["feature_type"] == "cross layer transcoder"]
    assert common
    for n in common:  # same feature activations: the same model and transcoders
        assert n["activation"] == pytest.approx(ref[_key(n)]["activation"], rel=1e-4, abs=1e-6)
    logits = {n["node_id"]: n for n in theirs["nodes"] if n["feature_type"] == "logit"}
    for n in ours["nodes"]:
        if n["feature_type"] == "logit":
            t = logits[n["node_id"]]
            assert n["token_prob"] == pytest.approx(t["token_prob"], rel=1e-4)
            assert n["is_target_logit"] == t["is_target_logit"] and n["clerp"] == t["clerp"]
    # a graph built from token ids: prompt text and tokens filled from the tokenizer, as circuit-tracer
    for k in ("prompt", "prompt_tokens", "slug", "scan", "node_threshold", "schema_version"):
        assert ours["metadata"][k] == theirs["metadata"][k], k
    assert ours["metadata"]["prompt"].startswith("<bos> the cat")


def test_shared_error_ids_warned(both) -> None:
    """circuit-tracer's MLP-error id ``0_{L}_{p}`` equals a layer-0 feature's ``0_{f}_{p}`` when f == L:
    both tools write such pairs (so do we, following its scheme); we warn, naming them."""
    ours, theirs, caught = both
    dup_theirs = sorted(k for k, c in Counter(n["node_id"] for n in theirs["nodes"]).items() if c > 1)
    dup_ours = sorted(k for k, c in Counter(n["node_id"] for n in ours["nodes"]).items() if c > 1)
    assert dup_theirs and set(dup_theirs) <= set(dup_ours)
    assert any(str(dup_ours[0]) in str(w.message) for w in caught)
