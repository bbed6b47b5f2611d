"""An edit of an MHSA head whose layer's attention a Lorsa replaces in the same trace without an error term is
refused (:meth:`.ReplacementModel.check_editable`, :func:`.splice_chain.refuse_discarded_edit`): the Lorsa computes
the attention output from its input alone, so the edit moved the logits by exactly 0.0, without a word (found by the
internals probe, docs/reliability.md). With ``error=True`` the edit reaches the model through the error term; on
another layer, in an invoke the Lorsa does not replace, or read rather than edited, nothing changes."""

from __future__ import annotations

import pytest
import torch
from helpers import make_lorsa, random_ids, tiny_nnsight
from hypothesis import given, settings
from hypothesis import strategies as st

from nnsight_lorsa import LorsaSet, ReplacementModel, get_adapter
from nnsight_lorsa.envoy.targets import LorsaHead, MHSAHead
from nnsight_lorsa.errors import ArgumentError
from nnsight_lorsa.patching import ablate, patch, read, scale, steer

MODEL, HF = tiny_nnsight("llama")
ADAPTER = get_adapter(MODEL)
LORSA = make_lorsa(HF, ADAPTER, 1)
N_HEADS = ADAPTER.n_heads


def bundle(error: bool) -> ReplacementModel:
    return ReplacementModel(MODEL, lorsas=LorsaSet(MODEL, {1: LORSA}), error=error)


def edit(r: ReplacementModel, kind: str, head: int, layer: int = 1) -> None:
    target = r(MHSAHead(layer, head))
    if kind == "ablate":
        ablate(target)
    elif kind == "scale":
        scale(target, -2.0)
    elif kind == "steer":
        steer(target, torch.ones(ADAPTER.head_dim))
    else:
        patch(target, torch.zeros(1, 1, ADAPTER.head_dim))


def logits(r: ReplacementModel, ids: torch.Tensor, kind: str | None, head: int = 0, layer: int = 1) -> torch.Tensor:
    with torch.no_grad(), MODEL.trace(ids):
        r.prepare([LorsaHead(1, 0)])  # the Lorsa on layer 1, spliced first
        if kind is not None:
            edit(r, kind, head, layer)
        out = MODEL.lm_head.output.save()
    return out


KINDS = ["ablate", "scale", "steer", "patch"]


@settings(max_examples=12, deadline=None)
@given(kind=st.sampled_from(KINDS), head=st.integers(0, N_HEADS - 1), seed=st.integers(0, 2**16))
def test_an_mhsa_edit_under_a_lorsa_without_error_term_is_refused(kind, head, seed):
    """``error=False``: every edit kind of a drawn head of the replaced layer raises ``ArgumentError`` naming the head
    and the Lorsa's site, and the model is left as it was (a later plain trace gives the plain logits)."""
    ids = random_ids(seed=seed)
    plain = HF(ids).logits
    with pytest.raises(ArgumentError, match=rf"MHSAHead\(layer=1, head={head}\).*would be discarded.*self_attn"):
        logits(bundle(False), ids, kind, head)
    with torch.no_grad(), MODEL.trace(ids):
        again = MODEL.lm_head.output.save()
    assert torch.equal(again, plain)


@settings(max_examples=6, deadline=None)
@given(kind=st.sampled_from(KINDS), head=st.integers(0, N_HEADS - 1), seed=st.integers(0, 2**16))
def test_the_same_edit_reaches_the_model_with_the_error_term(kind, head, seed):
    """``error=True``: the edit is taken and moves the logits (the error term carries it)."""
    ids = random_ids(seed=seed)
    r = bundle(True)
    assert (logits(r, ids, kind, head) - logits(r, ids, None)).abs().max() > 1e-4


def test_other_layers_other_invokes_and_reads_are_left_alone():
    """An MHSA head of a layer the Lorsa does not replace, one in an invoke the Lorsa does not replace, and a read of
    a head of the replaced layer are all taken as before."""
    ids = random_ids(batch=2)
    r = bundle(False)
    assert (logits(r, ids, "ablate", 0, layer=2) - logits(r, ids, None)).abs().max() > 1e-4
    with torch.no_grad(), MODEL.trace() as tracer:
        with tracer.invoke(ids[:1]):
            r.prepare([LorsaHead(1, 0)])
        with tracer.invoke(ids[1:]):
            ablate(r(MHSAHead(1, 0)))
            z = read(r(MHSAHead(1, 0)))
    assert bool((z == 0).all())
    with torch.no_grad(), MODEL.trace(ids):
        r.prepare([LorsaHead(1, 0)])
        z = read(r(MHSAHead(1, 0)))
    assert z.shape[-1] == ADAPTER.head_dim and bool(z.ne(0).any())
