"""``Trainer.folded()`` of a sparse coder acts on raw activations as the trained module acts on normalised ones,
``f_raw(x) = f(x · s_in) / s_out``, for every activation and ``normalize_decoder`` setting.

The fold renormalised each decoder row to unit norm, moving the row's norm into its encoder column: exact for
ReLU / JumpReLU, but a rank-based activation (TopK, AbsTopK, GroupMax) then ranks ``pre_i · ‖W_dec_i‖`` instead of
``pre_i``. Trained with ``normalize_decoder=False`` (rows of different norms) the folded TopK transcoder picked
other features: relative error 0.48 against the trained module — what ``evaluate`` measured and ``save`` wrote.
Reference, written here: the trained module on ``x · s_in``, divided by ``s_out``.
"""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_training_setup

from nnsight_lorsa.modules.transcoder import SkipTranscoder, Transcoder, TranscoderConfig
from nnsight_lorsa.training import ActivationSource, TrainConfig, Trainer

LAYER = 1


@pytest.fixture(scope="module")
def setup():
    return tiny_training_setup()


@pytest.mark.parametrize(("activation", "params"), [("topk", {"k": 8}), ("abstopk", {"k": 8}),
                                                     ("groupmax", {"k": 8}), ("relu", {}), ("jumprelu", {})])
@pytest.mark.parametrize("normalize", [False, None])
def test_the_folded_coder_is_the_trained_one_on_raw_activations(setup, activation, params, normalize):
    model, _, adapter, data = setup
    torch.manual_seed(0)
    cfg = TranscoderConfig(d_in=adapter.d_model, d_sae=128, activation=activation, activation_params=params,
                           layer=LAYER)
    coder = (SkipTranscoder if activation == "topk" else Transcoder)(cfg)
    source = ActivationSource.transcoder(model, LAYER, data, batch_size=8)
    trainer = Trainer(coder, source, TrainConfig(total_steps=3, lr=1e-2, normalize_decoder=normalize))
    trainer.train(progress=False)
    norms = trainer.module.W_dec.detach().norm(dim=1)
    if normalize is False and activation != "jumprelu":
        assert float(norms.max() / norms.min()) > 1.05  # the rows' norms differ: the case that matters
    batch = source(0)
    with torch.no_grad():
        want = trainer.module.eval()(batch.x * trainer.s_in) / trainer.s_out
        got = trainer.folded()(batch.x)
    err = float((got - want).abs().max() / want.abs().max())
    assert err < 1e-5, (activation, normalize, err)  # TopK with normalize_decoder=False: was 0.48
