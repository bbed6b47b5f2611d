"""SAELens v6, EleutherAI sparsify and circuit-tracer checkpoints, and our own sparse-coder format.

Files are written in each library's exact layout (random weights) and our modules' outputs are
compared with reference forwards written from that library's equations (< 1e-5, fp32).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from safetensors.torch import save_file

from nnsight_lorsa.errors import ArgumentError, CheckpointError, ConfigMismatchError, UnsupportedArchitectureError
from nnsight_lorsa.formats import load, load_all
from nnsight_lorsa.formats.circuit_tracer import (
    load_circuit_tracer_clt,
    load_circuit_tracer_transcoders,
    save_circuit_tracer_clt,
    save_circuit_tracer_transcoders,
)
from nnsight_lorsa.formats.hook_sites import sparsify_hookpoint_site, transformer_lens_hook_site
from nnsight_lorsa.formats.saelens import load_saelens, save_saelens
from nnsight_lorsa.formats.sparse_coder_format import load_sparse_coder, save_sparse_coder
from nnsight_lorsa.formats.sparsify import load_sparsify, save_sparsify
from nnsight_lorsa.modules.clt import CLTConfig, CrossLayerTranscoder
from nnsight_lorsa.modules.sae import SAEConfig, SparseAutoencoder
from nnsight_lorsa.modules.transcoder import SkipTranscoder, Transcoder, TranscoderConfig

D, F, DOUT = 8, 24, 6
ADAPTER = SimpleNamespace(layer_path=lambda L: f"model.layers.{L}", mlp_path=lambda L: f"model.layers.{L}.mlp")


def _g(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rand(*shape: int, g: torch.Generator, scale: float = 0.5) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * scale


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    assert (a - b).abs().max().item() < 1e-5


# ============================================================================ SAELens
def _saelens_files(tmp: Path, arch: str, *, extra_cfg: dict | None = None, seed: int = 0,
                   hook: str = "blocks.3.hook_resid_post") -> tuple[dict, dict]:
    g = _g(seed)
    is_tc = "transcoder" in arch
    d_out = DOUT if is_tc else D
    st = {"W_enc": _rand(D, F, g=g), "b_enc": _rand(F, g=g, scale=0.1), "W_dec": _rand(F, d_out, g=g),
          "b_dec": _rand(d_out, g=g, scale=0.2)}
    if "jumprelu" in arch:
        st["threshold"] = _rand(F, g=g, scale=0.3)  # some negative: exact clamp to 0
    if "skip" in arch:
        st["W_skip"] = _rand(d_out, D, g=g)
    cfg = {"architecture": arch, "d_in": D, "d_sae": F, "dtype": "float32", "device": "cpu",
           "apply_b_dec_to_input": not is_tc, "normalize_activations": "none", "reshape_activations": "none",
           "metadata": {"hook_name": hook, "model_name": "tiny", "sae_lens_version": "6.0.0"}}
    if is_tc:
        cfg["d_out"] = DOUT
    if arch == "topk":
        cfg.update(k=5, rescale_acts_by_decoder_norm=False)
    cfg.update(extra_cfg or {})
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(st, str(tmp / "sae_weights.safetensors"))
    (tmp / "cfg.json").write_text(json.dumps(cfg))
    return cfg, st


def _saelens_ref(cfg: dict, st: dict, x: torch.Tensor) -> torch.Tensor:
    """SAELens v6 forward (sae_lens/saes/{standard,topk,jumprelu}_sae.py, transcoder.py)."""
    arch = cfg["architecture"]
    sae_in = x - st["b_dec"] if cfg["apply_b_dec_to_input"] else x
    pre = sae_in @ st["W_enc"] + st["b_enc"]
    norms = st["W_dec"].norm(dim=-1)
    rescale = arch == "topk" and cfg.get("rescale_acts_by_decoder_norm")
    if arch == "topk":
        if rescale:
            pre = pre * norms
        vals, idx = pre.topk(cfg["k"], dim=-1, sorted=False)
        acts = torch.zeros_like(pre).scatter(-1, idx, vals.relu())
    elif "jumprelu" in arch:
        acts = pre.relu() * (pre > st["threshold"]).float()
    else:
        acts = pre.relu()
    out = (acts / norms if rescale else acts) @ st["W_dec"] + st["b_dec"]
    if "skip" in arch:
        out = out + x @ st["W_skip"].T
    return out


@pytest.mark.parametrize("arch", ["standard", "topk", "jumprelu", "transcoder", "skip_transcoder",
                                  "jumprelu_transcoder", "jumprelu_skip_transcoder"])
def test_saelens_architectures_match_reference(tmp_path: Path, arch: str) -> None:
    hook = "blocks.3.hook_mlp_out" if "transcoder" in arch else "blocks.3.hook_resid_post"
    cfg, st = _saelens_files(tmp_path, arch, hook=hook)
    m = load_saelens(tmp_path, adapter=ADAPTER, d_model=D)
    want = {"standard": SparseAutoencoder, "topk": SparseAutoencoder, "jumprelu": SparseAutoencoder,
            "transcoder": Transcoder, "jumprelu_transcoder": Transcoder,
            "skip_transcoder": SkipTranscoder, "jumprelu_skip_transcoder": SkipTranscoder}[arch]
    assert type(m) is want
    x = torch.randn(3, 4, D, generator=_g(9))
    _close(m(x), _saelens_ref(cfg, st, x))
    site = m.cfg.extra["saelens"]["site"]
    if "transcoder" in arch:
        assert m.cfg.layer == 3 and site["site"] == "mlp_out" and site["module_path"] == "model.layers.3.mlp"
    else:
        assert m.cfg.hook == "model.layers.3" and site["io"] == "output"


def test_saelens_topk_rescale_acts_by_decoder_norm(tmp_path: Path) -> None:
    cfg, st = _saelens_files(tmp_path, "topk", extra_cfg={"rescale_acts_by_decoder_norm": True})
    m = load_saelens(tmp_path)
    x = torch.randn(5, D, generator=_g(2))
    _close(m(x), _saelens_ref(cfg, st, x))


def test_saelens_expected_average_only_in_is_folded(tmp_path: Path) -> None:
    for arch in ("standard", "skip_transcoder"):
        d = tmp_path / arch
        cfg, st = _saelens_files(d, arch, extra_cfg={"normalize_activations": "expected_average_only_in"})
        s = 2.5
        m = load_saelens(d, norm_scaling_factor=s)
        x = torch.randn(4, D, generator=_g(3))
        # SAELens runs on s·x and its output is in the scaled space; ours takes raw activations
        _close(m(x), _saelens_ref(cfg, st, s * x) / s)
        assert m.cfg.extra["saelens"]["norm_folded"]
    with pytest.warns(UserWarning, match="norm_scaling_factor"):
        unfolded = load_saelens(tmp_path / "standard")
    assert not unfolded.cfg.extra["saelens"]["norm_folded"]


def test_saelens_round_trip(tmp_path: Path) -> None:
    for i, m in enumerate([
        SparseAutoencoder(SAEConfig(d_in=D, d_sae=F, activation="topk", activation_params={"k": 4})),
        SkipTranscoder(TranscoderConfig(d_in=D, d_sae=F, d_out=DOUT, activation="jumprelu")),
    ]):
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn(p.shape, generator=_g(i)) * 0.1)
        if i == 1:
            with pytest.raises(UnsupportedArchitectureError, match="negative"):
                save_saelens(m, tmp_path / "neg")
            with torch.no_grad():
                m.activation.threshold.abs_()
        save_saelens(m, tmp_path / str(i), hook_name="blocks.1.hook_resid_post")
        again = load_saelens(tmp_path / str(i))
        x = torch.randn(3, D, generator=_g(4))
        _close(again(x), m(x))


def test_saelens_bad_input(tmp_path: Path) -> None:
    _saelens_files(tmp_path / "a", "standard")
    with pytest.raises(ConfigMismatchError, match=r"cfg\.json.*d_in"):
        load_saelens(tmp_path / "a", d_model=D + 1)
    _saelens_files(tmp_path / "b", "temporal")
    with pytest.raises(UnsupportedArchitectureError, match=r"cfg\.json.*'architecture'.*temporal"):
        load_saelens(tmp_path / "b")
    _saelens_files(tmp_path / "c", "standard", extra_cfg={"normalize_activations": "covariance_whitening"})
    with pytest.raises(UnsupportedArchitectureError, match="covariance_whitening.*activation_whitening"):
        load_saelens(tmp_path / "c")
    _, st = _saelens_files(tmp_path / "d", "jumprelu")
    del st["threshold"]
    save_file(st, str(tmp_path / "d" / "sae_weights.safetensors"))
    with pytest.raises(CheckpointError, match=r"sae_weights\.safetensors.*missing.*activation\.threshold"):
        load_saelens(tmp_path / "d")
    _, st = _saelens_files(tmp_path / "e", "standard")
    st["W_dec"] = torch.zeros(F, D + 1)
    save_file(st, str(tmp_path / "e" / "sae_weights.safetensors"))
    with pytest.raises(CheckpointError, match=r"sae_weights\.safetensors.*'W_dec'.*\(24, 9\)"):
        load_saelens(tmp_path / "e")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_saelens(tmp_path / "missing")


def _saelens_gated_or_batchtopk(tmp: Path, arch: str, rescale: bool = False) -> tuple[dict, dict]:
    cfg, st = _saelens_files(tmp, "standard")
    g = _g(5)
    cfg["architecture"] = arch
    if arch == "gated":  # sae_lens/saes/gated_sae.py: no b_enc; b_gate, r_mag, b_mag
        del st["b_enc"]
        st.update(b_gate=_rand(F, g=g, scale=0.3), r_mag=_rand(F, g=g, scale=0.5), b_mag=_rand(F, g=g, scale=0.3))
    else:  # sae_lens/saes/batchtopk_sae.py training checkpoint: k (float), topk_threshold (double scalar)
        cfg.update(k=5.0, topk_threshold_lr=0.02, rescale_acts_by_decoder_norm=rescale)
        st["topk_threshold"] = torch.tensor(0.15, dtype=torch.float64)
    save_file(st, str(tmp / "sae_weights.safetensors"))
    (tmp / "cfg.json").write_text(json.dumps(cfg))
    return cfg, st


@pytest.mark.parametrize("arch", ["gated", "batchtopk", "batchtopk_rescaled"])
def test_saelens_gated_and_batchtopk_match_reference(tmp_path: Path, arch: str) -> None:
    cfg, st = _saelens_gated_or_batchtopk(tmp_path, arch.split("_")[0], rescale=arch.endswith("rescaled"))
    m = load_saelens(tmp_path, adapter=ADAPTER, d_model=D)
    x = torch.randn(64, D, generator=_g(9)) * 2
    sae_in = x - st["b_dec"]
    if arch == "gated":  # SAELens GatedSAE.encode / decode
        active = (sae_in @ st["W_enc"] + st["b_gate"] > 0).float()
        acts = active * (sae_in @ (st["W_enc"] * st["r_mag"].exp()) + st["b_mag"]).relu()
        assert m.cfg.activation == "jumprelu" and 0 < int((acts > 0).sum()) < acts.numel()
        _close(m(x), acts @ st["W_dec"] + st["b_dec"])
        return
    norms = st["W_dec"].norm(dim=-1) if cfg["rescale_acts_by_decoder_norm"] else torch.ones(F)
    pre = (sae_in @ st["W_enc"] + st["b_enc"]) * norms
    theta = float(st["topk_threshold"])
    # inference: what SAELens saves it as, a JumpReLU with threshold topk_threshold everywhere
    acts = pre.relu() * (pre > theta).float()
    assert m.cfg.activation == "batchtopk" and m.cfg.activation_params == {"k": 5, "threshold_lr": 0.02}
    assert 0 < int((acts > 0).sum()) < acts.numel()
    _close(m(x), (acts / norms) @ st["W_dec"] + st["b_dec"])
    # training rule: SAELens BatchTopK, k · n of the ReLU'd pre-activations of the whole batch
    flat = pre.relu().flatten()
    top = flat.topk(5 * x.shape[0])
    acts = torch.zeros_like(flat).scatter(-1, top.indices, top.values).view_as(pre)
    _close(m.train()(x), (acts / norms) @ st["W_dec"] + st["b_dec"])


def test_saelens_rescaled_batchtopk_with_expected_average_only_in(tmp_path: Path) -> None:
    """Mutation probe (2026-11-28): the ``norm_scaling_factor`` fold of a rescaled BatchTopK divides its threshold by
    ``s`` (it is in units of ``pre·‖W_dec‖`` and ``W_dec /= s``); multiplying passed every other test. SAELens on
    ``s·x``, its output divided by ``s``, in plain torch."""
    cfg, st = _saelens_gated_or_batchtopk(tmp_path, "batchtopk", rescale=True)
    cfg["normalize_activations"] = "expected_average_only_in"
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    s = 2.5
    m = load_saelens(tmp_path, adapter=ADAPTER, d_model=D, norm_scaling_factor=s).eval()
    x = torch.randn(64, D, generator=_g(9)) * 2
    norms = st["W_dec"].norm(dim=-1)
    pre = ((s * x - st["b_dec"]) @ st["W_enc"] + st["b_enc"]) * norms
    acts = pre.relu() * (pre > float(st["topk_threshold"])).float()
    assert 0 < int((acts > 0).sum()) < acts.numel()
    _close(m(x), ((acts / norms) @ st["W_dec"] + st["b_dec"]) / s)


def test_saelens_gated_and_batchtopk_bad_input(tmp_path: Path) -> None:
    _, st = _saelens_gated_or_batchtopk(tmp_path / "g", "gated")
    del st["r_mag"]
    save_file(st, str(tmp_path / "g" / "sae_weights.safetensors"))
    with pytest.raises(CheckpointError, match=r"sae_weights\.safetensors: missing tensor 'r_mag'"):
        load_saelens(tmp_path / "g")
    cfg, st = _saelens_gated_or_batchtopk(tmp_path / "b", "batchtopk")
    cfg["k"] = 2.5
    (tmp_path / "b" / "cfg.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match=r"cfg\.json: key 'k' is 2\.5"):
        load_saelens(tmp_path / "b")
    cfg["k"] = 5
    (tmp_path / "b" / "cfg.json").write_text(json.dumps(cfg))
    del st["topk_threshold"]
    save_file(st, str(tmp_path / "b" / "sae_weights.safetensors"))
    with pytest.raises(CheckpointError, match="missing tensor 'topk_threshold'"):
        load_saelens(tmp_path / "b")


def test_hook_sites() -> None:
    assert transformer_lens_hook_site("blocks.3.ln2.hook_normalized", ADAPTER).module_path == "model.layers.3.mlp"
    assert transformer_lens_hook_site("blocks.3.hook_mlp_in").site == "mlp_in"
    assert transformer_lens_hook_site("blocks.2.hook_resid_pre", ADAPTER).io == "input"
    assert transformer_lens_hook_site("blocks.3.hook_attn_out").site == "attn_out"
    with pytest.raises(UnsupportedArchitectureError, match="hook_z"):
        transformer_lens_hook_site("blocks.3.attn.hook_z")
    assert sparsify_hookpoint_site("layers.3.mlp", transcode=True, adapter=ADAPTER).io == "input"
    assert sparsify_hookpoint_site("layers.3.mlp", transcode=False).site == "mlp_out"
    assert sparsify_hookpoint_site("layers.5", transcode=False, adapter=ADAPTER).module_path == "model.layers.5"


# ============================================================================ sparsify
def _sparsify_files(tmp: Path, *, transcode: bool, skip: bool, k: int = 5, seed: int = 0,
                    extra_cfg: dict | None = None) -> tuple[dict, dict]:
    g = _g(seed)
    st = {"encoder.weight": _rand(F, D, g=g), "encoder.bias": _rand(F, g=g, scale=0.1),
          "W_dec": _rand(F, D, g=g), "b_dec": _rand(D, g=g, scale=0.2)}
    if skip:
        st["W_skip"] = _rand(D, D, g=g)
    cfg = {"activation": "topk", "expansion_factor": 32, "normalize_decoder": True, "num_latents": F, "k": k,
           "multi_topk": False, "skip_connection": skip, "transcode": transcode, "d_in": D}
    cfg.update(extra_cfg or {})
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(st, str(tmp / "sae.safetensors"))
    (tmp / "cfg.json").write_text(json.dumps(cfg))
    return cfg, st


def _sparsify_ref(cfg: dict, st: dict, x: torch.Tensor) -> torch.Tensor:
    """sparsify SparseCoder.encode/decode/forward (fused_encoder: relu then top-k)."""
    x_in = x if cfg["transcode"] else x - st["b_dec"]
    pre = torch.relu(x_in @ st["encoder.weight"].T + st["encoder.bias"])
    vals, idx = pre.topk(cfg["k"], sorted=False)
    out = torch.zeros_like(pre).scatter(-1, idx, vals) @ st["W_dec"] + st["b_dec"]
    if cfg["skip_connection"]:
        out = out + x @ st["W_skip"].T
    return out


@pytest.mark.parametrize("transcode,skip", [(False, False), (True, False), (True, True)])
def test_sparsify_matches_reference(tmp_path: Path, transcode: bool, skip: bool) -> None:
    cfg, st = _sparsify_files(tmp_path / "layers.2.mlp", transcode=transcode, skip=skip)
    m = load_sparsify(tmp_path, hookpoint="layers.2.mlp", adapter=ADAPTER, d_model=D)
    assert type(m) is (SkipTranscoder if skip else Transcoder if transcode else SparseAutoencoder)
    x = torch.randn(2, 3, D, generator=_g(5))
    _close(m(x), _sparsify_ref(cfg, st, x))
    assert m.cfg.extra["sparsify"]["site"]["io"] == ("input" if transcode else "output")
    again = load_sparsify(save_sparsify(m, tmp_path / "rt"))
    _close(again(x), m(x))


def test_sparsify_many_and_bad_input(tmp_path: Path) -> None:
    _sparsify_files(tmp_path / "layers.0", transcode=False, skip=False)
    _sparsify_files(tmp_path / "layers.10", transcode=False, skip=False, seed=1)
    _sparsify_files(tmp_path / "layers.2", transcode=False, skip=False, seed=2)
    assert list(load_all(tmp_path, format="sparsify")) == ["layers.0", "layers.2", "layers.10"]
    with pytest.raises(ConfigMismatchError, match=r"cfg\.json.*d_in"):
        load_sparsify(tmp_path / "layers.0", d_model=4)
    _sparsify_files(tmp_path / "g", transcode=False, skip=False, extra_cfg={"activation": "groupmax", "k": 7})
    with pytest.raises(CheckpointError, match="groupmax.*multiple of k=7"):
        load_sparsify(tmp_path / "g")
    _, st = _sparsify_files(tmp_path / "m", transcode=True, skip=True)
    del st["W_skip"]
    save_file(st, str(tmp_path / "m" / "sae.safetensors"))
    with pytest.raises(CheckpointError, match=r"sae\.safetensors.*missing.*W_skip"):
        load_sparsify(tmp_path / "m")
    _, st = _sparsify_files(tmp_path / "s", transcode=False, skip=False)
    st["encoder.bias"] = torch.zeros(F + 1)
    save_file(st, str(tmp_path / "s" / "sae.safetensors"))
    with pytest.raises(CheckpointError, match=r"sae\.safetensors.*'encoder\.bias'"):
        load_sparsify(tmp_path / "s")


# ============================================================================ circuit-tracer
def _ct_set_files(tmp: Path, n: int, *, skip: bool, jump: bool) -> list[dict]:
    tmp.mkdir(parents=True, exist_ok=True)
    states = []
    for layer in range(n):
        g = _g(10 + layer)
        st = {"W_enc": _rand(F, D, g=g), "W_dec": _rand(F, D, g=g), "b_enc": _rand(F, g=g, scale=0.1),
              "b_dec": _rand(D, g=g, scale=0.2)}
        if skip:
            st["W_skip"] = _rand(D, D, g=g)
        if jump:
            st["activation_function.threshold"] = _rand(F, g=g, scale=0.3).abs()
        save_file(st, str(tmp / f"layer_{layer}.safetensors"))
        states.append(st)
    (tmp / "config.yaml").write_text(yaml.safe_dump({
        "model_name": "org/tiny", "model_kind": "transcoder_set", "feature_input_hook": "mlp.hook_in",
        "feature_output_hook": "mlp.hook_out", "scan": "tiny-scan",
        "transcoders": [f"hf://org/tiny-tc/layer_{i}.safetensors" for i in range(n)]}))
    return states


def _ct_slt_ref(st: dict, x: torch.Tensor) -> torch.Tensor:
    """SingleLayerTranscoder.forward: F.linear(x, W_enc, b_enc) -> act -> @ W_dec + b_dec (+ x @ W_skip.T)."""
    pre = torch.nn.functional.linear(x, st["W_enc"], st["b_enc"])
    th = st.get("activation_function.threshold")
    acts = pre * (pre > th) if th is not None else pre.relu()
    out = acts @ st["W_dec"] + st["b_dec"]
    return out + x @ st["W_skip"].T if "W_skip" in st else out


@pytest.mark.parametrize("skip,jump", [(False, False), (True, True)])
def test_circuit_tracer_transcoder_set(tmp_path: Path, skip: bool, jump: bool) -> None:
    states = _ct_set_files(tmp_path, 3, skip=skip, jump=jump)
    ts = load(tmp_path, format="circuit_tracer", d_model=D)
    assert len(ts) == 3 and ts.feature_input_hook == "mlp.hook_in" and ts.scan == "tiny-scan"
    x = torch.randn(4, D, generator=_g(6))
    for layer, st in enumerate(states):
        assert isinstance(ts[layer], SkipTranscoder if skip else Transcoder) and ts[layer].cfg.layer == layer
        _close(ts[layer](x), _ct_slt_ref(st, x))
    again = load_circuit_tracer_transcoders(save_circuit_tracer_transcoders(ts.transcoders, tmp_path / "rt"))
    for layer in range(3):
        _close(again[layer](x), ts[layer](x))


def _ct_clt_files(tmp: Path, n: int, *, skip: bool, jump: bool) -> dict:
    """Following CrossLayerTranscoder.to_safetensors."""
    tmp.mkdir(parents=True, exist_ok=True)
    g = _g(42)
    ref = {"W_enc": _rand(n, F, D, g=g), "b_enc": _rand(n, F, g=g, scale=0.1), "b_dec": _rand(n, D, g=g, scale=0.2),
           "W_dec": [_rand(F, n - i, D, g=g) for i in range(n)]}
    if skip:
        ref["W_skip"] = _rand(n, D, D, g=g)
    if jump:
        ref["threshold"] = _rand(n, 1, F, g=g, scale=0.3).abs()
    for i in range(n):
        enc = {f"W_enc_{i}": ref["W_enc"][i].clone(), f"b_enc_{i}": ref["b_enc"][i].clone(),
               f"b_dec_{i}": ref["b_dec"][i].clone()}
        if skip:
            enc[f"W_skip_{i}"] = ref["W_skip"][i].clone()
        if jump:
            enc[f"threshold_{i}"] = ref["threshold"][i].squeeze(0).clone()
        save_file(enc, str(tmp / f"W_enc_{i}.safetensors"))
        save_file({f"W_dec_{i}": ref["W_dec"][i].clone()}, str(tmp / f"W_dec_{i}.safetensors"))
    (tmp / "config.yaml").write_text(yaml.safe_dump({"model_kind": "cross_layer_transcoder",
                                                     "feature_input_hook": "hook_resid_mid",
                                                     "feature_output_hook": "hook_mlp_out"}))
    return ref


def _ct_clt_ref(ref: dict, x: torch.Tensor) -> torch.Tensor:
    """circuit-tracer CLT: encode einsum('lbd,lfd->lbf') + b_enc, act, decode, + input_acts @ W_skip."""
    feats = torch.einsum("lbd,lfd->lbf", x, ref["W_enc"]) + ref["b_enc"][:, None]
    acts = feats * (feats > ref["threshold"]) if "threshold" in ref else feats.relu()
    n = x.shape[0]
    out = torch.zeros_like(x) + ref["b_dec"][:, None]
    for src in range(n):
        for j in range(n - src):
            out[src + j] = out[src + j] + acts[src] @ ref["W_dec"][src][:, j]
    if "W_skip" in ref:
        out = out + x @ ref["W_skip"]
    return out


@pytest.mark.parametrize("skip,jump", [(False, False), (True, True)])
def test_circuit_tracer_clt(tmp_path: Path, skip: bool, jump: bool) -> None:
    ref = _ct_clt_files(tmp_path, 3, skip=skip, jump=jump)
    clt = load(tmp_path, format="circuit_tracer")
    assert isinstance(clt, CrossLayerTranscoder) and clt.cfg.skip == skip
    assert clt.cfg.extra["circuit_tracer"]["feature_output_hook"] == "hook_mlp_out"
    x = torch.randn(3, 5, D, generator=_g(7))
    _close(clt(x), _ct_clt_ref(ref, x))
    if skip:  # circuit-tracer 0.5.0's load_clt reads no W_skip_{i}: refused rather than dropped there
        with pytest.raises(UnsupportedArchitectureError, match="skip"):
            save_circuit_tracer_clt(clt, tmp_path / "rt")
        return
    again = load_circuit_tracer_clt(save_circuit_tracer_clt(clt, tmp_path / "rt"))
    _close(again(x), clt(x))


def test_circuit_tracer_bad_input(tmp_path: Path) -> None:
    _ct_clt_files(tmp_path / "a", 3, skip=True, jump=False)
    with pytest.raises(ConfigMismatchError, match=r"W_enc_0\.safetensors.*d_model"):
        load_circuit_tracer_clt(tmp_path / "a", d_model=D + 2)
    (tmp_path / "a" / "W_dec_1.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"W_dec_1\.safetensors"):
        load_circuit_tracer_clt(tmp_path / "a")
    _ct_clt_files(tmp_path / "b", 2, skip=True, jump=False)
    save_file({"W_enc_1": torch.zeros(F, D), "b_enc_1": torch.zeros(F), "b_dec_1": torch.zeros(D)},
              str(tmp_path / "b" / "W_enc_1.safetensors"))
    with pytest.raises(CheckpointError, match=r"W_enc_1\.safetensors.*missing.*W_skip_1"):
        load_circuit_tracer_clt(tmp_path / "b")
    _ct_set_files(tmp_path / "c", 2, skip=False, jump=False)
    save_file({"W_enc": torch.zeros(F, D), "W_dec": torch.zeros(F, D + 1), "b_enc": torch.zeros(F),
               "b_dec": torch.zeros(D)}, str(tmp_path / "c" / "layer_1.safetensors"))
    with pytest.raises(CheckpointError, match=r"layer_1\.safetensors.*'W_dec'"):
        load_circuit_tracer_transcoders(tmp_path / "c")
    (tmp_path / "c" / "config.yaml").write_text("model_kind: spline_clt\n")
    with pytest.raises(UnsupportedArchitectureError, match=r"config\.yaml.*spline_clt"):
        load(tmp_path / "c", format="circuit_tracer")
    # JumpReLU threshold: circuit-tracer's key, or the bare key nnsight-lorsa wrote before; never both
    states = _ct_set_files(tmp_path / "d", 1, skip=False, jump=True)
    th = states[0].pop("activation_function.threshold")
    save_file({**states[0], "threshold": th}, str(tmp_path / "d" / "layer_0.safetensors"))
    x = torch.randn(4, D, generator=_g(6))
    _close(load_circuit_tracer_transcoders(tmp_path / "d")[0](x),
           _ct_slt_ref({**states[0], "activation_function.threshold": th}, x))
    save_file({**states[0], "threshold": th, "activation_function.threshold": th.clone()},
              str(tmp_path / "d" / "layer_0.safetensors"))
    with pytest.raises(CheckpointError, match=r"layer_0\.safetensors.*both"):
        load_circuit_tracer_transcoders(tmp_path / "d")
    topk = Transcoder(TranscoderConfig(d_in=D, d_sae=F, activation="topk", activation_params={"k": 2}))
    with pytest.raises(UnsupportedArchitectureError, match=r"layer 0.*'topk'.*circuit-tracer.*no k"):
        save_circuit_tracer_transcoders({0: topk}, tmp_path / "e")
    relu = Transcoder(TranscoderConfig(d_in=D, d_sae=F, activation="relu"))
    for layers in ([1], [0, 2]):  # circuit-tracer's list of files gives each its layer by place: 0..n-1 only
        with pytest.raises(ArgumentError, match=rf"layers 0\.\.n-1.*got layers {layers}".replace("[", r"\[")):
            save_circuit_tracer_transcoders(dict.fromkeys(layers, relu), tmp_path / "f")
        assert not (tmp_path / "f").exists()


# ============================================================================ our own format
def test_own_format_round_trip_and_errors(tmp_path: Path) -> None:
    mods = [
        SparseAutoencoder(SAEConfig(d_in=D, d_sae=F, activation="jumprelu", hook="model.layers.1")),
        Transcoder(TranscoderConfig(d_in=D, d_sae=F, d_out=DOUT, activation="topk", activation_params={"k": 3})),
        SkipTranscoder(TranscoderConfig(d_in=D, d_sae=F, layer=2)),
        CrossLayerTranscoder(CLTConfig(d_in=D, d_sae=F, n_layers=3, skip=True, activation="jumprelu")),
    ]
    for i, m in enumerate(mods):
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn(p.shape, generator=_g(i)) * 0.1)
        again = load_sparse_coder(save_sparse_coder(m, tmp_path / str(i)), d_model=D)
        assert type(again) is type(m) and again.cfg == m.cfg
        x = torch.randn(3, 2, D, generator=_g(8))
        _close(again(x), m(x))
    with pytest.raises(ConfigMismatchError, match=r"config\.json.*d_in"):
        load_sparse_coder(tmp_path / "0", d_model=D + 1)
    st = {k: v for k, v in mods[2].state_dict().items() if k != "W_skip"}
    save_file({k: v.contiguous() for k, v in st.items()}, str(tmp_path / "2" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*missing.*W_skip"):
        load_sparse_coder(tmp_path / "2")
    doc = json.loads((tmp_path / "1" / "config.json").read_text())
    doc["kind"] = "crosscoder"
    (tmp_path / "1" / "config.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=r"config\.json.*'kind'.*crosscoder"):
        load_sparse_coder(tmp_path / "1")


# ============================================================================ Llamascopium SAEs / transcoders
def _lls_files(tmp: Path, *, act: str, include_norm: bool, norm: str, transcoder: bool = False,
               use_bias: bool = True) -> tuple[dict, dict, dict]:
    g = _g(77)
    hook_in = "blocks.2.ln2.hook_normalized" if transcoder else "blocks.2.hook_resid_post"
    hook_out = "blocks.2.hook_mlp_out" if transcoder else hook_in
    st = {"W_E": _rand(D, F, g=g), "b_E": _rand(F, g=g, scale=0.1), "W_D": _rand(F, D, g=g)}
    if use_bias:
        st["b_D"] = _rand(D, g=g, scale=0.2)
    if act == "jumprelu":
        st["activation_function.log_jumprelu_threshold"] = _rand(F, g=g, scale=0.3) - 1.0
    norms = {hook_in: 3.0, hook_out: 0.7}
    full = dict(st)
    for hook, v in norms.items():
        full[f"dataset_average_activation_norm.{hook}"] = torch.tensor(v)
    cfg = {"sae_type": "sae", "d_model": D, "expansion_factor": F / D, "act_fn": act, "top_k": 5,
           "use_decoder_bias": use_bias, "use_glu_encoder": False, "sparsity_include_decoder_norm": include_norm,
           "norm_activation": norm, "hook_point_in": hook_in, "hook_point_out": hook_out,
           "jumprelu_threshold_window": 2.0, "use_triton_kernel": False}
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(full, str(tmp / "sae_weights.safetensors"))
    (tmp / "config.json").write_text(json.dumps(cfg))
    return cfg, st, norms


def _lls_ref(cfg: dict, st: dict, norms: dict, x: torch.Tensor) -> torch.Tensor:
    """Llamascopium SparseAutoEncoder.encode/decode, with dataset-wise normalize/denormalize."""
    dataset = cfg["norm_activation"] == "dataset-wise"
    s_in = D ** 0.5 / norms[cfg["hook_point_in"]] if dataset else 1.0
    s_out = D ** 0.5 / norms[cfg["hook_point_out"]] if dataset else 1.0
    pre = (x * s_in) @ st["W_E"] + st["b_E"]
    n = st["W_D"].norm(dim=1)
    if cfg["sparsity_include_decoder_norm"]:
        pre = pre * n
    if cfg["act_fn"] == "relu":
        acts = pre * pre.gt(0)
    elif cfg["act_fn"] == "topk":
        r = pre * pre.gt(0)
        vals, idx = r.topk(cfg["top_k"], dim=-1)
        acts = torch.zeros_like(r).scatter(-1, idx, vals)
    else:
        acts = pre * pre.gt(st["activation_function.log_jumprelu_threshold"].exp())
    if cfg["sparsity_include_decoder_norm"]:
        acts = acts / n
    out = acts @ st["W_D"] + st.get("b_D", 0)
    return out / s_out


@pytest.mark.parametrize("act,include_norm,norm,transcoder", [
    ("relu", True, "dataset-wise", False), ("topk", True, "inference", False),
    ("jumprelu", True, "dataset-wise", True), ("jumprelu", False, "dataset-wise", False),
    ("topk", False, "dataset-wise", True),
])
def test_llamascopium_sae_matches_reference(tmp_path: Path, act: str, include_norm: bool, norm: str,
                                            transcoder: bool) -> None:
    from nnsight_lorsa.formats.llamascopium_sae import load_llamascopium_sae

    cfg, st, norms = _lls_files(tmp_path, act=act, include_norm=include_norm, norm=norm, transcoder=transcoder,
                                use_bias=act != "topk")
    # a plain "dataset-wise" folder: the files cannot say whether the weights are folded (the keyword says)
    kw = {"weights_folded": False} if norm == "dataset-wise" else {}
    m = load_llamascopium_sae(tmp_path, adapter=ADAPTER, d_model=D, **kw)
    assert type(m) is (Transcoder if transcoder else SparseAutoencoder)
    x = torch.randn(3, 4, D, generator=_g(11)) * 3
    _close(m(x), _lls_ref(cfg, st, norms, x))
    if transcoder:
        assert m.cfg.layer == 2 and m.cfg.extra["llamascopium"]["site_out"]["module_path"] == "model.layers.2.mlp"


def test_llamascopium_sae_bad_input(tmp_path: Path) -> None:
    from nnsight_lorsa.formats.llamascopium_sae import load_llamascopium_sae

    _lls_files(tmp_path / "a", act="relu", include_norm=True, norm="dataset-wise")
    with pytest.raises(ConfigMismatchError, match=r"config\.json.*d_model"):
        load_llamascopium_sae(tmp_path / "a", d_model=D * 2)
    _lls_files(tmp_path / "b", act="batchtopk", include_norm=True, norm="inference")
    with pytest.raises(UnsupportedArchitectureError, match=r"config\.json.*batchtopk"):
        load_llamascopium_sae(tmp_path / "b")
    _, st, _ = _lls_files(tmp_path / "c", act="jumprelu", include_norm=True, norm="inference")
    del st["activation_function.log_jumprelu_threshold"]
    save_file(st, str(tmp_path / "c" / "sae_weights.safetensors"))
    with pytest.raises(CheckpointError, match=r"sae_weights\.safetensors.*missing.*log_jumprelu_threshold"):
        load_llamascopium_sae(tmp_path / "c")
    # dataset-wise without the norm scalars cannot be folded
    _, st, _ = _lls_files(tmp_path / "d", act="relu", include_norm=True, norm="dataset-wise")
    save_file(st, str(tmp_path / "d" / "sae_weights.safetensors"))
    with pytest.raises(CheckpointError, match=r"sae_weights\.safetensors.*dataset_average_activation_norm"):
        load_llamascopium_sae(tmp_path / "d", weights_folded=False)
    with pytest.raises(CheckpointError, match=r"config\.json.*does not say whether the weights.*weights_folded"):
        load_llamascopium_sae(tmp_path / "d")
    (tmp_path / "d" / "config.json").write_text(json.dumps({"sae_type": "clt", "d_model": D}))
    with pytest.raises(UnsupportedArchitectureError, match=r"config\.json.*'sae_type'.*clt"):
        load_llamascopium_sae(tmp_path / "d")


# ============================================================================ sets through formats.load
def test_clt_set_from_pretrained(tmp_path: Path) -> None:
    from helpers import tiny_nnsight

    from nnsight_lorsa import CLTSet
    from nnsight_lorsa.adapters.registry import get_adapter
    from nnsight_lorsa.formats import save

    model, _ = tiny_nnsight("llama")
    adapter = get_adapter(model)
    clt = CrossLayerTranscoder(CLTConfig(d_in=adapter.d_model, d_sae=8, n_layers=adapter.n_layers,
                                         activation="jumprelu"))
    with torch.no_grad():
        for p in clt.parameters():
            p.add_(torch.randn(p.shape, generator=_g(3)) * 0.1)
    save(clt, tmp_path / "ours")
    save(clt, tmp_path / "ct", format="circuit_tracer")
    x = torch.randn(2, 3, adapter.d_model, generator=_g(4))
    for sub in ("ours", "ct"):
        loaded = CLTSet.from_pretrained(model, tmp_path / sub).clt
        assert loaded.n_layers == adapter.n_layers
        _close(loaded.encode_layer(x, 0), clt.encode_layer(x, 0))
    save(SparseAutoencoder(SAEConfig(d_in=adapter.d_model, d_sae=8)), tmp_path / "sae")
    with pytest.raises(ConfigMismatchError, match="not a cross-layer transcoder"):
        CLTSet.from_pretrained(model, tmp_path / "sae")


def test_saving_a_module_that_is_no_sparse_coder_is_a_named_misuse(tmp_path):
    """Not a file error: the message names the function and the module's type, and nothing is written."""
    from nnsight_lorsa.errors import ArgumentError

    with pytest.raises(ArgumentError, match="save_sparse_coder: cannot save a Linear"):
        save_sparse_coder(torch.nn.Linear(2, 2), tmp_path / "x")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(("stored", "declared", "loaded"), [
    (torch.bfloat16, "float32", torch.float32),        # SAELens computes in fp32: so do we (was bf16)
    (torch.bfloat16, "torch.float64", torch.float64),
    (torch.float32, "bfloat16", torch.float32),         # at least SAELens's precision: the stored fp32 kept
    (torch.float16, "float16", torch.float16),
])
def test_a_saelens_file_loads_in_at_least_the_dtype_its_cfg_says_saelens_computes_in(tmp_path, stored, declared,
                                                                                      loaded):
    """SAELens's ``SAE.from_pretrained`` casts the weights and every input to ``cfg.json``'s ``dtype``; the default
    load is the wider of it and the stored dtype, and computes what fp32 arithmetic on the stored values gives."""
    torch.manual_seed(0)
    sae = SparseAutoencoder(SAEConfig(d_in=16, d_sae=32, activation="relu")).to(stored)
    with torch.no_grad():
        for p in sae.parameters():
            p.normal_(0, 0.3)
    save_saelens(sae, tmp_path / "s", hook_name="blocks.1.hook_resid_post")
    cfg_path = tmp_path / "s" / "cfg.json"
    raw = json.loads(cfg_path.read_text())
    raw["dtype"] = declared
    cfg_path.write_text(json.dumps(raw))
    (tmp_path / "s" / "checksums.json").unlink(missing_ok=True)
    got = load(tmp_path / "s")
    assert {p.dtype for p in got.parameters()} == {loaded}
    assert load(tmp_path / "s", dtype=torch.bfloat16).W_enc.dtype == torch.bfloat16  # dtype= still decides
    x = torch.randn(5, 16, dtype=torch.float64)
    t = {k: v.double() for k, v in sae.state_dict().items()}
    want = torch.relu((x - t["b_dec"]) @ t["W_enc"] + t["b_enc"]) @ t["W_dec"] + t["b_dec"]
    with torch.no_grad():
        out = got(x.to(loaded)).double()
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 5e-3}[loaded]
    assert float((out - want).abs().max()) <= tol * float(want.abs().max())
