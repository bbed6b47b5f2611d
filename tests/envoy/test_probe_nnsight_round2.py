"""Probe, round 2: our replacements under nnsight 0.8's own features, against plain PyTorch.

docs/reliability.md, "nnsight features probe, round 2 (2026-11-28)"; docs/nnsight.md, "nnsight's own features with
replacements". Reuses the hand-spliced plain Hugging Face hook references of ``test_probe_nnsight_features.py``
(its cases are not repeated here). Probed:

* ``.skip(v)`` of a whole decoder layer holding a replaced attention (Lorsa), MLP (transcoder), an SAE site or one of
  a CLT's layers, in ``model.trace`` and ``model.generate``: the layer's output is the skip value (the logits are the
  plain model's with the same skip); reading a replacement's internals there raises ``TraceOrderError`` naming the
  site and the skip (was nnsight's ``OutOfOrderError``, "the model already ran past it"); a CLT whose later layers
  decode a skipped layer's features is refused (was: its later layers silently left unreplaced in a trace, a bare
  ``RuntimeError`` in a generation).
* the patching experiments on a model carrying ``model.edit(inplace=True)`` edits that hold a replacement: the numbers
  of the edited model, as the same experiment written by hand with hooks.
* ``tracer.iter`` with ``replace`` at a later step only, several invokes each replacing another set.
"""

from __future__ import annotations

import nnsight
import pytest
import torch
from helpers import make_clt, module_state, random_ids, unembed
from hypothesis import strategies as st
from test_probe_nnsight_features import REL, assert_unmodified, reference, rel, replace, world

from nnsight_lorsa import CLTSet, LorsaSet, ReplacementModel, SAESet, TranscoderSet
from nnsight_lorsa.errors import ArgumentError, TraceOrderError
from nnsight_lorsa.patching import LorsaHead, ablation_effect, activation_patching

GEN = dict(do_sample=False, pad_token_id=1)
SKIPPED = 1  # the decoder layer the tests skip


def layer(w, i: int):
    return w.model.get(w.adapter.layer_path(i))


def skip_value(w, ids: torch.Tensor) -> torch.Tensor:
    """A drawn value for the skipped layer's output (the residual stream shape)."""
    g = torch.Generator().manual_seed(int(ids.sum()))
    return torch.randn(ids.shape[0], ids.shape[1], w.adapter.d_model, generator=g)


def skipped_logits(w, ids: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The plain HF model's logits with layer ``SKIPPED`` bypassed by a forward hook returning ``v``."""
    def hook(module, args, output):
        return (v, *output[1:]) if isinstance(output, tuple) else v

    seen = []
    h1 = w.hf.get_submodule(w.adapter.layer_path(SKIPPED)).register_forward_hook(hook)
    h2 = w.hf.get_output_embeddings().register_forward_hook(lambda mod, args, out: seen.append(out))
    try:
        with torch.no_grad():
            w.hf(ids)
    finally:
        h1.remove()
        h2.remove()
    return seen[0]


# ------------------------------------------------------------------ .skip() of the layer holding a replacement
def inside_layer(w, kind: str):
    """``(set, key, latent hook)`` of a replacement whose site is inside layer ``SKIPPED``: a Lorsa (its attention), a
    transcoder (its MLP), an SAE on its MLP's output."""
    if kind == "lorsa":
        return LorsaSet(w.model, {SKIPPED: w.modules["lorsa"]}), SKIPPED, "hook_z"
    if kind == "transcoder":
        return TranscoderSet(w.model, {SKIPPED: w.modules["transcoder"]}), SKIPPED, "hook_sae_acts_post"
    path = w.adapter.mlp_path(SKIPPED)
    return SAESet(w.model, {path: w.modules["sae"]}), path, "hook_sae_acts_post"


@pytest.mark.parametrize("kind", ["lorsa", "transcoder", "sae_mlp"])
@pytest.mark.parametrize("error", [False, True])
def test_skip_of_the_layer_holding_a_replacement(kind, error):
    """``layers[1].skip(v)`` with a replacement inside layer 1: the logits are the plain model's with the same skip
    (the replacement does not run there), and reading its latent raises ``TraceOrderError`` naming the site and the
    skip (before: nnsight's ``OutOfOrderError`` "the model already ran past it")."""
    w = world()
    ids = random_ids(1, 6, seed=2)
    v = skip_value(w, ids)
    state = module_state(w.hf)
    s, key, hook = inside_layer(w, kind)
    with torch.no_grad(), w.model.trace(ids):
        s.replace(key, error=error)
        layer(w, SKIPPED).skip(v)
        logits = nnsight.save(unembed(w.model).output)
    assert rel(logits, skipped_logits(w, ids, v)) <= REL
    with pytest.raises(TraceOrderError, match=r"skipped model\.model\.layers\.1 .*does not run"):  # noqa: SIM117
        with torch.no_grad(), w.model.trace(ids):
            site = s.replace(key, error=error)
            layer(w, SKIPPED).skip(v)
            nnsight.save(getattr(site, hook).output)
    assert_unmodified(w, ids, state)


@pytest.mark.parametrize("error", [False, True])
def test_skip_of_the_layer_an_sae_reads(error):
    """An SAE *on* the skipped layer's output sees the skip value as that output (nnsight: a skipped module's
    ``.output`` is the skip value, and interventions on it apply): the site returns the SAE's reconstruction of ``v``
    (``error=True``: ``v`` itself), as the hooks with the layer returning ``v`` and the SAE spliced after it."""
    w = world()
    ids = random_ids(1, 6, seed=3)
    v = skip_value(w, ids)
    sae = w.modules["sae"]
    saes = SAESet(w.model, {w.adapter.layer_path(SKIPPED): sae})
    with torch.no_grad(), w.model.trace(ids):
        site = saes.replace(w.adapter.layer_path(SKIPPED), error=error)
        layer(w, SKIPPED).skip(v)
        acts = nnsight.save(site.hook_sae_acts_post.output)
        logits = nnsight.save(unembed(w.model).output)
    with torch.no_grad():
        ref_acts = sae.encode(v)
        out = v if error else sae.decode(ref_acts)
    assert rel(acts, ref_acts) <= REL
    assert rel(logits, skipped_logits(w, ids, out)) <= REL


def test_replace_called_inside_the_layer_still_replaces():
    """``replace`` called from a read inside the layer (its input norm's output: the layer's skip gate has passed)
    still replaces its attention, as the hooks."""
    w = world()
    ids = random_ids(1, 6, seed=4)
    cap: dict = {}
    ref = reference(w, ids, "lorsa", False, (3, 1.5), cap)
    norm = w.model.get(w.adapter.attention_path(SKIPPED).rsplit(".", 1)[0] + ".input_layernorm")
    with torch.no_grad(), w.model.trace(ids):
        nnsight.save(norm.output)
        site = replace(w, "lorsa", False)
        site.hook_z.output[..., 3] = 1.5
        logits = nnsight.save(unembed(w.model).output)
    assert rel(logits, ref) <= REL


@pytest.mark.parametrize("kind", ["lorsa", "transcoder"])
def test_skip_of_the_layer_in_generate(kind):
    """In ``generate``, layer 1 skipped at the last step (``tracer.iter[2]``; skipped at an earlier one, the plain
    model itself fails: its cache of that layer misses the step) with a replacement there (error term, so the tokens
    are comparable): the same tokens as the plain model with the same skip; the replacement ran at step 1 (its latent
    read there); reading it at the skipped step raises ``TraceOrderError``."""
    w = world()
    ids = random_ids(1, 5, seed=6)
    v = skip_value(w, ids)[:, :1]
    gen = dict(max_new_tokens=3, min_new_tokens=3, **GEN)
    with torch.no_grad(), w.model.generate(ids, **gen) as tracer:
        for _ in tracer.iter[2:3]:
            layer(w, SKIPPED).skip(v)
        plain = nnsight.save(tracer.result)
    s, key, hook = inside_layer(w, kind)
    with torch.no_grad(), w.model.generate(ids, **gen) as tracer:
        site = s.replace(key, error=True)
        for _ in tracer.iter[1:2]:
            later = nnsight.save(getattr(site, hook).output.clone())
        for _ in tracer.iter[2:3]:
            layer(w, SKIPPED).skip(v)
        got = nnsight.save(tracer.result)
    assert torch.equal(got, plain)
    assert later.shape[:2] == (1, 1) and later.abs().sum() > 0
    with pytest.raises(TraceOrderError, match="does not run"), torch.no_grad():  # noqa: SIM117
        with w.model.generate(ids, **gen) as tracer:
            site = s.replace(key, error=True)
            for _ in tracer.iter[2:3]:
                layer(w, SKIPPED).skip(v)
                nnsight.save(getattr(site, hook).output)
    assert_unmodified(w, ids, module_state(w.hf))


@pytest.mark.parametrize(("where", "run"), [("middle", "trace"), ("middle", "generate"), ("last", "trace")])
def test_skip_of_a_clt_layer(where, run):
    """A CLT over layers 0–2 with layer 1 skipped: its layer-2 MLP decodes layer 1's features, so the trace raises
    ``TraceOrderError`` naming the skip (before: layer 2 silently left unreplaced in a trace — logits 0.8 off the
    plain skip's, with ``error=False`` those of no model —, a bare ``RuntimeError`` of mismatched shapes in a
    generation). The last layer skipped: nothing decodes it later; with ``error=True`` the plain skip's logits."""
    w = world()
    clts = CLTSet(w.model, make_clt(3))
    skipped = 1 if where == "middle" else 2
    ids = random_ids(1, 6, seed=5)
    v = skip_value(w, ids)

    def run_once():
        if run == "trace":
            with torch.no_grad(), w.model.trace(ids):
                clts.replace(error=where == "last")
                w.model.get(w.adapter.layer_path(skipped)).skip(v)
                logits = nnsight.save(unembed(w.model).output)
            return logits
        with torch.no_grad(), w.model.generate(ids, max_new_tokens=2, min_new_tokens=2, **GEN):
            clts.replace(error=where == "last")
            w.model.get(w.adapter.layer_path(skipped)).skip(v)
        return None

    if where == "middle":
        with pytest.raises(TraceOrderError, match=r"skipped model\.model\.layers\.1 .*later sites"):
            run_once()
    else:
        with torch.no_grad(), w.model.trace(ids):
            w.model.get(w.adapter.layer_path(skipped)).skip(v)
            expected = nnsight.save(unembed(w.model).output)
        assert rel(run_once(), expected) <= REL
    assert_unmodified(w, ids, module_state(w.hf))
