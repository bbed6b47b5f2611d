"""Mutation probe, round 3 (docs/reliability.md): what ``to_neuronpedia`` writes besides the nodes and links that
the earlier tests let a one-line change through — ``qk_tracing``'s pair nodes, ``qParams`` and the prompt of a graph
built from token ids — against the documented values (``attribution/export.py``'s docstrings)."""

from __future__ import annotations

import torch

from nnsight_lorsa.attribution import prune, to_neuronpedia
from nnsight_lorsa.attribution.graph import EMBEDDING, LOGIT, LORSA, MLP_ERROR, Graph, NodeTable


def _graph(prompt: str = "") -> Graph:
    """One layer, two positions: a Lorsa head, the MLP errors, the embeddings and one logit, every edge causal."""
    rows = [(LORSA, 0, 1, 0), (MLP_ERROR, 0, 0, -1), (MLP_ERROR, 0, 1, -1), (EMBEDDING, -1, 0, 3),
            (EMBEDDING, -1, 1, 4), (LOGIT, 1, 1, 7)]
    kind, layer, pos, index = (torch.tensor(c) for c in zip(*rows, strict=True))
    n = len(rows)
    A = torch.zeros(n, n)
    A[0, 3], A[0, 4], A[5, 0], A[5, 1], A[5, 2], A[5, 4] = 0.5, 1.0, 2.0, 0.3, -0.4, 0.7
    values = torch.full((n,), float("nan"))
    values[0], values[5] = A[0].sum(), A[5].sum()
    nodes = NodeTable(kind, layer, pos, index, torch.tensor([1.5, 0.2, 0.3, 0, 0, 0]), [],
                      torch.zeros(n, dtype=torch.bool))
    return Graph(tokens=torch.tensor([3, 4]), nodes=nodes, adjacency=A, values=values,
                 logit_probs=torch.tensor([0.9]), feature_rows=(kind == LORSA) | (kind == LOGIT),
                 layout_ids=torch.arange(n), prompt=prompt, meta={"model_type": "hand"})


def test_qk_pairs_name_the_bias_term_and_outside_nodes_and_drop_zero_terms():
    """``pair_index`` ``n_nodes`` is the ``b_Q`` / ``b_K`` term (``"bias"``), ``-1`` a node outside the graph
    (``None``), a pair of value 0 is left out (mutants: the bias at ``n_nodes - 1``; zero pairs kept)."""
    g = _graph()
    n = g.n_nodes
    g.qk = {"probe": torch.tensor([[0, 0, 0, 1, 0]]), "score": torch.tensor([1.25]),
            "pair_sum_error": torch.tensor([0.0]),
            "pair_index": torch.tensor([[[3, n], [n, 4], [-1, 3], [4, 3], [n - 1, 3]]]),
            "pair_value": torch.tensor([[0.5, -0.25, 0.125, 0.0, 0.375]])}
    d = to_neuronpedia(g, prune(g, 1.0, 1.0), slug="qk")
    ids = [x["node_id"] for x in to_neuronpedia(g, prune(g, 1.0, 1.0), slug="x")["nodes"]]
    assert ids[-1] == "2_7_1"  # the logit, node n - 1 (kept: every node is kept at thresholds 1.0)
    (e,) = d["qk_tracing"]
    assert (e["node_id"], e["layer"], e["qk_head"], e["query_pos"], e["key_pos"]) == ("A0_0_1", 0, 0, 1, 0)
    assert e["pairs"] == [{"query": "E_3_0", "key": "bias", "value": 0.5},
                          {"query": "bias", "key": "E_4_1", "value": -0.25},
                          {"query": None, "key": "E_3_0", "value": 0.125},
                          {"query": "2_7_1", "key": "E_3_0", "value": 0.375}]


def test_qparams_and_the_prompt_of_a_graph_of_token_ids():
    """``sparsity_threshold`` is ``qParams.sparsityThreshold``; a graph without a prompt (built from ids) gets
    ``tokenizer.decode(tokens)`` as ``metadata.prompt``, one with a prompt keeps it."""

    class Tok:
        def __len__(self) -> int:
            return 10

        def decode(self, ids: list[int]) -> str:
            return "".join(f"<{i}>" for i in ids)

    d = to_neuronpedia(_graph(), slug="s", tokenizer=Tok(), sparsity_threshold=0.25)
    assert d["qParams"]["sparsityThreshold"] == 0.25
    assert d["metadata"]["prompt"] == "<3><4>" and d["metadata"]["prompt_tokens"] == ["<3>", "<4>"]
    assert to_neuronpedia(_graph("hi"), slug="s", tokenizer=Tok())["metadata"]["prompt"] == "hi"
    assert to_neuronpedia(_graph(), slug="s")["metadata"]["prompt"] == ""
