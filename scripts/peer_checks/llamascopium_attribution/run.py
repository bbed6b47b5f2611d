"""Our ``attribute`` (Lorsa + transcoder attribution graphs, QK tracing) against the Lorsa authors' own: Llamascopium
2.0.0b34's ``llamascopium.circuits.attribution.attribute`` and ``qk_trace``, on the same files and tokens.

What it checks, per case (``CASES``):

1. (our environment) random tiny Hugging Face models under ``WORK/models``: ``llama`` (``LlamaForCausalLM``) and
   ``qwen2`` (``Qwen2ForCausalLM``, q/k/v biases): 2 layers, d_model 64, 4 query / 2 key-value heads of 16, MLP 128,
   vocabulary 1024, untied; weights ~ N(0, 1/fan_in), biases N(0, 0.1²), norm gains 1 ± 0.3 (random, so a missed
   norm scale shows); the tinyshakespeare tokenizer of ``nnsight_lorsa/assets``.
2. (the peer's venv, ``their_side.py``) one random Lorsa (``ln1.hook_normalized`` -> ``hook_attn_out``) and one
   transcoder (``ln2.hook_normalized`` -> ``hook_mlp_out``) per layer, written by THEIR save code and reloaded by
   THEIR ``from_pretrained``; THEIR ``attribute`` (every active feature kept, up to 10 logits to cumulative
   probability 0.95, QK tracing of the top ``qk_frac`` heads) and ``qk_trace`` (top 60 terms) on fixed token ids.
3. (our environment, ``our_side.py``) the same folders through ``LorsaSet`` / ``TranscoderSet.from_pretrained``,
   our ``attribute`` with their logit targets, and our ``qk_attribution`` for every head they traced, at the key
   their head attends to most (argmax of their cached attention score).
4. (``compare.py``) node sets per kind (Lorsa heads, transcoder features, errors, embeddings, logits); values (Lorsa
   ``z``, transcoder activations, logits) relative to the largest of their kind; edges on the common nodes relative
   to their largest edge; row sums; logit probabilities; QK marginals (÷ our largest marginal) and pair terms
   (÷ our largest pair) per traced head, and their ``b_Q`` / ``b_K`` leaf against our bias entry.

Conventions that differ, and how each is aligned (``aligned`` in each case's JSON):

- **Bias nodes.** Our graph has bias nodes (per layer: Lorsa ``b_V`` and ``b_D``, transcoder ``b_dec`` and
  ``b_enc``), so a row sums to its node's value; theirs has none, so its rows miss the biases' share (21-39 % of
  the largest value on these models: ``row_sums.their_gap_max_rel``). Their row sums plus our bias nodes' edges
  close it (``their_plus_our_bias_gap_max_rel``). Their QK leaves keep each bias per position (``sae.hook_b_D``,
  ``attn.hook_b_O``, ...) where ours sums a decoder bias over positions into one node: those leaves are counted
  (``qk.other_bias_entries``, ``qk.unmapped``), not compared; their ``b_Q`` / ``b_K`` leaf is (``qk.bQK``).
- **Decoder-norm units** (the probe's ``ALIGN_SIDN``). With ``sparsity_include_decoder_norm: true`` (c3) our
  activation is theirs × ``‖W_dec[f]‖`` (our loader folds the norm into the activation): values and the edge rows
  into feature nodes differ by that factor (``unaligned``: ~0.3 relative; ``decoder_norm_ratio``: our value / theirs
  is the norm to < 1e-4 per feature, fp32 noise on the smallest activations). Aligned by dividing our feature rows,
  values and activations by the norm.
- **An MLP without a transcoder** (Lorsa only). Theirs leaves it live: its Jacobian at the prompt is part of every
  path, and the graph has no MLP node. Ours carries its output as ``mlp_err`` nodes, as for every unreplaced MLP.
  c5 keeps theirs live (values agree; edges differ by up to ~1 of the largest edge and QK terms by several times
  our largest: an expected difference); c5a detaches their ``blocks.L.hook_mlp_out`` (their ``ln_detach_hooks``
  extended) and agrees. Their graph still has no ``mlp_err`` node, so their row sums close with our bias AND
  ``mlp_err`` edges (``their_plus_our_bias_and_absent_gap_max_rel``).
- The same on both sides (nothing to align): position 0 (BOS) kept as nodes, attention patterns, norm scales and
  QK-norm scales frozen, the target is the mean-subtracted logit. Their QK output keeps top-k terms, ours the full
  marginals and pair matrix: compared on their terms.
- A Lorsa with ``act_fn: jumprelu`` (c9): their attribution runs it; our loader refused the file by name until
  2026-11-29 and reads it since (a JumpReLU Lorsa): the graphs agree as the others.

A case is as expected when (``expect``) ``agree``: the node sets are equal (but ``mlp_err``, absent on their side
in Lorsa-only cases), no edge mismatch, and every relative difference (values, edges, closed row sums, QK
marginals, pairs, ``b_Q``/``b_K``) and the logit-probability difference ≤ ``compare.TOL`` (1e-5); ``mlp_live``:
nodes and values as for ``agree``, edges above it; ``refused``: our side refused with the named error.

Installing the peer (its own venv; never a dependency of nnsight-lorsa; transformer-lens without its pins)::

    python -m venv V; V/bin/pip install torch==2.13.0 llamascopium==2.0.0b34
    V/bin/pip install --no-deps transformer-lens==3.9.0 better-abc

Running (our environment, nnsight-lorsa installed; offline: ``HF_HUB_OFFLINE=1`` is set for every step; one thread
per process; cases run one after another)::

    python scripts/peer_checks/llamascopium_attribution/run.py --python V/bin/python --work DIR \\
        [--cases c1,c2,...] [--out benchmarks/results/attribution_vs_llamascopium.json]

``DIR/<case>/`` keeps both sides' files and logs (``theirs.log``, ``ours.log``); the exit status is 0 when every
case is as expected. Tensors pass between the processes as safetensors, metadata as JSON.
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
from compare import TOL, compare_graph, compare_qk, decoder_norm_ratio

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "attribution_vs_llamascopium.json"

TOKENS = [0, 836, 27, 222, 447, 366, 71, 85]  # "ROMEO: But soft" with BOS (id 0)
TOKENS_NO_BOS = [836, 27, 222, 447, 366, 71, 85, 13]
TOKENS_12 = [0, 836, 27, 222, 447, 366, 71, 85, 13, 435, 20, 99]
NTK_QK_NORM = {"use_post_qk_ln": True, "normalization_type": "RMS", "eps": 0.01, "use_NTK_by_parts_rope": True,
               "NTK_by_parts_factor": 8.0, "NTK_by_parts_low_freq_factor": 1.0,
               "NTK_by_parts_high_freq_factor": 4.0, "old_context_len": 8}

#: name -> (model, their_side.py options, expectation, description)
CASES: dict[str, tuple[str, dict[str, Any], str, str]] = {
    "c1": ("llama", {"tokens": TOKENS, "seed": 1}, "agree",
           "Llama; top-k Lorsa + top-k transcoders; their default qk_top_fraction 0.3"),
    "c2": ("llama", {"tokens": TOKENS, "seed": 2, "qk_frac": 1.0}, "agree",
           "Llama; top-k Lorsa + top-k transcoders; every traced head"),
    "c3": ("llama", {"tokens": TOKENS, "seed": 3, "qk_frac": 1.0, "sidn": True, "adj": True, "tc_act": "relu",
                     "b_E_shift": -0.4}, "agree",
           "sparsity_include_decoder_norm: true (aligned by decoder norm), adjacent-pair RoPE, ReLU transcoders"),
    "c4": ("qwen2", {"tokens": TOKENS_NO_BOS, "seed": 4, "qk_frac": 1.0}, "agree",
           "Qwen2 (q/k/v biases), no BOS"),
    "c5": ("llama", {"tokens": TOKENS, "seed": 5, "qk_frac": 1.0, "tc": False}, "mlp_live",
           "Lorsa only, their MLPs live (the expected difference)"),
    "c5a": ("llama", {"tokens": TOKENS, "seed": 5, "qk_frac": 1.0, "tc": False, "detach_mlp": True}, "agree",
            "Lorsa only, their MLP outputs detached (aligned)"),
    "c6": ("llama", {"tokens": TOKENS, "seed": 6, "qk": False, "lorsa": False}, "agree",
           "transcoders only (attention patterns frozen), no QK tracing"),
    "c7": ("llama", {"tokens": TOKENS, "seed": 7, "qk_frac": 1.0, "n_qk": 2, "tc_act": "jumprelu", "b_E_shift": 0.0,
                     "lorsa_extra": NTK_QK_NORM}, "agree",
           "Lorsa QK-norm + NTK-by-parts RoPE, 2 QK heads; JumpReLU transcoders"),
    "c8": ("llama", {"tokens": TOKENS_12, "seed": 8, "qk_frac": 1.0, "qk_scale": 0.3, "lorsa_k": 3}, "agree",
           "12 tokens, peaked attention (W_Q/W_K scale 0.3), Lorsa top-3"),
    "c9": ("llama", {"tokens": TOKENS, "seed": 9, "qk_frac": 1.0, "lorsa_act": "jumprelu"}, "agree",
           "JumpReLU Lorsa (act_fn: jumprelu)"),
}
#: model -> (class, config class, seed, folder under WORK/models: no "llama", "gemma", ... in it, see their_side.py)
MODELS = {"llama": ("LlamaForCausalLM", "LlamaConfig", 1, "m_tiny_l"),
          "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", 2, "m_tiny_q")}
REFUSAL = ("UnsupportedArchitectureError", "act_fn='jumprelu' is not supported")
#: node kinds a Lorsa-only graph of theirs lacks (no MLP node) while ours has them
ABSENT_ON_THEIR_SIDE = {"mlp_err"}


def build_model(name: str, out: Path) -> None:
    """A random tiny model ``name`` of :data:`MODELS`, saved with the tokenizer under ``out``."""
    import transformers

    import nnsight_lorsa

    cls_name, cfg_name, seed, _ = MODELS[name]
    tok = transformers.AutoTokenizer.from_pretrained(Path(nnsight_lorsa.__file__).parent / "assets"
                                                     / "tinyshakespeare-llama")
    cfg = getattr(transformers, cfg_name)(
        vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-5, bos_token_id=0,
        eos_token_id=1, pad_token_id=1, tie_word_embeddings=False, rope_theta=10000.0)
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(cfg).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif "bias" in n:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out)
    tok.save_pretrained(out)


def run_side(cmd: list[str], log: Path, env: dict[str, str]) -> tuple[bool, float]:
    """Run one side, stdout and stderr to ``log``; (exit status 0, seconds)."""
    t0 = time.time()
    with log.open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=HERE).returncode
    return rc == 0, time.time() - t0


def tail(log: Path, n: int = 12) -> list[str]:
    return log.read_text(errors="replace").splitlines()[-n:]


def summary(res: dict[str, Any]) -> dict[str, Any]:
    """The headline numbers of a compared case (max over kinds / QK parts)."""
    qk = res.get("qk")
    return {
        "node_sets_equal": res["node_sets_equal"],
        "values_max_rel": max(v["max_rel_vs_values"] for v in res["values"].values()),
        "edges_max_rel_to_largest": res["edges"]["max_rel_to_largest"],
        "bias_closed_row_sum_gap_max_rel": res["row_sums"]["their_plus_our_bias_gap_max_rel"],
        "closed_row_sum_gap_max_rel": res["row_sums"]["their_plus_our_bias_and_absent_gap_max_rel"],
        "logit_probs_max_abs_diff": res["logit_probs_max_abs_diff"],
        "qk_probes": qk["n_probes"] if qk else 0,
        "qk_marginals_max_rel": max(qk["q_marg"]["max_rel"], qk["k_marg"]["max_rel"]) if qk else None,
        "qk_pairs_max_rel": qk["pairs"]["max_rel"] if qk else None,
        "qk_bQK_max_rel": qk["bQK"]["max_rel"] if qk else None,
    }


def verdict(expect: str, res: dict[str, Any]) -> str:
    """``agree`` / ``differs_as_expected`` when the case met ``expect``, else ``UNEXPECTED: <why>``."""
    s = res["summary"]
    nodes_ok = all(v["equal"] or (k in ABSENT_ON_THEIR_SIDE and v["theirs"] == 0) for k, v in res["nodes"].items())
    values_ok = s["values_max_rel"] <= TOL and s["logit_probs_max_abs_diff"] <= TOL
    if not nodes_ok:
        return "UNEXPECTED: node sets differ"
    if not values_ok:
        return "UNEXPECTED: values differ"
    edges_ok = s["edges_max_rel_to_largest"] <= TOL and not res["edge_mismatch_by_kind"]
    if expect == "mlp_live":
        return "differs_as_expected" if not edges_ok else "UNEXPECTED: edges agree with their MLPs live"
    qk_ok = all(x is None or x <= TOL for x in (s["qk_marginals_max_rel"], s["qk_pairs_max_rel"], s["qk_bQK_max_rel"]))
    if not (edges_ok and qk_ok and s["closed_row_sum_gap_max_rel"] <= TOL):
        return "UNEXPECTED: " + ", ".join(w for w, ok in (("edges", edges_ok), ("qk", qk_ok),
                                                           ("row sums", s["closed_row_sum_gap_max_rel"] <= TOL))
                                          if not ok)
    return "agree"


def run_case(name: str, python: str, work: Path, models: dict[str, Path], env: dict[str, str]) -> dict[str, Any]:
    model, opts, expect, description = CASES[name]
    case = work / name
    if case.exists():
        shutil.rmtree(case)
    case.mkdir(parents=True)
    aligned = {"bias_nodes_close_their_rows": True, "decoder_norm_units": bool(opts.get("sidn")),
               "their_mlp_detached": bool(opts.get("detach_mlp"))}
    out: dict[str, Any] = {"description": description, "model": model, "opts": opts, "expect": expect,
                           "aligned": aligned}
    their_env = {k: v for k, v in env.items() if k != "PYTHONPATH"}  # the peer env never sees our package
    ok, out["theirs_s"] = run_side([python, str(HERE / "their_side.py"), str(models[model]), str(case),
                                    json.dumps(opts)], case / "theirs.log", their_env)
    if not ok:
        return out | {"status": "error: their side failed", "as_expected": False, "log_tail": tail(case / "theirs.log")}
    ok, out["ours_s"] = run_side([sys.executable, str(HERE / "our_side.py"), str(models[model]), str(case)],
                                 case / "ours.log", env)
    if not ok:
        return out | {"status": "error: our side failed", "as_expected": False, "log_tail": tail(case / "ours.log")}
    refused = json.loads((case / "ours.json").read_text()).get("refused")
    if refused is not None or expect == "refused":
        expected = (refused is not None and refused["error"] == REFUSAL[0] and REFUSAL[1] in refused["message"])
        return out | {"refusal": refused, "as_expected": expected,
                      "status": "refused_as_expected" if expected else "UNEXPECTED: " + (
                          f"refused: {refused['error']}" if refused else "not refused")}

    res = compare_graph(case, align_sidn=bool(opts.get("sidn")))
    res["qk"] = compare_qk(case)
    res["summary"] = summary(res)
    if opts.get("sidn"):
        raw = compare_graph(case)
        res["unaligned"] = {"values": raw["values"], "edges": raw["edges"],
                            "edge_mismatch_counts": {k: v["count"] for k, v in raw["edge_mismatch_by_kind"].items()},
                            "row_sums": raw["row_sums"]}
        res["decoder_norm_ratio"] = decoder_norm_ratio(case)
    status = verdict(expect, res)
    return out | {"status": status, "as_expected": not status.startswith("UNEXPECTED")} | res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--python", required=True, help="the Python of the venv with llamascopium 2.0.0b34")
    p.add_argument("--work", required=True, type=Path, help="working folder (models and one folder per case)")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)} (default all)")
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
        models[model] = work / "models" / MODELS[model][3]
        build_model(model, models[model])

    cases = {}
    for name in names:
        print(f"{name}: {CASES[name][3]} ...", flush=True)
        cases[name] = run_case(name, args.python, work, models, env)
        print(f"{name}: {cases[name]['status']} {json.dumps(cases[name].get('summary', {}))}", flush=True)

    versions = {}
    for side, file in (("theirs", "theirs.json"), ("ours", "ours.json")):
        for name in names:
            f = work / name / file
            if f.exists() and "versions" in (meta := json.loads(f.read_text())):
                versions[side] = meta["versions"]
                break
    result = {
        "what": "nnsight_lorsa.attribute / qk_attribution against Llamascopium 2.0.0b34's attribute / qk_trace "
                "(scripts/peer_checks/llamascopium_attribution/run.py docstring)",
        "date": date.today().isoformat(),
        "command": shlex.join(["python", *sys.argv]),
        "tolerance": TOL,
        "versions": versions,
        "all_as_expected": all(c["as_expected"] for c in cases.values()),
        "cases": cases,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {args.out}; all as expected: {result['all_as_expected']}")
    return 0 if result["all_as_expected"] else 1


if __name__ == "__main__":
    sys.exit(main())
