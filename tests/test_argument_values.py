"""Every argument of the public entry points, given a wrong value (None, a str, an empty list, NaN, -1, 2.5, True) one
at a time, ends in a named error of ours — or is a value the argument takes, listed below with why — in a fresh
interpreter without the suite's beartype hook (``tests/argument_value_cases.py``). Generated over the signatures: an
argument added to a probed entry point is probed at once, and an exported entry point with optional arguments must be
probed or listed in ``NOT_PROBED``.

Found by this probe (2026-11-29, fifth session), each fixed and now in the wrong-kind table
(``tests/test_wrong_argument_kinds.py``): arguments that ran wrong (``Graph.edge_sum_error("values")`` normalised by
the row's mass, ``path_patching(clean=None)``, ``means`` with ``mode="zero"``, ``bos_token_id=2.5`` / ``True``
rounded, a ``pad_token_id`` / ``eos_token_id`` of another kind passed over for the tokenizer's, a ``target_mask``
ignored with a 1-D stream, ``heads_spanned(nan)``, ``top_pairs(-1)``, truthy flags, a falsy ``adapter`` or
``model_dir`` replaced by the default, ``BatchTopK(threshold_lr=nan)``, ``JumpReLU(threshold=nan)``, an arithmetic
template without ``{op1}`` / ``{op2}``, a model passed as ``config``) and ~40 that were raw ``TypeError`` /
``AttributeError`` / ``IndexError`` from deep inside (``evaluate_sparse`` of ids outside the vocabulary among them).

Each integer tensor, list of ints or ``TokenDataset`` the valid call names is also given with its first entry replaced
by 10**6 (``"past range"``: token ids past the vocabulary, indices past their range; on CUDA a device-side assert where
one reaches an embedding or a gather unchecked). Found by it (2026-11-29, sixth session): every patching experiment's
prompts, ``evaluate``'s / ``write_activation_cache``'s / ``ActivationSource``'s dataset (torch's ``IndexError`` from the
embedding: ``tests/test_token_id_bounds.py``), and ``token_pieces`` of ids its tokenizer does not have (a label ``""``
without a word). Each floating tensor of a valid call is also given in bf16, fp16 and fp64: it runs or its dtype is
named (``mhsa_forward``'s ``x`` was a matmul's ``RuntimeError``)."""

from __future__ import annotations

import pytest
from helpers import recorded_outcomes

#: ``(entry point, argument, value)`` that run, because the value is one the argument takes
ALLOWED = {
    # -1: the last position, as Python indexing (positions, logit_difference's position)
    *{(name, "positions", "-1") for name in ("ablate", "ablation_effect", "activation_patching", "head_swap", "patch",
                                             "path_patching", "random_ablation_control", "read", "scale", "steer")},
    ("logit_difference", "position", "-1"),
    ("head_swap", "positions", "None"),  # every position
    # a seed of -1 seeds a generator as well as any other int
    *{(name, "seed", "-1") for name in ("ActivationSource.attention", "ActivationSource.clt", "ActivationSource.sae",
                                        "ActivationSource.transcoder", "arithmetic_task", "greater_than_task",
                                        "induction_task", "ioi_task", "random_ablation_control")},
    # texts, labels and paths: "x" is one
    ("LorsaConfig.from_mhsa", "architecture", "'x'"), ("TokenDataset.from_text", "document_separator", "'x'"),
    ("attribute", "prompt", "'x'"), ("estimate_memory", "prompt", "'x'"), ("cache_for_attribution", "prompt", "'x'"),
    ("mean_activations", "prompts", "'x'"), ("head_swap", "prompts", "'x'"), ("freeze_attention", "prompts", "'x'"),
    ("to_neuronpedia", "slug", "'x'"),
    ("freeze_attention", "targets", "[]"),  # no targets: the default's kind, empty
    ("save_neuronpedia", "path", "'x'"), ("greater_than_task", "noun", "'x'"),
    ("to_neuronpedia", "creator_name", "'x'"), ("to_neuronpedia", "scan", "'x'"), ("render_html", "path", "'x'"),
    ("render_html", "title", "'x'"),
    *{(name, what, "'x'") for name in ("plot_graph", "plot_heads_spanned", "plot_operand_grid",
                                       "plot_training_curves", "plot_z_pattern") for what in ("title", "path")},
    # numbers: a metric's baseline and intervened values of any sign
    *{("relative_effect", name, v) for name in ("baseline", "intervened") for v in ("-1", "2.5")},
    # flags given True
    ("attribute", "progress", "True"), ("evaluate", "progress", "True"), ("ReplacementModel", "offload", "True"),
    ("serialized_size", "compress", "True"),
    ("ReplacementModel.replace", "error", "True"),
    # empty collections: no modules, no receivers (the logits), the default ks only, no names (the vocabulary's)
    ("LorsaSet", "lorsas", "[]"), ("SAESet", "saes", "[]"), ("TranscoderSet", "transcoders", "[]"),
    ("ActivationCache", "sites", "[]"), ("path_patching", "receivers", "[]"), ("circuit_size", "ks", "[]"),
    ("ioi_task", "names", "[]"),
    # numbers in range: thresholds and biases of any sign or size, a bandwidth, a tolerance in nats
    ("circuit_metrics", "min_effect", "2.5"), ("circuit_size", "threshold", "-1"), ("circuit_size", "threshold", "2.5"),
    ("JumpReLU", "bandwidth", "2.5"), ("JumpReLU", "threshold", "-1"), ("JumpReLU", "threshold", "2.5"),
    ("install_gated_attention", "init_bias", "-1"), ("install_gated_attention", "init_bias", "2.5"),
    ("install_gated_attention", "temperature", "2.5"), ("train_sparse_attention", "heldout_tolerance", "2.5"),
    # the payload measures take any object (None, a str, a number: a few bytes of a request)
    *{(name, "obj", v) for name in ("payload_report", "check_payload", "serialized_size")
      for v in ("None", "'x'", "[]", "nan", "-1", "2.5", "True", "1e9", "inf")},
    ("payload_report", "name", "'x'"), ("module_allowed", "name", "'x'"),  # a label; a module name
    *{(name, "model_key", "'x'") for name in ("remote_backend", "MeasuredRemoteBackend")},  # any str names a model
    ("format_bytes", "n", "2.5"),  # a byte count from an estimate
    # the edit values: any finite factor or shift; patch writes the values it is given as they are, non-finite ones
    # included (documented: activations of another run are patched faithfully)
    *{(name, arg, v) for name, arg in (("scale", "alpha"), ("steer", "delta")) for v in ("-1", "2.5", "1e9")},
    *{("patch", "source_values", v) for v in ("-1", "2.5", "1e9", "nan", "inf")},
    # large values that are values: a billion bytes, a vocabulary, a metric, a year's century, a layer label (a Lorsa
    # is placed by its set's key, which is checked against the model), ids of a stream no config or tokenizer bounds
    ("parse_bytes", "value", "1e9"), ("TokenDataset", "vocab_size", "1e9"), ("relative_effect", "baseline", "1e9"),
    ("greater_than_task", "century", "1e9"), ("LorsaConfig.from_mhsa", "layer", "1e9"),
    ("TokenDataset.from_ids", "bos_token_id", "1e9"), ("TokenDataset.from_ids", "eos_token_id", "1e9"),
    *{(name, "queue_limit_bytes", "None") for name in ("remote_backend", "MeasuredRemoteBackend")},  # no limit
    # a mapping's get: any key (absent: the default, any value)
    *{("LorsaSet.get", name, v) for name in ("key", "default")
      for v in ("None", "'x'", "[]", "nan", "-1", "2.5", "True", "1e9", "inf") if (name, v) != ("default", "None")},
    ("LorsaSet.subset", "keys", "[]"),  # an empty subset
    ("TaskBatch.select", "rows", "-1"), ("TokenDataset.batch", "seed", "-1"),  # the last row; a seed
    ("token_pieces", "ids", "[]"), ("write_dashboard", "path", "'x'"),  # no token: no piece; a path
    # None: the default's meaning (never checkpoint; the model's own placement and dtype)
    ("Trainer.train", "checkpoint_every", "None"), ("load_model", "device", "None"), ("load_model", "dtype", "None"),
    # an index past its range (the valid call's integer tensor or list with its first entry 10**6): ids of a dataset
    # no config or tokenizer bounds (read against the model where one runs on it: check_dataset_ids); counts
    ("TokenDataset", "tokens", "past range"), ("TokenDataset.from_ids", "ids", "past range"),
    ("plot_heads_spanned", "n_spanned", "past range"),
}
#: exported entry points with optional arguments that the probe does not call, and why
NOT_PROBED = {
    "ActivationSource": "its constructor is called by its named constructors (probed: .sae, .transcoder, .clt, "
                        ".attention)",
    "DataParallel": "needs a torch.distributed process group (tests/training/test_ddp*.py)",
    "LorsaObjective": "made by the Trainer from a Lorsa (tests/training/)",
    "FrozenAttention": "made by freeze_attention (tests/patching/test_frozen_attention.py; its kinds checked, "
                       "tests/test_none_arguments.py)",
    "resolve_release": "needs a SAELens release registry file (tests/formats/test_saelens_releases*.py)",
    "write_pictures": "the demo's last stage: attributes a prompt and writes its pictures (tests/test_demo.py)",
    "register": "changes how this process's nnsight pickles (tests/test_remote.py; its guard flag is checked first)",
}


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> dict:
    return recorded_outcomes("argument_value_cases.py", tmp_path_factory.mktemp("arguments"))


def test_no_wrong_argument_is_a_raw_error(probe):
    raw = [r for r in probe["records"] if r["error"] is not None and not r["ours"]]
    assert not raw, raw[:10]


def test_the_wrong_values_that_run_are_values_the_argument_takes(probe):
    # a float tensor in another dtype (bf16 / fp16 / fp64) is a value most arguments take: it runs or is named
    ran = {(r["name"], r["param"], r["value"]) for r in probe["records"] if r["error"] is None
           and r["value"] not in ("bf16", "fp16", "fp64")}
    assert ran - ALLOWED == set(), sorted(ran - ALLOWED)  # a wrong value accepted: a silent misuse
    assert ALLOWED - ran == set(), sorted(ALLOWED - ran)  # the table says what runs, no more


def test_a_flag_takes_only_true_or_false(probe):
    flags = [r for r in probe["records"] if r["default"] in ("True", "False")]
    assert flags and all(r["ours"] for r in flags), [r for r in flags if not r["ours"]]


def test_every_exported_entry_point_with_optional_arguments_is_probed(probe):
    probed = {r["name"].split(".")[-1] for r in probe["records"]} | {r["name"] for r in probe["records"]}
    missing = {e.split(".")[-1] for e in probe["exported"]} - probed - set(NOT_PROBED)
    assert not missing, sorted(missing)


def test_a_wrong_argument_writes_nothing(probe):
    assert set(probe["written"]) <= {"x"}, probe["written"]  # "x": the paths given as "x" (a valid path)
