"""The argument checks of 2026-11-29 (``tests/test_argument_values.py``) take every collection a researcher passes —
a set, a range, a tensor or a numpy array of ints where a list is documented — not only lists: each form below runs
and gives what the list gives. Called past the suite's beartype hook (``inspect.unwrap``), which would refuse the
forms the annotations (``Sequence[int]``) do not name, as a researcher's process does not."""

from __future__ import annotations

import inspect

import numpy as np
import torch
from helpers import attribution_setup, rm

from nnsight_lorsa import LorsaSet, patching, remote
from nnsight_lorsa.patching import LorsaHead, mean_activations


def test_every_collection_of_ids_or_keys_is_taken_as_its_list():
    model, _, lorsas, tcs = attribution_setup("llama")
    r = rm(model, lorsas, tcs)
    pool = list(range(3, 40))
    induction_task = inspect.unwrap(patching.induction_task)
    want = induction_task(model.tokenizer, n_prompts=2, seq_len=3, token_pool=pool)
    for form in (torch.tensor(pool), np.array(pool), set(pool), range(3, 40)):
        got = induction_task(model.tokenizer, n_prompts=2, seq_len=3, token_pool=form)
        assert torch.equal(got.clean, want.clean) and torch.equal(got.corrupt, want.corrupt)
    lorsa_set = LorsaSet(model, lorsas)
    subset, for_remote = inspect.unwrap(LorsaSet.subset), inspect.unwrap(remote.for_remote)
    for keys in ({1}, (1,), range(1, 2), torch.tensor([1])):
        assert subset(lorsa_set, keys).keys() == [1]
    for layers in ({1}, range(1, 2)):  # a tensor / array of layers too, but the hook checks the helpers it calls
        assert for_remote(r, layers=layers).lorsas.keys() == [1]
    ids = torch.randint(3, 100, (2, 5), generator=torch.Generator().manual_seed(0))
    want_mean = mean_activations(r, [LorsaHead(1, 0)], ids)[LorsaHead(1, 0)]
    got_mean = inspect.unwrap(mean_activations)(r, [LorsaHead(1, 0)], {"input_ids": ids.numpy()})[LorsaHead(1, 0)]
    torch.testing.assert_close(got_mean, want_mean, rtol=0, atol=0)
