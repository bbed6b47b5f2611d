"""sparsify fixtures, written by EleutherAI sparsify itself (run in a venv with ``eai-sparsify``
installed, never nnsight-lorsa)::

    python -m venv V; V/bin/pip install torch==2.13.0; V/bin/pip install eai-sparsify
    V/bin/python scripts/peer_fixtures/sparsify.py OUT_DIR

One folder per case under ``OUT_DIR``: the files ``SparseCoder.save_to_disk`` wrote (``cfg.json``,
``sae.safetensors``) and ``reference.safetensors``: ``x (8, d_in)``, sparsify's own
``top_acts, top_indices = encode(x)`` scattered to a dense ``feature_acts (8, num_latents)``,
``sae_out = decode(top_acts, top_indices) (+ x W_skipᵀ)`` (what sparsify's ``forward`` returns
without ``multi_topk``), ``forward_out = forward(x).sae_out`` (for ``multi_topk`` files: the top-4k
reconstruction) and ``l0``. ``run/``: a directory written by sparsify's own ``Trainer`` on a tiny
random Llama (one folder per hookpoint); its pickled ``*.pt`` state files are deleted. ``run_mixed/``:
a run directory with one folder per kind of coder (the shape of a multi-hookpoint run).

Reverse direction: each ``OUT_DIR/reverse/<case>/`` (written by OUR ``save(..., format="sparsify")``
with ``ours_outputs.safetensors``) is loaded with ``SparseCoder.load_from_disk`` and compared;
``OUT_DIR/reverse/result.json`` records the result.
"""

from __future__ import annotations

import json
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]  # this file is named like the peer
from sparsify import SparseCoder, SparseCoderConfig  # noqa: E402

sys.path.append(str(HERE))
from _common import (  # noqa: E402
    fixed_inputs,
    fresh_output_dir,
    randomize_,
    run_reverse,
    save_reference,
)

D_IN, N_LATENTS, K = 16, 64, 4


@torch.no_grad()
def outputs(sae: SparseCoder, x: torch.Tensor) -> dict[str, torch.Tensor]:
    x = x.to(sae.dtype)
    top_acts, top_indices, _ = sae.encode(x)
    dense = torch.zeros(x.shape[0], sae.num_latents, dtype=top_acts.dtype).scatter(-1, top_indices, top_acts)
    out = sae.decode(top_acts, top_indices)
    if sae.W_skip is not None:
        out = out + x @ sae.W_skip.mT
    return {"x": x, "feature_acts": dense, "sae_out": out, "forward_out": sae(x).sae_out,
            "l0": (dense != 0).sum(-1)}


def case(out: Path, name: str, seed: int, dtype: torch.dtype = torch.float32, upcast: bool = False,
         **cfg: Any) -> None:
    """One coder saved by ``save_to_disk``; the reference from ``load_from_disk`` (``upcast``: also the loaded
    coder cast to fp32, ``fp32_*``: what a low-precision file loaded in fp32 computes)."""
    coder = SparseCoder(D_IN, SparseCoderConfig(num_latents=N_LATENTS, k=K, **cfg), dtype=dtype)
    randomize_(coder, seed=seed)
    coder.save_to_disk(out / name)
    again = SparseCoder.load_from_disk(out / name)
    ref = outputs(again, fixed_inputs(D_IN))
    if upcast:
        ref.update({f"fp32_{k}": v for k, v in outputs(again.float(), fixed_inputs(D_IN)).items()})
    save_reference(out / name, **ref)


def trainer_run(out: Path) -> None:
    """sparsify's own ``Trainer`` for a few steps on a tiny random Llama (no download)."""
    from datasets import Dataset
    from sparsify import Trainer
    from sparsify.config import TrainConfig
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=D_IN, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64))
    g = torch.Generator().manual_seed(0)
    data = Dataset.from_dict({"input_ids": torch.randint(0, 64, (16, 16), generator=g).tolist()})
    data.set_format("torch", columns=["input_ids"])
    cfg = TrainConfig(SparseCoderConfig(num_latents=N_LATENTS, k=K), batch_size=4, layers=[0, 1],
                      log_to_wandb=False, save_dir=str(out), run_name="run", save_every=10_000, lr=1e-3,
                      lr_warmup_steps=1)
    Trainer(cfg, data, model).fit()
    run = out / "run"
    for p in list(run.iterdir()):
        if p.suffix == ".pt":
            p.unlink()  # pickles: never in fixtures
    for layer in sorted(p for p in run.iterdir() if p.is_dir()):
        save_reference(layer, **outputs(SparseCoder.load_from_disk(layer), fixed_inputs(D_IN)))


def reverse(out: Path) -> None:
    """Load each case our ``save(..., format="sparsify")`` wrote in sparsify and compare."""
    run_reverse(out, lambda case, x: (outputs(SparseCoder.load_from_disk(case), x), {}))


def main(out: Path) -> None:
    fresh_output_dir(out)
    case(out, "sae", 1)
    case(out, "sae_unnormalized_decoder", 2, normalize_decoder=False)
    case(out, "transcoder", 3, transcode=True)
    case(out, "skip_transcoder", 4, transcode=True, skip_connection=True)
    case(out, "sae_skip", 5, skip_connection=True)
    case(out, "groupmax", 6, activation="groupmax")
    case(out, "groupmax_transcoder", 7, activation="groupmax", transcode=True)
    case(out, "multi_topk", 8, multi_topk=True)
    case(out, "sae_bf16", 9, dtype=torch.bfloat16)
    case(out, "sae_skip_bf16", 13, dtype=torch.bfloat16, upcast=True, skip_connection=True)  # added 2026-11-29
    mixed = out / "run_mixed"
    case(mixed, "layers.0", 10)
    case(mixed, "layers.1.mlp", 11, transcode=True, skip_connection=True)
    case(mixed, "layers.2", 12, activation="groupmax")
    (mixed / "layers.3").mkdir()  # a hookpoint folder whose save was cut short: cfg.json, no weights
    (mixed / "layers.3" / "cfg.json").write_text((mixed / "layers.0" / "cfg.json").read_text())
    trainer_run(out)
    (out / "peer.json").write_text(json.dumps({"peer": "eai-sparsify", "version": version("eai-sparsify"),
                                               "torch": torch.__version__}, indent=1) + "\n")
    reverse(out)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    main(Path(sys.argv[1]))
