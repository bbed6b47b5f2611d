"""Load Lorsa checkpoints written by the Lorsa authors' library.

The library is OpenMOSS **Llamascopium** (``llamascopium.models.lorsa.LowRankSparseAttention``),
formerly published as ``lm-saes`` (OpenMOSS/Language-Model-SAEs, ``lm_saes/lorsa.py`` and
``lm_saes/models/lorsa.py``). Its ``save_pretrained`` writes a directory with

``config.json``
    ``LorsaConfig.model_dump()`` (pydantic; ``device``/``dtype`` are excluded, and
    ``sae_pretrained_name_or_path``/``strict_loading`` are dropped by ``save_hyperparameters``).
``sae_weights.safetensors``
    ``full_state_dict()``: the parameters, the buffers ``mask`` ``(n_ctx, n_ctx)`` bool (causal
    ``tril``), ``IGNORE`` (scalar ``-inf``), ``rotary_sin``/``rotary_cos`` ``(n_ctx, rotary_dim)``
    (only with rotary), and one 0-d tensor ``dataset_average_activation_norm.<hook>`` for
    ``hook_point_in`` and ``hook_point_out`` (uninitialised ``torch.empty(())`` when no norm was
    ever set). Header metadata is ``{"version": <library version>}``. ``.pt`` (pickle) and
    ``.dcp`` variants are refused here: this loader reads JSON and safetensors only.

On the hub their layout is ``<repo_id>/<name>/{config.json,sae_weights.safetensors}``, addressed
as ``"repo_id:name"``; :func:`load_llamascopium_lorsa` accepts that form too.

Field mapping (their ``config.json`` → our :class:`LorsaConfig`)
-------------------------------------------------------------------
=================================  ==========================================================
theirs                             ours
=================================  ==========================================================
``sae_type == "lorsa"``            required
``d_model``                        ``d_model``
``d_sae`` or                       ``n_ov_heads`` (their ``n_ov_heads`` property is ``d_sae``)
``int(d_model*expansion_factor)``
``n_qk_heads``, ``d_qk_head``      same
``act_fn == "topk"``, ``top_k``    ``top_k`` (ReLU, then the top ``current_k = top_k`` per token)
``act_fn == "relu"``               ``top_k = n_ov_heads`` (top-all of ReLU = ReLU, exact)
``attn_scale`` (None→√d_qk_head)   ``attn_scale`` (scores are divided by it)
``use_post_qk_ln`` + ``"RMS"``     ``qk_norm=True``; ``eps`` → ``qk_norm_eps``
``use_decoder_bias``               ``use_decoder_bias``
``positional_embedding_type``      ``"rotary"`` → ``rotary``; ``"none"`` → ``rotary=None``
``rotary_dim``                     ``rotary.rotary_dim`` (``head_dim = d_qk_head``)
``rotary_base``                    ``rotary.base``
``rotary_adjacent_pairs``          ``rotary.interleaved`` (True = GPT-J adjacent pairs,
                                   False = half-split NeoX/Llama pairs)
``use_NTK_by_parts_rope``          ``rope_type="llama3"`` with ``factor``,
``NTK_by_parts_{,low_freq_,        ``low_freq_factor``, ``high_freq_factor``,
high_freq_}factor``,               ``original_max_position_embeddings = old_context_len``
``old_context_len``
``hook_point_in/out``, ``n_ctx``,  kept in ``cfg.extra["llamascopium"]`` (with the whole
``norm_activation``, ``skip_bos``  source config); the layer index is parsed from
                                   ``hook_point_in`` (``blocks.<L>.``) when not given
=================================  ==========================================================

Tensor names are the same (``W_Q W_K b_Q b_K W_V b_V W_O b_D ln_q.w ln_k.w``). Their forward,
which ours reproduces: ``q = x W_Q + b_Q``, ``k = x W_K + b_K`` (``(b, s, h, e)``), per-head
RMSNorm ``x / sqrt(mean(x²) + eps) * w`` on q and k (QK-norm *before* RoPE), RoPE on the first
``rotary_dim`` dims, causal SDPA with ``scale = 1/attn_scale`` over values
``v = x W_V^T + b_V`` reshaped ``(b, s, n_qk, n_ov/n_qk)`` (OV head ``h`` uses QK head
``h // (n_ov/n_qk)``), then the activation and ``out = acts W_O + b_D``.

Unsupported (raise :class:`UnsupportedArchitectureError`): ``attn_type == "local"`` (sliding
window), ``normalization_type == "LN"`` QK-norm, ``rotary_scale != 1``, ``act_fn`` other than
``topk``/``relu`` (``jumprelu`` has learned thresholds, ``batchtopk`` is batch-dependent),
``norm_activation`` ``"token-wise"``/``"batch-wise"`` (input-dependent scaling), and the chess
fork's ``use_smolgen``/``use_learnable_attn_scale``. Anything malformed raises
:class:`CheckpointError` naming the file and key.

Activation scale and decoder norm (what the loader folds into the weights)
---------------------------------------------------------------------------
* **Dataset-wise norm.** Training sees ``x·s_in`` and predicts ``y·s_out`` with
  ``s = sqrt(d_model) / dataset_average_activation_norm[hook]``. Their
  ``standardize_parameters_of_dataset_norm`` folds this: ``W_Q, W_K, W_V *= s_in``;
  ``W_O, b_D /= s_out`` (``b_Q b_K b_V`` unchanged), then sets ``norm_activation =
  "inference"``. We apply the same fold when the weights are not folded yet, so our module maps
  raw activations to raw outputs: ``ours(x) = theirs(x·s_in) / s_out``.
* **Decoder norm in the gate.** With ``sparsity_include_decoder_norm`` (default True) they rank
  heads by ``z_h·‖W_O[h]‖`` and return ``acts_h = topk(relu(z·‖W_O‖))_h / ‖W_O[h]‖``. We
  apply their ``transform_to_unit_decoder_norm`` (``W_O /= n``, ``W_V *= n``, ``b_V *= n``)
  so that our plain top-k selects the same heads; the output is unchanged and our head
  activation ``z_h`` equals their ``acts_h · ‖W_O[h]‖`` (the norm of the head's output; ``W_O``
  as in their ``"inference"`` mode, i.e. after the dataset-norm fold).

Telling folded from unfolded weights (``weights_folded=None``, the default)
---------------------------------------------------------------------------
The files carry no explicit "folded" flag, and ``full_state_dict`` writes the norm scalars
*even after* folding. The rule, from their code:

1. ``norm_activation == "inference"`` → folded (folding sets this; a config written after the
   fold says so). The norm scalars are ignored.
2. ``norm_activation == "dataset-wise"`` → **not folded**: the loader folds the
   ``dataset_average_activation_norm.<hook_point_in/out>`` scalars in (they must be present,
   finite and positive). This is what their own loaders assume: ``lm_saes``
   ``from_pretrained(fold_activation_scale=True)`` folds exactly such checkpoints, and
   ``standardize_parameters_of_dataset_norm`` asserts ``norm_activation == "dataset-wise"``;
   ``save_pretrained`` in ``lm_saes`` never folds, and ``Trainer.save_checkpoint``
   (``checkpoints/step_N/``) writes config and unfolded weights together.
3. The stale-config exception: Llamascopium's ``runners/train.py::train_sae`` writes
   ``exp_result_path/config.json`` *before* training (still ``"dataset-wise"``) and finally
   calls ``save_pretrained(exp_result_path, fold_activation_scale=True)`` (the default of
   ``TrainSAESettings.fold_activation_scale``), which folds the weights without rewriting
   ``config.json``. Nothing in the files distinguishes this from case 2, so pass
   ``weights_folded=True`` for such a training output directory (its top-level
   ``sae_weights.safetensors``). ``weights_folded=True/False`` always overrides the rule.

Other differences from their implementation: their rotary tables and mask stop at ``n_ctx``
(longer inputs fail there; ours has no limit); they compute angles as ``pos / (1/inv_freq)``
and RMSNorm as ``x / sqrt(·)`` where we use ``pos * inv_freq`` and ``x * rsqrt(·)`` (fp32
rounding-level differences); ``skip_bos`` only drops position 0 from their decoder output and
is recorded, not applied; old ``lm_saes`` top-k (``kthvalue`` threshold) keeps every head tied
with the k-th value, ours keeps exactly ``k``.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

import torch

from ..errors import CheckpointError, UnsupportedArchitectureError
from ..modules.lorsa import Lorsa
from ..modules.lorsa_config import LorsaConfig
from ..modules.rotary import RotaryConfig, rotary_cos_sin
from .lorsa_format import (
    build_lorsa,
    check_tensor_inventory,
    load_safetensors,
    read_json_object,
    resolve_checkpoint_dir,
)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "sae_weights.safetensors"
NORM_PREFIX = "dataset_average_activation_norm."
# buffers their module registers (validated when present) or that some versions add (ignored)
_CHECKED_BUFFERS = ("mask", "IGNORE", "rotary_sin", "rotary_cos")
_IGNORED_BUFFERS = ("tokens_since_last_activation", "is_dead")
_REFUSED_WEIGHT_FILES = (
    "sae_weights.pt",
    "sae_weights.dcp",
    "checkpoints/pruned.safetensors",
    "checkpoints/final.safetensors",
)
_N_CHECK = 128  # positions of the rotary/mask buffers compared with the config

__all__ = ["CONFIG_FILE", "WEIGHTS_FILE", "load_llamascopium_lorsa"]


def _get(
    raw: dict[str, Any], key: str, path: os.PathLike[str], kind: type | tuple[type, ...], default: Any = ...
) -> Any:
    value = raw.get(key)
    if value is None:  # absent, or JSON null (pydantic dumps unset optionals as null)
        if default is ...:
            raise CheckpointError(f"{path}: required key {key!r} is missing or null")
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if not ok:
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise CheckpointError(f"{path}: key {key!r} must be {names}, got {value!r}")
    return value


def _n_ov_heads(raw: dict[str, Any], path: os.PathLike[str], d_model: int) -> int:
    d_sae = _get(raw, "d_sae", path, int, None)
    factor = _get(raw, "expansion_factor", path, float, None)
    if factor is not None:
        product = d_model * factor
        if abs(product - round(product)) > 1e-6:
            raise CheckpointError(f"{path}: d_model * expansion_factor = {product} is not an integer")
        if d_sae is not None and d_sae != round(product):
            raise CheckpointError(
                f"{path}: key 'd_sae' ({d_sae}) disagrees with d_model * expansion_factor ({product})"
            )
        return int(round(product))
    if d_sae is None:
        raise CheckpointError(f"{path}: needs 'expansion_factor' (or 'd_sae') to know the number of OV heads")
    return d_sae


def _rotary(raw: dict[str, Any], path: os.PathLike[str], d_qk_head: int) -> RotaryConfig | None:
    kind = _get(raw, "positional_embedding_type", path, str, "rotary")
    if kind == "none":
        return None
    if kind != "rotary":
        raise UnsupportedArchitectureError(f"{path}: positional_embedding_type {kind!r} is not supported")
    if _get(raw, "rotary_scale", path, int, 1) != 1:
        raise UnsupportedArchitectureError(
            f"{path}: rotary_scale={raw['rotary_scale']} (q/k repeat_interleave before RoPE) is not supported"
        )
    rotary_dim = _get(raw, "rotary_dim", path, int)
    if not 0 < rotary_dim <= d_qk_head or rotary_dim % 2:
        raise CheckpointError(
            f"{path}: key 'rotary_dim' ({rotary_dim}) must be even and in (0, d_qk_head={d_qk_head}]"
        )
    base = float(_get(raw, "rotary_base", path, (int, float), 10000))
    interleaved = _get(raw, "rotary_adjacent_pairs", path, bool, True)
    if _get(raw, "use_NTK_by_parts_rope", path, bool, False):
        scaling = {
            "factor": _get(raw, "NTK_by_parts_factor", path, float, 1.0),
            "low_freq_factor": _get(raw, "NTK_by_parts_low_freq_factor", path, float, 1.0),
            "high_freq_factor": _get(raw, "NTK_by_parts_high_freq_factor", path, float, 1.0),
            "original_max_position_embeddings": _get(raw, "old_context_len", path, int, 2048),
        }
        return RotaryConfig(d_qk_head, rotary_dim, base, interleaved, "llama3", scaling)
    return RotaryConfig(d_qk_head, rotary_dim, base, interleaved)


def _parse_config(
    raw: dict[str, Any], path: os.PathLike[str], layer: int | None
) -> tuple[LorsaConfig, dict[str, Any]]:
    """Our LorsaConfig and the Llamascopium settings the loader still needs."""
    sae_type = raw.get("sae_type")
    if sae_type != "lorsa":
        raise CheckpointError(f"{path}: key 'sae_type' is {sae_type!r}, expected 'lorsa'")
    for key in ("use_smolgen", "use_learnable_attn_scale"):
        if raw.get(key):
            raise UnsupportedArchitectureError(
                f"{path}: {key}=true (chess-fork Lorsa variant) is not supported"
            )
    attn_type = _get(raw, "attn_type", path, str, "global")
    if attn_type != "global":
        raise UnsupportedArchitectureError(
            f"{path}: attn_type={attn_type!r} (window_size={raw.get('window_size')}) is not supported; "
            "only global causal attention"
        )
    d_model = _get(raw, "d_model", path, int)
    n_qk = _get(raw, "n_qk_heads", path, int)
    d_qk = _get(raw, "d_qk_head", path, int)
    n_ov = _n_ov_heads(raw, path, d_model)
    n_ctx = _get(raw, "n_ctx", path, int)
    hook_in = _get(raw, "hook_point_in", path, str)
    hook_out = _get(raw, "hook_point_out", path, str)

    act_fn = _get(raw, "act_fn", path, str, "relu").lower()
    if act_fn == "topk":
        top_k = _get(raw, "top_k", path, int, 50)
    elif act_fn == "relu":
        top_k = n_ov
    else:
        raise UnsupportedArchitectureError(
            f"{path}: act_fn={act_fn!r} is not supported (only 'topk', and 'relu' as top-all)"
        )
    norm_activation = _get(raw, "norm_activation", path, str, "dataset-wise")
    if norm_activation not in ("dataset-wise", "inference"):
        raise UnsupportedArchitectureError(
            f"{path}: norm_activation={norm_activation!r} rescales each input by its own norm and cannot be "
            "folded into fixed weights; only 'dataset-wise' and 'inference' are supported"
        )
    qk_norm = _get(raw, "use_post_qk_ln", path, bool, False)
    if qk_norm:
        norm_type = raw.get("normalization_type")
        if norm_type == "LN":
            raise UnsupportedArchitectureError(
                f"{path}: normalization_type='LN' (LayerNorm QK-norm) is not supported"
            )
        if norm_type != "RMS":
            raise CheckpointError(
                f"{path}: use_post_qk_ln=true needs normalization_type 'RMS', got {norm_type!r}"
            )
    attn_scale = _get(raw, "attn_scale", path, float, None)
    if attn_scale is not None and not (math.isfinite(attn_scale) and attn_scale > 0):
        raise CheckpointError(f"{path}: key 'attn_scale' must be a positive number, got {attn_scale!r}")

    found = re.search(r"(?:^|\.)(?:blocks|layers|h)\.(\d+)(?:\.|$)", hook_in)
    inferred = int(found.group(1)) if found else None
    if layer is not None and inferred is not None and layer != inferred:
        raise CheckpointError(
            f"{path}: layer={layer} was requested but hook_point_in {hook_in!r} is layer {inferred}"
        )
    settings = {
        "hook_point_in": hook_in,
        "hook_point_out": hook_out,
        "n_ctx": n_ctx,
        "act_fn": act_fn,
        "norm_activation": norm_activation,
        "sparsity_include_decoder_norm": _get(raw, "sparsity_include_decoder_norm", path, bool, True),
        "skip_bos": bool(raw.get("skip_bos", False)),
    }
    try:
        cfg = LorsaConfig(
            d_model=d_model,
            n_qk_heads=n_qk,
            d_qk_head=d_qk,
            n_ov_heads=n_ov,
            top_k=top_k,
            rotary=_rotary(raw, path, d_qk),
            attn_scale=attn_scale,
            qk_norm=qk_norm,
            qk_norm_eps=_get(raw, "eps", path, float, 1e-6),
            use_decoder_bias=_get(raw, "use_decoder_bias", path, bool, True),
            layer=layer if layer is not None else inferred,
        )
    except UnsupportedArchitectureError as e:
        raise UnsupportedArchitectureError(f"{path}: {e}") from e
    except (CheckpointError, ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: {e}") from e
    return cfg, settings


def _check_buffers(
    path: os.PathLike[str], state: dict[str, torch.Tensor], cfg: LorsaConfig, n_ctx: int
) -> None:
    """Shapes of the saved buffers, and their values against the config (layout, base, causality)."""
    if "IGNORE" in state and state["IGNORE"].dim() != 0:
        raise CheckpointError(
            f"{path}: buffer 'IGNORE' should be a scalar, got shape {tuple(state['IGNORE'].shape)}"
        )
    if "mask" in state:
        mask = state["mask"]
        if tuple(mask.shape) != (n_ctx, n_ctx):
            raise CheckpointError(
                f"{path}: buffer 'mask' has shape {tuple(mask.shape)}, config n_ctx={n_ctx}"
            )
        m = min(n_ctx, _N_CHECK)
        if not torch.equal(mask[:m, :m].bool(), torch.ones(m, m, dtype=torch.bool).tril()):
            raise UnsupportedArchitectureError(
                f"{path}: buffer 'mask' is not the plain causal mask "
                "(local/windowed attention is not supported)"
            )
    rot_keys = [k for k in ("rotary_sin", "rotary_cos") if k in state]
    if cfg.rotary is None:
        if rot_keys:
            raise CheckpointError(
                f"{path}: tensors {rot_keys} present but positional_embedding_type is 'none'"
            )
        return
    for key in rot_keys:
        if tuple(state[key].shape) != (n_ctx, cfg.rotary.rotary_dim):
            raise CheckpointError(
                f"{path}: buffer {key!r} has shape {tuple(state[key].shape)}, config implies "
                f"{(n_ctx, cfg.rotary.rotary_dim)}"
            )
    m = min(n_ctx, _N_CHECK)
    cos, sin = rotary_cos_sin(cfg.rotary, torch.arange(m))
    for key, ours in (("rotary_cos", cos), ("rotary_sin", sin)):
        if key in state:
            err = (state[key][:m].float() - ours).abs().max().item()
            if not err <= 1e-2:  # bf16 storage ~4e-3; a wrong layout/base/scaling is O(1)
                raise CheckpointError(
                    f"{path}: buffer {key!r} disagrees with the config's RoPE settings "
                    f"(max |diff| {err:.3g} over {m} positions; check rotary_adjacent_pairs, "
                    "rotary_base, NTK_by_parts_*)"
                )


def load_llamascopium_lorsa(
    directory: str | os.PathLike[str],
    *,
    layer: int | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    weights_folded: bool | None = None,
    local_files_only: bool = False,
    revision: str | None = None,
) -> Lorsa:
    """Load a Llamascopium / lm-saes Lorsa checkpoint as our :class:`Lorsa` (see the module docstring).

    Args:
        directory: a checkpoint directory (``config.json`` + ``sae_weights.safetensors``), or on
            the hub ``"repo_id:name"`` (their layout) or ``"repo_id"`` (files at the root).
        layer: target layer index stored in ``cfg.layer``; default parsed from ``hook_point_in``
            (``blocks.<L>.…``). A value contradicting ``hook_point_in`` raises.
        device: where the parameters go (default CPU).
        dtype: parameter dtype (default: the stored dtype of ``W_Q``). Folding runs in fp32 or wider.
        weights_folded: whether the dataset-wise activation norm is already folded into the
            weights; ``None`` applies the rule of the module docstring (``"inference"`` → folded,
            ``"dataset-wise"`` → fold the stored norms). Pass ``True`` for a Llamascopium
            training output saved with ``fold_activation_scale=True`` (stale config).
        local_files_only, revision: passed to ``huggingface_hub.snapshot_download``.

    Returns:
        The module in eval mode; ``ours(x_raw)`` reproduces their output on raw (un-normalised)
        activations. ``cfg.extra["llamascopium"]`` records the source settings and what was folded.

    Raises:
        CheckpointError: missing/unparsable file, missing/unexpected tensor, wrong shape, buffers
            disagreeing with the config, missing or invalid norm scalars when a fold is needed.
        UnsupportedArchitectureError: a setting our Lorsa cannot reproduce.
    """
    source = os.fspath(directory)
    subfolder = None
    if not isinstance(directory, os.PathLike) and not os.path.exists(source) and ":" in source:
        source, subfolder = source.split(":", 1)
    prefix = f"{subfolder}/" if subfolder else ""
    path = resolve_checkpoint_dir(
        directory if subfolder is None else source,
        allow_patterns=[prefix + CONFIG_FILE, prefix + WEIGHTS_FILE],
        subfolder=subfolder,
        local_files_only=local_files_only,
        revision=revision,
    )
    config_path, weights_path = path / CONFIG_FILE, path / WEIGHTS_FILE
    raw = read_json_object(config_path)
    cfg, settings = _parse_config(raw, config_path, layer)
    if not weights_path.is_file():
        others = [name for name in _REFUSED_WEIGHT_FILES if (path / name).exists()]
        hint = (
            f"; found {others}, which this loader does not read (pickle/DCP or training layout)"
            if others
            else ""
        )
        raise CheckpointError(f"{weights_path}: file not found{hint}")
    state = load_safetensors(weights_path)

    # ---- inventory: parameters required, buffers validated, norm scalars split off
    norms_raw = {k[len(NORM_PREFIX) :]: v for k, v in state.items() if k.startswith(NORM_PREFIX)}
    for hook, value in norms_raw.items():
        if value.numel() != 1:
            raise CheckpointError(
                f"{weights_path}: tensor {NORM_PREFIX + hook!r} should be a scalar, "
                f"got shape {tuple(value.shape)}"
            )
    params = {
        k: v
        for k, v in state.items()
        if not k.startswith(NORM_PREFIX) and k not in _CHECKED_BUFFERS + _IGNORED_BUFFERS
    }
    expected = {k: tuple(v.shape) for k, v in Lorsa(cfg, device="meta").state_dict().items()}
    check_tensor_inventory(
        weights_path, {k: tuple(v.shape) for k, v in params.items()}, expected, source=CONFIG_FILE
    )
    for key, tensor in params.items():
        if not tensor.is_floating_point():
            raise CheckpointError(f"{weights_path}: tensor {key!r} has non-floating dtype {tensor.dtype}")
    _check_buffers(weights_path, state, cfg, settings["n_ctx"])

    # ---- fold the dataset-wise activation norm and the decoder norm
    target_dtype = params["W_Q"].dtype if dtype is None else dtype
    work_dtype = torch.promote_types(params["W_Q"].dtype, torch.float32)
    w = {k: v.to(work_dtype) for k, v in params.items()}
    folded = settings["norm_activation"] == "inference" if weights_folded is None else bool(weights_folded)
    norms = {hook: float(v.reshape(())) for hook, v in norms_raw.items()}
    if not folded:
        scales = {}
        for role in ("hook_point_in", "hook_point_out"):
            hook = settings[role]
            if hook not in norms:
                raise CheckpointError(
                    f"{weights_path}: tensor {NORM_PREFIX + hook!r} is missing but config.json says "
                    f"norm_activation={settings['norm_activation']!r} (unfolded weights); pass "
                    "weights_folded=True if the weights are known to be folded already"
                )
            if not (math.isfinite(norms[hook]) and norms[hook] > 0):
                raise CheckpointError(
                    f"{weights_path}: tensor {NORM_PREFIX + hook!r} = {norms[hook]!r} "
                    "is not a positive finite norm"
                )
            scales[role] = math.sqrt(cfg.d_model) / norms[hook]
        for key in ("W_Q", "W_K", "W_V"):
            w[key] = w[key] * scales["hook_point_in"]
        for key in ("W_O", "b_D"):
            if key in w:
                w[key] = w[key] / scales["hook_point_out"]
    if settings["sparsity_include_decoder_norm"]:
        dec = w["W_O"].norm(dim=1).clamp_min(torch.finfo(work_dtype).tiny)
        w["W_O"] = w["W_O"] / dec[:, None]
        w["W_V"] = w["W_V"] * dec[:, None]
        w["b_V"] = w["b_V"] * dec

    cfg.extra = {
        "llamascopium": {
            **settings,
            # non-finite values (their uninitialised torch.empty(())) are recorded as None
            "dataset_average_activation_norm": {h: v if math.isfinite(v) else None for h, v in norms.items()}
            or None,
            "dataset_norm_folded_by_loader": not folded,
            "decoder_norm_folded_by_loader": settings["sparsity_include_decoder_norm"],
            "source_config": raw,
        }
    }
    return build_lorsa(cfg, w, device=device, dtype=target_dtype)
