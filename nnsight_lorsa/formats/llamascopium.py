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
as ``"repo_id:name"``; :func:`load_llamascopium_lorsa` (and ``formats.load``) accepts that form too.
Reader steps (:class:`~.reader.Reader`): :func:`parse_config`, :func:`load_weights` (buffers checked,
the folds below), :func:`build`.

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
``act_fn == "jumprelu"``           ``activation="jumprelu"``, ``top_k = n_ov_heads``; their
                                   ``activation_function.log_jumprelu_threshold`` → our
                                   ``threshold = exp(·)`` (``z_pre · 1[z_pre > θ_h]``, as their
                                   ``STEFunction.forward``)
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
window), ``normalization_type == "LN"`` QK-norm, ``act_fn`` other than ``topk``/``relu``/``jumprelu``
(``batchtopk`` is batch-dependent), ``norm_activation``
``"token-wise"``/``"batch-wise"`` (input-dependent scaling), and the chess fork's
``use_smolgen``/``use_learnable_attn_scale``. Anything malformed raises :class:`CheckpointError`
naming the file and key.

``rotary_scale = r``: their ``_apply_rotary`` does ``q.repeat_interleave(r, -1)`` (and on k) before
RoPE, so attention runs on heads of size ``d_qk_head·r``. We load that exactly by repeating
``W_Q W_K b_Q b_K ln_q.w ln_k.w`` along the head dimension (``d_qk_head *= r``; the RMS of a repeated
vector is unchanged) and keeping their ``attn_scale`` (``√d_qk_head`` of the stored size by default).

bf16/fp16 files are **upcast to fp32 by default** (``dtype=None``; ``cfg.extra["llamascopium"]
["stored_dtype"]`` records the file's dtype); ``dtype=torch.bfloat16`` keeps the stored dtype. Either way
the folds below run in fp32 on the stored values, and a bf16 module is that fp32 result rounded once
(tested: every tensor equals the fp32 load's, rounded; tensors no fold touches are the stored ones).
The fp32 load reproduces their fp32 reload of the file to 2e-7 - 9e-7 (relative max). A bf16 module
cannot reproduce their bf16 reload exactly: their module keeps the stored weights and rounds every
intermediate (``x·s_in``, q/k/v, RoPE, attention, ``z·‖W_O‖``) in bf16, ours rounds the folded weights
and its own intermediates, and on these random weights bf16 arithmetic flips the top-k on ~3% of
tokens whichever implementation does it. Measured on 512 tokens of the two bf16 peer fixtures
(``tokens.safetensors``; ``scripts/make_peer_fixtures.py --peer llamascopium --measure``): their bf16
reload is 0.25 / 0.32 (``bf16`` / ``bf16_dataset_wise``; relative max, top-k flips on 3.3% / 3.7% of
tokens) from their own fp32 reload, our bf16 load 0.22 / 0.34 (flips 3.3% / 2.9%) — as close to the
exact output as theirs; our bf16 load and their bf16 reload differ by 0.25 / 0.34 (flips 3.9% / 4.5%),
and by at most 0.0076 / 0.026 of max|out| (2 / 7 bf16 ulps) on the tokens where both pick the same
heads. That is why the default is fp32: it is their fp32 reload, and as close to their bf16 reload as
their fp32 reload is. Their reload uses the low-precision ``rotary_cos``/``rotary_sin`` stored in
the file (``load_state_dict`` overwrites the buffers); the loader sets ``RotaryConfig.table_dtype`` to
that dtype so our cos/sin are rounded the same way.

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
*even after* folding. The rule, from their code (llamascopium 2.0.0b34):

1. ``norm_activation == "inference"`` → folded (folding sets this; a config written after the
   fold says so). The norm scalars are ignored.
2. ``norm_activation == "dataset-wise"`` in a trainer checkpoint folder (:func:`is_trainer_checkpoint`:
   ``trainer.pt`` present or ``checkpoints/step_<N>/``) → **not folded**: ``Trainer.save_checkpoint``
   writes config and unfolded weights together; the loader folds the
   ``dataset_average_activation_norm.<hook_point_in/out>`` scalars in (they must be present,
   finite and positive).
3. ``norm_activation == "dataset-wise"`` anywhere else → :class:`CheckpointError`. ``runners/train.py
   ::train_lorsa`` writes ``exp_result_path/config.json`` *before* training (still ``"dataset-wise"``)
   and finally calls ``save_pretrained(exp_result_path, fold_activation_scale=True)`` (the default of
   ``TrainLorsaSettings.fold_activation_scale``), which folds the weights without rewriting
   ``config.json``; ``save_pretrained()``/``push_to_hub()`` of an unfolded Lorsa write the same two
   files with unfolded weights. Nothing in the files tells them apart, so the caller passes the
   keyword of the writer (the refusal's message says the same; llamascopium 2.0.0b34
   ``models/sparse_dictionary.py``, ``runners/train.py``, ``trainer.py``):

   ==============================================================  =========================
   their writer                                                    keyword
   ==============================================================  =========================
   ``train_lorsa`` (``TrainLorsaSettings.fold_activation_scale``   ``weights_folded=True``
   True, the default): ``exp_result_path``
   ``cfg.save_hyperparameters(p)`` then                            ``weights_folded=True``
   ``save_pretrained(p, fold_activation_scale=True)``, or
   ``save_pretrained(p)`` of a Lorsa folded since
   (``standardize_parameters_of_dataset_norm``,
   ``from_pretrained(..., fold_activation_scale=True)``)
   ``save_pretrained(p)`` (``fold_activation_scale=False``) +      ``weights_folded=False``
   ``cfg.save_hyperparameters(p)``; ``push_to_hub()`` of a
   ``"dataset-wise"`` Lorsa; ``train_lorsa`` with
   ``fold_activation_scale=False``
   ``Trainer.save_checkpoint`` (``checkpoints/step_<N>/``)         none (rule 2: unfolded)
   ``train_lorsa`` whose activation stream ended early: no         load ``checkpoints/step_<N>/``
   weights in ``exp_result_path``, only ``checkpoints/step_<N>/``  (the missing-file error says so)
   a config saved after any fold (says ``"inference"``)            none (rule 1: folded)
   ==============================================================  =========================

   ``weights_folded=True/False`` always overrides the rule.

Other differences from their implementation: their rotary tables and mask stop at ``n_ctx``
(longer inputs fail there; ours has no limit); they compute angles as ``pos / (1/inv_freq)``
and RMSNorm as ``x / sqrt(·)`` where we use ``pos * inv_freq`` and ``x * rsqrt(·)`` (fp32
rounding-level differences); ``skip_bos`` only drops position 0 from their decoder output and
is recorded, not applied; old ``lm_saes`` top-k (``kthvalue`` threshold) keeps every head tied
with the k-th value, ours keeps exactly ``k``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from pathlib import Path
from typing import Any

import torch

from .._atomic import atomic_directory
from .._placement import torch_module
from ..errors import CheckpointError, UnsupportedArchitectureError
from ..modules.lorsa import Lorsa
from ..modules.lorsa_config import LorsaConfig
from ..modules.rotary import RotaryConfig, rotary_cos_sin
from .files import load_safetensors, read_json_object, read_safetensors_header
from .hook_sites import ATTENTION_SITE, attention_norm_unfolded, lorsa_reads_attention_input, trained_centred
from .reader import Parsed, Reader, read
from .validate import (
    Field,
    check_scalar,
    check_tensor_inventory,
    check_tensors,
    config_errors,
    config_size,
    config_value,
    refuse,
    require,
    require_file,
    scaled_size,
    stored_dtype,
)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "sae_weights.safetensors"
#: safetensors header key of files this package writes: :data:`~.hook_sites.ATTENTION_SITE` when the Lorsa reads the
#: attention module's input (the pre-attention norm's output, gain included) and writes its output, as every Lorsa
#: of this package does — their files (TransformerLens's ``ln1.hook_normalized``, before the gain) carry none
SITE_METADATA_KEY = "nnsight_lorsa.site"
#: safetensors header key of files this package writes: ``"true"`` / ``"false"``, whether the Lorsa was trained on
#: TransformerLens's centred residual (:func:`~.hook_sites.trained_centred`: their files, which carry none, were;
#: a Lorsa of this package was not) — what its ``hook_attn_out`` target is on a LayerNorm model
CENTRED_METADATA_KEY = "nnsight_lorsa.center_writing_weights"
TRAINER_STATE_FILE = "trainer.pt"  # their Trainer.save_checkpoint's pickle: only its presence is checked
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
_QK_TENSORS = ("W_Q", "W_K", "b_Q", "b_K", "ln_q.w", "ln_k.w")  # last dim d_qk_head
_N_CHECK = 128  # positions of the rotary/mask buffers compared with the config

__all__ = ["CONFIG_FILE", "READER", "WEIGHTS_FILE", "build", "has_files", "is_trainer_checkpoint",
           "load_llamascopium_lorsa", "load_weights", "parse_config", "save_llamascopium_lorsa"]


def _n_ov_heads(raw: dict[str, Any], path: Path, d_model: int) -> int:
    d_sae = config_size(raw, "d_sae", path) if raw.get("d_sae") is not None else None
    if raw.get("expansion_factor") is not None:
        n_ov = scaled_size(d_model, config_value(raw, "expansion_factor", path, float), path, "expansion_factor",
                           floor=True)
        require(d_sae is None or d_sae == n_ov, path,
                f"key 'd_sae' ({d_sae}) disagrees with d_model * expansion_factor ({n_ov})")
        return n_ov
    require(d_sae is not None, path, "needs 'expansion_factor' (or 'd_sae') to know the number of OV heads")
    return int(d_sae)  # type: ignore[arg-type]


def _rotary(raw: dict[str, Any], path: Path, d_qk_head: int) -> RotaryConfig | None:
    kind = config_value(raw, "positional_embedding_type", path, str, "rotary")
    if kind == "none":
        return None
    if kind != "rotary":
        raise UnsupportedArchitectureError(
            f"{path}: key 'positional_embedding_type': positional_embedding_type {kind!r} is not supported")
    rotary_dim = config_size(raw, "rotary_dim", path)
    require(0 < rotary_dim <= d_qk_head and not rotary_dim % 2, path,
            f"key 'rotary_dim' ({rotary_dim}) must be even and in (0, d_qk_head*rotary_scale={d_qk_head}]")
    base = float(Field("rotary_base", (int, float), 10000, positive=True).read(raw, path))
    interleaved = config_value(raw, "rotary_adjacent_pairs", path, bool, True)
    if config_value(raw, "use_NTK_by_parts_rope", path, bool, False):
        scaling = {
            "factor": config_value(raw, "NTK_by_parts_factor", path, float, 1.0),
            "low_freq_factor": config_value(raw, "NTK_by_parts_low_freq_factor", path, float, 1.0),
            "high_freq_factor": config_value(raw, "NTK_by_parts_high_freq_factor", path, float, 1.0),
            "original_max_position_embeddings": config_size(raw, "old_context_len", path, 2048),
        }
        return RotaryConfig(d_qk_head, rotary_dim, base, interleaved, "llama3", scaling)
    return RotaryConfig(d_qk_head, rotary_dim, base, interleaved)


def _check_supported(raw: dict[str, Any], path: Path) -> None:
    Field("sae_type", equals="lorsa").read(raw, path)
    for key in ("use_smolgen", "use_learnable_attn_scale"):
        if raw.get(key):
            raise UnsupportedArchitectureError(
                f"{path}: key {key!r}: {key}=true (chess-fork Lorsa variant) is not supported"
            )
    attn_type = config_value(raw, "attn_type", path, str, "global")
    if attn_type != "global":
        raise UnsupportedArchitectureError(
            f"{path}: key 'attn_type': attn_type={attn_type!r} (window_size={raw.get('window_size')}) is not "
            "supported; only global causal attention"
        )


def _settings(raw: dict[str, Any], path: Path) -> dict[str, Any]:
    """The Llamascopium settings the weight step still needs (validated)."""
    norm_activation = config_value(raw, "norm_activation", path, str, "dataset-wise")
    if norm_activation not in ("dataset-wise", "inference"):
        raise UnsupportedArchitectureError(
            f"{path}: key 'norm_activation': norm_activation={norm_activation!r} rescales each input by its own norm "
            "and cannot be folded into fixed weights; only 'dataset-wise' and 'inference' are supported"
        )
    return {
        "hook_point_in": config_value(raw, "hook_point_in", path, str),
        "hook_point_out": config_value(raw, "hook_point_out", path, str),
        "n_ctx": config_size(raw, "n_ctx", path),
        "norm_activation": norm_activation,
        "sparsity_include_decoder_norm": config_value(raw, "sparsity_include_decoder_norm", path, bool, True),
        "skip_bos": config_value(raw, "skip_bos", path, bool, False),
    }


def _activation(raw: dict[str, Any], path: Path, n_ov: int) -> tuple[str, int]:
    """``(act_fn, top_k)``: ``topk`` keeps ``top_k``, ``relu`` and ``jumprelu`` are top-all (the JumpReLU's
    thresholds gate first: ``Lorsa.activation``)."""
    act_fn = config_value(raw, "act_fn", path, str, "relu").lower()
    if act_fn == "topk":
        return act_fn, config_size(raw, "top_k", path, 50)
    if act_fn in ("relu", "jumprelu"):
        return act_fn, n_ov
    raise UnsupportedArchitectureError(
        f"{path}: key 'act_fn': act_fn={act_fn!r} is not supported (only 'topk', 'jumprelu', and 'relu' as "
        "top-all; 'batchtopk' ranks a whole batch at once)"
    )


def _attention(raw: dict[str, Any], path: Path) -> tuple[bool, float | None]:
    """``(qk_norm, attn_scale)``: RMS QK-norm only; a positive finite scale or None."""
    qk_norm = config_value(raw, "use_post_qk_ln", path, bool, False)
    if qk_norm:
        norm_type = raw.get("normalization_type")
        if norm_type == "LN":
            raise UnsupportedArchitectureError(
                f"{path}: key 'normalization_type': normalization_type='LN' (LayerNorm QK-norm) is not supported"
            )
        require(norm_type == "RMS", path, f"use_post_qk_ln=true needs normalization_type 'RMS', got {norm_type!r}")
    attn_scale = Field("attn_scale", float, None, positive=True).read(raw, path)
    return qk_norm, attn_scale


def is_trainer_checkpoint(directory: Path) -> bool:
    """Whether ``directory`` is one of their ``Trainer.save_checkpoint`` folders: it holds
    ``trainer.pt`` (always written there, never by ``save_pretrained``) or is ``checkpoints/step_<N>``."""
    return (directory / TRAINER_STATE_FILE).exists() or (
        re.fullmatch(r"step_\d+", directory.name) is not None and directory.parent.name == "checkpoints")


def _trainer_steps(directory: Path) -> list[Path]:
    """``directory/checkpoints/step_<N>/`` folders holding ``sae_weights.safetensors``, by step."""
    steps = [p for p in (directory / "checkpoints").glob("step_*")
             if re.fullmatch(r"step_\d+", p.name) and (p / WEIGHTS_FILE).is_file()]
    return sorted(steps, key=lambda p: int(p.name[len("step_"):]))


def has_files(directory: Path) -> bool:
    """Format detection: ``config.json`` with ``sae_weights.safetensors``, or with only their trainer checkpoints
    ``checkpoints/step_<N>/`` (what ``train_lorsa`` leaves when its activation stream ended early): the Lorsa
    reader then names the step folder to load (:func:`_require_weights`), where detection would find no format."""
    return (directory / CONFIG_FILE).is_file() and (
        (directory / WEIGHTS_FILE).is_file() or bool(_trainer_steps(directory)))


def _require_weights(directory: Path) -> Path:
    """``directory/sae_weights.safetensors``; when missing, the error names what is there instead: files this
    loader does not read, or the trainer checkpoint ``train_lorsa`` saves instead of the folder's own weights
    when its activation stream ends before ``total_training_tokens``."""
    weights_path = directory / WEIGHTS_FILE
    if weights_path.is_file():
        return weights_path
    others = [name for name in _REFUSED_WEIGHT_FILES if (directory / name).exists()]
    hint = f"; found {others}, which this loader does not read (pickle/DCP or training layout)" if others else ""
    steps = _trainer_steps(directory)
    if steps:
        hint += (f"; found trainer checkpoint(s) {[p.name for p in steps]} under checkpoints/: llamascopium's "
                 "runners/train.py::train_lorsa saves only there (Trainer.save_checkpoint, unfolded weights) when "
                 f"its activation stream ends before total_training_tokens; load {steps[-1]} (the last step; "
                 "read as unfolded, no weights_folded keyword needed)")
    return require_file(weights_path, hint)


def _weights_folded(directory: Path, norm_activation: str, weights_folded: bool | None, path: Path,
                    kind: str = "lorsa") -> bool:
    """The folding rule of the module docstring, for a Lorsa (``kind="lorsa"``) or an SAE / transcoder
    (``kind="sae"``, :mod:`.llamascopium_sae`): llamascopium 2.0.0b34 ``runners/train.py::train_lorsa`` /
    ``train_sae`` writes ``config.json`` before training (``"dataset-wise"``) and ends with
    ``save_pretrained(fold_activation_scale=True)``, which folds the weights without rewriting ``config.json``;
    ``save_pretrained()`` (no fold) + ``save_hyperparameters`` write the same two files with unfolded weights.

    Raises:
        CheckpointError: ``"dataset-wise"`` outside a trainer checkpoint and no ``weights_folded=``: the one case
            the files cannot decide.
    """
    if weights_folded is not None:
        return bool(weights_folded)
    if norm_activation == "inference":
        return True
    if is_trainer_checkpoint(directory):
        return False
    name, settings = ("Lorsa", "TrainLorsaSettings") if kind == "lorsa" else ("SAE", "TrainSAESettings")
    refuse(
        path, f"norm_activation='dataset-wise' does not say whether the weights in {WEIGHTS_FILE} are folded "
        "(llamascopium writes config.json and the weights separately, and nothing in the files tells the two "
        "cases apart; reading folded weights as unfolded applies the norm twice). Pass the keyword for the "
        f"llamascopium writer that made this folder: weights_folded=True for runners/train.py::train_{kind}'s "
        f"exp_result_path ({settings}.fold_activation_scale=True, the default: config.json is written before "
        "training, then save_pretrained(fold_activation_scale=True)), or for "
        f"save_pretrained(fold_activation_scale=True), or save_pretrained() of a {name} folded since "
        "(standardize_parameters_of_dataset_norm, from_pretrained(..., fold_activation_scale=True)), next to a "
        "config.json saved before the fold; weights_folded=False for save_pretrained() "
        "(fold_activation_scale=False, its default) with cfg.save_hyperparameters(), push_to_hub() of a "
        f"{name} still in 'dataset-wise' mode, or train_{kind} with fold_activation_scale=False. (A "
        "Trainer.save_checkpoint folder, checkpoints/step_<N>/ or one holding trainer.pt, is read as unfolded "
        "without asking; a config.json saved after the fold says 'inference' and needs no keyword.)"
    )


def parse_config(directory: Path, *, layer: int | None = None, weights_folded: bool | None = None) -> Parsed:
    """``config.json`` -> ``Parsed(directory, LorsaConfig, settings)`` (field mapping: module docstring).

    Raises:
        CheckpointError: missing/unparsable file, a missing key, a field of the wrong type, a size
            that is not a positive int, ``layer`` contradicting ``hook_point_in``.
        UnsupportedArchitectureError: a setting our Lorsa cannot reproduce.
    """
    path = directory / CONFIG_FILE
    raw = read_json_object(path)
    _check_supported(raw, path)
    d_model = config_size(raw, "d_model", path)
    n_qk = config_size(raw, "n_qk_heads", path)
    d_qk_stored = config_size(raw, "d_qk_head", path)
    rotary_scale = config_size(raw, "rotary_scale", path, 1)
    if config_value(raw, "positional_embedding_type", path, str, "rotary") == "none":
        # their _apply_rotary, the only place that repeat_interleaves q and k by rotary_scale, runs for rotary
        # attention only (models/lorsa.py): without RoPE the scale does nothing (it doubled every score here
        # until 2026-11-29)
        rotary_scale = 1
    d_qk = d_qk_stored * rotary_scale  # their _apply_rotary repeat_interleaves q and k by rotary_scale
    n_ov = _n_ov_heads(raw, path, d_model)
    settings = _settings(raw, path)
    act_fn, top_k = _activation(raw, path, n_ov)
    qk_norm, attn_scale = _attention(raw, path)
    if attn_scale is None:  # their default, from the stored (not the repeated) head size
        attn_scale = math.sqrt(d_qk_stored)

    found = re.search(r"(?:^|\.)(?:blocks|layers|h)\.([0-9]+)(?:\.|$)", settings["hook_point_in"])
    inferred = int(found.group(1)) if found else None
    require(layer is None or inferred is None or layer == inferred, path,
            f"layer={layer} was requested but hook_point_in {settings['hook_point_in']!r} is layer {inferred}")
    with config_errors(path, "", (CheckpointError, ValueError, TypeError)):
        cfg = LorsaConfig(
            d_model=d_model,
            n_qk_heads=n_qk,
            d_qk_head=d_qk,
            n_ov_heads=n_ov,
            top_k=top_k,
            activation="jumprelu" if act_fn == "jumprelu" else "topk",
            rotary=_rotary(raw, path, d_qk),
            attn_scale=attn_scale,
            qk_norm=qk_norm,
            qk_norm_eps=config_value(raw, "eps", path, float, 1e-6),
            use_decoder_bias=config_value(raw, "use_decoder_bias", path, bool, True),
            layer=layer if layer is not None else inferred,
        )
    settings["act_fn"] = act_fn
    settings["rotary_scale"] = rotary_scale
    _require_weights(directory)  # before the folding rule: a folder without weights has nothing to fold
    folded = _weights_folded(directory, settings["norm_activation"], weights_folded, path)
    return Parsed(directory, cfg, {**settings, "folded": folded, "source_config": raw, "source": CONFIG_FILE})


def _check_buffers(
    path: os.PathLike[str], state: dict[str, torch.Tensor], cfg: LorsaConfig, n_ctx: int
) -> None:
    """Shapes of the saved buffers, and their values against the config (layout, base, causality; not on a
    header-only ``device="meta"`` load, whose buffers hold no values)."""
    ignore = tuple(state["IGNORE"].shape) if "IGNORE" in state else ()
    require(ignore == (), path, f"buffer 'IGNORE' should be a scalar, got shape {ignore}")
    if "mask" in state:
        mask = state["mask"]
        require(tuple(mask.shape) == (n_ctx, n_ctx), path,
                f"buffer 'mask' has shape {tuple(mask.shape)}, {CONFIG_FILE} n_ctx={n_ctx}")
        m = min(n_ctx, _N_CHECK)
        causal = torch.ones(m, m, dtype=torch.bool, device=mask.device).tril()
        if not mask.is_meta and not torch.equal(mask[:m, :m].bool(), causal):  # meta: header-only, no values
            raise UnsupportedArchitectureError(
                f"{path}: buffer 'mask' (tensor key 'mask') is not the plain causal mask "
                "(local/windowed attention is not supported)"
            )
    rot_keys = [k for k in ("rotary_sin", "rotary_cos") if k in state]
    if cfg.rotary is None:
        require(not rot_keys, path, f"tensors {rot_keys} present but positional_embedding_type is 'none'")
        return
    for key in rot_keys:
        require(tuple(state[key].shape) == (n_ctx, cfg.rotary.rotary_dim), path,
                f"buffer {key!r} has shape {tuple(state[key].shape)}, {CONFIG_FILE} implies "
                f"{(n_ctx, cfg.rotary.rotary_dim)}")
    m = min(n_ctx, _N_CHECK)
    cos, sin = rotary_cos_sin(cfg.rotary, torch.arange(m, device="cpu"))
    for key, ours in (("rotary_cos", cos), ("rotary_sin", sin)):
        if key in state and not state[key].is_meta:  # meta: a header-only load (device="meta"), no values
            err = (state[key][:m].float() - ours).abs().max().item()
            # bf16 storage ~4e-3; a wrong layout/base/scaling is O(1)
            require(err <= 1e-2, path, f"buffer {key!r} disagrees with {CONFIG_FILE}'s RoPE settings (max |diff| "
                                       f"{err:.3g} over {m} positions; check rotary_adjacent_pairs, rotary_base, "
                                       "NTK_by_parts_*)")


#: their JumpReLU's parameter (``activation_functions.py``: ``JumpReLU.log_jumprelu_threshold``), ``(d_sae,)``
JUMPRELU_KEY = "activation_function.log_jumprelu_threshold"


def _split_state(weights_path: Path, state: dict[str, torch.Tensor], cfg: LorsaConfig,
                 n_ctx: int, rotary_scale: int = 1) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(params, norm scalars by hook)``: parameters checked against ``cfg``, buffers validated."""
    norms = {k[len(NORM_PREFIX) :]: v for k, v in state.items() if k.startswith(NORM_PREFIX)}
    for hook, value in norms.items():
        require(value.numel() == 1, weights_path,
                f"tensor {NORM_PREFIX + hook!r} should be a scalar, got shape {tuple(value.shape)}")
    params = {
        k: v
        for k, v in state.items()
        if not k.startswith(NORM_PREFIX) and k not in _CHECKED_BUFFERS + _IGNORED_BUFFERS
    }
    if cfg.activation == "jumprelu":  # their JumpReLU.forward: log_threshold.exp()
        require(JUMPRELU_KEY in params and params[JUMPRELU_KEY].dim() == 1, weights_path,
                f"missing tensor {JUMPRELU_KEY!r} (d_sae,): {CONFIG_FILE} says act_fn: jumprelu")
        log_threshold = params.pop(JUMPRELU_KEY)
        params["threshold"] = log_threshold.to(torch.promote_types(log_threshold.dtype, torch.float32)).exp()
    if rotary_scale > 1:  # exact: q·k over repeated dims, RMS of a repeated vector is unchanged
        for key in _QK_TENSORS:
            if key in params and params[key].dim() >= 1:
                params[key] = params[key].repeat_interleave(rotary_scale, dim=-1)
    expected = {k: tuple(v.shape) for k, v in Lorsa(cfg, device="meta").state_dict().items()}
    check_tensor_inventory(
        weights_path, {k: tuple(v.shape) for k, v in params.items()}, expected, source=CONFIG_FILE
    )
    check_tensors(weights_path, params)
    _check_buffers(weights_path, state, cfg, n_ctx)
    return params, norms


def load_weights(directory: Path, parsed: Parsed) -> dict[str, torch.Tensor]:
    """``sae_weights.safetensors`` checked (tensors, buffers), then the dataset-norm and decoder-norm
    folds (module docstring) in fp32 or wider; records what was folded in ``cfg.extra["llamascopium"]``.

    Raises:
        CheckpointError: missing file (naming the pickle/DCP files it does not read), missing/unexpected
            tensor, wrong shape, non-floating/non-finite parameter, buffers disagreeing with the config,
            missing or invalid norm scalars when a fold is needed.
        UnsupportedArchitectureError: a non-causal ``mask`` buffer.
    """
    cfg, settings = parsed.config, parsed.settings
    weights_path = _require_weights(directory)
    state = load_safetensors(weights_path)
    # written by this package: its Lorsa reads the attention's input (SITE_METADATA_KEY); their files say nothing
    header = read_safetensors_header(weights_path)[1]
    site = header.get(SITE_METADATA_KEY)
    centred = {"true": True, "false": False}.get(str(header.get(CENTRED_METADATA_KEY)))
    params, norms_raw = _split_state(weights_path, state, cfg, settings["n_ctx"], settings["rotary_scale"])
    table = state.get("rotary_cos")
    if cfg.rotary is not None and table is not None and table.dtype in (torch.bfloat16, torch.float16):
        # their reload uses the stored low-precision tables (load_state_dict overwrites the buffers)
        cfg.rotary = dataclasses.replace(cfg.rotary, table_dtype=str(table.dtype).removeprefix("torch."))

    settings["stored_dtype"] = stored = stored_dtype(params) or torch.float32  # the widest, where several
    work_dtype = torch.promote_types(stored, torch.float32)
    settings["load_dtype"] = work_dtype  # the default: bf16/fp16 files are upcast (module docstring)
    w = {k: v.to(work_dtype) for k, v in params.items()}
    norms = {hook: float(v.reshape(())) for hook, v in norms_raw.items()}
    if not settings["folded"]:
        scales = {}
        for role in ("hook_point_in", "hook_point_out"):
            hook = settings[role]
            norm = check_scalar(norms_raw.get(hook), weights_path, NORM_PREFIX + hook,
                                f" (config.json says norm_activation={settings['norm_activation']!r}: unfolded "
                                "weights; pass weights_folded=True if they are known to be folded already)")
            scales[role] = math.sqrt(cfg.d_model) / norm
        for key in ("W_Q", "W_K", "W_V"):
            w[key] = w[key] * scales["hook_point_in"]
        for key in ("W_O", "b_D"):
            if key in w:
                w[key] = w[key] / scales["hook_point_out"]
    if settings["sparsity_include_decoder_norm"]:
        if not settings["folded"] and "threshold" in w:
            # their JumpReLU gates hidden_pre · ‖W_O‖ of the unfolded W_O; ours gates z · ‖W_O / s_out‖ (the norm
            # measured below, after the dataset fold): the same heads where θ is divided by s_out as well
            w["threshold"] = w["threshold"] / scales["hook_point_out"]
        dec = w["W_O"].norm(dim=1).clamp_min(torch.finfo(work_dtype).tiny)
        w["W_O"] = w["W_O"] / dec[:, None]
        w["W_V"] = w["W_V"] * dec[:, None]
        w["b_V"] = w["b_V"] * dec

    keep = ("hook_point_in", "hook_point_out", "n_ctx", "act_fn", "norm_activation",
            "sparsity_include_decoder_norm", "skip_bos", "rotary_scale")
    cfg.extra = {
        "llamascopium": {
            **{k: settings[k] for k in keep},
            # non-finite values (their uninitialised torch.empty(())) are recorded as None
            "dataset_average_activation_norm": {h: v if math.isfinite(v) else None for h, v in norms.items()}
            or None,
            "dataset_norm_folded_by_loader": not settings["folded"],
            "decoder_norm_folded_by_loader": settings["sparsity_include_decoder_norm"],
            "stored_dtype": str(settings["stored_dtype"]).removeprefix("torch."),
            "source_config": settings["source_config"],
            **({"site": ATTENTION_SITE} if site == ATTENTION_SITE else {}),
            **({"center_writing_weights": centred} if centred is not None else {}),
        }
    }
    return w


def build(parsed: Parsed, state: dict[str, torch.Tensor], *, device: torch.device | str | None = None,
          dtype: torch.dtype | None = None) -> Lorsa:
    """Our :class:`Lorsa` with the folded ``state`` (``dtype`` default: the stored dtype (the widest, where
    the parameters are stored in several) upcast to at least fp32 — a bf16/fp16 file loads as fp32, see the
    module docstring).

    Raises:
        CheckpointError: non-floating or non-finite tensor.
    """
    return parsed.build_module(Lorsa, state, WEIGHTS_FILE, device=device,
                               dtype=dtype or parsed.settings["load_dtype"])


READER = Reader("llamascopium_lorsa", (CONFIG_FILE, WEIGHTS_FILE), parse_config, load_weights, build)


def load_llamascopium_lorsa(directory: str | os.PathLike[str], **kwargs: Any) -> Lorsa:
    """Load a Llamascopium / lm-saes Lorsa checkpoint as our :class:`Lorsa` (see the module docstring).

    Source: OpenMOSS Llamascopium ``llamascopium.models.lorsa.LowRankSparseAttention`` (formerly
    ``lm_saes/models/lorsa.py``). Same as ``formats.load(directory, format="llamascopium")`` for
    ``sae_type: lorsa``.

    Args:
        directory: a checkpoint directory (``config.json`` + ``sae_weights.safetensors``), or on
            the hub ``"repo_id:name"`` (their layout) or ``"repo_id"`` (files at the root).
        kwargs: ``layer`` (target layer stored in ``cfg.layer``; default parsed from ``hook_point_in``
            ``blocks.<L>.…``; a contradicting value raises), ``device`` (default CPU), ``dtype``
            (default: the stored dtype, the widest where there are several, bf16/fp16 upcast to fp32 — their
            fp32 reload to <1e-6;
            ``dtype=torch.bfloat16`` keeps a bf16 file's dtype: the fp32 folds rounded once, as far from
            the exact output as their own bf16 reload, see the module docstring), ``weights_folded``
            (whether the dataset-wise norm is already folded; ``None`` applies the rule of the module
            docstring, which refuses a ``"dataset-wise"`` file outside a trainer checkpoint; pass
            ``True`` for a ``train_lorsa`` output or ``save_pretrained(fold_activation_scale=True)``,
            ``False`` for ``save_pretrained()`` / ``push_to_hub()`` of an unfolded Lorsa),
            ``subfolder``, ``local_files_only`` / ``revision`` (``huggingface_hub.snapshot_download``).

    Returns:
        The module in eval mode (``W_Q (n_qk_heads, d_model, d_qk_head)``, ``W_O (n_ov_heads, d_model)``);
        ``ours(x_raw)`` reproduces their output on raw (un-normalised) activations.
        ``cfg.extra["llamascopium"]`` records the source settings and what was folded.

    Raises:
        CheckpointError: missing/unparsable file (a missing ``sae_weights.safetensors`` next to their
            ``checkpoints/step_<N>/`` names the step folder to load), missing/unexpected tensor, wrong shape,
            buffers disagreeing with the config, missing or invalid norm scalars when a fold is needed, a
            ``"dataset-wise"`` file whose folding the files cannot decide (rule 3 of the module docstring).
        UnsupportedArchitectureError: a setting our Lorsa cannot reproduce.
    """
    return read(READER, directory, **kwargs)  # type: ignore[no-any-return]


def _their_cos_sin(doc: dict[str, Any], n_ctx: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rotary_cos, rotary_sin)`` ``(n_ctx, rotary_dim)`` as their ``LowRankSparseAttention.__init__`` builds them for
    the config ``doc`` and a module of ``dtype`` (``_calculate_sin_cos_rotary``: angles ``pos / freq`` in fp32, fp64
    for an fp64 module, then cast). Ours (``pos * inv_freq``) agree to fp32 rounding, which can move a bf16 value by one
    step (4 of 4096 entries at n_ctx 128, rotary_dim 32; 18 of 16384 at n_ctx 2048, rotary_dim 8).

    Source: Llamascopium 2.0.0b34 ``llamascopium/models/lorsa.py`` (``_calculate_sin_cos_rotary``).
    """
    high = torch.float64 if dtype == torch.float64 else torch.float32
    rotary_dim, base = int(doc["rotary_dim"]), doc["rotary_base"]
    pos = torch.arange(n_ctx, dtype=high, device="cpu")
    dim = torch.arange(rotary_dim // 2, dtype=high, device="cpu")
    if doc["use_NTK_by_parts_rope"]:
        even = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float()
        inv_freq = 1.0 / (base ** (even / rotary_dim))
        factor, old = doc["NTK_by_parts_factor"], doc["old_context_len"]
        low, high_f = doc["NTK_by_parts_low_freq_factor"], doc["NTK_by_parts_high_freq_factor"]
        low_wavelen, high_wavelen = old / low, old / high_f
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - low) / (high_f - low)
        smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        freq = 1 / torch.where(is_medium, smoothed, inv_freq_llama)
    else:
        freq = base ** (dim / (rotary_dim / 2))
    # einops.repeat "d -> (d 2)" (adjacent pairs) / "d -> (2 d)" (half-split)
    freq = freq.repeat_interleave(2) if doc["rotary_adjacent_pairs"] else freq.repeat(2)
    angles = pos[:, None] / freq[None, :]
    return torch.cos(angles).to(dtype), torch.sin(angles).to(dtype)


def save_llamascopium_lorsa(lorsa: Lorsa, directory: str | os.PathLike[str], *, hook_point_in: str | None = None,
                            hook_point_out: str | None = None, n_ctx: int | None = None, model: Any = None) -> Path:
    """Write ``lorsa`` as Llamascopium does (``config.json`` + ``sae_weights.safetensors``), readable by
    their ``SparseDictionary.from_pretrained`` and by :func:`load_llamascopium_lorsa`.

    The config says ``norm_activation: "inference"`` (our weights map raw activations) and
    ``sparsity_include_decoder_norm: false`` (our top-k ranks ``z`` itself); the buffers ``mask``,
    ``IGNORE``, ``rotary_sin/cos`` ``(n_ctx, rotary_dim)`` are written as their ``__init__`` builds them
    (their angles ``pos / freq`` in fp32, cast to the weights' dtype — or to the dtype the tables were read in,
    ``RotaryConfig.table_dtype``: a bf16 file loaded as fp32 is written with the bf16 tables it came with, so that
    their reload and ours compute what they computed on the original file). ``hook_point_in/out`` and ``n_ctx``
    default to ``cfg.extra["llamascopium"]`` (a Lorsa loaded from their files), else TransformerLens names of
    ``cfg.layer`` (``blocks.<L>.ln1.hook_normalized`` / ``blocks.<L>.hook_attn_out``) and 2048.

    A Lorsa of this package reads the attention module's input — the pre-attention norm's output, **gain (and
    bias) included** — where TransformerLens's ``ln1.hook_normalized`` (what Llamascopium feeds a Lorsa) is before
    them: the file says so in its safetensors header (``nnsight_lorsa.site: attention``), which
    :class:`~nnsight_lorsa.envoy.lorsa_set.LorsaSet` reads back (no fold), but Llamascopium ignores — there it
    computes what it was trained on only where the layer's pre-attention norm has gain 1 and no bias. A Lorsa loaded
    from their files and not folded (``load``) is written without the mark, as it came. ``model=`` (the model the
    Lorsa belongs to, ``cfg.layer`` its layer) writes the TransformerLens form instead: the layer's norm gain and bias
    folded out of ``W_Q``, ``W_K``, ``W_V`` (:func:`~.hook_sites.attention_norm_unfolded`), so that their library
    feeding ``ln1.hook_normalized`` computes what the Lorsa computes here; no mark (a set folds it back).

    Raises:
        UnsupportedArchitectureError: RoPE their config cannot express (``rope_type`` other than
            default/llama3, ``attention_scaling != 1``, a non-integer base or llama3
            ``original_max_position_embeddings``).
        ArgumentError: no hook points given and neither ``cfg.extra`` nor ``cfg.layer`` names them, or one hook for
            both (their ``LorsaConfig`` refuses it); ``model=`` for
            a Lorsa without ``cfg.layer``, or one that reads ``ln1.hook_normalized`` already (theirs, not folded).
        UnsupportedArchitectureError: ``model=`` of a family whose Lorsa has no TransformerLens form (a
            post-attention norm: Gemma-2/3, OLMo-2); a JumpReLU Lorsa with a top-k below every head or a
            threshold ≤ 0 (their JumpReLU stores log-thresholds and has no top-k).
    """
    from ..errors import ArgumentError

    cfg = lorsa.cfg
    known = cfg.extra.get("llamascopium", {}) if isinstance(cfg.extra, dict) else {}
    if hook_point_in is None or hook_point_out is None:
        if "hook_point_in" in known and "hook_point_out" in known:
            hook_point_in = hook_point_in or known["hook_point_in"]
            hook_point_out = hook_point_out or known["hook_point_out"]
        elif cfg.layer is not None:
            hook_point_in = hook_point_in or f"blocks.{cfg.layer}.ln1.hook_normalized"
            hook_point_out = hook_point_out or f"blocks.{cfg.layer}.hook_attn_out"
        else:
            raise ArgumentError("save(format='llamascopium') needs hook_point_in= and hook_point_out= "
                                "(cfg.layer is None and cfg.extra has no llamascopium hook points)")
    if hook_point_in == hook_point_out:
        raise ArgumentError(f"save(format='llamascopium'): hook_point_in and hook_point_out are both "
                            f"{hook_point_in!r}; their LorsaConfig refuses a Lorsa that reads and writes one hook")
    n_ctx = int(n_ctx or known.get("n_ctx") or 2048)
    expansion = cfg.n_ov_heads / cfg.d_model
    while int(cfg.d_model * expansion) < cfg.n_ov_heads:  # their d_sae = int(d_model * expansion_factor)
        expansion = math.nextafter(expansion, math.inf)
    doc: dict[str, Any] = {
        "sae_type": "lorsa", "d_model": cfg.d_model, "expansion_factor": expansion,
        "use_decoder_bias": cfg.use_decoder_bias, "act_fn": "topk", "top_k": cfg.top_k,
        "norm_activation": "inference", "sparsity_include_decoder_norm": False,
        "hook_point_in": hook_point_in, "hook_point_out": hook_point_out,
        "n_qk_heads": cfg.n_qk_heads, "d_qk_head": cfg.d_qk_head, "n_ctx": n_ctx, "rotary_scale": 1,
        "attn_scale": cfg.scale, "use_post_qk_ln": cfg.qk_norm, "normalization_type": "RMS" if cfg.qk_norm else None,
        "eps": cfg.qk_norm_eps, "positional_embedding_type": "none" if cfg.rotary is None else "rotary",
    }
    dtype = lorsa.W_Q.dtype
    state = {k: v.detach().to("cpu").contiguous() for k, v in lorsa.state_dict().items()}
    if cfg.activation == "jumprelu":  # their JumpReLU: act_fn jumprelu, top-all, log-thresholds
        threshold = state.pop("threshold")
        if cfg.top_k != cfg.n_ov_heads or not bool((threshold > 0).all()):
            raise UnsupportedArchitectureError(
                f"save(format='llamascopium'): a JumpReLU Lorsa with top_k={cfg.top_k} of {cfg.n_ov_heads} heads, "
                f"smallest threshold {float(threshold.min()):g}: their JumpReLU keeps every head above a positive "
                "threshold (log_jumprelu_threshold), with no top-k")
        doc.update(act_fn="jumprelu")
        del doc["top_k"]
        state[JUMPRELU_KEY] = threshold.double().log().to(threshold.dtype)
    state["mask"] = torch.ones(n_ctx, n_ctx, dtype=torch.bool, device="cpu").tril()
    state["IGNORE"] = torch.tensor(-torch.inf, device="cpu")
    rot = cfg.rotary
    if rot is not None:
        original = (rot.scaling or {}).get("original_max_position_embeddings", 0) if rot.rope_type == "llama3" else 0
        if (rot.rope_type not in ("default", "llama3") or rot.attention_scaling != 1 or float(rot.base) != int(rot.base)
                or rot.inv_freq_dtype is not None or float(original) != int(original)):
            raise UnsupportedArchitectureError(
                f"Llamascopium's config cannot express rope_type={rot.rope_type!r}, "
                f"attention_scaling={rot.attention_scaling}, base={rot.base}, inv_freq_dtype={rot.inv_freq_dtype!r}, "
                f"original_max_position_embeddings={original!r} (default/llama3 RoPE, integer base and context, fp32 "
                "frequencies)")
        doc.update(rotary_dim=rot.rotary_dim, rotary_base=int(rot.base), rotary_adjacent_pairs=rot.interleaved,
                   use_NTK_by_parts_rope=rot.rope_type == "llama3")
        if rot.rope_type == "llama3":
            doc.update(NTK_by_parts_factor=rot.scaling["factor"],
                       NTK_by_parts_low_freq_factor=rot.scaling["low_freq_factor"],
                       NTK_by_parts_high_freq_factor=rot.scaling["high_freq_factor"],
                       old_context_len=int(rot.scaling["original_max_position_embeddings"]))
        # as their __init__ builds them for a module of the dtype the tables were read in (a bf16 file loaded as fp32
        # keeps bf16 tables: their reload, and ours — table_dtype — are then the original file's)
        table_dtype = getattr(torch, rot.table_dtype) if rot.table_dtype is not None else dtype
        state["rotary_cos"], state["rotary_sin"] = _their_cos_sin(doc, n_ctx, table_dtype)
    else:
        doc["rotary_dim"] = cfg.d_qk_head  # a required field of theirs, unused without RoPE
    text = json.dumps(doc, indent=1)
    marked = lorsa_reads_attention_input(lorsa)
    if model is not None:
        if not marked or cfg.layer is None:
            raise ArgumentError("save(format='llamascopium', model=...) folds the model's pre-attention norm out of a "
                                "Lorsa of layer cfg.layer that reads the attention's input; "
                                + ("this one reads ln1.hook_normalized already: save it without model="
                                   if not marked else "this one has no cfg.layer"))
        from ..adapters.registry import get_adapter

        unfolded = attention_norm_unfolded(lorsa, get_adapter(model), torch_module(model), cfg.layer)
        state.update({k: v.to("cpu").contiguous() for k, v in unfolded.items()})
        marked = False  # the TransformerLens form: what their library feeds it
    header = {"format": "pt", **({SITE_METADATA_KEY: ATTENTION_SITE} if marked else {}),
              CENTRED_METADATA_KEY: str(trained_centred(lorsa) is True).lower()}
    with atomic_directory(directory) as stage:
        stage.save_tensors(WEIGHTS_FILE, state, header)
        stage.write_text(CONFIG_FILE, text)
    return Path(directory)
