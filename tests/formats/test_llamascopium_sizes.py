"""Llamascopium sizes a dictionary as ``d_sae = int(d_model * expansion_factor)`` (floating point, rounded down:
``SparseDictionaryConfig.d_sae``, ``llamascopium/models/sparse_dictionary.py``), whatever the product's fraction. Our
readers (SAE / transcoder and Lorsa) take the same number: a file whose product is not integral loads with the
peer's size (it was refused), and one whose product falls just below its weights' size is refused by name, as the
peer's own loader would fail on it (it loaded)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from helpers import same_weights
from peer_reference import PEER_FIXTURES

from nnsight_lorsa.errors import CheckpointError
from nnsight_lorsa.formats import load

CASES = {"sae": PEER_FIXTURES / "probe_llamascopium" / "sae_relu_inference",
         "lorsa": PEER_FIXTURES / "llamascopium" / "folded_inference"}


def _with_factor(src: Path, dst: Path, factor: float) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["expansion_factor"] = factor
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _size(module) -> int:  # type: ignore[no-untyped-def]
    return module.cfg.n_ov_heads if hasattr(module.cfg, "n_ov_heads") else module.cfg.d_sae


@pytest.mark.parametrize("kind", sorted(CASES))
def test_the_size_is_the_peers_floor_of_the_product(kind: str, tmp_path: Path) -> None:
    original = load(CASES[kind])
    d_model = json.loads((CASES[kind] / "config.json").read_text())["d_model"]
    n = _size(original)
    fraction = (n + 0.5) / d_model  # product n + 0.5: theirs int() -> n
    assert int(d_model * fraction) == n
    loaded = load(_with_factor(CASES[kind], tmp_path / "half", fraction))
    assert _size(loaded) == n and same_weights(loaded, original)
    below = math.nextafter(n / d_model, 0.0)  # product just below n: theirs int() -> n - 1, the weights hold n
    assert int(d_model * below) == n - 1
    with pytest.raises(CheckpointError):
        load(_with_factor(CASES[kind], tmp_path / "below", below))
