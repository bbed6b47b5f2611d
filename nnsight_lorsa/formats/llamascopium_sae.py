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

* ``norm_activation == "dataset-wise"`` (weights not folded; the rule of :mod:`.llamascopium`):
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
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from ..errors import CheckpointError, UnsupportedArchitectureError
from ..modules.sae import SAEConfig, SparseAutoencoder
from ..modules.transcoder import Transcoder, TranscoderConfig
from .hook_sites import transformer_lens_hook_site
from .lorsa_format import check_tensor_inventory, load_safetensors, read_json_object, resolve_checkpoint_dir
from .sparse_coder_format import build_module, check_d_model

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "sae_weights.safetensors"
NORM_PREFIX = "dataset_average_activation_norm."
THRESHOLD_KEY = "activation_function.log_jumprelu_threshold"
_IGNORED = ("tokens_since_last_activation", "is_dead")

__all__ = ["load_llamascopium_sae"]


def _site(hook: Any, adapter: Any) -> dict[str, Any] | None:
    if not isinstance(hook, str):
        return None
    try:
        s = transformer_lens_hook_site(hook, adapter)
    except UnsupportedArchitectureError:
        return None
    return {"layer": s.layer, "site": s.site, "module_path": s.module_path, "io": s.io}


def load_llamascopium_sae(
    directory: str | os.PathLike[str],
    *,
    weights_folded: bool | None = None,
    d_model: int | None = None,
    adapter: Any = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    local_files_only: bool = False,
    revision: str | None = None,
) -> SparseAutoencoder | Transcoder:
    """Load a Llamascopium SAE / transcoder directory (or ``"repo_id:name"`` on the hub) as our module.

    Raises:
        CheckpointError: missing file/key, missing/unexpected tensor, wrong shape, bad norm scalars.
        UnsupportedArchitectureError: see the module docstring.
        ConfigMismatchError: ``d_model`` given and different from the checkpoint's.
    """
    source, subfolder = os.fspath(directory), None
    if not isinstance(directory, os.PathLike) and not os.path.exists(source) and ":" in source:
        source, subfolder = source.split(":", 1)
    prefix = f"{subfolder}/" if subfolder else ""
    path = resolve_checkpoint_dir(directory if subfolder is None else source,
                                  allow_patterns=[prefix + CONFIG_FILE, prefix + WEIGHTS_FILE], subfolder=subfolder,
                                  local_files_only=local_files_only, revision=revision)
    cfg_path, weights_path = path / CONFIG_FILE, path / WEIGHTS_FILE
    raw = read_json_object(cfg_path)
    if raw.get("sae_type") != "sae":
        raise UnsupportedArchitectureError(f"{cfg_path}: key 'sae_type' is {raw.get('sae_type')!r}; supported: 'sae'")
    d = raw.get("d_model")
    if not isinstance(d, int) or isinstance(d, bool) or d <= 0:
        raise CheckpointError(f"{cfg_path}: key 'd_model' must be a positive int, got {d!r}")
    check_d_model(d, d_model, cfg_path, "d_model")
    ef = raw.get("expansion_factor")
    if not isinstance(ef, (int, float)) or isinstance(ef, bool) or ef <= 0 or abs(d * ef - round(d * ef)) > 1e-6:
        raise CheckpointError(f"{cfg_path}: key 'expansion_factor' must make d_model·expansion_factor an integer")
    f = int(round(d * ef))
    act = raw.get("act_fn", "relu")
    if act not in ("relu", "topk", "jumprelu"):
        raise UnsupportedArchitectureError(f"{cfg_path}: key 'act_fn' is {act!r}; supported: relu, topk, jumprelu")
    if raw.get("use_glu_encoder"):
        raise UnsupportedArchitectureError(f"{cfg_path}: key 'use_glu_encoder' is true (not supported)")
    norm = raw.get("norm_activation", "dataset-wise")
    if norm not in ("dataset-wise", "inference"):
        raise UnsupportedArchitectureError(f"{cfg_path}: key 'norm_activation' is {norm!r}; supported: "
                                           "'dataset-wise', 'inference'")
    hook_in, hook_out = raw.get("hook_point_in"), raw.get("hook_point_out")
    if not isinstance(hook_in, str) or not isinstance(hook_out, str):
        raise CheckpointError(f"{cfg_path}: keys 'hook_point_in'/'hook_point_out' must be strings")
    use_bias = bool(raw.get("use_decoder_bias", True))
    include_norm = bool(raw.get("sparsity_include_decoder_norm", True))

    state = load_safetensors(weights_path)
    norms = {k[len(NORM_PREFIX):]: state.pop(k) for k in list(state) if k.startswith(NORM_PREFIX)}
    for k in _IGNORED:
        state.pop(k, None)
    expected = {"W_E": (d, f), "b_E": (f,), "W_D": (f, d)}
    if use_bias:
        expected["b_D"] = (d,)
    if act == "jumprelu":
        expected[THRESHOLD_KEY] = (f,)
    src = f"{cfg_path.name} (d_model={d}, d_sae={f}, act_fn={act!r}, use_decoder_bias={use_bias})"
    check_tensor_inventory(weights_path, {k: tuple(v.shape) for k, v in state.items()}, expected, src)

    work = torch.float64
    W_E, b_E, W_D = (state[k].to(work) for k in ("W_E", "b_E", "W_D"))
    b_D = state["b_D"].to(work) if use_bias else torch.zeros(d, dtype=work)
    theta = state[THRESHOLD_KEY].to(work).exp() if act == "jumprelu" else None
    folded = (norm == "inference") if weights_folded is None else bool(weights_folded)
    scales: dict[str, float] = {}
    if not folded:
        for hook in (hook_in, hook_out):
            value = norms.get(hook)
            if value is None or value.numel() != 1 or not math.isfinite(float(value)) or float(value) <= 0:
                raise CheckpointError(f"{weights_path}: tensor {NORM_PREFIX + hook!r} must be a finite positive "
                                      f"scalar to fold norm_activation='dataset-wise', got "
                                      f"{None if value is None else value.tolist()}")
            scales[hook] = math.sqrt(d) / float(value)
        s_in, s_out = scales[hook_in], scales[hook_out]
        b_E, W_D, b_D = b_E / s_in, W_D * (s_in / s_out), b_D / s_out
        if theta is not None:
            theta = theta / (s_out if include_norm else s_in)
    if include_norm:
        n = W_D.norm(dim=-1).clamp_min(1e-12)
        W_E, b_E, W_D = W_E * n, b_E * n, W_D / n[:, None]
    ours = {"W_enc": W_E, "b_enc": b_E, "W_dec": W_D, "b_dec": b_D}
    if theta is not None:
        ours["activation.threshold"] = theta
    stored = state["W_E"].dtype
    ours = {k: v.to(stored) for k, v in ours.items()}
    params: dict[str, Any] = {"k": int(raw.get("top_k", 50))} if act == "topk" else {}
    extra = {"llamascopium": {
        "hook_point_in": hook_in, "hook_point_out": hook_out, "norm_activation": norm,
        "dataset_norm_folded_here": not folded, "scales": scales, "sparsity_include_decoder_norm": include_norm,
        "site_in": _site(hook_in, adapter), "site_out": _site(hook_out, adapter),
        "config": {k: v for k, v in raw.items() if isinstance(v, (int, float, str, bool)) or v is None},
    }}
    site_in = extra["llamascopium"]["site_in"]
    if hook_in == hook_out:
        scfg = SAEConfig(d_in=d, d_sae=f, activation=act, activation_params=params, extra=extra,
                         apply_b_dec_to_input=False,
                         hook=(site_in or {}).get("module_path") or hook_in)
        return build_module(lambda: SparseAutoencoder(scfg), ours, weights_path, src, device=device,
                            dtype=dtype or stored)
    tcfg = TranscoderConfig(d_in=d, d_sae=f, d_out=d, activation=act, activation_params=params, extra=extra,
                            layer=None if site_in is None else site_in["layer"])
    return build_module(lambda: Transcoder(tcfg), ours, weights_path, src, device=device, dtype=dtype or stored)
