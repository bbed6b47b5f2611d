"""Review 2026-11-27: circuit discovery (``component_scores`` / ``circuit_size``) ablates MHSA heads straight on
``o_proj``'s input, not through :func:`.interventions.ablate`, so the refusal of an MHSA edit discarded by a Lorsa
without an error term (:meth:`.ReplacementModel.check_editable`) did not reach it: with an MHSA head and a Lorsa
head of the same layer and ``error=False``, every ablation of the MHSA head moved nothing and its score was 0.0,
without a word. It is refused there too; with ``error=True`` or an MHSA head of another layer it runs as before."""

from __future__ import annotations

import pytest
import torch
from helpers import make_lorsa, random_ids, tiny_nnsight

from nnsight_lorsa import LorsaSet, ReplacementModel, get_adapter
from nnsight_lorsa.envoy.targets import LorsaHead, MHSAHead
from nnsight_lorsa.errors import ArgumentError
from nnsight_lorsa.patching.circuit import circuit_size, component_scores
from nnsight_lorsa.patching.tasks import TaskBatch

MODEL, HF = tiny_nnsight("llama")
ADAPTER = get_adapter(MODEL)
LORSA = make_lorsa(HF, ADAPTER, 1)


def task() -> TaskBatch:
    ids = random_ids(batch=2, seed=5)
    return TaskBatch("review", ids, ids.flip(1), torch.tensor([3, 4]), torch.tensor([5, 6]))


def bundle(error: bool) -> ReplacementModel:
    return ReplacementModel(MODEL, lorsas=LorsaSet(MODEL, {1: LORSA}), error=error)


@pytest.mark.parametrize("run", ["scores", "size"])
def test_an_mhsa_component_of_a_lorsa_layer_without_error_term_is_refused(run):
    comps = [MHSAHead(1, 0), LorsaHead(1, 0)]
    with pytest.raises(ArgumentError, match=r"MHSAHead\(layer=1, head=0\).*would be discarded"):
        if run == "scores":
            component_scores(bundle(False), task(), comps)
        else:
            circuit_size(bundle(False), task(), comps, scores=torch.ones(2, 2), ks=[1])


def test_with_the_error_term_or_on_another_layer_the_mhsa_head_scores():
    with torch.no_grad():
        s = component_scores(bundle(True), task(), [MHSAHead(1, 0), LorsaHead(1, 0)])
        assert bool(s[:, 0].ne(0).any())
        s = component_scores(bundle(False), task(), [MHSAHead(2, 0), LorsaHead(1, 0)])
        assert bool(s[:, 0].ne(0).any())
