"""A JumpReLU Lorsa (Llamascopium's ``act_fn: jumprelu``: head ``h`` fires where ``z_pre > θ_h``), read from the
authors' files since 2026-11-29 (refused before): the peer's own file against its own forward is
``tests/formats/test_peer_fixtures_llamascopium.py::test_peer_file[jumprelu]``; here the module, its round trips,
its splice and its attribution graph."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import make_lorsa, random_ids, rm, tiny_nnsight

from nnsight_lorsa import Lorsa, LorsaSet, get_adapter, load, save
from nnsight_lorsa.attribution import attribute
from nnsight_lorsa.attribution.graph import Graph
from nnsight_lorsa.errors import CheckpointError, ConfigMismatchError, UnsupportedArchitectureError
from nnsight_lorsa.training.lorsa_objective import LorsaObjective

LAYER = 1


def jumprelu_lorsa(hf, adapter, seed: int = 0) -> Lorsa:
    """The helpers' Lorsa as a JumpReLU one: every head may fire (top-all), thresholds at the median of
    the heads' positive pre-activations on random input, so that they cut."""
    topk = make_lorsa(hf, adapter, LAYER, seed=seed)
    cfg = dataclasses.replace(topk.cfg, activation="jumprelu", top_k=topk.cfg.n_ov_heads)
    lorsa = Lorsa(cfg)
    lorsa.load_state_dict({**topk.state_dict(), "threshold": torch.zeros(cfg.n_ov_heads)})
    with torch.no_grad():
        z_pre = lorsa.compute_z_pre(torch.randn(2, 6, cfg.d_model, generator=torch.Generator().manual_seed(seed)))
        lorsa.threshold.copy_(z_pre.clamp_min(0).flatten(0, 1).median(0).values.clamp_min(1e-3))
    return lorsa


@pytest.fixture(scope="module")
def llama():
    model, hf = tiny_nnsight("llama")
    return model, hf, get_adapter(model)


def test_the_activation_gates_each_head_by_its_threshold(llama):
    _, hf, adapter = llama
    lorsa = jumprelu_lorsa(hf, adapter)
    z_pre = torch.randn(3, 5, lorsa.cfg.n_ov_heads)
    z, _ = lorsa.activation(z_pre)
    want = z_pre * (z_pre > lorsa.threshold)
    assert torch.equal(z, want) and 0 < int((z != 0).sum()) < int((z_pre > 0).sum())


@pytest.mark.parametrize("fmt", [None, "llamascopium"])
def test_a_jumprelu_lorsa_round_trips(llama, tmp_path, fmt):
    _, hf, adapter = llama
    lorsa = jumprelu_lorsa(hf, adapter, seed=1)
    back = load(save(lorsa, tmp_path / "l", **({"format": fmt} if fmt else {})))
    assert back.cfg.activation == "jumprelu" and back.cfg.top_k == lorsa.cfg.n_ov_heads
    x = torch.randn(2, 7, lorsa.cfg.d_model)
    with torch.no_grad():
        a, b = lorsa(x), back(x)
    assert float((a - b).abs().max() / a.abs().max()) < 1e-6


def test_their_writer_refuses_what_their_jumprelu_cannot_express(llama, tmp_path):
    _, hf, adapter = llama
    lorsa = jumprelu_lorsa(hf, adapter)
    lorsa.cfg.top_k = 8
    with pytest.raises(UnsupportedArchitectureError, match="top_k=8"):
        save(lorsa, tmp_path / "a", format="llamascopium")
    lorsa.cfg.top_k = lorsa.cfg.n_ov_heads
    with torch.no_grad():
        lorsa.threshold[0] = 0.0
    with pytest.raises(UnsupportedArchitectureError, match="threshold"):
        save(lorsa, tmp_path / "b", format="llamascopium")


def test_config_and_trainer_name_what_they_refuse(llama):
    _, hf, adapter = llama
    with pytest.raises(CheckpointError, match="activation"):
        dataclasses.replace(make_lorsa(hf, adapter).cfg, activation="batchtopk")
    with pytest.raises(ConfigMismatchError, match="jumprelu"):
        LorsaObjective(jumprelu_lorsa(hf, adapter))


def test_a_jumprelu_lorsa_splices_and_attributes_exactly(llama):
    model, hf, adapter = llama
    lorsa = jumprelu_lorsa(hf, adapter, seed=2)
    lorsas = LorsaSet(model, {LAYER: lorsa})
    ids = random_ids(1, 8, seed=3)[0]
    with torch.no_grad(), model.trace(ids[None]):
        z = lorsas.replace(LAYER, error=True).hook_z.output.save()
    g = attribute(rm(model, lorsas, None), ids, batch_size=32)
    assert g.edge_sum_error("mass").max() < 1e-5
    heads = g.ids_of(Graph.LORSA)
    got = torch.zeros_like(z[0])
    got[g.nodes.pos[heads], g.nodes.index[heads]] = g.nodes.activation[heads].to(got.dtype)
    assert int((z != 0).sum()) > 0 and torch.allclose(got, z[0], rtol=1e-5, atol=1e-6)
