"""Regenerate the peer fixtures under ``tests/fixtures/peers/<peer>/``: files written by each peer
library's OWN code (tiny random weights), the peer's own outputs on fixed inputs, and the reverse
direction (what our ``save(..., format=<peer>)`` writes, loaded by the peer and compared).

The peers are never dependencies of nnsight-lorsa: each lives in its own virtual environment::

    python -m venv V; V/bin/pip install torch==2.13.0; V/bin/pip install <peer>

with ``<peer>`` one of ``sae-lens`` (saelens), ``eai-sparsify`` (sparsify), ``circuit-tracer``
(circuit_tracer), ``llamascopium`` (llamascopium). Then, from the repository root, in OUR environment
(the one with nnsight-lorsa installed)::

    python scripts/make_peer_fixtures.py --peer saelens --python V/bin/python

Layout: one script per peer, ``scripts/peer_fixtures/<peer>.py``, run as
``<venv>/bin/python scripts/peer_fixtures/<peer>.py OUT_DIR``; it imports only the peer (and torch /
safetensors), never nnsight-lorsa. Steps for ``--peer NAME``:

1. (our env) if this file has a reverse writer for NAME (:data:`REVERSE`), it saves our modules in
   NAME's format under ``OUT_DIR/reverse/<case>/`` with our outputs on fixed inputs
   (``ours_outputs.safetensors``);
2. (peer env) ``scripts/peer_fixtures/NAME.py OUT_DIR`` writes one folder per fixture case
   ``OUT_DIR/<case>/`` (the peer's files + ``reference.safetensors``: the inputs ``x`` and the peer's
   own outputs) and, when ``OUT_DIR/reverse/`` exists, loads each reverse case in the peer and writes
   ``OUT_DIR/reverse/result.json`` (per case: pass/fail and the max relative error).

``python scripts/make_peer_fixtures.py --peer NAME --measure`` (our env only) prints each case's
relative error against the peer's outputs (the numbers in docs/formats.md); for ``llamascopium`` it
compares our bf16 and fp32 loads of its bf16 files with its bf16 and fp32 reloads on 512 tokens
(:func:`measure_llamascopium_bf16`; the Llamascopium fp32 cases are measured by their test).

The per-field probes (``probe_llamascopium``, ``probe_circuit_tracer``: one folder per math-changing field value,
``cases.json`` naming it) are peers of their own here, run in the llamascopium / circuit-tracer venvs; their
``--measure`` prints ``scripts/probe_peer_fields.py``'s classification (``tests/formats/test_probe_peer_fields.py``).

``tests/formats/test_peer_fixtures_<peer>.py`` loads every case with ``nnsight_lorsa.formats.load``
(format detected) without the peer installed. No pickles are written: safetensors, JSON and YAML only.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PEER_SCRIPTS = ROOT / "scripts" / "peer_fixtures"
FIXTURES = ROOT / "tests" / "fixtures" / "peers"


def _write_ours(module: Any, case: Path, fmt: str, d_in: int, **options: Any) -> None:
    """``save(module, case, format=fmt)`` + ``ours_outputs.safetensors`` (x, feature_acts, sae_out, l0)."""
    import torch
    from safetensors.torch import save_file

    from nnsight_lorsa.formats import save

    save(module, case, format=fmt, **options)
    x = torch.randn(8, d_in, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        acts = module.encode(x)
        ref = {"x": x, "feature_acts": acts, "sae_out": module(x), "l0": (acts != 0).sum(-1)}
    save_file({k: v.contiguous() for k, v in ref.items()}, str(case / "ours_outputs.safetensors"))


def _random_(module: Any, seed: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        threshold = getattr(module.activation, "threshold", None)
        if isinstance(threshold, torch.Tensor):
            threshold.abs_()
    return module.eval()


def _reverse_saelens(out: Path) -> None:
    """Our SAEs / transcoders of every activation SAELens reads, in SAELens layout."""
    from nnsight_lorsa.modules import SAEConfig, SkipTranscoder, SparseAutoencoder, Transcoder, TranscoderConfig

    d, f, hook = 16, 48, "blocks.1.hook_resid_post"
    for i, (name, module) in enumerate({
        "sae_relu": SparseAutoencoder(SAEConfig(d_in=d, d_sae=f)),
        "sae_relu_no_b_dec_in": SparseAutoencoder(SAEConfig(d_in=d, d_sae=f, apply_b_dec_to_input=False)),
        "sae_topk": SparseAutoencoder(SAEConfig(d_in=d, d_sae=f, activation="topk", activation_params={"k": 4})),
        "sae_jumprelu": SparseAutoencoder(SAEConfig(d_in=d, d_sae=f, activation="jumprelu")),
        "sae_abstopk": SparseAutoencoder(SAEConfig(d_in=d, d_sae=f, activation="abstopk",
                                                   activation_params={"k": 4})),
        "sae_relu_layer_norm": SparseAutoencoder(SAEConfig(d_in=d, d_sae=f, normalize_activations="layer_norm")),
        "sae_topk_constant_norm_rescale": SparseAutoencoder(SAEConfig(
            d_in=d, d_sae=f, activation="topk", activation_params={"k": 4},
            normalize_activations="constant_norm_rescale")),
        "transcoder_relu": Transcoder(TranscoderConfig(d_in=d, d_sae=f, d_out=12)),
        "transcoder_jumprelu": Transcoder(TranscoderConfig(d_in=d, d_sae=f, d_out=12, activation="jumprelu")),
        "skip_transcoder_relu": SkipTranscoder(TranscoderConfig(d_in=d, d_sae=f, d_out=12)),
        "skip_transcoder_jumprelu": SkipTranscoder(TranscoderConfig(d_in=d, d_sae=f, d_out=12, activation="jumprelu")),
    }.items()):
        _write_ours(_random_(module, i), out / name, "saelens", d, hook_name=hook)


def _reverse_sparsify(out: Path) -> None:
    """Our coders of every kind sparsify reads, in sparsify layout."""
    from nnsight_lorsa.modules import SAEConfig, SkipTranscoder, SparseAutoencoder, Transcoder, TranscoderConfig

    d, f, topk, groupmax = 16, 64, {"activation": "topk", "activation_params": {"k": 4}}, {
        "activation": "groupmax", "activation_params": {"k": 4}}
    for i, (name, module) in enumerate({
        "sae_topk": SparseAutoencoder(SAEConfig(d_in=d, d_sae=f, **topk)),  # type: ignore[arg-type]
        "sae_groupmax": SparseAutoencoder(SAEConfig(d_in=d, d_sae=f, **groupmax)),  # type: ignore[arg-type]
        "transcoder_topk": Transcoder(TranscoderConfig(d_in=d, d_sae=f, **topk)),  # type: ignore[arg-type]
        "skip_transcoder_topk": SkipTranscoder(TranscoderConfig(d_in=d, d_sae=f, **topk)),  # type: ignore[arg-type]
    }.items()):
        _write_ours(_random_(module, i), out / name, "sparsify", d)


def _reverse_circuit_tracer(out: Path) -> None:
    """Our transcoder sets and CLTs in circuit-tracer layout (``scripts/peer_fixtures/_reverse_circuit_tracer.py``)."""
    sys.path.insert(0, str(PEER_SCRIPTS))
    from _reverse_circuit_tracer import write_reverse  # type: ignore[import-not-found]
    write_reverse(out)


def _reverse_llamascopium(out: Path) -> None:
    """Our Lorsas (RoPE layouts, QK-norm, llama3 RoPE, no RoPE) in Llamascopium layout, with our outputs
    ``x (2, 12, d)``, ``out``, ``z`` (head activations) in ``ours_outputs.safetensors``."""
    import torch
    from safetensors.torch import save_file

    from nnsight_lorsa.formats import save
    from nnsight_lorsa.modules import Lorsa, LorsaConfig, RotaryConfig

    d = 16
    llama3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
    cases = {
        "adjacent": LorsaConfig(d_model=d, n_qk_heads=4, d_qk_head=8, n_ov_heads=32, top_k=5, layer=1,
                                rotary=RotaryConfig(8, 8, 10000.0, True)),
        "neox_partial_qknorm": LorsaConfig(d_model=d, n_qk_heads=2, d_qk_head=8, n_ov_heads=24, top_k=4, layer=0,
                                           rotary=RotaryConfig(8, 4, 500000.0, False), qk_norm=True),
        "llama3": LorsaConfig(d_model=d, n_qk_heads=4, d_qk_head=8, n_ov_heads=32, top_k=6, layer=2,
                              rotary=RotaryConfig(8, 8, 10000.0, False, "llama3", llama3)),
        "no_rope_no_bias": LorsaConfig(d_model=d, n_qk_heads=4, d_qk_head=4, n_ov_heads=16, top_k=3, layer=0,
                                       use_decoder_bias=False),
    }
    for i, (name, cfg) in enumerate(cases.items()):
        module = _random_(Lorsa(cfg), i)
        save(module, out / name, format="llamascopium", n_ctx=32)
        x = torch.randn(2, 12, d, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            y, cache = module(x, return_cache=True)
        save_file({"x": x, "out": y, "z": cache.z}, str(out / name / "ours_outputs.safetensors"))


#: peer -> (our env) writer of ``OUT_DIR/reverse/<case>/`` (our ``save`` in the peer's format)
REVERSE: dict[str, Callable[[Path], None]] = {"saelens": _reverse_saelens, "sparsify": _reverse_sparsify,
                                               "circuit_tracer": _reverse_circuit_tracer,
                                               "llamascopium": _reverse_llamascopium}


def peers() -> list[str]:
    """The peers that have a fixture script (``scripts/peer_fixtures/<peer>.py``)."""
    return sorted(p.stem for p in PEER_SCRIPTS.glob("*.py") if not p.stem.startswith("_"))


def make(peer: str, python: str, out: Path) -> None:
    """Regenerate ``out`` (default ``tests/fixtures/peers/<peer>``) for ``peer`` with the peer's ``python``."""
    script = PEER_SCRIPTS / f"{peer}.py"
    if not script.is_file():
        raise SystemExit(f"no fixture script {script}; peers with one: {peers()}")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    if peer in REVERSE:
        REVERSE[peer](out / "reverse")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the peer env never sees our package
    subprocess.run([python, str(script), str(out)], check=True, env=env, cwd=ROOT)


def measure(out: Path) -> dict[str, Any]:
    """(our env) Load every case under ``out`` (a folder with ``cfg.json``, ``reverse/`` aside) with
    ``nnsight_lorsa.formats.load`` and print its relative max error on ``encode`` / ``forward``
    against ``reference.safetensors`` (or the named error that refused it); returns the worst per dtype."""
    import warnings

    import torch
    from safetensors.torch import load_file

    from nnsight_lorsa.errors import LorsaError
    from nnsight_lorsa.formats import load

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.detach().double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12))

    worst: dict[str, Any] = {}
    for case in sorted(p.parent for p in out.rglob("cfg.json") if "reverse" not in p.relative_to(out).parts):
        name = case.relative_to(out).as_posix()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                has_ref = (case / "reference.safetensors").is_file()
                ref = load_file(str(case / "reference.safetensors")) if has_ref else {}
                kw = {"norm_scaling_factor": float(ref["norm_scaling_factor"])} if "norm_scaling_factor" in ref else {}
                module = load(case, **kw)
        except LorsaError as e:
            print(f"{name}: refused, {type(e).__name__}: {e}")
            continue
        with torch.no_grad():
            acts, y = module.encode(ref["x"]), module(ref["x"])
        errs = (rel(acts, ref["feature_acts"]), rel(y, ref["sae_out"]))
        same_l0 = torch.equal((acts != 0).sum(-1), ref["l0"])
        print(f"{name}: encode {errs[0]:.1e}  forward {errs[1]:.1e}  same L0 {same_l0}")
        key = str(ref["x"].dtype).removeprefix("torch.")
        prev = worst.get(key, [0.0, 0.0, True])
        worst[key] = [max(prev[0], errs[0]), max(prev[1], errs[1]), prev[2] and same_l0]
    print("worst (encode, forward, all L0 equal) by dtype:", worst)
    return worst


#: bf16 Llamascopium cases with ``tokens.safetensors`` -> the ``load`` keywords they need
LLAMASCOPIUM_BF16: dict[str, dict[str, Any]] = {"bf16": {}, "bf16_dataset_wise": {"weights_folded": False}}


def token_stats(out: Any, active: Any, ref_out: Any, ref_active: Any) -> dict[str, float]:
    """Per-token comparison of outputs ``(..., d)`` and active-head masks ``(..., n_heads)`` with a reference:
    ``flips`` (fraction of tokens whose active heads differ), ``max_rel`` (``max|diff| / max|ref|``),
    ``same_heads_max_rel`` (the same over the tokens with equal heads), ``rms_rel`` (``rms(diff) / rms(ref)``)."""
    a, b = out.detach().double().flatten(0, -2), ref_out.double().flatten(0, -2)
    same = (active == ref_active).all(-1).flatten()
    diff, top = (a - b).abs(), b.abs().max()
    return {"tokens": same.numel(), "flips": 1.0 - same.double().mean().item(), "max_rel": float(diff.max() / top),
            "same_heads_max_rel": float(diff[same].max() / top) if same.any() else float("nan"),
            "rms_rel": float(diff.pow(2).mean().sqrt() / b.pow(2).mean().sqrt())}


def measure_llamascopium_bf16(out: Path) -> dict[str, dict[str, dict[str, float]]]:
    """(our env) Each bf16 Llamascopium case's ``tokens.safetensors`` (their bf16 and their fp32 reload on 512
    tokens): our bf16 load (``dtype=torch.bfloat16``) and our default load (fp32) against both
    (:func:`token_stats`); prints and returns ``{case: {comparison: stats}}``."""
    import torch
    from safetensors.torch import load_file

    from nnsight_lorsa.formats import load

    result: dict[str, dict[str, dict[str, float]]] = {}
    for case, options in LLAMASCOPIUM_BF16.items():
        tok = load_file(str(out / case / "tokens.safetensors"))
        theirs, exact = (tok["out"], tok["active"]), (tok["out_fp32"], tok["active_fp32"])
        with torch.no_grad():
            low, low_cache = load(out / case, dtype=torch.bfloat16, **options)(tok["x"], return_cache=True)
            up, up_cache = load(out / case, **options)(tok["x"].float(), return_cache=True)
        result[case] = {
            "their bf16 vs their fp32": token_stats(*theirs, *exact),
            "our bf16 vs their fp32": token_stats(low, low_cache.z != 0, *exact),
            "our bf16 vs their bf16": token_stats(low, low_cache.z != 0, *theirs),
            "our fp32 vs their fp32": token_stats(up, up_cache.z != 0, *exact),
            "our fp32 vs their bf16": token_stats(up, up_cache.z != 0, *theirs),
        }
        for name, r in result[case].items():
            print(f"{case} ({r['tokens']} tokens) {name}: top-k flips {r['flips']:.3f}  max_rel {r['max_rel']:.2g}  "
                  f"same-heads max_rel {r['same_heads_max_rel']:.2g}  rms_rel {r['rms_rel']:.2g}")
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peer", required=True, help=f"one of {peers()}")
    parser.add_argument("--python", help="the python of a venv with that peer installed")
    parser.add_argument("--out", type=Path, default=None, help="default: tests/fixtures/peers/<peer>")
    parser.add_argument("--measure", action="store_true",
                        help="only load the existing fixtures in our env and print each case's error")
    args = parser.parse_args(argv)
    out = args.out or FIXTURES / args.peer
    if args.measure:
        if args.peer.startswith("probe_"):  # the per-field probes: classified by scripts/probe_peer_fields.py
            from probe_peer_fields import main as classify

            classify([str(out)])
        else:
            measure_llamascopium_bf16(out) if args.peer == "llamascopium" else measure(out)
        return
    if not args.python:
        parser.error("--python is required to regenerate fixtures")
    make(args.peer, args.python, out)


if __name__ == "__main__":
    main()
