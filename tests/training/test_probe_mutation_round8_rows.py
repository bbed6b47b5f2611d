"""Mutation probe, round 8: ``objective_base.row_norms`` (docs/reliability.md, "Mutation probe, round 8: set loading,
offload and CLT subsets"). Its mutants (the scaling ``fn`` dropped, the squared norm) left the folded coder's function
unchanged — the fold moves any factor between encoder and decoder exactly — and so survived the fold tests; what they
change is the folded decoder's documented unit rows. References: plain torch, and the fold's documented rows."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_training_setup

from nnsight_lorsa.modules.transcoder import Transcoder, TranscoderConfig
from nnsight_lorsa.training import ActivationSource, TrainConfig, Trainer
from nnsight_lorsa.training.objective_base import FOLD_CHUNK, row_chunks, row_norms


@pytest.mark.parametrize(("shape", "dim"), [((2600, 512), -1), ((2600, 512), 1), ((1200, 8, 128), 1)])
def test_row_norms_are_the_norms_of_fn_of_every_row_and_leave_the_source(shape, dim):
    """``row_norms(src, fn, dim) == fn(src).norm(dim=dim)`` over several row chunks (``src`` larger than
    ``FOLD_CHUNK``), ``fn`` applied to a copy: ``src`` unchanged."""
    g = torch.Generator().manual_seed(0)
    src = torch.randn(*shape, generator=g) * torch.rand(shape[0], *[1] * (len(shape) - 1), generator=g).add(0.1)
    assert src.numel() > FOLD_CHUNK and len(row_chunks(src)) > 1
    before = src.clone()
    got = row_norms(src, lambda w: w.div_(3.0), dim=dim)
    want = (src.double() / 3.0).norm(dim=dim)
    assert got.shape == want.shape
    assert float(((got.double() - want).abs() / want).max()) < 1e-5
    assert torch.equal(src, before)


@pytest.fixture(scope="module")
def setup():
    return tiny_training_setup()


@pytest.mark.parametrize(("activation", "params"), [("relu", {}), ("topk", {"k": 8})])
def test_a_folded_decoder_has_the_documented_unit_rows(setup, activation, params):
    """``Trainer.folded()`` of a transcoder: each decoder row at unit norm for ReLU; for the rank-based TopK every row
    divided by one common factor, their mean norm, so the rows' mean norm is 1 (``SparseObjective.fold``). The
    scales are far from 1 on the tiny model's activations, so a norm without ``/ s_out`` misses."""
    model, _, adapter, data = setup
    torch.manual_seed(0)
    cfg = TranscoderConfig(d_in=adapter.d_model, d_sae=128, activation=activation, activation_params=params, layer=1)
    source = ActivationSource.transcoder(model, 1, data, batch_size=8)
    trainer = Trainer(Transcoder(cfg), source, TrainConfig(total_steps=2, lr=1e-2, normalize_decoder=False))
    trainer.train(progress=False)
    assert abs(float(trainer.s_out) - 1) > 0.05, float(trainer.s_out)
    norms = trainer.folded().W_dec.detach().double().norm(dim=1)
    if activation == "relu":
        assert float((norms - 1).abs().max()) < 1e-5
    else:
        assert abs(float(norms.mean()) - 1) < 1e-5 and float(norms.max() / norms.min()) > 1.01
