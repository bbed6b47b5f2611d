"""EleutherAI sparsify checkpoints: ``cfg.json`` + ``sae.safetensors`` per hookpoint -> our modules.

Layout (sparsify ``sparsify/sparse_coder.py`` ``SparseCoder.save_to_disk``; one directory per
hookpoint, e.g. ``layers.3`` or ``layers.3.mlp``)::

    cfg.json         {**SparseCoderConfig.to_dict(), "d_in": d_in}: "activation" ("topk"|"groupmax"),
                     "k", "num_latents" (0: d_in · "expansion_factor"), "transcode", "skip_connection",
                     "normalize_decoder", "multi_topk", …
    sae.safetensors  encoder.weight (num_latents, d_in), encoder.bias (num_latents),
                     W_dec (num_latents, d_in), b_dec (d_in), [W_skip (d_in, d_in)]

Their forward (``encode``/``decode``/``forward``, ``fused_encoder``)::

    x̃    = x − b_dec  (SAE)   |   x  (transcode=True)
    acts = TopK_k(relu(x̃ encoder.weightᵀ + encoder.bias))
    out  = acts W_dec + b_dec  (+ x W_skipᵀ with skip_connection)

Ours: ``W_enc = encoder.weightᵀ``, the rest as stored; an SAE is a :class:`SparseAutoencoder`
(``apply_b_dec_to_input=True``, topk), a transcoder a :class:`Transcoder` or, with a skip
connection, a :class:`SkipTranscoder`. An SAE with ``W_skip`` is rejected
(UnsupportedArchitectureError), as is ``activation="groupmax"``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError, UnsupportedArchitectureError
from ..modules.sae import SAEConfig, SparseAutoencoder
from ..modules.transcoder import SkipTranscoder, Transcoder, TranscoderConfig
from .hook_sites import sparsify_hookpoint_site
from .lorsa_format import check_tensor_inventory, load_safetensors, read_json_object, resolve_checkpoint_dir
from .sparse_coder_format import build_module, check_d_model

CFG_FILE = "cfg.json"
WEIGHTS_FILE = "sae.safetensors"

__all__ = ["load_sparsify", "load_sparsify_many", "save_sparsify"]


def load_sparsify(
    directory: str | os.PathLike[str],
    *,
    hookpoint: str | None = None,
    d_model: int | None = None,
    adapter: Any = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    local_files_only: bool = False,
    revision: str | None = None,
) -> SparseAutoencoder | Transcoder:
    """Load one sparsify sparse coder (a hookpoint directory, or a hub repo id + ``hookpoint``).

    Args:
        directory: the hookpoint directory (``cfg.json`` + ``sae.safetensors``), its parent with
            ``hookpoint``, or a hub repo id (with ``hookpoint`` for multi-hookpoint repos).
        hookpoint: the subfolder, e.g. ``"layers.3.mlp"``; default: the directory's own name.
        d_model: the model's width; a different ``d_in`` raises ConfigMismatchError.
        adapter: resolves the hookpoint to our module path (``cfg.extra["sparsify"]["site"]``).

    Raises:
        CheckpointError: missing file/key, missing/unexpected tensor, wrong shape.
        UnsupportedArchitectureError: ``activation`` other than ``"topk"``, or an SAE with ``W_skip``.
        ConfigMismatchError: ``d_model`` given and different from ``d_in``.
    """
    prefix = f"{hookpoint}/" if hookpoint else ""
    local = Path(directory)
    if hookpoint and (isinstance(directory, Path) or local.exists()):
        path = resolve_checkpoint_dir(local / hookpoint, allow_patterns=[])
    else:
        path = resolve_checkpoint_dir(directory, allow_patterns=[prefix + CFG_FILE, prefix + WEIGHTS_FILE],
                                      subfolder=hookpoint, local_files_only=local_files_only, revision=revision)
    cfg_path, weights_path = path / CFG_FILE, path / WEIGHTS_FILE
    raw = read_json_object(cfg_path)
    d_in = raw.get("d_in")
    if not isinstance(d_in, int) or isinstance(d_in, bool) or d_in <= 0:
        raise CheckpointError(f"{cfg_path}: key 'd_in' must be a positive int, got {d_in!r}")
    check_d_model(d_in, d_model, cfg_path, "d_in")
    activation = raw.get("activation", "topk")
    if activation != "topk":
        raise UnsupportedArchitectureError(f"{cfg_path}: key 'activation' is {activation!r}; supported: 'topk'")
    k = raw.get("k")
    if not isinstance(k, int) or isinstance(k, bool) or k <= 0:
        raise CheckpointError(f"{cfg_path}: key 'k' must be a positive int, got {k!r}")
    num_latents = raw.get("num_latents") or d_in * int(raw.get("expansion_factor") or 0)
    if not isinstance(num_latents, int) or num_latents <= 0:
        raise CheckpointError(f"{cfg_path}: keys 'num_latents'/'expansion_factor' give no latent count")
    transcode, skip = bool(raw.get("transcode", False)), bool(raw.get("skip_connection", False))
    if skip and not transcode:
        raise UnsupportedArchitectureError(f"{cfg_path}: key 'skip_connection' on an SAE (transcode=false) "
                                           "has no equivalent module here")
    state = load_safetensors(weights_path)
    expected = {"encoder.weight": (num_latents, d_in), "encoder.bias": (num_latents,),
                "W_dec": (num_latents, d_in), "b_dec": (d_in,)}
    if skip:
        expected["W_skip"] = (d_in, d_in)
    src = f"{cfg_path.name} (d_in={d_in}, num_latents={num_latents}, skip_connection={skip})"
    check_tensor_inventory(weights_path, {n: tuple(t.shape) for n, t in state.items()}, expected, src)
    ours = {"W_enc": state["encoder.weight"].T.contiguous(), "b_enc": state["encoder.bias"],
            "W_dec": state["W_dec"], "b_dec": state["b_dec"]}
    if skip:
        ours["W_skip"] = state["W_skip"]
    name = hookpoint or path.name
    try:
        site = sparsify_hookpoint_site(name, transcode=transcode, adapter=adapter)
    except UnsupportedArchitectureError:
        site = None
    extra = {"sparsify": {
        "hookpoint": name, "transcode": transcode, "skip_connection": skip,
        "config": {key: v for key, v in raw.items() if isinstance(v, (int, float, str, bool)) or v is None},
        "site": None if site is None else {"layer": site.layer, "site": site.site,
                                           "module_path": site.module_path, "io": site.io},
    }}
    dt = dtype or ours["W_enc"].dtype
    if not transcode:
        scfg = SAEConfig(d_in=d_in, d_sae=num_latents, activation="topk", activation_params={"k": k},
                         extra=extra, apply_b_dec_to_input=True,
                         hook=site.module_path if site is not None and site.module_path else name)
        return build_module(lambda: SparseAutoencoder(scfg), ours, weights_path, src, device=device, dtype=dt)
    tcfg = TranscoderConfig(d_in=d_in, d_sae=num_latents, activation="topk", activation_params={"k": k},
                            extra=extra, layer=None if site is None else site.layer)
    cls = SkipTranscoder if skip else Transcoder
    return build_module(lambda: cls(tcfg), ours, weights_path, src, device=device, dtype=dt)


def load_sparsify_many(directory: str | os.PathLike[str], **kwargs: Any) -> dict[str, SparseAutoencoder | Transcoder]:
    """Every hookpoint subfolder (with a ``cfg.json``) of a local sparsify run directory, by name."""
    root = Path(directory)
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a directory")
    names = sorted((p.name for p in root.iterdir() if (p / CFG_FILE).is_file()),
                   key=lambda s: [int(t) if t.isdigit() else t for t in s.split(".")])
    if not names:
        raise CheckpointError(f"{root}: no hookpoint folders with {CFG_FILE}")
    return {name: load_sparsify(root, hookpoint=name, **kwargs) for name in names}


def save_sparsify(module: SparseAutoencoder | Transcoder, directory: str | os.PathLike[str]) -> Path:
    """Write a TopK SAE / transcoder in sparsify layout (``cfg.json`` + ``sae.safetensors``).

    Raises:
        UnsupportedArchitectureError: not TopK, an SAE without ``b_dec`` centering, or ``d_out != d_in``.
    """
    from safetensors.torch import save_file

    cfg: Any = module.cfg
    transcode = isinstance(module, Transcoder)
    if cfg.activation != "topk" or module.d_out != cfg.d_in or (
            not transcode and not getattr(cfg, "apply_b_dec_to_input", True)):
        raise UnsupportedArchitectureError("sparsify stores TopK coders with d_out = d_in (SAEs centred by b_dec)")
    state = {"encoder.weight": module.W_enc.detach().T, "encoder.bias": module.b_enc.detach(),
             "W_dec": module.W_dec.detach(), "b_dec": module.b_dec.detach()}
    skip = isinstance(module, SkipTranscoder)
    if skip:
        state["W_skip"] = module.state_dict()["W_skip"]
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to("cpu").contiguous() for k, v in state.items()}, str(path / WEIGHTS_FILE))
    doc = {"activation": "topk", "expansion_factor": 32, "normalize_decoder": True, "num_latents": cfg.d_sae,
           "k": cfg.activation_params["k"], "multi_topk": False, "skip_connection": skip, "transcode": transcode,
           "d_in": cfg.d_in}
    (path / CFG_FILE).write_text(json.dumps(doc), encoding="utf-8")
    return path
