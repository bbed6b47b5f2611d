"""A target's layer / head / index given as a numpy integer or a 0-d integer tensor (``z.argmax()``) is that int:
equal to, and hashing as, the target of the Python int, and editing the same values (until 2026-11-30 refused as
"index tensor(7) is out of range [0, 1024)"; a researcher's probe of the tenth session). A float or a bool stays
refused by the checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import make_lorsa, random_ids, tiny_nnsight

from nnsight_lorsa import ReplacementModel, get_adapter
from nnsight_lorsa.envoy.targets import TargetIndexError
from nnsight_lorsa.patching import Feature, LorsaHead, MHSAHead, ablate


@pytest.mark.parametrize("kind", [np.int64, np.int32, torch.tensor])
def test_integer_kinds_are_the_int(kind):
    assert LorsaHead(kind(2), kind(7)) == LorsaHead(2, 7)
    assert hash(MHSAHead(kind(1), kind(3))) == hash(MHSAHead(1, 3))
    assert Feature(kind(1), kind(5), kind="transcoder") == Feature(1, 5, kind="transcoder")
    assert type(LorsaHead(2, kind(7)).head) is int


def test_an_argmax_head_edits_what_the_int_head_edits():
    model, hf = tiny_nnsight("llama")
    rm = ReplacementModel(model, lorsas={1: make_lorsa(hf, get_adapter(model), layer=1)})
    ids = random_ids(1, 8, seed=2)
    with torch.no_grad(), model.trace(ids):
        z = rm.lorsas.replace(1, error=True).hook_z.output.save()
    best = z[0, -1].argmax()  # a 0-d tensor
    outs = []
    for head in (best, int(best)):
        with torch.no_grad(), model.trace(ids):
            rm.prepare([LorsaHead(1, head)])
            ablate(rm(LorsaHead(1, head)), positions=-1)
            outs.append(model.lm_head.output.save())
    assert torch.equal(outs[0], outs[1])
    with pytest.raises(TargetIndexError):
        rm(LorsaHead(1, 7.0))


def test_a_bool_tensor_is_no_index():
    """``torch.tensor(True)`` went through ``operator.index`` as 1 (the mutation review): refused as a bool."""
    model, hf = tiny_nnsight("llama")
    rm = ReplacementModel(model)
    with pytest.raises(TargetIndexError):
        rm(MHSAHead(0, torch.tensor(True)))
