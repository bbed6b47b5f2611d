"""``evaluate`` against its peers: nnsight-lorsa's ``evaluate(...)`` metrics (FVU, L0, dead fraction, feature density,
the shrinkage metrics ``l2_norm_in`` / ``l2_norm_out`` / ``l2_ratio`` / ``relative_reconstruction_bias``, CE original /
spliced / zero-ablated, CE recovered, KL) against SAELens 6.54.12's ``run_evals``, sparsify 1.3.3's ``fvu`` and
Llamascopium 2.0.0b34's ``ExplainedVarianceMetric`` / ``L0Metric``, and against a from-scratch plain-torch
recomputation. Each peer runs its own code in its own interpreter (a subprocess); tensors cross over as safetensors.

Fixture (CPU, fp32, one thread, no network): a random GPT-2 (2 layers, d_model 64, 4 heads, vocab 512; BOS 1, EOS 2,
pad 3) and 6 windows of 24 tokens, BOS first, rows 4 and 5 right-padded (pad id, attention mask 0). Three SAEs of
64 -> 128 latents with random weights, written in SAELens's file layout (by SAELens's ``save_model`` when SAELens is
run, else by this script with the same draw; ``setup.sae_files`` says which, and with SAELens whether this script's
draw equals SAELens's files): ``relu_resid0`` (standard ReLU, ``blocks.0.hook_resid_post``), ``topk_mlp1`` (TopK
k = 8, ``blocks.1.hook_mlp_out``), ``jumprelu_attn1`` (JumpReLU, ``blocks.1.hook_attn_out``); and a sparsify TopK
SAE written by sparsify on the layer-0 output. Ours evaluates the six windows with ``target_mask=None`` and with
``target_mask=attention_mask``; SAELens runs ``run_evals`` on a TransformerLens copy of the model with
``exclude_special_tokens=False`` (its default ``True`` excludes nothing here: the TransformerLens copy has no
tokenizer) and with ``exclude_special_tokens=[1, 3]`` (BOS and pad ids: what the default excludes on a tokenizer with
these special ids).

Definitional differences the output demonstrates (``unaligned*`` entries), and their alignment (``aligned*`` entries,
which agree to ~1e-6 relative or better; ``ce_recovered`` after dividing by its amplification):

* FVU / L0 / dead / shrinkage / density tokens: ours drops column 0 (BOS) and the positions ``target_mask`` drops
  (padding); SAELens drops the positions holding special-token ids (none by default here, so it counts BOS). Aligned:
  ``target_mask=attention_mask`` against ``exclude_special_tokens=[1, 3]`` (the same token set when BOS sits only in
  column 0 and pads only where the mask is 0), and a recomputation over all tokens against SAELens's default.
* CE: ours counts the predictions whose *target* is kept and splices the module at every position; SAELens with
  excluded ids counts the predictions whose *source* token is not special and does not splice at special positions.
  Aligned: no exclusion on either side, and a recomputation (source-masked, not spliced at BOS / pad) against
  ``exclude_special_tokens=[1, 3]``. ``ce_recovered`` is a ratio of CE differences: its entries carry the
  ``amplification`` of relative CE errors into it (compare ``rel / amplification``).
* KL: SAELens also counts the last position (a prediction without a target); ours does not. Aligned: a recomputation
  over all positions (and over non-special positions, spliced except at BOS / pad, against the excluded run).
* sparsify's trainer and Llamascopium average per-batch FVUs (explained variances); ours pools the sums over all
  batches (batch-size invariant). Aligned: one batch holding all kept tokens. Llamascopium's
  ``explained_variance_legacy`` is a mean of per-token explained variances (a different quantity).

``from_scratch``: every ``evaluate`` metric recomputed in plain torch (fp64) from the site values, latents,
reconstructions and logits that forward hooks on the plain HF module record, with our documented definitions; also
for a target mask with holes (``holes_relu_resid0``).

Install each peer into its own venv: torch 2.13.0 first (the recorded run used its CPU build), then the peer, then
for SAELens and Llamascopium TransformerLens without its dependencies::

    python -m venv /tmp/peer_sl && /tmp/peer_sl/bin/pip install torch==2.13.0 && \\
        /tmp/peer_sl/bin/pip install sae-lens==6.54.12 && \\
        /tmp/peer_sl/bin/pip install --no-deps transformer-lens==3.9.0 better-abc
    python -m venv /tmp/peer_sp && /tmp/peer_sp/bin/pip install torch==2.13.0 && \\
        /tmp/peer_sp/bin/pip install eai-sparsify==1.3.3
    python -m venv /tmp/peer_ls && /tmp/peer_ls/bin/pip install torch==2.13.0 && \\
        /tmp/peer_ls/bin/pip install llamascopium==2.0.0b34 && \\
        /tmp/peer_ls/bin/pip install --no-deps transformer-lens==3.9.0 better-abc

Run from the repository root with our interpreter (nnsight-lorsa installed); a peer whose ``--*-python`` is omitted is
skipped (with SAELens omitted, this script writes the SAE files itself)::

    python scripts/peer_checks/evaluate/run.py --saelens-python /tmp/peer_sl/bin/python \\
        --sparsify-python /tmp/peer_sp/bin/python --llamascopium-python /tmp/peer_ls/bin/python \\
        --work /tmp/evaluate_vs_peers [--out benchmarks/results/evaluate_vs_peers.json]

``--work`` holds the model, tokens, SAE files and every side's results (the entries this script writes there are
replaced on each run). Relative differences are ``|ours - peer| / |peer|``; ``feature_density`` entries give the
largest absolute difference of the per-feature densities instead.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import _shared
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
#: aligned entries above this (``rel``, or ``rel / amplification`` where given) are listed in the summary
TOL = 1e-5
#: the fields SAELens 6.54.12's ``save_model`` writes to ``cfg.json`` (this script's writer repeats them)
SAELENS_CFG = {"d_in": _shared.D_MODEL, "d_sae": _shared.D_SAE, "dtype": "float32", "device": "cpu",
               "apply_b_dec_to_input": True, "normalize_activations": "none", "reshape_activations": "none"}
SAELENS_CFG_EXTRA = {"topk": {"k": _shared.TOPK, "rescale_acts_by_decoder_norm": False}}
SAELENS_VERSION = "6.54.12"
WORK_ENTRIES = ("model", "tokens.safetensors", "saes", "saelens", "ours", "sparsify", "llamascopium")
ACTIVATION_METRICS = ("fvu", "l0", "dead_frac", "l2_norm_in", "l2_norm_out", "l2_ratio",
                      "relative_reconstruction_bias", "feature_density")
CE_METRICS = ("ce_orig", "ce_spliced", "ce_zero", "ce_recovered")
SAELENS_COMPARISONS = {
    "aligned": "activation metrics: evaluate(target_mask=attention_mask) vs run_evals(exclude_special_tokens=[1, 3]); "
               "CE: evaluate(target_mask=None) vs run_evals(exclude_special_tokens=False)",
    "aligned_scratch_noexcl": "plain-torch recomputation with SAELens's definition vs run_evals(exclude_special_tokens="
                              "False): FVU over all 144 tokens (BOS included), KL over all positions (last included)",
    "aligned_scratch_excl": "plain-torch recomputation with SAELens's definition vs run_evals(exclude_special_tokens="
                            "[1, 3]): CE over predictions whose source is not BOS / pad, KL over the positions not "
                            "BOS / pad, the SAE spliced everywhere except at BOS / pad (zero ablation everywhere)",
    "unaligned_noexcl": "evaluate(target_mask=None) vs run_evals default (exclude_special_tokens=True excludes "
                        "nothing on this tokenizer-less model): SAELens counts BOS in the activation metrics and the "
                        "last position in KL",
    "unaligned_excl": "evaluate(target_mask=attention_mask) vs run_evals(exclude_special_tokens=[1, 3]) (the "
                      "default's behaviour with a tokenizer whose special ids are BOS 1 / pad 3): CE / KL count "
                      "kept targets and splice everywhere (ours) vs non-special sources, not spliced there (SAELens)",
}


# ---------------------------------------------------------------------------------------------------------- fixture


def prepare_work(work: Path) -> None:
    """``work`` created, with the entries this script writes there removed (nothing else is touched)."""
    _shared.clear_work(work, WORK_ENTRIES)


def build_model_and_tokens(work: Path) -> None:
    """The random GPT-2 (``WORK/model``) and the windows (``WORK/tokens.safetensors``)."""
    import transformers  # after setup(): offline

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=_shared.D_MODEL, n_head=4, n_layer=2, vocab_size=_shared.VOCAB,
                                  n_positions=64, bos_token_id=_shared.BOS_ID, eos_token_id=_shared.EOS_ID,
                                  pad_token_id=_shared.PAD_ID, initializer_range=0.2)
    transformers.GPT2LMHeadModel(cfg).eval().save_pretrained(_shared.model_dir(work))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(_shared.PAD_ID + 1, _shared.VOCAB, (_shared.N_WINDOWS, _shared.WINDOW), generator=g)
    ids[:, 0] = _shared.BOS_ID
    attention_mask = torch.ones_like(ids)
    for row, col in _shared.PADDED_FROM.items():
        ids[row, col:] = _shared.PAD_ID
        attention_mask[row, col:] = 0
    g = torch.Generator().manual_seed(_shared.HOLES_SEED)
    holes = torch.rand(ids.shape, generator=g) < _shared.HOLES_KEEP
    holes[:, 0] = True
    holes[:, -1] = True
    save_file({"input_ids": ids, "attention_mask": attention_mask, "holes_mask": holes}, _shared.tokens_file(work))


def plain_sae(name: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """SAE ``name``'s ``cfg.json`` and weights as SAELens writes them, drawn without SAELens."""
    arch, hook, _, _, seed = _shared.SAE_CASES[name]
    d, f = _shared.D_MODEL, _shared.D_SAE
    shapes = {"W_enc": (d, f), "W_dec": (f, d), "b_enc": (f,), "b_dec": (d,), "threshold": (f,)}
    order = _shared.SAELENS_PARAM_ORDER[arch]
    weights = {k: torch.zeros(shapes[k]) for k in order}
    _shared.randomize_(weights, order, seed)
    cfg = {**SAELENS_CFG, "metadata": {"sae_lens_version": SAELENS_VERSION, "sae_lens_training_version":
                                       SAELENS_VERSION, "hook_name": hook},
           **SAELENS_CFG_EXTRA.get(arch, {}), "architecture": arch}
    return cfg, weights


def write_plain_saes(work: Path) -> None:
    for name in _shared.SAE_CASES:
        cfg, weights = plain_sae(name)
        _shared.write_json(_shared.sae_dir(work, name) / "cfg.json", cfg)
        save_file(weights, _shared.sae_dir(work, name) / "sae_weights.safetensors")


def plain_matches_saelens(work: Path, saelens: dict[str, Any]) -> bool:
    """Whether this script's draw (config, weights bit for bit, parameter order) equals the files SAELens wrote."""
    for name in _shared.SAE_CASES:
        cfg, weights = plain_sae(name)
        theirs = load_file(_shared.sae_dir(work, name) / "sae_weights.safetensors")
        if (_shared.read_json(_shared.sae_dir(work, name) / "cfg.json") != cfg or theirs.keys() != weights.keys()
                or any(not torch.equal(theirs[k], weights[k]) for k in weights)
                or tuple(saelens["saes"][name]["param_order"]) != _shared.SAELENS_PARAM_ORDER[cfg["architecture"]]):
            return False
    return True


def run_side(python: str, script: str, work: Path, *args: str) -> None:
    """``python HERE/script WORK args…`` offline, one thread; its output passes through."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    print(f"[evaluate_vs_peers] {' '.join((python, script, *args))}", flush=True)
    subprocess.run([python, str(HERE / script), str(work), *args], check=True, env=env)


# ------------------------------------------------------------------------------------------------ plain-torch metrics


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def pair(ours: float, peer: float, **extra: float) -> dict[str, float]:
    return {"ours": ours, "peer": peer, "rel": rel(ours, peer), **extra}


def density_pair(ours: list[float] | torch.Tensor, peer: list[float] | torch.Tensor) -> dict[str, float]:
    diff = torch.as_tensor(ours, dtype=torch.float64) - torch.as_tensor(peer, dtype=torch.float64)
    return {"max_abs_diff": float(diff.abs().max())}


def fvu(y: torch.Tensor, out: torch.Tensor) -> float:
    """Sum of squared errors over the total variance about the per-dimension mean (fp64), over the rows given."""
    y, out = y.double(), out.double()
    return float((y - out).pow(2).sum() / (y - y.mean(0)).pow(2).sum())


def ce_per_prediction(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``(batch, pos - 1)`` next-token CE (fp64): prediction ``t`` is made at position ``t`` for target ``t + 1``."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).double(), ids[:, 1:].reshape(-1),
                           reduction="none").view(ids.shape[0], -1)


def kl_per_position(lo: torch.Tensor, lq: torch.Tensor) -> torch.Tensor:
    """``(batch, pos)`` KL(softmax(lo) ‖ softmax(lq)) (fp64)."""
    p, q = lo.double().log_softmax(-1), lq.double().log_softmax(-1)
    return (p.exp() * (p - q)).sum(-1)


def ce_recovered(ce_orig: float, ce_spliced: float, ce_zero: float) -> float:
    return (ce_zero - ce_spliced) / (ce_zero - ce_orig)


def amplification(ce_orig: float, ce_spliced: float, ce_zero: float) -> float:
    """Bound on how much ``ce_recovered``'s relative error exceeds its CEs' relative errors (conditioning of the two
    differences in its ratio)."""
    return ((abs(ce_zero) + abs(ce_spliced)) / abs(ce_zero - ce_spliced)
            + (abs(ce_zero) + abs(ce_orig)) / abs(ce_zero - ce_orig))


def with_amplification(entry: dict[str, Any], ce: dict[str, Any]) -> None:
    """``entry`` (a ``ce_recovered`` comparison) given the amplification of ``ce``'s CEs and its rel divided by it."""
    entry["amplification"] = amplification(ce["ce_orig"], ce["ce_spliced"], ce["ce_zero"])
    entry["rel_over_amplification"] = entry["rel"] / entry["amplification"]


def scratch_metrics(raw: dict[str, torch.Tensor], ids: torch.Tensor, target_mask: torch.Tensor,
                    spliced: str = "ls") -> dict[str, Any]:
    """Every ``evaluate`` metric from the hook tensors with our definitions: activation metrics over the kept
    positions except column 0, CE / KL over the predictions whose target is kept."""
    keep = target_mask.clone()
    keep[:, 0] = False
    y, z, out = raw["y"][keep].double(), raw["z"][keep], raw["out"][keep].double()
    norm_in, norm_out = y.norm(dim=-1), out.norm(dim=-1)
    pred = target_mask[:, 1:]
    ce = {k: float(ce_per_prediction(raw[key], ids)[pred].mean())
          for k, key in (("ce_orig", "lo"), ("ce_spliced", spliced), ("ce_zero", "lz"))}
    return {"fvu": fvu(y, out), "l0": float((z != 0).sum(-1).double().mean()),
            "dead_frac": float((~(z != 0).any(0)).double().mean()),
            "l2_norm_in": float(norm_in.mean()), "l2_norm_out": float(norm_out.mean()),
            "l2_ratio": float((norm_out / norm_in).mean()),
            "relative_reconstruction_bias": float(norm_out.pow(2).sum() / (y * out).sum()),
            "feature_density": (z != 0).double().mean(0), **ce, "ce_recovered": ce_recovered(**ce),
            "kl": float(kl_per_position(raw["lo"], raw[spliced])[:, :-1][pred].mean()), "n_tokens": int(pred.sum())}


def against_scratch(ours: dict[str, Any], scratch: dict[str, Any], metrics: tuple[str, ...]) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for k in metrics:
        if k == "feature_density":
            rows[k] = density_pair(ours[k], scratch[k])
        else:
            rows[k] = {"ours": ours[k], "scratch": scratch[k], "rel": rel(ours[k], scratch[k])}
    if "ce_recovered" in rows:
        with_amplification(rows["ce_recovered"], scratch)
    return rows


# ---------------------------------------------------------------------------------------------------------- compare


def compare_scratch(work: Path, ours: dict[str, Any], tok: dict[str, torch.Tensor]) -> dict[str, Any]:
    ids, am = tok["input_ids"], tok["attention_mask"].bool()
    metrics = (*ACTIVATION_METRICS, *CE_METRICS, "kl", "n_tokens")
    result: dict[str, Any] = {}
    for name in _shared.SAE_CASES:
        raw = load_file(_shared.side_dir(work, "ours") / f"{name}_raw.safetensors")
        result[name] = {label: against_scratch(ours["saes"][name][label], scratch_metrics(raw, ids, mask), metrics)
                        for label, mask in (("target_mask=None", torch.ones_like(am)),
                                            ("target_mask=attention_mask", am))}
    raw = load_file(_shared.side_dir(work, "ours") / "relu_resid0_raw.safetensors")
    result["holes_relu_resid0"] = against_scratch(
        ours["holes_relu_resid0"], scratch_metrics(raw, ids, tok["holes_mask"]),
        ("fvu", "l0", "ce_orig", "ce_spliced", "ce_zero", "kl", "n_tokens"))
    return result


def saelens_values(m: dict[str, Any], density: list[float]) -> dict[str, Any]:
    """SAELens's ``run_evals`` output under our metric names."""
    perf, shrink = m["model_performance_preservation"], m["shrinkage"]
    return {"fvu": 1 - m["reconstruction_quality"]["explained_variance"], "l0": m["sparsity"]["l0"],
            "dead_frac": float((torch.tensor(density) == 0).double().mean()),
            **{k: shrink[k] for k in ("l2_norm_in", "l2_norm_out", "l2_ratio", "relative_reconstruction_bias")},
            "feature_density": density, "ce_orig": perf["ce_loss_without_sae"], "ce_spliced": perf["ce_loss_with_sae"],
            "ce_zero": perf["ce_loss_with_ablation"], "ce_recovered": perf["ce_loss_score"],
            "kl": m["model_behavior_preservation"]["kl_div_with_sae"]}


def saelens_definitions(raw: dict[str, torch.Tensor], ids: torch.Tensor) -> dict[str, dict[str, float]]:
    """Our tensors measured with SAELens's definitions: ``noexcl`` (every token / position) and ``excl`` (BOS / pad
    ids excluded: CE by source token, the SAE not spliced at BOS / pad)."""
    special = (ids == _shared.BOS_ID) | (ids == _shared.PAD_ID)
    source = ~special[:, :-1]
    ce = {k: float(ce_per_prediction(raw[key], ids)[source].mean())
          for k, key in (("ce_orig", "lo"), ("ce_spliced", "ls_nospecial"), ("ce_zero", "lz"))}
    return {"noexcl": {"fvu": fvu(raw["y"].flatten(0, 1), raw["out"].flatten(0, 1)),
                       "kl": float(kl_per_position(raw["lo"], raw["ls"]).mean())},
            "excl": {**ce, "ce_recovered": ce_recovered(**ce),
                     "kl": float(kl_per_position(raw["lo"], raw["ls_nospecial"])[~special].mean())}}


def compare_saelens(work: Path, ours: dict[str, Any], saelens: dict[str, Any], ids: torch.Tensor) -> dict[str, Any]:
    per_sae: dict[str, Any] = {}
    tl_vs_hf: dict[str, Any] = {}
    for name in _shared.SAE_CASES:
        theirs = saelens["saes"][name]
        sl0 = saelens_values(theirs["noexcl"]["metrics"], theirs["noexcl"]["feature_density"])
        sl1 = saelens_values(theirs["excl_bos_pad"]["metrics"], theirs["excl_bos_pad"]["feature_density"])
        o0, o1 = ours["saes"][name]["target_mask=None"], ours["saes"][name]["target_mask=attention_mask"]
        raw = load_file(_shared.side_dir(work, "ours") / f"{name}_raw.safetensors")
        rec = saelens_definitions(raw, ids)
        rows: dict[str, dict[str, Any]] = {}
        for k in ACTIVATION_METRICS:
            both = density_pair if k == "feature_density" else pair
            rows[k] = {"aligned": both(o1[k], sl1[k]), "unaligned_noexcl": both(o0[k], sl0[k])}
        rows["fvu"]["aligned_scratch_noexcl"] = pair(rec["noexcl"]["fvu"], sl0["fvu"])
        for k in CE_METRICS:
            rows[k] = {"aligned": pair(o0[k], sl0[k]), "aligned_scratch_excl": pair(rec["excl"][k], sl1[k]),
                       "unaligned_excl": pair(o1[k], sl1[k])}
        for key, ev in (("aligned", o0), ("aligned_scratch_excl", rec["excl"]), ("unaligned_excl", o1)):
            with_amplification(rows["ce_recovered"][key], ev)
        rows["kl"] = {"aligned_scratch_noexcl": pair(rec["noexcl"]["kl"], sl0["kl"]),
                      "aligned_scratch_excl": pair(rec["excl"]["kl"], sl1["kl"]),
                      "unaligned_noexcl": pair(o0["kl"], sl0["kl"]), "unaligned_excl": pair(o1["kl"], sl1["kl"])}
        per_sae[name] = rows
        peer_raw = load_file(_shared.side_dir(work, "saelens") / f"{name}_raw.safetensors")
        tl_vs_hf[name] = {k: float((raw[a] - peer_raw[b]).abs().max())
                          for k, a, b in (("y", "y", "x"), ("z", "z", "z"), ("out", "out", "out"),
                                          ("logits_orig", "lo", "logits_orig"),
                                          ("logits_spliced", "ls", "logits_spliced"),
                                          ("logits_zero", "lz", "logits_zero"))}
    return {"versions": saelens["versions"], "comparisons": SAELENS_COMPARISONS,
            "tl_vs_hf_max_abs": {"logits": saelens["tl_vs_hf_logits_max_abs"], **tl_vs_hf}, "per_sae": per_sae}


def compare_sparsify(work: Path) -> dict[str, Any]:
    peer = _shared.read_json(_shared.side_dir(work, "sparsify") / "results.json")
    ours = _shared.read_json(_shared.side_dir(work, "ours") / "sparsify_results.json")
    by_bs = ours["by_batch_size"]
    one, four = by_bs["6"], by_bs["4"]
    invariance = {k: max(rel(by_bs[b][k], one[k]) if one[k] else abs(by_bs[b][k]) for b in ("4", "1"))
                  for k in ("fvu", "l0", "dead_frac", "ce_orig", "ce_spliced", "ce_zero", "kl", "l2_norm_in",
                            "l2_norm_out", "l2_ratio", "relative_reconstruction_bias")}
    return {"versions": peer["versions"], "our_sites": ours["sites"],
            "comparisons": {
                "aligned": "evaluate(target_mask=attention_mask, batch_size=6) vs sparsify's fvu / L0 / dead latents "
                           "on the same kept tokens in one batch",
                "unaligned_batches": "evaluate(..., batch_size=4) (sums pooled over rows 0-3 and 4-5) vs the mean of "
                                     "sparsify's per-batch FVUs over the same two batches"},
            "fvu": {"aligned": pair(one["fvu"], peer["fvu_one_batch_masked"]),
                    "unaligned_batches": pair(four["fvu"], peer["fvu_mean_of_batches"])},
            "l0": {"aligned": pair(one["l0"], peer["l0"])},
            "dead_frac": {"aligned": pair(one["dead_frac"], peer["n_dead"] / _shared.D_SAE)},
            "peer_only": {k: peer[k] for k in ("fvu_one_batch_all_tokens", "fvu_batches", "auxk_loss")},
            "ours_batch_size_invariance_max_rel": invariance}


def compare_llamascopium(work: Path, ours: dict[str, Any]) -> dict[str, Any]:
    peer = _shared.read_json(_shared.side_dir(work, "llamascopium") / "results.json")
    ev = ours["saes"]["topk_mlp1"]["target_mask=attention_mask"]
    one, two = peer["one_batch"], peer["two_batches_4_2"]
    return {"versions": peer["versions"],
            "comparisons": {
                "aligned": "topk_mlp1 evaluate(target_mask=attention_mask) vs ExplainedVarianceMetric / L0Metric on "
                           "our y / out / z, the same kept tokens, one batch",
                "unaligned_batches": "the same vs two batches (rows 0-3, 4-5): Llamascopium averages per-batch "
                                     "explained variances",
                "unaligned_legacy": "the same vs 1 - explained_variance_legacy (one batch; a mean of per-token "
                                    "explained variances)"},
            "fvu": {"aligned": pair(ev["fvu"], 1 - one["metrics/explained_variance"]),
                    "unaligned_batches": pair(ev["fvu"], 1 - two["metrics/explained_variance"]),
                    "unaligned_legacy": pair(ev["fvu"], 1 - one["metrics/explained_variance_legacy"])},
            "l0": {"aligned": pair(ev["l0"], one["metrics/l0"]),
                   "aligned_two_batches": pair(ev["l0"], two["metrics/l0"])}}


def entries(tree: Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], dict[str, Any]]]:
    """Every comparison entry (a dict with ``rel`` or ``max_abs_diff``) of ``tree`` with its key path."""
    if not isinstance(tree, dict):
        return []
    if "rel" in tree or "max_abs_diff" in tree:
        return [(path, tree)]
    return [found for k, v in tree.items() for found in entries(v, (*path, k))]


def error_of(entry: dict[str, Any]) -> float:
    """An entry's error as judged against TOL: ``rel / amplification`` where given, else ``rel`` or the density's
    largest absolute difference."""
    for key in ("rel_over_amplification", "rel", "max_abs_diff"):
        if key in entry:
            return entry[key]
    raise KeyError(entry)


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """Per section, the worst error per metric of the aligned / from-scratch entries and the largest unaligned
    differences, and the aligned entries above TOL."""
    out: dict[str, Any] = {"tolerance": TOL}
    over: list[str] = []
    for section in ("from_scratch", "saelens", "sparsify", "llamascopium"):
        if section not in result:
            continue
        worst: dict[str, dict[str, float]] = {"aligned": {}, "unaligned": {}}
        for path, entry in entries(result[section]):
            kind = "unaligned" if any(p.startswith("unaligned") for p in path) else "aligned"
            metric = next((p for p in path if p in (*ACTIVATION_METRICS, *CE_METRICS, "kl", "n_tokens")), path[-1])
            err = error_of(entry)
            worst[kind][metric] = max(worst[kind].get(metric, 0.0), err)
            if kind == "aligned" and err > TOL:
                over.append("/".join((section, *path)))
        out[section] = {k: v for k, v in worst.items() if v}
    out["aligned_over_tolerance"] = over
    return out


# -------------------------------------------------------------------------------------------------------------- main


def print_table(result: dict[str, Any]) -> None:
    for section in ("from_scratch", "saelens", "sparsify", "llamascopium"):
        for path, entry in entries(result.get(section, {})):
            if "max_abs_diff" in entry:
                print(f"{section:13s} {'/'.join(path):70s} max|Δ| {entry['max_abs_diff']:.2e}")
                continue
            peer = entry.get("peer", entry.get("scratch"))
            print(f"{section:13s} {'/'.join(path):70s} {entry['ours']:12.7g} {peer:12.7g} rel {entry['rel']:.2e}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--saelens-python", help="interpreter with sae-lens 6.54.12 (omitted: SAELens skipped)")
    ap.add_argument("--sparsify-python", help="interpreter with eai-sparsify 1.3.3 (omitted: sparsify skipped)")
    ap.add_argument("--llamascopium-python", help="interpreter with llamascopium 2.0.0b34 (omitted: skipped)")
    ap.add_argument("--work", required=True, type=Path, help="folder for the model, tokens, SAE files and results")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "evaluate_vs_peers.json")
    args = ap.parse_args(argv)
    _shared.setup()
    work = args.work.resolve()
    prepare_work(work)
    build_model_and_tokens(work)
    if args.saelens_python:
        run_side(args.saelens_python, "saelens_side.py", work)
    else:
        write_plain_saes(work)
    run_side(sys.executable, "ours_side.py", work, "saes")
    if args.sparsify_python:
        run_side(args.sparsify_python, "sparsify_side.py", work)
        run_side(sys.executable, "ours_side.py", work, "sparsify")
    if args.llamascopium_python:
        run_side(args.llamascopium_python, "llamascopium_side.py", work)

    tok = load_file(_shared.tokens_file(work))
    ours = _shared.read_json(_shared.side_dir(work, "ours") / "results.json")
    saelens = _shared.read_json(_shared.side_dir(work, "saelens") / "results.json") if args.saelens_python else None
    result: dict[str, Any] = {
        "about": __doc__.split("\n\n")[0].replace("\n", " "),
        "command": "python scripts/peer_checks/evaluate/run.py --saelens-python P --sparsify-python P "
                   "--llamascopium-python P --work DIR [--out benchmarks/results/evaluate_vs_peers.json]",
        "setup": {
            "model": "random GPT2LMHeadModel (torch seed 0): 2 layers, d_model 64, 4 heads, vocab 512, 64 positions, "
                     "initializer_range 0.2; BOS 1, EOS 2, pad 3; fp32 CPU, 1 thread",
            "tokens": "6 windows x 24 (generator seed 1, ids 4..511), BOS in column 0; row 4 padded from column 15, "
                      "row 5 from column 9 (pad id 3, attention mask 0); evaluate batch_size 6",
            "saes": {name: {"saelens_arch": arch, "saelens_hook": hook, "our_site": ours["saes"][name]["site"]}
                     for name, (arch, hook, *_) in _shared.SAE_CASES.items()},
            "sae_files": "written by SAELens's save_model" if saelens else "written by run.py (SAELens not run)",
            "plain_draw_equals_saelens_files": plain_matches_saelens(work, saelens) if saelens else None,
            "ours": {"versions": ours["versions"], "git_head": ours["git_head"]},
            "skipped": [p for p, a in (("saelens", args.saelens_python), ("sparsify", args.sparsify_python),
                                       ("llamascopium", args.llamascopium_python)) if not a],
        },
        "from_scratch": compare_scratch(work, ours, tok),
    }
    if saelens:
        result["saelens"] = compare_saelens(work, ours, saelens, tok["input_ids"])
    if args.sparsify_python:
        result["sparsify"] = compare_sparsify(work)
    if args.llamascopium_python:
        result["llamascopium"] = compare_llamascopium(work, ours)
    result["summary"] = summary(result)
    _shared.write_json(args.out, result)
    print_table(result)
    print(f"[evaluate_vs_peers] aligned entries over {TOL:g}: {result['summary']['aligned_over_tolerance'] or 'none'}")
    print(f"[evaluate_vs_peers] wrote {args.out}")


if __name__ == "__main__":
    main()
