"""Mutation probe, round 11 (docs/reliability.md): rotary embeddings (``modules/rotary.py``), round 10's unrun
mutants and a few more; each test seen failing with the mutant it names and passing without.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nnsight_lorsa.errors import CheckpointError
from nnsight_lorsa.formats import load
from nnsight_lorsa.modules.rotary import RotaryConfig, rotary_cos_sin

LLAMASCOPIUM = Path(__file__).resolve().parent.parent / "fixtures" / "peers" / "llamascopium"


def test_bf16_tables_are_the_peers_stored_cos_and_sin_bit_for_bit():
    """llamascopium's own bf16 file stores its rotary tables (``rotary_cos`` / ``rotary_sin``, bf16, one row per
    position of ``n_ctx``); the loader sets ``table_dtype="bfloat16"`` and ``rotary_cos_sin`` must give both tables
    exactly, in fp32 (mutant R13: ``table_dtype`` rounds the cosine only: the sine stays fp32)."""
    case = LLAMASCOPIUM / "bf16"
    stored = load_file(str(case / "sae_weights.safetensors"))
    module = load(case, dtype=torch.float32)
    rotary = module.cfg.rotary
    assert rotary is not None and rotary.table_dtype == "bfloat16"
    n_ctx = stored["rotary_cos"].shape[0]
    cos, sin = rotary_cos_sin(rotary, torch.arange(n_ctx))
    assert cos.dtype == sin.dtype == torch.float32
    assert torch.equal(cos, stored["rotary_cos"].float())
    assert torch.equal(sin, stored["rotary_sin"].float())
    # the tables are not trivially equal to fp32 ones: the rounding is what is compared
    plain_cos, plain_sin = rotary_cos_sin(type(rotary).from_dict({**rotary.to_dict(), "table_dtype": None}),
                                          torch.arange(n_ctx))
    assert not torch.equal(plain_sin, sin) and not torch.equal(plain_cos, cos)


@pytest.mark.parametrize("name", ["base", "attention_scaling"])
@pytest.mark.parametrize("value", [0.0, -1.0])
def test_a_base_or_attention_scaling_of_zero_is_refused_by_name(name, value):
    """``RotaryConfig``'s documented rule: ``base`` and ``attention_scaling`` are positive finite numbers; 0 is not
    (a base of 0 makes every inverse frequency infinite, a scaling of 0 every cos and sin 0) (mutant E1: ``< 0`` for
    ``<= 0``: a 0 accepted)."""
    with pytest.raises(CheckpointError, match=rf"RotaryConfig\.{name} must be a positive finite number"):
        RotaryConfig(head_dim=8, rotary_dim=8, **{name: value})


@pytest.mark.parametrize("scaling", [0.5, 0.9, 1.25])
def test_attention_scaling_multiplies_cos_and_sin_whether_below_or_above_one(scaling):
    """``attention_scaling`` is the "factor multiplied into cos and sin" (yarn's ``attention_factor``, below 1 for
    an ``mscale`` under ``mscale_all_dim``); plain torch: ``cos(p·f)``, ``sin(p·f)`` with transformers' inverse
    frequencies ``base^(-2i/d)``, times the factor (mutant E2: the product taken only for a factor above 1)."""
    cfg = RotaryConfig(head_dim=8, rotary_dim=8, base=10000.0, attention_scaling=scaling)
    pos = torch.arange(12)
    cos, sin = rotary_cos_sin(cfg, pos)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8))
    emb = torch.cat([pos[:, None].double() * inv_freq] * 2, dim=-1)
    torch.testing.assert_close(cos.double(), emb.cos() * scaling, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin.double(), emb.sin() * scaling, rtol=1e-6, atol=1e-6)


_REQUIRED = {"linear": {"factor": 2.0},
             "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 64.0},
             "yarn": {"factor": 4.0, "original_max_position_embeddings": 64.0}}


@pytest.mark.parametrize(("rope_type", "missing"), [(t, k) for t, ks in _REQUIRED.items() for k in ks])
def test_a_rope_type_without_one_of_its_scaling_parameters_is_refused_naming_it(rope_type, missing):
    """``RotaryConfig``'s documented parameters per rope type (``scaling``: ``factor``; llama3 also
    ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``; yarn ``factor`` and
    ``original_max_position_embeddings``): each one missing is a ``CheckpointError`` naming it when the config is
    made, not a ``KeyError`` at the first forward (mutant E3: llama3's ``original_max_position_embeddings`` not
    required)."""
    full = _REQUIRED[rope_type]
    RotaryConfig(head_dim=8, rotary_dim=8, rope_type=rope_type, scaling=dict(full))  # complete: fine
    scaling = {k: v for k, v in full.items() if k != missing}
    with pytest.raises(CheckpointError, match=rf"rope_type '{rope_type}' needs scaling parameters \['{missing}'\]"):
        RotaryConfig(head_dim=8, rotary_dim=8, rope_type=rope_type, scaling=scaling)


def test_from_dict_copies_scaling_so_the_frozen_config_cannot_change_under_it():
    """``RotaryConfig.from_dict``'s documented rule (``scaling`` copied): the config is frozen, so a later edit of
    the dict it was read from (a JSON config reused for another checkpoint) must not reach its frequencies
    (mutant E4: the caller's ``scaling`` dict kept as it is)."""
    d = RotaryConfig(head_dim=8, rotary_dim=8, rope_type="linear", scaling={"factor": 2.0}).to_dict()
    cfg = RotaryConfig.from_dict(d)
    before = rotary_cos_sin(cfg, torch.arange(6))
    d["scaling"]["factor"] = 8.0
    assert cfg.scaling == {"factor": 2.0}
    after = rotary_cos_sin(cfg, torch.arange(6))
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
