"""Checkpoint formats: our own save/load round trip and its validation, and Llamascopium Lorsa import.

The Llamascopium tests write checkpoints in the exact layout of the Lorsa authors' library
(``config.json`` = pydantic dump of their ``LorsaConfig``; ``sae_weights.safetensors`` = their
``full_state_dict()`` including the ``mask``/``IGNORE``/``rotary_sin``/``rotary_cos`` buffers and
the ``dataset_average_activation_norm.<hook>`` scalars) and compare our loaded module with an
independent reference forward written from their ``LowRankSparseAttention`` equations
(``_compute_qkv``, ``_apply_rotary``/``_rotate_every_two``, ``_calculate_sin_cos_rotary``,
``_compute_attention_pattern``/``_compute_head_outputs``, ``encode``'s decoder-norm gating with
the ReLU + top-k activation, ``decode``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from nnsight_lorsa.errors import ArgumentError, CheckpointError, UnsupportedArchitectureError
from nnsight_lorsa.formats.llamascopium import load_llamascopium_lorsa
from nnsight_lorsa.formats.lorsa_format import load_lorsa, save_lorsa
from nnsight_lorsa.modules.lorsa import Lorsa
from nnsight_lorsa.modules.lorsa_config import LorsaConfig
from nnsight_lorsa.modules.rotary import RotaryConfig

TOL = 1e-5


# =============================================================================== our format
def _our_config(**over) -> LorsaConfig:
    rotary = RotaryConfig(
        head_dim=8,
        rotary_dim=8,
        base=500000.0,
        rope_type="llama3",
        scaling={
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    kw = dict(
        d_model=16,
        n_qk_heads=2,
        d_qk_head=8,
        n_ov_heads=16,
        top_k=4,
        rotary=rotary,
        qk_norm=True,
        layer=3,
        architecture="llama",
        extra={"note": "unit test", "metrics": {"fvu": 0.25}},
    )
    kw.update(over)
    return LorsaConfig(**kw)


def _random_lorsa(cfg: LorsaConfig, seed: int = 0) -> Lorsa:
    torch.manual_seed(seed)
    m = Lorsa(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))  # non-trivial biases and QK-norm weights
    return m.eval()


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Lorsa, Path]:
    m = _random_lorsa(_our_config())
    return m, save_lorsa(m, tmp_path / "ckpt")


def test_roundtrip_state_and_forward(saved):
    m, path = saved
    assert sorted(p.name for p in path.iterdir()) == ["checksums.json", "config.json", "model.safetensors"]
    raw = json.loads((path / "config.json").read_text())
    assert raw["format"] == "nnsight-lorsa" and raw["version"] == 1
    loaded = load_lorsa(path)
    assert loaded.cfg == m.cfg
    sd, sd2 = m.state_dict(), loaded.state_dict()
    assert sd.keys() == sd2.keys()
    for k in sd:
        assert sd[k].dtype == sd2[k].dtype and torch.equal(sd[k], sd2[k]), k
    x = torch.randn(2, 10, 16)
    assert torch.equal(m(x), loaded(x))


def test_roundtrip_without_optional_parts(tmp_path):
    m = _random_lorsa(_our_config(rotary=None, qk_norm=False, use_decoder_bias=False, extra={}))
    loaded = load_lorsa(save_lorsa(m, tmp_path / "c"))
    assert "b_D" not in loaded.state_dict() and "ln_q.w" not in loaded.state_dict()
    x = torch.randn(1, 7, 16)
    assert torch.equal(m(x), loaded(x))


def test_load_dtype_override_and_overwrite(saved):
    m, path = saved
    save_lorsa(m, path)  # overwriting an existing checkpoint works
    loaded = load_lorsa(path, dtype=torch.float64, device="cpu")
    assert loaded.W_Q.dtype == torch.float64
    assert torch.equal(loaded.W_O, m.W_O.double())


def _rewrite_tensors(path: Path, edit) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def _rewrite_config(path: Path, edit) -> None:
    raw = json.loads((path / "config.json").read_text())
    edit(raw)
    (path / "config.json").write_text(json.dumps(raw))


@pytest.mark.parametrize(
    ("corrupt", "needles"),
    [
        (lambda p: (p / "config.json").unlink(), ["config.json", "not found"]),
        (lambda p: (p / "model.safetensors").unlink(), ["model.safetensors", "not found"]),
        (lambda p: (p / "config.json").write_text("{not json"), ["config.json", "invalid JSON"]),
        (lambda p: (p / "config.json").write_text("[1, 2]"), ["config.json", "JSON object"]),
        (lambda p: _rewrite_config(p, lambda r: r.update(format="other")), ["config.json", "'format'"]),
        (lambda p: _rewrite_config(p, lambda r: r.update(version=2)), ["config.json", "'version'"]),
        (lambda p: _rewrite_config(p, lambda r: r.pop("config")), ["config.json", "'config'"]),
        (lambda p: _rewrite_config(p, lambda r: r["config"].update(bogus=1)), ["config.json", "bogus"]),
        (lambda p: _rewrite_config(p, lambda r: r["config"].update(top_k=999)), ["config.json", "top_k"]),
        (lambda p: _rewrite_tensors(p, lambda t: t.pop("W_V")), ["model.safetensors", "missing", "W_V"]),
        (
            lambda p: _rewrite_tensors(p, lambda t: t.update(extra_thing=torch.zeros(3))),
            ["model.safetensors", "unexpected", "extra_thing"],
        ),
        (
            lambda p: _rewrite_tensors(p, lambda t: t.update(W_K=torch.zeros(2, 16, 4))),
            ["model.safetensors", "'W_K'", "(2, 16, 4)", "(2, 16, 8)"],
        ),
        (
            lambda p: _rewrite_tensors(p, lambda t: t.update(b_V=torch.zeros(16, dtype=torch.int32))),
            ["model.safetensors", "'b_V'", "dtype"],
        ),
        (
            lambda p: _rewrite_config(p, lambda r: r["config"].update(d_model=32)),
            ["model.safetensors", "'W_Q'", "'W_O'", "config.json"],
        ),
        (lambda p: (p / "model.safetensors").write_bytes(b"garbage"), ["model.safetensors", "safetensors"]),
    ],
    ids=[
        "no-config",
        "no-weights",
        "bad-json",
        "not-object",
        "format-tag",
        "version",
        "no-config-key",
        "unknown-config-key",
        "invalid-config",
        "missing-tensor",
        "extra-tensor",
        "wrong-shape",
        "int-tensor",
        "config-mismatch",
        "corrupt-weights",
    ],
)
def test_malformed_checkpoints(saved, corrupt, needles):
    _, path = saved
    corrupt(path)
    with pytest.raises(CheckpointError) as info:
        load_lorsa(path)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


def test_load_path_that_is_a_file(saved):
    _, path = saved
    with pytest.raises(CheckpointError, match="is a file"):
        load_lorsa(path / "config.json")


def test_missing_local_dir_invalid_repo_id(tmp_path):
    missing = tmp_path / "nope" / "deeper"
    with pytest.raises(CheckpointError, match="does not exist"):
        load_lorsa(missing)  # a Path is always local
    with pytest.raises(
        CheckpointError, match="neither an existing local directory nor a valid Hugging Face repo id"
    ):
        load_lorsa(str(missing))  # several slashes: not a repo id, no network involved


def test_valid_repo_id_offline_cache_miss():
    with pytest.raises(CheckpointError, match="could not be fetched from the Hugging Face hub"):
        load_lorsa("nnsight-lorsa-tests/surely-not-a-repo-3f9c", local_files_only=True)


def test_save_rejects_non_lorsa(tmp_path):
    with pytest.raises(TypeError):
        save_lorsa(torch.nn.Linear(2, 2), tmp_path)  # type: ignore[arg-type]


# =============================================================================== Llamascopium
D_MODEL, N_QK, D_QK, N_OV, N_CTX = 16, 2, 8, 16, 32
HOOK_IN, HOOK_OUT = "blocks.3.ln1.hook_normalized", "blocks.3.hook_attn_out"


def _their_config(**over) -> dict:
    """A ``LorsaConfig.model_dump()`` as their ``save_hyperparameters`` writes it."""
    cfg = {
        "sae_type": "lorsa",
        "d_model": D_MODEL,
        "expansion_factor": N_OV / D_MODEL,
        "use_decoder_bias": True,
        "act_fn": "topk",
        "norm_activation": "inference",
        "sparsity_include_decoder_norm": True,
        "top_k": 4,
        "use_triton_kernel": False,
        "sparsity_threshold_for_triton_spmm_kernel": 0.996,
        "jumprelu_threshold_window": 2.0,
        "hook_point_in": HOOK_IN,
        "hook_point_out": HOOK_OUT,
        "n_qk_heads": N_QK,
        "d_qk_head": D_QK,
        "positional_embedding_type": "rotary",
        "rotary_dim": D_QK,
        "rotary_base": 10000,
        "rotary_base_local": None,
        "rotary_adjacent_pairs": True,
        "rotary_scale": 1,
        "use_NTK_by_parts_rope": False,
        "NTK_by_parts_factor": 1.0,
        "NTK_by_parts_low_freq_factor": 1.0,
        "NTK_by_parts_high_freq_factor": 1.0,
        "old_context_len": 2048,
        "n_ctx": N_CTX,
        "attn_type": "global",
        "window_size": None,
        "attn_scale": math.sqrt(D_QK),
        "use_post_qk_ln": False,
        "normalization_type": None,
        "eps": 1e-6,
    }
    cfg.update(over)
    return cfg


def _their_sin_cos(cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Their ``_calculate_sin_cos_rotary`` (fp32), returning ``(sin, cos)`` like theirs."""
    rotary_dim, n_ctx, base = cfg["rotary_dim"], cfg["n_ctx"], cfg["rotary_base"]
    pos = torch.arange(n_ctx, dtype=torch.float32)
    dim = torch.arange(rotary_dim // 2, dtype=torch.float32)
    if cfg["use_NTK_by_parts_rope"]:
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
        factor = cfg["NTK_by_parts_factor"]
        low, high = cfg["NTK_by_parts_low_freq_factor"], cfg["NTK_by_parts_high_freq_factor"]
        old = cfg["old_context_len"]
        low_wavelen, high_wavelen = old / low, old / high
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        freq = 1 / torch.where(is_medium, smoothed, inv_freq_llama)
    else:
        freq = base ** (dim / (rotary_dim / 2))
    freq = freq.repeat_interleave(2) if cfg["rotary_adjacent_pairs"] else freq.repeat(2)  # (d 2) / (2 d)
    angles = pos[:, None] / freq[None, :]
    return torch.sin(angles), torch.cos(angles)


def _their_params(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n_ov = round(cfg["d_model"] * cfg["expansion_factor"])
    d, h, e = cfg["d_model"], cfg["n_qk_heads"], cfg["d_qk_head"]

    def r(*shape, scale=1.0):
        return scale * torch.randn(*shape, generator=g)

    p = {
        "W_Q": r(h, d, e, scale=0.4),
        "W_K": r(h, d, e, scale=0.4),
        "b_Q": r(h, e, scale=0.2),
        "b_K": r(h, e, scale=0.2),
        "W_V": r(n_ov, d, scale=0.3),
        "b_V": r(n_ov, scale=0.1),
        # decoder rows of very different norms, so decoder-norm gating changes the ranking
        "W_O": r(n_ov, d, scale=0.25)
        * torch.linspace(0.3, 3.0, n_ov)[torch.randperm(n_ov, generator=g)][:, None],
    }
    if cfg["use_decoder_bias"]:
        p["b_D"] = r(d, scale=0.1)
    if cfg["use_post_qk_ln"]:
        p["ln_q.w"] = 1 + r(h, e, scale=0.2)
        p["ln_k.w"] = 1 + r(h, e, scale=0.2)
    return p


def _write_their_checkpoint(
    path: Path, cfg: dict, params: dict, norms: dict[str, float] | None = None, buffers: bool = True
) -> Path:
    """``save_hyperparameters`` + ``save_pretrained`` layout: config.json + sae_weights.safetensors."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=4))
    state = dict(params)
    if buffers:
        state["mask"] = torch.ones(cfg["n_ctx"], cfg["n_ctx"]).tril().bool()
        state["IGNORE"] = torch.tensor(-torch.inf)
        if cfg["positional_embedding_type"] == "rotary":
            state["rotary_sin"], state["rotary_cos"] = _their_sin_cos(cfg)
    for hook in (cfg["hook_point_in"], cfg["hook_point_out"]):
        # full_state_dict writes torch.empty(()) when no norm was set: any value, here NaN
        value = float("nan") if norms is None else norms[hook]
        state[f"dataset_average_activation_norm.{hook}"] = torch.tensor(value)
    save_file(state, str(path / "sae_weights.safetensors"), {"version": "2.0.0b34"})
    return path


def _reference_forward(
    cfg: dict, sd: dict[str, torch.Tensor], x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Their ``decode(encode(x))`` written from their equations: ``(out, feature_acts)``."""
    n_qk = cfg["n_qk_heads"]
    n_ov = sd["W_V"].shape[0]
    b, s, _ = x.shape
    q = torch.einsum("bsd,Qdq->bsQq", x, sd["W_Q"]) + sd["b_Q"]
    k = torch.einsum("bsd,Kdk->bsKk", x, sd["W_K"]) + sd["b_K"]
    v = torch.einsum("bsd,Vd->bsV", x, sd["W_V"]) + sd["b_V"]
    if cfg["use_post_qk_ln"]:  # RMSNormPerHead: x / sqrt(mean(x^2) + eps) * w, before RoPE
        q = q / (q.pow(2).mean(-1, keepdim=True) + cfg["eps"]).sqrt() * sd["ln_q.w"]
        k = k / (k.pow(2).mean(-1, keepdim=True) + cfg["eps"]).sqrt() * sd["ln_k.w"]

    def rotate_every_two(t):
        rot = t.clone()
        if cfg["rotary_adjacent_pairs"]:
            rot[..., ::2] = -t[..., 1::2]
            rot[..., 1::2] = t[..., ::2]
        else:
            n = t.size(-1) // 2
            rot[..., :n] = -t[..., n:]
            rot[..., n:] = t[..., :n]
        return rot

    def apply_rotary(t):
        rd = cfg["rotary_dim"]
        t_rot, t_pass = t[..., :rd], t[..., rd:]
        cos = sd["rotary_cos"][None, : t.size(1), None, :]
        sin = sd["rotary_sin"][None, : t.size(1), None, :]
        return torch.cat([t_rot * cos + rotate_every_two(t_rot) * sin, t_pass], dim=-1)

    if cfg["positional_embedding_type"] == "rotary":
        q, k = apply_rotary(q), apply_rotary(k)
    scores = torch.einsum("bqhd,bkhd->hbqk", q, k) / cfg["attn_scale"]
    mask = sd["mask"][None, None, -s:, -s:]
    pattern = torch.where(mask, scores, torch.tensor(-torch.inf)).softmax(-1)  # (n_qk, b, q, k)
    v4 = v.transpose(1, 2).reshape(b, n_qk, n_ov // n_qk, s).permute(1, 0, 2, 3)  # (n_qk, b, G, k)
    z = torch.einsum("hbqk,hbrk->hbrq", pattern, v4).permute(1, 0, 2, 3).flatten(1, 2).permute(0, 2, 1)
    dec_norm = sd["W_O"].norm(dim=1)
    hidden = z * dec_norm if cfg["sparsity_include_decoder_norm"] else z
    acts = hidden * hidden.gt(0)
    if cfg["act_fn"] == "topk":
        idx = acts.topk(cfg["top_k"], dim=-1).indices
        acts = acts * torch.zeros_like(acts, dtype=torch.bool).scatter(-1, idx, True)
    if cfg["sparsity_include_decoder_norm"]:
        acts = acts / dec_norm
    out = torch.einsum("bps,sd->bpd", acts, sd["W_O"])
    if cfg["use_decoder_bias"]:
        out = out + sd["b_D"]
    return out, acts


def module_state(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "sae_weights.safetensors"))


VARIANTS = {
    "adjacent-ntk-qknorm-partial": dict(
        rotary_adjacent_pairs=True,
        use_NTK_by_parts_rope=True,
        NTK_by_parts_factor=8.0,
        NTK_by_parts_low_freq_factor=1.0,
        NTK_by_parts_high_freq_factor=4.0,
        old_context_len=64,  # wavelengths 6.3 / 63 / 628 fall in all three NTK bands
        rotary_base=100,
        rotary_dim=6,
        use_post_qk_ln=True,
        normalization_type="RMS",
        eps=1e-5,
    ),
    "halfsplit-nobias-plain-gate": dict(
        rotary_adjacent_pairs=False,
        rotary_base=500000,
        use_decoder_bias=False,
        sparsity_include_decoder_norm=False,
        attn_scale=3.0,
        top_k=5,
    ),
    "no-rope-relu": dict(positional_embedding_type="none", act_fn="relu"),
    "halfsplit-partial-qknorm": dict(
        rotary_adjacent_pairs=False, rotary_dim=4, use_post_qk_ln=True, normalization_type="RMS"
    ),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_llamascopium_matches_reference(tmp_path, variant):
    cfg = _their_config(**VARIANTS[variant])
    params = _their_params(cfg, seed=1)
    path = _write_their_checkpoint(tmp_path / variant, cfg, params)
    ours = load_llamascopium_lorsa(path)
    assert ours.cfg.layer == 3
    assert ours.cfg.n_ov_heads == N_OV and ours.cfg.d_qk_head == D_QK
    assert (ours.cfg.rotary is None) == (cfg["positional_embedding_type"] == "none")
    if ours.cfg.rotary is not None:
        assert ours.cfg.rotary.interleaved == cfg["rotary_adjacent_pairs"]
    torch.manual_seed(2)
    for seq in (1, 9, N_CTX):
        x = torch.randn(3, seq, D_MODEL)
        ref_out, ref_acts = _reference_forward(cfg, module_state(path), x)
        out, cache = ours(x, return_cache=True)
        assert (out - ref_out).abs().max().item() < TOL, variant
        # same heads active; our head activation = theirs x ||W_O[h]|| when the gate includes it
        scale = params["W_O"].norm(dim=1) if cfg["sparsity_include_decoder_norm"] else torch.ones(N_OV)
        assert torch.equal(cache.z > 0, ref_acts > 0)
        assert (cache.z - ref_acts * scale).abs().max().item() < TOL


def test_llamascopium_dataset_norm_is_folded(tmp_path):
    cfg = _their_config(norm_activation="dataset-wise", use_post_qk_ln=True, normalization_type="RMS")
    params = _their_params(cfg, seed=3)
    norms = {HOOK_IN: 7.5, HOOK_OUT: 0.8}
    path = _write_their_checkpoint(tmp_path / "dw", cfg, params, norms=norms)
    # a top-level dataset-wise folder is ambiguous (train_lorsa folds without rewriting config.json)
    with pytest.raises(CheckpointError, match="does not say whether the weights"):
        load_llamascopium_lorsa(path)
    ours = load_llamascopium_lorsa(path, weights_folded=False)
    info = ours.cfg.extra["llamascopium"]
    assert info["dataset_norm_folded_by_loader"]
    assert info["dataset_average_activation_norm"] == pytest.approx(norms)  # stored as fp32 scalars
    s_in, s_out = math.sqrt(D_MODEL) / norms[HOOK_IN], math.sqrt(D_MODEL) / norms[HOOK_OUT]
    torch.manual_seed(4)
    x = 2.0 * torch.randn(2, 11, D_MODEL)  # raw (un-normalised) activations
    ref, _ = _reference_forward(cfg, module_state(path), x * s_in)
    assert (ours(x) - ref / s_out).abs().max().item() < TOL
    # weights_folded=True: the same files are taken as already folded -> no rescaling at all
    as_folded = load_llamascopium_lorsa(path, weights_folded=True)
    ref_raw, _ = _reference_forward(cfg, module_state(path), x)
    assert (as_folded(x) - ref_raw).abs().max().item() < TOL
    assert not as_folded.cfg.extra["llamascopium"]["dataset_norm_folded_by_loader"]


def test_llamascopium_inference_ignores_norm_scalars(tmp_path):
    # "inference": folded already; the scalars full_state_dict keeps writing (here NaN) are ignored
    cfg = _their_config(norm_activation="inference")
    path = _write_their_checkpoint(tmp_path / "inf", cfg, _their_params(cfg))
    ours = load_llamascopium_lorsa(path)
    x = torch.randn(1, 6, D_MODEL)
    assert (ours(x) - _reference_forward(cfg, module_state(path), x)[0]).abs().max().item() < TOL
    # but unfolding with garbage norms is refused
    with pytest.raises(CheckpointError, match="positive finite norm"):
        load_llamascopium_lorsa(path, weights_folded=False)


def test_llamascopium_then_our_format_roundtrip(tmp_path):
    cfg = _their_config(**VARIANTS["adjacent-ntk-qknorm-partial"])
    path = _write_their_checkpoint(tmp_path / "src", cfg, _their_params(cfg, seed=5))
    ours = load_llamascopium_lorsa(path, dtype=torch.float64)
    assert ours.W_Q.dtype == torch.float64
    again = load_lorsa(save_lorsa(ours, tmp_path / "ours"))
    assert again.cfg == ours.cfg and again.cfg.extra["llamascopium"]["hook_point_in"] == HOOK_IN
    x = torch.randn(2, 5, D_MODEL, dtype=torch.float64)
    assert torch.equal(ours(x), again(x))


def _write(tmp_path, name, cfg_over=None, edit_params=None, **kw):
    params = _their_params(_their_config())
    cfg = _their_config(**(cfg_over or {}))
    if edit_params:
        edit_params(params)
    return _write_their_checkpoint(tmp_path / name, cfg, params, **kw)


@pytest.mark.parametrize(
    ("name", "make", "error", "needles"),
    [
        (
            "missing",
            lambda t: _write(t, "a", edit_params=lambda p: p.pop("W_V")),
            CheckpointError,
            ["W_V", "missing"],
        ),
        (
            "shape",
            lambda t: _write(t, "b", edit_params=lambda p: p.update(b_Q=torch.zeros(2, 4))),
            CheckpointError,
            ["'b_Q'", "(2, 4)"],
        ),
        (
            "extra",
            lambda t: _write(
                t, "c", edit_params=lambda p: p.update({"smolgen.compress.weight": torch.zeros(1)})
            ),
            CheckpointError,
            ["unexpected", "smolgen.compress.weight"],
        ),
        (
            "sae-type",
            lambda t: _write(t, "d", {"sae_type": "sae"}),
            CheckpointError,
            ["config.json", "sae_type"],
        ),
        (
            "no-norms",
            # a trainer checkpoint folder: read as unfolded, so the missing scalars are reported
            lambda t: _write(t, "e/checkpoints/step_1", {"norm_activation": "dataset-wise"}),
            CheckpointError,
            [HOOK_IN],
        ),
        (
            "local",
            lambda t: _write(t, "f", {"attn_type": "local", "window_size": 4}),
            UnsupportedArchitectureError,
            ["local"],
        ),
        (
            "jumprelu-without-thresholds",  # act_fn jumprelu is read (2026-11-29); its thresholds must be there
            lambda t: _write(t, "g", {"act_fn": "jumprelu"}),
            CheckpointError,
            ["activation_function.log_jumprelu_threshold", "jumprelu"],
        ),
        (
            "batchtopk",
            lambda t: _write(t, "g2", {"act_fn": "batchtopk"}),
            UnsupportedArchitectureError,
            ["batchtopk"],
        ),
        (
            "ln-qk-norm",
            lambda t: _write(t, "h", {"use_post_qk_ln": True, "normalization_type": "LN"}),
            UnsupportedArchitectureError,
            ["LN"],
        ),
        (
            "token-wise",
            lambda t: _write(t, "i", {"norm_activation": "token-wise"}),
            UnsupportedArchitectureError,
            ["token-wise"],
        ),
        (
            "rotary-scale",
            # rotary_scale=2 is supported (tests/formats/test_peer_fixtures_llamascopium.py)
            lambda t: _write(t, "j", {"rotary_scale": 0}),
            CheckpointError,
            ["rotary_scale"],
        ),
        ("no-d-model", lambda t: _write(t, "k", {"d_model": None}), CheckpointError, ["'d_model'"]),
        (
            # int(16 * 0.3) = 4 OV heads by the peer's rule (their d_sae property), against weights of 16
            "bad-expansion",
            lambda t: _write(t, "l", {"expansion_factor": 0.3}),
            CheckpointError,
            ["'W_O'", "config.json implies (4, 16)"],
        ),
    ],
)
def test_llamascopium_malformed(tmp_path, name, make, error, needles):
    path = make(tmp_path)
    with pytest.raises(error) as info:
        load_llamascopium_lorsa(path)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


def test_llamascopium_rotary_buffers_must_match_config(tmp_path):
    # buffers written with adjacent pairs, config claims half-split: the mapping would be wrong
    cfg = _their_config(rotary_adjacent_pairs=True)
    path = _write_their_checkpoint(tmp_path / "r", cfg, _their_params(cfg))
    _rewrite_llamascopium_config(path, rotary_adjacent_pairs=False)
    with pytest.raises(CheckpointError, match="rotary_cos"):
        load_llamascopium_lorsa(path)


def _rewrite_llamascopium_config(path: Path, **over) -> None:
    raw = json.loads((path / "config.json").read_text())
    raw.update(over)
    (path / "config.json").write_text(json.dumps(raw))


def test_llamascopium_files_and_layer(tmp_path):
    cfg = _their_config()
    # the buffers are optional (validated when present)
    path = _write_their_checkpoint(tmp_path / "ok", cfg, _their_params(cfg), buffers=False)
    assert load_llamascopium_lorsa(path, layer=3).cfg.layer == 3
    with pytest.raises(CheckpointError, match="layer=5"):
        load_llamascopium_lorsa(path, layer=5)
    (path / "sae_weights.safetensors").rename(path / "sae_weights.pt")
    with pytest.raises(CheckpointError, match="sae_weights.pt"):
        load_llamascopium_lorsa(path)
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        load_llamascopium_lorsa(path)
    with pytest.raises(CheckpointError, match="repo id"):
        load_llamascopium_lorsa(str(tmp_path / "a" / "b"))


# =============================================================================== the front door
# formats.load / formats.save / the registry, and the validation layer every reader goes through.
from nnsight_lorsa.errors import ConfigMismatchError, FormatDetectionError  # noqa: E402
from nnsight_lorsa.formats import FORMATS, detect_format, load, load_all, save  # noqa: E402
from nnsight_lorsa.modules.sae import SAEConfig, SparseAutoencoder  # noqa: E402


def _sae(**cfg) -> SparseAutoencoder:
    torch.manual_seed(0)
    m = SparseAutoencoder(SAEConfig(d_in=8, d_sae=16, **cfg))
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape) * 0.1)
    return m


def _edit_json(path: Path, **over) -> None:
    raw = json.loads(path.read_text())
    target = raw["config"] if "config" in raw and isinstance(raw["config"], dict) else raw
    target.update(over)
    path.write_text(json.dumps(raw))


def _raises_naming(error, fn, *needles):
    with pytest.raises(error) as info:
        fn()
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))
    return info.value


def test_load_detects_every_format_and_save_writes_them(tmp_path):
    lorsa, _ = _our_config(), None
    m = Lorsa(lorsa)
    sae = _sae(activation="topk", activation_params={"k": 4})
    save(m, tmp_path / "lorsa")
    save(sae, tmp_path / "ours")
    save(sae, tmp_path / "saelens", format="saelens", hook_name="blocks.1.hook_resid_post")
    save(sae, tmp_path / "run" / "layers.1", format="sparsify")
    expected = {"lorsa": "nnsight_lorsa", "ours": "nnsight_lorsa", "saelens": "saelens",
                "run/layers.1": "sparsify"}
    x = torch.randn(2, 3, 8)
    for sub, fmt in expected.items():
        assert detect_format(tmp_path / sub) == fmt
        loaded = load(tmp_path / sub)
        if sub == "lorsa":
            assert isinstance(loaded, Lorsa) and loaded.cfg == m.cfg
        else:
            assert isinstance(loaded, SparseAutoencoder)
            assert torch.allclose(loaded(x), sae(x), atol=1e-6)
    # explicit format= bypasses detection; a run folder loads by hookpoint
    assert isinstance(load(tmp_path / "saelens", format="saelens"), SparseAutoencoder)
    assert list(load_all(tmp_path / "run")) == ["layers.1"]
    assert set(FORMATS) == {"nnsight_lorsa", "llamascopium", "saelens", "sparsify", "circuit_tracer",
                            "sparse_attention"}


def test_load_detection_errors_list_what_was_looked_for(tmp_path):
    (tmp_path / "empty").mkdir()
    err = _raises_naming(FormatDetectionError, lambda: load(tmp_path / "empty"), "empty",
                         "cfg.json + sae.safetensors", "config.json + model.safetensors", "config.yaml")
    assert isinstance(err, CheckpointError)
    save(_sae(activation="topk", activation_params={"k": 4}), tmp_path / "both", format="sparsify")
    (tmp_path / "both" / "sae_weights.safetensors").write_bytes((tmp_path / "both" / "sae.safetensors").read_bytes())
    _raises_naming(FormatDetectionError, lambda: load(tmp_path / "both"), "ambiguous", "saelens", "sparsify")
    assert isinstance(load(tmp_path / "both", format="sparsify"), SparseAutoencoder)
    _raises_naming(UnsupportedArchitectureError, lambda: load(tmp_path / "both", format="pickle"), "pickle")


def test_load_options_and_save_errors(tmp_path):
    sae = _sae()
    save(sae, tmp_path / "s", format="saelens")
    _raises_naming(ConfigMismatchError, lambda: load(tmp_path / "s", d_model=9), "cfg.json", "d_in")
    save(Lorsa(_our_config()), tmp_path / "l")
    assert isinstance(load(tmp_path / "l", d_model=16, adapter=None), Lorsa)  # shared options: ignored
    with pytest.raises(TypeError, match="norm_scaling_factor"):
        load(tmp_path / "l", norm_scaling_factor=2.0)
    with pytest.raises(TypeError, match="Lorsa"):
        save(Lorsa(_our_config()), tmp_path / "x", format="saelens")
    # llamascopium writes Lorsas only (their SAE format is read-only)
    _raises_naming(ArgumentError, lambda: save(sae, tmp_path / "x", format="llamascopium"),
                   "SparseAutoencoder", "Lorsa")


def test_load_hub_repo_id_fetches_then_detects(tmp_path, monkeypatch):
    import huggingface_hub

    snapshot = tmp_path / "snap"
    save(_sae(), snapshot / "blocks.1", format="saelens", hook_name="blocks.1.hook_resid_post")
    calls = []

    def fake_snapshot_download(repo_id, allow_patterns, local_files_only, revision):
        calls.append((repo_id, sorted(allow_patterns), revision))
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    loaded = load("org/saes:blocks.1", revision="main")
    assert isinstance(loaded, SparseAutoencoder)
    (repo_id, patterns, revision), (_, weights, commit) = calls  # the configs, then the weights they call for
    assert repo_id == "org/saes" and revision == "main" and commit == "snap"  # the first download's commit
    assert "blocks.1/cfg.json" in patterns and "blocks.1/sae_weights.safetensors" in weights


# --------------------------------------------------------------------------- the validation layer
@pytest.fixture
def saelens_dir(tmp_path):
    return save(_sae(), tmp_path / "sae", format="saelens")


@pytest.mark.parametrize(
    ("over", "needles"),
    [
        ({"d_sae": True}, ["'d_sae'", "positive int", "True"]),  # bool is not int
        ({"d_sae": 2.5}, ["'d_sae'", "positive int", "2.5"]),  # non-integral
        ({"d_sae": 16.0}, ["'d_sae'", "positive int"]),  # a float is not a size either
        ({"d_in": -8}, ["'d_in'", "positive int"]),
        ({"d_sae": 10**12}, ["'d_sae'", "largest size"]),  # absurd: refused before allocation
        ({"apply_b_dec_to_input": 1}, ["'apply_b_dec_to_input'", "bool"]),  # an int is not a bool either
    ],
    ids=["bool-size", "non-integral-size", "float-size", "negative-size", "absurd-size", "int-flag"],
)
def test_validation_config_sizes(saelens_dir, over, needles):
    _edit_json(saelens_dir / "cfg.json", **over)
    _raises_naming(CheckpointError, lambda: load(saelens_dir), "cfg.json", *needles)


def test_validation_our_config_sizes(saved):
    _, path = saved
    _rewrite_config(path, lambda r: r["config"].update(n_qk_heads=True))
    _raises_naming(CheckpointError, lambda: load(path), "config.json", "'config.n_qk_heads'", "True")
    _rewrite_config(path, lambda r: r["config"].update(n_qk_heads=2, n_ov_heads=1 << 30))
    _raises_naming(CheckpointError, lambda: load(path), "config.json", "'config.n_ov_heads'", "largest size")


def test_validation_non_finite_tensors(saved, saelens_dir):
    _, path = saved
    _rewrite_tensors(path, lambda t: t["W_V"].view(-1).__setitem__(3, float("nan")))
    _raises_naming(CheckpointError, lambda: load(path), "model.safetensors", "'W_V'", "non-finite")
    tensors = load_file(str(saelens_dir / "sae_weights.safetensors"))
    tensors["b_enc"][0] = float("inf")
    save_file(tensors, str(saelens_dir / "sae_weights.safetensors"))
    _raises_naming(CheckpointError, lambda: load(saelens_dir), "sae_weights.safetensors", "'b_enc'", "non-finite")


def test_validation_wrong_shape_and_dtype(saelens_dir):
    tensors = load_file(str(saelens_dir / "sae_weights.safetensors"))
    tensors["W_dec"] = torch.zeros(16, 9)
    save_file(tensors, str(saelens_dir / "sae_weights.safetensors"))
    _raises_naming(CheckpointError, lambda: load(saelens_dir), "sae_weights.safetensors", "'W_dec'", "(16, 9)",
                   "(16, 8)")
    tensors["W_dec"] = torch.zeros(16, 8, dtype=torch.int64)
    save_file(tensors, str(saelens_dir / "sae_weights.safetensors"))
    _raises_naming(CheckpointError, lambda: load(saelens_dir), "sae_weights.safetensors", "'W_dec'", "dtype")


def test_validation_float_fields_and_scalars(tmp_path, saelens_dir):
    _raises_naming(CheckpointError, lambda: load(saelens_dir, norm_scaling_factor=float("nan")), "cfg.json",
                   "'norm_scaling_factor'", "finite")
    cfg = _their_config()
    path = _write_their_checkpoint(tmp_path / "lls", cfg, _their_params(cfg))
    _rewrite_llamascopium_config(path, attn_scale=float("inf"))
    _raises_naming(CheckpointError, lambda: load(path), "config.json", "'attn_scale'", "finite")
    _rewrite_llamascopium_config(path, attn_scale=None, n_qk_heads=True)
    _raises_naming(CheckpointError, lambda: load(path), "config.json", "'n_qk_heads'", "True")


def test_hook_sites_imports_no_loader():
    import ast

    import nnsight_lorsa.formats.hook_sites as hook_sites

    tree = ast.parse(Path(hook_sites.__file__).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    loaders = {"circuit_tracer", "llamascopium", "llamascopium_sae", "lorsa_format", "saelens",
               "sparse_coder_format", "sparsify", "registry", "reader"}
    assert not {m for m in imported if m and m.split(".")[-1] in loaders}, imported


def test_lorsa_set_from_pretrained(tmp_path):
    from nnsight_lorsa import LorsaSet
    from nnsight_lorsa.assets import default_lorsa_dir
    from nnsight_lorsa.envoy import load_model

    model = load_model()
    whole = LorsaSet.from_pretrained(model, default_lorsa_dir())
    one = LorsaSet.from_pretrained(model, default_lorsa_dir() / "layer_2")  # the layer from cfg.layer
    explicit = LorsaSet.from_pretrained(model, {2: default_lorsa_dir() / "layer_2"}, dtype=torch.float64)
    assert whole.layers == one.layers == explicit.layers == [2]
    assert explicit[2].W_Q.dtype == torch.float64
    whole.save(tmp_path / "set")
    again = LorsaSet.from_pretrained(model, tmp_path / "set")
    assert torch.equal(again[2].W_O, whole[2].W_O)
    with pytest.raises(ConfigMismatchError, match="second Lorsa"):
        LorsaSet.from_pretrained(model, [default_lorsa_dir(), tmp_path / "set"])
    save(_sae(), tmp_path / "notlorsa" / "layer_1")
    with pytest.raises(ConfigMismatchError, match="not a Lorsa"):
        LorsaSet.from_pretrained(model, tmp_path / "notlorsa")
