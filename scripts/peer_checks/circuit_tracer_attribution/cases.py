"""The cases of the check (imported by ``run.py``; plain data, no torch).

A case is a spec: ``family`` (llama, gemma2, gemma3, qwen2, qwen3, gpt2), ``kind`` (``plt``: a per-layer transcoder
set, ``clt``: a cross-layer transcoder), ``act`` (relu / jumprelu / topk, or one per layer), ``hooks`` (circuit-tracer's
``feature_input_hook`` / ``feature_output_hook``) and options: ``skip`` (bool or one per layer), ``k`` (TopK),
``neg_threshold``, ``frac`` (fraction of features active), ``d_model`` / ``n_layers`` / ``d_head`` / ``d_tc``,
``n_tokens``, ``pad`` (the model's pad token id: 0, the BOS token, unless set), ``window`` / ``layer_types``
(sliding attention), ``zero_wpe`` (GPT-2 without position embedding), ``store_bf16`` (files stored in bfloat16),
``targets`` / ``max_n_logits`` / ``desired_logit_prob``, ``max_feature_nodes`` / ``batch`` / ``update_interval``,
and the alignments read by circuit-tracer's side only, ``ct_no_dedup`` and ``ct_pad_skip`` (``their_side.py``).

The seed of a case is ``10 + its index in its group`` (the probe's numbering: the ``*_p`` groups, their group with
``pad=1`` and without GPT-2, are numbered after that filter).
"""

from __future__ import annotations

from typing import Any

H_MLP = ["mlp.hook_in", "mlp.hook_out"]
H_RESID = ["hook_resid_mid", "hook_mlp_out"]
H_NORM_MLPOUT = ["ln2.hook_normalized", "mlp.hook_out"]
H_GSCOPE = ["ln2.hook_normalized", "hook_mlp_out"]

Spec = dict[str, Any]

_GROUPS: dict[str, list[tuple[str, Spec]]] = {
    "base": [
        ("llama_relu_mlp", dict(family="llama", kind="plt", act="relu", hooks=H_MLP)),
        ("llama_jr_skip_norm", dict(family="llama", kind="plt", act="jumprelu", skip=True, hooks=H_NORM_MLPOUT)),
        ("llama_relu_resid", dict(family="llama", kind="plt", act="relu", hooks=H_RESID)),
        ("llama_topk", dict(family="llama", kind="plt", act="topk", hooks=H_MLP, k=6)),
        ("llama_clt_relu", dict(family="llama", kind="clt", act="relu", hooks=H_RESID)),
        ("llama_clt_jr", dict(family="llama", kind="clt", act="jumprelu", hooks=H_RESID)),
        ("gemma2_jr_gscope", dict(family="gemma2", kind="plt", act="jumprelu", hooks=H_GSCOPE, d_head=16)),
        ("gemma2_relu_skip_gscope", dict(family="gemma2", kind="plt", act="relu", skip=True, hooks=H_GSCOPE,
                                         d_head=16)),
        ("gemma2_relu_mlp", dict(family="gemma2", kind="plt", act="relu", hooks=H_MLP, d_head=16)),
        ("gemma2_jr_resid", dict(family="gemma2", kind="plt", act="jumprelu", hooks=H_RESID, d_head=16)),
        ("gemma2_clt_jr_resid", dict(family="gemma2", kind="clt", act="jumprelu", hooks=H_RESID, d_head=16)),
        ("gemma2_clt_relu_gscope", dict(family="gemma2", kind="clt", act="relu", hooks=H_GSCOPE, d_head=16)),
        ("gemma2_topk", dict(family="gemma2", kind="plt", act="topk", hooks=H_MLP, k=6, d_head=16)),
        ("qwen2_relu_mlp", dict(family="qwen2", kind="plt", act="relu", hooks=H_MLP)),
        ("qwen2_clt_relu", dict(family="qwen2", kind="clt", act="relu", hooks=H_RESID)),
        ("qwen3_jr_skip_mlp", dict(family="qwen3", kind="plt", act="jumprelu", skip=True, hooks=H_MLP, d_head=16)),
        ("qwen3_relu_norm", dict(family="qwen3", kind="plt", act="relu", hooks=H_NORM_MLPOUT, d_head=16)),
        ("qwen3_clt_jr", dict(family="qwen3", kind="clt", act="jumprelu", hooks=H_RESID, d_head=16)),
        ("gpt2_relu_resid", dict(family="gpt2", kind="plt", act="relu", hooks=H_RESID)),
        ("gpt2_jr_skip_mlp", dict(family="gpt2", kind="plt", act="jumprelu", skip=True, hooks=H_MLP)),
        ("gpt2_clt_relu", dict(family="gpt2", kind="clt", act="relu", hooks=H_RESID)),
    ],
    "more": [
        ("gpt2_relu_resid_nowpe", dict(family="gpt2", kind="plt", act="relu", hooks=H_RESID, zero_wpe=True)),
        ("gpt2_clt_relu_nowpe", dict(family="gpt2", kind="clt", act="relu", hooks=H_RESID, zero_wpe=True)),
        ("llama_mixed_act", dict(family="llama", kind="plt", act=["relu", "jumprelu", "relu"], hooks=H_MLP)),
        ("llama_mixed_skip", dict(family="llama", kind="plt", act="relu", skip=[False, True, False], hooks=H_MLP)),
        ("llama_jr_negthr", dict(family="llama", kind="plt", act="jumprelu", neg_threshold=True, hooks=H_MLP)),
        ("gemma2_jr_negthr", dict(family="gemma2", kind="plt", act="jumprelu", neg_threshold=True, hooks=H_GSCOPE,
                                  d_head=16)),
        ("llama_targets", dict(family="llama", kind="plt", act="relu", hooks=H_MLP, targets=[5, 17, 30, 2])),
        ("gemma2_targets", dict(family="gemma2", kind="plt", act="jumprelu", hooks=H_GSCOPE, d_head=16,
                                targets=[3, 40, 11])),
        ("llama_fewlogits", dict(family="llama", kind="plt", act="relu", hooks=H_MLP, max_n_logits=3,
                                 desired_logit_prob=0.3)),
        ("llama_12tok", dict(family="llama", kind="plt", act="relu", hooks=H_MLP, n_tokens=12)),
        ("gemma2_clt_12tok", dict(family="gemma2", kind="clt", act="jumprelu", hooks=H_GSCOPE, d_head=16,
                                  n_tokens=12)),
        ("qwen3_4tok", dict(family="qwen3", kind="plt", act="relu", hooks=H_MLP, d_head=16, n_tokens=4)),
        ("llama_big", dict(family="llama", kind="plt", act="jumprelu", skip=True, hooks=H_NORM_MLPOUT, n_layers=4,
                           d_model=64, d_tc=64, n_tokens=10)),
        ("gemma2_big_clt", dict(family="gemma2", kind="clt", act="relu", hooks=H_RESID, n_layers=4, d_model=64,
                                d_head=16, d_tc=64, n_tokens=10)),
    ],
    "g3": [
        ("gemma2_window3_gscope", dict(family="gemma2", kind="plt", act="jumprelu", hooks=H_GSCOPE, d_head=16,
                                       window=3)),
        ("gemma2_window3_clt", dict(family="gemma2", kind="clt", act="relu", hooks=H_RESID, d_head=16, window=3)),
        ("gemma3_jr_resid", dict(family="gemma3", kind="plt", act="jumprelu", hooks=H_RESID, d_head=16)),
        ("gemma3_jr_skip_gscope_w3", dict(family="gemma3", kind="plt", act="jumprelu", skip=True, hooks=H_GSCOPE,
                                          d_head=16, window=3)),
        ("gemma3_clt_jr_w3", dict(family="gemma3", kind="clt", act="jumprelu", hooks=H_RESID, d_head=16, window=3)),
        ("gemma3_relu_mlp", dict(family="gemma3", kind="plt", act="relu", hooks=H_MLP, d_head=16, n_tokens=11)),
    ],
    "g3b": [  # Gemma-3 with one RoPE base (all layers local or all global): circuit-tracer's buffer sharing is moot
        ("gemma3_alllocal_jr_gscope_w3", dict(family="gemma3", kind="plt", act="jumprelu", skip=True, hooks=H_GSCOPE,
                                              d_head=16, window=3, layer_types=["sliding_attention"] * 3)),
        ("gemma3_allglobal_clt_jr", dict(family="gemma3", kind="clt", act="jumprelu", hooks=H_RESID, d_head=16,
                                         layer_types=["full_attention"] * 3)),
        ("gemma3_alllocal_relu_mlp_11", dict(family="gemma3", kind="plt", act="relu", hooks=H_MLP, d_head=16,
                                             n_tokens=11, window=4, layer_types=["sliding_attention"] * 3)),
    ],
    "g3c": [  # Gemma-3 with local and global bases, circuit-tracer's buffer sharing off
        ("gemma3_jr_resid_nodedup", dict(family="gemma3", kind="plt", act="jumprelu", hooks=H_RESID, d_head=16,
                                         ct_no_dedup=True)),
        ("gemma3_jr_skip_gscope_w3_nodedup", dict(family="gemma3", kind="plt", act="jumprelu", skip=True,
                                                  hooks=H_GSCOPE, d_head=16, window=3, ct_no_dedup=True)),
        ("gemma3_clt_jr_w3_nodedup", dict(family="gemma3", kind="clt", act="jumprelu", hooks=H_RESID, d_head=16,
                                          window=3, ct_no_dedup=True)),
        ("gemma3_relu_mlp_nodedup", dict(family="gemma3", kind="plt", act="relu", hooks=H_MLP, d_head=16,
                                         n_tokens=11, ct_no_dedup=True)),
    ],
    "edge": [
        ("llama_2tok", dict(family="llama", kind="plt", act="relu", hooks=H_MLP, n_tokens=2)),
        ("gemma2_2tok_clt", dict(family="gemma2", kind="clt", act="jumprelu", hooks=H_GSCOPE, d_head=16, n_tokens=2)),
        ("gemma2_resid_mlpout", dict(family="gemma2", kind="plt", act="relu", hooks=["hook_resid_mid", "mlp.hook_out"],
                                     d_head=16)),
        ("gemma2_mlpin_hookmlpout", dict(family="gemma2", kind="plt", act="jumprelu", skip=True,
                                         hooks=["mlp.hook_in", "hook_mlp_out"], d_head=16)),
        ("llama_norm_hookmlpout_clt", dict(family="llama", kind="clt", act="relu",
                                           hooks=["ln2.hook_normalized", "hook_mlp_out"])),
        ("llama_clt_mlp", dict(family="llama", kind="clt", act="jumprelu", hooks=H_MLP)),
        ("qwen3_clt_norm", dict(family="qwen3", kind="clt", act="relu", hooks=H_NORM_MLPOUT, d_head=16)),
        ("gpt2_norm", dict(family="gpt2", kind="plt", act="relu", hooks=["ln2.hook_normalized", "mlp.hook_out"],
                           zero_wpe=True)),
        ("llama_dense_frac60", dict(family="llama", kind="plt", act="relu", hooks=H_MLP, frac=0.6)),
        ("llama_sparse_frac02", dict(family="llama", kind="plt", act="jumprelu", hooks=H_MLP, frac=0.02)),
        ("b_llama_big_budget_ties", dict(family="llama", kind="plt", act="relu", hooks=H_MLP, n_layers=4, d_model=64,
                                         d_tc=64, n_tokens=10, max_feature_nodes=150, batch=16)),
        ("b_llama_budget_over", dict(family="llama", kind="plt", act="relu", hooks=H_MLP, max_feature_nodes=5000,
                                     batch=8)),
        ("b_gemma3_budget_nodedup", dict(family="gemma3", kind="clt", act="jumprelu", hooks=H_RESID, d_head=16,
                                         ct_no_dedup=True, max_feature_nodes=45, batch=4)),
    ],
    "bf16": [
        ("llama_relu_bf16file", dict(family="llama", kind="plt", act="relu", hooks=H_MLP, store_bf16=True)),
        ("gemma2_jr_gscope_bf16file", dict(family="gemma2", kind="plt", act="jumprelu", hooks=H_GSCOPE, d_head=16,
                                           store_bf16=True)),
        ("gemma2_clt_bf16file", dict(family="gemma2", kind="clt", act="jumprelu", hooks=H_RESID, d_head=16,
                                     store_bf16=True)),
    ],
    "ui": [
        ("ui1_llama", dict(family="llama", kind="plt", act="relu", hooks=H_MLP, max_feature_nodes=33, batch=5,
                           update_interval=1, pad=1)),
        ("ui2_gemma2_clt", dict(family="gemma2", kind="clt", act="jumprelu", hooks=H_GSCOPE, d_head=16, n_tokens=10,
                                max_feature_nodes=57, batch=6, update_interval=2, pad=1)),
        ("ui7_qwen3", dict(family="qwen3", kind="plt", act="jumprelu", skip=True, hooks=H_MLP, d_head=16,
                           max_feature_nodes=70, batch=4, update_interval=7, pad=1)),
        ("ui1_gpt2", dict(family="gpt2", kind="plt", act="relu", hooks=H_RESID, zero_wpe=True, max_feature_nodes=25,
                          batch=3, update_interval=1)),
    ],
    "budget": [
        ("b_llama_relu", dict(family="llama", kind="plt", act="relu", hooks=H_MLP, max_feature_nodes=40, batch=8)),
        ("b_gemma2_jr", dict(family="gemma2", kind="plt", act="jumprelu", hooks=H_GSCOPE, d_head=16,
                             max_feature_nodes=60, batch=8)),
        ("b_llama_clt", dict(family="llama", kind="clt", act="relu", hooks=H_RESID, max_feature_nodes=50, batch=8)),
        ("b_qwen3_skip", dict(family="qwen3", kind="plt", act="jumprelu", skip=True, hooks=H_MLP, d_head=16,
                              max_feature_nodes=30, batch=16)),
        ("b_gpt2_nowpe", dict(family="gpt2", kind="plt", act="relu", hooks=H_RESID, zero_wpe=True,
                              max_feature_nodes=40, batch=8)),
        ("b_gemma2_clt_12", dict(family="gemma2", kind="clt", act="jumprelu", hooks=H_GSCOPE, d_head=16,
                                 n_tokens=12, max_feature_nodes=100, batch=8)),
    ],
}
# the same with pad_token_id 1 (not the BOS token), GPT-2 left out
for _g in ("base", "more", "g3c", "budget", "edge"):
    _GROUPS[_g + "_p"] = [(n + "_p", {**sp, "pad": 1}) for n, sp in _GROUPS[_g] if sp["family"] != "gpt2"]

#: group -> {case name: spec (seed included)}
GROUPS: dict[str, dict[str, Spec]] = {g: {n: {"seed": 10 + i, **sp} for i, (n, sp) in enumerate(cases)}
                                      for g, cases in _GROUPS.items()}
#: case name -> (group, spec)
CASES: dict[str, tuple[str, Spec]] = {n: (g, sp) for g, cases in GROUPS.items() for n, sp in cases.items()}
assert len(CASES) == sum(len(c) for c in GROUPS.values()), "case names must be unique across groups"

#: our pruning / scores against circuit-tracer's on these graphs (group ``prune``)
PRUNE_CASES = ["llama_relu_mlp_p", "gemma2_jr_gscope_p", "gemma2_clt_relu_gscope_p", "qwen3_clt_jr_p",
               "llama_12tok_p", "gpt2_relu_resid_nowpe"]
#: our other engines / settings against circuit-tracer's graph on these cases (group ``variants``)
VARIANT_CASES = ["llama_jr_skip_norm", "gemma2_jr_gscope", "gemma2_window3_clt", "qwen3_clt_jr",
                 "gemma3_jr_skip_gscope_w3_nodedup", "b_gemma2_jr", "gpt2_relu_resid_nowpe"]
VARIANTS = ("cached", "lean", "second", "batch3", "tracer")

#: the default run: every family, both transcoder kinds, each activation / skip / hook pair / option kind once or
#: so, the three known differences (each with its aligned re-run), pruning on three graphs, the variants on one
DEFAULT_CASES = [
    "llama_relu_mlp_p", "llama_jr_skip_norm_p", "llama_relu_resid", "llama_topk_p", "llama_clt_relu_p",
    "gemma2_jr_gscope_p", "gemma2_relu_skip_gscope_p", "gemma2_clt_jr_resid_p", "gemma2_topk_p",
    "qwen2_relu_mlp_p", "qwen2_clt_relu_p", "qwen3_jr_skip_mlp_p", "qwen3_clt_jr_p",
    "gpt2_relu_resid", "gpt2_clt_relu", "gpt2_relu_resid_nowpe", "gpt2_norm",
    "llama_mixed_act_p", "llama_mixed_skip", "llama_jr_negthr_p", "gemma2_targets_p", "llama_fewlogits_p",
    "llama_12tok_p", "gemma2_clt_12tok_p", "llama_2tok_p",
    "gemma2_window3_clt", "gemma3_jr_resid", "gemma3_allglobal_clt_jr", "gemma3_jr_skip_gscope_w3_nodedup_p",
    "gemma2_clt_bf16file", "b_gemma2_jr_p", "b_qwen3_skip_p", "b_llama_big_budget_ties_p", "ui2_gemma2_clt",
    "ui1_gpt2",
]
DEFAULT_PRUNE = ["llama_relu_mlp_p", "gemma2_jr_gscope_p", "gpt2_relu_resid_nowpe"]
DEFAULT_VARIANTS = ["gemma2_window3_clt"]
assert not set(DEFAULT_CASES + DEFAULT_PRUNE + DEFAULT_VARIANTS + PRUNE_CASES + VARIANT_CASES) - set(CASES)

#: the known differences: name -> (which side is right, why, the spec key that aligns circuit-tracer's run)
KNOWN: dict[str, tuple[str, str, str]] = {
    "gpt2_embedding": (
        "ours",
        "GPT-2's residual stream starts from wte[token] + wpe[pos]; our embedding node carries both, circuit-tracer's "
        "(hook_embed) the token embedding alone, so no node of its graph carries wpe's share and its rows do not sum "
        "to the node's value; aligned by zeroing wpe",
        "zero_wpe"),
    "gemma3_rope": (
        "ours",
        "circuit-tracer's _deduplicate_attention_buffers shares one rotary_sin/cos (the last layer's) across all "
        "layers, so where local and global layers have different RoPE bases (every released Gemma-3) its "
        "replacement model computes other logits than the model; ours equal the model's; aligned by switching the "
        "sharing off (or a model with one base: group g3b)",
        "ct_no_dedup"),
    "mixed_skip": (
        "ours",
        "circuit-tracer's TranscoderSet takes layer 0's skip flag (W_skip is not None) for the whole set, so the "
        "skip paths of the other layers are dropped from its graph (its rows then miss their share); aligned by "
        "giving every layer without a skip an all-zero W_skip (the same transcoders)",
        "ct_pad_skip"),
}


def known_difference(spec: Spec) -> str | None:
    """The known difference a spec runs into (``None``: the graphs should agree)."""
    if spec["family"] == "gpt2" and not spec.get("zero_wpe"):
        return "gpt2_embedding"
    types = spec.get("layer_types", ["sliding_attention", "full_attention"] * 2)[:spec.get("n_layers", 3)]
    if spec["family"] == "gemma3" and len(set(types)) > 1 and not spec.get("ct_no_dedup"):
        return "gemma3_rope"
    skip = spec.get("skip", False)
    if isinstance(skip, list) and len(set(skip)) > 1 and not spec.get("ct_pad_skip"):
        return "mixed_skip"
    return None


def aligned(spec: Spec) -> Spec:
    """The same case with its known difference aligned (same seed)."""
    return {**spec, KNOWN[known_difference(spec)][2]: True}
