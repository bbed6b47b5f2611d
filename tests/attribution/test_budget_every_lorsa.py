"""The device estimate of a frozen pass without a frozen MHSA layer (issue 21, goal 4(d)):
``PER_COPY_NUMBERS_GPU_SDPA`` is fitted with frozen MHSA layers attending through SDPA; a Lorsa layer's frozen pass
calls no SDPA (its ``z_pre`` through recomputed pattern rows keeps nothing per prompt copy, ``frozen.z_pre``), so with
a Lorsa on every attention the GPU path counts the frozen pass from the structure, as the CPU's SDPA path does (the
H200's offloaded all-layer runs peaked at 0.72–0.89× the fitted estimate, at 0.98–0.99× the structural count plus
the kept rows: docs/attribution.md, "Offloaded replacement modules"). With any frozen MHSA layer left, the fitted
path is unchanged."""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import make_lorsa, make_transcoders, random_ids, rm, tiny_nnsight

import nnsight_lorsa.attribution.frozen as frozen
from nnsight_lorsa import get_adapter
from nnsight_lorsa.attribution.budget import (
    PER_COPY_NUMBERS_GPU_SDPA,
    ROW_BUFFERS,
    estimate_layout,
    frozen_model_bytes,
    layout_for_estimate,
)
from nnsight_lorsa.attribution.frozen import node_chunk_elements
from nnsight_lorsa.attribution.options import AttributionOptions

IDS = random_ids(1, 12, seed=4)[0]
N_LAYERS = 3


def _setup(layers):
    model, hf = tiny_nnsight("llama", attn="sdpa")
    adapter = get_adapter(model)
    assert adapter.n_layers == N_LAYERS
    lorsas = {layer: make_lorsa(hf, adapter, layer, seed=layer) for layer in layers}
    return rm(model, lorsas, make_transcoders(range(N_LAYERS))), hf


@pytest.mark.parametrize("layers", [c for n in range(N_LAYERS + 1) for c in itertools.combinations(range(N_LAYERS), n)])
@pytest.mark.parametrize("batch", [1, 4])
def test_the_gpu_path_counts_a_frozen_pass_without_sdpa_from_the_structure(layers, batch, monkeypatch):
    """Every subset of the tiny Llama's layers with a Lorsa (SDPA attention, ``memory="lean"``): where every layer has
    one, the "cuda" estimate's per-copy bytes are the CPU's structural count and its shared bytes the CPU's but for
    the gathered sites' chunk temporaries (sized by the device's chunk) — the model's own parts (logits, MLP, norms)
    counted, as nothing fitted holds them; otherwise the per-copy bytes are the fitted coefficient's and the shared
    bytes leave the model's own parts out, as before. Both estimates count the recomputed Lorsa rows' head product
    (a GPU's ``z_pre``, ``frozen.HEAD_PRODUCT``; its steps and index vectors differ from the CPU's gather)."""
    monkeypatch.setitem(frozen.HEAD_PRODUCT, "cpu", True)
    replacement, hf = _setup(layers)
    layout, info = layout_for_estimate(replacement, IDS, AttributionOptions(batch_size=batch, memory="lean"))
    assert info["store_patterns"] is False and set(info["mhsa_heads"]) == set(range(N_LAYERS)) - set(layers)
    est = {device: estimate_layout(layout, batch_size=batch, **{**info, "device": device})
           for device in ("cpu", "cuda")}
    cpu, gpu = est["cpu"].terms, est["cuda"].terms
    L, d, P, b = N_LAYERS, hf.config.hidden_size, len(IDS), info["model_itemsize"]
    rows_part = ROW_BUFFERS * cpu["n_sources"] * info["edge_itemsize"] + info["mask_entry_bytes"] * P * P
    # a gathered site's chunks: its (positions, width, d) grid and (positions, batch, d) product, fp32, to the budget
    widest = max(max(batch, int(torch.bincount(p).max())) for lay in layout.layers
                 for p in (lay.lorsa_pos, lay.tc_pos) if p.numel())
    chunks = {dev: 2 * 4 * min(node_chunk_elements(torch.device(dev)), widest * P * d) for dev in ("cpu", "cuda")}
    assert cpu["gather_chunks"] == chunks["cpu"] and gpu["gather_chunks"] == chunks["cuda"]
    if len(layers) == N_LAYERS:
        assert gpu["frozen_per_copy"] == cpu["frozen_per_copy"]
        assert gpu["frozen_shared"] - gpu["gather_chunks"] == cpu["frozen_shared"] - cpu["gather_chunks"]
    else:
        assert gpu["frozen_per_copy"] == int(PER_COPY_NUMBERS_GPU_SDPA * L * d * P * b) + rows_part
        model_parts = frozen_model_bytes(
            layout, n_layers=L, d_model=d, mhsa_heads=info["mhsa_heads"], mhsa_widths=info["mhsa_widths"],
            store_patterns=False, vocab=info["vocab"], d_mlp=info["d_mlp"], itemsize=b, model_itemsize=b,
            grid=lambda pos: 0, n_norms=info["n_norms"])
        assert model_parts > 0  # what the fitted coefficient holds: left out of the shared bytes on the GPU path
        assert gpu["frozen_shared"] - gpu["gather_chunks"] == cpu["frozen_shared"] - cpu["gather_chunks"] - model_parts
    assert est["cuda"].device_bytes == gpu["frozen_per_copy"] * batch + gpu["frozen_shared"]
