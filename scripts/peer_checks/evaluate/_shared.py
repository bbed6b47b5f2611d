"""What every side of the ``evaluate`` peer check shares: the fixture's constants, the work-folder layout and the JSON
helpers. Imports only the standard library and torch, so the SAELens, sparsify and Llamascopium interpreters (which
do not have nnsight-lorsa) import it too: each side script is run as ``python <folder>/<side>.py WORK``, which puts
this folder first on ``sys.path``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # scripts/peer_checks: peer_io
from peer_io import clear_work, finite, read_json, write_json  # noqa: E402, F401  (after the path it is found on)

#: token ids of the tiny GPT-2 (EOS never occurs in the windows: the other ids are drawn from 4 … VOCAB-1)
BOS_ID, EOS_ID, PAD_ID = 1, 2, 3
VOCAB, D_MODEL, D_SAE, TOPK = 512, 64, 128, 8
#: 6 windows of 24 tokens, BOS first; rows 4 and 5 right-padded (pad id, attention mask 0) from these columns on
N_WINDOWS, WINDOW = 6, 24
PADDED_FROM = {4: 15, 5: 9}
#: the SAEs: name -> (SAELens architecture, TransformerLens hook, extra cfg fields, module path on the HF GPT-2,
#: seed of the random weights)
SAE_CASES: dict[str, tuple[str, str, dict[str, Any], str, int]] = {
    "relu_resid0": ("standard", "blocks.0.hook_resid_post", {}, "transformer.h.0", 0),
    "topk_mlp1": ("topk", "blocks.1.hook_mlp_out", {"k": TOPK}, "transformer.h.1.mlp", 1),
    "jumprelu_attn1": ("jumprelu", "blocks.1.hook_attn_out", {}, "transformer.h.1.attn", 2),
}
#: SAELens's parameter order (``named_parameters()``), in which the random weights are drawn
SAELENS_PARAM_ORDER = {"standard": ("b_dec", "W_dec", "W_enc", "b_enc"), "topk": ("b_dec", "W_dec", "W_enc", "b_enc"),
                       "jumprelu": ("b_dec", "W_dec", "W_enc", "threshold", "b_enc")}
WEIGHT_SCALE = 0.3
#: the sparsify TopK SAE sits on the output of layer 0 (the ``relu_resid0`` site); its weights' seed
SPARSIFY_SITE, SPARSIFY_SEED = "transformer.h.0", 5
#: the target mask with holes (``holes`` check): seed and keep probability
HOLES_SEED, HOLES_KEEP = 3, 0.6
#: SAELens's ``exclude_special_tokens`` for the aligned runs: the BOS and pad ids
EXCLUDED_IDS = [BOS_ID, PAD_ID]


def setup() -> None:
    """No network, one thread (every side calls this first)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    torch.set_num_threads(1)


def model_dir(work: Path) -> Path:
    return work / "model"


def tokens_file(work: Path) -> Path:
    """``input_ids`` (int64), ``attention_mask`` (int64) and ``holes_mask`` (bool), all ``(N_WINDOWS, WINDOW)``."""
    return work / "tokens.safetensors"


def sae_dir(work: Path, name: str) -> Path:
    """The SAELens-layout folder of SAE ``name`` (``cfg.json``, ``sae_weights.safetensors``)."""
    return work / "saes" / name


def side_dir(work: Path, side: str) -> Path:
    """Where side ``side`` (``saelens``, ``ours``, ``sparsify``, ``llamascopium``) writes its results."""
    d = work / side
    d.mkdir(parents=True, exist_ok=True)
    return d


def randomize_(tensors: dict[str, torch.Tensor], order: tuple[str, ...] | list[str], seed: int) -> None:
    """The SAE weights' random draw, in place: ``N(0, 1) * WEIGHT_SCALE`` per tensor in ``order`` from one generator
    seeded ``seed``; a ``threshold`` is then made positive and halved. Used on SAELens's own parameters by
    ``saelens_side.py`` and by ``run.py``'s writer of the same files when SAELens is not run."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in order:
            t = tensors[name]
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=g) * WEIGHT_SCALE)
        if "threshold" in tensors:
            tensors["threshold"].abs_().mul_(0.5)


