"""jaxtyping shape annotations that cost nothing where jaxtyping is absent.

Code that may run on an NDIF server (which has only torch, numpy, einops, transformers and
nnsight) imports ``Float``/``Int``/``Bool`` from here: with jaxtyping installed they are the
real jaxtyping types (checked in the tests through jaxtyping's import hook with beartype);
without it they degrade to plain ``torch.Tensor`` so nothing fails at import or run time.
"""

from __future__ import annotations

from typing import Any

try:  # pragma: no cover - exercised by the remote loopback test
    from jaxtyping import Bool, Float, Int
except ImportError:  # pragma: no cover
    import torch

    class _Shaped:
        def __getitem__(self, _: Any) -> Any:
            return torch.Tensor

    Float = Int = Bool = _Shaped()  # type: ignore[assignment,misc]

__all__ = ["Bool", "Float", "Int"]
