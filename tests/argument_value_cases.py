"""Every argument of the public entry points given a wrong value, in a plain interpreter (without the suite's beartype
hook, as a researcher's process runs) inside an empty scratch directory: ``python tests/argument_value_cases.py --json
OUT`` writes one record per (entry point, argument, value), ``{"name", "param", "default", "value", "error", "ours",
"message"}`` (``default``: ``"(required)"`` for an argument without one; ``error``: the exception's class name, None
when the call returned; ``ours``: a ``LorsaError``), and the names of the exported callables with optional arguments
(``"exported"``) so that the test can tell which are probed. Read by ``tests/test_argument_values.py``.

Each entry point is called once per argument and value from a valid call (:func:`base_calls`) with that one argument
replaced — every argument the valid call names, and every optional one — by None (where the default is not None), a
str, an empty list, NaN, -1, 2.5, True (where the default is not a bool), 10**9 and inf (not to counts, sizes, seeds,
thresholds and positions: :data:`NOT_HUGE`): the wrong kinds and ranges a typo or a mix-up gives, one at a time, so
that each check is reached (``tests/test_none_arguments.py`` gives None to every required argument at once: the first
check answers). (0 is left out: it is valid almost everywhere.)"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import pickle
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

warnings.simplefilter("ignore")
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
from helpers import (  # noqa: E402
    attribution_setup,
    make_clt,
    make_sae,
    random_ids,
    reconstruction_source,
    rm,
    tiny_hf_model,
)
from none_argument_cases import public_callables  # noqa: E402

from nnsight_lorsa import (  # noqa: E402
    CLTSet,
    Graph,
    LorsaConfig,
    LorsaSet,
    ReplacementModel,
    SAESet,
    TokenDataset,
    TrainConfig,
    Trainer,
    TranscoderSet,
    analysis,
    attribute,
    evaluate,
    get_adapter,
    load,
    patching,
    remote,
    save,
)
from nnsight_lorsa.adapters import mhsa_forward  # noqa: E402
from nnsight_lorsa.assets import default_model_dir  # noqa: E402
from nnsight_lorsa.attribution import (  # noqa: E402
    cache_for_attribution,
    circuit_metrics,
    estimate_memory,
    prune,
    qk_attribution,
    save_neuronpedia,  # noqa: E402
    to_neuronpedia,
)
from nnsight_lorsa.envoy import (  # noqa: E402
    Site,
    load_model,  # noqa: E402
    load_tokenizer,
)
from nnsight_lorsa.errors import LorsaError  # noqa: E402
from nnsight_lorsa.formats import detect_format, load_all  # noqa: E402
from nnsight_lorsa.modules import (  # noqa: E402
    BatchTopK,
    CrossLayerTranscoder,
    GroupMax,
    JumpReLU,
    Lorsa,
    SkipTranscoder,
    SparseAutoencoder,
    Transcoder,
    make_activation,
)
from nnsight_lorsa.ndif_rules import NDIF_DESERIALIZATION_MODULES, check_request, module_allowed  # noqa: E402
from nnsight_lorsa.patching import LorsaHead, MHSAHead  # noqa: E402
from nnsight_lorsa.sparse_attention import (  # noqa: E402
    SparseTrainConfig,
    evaluate_sparse,
    install_gated_attention,
    load_gates,
    save_sparse_model,
    set_gate_mode,
    train_sparse_attention,
)
from nnsight_lorsa.training import ActivationCache, ActivationSource, write_activation_cache  # noqa: E402
from nnsight_lorsa.viz import (  # noqa: E402
    head_dashboard_data,
    plot_graph,
    plot_heads_spanned,
    plot_operand_grid,
    plot_training_curves,
    plot_z_pattern,
    render_html,
    token_pieces,
    write_dashboard,
)

#: the wrong values (None only where the default is not None, True only where it is not a bool)
VALUES: dict[str, Any] = {"None": None, "'x'": "x", "[]": [], "nan": float("nan"), "-1": -1, "2.5": 2.5,
                          "True": True, "1e9": 10**9, "inf": float("inf")}
#: the huge values are not given to counts, sizes, seeds, thresholds and positions: most of them are valid there and
#: run the workflow that long (a billion steps, samples, prompts) or are refused by the tests of their ranges
NOT_HUGE = {"steps", "n_samples", "max_batches", "max_windows", "n_prompts", "checkpoint_every", "seq_len",
            "windows_per_shard", "n_contexts", "window", "chunk", "batch_size", "n", "k", "max_feature_nodes",
            "groups_per_trace", "n_top", "lens_k", "n_features", "max_edges", "update_interval", "max_memory",
            "cap_bytes", "queue_limit_bytes", "n_layers", "zero_positions", "qk_heads", "min_effect", "seed",
            "threshold", "init_bias", "temperature", "heldout_tolerance", "top_k", "d_sae", "bandwidth", "position",
            "positions", "rows", "index", "n_ov_heads"}


def base_calls(scratch: Path) -> dict[str, tuple[Callable[..., Any], Callable[..., Any]]]:
    """``{name: (the function whose signature lists the optional arguments, call(**kwargs))}``: each call valid as
    it stands (it is run once without a replaced argument, as the control)."""
    model, hf, lorsas, tcs = attribution_setup("llama")
    r = rm(model, lorsas, tcs)
    ids = random_ids(1, 6)[0]
    graph = attribute(r, ids, batch_size=16)
    pruned = prune(graph)
    data = TokenDataset(torch.randint(3, 100, (6, 8), generator=torch.Generator().manual_seed(0)))
    batch = torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    task = patching.induction_task(model.tokenizer, n_prompts=4, seq_len=4)
    answers = dict(correct_ids=task.correct_ids, incorrect_ids=task.incorrect_ids)
    site = Site.mlp_input(get_adapter(model), 1)
    sae = make_sae(d_in=64, d_sae=16, activation="topk", activation_params={"k": 2})
    top = analysis.collect_top_activations(r, 1, batch)
    corr = analysis.mhsa_correlation(r, 1, batch)
    qka = qk_attribution(r, ids, layer=1, head=0, query_pos=5, key_pos=2)
    impacts = analysis.qk_feature_impacts(r, 1, 0, sae, batch)
    LorsaSet(model, lorsas).save(scratch / "set")
    graph.save(scratch / "graph")
    heads = [LorsaHead(1, i) for i in range(4)]
    gated = tiny_hf_model("llama")
    install_gated_attention(gated)
    words = load_tokenizer(default_model_dir())  # the embedded model's: names, digits (the tiny one has neither)
    text = "ROMEO: But soft, what light through yonder window breaks? " * 4

    def trainer(**kw: Any) -> Any:
        sae8 = make_sae(d_in=8, d_sae=16, activation="topk", activation_params={"k": 2})
        return Trainer(sae8, reconstruction_source(2, 4, 8), TrainConfig(total_steps=2, norm_batches=1)).train(
            **{"progress": False, **kw})

    def trainer_obj() -> Any:
        sae8 = make_sae(d_in=8, d_sae=16, activation="topk", activation_params={"k": 2})
        return Trainer(sae8, reconstruction_source(2, 4, 8), TrainConfig(total_steps=2, norm_batches=1))

    def in_trace(call: Callable[[], Any]) -> None:
        with model.trace(ids[None]):
            call()

    def traced(fn: Callable[..., Any], **fixed: Any) -> tuple[Callable[..., Any], Callable[..., Any]]:
        """``fn(**fixed)`` called inside a trace of the prompt (an intervention): each argument varied as ``same``'s."""
        call = lambda **kw: in_trace(lambda: fn(**{**fixed, **kw}))  # noqa: E731
        call.required = [n for n in fixed if n in required_names(fn)]  # type: ignore[attr-defined]
        call.bound = fixed  # type: ignore[attr-defined]
        return fn, call

    def same(fn: Callable[..., Any], *args: Any, **fixed: Any) -> tuple[Callable[..., Any], Callable[..., Any]]:
        sig = inspect.signature(fn)
        bound = dict(sig.bind_partial(*args, **fixed).arguments)  # by name; **kwargs flattened
        for p in sig.parameters.values():
            if p.kind == p.VAR_KEYWORD:
                bound.update(bound.pop(p.name, {}))
        call = lambda **kw: fn(**{**bound, **kw})  # noqa: E731
        call.required = [n for n in bound if n in required_names(fn)]  # type: ignore[attr-defined]
        call.bound = bound  # type: ignore[attr-defined]
        return fn, call

    return {
        "attribute": same(attribute, r, prompt=ids, batch_size=16),
        "estimate_memory": same(estimate_memory, r, ids),
        "evaluate": same(evaluate, r.lorsas, data),
        "prune": same(prune, graph),
        "to_neuronpedia": same(to_neuronpedia, graph, slug="t"),
        "circuit_metrics": same(circuit_metrics, r, graph, pruned),
        "qk_attribution": same(qk_attribution, r, ids, layer=1, head=0, query_pos=5, key_pos=2),
        "cache_for_attribution": same(cache_for_attribution, r, ids),
        "ablation_effect": same(patching.ablation_effect, r, task.clean, [LorsaHead(1, 0)], **answers),
        "activation_patching": same(patching.activation_patching, r, task.clean, task.corrupt, [LorsaHead(1, 0)],
                                    **answers),
        "path_patching": same(patching.path_patching, r, task.clean, [MHSAHead(0, 0)], corrupt=task.corrupt,
                              **answers),
        "random_ablation_control": same(patching.random_ablation_control, r, task.clean, heads, 2, n_samples=2,
                                        **answers),
        "mean_activations": same(patching.mean_activations, r, [LorsaHead(1, 0)], task.clean),
        "freeze_attention": same(patching.freeze_attention, r, task.clean),
        "head_swap": same(patching.head_swap, r, 1, 0, 1, task.clean),
        "circuit_size": same(patching.circuit_size, r, task, [MHSAHead(0, h) for h in range(4)]),
        "induction_task": same(patching.induction_task, words, n_prompts=2, seq_len=3),
        "ioi_task": same(patching.ioi_task, words, n_prompts=2),
        "greater_than_task": same(patching.greater_than_task, words, n_prompts=2),
        "arithmetic_task": same(patching.arithmetic_task, words, n_prompts=2),
        "collect_top_activations": same(analysis.collect_top_activations, r, 1, batch),
        "mhsa_correlation": same(analysis.mhsa_correlation, r, 1, batch),
        "ov_logit_lens": same(analysis.ov_logit_lens, r, 1),
        "ov_feature_cosines": same(analysis.ov_feature_cosines, lorsas[1], 0),
        "qk_feature_impacts": same(analysis.qk_feature_impacts, r, 1, 0, sae, batch),
        "MHSACorrelation.heads_spanned": same(corr.heads_spanned),
        "QKAttribution.top_pairs": same(qka.top_pairs),
        "QKFeatureImpacts.top_query_features": same(impacts.top_query_features),
        "head_dashboard_data": same(head_dashboard_data, r, 1, 0, top, batch),
        "render_html": same(render_html, graph, prune_result=pruned),
        "plot_graph": same(plot_graph, graph, pruned),
        "write_activation_cache": same(write_activation_cache, model, [site], data, scratch / "cache"),
        "ActivationSource.sae": same(ActivationSource.sae, model, site, dataset=data),
        "ActivationSource.transcoder": same(ActivationSource.transcoder, model, 1, dataset=data),
        "ActivationSource.clt": same(ActivationSource.clt, model, dataset=data),
        "ActivationSource.attention": same(ActivationSource.attention, model, 1, data, 2),
        "LorsaSet.from_pretrained": same(LorsaSet.from_pretrained, model, scratch / "set"),
        "LorsaSet": same(LorsaSet, model, lorsas=lorsas),
        "LorsaSet.replace": traced(LorsaSet(model, lorsas).replace, layer=1),
        "TranscoderSet.replace": traced(TranscoderSet(model, tcs).replace, layer=0),
        "SAESet.replace": traced(SAESet(model, {site.path: sae}).replace, site=site.path),
        "CLTSet.replace": traced(CLTSet(model, make_clt()).replace),
        "ReplacementModel.replace": traced(r.replace),
        "load": same(load, scratch / "set" / "layer_1"),
        "save": same(save, lorsas[1], scratch / "saved"),
        "Graph.load": same(Graph.load, scratch / "graph"),
        "Graph.edge_sum_error": same(graph.edge_sum_error),
        "TokenDataset.from_text": same(TokenDataset.from_text, model.tokenizer, text, 8),
        "TokenDataset.from_documents": same(TokenDataset.from_documents, model.tokenizer, [text, text[:20]], 8),
        "TokenDataset.from_ids": same(TokenDataset.from_ids, torch.arange(3, 40).view(1, -1), 8),
        "LorsaConfig.from_mhsa": same(LorsaConfig.from_mhsa, get_adapter(model).mhsa_weights(hf, 1),
                                      n_ov_heads=16, top_k=4),
        "Trainer.train": (Trainer.train, trainer),
        "evaluate_sparse": same(evaluate_sparse, gated, torch.arange(3, 120), seq_len=8),
        "install_gated_attention": (install_gated_attention,
                                    lambda **kw: install_gated_attention(tiny_hf_model("llama"), **kw)),
        "set_gate_mode": same(set_gate_mode, gated, "topk"),
        "train_sparse_attention": same(train_sparse_attention, tiny_hf_model("llama"), torch.arange(3, 120),
                                       SparseTrainConfig(total_steps=1, batch_size=2, seq_len=8, target_batches=1,
                                                         allow_slack_constraint=True), progress=False),
        "save_sparse_model": same(save_sparse_model, gated, scratch / "sparse"),
        "CLTSet": same(CLTSet, model, make_clt()),
        "TranscoderSet": same(TranscoderSet, model, transcoders=tcs),
        "SAESet": same(SAESet, model, saes={site.path: sae}),
        "ReplacementModel": same(ReplacementModel, model, lorsas=lorsas, transcoders=tcs),
        "TokenDataset": same(TokenDataset, data.tokens),
        "ActivationCache": same(ActivationCache, scratch / "cache"),
        "ablate": traced(patching.ablate, target=r(LorsaHead(1, 0))),
        "patch": traced(patching.patch, target=r(LorsaHead(1, 0)), source_values=torch.zeros(())),
        "read": traced(patching.read, target=r(LorsaHead(1, 0))),
        "scale": traced(patching.scale, target=r(LorsaHead(1, 0)), alpha=2.0),
        "steer": traced(patching.steer, target=r(LorsaHead(1, 0)), delta=1.0),
        "logit_difference": same(patching.logit_difference, torch.randn(2, 5, 128), torch.tensor([1, 2]),
                                 torch.tensor([3, 4])),
        "relative_effect": same(patching.relative_effect, torch.tensor([2.0, 3.0]), torch.tensor([1.0, 1.0])),
        "save_neuronpedia": same(save_neuronpedia, graph, scratch / "graph.json", slug="t"),
        "load_all": same(load_all, scratch / "set"),
        "make_activation": same(make_activation, "topk", 16, params={"k": 2}),
        "BatchTopK": same(BatchTopK, 2, 16),
        "JumpReLU": same(JumpReLU, 16),
        "mhsa_forward": same(mhsa_forward, get_adapter(model).mhsa_weights(hf, 1), torch.randn(1, 5, 64)),
        "load_model": same(load_model),
        "plot_z_pattern": same(plot_z_pattern, torch.ones(2, 2).tril(), ["a", "b"], scratch / "z.png"),
        "plot_operand_grid": same(plot_operand_grid, torch.ones(2, 2), scratch / "grid.png"),
        "plot_heads_spanned": same(plot_heads_spanned, torch.tensor([1, 2]), scratch / "spanned.png"),
        "plot_training_curves": same(plot_training_curves, [{"step": 0, "loss": 1.0}, {"step": 1, "loss": 0.5}],
                                     scratch / "curves.png"),
        "for_remote": same(remote.for_remote, r, layers=[1]),
        "model_dtype": same(remote.model_dtype, r),
        "payload_report": same(remote.payload_report, lorsas[1]),
        "check_payload": same(remote.check_payload, lorsas[1], "1GB"),
        "remote_backend": same(remote.remote_backend, model, dry_run=True, model_key="local:test"),
        "parse_bytes": same(remote.parse_bytes, "1.5GB"),
        "format_bytes": same(remote.format_bytes, 1500),
        "Lorsa.forward": same(lorsas[1].forward, torch.randn(1, 5, 64)),
        "Lorsa.attention_pattern": same(lorsas[1].attention_pattern, torch.randn(1, 5, 64)),
        "Lorsa.z_pattern": same(lorsas[1].z_pattern, torch.randn(1, 5, 64), [0, 1]),
        "Lorsa.init_from_mhsa": same(Lorsa(lorsas[1].cfg).init_from_mhsa, get_adapter(model).mhsa_weights(hf, 1)),
        "SparseAutoencoder.encode": same(sae.encode, torch.randn(2, 64)),
        "SparseAutoencoder.forward": same(sae.forward, torch.randn(2, 64)),
        "Trainer.save_checkpoint": (Trainer.save_checkpoint, lambda **kw: trainer_obj().save_checkpoint(
            **{"directory": scratch / "ckpt", **kw})),
        "LorsaSet.subset": same(LorsaSet(model, lorsas).subset),
        "LorsaSet.save": same(LorsaSet(model, lorsas).save, scratch / "set2"),
        "LorsaSet.get": same(LorsaSet(model, lorsas).get, 1),
        "TokenDataset.split": same(data.split, 0.5),
        "TokenDataset.batch": same(data.batch, 0, 2),
        "TopActivations.top_heads": same(top.top_heads, 2),
        "write_dashboard": same(write_dashboard, scratch / "d.html", {"title": "t"}),
        "token_pieces": same(token_pieces, words, [3, 4, 5]),
        "detect_format": same(detect_format, scratch / "set" / "layer_1"),
        "LorsaConfig.from_dict": same(LorsaConfig.from_dict, lorsas[1].cfg.to_dict()),
        "TaskBatch.select": same(task.select, [0, 1]),
        "Site.mlp_input": same(Site.mlp_input, get_adapter(model), 1),
        "Graph.edge_values": same(graph.edge_values, torch.tensor([graph.n_nodes - 1]), torch.tensor([0])),
        "Graph.ids_of": same(graph.ids_of, 1),
        "Graph.save": same(graph.save, scratch / "graph2"),
        "Trainer": same(Trainer, make_sae(d_in=8, d_sae=16, activation="topk", activation_params={"k": 2}),
                        reconstruction_source(2, 4, 8), TrainConfig(total_steps=2, norm_batches=1)),
        "GroupMax": same(GroupMax, 2, 16),
        "module_allowed": same(module_allowed, "torch", NDIF_DESERIALIZATION_MODULES),
        "load_gates": same(load_gates, tiny_hf_model("llama"), scratch / "sparse"),
        "check_request": same(check_request, pickle.dumps([1, "a"])),
        "serialized_size": same(remote.serialized_size, torch.zeros(3)),
        "MeasuredRemoteBackend": same(remote.MeasuredRemoteBackend, "local:test", dry_run=True),
        **{kind.__name__: same(kind, cfg) for kind, cfg in ((Lorsa, lorsas[1].cfg), (SparseAutoencoder, sae.cfg),
                                                            (Transcoder, tcs[0].cfg), (SkipTranscoder, tcs[2].cfg),
                                                            (CrossLayerTranscoder, make_clt().cfg))},
    }


#: an index far past every range (a vocabulary, a position, a head, a row, a layer): :func:`past_range`
PAST = 10**6


def past_range(value: Any) -> Any:
    """``value`` — the valid call's integer tensor, list of ints or :class:`TokenDataset` — with its first entry
    replaced by :data:`PAST` (token ids past the vocabulary, indices past their range: on CUDA a device-side assert
    when they reach an embedding or a gather unchecked); None for a value of another kind (no such variant)."""
    if isinstance(value, TokenDataset):
        tokens = past_range(value.tokens)
        return TokenDataset(tokens, value.target_mask)
    if isinstance(value, torch.Tensor) and value.numel() and not value.is_floating_point() \
            and value.dtype != torch.bool:
        out = value.clone()
        out.view(-1)[0] = PAST  # the first: inside the first window of a stream (its tail may be dropped)
        return out
    if isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return [PAST, *value[1:]]
    return None


#: the floating dtypes a valid call's float tensor is also given in (:func:`derived`)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}


def derived(value: Any) -> dict[str, Any]:
    """The variants of a valid call's value: ``"past range"`` (:func:`past_range`) of an integer tensor, id list or
    dataset; a floating tensor cast to each of :data:`DTYPES` (another model's or module's dtype: it runs, or the
    dtype is named; a raw error is not)."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return {label: value.to(dtype) for label, dtype in DTYPES.items() if dtype != value.dtype}
    bad = past_range(value)
    return {} if bad is None else {"past range": bad}


def required_names(fn: Callable[..., Any]) -> set[str]:
    """``fn``'s arguments without a default (named ones: not ``*args`` / ``**kwargs``)."""
    params = inspect.signature(fn).parameters.values()
    return {p.name for p in params if p.default is inspect.Parameter.empty
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def optional(fn: Callable[..., Any]) -> list[inspect.Parameter]:
    """``fn``'s arguments that have a default (its ``self`` and ``**kwargs`` left out)."""
    params = inspect.signature(fn).parameters.values()
    return [p for p in params if p.default is not inspect.Parameter.empty
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def exported_with_options() -> list[str]:
    """The exported callables (not records) that take optional arguments, by qualified name."""
    out = []
    for name, obj in public_callables().items():
        if dataclasses.is_dataclass(obj):
            continue
        try:
            if optional(obj if isinstance(obj, type) else obj):  # type: ignore[arg-type]
                out.append(name)
        except (TypeError, ValueError):
            continue
    return out


def main(out_path: str) -> None:
    out = Path(out_path).resolve()
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as d:
        scratch = Path(d)
        work = scratch / "cwd"
        work.mkdir()
        calls = base_calls(scratch)
        os.chdir(work)
        for name, (fn, call) in calls.items():
            call()  # the control: valid as it stands
            required = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY) for n in getattr(call, "required", [])]
            for p in [*required, *optional(fn)]:
                for label, value in VALUES.items():
                    if (value is None and p.default is None) or (label == "True" and isinstance(p.default, bool)) \
                            or (label in ("1e9", "inf") and p.name in NOT_HUGE):
                        continue
                    try:
                        call(**{p.name: value})
                        error, ours, message = None, False, ""
                    except Exception as e:  # noqa: BLE001 — recorded for the test
                        error, ours, message = type(e).__name__, isinstance(e, LorsaError), str(e)[:300]
                    default = "(required)" if p.default is inspect.Parameter.empty else repr(p.default)[:40]
                    records.append({"name": name, "param": p.name, "default": default, "value": label,
                                    "error": error, "ours": ours, "message": message})
            for param, value in getattr(call, "bound", {}).items():  # the valid value past its range, in other dtypes
                for label, bad in derived(value).items():
                    try:
                        call(**{param: bad})
                        error, ours, message = None, False, ""
                    except Exception as e:  # noqa: BLE001 — recorded for the test
                        error, ours, message = type(e).__name__, isinstance(e, LorsaError), str(e)[:300]
                    records.append({"name": name, "param": param, "default": "(valid call)", "value": label,
                                    "error": error, "ours": ours, "message": message})
        written = sorted(os.listdir(work))
    out.write_text(json.dumps({"records": records, "exported": exported_with_options(), "written": written},
                              indent=1))


if __name__ == "__main__":
    main(sys.argv[sys.argv.index("--json") + 1])
