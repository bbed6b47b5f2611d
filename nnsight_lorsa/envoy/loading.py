"""Loading a model into nnsight: :func:`load_model`, a local Hugging Face directory (default: the embedded
tinyshakespeare Llama) as a ``TransformersModel``, offline and without touching the process environment.

Offline by argument, not by environment: ``local_files_only=True`` reaches every ``from_pretrained`` the
load makes, so nothing is downloaded and ``os.environ`` (``HF_HUB_OFFLINE`` …) is left as it was:

* the tokenizer: :func:`~.tokens.load_tokenizer` passes it to ``AutoTokenizer`` / ``AutoConfig``;
* the config: loaded here with it, and handed to ``TransformersModel(..., config=...)``;
* the weights: with a ``config``, nnsight 0.8.1 loads the model itself (``AutoModelForCausalLM.from_pretrained``
  with every keyword transformers' ``pipeline()`` does not name, ``local_files_only`` among them) and wraps
  it in the pipeline. Without one it hands the repository to ``pipeline(model=path, model_kwargs=...)``,
  which with transformers 5 fails on ``local_files_only`` ("got multiple values": the pipeline passes its
  own ``local_files_only=False`` to ``AutoConfig`` beside the model kwargs).

The model is the same either way (same class, config, weights, dtype and device; the embedded model's
logits are bit-identical, ``tests/envoy/test_loading.py``).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from .._placement import check_device_arg, check_dtype_arg
from ..errors import CheckpointError, LorsaError, PlacementError

__all__ = ["load_model"]


def load_model(model_dir: str | None = None, *, device: Any = "cpu",  # str | torch.device, checked below
               dtype: Any = torch.float32) -> Any:  # a torch.dtype, checked below (a named error)
    """An nnsight ``TransformersModel`` from a local Hugging Face directory (default: the embedded one).

    ``device``: where the weights go (``"cpu"``, ``"cuda"``, ``"cuda:1"``, or ``"auto"`` to spread a
    large model over the visible GPUs through ``device_map="auto"``); ``dtype``: the weights' dtype.
    Loads offline (``local_files_only=True``): nothing is downloaded, and the process environment is not
    changed. A directory without tokenizer files loads too (:func:`~.tokens.load_tokenizer`): token ids
    then work everywhere, text raises :class:`~nnsight_lorsa.errors.MissingTokenizerError`.

    Raises:
        MissingTokenizerError: tokenizer files that cannot be loaded (the message names the cause).
        CheckpointError: a ``config.json`` transformers cannot load (not JSON, no or an unknown ``model_type``),
            or weights it cannot load (a damaged file, shapes other than the config's); the message names the
            directory and the cause's first line.
        ArgumentError: a ``dtype`` other than ``torch.float16`` / ``bfloat16`` / ``float32`` / ``float64``, or
            a ``device`` that is not one, ``model_dir`` not None, a str or ``os.PathLike`` (checked before anything
            is read).
        PlacementError: a ``device`` this machine lacks (``"cuda"`` without CUDA), or ``"meta"`` (no weights).

    Source: ours (offline loading into nnsight's ``TransformersModel``).
    """
    from nnsight import TransformersModel
    from transformers import AutoConfig

    from ..assets import default_model_dir
    from .tokens import load_tokenizer

    if model_dir is not None:  # a falsy one ("", [], 0) loaded the embedded model instead
        from ..formats.files import check_path

        check_path(model_dir, "load_model", "a model directory")
    path = str(default_model_dir() if model_dir is None else model_dir)
    check_dtype_arg(dtype, f"load_model({path!r})")
    if str(device) != "auto":
        checked = check_device_arg(device, f"load_model({path!r})")
        if checked is not None and checked.type == "meta":
            raise PlacementError(f"load_model({path!r}): device='meta' loads no weights, so the model could not run "
                                 "(a trace fails inside torch); load on 'cpu' or a GPU")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:  # first: a broken config.json is named as such, not as a tokenizer that cannot be loaded
            config = AutoConfig.from_pretrained(path, local_files_only=True)
        except Exception as e:  # transformers raises OSError / ValueError / KeyError … for a bad config
            raise CheckpointError(f"load_model({path!r}): no model config transformers can load (not a model "
                                  f"directory, nor a repo id in the local Hugging Face cache, or a damaged "
                                  f"config.json: {_first_line(e)})") from e
        tokenizer = load_tokenizer(path)  # an ids-only stand-in when the directory has no tokenizer files
        where = {"device_map": "auto"} if str(device) == "auto" else {"device": device}
        try:
            return TransformersModel(path, task="text-generation", tokenizer=tokenizer, dispatch=True, dtype=dtype,
                                     config=config, local_files_only=True, **where)
        except (LorsaError, MemoryError, torch.OutOfMemoryError):
            raise
        except Exception as e:  # a damaged weights file, weights of other shapes than config.json's, …
            raise CheckpointError(f"load_model({path!r}): the model's weights could not be loaded "
                                  f"({_first_line(e)})") from e


def _first_line(e: BaseException) -> str:
    """``Type: first line of the message`` (transformers' and torch's messages run over many lines)."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"
