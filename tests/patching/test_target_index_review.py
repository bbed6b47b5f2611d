"""A Feature's layer given as a numpy integer or a 0-d integer tensor is the Python int (an independent review's
case: the equality and hash checks of ``test_target_index_kinds`` hold for ``np.int64(1)`` unconverted too, since it
equals and hashes as ``1``): the replacement model binds it as it binds the int."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import make_transcoders, tiny_nnsight

from nnsight_lorsa import ReplacementModel, get_adapter
from nnsight_lorsa.patching import Feature


@pytest.mark.parametrize("kind", [np.int64, torch.tensor])
def test_a_feature_layer_of_another_integer_kind_is_the_int(kind):
    target = Feature(kind(1), kind(5), kind="transcoder")
    assert type(target.site) is int and type(target.index) is int
    model, _ = tiny_nnsight("llama")
    rm = ReplacementModel(model, transcoders=make_transcoders(range(get_adapter(model).n_layers)))
    rm.check(target)
    assert rm(target) is not None
