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
``gated``                   ``1[x̃ W_enc + b_gate > 0] ·                         SparseAutoencoder, jumprelu
                            relu(x̃ (W_enc ⊙ exp(r_mag)) + b_mag)``             (exact conversion below)
==========================  =================================================  ==========================

(``a`` = ``apply_b_dec_to_input``.) A gated SAE (Rajamanoharan et al. 2024, arXiv:2404.16014;
``sae_lens/saes/gated_sae.py``) is a JumpReLU SAE: with ``m = x̃ (W_enc ⊙ exp(r_mag)) + b_mag``,
the gate ``x̃ W_enc + b_gate > 0`` is ``m > b_mag − exp(r_mag) ⊙ b_gate`` (``exp(r_mag) > 0``), so
``W_enc ← W_enc ⊙ exp(r_mag)``, ``b_enc ← b_mag``, ``θ ← max(b_mag − exp(r_mag) ⊙ b_gate, 0)``.
A ``batchtopk`` file is a SAELens *training* checkpoint (SAELens saves BatchTopK SAEs for inference
as ``jumprelu``); ``k`` must be a whole number, ``topk_threshold`` becomes our BatchTopK threshold
(used in eval mode; ``to_jumprelu_()`` exports it) and ``topk_threshold_lr`` its EMA rate.
Exact conversions: a JumpReLU threshold ``θ < 0`` becomes
``max(θ, 0)`` (``relu(x)·1[x > θ] = x·1[x > max(θ, 0)]``); a TopK SAE with
``rescale_acts_by_decoder_norm`` (pre-activations times ``‖W_dec[i]‖``, decoder rows divided by it)
is folded with :meth:`~nnsight_lorsa.modules.sparse_coder.SparseCoder.fold_decoder_norm_`.

``normalize_activations``: ``"none"``; ``"expected_average_only_in"`` means the SAE expects inputs
multiplied by a dataset-wide scalar ``s`` (kept in SAELens's pretrained-SAE directory, not in the
files). Pass ``norm_scaling_factor=s`` and we fold it as SAELens ``fold_activation_norm_scaling_factor``
does (``W_enc *= s``, ``W_dec /= s``, ``b_dec /= s``) so the module takes raw activations; without it
the weights stay unfolded (a warning; ``cfg.extra["saelens"]["norm_folded"]`` is False).
``"constant_norm_rescale"`` and ``"layer_norm"`` normalise per token at run time, which our modules do
not: :class:`~nnsight_lorsa.errors.UnsupportedArchitectureError`.

Hook names map to our sites with :func:`~.hook_sites.transformer_lens_hook_site`
(``cfg.extra["saelens"]["site"]``; ``SAEConfig.hook`` is the module path when an adapter is given).

Reader steps (:class:`~.reader.Reader`): :func:`parse_config` (``cfg.json`` -> ``SAEConfig`` /
``TranscoderConfig``), :func:`load_weights` (gated / batchtopk / threshold conversions), :func:`build`
(decoder-norm and activation-norm folds).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from ..errors import ArgumentError, CheckpointError, UnsupportedArchitectureError
from ..modules.sae import SAEConfig, SparseAutoencoder
from ..modules.transcoder import SkipTranscoder, Transcoder, TranscoderConfig
from .files import load_safetensors, read_json_object, read_safetensors_header
from .hook_sites import site_record
from .reader import Parsed, Reader, read
from .validate import check_d_model, check_file_tensors, config_size, config_value

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
    "gated": ("sae", "jumprelu"),
}

__all__ = ["ARCHITECTURES", "READER", "build", "load_saelens", "load_weights", "parse_config", "save_saelens"]


def _architecture(raw: dict[str, Any], path: Path) -> str:
    arch = raw.get("architecture")
    if arch is None:  # pre-v6 configs: SAELens handle_config_defaulting, from the activation function
        legacy = raw.get("activation_fn", raw.get("activation_fn_str"))
        if legacy is None:  # nothing says which forward: guessing "standard" would change a TopK SAE's outputs
            raise CheckpointError(f"{path}: key 'architecture' is missing (and no pre-v6 'activation_fn'); "
                                  f"add one of {list(ARCHITECTURES)}")
        arch = "topk" if legacy == "topk" else "standard"
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{path}: key 'architecture' is {arch!r}; supported SAELens architectures: {list(ARCHITECTURES)}")
    return str(arch)


def _normalization(raw: dict[str, Any], path: Path) -> str:
    norm = raw.get("normalize_activations", "none") or "none"
    if norm in ("constant_norm_rescale", "layer_norm"):
        raise UnsupportedArchitectureError(
            f"{path}: key 'normalize_activations' is {norm!r} (per-token run-time normalisation), "
            "which our modules do not reproduce")
    if norm not in ("none", "expected_average_only_in"):
        raise UnsupportedArchitectureError(f"{path}: key 'normalize_activations' is {norm!r}; "
                                           "supported: 'none', 'expected_average_only_in'")
    return str(norm)


def _activation_params(raw: dict[str, Any], path: Path, arch: str, activation: str) -> dict[str, Any]:
    params: dict[str, Any] = {}
    if activation == "topk":
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


def parse_config(directory: Path, *, norm_scaling_factor: float | None = None, d_model: int | None = None,
                 adapter: Any = None) -> Parsed:
    """``cfg.json`` -> ``Parsed(directory, SAEConfig | TranscoderConfig, settings)`` (module docstring).

    Raises:
        CheckpointError: missing file/key, a size that is not a positive int, a transcoder with
            ``apply_b_dec_to_input``, a non-finite ``norm_scaling_factor``.
        UnsupportedArchitectureError: unknown ``architecture`` or run-time normalisation.
        ConfigMismatchError: ``d_model`` given and different from ``d_in``.
    """
    cfg_path = directory / CFG_FILE
    raw = read_json_object(cfg_path)
    arch = _architecture(raw, cfg_path)
    kind, activation = ARCHITECTURES[arch]
    d_in, d_sae = config_size(raw, "d_in", cfg_path), config_size(raw, "d_sae", cfg_path)
    d_out = config_size(raw, "d_out", cfg_path) if kind != "sae" else d_in
    check_d_model(d_in, d_model, cfg_path, "d_in")
    norm = _normalization(raw, cfg_path)
    if norm_scaling_factor is not None:
        norm_scaling_factor = config_value({"norm_scaling_factor": norm_scaling_factor}, "norm_scaling_factor",
                                           cfg_path, float)
    apply_b_dec = config_value(raw, "apply_b_dec_to_input", cfg_path, bool, None)
    metadata = raw.get("metadata") if isinstance(raw.get("metadata"), dict) else {}
    hook_name = (metadata or {}).get("hook_name") or raw.get("hook_name")
    site = site_record(hook_name, adapter)
    params = _activation_params(raw, cfg_path, arch, activation)
    extra = {"saelens": {
        "architecture": arch, "hook_name": hook_name, "normalize_activations": norm,
        "norm_folded": False, "apply_b_dec_to_input": apply_b_dec if apply_b_dec is not None else kind == "sae",
        "reshape_activations": raw.get("reshape_activations", "none"), "site": site,
    }}
    cfg: SAEConfig | TranscoderConfig
    if kind == "sae":
        cfg = SAEConfig(d_in=d_in, d_sae=d_sae, activation=activation, activation_params=params, extra=extra,
                        apply_b_dec_to_input=apply_b_dec is not False,
                        hook=(site or {}).get("module_path") or hook_name)
    else:
        if apply_b_dec:
            raise CheckpointError(f"{cfg_path}: key 'apply_b_dec_to_input' is true, which SAELens forbids "
                                  "for transcoders")
        cfg = TranscoderConfig(d_in=d_in, d_sae=d_sae, d_out=d_out, activation=activation, activation_params=params,
                               extra=extra, layer=None if site is None else site["layer"])
    return Parsed(directory, cfg, {
        "architecture": arch, "kind": kind, "norm_scaling_factor": norm_scaling_factor,
        "fold_decoder_norm": activation in ("topk", "batchtopk") and config_value(
            raw, "rescale_acts_by_decoder_norm", cfg_path, bool, False),
        "source": f"{CFG_FILE} (architecture {arch!r}, d_in={d_in}, d_sae={d_sae}, d_out={d_out})"})


def load_weights(directory: Path, parsed: Parsed) -> dict[str, torch.Tensor]:
    """``sae_weights.safetensors`` in our names: gated -> JumpReLU, ``topk_threshold`` -> BatchTopK
    threshold, ``log_threshold`` / ``threshold`` -> ``activation.threshold`` (clamped to ≥ 0).

    Raises:
        CheckpointError: a missing/corrupt file, a tensor the architecture needs.
    """
    weights_path = directory / WEIGHTS_FILE
    arch = parsed.settings["architecture"]
    read_safetensors_header(weights_path)
    state = load_safetensors(weights_path)
    check_file_tensors(weights_path, state)
    if arch == "gated":
        _gated_to_jumprelu(state, weights_path)
    if arch == "batchtopk":
        if "topk_threshold" not in state:
            raise CheckpointError(f"{weights_path}: missing tensor 'topk_threshold' (architecture 'batchtopk')")
        theta = state.pop("topk_threshold").reshape(())
        state["activation.threshold"] = theta.to(state["W_enc"].dtype if "W_enc" in state else torch.float32)
        state["activation.n_updates"] = torch.ones((), dtype=torch.long)
    if "log_threshold" in state and "threshold" not in state:
        state["threshold"] = state.pop("log_threshold").exp()
    if "threshold" in state:
        state["activation.threshold"] = state.pop("threshold").clamp_min(0)
    return state


def build(parsed: Parsed, state: dict[str, torch.Tensor], *, device: torch.device | str | None = None,
          dtype: torch.dtype | None = None) -> SparseAutoencoder | Transcoder:
    """Our module with ``state``, then SAELens's folds (decoder norm; ``norm_scaling_factor``).

    Raises:
        CheckpointError: missing/unexpected tensor, wrong shape, non-floating or non-finite tensor.
    """
    cfg, settings = parsed.config, parsed.settings
    cls = {"sae": SparseAutoencoder, "transcoder": Transcoder, "skip_transcoder": SkipTranscoder}[settings["kind"]]
    module: SparseAutoencoder | Transcoder = parsed.build_module(
        cls, state, WEIGHTS_FILE, device=device, dtype=dtype or (state["W_enc"].dtype if "W_enc" in state else None))
    extra = cfg.extra["saelens"]
    if settings["fold_decoder_norm"]:
        module.fold_decoder_norm_()
        extra["folded_decoder_norm"] = True
    s = settings["norm_scaling_factor"]
    if extra["normalize_activations"] == "expected_average_only_in":
        if s is None:
            warnings.warn(f"{parsed.directory / CFG_FILE}: normalize_activations is 'expected_average_only_in' but no "
                          "norm_scaling_factor was given; the module expects inputs scaled by it", stacklevel=4)
        else:
            with torch.no_grad():
                module.W_enc.mul_(s)
                module.W_dec.div_(s)
                module.b_dec.div_(s)
            extra["norm_folded"] = True
            extra["norm_scaling_factor"] = s
    return module


READER = Reader("saelens", (CFG_FILE, WEIGHTS_FILE), parse_config, load_weights, build)


def load_saelens(directory: str | os.PathLike[str], **kwargs: Any) -> SparseAutoencoder | Transcoder:
    """Load a SAELens v6 SAE / transcoder directory (or hub repo id + ``subfolder``) as our module.

    Source: SAELens ``sae_lens/saes/sae.py`` (``SAE.save_model``), ``sae_lens/saes/*.py`` (module
    docstring). Same as ``formats.load(directory, format="saelens")``.

    Args:
        directory: local directory with ``cfg.json`` and ``sae_weights.safetensors``, or a hub repo id.
        kwargs: ``norm_scaling_factor`` (the ``s`` of ``normalize_activations="expected_average_only_in"``,
            folded), ``d_model`` (the model's width; a different ``d_in`` raises), ``adapter`` (resolves
            the hook site), ``subfolder`` (SAELens releases keep one folder per SAE id), ``device`` /
            ``dtype`` (default CPU, the stored dtype), ``local_files_only`` / ``revision``.

    Returns:
        :class:`SparseAutoencoder`, :class:`Transcoder` or :class:`SkipTranscoder` in eval mode
        (``W_enc (d_in, d_sae)``, ``W_dec (d_sae, d_out)``); ``cfg.extra["saelens"]`` records the
        source settings, hook name and site.

    Raises:
        CheckpointError: missing file/key, missing/unexpected tensor, wrong shape, non-finite values.
        UnsupportedArchitectureError: unknown ``architecture`` or run-time normalisation.
        ConfigMismatchError: ``d_model`` given and different from ``d_in``.
    """
    return read(READER, directory, **kwargs)  # type: ignore[no-any-return]


def _gated_to_jumprelu(state: dict[str, torch.Tensor], path: Path) -> None:
    """Rewrite a gated SAE's tensors (``W_enc, b_gate, r_mag, b_mag``) as a JumpReLU SAE's, in place
    (module docstring); the threshold is stored as ``threshold`` (clamped to ≥ 0 by the caller)."""
    for key in ("W_enc", "b_gate", "r_mag", "b_mag"):
        if key not in state:
            raise CheckpointError(f"{path}: missing tensor {key!r} (architecture 'gated')")
    if "b_enc" in state:
        raise CheckpointError(f"{path}: unexpected tensor 'b_enc' (a gated SAE has b_gate and b_mag instead)")
    b_gate, r_mag, b_mag = state.pop("b_gate"), state.pop("r_mag"), state.pop("b_mag")
    if not (b_gate.shape == r_mag.shape == b_mag.shape == state["W_enc"].shape[-1:]):
        raise CheckpointError(f"{path}: 'b_gate' {tuple(b_gate.shape)}, 'r_mag' {tuple(r_mag.shape)}, 'b_mag' "
                              f"{tuple(b_mag.shape)} must all be (d_sae,) = {tuple(state['W_enc'].shape[-1:])}")
    scale = r_mag.exp()
    state["W_enc"] = state["W_enc"] * scale
    state["b_enc"] = b_mag
    state["threshold"] = b_mag - scale * b_gate


_ARCH_OF = {("sae", "relu"): "standard", ("sae", "topk"): "topk", ("sae", "jumprelu"): "jumprelu",
            ("transcoder", "relu"): "transcoder", ("skip_transcoder", "relu"): "skip_transcoder",
            ("transcoder", "jumprelu"): "jumprelu_transcoder",
            ("skip_transcoder", "jumprelu"): "jumprelu_skip_transcoder"}


def save_saelens(module: SparseAutoencoder | Transcoder, directory: str | os.PathLike[str], *,
                 hook_name: str | None = None, model_name: str | None = None) -> Path:
    """Write ``module`` in SAELens v6 layout (``cfg.json`` + ``sae_weights.safetensors``).

    Raises:
        UnsupportedArchitectureError: an activation SAELens has no inference architecture for here
            (batchtopk: export with ``module.to_jumprelu_()`` first), or a negative JumpReLU threshold.
    """
    from safetensors.torch import save_file

    for name, value in (("hook_name", hook_name), ("model_name", model_name)):
        if value is not None and not isinstance(value, str):
            raise ArgumentError(f"save_saelens({name}=...) must be a string or None, got {value!r}")
    kind = "skip_transcoder" if isinstance(module, SkipTranscoder) else (
        "transcoder" if isinstance(module, Transcoder) else "sae")
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
    cfg: dict[str, Any] = {
        "architecture": arch, "d_in": module.cfg.d_in, "d_sae": module.cfg.d_sae, "dtype": dtype, "device": "cpu",
        "apply_b_dec_to_input": bool(getattr(module.cfg, "apply_b_dec_to_input", False)),
        "normalize_activations": "none", "reshape_activations": "none",
        "metadata": {"hook_name": hook_name, "model_name": model_name},
    }
    if kind != "sae":
        cfg["d_out"] = module.d_out
    if arch == "topk":
        cfg["k"] = module.cfg.activation_params["k"]
        cfg["rescale_acts_by_decoder_norm"] = False
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / WEIGHTS_FILE))
    (path / CFG_FILE).write_text(json.dumps(cfg, indent=2), encoding="utf-8")
    return path
