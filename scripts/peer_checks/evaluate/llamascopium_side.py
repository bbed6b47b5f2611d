"""Llamascopium's side of the ``evaluate`` check, run by ``run.py`` with the Llamascopium venv's interpreter
(llamascopium 2.0.0b34; never nnsight-lorsa), after ``ours_side.py saes`` wrote the ``topk_mlp1`` tensors::

    python llamascopium_side.py WORK

Feeds our hook value ``y`` (label), the SAE's reconstruction ``out`` and latents ``z`` of ``topk_mlp1`` with the mask
of the positions our ``evaluate(target_mask=attention_mask)`` counts (no column 0, no padding) to Llamascopium's own
``ExplainedVarianceMetric`` and ``L0Metric``: all six rows as one batch, and rows 0-3 and 4-5 as two batches (its
explained variance is a mean of per-batch values). Writes ``WORK/llamascopium/results.json``.
"""

from __future__ import annotations

import sys
from importlib.metadata import version
from pathlib import Path

import _shared
import torch
from llamascopium.metrics import ExplainedVarianceMetric, L0Metric
from llamascopium.utils.tensor_specs import TensorSpecs
from safetensors.torch import load_file


class SpecsOnly:
    """The one attribute of a Llamascopium model that its metrics read."""

    specs = TensorSpecs


@torch.no_grad()
def main(work: Path) -> None:
    raw = load_file(_shared.side_dir(work, "ours") / "topk_mlp1_raw.safetensors")
    keep = load_file(_shared.tokens_file(work))["attention_mask"].bool()
    keep[:, 0] = False
    results = {}
    for label, splits in (("one_batch", [slice(0, 6)]), ("two_batches_4_2", [slice(0, 4), slice(4, 6)])):
        explained, l0 = ExplainedVarianceMetric(SpecsOnly()), L0Metric(SpecsOnly())
        for rows in splits:
            mask = keep[rows].long()
            ctx = {"label": raw["y"][rows], "reconstructed": raw["out"][rows], "mask": mask,
                   "feature_acts": raw["z"][rows], "n_tokens": int(mask.sum())}
            explained.update(ctx)
            l0.update(ctx)
        values = {**explained.compute(), **l0.compute()}
        results[label] = {k: float(v) for k, v in values.items()}
    _shared.write_json(_shared.side_dir(work, "llamascopium") / "results.json",
                       {"versions": {p: version(p) for p in ("llamascopium", "torch")}, **results})


if __name__ == "__main__":
    _shared.setup()
    main(Path(sys.argv[1]))
