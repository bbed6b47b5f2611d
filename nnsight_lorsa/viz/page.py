"""What every HTML page of :mod:`nnsight_lorsa.viz` shares: inert JSON embedding and the package's scripts.

The pages are self-contained (inline JSON, CSS and script; nothing fetched), so they open offline from
a file. Data goes in as JSON inside ``<script type="application/json">`` (:func:`embed_json`), never as
markup; the viewer scripts are package files under ``nnsight_lorsa/viz/static/`` (:func:`static_text`).
"""

from __future__ import annotations

import json
import math
from importlib import resources
from typing import Any

import torch

from ..errors import ArgumentError, CheckpointError

__all__ = ["embed_json", "finite", "static_text", "token_pieces"]


def embed_json(data: Any) -> str:
    """``data`` as JSON safe inside ``<script type="application/json">``: ``<``, ``>``, ``&`` and the
    JS line separators are written as ``\\uXXXX`` escapes, so no ``</script>`` or ``<!--`` can occur.

    Raises:
        ValueError: NaN / Infinity in ``data`` (not JSON; :func:`finite` replaces them by ``null``).
    """
    s = json.dumps(data, allow_nan=False, ensure_ascii=False)
    for ch, esc in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"),
                    ("\u2029", "\\u2029")):
        s = s.replace(ch, esc)
    return s


def finite(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, ±inf) replaced by None (JSON ``null``, shown as "n/a"),
    through nested dicts, lists and tuples."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def static_text(name: str) -> str:
    """The text of the package file ``nnsight_lorsa/viz/static/<name>`` (e.g. ``"graph.js"``).

    Raises:
        CheckpointError: no such file in the installed package (a broken install: the package data
            ``viz/static/*`` is listed in pyproject.toml).
    """
    try:
        return resources.files("nnsight_lorsa.viz").joinpath("static", name).read_text(encoding="utf-8")
    except (FileNotFoundError, OSError) as e:
        raise CheckpointError(f"nnsight_lorsa/viz/static/{name} is missing from the installed package "
                            f"({e}); reinstall nnsight-lorsa") from None


def token_pieces(tokenizer: Any, ids: Any) -> list[str]:
    """``ids`` ``(n,)`` decoded as one text and cut into one piece per token: ``"".join(pieces)`` is
    ``tokenizer.decode(ids)`` wherever the decoder only appends as tokens are added.

    Byte-level BPE splits a multi-byte UTF-8 character over tokens, and decoding those tokens one by one
    gives ``\ufffd`` for each part; here a token whose decoded prefix ends in an incomplete character gets
    ``""`` and the token that completes it gets the whole character. Where a decoder rewrites earlier
    text as tokens are added (clean-up of spaces), that token falls back to ``tokenizer.decode([id])``.
    Costs ``n`` decodes of up to ``n`` tokens.

    Raises:
        ArgumentError: ``ids`` not a 1-D sequence of ints (a tensor, list or tuple), or holding an id below 0 or
            past the tokenizer's ``len`` (its decode gave ``""`` for it, without a word); ``tokenizer`` without a
            ``decode`` (None: the model was loaded without one).

    Source: ours (labels for tokens that split a character).
    """
    if not callable(getattr(tokenizer, "decode", None)):
        raise ArgumentError(f"token_pieces: tokenizer must be a tokenizer with decode (e.g. model.tokenizer), got a "
                            f"{type(tokenizer).__name__}")
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1 or ids.is_floating_point() or ids.is_complex():
            raise ArgumentError(f"token_pieces: ids must be a 1-D integer tensor, got {ids.dtype} "
                                f"of shape {tuple(ids.shape)}")
        ids = ids.tolist()
    if not isinstance(ids, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ArgumentError(f"token_pieces: ids must be a sequence of ints, got {type(ids).__name__}")
    known = len(tokenizer) if hasattr(tokenizer, "__len__") else None
    outside = [i for i in ids if i < 0 or known is not None and i >= known]
    if outside:  # decoded as "" without a word: a label for a token the tokenizer does not have
        raise ArgumentError(f"token_pieces: ids must be the tokenizer's token ids, in [0, {known}), got "
                            f"{outside[:5]} (another model's tokenizer?)")
    pieces: list[str] = []
    prev = ""
    for k in range(len(ids)):
        text = str(tokenizer.decode(list(ids[:k + 1])))
        if text.endswith("\ufffd") and k + 1 < len(ids) and text.startswith(prev):
            pieces.append("")  # an incomplete character: the next token completes it
        elif text.startswith(prev):
            pieces.append(text[len(prev):])
            prev = text
        else:
            pieces.append(str(tokenizer.decode([ids[k]])))
            prev = text
    return pieces
