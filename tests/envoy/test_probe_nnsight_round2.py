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

import contextlib

import nnsight
import pytest
import torch
from helpers import generated, make_clt, module_state, random_ids, relative, unembed
from hypothesis import strategies as st
from test_probe_nnsight_features import REL, assert_unmodified, reference, replace, world

from nnsight_lorsa import CLTSet, LorsaSet, ReplacementModel, SAESet, TranscoderSet
from nnsight_lorsa.analysis import collect_top_activations
from nnsight_lorsa.errors import ArgumentError, TraceOrderError
from nnsight_lorsa.patching import LorsaHead, ablation_effect, activation_patching, path_patching

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
    assert relative(logits, skipped_logits(w, ids, v)) <= REL
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
    assert relative(acts, ref_acts) <= REL
    assert relative(logits, skipped_logits(w, ids, out)) <= REL


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
    assert relative(logits, ref) <= REL


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
        assert relative(run_once(), expected) <= REL
    assert_unmodified(w, ids, module_state(w.hf))


# ------------------------------------------------------------------ experiments on a model with stored edits
def metric(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1, 3] - logits[:, -1, 5]


def mrel(a: torch.Tensor, b: torch.Tensor) -> float:
    """A metric's gap relative to the logits' scale (1 on the tiny model), not to the metric itself: a difference of
    two logits can be ~1e-3 (seen: 0.0039, 7e-8 apart in fp32)."""
    return float((a.double() - b.double()).abs().max() / max(float(b.abs().max()), 1.0))


@torch.no_grad()
def lorsa_hooked(w, ids: torch.Tensor, zeroed: tuple[int, ...], patched: dict | None = None,
                 capture: dict | None = None) -> torch.Tensor:
    """The plain HF model's logits with layer 1's Lorsa spliced by a forward hook with its error term
    (``true + (edited − clean)``), heads ``zeroed`` set to 0 and heads ``patched`` ``{head: (pos, values)}`` set;
    ``capture["z"]``: the edited z."""
    a, m = w.adapter, w.modules["lorsa"]

    def hook(module, args, kwargs, output):
        x = a.attention_input(args, kwargs)
        z = m.activation(m.compute_z_pre(x, a.attention_positions(args, kwargs, x), a.attention_mask(args, kwargs)))[0]
        edited = z.clone()
        edited[..., list(zeroed)] = 0
        for head, values in (patched or {}).items():
            edited[..., head] = values
        if capture is not None:
            capture["z"] = edited
        return a.with_attention_output(output, a.attention_output(output) + (m.decode(edited) - m.decode(z)))

    handle = w.hf.get_submodule(w.paths["lorsa"]).register_forward_hook(hook, with_kwargs=True)
    seen = []
    head = w.hf.get_output_embeddings().register_forward_hook(lambda mod, args, out: seen.append(out))
    try:
        w.hf(ids)
    finally:
        handle.remove()
        head.remove()
    return seen[0]


@contextlib.contextmanager
def frozen_attention(w, ids: torch.Tensor, zeroed: tuple[int, ...]):
    """Forward hooks holding the attention of every layer after 1 at its output in the hooked clean run."""
    outs: dict = {}
    paths = [w.adapter.attention_path(i) for i in range(2, w.adapter.n_layers)]
    grab = [w.hf.get_submodule(p).register_forward_hook(
        lambda mod, args, out, p=p: outs.__setitem__(p, out)) for p in paths]
    try:
        lorsa_hooked(w, ids, zeroed)
    finally:
        for h in grab:
            h.remove()
    hold = [w.hf.get_submodule(p).register_forward_hook(lambda mod, args, out, p=p: outs[p]) for p in paths]
    try:
        yield
    finally:
        for h in hold:
            h.remove()


def active_heads(w, ids: torch.Tensor) -> list[int]:
    cap: dict = {}
    lorsa_hooked(w, ids, (), capture=cap)
    return cap["z"][0].abs().sum(0).argsort(descending=True).tolist()


@generated(2, 60, inplace=st.booleans(), seed=st.integers(0, 10_000), length=st.integers(3, 9),
           pick=st.integers(0, 5))
def test_experiments_on_a_model_with_stored_edits(inplace, seed, length, pick):
    """``ablation_effect`` and ``activation_patching`` on a model carrying a ``model.edit()`` (a copy, or
    ``inplace=True``) that splices layer 1's Lorsa with its error term and zeroes one of its heads: every pass of the
    experiment is the edited model (nnsight replays the edit in each trace and invoke), so the numbers are those of
    the same experiment written by hand with hooks on the edited model — the stored head ablated in the baseline, the
    clean and the corrupt runs alike; ablating or patching the stored head itself changes nothing."""
    w = world()
    ids, corrupt = random_ids(1, length, seed=seed), random_ids(1, length, seed=seed + 1)
    heads = active_heads(w, ids)
    stored, other = heads[pick], heads[pick + 1]
    if inplace:
        with w.model.edit(inplace=True):
            w.sets["lorsa"].replace(1, error=True).hook_z.output[..., stored] = 0
        edited = w.model
    else:
        with w.model.edit() as (_, edited):
            w.sets["lorsa"].replace(1, error=True).hook_z.output[..., stored] = 0
    rm = ReplacementModel(edited, lorsas=LorsaSet(edited, {1: w.modules["lorsa"]}))
    try:
        base = metric(lorsa_hooked(w, ids, (stored,)))
        for target, zeroed in ((other, (stored, other)), (stored, (stored,))):
            r = ablation_effect(rm, ids, [LorsaHead(1, target)], metric=metric)
            assert mrel(r.baseline, base) <= REL
            assert mrel(r.ablated, metric(lorsa_hooked(w, ids, zeroed))) <= REL
        cap: dict = {}
        clean = metric(lorsa_hooked(w, ids, (stored,), capture=cap))
        r = activation_patching(rm, ids, corrupt, [[LorsaHead(1, other)], [LorsaHead(1, stored)]], metric=metric)
        expected = [metric(lorsa_hooked(w, corrupt, (stored,), {other: cap["z"][..., other]})),
                    metric(lorsa_hooked(w, corrupt, (stored,)))]
        assert mrel(r.clean, clean) <= REL and mrel(r.corrupt, expected[1]) <= REL
        assert mrel(r.patched, torch.stack(expected)) <= REL
        # path patching, the sender's value from the corrupt run: without freezing = activation patching the other
        # way round; frozen, the later attention (layer 2) keeps its clean output
        cap_c: dict = {}
        lorsa_hooked(w, corrupt, (stored,), capture=cap_c)
        senders = [[LorsaHead(1, other)], [LorsaHead(1, stored)]]
        loose = path_patching(rm, ids, senders, corrupt=corrupt, metric=metric, freeze=False)
        frozen = path_patching(rm, ids, senders, corrupt=corrupt, metric=metric)
        after = frozen_attention(w, ids, (stored,))
        expected = [metric(lorsa_hooked(w, ids, (stored,), {other: cap_c["z"][..., other]})),
                    metric(lorsa_hooked(w, ids, (stored,)))]
        assert mrel(loose.patched, torch.stack(expected)) <= REL
        with after:
            expected_frozen = metric(lorsa_hooked(w, ids, (stored,), {other: cap_c["z"][..., other]}))
        assert mrel(frozen.patched[0], expected_frozen) <= REL and mrel(frozen.patched[1], expected[1]) <= REL
    finally:
        edited.clear_edits()
    assert_unmodified(w, ids, module_state(w.hf))


def test_experiment_splicing_against_a_stored_splice_is_refused():
    """A stored edit splicing the Lorsa *without* an error term, and an experiment that splices it with one: the
    site is spliced once per trace, so the experiment raises ``ArgumentError`` naming the site and the stored flag
    (no number of a mix)."""
    w = world()
    ids = random_ids(1, 6, seed=1)
    rm = ReplacementModel(w.model, lorsas=w.sets["lorsa"])
    with w.model.edit(inplace=True):
        w.sets["lorsa"].replace(1, error=False)
    try:
        with pytest.raises(ArgumentError, match=r"already replaced in this trace \(error=False\)"):
            ablation_effect(rm, ids, [LorsaHead(1, 0)], metric=metric)
    finally:
        w.model.clear_edits()
    assert_unmodified(w, ids, module_state(w.hf))


def test_top_activations_of_a_model_with_stored_edits():
    """``collect_top_activations`` on a model whose stored edit splices the Lorsa with its error term and zeroes its
    most active head: that head's top activations are 0, one per window (the edited model's z); every other head's
    are the unedited run's, bit for bit (the head is in the layer's output only, not its inputs)."""
    w = world()
    rm = ReplacementModel(w.model, lorsas=w.sets["lorsa"])
    toks = random_ids(4, 8, seed=3)
    before = collect_top_activations(rm, 1, toks, skip_start=0)
    head = int(before.values[:, 0].argmax())
    with w.model.edit(inplace=True):
        w.sets["lorsa"].replace(1, error=True).hook_z.output[..., head] = 0
    try:
        after = collect_top_activations(rm, 1, toks, skip_start=0)
    finally:
        w.model.clear_edits()
    keep = torch.arange(before.values.shape[0]) != head
    seen = after.values[head][torch.isfinite(after.values[head])]
    assert float(before.values[head, 0]) > 0 and len(seen) and not seen.any()
    assert torch.equal(after.values[keep], before.values[keep])


# ------------------------------------------------------------------ remote with stored edits
REMOTE_CLIENT = r'''
import json, torch, nnsight
from loopback import LoopbackServer, build_model, loopback
from helpers import make_lorsa, random_ids
from nnsight_lorsa import LorsaSet, ReplacementModel, get_adapter
from nnsight_lorsa.patching import LorsaHead, ablate
from nnsight_lorsa.remote import for_remote, register
server = LoopbackServer(family="llama")
loopback(server)
model, hf = build_model(family="llama")
adapter = get_adapter(model)
lorsas = LorsaSet(model, {1: make_lorsa(hf, adapter, layer=1, seed=1)})
register()
ids = random_ids(1, 6, 3)
with model.trace(ids):
    z = nnsight.save(lorsas.replace(1).hook_z.output)
    plain = nnsight.save(model.lm_head.output)
head = int(z[0].sum(0).argmax())   # an active head: its ablation moves the logits
out = {}
for inplace in (False, True):
    for error in (False, True):
        r = for_remote(ReplacementModel(model, lorsas=lorsas, error=error))
        if inplace:
            with model.edit(inplace=True):
                r.prepare([LorsaHead(1, head)])
                ablate(r(LorsaHead(1, head)))
            m = model
        else:
            with model.edit() as (_, m):
                r.prepare([LorsaHead(1, head)])
                ablate(r(LorsaHead(1, head)))
        with m.trace(ids):
            local = nnsight.save(m.lm_head.output)
        with m.trace(ids, remote=True):
            remote = nnsight.save(m.lm_head.output)
        with m.trace(ids, remote=True):    # the body's replace returns the stored splice, its head read there
            zr = nnsight.save(r.lorsas.replace(1, error=error).hook_z.output[..., head])
        m.clear_edits()
        out[f"{inplace}-{error}"] = {"equal": torch.equal(local, remote), "moved": float((local - plain).abs().max()),
                                     "z": float(zr.abs().max())}
server.close()
print(json.dumps(out))
'''


@pytest.mark.slow
def test_remote_trace_of_a_model_with_stored_edits():
    """``model.edit()`` (a copy and ``inplace=True``) holding a Lorsa splice (``error`` both) and an ablation of its
    most active head, traced with ``remote=True`` through the loopback server: the logits equal the local run's bit
    for bit, the edit moved them, and the stored ablation is seen by a body that replaces again (its z is 0). Found:
    the first version of the ``.skip`` gate compared with a copy of nnsight's sentinel shipped by value, so every
    remote splice looked skipped (``TraceOrderError``)."""
    from loopback import run_client

    out = run_client(REMOTE_CLIENT, timeout=400)
    assert set(out) == {"False-False", "False-True", "True-False", "True-True"}
    for case, r in out.items():
        assert r["equal"] and r["moved"] > 0 and r["z"] == 0, (case, r)


# ------------------------------------------------------------------ generation loops, invokes, sessions
def test_replace_first_called_at_a_later_step_is_refused():
    """``replace`` first called inside ``tracer.iter[1:]`` cannot leave out the earlier steps (the Lorsa's keys and
    values of the prompt): ``TraceOrderError`` naming the fix."""
    w = world()
    ids = random_ids(1, 5, seed=1)
    with pytest.raises(TraceOrderError, match="later generation step"), torch.no_grad():  # noqa: SIM117
        with w.model.generate(ids, max_new_tokens=3, min_new_tokens=3, **GEN) as tracer:
            for _ in tracer.iter[1:]:
                replace(w, "lorsa", False)
    assert_unmodified(w, ids, module_state(w.hf))


@pytest.mark.filterwarnings("ignore:.*the loop asked for a step")  # an open loop's end
@pytest.mark.parametrize("kind", ["lorsa", "transcoder"])
def test_replace_and_edit_in_every_step(kind):
    """``replace`` and a latent edit inside ``tracer.all()`` (called again at every step: the same splice): each step's
    last logits = a loop of hooked forwards with the edit."""
    w = world()
    ids = random_ids(1, 5, seed=2)
    unit = 3
    with torch.no_grad(), w.model.generate(ids, max_new_tokens=3, min_new_tokens=3, **GEN) as tracer:
        steps = nnsight.save([])  # (code after an open tracer.all() loop does not run: nnsight's rule)
        for _ in tracer.all():
            site = replace(w, kind, False)
            getattr(site, "hook_z" if kind == "lorsa" else "hook_sae_acts_post").output[..., unit] = 2.0
            steps.append(unembed(w.model).output[:, -1])
    seq = ids
    assert len(steps) == 3
    for got in steps:
        ref = reference(w, seq, kind, False, (unit, 2.0))[:, -1]
        assert relative(got, ref) <= REL
        seq = torch.cat([seq, ref.argmax(-1, keepdim=True)], 1)


@pytest.mark.parametrize("error", [False, True])
def test_invokes_replacing_different_sets(error):
    """Three invokes of one trace: the first replaces the Lorsa, the second the transcoder, the third both: each row
    = the hooks with its own set (the third: both hooks), none leaking into another."""
    w = world()
    ids = random_ids(3, 6, seed=3)
    with torch.no_grad(), w.model.trace() as tracer:
        with tracer.invoke(ids[:1]):
            replace(w, "lorsa", error).hook_z.output[..., 1] = 1.0
            a = nnsight.save(unembed(w.model).output)
        with tracer.invoke(ids[1:2]):
            replace(w, "transcoder", error)
            b = nnsight.save(unembed(w.model).output)
        with tracer.invoke(ids[2:]):
            replace(w, "lorsa", error).hook_z.output[..., 1] = 1.0
            replace(w, "transcoder", error)
            c = nnsight.save(unembed(w.model).output)
    assert relative(a, reference(w, ids[:1], "lorsa", error, (1, 1.0))) <= REL
    assert relative(b, reference(w, ids[1:2], "transcoder", error)) <= REL
    mlp = w.hf.get_submodule(w.paths["transcoder"])
    handle = mlp.register_forward_hook(transcoder_hook(w, error), with_kwargs=True)
    try:
        both = reference(w, ids[2:], "lorsa", error, (1, 1.0))
    finally:
        handle.remove()
    assert relative(c, both) <= REL


def transcoder_hook(w, error: bool):
    """A forward hook splicing the transcoder into its MLP (``error``: ``true + (out − clean)``, i.e. the true output:
    no edit)."""
    a, m = w.adapter, w.modules["transcoder"]

    @torch.no_grad()
    def hook(module, args, kwargs, output):
        if error:
            return output
        x = a.mlp_input(args, kwargs)
        skip = m.skip(x)
        out = m.decode(m.encode(x)) + (0 if skip is None else skip)
        return (out, *output[1:]) if isinstance(output, tuple) else out

    return hook


def test_edit_inside_a_session():
    """``model.edit(inplace=True)`` holding a replacement, made inside ``model.session()`` between two traces: the
    trace after it runs the edited model (= the hooks), the one before it the plain model; cleared after."""
    w = world()
    ids = random_ids(1, 6, seed=4)
    try:
        with torch.no_grad(), w.model.session():
            with w.model.trace(ids):
                before = nnsight.save(unembed(w.model).output)
            with w.model.edit(inplace=True):
                replace(w, "lorsa", False).hook_z.output[..., 2] = 1.0
            with w.model.trace(ids):
                after = nnsight.save(unembed(w.model).output)
    finally:
        w.model.clear_edits()
    from test_probe_nnsight_features import plain_logits
    assert torch.equal(before, plain_logits(w, ids))
    assert relative(after, reference(w, ids, "lorsa", False, (2, 1.0))) <= REL
    assert_unmodified(w, ids, module_state(w.hf))
