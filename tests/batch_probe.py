"""Probe for silent wrong results in batched work: padding, several invokes, generation, batch 1 vs B, patching.

Every case compares against a ground truth computed independently of the splice: the prompt alone (no padding,
batch 1) with the replacement applied by hand through a plain PyTorch forward hook (``module(x)`` on the hooked
activation), the unmodified model (``error=True``), a loop of full-sequence traces without a KV cache
(generation), or a refusal the case expects (``ArgumentError``). Script only (pytest does not collect it); the
fast, generated-case checks of what it found are ``tests/patching/test_patching_padding.py``::

    PYTHONPATH=. python tests/batch_probe.py            # ~15 s (1,163 cases); exit 1 on any wrong case
    PYTHONPATH=. python tests/batch_probe.py --only patching

Outcomes per case: ``correct`` (within the bound), ``named_error`` (an expected ``LorsaError``) or ``wrong``.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import nnsight
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import (  # noqa: E402
    VOCAB,
    make_clt,
    make_lorsa,
    make_sae,
    make_transcoder,
    relative,
    tiny_nnsight,
    unembed,
)

from nnsight_lorsa import CLTSet, LorsaSet, ReplacementModel, SAESet, TranscoderSet, get_adapter  # noqa: E402
from nnsight_lorsa.errors import LorsaError  # noqa: E402

LAYER = 1
REL = 1e-4  # max |row − reference| / max |reference| (fp32; observed ≤ 5e-7)
RECORDS: list[tuple[str, str, str]] = []
#: the families added after this probe (OLMo-2, Phi-3, Gemma-1), each probe runs them too (eager and SDPA);
#: ``--families`` replaces both lists (``--families olmo2 phi3 gemma``: the new ones only)
NEW_FAMILIES = ("olmo2", "phi3", "gemma")
ONLY_FAMILIES: list[str] | None = None


def _runs(first: list[tuple[str, str]], attns: tuple[str, ...] = ("eager", "sdpa")) -> list[tuple[str, str]]:
    """``(family, attn)`` pairs a probe runs: its own list, then the later families in ``attns``."""
    runs = first + [(f, a) for f in NEW_FAMILIES for a in attns]
    return [r for r in runs if ONLY_FAMILIES is None or r[0] in ONLY_FAMILIES]


def record(name: str, ok: bool, detail: str = "", outcome: str = "correct") -> None:
    RECORDS.append((name, outcome if ok else "wrong", detail))
    if not ok:
        print(f"WRONG {name}: {detail}", flush=True)


def expect_refusal(name: str, fn: Callable[[], object]) -> None:
    try:
        fn()
    except LorsaError as e:
        record(name, True, str(e)[:120], "named_error")
        return
    record(name, False, "no error")


def prompts(lengths: list[int], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        p = torch.randint(2, VOCAB, (n,), generator=g)
        p[0] = 0
        out.append(p)
    return out


def pad(ps: list[torch.Tensor], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(len(p) for p in ps)
    ids, mask = torch.ones(len(ps), n, dtype=torch.long), torch.zeros(len(ps), n, dtype=torch.long)
    for i, p in enumerate(ps):
        cols = slice(n - len(p), n) if side == "left" else slice(0, len(p))
        ids[i, cols], mask[i, cols] = p, 1
    return ids, mask


def tokens(t: torch.Tensor, i: int, length: int, side: str) -> torch.Tensor:
    """Row ``i``'s token positions of a padded ``(batch, n, ...)`` tensor."""
    return t[i, t.shape[1] - length:] if side == "left" else t[i, :length]


def by_hand(hf, adapter, kind: str, module) -> Callable[[], object]:
    """A plain forward hook applying ``module`` to the site's input (``kind``: lorsa, tc) or output (sae)."""
    if kind == "lorsa":
        site = adapter.attention_module(hf, LAYER)

        def hook(m, args, kwargs, out):
            y = module(kwargs.get("hidden_states", args[0] if args else None))
            return (y, *out[1:]) if isinstance(out, tuple) else y
        return site.register_forward_hook(hook, with_kwargs=True).remove
    if kind == "tc":
        return adapter.mlp_module(hf, LAYER).register_forward_hook(lambda m, a, out: module(a[0])).remove
    site = hf.get_submodule(adapter.layer_path(LAYER))

    def hook_out(m, a, out):
        y = module(out[0] if isinstance(out, tuple) else out)
        return (y, *out[1:]) if isinstance(out, tuple) else y
    return site.register_forward_hook(hook_out).remove


def spliced(model, adapter, kind: str, module, error: bool):
    """Splice ``module`` (in a trace body); its envoy and the latents' hook."""
    if kind == "lorsa":
        site = LorsaSet(model, {LAYER: module}).replace(LAYER, error=error)
        return site, site.hook_z
    if kind == "tc":
        site = TranscoderSet(model, {LAYER: module}).replace(LAYER, error=error)
    else:
        path = adapter.layer_path(LAYER)
        site = SAESet(model, {path: module}).replace(path, error=error)
    return site, site.hook_sae_acts_post


@torch.no_grad()
def probe_padding() -> None:
    """Row i of a padded batch (right; left, with position ids given or left to nnsight) vs the prompt alone."""
    for family, attn in _runs([("llama", "eager"), ("llama", "sdpa"), ("gpt2", "sdpa"), ("neox", "eager"),
                               ("qwen3", "sdpa")]):
        model, hf = tiny_nnsight(family, attn=attn)
        adapter = get_adapter(model)
        mods = {"lorsa": make_lorsa(hf, adapter, LAYER), "tc": make_transcoder(), "sae": make_sae()}
        ps = prompts([7, 4, 9], seed=3)
        for side, counted in [("right", False), ("left", True), ("left", False)]:
            ids, mask = pad(ps, side)
            kw: dict = {"attention_mask": mask}
            if counted:
                kw["position_ids"] = (mask.cumsum(-1) - 1).clamp_min(0)
            for kind, module in mods.items():
                for error in (False, True):
                    name = f"padding/{family}-{attn}/{side}{'+positions' if counted else ''}/{kind}/error={error}"
                    with model.trace(ids, **kw):
                        _, hook = spliced(model, adapter, kind, module, error)
                        z = hook.output.save()
                        logits = unembed(model).output.save()
                    record(name + "/finite", bool(torch.isfinite(logits).all() and torch.isfinite(z).all()))
                    for i, p in enumerate(ps):  # nnsight counts position ids from a left-padded mask itself
                        undo = (lambda: None) if error else by_hand(hf, adapter, kind, module)
                        try:
                            want = hf(p[None]).logits[0]
                        finally:
                            undo()
                        with model.trace(p[None]):
                            _, hook = spliced(model, adapter, kind, module, error)
                            z_alone = hook.output.save()
                        r = relative(tokens(logits, i, len(p), side), want)
                        rz = relative(tokens(z, i, len(p), side), z_alone[0])
                        record(f"{name}/row{i}", r < REL and rz < REL, f"logits {r:.2e}, latents {rz:.2e}")


@torch.no_grad()
def probe_invokes() -> None:
    """Several invokes in one trace: edits per invoke, prompts of different lengths, an empty invoke."""
    for family, attn in _runs([("llama", "eager"), ("llama", "sdpa"), ("gpt2", "sdpa"), ("neox", "eager")]):
        _invokes(family, attn)


def _invokes(family: str, attn: str) -> None:
    model, hf = tiny_nnsight(family, attn=attn)
    adapter = get_adapter(model)
    lorsa = make_lorsa(hf, adapter, LAYER)
    ls = LorsaSet(model, {LAYER: lorsa})

    def alone(p: torch.Tensor, head: int | None = None) -> torch.Tensor:
        def edited(x: torch.Tensor) -> torch.Tensor:
            _, cache = lorsa(x, return_cache=True)
            z = cache.z.clone()
            if head is not None:
                z[..., head] = 0
            return lorsa.decode(z)
        undo = by_hand(hf, adapter, "lorsa", edited)
        try:
            return hf(p if p.dim() == 2 else p[None]).logits
        finally:
            undo()

    for lengths in ([8, 8], [9, 5], [5, 9]):
        a, b = prompts(lengths, seed=7)
        tag = f"invokes/{family}-{attn}/lengths={lengths}"
        with model.trace() as tracer:
            with tracer.invoke(a[None]):
                site = ls.replace(LAYER)
                site.hook_z.output[..., 3] = 0
                la = unembed(model).output.save()
            with tracer.invoke(b[None]):
                site = ls.replace(LAYER)  # replace() in each invoke: it replaces the invoke's rows
                site.hook_z.output[..., 5] = 0
                zb = site.hook_z.output.save()
                lb = unembed(model).output.save()
        ra, rb = relative(la[:, -len(a):], alone(a, 3)), relative(lb[:, -len(b):], alone(b, 5))
        record(f"{tag}/edit_per_invoke", ra < REL and rb < REL and zb.shape[0] == 1, f"{ra:.2e} {rb:.2e}")
        with model.trace() as tracer:
            with tracer.invoke(a[None]):
                ls.replace(LAYER, error=True)
                la = unembed(model).output.save()
            with tracer.invoke(b[None]):
                lb = unembed(model).output.save()
        ra, rb = relative(la[:, -len(a):], hf(a[None]).logits), relative(lb[:, -len(b):], hf(b[None]).logits)
        record(f"{tag}/error_term_exact", ra < REL and rb < REL, f"{ra:.2e} {rb:.2e}")
        with model.trace() as tracer:
            with tracer.invoke(a[None]):
                la = unembed(model).output.save()
            with tracer.invoke(b[None]):
                ls.replace(LAYER)  # this invoke's rows only (docs/nnsight.md)
                lb = unembed(model).output.save()
        with model.trace() as tracer:
            with tracer.invoke(a[None]):
                wa = unembed(model).output.save()
            with tracer.invoke(b[None]):
                pass
        rb = relative(lb[:, -len(b):], alone(b))
        record(f"{tag}/replace_in_one_invoke", bool(torch.equal(la, wa)) and rb < REL, f"{rb:.2e}")

        def internals_from_another_invoke(a=a, b=b) -> None:
            with model.trace() as tracer:
                with tracer.invoke(a[None]):
                    site = ls.replace(LAYER)
                with tracer.invoke(b[None]):
                    site.hook_z.output.save()

        expect_refusal(f"{tag}/internals_from_an_invoke_not_replaced", internals_from_another_invoke)
    a, b = prompts([8, 8], seed=9)
    with model.trace() as tracer:
        with tracer.invoke(a[None]):
            la = unembed(model).output.save()
        with tracer.invoke(b[None]):
            lb = unembed(model).output.save()
        with tracer.invoke():  # the whole batch
            ls.replace(LAYER).hook_z.output[..., 3] = 0
    want = alone(torch.stack([a, b]), 3)
    r = relative(torch.cat([la, lb]), want)
    record(f"invokes/{family}-{attn}/empty_invoke_edits_every_row", r < REL, f"{r:.2e}")


def no_cache_loop(model, make_site: Callable[[], object], edit: Callable[[object], None] | None,
                  p: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decoding by full-sequence traces; the end-of-sequence ids never chosen, as ``generate`` with
    ``min_new_tokens=steps`` does (OLMo-2's tiny model, eos 1 in the vocabulary, picks it greedily)."""
    eos = model.generation_config.eos_token_id
    eos = [e for e in ([eos] if isinstance(eos, int) else eos or []) if e < VOCAB]
    seq, logits = p[None], []
    for _ in range(steps):
        with model.trace(seq):
            site = make_site()
            if edit is not None:
                edit(site)
            logits.append(nnsight.save(unembed(model).output[:, -1]))
        allowed = logits[-1].clone()
        allowed[..., eos] = float("-inf")
        seq = torch.cat([seq, allowed.argmax(-1, keepdim=True)], 1)
    return seq[0], torch.stack(logits, 1)[0]


@torch.no_grad()
def probe_generate(steps: int = 4) -> None:
    """generate() with the KV cache vs a no-cache loop of full-sequence traces: invokes of different lengths
    with their own edits, nnsight's left padding, batch 1 vs B."""
    for family, attn in _runs([("llama", "eager"), ("llama", "sdpa"), ("gpt2", "sdpa"), ("neox", "eager"),
                               ("qwen3", "eager")]):
        model, hf = tiny_nnsight(family, attn=attn)
        adapter = get_adapter(model)
        tag = f"generate/{family}-{attn}"
        for kind in ("lorsa", "tc"):
            _generate(model, adapter, kind, make_lorsa(hf, adapter, LAYER) if kind == "lorsa" else make_transcoder(),
                      steps, f"{tag}/{kind}")
        _generate_left_padded(model, LorsaSet(model, {LAYER: make_lorsa(hf, adapter, LAYER)}), steps, tag)


def _generate(model, adapter, kind: str, module, steps: int, tag: str) -> None:
    gen = {"max_new_tokens": steps, "min_new_tokens": steps, "do_sample": False, "pad_token_id": 1}

    def zero3(site) -> None:
        (site.hook_z if kind == "lorsa" else site.hook_sae_acts_post).output[..., 3] = 0

    a, b = prompts([8, 5], seed=11)
    for error in (False, True):
        with model.generate(**gen) as tracer:
            with tracer.invoke(a[None]):
                site, _ = spliced(model, adapter, kind, module, error)
                la = nnsight.save([])
                for _ in tracer.iter[:steps]:
                    la.append(unembed(model).output[:, -1].clone())
                oa = nnsight.save(tracer.result)
            with tracer.invoke(b[None]):
                site, _ = spliced(model, adapter, kind, module, error)  # replace() per invoke: its rows
                lb = nnsight.save([])
                for _ in tracer.iter[:steps]:
                    zero3(site)
                    lb.append(unembed(model).output[:, -1].clone())
                ob = nnsight.save(tracer.result)

        def make_site(error: bool = error):
            return spliced(model, adapter, kind, module, error)[0]

        for p, got, out, edit in ((a, la, oa, None), (b, lb, ob, zero3)):
            seq, want = no_cache_loop(model, make_site, edit, p, steps)
            r = relative(torch.stack(list(got), 1)[0], want)
            record(f"{tag}/error={error}/invoke_len{len(p)}", bool(torch.equal(out[0, -len(seq):], seq)) and r < REL,
                   f"{r:.2e}")
    outs = {}
    for batch in (1, 3):
        with model.generate(a[None].repeat(batch, 1), **gen) as tracer:
            site, _ = spliced(model, adapter, kind, module, False)
            lg = nnsight.save([])
            for _ in tracer.iter[:steps]:
                zero3(site)
                lg.append(unembed(model).output[:, -1].clone())
            out = nnsight.save(tracer.result)
        outs[batch] = (out, torch.stack(list(lg), 1))
    r = max(relative(outs[3][1][i], outs[1][1][0]) for i in range(3))
    same = all(torch.equal(outs[3][0][i], outs[1][0][0]) for i in range(3))
    record(f"{tag}/batch1_vs_3", same and r < 1e-5, f"{r:.2e}")


def _generate_left_padded(model, ls: LorsaSet, steps: int, tag: str) -> None:
    gen = {"max_new_tokens": steps, "min_new_tokens": steps, "do_sample": False, "pad_token_id": 1}

    def edit_kv(site) -> None:
        site.hook_v.output[..., 4] *= 2
        site.hook_z.output[..., 3] = 0

    ps = prompts([8, 4, 6], seed=61)
    with model.generate([p.tolist() for p in ps], **gen) as tracer:  # nnsight left-pads
        site = ls.replace(LAYER)
        lg = nnsight.save([])
        for _ in tracer.iter[:steps]:
            edit_kv(site)
            lg.append(unembed(model).output[:, -1].clone())
        out = nnsight.save(tracer.result)
    lg = torch.stack(list(lg), 1)
    for i, p in enumerate(ps):
        seq, want = no_cache_loop(model, lambda: ls.replace(LAYER), edit_kv, p, steps)
        r = relative(lg[i], want)
        record(f"{tag}/left_padded_row{i}", bool(torch.equal(out[i, -len(seq):], seq))
               and r < REL, f"{r:.2e}")


@torch.no_grad()
def probe_clt_sparse_batch() -> None:
    """A CLT and gated sparse attention on padded batches, and batch 1 vs B for a full replacement."""
    from nnsight_lorsa.sparse_attention import edge_statistics, install_gated_attention, set_gate_mode
    from nnsight_lorsa.sparse_attention.install import uninstall_gated_attention

    # SDPA only, as the first three: under eager the rows of a pad query (every key masked) are the model's
    # own arbitrary numbers, which the whole-batch comparison below would read (tokens agree bit for bit)
    for family, attn in _runs([("llama", "sdpa"), ("gpt2", "sdpa"), ("neox", "sdpa")], attns=("sdpa",)):
        model, hf = tiny_nnsight(family, attn=attn)
        adapter = get_adapter(model)
        ps = prompts([8, 3, 6], seed=41)
        lists, n = [p.tolist() for p in ps], 8
        clt = CLTSet(model, make_clt(3))
        for error in (False, True):
            with model.trace(lists):
                site = clt.replace(error=error)
                site.hook_sae_acts_post[0].output[..., 2] = 0
                out = unembed(model).output.save()
            for i, p in enumerate(lists):
                with model.trace([p]):
                    site = clt.replace(error=error)
                    site.hook_sae_acts_post[0].output[..., 2] = 0
                    want = unembed(model).output.save()
                r = relative(out[i, n - len(p):], want[0])
                record(f"clt/{family}/error={error}/padded_row{i}", r < REL, f"{r:.2e}")
        with model.trace(lists):
            ref = unembed(model).output.save()
        install_gated_attention(model, init_bias=30.0)
        gate = model.get(adapter.attention_path(LAYER) + ".gate")
        with model.trace(lists):
            out = unembed(model).output.save()
        heads = edge_statistics(model).possible.shape[-1]
        window = adapter.sliding_window(LAYER) or n  # Phi-3's window 4: the edges a query can have
        allowed = sum(min(t + 1, window) for p in lists for t in range(len(p))) * heads
        st = edge_statistics(model)
        record(f"sparse/{family}/open_gates_equal_model_padded", relative(out, ref) < REL, f"{relative(out, ref):.2e}")
        record(f"sparse/{family}/possible_edges_padded", float(st.possible[LAYER].sum()) == allowed)
        with model.trace() as tracer:
            with tracer.invoke([lists[0]]):
                la = unembed(model).output.save()
            with tracer.invoke([lists[2]]):
                gate.output[0, 1, -1, -6] = 0  # last token -> the row's first token (6 tokens, padded to 8)
                lb = unembed(model).output.save()
        with model.trace([lists[0]]):
            wa = unembed(model).output.save()
        with model.trace([lists[2]]):
            gate.output[0, 1, -1, 0] = 0
            wb = unembed(model).output.save()
        r = max(relative(la, wa), relative(lb[:, -6:], wb))
        record(f"sparse/{family}/gate_edit_per_invoke", r < REL, f"{r:.2e}")
        set_gate_mode(model, "topk", top_k=2)
        with model.trace(lists):
            out = unembed(model).output.save()
        kept = sum(sum(min(2, t + 1) for t in range(len(p))) for p in lists) * heads
        record(f"sparse/{family}/topk_edges_padded", float(edge_statistics(model).active[LAYER].sum()) == kept)
        for i, p in enumerate(lists):
            with model.trace([p]):
                want = unembed(model).output.save()
            record(f"sparse/{family}/topk_padded_row{i}", relative(out[i, n - len(p):], want[0]) < REL)
        uninstall_gated_attention(model)
        ls = LorsaSet(model, {LAYER: make_lorsa(hf, adapter, LAYER)})
        rm = ReplacementModel(model, lorsas=ls, transcoders=TranscoderSet(model, {0: make_transcoder()}), error=False)
        p = prompts([10], seed=51)[0]
        outs = []
        for batch in (1, 4):
            with model.trace(p[None].repeat(batch, 1)):
                rm.replace()
                outs.append(unembed(model).output.save())
        r = max(relative(outs[1][i], outs[0][0]) for i in range(4))
        record(f"batch/{family}/batch1_vs_4", r < 1e-5, f"{r:.2e}")


@torch.no_grad()
def probe_patching() -> None:
    """Experiments on padded prompts: each row vs its prompt alone, or a refusal."""
    from nnsight_lorsa import patching as pt

    model, hf = tiny_nnsight("llama")
    adapter = get_adapter(model)
    r = ReplacementModel(model, lorsas=LorsaSet(model, {LAYER: make_lorsa(hf, adapter, LAYER)}),
                         transcoders=TranscoderSet(model, {LAYER: make_transcoder()}))
    targets = [pt.MHSAHead(0, 1), pt.LorsaHead(LAYER, 5), pt.Feature(LAYER, 3, kind="transcoder")]
    clean = [p.tolist() for p in prompts([9, 5, 7], seed=21)]
    ids = {"correct_ids": torch.tensor([5, 6, 7]), "incorrect_ids": torch.tensor([8, 9, 10])}

    def row(i: int) -> dict:
        return {k: v[i:i + 1] for k, v in ids.items()}

    means = pt.mean_activations(r, targets, clean)
    alone = [pt.mean_activations(r, targets, [p], per_position=True) for p in clean]
    for t in targets:
        want = torch.cat([a[t] for a in alone]).mean(0)
        gap = relative(means[t], want)
        record(f"patching/mean_activations_over_tokens/{t}", gap < REL, f"{gap:.2e}")
    expect_refusal("patching/mean_activations_per_position_padded",
                   lambda: pt.mean_activations(r, targets, clean, per_position=True))
    other = [p.tolist() for p in prompts([7, 9, 5], seed=22)]
    expect_refusal("patching/activation_patching_padded_differently",
                   lambda: pt.activation_patching(r, clean, other, targets, **ids))
    expect_refusal("patching/path_patching_padded_differently",
                   lambda: pt.path_patching(r, clean, [pt.MHSAHead(0, 1)], corrupt=other, **ids))
    corrupt = [p.tolist() for p in prompts([9, 5, 7], seed=23)]
    ap = pt.activation_patching(r, clean, corrupt, targets, **ids)
    pp = pt.path_patching(r, clean, [pt.MHSAHead(0, 1)], corrupt=corrupt, **ids)
    ab = pt.ablation_effect(r, clean, targets, **ids)
    for i in range(3):
        one = pt.activation_patching(r, clean[i:i + 1], corrupt[i:i + 1], targets, **row(i))
        one_pp = pt.path_patching(r, clean[i:i + 1], [pt.MHSAHead(0, 1)], corrupt=corrupt[i:i + 1], **row(i))
        one_ab = pt.ablation_effect(r, clean[i:i + 1], targets, **row(i))
        d = max(float((ap.patched[:, i] - one.patched[:, 0]).abs().max()),
                float((pp.effect[:, i] - one_pp.effect[:, 0]).abs().max()),
                float((ab.ablated[i] - one_ab.ablated[0]).abs()))
        record(f"patching/padded_alike_row{i}_vs_alone", d < 1e-5, f"{d:.2e}")
    right, mask = pad([torch.tensor(p) for p in clean], "right")
    expect_refusal("patching/default_metric_on_right_padding",
                   lambda: pt.ablation_effect(r, {"input_ids": right, "attention_mask": mask}, targets, **ids))

    def edit_at_pad() -> None:
        with model.trace(clean):
            pt.padding_mask(model)
            pt.ablate(r(pt.LorsaHead(LAYER, 5)), positions=1)

    expect_refusal("patching/edit_at_a_padded_position", edit_at_pad)

    def edit_at_pad_after_prepare() -> None:
        with model.trace(clean):
            r.prepare([pt.LorsaHead(LAYER, 5)])
            pt.scale(r(pt.LorsaHead(LAYER, 5)), 2.0, positions=[0, -1])

    expect_refusal("patching/edit_at_a_padded_position_after_prepare", edit_at_pad_after_prepare)
    expect_refusal("patching/head_swap_at_a_padded_position",
                   lambda: pt.head_swap(r, LAYER, 5, 6, clean, positions=1))
    expect_refusal("patching/ablation_effect_at_a_padded_position",
                   lambda: pt.ablation_effect(r, clean, targets, positions=2, **ids))


PROBES = {"padding": probe_padding, "invokes": probe_invokes, "generate": probe_generate,
          "clt_sparse_batch": probe_clt_sparse_batch, "patching": probe_patching}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(PROBES), action="append")
    parser.add_argument("--families", nargs="+", help="run only these families (default: all)")
    args = parser.parse_args()
    global ONLY_FAMILIES
    ONLY_FAMILIES = args.families
    warnings.simplefilter("ignore")
    for name in args.only or PROBES:
        PROBES[name]()
    print("| probe | correct | named_error | wrong |\n|---|---|---|---|")
    groups = sorted({n.split("/")[0] for n, _, _ in RECORDS})
    for g in [*groups, None]:
        c = Counter(o for n, o, _ in RECORDS if g is None or n.split("/")[0] == g)
        print(f"| {g or '**total**'} | {c['correct']} | {c['named_error']} | {c['wrong']} |")
    return 1 if any(o == "wrong" for _, o, _ in RECORDS) else 0


if __name__ == "__main__":
    sys.exit(main())
