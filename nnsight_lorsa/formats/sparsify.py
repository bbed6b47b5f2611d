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
    acts = TopK_k(relu(x̃ encoder.weightᵀ + encoder.bias))      (activation="topk")
         | GroupMax_k(relu(…))   the max of each of k contiguous groups of num_latents/k ("groupmax")
    out  = acts W_dec + b_dec  (+ x W_skipᵀ with skip_connection)

Ours: ``W_enc = encoder.weightᵀ``, the rest as stored; an SAE is a :class:`SparseAutoencoder`
(``apply_b_dec_to_input=True``), a transcoder a :class:`Transcoder` or, with a skip connection, a
:class:`SkipTranscoder`; the activation is our ``"topk"`` or ``"groupmax"``
(:class:`~nnsight_lorsa.modules.activations.GroupMax`). An SAE with a skip connection (centred
encoder input, skip path on the raw input) is the exact :class:`SkipTranscoder` with
``b_enc ← encoder.bias − b_dec · encoder.weightᵀ`` (``cfg.extra["sparsify"]["transcode"]`` stays
False), folded once in the dtype the module is loaded in.

The hookpoint is the folder's name; a folder ``seed<N>`` inside one (sparsify's ``Trainer`` with several
``init_seeds`` saves ``<hookpoint>/seed<N>/``) is that hookpoint's coder of seed N
(``cfg.extra["sparsify"]["seed"]``).

``multi_topk``: a training option (an extra loss on the top-4k reconstruction). sparsify's
``forward()`` of such a coder returns that top-4k reconstruction (and top-4k latents) as
``sae_out``; its ``encode`` / ``decode`` — what it hooks into a model — use ``k``. We load the
``k`` coder (``cfg.extra["sparsify"]["multi_topk"]`` records the flag); ``module.activation.k = 4 * k``
reproduces ``forward()``'s output (skip path aside: sparsify's 4k ``sae_out`` omits ``W_skip``).

Reader steps (:class:`~.reader.Reader`): :func:`parse_config`, :func:`load_weights`, :func:`build`.
A run directory (one folder per hookpoint) is loaded with ``formats.load_all(run, format="sparsify")``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from .._atomic import atomic_directory
from ..errors import UnsupportedArchitectureError
from ..modules.sae import SAEConfig, SparseAutoencoder
from ..modules.transcoder import SkipTranscoder, Transcoder, TranscoderConfig
from .files import checkpoint_name, load_safetensors, read_json_object
from .hook_sites import site_record
from .reader import Parsed, Reader, read
from .sparse_coder_format import kind_of
from .validate import (
    Field,
    TensorSpec,
    check_d_model,
    check_declared_tensors,
    check_file_tensors,
    config_size,
    read_fields,
    require,
    scaled_size,
)

CFG_FILE = "cfg.json"
WEIGHTS_FILE = "sae.safetensors"

#: ``cfg.json`` fields read (``num_latents`` 0 / absent: ``d_in · expansion_factor``, :func:`.validate.scaled_size`)
FIELDS = (Field("d_in", size=True),
          Field("activation", str, "topk", choices=("topk", "groupmax"), error=UnsupportedArchitectureError),
          Field("k", size=True), Field("transcode", bool, False), Field("skip_connection", bool, False),
          Field("multi_topk", bool, False))
#: ``sae.safetensors`` (their names and layout); ``W_skip`` with ``skip_connection``
TENSORS = TensorSpec({"encoder.weight": ("num_latents", "d_in"), "encoder.bias": ("num_latents",),
                      "W_dec": ("num_latents", "d_in"), "b_dec": ("d_in",)}, {"W_skip": ("d_in", "d_in")})

__all__ = ["FIELDS", "READER", "TENSORS", "build", "load_sparsify", "load_weights", "parse_config", "save_sparsify"]


def parse_config(directory: Path, *, d_model: int | None = None, adapter: Any = None) -> Parsed:
    """``cfg.json`` -> ``Parsed(directory, SAEConfig | TranscoderConfig, settings)``; the hookpoint
    is the directory's name (None at the top of a hub repo: :func:`.files.checkpoint_name`).

    Raises:
        CheckpointError: missing file/key, ``d_in`` / ``k`` / latent count not a positive int.
        UnsupportedArchitectureError: ``activation`` other than ``"topk"`` / ``"groupmax"``.
        ConfigMismatchError: ``d_model`` given and different from ``d_in``.
    """
    cfg_path = directory / CFG_FILE
    raw = read_json_object(cfg_path)
    d_in = read_fields(raw, cfg_path, FIELDS[:1])["d_in"]
    check_d_model(d_in, d_model, cfg_path, "d_in")
    fields = read_fields(raw, cfg_path, FIELDS[1:])
    if raw.get("signed") not in (None, False):  # not a SparseCoderConfig field of sparsify 1.3.3 (it drops it)
        raise UnsupportedArchitectureError(
            f"{cfg_path}: key 'signed' is {raw['signed']!r}: sparsify 1.3.3 has no signed coders (it drops the key "
            "and runs its ReLU TopK); the file comes from another version whose activation we cannot verify")
    activation, k, transcode, skip = fields["activation"], fields["k"], fields["transcode"], fields["skip_connection"]
    if raw.get("num_latents"):  # 0 / absent: d_in · expansion_factor
        num_latents = config_size(raw, "num_latents", cfg_path)
    else:
        num_latents = scaled_size(d_in, raw.get("expansion_factor"), cfg_path, "expansion_factor")
    require(activation != "groupmax" or not num_latents % k, cfg_path,
            f"'groupmax' needs num_latents={num_latents} to be a multiple of k={k}")
    name = checkpoint_name(directory)  # None at the top of a hub snapshot (its name is a commit hash)
    seed = None
    if name is not None and re.fullmatch(r"seed[0-9]+", name) and checkpoint_name(directory.parent):
        # sparsify's Trainer with several init_seeds saves <hookpoint>/seed<N>/ (trainer.py: "{hook}/seed{seed}";
        # its hooks take the part before the slash)
        seed, name = int(name[len("seed"):]), checkpoint_name(directory.parent)
    site = site_record(name, adapter, sparsify_transcode=transcode)
    extra = {"sparsify": {
        "hookpoint": name, "seed": seed, "transcode": transcode, "skip_connection": skip,
        "multi_topk": fields["multi_topk"],
        "config": {key: v for key, v in raw.items() if isinstance(v, (int, float, str, bool)) or v is None},
        "site": site,
    }}
    cfg: SAEConfig | TranscoderConfig
    if not transcode and not skip:
        cfg = SAEConfig(d_in=d_in, d_sae=num_latents, activation=activation, activation_params={"k": k},
                        extra=extra, apply_b_dec_to_input=True, hook=(site or {}).get("module_path") or name)
    else:  # an SAE with a skip connection is a skip transcoder with b_dec folded into b_enc (docstring)
        cfg = TranscoderConfig(d_in=d_in, d_sae=num_latents, activation=activation, activation_params={"k": k},
                               extra=extra, layer=None if site is None else site["layer"])
    return Parsed(directory, cfg, {
        "cls": SkipTranscoder if skip else (Transcoder if transcode else SparseAutoencoder),
        "fold_b_dec": skip and not transcode,
        "source": f"{CFG_FILE} (d_in={d_in}, num_latents={num_latents}, skip_connection={skip})"})


def load_weights(directory: Path, parsed: Parsed) -> dict[str, torch.Tensor]:
    """``sae.safetensors`` checked against the config, in our layout (``W_enc = encoder.weightᵀ``).

    Raises:
        CheckpointError: missing file, missing/unexpected tensor, wrong shape.
    """
    weights_path = directory / WEIGHTS_FILE
    cfg = parsed.config
    d_in, num_latents, skip = cfg.d_in, cfg.d_sae, parsed.settings["cls"] is SkipTranscoder
    state = load_safetensors(weights_path)
    check_file_tensors(weights_path, state)
    check_declared_tensors(weights_path, state, TENSORS, {"d_in": d_in, "num_latents": num_latents},
                           parsed.settings["source"], with_=("W_skip",) if skip else ())
    ours = {"W_enc": state["encoder.weight"].T, "b_enc": state["encoder.bias"],
            "W_dec": state["W_dec"], "b_dec": state["b_dec"]}
    if skip:
        ours["W_skip"] = state["W_skip"]
    return ours


def build(parsed: Parsed, state: dict[str, torch.Tensor], *, device: torch.device | str | None = None,
          dtype: torch.dtype | None = None) -> SparseAutoencoder | Transcoder:
    """Our :class:`SparseAutoencoder` / :class:`Transcoder` / :class:`SkipTranscoder` with ``state``; an SAE with a
    skip connection gets ``b_dec`` folded into ``b_enc`` once in the module's dtype (``b_enc − b_dec W_enc``).

    Raises:
        CheckpointError: non-floating or non-finite tensor.
    """
    module = parsed.build_module(parsed.settings["cls"], state, WEIGHTS_FILE, device=device, dtype=dtype)
    if parsed.settings["fold_b_dec"]:  # x̃ = x − b_dec: (x − b_dec) Wᵀ + b = x Wᵀ + (b − b_dec Wᵀ)
        # from the stored values in fp64, rounded once to the dtype the module runs in (folded in the stored dtype,
        # a bf16 file loaded in fp32 kept a bf16 rounding of the fold: features 0.23 off, other top-k picks)
        with torch.no_grad():
            b_enc = module.b_enc
            folded = state["b_enc"].double() - state["b_dec"].double() @ state["W_enc"].double()
            b_enc.copy_(folded.to(device=b_enc.device, dtype=b_enc.dtype))
    return module  # type: ignore[no-any-return]


READER = Reader("sparsify", (CFG_FILE, WEIGHTS_FILE), parse_config, load_weights, build)


def load_sparsify(directory: str | os.PathLike[str], *, hookpoint: str | None = None,
                  **kwargs: Any) -> SparseAutoencoder | Transcoder:
    """Load one sparsify sparse coder (a hookpoint directory, or a hub repo id + ``hookpoint``).

    Source: sparsify ``sparsify/sparse_coder.py`` (``SparseCoder.save_to_disk``; module docstring).
    Same as ``formats.load(directory, format="sparsify", subfolder=hookpoint)``.

    Args:
        directory: the hookpoint directory (``cfg.json`` + ``sae.safetensors``), its parent with
            ``hookpoint``, or a hub repo id (with ``hookpoint`` for multi-hookpoint repos).
        hookpoint: the subfolder, e.g. ``"layers.3.mlp"``; default: the directory's own name.
        kwargs: ``d_model`` (a different ``d_in`` raises), ``adapter`` (resolves the hookpoint to our
            module path, ``cfg.extra["sparsify"]["site"]``), ``device``, ``dtype``,
            ``local_files_only``, ``revision``.

    Returns:
        The module in eval mode: ``W_enc (d_in, num_latents)``, ``W_dec (num_latents, d_in)``.

    Raises:
        CheckpointError: missing file/key, missing/unexpected tensor, wrong shape, non-finite values.
        UnsupportedArchitectureError: ``activation`` other than ``"topk"``, or an SAE with ``W_skip``.
        ConfigMismatchError: ``d_model`` given and different from ``d_in``.
    """
    return read(READER, directory, subfolder=hookpoint, **kwargs)  # type: ignore[no-any-return]


def save_sparsify(module: SparseAutoencoder | Transcoder, directory: str | os.PathLike[str]) -> Path:
    """Write a TopK SAE / transcoder in sparsify layout (``cfg.json`` + ``sae.safetensors``).

    Raises:
        UnsupportedArchitectureError: not TopK / GroupMax, an SAE without ``b_dec`` centering or with an input
            normalisation (``normalize_activations``: sparsify's ``encode`` has none), or ``d_out != d_in``.
    """
    cfg: Any = module.cfg
    kind = kind_of(module)
    transcode = kind in ("transcoder", "skip_transcoder")
    if cfg.activation not in ("topk", "groupmax") or module.d_out != cfg.d_in or (
            not transcode and not getattr(cfg, "apply_b_dec_to_input", True)):
        raise UnsupportedArchitectureError("sparsify stores TopK / GroupMax coders with d_out = d_in (SAEs centred "
                                           f"by b_dec); got activation {cfg.activation!r}, d_out={module.d_out}")
    norm = getattr(cfg, "normalize_activations", "none")
    if norm != "none":
        raise UnsupportedArchitectureError(
            f"the SAE normalises its input (normalize_activations={norm!r}), which sparsify's coders do not "
            "(sparse_coder.py encode: x − b_dec only): written, it would compute another function there; save it "
            "with format='saelens' or 'nnsight_lorsa'")
    state = {"encoder.weight": module.W_enc.detach().T, "encoder.bias": module.b_enc.detach(),
             "W_dec": module.W_dec.detach(), "b_dec": module.b_dec.detach()}
    skip = kind == "skip_transcoder"
    if skip:
        state["W_skip"] = module.state_dict()["W_skip"]
    doc = {"activation": cfg.activation, "expansion_factor": 32, "normalize_decoder": True, "num_latents": cfg.d_sae,
           "k": cfg.activation_params["k"], "multi_topk": False, "skip_connection": skip, "transcode": transcode,
           "d_in": cfg.d_in}
    text = json.dumps(doc)
    with atomic_directory(directory) as stage:
        stage.save_tensors(WEIGHTS_FILE, {k: v.to("cpu").contiguous() for k, v in state.items()})
        stage.write_text(CFG_FILE, text)
    return Path(directory)
