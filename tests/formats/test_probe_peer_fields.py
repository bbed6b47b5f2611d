"""Per-field probe of circuit-tracer 0.5.0 and Llamascopium 2.0.0b34 files: every case under
``tests/fixtures/peers/probe_<peer>/`` was written AND given its reference output by the peer's own code
(``scripts/peer_fixtures/probe_llamascopium.py``, ``scripts/peer_fixtures/probe_circuit_tracer.py``; their
``cases.json`` names the field value each case probes). For each, our ``formats.load`` with default arguments
either reproduces the peer's output, or raises an error of ours naming the file: never a silent wrong result.
No peer library here. ``scripts/probe_peer_fields.py`` prints the same classification (docs/reliability.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from nnsight_lorsa.errors import LorsaError, UnsupportedArchitectureError
from nnsight_lorsa.formats import load

PEERS = Path(__file__).resolve().parents[1] / "fixtures" / "peers"
#: cases the peer's own reload refuses and we load, on purpose: per-layer transcoders of different widths
#: (circuit-tracer's TranscoderSet asserts one d_transcoder; each layer's math is still its own file's), and a
#: JumpReLU threshold under the bare key ``threshold`` (what nnsight-lorsa wrote before 0.1.1; circuit-tracer's
#: load_state_dict rejects the key)
PEER_REFUSES_WE_LOAD = {"set_d_transcoder_per_layer", "set_bare_threshold_key"}
AMBIGUOUS = "does not say whether the weights"


def _cases() -> list[tuple[str, str, dict[str, Any]]]:
    out = []
    for peer in ("llamascopium", "circuit_tracer"):
        for name, meta in sorted(json.loads((PEERS / f"probe_{peer}" / "cases.json").read_text()).items()):
            if (PEERS / f"probe_{peer}" / name).is_dir():
                out.append((peer, name, meta))
    return out


CASES = _cases()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


@torch.no_grad()
def _error(obj: Any, ref: dict[str, torch.Tensor], key: str = "out") -> float:
    x = ref["x"]
    if "forward" in ref:  # a CLT: x (n_layers, n, d_model)
        return _rel(obj(x.to(obj.W_enc.dtype)), ref["forward"])
    if "forward_0" in ref:  # a transcoder set: layer i's transcoder as circuit-tracer assigns it
        return max(_rel(obj[int(k.split("_")[1])](x.to(obj[int(k.split("_")[1])].W_enc.dtype)), v)
                   for k, v in ref.items() if k.startswith("forward_"))
    dtype = next(obj.parameters()).dtype
    return _rel(obj(x.to(dtype)), ref[key])


def _dtype(obj: Any) -> torch.dtype:
    return obj[0].W_enc.dtype if hasattr(obj, "transcoders") else next(obj.parameters()).dtype


def _bound(ref: dict[str, torch.Tensor], obj: Any) -> float:
    # bf16 files (or modules): against the peer's fp32 reload of the file where there is one (bf16 arithmetic
    # flips TopK choices, theirs too)
    low = ref["x"].dtype == torch.bfloat16 or "out_fp32" in ref or _dtype(obj) == torch.bfloat16
    return 5e-2 if low else 1e-4


def test_probe_covers_the_fields() -> None:
    fields = {meta["field"] for _, _, meta in CASES}
    for field in ("act_fn+norm_activation", "norm_activation", "sparsity_include_decoder_norm", "use_decoder_bias",
                  "use_glu_encoder", "dtype", "n_qk_heads", "positional_embedding_type", "rotary_adjacent_pairs",
                  "rotary_scale", "use_NTK_by_parts_rope", "attn_scale", "use_post_qk_ln/eps", "top_k", "n_ctx",
                  "d_transcoder", "W_skip", "activation_function.threshold", "threshold_{i}",
                  "transcoders (list order)"):
        assert field in fields, field
    assert len(CASES) >= 50


@pytest.mark.parametrize("peer,name,meta", CASES, ids=[f"{p}/{n}" for p, n, _ in CASES])
def test_probe_case_is_correct_or_named(peer: str, name: str, meta: dict[str, Any]) -> None:
    folder = PEERS / f"probe_{peer}" / name
    try:
        obj = load(folder)
    except LorsaError as e:
        assert str(folder) in str(e), f"the error does not name the file: {e}"
        if AMBIGUOUS in str(e):  # with the keyword of the writer that made it, the peer's module
            ref = load_file(str(folder / "reference.safetensors"))
            folded = meta["writer"] == "train"
            again = load(folder, weights_folded=folded)
            # their fold of a JumpReLU SAE leaves the threshold alone: the folded files compute their folded module
            key = "out_folded" if "out_folded" in ref else "out"
            assert _error(again, ref, key) <= 1e-4
        return
    assert "peer_error" not in meta or name in PEER_REFUSES_WE_LOAD, f"the peer refuses it: {meta['peer_error']}"
    if "peer_error" in meta:
        return
    ref = load_file(str(folder / "reference.safetensors"))
    key = "out_fp32" if "out_fp32" in ref else "out"
    err = _error(obj, ref, key)
    assert err <= _bound(ref, obj), f"silent wrong result: max rel {err:.3g} from the peer's output"


def test_train_sae_folder_refused_without_keyword() -> None:
    """llamascopium ``train_sae``: config.json ("dataset-wise") written before training, weights folded at the end;
    loading them as unfolded applied the norm twice (1.8e-2 to 0.35 relative on these cases)."""
    folder = PEERS / "probe_llamascopium" / "sae_train_topk"
    with pytest.raises(LorsaError, match=r"config\.json.*weights_folded=True for runners/train\.py::train_sae"):
        load(folder)


@pytest.mark.parametrize("case", ["set_mixed_activation", "relu"])
def test_a_topk_activation_key_is_refused(tmp_path: Path, case: str) -> None:
    """``config.yaml`` ``activation: topk`` (with ``k``): circuit-tracer 0.5.0 reads no ``activation`` key and runs the
    layer files as ReLU (JumpReLU where one holds a threshold), so the file means two things. It loaded as TopK here
    (L0 2 against circuit-tracer's 12–18) — or, next to a threshold tensor, as JumpReLU with the TopK dropped; now
    refused by name, both ways."""
    import shutil

    if case == "relu":  # ReLU layer files (no threshold), as our writer writes them
        from nnsight_lorsa import save
        from nnsight_lorsa.modules import Transcoder, TranscoderConfig

        save({layer: Transcoder(TranscoderConfig(d_in=8, d_sae=16, layer=layer)) for layer in (0, 1)}, tmp_path / "s",
             format="circuit_tracer")
    else:
        shutil.copytree(PEERS / "probe_circuit_tracer" / case, tmp_path / "s")
    cfg = (tmp_path / "s" / "config.yaml").read_text()
    (tmp_path / "s" / "config.yaml").write_text(cfg + "activation: topk\nk: 3\n")
    (tmp_path / "s" / "checksums.json").unlink(missing_ok=True)
    with pytest.raises(UnsupportedArchitectureError, match=r"'activation' is 'topk', which circuit-tracer \(0\.5\.0\) "
                                                           r"does not read"):
        load(tmp_path / "s")


@pytest.mark.parametrize("name", [n for p, n, meta in CASES if p == "llamascopium" and meta.get("kind") == "sae"
                                  and (PEERS / "probe_llamascopium" / n / "reference.safetensors").is_file()
                                  and "out_fp32" in load_file(str(PEERS / "probe_llamascopium" / n /
                                                                  "reference.safetensors"))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_low_precision_llamascopium_sae_loaded_wider_is_their_fp32_reload(name: str, dtype: torch.dtype) -> None:
    """A bf16 SAE loaded with ``dtype=float32`` (or fp64) computes what their ``from_pretrained(dtype=float32)``
    computes, within the fp32 bound: the decoder-norm (and dataset-norm) folds are cast once, to the loaded dtype
    (they were rounded to bf16 first: 1.7e-4 – 0.31 relative, other TopK picks)."""
    folder = PEERS / "probe_llamascopium" / name
    ref = load_file(str(folder / "reference.safetensors"))
    module = load(folder, dtype=dtype)
    assert next(module.parameters()).dtype == dtype
    with torch.no_grad():
        err = _rel(module(ref["x"].to(dtype)), ref["out_fp32"])
    assert err <= 1e-4, f"{name}: max rel {err:.3g} from their fp32 reload"
