"""Our interventions (``nnsight_lorsa.patching``) against circuit-tracer 0.5.0's
``ReplacementModel.feature_intervention`` and SAELens 6.54.12's ``HookedSAETransformer``, on the same models, the
peers' own files and the same tokens.

What it checks (CPU, fp32, one thread per process, no network). ``run.py`` writes two tiny random Hugging Face models
(a GPT-2: 3 layers, d_model 32, 4 heads, vocab 40, biases and LayerNorm parameters moved off their defaults; a Llama:
3 layers, d_model 64, GQA 4/2, norm gains moved) and a word-level tokenizer (BOS 0). Each peer, in its own venv and its
own interpreter (a subprocess: ``circuit_tracer_side.py``, ``saelens_side.py``), makes random transcoders / CLTs / SAEs
with its own classes, writes them with its own writer (circuit-tracer ``to_safetensors`` + ``config.yaml``; SAELens
``save_model``, read back with ``SAE.load_from_disk``) and runs its own intervention code on them; ours
(``ours_side.py``, in this interpreter) reads the same folders with ``TranscoderSet`` / ``CLTSet`` /
``SAESet.from_pretrained`` and makes the same edits through ``nnsight_lorsa.patching``. Groups (case counts:
``--full`` / default):

- ``ct_gpt2`` (175 / 91): GPT-2 with ReLU, JumpReLU, skip, JumpReLU + skip, TopK per-layer sets and ReLU, JumpReLU
  CLTs on ``mlp.hook_in`` / ``mlp.hook_out`` (25 cases each; a TopK set from circuit-tracer's raw tensors: its files
  cannot say TopK); prompts of 5-9 tokens, 1-4 interventions (set to a value, zero, zero an active feature, set to its
  clean value, set at every position from 1 on). Logits and every layer's features against circuit-tracer's.
- ``ct_llama`` (48 / 24): the Llama through circuit-tracer's ``ReplacementModel.from_config(..., backend=
  "transformerlens")``, per-layer sets and CLTs on six hook pairs (``mlp.hook_in``/``mlp.hook_out``,
  ``hook_resid_mid``/``hook_mlp_out``, ``ln2.hook_normalized``/``hook_mlp_out`` and ``/mlp.hook_out``, CLTs on two).
- ``ct_constrained`` (48 / 24): one active feature zeroed with ``constrained_layers=range(n_layers)`` against minus our
  attribution graph's feature → logit edges (6 modules); the same ablation with ``freeze_attention=True`` against ours
  with frozen attention.
- ``ct_call_options`` and ``ct_bos``: scale / steer as circuit-tracer expresses them; its options
  ``apply_activation_function=False``, ``sparse=True``, ``return_activations=False``; the BOS difference (below).
- ``sl_gpt2`` (60 / 30): 1-3 SAEs (standard, JumpReLU, TopK, gated on ``hook_resid_pre`` / ``hook_attn_out`` /
  ``hook_mlp_out`` / ``hook_resid_post``) and transcoders (4 kinds, ``hook_resid_mid`` / ``hook_mlp_in`` →
  ``hook_mlp_out``) at once, error term on (60 %) or off, 0-3 edits each (set, zero, scale, steer, set / zero at every
  position, the clean value written back), on an unprocessed TransformerLens copy of the GPT-2.
- ``sl_centred`` (50 / 25): the same on TransformerLens's default processing (``fold_ln``, ``center_writing_weights``,
  ``center_unembed``, ``fold_value_biases``) with files recording ``center_writing_weights: true``; transcoders also
  on ``ln2.hook_normalized`` (logits compared after subtracting their mean: ``center_unembed``).
- ``sl_transcoders`` (24 / 12): one transcoder without the error term, each kind × input × layer (the skip difference).
- ``sl_batch`` (per-row edits in a batch of two: two invokes, and per-row values in one), ``sl_experiments``
  (``activation_patching``, ``ablation_effect`` zero / mean with ``mean_activations``, ``path_patching`` with and
  without the freeze, against the same experiments by hand with SAELens's hooks), ``sl_centred_pair`` (the centred
  difference on one prompt); each with the error term on and off where it applies.

Every random draw is the probe's (same seeds, same order); the default subset runs every second case of each drawn
group (the draws go on in between), so each of its cases is the same case as in ``--full``.

Semantics mapping (peer call ↔ ours; ``rm = ReplacementModel(model, transcoders=... | saes=..., error=...)``, edits
inside ``with model.trace(ids):`` after ``rm.prepare(targets)``, in the model's order):

- circuit-tracer ``feature_intervention(ids, [(layer, pos, f, v)], freeze_attention=False)`` — free: nothing frozen,
  no constrained layers; it adds ``(v − a)·W_dec[f]`` where ``a`` is the feature's current activation — ↔
  ``patch(rm(Feature(layer, f, kind="transcoder")), v, positions=[pos])``; ``v = 0`` ↔ ``ablate``; ``pos =
  slice(1, None)`` ↔ ``positions=slice(1, None)``; a set to ``α·a`` ↔ ``scale(…, α)``; to ``a + δ`` ↔ ``steer(…,
  δ)``. A CLT's layer-``L`` features ↔ ``Feature(L, f, kind="transcoder")`` on a ``ReplacementModel`` holding the
  ``CLTSet`` (an edit moves every MLP output from layer ``L`` on, in both). Its replacement model is error-corrected
  ↔ our default ``error=True``: the unedited replacement is the model. Its returned activation cache ↔ each layer's
  ``hook_sae_acts_post`` read before that layer's edits (positions ≥ 1: its cache is zero at 0); with
  ``apply_activation_function=False`` ↔ ``hook_sae_acts_pre``. ``constrained_layers=range(n_layers)`` (attention
  patterns, norms and MLPs frozen: the direct effect) ↔ minus our ``attribute`` graph's feature → logit edge on the
  mean-subtracted logits; ``freeze_attention=True`` alone ↔ ``rm.prepare([target], frozen=freeze_attention(rm, ids))``
  then the same edit (every attention pattern held at the unedited prompt's; norms and MLPs live), compared on the last
  position's logits (``freeze_attention_vs_ours``; ``freeze_attention_vs_edges`` shows how far it is from the direct
  effect). Partial ``constrained_layers`` has no equivalent here.
- SAELens ``HookedSAETransformer.add_sae(sae, use_error_term=e)`` ↔ ``ReplacementModel(model, saes=...,
  transcoders=..., error=e)`` of ``SAESet`` / ``TranscoderSet.from_pretrained(model, folder)`` (each placed at the
  module output its file records: ``hook_resid_pre`` L → the previous block's output / the embedding dropout,
  ``hook_attn_out`` → the attention's output, ``hook_mlp_out`` → the MLP's, ``hook_resid_post`` → the block's; a
  transcoder replaces its layer's MLP). A forward hook on ``<hook>.hook_sae_acts_post`` doing ``acts[:, p, f] = v`` ↔
  ``patch``; ``= 0`` ↔ ``ablate``; ``*= α`` ↔ ``scale``; ``+= δ`` ↔ ``steer``; ``acts[:, :, f] = v`` / ``= 0`` ↔
  ``patch`` / ``ablate`` at every position; the value left as it is ↔ ``patch(t, read(t))``; per-row edits ↔ one
  ``tracer.invoke`` per row, or per-row value tensors. ``run_with_hooks`` experiments by hand ↔ ``activation_patching``,
  ``ablation_effect(mode="zero" | "mean", means=mean_activations(...))``, ``path_patching(freeze=True)`` (later layers'
  ``hook_attn_out`` held at their clean values) and ``freeze=False``.

Checks per group: the count; the largest relative difference of the logits (÷ the peer's max |logit|) and of the
features (÷ the peer's max |activation|); the unedited replacement with the error term against the plain model (ours:
bit for bit) and the peer's against the HF model (TransformerLens's float floor, ~1e-6); a clean-value patch
(``patch(t, read(t))`` of every edited feature at every position) against the unedited replacement (bit for bit); the
size of the edits (``edit_effect``). Agreement: ``TOL`` (1e-5; ``ct_constrained``'s node activations, relative per
feature: 1e-4); a documented difference must show above ``DIFFERS`` (1e-3) where the peers disagree.

Three documented differences, measured (``differences`` in the JSON; each says which side is right):

1. circuit-tracer zeroes position 0 in its activation cache (``zero_positions = slice(0, 1)`` in
   ``_get_activation_caching_hooks``) and computes an edit's delta against that cache (``value − cache``), so an edit
   at BOS is made against 0: an ablation there is a no-op (a set to ``v`` adds ``v·W_dec``). Ours edits the feature's
   activation (circuit-tracer's own encoder gives the same, non-zero, value): ours is right. Aligned (``slice(None)``
   there = our positions 1 on) they agree.
2. SAELens's ``HookedSAETransformer`` without the error term splices ``decode(encode(x))`` (``_SAEWrapper.forward``),
   dropping a skip transcoder's ``x @ W_skip.T``, which its own ``SkipTranscoder.forward`` adds: ours equals its
   ``forward`` spliced by hand (ours is right); its splice equals ``decode(encode(x))`` by hand exactly. ``sl_gpt2``
   cases holding a skip transcoder without the error term are this difference (``skip_without_error``).
3. Centred files under an upstream edit (TransformerLens's centred residual, docs/formats.md): ours feeds such a
   module its input minus its mean (what it was trained on); TransformerLens's residual carries an upstream edit's
   (or, without the error term, an earlier reconstruction's) mean, so a later module's features differ, and the
   logits too where such features are edited. SAELens's encoder fed its own live input minus its mean gives ours.
   Ours is the module as trained; SAELens's value depends on TransformerLens's parametrisation. ``sl_centred`` splits
   its cases: ``aligned`` (with the error term no module has an edited one before it; without it a single module),
   ``edit_upstream`` (error term on: the features of modules before any edit, and SAELens's encoder on its own input
   minus its mean, must agree; so must the logits unless a module whose input an edit moved is itself edited) and
   ``stacked_without_error`` (the first module's features must agree). ``sl_centred_pair`` measures it on one prompt.

Installing the peers (each in its own venv; never a dependency of nnsight-lorsa)::

    python -m venv CT && CT/bin/pip install torch==2.13.0 && \\
        CT/bin/pip install circuit-tracer==0.5.0 'transformers>=4.57,<4.58'
    python -m venv SL && SL/bin/pip install torch==2.13.0 && SL/bin/pip install sae-lens==6.54.12

(The recorded run: circuit-tracer's venv with transformer-lens 3.2.1 and transformers 4.57.3; SAELens's with
transformer-lens 3.9.0 and transformers 5.24.0; ``versions`` in the JSON.)

Running (repository root, our interpreter with nnsight-lorsa; ``HF_HUB_OFFLINE=1`` is set for every step; sides run
one after another; either peer may be omitted, its groups and differences are then left out)::

    python scripts/peer_checks/interventions/run.py --circuit-tracer-python CT/bin/python \\
        --saelens-python SL/bin/python --work DIR [--full] [--out benchmarks/results/interventions_vs_peers.json]

``DIR`` keeps the models, both peers' files and results (``DIR/circuit_tracer/<group>``, ``DIR/saelens/<group>``) and
our per-case rows (``DIR/ours/rows.json``); the entries this script writes there are replaced on each run. Measured
on 2 CPU cores: the default subset ~20 s, ``--full`` ~25 s (mostly process and import start-up). The exit status is 0
when every agreement holds and every documented difference shows.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any

import _shared as S
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "interventions_vs_peers.json"
#: agreement: relative differences at most this
TOL = 1e-5
#: a documented difference must show above this
DIFFERS = 1e-3
WORK_ENTRIES = ("plan.json", "models", "circuit_tracer", "saelens", "ours")
COMMAND = ("python scripts/peer_checks/interventions/run.py --circuit-tracer-python P --saelens-python P --work DIR "
           "[--full] [--out benchmarks/results/interventions_vs_peers.json]")


# ------------------------------------------------------------------------------------------------------------ setup
def prepare_work(work: Path, full: bool) -> None:
    """``work`` created, with the entries this script writes there removed (nothing else is touched)."""
    S.clear_work(work, WORK_ENTRIES)
    S.write_json(work / "plan.json", {"full": full})


def build_models(work: Path) -> None:
    """The random GPT-2 and Llama (``WORK/models/<family>``), each with the word-level tokenizer; the tokenizer's
    config names ``PreTrainedTokenizerFast`` so that circuit-tracer's transformers 4.57 reads it too."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<bos>": S.BOS_ID, "<unk>": 1, **{f"w{i}": i + 2 for i in range(S.VOCAB - 2)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##")
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<bos>", unk_token="<unk>",
                                                     eos_token="<bos>")
    families = {"gpt2": (transformers.GPT2Config(**S.GPT2), transformers.GPT2LMHeadModel, S.GPT2_SEED,
                         lambda n: n.endswith("bias") or ".ln_" in n, S.GPT2_PERTURB),
                "llama": (transformers.LlamaConfig(**S.LLAMA), transformers.LlamaForCausalLM, S.LLAMA_SEED,
                          lambda n: "norm" in n, S.LLAMA_PERTURB)}
    for family, (cfg, cls, seed, moved, size) in families.items():
        torch.manual_seed(seed)
        model = cls(cfg).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if moved(name):
                    p.add_(torch.randn_like(p) * size)
        out = S.model_dir(work, family)
        model.save_pretrained(str(out))
        tokenizer.save_pretrained(str(out))
        S.write_json(out / "tokenizer_config.json", {
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<bos>",
            "unk_token": "<unk>", "clean_up_tokenization_spaces": False, "model_max_length": 64})


def run_side(python: str, script: str, work: Path) -> float:
    """``python HERE/script WORK`` offline, one thread; its output passes through. Returns its wall time."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "OMP_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    print(f"[interventions_vs_peers] {python} {script} {work}", flush=True)
    start = time.perf_counter()
    subprocess.run([python, str(HERE / script), str(work)], check=True, env=env)
    return time.perf_counter() - start


# -------------------------------------------------------------------------------------------------------- summaries
def top(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return max(vals) if vals else None


def spread(rows: list[dict], key: str) -> dict[str, float] | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return {"min": min(vals), "median": statistics.median(vals), "max": max(vals)} if vals else None


def bit_check(rows: list[dict], rel_key: str, bit_key: str) -> dict[str, Any]:
    sub = [r for r in rows if bit_key in r]
    return {"cases": len(sub), "rel_max": top(sub, rel_key), "bitwise": all(r[bit_key] for r in sub)}


def counts(rows: list[dict], key: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in rows:
        out[str(r[key])] = out.get(str(r[key]), 0) + 1
    return out


def bit_for_bit(s: dict[str, Any]) -> bool:
    """The unedited replacement (error term on) is the plain model and a clean-value patch is no edit, bit for bit."""
    return s["ours_unedited_with_error_vs_plain"]["bitwise"] and s["clean_value_patch_vs_unedited"]["bitwise"]


def ok(*values: float | None, at_most: float = TOL) -> bool:
    return all(v is not None and v <= at_most for v in values)


def summarise_ct_free(rows: list[dict]) -> dict[str, Any]:
    s = {
        "peer": "circuit-tracer feature_intervention(freeze_attention=False)",
        "cases": len(rows), "per_module": counts(rows, "module"),
        "logits_rel_max": top(rows, "logits"), "acts_rel_max": top(rows, "acts"),
        "unedited_acts_rel_max": top(rows, "clean_acts"),
        "ours_unedited_with_error_vs_plain": bit_check(rows, "ours_unedited_vs_plain", "ours_unedited_bitwise"),
        "clean_value_patch_vs_unedited": bit_check(rows, "noop", "noop_bitwise"),
        "peer_unedited_vs_plain_rel_max": top(rows, "peer_unedited_vs_plain"),
        "plain_vs_peer_hf_rel_max": top(rows, "plain_vs_peer_hf"),
        "edit_effect": spread(rows, "effect"),
    }
    s["agree"] = (ok(s["logits_rel_max"], s["acts_rel_max"], s["unedited_acts_rel_max"])
                  and bit_for_bit(s))
    return s


def summarise_ct_constrained(rows: list[dict]) -> dict[str, Any]:
    s = {
        "peer": "circuit-tracer feature_intervention(constrained_layers=range(n_layers)) vs our attribute edges; "
                "feature_intervention(freeze_attention=True) vs our freeze_attention + prepare(frozen=...)",
        "cases": len(rows), "per_module": counts(rows, "module"),
        "cases_with_a_direct_effect": sum(r["edge_max_over_logit_max"] > 0 for r in rows),
        "constrained_vs_minus_edges_rel_max": top(rows, "constrained_vs_edges"),
        "node_activation_rel_max": top(rows, "activation"),
        "freeze_attention_vs_ours_rel_max": top(rows, "freeze_attention_vs_ours"),
        "freeze_attention_effect_rel_max": top(rows, "freeze_attention_effect"),
        "ours_without_freezing_vs_freeze_attention_rel_max": top(rows, "ours_free_vs_freeze_attention"),
        "freeze_attention_only_vs_minus_edges_rel_max": top(rows, "freeze_attention_vs_edges"),
        "edge_max_over_logit_max": top(rows, "edge_max_over_logit_max"),
    }
    s["agree"] = (ok(s["constrained_vs_minus_edges_rel_max"], s["node_activation_rel_max"], at_most=1e-4)
                  and ok(s["freeze_attention_vs_ours_rel_max"]))
    return s


def skip_without_error(row: dict) -> bool:
    return not row["error"] and any("skip" in arch for arch, _, _ in row["saes"])


def summarise_sl_gpt2(rows: list[dict]) -> dict[str, Any]:
    aligned = [r for r in rows if not skip_without_error(r)]
    known = [r for r in rows if skip_without_error(r)]
    s = {
        "peer": "SAELens HookedSAETransformer (add_sae, run_with_hooks on hook_sae_acts_post)",
        "cases": len(rows), "error_term_on": sum(r["error"] for r in rows),
        "aligned": {"cases": len(aligned), "logits_rel_max": top(aligned, "logits"),
                    "acts_rel_max": top(aligned, "acts"),
                    "unedited_vs_saelens_unedited_rel_max": top(aligned, "unedited_vs_saelens_unedited")},
        "skip_without_error": {"cases": len(known), "logits_rel": spread(known, "logits"),
                               "unedited_vs_saelens_unedited_rel": spread(known, "unedited_vs_saelens_unedited")},
        "ours_unedited_with_error_vs_plain": bit_check(rows, "ours_unedited_vs_plain", "ours_unedited_bitwise"),
        "clean_value_patch_vs_unedited": bit_check(rows, "noop", "noop_bitwise"),
        "peer_unedited_with_error_vs_plain_rel_max": top([r for r in rows if r["error"]], "saelens_unedited_vs_plain"),
        "edit_effect": spread(rows, "effect"),
    }
    a = s["aligned"]
    s["agree"] = (ok(a["logits_rel_max"], a["acts_rel_max"], a["unedited_vs_saelens_unedited_rel_max"])
                  and bit_for_bit(s))
    return s


def centred_buckets(row: dict) -> dict[str, Any]:
    """Which of a centred case's numbers must agree: with the error term, module ``j``'s features unless a module
    before it is edited; SAELens's encoder on its own input minus its mean, unless an edited module before ``j`` itself
    read a moved input; the logits unless such a module is edited. Without the error term: one module agrees
    (several: TransformerLens's stacked splice, docs/formats.md)."""
    n = len(row["saes"])
    edited = [any(iv["sae"] == j and iv["kind"] != "clean" for iv in row["ivs"]) for j in range(n)]
    if not row["error"]:
        return {"bucket": "aligned" if n == 1 else "stacked_without_error", "acts_aligned": [True] + [False] * (n - 1)}
    moved_in = [any(edited[:j]) for j in range(n)]  # an edit upstream moved module j's input
    hyp = [not any(edited[k] and moved_in[k] for k in range(j)) for j in range(n)]
    logits_aligned = not any(edited[j] and moved_in[j] for j in range(n))
    return {"bucket": "aligned" if not any(moved_in) else "edit_upstream", "acts_aligned": [not m for m in moved_in],
            "hyp_aligned": hyp, "logits_aligned": logits_aligned}


def summarise_sl_centred(rows: list[dict], cases: list[dict]) -> dict[str, Any]:
    ivs = {c["key"]: c["ivs"] for c in cases}
    for r in rows:
        r.update(centred_buckets({**r, "ivs": ivs[r["key"]]}))
    buckets: dict[str, list[dict]] = {"aligned": [], "edit_upstream": [], "stacked_without_error": []}
    for r in rows:
        buckets[r["bucket"]].append(r)

    def acts_where(sub: list[dict], aligned: bool) -> float | None:
        vals = [a for r in sub for a, al in zip(r["acts_per_sae"], r["acts_aligned"], strict=True) if al == aligned]
        return max(vals) if vals else None

    up = buckets["edit_upstream"]
    hyp = [a for r in up for a, al in zip(r["acts_vs_own_input_centred_per_sae"], r["hyp_aligned"], strict=True) if al]
    s = {
        "peer": "SAELens HookedSAETransformer on TransformerLens's default processing (centred residual)",
        "cases": len(rows), "error_term_on": sum(r["error"] for r in rows),
        "ln2_hook_normalized_transcoder_cases": sum(any("ln2.hook_normalized" in h for _, h, _ in r["saes"])
                                                     for r in rows),
        "aligned": {"cases": len(buckets["aligned"]), "logits_rel_max": top(buckets["aligned"], "logits"),
                    "acts_rel_max": top(buckets["aligned"], "acts")},
        "edit_upstream": {
            "cases": len(up),
            "features_of_modules_before_any_edit_rel_max": acts_where(up, True),
            "features_after_an_edit_rel_max": acts_where(up, False),
            "features_vs_saelens_encoder_on_own_input_minus_mean_rel_max": max(hyp) if hyp else None,
            "logits_no_moved_module_edited_rel_max": top([r for r in up if r["logits_aligned"]], "logits"),
            "logits_moved_module_edited_rel_max": top([r for r in up if not r["logits_aligned"]], "logits")},
        "stacked_without_error": {
            "cases": len(buckets["stacked_without_error"]),
            "first_module_features_rel_max": acts_where(buckets["stacked_without_error"], True),
            "later_features_rel_max": acts_where(buckets["stacked_without_error"], False),
            "logits_rel_max": top(buckets["stacked_without_error"], "logits")},
        "ours_unedited_with_error_vs_plain": bit_check(rows, "ours_unedited_vs_plain", "ours_unedited_bitwise"),
        "clean_value_patch_vs_unedited": bit_check(rows, "noop", "noop_bitwise"),
        "peer_unedited_with_error_vs_plain_rel_max": top([r for r in rows if r["error"]], "saelens_unedited_vs_plain"),
        "edit_effect": spread(rows, "effect"),
    }
    e = s["edit_upstream"]
    s["agree"] = (ok(s["aligned"]["logits_rel_max"], s["aligned"]["acts_rel_max"],
                     e["features_of_modules_before_any_edit_rel_max"],
                     e["features_vs_saelens_encoder_on_own_input_minus_mean_rel_max"],
                     e["logits_no_moved_module_edited_rel_max"],
                     s["stacked_without_error"]["first_module_features_rel_max"])
                  and bit_for_bit(s))
    return s


def summarise_sl_transcoders(rows: list[dict]) -> dict[str, Any]:
    plain = [r for r in rows if "skip" not in r["arch"]]
    s = {
        "peer": "SAELens HookedSAETransformer.add_sae(transcoder, use_error_term=False)",
        "cases": len(rows), "per_arch": counts(rows, "arch"),
        "without_skip": {"cases": len(plain), "logits_vs_saelens_rel_max": top(plain, "logits_vs_saelens_spliced")},
        "module_vs_saelens_forward_rel_max": top(rows, "module_vs_saelens_forward"),
        "logits_vs_saelens_forward_spliced_by_hand_rel_max": top(rows, "logits_vs_saelens_forward_by_hand"),
    }
    s["agree"] = ok(s["without_skip"]["logits_vs_saelens_rel_max"], s["module_vs_saelens_forward_rel_max"],
                    s["logits_vs_saelens_forward_spliced_by_hand_rel_max"])
    return s


def flat_max(obj: Any) -> float:
    """The largest number in a nested dict (the relative differences of ``sl_batch`` / ``sl_experiments``)."""
    if isinstance(obj, dict):
        return max(flat_max(v) for v in obj.values())
    return float(obj)


def differences(ours: dict[str, Any], summaries: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "ct_bos" in ours:
        b = ours["ct_bos"]
        shows = (b["ours_bos_ablation_vs_unedited"] > DIFFERS and b["circuit_tracer_bos_ablation_vs_unedited"] <= TOL
                 and b["aligned_ours_positions_1_on_vs_circuit_tracer_slice_none"] <= TOL
                 and abs(b["activation_at_bos"]["ours"] - b["activation_at_bos"]["circuit_tracer_encoder"])
                 <= TOL * abs(b["activation_at_bos"]["ours"]))
        out["circuit_tracer_bos_cache"] = {
            "what": "circuit-tracer zeroes position 0 of its activation cache (zero_positions) and sets a feature by "
                    "adding (value - cache)·W_dec: an edit at BOS is made against 0, an ablation there is a no-op",
            "measured": b, "right": "ours",
            "why": "the feature's activation at BOS is non-zero (circuit-tracer's own encoder on its own hook gives "
                   "ours); zeroing it must move the logits",
            "shows": shows}
    if "sl_transcoders" in ours:
        skip = [r for r in ours["sl_transcoders"] if "skip" in r["arch"]]
        known = summaries.get("sl_gpt2", {}).get("skip_without_error", {})
        m = {"cases": len(skip), "ours_vs_saelens_spliced": spread(skip, "logits_vs_saelens_spliced"),
             "ours_vs_saelens_forward_spliced_by_hand_rel_max": top(skip, "logits_vs_saelens_forward_by_hand"),
             "saelens_spliced_vs_its_forward_by_hand": spread(skip, "saelens_spliced_vs_forward_by_hand"),
             "saelens_spliced_vs_decode_encode_by_hand_rel_max": top(skip, "saelens_spliced_vs_decode_encode_by_hand"),
             "sl_gpt2_cases_with_a_skip_transcoder_without_error": known}
        out["saelens_skip_transcoder_without_error"] = {
            "what": "HookedSAETransformer without the error term splices decode(encode(x)) (_SAEWrapper.forward), "
                    "dropping a skip transcoder's x @ W_skip.T that SkipTranscoder.forward adds",
            "measured": m, "right": "ours", "why": "ours equals SAELens's own SkipTranscoder.forward spliced by hand",
            "shows": (m["ours_vs_saelens_spliced"]["min"] > DIFFERS
                      and ok(m["ours_vs_saelens_forward_spliced_by_hand_rel_max"],
                             m["saelens_spliced_vs_decode_encode_by_hand_rel_max"]))}
    if "sl_centred_pair" in ours:
        p = ours["sl_centred_pair"]
        c = summaries.get("sl_centred", {})
        out["saelens_centred_under_edit"] = {
            "what": "a module trained on TransformerLens's centred residual, after an upstream edit with the error "
                    "term: ours reads its input minus its mean, SAELens's HookedSAETransformer TransformerLens's "
                    "residual carrying the edit's mean (without the error term, earlier reconstructions' means)",
            "measured": {"one_prompt": p, "sl_centred_edit_upstream": c.get("edit_upstream"),
                         "sl_centred_stacked_without_error": c.get("stacked_without_error")},
            "right": "ours (the module as trained: a mean-free input); SAELens's value depends on how "
                     "TransformerLens's processing parametrises the model",
            "why": "SAELens's own encoder fed its live input minus its mean gives our features",
            "shows": (p["later_features_vs_saelens"] > DIFFERS and p["logits_later_feature_edited_too"] > DIFFERS
                      and ok(p["later_features_vs_saelens_encoder_on_own_input_minus_mean"],
                             p["logits_edit_of_earlier_sae_only"]))}
    return out


def summarise(ours: dict[str, Any], work: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    groups: dict[str, Any] = {}
    for g in ("ct_gpt2", "ct_llama"):
        if g in ours:
            groups[g] = summarise_ct_free(ours[g])
    if "ct_constrained" in ours:
        groups["ct_constrained"] = summarise_ct_constrained(ours["ct_constrained"])
    if "ct_call_options" in ours:
        groups["ct_call_options"] = {"peer": "circuit-tracer feature_intervention options; scale / steer as sets",
                                     **ours["ct_call_options"], "agree": flat_max(ours["ct_call_options"]) <= TOL}
    if "sl_gpt2" in ours:
        groups["sl_gpt2"] = summarise_sl_gpt2(ours["sl_gpt2"])
    if "sl_centred" in ours:
        groups["sl_centred"] = summarise_sl_centred(ours["sl_centred"],
                                                    S.read_json(work / "saelens" / "sl_centred" / "cases.json"))
    if "sl_transcoders" in ours:
        groups["sl_transcoders"] = summarise_sl_transcoders(ours["sl_transcoders"])
    for g in ("sl_batch", "sl_experiments"):
        if g in ours:
            diffs = {k: v for k, v in ours[g].items() if k.startswith(("two_", "one_", "error_"))}
            groups[g] = {"peer": "SAELens hooks by hand", **ours[g], "agree": flat_max(diffs) <= TOL}
    for g, s in groups.items():
        if g in S.FULL_CASES:
            s["cases_full"] = S.FULL_CASES[g]
    return groups, differences(ours, groups)


# -------------------------------------------------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--circuit-tracer-python", help="the interpreter of circuit-tracer 0.5.0's venv")
    ap.add_argument("--saelens-python", help="the interpreter of SAELens 6.54.12's venv")
    ap.add_argument("--work", required=True, type=Path, help="work folder (models, both sides' files and results)")
    ap.add_argument("--full", action="store_true", help="the probe's full case counts (default: every second case)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the JSON written (default: %(default)s)")
    args = ap.parse_args()
    if not (args.circuit_tracer_python or args.saelens_python):
        ap.error("give --circuit-tracer-python, --saelens-python or both")
    S.setup()
    start = time.perf_counter()
    work = args.work.resolve()
    prepare_work(work, args.full)
    runtime: dict[str, float] = {}
    t = time.perf_counter()
    build_models(work)
    runtime["models"] = time.perf_counter() - t
    groups: list[str] = []
    versions: dict[str, Any] = {}
    if args.circuit_tracer_python:
        runtime["circuit_tracer_side"] = run_side(args.circuit_tracer_python, "circuit_tracer_side.py", work)
        versions["circuit_tracer_venv"] = S.read_json(work / "circuit_tracer" / "versions.json")
        groups += S.CT_GROUPS
    if args.saelens_python:
        runtime["saelens_side"] = run_side(args.saelens_python, "saelens_side.py", work)
        versions["saelens_venv"] = S.read_json(work / "saelens" / "versions.json")
        groups += S.SL_GROUPS

    import ours_side

    t = time.perf_counter()
    models = ours_side.Models(work)
    ours: dict[str, Any] = {}
    for g in groups:
        print(f"[interventions_vs_peers] ours: {g}", flush=True)
        ours[g] = getattr(ours_side, g)(models, work)
    runtime["ours"] = time.perf_counter() - t
    S.write_json(S.side_dir(work, "ours") / "rows.json", ours)
    summaries, diffs = summarise(ours, work)
    versions["ours"] = {**S.versions("nnsight-lorsa", "nnsight", "transformers", "torch"), "git_head": git_head()}
    runtime["total"] = time.perf_counter() - start
    failed = [g for g, s in summaries.items() if not s["agree"]] + [d for d, s in diffs.items() if not s["shows"]]
    result = {
        "about": "nnsight-lorsa's interventions (nnsight_lorsa.patching on TranscoderSet / CLTSet / SAESet features "
                 "in a ReplacementModel) against circuit-tracer 0.5.0's feature_intervention and SAELens 6.54.12's "
                 "HookedSAETransformer, on the same tiny random GPT-2 / Llama, the peers' own files and the same "
                 "tokens; relative differences are max |ours - peer| / max |peer| (logits: the peer's max |logit|; "
                 "features: its max |activation|). See scripts/peer_checks/interventions/run.py.",
        "command": COMMAND, "generated": str(date.today()), "subset": "full" if args.full else "default",
        "peers_run": [p for p, given in (("circuit-tracer", args.circuit_tracer_python),
                                         ("saelens", args.saelens_python)) if given],
        "tolerance": {"agree": TOL, "differs": DIFFERS},
        "runtime_s": {k: round(v, 1) for k, v in runtime.items()},
        "versions": versions, "groups": summaries, "differences": diffs,
        "status": {"ok": not failed, "failed": failed},
    }
    S.write_json(args.out, result)
    print(f"[interventions_vs_peers] wrote {args.out} in {runtime['total']:.0f} s; "
          + ("every group agrees and every difference shows" if not failed else f"FAILED: {failed}"), flush=True)
    return 0 if not failed else 1


def git_head() -> str | None:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


if __name__ == "__main__":
    sys.exit(main())
