"""The graph of a traced pass (``attribute(rm, tracer=tracer).graph``) multiplies each transcoder's encoder once.

Its layout needs, per transcoder layer, the features of the pass's input without edits and their pre-activations
``x W_enc + b_enc`` (what an edited node's row sums to): it ran ``tc.encode(x)`` and then ``affine(x, W_enc, b_enc)``
again — two full ``(pos, d_in) × (d_in, d_sae)`` matmuls for one. It now takes both from one
(``encode_and_pre``), with the same bits. Counted with a dispatch-mode spy on the operators that read the encoder's
storage (a gathered block of encoder columns, which the frozen pass multiplies, is a copy and not counted), and
against one module ``encode`` of the same input.
"""

from __future__ import annotations

import torch
from helpers import attribution_setup, make_clt, random_ids, rm
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from nnsight_lorsa.attribution import attribute
from nnsight_lorsa.attribution.nodes import ATTN_ERROR, MLP_ERROR
from nnsight_lorsa.modules import CrossLayerTranscoder

MATMULS = ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten.matmul", "aten.linear")


class EncoderMatmuls(TorchDispatchMode):
    """Counts the matmuls that read one of ``weights``' storages (an encoder, or a view of it)."""

    def __init__(self, weights: list[torch.Tensor]) -> None:
        super().__init__()
        self.storages = {w.untyped_storage().data_ptr() for w in weights}
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if str(func.overloadpacket) in MATMULS and any(
                isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.storages
                for t in tree_flatten((args, kwargs))[0]):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _graph_build_matmuls(model, bundle, ids: torch.Tensor, encoders: list[torch.Tensor]) -> tuple[int, object]:
    with model.trace(ids) as tracer:
        bundle.replace()
        handle = attribute(bundle, tracer=tracer, batch_size=40)
    with EncoderMatmuls(encoders) as spy:
        graph = handle.graph  # built here, after the trace
    return spy.count, graph


def test_the_traced_graph_multiplies_each_transcoders_encoder_once() -> None:
    model, _, lorsas, tcs = attribution_setup("llama")
    bundle = rm(model, lorsas, tcs)
    ids = random_ids(1, 8, seed=2)[0]
    n, graph = _graph_build_matmuls(model, bundle, ids, [t.W_enc for t in tcs.values()])
    with EncoderMatmuls([t.W_enc for t in tcs.values()]) as once, torch.no_grad():
        for t in tcs.values():
            t.encode(torch.randn(1, ids.numel(), t.cfg.d_in))
    assert once.count == len(tcs)
    assert n == once.count, f"{n} encoder matmuls building the traced graph of {len(tcs)} transcoders (was 2 each)"
    clean = attribute(bundle, ids, batch_size=40)  # the same nodes as the prompt's graph (nothing was edited)
    # the features' activations bit for bit; the error nodes' (their error vectors' norms, since 2026-11-29) from
    # the traced pass's own outputs, within rounding
    errors = (graph.nodes.kind == MLP_ERROR) | (graph.nodes.kind == ATTN_ERROR)  # type: ignore[attr-defined]
    assert torch.equal(graph.nodes.activation[~errors], clean.nodes.activation[~errors])  # type: ignore[attr-defined]
    assert torch.allclose(graph.nodes.activation[errors], clean.nodes.activation[errors], rtol=1e-5)  # type: ignore


def test_the_traced_graph_multiplies_each_clt_layers_encoder_once() -> None:
    model, _, lorsas, _ = attribution_setup("llama")
    clt: CrossLayerTranscoder = make_clt(n_layers=3, seed=1)
    bundle = rm(model, lorsas, clt)
    ids = random_ids(1, 8, seed=2)[0]
    n, _ = _graph_build_matmuls(model, bundle, ids, [clt.W_enc])
    assert n == 3, f"{n} encoder matmuls building the traced graph of a 3-layer CLT (was 6)"
