"""Arguments of the wrong kind at the front door, run without the suite's beartype hook (as a researcher's process
runs them): ``python tests/wrong_kind_cases.py --json OUT`` writes one record per case, ``{"case", "error",
"message", "wrote"}`` (``error``: the exception's class name, None when the call returned). Read by
``tests/test_wrong_argument_kinds.py``."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings
from pathlib import Path

warnings.simplefilter("ignore")
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
from helpers import (  # noqa: E402
    LAYER,
    attribution_setup,
    make_clt,
    make_lorsa,
    make_sae,
    make_transcoder,
    random_ids,
    reconstruction_source,
    rm,
    tiny_hf_model,
    tiny_nnsight,
)

from nnsight_lorsa import (  # noqa: E402
    LorsaSet,
    SAESet,
    TokenDataset,
    TrainConfig,
    Trainer,
    TranscoderSet,
    get_adapter,
    load,
    patching,  # noqa: E402
    save,
)
from nnsight_lorsa.attribution import (  # noqa: E402
    Graph,
    PruneConfig,
    attribute,
    circuit_metrics,
    graph_scores,
    prune,
    save_neuronpedia,
    to_neuronpedia,
)
from nnsight_lorsa.envoy import (  # noqa: E402
    Site,
    load_model,  # noqa: E402
    load_tokenizer,
)
from nnsight_lorsa.formats import detect_format, register_format  # noqa: E402
from nnsight_lorsa.formats.registry import load_all  # noqa: E402
from nnsight_lorsa.modules import BatchTopK, JumpReLU, Lorsa, LorsaConfig, SparseAutoencoder  # noqa: E402
from nnsight_lorsa.sparse_attention import (  # noqa: E402
    SparseTrainConfig,
    evaluate_sparse,
    install_gated_attention,
    set_gate_mode,
    train_sparse_attention,
)
from nnsight_lorsa.training import ActivationCache, ActivationSource, write_activation_cache  # noqa: E402
from nnsight_lorsa.viz import (  # noqa: E402
    plot_graph,
    plot_heads_spanned,
    plot_operand_grid,
    plot_training_curves,
    plot_z_pattern,
    render_html,
    token_pieces,
    write_dashboard,
)


def cases(lorsa, model, scratch: Path) -> dict:
    sae = make_sae(d_in=8, d_sae=16, activation="topk", activation_params={"k": 2})
    out = {
        "LorsaSet(model, [lorsa])": lambda: LorsaSet(model, [lorsa]),
        "LorsaSet(model, lorsa)": lambda: LorsaSet(model, lorsa),
        "LorsaSet(model, (layer, lorsa))": lambda: LorsaSet(model, (LAYER, lorsa)),
        "TranscoderSet(model, [lorsa])": lambda: TranscoderSet(model, [lorsa]),
        "SAESet(model, [sae])": lambda: SAESet(model, [sae]),
        "Trainer(sae, None, config)": lambda: Trainer(sae, None, TrainConfig(total_steps=2)),
        "Trainer(sae, 3, config)": lambda: Trainer(sae, 3, TrainConfig(total_steps=2)),
    }
    for label, path in (("None", None), ("3", 3), ("bytes", b"/tmp/x")):
        out[f"save(lorsa, {label})"] = lambda p=path: save(lorsa, p)
        out[f"load({label})"] = lambda p=path: load(p)
        out[f"load_all({label})"] = lambda p=path: load_all(p)
        out[f"LorsaSet.save({label})"] = lambda p=path: LorsaSet(model, {LAYER: lorsa}).save(p)
        out[f"LorsaSet.from_pretrained(model, {label})"] = lambda p=path: LorsaSet.from_pretrained(model, p)
        out[f"LorsaSet.from_pretrained(model, [{label}])"] = lambda p=path: LorsaSet.from_pretrained(model, [p])
    for label, value in (("None", None), ("Tensor", torch.zeros(2, 3, 8)), ("dict", {"x": torch.zeros(2, 3, 8)})):
        out[f"Trainer source returning {label}"] = (
            lambda v=value: Trainer(make_sae(d_in=8, d_sae=16, activation="topk", activation_params={"k": 2}),
                                    lambda i: v, TrainConfig(total_steps=2)).train(progress=False))
    for name, value in (("batch_size", "x"), ("batch_size", 2.5), ("batch_size", True), ("seq_len", 2.5),
                        ("gate_lr", "x"), ("target_ce", "x"), ("target_batches", 2.5), ("seed", 2.5),
                        ("lora_rank", 2.5), ("bos_id", 2.5), ("allow_slack_constraint", "no"),
                        ("init_bias", "x"), ("target_margin", None)):
        out[f"SparseTrainConfig({name}={value!r})"] = lambda n=name, v=value: SparseTrainConfig(**{n: v})
    for name, value in (("node_threshold", "x"), ("edge_threshold", None), ("keep_mass", True)):
        out[f"PruneConfig({name}={value!r})"] = lambda n=name, v=value: PruneConfig(**{n: v})
    out["SAEConfig(hook=['model.layers.3'])"] = lambda: make_sae(d_in=8, d_sae=16, hook=["model.layers.3"])
    graph_cases(out, scratch)
    patching_cases(out)
    training_cases(out, model, lorsa, scratch)
    gated = tiny_hf_model("llama")
    install_gated_attention(gated)
    out["set_gate_mode(topk, top_k=2.5)"] = lambda: set_gate_mode(gated, "topk", top_k=2.5)
    out["evaluate_sparse(ids outside the vocabulary)"] = lambda: evaluate_sparse(gated, torch.arange(3, 200), seq_len=8)
    out["train_sparse_attention(ids outside the vocabulary)"] = lambda: train_sparse_attention(
        gated, torch.arange(3, 200), SparseTrainConfig(total_steps=1, batch_size=2, seq_len=8), progress=False)
    out["arithmetic_task(template='x')"] = lambda: patching.arithmetic_task(model.tokenizer, template="x")
    out["BatchTopK(threshold_lr=nan)"] = lambda: BatchTopK(2, 16, threshold_lr=float("nan"))
    out["JumpReLU(threshold=nan)"] = lambda: JumpReLU(16, threshold=float("nan"))
    out["load_model([])"] = lambda: load_model([])
    module_cases(out, lorsa)
    for task in ("ioi_task", "greater_than_task", "induction_task", "arithmetic_task"):
        out[f"{task}(None)"] = lambda t=task: getattr(patching, t)(None)
    out["patch(None, values)"] = lambda: patching.patch(None, torch.zeros(3))
    out["detect_format(None)"] = lambda: detect_format(None)
    out["load_tokenizer(None)"] = lambda: load_tokenizer(None)
    out["register_format(None)"] = lambda: register_format(None)
    out["TokenDataset(tokens, target_mask=list)"] = lambda: TokenDataset(torch.ones(2, 4, dtype=torch.long),
                                                                          [[1, 1, 1, 1], [1, 1, 1, 0]])
    return out


def patching_cases(out: dict) -> None:
    """Experiments and head analyses given prompts nnsight cannot batch, an argument their mode ignores, or a flag
    that is not a bool (2026-11-29, fifth session: each raised deep in nnsight or ran ignoring it)."""
    from nnsight_lorsa import LorsaConfig, ReplacementModel
    from nnsight_lorsa.analysis import collect_top_activations, mhsa_correlation, ov_logit_lens, qk_feature_impacts
    from nnsight_lorsa.attribution import cache_for_attribution, qk_attribution
    from nnsight_lorsa.envoy.nnsight_internals import hf_module
    from nnsight_lorsa.patching import LorsaHead, MHSAHead, induction_task
    from nnsight_lorsa.viz import head_dashboard_data

    model, _, lorsas, tcs = attribution_setup("llama")
    r = rm(model, lorsas, tcs)
    task = induction_task(model.tokenizer, n_prompts=2, seq_len=3)
    ids = dict(correct_ids=task.correct_ids, incorrect_ids=task.incorrect_ids)
    head, heads = LorsaHead(1, 0), [LorsaHead(1, 0), LorsaHead(1, 1)]
    means = patching.mean_activations(r, heads, task.clean)
    for label, bad in (("5", 5), ("None", None), ("[]", []), ("2.5", 2.5), ("['']", [""])):
        out[f"ablation_effect(prompts={label})"] = lambda b=bad: patching.ablation_effect(r, b, [head], **ids)
        out[f"activation_patching(corrupt={label})"] = lambda b=bad: patching.activation_patching(
            r, task.clean, b, [head], **ids)
        out[f"mean_activations(prompts={label})"] = lambda b=bad: patching.mean_activations(r, [head], b)
        out[f"head_swap(prompts={label})"] = lambda b=bad: patching.head_swap(r, 1, 0, 1, b)
        out[f"random_ablation_control(prompts={label})"] = lambda b=bad: patching.random_ablation_control(
            r, b, heads, 1, n_samples=1, **ids)
        out[f"path_patching(clean={label})"] = lambda b=bad: patching.path_patching(
            r, b, [MHSAHead(0, 0)], corrupt=task.corrupt, **ids)
    out["path_patching(corrupt=5)"] = lambda: patching.path_patching(r, task.clean, [MHSAHead(0, 0)], corrupt=5, **ids)
    out["ablation_effect(means, mode='zero')"] = lambda: patching.ablation_effect(r, task.clean, [head], means=means,
                                                                                  **ids)
    out["random_ablation_control(means, mode='zero')"] = lambda: patching.random_ablation_control(
        r, task.clean, heads, 1, n_samples=1, means=means, **ids)
    out["circuit_size(means, mode='zero')"] = lambda: patching.circuit_size(r, task, heads, means=means)
    out["path_patching(means, mode='patch')"] = lambda: patching.path_patching(
        r, task.clean, [head], corrupt=task.corrupt, means=means, **ids)
    out["path_patching(corrupt, mode='zero')"] = lambda: patching.path_patching(
        r, task.clean, [head], corrupt=task.corrupt, mode="zero", **ids)
    out["circuit_size(task=Tensor)"] = lambda: patching.circuit_size(r, task.clean, heads)
    out["circuit_size(scores='x')"] = lambda: patching.circuit_size(r, task, heads, scores="x")
    out["circuit_size(ks=3)"] = lambda: patching.circuit_size(r, task, heads, ks=3)
    out["head_swap(swap='no')"] = lambda: patching.head_swap(r, 1, 0, 1, task.clean, swap="no")
    out["collect_top_activations(distinct_windows='no')"] = lambda: collect_top_activations(
        r, 1, task.clean, distinct_windows="no")
    out["mhsa_correlation(skip_first='no')"] = lambda: mhsa_correlation(r, 1, task.clean, skip_first="no")
    sae = make_sae(d_in=64, d_sae=16, activation="topk", activation_params={"k": 2})
    out["qk_feature_impacts(skip_first='no')"] = lambda: qk_feature_impacts(r, 1, 0, sae, task.clean,
                                                                             skip_first="no")
    out["ov_logit_lens(tokenizer=3)"] = lambda: ov_logit_lens(r, 1, tokenizer=3)
    for label, bad in (("2.5", 2.5), ("[]", []), ("[2]", [2]), ("True", True)):
        out[f"TaskBatch.select({label})"] = lambda b=bad: task.select(b)
    out["TaskBatch.to('x')"] = lambda: task.to("x")
    out["Site.mlp_input(model, 1)"] = lambda: Site.mlp_input(model, 1)
    out["adapter.sliding_window('x')"] = lambda: get_adapter(model).sliding_window("x")
    corr = mhsa_correlation(r, 1, task.clean)
    for bad in (float("nan"), 2.5, -1):
        out[f"MHSACorrelation.heads_spanned({bad!r})"] = lambda b=bad: corr.heads_spanned(b)
    qka = qk_attribution(r, task.clean[0], layer=1, head=0, query_pos=3, key_pos=1)
    out["QKAttribution.top_pairs(-1)"] = lambda: qka.top_pairs(-1)
    impacts = qk_feature_impacts(r, 1, 0, sae, task.clean)
    out["QKFeatureImpacts.top_query_features(-1)"] = lambda: impacts.top_query_features(-1)
    mhsa = get_adapter(model).mhsa_weights(hf_module(model), 1)
    out["LorsaConfig.from_mhsa(qk_heads_per_mhsa_head=True)"] = lambda: LorsaConfig.from_mhsa(
        mhsa, n_ov_heads=16, top_k=4, qk_heads_per_mhsa_head=True)
    tok = model.tokenizer
    out["induction_task(token_pool=3)"] = lambda: patching.induction_task(tok, token_pool=3)
    out["ioi_task(template=None)"] = lambda: patching.ioi_task(tok, template=None)
    out["ioi_task(names=3)"] = lambda: patching.ioi_task(tok, names=3)
    out["greater_than_task(years=5)"] = lambda: patching.greater_than_task(tok, years=5)
    out["greater_than_task(noun=3)"] = lambda: patching.greater_than_task(tok, noun=3)
    out["greater_than_task(century='13')"] = lambda: patching.greater_than_task(tok, century="13")
    out["arithmetic_task(pairs='x')"] = lambda: patching.arithmetic_task(tok, pairs="x")
    out["arithmetic_task(template=None)"] = lambda: patching.arithmetic_task(tok, template=None)
    out["cache_for_attribution(remote='x')"] = lambda: cache_for_attribution(r, task.clean[0], remote="x")
    for label, bad in (("'x'", "x"), ("0", 0), ("[]", [])):
        out[f"LorsaSet(adapter={label})"] = lambda b=bad: LorsaSet(model, lorsas, adapter=b)
        out[f"ReplacementModel(adapter={label})"] = lambda b=bad: ReplacementModel(model, lorsas=lorsas, adapter=b)
    top = collect_top_activations(r, 1, task.clean)
    out["head_dashboard_data(correlation=3)"] = lambda: head_dashboard_data(r, 1, 0, top, task.clean, correlation=3)
    out["head_dashboard_data(extra='x')"] = lambda: head_dashboard_data(r, 1, 0, top, task.clean, extra="x")


def module_cases(out: dict, lorsa) -> None:
    """A replacement module's constructor given a dict or None for its config, or a dtype / device of the wrong
    kind."""
    sae = make_sae(d_in=8, d_sae=16, activation="topk", activation_params={"k": 2})
    kinds = {"Lorsa": (Lorsa, lorsa.cfg), "SparseAutoencoder": (SparseAutoencoder, sae.cfg)}
    for name, (cls, cfg) in kinds.items():
        out[f"{name}(dict)"] = lambda c=cls, f=cfg: c(f.to_dict())
        out[f"{name}(None)"] = lambda c=cls: c(None)
        for label, kw in (("dtype='bf16'", {"dtype": "bf16"}), ("dtype=float", {"dtype": float}),
                          ("device=3.5", {"device": 3.5})):
            out[f"{name}(cfg, {label})"] = lambda c=cls, f=cfg, k=kw: c(f, **k)
    # the Lorsa's primitives (2026-11-29, sixth session): a raw TypeError / RuntimeError, or a top-k over the wrong
    # width that ran
    n, d = lorsa.cfg.n_ov_heads, lorsa.cfg.d_model
    for label, bad in (("None", None), ("list", [[0.0] * d]), ("wrong width", torch.zeros(1, 2, d - 1)),
                       ("int tensor", torch.zeros(1, 2, d, dtype=torch.long))):
        out[f"Lorsa.values({label})"] = lambda b=bad: lorsa.values(b)
    for label, bad in (("None", None), ("list", [[0.0] * n]), ("wrong width", torch.zeros(1, 2, n - 1)),
                       ("int tensor", torch.zeros(1, 2, n, dtype=torch.long))):
        out[f"Lorsa.activation({label})"] = lambda b=bad: lorsa.activation(b)
        out[f"Lorsa.decode({label})"] = lambda b=bad: lorsa.decode(b)
    plain = Lorsa(LorsaConfig(d_model=16, n_qk_heads=2, d_qk_head=4, n_ov_heads=8, top_k=2))  # no RoPE (GPT-2's)
    for label, bad in (("'x'", "x"), ("list", [0, 1, 2]), ("float", torch.ones(3)), ("wrong length", torch.arange(2))):
        out[f"Lorsa without RoPE.forward(positions={label})"] = lambda b=bad: plain(torch.zeros(1, 3, 16), b)
    # the sparse coders' building blocks (2026-11-29, seventh session): a raw TypeError / RuntimeError, or a wrong-width
    # / integer input that ran (normalize, encoder_input, a CLT layer's skip: integer weights)
    norm_sae = make_sae(d_in=8, d_sae=16, normalize_activations="layer_norm", apply_b_dec_to_input=True)
    skip_tc, clt_layer = make_transcoder(skip=True, d_in=8, d_sae=16), make_clt(skip=True).by_layer()[1]
    blocks = {"SAE.normalize": norm_sae.normalize, "SAE.encoder_input": norm_sae.encoder_input,
              "SAE.denormalize(x, out=·)": lambda b: norm_sae.denormalize(torch.ones(1, 2, 8), b),
              "SkipTranscoder.skip": skip_tc.skip, "Transcoder.encoder_input": skip_tc.encoder_input,
              "CLT layer.skip": clt_layer.skip, "CLT layer.encoder_input": clt_layer.encoder_input}
    for name, call in blocks.items():
        width = clt_layer.clt.cfg.d_in if name.startswith("CLT") else 8
        for label, bad in (("None", None), ("wrong width", torch.zeros(1, 2, width - 1)),
                           ("int tensor", torch.zeros(1, 2, width, dtype=torch.long))):
            out[f"{name}({label})"] = lambda c=call, b=bad: c(b)
    from nnsight_lorsa.adapters import mhsa_forward

    mhsa = get_adapter(tiny_hf_model("llama")).mhsa_weights(tiny_hf_model("llama"), lorsa.cfg.layer or 0)
    for label, bad in (("wrong width", torch.zeros(1, 2, d - 1)), ("bf16", torch.zeros(1, 2, d, dtype=torch.bfloat16)),
                       ("fp64", torch.zeros(1, 2, d, dtype=torch.float64))):
        out[f"mhsa_forward(x={label})"] = lambda b=bad: mhsa_forward(mhsa, b)


def training_cases(out: dict, model, lorsa, scratch: Path) -> None:
    """Activation sources, caches, datasets and a loader's subfolder given the wrong kinds."""
    adapter = get_adapter(model)
    data = TokenDataset(torch.randint(3, 100, (6, 8), generator=torch.Generator().manual_seed(0)))
    site = Site.mlp_input(adapter, 1)
    out["ActivationSource.sae(batch_size=2.5)"] = lambda: ActivationSource.sae(model, site, data, batch_size=2.5)
    out["ActivationSource.sae(seed='x')"] = lambda: ActivationSource.sae(model, site, data, seed="x")
    out["ActivationSource.sae(dataset=Tensor)"] = lambda: ActivationSource.sae(model, site, data.tokens)
    out["write_activation_cache(sites='x')"] = lambda: write_activation_cache(model, "x", data, scratch / "c1")
    out["write_activation_cache(sites=[3])"] = lambda: write_activation_cache(model, [3], data, scratch / "c2")
    out["write_activation_cache(dataset=Tensor)"] = lambda: write_activation_cache(model, [site], data.tokens,
                                                                                   scratch / "c3")
    out["write_activation_cache(directory=None)"] = lambda: write_activation_cache(model, [site], data, None)
    out["write_activation_cache(batch_size=2.5)"] = lambda: write_activation_cache(model, [site], data, scratch / "c4",
                                                                                   batch_size=2.5)
    out["ActivationCache(None)"] = lambda: ActivationCache(None)
    out["TokenDataset.from_ids(seq_len=2.5)"] = lambda: TokenDataset.from_ids(torch.arange(3, 50), 2.5)
    out["TokenDataset.batch(1.5, 2)"] = lambda: data.batch(1.5, 2)
    tok, text = model.tokenizer, "ROMEO: But soft, what light through yonder window breaks? " * 4
    for bad in (2.5, True, "x"):
        out[f"TokenDataset.from_text(bos_token_id={bad!r})"] = lambda b=bad: TokenDataset.from_text(
            tok, text, 8, bos_token_id=b)
    out["TokenDataset.from_text(document_separator=3)"] = lambda: TokenDataset.from_text(tok, text, 8,
                                                                                          document_separator=3)
    for bad in (2.5, "x", -1):
        out[f"TokenDataset.from_documents(pad_token_id={bad!r})"] = lambda b=bad: TokenDataset.from_documents(
            tok, [text, text[:20]], 8, pad_token_id=b)
    out["TokenDataset.from_ids(1-D ids, target_mask)"] = lambda: TokenDataset.from_ids(
        torch.arange(3, 40), 8, target_mask=torch.ones(37, dtype=torch.bool))
    out["TokenDataset.from_text(bos_token_id past the tokenizer)"] = lambda: TokenDataset.from_text(
        tok, text, 8, bos_token_id=len(tok) + 5)
    out["TokenDataset.from_documents(pad_token_id past the tokenizer)"] = lambda: TokenDataset.from_documents(
        tok, [text, text[:20]], 8, pad_token_id=len(tok) + 5)
    out["TokenDataset.from_text(config=model)"] = lambda: TokenDataset.from_text(tok, text, 8, config=model)
    out["TokenDataset.from_ids(eos_token_id='x')"] = lambda: TokenDataset.from_ids(torch.arange(3, 40), 8,
                                                                                    eos_token_id="x")
    def trainer() -> Trainer:
        return Trainer(make_sae(d_in=8, d_sae=16, activation="topk", activation_params={"k": 2}),
                       reconstruction_source(2, 4, 8), TrainConfig(total_steps=2, norm_batches=1))

    out["Trainer.train(checkpoint_dir=3)"] = lambda: trainer().train(progress=False, checkpoint_dir=3)
    out["Trainer.train(progress='no')"] = lambda: trainer().train(progress="no")
    out["Trainer.save_checkpoint(None)"] = lambda: trainer().save_checkpoint(None)
    out["Trainer.resume(None, source)"] = lambda: Trainer.resume(None, reconstruction_source(2, 4, 8))
    save(lorsa, scratch / "saved")
    out["load(subfolder=3)"] = lambda: load(scratch / "saved", subfolder=3)
    out["load(local_files_only='no')"] = lambda: load(scratch / "saved", local_files_only="no")
    out["load(revision=3)"] = lambda: load(scratch / "saved", revision=3)
    out["load(format=[])"] = lambda: load(scratch / "saved", format=[])
    out["LorsaSet.from_pretrained(adapter='x')"] = lambda: LorsaSet.from_pretrained(model, scratch / "saved",
                                                                                      adapter="x")


def graph_cases(out: dict, scratch: Path) -> None:
    """A graph or prune result of the wrong kind (arguments in the wrong order, None, the prompt's ids) at every
    entry point that reads one, and a None path for a graph's files."""
    model, _, lorsas, tcs = attribution_setup("llama")
    replacement = rm(model, lorsas, tcs)
    ids = random_ids(1, 6)[0]
    graph = attribute(replacement, ids, batch_size=16)
    pruned = prune(graph)
    for label, bad in (("None", None), ("Tensor", ids), ("PruneResult", pruned)):
        out[f"prune({label})"] = lambda b=bad: prune(b)
        out[f"graph_scores({label})"] = lambda b=bad: graph_scores(b)
        out[f"to_neuronpedia({label})"] = lambda b=bad: to_neuronpedia(b, slug="t")
        out[f"save_neuronpedia({label})"] = lambda b=bad: save_neuronpedia(b, scratch / "g.json", slug="t")
        out[f"plot_graph({label}, pruned)"] = lambda b=bad: plot_graph(b, pruned)
        out[f"circuit_metrics(replacement, {label}, pruned)"] = lambda b=bad: circuit_metrics(replacement, b, pruned)
    for label, bad in (("Tensor", ids), ("Graph", graph)):
        out[f"to_neuronpedia(graph, {label})"] = lambda b=bad: to_neuronpedia(graph, b, slug="t")
        out[f"plot_graph(graph, {label})"] = lambda b=bad: plot_graph(graph, b)
        out[f"circuit_metrics(replacement, graph, {label})"] = lambda b=bad: circuit_metrics(replacement, graph, b)
    for name, bad in (("slug", None), ("slug", 3), ("scan", float("nan")), ("scan", ["m"]), ("creator_name", 3),
                      ("tokenizer", "x")):
        kw = {"slug": "t", name: bad}
        out[f"to_neuronpedia({name}={bad!r})"] = lambda k=kw: to_neuronpedia(graph, **k)
    out["circuit_metrics(lorsas, graph, pruned)"] = lambda: circuit_metrics(lorsas, graph, pruned)
    out["circuit_metrics(incorrect_token=2.5)"] = lambda: circuit_metrics(replacement, graph, pruned,
                                                                           incorrect_token=2.5)
    out["Graph.save(None)"] = lambda: graph.save(None)
    out["Graph.load(None)"] = lambda: Graph.load(None)
    out["save_neuronpedia(graph, None)"] = lambda: save_neuronpedia(graph, None)
    out["plot_graph(path=3)"] = lambda: plot_graph(graph, pruned, path=3)
    out["plot_graph(tokens=str)"] = lambda: plot_graph(graph, pruned, tokens="abcdef")
    out["render_html(path=3)"] = lambda: render_html(graph, pruned, path=3)
    out["Graph.edge_sum_error('values')"] = lambda: graph.edge_sum_error("values")
    out["Graph.ids_of('lorsa')"] = lambda: graph.ids_of("lorsa")
    out["Graph.ids_of(7)"] = lambda: graph.ids_of(7)
    n, one = graph.n_nodes, torch.tensor([0])
    for label, bad in (("-1", torch.tensor([-1])), ("n_nodes", torch.tensor([n])), ("0.5", torch.tensor([0.5]))):
        out[f"Graph.edge_values(targets={label})"] = lambda b=bad: graph.edge_values(b, one)
        out[f"Graph.edge_values(sources={label})"] = lambda b=bad: graph.edge_values(torch.tensor([n - 1]), b)
    graph.save(scratch / "graph")
    out["Graph.load(subfolder=0)"] = lambda: Graph.load(scratch / "graph", subfolder=0)
    out["Graph.load(local_files_only='no')"] = lambda: Graph.load(scratch / "graph", local_files_only="no")
    out["render_html(title=[])"] = lambda: render_html(graph, pruned, title=[])
    out["render_html(details=list)"] = lambda: render_html(graph, pruned, details=[1])
    out["plot_z_pattern(path=None)"] = lambda: plot_z_pattern(torch.ones(2, 2).tril(), ["a", "b"], None)
    out["plot_operand_grid(path=None)"] = lambda: plot_operand_grid(torch.ones(2, 2), None)
    out["plot_heads_spanned(path=None)"] = lambda: plot_heads_spanned(torch.tensor([1, 2]), None)
    out["plot_training_curves(path=None)"] = lambda: plot_training_curves([{"step": 0, "loss": 1.0}], None)
    out["write_dashboard(None, data)"] = lambda: write_dashboard(None, {"title": "t"})
    out["write_dashboard(path, None)"] = lambda: write_dashboard(scratch / "d.html", None)
    out["token_pieces(None, ids)"] = lambda: token_pieces(None, [1, 2])


def main(out_path: str) -> None:
    model, hf = tiny_nnsight("llama")
    lorsa = make_lorsa(hf, get_adapter(model), LAYER)
    records = []
    with tempfile.TemporaryDirectory() as d:
        scratch = Path(d)
        before = os.listdir(os.getcwd())
        for case, call in cases(lorsa, model, scratch).items():
            try:
                call()
                error, message = None, ""
            except Exception as e:  # noqa: BLE001 — recorded for the test
                error, message = type(e).__name__, str(e)
            records.append({"case": case, "error": error, "message": message,
                            "wrote": sorted(set(os.listdir(os.getcwd())) - set(before))})
    Path(out_path).write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main(sys.argv[sys.argv.index("--json") + 1])
