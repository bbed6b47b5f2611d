"""Our Lorsa head analysis (``nnsight_lorsa.analysis`` / ``viz``) against the Lorsa authors' own: Llamascopium
2.0.0b34's ``LowRankSparseAttention.encode`` / ``encode_z_pattern_for_head``, ``FeatureAnalyzer`` with the Lorsa
post-analysis (top activations, activation counts, the dashboards' z-patterns) and ``DirectLogitAttributor`` (the
OV logit lens), on the same Lorsa files and tokens.

What it checks, per case (``CASES``) and seed (``--seeds``):

1. (our environment) random tiny Hugging Face models under ``WORK/models``: ``llama`` (``LlamaForCausalLM``, RMSNorm),
   ``qwen2`` (``Qwen2ForCausalLM``, q/k/v biases) and ``gpt2`` (``GPT2LMHeadModel``, LayerNorm with a bias): 2 layers,
   d_model 64, 4 heads, vocabulary 1024; weights ~ N(0, 1/fan_in), biases N(0, 0.1²), norm gains 1 ± 0.3.
2. (the peer's venv, ``their_side.py``) a random Lorsa of layer 1 (64 OV heads, ``blocks.1.ln1.hook_normalized`` ->
   ``blocks.1.hook_attn_out``) written by THEIR save code and reloaded by THEIR ``from_pretrained``; on 24 random
   windows of 16 tokens (BOS at column 0) their head activations, z-patterns of every head (first 4 windows),
   ``FeatureAnalyzer.analyze_chunk`` (top 6 windows per head, BOS / padding ignored) with the Lorsa post-analysis,
   and ``DirectLogitAttributor`` (top 10) with the full logit matrix.
3. (our environment, ``our_side.py``) the same folder through ``LorsaSet.from_pretrained``: ``Lorsa.forward`` z,
   ``Lorsa.z_pattern``, ``collect_top_activations`` (``skip_start=1``, distinct windows), ``head_dashboard_data``
   of every head that fired, ``ov_logit_lens`` (whole rows).
4. (``compare.py``) every quantity, relative to the largest of its kind.

Conventions that differ, and how each is aligned (``compare.py``):

- **Decoder norm.** With ``sparsity_include_decoder_norm`` our loader folds ``‖W_O[h]‖`` into the head: our z and
  z-patterns are theirs × the norm, our logit-lens row theirs ÷ it. Aligned per head.
- **Logit lens.** Theirs is ``unembed(ln_final(W_O[h]))`` on their TransformerLens model: ``ln_final`` normalises
  each ``W_O[h]`` to unit RMS (a per-head scale), ``center_unembed`` shifts each row by a constant, and ``unembed``
  adds ``b_U`` — on a LayerNorm model with the final norm's bias folded in: the same per-token offset for every
  head. Ours is ``W_U (g ⊙ P W_O[h])`` per unit of z (``P``: a LayerNorm's centring), no bias. Compared as rows
  centred over the vocabulary and scaled to unit norm, against theirs minus their ``unembed(ln_final(0))`` (the
  bias) and against theirs raw (``rows_max_rel_vs_theirs_raw``: the bias's share, an expected difference on a
  LayerNorm model).
- **Their dashboard z-patterns** drop keys with ``|zp| < 0.01 z`` at the query; ours lists every key (rounded to
  4 decimals). Compared on their kept keys; ours where they dropped is checked below ``0.01 z``.
- **Lorsa input.** Theirs is TransformerLens's ``ln1.hook_normalized`` (before the norm's gain; centred model), ours
  the attention module's input; our loader folds the difference into the weights, so the inputs are not compared,
  their consequences (z) are.

A case agrees when the active sets, counts and top windows are equal, the query positions of the dashboards are
theirs, and every relative difference is ``<= compare.TOL`` (dashboards: within their 4-decimal rounding).

Installing the peer (its own venv; never a dependency of nnsight-lorsa; transformer-lens without its pins)::

    python -m venv V; V/bin/pip install torch==2.13.0; V/bin/pip install llamascopium==2.0.0b34
    V/bin/pip install --no-deps transformer-lens==3.9.0 better-abc

Running (our environment; offline, one thread per process)::

    python scripts/peer_checks/lorsa_analysis/run.py --python V/bin/python --work DIR [--cases a,b] [--seeds 2] \\
        [--out benchmarks/results/lorsa_analysis_vs_llamascopium.json]

``DIR/<case>_s<seed>/`` keeps both sides' files and logs; the exit status is 0 when every case agrees.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any

import torch
from compare import TOL, compare_case

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(HERE.parent))
from peer_io import write_json  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "lorsa_analysis_vs_llamascopium.json"
QK_NORM_NTK = {"use_post_qk_ln": True, "normalization_type": "RMS", "eps": 0.01, "use_NTK_by_parts_rope": True,
               "NTK_by_parts_factor": 8.0, "NTK_by_parts_low_freq_factor": 1.0, "NTK_by_parts_high_freq_factor": 4.0,
               "old_context_len": 8}
PAD_ROWS = {"21": 9, "22": 5, "23": 12}

#: name -> (model, their_side.py options (the seed is added), description)
CASES: dict[str, tuple[str, dict[str, Any], str]] = {
    "llama_topk": ("llama", {}, "Llama (RMSNorm); top-k 8 Lorsa, 4 QK heads, NeoX RoPE"),
    "llama_sidn_gqa": ("llama", {"sidn": True, "adj": True, "n_qk": 2, "k": 4},
                       "sparsity_include_decoder_norm, adjacent-pair RoPE, 2 QK heads (32 OV heads each), top-4"),
    "llama_qknorm_jumprelu": ("llama", {"act": "jumprelu", "extra": QK_NORM_NTK, "qk_scale": 0.4},
                              "JumpReLU Lorsa, RMS QK-norm, NTK-by-parts RoPE, peaked attention"),
    "llama_padded": ("llama", {"pad_rows": PAD_ROWS}, "3 right-padded rows (their mask / our attention_mask)"),
    "qwen2_sidn": ("qwen2", {"sidn": True, "ef": 2}, "Qwen2 (q/k/v biases); 128 OV heads, decoder norm in the gate"),
    "gpt2_topk": ("gpt2", {}, "GPT-2 (LayerNorm with bias); top-k Lorsa"),
    "gpt2_sidn_nope": ("gpt2", {"sidn": True, "pe": "none", "k": 12},
                       "GPT-2; decoder norm in the gate, no positional embedding in the Lorsa, top-12"),
    "gpt2_padded_jumprelu": ("gpt2", {"act": "jumprelu", "pad_rows": PAD_ROWS}, "GPT-2; JumpReLU, right padding"),
}
#: model -> (class, folder under WORK/models: no "llama", "gpt2", ... in it: TransformerLens would guess from it)
MODELS = {"llama": ("LlamaForCausalLM", "m_tiny_l"), "qwen2": ("Qwen2ForCausalLM", "m_tiny_q"),
          "gpt2": ("GPT2LMHeadModel", "m_tiny_g")}


def build_model(name: str, out: Path) -> None:
    """A random tiny model ``name`` of :data:`MODELS`, saved with the embedded tokenizer under ``out``."""
    import transformers

    import nnsight_lorsa

    tok = transformers.AutoTokenizer.from_pretrained(Path(nnsight_lorsa.__file__).parent / "assets"
                                                     / "tinyshakespeare-llama")
    if name == "gpt2":
        cfg = transformers.GPT2Config(n_embd=64, n_head=4, n_layer=2, vocab_size=1024, n_positions=64,
                                      bos_token_id=0, eos_token_id=1, pad_token_id=1)
    else:
        cfg = getattr(transformers, {"llama": "LlamaConfig", "qwen2": "Qwen2Config"}[name])(
            vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-5, bos_token_id=0,
            eos_token_id=1, pad_token_id=1, tie_word_embeddings=False, rope_theta=10000.0)
    torch.manual_seed(0)
    model = getattr(transformers, MODELS[name][0])(cfg).float().eval()
    g = torch.Generator().manual_seed(sorted(MODELS).index(name) + 1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or ".ln_" in n:
                p.copy_((1.0 if n.endswith("weight") else 0.0) + 0.3 * torch.randn(p.shape, generator=g))
            elif "bias" in n:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) / min(p.shape) ** 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    if name == "gpt2":  # TransformerLens 3.9 reads hf_config.n_ctx, which transformers 5's GPT2Config lacks
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, "n_ctx": 64}, indent=1))


def run_side(cmd: list[str], log: Path, env: dict[str, str]) -> tuple[bool, float]:
    t0 = time.time()
    with log.open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=HERE).returncode
    return rc == 0, time.time() - t0


def verdict(res: dict[str, Any]) -> str:
    """``agree``, or ``DIFFERS: <what>``."""
    top, dash, lens = res["top_windows"], res["dashboard_zp"], res["lens"]
    checks = {
        "active sets": res["active_sets_equal"], "z": res["z_max_rel"] <= TOL, "z-patterns": res["zp_max_rel"] <= TOL,
        "counts": res["counts_equal"], "n_tokens": res["n_tokens"]["ours"] == res["n_tokens"]["theirs"],
        "max activation": res["max_act_max_rel"] <= TOL,
        "top windows": top["n_window_set_mismatches"] == 0 and top["values_max_rel"] <= TOL,
        "dashboard query positions": top["n_query_position_mismatches"] == 0,
        "dashboard z-patterns": dash["max_abs_diff"] <= dash["rounding"] + 1e-5
        and dash["ours_where_theirs_dropped_max_frac_of_z"] < 0.01 + 1e-4,
        "logit lens": lens["rows_max_rel_vs_theirs_minus_bias"] <= TOL and lens["top_ids_equal_vs_theirs_minus_bias"],
    }
    bad = [k for k, ok in checks.items() if not ok]
    return "agree" if not bad else "DIFFERS: " + ", ".join(bad)


def run_case(name: str, seed: int, python: str, work: Path, models: dict[str, Path],
             env: dict[str, str]) -> dict[str, Any]:
    model, opts, description = CASES[name]
    opts = {"layer": 1, **opts, "seed": seed}
    case = work / f"{name}_s{seed}"
    if case.exists():
        shutil.rmtree(case)
    case.mkdir(parents=True)
    out: dict[str, Any] = {"description": description, "model": model, "opts": opts}
    their_env = {k: v for k, v in env.items() if k != "PYTHONPATH"}  # the peer env never sees our package
    ok, out["theirs_s"] = run_side([python, str(HERE / "their_side.py"), str(models[model]), str(case),
                                    json.dumps(opts)], case / "theirs.log", their_env)
    if not ok:
        return out | {"status": "error: their side failed", "agree": False}
    ok, out["ours_s"] = run_side([sys.executable, str(HERE / "our_side.py"), str(models[model]), str(case)],
                                 case / "ours.log", env)
    if not ok:
        return out | {"status": "error: our side failed", "agree": False}
    res = compare_case(case)
    status = verdict(res)
    return out | {"status": status, "agree": status == "agree"} | res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--python", required=True, help="the Python of the venv with llamascopium 2.0.0b34")
    p.add_argument("--work", required=True, type=Path, help="working folder (models and one folder per case)")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)} (default all)")
    p.add_argument("--seeds", type=int, default=2, help="seeds per case (1, 2, ...; default %(default)s)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the JSON written (default %(default)s)")
    args = p.parse_args()
    names = [c for c in args.cases.split(",") if c]
    if unknown := [c for c in names if c not in CASES]:
        p.error(f"unknown case(s) {unknown}; known: {list(CASES)}")
    if not Path(args.python).exists():
        p.error(f"--python {args.python}: no such file")

    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    torch.set_num_threads(1)
    work = args.work.resolve()
    models = {}
    for model in sorted({CASES[c][0] for c in names}):
        models[model] = work / "models" / MODELS[model][1]
        build_model(model, models[model])

    cases = {}
    for name in names:
        for seed in range(1, args.seeds + 1):
            key = f"{name}_s{seed}"
            print(f"{key}: {CASES[name][2]} ...", flush=True)
            cases[key] = run_case(name, seed, args.python, work, models, env)
            print(f"{key}: {cases[key]['status']}", flush=True)

    versions = {}
    for side, file in (("theirs", "theirs.json"), ("ours", "ours.json")):
        for key in cases:
            f = work / key / file
            if f.exists():
                versions[side] = json.loads(f.read_text())["versions"]
                break
    done = [c for c in cases.values() if "z_max_rel" in c]

    def worst(get: Any) -> float:
        return max((get(c) for c in done), default=0.0)

    result = {
        "what": "nnsight_lorsa.analysis / viz (Lorsa z, z-patterns, top activations, activation counts, dashboard "
                "z-patterns, OV logit lens) against Llamascopium 2.0.0b34 (scripts/peer_checks/lorsa_analysis/run.py "
                "docstring)",
        "date": date.today().isoformat(),
        "command": shlex.join(["python", *sys.argv]),
        "tolerance": TOL,
        "versions": versions,
        "all_agree": all(c["agree"] for c in cases.values()),
        "summary": {
            "cases": len(cases),
            "z_entries": sum(c["n_active"] for c in done), "z_max_rel": worst(lambda c: c["z_max_rel"]),
            "zp_entries": sum(c["zp_entries"] for c in done), "zp_max_rel": worst(lambda c: c["zp_max_rel"]),
            "max_act_max_rel": worst(lambda c: c["max_act_max_rel"]),
            "top_window_entries": sum(c["top_windows"]["entries"] for c in done),
            "top_values_max_rel": worst(lambda c: c["top_windows"]["values_max_rel"]),
            "dashboard_zp_entries": sum(c["dashboard_zp"]["entries"] for c in done),
            "dashboard_zp_max_abs_diff": worst(lambda c: c["dashboard_zp"]["max_abs_diff"]),
            "lens_rows_max_rel_vs_theirs_minus_bias": worst(lambda c: c["lens"]["rows_max_rel_vs_theirs_minus_bias"]),
            "lens_rows_max_rel_vs_theirs_raw_layernorm": max(
                (c["lens"]["rows_max_rel_vs_theirs_raw"] for c in done if c["model"] == "gpt2"), default=None),
        },
        "cases": cases,
    }
    write_json(args.out, result)
    print(f"wrote {args.out}; all agree: {result['all_agree']}")
    return 0 if result["all_agree"] else 1


if __name__ == "__main__":
    sys.exit(main())
