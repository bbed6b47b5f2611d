"""Llamascopium (OpenMOSS, formerly lm-saes) SAEs and per-layer transcoders -> our modules.

Layout (``src/llamascopium/models/sparse_dictionary.py`` ``save_pretrained`` / ``full_state_dict``,
``models/sae.py`` ``SparseAutoEncoder``): a directory with

``config.json``
    ``SAEConfig.model_dump()``: ``sae_type == "sae"``, ``d_model``, ``expansion_factor``
    (``d_sae = int(d_model·expansion_factor)``), ``act_fn`` (``relu``/``topk``/``jumprelu``), ``top_k``,
    ``use_decoder_bias``, ``use_glu_encoder``, ``sparsity_include_decoder_norm``, ``norm_activation``,
    ``hook_point_in``, ``hook_point_out`` (different hooks: a transcoder).
``sae_weights.safetensors``
    ``W_E (d_model, d_sae)``, ``b_E (d_sae)``, ``W_D (d_sae, d_model)``, [``b_D (d_model)``],
    [``activation_function.log_jumprelu_threshold (d_sae)``], and 0-d
    ``dataset_average_activation_norm.<hook>`` for ``hook_point_in`` / ``hook_point_out``.

Their forward (on normalised activations)::

    pre  = x W_E + b_E                         (no b_D centering)
    acts = σ(pre · ‖W_D‖) / ‖W_D‖             with sparsity_include_decoder_norm, else σ(pre)
    out  = acts W_D + b_D
    σ: relu; topk = top-k of relu; jumprelu = x·1[x > exp(log_jumprelu_threshold)]

What we fold so that our module maps raw activations to raw outputs:

* Folded or not: the rule of :mod:`.llamascopium` (:func:`_weights_folded`): ``"inference"`` → folded; a
  ``"dataset-wise"`` trainer checkpoint (``trainer.pt`` / ``checkpoints/step_<N>/``) → unfolded; any other
  ``"dataset-wise"`` folder → :class:`~nnsight_lorsa.errors.CheckpointError` unless ``weights_folded=`` is given
  (``train_sae`` writes a ``"dataset-wise"`` config next to folded weights; before 2026-11-26 such a folder
  loaded as unfolded: the norm applied twice, 2-35% off on the probe, ``docs/reliability.md``).
* Unfolded weights (``norm_activation == "dataset-wise"``):
  ``s = √d_model / dataset_average_activation_norm[hook]``; their ``standardize_parameters_of_dataset_norm``
  (``b_E /= s_in``, ``W_D *= s_in/s_out``, ``b_D /= s_out``); the JumpReLU threshold, which their
  fold leaves alone, is divided by ``s_out`` (decoder-norm gating) or ``s_in`` so that the result is
  exactly ``theirs(x·s_in)/s_out``. ``"inference"`` → already folded. ``weights_folded=`` overrides.
* ``sparsity_include_decoder_norm``: ``W_E[:, i] *= n_i``, ``b_E[i] *= n_i``, ``W_D[i] /= n_i``
  (``n = ‖W_D‖`` after the first fold); the threshold already applies to ``pre·n``. Our features then
  equal their ``acts·‖W_D‖``; outputs are unchanged.

Unsupported (:class:`~nnsight_lorsa.errors.UnsupportedArchitectureError`): other ``sae_type`` s
(``lorsa``: use :func:`~.llamascopium.load_llamascopium_lorsa`), ``act_fn`` ``batchtopk`` (batch
dependent), ``use_glu_encoder``, ``norm_activation`` ``token-wise``/``batch-wise``.

Reader steps (:class:`~.reader.Reader`): :func:`parse_config`, :func:`load_weights` (the folds above,
in fp64), :func:`build`.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch

from ..errors import UnsupportedArchitectureError
from ..modules.sae import SAEConfig, SparseAutoencoder
from ..modules.transcoder import Transcoder, TranscoderConfig
from .files import load_safetensors, read_json_object
from .hook_sites import site_record
from .llamascopium import _weights_folded
from .reader import Parsed, Reader, read
from .validate import (
    Field,
    TensorSpec,
    check_d_model,
    check_declared_tensors,
    check_file_tensors,
    check_scalar,
    config_size,
    read_fields,
    scaled_size,
    stored_dtype,
)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "sae_weights.safetensors"
NORM_PREFIX = "dataset_average_activation_norm."
THRESHOLD_KEY = "activation_function.log_jumprelu_threshold"
_IGNORED = ("tokens_since_last_activation", "is_dead")

_UNSUPPORTED = UnsupportedArchitectureError
#: ``config.json`` fields read (``d_sae = int(d_model · expansion_factor)``, :func:`.validate.scaled_size`;
#: ``top_k`` for ``act_fn: topk``)
FIELDS = (Field("sae_type", str, choices=("sae",), error=_UNSUPPORTED), Field("d_model", size=True),
          Field("act_fn", str, "relu", choices=("relu", "topk", "jumprelu"), error=_UNSUPPORTED),
          Field("use_glu_encoder", bool, False, choices=(False,), error=_UNSUPPORTED),
          Field("norm_activation", str, "dataset-wise", choices=("dataset-wise", "inference"), error=_UNSUPPORTED),
          Field("hook_point_in", str), Field("hook_point_out", str), Field("use_decoder_bias", bool, True),
          Field("sparsity_include_decoder_norm", bool, True))
#: ``sae_weights.safetensors`` (their names); ``b_D`` with ``use_decoder_bias``, the threshold for jumprelu
TENSORS = TensorSpec({"W_E": ("d_model", "d_sae"), "b_E": ("d_sae",), "W_D": ("d_sae", "d_model")},
                     {"b_D": ("d_model",), THRESHOLD_KEY: ("d_sae",)})

__all__ = ["FIELDS", "READER", "TENSORS", "build", "load_llamascopium_sae", "load_weights", "parse_config"]

#: the module a parsed config builds (a transcoder's config: a Transcoder; else an SAE)
_MODULE_OF: dict[type, type[SparseAutoencoder] | type[Transcoder]] = {TranscoderConfig: Transcoder,
                                                                        SAEConfig: SparseAutoencoder}


def parse_config(directory: Path, *, weights_folded: bool | None = None, d_model: int | None = None,
                 adapter: Any = None) -> Parsed:
    """``config.json`` -> ``Parsed(directory, SAEConfig | TranscoderConfig, settings)``.

    Raises:
        CheckpointError: missing file/key, ``d_model`` not a positive int, a non-integral
            ``d_model · expansion_factor``, hook points that are not strings, a ``"dataset-wise"`` folder
            whose folding the files cannot decide (:func:`_weights_folded`).
        UnsupportedArchitectureError: see the module docstring.
        ConfigMismatchError: ``d_model`` given and different from the checkpoint's.
    """
    cfg_path = directory / CONFIG_FILE
    raw = read_json_object(cfg_path)
    d = read_fields(raw, cfg_path, FIELDS[:2])["d_model"]
    check_d_model(d, d_model, cfg_path, "d_model")
    f = scaled_size(d, raw.get("expansion_factor"), cfg_path, "expansion_factor", floor=True)
    fields = read_fields(raw, cfg_path, FIELDS[2:])
    act, norm, use_bias = fields["act_fn"], fields["norm_activation"], fields["use_decoder_bias"]
    hook_in, hook_out = fields["hook_point_in"], fields["hook_point_out"]
    params: dict[str, Any] = {"k": config_size(raw, "top_k", cfg_path, 50)} if act == "topk" else {}
    site_in = site_record(hook_in, adapter)
    extra = {"llamascopium": {
        "hook_point_in": hook_in, "hook_point_out": hook_out, "norm_activation": norm,
        "sparsity_include_decoder_norm": fields["sparsity_include_decoder_norm"],
        "site_in": site_in, "site_out": site_record(hook_out, adapter),
        "config": {k: v for k, v in raw.items() if isinstance(v, (int, float, str, bool)) or v is None},
    }}
    cfg: SAEConfig | TranscoderConfig
    if hook_in == hook_out:
        cfg = SAEConfig(d_in=d, d_sae=f, activation=act, activation_params=params, extra=extra,
                        apply_b_dec_to_input=False, hook=(site_in or {}).get("module_path") or hook_in)
    else:
        cfg = TranscoderConfig(d_in=d, d_sae=f, d_out=d, activation=act, activation_params=params, extra=extra,
                               layer=None if site_in is None else site_in["layer"])
    folded = _weights_folded(directory, norm, weights_folded, cfg_path, kind="sae")
    return Parsed(directory, cfg, {
        "use_bias": use_bias, "folded": folded,
        "source": f"{CONFIG_FILE} (d_model={d}, d_sae={f}, act_fn={act!r}, use_decoder_bias={use_bias})"})


def load_weights(directory: Path, parsed: Parsed) -> dict[str, torch.Tensor]:
    """``sae_weights.safetensors`` checked, then the dataset-norm and decoder-norm folds, in our names and in
    float64 (:func:`build` casts them once; ``parsed.settings["stored_dtype"]`` the file's dtype).

    Raises:
        CheckpointError: missing file, missing/unexpected tensor, wrong shape, a norm scalar that
            is not finite and positive when a fold needs it.
    """
    weights_path = directory / WEIGHTS_FILE
    cfg, settings = parsed.config, parsed.settings
    d, f, act, use_bias = cfg.d_in, cfg.d_sae, cfg.activation, settings["use_bias"]
    extra = cfg.extra["llamascopium"]
    state = load_safetensors(weights_path)
    check_file_tensors(weights_path, state, exempt=(NORM_PREFIX, *_IGNORED))
    norms = {k[len(NORM_PREFIX):]: state.pop(k) for k in list(state) if k.startswith(NORM_PREFIX)}
    for k in _IGNORED:
        state.pop(k, None)
    check_declared_tensors(weights_path, state, TENSORS, {"d_model": d, "d_sae": f}, settings["source"],
                           with_=("b_D",) * use_bias + (THRESHOLD_KEY,) * (act == "jumprelu"))

    work = torch.float64
    W_E, b_E, W_D = (state[k].to(work) for k in ("W_E", "b_E", "W_D"))
    b_D = state["b_D"].to(work) if use_bias else torch.zeros(d, dtype=work, device=W_E.device)
    theta = state[THRESHOLD_KEY].to(work).exp() if act == "jumprelu" else None
    scales: dict[str, float] = {}
    if not settings["folded"]:
        for hook in (extra["hook_point_in"], extra["hook_point_out"]):
            norm = check_scalar(norms.get(hook), weights_path, NORM_PREFIX + hook,
                                " to fold norm_activation='dataset-wise'")
            scales[hook] = math.sqrt(d) / norm
        s_in, s_out = scales[extra["hook_point_in"]], scales[extra["hook_point_out"]]
        b_E, W_D, b_D = b_E / s_in, W_D * (s_in / s_out), b_D / s_out
        if theta is not None:
            theta = theta / (s_out if extra["sparsity_include_decoder_norm"] else s_in)
    if extra["sparsity_include_decoder_norm"]:
        n = W_D.norm(dim=-1).clamp_min(1e-12)
        W_E, b_E, W_D = W_E * n, b_E * n, W_D / n[:, None]
    ours = {"W_enc": W_E, "b_enc": b_E, "W_dec": W_D, "b_dec": b_D}
    if theta is not None:
        ours["activation.threshold"] = theta
    extra.update(dataset_norm_folded_here=not settings["folded"], scales=scales)
    # the folds stay in float64 until build casts them once to the dtype the module is loaded in (rounded to the
    # stored dtype here first, a bf16 file loaded with dtype=float32 kept bf16 roundings of W_E·n, W_D/n: 1.7e-4
    # to 0.31 relative): the stored dtype (the widest, where the tensors are stored in several) unless dtype= says
    settings["stored_dtype"] = stored_dtype(state)
    return ours


def build(parsed: Parsed, state: dict[str, torch.Tensor], *, device: torch.device | str | None = None,
          dtype: torch.dtype | None = None) -> SparseAutoencoder | Transcoder:
    """Our :class:`SparseAutoencoder` (``hook_point_in == hook_point_out``) or :class:`Transcoder`.

    Raises:
        CheckpointError: non-floating or non-finite tensor.
    """
    cls = _MODULE_OF.get(type(parsed.config), SparseAutoencoder)
    return parsed.build_module(cls, state, WEIGHTS_FILE, device=device,  # type: ignore[no-any-return]
                               dtype=dtype or parsed.settings.get("stored_dtype"))


READER = Reader("llamascopium_sae", (CONFIG_FILE, WEIGHTS_FILE), parse_config, load_weights, build)


def load_llamascopium_sae(directory: str | os.PathLike[str], **kwargs: Any) -> SparseAutoencoder | Transcoder:
    """Load a Llamascopium SAE / transcoder directory (or ``"repo_id:name"`` on the hub) as our module.

    Source: Llamascopium ``src/llamascopium/models/sparse_dictionary.py``, ``models/sae.py`` (module
    docstring). Same as ``formats.load(directory, format="llamascopium")`` for ``sae_type: sae``.
    ``kwargs``: ``weights_folded`` (override the folding rule), ``d_model``, ``adapter``, ``device``,
    ``dtype``, ``subfolder``, ``local_files_only``, ``revision``.

    Returns:
        The module in eval mode: ``W_enc (d_model, d_sae)``, ``W_dec (d_sae, d_model)``, mapping raw
        activations to raw outputs.

    Raises:
        CheckpointError: missing file/key, missing/unexpected tensor, wrong shape, bad norm scalars, a
            ``"dataset-wise"`` folder outside a trainer checkpoint without ``weights_folded=`` (the files cannot
            say whether the weights are folded: :func:`_weights_folded`).
        UnsupportedArchitectureError: see the module docstring.
        ConfigMismatchError: ``d_model`` given and different from the checkpoint's.
    """
    return read(READER, directory, **kwargs)  # type: ignore[no-any-return]
