"""SAELens v6 checkpoints: ``cfg.json`` + ``sae_weights.safetensors`` -> our SAE / transcoder modules.

Layout (SAELens ``sae_lens/saes/sae.py`` ``SAE.save_model``; ``SAEConfig.to_dict`` adds
``architecture`` and ``metadata``)::

    cfg.json                 {"architecture": ..., "d_in", "d_sae", ["d_out"], ["k",
                              "rescale_acts_by_decoder_norm"], "apply_b_dec_to_input",
                              "normalize_activations", "reshape_activations", "dtype", "device",
                              "metadata": {"hook_name": "blocks.3.hook_resid_post", ...}}
    sae_weights.safetensors  W_enc (d_in, d_sae), b_enc (d_sae), W_dec (d_sae, d_out), b_dec (d_out),
                             [threshold (d_sae)] (jumprelu*), [W_skip (d_out, d_in)] (*skip_transcoder)

Architectures (``sae_lens/saes/*.py``) and what we build:

==========================  =================================================  ==========================
SAELens ``architecture``    their forward                                      ours
==========================  =================================================  ==========================
``standard``                ``relu((x − b_dec·a) W_enc + b_enc) W_dec + b_dec``  SparseAutoencoder, relu
``topk``                    TopK(k) of the same pre-activations (ReLU'd)        SparseAutoencoder, topk
``jumprelu``                ``relu(pre) · 1[pre > threshold]``                  SparseAutoencoder, jumprelu
``transcoder``              ``relu(x W_enc + b_enc) W_dec + b_dec``            Transcoder, relu
``skip_transcoder``         … ``+ x W_skipᵀ``                                   SkipTranscoder, relu
``jumprelu_transcoder``     JumpReLU transcoder                                Transcoder, jumprelu
``jumprelu_skip_transcoder``  JumpReLU + skip                                  SkipTranscoder, jumprelu
``batchtopk`` (training)    BatchTopK(k) of the ReLU'd pre-activations; the    SparseAutoencoder, batchtopk
                            buffer ``topk_threshold`` is the inference θ       (eval: ``x·1[x > θ]``)
``matryoshka_batchtopk``    the same tensors and inference rule as batchtopk   SparseAutoencoder, batchtopk
``abstopk``                 the k largest ``|pre|``, signed (no ReLU)           SparseAutoencoder, abstopk
``gated``                   ``1[x̃ W_enc + b_gate > 0] ·                         SparseAutoencoder, jumprelu
                            relu(x̃ (W_enc ⊙ exp(r_mag)) + b_mag)``             (exact conversion below)
==========================  =================================================  ==========================

Refused with :class:`~nnsight_lorsa.errors.UnsupportedArchitectureError` (:data:`REFUSED`):
``temporal`` (attends over the sequence) and ``matching_pursuit`` (iterative encoder).

(``a`` = ``apply_b_dec_to_input``.) A gated SAE (Rajamanoharan et al. 2024, arXiv:2404.16014;
``sae_lens/saes/gated_sae.py``) is a JumpReLU SAE: with ``m = x̃ (W_enc ⊙ exp(r_mag)) + b_mag``,
the gate ``x̃ W_enc + b_gate > 0`` is ``m > b_mag − exp(r_mag) ⊙ b_gate`` (``exp(r_mag) > 0``), so
``W_enc ← W_enc ⊙ exp(r_mag)``, ``b_enc ← b_mag``, ``θ ← max(b_mag − exp(r_mag) ⊙ b_gate, 0)``.
A ``batchtopk`` / ``matryoshka_batchtopk`` file is a SAELens *training* checkpoint (SAELens saves
them for inference as ``jumprelu``); ``k`` must be a whole number, ``topk_threshold`` becomes our
BatchTopK threshold (used in eval mode; ``to_jumprelu_()`` exports it) and ``topk_threshold_lr``
its EMA rate. Exact conversions: a JumpReLU threshold ``θ < 0`` becomes
``max(θ, 0)`` (``relu(x)·1[x > θ] = x·1[x > max(θ, 0)]``); a (Abs/Batch)TopK SAE with
``rescale_acts_by_decoder_norm`` (pre-activations times ``‖W_dec[i]‖``, decoder rows divided by it)
is folded with :meth:`~nnsight_lorsa.modules.sparse_coder.SparseCoder.fold_decoder_norm_`.

A ``cfg.json`` without ``architecture`` (pre-v6 files, hand-written configs) is inferred only
where the evidence leaves one architecture: ``activation_fn[_str]`` (+ ``activation_fn_kwargs.k``
for topk, SAELens ``handle_pre_6_0_config``), a top-level ``k``, and the tensors (``b_gate``/
``r_mag``/``b_mag`` gated, ``threshold`` jumprelu, ``topk_threshold`` batchtopk). A v6 topk config
stripped of ``architecture`` could be topk or abstopk (same tensors): ``CheckpointError``.

``normalize_activations`` (``sae_lens/saes/sae.py``):

* ``"none"``;
* ``"expected_average_only_in"``: the SAE expects inputs multiplied by a dataset-wide scalar ``s``
  (kept in SAELens's release registry, :mod:`.saelens_releases`, or in a trainer checkpoint's
  ``activation_scaler.json``, which is read when present). Pass ``norm_scaling_factor=s`` (or load
  by release name) and we fold it as SAELens ``fold_activation_norm_scaling_factor`` does
  (``W_enc *= s``, ``W_dec /= s``, ``b_dec /= s``; a rescaled BatchTopK threshold ``/= s``) so the
  module takes raw activations; without it the weights stay unfolded (a warning;
  ``cfg.extra["saelens"]["norm_folded"]`` is False);
* ``"covariance_whitening"``: a trainer checkpoint holds the whitening ``mean``, ``matrix`` and
  ``inverse_matrix`` in ``activation_whitening.safetensors``; folded exactly as SAELens's trainer
  does at the end (``fold_activation_whitening``). Without that file the statistics are not in the
  files: ``UnsupportedArchitectureError``;
* ``"constant_norm_rescale"``, ``"layer_norm"``: per-token run-time normalisation, reproduced by our
  SAE (``SAEConfig.normalize_activations``, :mod:`~nnsight_lorsa.modules.sae`); on a transcoder:
  ``UnsupportedArchitectureError``.

Folds run in SAELens's order: data statistics (whitening, ``s``) first, then the decoder norm.
``config_overrides=`` (a dict merged over ``cfg.json``) is how a release's overrides arrive.

Hook names map to our sites with :func:`~.hook_sites.transformer_lens_hook_site`
(``cfg.extra["saelens"]["site"]``; ``SAEConfig.hook`` is the module path when an adapter is given).

Reader steps (:class:`~.reader.Reader`): :func:`parse_config` (``cfg.json`` -> ``SAEConfig`` /
``TranscoderConfig``), :func:`load_weights` (gated / batchtopk / threshold conversions), :func:`build`
(decoder-norm and activation-norm folds).
"""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from .._atomic import atomic_directory
from ..errors import ArgumentError, UnsupportedArchitectureError
from ..modules.sae import SAEConfig, SparseAutoencoder
from ..modules.transcoder import SkipTranscoder, Transcoder, TranscoderConfig
from .files import load_safetensors, read_json_object, read_safetensors_header
from .hook_sites import site_record, trained_centred
from .reader import Parsed, Reader, read
from .sparse_coder_format import kind_of
from .validate import (
    Field,
    TensorSpec,
    check_d_model,
    check_declared_tensors,
    check_file_tensors,
    config_size,
    config_value,
    read_fields,
    require,
)

CFG_FILE = "cfg.json"
WEIGHTS_FILE = "sae_weights.safetensors"

#: SAELens architecture -> (kind, activation)
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "standard": ("sae", "relu"),
    "topk": ("sae", "topk"),
    "jumprelu": ("sae", "jumprelu"),
    "transcoder": ("transcoder", "relu"),
    "skip_transcoder": ("skip_transcoder", "relu"),
    "jumprelu_transcoder": ("transcoder", "jumprelu"),
    "jumprelu_skip_transcoder": ("skip_transcoder", "jumprelu"),
    "batchtopk": ("sae", "batchtopk"),
    "matryoshka_batchtopk": ("sae", "batchtopk"),
    "abstopk": ("sae", "abstopk"),
    "gated": ("sae", "jumprelu"),
}

#: SAELens architectures refused, and why
REFUSED: dict[str, str] = {
    "temporal": "its encoder attends over the token sequence (sae_lens/saes/temporal_sae.py), not one "
                "affine map + activation per token",
    "matching_pursuit": "its encoder is iterative greedy matching pursuit (sae_lens/saes/matching_pursuit_sae.py), "
                        "not one affine map + activation",
}
#: trainer-checkpoint files (``sae_lens/training/activation_scaler.py``)
SCALER_FILE = "activation_scaler.json"
WHITENING_FILE = "activation_whitening.safetensors"

#: ``cfg.json`` fields read for every architecture; :data:`D_OUT` for transcoders, :data:`RESCALE` for
#: (abs/batch) TopK; ``k`` / ``topk_threshold_lr``: :func:`_activation_params`; ``architecture`` /
#: ``normalize_activations``: the tables of the module docstring
FIELDS = (Field("d_in", size=True), Field("d_sae", size=True), Field("apply_b_dec_to_input", bool, None))
D_OUT = Field("d_out", size=True)
RESCALE = Field("rescale_acts_by_decoder_norm", bool, False)
#: ``activation_whitening.safetensors`` (``covariance_whitening``)
WHITENING_TENSORS = TensorSpec({"mean": ("d_in",), "matrix": ("d_in", "d_in"), "inverse_matrix": ("d_in", "d_in")})

__all__ = ["ARCHITECTURES", "D_OUT", "FIELDS", "READER", "REFUSED", "RESCALE", "WHITENING_TENSORS", "build",
           "convert_state", "load_saelens", "load_weights", "parse_config", "parse_raw_config", "save_saelens"]


def _architecture(raw: dict[str, Any], path: Path) -> str:
    arch = raw.get("architecture")
    if arch is None:
        arch = _infer_architecture(raw, path)
    if not isinstance(arch, str):
        raise UnsupportedArchitectureError(f"{path}: key 'architecture' must be a string, got {arch!r}")
    if arch in REFUSED:
        raise UnsupportedArchitectureError(f"{path}: key 'architecture' is {arch!r}: {REFUSED[arch]}")
    if arch not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{path}: key 'architecture' is {arch!r}; supported SAELens architectures: {list(ARCHITECTURES)}")
    return str(arch)


def _infer_architecture(raw: dict[str, Any], path: Path) -> str:
    """The architecture of a ``cfg.json`` without one, only where the config and the tensors leave one
    choice (SAELens ``handle_pre_6_0_config``: ``activation_fn[_str]`` + ``activation_fn_kwargs.k``).

    Raises:
        CheckpointError: the evidence allows several architectures, or contradicts itself.
    """
    tensors, _ = read_safetensors_header(path.parent / WEIGHTS_FILE)
    act = raw.get("activation_fn", raw.get("activation_fn_str"))
    kwargs: dict[str, Any] = raw["activation_fn_kwargs"] if isinstance(raw.get("activation_fn_kwargs"), dict) else {}
    evidence: dict[str, set[str]] = {}
    if {"b_gate", "r_mag", "b_mag"} <= set(tensors):
        evidence["tensors b_gate, r_mag, b_mag"] = {"gated"}
    if "threshold" in tensors or "log_threshold" in tensors:
        evidence["tensor threshold"] = {"jumprelu"}
    if "topk_threshold" in tensors:
        evidence["tensor topk_threshold"] = {"batchtopk"}
    if not evidence:
        evidence["no gate/threshold tensors"] = {"standard", "topk", "abstopk"}
    if "W_skip" in tensors or "d_out" in raw:
        evidence["a transcoder's W_skip / d_out"] = set()  # transcoders always name their architecture
    if act is not None:
        evidence[f"activation_fn {act!r}"] = {"relu": {"standard", "gated"}, "jumprelu": {"jumprelu"},
                                              "topk": {"topk"} if kwargs.get("k") is not None else set()
                                              }.get(str(act), set())
    if "k" in raw:
        evidence["key 'k'"] = {"topk", "abstopk", "batchtopk"}
    elif act is None:
        evidence["no activation_fn, no k"] = {"standard", "gated", "jumprelu"}
    candidates = set.intersection(*evidence.values())
    require(len(candidates) == 1, path, "no key 'architecture', and the config and tensors do not determine one "
            f"(evidence: {'; '.join(f'{k} -> {sorted(v)}' for k, v in evidence.items())}); add \"architecture\" "
            f"to {CFG_FILE}")
    arch = candidates.pop()
    if arch == "topk" and "k" not in raw:
        raw["k"] = kwargs["k"]
    return arch


def _normalization(raw: dict[str, Any], path: Path, kind: str) -> str:
    norm = raw.get("normalize_activations", "none") or "none"
    if norm in ("constant_norm_rescale", "layer_norm") and kind != "sae":
        raise UnsupportedArchitectureError(
            f"{path}: key 'normalize_activations' is {norm!r} on a transcoder; our transcoders do not normalise "
            "their input at run time (SAEs do)")
    if norm == "covariance_whitening" and not (path.parent / WHITENING_FILE).is_file():
        raise UnsupportedArchitectureError(
            f"{path}: key 'normalize_activations' is 'covariance_whitening' but {WHITENING_FILE} (the mean and "
            "whitening matrices SAELens's trainer estimated from data) is not beside it; the weights expect "
            "whitened inputs, which these files cannot reproduce")
    if norm not in ("none", "expected_average_only_in", "constant_norm_rescale", "layer_norm",
                    "covariance_whitening"):
        raise UnsupportedArchitectureError(f"{path}: key 'normalize_activations' is {norm!r}; supported: 'none', "
                                           "'expected_average_only_in', 'constant_norm_rescale', 'layer_norm', "
                                           "'covariance_whitening' (with its statistics file)")
    return str(norm)


#: ``cfg.json`` ``dtype`` strings SAELens reads (``sae_lens.constants.DTYPE_MAP``; it casts the weights and
#: every input to it). We load the wider of the stored dtype and it (or ``dtype=``): the same math, in at least its
#: precision.
DTYPES = ("float32", "float64", "float16", "bfloat16", "torch.float32", "torch.float64", "torch.float16",
          "torch.bfloat16")


def _check_dtype_field(raw: dict[str, Any], path: Path) -> None:
    """``dtype``, where present, one of :data:`DTYPES` (SAELens ``str_to_dtype`` refuses the rest).

    Raises:
        CheckpointError: another value.
    """
    if "dtype" in raw:
        require(raw["dtype"] in DTYPES, path, f"key 'dtype' is {raw['dtype']!r}; SAELens reads only {list(DTYPES)}")


def _reshape_field(raw: dict[str, Any], path: Path, hook_name: Any) -> str:
    """``reshape_activations``: ``"hook_z"`` (SAELens flattens ``(…, n_heads, d_head)`` inputs to
    ``(…, d_in)`` and reshapes its output back; our module takes and gives the flat ``(…, d_in)``) or
    anything else, which SAELens treats as ``"none"``.

    Raises:
        CheckpointError: ``"hook_z"`` on a hook that is not a ``…_z`` hook (SAELens refuses it).
    """
    reshape = raw.get("reshape_activations", "none")
    if reshape == "hook_z":
        require(not isinstance(hook_name, str) or hook_name.endswith("_z"), path,
                f"key 'reshape_activations' is 'hook_z' but the hook {hook_name!r} is not a hook_z hook (SAELens "
                "refuses this: turn_on_forward_pass_hook_z_reshaping)")
        return "hook_z"
    return "none"


def _scaler_factor(directory: Path) -> float | None:
    """The ``scaling_factor`` a SAELens trainer checkpoint's ``activation_scaler.json`` records, if any."""
    path = directory / SCALER_FILE
    if not path.is_file():
        return None
    value = read_json_object(path).get("scaling_factor")
    return None if value is None else config_value({"scaling_factor": value}, "scaling_factor", path, float)


def _activation_params(raw: dict[str, Any], path: Path, arch: str, activation: str) -> dict[str, Any]:
    params: dict[str, Any] = {}
    if activation == "topk":
        params["k"] = config_size(raw, "k", path)
    if activation == "abstopk":
        params["k"] = config_size(raw, "k", path)
    if activation == "batchtopk":
        k = raw.get("k")
        if isinstance(k, float) and k.is_integer():
            k = int(k)
        if not isinstance(k, int) or isinstance(k, bool) or k <= 0:
            raise UnsupportedArchitectureError(f"{path}: key 'k' is {k!r}; our BatchTopK needs a positive "
                                               "whole number")
        params["k"] = k
        if "topk_threshold_lr" in raw:
            params["threshold_lr"] = config_value(raw, "topk_threshold_lr", path, float)
    if arch == "gated":
        params["bandwidth"] = 1e-3
    return params


#: SAELens trained on a ``HookedTransformer`` loaded with TransformerLens's default weight processing
#: (``center_writing_weights=True`` on LayerNorm models) until 3.19.2, and with ``from_pretrained_no_processing``
#: since (2024-09-04, SAELens PR #279, "default to using no processing when training SAEs")
_NO_PROCESSING_SINCE = (3, 19, 2)


#: pre-6.0 spellings SAELens renames (``handle_pre_6_0_config``)
_PRE6_NAMES = {"hook_point": "hook_name", "hook_point_head_index": "hook_head_index",
               "activation_fn_str": "activation_fn"}


def _pre6_config(raw: dict[str, Any]) -> dict[str, Any]:
    """A ``cfg.json`` as SAELens reads it: one without ``sae_lens_version`` (top level or ``metadata``) or older than
    6.0 goes through SAELens's ``handle_pre_6_0_config`` — the renames of :data:`_PRE6_NAMES`; ``activation_fn:
    topk`` with ``activation_fn_kwargs.k`` is a TopK SAE of that ``k`` whatever ``architecture`` says (SAELens ≤ 5
    wrote TopK SAEs as ``standard`` so); a ``topk`` architecture takes ``k`` from ``activation_fn_kwargs``; a boolean
    ``normalize_activations`` is ``expected_average_only_in`` / ``none``. Others are returned as they are.

    Source: SAELens ``loading/pretrained_sae_loaders.py`` (``handle_config_defaulting``, ``handle_pre_6_0_config``).
    """
    metadata: dict[str, Any] = raw["metadata"] if isinstance(raw.get("metadata"), dict) else {}
    version = _version(raw.get("sae_lens_version") or metadata.get("sae_lens_version"))
    if version is not None and version >= (6, 0, 0):
        return raw
    out = {_PRE6_NAMES.get(k, k) if _PRE6_NAMES.get(k, k) not in raw else k: v for k, v in raw.items()}
    kwargs: dict[str, Any] = out["activation_fn_kwargs"] if isinstance(out.get("activation_fn_kwargs"), dict) else {}
    if out.get("activation_fn") == "topk" and kwargs.get("k") is not None:
        out["architecture"] = "topk"
    if out.get("architecture") == "topk" and kwargs.get("k") is not None:
        out["k"] = kwargs["k"]
    if isinstance(out.get("normalize_activations"), bool):
        out["normalize_activations"] = "expected_average_only_in" if out["normalize_activations"] else "none"
    return out


def _version(value: Any) -> tuple[int, ...] | None:
    """``"3.19.1"`` / ``"6.0.0-rc.0"`` -> ``(3, 19, 1)`` / ``(6, 0, 0)``; None for anything else."""
    if not isinstance(value, str):
        return None
    match = re.match(r"^v?(\d+)\.(\d+)(?:\.(\d+))?", value.strip())
    return None if match is None else tuple(int(g or 0) for g in match.groups())


def _centred_training(raw: dict[str, Any], metadata: dict[str, Any], path: Path) -> bool | None:
    """Whether a SAELens ``cfg.json`` says its coder was trained on TransformerLens's centred residual stream
    (a ``HookedTransformer`` with ``center_writing_weights``; on LayerNorm models every write to the residual is
    then mean-free over ``d_model``): ``model_from_pretrained_kwargs.center_writing_weights`` where recorded (in
    ``metadata``, or flat in a pre-6.0 file or a release's ``config_overrides``); else False for a model class
    other than ``HookedTransformer``; else by ``sae_lens_training_version``: before 3.19.2 SAELens trained with
    TransformerLens's default processing (True), since without it (False); None where the file records neither
    (a pre-SAELens-3 file such as the ``gpt2-small-res-jb`` folders, or one written by other code).

    Raises:
        CheckpointError: ``model_from_pretrained_kwargs`` not a mapping, or its ``center_writing_weights`` not a
            bool.

    Source: SAELens ``config.py`` (``model_from_pretrained_kwargs`` defaults), ``saes/sae.py`` (its warning to load
    the model with them), ``pretrained_saes.yaml`` (``gpt2-small-res-jb``'s ``config_overrides``); SAELens PR #279.
    """
    kwargs = metadata.get("model_from_pretrained_kwargs", raw.get("model_from_pretrained_kwargs"))
    require(kwargs is None or isinstance(kwargs, dict), path,
            f"key 'model_from_pretrained_kwargs' must be a mapping (TransformerLens from_pretrained keywords), got "
            f"{kwargs!r}")
    if kwargs is not None and "center_writing_weights" in kwargs:
        value = kwargs["center_writing_weights"]
        require(isinstance(value, bool), path, "key 'model_from_pretrained_kwargs.center_writing_weights' must be "
                f"true or false, got {value!r}")
        return bool(value)
    model_class = metadata.get("model_class_name", raw.get("model_class_name"))
    if model_class is not None and model_class != "HookedTransformer":
        return False  # a Hugging Face model (AutoModelForCausalLM) or another class: no TransformerLens processing
    version = _version(metadata.get("sae_lens_training_version", raw.get("sae_lens_training_version")))
    return None if version is None else version < _NO_PROCESSING_SINCE


def parse_config(directory: Path, *, norm_scaling_factor: float | None = None, d_model: int | None = None,
                 adapter: Any = None, config_overrides: dict[str, Any] | None = None) -> Parsed:
    """``cfg.json`` -> ``Parsed(directory, SAEConfig | TranscoderConfig, settings)`` (module docstring).

    Raises:
        CheckpointError: missing file/key, a size that is not a positive int, a transcoder with
            ``apply_b_dec_to_input``, a non-finite ``norm_scaling_factor``, no ``architecture`` and the
            evidence allows several.
        UnsupportedArchitectureError: unknown or refused ``architecture`` (:data:`REFUSED`); a normalisation
            the files cannot reproduce (covariance_whitening without its statistics, run-time on a transcoder).
        ConfigMismatchError: ``d_model`` given and different from ``d_in``.
    """
    cfg_path = directory / CFG_FILE
    raw = _pre6_config({**read_json_object(cfg_path), **(config_overrides or {})})  # overrides: a release's
    return parse_raw_config(directory, raw, cfg_path, norm_scaling_factor=norm_scaling_factor, d_model=d_model,
                            adapter=adapter)


def parse_raw_config(directory: Path, raw: dict[str, Any], cfg_path: Path, *, norm_scaling_factor: float | None = None,
                     d_model: int | None = None, adapter: Any = None, weights_file: str = WEIGHTS_FILE) -> Parsed:
    """A SAELens config dict (as SAELens holds it after ``handle_config_defaulting``: a ``cfg.json`` read by
    :func:`parse_config`, or the dict one of SAELens's converters builds, :mod:`.saelens_releases`) ->
    ``Parsed``; errors name ``cfg_path``, the weights are ``directory / weights_file``.

    Raises:
        CheckpointError, UnsupportedArchitectureError, ConfigMismatchError: as :func:`parse_config`.

    Source: SAELens ``sae_lens/saes/sae.py`` (``SAEConfig.from_dict``), ``sae_lens/saes/*.py``.
    """
    arch = _architecture(raw, cfg_path)
    kind, activation = ARCHITECTURES[arch]
    fields = read_fields(raw, cfg_path, FIELDS)
    d_in, d_sae = fields["d_in"], fields["d_sae"]
    d_out = D_OUT.read(raw, cfg_path) if kind != "sae" else d_in
    check_d_model(d_in, d_model, cfg_path, "d_in")
    norm = _normalization(raw, cfg_path, kind)
    if norm_scaling_factor is None and norm == "expected_average_only_in":
        norm_scaling_factor = _scaler_factor(directory)
    if norm_scaling_factor is not None:
        norm_scaling_factor = config_value({"norm_scaling_factor": norm_scaling_factor}, "norm_scaling_factor",
                                           cfg_path, float)
    apply_b_dec = fields["apply_b_dec_to_input"]
    metadata = raw.get("metadata") if isinstance(raw.get("metadata"), dict) else {}
    hook_name = (metadata or {}).get("hook_name") or raw.get("hook_name")
    require(hook_name is None or isinstance(hook_name, str), cfg_path,
            f"key 'hook_name' must be a string (the hook the coder reads, e.g. 'blocks.3.hook_resid_post'), got "
            f"{hook_name!r}")
    _check_dtype_field(raw, cfg_path)
    reshape = _reshape_field(raw, cfg_path, hook_name)
    head_index = (metadata or {}).get("hook_head_index", raw.get("hook_head_index"))
    # one head's slice (SAELens ActivationsStore: activations[:, :, head_index]) is no module boundary of ours
    site = None if head_index is not None else site_record(hook_name, adapter)
    params = _activation_params(raw, cfg_path, arch, activation)
    extra = {"saelens": {
        "architecture": arch, "hook_name": hook_name, "normalize_activations": norm,
        "norm_folded": False, "apply_b_dec_to_input": apply_b_dec if apply_b_dec is not None else kind == "sae",
        "reshape_activations": reshape, "hook_head_index": head_index, "site": site,
        # trained on a TransformerLens model with centred writing weights (True / False / None: not recorded): on
        # LayerNorm families its residual is mean-free (hook_sites.centre_residual_input_)
        "center_writing_weights": _centred_training(raw, metadata or {}, cfg_path),
    }}
    if kind != "sae":  # SAELens TranscoderConfig.hook_name_out: where the transcoder writes (hook_sites.hook_record)
        extra["saelens"]["hook_name_out"] = (metadata or {}).get("hook_name_out") or raw.get("hook_name_out")
    cfg: SAEConfig | TranscoderConfig
    if kind == "sae":
        cfg = SAEConfig(d_in=d_in, d_sae=d_sae, activation=activation, activation_params=params, extra=extra,
                        apply_b_dec_to_input=apply_b_dec is not False,
                        normalize_activations=norm if norm in ("constant_norm_rescale", "layer_norm") else "none",
                        hook=(site or {}).get("module_path") or hook_name)
    else:
        require(not apply_b_dec, cfg_path, "key 'apply_b_dec_to_input' is true, which SAELens forbids for transcoders")
        cfg = TranscoderConfig(d_in=d_in, d_sae=d_sae, d_out=d_out, activation=activation, activation_params=params,
                               extra=extra, layer=None if site is None else site["layer"])
    return Parsed(directory, cfg, {
        "architecture": arch, "kind": kind, "norm_scaling_factor": norm_scaling_factor,
        "cfg_dtype": getattr(torch, str(raw["dtype"]).removeprefix("torch.")) if "dtype" in raw else None,
        "fold_decoder_norm": activation in ("topk", "batchtopk", "abstopk") and RESCALE.read(raw, cfg_path),
        "weights_file": weights_file,
        "source": f"{cfg_path.name} (architecture {arch!r}, d_in={d_in}, d_sae={d_sae}, d_out={d_out})"})


def load_weights(directory: Path, parsed: Parsed) -> dict[str, torch.Tensor]:
    """``sae_weights.safetensors`` in our names: gated -> JumpReLU, ``topk_threshold`` -> BatchTopK
    threshold, ``log_threshold`` / ``threshold`` -> ``activation.threshold`` (clamped to ≥ 0); an all-ones
    ``scaling_factor`` dropped (SAELens ``read_sae_components_from_disk``).

    Raises:
        CheckpointError: a missing/corrupt file, a tensor the architecture needs.
    """
    weights_path = directory / WEIGHTS_FILE
    read_safetensors_header(weights_path)
    state = load_safetensors(weights_path)
    check_file_tensors(weights_path, state)
    return convert_state(state, weights_path, parsed)


def convert_state(state: dict[str, torch.Tensor], weights_path: Path, parsed: Parsed) -> dict[str, torch.Tensor]:
    """A state dict in SAELens's names (``W_enc``, ``threshold``, …; read from ``weights_path``) in ours, as
    :func:`load_weights` describes; the dict is changed in place and returned.

    Raises:
        CheckpointError: a tensor the architecture needs is missing (naming ``weights_path``).

    Source: SAELens ``sae_lens/saes/sae.py`` (``read_sae_components_from_disk``, ``process_state_dict_for_loading``).
    """
    arch = parsed.settings["architecture"]
    scale = state.get("scaling_factor")
    if scale is not None and scale.is_floating_point() and torch.allclose(scale.float(), torch.ones_like(scale,
                                                                                               dtype=torch.float32)):
        # SAELens's files of spring 2024 carried an all-ones scaling_factor, which its reader drops
        # (read_sae_components_from_disk); any other value stays an unexpected tensor
        del state["scaling_factor"]
    if arch == "gated":
        _gated_to_jumprelu(state, weights_path)
    if parsed.config.activation == "batchtopk":  # batchtopk, matryoshka_batchtopk
        require("topk_threshold" in state, weights_path, f"missing tensor 'topk_threshold' (architecture {arch!r})")
        theta = state.pop("topk_threshold").reshape(())
        state["activation.threshold"] = theta.to(state["W_enc"].dtype if "W_enc" in state else torch.float32)
        state["activation.n_updates"] = torch.ones((), dtype=torch.long, device=theta.device)
    if "log_threshold" in state and "threshold" not in state:
        state["threshold"] = state.pop("log_threshold").exp()
    if "threshold" in state:
        state["activation.threshold"] = state.pop("threshold").clamp_min(0)
    return state


def build(parsed: Parsed, state: dict[str, torch.Tensor], *, device: torch.device | str | None = None,
          dtype: torch.dtype | None = None) -> SparseAutoencoder | Transcoder:
    """Our module with ``state``, then SAELens's folds (whitening, ``norm_scaling_factor``, decoder norm).

    Raises:
        CheckpointError: missing/unexpected tensor, wrong shape, non-floating or non-finite tensor
            (also in ``activation_whitening.safetensors``).
    """
    cfg, settings = parsed.config, parsed.settings
    cls = {"sae": SparseAutoencoder, "transcoder": Transcoder, "skip_transcoder": SkipTranscoder}[settings["kind"]]
    stored = state.get("W_enc")
    if dtype is None and settings.get("cfg_dtype") is not None and stored is not None and stored.is_floating_point():
        # SAELens casts the weights and every input to cfg.json's dtype: at least its precision (bf16 weights
        # stored under "dtype": "float32" were run in bf16 here until 2026-11-29, 3.7e-3 relative off)
        dtype = torch.promote_types(stored.dtype, settings["cfg_dtype"])
    module: SparseAutoencoder | Transcoder = parsed.build_module(
        cls, state, settings.get("weights_file", WEIGHTS_FILE), device=device, dtype=dtype)
    extra = cfg.extra["saelens"]
    # SAELens's order: its trainer folds the data statistics first, its inference export the decoder norm — but a
    # TopK-family SAE rescaled by its decoder norm folds that norm before the whitening (TopKSAE.
    # fold_activation_whitening: unwhitening changes the rows' norms, which would change the top-k selection)
    if extra["normalize_activations"] == "covariance_whitening":
        if settings["fold_decoder_norm"]:
            module.fold_decoder_norm_()
            extra["folded_decoder_norm"] = True
        _fold_whitening(module, parsed.directory / WHITENING_FILE)
        extra["norm_folded"] = True
    s = settings["norm_scaling_factor"]
    if extra["normalize_activations"] == "expected_average_only_in":
        if s is None:
            warnings.warn(f"{parsed.directory / CFG_FILE}: normalize_activations is 'expected_average_only_in' but no "
                          "norm_scaling_factor was given (nor an activation_scaler.json beside it); the module "
                          "expects inputs scaled by it", stacklevel=4)
        else:
            with torch.no_grad():
                module.W_enc.mul_(s)
                module.W_dec.div_(s)
                module.b_dec.div_(s)
                threshold = getattr(module.activation, "threshold", None)
                if settings["fold_decoder_norm"] and cfg.activation == "batchtopk" and threshold is not None:
                    threshold.div_(s)  # in units of pre · ‖W_dec‖ (BatchTopKTrainingSAE.fold_…)
            extra["norm_folded"] = True
            extra["norm_scaling_factor"] = s
    if settings["fold_decoder_norm"] and not extra.get("folded_decoder_norm"):
        module.fold_decoder_norm_()
        extra["folded_decoder_norm"] = True
    return module


@torch.no_grad()
def _fold_whitening(module: SparseAutoencoder | Transcoder, path: Path) -> None:
    """SAELens ``SAE.fold_activation_whitening`` with the trainer's ``mean``, ``matrix`` ``M`` and
    ``inverse_matrix`` ``M⁻¹``: ``W_enc ← M W_enc``, ``b_enc −= mean·W_enc`` (no ``b_dec`` centring),
    ``W_dec ← W_dec M⁻¹``, ``b_dec ← b_dec M⁻¹ + mean`` (exact; float64 arithmetic)."""
    stats = load_safetensors(path)
    check_declared_tensors(path, stats, WHITENING_TENSORS, {"d_in": module.cfg.d_in}, "covariance_whitening statistics")
    check_file_tensors(path, stats)
    mean, M, M_inv = (stats[k].double() for k in ("mean", "matrix", "inverse_matrix"))
    W_enc = M @ module.W_enc.double()
    module.W_enc.copy_(W_enc)
    if not getattr(module.cfg, "apply_b_dec_to_input", False):
        module.b_enc.sub_((mean @ W_enc).to(module.b_enc.dtype))
    module.W_dec.copy_(module.W_dec.double() @ M_inv)
    module.b_dec.copy_(module.b_dec.double() @ M_inv + mean)


# the trainer checkpoint's scaler and whitening files too: read when present (a download without them loaded the
# weights unfolded, or refused the whitening, where the local folder loads folded)
READER = Reader("saelens", (CFG_FILE, WEIGHTS_FILE, SCALER_FILE, WHITENING_FILE), parse_config, load_weights, build)


def load_saelens(directory: str | os.PathLike[str], **kwargs: Any) -> SparseAutoencoder | Transcoder:
    """Load a SAELens v6 SAE / transcoder directory (or hub repo id + ``subfolder``) as our module.

    Source: SAELens ``sae_lens/saes/sae.py`` (``SAE.save_model``), ``sae_lens/saes/*.py`` (module
    docstring). Same as ``formats.load(directory, format="saelens")``.

    Args:
        directory: local directory with ``cfg.json`` and ``sae_weights.safetensors``, or a hub repo id.
        kwargs: ``norm_scaling_factor`` (the ``s`` of ``normalize_activations="expected_average_only_in"``,
            folded), ``d_model`` (the model's width; a different ``d_in`` raises), ``adapter`` (resolves
            the hook site), ``subfolder`` (SAELens releases keep one folder per SAE id), ``device`` /
            ``dtype`` (default CPU, and the wider of the stored dtype and ``cfg.json``'s ``dtype``, which SAELens
            computes in), ``local_files_only`` / ``revision``.

    Returns:
        :class:`SparseAutoencoder`, :class:`Transcoder` or :class:`SkipTranscoder` in eval mode
        (``W_enc (d_in, d_sae)``, ``W_dec (d_sae, d_out)``); ``cfg.extra["saelens"]`` records the
        source settings, hook name and site.

    Raises:
        CheckpointError: missing file/key, missing/unexpected tensor, wrong shape, non-finite values.
        UnsupportedArchitectureError: unknown or refused ``architecture``; an unreproducible normalisation.
        ConfigMismatchError: ``d_model`` given and different from ``d_in``.
    """
    return read(READER, directory, **kwargs)  # type: ignore[no-any-return]


def _gated_to_jumprelu(state: dict[str, torch.Tensor], path: Path) -> None:
    """Rewrite a gated SAE's tensors (``W_enc, b_gate, r_mag, b_mag``) as a JumpReLU SAE's, in place
    (module docstring); the threshold is stored as ``threshold`` (clamped to ≥ 0 by the caller)."""
    for key in ("W_enc", "b_gate", "r_mag", "b_mag"):
        require(key in state, path, f"missing tensor {key!r} (architecture 'gated')")
    require("b_enc" not in state, path, "unexpected tensor 'b_enc' (a gated SAE has b_gate and b_mag instead)")
    b_gate, r_mag, b_mag = state.pop("b_gate"), state.pop("r_mag"), state.pop("b_mag")
    require(b_gate.shape == r_mag.shape == b_mag.shape == state["W_enc"].shape[-1:], path,
            f"'b_gate' {tuple(b_gate.shape)}, 'r_mag' {tuple(r_mag.shape)}, 'b_mag' {tuple(b_mag.shape)} must all be "
            f"(d_sae,) = {tuple(state['W_enc'].shape[-1:])}")
    scale = r_mag.exp()
    state["W_enc"] = state["W_enc"] * scale
    state["b_enc"] = b_mag
    state["threshold"] = b_mag - scale * b_gate


_ARCH_OF = {("sae", "relu"): "standard", ("sae", "topk"): "topk", ("sae", "jumprelu"): "jumprelu",
            ("transcoder", "relu"): "transcoder", ("skip_transcoder", "relu"): "skip_transcoder",
            ("transcoder", "jumprelu"): "jumprelu_transcoder",
            ("skip_transcoder", "jumprelu"): "jumprelu_skip_transcoder", ("sae", "abstopk"): "abstopk"}


def save_saelens(module: SparseAutoencoder | Transcoder, directory: str | os.PathLike[str], *,
                 hook_name: str | None = None, model_name: str | None = None) -> Path:
    """Write ``module`` in SAELens v6 layout (``cfg.json`` + ``sae_weights.safetensors``). A module loaded from
    SAELens keeps its ``hook_name`` (unless one is given) and, loaded without its ``norm_scaling_factor``, its
    ``normalize_activations: expected_average_only_in`` (its weights still expect scaled inputs). ``metadata`` records
    ``model_from_pretrained_kwargs.center_writing_weights`` (:func:`~.hook_sites.trained_centred`): false for a
    module of this package (trained on the Hugging Face model), the file's own for one loaded from SAELens or
    Llamascopium (left out where that file did not say).

    Raises:
        UnsupportedArchitectureError: an activation SAELens has no inference architecture for here
            (batchtopk: export with ``module.to_jumprelu_()`` first), or a negative JumpReLU threshold.
    """
    for name, value in (("hook_name", hook_name), ("model_name", model_name)):
        if value is not None and not isinstance(value, str):
            raise ArgumentError(f"save_saelens({name}=...) must be a string or None, got {value!r}")
    kind = kind_of(module) or "sae"
    arch = _ARCH_OF.get((kind, module.cfg.activation))
    if arch is None:
        raise UnsupportedArchitectureError(f"no SAELens architecture for a {kind} with activation "
                                           f"{module.cfg.activation!r}")
    state = {k: v.detach().to("cpu").contiguous() for k, v in module.state_dict().items()}
    if "activation.threshold" in state and bool((state["activation.threshold"] < 0).any()):
        raise UnsupportedArchitectureError(
            "activation.threshold has negative entries: SAELens's JumpReLU is relu(x)·1[x > θ], ours x·1[x > θ]; "
            "they agree only for θ ≥ 0 (clamp the threshold first)")
    if "activation.threshold" in state:
        state["threshold"] = state.pop("activation.threshold")
    state = {k: v for k, v in state.items() if not k.startswith("activation.")}
    dtype = str(state["W_enc"].dtype).removeprefix("torch.")
    record = module.cfg.extra.get("saelens")
    source: dict[str, Any] = record if isinstance(record, dict) else {}
    # a hook_z SAE loaded from SAELens keeps its reshape (SAELens refuses it on another hook) and head index
    reshape = ("hook_z" if source.get("reshape_activations") == "hook_z"
               and (hook_name is None or hook_name.endswith("_z")) else "none")
    # the layout's version: SAELens reads a file without one as pre-6.0 and rebuilds metadata from top-level keys
    # only, losing hook_name (handle_config_defaulting)
    if hook_name is None and isinstance(source.get("hook_name"), str):  # a module loaded from SAELens keeps its hook
        hook_name = source["hook_name"]
    metadata: dict[str, Any] = {"hook_name": hook_name, "model_name": model_name, "sae_lens_version": "6.0.0"}
    centred = trained_centred(module)
    if centred is not None:  # which residual it reads (SAELens: load the model with these); unknown stays unsaid
        metadata["model_from_pretrained_kwargs"] = {"center_writing_weights": centred}
    if source.get("hook_head_index") is not None:
        metadata["hook_head_index"] = source["hook_head_index"]
    normalize = getattr(module.cfg, "normalize_activations", "none")
    if normalize == "none" and source.get("normalize_activations") == "expected_average_only_in" \
            and not source.get("norm_folded"):
        # loaded without its dataset-wide factor: the weights still expect inputs scaled by it — the file says so
        normalize = "expected_average_only_in"
    cfg: dict[str, Any] = {
        "architecture": arch, "d_in": module.cfg.d_in, "d_sae": module.cfg.d_sae, "dtype": dtype, "device": "cpu",
        "apply_b_dec_to_input": bool(getattr(module.cfg, "apply_b_dec_to_input", False)),
        "normalize_activations": normalize, "reshape_activations": reshape,
        "metadata": metadata,
    }
    if kind != "sae":
        cfg["d_out"] = module.d_out
    if arch in ("topk", "abstopk"):
        cfg["k"] = module.cfg.activation_params["k"]
        cfg["rescale_acts_by_decoder_norm"] = False
    text = json.dumps(cfg, indent=2)
    with atomic_directory(directory) as stage:
        stage.save_tensors(WEIGHTS_FILE, state)
        stage.write_text(CFG_FILE, text)
    return Path(directory)
