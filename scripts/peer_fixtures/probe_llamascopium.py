"""Per-field probe cases for Llamascopium files, written by llamascopium 2.0.0b34 itself (run in a venv with
``llamascopium`` installed, never nnsight-lorsa)::

    V/bin/python scripts/peer_fixtures/probe_llamascopium.py OUT_DIR
    python scripts/make_peer_fixtures.py --peer probe_llamascopium --python V/bin/python
    # (the latter writes tests/fixtures/peers/probe_llamascopium)

One folder per case under ``OUT_DIR`` (``config.json`` by their ``save_hyperparameters``,
``sae_weights.safetensors`` by their ``save_pretrained``) with ``reference.safetensors``: ``x`` raw inputs
and ``out`` the raw-space output of the module their writer saved (``decode(encode(x·s_in)) / s_out``;
``token-wise``: their per-token factor); bf16 cases also ``out_fp32``, their fp32 reload of the file (the exact
output of the stored weights: bf16 arithmetic flips TopK choices, theirs included); ``train`` cases also
``out_folded``, their module after ``save_pretrained(fold_activation_scale=True)`` (``"inference"``) on ``x``.
``OUT_DIR/cases.json`` says, per case, which field value it probes and the writer sequence.
Deterministic but for the ``dataset_average_activation_norm.<hook>`` scalars of ``"inference"`` cases, which their
``full_state_dict`` writes uninitialised (``torch.empty(())``; unread by both sides).
Classified on our side by ``scripts/probe_peer_fields.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
from llamascopium.models.lorsa import LorsaConfig, LowRankSparseAttention  # noqa: E402
from llamascopium.models.sae import SAEConfig, SparseAutoEncoder  # noqa: E402

D, SEQ, N_CTX = 16, 12, 32
NORMS_IN, NORMS_OUT = 3.7, 0.9
CASES: dict[str, dict[str, Any]] = {}


def _randomize(m: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            v = torch.randn(p.shape, generator=g) * 0.3
            if "threshold" in name:
                v = v - 1.0
            p.copy_(v.to(p.dtype))


def _norms(m: Any) -> None:
    if m.cfg.norm_activation == "dataset-wise":
        m.set_dataset_average_activation_norm({m.cfg.hook_point_in: NORMS_IN, m.cfg.hook_point_out: NORMS_OUT})


@torch.no_grad()
def _out(m: Any, x: torch.Tensor) -> torch.Tensor:
    x = x.to(m.cfg.dtype)
    mode = m.cfg.norm_activation
    if mode == "inference":
        return m.decode(m.encode(x))
    if mode == "dataset-wise":
        s_in = m.compute_norm_factor(x, m.cfg.hook_point_in)
        s_out = m.compute_norm_factor(x, m.cfg.hook_point_out)
        return m.decode(m.encode(x * s_in)) / s_out
    # token-wise / batch-wise: their per-input factor, on the input hook, and the output hook likewise
    s_in = m.compute_norm_factor(x, m.cfg.hook_point_in)
    return m.decode(m.encode(x * s_in)) / s_in


def sae(seed: int, **kw: Any) -> SparseAutoEncoder:
    base: dict[str, Any] = dict(d_model=D, expansion_factor=4, hook_point_in="blocks.1.hook_resid_post",
                                hook_point_out="blocks.1.hook_resid_post", act_fn="relu", top_k=5, device="cpu",
                                dtype=torch.float32)
    base.update(kw)
    m = SparseAutoEncoder(SAEConfig(**base))
    _randomize(m, seed)
    _norms(m)
    return m


def lorsa(seed: int, **kw: Any) -> LowRankSparseAttention:
    base: dict[str, Any] = dict(d_model=D, expansion_factor=2, n_qk_heads=4, d_qk_head=8, rotary_dim=8, n_ctx=N_CTX,
                                hook_point_in="blocks.1.ln1.hook_normalized", hook_point_out="blocks.1.hook_attn_out",
                                act_fn="topk", top_k=5, norm_activation="inference", device="cpu",
                                dtype=torch.float32)
    base.update(kw)
    m = LowRankSparseAttention(LorsaConfig(**base))
    _randomize(m, seed)
    _norms(m)
    return m


def write(out: Path, name: str, m: Any, field: str, value: Any, writer: str = "save_pretrained") -> None:
    """``writer``: ``save_pretrained`` (no fold) + ``save_hyperparameters``; ``train`` (runners/train.py:
    config written before training, then ``save_pretrained(fold_activation_scale=True)``)."""
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    x = torch.randn(2, SEQ, D, generator=torch.Generator().manual_seed(1)) * 2.0
    ref = _out(m, x)
    m.cfg.save_hyperparameters(folder)
    m.save_pretrained(folder, fold_activation_scale=writer == "train")
    tensors = {"x": x.to(m.cfg.dtype).contiguous(), "out": ref.contiguous()}
    if writer == "train":  # their module after the fold (now "inference"): what the folded weights compute there
        tensors["out_folded"] = _out(m, x).contiguous()
    if m.cfg.dtype != torch.float32:  # their fp32 reload of the low-precision file: the exact output of its weights
        from llamascopium.models.sparse_dictionary import SparseDictionary

        wide = SparseDictionary.from_pretrained(str(folder), device="cpu", dtype=torch.float32,
                                                fold_activation_scale=False)
        tensors["out_fp32"] = _out(wide, tensors["x"].float()).contiguous()
    save_file(tensors, str(folder / "reference.safetensors"))
    CASES[name] = {"field": field, "value": value, "writer": writer, "kind": m.cfg.sae_type}


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    hook_tc = dict(hook_point_in="blocks.1.ln2.hook_normalized", hook_point_out="blocks.1.hook_mlp_out")
    s = 0
    # ---------------------------------------------------------------- SAEs / transcoders
    for act in ("relu", "topk", "jumprelu", "batchtopk"):
        for norm in ("inference", "dataset-wise"):
            s += 1
            write(out, f"sae_{act}_{norm}", sae(s, act_fn=act, top_k=3, norm_activation=norm), "act_fn+norm_activation",
                  f"{act}/{norm}")
    for norm in ("token-wise", "batch-wise"):
        s += 1
        write(out, f"sae_norm_{norm}", sae(s, norm_activation=norm), "norm_activation", norm)
    for act in ("relu", "jumprelu", "topk"):
        s += 1
        write(out, f"sae_train_{act}", sae(s, act_fn=act, top_k=3, norm_activation="dataset-wise"), "norm_activation",
              f"dataset-wise, train_sae sequence ({act})", writer="train")
    for act in ("relu", "jumprelu"):
        s += 1
        write(out, f"sae_no_dec_norm_{act}", sae(s, act_fn=act, sparsity_include_decoder_norm=False,
                                                 norm_activation="dataset-wise"),
              "sparsity_include_decoder_norm", False)
    s += 1
    write(out, "sae_no_decoder_bias", sae(s, use_decoder_bias=False, norm_activation="inference"), "use_decoder_bias",
          False)
    s += 1
    write(out, "sae_glu", sae(s, use_glu_encoder=True, norm_activation="inference"), "use_glu_encoder", True)
    s += 1
    write(out, "transcoder_jumprelu_dataset_wise", sae(s, act_fn="jumprelu", norm_activation="dataset-wise", **hook_tc),
          "hook_point_in != hook_point_out", "transcoder")
    s += 1
    write(out, "sae_bf16", sae(s, dtype=torch.bfloat16, norm_activation="inference", act_fn="topk", top_k=3), "dtype",
          "bfloat16")
    s += 1
    write(out, "sae_expansion_frac", sae(s, expansion_factor=2.5, norm_activation="inference"), "expansion_factor", 2.5)
    # ---------------------------------------------------------------- Lorsa
    lorsa_cases: list[tuple[str, str, Any, dict[str, Any]]] = [
        ("lorsa_relu", "act_fn", "relu", dict(act_fn="relu")),
        ("lorsa_jumprelu", "act_fn", "jumprelu", dict(act_fn="jumprelu")),
        ("lorsa_batchtopk", "act_fn", "batchtopk", dict(act_fn="batchtopk")),
        ("lorsa_top_k_1", "top_k", 1, dict(top_k=1)),
        ("lorsa_n_qk_2", "n_qk_heads", "2 (group 16)", dict(n_qk_heads=2)),
        ("lorsa_n_qk_32", "n_qk_heads", "32 (group 1)", dict(n_qk_heads=32, d_qk_head=4, rotary_dim=4)),
        ("lorsa_d_qk_12_rot_4", "d_qk_head/rotary_dim", "12/4", dict(d_qk_head=12, rotary_dim=4)),
        ("lorsa_pos_none", "positional_embedding_type", "none", dict(positional_embedding_type="none")),
        ("lorsa_neox", "rotary_adjacent_pairs", False, dict(rotary_adjacent_pairs=False)),
        ("lorsa_base_500k", "rotary_base", 500000, dict(rotary_base=500000)),
        ("lorsa_rotary_scale_2", "rotary_scale", 2, dict(rotary_scale=2, rotary_dim=16)),
        ("lorsa_ntk", "use_NTK_by_parts_rope", True,
         dict(use_NTK_by_parts_rope=True, NTK_by_parts_factor=8.0, NTK_by_parts_high_freq_factor=4.0,
              old_context_len=8)),
        ("lorsa_attn_scale_3", "attn_scale", 3.0, dict(attn_scale=3.0)),
        ("lorsa_qk_rms_eps", "use_post_qk_ln/eps", "RMS/1e-2",
         dict(use_post_qk_ln=True, normalization_type="RMS", eps=1e-2)),
        ("lorsa_rms_type_no_ln", "normalization_type", "RMS without use_post_qk_ln", dict(normalization_type="RMS")),
        ("lorsa_no_decoder_bias", "use_decoder_bias", False, dict(use_decoder_bias=False)),
        ("lorsa_no_dec_norm", "sparsity_include_decoder_norm", False, dict(sparsity_include_decoder_norm=False)),
        ("lorsa_token_wise", "norm_activation", "token-wise", dict(norm_activation="token-wise")),
        ("lorsa_bf16", "dtype", "bfloat16", dict(dtype=torch.bfloat16)),
        ("lorsa_n_ctx_8", "n_ctx", 8, dict(n_ctx=8)),
    ]
    for name, field, value, kw in lorsa_cases:
        s += 1
        try:
            m = lorsa(s, **kw)
            if name == "lorsa_n_ctx_8":  # their tables stop at n_ctx: compare on n_ctx positions
                folder = out / name
                folder.mkdir(parents=True, exist_ok=True)
                x = torch.randn(2, 8, D, generator=torch.Generator().manual_seed(1)) * 2.0
                m.cfg.save_hyperparameters(folder)
                m.save_pretrained(folder)
                save_file({"x": x, "out": _out(m, x).contiguous()}, str(folder / "reference.safetensors"))
                CASES[name] = {"field": field, "value": value, "writer": "save_pretrained", "kind": "lorsa"}
            else:
                write(out, name, m, field, value)
        except Exception as e:  # the peer itself cannot build it: recorded, not a case
            CASES[name] = {"field": field, "value": value, "peer_error": f"{type(e).__name__}: {e}"}
    s += 1
    write(out, "lorsa_train_dataset_wise", lorsa(s, norm_activation="dataset-wise"), "norm_activation",
          "dataset-wise, train_lorsa sequence", writer="train")
    extra_cases(out, s)


def extra_cases(out: Path, s: int) -> None:
    """Cases added 2026-11-29 (after the others, so that their seeds stay): RoPE off with a ``rotary_scale``
    (their repeat runs inside the rotary step only), a bf16 JumpReLU SAE (its decoder-norm fold, read wider)."""
    s += 1
    write(out, "lorsa_pos_none_rotary_scale_2", lorsa(s, positional_embedding_type="none", rotary_scale=2),
          "positional_embedding_type+rotary_scale", "none/2")
    s += 1
    write(out, "sae_bf16_jumprelu", sae(s, dtype=torch.bfloat16, norm_activation="inference", act_fn="jumprelu"),
          "dtype", "bfloat16 (jumprelu)")
    (out / "cases.json").write_text(json.dumps(CASES, indent=1, sort_keys=True, default=str) + "\n")
    print(json.dumps({k: v.get("peer_error", "ok") for k, v in CASES.items()}, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
