"""Patching experiments on an fp16 model whose logits overflow (issue 21): the logit difference of inf logits is
NaN (inf − inf), and every experiment returned NaN clean / patched / ablated values with no word. The metric's
values, read on the host anyway, are checked: a NonFiniteError names the metric and says where it comes from.
The same model in bf16 (fp32's range) gives finite values."""

from __future__ import annotations

import pytest
import torch
from helpers import random_ids
from patching.test_patching_devices import LAYER, setup

from nnsight_lorsa.errors import NonFiniteError
from nnsight_lorsa.patching import LorsaHead, MHSAHead
from nnsight_lorsa.patching.experiments import ablation_effect, activation_patching

KW = {"correct_ids": torch.tensor([5, 9]), "incorrect_ids": 6}


def _loud(dtype: torch.dtype):
    model, hf, r = setup("cpu", dtype, torch.float32)
    with torch.no_grad():
        hf.lm_head.weight.mul_(1e5)
        hf.model.norm.weight.mul_(100)
    return model, hf, r


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_experiments_refuse_a_non_finite_metric(dtype):
    _, hf, r = _loud(dtype)
    ids, corrupt = random_ids(), random_ids(seed=5)
    groups = [MHSAHead(0, 0), LorsaHead(LAYER, 3)]
    if dtype == torch.bfloat16:
        res = activation_patching(r, ids, corrupt, groups, **KW)
        ab = ablation_effect(r, ids, [MHSAHead(1, 2)], **KW)
        for t in (res.clean, res.corrupt, res.patched, ab.ablated):
            assert bool(torch.isfinite(t).all())
        return
    with torch.no_grad():
        assert not bool(torch.isfinite(hf(ids).logits).all())  # the fp16 model overflows (not vacuous)
    with pytest.raises(NonFiniteError, match="metric"):
        activation_patching(r, ids, corrupt, groups, **KW)
    with pytest.raises(NonFiniteError, match="metric"):
        ablation_effect(r, ids, [MHSAHead(1, 2)], **KW)
    with pytest.raises(NonFiniteError, match="metric"):  # a metric of the caller's own: the same check
        activation_patching(r, ids, corrupt, groups, metric=lambda logits: logits[:, -1, 5] - logits[:, -1, 6])
