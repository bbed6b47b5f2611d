"""Mutation probe, round 10 (docs/reliability.md): rotary embeddings (``modules/rotary.py``): the config's checks,
the frequency scalings and the layouts; each test seen failing with the mutant it names and passing without.
"""

from __future__ import annotations

import pytest
import torch
from helpers import rope_kwargs

from nnsight_lorsa.errors import CheckpointError
from nnsight_lorsa.modules.rotary import RotaryConfig, rotary_inv_freq


@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(8, 3), (8, 7), (6, 5)])
def test_an_odd_rotary_dim_is_refused_by_name(head_dim, rotary_dim):
    """RotaryConfig's documented rule: ``rotary_dim`` even (dimensions rotate in pairs) and in ``(0, head_dim]``
    (mutant R1: the evenness check dropped; an odd one failed later with a shape error, or not at all)."""
    with pytest.raises(CheckpointError, match="rotary_dim must be even"):
        RotaryConfig(head_dim=head_dim, rotary_dim=rotary_dim)
    RotaryConfig(head_dim=head_dim, rotary_dim=rotary_dim - 1)  # the even one below is fine


def _hf_yarn_inv_freq(head_dim: int, base: float, scaling: dict) -> torch.Tensor:
    """transformers' own yarn inverse frequencies (``ROPE_INIT_FUNCTIONS["yarn"]``) for a Llama config."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    heads = 4
    cfg = transformers.LlamaConfig(hidden_size=head_dim * heads, num_attention_heads=heads, num_key_value_heads=heads,
                                   num_hidden_layers=1, vocab_size=16, intermediate_size=8,
                                   max_position_embeddings=8 * int(scaling["original_max_position_embeddings"]),
                                   **rope_kwargs({"rope_type": "yarn", "rope_theta": base, **scaling}))
    inv_freq, _ = ROPE_INIT_FUNCTIONS["yarn"](cfg, torch.device("cpu"))
    return inv_freq.float()


@pytest.mark.parametrize("scaling", [
    {"factor": 4.0, "original_max_position_embeddings": 4096},  # truncate absent: transformers rounds (True)
    {"factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 16.0},
    {"factor": 4.0, "original_max_position_embeddings": 4096, "truncate": 0.0},
    {"factor": 2.0, "original_max_position_embeddings": 1000, "beta_slow": 2.0},
], ids=["default-truncate", "beta-fast", "no-truncate", "beta-slow"])
@pytest.mark.parametrize("base", [500.0, 10000.0])
def test_yarn_inverse_frequencies_are_transformers_own(scaling, base):
    """``rotary_inv_freq`` of a yarn config equals transformers' ``_compute_yarn_parameters`` bit for bit, with
    ``truncate`` absent (its default: the correction range rounded to whole dimensions) and a small base whose
    ``beta_slow`` end passes half the rotary dims (clamped to ``dim - 1``, not ``dim // 2 - 1``) (mutants R8: the
    ``truncate`` default 0; R9: the range clamped at ``dim // 2 - 1``)."""
    head_dim = 16
    ours = rotary_inv_freq(RotaryConfig(head_dim=head_dim, rotary_dim=head_dim, base=base, rope_type="yarn",
                                        scaling=dict(scaling)))
    hf_scaling = {k: (bool(v) if k == "truncate" else float(v)) for k, v in scaling.items()}
    want = _hf_yarn_inv_freq(head_dim, base, hf_scaling)
    assert torch.equal(ours, want), (ours, want)
