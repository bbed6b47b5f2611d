"""``nnsight_lorsa.patching``: interventions vs plain-PyTorch-hook references, patching, controls."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    N_HEADS,
    N_LAYERS,
    TESTS,
    head_logits,
    hooked,
    make_lorsa,
    make_sae,
    make_transcoder,
    random_ids,
    tiny_nnsight,
    unembed,
)

from nnsight_lorsa import LorsaSet, SAESet, TranscoderSet, get_adapter
from nnsight_lorsa.errors import ConfigMismatchError, LayerOutOfRangeError, ShapeError
from nnsight_lorsa.patching import (
    Feature,
    LorsaHead,
    MHSAHead,
    ReplacementModel,
    TargetIndexError,
    ablate,
    logit_difference,
    mean_activations,
    patch,
    read,
    relative_effect,
    scale,
    steer,
)
from nnsight_lorsa.patching.experiments import (
    ablation_effect,
    activation_patching,
    head_swap,
    random_ablation_control,
)

PROJ = {"llama": "o_proj", "neox": "dense", "gpt2": "c_proj", "gemma2": "o_proj", "gemma3": "o_proj", "olmo2": "o_proj",
        "phi3": "o_proj", "gemma": "o_proj"}


def proj_module(hf, adapter, family, layer):
    return getattr(adapter.attention_module(hf, layer), PROJ[family])


def with_proj_edit(hf, adapter, family, layer, edit):
    """Reference: edit the output projection's input (batch, pos, n_heads*head_dim) with a pre-hook."""
    def pre(module, args):
        return (edit(args[0].clone()), *args[1:])
    return proj_module(hf, adapter, family, layer).register_forward_pre_hook(pre)


@pytest.mark.parametrize("family", ["llama", "neox", "gpt2", "gemma2", "gemma3", "olmo2", "phi3", "gemma"])
@torch.no_grad()
def test_mhsa_interventions_match_hook_reference(family):
    model, hf = tiny_nnsight(family)
    adapter = get_adapter(model)
    r = ReplacementModel(model)
    d = adapter.head_dim
    ids = random_ids()
    delta = torch.randn(d)

    def edit1(x):
        x[:, :, 2 * d:3 * d] = 0
        return x

    def edit2(x):
        x[:, [1, 3], 0:d] *= -2.0
        x[:, :, d:2 * d] += delta
        return x

    h1 = with_proj_edit(hf, adapter, family, 0, edit1)
    h2 = with_proj_edit(hf, adapter, family, 2, edit2)
    want = head_logits(hf, ids)
    h1.remove()
    h2.remove()
    with model.trace(ids):
        ablate(r(MHSAHead(0, 2)))
        scale(r(MHSAHead(2, 0)), -2.0, positions=[1, 3])
        steer(r(MHSAHead(2, 1)), delta)
        logits = unembed(model).output.save()
    assert (logits - want).abs().max() < 1e-5
    assert (logits - head_logits(hf, ids)).abs().max() > 1e-4


@torch.no_grad()
def test_mean_ablation_and_read():
    model, hf = tiny_nnsight("llama")
    adapter = get_adapter(model)
    r = ReplacementModel(model)
    d = adapter.head_dim
    ref_ids, ids = random_ids(batch=4, seed=3), random_ids()
    seen = {}
    h = proj_module(hf, adapter, "llama", 1).register_forward_pre_hook(lambda m, a: seen.update(x=a[0].clone()))
    hf(ref_ids)
    h.remove()
    means = mean_activations(r, [MHSAHead(1, 3)], ref_ids)
    want_mean = seen["x"][..., 3 * d:4 * d].mean((0, 1))
    assert torch.allclose(means[MHSAHead(1, 3)], want_mean, atol=1e-6)

    def edit(x):
        x[:, :, 3 * d:4 * d] = want_mean
        return x

    h = with_proj_edit(hf, adapter, "llama", 1, edit)
    want = hf(ids).logits
    h.remove()
    with model.trace(ids):
        ablate(r(MHSAHead(1, 3)), "mean", means)
        after = read(r(MHSAHead(1, 3)), positions=-1)
        logits = unembed(model).output.save()
    assert (logits - want).abs().max() < 1e-5
    assert torch.allclose(after, want_mean.expand(2, d))


@torch.no_grad()
def test_lorsa_head_interventions_match_hooked_reference():
    model, hf = tiny_nnsight("llama")
    adapter = get_adapter(model)
    lorsa = make_lorsa(hf, adapter)
    lorsas = LorsaSet(model, {1: lorsa})
    r = ReplacementModel(model, lorsas=lorsas, error=False)
    ids = random_ids()

    def edit(z):
        z = z.clone()
        z[:, :, 3] = 0
        z[:, -1, 5] = z[:, -1, 5] * 3.0
        z[:, :, 6] += 0.5
        return z

    with hooked(hf, adapter, {1: lorsa}, edit=edit):
        want = hf(ids).logits
    with model.trace(ids):
        ablate(r(LorsaHead(1, 3)))
        scale(r(LorsaHead(1, 5)), 3.0, positions=-1)
        steer(r(LorsaHead(1, 6)), 0.5)
        logits = unembed(model).output.save()
    assert (logits - want).abs().max() < 1e-5

    # head swap (App. D.4): z[from] -> 0, z[to] <- old z[from], at the last position
    def swap(z):
        z = z.clone()
        z[:, -1, 9] = z[:, -1, 2]
        z[:, -1, 2] = 0
        return z

    with hooked(hf, adapter, {1: lorsa}, edit=swap):
        want = hf(ids).logits
    with hooked(hf, adapter, {1: lorsa}):
        plain = hf(ids).logits
    base, swapped = head_swap(r, 1, from_head=2, to_head=9, prompts=ids)
    assert (swapped - want).abs().max() < 1e-5
    assert (base - plain).abs().max() < 1e-5


@torch.no_grad()
def test_multi_invoke_experiments_replace_in_every_invoke():
    """A splice replaces the rows of the invokes that call it: ``ablation_effect``'s baseline invoke, each of
    ``circuit``'s keep runs, ``circuit_metrics``' baseline and ``activation_patching``'s corrupt baseline go through
    the replacement too (``error=False``: the replacement differs from the model, so a baseline left on the model
    would show)."""
    from nnsight_lorsa.attribution.checks import _delta
    from nnsight_lorsa.patching.circuit import _keep_runs

    model, hf = tiny_nnsight("llama")
    adapter = get_adapter(model)
    lorsa = make_lorsa(hf, adapter)
    r = ReplacementModel(model, lorsas=LorsaSet(model, {1: lorsa}), error=False)
    ids = random_ids()
    with hooked(hf, adapter, {1: lorsa}):
        replaced = hf(ids).logits
    assert (replaced - hf(ids).logits).abs().max() > 1e-3
    res = ablation_effect(r, ids, [LorsaHead(1, 3)], correct_ids=5, incorrect_ids=6)
    assert (res.baseline - logit_difference(replaced, 5, 6)).abs().max() < 1e-5
    heads = [MHSAHead(1, 0), LorsaHead(1, 3), LorsaHead(1, 5)]  # an MHSA head is read inside the Lorsa's layer
    keep = torch.ones(ids.shape[0], len(heads), dtype=torch.bool)
    for out in _keep_runs(r, ids, heads, [keep, keep, keep], "zero", None):
        assert (out - replaced).abs().max() < 1e-5
    # circuit_metrics' single ablations: the baseline (the empty set) through the replacement as well
    base, _ = _delta(r, ids[0], [[], [(LorsaHead(1, 3), -1)]], 5, 6)
    assert abs(float(base) - float(replaced[0, -1, 5] - replaced[0, -1, 6])) < 1e-5
    # activation_patching's clean, corrupt (it ran on the plain model) and patched runs: the same replacement
    res = activation_patching(r, ids, ids, [LorsaHead(1, 3)], correct_ids=5, incorrect_ids=6)
    for got in (res.clean, res.corrupt, res.patched[0]):
        assert (got - logit_difference(replaced, 5, 6)).abs().max() < 1e-5


@torch.no_grad()
def test_feature_interventions_match_hook_reference():
    model, hf = tiny_nnsight("llama")
    adapter = get_adapter(model)
    sae = make_sae()
    tc = make_transcoder(skip=False)
    saes = SAESet(model, {"model.layers.1": sae})
    tcs = TranscoderSet(model, {0: tc})
    r = ReplacementModel(model, saes=saes, transcoders=tcs, error=False)
    ids = random_ids()

    def tc_hook(module, args, kwargs, output):
        acts = tc.encode(adapter.mlp_input(args, kwargs)).clone()
        acts[:, :, 7] = 0
        return adapter.with_mlp_output(output, tc.decode(acts))

    def sae_hook(module, args, output):
        x = output[0] if isinstance(output, tuple) else output
        acts = sae.encode(x).clone()
        acts[:, :, 4] = acts[:, :, 4] + 1.5
        new = sae.decode(acts)
        return (new, *output[1:]) if isinstance(output, tuple) else new

    h1 = adapter.mlp_module(hf, 0).register_forward_hook(tc_hook, with_kwargs=True)
    h2 = hf.get_submodule("model.layers.1").register_forward_hook(sae_hook)
    want = hf(ids).logits
    h1.remove()
    h2.remove()
    with model.trace(ids):
        ablate(r(Feature(0, 7, kind="transcoder")))  # layer 0's MLP runs before layer 1's output
        steer(r(Feature("model.layers.1", 4)), 1.5)
        logits = unembed(model).output.save()
    assert (logits - want).abs().max() < 1e-5
    order = r.sort([Feature("model.layers.1", 4), Feature(0, 7, kind="transcoder"), MHSAHead(1, 0)])
    assert order == [Feature(0, 7, kind="transcoder"), MHSAHead(1, 0), Feature("model.layers.1", 4)]
    # an SAE on a norm output runs where the norm does: before the attention / between attention and MLP
    a = r.adapter
    norms = r.sort([Feature(a.mlp_norm_path(1), 2), MHSAHead(1, 0), Feature(a.attention_norm_path(1), 3),
                    Feature(0, 7, kind="transcoder")])
    assert norms == [Feature(0, 7, kind="transcoder"), Feature(a.attention_norm_path(1), 3), MHSAHead(1, 0),
                     Feature(a.mlp_norm_path(1), 2)]


@torch.no_grad()
def test_interventions_compose_with_invokes():
    """An edit in one invoke changes that invoke's rows only; batches of several rows work."""
    model, hf = tiny_nnsight("llama")
    r = ReplacementModel(model)
    ids = random_ids(batch=3)
    ref = hf(ids).logits
    with model.trace(ids[1:]):
        ablate(r(MHSAHead(1, 0)))
        alone = unembed(model).output.save()
    with model.trace() as tracer:
        with tracer.invoke(ids[:1]):
            first = unembed(model).output.save()
        with tracer.invoke(ids[1:]):
            ablate(r(MHSAHead(1, 0)))
            rest = unembed(model).output.save()
    assert (first - ref[:1]).abs().max() < 1e-5
    assert (rest - alone).abs().max() < 1e-5
    assert (rest - ref[1:]).abs().max() > 1e-4


@torch.no_grad()
def test_self_patching_changes_nothing():
    model, hf = tiny_nnsight("llama")
    adapter = get_adapter(model)
    lorsas = LorsaSet(model, {1: make_lorsa(hf, adapter)})
    r = ReplacementModel(model, lorsas=lorsas)  # error=True: spliced Lorsa reproduces the model
    ids = random_ids()
    heads = [MHSAHead(1, h) for h in range(N_HEADS)]
    lheads = [LorsaHead(1, h) for h in range(0, 64, 16)]
    res = activation_patching(r, ids, ids, [*heads, tuple(heads), tuple(lheads)], correct_ids=5, incorrect_ids=6)
    assert res.patched.shape == (N_HEADS + 2, 2)
    assert (res.patched - res.clean).abs().max() < 1e-5


@torch.no_grad()
def test_patching_clean_into_corrupt_restores_later_positions():
    """Tokens differ at position J only: patching every head of every layer at all other positions
    makes every later position's residual (hence logits) the clean one."""
    model, hf = tiny_nnsight("llama")
    r = ReplacementModel(model)
    clean = random_ids()
    corrupt = clean.clone()
    J = 4
    corrupt[:, J] = (clean[:, J] + 7) % 120 + 2
    others = [p for p in range(clean.shape[1]) if p != J]
    everything = tuple(MHSAHead(layer, h) for layer in range(N_LAYERS) for h in range(N_HEADS))
    clean_logits, corrupt_logits = hf(clean).logits, hf(corrupt).logits

    def metric_at(p):
        return lambda logits: logits[:, p, :5].sum(-1)

    for p in (J + 1, clean.shape[1] - 1):
        res = activation_patching(r, clean, corrupt, [everything, MHSAHead(1, 0)], metric=metric_at(p),
                                  positions=others)
        assert torch.allclose(res.clean, clean_logits[:, p, :5].sum(-1), atol=1e-5)
        assert torch.allclose(res.corrupt, corrupt_logits[:, p, :5].sum(-1), atol=1e-5)
        assert (res.patched[0] - res.clean).abs().max() < 1e-4
        assert (res.corrupt - res.clean).abs().max() > 1e-3
        assert torch.allclose(res.normalized[0], torch.ones(2), atol=1e-2)
    # the last-position metric only: patching everything at the last position alone also restores it
    res = activation_patching(r, clean, corrupt, [everything], metric=metric_at(-1), positions=-1)
    assert (res.patched[0] - res.corrupt).abs().max() > 0  # something moved, but not (in general) all the way


def test_bad_targets_raise_before_the_model_runs():
    model, hf = tiny_nnsight("llama")
    adapter = get_adapter(model)
    lorsas = LorsaSet(model, {1: make_lorsa(hf, adapter)})
    saes = SAESet(model, {"model.layers.1": make_sae()})
    calls = []
    hf.register_forward_pre_hook(lambda m, a: calls.append(1))
    r = ReplacementModel(model, lorsas=lorsas, saes=saes)
    ids = random_ids()
    with pytest.raises(TargetIndexError, match="out of range"):
        r(MHSAHead(1, N_HEADS))
    with pytest.raises(LayerOutOfRangeError):
        r(MHSAHead(N_LAYERS, 0))
    with pytest.raises(TargetIndexError):
        r(LorsaHead(1, lorsas[1].cfg.n_ov_heads))
    with pytest.raises(LayerOutOfRangeError, match="no Lorsa for layer 0"):
        r(LorsaHead(0, 0))
    with pytest.raises(ConfigMismatchError, match="needs a LorsaSet"):
        ReplacementModel(model)(LorsaHead(1, 0))
    with pytest.raises(ConfigMismatchError, match="no SAE at site"):
        r(Feature("model.layers.2", 0))
    with pytest.raises(TargetIndexError):
        r(Feature("model.layers.1", 128))
    with pytest.raises(ConfigMismatchError, match="TranscoderSet"):
        r(Feature(1, 0, kind="transcoder"))
    with pytest.raises(ConfigMismatchError, match="not an intervention target"):
        r.check("model.layers.1")
    with pytest.raises(ShapeError, match="head_dim"):
        r.check_values(MHSAHead(1, 0), torch.zeros(2, 10, adapter.head_dim + 1))
    with pytest.raises(ShapeError, match="scalars"):
        r.check_values(LorsaHead(1, 0), torch.zeros(2, 10, 3))
    with pytest.raises(TargetIndexError):
        activation_patching(r, ids, ids, [MHSAHead(0, 0), MHSAHead(1, 99)], correct_ids=5, incorrect_ids=6)
    with pytest.raises(ShapeError):
        activation_patching(r, ids, ids[:, :5], [MHSAHead(0, 0)], correct_ids=5, incorrect_ids=6)
    with pytest.raises(ConfigMismatchError, match="k=9"):
        random_ablation_control(r, ids, [MHSAHead(0, 0)], 9, correct_ids=5, incorrect_ids=6)
    assert calls == []  # nothing ran
    with pytest.raises(ShapeError), model.trace(ids):  # a bad patch inside a trace: raised by the trace
        patch(r(MHSAHead(1, 0)), torch.zeros(2, 10, 3))
        unembed(model).output.save()


@torch.no_grad()
def test_metrics_and_random_control():
    logits = torch.zeros(2, 3, 8)
    logits[0, -1, 2], logits[1, -1, 4], logits[1, 0, 4] = 3.0, 1.0, 9.0
    assert torch.equal(logit_difference(logits, 2, 4), torch.tensor([3.0, -1.0]))
    assert torch.equal(logit_difference(logits, torch.tensor([2, 4]), torch.tensor([0, 0]), position=0),
                       torch.tensor([0.0, 9.0]))
    assert torch.allclose(relative_effect(torch.tensor(2.0), torch.tensor(0.5)), torch.tensor(0.75))
    model, hf = tiny_nnsight("llama")
    r = ReplacementModel(model)
    ids = random_ids()
    pool = [MHSAHead(layer, h) for layer in range(N_LAYERS) for h in range(N_HEADS)]
    ctl = random_ablation_control(r, ids, pool, 2, n_samples=3, correct_ids=5, incorrect_ids=6)
    assert ctl.samples.shape == (3, 2) and len(ctl.draws) == 3 and all(len(d) == 2 for d in ctl.draws)
    for draw, got in zip(ctl.draws, ctl.samples, strict=True):
        assert torch.allclose(ablation_effect(r, ids, draw, correct_ids=5, incorrect_ids=6).ablated, got, atol=1e-6)
    assert torch.allclose(ctl.baseline, logit_difference(hf(ids).logits, 5, 6), atol=1e-5)


@torch.no_grad()
def test_induction_drops_when_ablating_top_patched_heads():
    """Embedded model: logit(repeated token) − logit(distractor) on a repeated random sequence."""
    from nnsight_lorsa.assets import default_lorsa_dir
    from nnsight_lorsa.envoy import load_model

    model = load_model()
    lorsas = LorsaSet.from_pretrained(model, default_lorsa_dir())
    r = ReplacementModel(model, lorsas=lorsas)
    g = torch.Generator().manual_seed(0)
    B, L, V = 8, 24, model.config.vocab_size
    seq = torch.randint(10, V, (B, L), generator=g)
    bos = torch.zeros(B, 1, dtype=torch.long)
    ids = torch.cat([bos, seq, seq[:, :-1]], 1)  # next token: seq[:, -1] (copied from the first half)
    corrupt = torch.cat([bos, seq, torch.randint(10, V, (B, L - 1), generator=g)], 1)
    correct, distractor = seq[:, -1], torch.randint(10, V, (B,), generator=g)
    heads = [MHSAHead(layer, h) for layer in range(model.config.num_hidden_layers)
             for h in range(model.config.num_attention_heads)]
    res = activation_patching(r, ids, corrupt, heads, correct_ids=correct, incorrect_ids=distractor)
    assert res.clean.mean() > 1.0 > res.corrupt.mean()
    top = [grp[0] for grp in res.top(2)]
    pool = [h for h in heads if h not in top]
    means = mean_activations(r, heads, corrupt)
    ab = ablation_effect(r, ids, top, correct_ids=correct, incorrect_ids=distractor, mode="mean", means=means)
    ctl = random_ablation_control(r, ids, pool, 2, n_samples=6, correct_ids=correct, incorrect_ids=distractor,
                                  mode="mean", means=means)
    assert relative_effect(ab.baseline.mean(), ab.ablated.mean()) > 0.5
    assert ab.ablated.mean() < ctl.samples.mean()
    # Lorsa heads patch too (error term on: an unedited Lorsa leaves the model as is)
    lres = activation_patching(r, ids, ids, [LorsaHead(2, 0), LorsaHead(2, 1023)], correct_ids=correct,
                               incorrect_ids=distractor)
    assert (lres.patched - lres.clean).abs().max() < 1e-4


REMOTE_LOCAL_PATCHING = r"""
import torch, nnsight
import nnsight_lorsa
from helpers import random_ids, tiny_nnsight, unembed
from helpers import make_lorsa
from nnsight_lorsa import LorsaSet, get_adapter
from nnsight_lorsa.patching import LorsaHead, MHSAHead, ReplacementModel, ablate, steer
model, hf = tiny_nnsight("llama")
lorsas = LorsaSet(model, {1: make_lorsa(hf, get_adapter(model), 1)})
r = ReplacementModel(model, lorsas=lorsas)
ids = random_ids()
targets = [MHSAHead(0, 1), LorsaHead(1, 3), LorsaHead(1, 9)]
def run(remote):
    with model.trace(ids, remote=remote):
        r.prepare(targets)
        ablate(r(targets[0]))
        ablate(r(targets[1]), positions=-1)
        steer(r(targets[2]), 0.5)
        logits = nnsight.save(unembed(model).output)
    return logits
local = run(False)
nnsight.register(nnsight_lorsa)
remote = run("local")
assert torch.equal(local, remote), (local - remote).abs().max()
assert not torch.equal(local, hf(ids).logits)  # the interventions did something
print("ok")
"""


def test_interventions_under_nnsight_remote_local_simulation():
    """Ablate / steer MHSA and Lorsa heads in a trace serialized by nnsight (our code by value):
    bit-identical to the local run. Fresh interpreter (the type-checking wrappers are not picklable)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    done = subprocess.run([sys.executable, "-c", REMOTE_LOCAL_PATCHING], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")


@torch.no_grad()
def test_replacement_model_splices_every_set_and_reproduces_the_model():
    """``ReplacementModel.replace()`` splices Lorsas, transcoders and SAEs together in one trace; with
    error terms the logits are the model's (relative bound 1e-5 of max |logit|, fp32), without them they move."""
    model, hf = tiny_nnsight("llama")
    adapter = get_adapter(model)
    rm = ReplacementModel(model, lorsas={1: make_lorsa(hf, adapter, 1)}, transcoders={0: make_transcoder()},
                          saes={"model.layers.2": make_sae()})
    assert isinstance(rm.lorsas, LorsaSet) and isinstance(rm.transcoders, TranscoderSet)
    ids = random_ids()
    want = hf(ids).logits
    with rm.trace(ids):
        sites = rm.replace()
        acts = sites["transcoders"][0].hook_sae_acts_post.output.save()  # read in execution order
        z = sites["lorsas"][1].hook_z.output.save()
        sae_acts = sites["saes"]["model.layers.2"].hook_sae_acts_post.output.save()
        got = unembed(model).output.save()
    assert z.shape[-1] == rm.lorsas[1].cfg.n_ov_heads and acts.shape[-1] == sae_acts.shape[-1] == 128
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    with rm.trace(ids):
        rm.replace(error=False)
        bare = unembed(model).output.save()
    assert (bare - want).abs().max() > 1e-3 * want.abs().max()
    other, _ = tiny_nnsight("llama")
    with pytest.raises(ConfigMismatchError, match="another model"):
        ReplacementModel(model, lorsas=LorsaSet(other, {}))
    with pytest.raises(ConfigMismatchError, match="must be a"):
        ReplacementModel(model, saes=[make_sae()])


@pytest.mark.parametrize("family", ["llama", "gemma2", "olmo2", "phi3", "gemma"])
@torch.no_grad()
def test_site_order_is_the_execution_order(family):
    """The order interventions are run in (``ReplacementModel.order_path``) and path patching's SAE-sender steps
    are the order the model runs a layer's modules in — Gemma-2's post-attention / post-feedforward norms
    included, each right after the output it normalises."""
    from nnsight_lorsa.patching.path_patching import _place

    model, hf = tiny_nnsight(family)
    r = ReplacementModel(model)
    a = r.adapter
    paths = [p for p in (a.attention_norm_path(1), a.attention_path(1), a.attention_post_norm_path(1),
                         a.mlp_norm_path(1), a.mlp_path(1), a.mlp_post_norm_path(1)) if p is not None]
    assert len(paths) == (6 if family == "gemma2" else 4)
    ran: list[str] = []
    handles = [a.get_module(hf, p).register_forward_hook(lambda m, i, o, p=p: ran.append(p)) for p in paths]
    try:
        hf(random_ids())
    finally:
        for h in handles:
            h.remove()
    assert sorted(paths, key=r.order_path) == ran
    steps = [_place(r, Feature(p, 0, kind="sae"))[0] for p in ran]  # as SAE senders (on the modules' outputs)
    assert steps == sorted(steps) and len(set(steps)) == len(steps)


@torch.no_grad()
def test_gemma2_experiments_read_the_models_logits():
    """Gemma-2 soft-caps its logits after the unembedding: an experiment's metric reads the model's logits (capped),
    not the unembedding's output."""
    model, hf = tiny_nnsight("gemma2")
    ids = random_ids()
    got = ablation_effect(ReplacementModel(model), ids, [MHSAHead(1, 0)], correct_ids=5, incorrect_ids=9)
    want = logit_difference(hf(ids).logits, 5, 9)
    uncapped = logit_difference(head_logits(hf, ids), 5, 9)
    torch.testing.assert_close(got.baseline, want.cpu())
    assert (uncapped - want).abs().max() > 1e-3  # the cap bites
