"""sparsify's side of the ``evaluate`` check, run by ``run.py`` with the sparsify venv's interpreter (eai-sparsify
1.3.3; never nnsight-lorsa), after ``ours_side.py saes`` wrote the layer-0 output ``y``::

    python sparsify_side.py WORK

Draws a TopK ``SparseCoder`` (64 -> 128, k = 8; random weights, decoder rows unit norm), writes it with sparsify's own
``save_to_disk`` into ``WORK/sparsify/saes/transformer.h.0/`` (ours evaluates that file in ``ours_side.py
sparsify``), reloads it with ``load_from_disk`` and computes sparsify's ``fvu`` (its forward's output) on our ``y`` at
the positions our ``evaluate(target_mask=attention_mask)`` counts (no column 0, no padding): in one batch, on all 144
tokens, and as the trainer would see the kept tokens of rows 0-3 and 4-5 in two batches (per-batch FVUs, averaged);
plus its L0, dead latents and ``auxk_loss`` on the same tokens. Writes ``WORK/sparsify/results.json``.
"""

from __future__ import annotations

import sys
from importlib.metadata import version
from pathlib import Path

import _shared
import torch
from safetensors.torch import load_file
from sparsify import SparseCoder, SparseCoderConfig


@torch.no_grad()
def main(work: Path) -> None:
    out_dir = _shared.side_dir(work, "sparsify")
    y = load_file(_shared.side_dir(work, "ours") / "relu_resid0_raw.safetensors")["y"]
    keep = load_file(_shared.tokens_file(work))["attention_mask"].bool()
    keep[:, 0] = False
    torch.manual_seed(0)
    sae = SparseCoder(_shared.D_MODEL, SparseCoderConfig(num_latents=_shared.D_SAE, k=_shared.TOPK))
    params = dict(sae.named_parameters())
    _shared.randomize_(params, list(params), _shared.SPARSIFY_SEED)
    sae.set_decoder_norm_to_unit_norm()
    path = out_dir / "saes" / _shared.SPARSIFY_SITE
    sae.save_to_disk(path)
    sae = SparseCoder.load_from_disk(path)

    kept = y[keep]
    first, second = keep.clone(), keep.clone()
    first[4:] = False
    second[:4] = False
    batch_fvus = [float(sae(y[b], y[b]).fvu) for b in (first, second)]
    top_acts, top_idx, _ = sae.encode(kept)
    dead = torch.ones(_shared.D_SAE, dtype=torch.bool)
    dead[top_idx.unique()] = False
    _shared.write_json(out_dir / "results.json", {
        "versions": {p: version(p) for p in ("eai-sparsify", "torch")},
        "fvu_one_batch_masked": float(sae(kept, kept).fvu),
        "fvu_one_batch_all_tokens": float(sae(y.flatten(0, 1), y.flatten(0, 1)).fvu),
        "fvu_batches": batch_fvus, "fvu_mean_of_batches": sum(batch_fvus) / len(batch_fvus),
        "n_dead": int(dead.sum()), "l0": float((top_acts != 0).sum(-1).float().mean()),
        "auxk_loss": float(sae(kept, kept, dead_mask=dead).auxk_loss)})


if __name__ == "__main__":
    _shared.setup()
    main(Path(sys.argv[1]))
