"""Llamascopium Lorsa fixtures, written by OpenMOSS llamascopium itself (run in a venv with
``llamascopium`` installed, never nnsight-lorsa)::

    python -m venv V; V/bin/pip install torch==2.13.0; V/bin/pip install llamascopium==2.0.0b34
    V/bin/python scripts/peer_fixtures/llamascopium.py OUT_DIR
    V/bin/python scripts/peer_fixtures/llamascopium.py OUT_DIR --tokens-only  # only tokens.safetensors

One folder per case under ``OUT_DIR``, each holding what llamascopium's own code wrote
(``config.json`` via ``LorsaConfig.save_hyperparameters``, ``sae_weights.safetensors`` via
``save_pretrained`` / ``Trainer.save_checkpoint``) and ``reference.safetensors``, computed from
llamascopium's OWN reload of that folder (``SparseDictionary.from_pretrained``):

``x (2, S, d_model)``
    fixed fp32 inputs (raw, un-normalised activations).
``out``
    the raw-space output: for ``norm_activation="dataset-wise"`` their pipeline
    ``decode(encode(x·s_in)) / s_out`` with ``s = compute_norm_factor(x, hook)``; for
    ``"inference"`` plainly ``forward(x)``.
``head_act``
    their ``encode`` output times their decoder norm, in raw output units
    (``feature_acts · ‖W_O‖ / s_out``): the norm of each head's output, which is what our
    ``Lorsa`` head activation ``z`` is after the decoder-norm fold.
``active``
    ``feature_acts != 0`` (which heads fire per token).
``out_fp32``, ``head_act_fp32``, ``active_fp32`` (bf16 files only)
    the same from their ``from_pretrained(..., dtype=torch.float32)`` of the bf16 file, on the same
    (bf16-valued) ``x``: weights upcast exactly, and the rotary tables are the bf16 ones stored in
    the file (``load_state_dict`` overwrites the buffers their ``__init__`` computed).

bf16 cases also hold ``tokens.safetensors``: ``x (16, 32, d_model)`` bf16 (512 tokens, seed 7) with
``out``/``active`` from their bf16 reload and ``out_fp32``/``active_fp32`` from their fp32 reload of the
same folder, so a bf16 load can be compared with their bf16 reload statistically (top-k flips are a
per-token event: 24 tokens say little).

The case ``train_lorsa_output`` is written by the exact sequence of llamascopium's
``runners/train.py::train_lorsa``: ``sae.cfg.save_hyperparameters(exp_result_path)`` BEFORE
training (config says ``"dataset-wise"``), their ``Trainer.fit`` (10 steps on a tiny random
activation stream; the norm scalars set as their ``Initializer`` would), then
``sae.save_pretrained(exp_result_path, fold_activation_scale=True)`` (the default of
``TrainLorsaSettings.fold_activation_scale``), which folds the weights in place and does not rewrite
``config.json``. Its reference is the trained module's own outputs (in memory, before the save:
the raw→raw map the user trained); ``reload_out`` is what their own ``from_pretrained`` + dataset-wise
pipeline computes from the files (the norm applied twice).

Reverse direction: each ``OUT_DIR/reverse/<case>/`` (written by OUR ``save(..., format="llamascopium")``
with ``ours_outputs.safetensors``) is loaded with their ``from_pretrained`` and compared;
``OUT_DIR/reverse/result.json`` records the result.

``train_lorsa_output/checkpoints/step_10``: their ``Trainer.save_checkpoint`` of the trained module
(config + unfolded weights; its pickled ``trainer.pt`` / ``optimizer.pt`` are emptied: the file
names are kept as markers, the pickles are not committed).
"""

from __future__ import annotations

import json
import math
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]  # this file is named like the peer
from llamascopium.models.lorsa import LorsaConfig, LowRankSparseAttention  # noqa: E402
from llamascopium.models.sparse_dictionary import SparseDictionary  # noqa: E402

sys.path.append(str(HERE))
from _common import (  # noqa: E402
    load_ours_outputs,
    max_rel,
    reverse_cases,
    save_reference,
    write_reverse_result,
)

D, SEQ, N_CTX = 16, 12, 32
HOOK_IN, HOOK_OUT = "blocks.1.ln1.hook_normalized", "blocks.1.hook_attn_out"
NORMS = {HOOK_IN: 3.7, HOOK_OUT: 0.9}
TOKENS, TOKENS_FILE = 16, "tokens.safetensors"  # bf16 cases: 16 windows of N_CTX positions (512 tokens)


def make(dtype: torch.dtype = torch.float32, seed: int = 0, **cfg: Any) -> LowRankSparseAttention:
    kw: dict[str, Any] = dict(sae_type="lorsa", d_model=D, expansion_factor=2, n_qk_heads=4, d_qk_head=8,
                              rotary_dim=8, n_ctx=N_CTX, hook_point_in=HOOK_IN, hook_point_out=HOOK_OUT,
                              act_fn="topk", top_k=5, device="cpu", dtype=dtype)
    kw.update(cfg)
    sae = LowRankSparseAttention(LorsaConfig(**kw))
    # random parameters only (the buffers mask/IGNORE/rotary tables stay as their __init__ built them)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sae.named_parameters():
            p.copy_((torch.randn(p.shape, generator=g) * 0.3).to(p.dtype))
    if sae.cfg.norm_activation == "dataset-wise":
        sae.set_dataset_average_activation_norm(dict(NORMS))
    return sae


def inputs() -> torch.Tensor:
    return torch.randn(2, SEQ, D, generator=torch.Generator().manual_seed(1)) * 2.0


@torch.no_grad()
def outputs(sae: LowRankSparseAttention, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Their raw-space pipeline (module docstring)."""
    x = x.to(sae.cfg.dtype)
    if sae.cfg.norm_activation == "inference":
        s_in = s_out = torch.tensor(1.0)
    else:
        s_in = sae.compute_norm_factor(x, HOOK_IN)
        s_out = sae.compute_norm_factor(x, HOOK_OUT)  # dataset-wise: a constant, x only gives the dtype
    acts = sae.encode(x * s_in)
    out = sae.decode(acts) / s_out
    dec = sae.decoder_norm() / s_out
    return {"x": x, "out": out, "head_act": acts * dec, "active": acts != 0}


def write_config(sae: LowRankSparseAttention, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    sae.cfg.save_hyperparameters(folder)


def saved(out: Path, name: str, sae: LowRankSparseAttention, note: str) -> None:
    """``save_pretrained`` + ``save_hyperparameters`` (what their ``push_to_hub`` writes), reference from
    their reload."""
    folder = out / name
    sae.save_pretrained(folder)
    write_config(sae, folder)
    again = SparseDictionary.from_pretrained(str(folder), device="cpu", dtype=sae.cfg.dtype)
    ref = outputs(again, inputs())
    if sae.cfg.dtype != torch.float32:  # also their fp32 reload of the same file (stored rotary tables upcast)
        wide = SparseDictionary.from_pretrained(str(folder), device="cpu", dtype=torch.float32)
        ref.update({f"{k}_fp32": v for k, v in outputs(wide, ref["x"].float()).items() if k != "x"})
        write_tokens(folder)
    save_reference(folder, **ref)
    CASES[name] = note


@torch.no_grad()
def write_tokens(folder: Path) -> None:
    """``TOKENS_FILE`` of a bf16 case: their bf16 and their fp32 reload of ``folder`` on ``TOKENS`` windows
    of ``N_CTX`` positions (``x``, ``out``, ``active``, ``out_fp32``, ``active_fp32``): enough tokens to
    compare bf16 arithmetic statistically (top-k flips are per-token events)."""
    low = SparseDictionary.from_pretrained(str(folder), device="cpu", dtype=torch.bfloat16)
    wide = SparseDictionary.from_pretrained(str(folder), device="cpu", dtype=torch.float32)
    x = (torch.randn(TOKENS, N_CTX, D, generator=torch.Generator().manual_seed(7)) * 2.0).to(torch.bfloat16)
    ref = {"x": x, **{k: v for k, v in outputs(low, x).items() if k in ("out", "active")}}
    ref.update({f"{k}_fp32": v for k, v in outputs(wide, x.float()).items() if k in ("out", "active")})
    save_file({k: v.contiguous() for k, v in ref.items()}, str(folder / TOKENS_FILE))


CASES: dict[str, str] = {}


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    x = inputs()
    saved(out, "save_pretrained_dataset_wise", make(seed=0),
          "save_pretrained (no fold) + save_hyperparameters: dataset-wise config, unfolded weights")
    folded = SparseDictionary.from_pretrained(str(out / "save_pretrained_dataset_wise"), device="cpu",
                                              fold_activation_scale=True)
    saved(out, "folded_inference", folded,
          "from_pretrained(fold_activation_scale=True) then save: config says inference")
    saved(out, "relu_neox_qknorm", make(seed=2, act_fn="relu", rotary_adjacent_pairs=False, use_post_qk_ln=True,
                                        normalization_type="RMS", norm_activation="inference"),
          "ReLU, NeoX half-split RoPE, RMS QK-norm, inference")
    saved(out, "bf16", make(dtype=torch.bfloat16, seed=3, norm_activation="inference"),
          "bf16 Lorsa (bf16 rotary tables in the file), inference")
    saved(out, "bf16_dataset_wise", make(dtype=torch.bfloat16, seed=4),
          "bf16 Lorsa, dataset-wise, unfolded")
    saved(out, "rotary_scale_2", make(seed=5, rotary_scale=2, rotary_dim=16, norm_activation="inference"),
          "rotary_scale=2 (q/k repeat_interleave before RoPE), inference")
    saved(out, "ntk_by_parts", make(seed=6, use_NTK_by_parts_rope=True, NTK_by_parts_factor=8.0,
                                    NTK_by_parts_low_freq_factor=1.0, NTK_by_parts_high_freq_factor=4.0,
                                    old_context_len=8, norm_activation="inference"),
          "llama3 NTK-by-parts RoPE, inference")
    saved(out, "jumprelu", make(seed=7, act_fn="jumprelu", norm_activation="inference"), "JumpReLU Lorsa")
    saved(out, "jumprelu_dataset_wise", make(seed=11, act_fn="jumprelu"),
          "JumpReLU Lorsa, dataset-wise, unfolded, sparsity_include_decoder_norm (their default)")
    saved(out, "batchtopk", make(seed=8, act_fn="batchtopk", norm_activation="inference"), "BatchTopK Lorsa")
    saved(out, "token_wise", make(seed=9, norm_activation="token-wise"), "token-wise norm")

    # train_lorsa's sequence (module docstring), with their own Trainer.fit on a tiny activation stream
    from llamascopium.trainer import Trainer, TrainerConfig

    trained = make(seed=10)
    run = out / "train_lorsa_output"
    write_config(trained, run)  # runners/train.py: sae.cfg.save_hyperparameters(exp_result_path) before fit
    g = torch.Generator().manual_seed(12)
    batches = [{HOOK_IN: torch.randn(4, SEQ, D, generator=g) * NORMS[HOOK_IN] / math.sqrt(D),
                HOOK_OUT: torch.randn(4, SEQ, D, generator=g) * NORMS[HOOK_OUT] / math.sqrt(D),
                "tokens": torch.randint(0, 50, (4, SEQ), generator=g), "mask": torch.ones(4, SEQ, dtype=torch.bool)}
               for _ in range(12)]
    trainer = Trainer(TrainerConfig(exp_result_path=str(run), total_training_tokens=4 * SEQ * 10, lr=1e-2,
                                    lr_warm_up_steps=1, lr_cool_down_steps=1, l1_coefficient_warmup_steps=1,
                                    k_warmup_steps=1, initial_k=5, skip_metrics_calculation=True))
    end_of_stream = trainer.fit(sae=trained, activation_stream=iter(batches), eval_fn=None, wandb_logger=None)
    assert not end_of_stream and trainer.cur_step == 10, (end_of_stream, trainer.cur_step)
    # a trainer checkpoint of the trained (unfolded) module: checkpoints/step_10/{config.json, weights, trainer.pt}
    trainer.save_checkpoint(trained, run)
    step = run / "checkpoints" / f"step_{trainer.cur_step}"
    for pickled in step.glob("*.pt"):
        pickled.unlink()
        pickled.touch()  # an empty marker: the layout their trainer writes, without the pickle
    again = SparseDictionary.from_pretrained(str(step), device="cpu")
    save_reference(step, **outputs(again, x))
    CASES[f"train_lorsa_output/checkpoints/step_{trainer.cur_step}"] = (
        "Trainer.save_checkpoint after Trainer.fit: config + unfolded weights")
    live = outputs(trained, x)  # the trained module, dataset-wise, in memory
    trained.save_pretrained(run, fold_activation_scale=True)  # train_lorsa's end (not end_of_stream)
    again = SparseDictionary.from_pretrained(str(run), device="cpu")
    live["reload_out"] = outputs(again, x)["out"]
    save_reference(run, **live)
    CASES["train_lorsa_output"] = ("train_lorsa: config.json written before Trainer.fit (dataset-wise), then "
                                   "save_pretrained(fold_activation_scale=True)")

    reverse(out)
    (out / "peer.json").write_text(json.dumps(
        {"peer": "llamascopium", "version": version("llamascopium"), "torch": torch.__version__,
         "cases": CASES, "norms": NORMS, "sqrt_d_model": math.sqrt(D)}, indent=1, sort_keys=True) + "\n")


@torch.no_grad()
def reverse(out: Path) -> None:
    """Each ``OUT_DIR/reverse/<case>/`` (our ``save(..., format="llamascopium")``) loaded with their
    ``SparseDictionary.from_pretrained`` and run on our ``x``; bound 1e-5 relative on the output and
    on the head activations (their ``encode`` = our ``z``: the file says ``sparsity_include_decoder_norm:
    false``), and the same active heads."""
    results: dict[str, Any] = {}
    for case in reverse_cases(out):
        ours = load_ours_outputs(case)
        try:
            sae = SparseDictionary.from_pretrained(str(case), device="cpu")
            acts = sae.encode(ours["x"])
            y = sae.decode(acts)
            r = {"out_max_rel": max_rel(y, ours["out"]), "z_max_rel": max_rel(acts, ours["z"]),
                 "same_active": bool(torch.equal(acts != 0, ours["z"] != 0))}
            r["pass"] = r["out_max_rel"] <= 1e-5 and r["z_max_rel"] <= 1e-5 and r["same_active"]
        except Exception as e:  # recorded, so the test names the case that failed
            r = {"pass": False, "error": f"{type(e).__name__}: {e}"}
        results[case.name] = r
    if results:
        write_reverse_result(out, results)


if __name__ == "__main__":
    if sys.argv[2:] == ["--tokens-only"]:  # (re)write only TOKENS_FILE of the bf16 cases already in OUT_DIR
        for case in ("bf16", "bf16_dataset_wise"):
            write_tokens(Path(sys.argv[1]) / case)
    else:
        main(Path(sys.argv[1]))
