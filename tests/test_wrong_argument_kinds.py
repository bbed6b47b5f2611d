"""Arguments of the wrong kind at the front door — a list where a set takes a mapping, ``None`` for a path, a
training source that is not callable or returns no ``Batch`` — are named errors of ours saying what was expected,
before anything is read, written or run. Each was a bare ``AttributeError`` / ``TypeError`` from deep inside (found
by a probe of the public entry points, 2026-11-29). The cases run in a fresh interpreter without the suite's
beartype hook (``tests/wrong_kind_cases.py``), which would refuse most of them first by their annotations."""

from __future__ import annotations

import pytest
from helpers import recorded_outcomes

EXPECTED = {
    "LorsaSet(model, [lorsa])": r"LorsaSet: modules must be a mapping {key: module}",
    "LorsaSet(model, lorsa)": r"LorsaSet: modules must be a mapping {key: module}",
    "LorsaSet(model, (layer, lorsa))": r"LorsaSet: modules must be a mapping {key: module}",
    "TranscoderSet(model, [lorsa])": r"TranscoderSet: modules must be a mapping",
    "SAESet(model, [sae])": r"SAESet: modules must be a mapping",
    "Trainer(sae, None, config)": r"source must be a callable index -> Batch",
    "Trainer(sae, 3, config)": r"source must be a callable index -> Batch",
    **{f"save(lorsa, {p})": r"save: the path must be a str or os.PathLike (a directory)"
       for p in ("None", "3", "bytes")},
    **{f"load({p})": r"load: the path must be a str or os.PathLike" for p in ("None", "3", "bytes")},
    **{f"load_all({p})": r"load_all: the path must be a str or os.PathLike" for p in ("None", "3", "bytes")},
    **{f"LorsaSet.save({p})": r"LorsaSet.save: the path must be" for p in ("None", "3", "bytes")},
    **{f"LorsaSet.from_pretrained(model, {p})": r"from_pretrained: sources must be a directory"
       for p in ("None", "3", "bytes")},
    **{f"LorsaSet.from_pretrained(model, [{p}])": r"the path must be a str or os.PathLike"
       for p in ("None", "3", "bytes")},
    **{f"Trainer source returning {label}": rf"the training source returned a {t} for batch 0, not a Batch"
       for label, t in (("None", "NoneType"), ("Tensor", "Tensor"), ("dict", "dict"))},
}
# (case, error class, message): checked config fields (2026-11-29, fourth session) — each was accepted (and ran wrong
# or failed deep in torch / peft) or was a bare TypeError
FIELDS = {
    **{f"SparseTrainConfig({n}={v!r})": ("ArgumentError", rf"SparseTrainConfig.{n} must be")
       for n, v in (("batch_size", "x"), ("batch_size", 2.5), ("batch_size", True), ("seq_len", 2.5),
                    ("gate_lr", "x"), ("target_ce", "x"), ("target_batches", 2.5), ("seed", 2.5),
                    ("lora_rank", 2.5), ("bos_id", 2.5), ("allow_slack_constraint", "no"), ("init_bias", "x"),
                    ("target_margin", None))},
    **{f"PruneConfig({n}={v!r})": ("ConfigMismatchError", f"prune: {n} must be a number")
       for n, v in (("node_threshold", "x"), ("edge_threshold", None), ("keep_mass", True))},
    "SAEConfig(hook=['model.layers.3'])": ("CheckpointError", "SAEConfig.hook must be None or a str"),
    "TokenDataset(tokens, target_mask=list)": ("ArgumentError", "TokenDataset: target_mask must be a bool tensor"),
    "set_gate_mode(topk, top_k=2.5)": ("GateConfigError", "top_k must be an int >= 1, got 2.5"),
}
# a graph or prune result of the wrong kind, and graph file paths (2026-11-29, fourth session): each was an
# AttributeError ('Tensor' object has no attribute 'nodes') or a bare TypeError from pathlib
GRAPH = {
    **{f"{fn}({label})": f"{where}(graph=...) must be a Graph, got a {label}"
       for label in ("None", "Tensor", "PruneResult")
       for fn, where in (("prune", "prune"), ("graph_scores", "graph_scores"), ("to_neuronpedia", "to_neuronpedia"),
                         ("save_neuronpedia", "to_neuronpedia"))},
    **{f"plot_graph({label}, pruned)": f"plot_graph(graph=...) must be a Graph, got a {label}"
       for label in ("None", "Tensor", "PruneResult")},
    **{f"circuit_metrics(replacement, {label}, pruned)": f"circuit_metrics(graph=...) must be a Graph, got a {label}"
       for label in ("None", "Tensor", "PruneResult")},
    **{f"to_neuronpedia(graph, {label})": f"to_neuronpedia(prune_result=...) must be a PruneResult, got a {label}"
       for label in ("Tensor", "Graph")},
    **{f"plot_graph(graph, {label})": f"plot_graph(pruned=...) must be a PruneResult, got a {label}"
       for label in ("Tensor", "Graph")},
    **{f"circuit_metrics(replacement, graph, {label})": f"circuit_metrics(pruned=...) must be a PruneResult, got "
       f"a {label}" for label in ("Tensor", "Graph")},
    "circuit_metrics(lorsas, graph, pruned)": "circuit_metrics(replacement=...) must be a ReplacementModel",
    "circuit_metrics(incorrect_token=2.5)": "circuit_metrics(incorrect_token=...) must be None or a token id",
    "Graph.save(None)": "Graph.save: the path must be a str or os.PathLike",
    "Graph.load(None)": "Graph.load: the path must be a str or os.PathLike",
    "save_neuronpedia(graph, None)": "save_neuronpedia: the path must be a str or os.PathLike",
    "plot_graph(path=3)": "plot_graph: the path must be a str or os.PathLike",
    # figures and pages (2026-11-29, fourth session): pathlib's TypeError, an AttributeError, or a str drawn as labels
    "plot_graph(tokens=str)": "plot_graph: tokens must be a list of str labels",
    "render_html(path=3)": "render_html: the path must be a str or os.PathLike",
    "render_html(details=list)": "render_html(details=...) must be None or a mapping",
    **{f"{fn}(path=None)": f"{fn}: the path must be a str or os.PathLike"
       for fn in ("plot_z_pattern", "plot_operand_grid", "plot_heads_spanned", "plot_training_curves")},
    "write_dashboard(None, data)": "write_dashboard: the path must be a str or os.PathLike",
    "write_dashboard(path, None)": "render_dashboard: data must be head_dashboard_data(...)'s dict",
    "token_pieces(None, ids)": "token_pieces: tokenizer must be a tokenizer with decode",
    # tasks, patch, the format registry, the tokenizer loader (2026-11-29, fourth session): 'NoneType' object is not
    # callable / has no attribute 'replacement' / 'name', pathlib's TypeError
    **{f"{task}(None)": f"{task}: tokenizer must be a tokenizer"
       for task in ("ioi_task", "greater_than_task", "induction_task", "arithmetic_task")},
    "detect_format(None)": "detect_format: the path must be a str or os.PathLike",
    "load_tokenizer(None)": "load_tokenizer: the path must be a str or os.PathLike",
    "register_format(None)": "register_format: fmt must be a Format",
    # module constructors (2026-11-29, fourth session): an AttributeError or torch's TypeError from torch.empty
    **{f"{kind}(dict)": f"{kind}(cfg=...) must be a {cfg}, got a dict" for kind, cfg in (
        ("Lorsa", "LorsaConfig"), ("SparseAutoencoder", "SparseCoderConfig"))},
    **{f"{kind}(None)": f"{kind}(cfg=...) must be a {cfg}, got a NoneType" for kind, cfg in (
        ("Lorsa", "LorsaConfig"), ("SparseAutoencoder", "SparseCoderConfig"))},
    **{f"{kind}(cfg, {label})": f"{kind}: {what} must be" for kind in ("Lorsa", "SparseAutoencoder")
       for label, what in (("dtype='bf16'", "dtype"), ("dtype=float", "dtype"), ("device=3.5", "device"))},
}
# activation sources, caches, datasets, a loader's subfolder (2026-11-29, fourth session): each was accepted (and failed
# at the first batch) or an AttributeError / TypeError from inside
TRAINING = {
    "ActivationSource.sae(batch_size=2.5)": ("ArgumentError", "ActivationSource(batch_size=...) must be an int >= 1"),
    "ActivationSource.sae(seed='x')": ("ArgumentError", "ActivationSource(seed=...) must be an int"),
    "ActivationSource.sae(dataset=Tensor)": ("ArgumentError", "ActivationSource(dataset=Tensor)"),
    "write_activation_cache(sites='x')": ("ArgumentError", "write_activation_cache(sites=...) must be a list of Sites"),
    "write_activation_cache(sites=[3])": ("ArgumentError", "['3'] are not Sites"),
    "write_activation_cache(dataset=Tensor)": ("ArgumentError", "write_activation_cache(dataset=...) must be a "
                                                                "TokenDataset, got a Tensor"),
    "write_activation_cache(directory=None)": ("ArgumentError", "write_activation_cache: the path must be a str"),
    "write_activation_cache(batch_size=2.5)": ("ActivationCacheError", "must be positive ints, got 2.5"),
    "ActivationCache(None)": ("ArgumentError", "ActivationCache: the path must be a str or os.PathLike"),
    "TokenDataset.from_ids(seq_len=2.5)": ("ArgumentError", "from_ids: seq_len must be an int >= 2"),
    "TokenDataset.batch(1.5, 2)": ("ArgumentError", "a batch index must be an int >= 0, got 1.5"),
    "load(subfolder=3)": ("ArgumentError", "load: subfolder must be None or a str"),
    "Trainer.train(checkpoint_dir=3)": ("ArgumentError", "Trainer.train: the path must be a str or os.PathLike"),
    "Trainer.train(progress='no')": ("ArgumentError", "Trainer.train(progress=...) must be True or False"),
    "Trainer.save_checkpoint(None)": ("ArgumentError", "checkpoint: the path must be a str or os.PathLike"),
    "Trainer.resume(None, source)": ("ArgumentError", "checkpoint: the path must be a str or os.PathLike"),
}


_PROMPTS = "must be prompts — a non-empty text, token ids"
# (case, error class, message): experiments' prompts, arguments their mode ignores, flags and export fields
# (2026-11-29, fifth session): path_patching(clean=None) and the ignored / truthy ones ran, the rest were raw errors
PATCHING = {
    **{f"{call}={label})": ("ArgumentError", f"{where}: {name} {_PROMPTS}")
       for label in ("5", "None", "[]", "2.5", "['']")
       for call, where, name in (("ablation_effect(prompts", "ablation_effect", "prompts"),
                                 ("activation_patching(corrupt", "activation_patching", "corrupt"),
                                 ("mean_activations(prompts", "mean_activations", "prompts"),
                                 ("head_swap(prompts", "head_swap", "prompts"),
                                 ("random_ablation_control(prompts", "random_ablation_control", "prompts"),
                                 ("path_patching(clean", "path_patching", "clean"))},
    "path_patching(corrupt=5)": ("ArgumentError", f"path_patching: corrupt {_PROMPTS}"),
    **{f"{where}(means, mode='zero')": ("ConfigMismatchError", f"{where}: means= is read only with mode='mean'")
       for where in ("ablation_effect", "random_ablation_control", "circuit_size")},
    "path_patching(means, mode='patch')": ("ConfigMismatchError",
                                           "path_patching: means= is read only with mode='mean'"),
    "path_patching(corrupt, mode='zero')": ("ConfigMismatchError",
                                            "path_patching: corrupt= is read only with mode='patch'"),
    "circuit_size(task=Tensor)": ("ArgumentError", "circuit_size(task=...) must be a TaskBatch, got a Tensor"),
    "circuit_size(scores='x')": ("ArgumentError", "circuit_size: scores must be None or a (batch, n) tensor"),
    "circuit_size(ks=3)": ("ArgumentError", "circuit_size: ks must be a sequence of ints, got 3"),
    "head_swap(swap='no')": ("ArgumentError", "head_swap(swap=...) must be True or False"),
    "collect_top_activations(distinct_windows='no')": ("ArgumentError", "collect_top_activations(distinct_windows=...) "
                                                       "must be True or False"),
    "mhsa_correlation(skip_first='no')": ("ArgumentError", "mhsa_correlation(skip_first=...) must be True or False"),
    "qk_feature_impacts(skip_first='no')": ("ArgumentError",
                                            "qk_feature_impacts(skip_first=...) must be True or False"),
    "ov_logit_lens(tokenizer=3)": ("ArgumentError", "tokenizer must be a tokenizer (with decode"),
    "to_neuronpedia(slug=None)": ("ArgumentError", "to_neuronpedia(slug=...) must be a str, got a NoneType"),
    "to_neuronpedia(slug=3)": ("ArgumentError", "to_neuronpedia(slug=...) must be a str, got a int"),
    "to_neuronpedia(scan=nan)": ("ArgumentError", "to_neuronpedia(scan=...) must be a str, got a float"),
    "to_neuronpedia(scan=['m'])": ("ArgumentError", "to_neuronpedia(scan=...) must be a str, got a list"),
    "to_neuronpedia(creator_name=3)": ("ArgumentError", "to_neuronpedia(creator_name=...) must be a str"),
    "to_neuronpedia(tokenizer='x')": ("ArgumentError", "tokenizer must be a tokenizer (with decode"),
    "induction_task(token_pool=3)": ("ArgumentError", "induction_task: token_pool must be a list of ints, got 3"),
    "ioi_task(template=None)": ("ArgumentError", "ioi_task: template must be a str, got None"),
    "ioi_task(names=3)": ("ArgumentError", "ioi_task: names must be a list of str, got 3"),
    "greater_than_task(years=5)": ("ArgumentError", "greater_than_task: years must be a list of ints, got 5"),
    "greater_than_task(noun=3)": ("ArgumentError", "greater_than_task: noun must be a str, got 3"),
    "greater_than_task(century='13')": ("ArgumentError", "century must be an int >= 0, got '13'"),
    "arithmetic_task(pairs='x')": ("ArgumentError", "arithmetic_task: pairs must be a list of (op1, op2) pairs"),
    "arithmetic_task(template=None)": ("ArgumentError", "arithmetic_task: template must be a str, got None"),
    "cache_for_attribution(remote='x')": ("ArgumentError",
                                          "cache_for_attribution(remote=...) must be True, False or 'local'"),
    **{f"{kind}(adapter={label})": ("ArgumentError", f"{kind}(adapter=...) must be None (the model's own")
       for kind in ("LorsaSet", "ReplacementModel") for label in ("'x'", "0", "[]")},
    "head_dashboard_data(correlation=3)": ("ArgumentError", "correlation must be None or mhsa_correlation(...)"),
    "head_dashboard_data(extra='x')": ("ArgumentError", "extra must be None or a mapping"),
    "load(local_files_only='no')": ("ArgumentError", "load(local_files_only=...) must be True or False"),
    "load(revision=3)": ("ArgumentError", "load: revision must be None or a str"),
    "load(format=[])": ("UnsupportedArchitectureError", "unknown checkpoint format []"),
    "LorsaSet.from_pretrained(adapter='x')": ("ArgumentError", "LorsaSet(adapter=...) must be None"),
    "render_html(title=[])": ("ArgumentError", "render_html(title=...) must be None (the prompt) or a str"),
    "Graph.edge_sum_error('values')": ("ArgumentError", "Graph.edge_sum_error(relative_to=...) must be 'value' or "
                                                        "'mass', got 'values'"),
    "Graph.ids_of('lorsa')": ("ArgumentError", "Graph.ids_of(kind=...) must be one of the node kinds"),
    "Graph.ids_of(7)": ("ArgumentError", "Graph.ids_of(kind=...) must be one of the node kinds"),
    **{f"Graph.edge_values({side}={label})": ("ArgumentError", f"Graph.edge_values: {side} {what}")
       for side in ("targets", "sources")
       for label, what in (("-1", "hold node ids from -1"), ("n_nodes", "hold node ids from"),
                           ("0.5", "must be an integer tensor of node ids, got a torch.float32 tensor"))},
    **{f"TaskBatch.select({label})": ("ArgumentError", "TaskBatch.select")
       for label in ("2.5", "[]", "[2]", "True")},
    "TaskBatch.to('x')": ("ArgumentError", "TaskBatch.to: device 'x' is not a device"),
    "Site.mlp_input(model, 1)": ("ArgumentError", "Site.mlp_input(adapter=...) must be a ArchitectureAdapter"),
    "adapter.sliding_window('x')": ("LayerOutOfRangeError", "'x'"),
    "Graph.load(subfolder=0)": ("ArgumentError", "Graph.load: subfolder must be None or a str"),
    "Graph.load(local_files_only='no')": ("ArgumentError", "Graph.load(local_files_only=...) must be True or False"),
    **{f"MHSACorrelation.heads_spanned({bad!r})": ("ArgumentError", "MHSACorrelation.heads_spanned.threshold must be")
       for bad in (float("nan"), 2.5, -1)},
    "QKAttribution.top_pairs(-1)": ("ArgumentError", "QKAttribution.top_pairs.n must be an int >= 0, got -1"),
    "QKFeatureImpacts.top_query_features(-1)": ("ArgumentError",
                                                "QKFeatureImpacts.top_query_features.n must be an int >= 0"),
    "LorsaConfig.from_mhsa(qk_heads_per_mhsa_head=True)": ("ArgumentError", "LorsaConfig.from_mhsa."
                                                           "qk_heads_per_mhsa_head must be a positive int, got True"),
    **{f"TokenDataset.from_text(bos_token_id={bad!r})": ("ArgumentError", "bos_token_id must be None or a token id")
       for bad in (2.5, True, "x")},
    "TokenDataset.from_text(document_separator=3)": ("ArgumentError", "document_separator must be None, 'auto' or a "
                                                                      "str, got 3"),
    **{f"TokenDataset.from_documents(pad_token_id={bad!r})": ("ArgumentError", "pad_token_id must be None or a token "
                                                                               "id")
       for bad in (2.5, "x", -1)},
    "TokenDataset.from_ids(1-D ids, target_mask)": ("ArgumentError", "from_ids: target_mask applies to 2-D ids"),
    "TokenDataset.from_text(bos_token_id past the tokenizer)": ("ArgumentError", "bos_token_id=133 is past the "
                                                                                 "tokenizer's 128 ids"),
    "TokenDataset.from_documents(pad_token_id past the tokenizer)": ("ArgumentError", "pad_token_id=133 is past the "
                                                                                      "tokenizer's 128 ids"),
    "TokenDataset.from_text(config=model)": ("ArgumentError", "config must be None or the model's config "
                                                              "(model.config"),
    "evaluate_sparse(ids outside the vocabulary)": ("ArgumentError", "evaluate_sparse: token_ids must be token ids in "
                                                                     "[0, 128) (the model's vocabulary), got ids from"),
    "train_sparse_attention(ids outside the vocabulary)": ("ArgumentError", "the training stream must be token ids in "
                                                                            "[0, 128)"),
    "arithmetic_task(template='x')": ("ArgumentError", "template must hold {op1} and {op2} and no other field"),
    "BatchTopK(threshold_lr=nan)": ("CheckpointError", "batchtopk threshold_lr must be a number in [0, 1], got nan"),
    "JumpReLU(threshold=nan)": ("CheckpointError", "jumprelu threshold must be a finite number, got nan"),
    "load_model([])": ("ArgumentError", "load_model: the path must be a str or os.PathLike"),
    "TokenDataset.from_ids(eos_token_id='x')": ("ArgumentError", "eos_token_id must be None, a token id or a "
                                                                 "non-empty list of them, got 'x'"),
}

# the Lorsa's primitives (2026-11-29, sixth session): a raw TypeError / RuntimeError, or (activation) a top-k over the
# wrong width or over integers that ran
PRIMITIVES = {
    **{f"Lorsa.values({label})": ("ShapeError", "Lorsa expects x") for label in ("None", "list", "wrong width")},
    "Lorsa.values(int tensor)": ("ShapeError", "Lorsa expects x in its weights' dtype"),
    **{f"Lorsa.{method}({label})": ("ShapeError", f"Lorsa.{method}: {name} must be a floating tensor (..., n_ov_heads=")
       for method, name in (("activation", "z_pre"), ("decode", "z"))
       for label in ("None", "list", "wrong width", "int tensor")},
    # a Lorsa without RoPE ignored positions of any kind (they are unused there; a wrong one is a misuse)
    **{f"Lorsa without RoPE.forward(positions={label})": ("ShapeError", "positions must be")
       for label in ("'x'", "list", "float", "wrong length")},
    # the sparse coders' building blocks (seventh session): raw errors, or a wrong-width / integer input that ran
    **{f"{name}({label})": ("ShapeError", f"{who} expects {what}")
       for name, who, what in (("SAE.normalize", "SparseAutoencoder.normalize", "x"),
                               ("SAE.encoder_input", "SparseAutoencoder", "x"),
                               ("SAE.denormalize(x, out=·)", "SparseAutoencoder.denormalize", "out"),
                               ("SkipTranscoder.skip", "Transcoder", "x"),
                               ("Transcoder.encoder_input", "Transcoder", "x"),
                               ("CLT layer.skip", "CrossLayerTranscoder layer 1", "x"),
                               ("CLT layer.encoder_input", "CrossLayerTranscoder layer 1", "x"))
       for label in ("None", "wrong width", "int tensor")},
    # mhsa_forward's x of another width or dtype than the weights: a matmul's RuntimeError
    "mhsa_forward(x=wrong width)": ("ShapeError", "mhsa_forward expects x of shape (*batch, 64), got (1, 2, 63)"),
    **{f"mhsa_forward(x={label})": ("ShapeError", "mhsa_forward expects x in its weights' dtype torch.float32")
       for label in ("bf16", "fp64")},
}

#: every case: (the error's class name, a part of its message)
CASES = {**{case: ("ArgumentError", message) for case, message in {**EXPECTED, **GRAPH}.items()}, **FIELDS, **TRAINING,
         **PATCHING, **PRIMITIVES, "patch(None, values)": ("ConfigMismatchError", "bind targets first")}


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> dict[str, dict]:
    return {r["case"]: r for r in recorded_outcomes("wrong_kind_cases.py", tmp_path_factory.mktemp("kinds"))}


def test_every_case_ran(records):
    assert set(records) == set(CASES)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_wrong_kind_is_a_named_error_saying_what_was_expected(records, case):
    r = records[case]
    error, message = CASES[case]
    assert r["error"] == error, r
    assert message in r["message"], r
    assert r["wrote"] == [], r  # nothing written where the process ran
