"""Replacements inside ``model.generate``: every generated token is replaced, exactly.

The reference is a loop with no KV cache: at each step ``model.trace(full_sequence)`` with the
same ``replace`` (and the same edit), the next token the argmax of the last position. Generation
must give the same tokens, and its per-step logits must agree to ``REL`` of max |logit| (fp32;
what differs is only the attention's shape — one query against cached keys instead of the whole
square — so the rounding, ~1e-7 observed).
"""

from __future__ import annotations

import nnsight
import pytest
import torch
import transformers
from helpers import make_clt, make_lorsa, make_sae, make_transcoder, random_ids, tiny_nnsight, unembed

from nnsight_lorsa import CLTSet, LorsaSet, SAESet, TranscoderSet, get_adapter
from nnsight_lorsa.errors import TraceOrderError, UnsupportedGenerationError

LAYER = 1
STEPS = 5
HEAD = 7
REL = 1e-5  # per-step logits: max |generate − loop| ≤ REL · max |loop| (fp32)
GEN = {"max_new_tokens": STEPS, "min_new_tokens": STEPS, "do_sample": False, "pad_token_id": 1}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().abs().max() / b.detach().abs().max())


def no_cache_loop(model, ids: torch.Tensor, setup, steps: int = STEPS, mask: torch.Tensor | None = None,
                  positions: torch.Tensor | None = None):
    """Greedy decoding with a full-sequence ``model.trace`` per step: (sequence, [logits of each step]).

    ``positions``: ``(batch, pos + steps)`` position ids to run at (default: counted from the mask)."""
    seq, logits = ids, []
    for _ in range(steps):
        kwargs = {}
        if mask is not None:  # left padding: positions as generate computes them
            pos = (mask.cumsum(-1) - 1).clamp_min(0) if positions is None else positions[:, :seq.shape[1]]
            kwargs = {"attention_mask": mask, "position_ids": pos}
        with model.trace(seq, **kwargs):
            setup()
            last = nnsight.save(unembed(model).output[:, -1])
        logits.append(last)
        seq = torch.cat([seq, last.argmax(-1, keepdim=True)], 1)
        if mask is not None:
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    return seq, logits


def generated(model, inputs, setup, each_step=None, steps: int = STEPS):
    """``model.generate`` with ``setup()`` before the first step and ``each_step(envoys)`` at every step."""
    with model.generate(inputs, **{**GEN, "max_new_tokens": steps, "min_new_tokens": steps}) as tracer:
        envoys = setup()
        logits = nnsight.save([])
        for _ in tracer.iter[:steps]:
            if each_step is not None:
                each_step(envoys)
            logits.append(unembed(model).output[:, -1].clone())
        out = nnsight.save(tracer.result)
    return out, logits


def assert_same(out, logits, seq, ref_logits):
    assert len(logits) == len(ref_logits) == STEPS
    assert torch.equal(out, seq)
    for step, (a, b) in enumerate(zip(logits, ref_logits, strict=True)):
        assert rel_err(a, b) <= REL, f"step {step}: {rel_err(a, b):.2e}"


def lorsa_set(family: str, attn: str = "eager"):
    model, hf = tiny_nnsight(family, attn=attn)
    adapter = get_adapter(model)
    return model, hf, LorsaSet(model, {LAYER: make_lorsa(hf, adapter, LAYER)})


@pytest.mark.parametrize(("family", "attn"), [("llama", "eager"), ("llama", "sdpa"), ("qwen3", "eager"),
                                              ("neox", "eager"), ("gpt2", "sdpa"),
                                              ("olmo2", "eager"), ("olmo2", "sdpa"), ("phi3", "eager"),
                                              ("phi3", "sdpa"), ("gemma", "eager"), ("gemma", "sdpa")])
def test_lorsa_generate_matches_no_cache_loop(family, attn):
    model, hf, lorsa = lorsa_set(family, attn)
    ids = random_ids(2, 6)
    setup = lambda: lorsa.replace(layer=LAYER)  # noqa: E731
    seq, ref = no_cache_loop(model, ids, setup)
    out, logits = generated(model, ids, setup)
    assert_same(out, logits, seq, ref)
    # the Lorsa changes the output (the test would pass trivially otherwise) …
    plain, _ = generated(model, ids, lambda: None)
    assert not torch.equal(plain, out)
    # … and nothing survives the trace
    assert "lorsa" not in dict(lorsa.adapter.attention_module(hf, LAYER).named_children())


def test_lorsa_generate_left_padded_batch():
    """The reference runs at the positions generate fed the model (recorded): nnsight 0.8.1 supplies
    mask-counted ``position_ids`` for a left-padded batch, and transformers 4.x's ``generate`` then
    repeats the last given position at every later step instead of advancing it (the plain model too,
    no Lorsa involved); transformers 5 advances them."""
    model, hf, lorsa = lorsa_set("llama")
    ids = random_ids(2, 7)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids[1, :3] = 1
    setup = lambda: lorsa.replace(layer=LAYER)  # noqa: E731
    fed: list[torch.Tensor] = []
    hook = hf.model.register_forward_pre_hook(
        lambda module, args, kwargs: fed.append(kwargs["position_ids"].clone()), with_kwargs=True)
    try:
        out, logits = generated(model, {"input_ids": ids, "attention_mask": mask}, setup)
    finally:
        hook.remove()
    assert len(fed) == STEPS and fed[0].shape == ids.shape
    positions = torch.cat(fed, 1)
    full_mask = torch.cat([mask, torch.ones(2, STEPS - 1, dtype=mask.dtype)], 1)
    if not torch.equal(positions, (full_mask.cumsum(-1) - 1).clamp_min(0)):
        assert int(transformers.__version__.split(".")[0]) < 5, positions  # the known transformers-4 behaviour
    seq, ref = no_cache_loop(model, ids, setup, mask=mask, positions=positions)
    assert_same(out, logits, seq, ref)


def test_lorsa_steering_every_step_matches_loop():
    model, _, lorsa = lorsa_set("llama")
    ids = random_ids(2, 6)

    def setup_edit():
        site = lorsa.replace(layer=LAYER)
        site.hook_z.output[..., HEAD] = 0
        site.hook_z.output[..., HEAD + 1] += 2.0

    def edit(site):
        site.hook_z.output[..., HEAD] = 0
        site.hook_z.output[..., HEAD + 1] += 2.0

    seq, ref = no_cache_loop(model, ids, setup_edit)
    out, logits = generated(model, ids, lambda: lorsa.replace(layer=LAYER), each_step=edit)
    assert_same(out, logits, seq, ref)
    unedited, _ = generated(model, ids, lambda: lorsa.replace(layer=LAYER))
    assert not torch.equal(unedited, out)


def test_lorsa_edit_on_keys_and_values_matches_loop():
    """An edit to what later tokens attend to (the keys, the values) is kept in the LorsaKV."""
    model, _, lorsa = lorsa_set("llama")
    ids = random_ids(1, 6)

    def edit(site):
        site.hook_k.output[:, 0] *= 0.5  # (in the order the Lorsa computes them)
        site.hook_v.output[..., HEAD] = 0

    def setup_edit():
        edit(lorsa.replace(layer=LAYER))

    seq, ref = no_cache_loop(model, ids, setup_edit)
    out, logits = generated(model, ids, lambda: lorsa.replace(layer=LAYER), each_step=edit)
    assert_same(out, logits, seq, ref)


def test_lorsa_reads_the_attention_input_as_the_body_set_it_at_every_step():
    """The trace body doubles the attention's input at every step; the Lorsa replacing that attention must read
    the doubled input at every step, not only the first: the splice's worker is moved behind the body's workers
    before each later visit (``serve_last``; round 9b's mutant #56 put it second to last, so from the second step
    on it read the input before the body's edit)."""
    model, _, lorsa = lorsa_set("llama")
    ids = random_ids(2, 6)

    def double(_site=None):
        attn = model.model.layers[LAYER].self_attn
        attn.inputs = ((), {**attn.inputs[1], "hidden_states": 2 * attn.inputs[1]["hidden_states"]})

    def setup_edit():
        lorsa.replace(layer=LAYER)
        double()

    seq, ref = no_cache_loop(model, ids, setup_edit)
    out, logits = generated(model, ids, lambda: lorsa.replace(layer=LAYER), each_step=double)
    assert_same(out, logits, seq, ref)
    undoubled, _ = no_cache_loop(model, ids, lambda: lorsa.replace(layer=LAYER))
    assert not torch.equal(undoubled, seq)  # the doubling shows in the tokens


def test_lorsa_error_term_generates_the_unmodified_model():
    model, _, lorsa = lorsa_set("llama")
    ids = random_ids(2, 6)
    plain, plain_logits = generated(model, ids, lambda: None)
    out, logits = generated(model, ids, lambda: lorsa.replace(layer=LAYER, error=True))
    assert_same(out, logits, plain, plain_logits)


def test_lorsa_error_term_with_steering_matches_loop():
    model, _, lorsa = lorsa_set("llama")
    ids = random_ids(2, 6)

    def edit(site):
        site.hook_z.output[..., HEAD] += 3.0

    seq, ref = no_cache_loop(model, ids, lambda: edit(lorsa.replace(layer=LAYER, error=True)))
    out, logits = generated(model, ids, lambda: lorsa.replace(layer=LAYER, error=True), each_step=edit)
    assert_same(out, logits, seq, ref)


def test_transcoder_generate_matches_no_cache_loop():
    model, _ = tiny_nnsight("llama")
    tcs = TranscoderSet(model, {LAYER: make_transcoder()})
    ids = random_ids(2, 6)
    setup = lambda: tcs.replace(layer=LAYER)  # noqa: E731
    seq, ref = no_cache_loop(model, ids, setup)
    out, logits = generated(model, ids, setup)
    assert_same(out, logits, seq, ref)
    plain, _ = generated(model, ids, lambda: None)
    assert not torch.equal(plain, out)

    def edit(site):
        site.hook_sae_acts_post.output[..., 3] += 5.0

    seq, ref = no_cache_loop(model, ids, lambda: edit(tcs.replace(layer=LAYER)))
    out, logits = generated(model, ids, lambda: tcs.replace(layer=LAYER), each_step=edit)
    assert_same(out, logits, seq, ref)


def test_sae_generate_matches_no_cache_loop():
    model, _ = tiny_nnsight("gpt2")
    path = f"{get_adapter(model).layers_path}.{LAYER}"
    saes = SAESet(model, {path: make_sae()})
    ids = random_ids(2, 6)
    setup = lambda: saes.replace(path)  # noqa: E731
    seq, ref = no_cache_loop(model, ids, setup)
    out, logits = generated(model, ids, setup)
    assert_same(out, logits, seq, ref)
    plain, plain_logits = generated(model, ids, lambda: None)
    assert not torch.equal(plain, out)
    out, logits = generated(model, ids, lambda: saes.replace(path, error=True))
    assert_same(out, logits, plain, plain_logits)


@pytest.mark.parametrize("kwargs", [{"num_beams": 2}, {"num_beams": 2, "num_beam_groups": 2, "diversity_penalty": 1.0},
                                    {"penalty_alpha": 0.6, "top_k": 4}])
def test_lorsa_unsupported_decoding_raises_before_any_token(kwargs):
    model, _, lorsa = lorsa_set("llama")
    ids = random_ids(1, 6)
    reached = []
    with pytest.raises(UnsupportedGenerationError, match="num_beams=1"), model.generate(
            ids, max_new_tokens=3, pad_token_id=1, **kwargs):
        lorsa.replace(layer=LAYER)
        reached.append(nnsight.save(unembed(model).output))
    assert not reached  # raised from replace(), before the model ran


def test_lorsa_beams_from_the_checkpoint_config_raise_before_any_token():
    """num_beams > 1 set only in the model's generation_config (no generate kwarg) is refused by
    replace() itself, before the model runs, like the explicit kwarg; a plain trace ignores it."""
    model, hf, lorsa = lorsa_set("llama")
    hf.generation_config.num_beams = 2
    try:
        reached = []
        with pytest.raises(UnsupportedGenerationError, match="num_beams=2.*beam search"), model.generate(
                random_ids(1, 6), max_new_tokens=3, pad_token_id=1) as tracer:
            lorsa.replace(layer=LAYER)
            reached.append(nnsight.save(unembed(model).output))
            reached.append(nnsight.save(tracer.result))
        assert not reached  # raised from replace(), before the first forward pass
        with model.trace(random_ids(1, 6)):  # generation settings play no part in a trace
            lorsa.replace(layer=LAYER)
            logits = nnsight.save(unembed(model).output)
        assert logits.shape == (1, 6, hf.config.vocab_size)
    finally:
        hf.generation_config.num_beams = 1


def test_replace_at_a_later_iter_step_says_to_call_it_before_the_loop():
    model, _, lorsa = lorsa_set("llama")
    # "iter[1:3] after a read": nnsight drops a worker's step pin at its first value of a later step (the worker is
    # then relaxed, ``iteration = None``); a relaxed worker is not at step 0 (round 9b's mutant #76 read it so, and
    # the refusal then said the model "already ran" the site, not why)
    for steps in ("iter[1:3]", "after step 0", "iter[1:3] after a read"):
        with pytest.raises(TraceOrderError, match="before the loop"), model.generate(random_ids(1, 6), **GEN) as tracer:
            if steps.startswith("iter[1:3]"):
                for _ in tracer.iter[1:3]:
                    if steps.endswith("read"):
                        nnsight.save(model.model.embed_tokens.output)
                    lorsa.replace(layer=LAYER)
            else:
                for step in tracer.iter[:3]:
                    if step == 1:
                        lorsa.replace(layer=LAYER)
                    nnsight.save(unembed(model).output)


def test_replace_inside_iter_from_step_zero_serves_every_step():
    model, _, lorsa = lorsa_set("llama")
    ids = random_ids(2, 6)
    seq, ref = no_cache_loop(model, ids, lambda: lorsa.replace(layer=LAYER))
    with model.generate(ids, **GEN) as tracer:
        logits = nnsight.save([])
        for _ in tracer.iter[:STEPS]:
            lorsa.replace(layer=LAYER)  # the same splice at every step
            logits.append(unembed(model).output[:, -1].clone())
        out = nnsight.save(tracer.result)
    assert_same(out, logits, seq, ref)


def test_cross_layer_transcoder_generate_matches_no_cache_loop():
    model, _ = tiny_nnsight("llama")
    clt = CLTSet(model, make_clt())
    ids = random_ids(2, 6)

    def edit(site):
        site.hook_sae_acts_post[0].output[..., 5] += 4.0

    seq, ref = no_cache_loop(model, ids, lambda: edit(clt.replace()))
    out, logits = generated(model, ids, lambda: clt.replace(), each_step=edit)
    assert_same(out, logits, seq, ref)


def test_lorsa_generate_without_kv_cache_matches_loop():
    """``use_cache=False``: every step is a whole-sequence forward; the Lorsa starts afresh each time."""
    model, _, lorsa = lorsa_set("llama")
    ids = random_ids(2, 6)
    setup = lambda: lorsa.replace(layer=LAYER)  # noqa: E731
    seq, ref = no_cache_loop(model, ids, setup)
    with model.generate(ids, **GEN, use_cache=False) as tracer:
        setup()
        logits = nnsight.save([])
        for _ in tracer.iter[:STEPS]:
            logits.append(unembed(model).output[:, -1].clone())
        out = nnsight.save(tracer.result)
    assert_same(out, logits, seq, ref)


def test_transcoder_under_beam_search_is_allowed():
    """Per-token replacements follow any decoding strategy: beams need no cache of their own."""
    model, _ = tiny_nnsight("llama")
    tcs = TranscoderSet(model, {LAYER: make_transcoder()})
    with model.generate(random_ids(1, 6), max_new_tokens=3, num_beams=2, pad_token_id=1) as tracer:
        tcs.replace(layer=LAYER)
        out = nnsight.save(tracer.result)
    assert out.shape == (1, 9)


@pytest.mark.parametrize(("family", "attn"), [("llama", "eager"), ("llama", "sdpa"), ("gpt2", "sdpa"),
                                              ("gemma2", "eager"), ("qwen3", "sdpa")])
def test_lorsa_generate_with_a_static_cache_matches_no_cache_loop(family, attn):
    """``generate(cache_implementation="static")``: the model's masks span every slot of the preallocated cache, so a
    Lorsa on a full-attention layer (Gemma-2's layer 1 too) was refused at the prompt's forward — ``LorsaError:
    attention mask over 11 keys, expected 0 cached + 7 new positions`` — even with ``error=True`` and no edit. The
    slots past the positions so far are empty: the Lorsa takes the mask over its own keys. A left-padded batch."""
    model, _, lorsa = lorsa_set(family, attn)
    ids = random_ids(2, 7)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids[1, :3] = 1
    setup = lambda: lorsa.replace(layer=LAYER)  # noqa: E731
    static = {**GEN, "cache_implementation": "static"}
    with model.generate({"input_ids": ids, "attention_mask": mask}, **static) as tracer:
        setup()
        logits = nnsight.save([])
        for _ in tracer.iter[:STEPS]:
            logits.append(unembed(model).output[:, -1].clone())
        out = nnsight.save(tracer.result)
    seq, ref = no_cache_loop(model, ids, setup, mask=mask)
    assert_same(out, logits, seq, ref)
    with model.generate({"input_ids": ids, "attention_mask": mask}, **static) as tracer:  # the unmodified model
        plain = nnsight.save(tracer.result)
    with model.generate({"input_ids": ids, "attention_mask": mask}, **static) as tracer:
        lorsa.replace(layer=LAYER, error=True)
        exact = nnsight.save(tracer.result)
    assert torch.equal(exact, plain) and not torch.equal(out, plain)


@pytest.mark.parametrize("error", [False, True])
def test_an_edit_stored_by_model_edit_acts_on_the_prompt_pass_and_with_all_on_every_token(error):
    """``model.edit()`` with a ``replace`` and an edit of its internals, then ``edited.generate``: the replacement is
    spliced at every token, the stored edit — as any stored edit in nnsight, of the model's own modules too — acts
    on the first forward (the prompt's) only; ``for _ in tracer.all():`` around it in the edit block makes it act on
    every token. (docs/nnsight.md said every token for both until 2026-11-29: the edit stopped after the prompt.)"""
    model, _, lorsa = lorsa_set("llama")
    ids = random_ids(1, 6, seed=3)
    n = ids.shape[1]

    def ablated(prompt_only: bool):
        def setup():
            site = lorsa.replace(layer=LAYER, error=error)
            if prompt_only:
                site.hook_z.output[:, :n] = 0
            else:
                site.hook_z.output[:] = 0
        return setup

    with model.edit() as (_, once):
        lorsa.replace(layer=LAYER, error=error).hook_z.output[:] = 0
    with model.edit() as (tracer, every):
        site = lorsa.replace(layer=LAYER, error=error)
        for _ in tracer.all():
            site.hook_z.output[:] = 0
    for edited, prompt_only in ((once, True), (every, False)):
        with edited.generate(ids, **GEN) as tracer:
            logits = nnsight.save([])
            for _ in tracer.iter[:STEPS]:
                logits.append(unembed(edited).output[:, -1].clone())
            out = nnsight.save(tracer.result)
        seq, ref = no_cache_loop(model, ids, ablated(prompt_only))
        assert_same(out, logits, seq, ref)
    # the two readings differ after the prompt's step (the test tells them apart)
    once_ref, every_ref = no_cache_loop(model, ids, ablated(True))[1], no_cache_loop(model, ids, ablated(False))[1]
    assert max(rel_err(a, b) for a, b in zip(once_ref[1:], every_ref[1:], strict=True)) > 100 * REL
