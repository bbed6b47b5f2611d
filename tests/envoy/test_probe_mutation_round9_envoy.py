"""Mutation probe, round 9 (Lorsa sets, reading internals and nnsight internals): tests for the mutants that survived
the area's tests (docs/reliability.md, "Mutation probe, round 9: Lorsa sets, reading internals and nnsight
internals"). Each compares against an independent reference: the documented rule (``generate`` settings a Lorsa can
follow, the padding checks), the unmodified model or a plain torch forward hook."""

from __future__ import annotations

import nnsight
import pytest
import transformers
from helpers import make_lorsa, random_ids, tiny_nnsight, unembed

from nnsight_lorsa import LorsaSet, get_adapter
from nnsight_lorsa.envoy.lorsa_set import check_generation
from nnsight_lorsa.errors import UnsupportedGenerationError

LAYER = 1


@pytest.fixture(scope="module")
def llama():
    model, hf = tiny_nnsight("llama")
    adapter = get_adapter(model)
    return model, hf, LorsaSet(model, {LAYER: make_lorsa(hf, adapter, LAYER)})


# ------------------------------------------------------------------------------------------------- check_generation
@pytest.mark.parametrize("kwargs", [{"num_beams": 1}, {"num_beam_groups": 1}, {"num_beams": 1, "num_beam_groups": 1},
                                    {"penalty_alpha": 0.0}, {"prompt_lookup_num_tokens": 0},
                                    {"assistant_model": None}, {"num_beams": None}])
def test_greedy_settings_spelled_out_are_not_refused(kwargs):
    """``num_beams=1`` / ``num_beam_groups=1`` (one beam, one group) and a zero / unset contrastive or prompt-lookup
    setting are plain greedy or sampled decoding (transformers' meaning of those values): allowed, as the error
    message itself says (``num_beams=1``)."""
    check_generation(kwargs)
    check_generation({}, transformers.GenerationConfig(**{k: v for k, v in kwargs.items() if k != "assistant_model"}))


@pytest.mark.parametrize("kwargs", [{"num_beams": 2}, {"num_beam_groups": 2}, {"penalty_alpha": 0.6},
                                    {"prompt_lookup_num_tokens": 3}])
def test_a_generation_config_given_to_generate_is_read_for_what_the_kwargs_leave_unset(kwargs):
    """``generate(ids, generation_config=GenerationConfig(num_beams=2))``: the config passed to the call counts
    (transformers reads it before the model's own), so the beam search is refused like the keyword itself."""
    given = transformers.GenerationConfig(**kwargs)
    with pytest.raises(UnsupportedGenerationError, match=next(iter(kwargs))):
        check_generation({"generation_config": given}, transformers.GenerationConfig())
    with pytest.raises(UnsupportedGenerationError, match=next(iter(kwargs))):
        check_generation(kwargs, transformers.GenerationConfig())
    # the call's own kwarg wins over its generation_config, which wins over the model's
    check_generation({**{k: 1 if "beam" in k else 0 for k in kwargs}, "generation_config": given})
    check_generation({"generation_config": transformers.GenerationConfig(num_beams=1)},
                     transformers.GenerationConfig(num_beams=2))


def test_generate_with_a_beam_search_generation_config_is_refused_before_any_token(llama):
    """End to end: nnsight hands ``generate``'s ``generation_config`` to the traced call; ``replace`` refuses it
    before the model runs (a Lorsa keeps its own keys and values, which beams would reorder)."""
    model, _, lorsa = llama
    reached = []
    config = transformers.GenerationConfig(num_beams=2, max_new_tokens=3, pad_token_id=1)
    with pytest.raises(UnsupportedGenerationError, match="num_beams=2"), model.generate(
            random_ids(1, 6), generation_config=config):
        lorsa.replace(layer=LAYER)
        reached.append(nnsight.save(unembed(model).output))
    assert not reached
