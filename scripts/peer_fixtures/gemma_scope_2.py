"""GemmaScope-2 transcoder sets and CLTs as circuit-tracer 0.5.0 reads them, with circuit-tracer's OWN loaders
(run in its venv, never with nnsight-lorsa)::

    V/bin/python scripts/peer_fixtures/gemma_scope_2.py [OUT_DIR]
    # or, from our env (make_peer_fixtures finds every scripts/peer_fixtures/<peer>.py):
    python scripts/make_peer_fixtures.py --peer gemma_scope_2 --python V/bin/python \\
        --out tests/fixtures/peers/circuit_tracer/gemma_scope_2

with ``V`` the circuit-tracer venv of ``scripts/peer_fixtures/circuit_tracer.py``. Google's GemmaScope-2 files are
JumpReLU SAEs saved with lower-case keys (``w_enc (d_in, d_sae)``, ``w_dec``, ``b_enc``, ``b_dec``, ``threshold``,
optional ``affine_skip_connection (d_in, d_out)``); no GemmaScope-2 writer exists in circuit-tracer, so the files
here are written with ``safetensors`` in that layout (tiny random weights) and then read with circuit-tracer's own
code: ``utils/hf_utils.py load_transcoders(config)`` for the sets (it picks ``load_gemma_scope_2_transcoder`` because
``repo_id`` contains ``gemma-scope-2`` and the config lists ``transcoders``) and
``transcoder/cross_layer_transcoder.py load_gemma_scope_2_clt`` for the CLTs.

Writes under ``OUT_DIR`` (default ``tests/fixtures/peers/circuit_tracer/gemma_scope_2``):

* ``transcoders/``, ``transcoders_skip/``: a 3-layer set (``config.yaml`` listing ``l{i}/params.safetensors``, the
  nesting of the hub's ``.../layer_{i}_width_.../params.safetensors``); ``reference.safetensors``: ``x`` and per
  layer ``encode_{i}`` / ``forward_{i}`` (circuit-tracer's ``SingleLayerTranscoder``).
* ``clt/``, ``clt_skip/``: a 3-layer CLT, one ``layer_{i}.safetensors`` per layer with ``w_dec (d_sae, n_layers,
  d_out)`` (the entries for layers before ``i`` are random too: circuit-tracer slices them away);
  ``reference.safetensors``: ``x (n_layers, n, d)``, ``encode``, ``forward`` (a skip CLT: ``decode(encode(x), x)``,
  circuit-tracer's ``forward`` asserts on a skip CLT).
* ``limits.json``: circuit-tracer's ``load_gemma_scope_2_clt`` on the paths its ``config.yaml`` lists
  (``range(max(paths.keys()))`` stacks n − 1 layers; the error it raises, recorded). The CLT references are
  computed by the same function given one more key (never opened), so that it reads all n layers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import yaml
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
from circuit_tracer.transcoder.cross_layer_transcoder import load_gemma_scope_2_clt  # noqa: E402
from circuit_tracer.utils.hf_utils import load_transcoders  # noqa: E402

sys.path.append(str(HERE))
from _common import fixed_inputs, max_rel, save_reference  # noqa: E402

D_MODEL, D_SAE, N_LAYERS = 8, 16, 3
CPU = torch.device("cpu")
REPO = "google/gemma-scope-2-270m-pt"  # only its name matters to circuit-tracer's loader choice


def _layer(g: torch.Generator, skip: bool, n_layers: int | None = None) -> dict[str, torch.Tensor]:
    """One GemmaScope-2 file's tensors (their names and layout); thresholds that cut some positive pre-acts."""
    def rnd(*shape: int, scale: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    w_dec = rnd(D_SAE, D_MODEL, scale=0.3) if n_layers is None else rnd(D_SAE, n_layers, D_MODEL, scale=0.3)
    t = {"w_enc": rnd(D_MODEL, D_SAE, scale=0.4), "w_dec": w_dec, "b_enc": rnd(D_SAE, scale=0.2),
         "b_dec": rnd(D_MODEL, scale=0.1), "threshold": torch.rand(D_SAE, generator=g) * 0.6}
    if skip:
        t["affine_skip_connection"] = rnd(D_MODEL, D_MODEL, scale=0.2)
    return t


def _config(kind: str, files: list[str]) -> dict:
    return {"model_kind": kind, "repo_id": REPO, "scan": "gemma-scope-2-tiny", "feature_input_hook": "hook_resid_mid",
            "feature_output_hook": "hook_mlp_out", "transcoders": files}


def write_set(out: Path, name: str, skip: bool, seed: int) -> None:
    case = out / name
    g = torch.Generator().manual_seed(seed)
    files = []
    for i in range(N_LAYERS):
        rel = f"l{i}/params.safetensors"
        (case / rel).parent.mkdir(parents=True, exist_ok=True)
        save_file(_layer(g, skip), str(case / rel))
        files.append(rel)
    (case / "config.yaml").write_text(yaml.safe_dump(_config("transcoder_set", files), sort_keys=False))
    # circuit-tracer opens a listed local path as given (resolve_transcoder_paths): give it absolute ones
    ts = load_transcoders(_config("transcoder_set", [str((case / f).resolve()) for f in files]), device=CPU,
                          dtype=torch.float32, lazy_decoder=False)
    assert [type(tc).__name__ for tc in ts] == ["SingleLayerTranscoder"] * N_LAYERS
    assert all(type(tc.activation_function).__name__ == "JumpReLU" for tc in ts)
    assert all((tc.W_skip is not None) == skip for tc in ts)
    x = fixed_inputs(D_MODEL, n=8, seed=seed)
    ref = {"x": x}
    with torch.no_grad():
        for i, tc in enumerate(ts):
            ref[f"encode_{i}"] = tc.encode(x)
            ref[f"forward_{i}"] = tc(x)
            pre = tc.encode(x, apply_activation_function=False)
            assert bool(((pre > 0) & (ref[f"encode_{i}"] == 0)).any()), "thresholds must cut"
            assert bool((ref[f"encode_{i}"] > 0).any())
    save_reference(case, **ref)


def _clt_paths(case: Path) -> dict[int, str]:
    return {i: str(case / f"layer_{i}.safetensors") for i in range(N_LAYERS)}


def write_clt(out: Path, name: str, skip: bool, seed: int) -> dict:
    case = out / name
    case.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    for i in range(N_LAYERS):
        save_file(_layer(g, skip, N_LAYERS), str(case / f"layer_{i}.safetensors"))
    files = [f"layer_{i}.safetensors" for i in range(N_LAYERS)]
    (case / "config.yaml").write_text(yaml.safe_dump(_config("cross_layer_transcoder", files), sort_keys=False))
    paths = _clt_paths(case)
    try:  # what circuit-tracer does with the n paths config.yaml lists (utils/hf_utils.py load_transcoders)
        load_gemma_scope_2_clt(paths, device=CPU, dtype=torch.float32)
        as_listed = {"loads": True}
    except Exception as e:  # recorded: the test and docs read it
        as_listed = {"loads": False, "error": f"{type(e).__name__}: " + " | ".join(
            line.strip() for line in str(e).strip().splitlines())[:600]}
    # the same function with one more key: range(max(keys)) = range(n), every layer read (the key is never opened)
    clt = load_gemma_scope_2_clt({**paths, N_LAYERS: "never-opened"}, device=CPU, dtype=torch.float32)
    assert clt.n_layers == N_LAYERS and (clt.W_skip is not None) == skip
    x = torch.stack([fixed_inputs(D_MODEL, n=8, seed=seed + 1 + i) for i in range(N_LAYERS)])
    with torch.no_grad():
        acts = clt.encode(x)
        fwd = clt.decode(acts.to_sparse(), x) if skip else clt(x)
        pre = torch.einsum("lbd,lfd->lbf", x, clt.W_enc) + clt.b_enc[:, None]
        assert bool(((pre > 0) & (acts == 0)).any()) and bool((acts > 0).any())
        if not skip:  # forward == decode(encode) without input_acts
            assert max_rel(clt.decode(acts.to_sparse()), fwd) == 0
    save_reference(case, x=x, encode=acts, forward=fwd)
    return {"as_listed": as_listed, "n_layers_files": N_LAYERS}


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("tests/fixtures/peers/circuit_tracer/gemma_scope_2")
    out.mkdir(parents=True, exist_ok=True)
    write_set(out, "transcoders", False, seed=1)
    write_set(out, "transcoders_skip", True, seed=2)
    limits = {name: write_clt(out, name, skip, seed=10 * (k + 1)) for k, (name, skip) in
              enumerate((("clt", False), ("clt_skip", True)))}
    (out / "limits.json").write_text(json.dumps({"load_gemma_scope_2_clt": limits}, indent=1, sort_keys=True) + "\n")
    print(json.dumps(limits, indent=1))


if __name__ == "__main__":
    main()
