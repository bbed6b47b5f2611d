"""Per-field probe cases for circuit-tracer 0.5.0 files, written and re-read by circuit-tracer itself (run in its
venv, never with nnsight-lorsa)::

    V/bin/python scripts/peer_fixtures/probe_circuit_tracer.py OUT_DIR
    python scripts/make_peer_fixtures.py --peer probe_circuit_tracer --python V/bin/python
    # (the latter writes tests/fixtures/peers/probe_circuit_tracer)

One folder per case (``layer_{i}.safetensors`` by ``SingleLayerTranscoder.to_safetensors`` or ``W_enc_{i}`` /
``W_dec_{i}.safetensors`` by ``CrossLayerTranscoder.to_safetensors``, and a ``config.yaml``) with
``reference.safetensors``: ``x`` and ``forward_{i}`` (a set: layer ``i``'s transcoder, as circuit-tracer's
``load_transcoder_set`` assigns it) or ``forward`` (a CLT, ``load_clt``), both from circuit-tracer's own reload
(fp32). A case circuit-tracer's own reload refuses records ``peer_error``. ``OUT_DIR/cases.json`` names the field
each case probes. Classified on our side by ``scripts/probe_peer_fields.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file, save_file

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
from circuit_tracer.transcoder.activation_functions import JumpReLU  # noqa: E402
from circuit_tracer.transcoder.cross_layer_transcoder import CrossLayerTranscoder, load_clt  # noqa: E402
from circuit_tracer.transcoder.single_layer_transcoder import SingleLayerTranscoder, load_transcoder_set  # noqa: E402

D = 8
CPU = torch.device("cpu")
CASES: dict[str, dict[str, Any]] = {}


def _rand(m: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            v = torch.randn(p.shape, generator=g) * 0.3
            p.copy_((v.abs() * 2 if "threshold" in name else v).to(p.dtype))


def _slt(layer: int, d_sae: int, act: str = "relu", skip: bool = False, dtype: torch.dtype = torch.float32,
         d_model: int = D) -> SingleLayerTranscoder:
    fn = JumpReLU(torch.zeros(d_sae), 0.1) if act == "jumprelu" else F.relu
    tc = SingleLayerTranscoder(d_model, d_sae, fn, layer, skip_connection=skip, device=CPU, dtype=dtype)
    _rand(tc, 10 + layer + d_sae)
    return tc


def _yaml(folder: Path, kind: str, files: list[str] | None = None) -> None:
    cfg: dict[str, Any] = {"model_kind": kind, "feature_input_hook": "mlp.hook_in",
                           "feature_output_hook": "mlp.hook_out"}
    if files is not None:
        cfg["transcoders"] = files
    (folder / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))


def _reload_set(folder: Path) -> dict[int, SingleLayerTranscoder]:
    """circuit-tracer's reader (``load_transcoders`` minus the hub): list index = layer."""
    cfg = yaml.safe_load((folder / "config.yaml").read_text())
    paths = {i: str(folder / p) for i, p in enumerate(cfg["transcoders"])}
    ts = load_transcoder_set(paths, scan="s", feature_input_hook="mlp.hook_in", feature_output_hook="mlp.hook_out",
                             device=CPU, dtype=torch.float32, lazy_encoder=False, lazy_decoder=False)
    return dict(enumerate(ts.transcoders))


def transcoder_set(out: Path, name: str, field: str, value: Any, layers: dict[str, SingleLayerTranscoder],
                   order: list[str] | None = None, edit: Any = None) -> None:
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    for fname, tc in layers.items():
        tc.to_safetensors(str(folder / fname))
    _yaml(folder, "transcoder_set", order or list(layers))
    if edit is not None:
        edit(folder)
    x = torch.randn(6, D, generator=torch.Generator().manual_seed(1))
    CASES[name] = {"field": field, "value": value, "kind": "transcoder_set"}
    try:
        peer = _reload_set(folder)
        ref = {"x": x}
        with torch.no_grad():
            for i, tc in peer.items():
                ref[f"forward_{i}"] = tc(x)
        save_file({k: v.contiguous() for k, v in ref.items()}, str(folder / "reference.safetensors"))
    except Exception as e:
        CASES[name]["peer_error"] = f"{type(e).__name__}: {e}"


def clt(out: Path, name: str, field: str, value: Any, act: str = "relu", dtype: torch.dtype = torch.float32,
        edit: Any = None) -> None:
    folder = out / name
    m = CrossLayerTranscoder(3, 12, D, activation_function="jump_relu" if act == "jumprelu" else "relu",
                             lazy_decoder=False, lazy_encoder=False, device=CPU, dtype=dtype)
    _rand(m, 7)
    m.to_safetensors(str(folder))
    _yaml(folder, "cross_layer_transcoder")
    if edit is not None:
        edit(folder)
    x = torch.randn(3, 6, D, generator=torch.Generator().manual_seed(2))
    CASES[name] = {"field": field, "value": value, "kind": "cross_layer_transcoder"}
    try:
        peer = load_clt(str(folder), device=CPU, dtype=torch.float32, lazy_decoder=False)
        with torch.no_grad():
            ref = peer(x)
        save_file({"x": x, "forward": ref.contiguous()}, str(folder / "reference.safetensors"))
    except Exception as e:
        CASES[name]["peer_error"] = f"{type(e).__name__}: {e}"


def _retensor(path: Path, fn: Any) -> None:
    state = load_file(str(path))
    fn(state)
    save_file(state, str(path))


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    L = "layer_{}.safetensors".format
    transcoder_set(out, "set_bf16", "dtype", "bfloat16",
                   {L(i): _slt(i, 16, "jumprelu", dtype=torch.bfloat16) for i in range(2)})
    transcoder_set(out, "set_d_transcoder_per_layer", "d_transcoder", "16 / 24 per layer",
                   {L(0): _slt(0, 16), L(1): _slt(1, 24)})
    transcoder_set(out, "set_mixed_activation", "activation_function.threshold", "layer 0 only",
                   {L(0): _slt(0, 16, "jumprelu"), L(1): _slt(1, 16)})
    transcoder_set(out, "set_mixed_skip", "W_skip", "layer 1 only", {L(0): _slt(0, 16), L(1): _slt(1, 16, skip=True)})
    transcoder_set(out, "set_list_order", "transcoders (list order)", "[layer_1, layer_0]",
                   {L(0): _slt(0, 16), L(1): _slt(1, 16, "jumprelu")}, order=[L(1), L(0)])
    transcoder_set(out, "set_list_names", "transcoders (file names)", "[b.safetensors, a.safetensors]",
                   {"a.safetensors": _slt(1, 16), "b.safetensors": _slt(0, 16, "jumprelu")},
                   order=["b.safetensors", "a.safetensors"])
    transcoder_set(out, "set_d_model_per_layer", "d_model", "8 / 6 per layer",
                   {L(0): _slt(0, 16), L(1): _slt(1, 16, d_model=6)})
    # not written by circuit-tracer's to_safetensors: a threshold under the bare key (Gemma Scope .npz name)
    transcoder_set(out, "set_bare_threshold_key", "threshold (bare key)", "layer file",
                   {L(0): _slt(0, 16), L(1): _slt(1, 16)},
                   edit=lambda f: _retensor(f / L(0), lambda s: s.update(threshold=torch.full((16,), 0.2))))
    transcoder_set(out, "set_log_thresholds", "log_thresholds", "present", {L(0): _slt(0, 16)},
                   edit=lambda f: _retensor(f / L(0), lambda s: s.update(log_thresholds=torch.zeros(16))))
    CASES["set_log_thresholds"]["peer_note"] = "load_relu_transcoder asserts log_thresholds is None"

    clt(out, "clt_bf16", "dtype", "bfloat16", act="jumprelu", dtype=torch.bfloat16)
    clt(out, "clt_threshold_layer0_only", "threshold_{i}", "layer 0 only", act="jumprelu",
        edit=lambda f: _retensor(f / "W_enc_1.safetensors", lambda s: s.pop("threshold_1")))
    clt(out, "clt_d_transcoder_mismatch", "d_transcoder", "layer 1 wider",
        edit=lambda f: _retensor(f / "W_enc_1.safetensors", lambda s: s.update(
            W_enc_1=torch.randn(20, D, generator=torch.Generator().manual_seed(3)), b_enc_1=torch.zeros(20))))
    clt(out, "clt_missing_b_dec", "b_dec_{i}", "absent in layer 2",
        edit=lambda f: _retensor(f / "W_enc_2.safetensors", lambda s: s.pop("b_dec_2")))
    clt(out, "clt_extra_layer_file", "n_layers", "W_enc_3 without W_dec_3",
        edit=lambda f: save_file(load_file(str(f / "W_enc_2.safetensors")), str(f / "W_enc_3.safetensors")))
    (out / "cases.json").write_text(json.dumps(CASES, indent=1, sort_keys=True) + "\n")
    print(json.dumps({k: v.get("peer_error", "ok") for k, v in CASES.items()}, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
