"""The one-layer copies of a cross-layer transcoder's stacks (``layout.coder_layer_parts``): the ``parts`` of the
``resident`` blocks of its encoder (clean pass, :func:`.layout.build_layout`: ``W_enc[layer]`` / ``b_enc[layer]``) and
of its MLP site (frozen pass, :meth:`.replacement.FrozenReplacement.mlp`: ``W_skip[layer]``). Until 2026-11-27 two
functions made them, each with its own stack test (``offload.coder_site_parts``, ``layout.coder_encoder_parts``); their
logic is kept here as the reference the one function and both call sites must give, for every module kind."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from helpers import attribution_setup, random_ids, rm

import nnsight_lorsa._placement as placement
from nnsight_lorsa import ReplacementModel
from nnsight_lorsa.attribution import attribute
from nnsight_lorsa.attribution.layout import ENCODER_PARTS, SITE_PARTS, coder_layer_parts
from nnsight_lorsa.modules import TranscoderConfig
from nnsight_lorsa.modules.clt import CLTConfig, CrossLayerTranscoder
from nnsight_lorsa.modules.sae import SAEConfig, SparseAutoencoder
from nnsight_lorsa.modules.transcoder import SkipTranscoder, Transcoder


def former_site_parts(tc: Any) -> dict[str, int]:
    """``offload.coder_site_parts`` as it was (HEAD e0614c5)."""
    owner = tc.weights_owner
    skip = getattr(owner, "W_skip", None)
    return {"W_skip": tc.layer} if owner is not tc and isinstance(skip, torch.Tensor) and skip.dim() == 3 else {}


def former_encoder_parts(tc: Any) -> dict[str, int]:
    """``layout.coder_encoder_parts`` as it was (HEAD e0614c5)."""
    owner = tc.weights_owner
    if owner is tc or not isinstance(getattr(owner, "W_enc", None), torch.Tensor) or owner.W_enc.dim() != 3:
        return {}
    return {"W_enc": tc.layer, "b_enc": tc.layer}


def _clt(skip: bool, n_layers: int = 3) -> CrossLayerTranscoder:
    return CrossLayerTranscoder(CLTConfig(d_in=8, d_sae=12, n_layers=n_layers, activation="topk",
                                          activation_params={"k": 2}, skip=skip))


def _coder(kind: str) -> dict[int, Any]:
    cfg: dict[str, Any] = {"d_in": 8, "d_sae": 12, "activation": "topk", "activation_params": {"k": 2}}
    if kind == "transcoder":
        return {1: Transcoder(TranscoderConfig(**cfg, layer=1))}
    if kind == "skip_transcoder":
        return {1: SkipTranscoder(TranscoderConfig(**cfg, layer=1))}
    if kind == "sae":
        return {1: SparseAutoencoder(SAEConfig(**cfg))}
    return _clt(skip=kind == "clt_skip").by_layer()


@pytest.mark.parametrize("kind", ["transcoder", "skip_transcoder", "sae", "clt", "clt_skip"])
def test_coder_layer_parts_are_the_former_functions(kind):
    """Every module kind (and every layer of a CLT): the site's and the encoder's parts are the former functions'."""
    for tc in _coder(kind).values():
        site, encoder = coder_layer_parts(tc, SITE_PARTS), coder_layer_parts(tc, ENCODER_PARTS)
        assert site == former_site_parts(tc), (kind, site)
        assert encoder == former_encoder_parts(tc), (kind, encoder)
        # written out, so that the reference itself cannot drift: a CLT layer copies its own layer's slices
        if kind.startswith("clt"):
            assert encoder == {"W_enc": tc.layer, "b_enc": tc.layer}
            assert site == ({"W_skip": tc.layer} if kind == "clt_skip" else {})
        else:
            assert site == encoder == {}


def _bundle(kind: str) -> ReplacementModel:
    model, _, lorsas, tcs = attribution_setup("llama")  # transcoders: layer 0 plain, layer 2 a skip transcoder
    if kind == "transcoders":
        return ReplacementModel(model, lorsas=lorsas, transcoders=tcs, offload=True)
    # the parts do not depend on the weights' values: the CLT as initialised
    bundle = rm(model, lorsas, CrossLayerTranscoder(CLTConfig(d_in=64, d_sae=96, n_layers=3, activation="topk",
                                                              activation_params={"k": 5}, skip=kind == "clt_skip")))
    return ReplacementModel(bundle.model, **dict(bundle.sets()), offload=True)


@pytest.mark.parametrize("kind", ["transcoders", "clt", "clt_skip"])
def test_both_call_sites_pass_the_former_parts(kind, monkeypatch):
    """One offloaded attribution, every ``resident`` block of a transcoder spied on: the clean pass's encoder blocks
    (``layout.py``) pass the former ``coder_encoder_parts`` of their layer, the frozen pass's MLP sites
    (``replacement.py``) the former ``coder_site_parts`` — one layer each of a CLT, nothing for a per-layer one."""
    rep = _bundle(kind)
    tcs = [v for m in rep.transcoders.values()
           for v in (m.by_layer().values() if isinstance(m, CrossLayerTranscoder) else [m])]
    lorsas = {id(m) for m in rep.lorsas.values()}
    seen: dict[str, set[tuple[tuple[str, int], ...]]] = {"layout.py": set(), "replacement.py": set()}
    init = placement.resident.__init__

    def spying_init(res, module, device, leave=(), parts=None):
        caller = sys._getframe(1).f_code.co_filename.rsplit("/", 1)[-1]
        if id(module) not in lorsas and caller in seen:
            seen[caller].add(tuple(sorted((parts or {}).items())))
        init(res, module, device, leave, parts)

    monkeypatch.setattr(placement.resident, "__init__", spying_init)
    attribute(rep, random_ids(1, 8, seed=7)[0], batch_size=8)
    expected = {"layout.py": {tuple(sorted(former_encoder_parts(tc).items())) for tc in tcs},
                "replacement.py": {tuple(sorted(former_site_parts(tc).items())) for tc in tcs}}
    assert seen == expected, (seen, expected)
    if kind != "transcoders":  # every CLT layer's encoder ran, each with its own slices
        assert len(seen["layout.py"]) == len(tcs) == 3
