"""The prompt forms the experiments accept (``patching.interventions.check_prompts``) are the forms nnsight batches:
each accepted form runs through an experiment and gives the same means as its token ids; each refused one is an
``ArgumentError`` before the model runs (nnsight took a number for a text and failed in its batching with a
``TypeError``, and ``None`` as an empty batch)."""

from __future__ import annotations

import pytest
import torch
from helpers import attribution_setup, rm

from nnsight_lorsa.errors import ArgumentError
from nnsight_lorsa.patching import LorsaHead, mean_activations
from nnsight_lorsa.patching.interventions import check_prompts


@pytest.fixture(scope="module")
def setup():
    model, _, lorsas, tcs = attribution_setup("llama")
    ids = torch.randint(3, 100, (2, 5), generator=torch.Generator().manual_seed(0))
    return rm(model, lorsas, tcs), ids


def forms(ids: torch.Tensor) -> dict[str, object]:
    """The same two prompts in every form nnsight batches (one prompt: the first row)."""
    return {
        "2-D tensor": ids,
        "list of id lists": ids.tolist(),
        "list of 1-D tensors": [ids[0], ids[1]],
        "mapping with input_ids": {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
    }


@pytest.mark.parametrize("form", list(forms(torch.zeros(2, 5, dtype=torch.long))))
def test_every_accepted_form_runs_and_means_what_its_ids_mean(setup, form):
    r, ids = setup
    want = mean_activations(r, [LorsaHead(1, 0)], ids)[LorsaHead(1, 0)]
    got = mean_activations(r, [LorsaHead(1, 0)], forms(ids)[form])[LorsaHead(1, 0)]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("one", ["1-D tensor", "list of ints", "text"])
def test_one_prompt_is_accepted_in_each_form(setup, one):
    r, ids = setup
    prompt = {"1-D tensor": ids[0], "list of ints": ids[0].tolist(), "text": "ROMEO: But soft"}[one]
    check_prompts(prompt, "t")
    mean_activations(r, [LorsaHead(1, 0)], prompt)


@pytest.mark.parametrize("bad", [None, 5, 2.5, "", [], [""], [True], torch.tensor([1.0, 2.0]),
                                 torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, 2, 3, dtype=torch.long),
                                 {"input_ids": "x"}, [[1, 2], "a", 3], [torch.zeros(2, 2, dtype=torch.long)]],
                         ids=repr)
def test_what_nnsight_cannot_batch_is_refused_by_name_before_the_model_runs(setup, bad):
    r, _ = setup
    with pytest.raises(ArgumentError, match="mean_activations: prompts must be prompts"):
        mean_activations(r, [LorsaHead(1, 0)], bad)
