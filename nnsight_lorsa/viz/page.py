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

from ..errors import CheckpointError

__all__ = ["embed_json", "finite", "static_text"]


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
