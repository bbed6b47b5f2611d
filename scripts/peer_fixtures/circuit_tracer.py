"""circuit-tracer fixtures, written by circuit-tracer's OWN code (run in its venv, never with nnsight-lorsa)::

    python -m venv V; V/bin/pip install torch==2.13.0
    V/bin/pip install circuit-tracer==0.5.0 "transformers>=4.57,<4.58"
    V/bin/python scripts/peer_fixtures/circuit_tracer.py OUT_DIR     # or scripts/make_peer_fixtures.py

Writes under ``OUT_DIR`` (default ``tests/fixtures/peers/circuit_tracer``):

* ``transcoders_{relu,jumprelu,skip,jumprelu_skip}/``: a 2-layer ``TranscoderSet`` saved with its
  ``to_safetensors`` (``layer_{i}.safetensors``) + a hub-style ``config.yaml`` (circuit-tracer writes
  none; ``load_transcoders`` reads one), re-read with circuit-tracer's ``load_transcoders``;
  ``reference.safetensors``: ``x`` and per layer ``encode_{i}`` / ``decode_{i}`` / ``forward_{i}``.
* ``clt_{relu,jumprelu}/``: a 3-layer ``CrossLayerTranscoder.to_safetensors`` + ``config.yaml``, re-read
  with ``load_clt``; ``reference.safetensors``: ``x (n_layers, n, d)``, ``encode``, ``forward``.
* ``limits.json``: what circuit-tracer's files cannot express, measured with its own code (a
  ``TopK`` transcoder saved and re-loaded comes back as ReLU; a skip CLT comes back without its skip).
* ``graph/``: a tiny GPT-2 (random, seeded; HF ``config.json`` + ``model.safetensors`` + a word-level
  ``tokenizer.json``), its per-layer transcoders (``transcoders/``), and circuit-tracer's own graph JSON
  for a prompt (``circuit_tracer_graph.json``: TransformerLens backend, ``attribute`` +
  ``create_graph_files``) — the reference for our export's node ids.
* ``frontend/``: circuit-tracer's graph frontend (``circuit_tracer/frontend/assets``: ``index.html``,
  ``util.js``, ``style.css``, ``attribution_graph/``, ``feature_examples/``, its MIT ``LICENSE``), copied
  from the installed package; the libraries it loads from CDNs come from the npm registry
  (``tests/fixtures/npm/package.json``).
* ``reverse/result.json`` (when ``OUT_DIR/reverse/`` holds cases our ``save`` wrote): each case loaded
  with circuit-tracer's loaders and compared with our outputs (``ours_outputs.safetensors``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

# this file is named like the package it drives: import the package with this folder off sys.path
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
from circuit_tracer.transcoder.activation_functions import JumpReLU, TopK  # noqa: E402
from circuit_tracer.transcoder.cross_layer_transcoder import CrossLayerTranscoder, load_clt  # noqa: E402
from circuit_tracer.transcoder.single_layer_transcoder import (  # noqa: E402
    SingleLayerTranscoder,
    TranscoderSet,
    load_transcoder_set,
)

sys.path.append(str(HERE))
from _common import (  # noqa: E402
    fixed_inputs,
    load_ours_outputs,
    max_rel,
    randomize_,
    reverse_cases,
    save_reference,
    write_reverse_result,
)

D_MODEL, D_TC, N_SET, N_CLT = 8, 16, 2, 3
CPU = torch.device("cpu")
TOL = 1e-5


def _slt(layer: int, act: str, skip: bool, seed: int) -> SingleLayerTranscoder:
    activation = JumpReLU(torch.zeros(D_TC), 0.1) if act == "jumprelu" else TopK(4) if act == "topk" else F.relu
    tc = SingleLayerTranscoder(D_MODEL, D_TC, activation, layer, skip_connection=skip, device=CPU,
                               dtype=torch.float32)
    randomize_(tc, seed=seed)
    if act == "jumprelu":  # thresholds > 0 with some features below, some above
        with torch.no_grad():
            tc.activation_function.threshold.abs_().mul_(2)
    return tc


def _config(kind: str, files: list[str] | None = None, **extra) -> dict:
    cfg = {"model_kind": kind, "feature_input_hook": "mlp.hook_in" if kind == "transcoder_set" else "hook_resid_mid",
           "feature_output_hook": "mlp.hook_out" if kind == "transcoder_set" else "hook_mlp_out", **extra}
    if files is not None:
        cfg["transcoders"] = files
    return cfg


def _load_set(directory: Path) -> TranscoderSet:
    """circuit-tracer's own reader of a local ``config.yaml`` + layer files (``load_transcoders`` minus the hub:
    ``resolve_transcoder_paths``, its listed paths, or without a list the folder's ``layer_<i>.safetensors``)."""
    cfg = yaml.safe_load((directory / "config.yaml").read_text())
    if "transcoders" in cfg:
        paths = {i: str(directory / p) for i, p in enumerate(cfg["transcoders"])}
    else:  # resolve_transcoder_paths without a list: layer_0 .. layer_{n-1} of the snapshot
        n = len(list(directory.glob("layer_*.safetensors")))
        paths = {i: str(directory / f"layer_{i}.safetensors") for i in range(n)}
    return load_transcoder_set(paths, scan=cfg.get("scan", "local"), feature_input_hook=cfg["feature_input_hook"],
                               feature_output_hook=cfg["feature_output_hook"], device=CPU, dtype=torch.float32,
                               lazy_encoder=False, lazy_decoder=False)


def _set_outputs(ts: TranscoderSet, x: torch.Tensor) -> dict[str, torch.Tensor]:
    out = {}
    with torch.no_grad():
        for i, tc in enumerate(ts):
            acts = tc.encode(x)
            out[f"encode_{i}"] = acts
            out[f"decode_{i}"] = tc.decode(acts, x)
            out[f"forward_{i}"] = tc(x)
    return out


def _clt_outputs(clt: CrossLayerTranscoder, x: torch.Tensor) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return {"encode": clt.encode(x), "forward": clt(x)}


def write_transcoder_sets(out: Path) -> None:
    for seed, (name, act, skip) in enumerate([("relu", "relu", False), ("jumprelu", "jumprelu", False),
                                              ("skip", "relu", True), ("jumprelu_skip", "jumprelu", True)]):
        case = out / f"transcoders_{name}"
        ts = TranscoderSet({i: _slt(i, act, skip, seed=10 * seed + i) for i in range(N_SET)},
                           feature_input_hook="mlp.hook_in", feature_output_hook="mlp.hook_out", scan="tiny-scan")
        ts.to_safetensors(str(case))
        (case / "config.yaml").write_text(yaml.safe_dump(_config(
            "transcoder_set", [f"layer_{i}.safetensors" for i in range(N_SET)], scan="tiny-scan"), sort_keys=False))
        x = fixed_inputs(D_MODEL, seed=seed)
        reread = _load_set(case)
        ref = _set_outputs(ts, x)
        assert all(max_rel(v, _set_outputs(reread, x)[k]) == 0 for k, v in ref.items()), name
        save_reference(case, x=x, **ref)


def _clt(act: str, skip: bool, seed: int) -> CrossLayerTranscoder:
    clt = CrossLayerTranscoder(N_CLT, D_TC, D_MODEL, activation_function="jump_relu" if act == "jumprelu" else "relu",
                               skip_connection=skip, lazy_decoder=False, lazy_encoder=False, device=CPU,
                               dtype=torch.float32)
    randomize_(clt, seed=seed)
    if act == "jumprelu":
        with torch.no_grad():
            clt.activation_function.threshold.abs_().mul_(2)
    return clt


def write_clts(out: Path) -> None:
    for seed, act in enumerate(["relu", "jumprelu"]):
        case = out / f"clt_{act}"
        clt = _clt(act, False, seed=100 + seed)
        clt.to_safetensors(str(case))
        (case / "config.yaml").write_text(yaml.safe_dump(_config("cross_layer_transcoder"), sort_keys=False))
        x = torch.stack([fixed_inputs(D_MODEL, seed=200 + seed + i) for i in range(N_CLT)])
        ref = _clt_outputs(clt, x)
        reread = load_clt(str(case), device=CPU, dtype=torch.float32, lazy_decoder=False)
        assert all(max_rel(v, _clt_outputs(reread, x)[k]) == 0 for k, v in ref.items()), act
        save_reference(case, x=x, **ref)


def write_limits(out: Path, tmp: Path) -> None:
    """What circuit-tracer 0.5.0's own save/load loses (evidence for our named refusals)."""
    x = fixed_inputs(D_MODEL, seed=7)
    topk = _slt(0, "topk", False, seed=3)
    topk.to_safetensors(str(tmp / "topk.safetensors"))
    back = load_transcoder_set({0: str(tmp / "topk.safetensors")}, "s", "mlp.hook_in", "mlp.hook_out", device=CPU,
                               dtype=torch.float32, lazy_encoder=False, lazy_decoder=False)[0]
    with torch.no_grad():
        topk_rel = max_rel(back(x), topk(x))
    clt = _clt("relu", True, seed=5)
    clt.to_safetensors(str(tmp / "clt_skip"))
    clt_back = load_clt(str(tmp / "clt_skip"), device=CPU, dtype=torch.float32, lazy_decoder=False)
    xs = torch.stack([fixed_inputs(D_MODEL, seed=8 + i) for i in range(N_CLT)])
    with torch.no_grad():  # its forward() asserts on a skip CLT (decode without input_acts): decode with them
        skip_rel = max_rel(clt_back.decode(clt_back.encode(xs).to_sparse(), xs),
                           clt.decode(clt.encode(xs).to_sparse(), xs))
    doc = {"topk": {"reloaded_activation": getattr(back.activation_function, "__name__",
                                                   type(back.activation_function).__name__),
                    "max_rel_forward_after_reload": topk_rel},
           "clt_skip": {"reloaded_has_skip": clt_back.W_skip is not None, "max_rel_forward_after_reload": skip_rel}}
    (out / "limits.json").write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


def copy_frontend(out: Path) -> None:
    import shutil

    import circuit_tracer.frontend

    assets = Path(circuit_tracer.frontend.__file__).parent / "assets"
    dest = out / "frontend"
    for name in ("index.html", "util.js", "style.css", "LICENSE"):
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy(assets / name, dest / name)
    for sub in ("attribution_graph", "feature_examples"):
        shutil.copytree(assets / sub, dest / sub, ignore=shutil.ignore_patterns("__pycache__"))


def check_reverse(out: Path) -> None:
    """Load each case our ``save(format='circuit_tracer')`` wrote with circuit-tracer and compare."""
    cases = reverse_cases(out)
    if not cases:
        return
    results = {}
    for case in cases:
        ours = load_ours_outputs(case)
        kind = yaml.safe_load((case / "config.yaml").read_text())["model_kind"]
        try:
            if kind == "transcoder_set":
                got = _set_outputs(_load_set(case), ours["x"])
            else:
                got = _clt_outputs(load_clt(str(case), device=CPU, dtype=torch.float32, lazy_decoder=False), ours["x"])
            rel = {k: max_rel(got[k], v) for k, v in ours.items() if k != "x"}
            results[case.name] = {"pass": bool(rel) and max(rel.values()) <= TOL, "max_rel": max(rel.values()),
                                  "compared": sorted(rel)}
        except Exception as e:  # a load failure is a recorded fail, not a crash
            results[case.name] = {"pass": False, "error": f"{type(e).__name__}: {e}"}
    write_reverse_result(out, results)


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("tests/fixtures/peers/circuit_tracer")
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    write_transcoder_sets(out)
    write_clts(out)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        write_limits(out, Path(tmp))
    if "--no-graph" not in sys.argv:
        from _circuit_tracer_graph import write_graph  # the graph half, in its own file

        write_graph(out / "graph")
    copy_frontend(out)
    check_reverse(out)


if __name__ == "__main__":
    main()
