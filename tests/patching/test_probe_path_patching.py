"""Generated probe of ``path_patching`` (sender groups, positions, zero / mean / patch, every sender kind) and of the
metrics, against references written with plain PyTorch forward hooks on the Hugging Face model (docs/reliability.md,
"Path patching, tasks and metrics probe (2026-11-27)").

The reference of one sender group, row by row (each row alone, unpadded): the clean run records every attention
output, every output projection's input and the Lorsa's z; the sender values are read from the corrupt row (or are
0 / the mean at the edited positions); the patched run sets them and, from the group's first attention after its
earliest sender on (docs/patching.md: a head's layer + 1, an SAE on layer L's attention norm L, other SAE / transcoder
sites L + 1), holds every attention output at its clean value — in a layer with sender heads through the per-head
values (o_proj's input / the Lorsa's z, with the clean error term), the senders set. Where the library must refuse
(an MHSA sender discarded by a Lorsa without error term, an MHSA sender in a frozen Lorsa layer), the refusal is
checked instead. Metrics: the default logit difference or a user metric (log-probability, KL of the clean
distribution from the patched one) read from the reference's logits.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from helpers import generated
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_probe_patching_generated import (
    as_input,
    attention_hook,
    by_hand,
    case_of,
    combine,
    dtype_of,
    needs,
    one,
    reference,
)

from nnsight_lorsa.errors import ArgumentError, ConfigMismatchError, ShapeError
from nnsight_lorsa.patching import (
    Feature,
    LorsaHead,
    MHSAHead,
    ablation_effect,
    activation_patching,
    logit_difference,
    mean_activations,
    relative_effect,
)
from nnsight_lorsa.patching.path_patching import HeadInput, path_patching

FAMILIES = ("llama", "gemma2", "qwen3", "neox", "gpt2", "olmo2", "gemma", "phi3")
SEEDS = st.integers(0, 2**31 - 1)
BOUND = {torch.float32: 1e-4, torch.bfloat16: 5e-2}  # of max(1, the clean logits' largest |value|)
POSITIONS = (None, -1, [-2, -1], -2, slice(-3, None), [-3, -1], torch.tensor([-2, -1]))


def first_of(case: Any, t: Any) -> int:
    """The first layer whose attention reads what sender ``t`` changes (docs/patching.md, written out here)."""
    if isinstance(t, (MHSAHead, LorsaHead)):
        return t.layer + 1
    if t.kind == "transcoder":
        return int(t.site) + 1
    a = case.adapter
    for layer in range(3):
        if t.site == a.attention_norm_path(layer):
            return layer
        if t.site in (a.layer_path(layer), a.attention_path(layer), a.mlp_norm_path(layer), a.mlp_path(layer),
                      a.mlp_post_norm_path(layer)):
            return layer + 1
    raise AssertionError(t)


def at(mean: torch.Tensor, pos: Any, per_position: bool) -> torch.Tensor:
    """A mean at the edited positions: a per-position mean indexed there, else as it is."""
    if not per_position or pos is None:
        return mean
    return mean[pos.tolist() if isinstance(pos, torch.Tensor) else pos]


def row_rng(seed: int) -> tuple:
    rng = random.Random(seed)
    dtype = torch.bfloat16 if rng.random() < 0.3 else torch.float32
    case = case_of(rng.choice(FAMILIES), dtype, rng.choice([dtype, torch.float32]))
    return rng, case, dtype


def draw_groups(rng: random.Random, case: Any) -> list:
    a = case.adapter
    pool = [MHSAHead(rng.randrange(3), rng.randrange(a.n_heads)), MHSAHead(rng.randrange(2), rng.randrange(a.n_heads)),
            MHSAHead(case.layer, rng.randrange(a.n_heads)),
            LorsaHead(case.layer, rng.randrange(case.lorsa.cfg.n_ov_heads)),
            Feature(rng.choice([1, 2]), rng.randrange(128), kind="transcoder")]
    pool += [Feature(site, rng.randrange(128)) for site in case.saes]
    groups: list = []
    for _ in range(rng.randint(1, 3)):
        g = tuple(dict.fromkeys(rng.choice(pool) for _ in range(rng.randint(1, 3))))
        groups.append(g if len(g) > 1 or rng.random() < 0.5 else g[0])
    return groups


def expected_refusal(case: Any, r: Any, groups: list, error: bool) -> type | None:
    """The named error the call must raise, from the rules of docs/patching.md (None: it must run)."""
    flat = [t for g in groups for t in (g if isinstance(g, tuple) else (g,))]
    lorsa_layers = {t.layer for t in flat if isinstance(t, LorsaHead)}
    if not error and any(isinstance(t, MHSAHead) and t.layer in lorsa_layers for t in flat):
        return ArgumentError  # the MHSA edit would be discarded (as activation_patching refuses it)
    for g in groups:
        g = g if isinstance(g, tuple) else (g,)
        first = min(first_of(case, t) for t in g)
        if any(isinstance(t, MHSAHead) and t.layer >= first and t.layer in lorsa_layers for t in g):
            return ConfigMismatchError  # a frozen Lorsa layer around an MHSA sender
    a = case.adapter
    tc_layers = {int(t.site) for t in flat if isinstance(t, Feature) and t.kind == "transcoder"}
    for t in flat:  # an SAE reading an output the call replaces
        if isinstance(t, Feature) and t.kind == "sae" and (any(t.site == a.attention_path(L) for L in lorsa_layers)
                                                           or any(t.site == a.mlp_path(L) for L in tc_layers)):
            return ConfigMismatchError
    return None


def make_metric(kind: str, correct: torch.Tensor, wrong: torch.Tensor, clean_logits: list) -> Any:
    """(library metric or None, reference metric of one row's logits ``(pos, vocab)`` and its row)."""
    if kind == "logit_diff":
        return None, lambda lg, j: float(lg[-1, int(correct[j])] - lg[-1, int(wrong[j])])
    if kind == "logprob":
        lib = lambda lg: torch.log_softmax(lg[:, -1].float(), -1)[torch.arange(lg.shape[0]), correct]  # noqa: E731
        return lib, lambda lg, j: float(torch.log_softmax(lg[-1].double(), -1)[int(correct[j])])
    # KL(clean ‖ patched) of the last position's next-token distributions, per row (sum over the vocabulary)
    store: dict = {}

    def lib_kl(lg: torch.Tensor) -> torch.Tensor:
        p = torch.log_softmax(lg[:, -1].float(), -1)
        if "clean" not in store:  # the first call is the clean run's
            store["clean"] = p
        q = store["clean"]
        return (q.exp() * (q - p)).sum(-1)

    def ref_kl(lg: torch.Tensor, j: int) -> float:
        q = torch.log_softmax(clean_logits[j][-1].double(), -1)
        p = torch.log_softmax(lg[-1].double(), -1)
        return float((q.exp() * (q - p)).sum())
    return lib_kl, ref_kl


def draw_prompts(rng: random.Random, batch: int) -> tuple[bool, list, list, torch.Tensor, torch.Tensor]:
    """``(padded, clean, corrupt, correct, wrong)``: ``batch`` clean / corrupt token rows of 5–9 tokens (BOS 0;
    padded to different lengths with probability 0.4 when ``batch > 1``) and each row's two answer tokens."""
    padded = batch > 1 and rng.random() < 0.4
    lens = [rng.randint(5, 9) for _ in range(batch)] if padded else [rng.randint(5, 9)] * batch
    clean = [[0] + [rng.randrange(2, 128) for _ in range(n - 1)] for n in lens]
    corrupt = [[0] + [rng.randrange(2, 128) for _ in range(n - 1)] for n in lens]
    correct = torch.tensor([rng.randrange(2, 128) for _ in range(batch)])
    wrong = torch.tensor([rng.randrange(2, 128) for _ in range(batch)])
    return padded, clean, corrupt, correct, wrong


@torch.no_grad()
def run_groups(seed: int) -> str:
    rng, case, dtype = row_rng(seed)
    a = case.adapter
    error = rng.random() < 0.6
    r = case.bundle(error)
    batch = 1 if dtype != torch.float32 else rng.randint(1, 3)  # half precision: single rows (batched rounding)
    padded, clean, corrupt, correct, wrong = draw_prompts(rng, batch)
    mode = rng.choice(["patch", "zero", "mean"])
    pos = rng.choice(POSITIONS)
    groups = draw_groups(rng, case)
    flat = list(dict.fromkeys(t for g in groups for t in (g if isinstance(g, tuple) else (g,))))
    per_position = mode == "mean" and not padded and rng.random() < 0.5
    means = mean_activations(r, flat, as_input(clean), per_position=per_position) if mode == "mean" else None
    metric_kind = rng.choice(["logit_diff", "logit_diff", "logprob", "kl"])
    where = (f"seed {seed}: {a.family} {dtype} error={error} mode={mode} pos={pos} groups {groups} "
             f"padded={padded} per_position={per_position} metric={metric_kind}")
    spliced = needs(flat)

    def logits_of(head_out: torch.Tensor) -> torch.Tensor:  # the experiments' metrics read the soft-capped logits
        return a.final_logits(head_out).float()
    clean_logits: list = []
    records = []
    for j in range(batch):  # the clean run: every attention output, o_proj input and the Lorsa's z
        attn: dict = {}
        oin: dict = {}
        oout: dict = {}
        zc = dict(t=LorsaHead(case.layer, 0), op="capture", val=None, pos=None, lib_pos=None, per_row=False,
                  cols=slice(None), store={})

        def read_oin(layer, oin=oin):
            proj = case.hf.get_submodule(r.output_projection_path(layer))
            return lambda: proj.register_forward_pre_hook(lambda m, args: oin.__setitem__(layer, args[0].clone()))

        def read_oout(layer, oout=oout):
            proj = case.hf.get_submodule(r.output_projection_path(layer))
            return lambda: proj.register_forward_hook(lambda m, args, o: oout.__setitem__(layer, o.clone()))
        extra = [attention_hook(case, L, attn, freeze=False) for L in range(3)]
        extra += [read_oin(L) for L in range(3)] + [read_oout(L) for L in range(3)]
        clean_logits.append(logits_of(reference(case, clean[j], [zc] if "lorsa" in spliced else [], j, spliced,
                                                error, extra=extra)))
        records.append((attn, oin, oout, zc["store"].get(j)))
    lib_metric, ref_metric = make_metric(metric_kind, correct, wrong, clean_logits)
    kw = dict(corrupt=as_input(corrupt)) if mode == "patch" else {}
    refusal = expected_refusal(case, r, groups, error)
    call = lambda: path_patching(r, as_input(clean), groups, mode=mode, means=means, positions=pos,  # noqa: E731
                                 metric=lib_metric, correct_ids=correct, incorrect_ids=wrong,
                                 groups_per_trace=rng.choice([1, 2, 8]), **kw)
    if refusal is not None:
        with pytest.raises(refusal):
            call()
        return "refused"
    res = call()
    for j in range(batch):
        attn, oin, oout, zclean = records[j]
        scale = max(1.0, float(clean_logits[j].abs().max()))
        tol = BOUND[dtype] * scale
        want = ref_metric(clean_logits[j], j)
        assert abs(float(res.clean[j]) - want) <= tol, f"{where}: clean row {j}: {float(res.clean[j])} vs {want}"
        for gi, g in enumerate(groups):
            ts = r.sort(list(g) if isinstance(g, tuple) else [g])
            if mode == "patch":
                reads = [one(case, t, "capture", pos) for t in ts]
                reference(case, corrupt[j], reads, j, spliced, error)
                edits = [one(case, t, "patch", pos, e["store"][j]) for t, e in zip(ts, reads, strict=True)]
            elif mode == "zero":
                edits = [one(case, t, "ablate", pos) for t in ts]
            else:
                edits = [one(case, t, "mean", pos, at(means[t], pos, per_position)) for t in ts]
            first = min(first_of(case, t) for t in ts)
            extra = []
            for layer in range(first, 3):
                mh = [e for e in edits if isinstance(e["t"], MHSAHead) and e["t"].layer == layer]
                lh = [e for e in edits if isinstance(e["t"], LorsaHead) and e["t"].layer == layer]
                if mh:  # frozen through o_proj's input: the clean values, the senders set
                    proj = case.hf.get_submodule(r.output_projection_path(layer))

                    def pre(m, args, mh=mh, layer=layer, oin=oin, j=j):
                        x = oin[layer]
                        for e in mh:
                            x = by_hand(x, e, j)
                        return (x, *args[1:])
                    extra.append(lambda proj=proj, pre=pre: proj.register_forward_pre_hook(pre))
                elif lh:  # frozen through the Lorsa's z (and the clean error term)
                    module = a.attention_module(case.hf, layer)

                    def post(m, args, output, lh=lh, layer=layer, attn=attn, zclean=zclean, j=j):
                        ze = zclean
                        for e in lh:
                            ze = by_hand(ze, e, j)
                        out = combine(attn[layer], case.lorsa.decode(ze), case.lorsa.decode(zclean), error)
                        return a.with_attention_output(output, out)
                    extra.append(lambda module=module, post=post: module.register_forward_hook(post))
                elif "lorsa" in spliced and layer == case.layer:  # the spliced attention output
                    extra.append(attention_hook(case, layer, attn, freeze=True))
                else:  # o_proj's output: an SAE sender on the attention output reads the frozen value
                    proj = case.hf.get_submodule(r.output_projection_path(layer))
                    extra.append(lambda proj=proj, layer=layer, oout=oout: proj.register_forward_hook(
                        lambda m, args, o: oout[layer]))
            out = logits_of(reference(case, clean[j], edits, j, spliced, error, extra=extra))
            want = ref_metric(out, j)
            got = float(res.patched[gi, j])
            assert abs(got - want) <= tol, f"{where}: group {g} row {j}: {got} vs {want} (tol {tol:.2e})"
    return "compared"


@generated(10, 400, seed=SEEDS)
def test_generated_group_path_patching_equals_the_hooks_reference(seed):
    run_groups(seed)


SEPARATE_QKV = ("llama", "qwen3", "gemma2", "olmo2", "gemma")  # MHSA receivers need separate q/k/v projections


@torch.no_grad()
def run_receivers(seed: int) -> str:
    """Sender groups → MHSA and Lorsa q / k / v receivers: the receivers' inputs from the sender-patched run (frozen
    from the group's first attention to the last receiver's layer), everything else the clean run's."""
    rng, case, dtype = row_rng(seed)
    a = case.adapter
    error = rng.random() < 0.6
    r = case.bundle(error)
    batch = 1 if dtype != torch.float32 else rng.randint(1, 2)
    padded, clean, corrupt, correct, wrong = draw_prompts(rng, batch)
    mode = rng.choice(["patch", "zero"])
    pos = rng.choice(POSITIONS)
    receivers: list = []
    for _ in range(rng.randint(1, 3)):
        lorsa = case.layer == 1 and (a.family not in SEPARATE_QKV or rng.random() < 0.5)
        if lorsa:
            hi = HeadInput(LorsaHead(1, rng.randrange(case.lorsa.cfg.n_ov_heads)), rng.choice(["q", "k", "v"]))
        elif a.family in SEPARATE_QKV:
            hi = HeadInput(MHSAHead(rng.choice([1, 2]), rng.randrange(a.n_heads)), rng.choice(["q", "k", "v"]))
        else:
            continue
        if hi not in receivers:
            receivers.append(hi)
    if not receivers:
        return "skipped"
    low = min(x.head.layer for x in receivers)
    pool = [MHSAHead(0, rng.randrange(a.n_heads)), MHSAHead(0, rng.randrange(a.n_heads))]
    pool += [Feature(site, rng.randrange(128)) for site in case.saes if first_of(case, Feature(site, 0)) <= low]
    if low == 2:
        pool += [MHSAHead(1, rng.randrange(a.n_heads)), Feature(1, rng.randrange(128), kind="transcoder")]
    groups = [tuple(dict.fromkeys(rng.choice(pool) for _ in range(rng.randint(1, 2))))
              for _ in range(rng.randint(1, 2))]
    flat = list(dict.fromkeys(t for g in groups for t in g))
    spliced = needs(flat + [x.head for x in receivers])
    kw = dict(corrupt=as_input(corrupt)) if mode == "patch" else {}
    where = f"seed {seed}: {a.family} {dtype} error={error} mode={mode} pos={pos} groups {groups} receivers {receivers}"
    call = lambda: path_patching(r, as_input(clean), groups, mode=mode, positions=pos,  # noqa: E731
                                 correct_ids=correct, incorrect_ids=wrong, receivers=receivers, **kw)
    lorsa_layers = {x.head.layer for x in receivers if isinstance(x.head, LorsaHead)}
    if not error and any(isinstance(x.head, MHSAHead) and x.head.layer in lorsa_layers for x in receivers):
        with pytest.raises(ArgumentError, match="would be discarded"):
            call()
        return "refused"
    res = call()
    d, per_kv = a.head_dim, a.n_heads // getattr(case.hf.config, "num_key_value_heads", a.n_heads)
    last = max(x.head.layer for x in receivers)
    for j in range(batch):
        attn: dict = {}
        got: dict = {}

        def module_of(x):
            if isinstance(x.head, LorsaHead):
                return getattr(case.lorsa, f"hook_{x.which}")
            return getattr(a.attention_module(case.hf, x.head.layer), a.head_input_names[x.which])

        def index_of(x):
            if isinstance(x.head, LorsaHead):  # hook_q / hook_k (batch, n_qk, pos, d); hook_v (batch, pos, n_ov)
                h = x.head.head
                return (Ellipsis, h) if x.which == "v" else (slice(None), h // case.lorsa.cfg.group_size)
            h = x.head.head if x.which == "q" else x.head.head // per_kv
            return (Ellipsis, slice(h * d, (h + 1) * d))

        def record(x, got=got):
            return lambda: module_of(x).register_forward_hook(lambda m, args, o: got.__setitem__(x, o.clone()))

        live = {"on": True}

        def put(x, got=got, live=live):
            def hook(m, args, o):
                if not live["on"]:
                    return o
                o = o.clone()
                o[index_of(x)] = got[x][index_of(x)]
                return o
            return lambda: module_of(x).register_forward_hook(hook)

        def error_of_the_unedited_lorsa(live=live):
            """With the error term, ``MHSA − Lorsa`` is the *unedited* Lorsa's (the splice's clean pass): the
            receivers' q / k / v edits reach the output as ``true + (live − clean)``."""
            lorsa, sliding = case.lorsa, a.sliding_window(case.layer) is not None

            def hook(m, args, kwargs, output):
                x = a.attention_input(args, kwargs).to(dtype_of(lorsa))
                mask = None if sliding else a.attention_mask(args, kwargs)
                where_ = (x, a.attention_positions(args, kwargs, x), mask)
                live["on"] = False
                zc = lorsa.activation(lorsa.compute_z_pre(*where_))[0]
                live["on"] = True
                zl = lorsa.activation(lorsa.compute_z_pre(*where_))[0]
                return a.with_attention_output(output, combine(a.attention_output(output), lorsa.decode(zl),
                                                               lorsa.decode(zc), error))
            return lambda: a.attention_module(case.hf, case.layer).register_forward_hook(hook, with_kwargs=True)
        puts = [put(x) for x in receivers]
        if error and any(isinstance(x.head, LorsaHead) for x in receivers):
            puts.append(error_of_the_unedited_lorsa())

        reference(case, clean[j], [], j, spliced, error,
                  extra=[attention_hook(case, L, attn, freeze=False) for L in range(3)])
        for gi, g in enumerate(groups):
            ts = r.sort(list(g))
            if mode == "patch":
                reads = [one(case, t, "capture", pos) for t in ts]
                reference(case, corrupt[j], reads, j, spliced, error)
                edits = [one(case, t, "patch", pos, e["store"][j]) for t, e in zip(ts, reads, strict=True)]
            else:
                edits = [one(case, t, "ablate", pos) for t in ts]
            first = min(first_of(case, t) for t in ts)
            frozen = [attention_hook(case, L, attn, freeze=True) for L in range(first, last)
                      if not any(isinstance(t, MHSAHead) and t.layer == L for t in ts)]
            if any(isinstance(t, MHSAHead) and first <= t.layer < last for t in ts):
                return "skipped"  # a frozen layer around a sender head: run_groups checks it
            got.clear()
            reference(case, clean[j], edits, j, spliced, error, extra=frozen + [record(x) for x in receivers])
            out = a.final_logits(reference(case, clean[j], [], j, spliced, error, extra=puts))
            want = float(out[-1, int(correct[j])] - out[-1, int(wrong[j])])
            assert abs(float(res.patched[gi, j]) - want) <= BOUND[dtype] * max(1.0, float(out.abs().max())), \
                f"{where}: group {g} row {j}: {float(res.patched[gi, j])} vs {want}"
    return "compared"


@generated(8, 300, seed=SEEDS)
def test_generated_receivers_equal_the_hooks_reference(seed):
    run_receivers(seed)

# ------------------------------------------------------------------------------------ bugs the probe found
@pytest.fixture(scope="module")
def llama():
    """The probe's tiny Llama (Lorsa on layer 1, transcoders on 1 and 2, two SAEs), unpadded prompts, answer ids."""
    case = case_of("llama", torch.float32, torch.float32)
    g = torch.Generator().manual_seed(5)
    clean, corrupt = torch.randint(2, 128, (3, 3), generator=g), torch.randint(2, 128, (3, 3), generator=g)
    return case, clean, corrupt, dict(correct_ids=[3, 4, 7], incorrect_ids=[5, 6, 8])


@torch.no_grad()
def test_an_mhsa_head_a_lorsa_without_error_term_discards_is_refused(llama):
    """With ``error=False`` a Lorsa the call splices (for a Lorsa head of that layer) computes the layer's attention
    output without the MHSA heads: an MHSA sender's patch (or an MHSA receiver's input) there moved nothing and the
    result came back as the clean metric (``patched == clean`` exactly), where ``activation_patching`` refuses the same
    edit. Now an ArgumentError names it, before the model runs."""
    case, clean, corrupt, kw = llama
    r = case.bundle(False)
    for senders in ([MHSAHead(1, 2), LorsaHead(1, 3)], [(MHSAHead(1, 2), LorsaHead(1, 3))]):
        with pytest.raises(ArgumentError, match=r"MHSA sender MHSAHead\(layer=1, head=2\) would be discarded"):
            path_patching(r, clean, senders, corrupt=corrupt, **kw)
    with pytest.raises(ArgumentError, match=r"MHSA receiver \(q\) MHSAHead\(layer=1, head=2\) would be discarded"):
        path_patching(r, clean, [MHSAHead(0, 1)], corrupt=corrupt,
                      receivers=[HeadInput(MHSAHead(1, 2), "q"), HeadInput(LorsaHead(1, 3), "q")], **kw)
    res = path_patching(case.bundle(True), clean, [MHSAHead(1, 2), LorsaHead(1, 3)], corrupt=corrupt, **kw)
    assert not torch.equal(res.patched[0], res.clean)  # with the error term the head's patch moves the metric


@torch.no_grad()
def test_a_per_position_mean_at_an_int_position_is_that_position_s_mean(llama):
    """``mean_activations(per_position=True)`` gives ``(pos[, head_dim])``; at an int position (which drops the
    position axis of the edited values) ``ablate`` broadcast it along the *batch* — row ``b`` got the mean of position
    ``b`` when batch == pos — and ``path_patching`` wrote it unchecked (the same; ``[p]`` a raw RuntimeError). Now
    the mean of the edited position is written: ``positions=p`` and ``[p]`` agree. On a padded batch a per-position
    mean mixed tokens up (position ``p`` is another token in a shifted row; ``mean_activations(per_position=True)``
    refuses padded prompts): refused."""
    case, clean, _, kw = llama
    r = case.bundle(True)
    heads = [MHSAHead(1, 0), Feature(case.adapter.layer_path(1), 7)]
    means = mean_activations(r, heads, torch.randint(2, 128, (4, 3), generator=torch.Generator().manual_seed(1)),
                             per_position=True)
    for t in heads:
        last = {t: means[t][-1]}  # the last position's mean, as one mean for every position
        for p in (2, -1, [2]):  # the same position
            a = ablation_effect(r, clean, [t], mode="mean", means=means, positions=p, **kw).ablated
            b = ablation_effect(r, clean, [t], mode="mean", means=last, positions=p, **kw).ablated
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            a = path_patching(r, clean, [t], mode="mean", means=means, positions=p, **kw).patched
            b = path_patching(r, clean, [t], mode="mean", means=last, positions=p, **kw).patched
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ShapeError, match="per-position means"):
        path_patching(r, clean[:, :2], heads[:1], mode="mean", means=means, **kw)
    padded = [clean[0].tolist(), clean[1, :2].tolist(), clean[2].tolist()]  # left-padded to 3: row 1 shifted
    with pytest.raises(ArgumentError, match="per-position means of .* on a padded batch"):
        path_patching(r, padded, heads[:1], mode="mean", means=means, **kw)
    with pytest.raises(ArgumentError, match="per-position means of .* on a padded batch"):
        ablation_effect(r, padded, heads[:1], mode="mean", means=means, **kw)


@torch.no_grad()
def test_misuse_of_path_patching_is_named_before_or_in_the_run(llama):
    """Misuse that gave raw errors (torch's broadcast / index / embedding errors, ``TypeError``)."""
    case, clean, corrupt, kw = llama
    r = case.bundle(True)
    with pytest.raises(ShapeError, match="3 clean prompts but 2 corrupt"):  # lists: a broadcast error in the trace
        path_patching(r, clean.tolist(), [MHSAHead(0, 1)], corrupt=corrupt[:2].tolist(), **kw)
    with pytest.raises(ArgumentError, match=r"positions \[3\] are out of range"):  # lists: an IndexError
        path_patching(r, clean.tolist(), [MHSAHead(0, 1)], corrupt=corrupt.tolist(), positions=3, **kw)
    unchecked_pp = getattr(path_patching, "__wrapped__", path_patching)  # as a user calls it: no type hook
    unchecked_ap = getattr(activation_patching, "__wrapped__", activation_patching)
    with pytest.raises(ConfigMismatchError, match="senders must be a list"):  # TypeError: not iterable
        unchecked_pp(r, clean, MHSAHead(0, 1), corrupt=corrupt, **kw)
    with pytest.raises(ConfigMismatchError, match="receivers must be a list"):
        unchecked_pp(r, clean, [MHSAHead(0, 1)], corrupt=corrupt, receivers=HeadInput(MHSAHead(2, 1)), **kw)
    with pytest.raises(ConfigMismatchError, match="targets must be a list"):
        unchecked_ap(r, clean, corrupt, MHSAHead(0, 1), **kw)
    for bad in (clean.float(), clean[None], clean[:, :0]):
        with pytest.raises(ArgumentError, match="clean must be prompts"):
            path_patching(r, bad, [MHSAHead(0, 1)], mode="zero", **kw)



@torch.no_grad()
def test_unfrozen_path_patching_is_activation_patching_and_right_padding_reads_each_row(llama):
    """``freeze=False`` is activation patching (docs: "the total effect"): the clean run with the senders' corrupt
    values = ``activation_patching`` from the clean into the corrupt prompts the other way round, to the logits'
    rounding (the two calls batch the runs differently: on an AVX-512 CPU they differ in the last bit); a
    right-padded dict input with a metric at each row's last token = each row alone."""
    case, clean, corrupt, kw = llama
    for error in (True, False):
        r = case.bundle(error)
        groups = [MHSAHead(0, 1), (MHSAHead(0, 2), Feature(1, 5, kind="transcoder")), LorsaHead(1, 3),
                  Feature(case.adapter.layer_path(1), 9)]
        pp = path_patching(r, clean, groups, corrupt=corrupt, freeze=False, positions=[-2, -1], **kw)
        ap = activation_patching(r, corrupt, clean, groups, positions=[-2, -1], **kw)
        bound = 8 * pp.rounding * (1 + float(ap.patched.abs().max()))  # a few ulps; a wrong patch moves it by ~1e-2
        torch.testing.assert_close(pp.patched, ap.patched, rtol=0, atol=bound)
        torch.testing.assert_close(pp.clean, ap.corrupt, rtol=0, atol=bound)
    r = case.bundle(True)
    ids = torch.tensor([[0, 5, 6, 7, 8], [0, 11, 12, 1, 1]])
    ids_c = torch.tensor([[0, 15, 16, 17, 18], [0, 21, 22, 1, 1]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    last = mask.sum(1) - 1

    def at_last(lg):
        rows = torch.arange(lg.shape[0])
        lst = last.to(lg.device) if lg.shape[0] == 2 else torch.full((1,), lg.shape[1] - 1, device=lg.device)
        return lg[rows, lst, 3] - lg[rows, lst, 4]
    both = path_patching(r, {"input_ids": ids, "attention_mask": mask}, [MHSAHead(0, 1)],
                         corrupt={"input_ids": ids_c, "attention_mask": mask}, metric=at_last)
    for j, n in enumerate((5, 3)):
        alone = path_patching(r, ids[j:j + 1, :n], [MHSAHead(0, 1)], corrupt=ids_c[j:j + 1, :n], metric=at_last)
        torch.testing.assert_close(both.patched[:, j], alone.patched[:, 0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(both.clean[j], alone.clean[0], rtol=1e-5, atol=1e-5)


def test_experiments_inside_a_trace_are_refused(llama):
    """The experiments run their own traces; called inside a ``model.trace`` body they ended in nnsight's
    ``ValueError: Cannot invoke while the model is already running``. Now ``TraceOrderError`` says why."""
    from nnsight_lorsa.errors import TraceOrderError
    from nnsight_lorsa.patching import circuit_size, head_swap, random_ablation_control
    from nnsight_lorsa.patching.tasks import TaskBatch
    case, clean, corrupt, kw = llama
    r = case.bundle(True)
    task = TaskBatch("t", clean, corrupt, torch.tensor(kw["correct_ids"]), torch.tensor(kw["incorrect_ids"]))
    calls = {"path_patching": lambda: path_patching(r, clean, [MHSAHead(0, 1)], mode="zero", **kw),
             "activation_patching": lambda: activation_patching(r, clean, corrupt, [MHSAHead(0, 1)], **kw),
             "ablation_effect": lambda: ablation_effect(r, clean, [MHSAHead(0, 1)], **kw),
             "random_ablation_control": lambda: random_ablation_control(r, clean, [MHSAHead(0, 1)], 1, **kw),
             "head_swap": lambda: head_swap(r, 1, 0, 1, clean),
             "mean_activations": lambda: mean_activations(r, [MHSAHead(0, 1)], clean),
             "circuit_size": lambda: circuit_size(r, task, [MHSAHead(0, 1), MHSAHead(0, 2)])}
    for name, call in calls.items():
        with pytest.raises(TraceOrderError, match=f"{name}.*cannot be called inside a model.trace"), \
                torch.no_grad(), case.model.trace(clean):
            call()

# --------------------------------------------------------------------------------------------- the metrics
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=SEEDS)
def test_generated_logit_difference_and_relative_effect_equal_their_formulas(seed):
    """``logit_difference`` = ``logits[b, position, c_b] − logits[b, position, w_b]`` in fp32 (ids as ints, lists or
    tensors, positions counted from either end, fp32 / bf16 / fp16 logits); ``relative_effect`` =
    ``(baseline − intervened) / baseline``; ``PathPatchingResult``'s effect / normalized / relative their formulas."""
    rng = random.Random(seed)
    b, s, v = rng.randint(1, 4), rng.randint(1, 6), rng.randint(2, 50)
    dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16])
    logits = (torch.randn(b, s, v, generator=torch.Generator().manual_seed(seed)) * 10).to(dtype)
    pos = rng.randrange(-s, s)
    c = [rng.randrange(v) for _ in range(b)]
    w = [rng.randrange(v) for _ in range(b)]
    as_ = rng.choice([list, torch.tensor, lambda x: x[0] if b == 1 else x])
    got = logit_difference(logits, as_(c) if as_ is not list else c, as_(w) if as_ is not list else w, pos)
    want = torch.tensor([float(logits[i, pos, c[i]]) - float(logits[i, pos, w[i]]) for i in range(b)])
    assert got.dtype == torch.float32 and got.shape == (b,)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    base, new = torch.randn(b).double() + 3, torch.randn(b).double()
    torch.testing.assert_close(relative_effect(base, new).double(), (base - new) / base, rtol=1e-6, atol=1e-6)
    from nnsight_lorsa.patching.path_patching import PathPatchingResult
    patched = torch.randn(3, b)
    res = PathPatchingResult([(MHSAHead(0, i),) for i in range(3)], [], base.float(), new.float(), patched)
    torch.testing.assert_close(res.effect, base.float()[None] - patched)
    torch.testing.assert_close(res.normalized, (base.float()[None] - patched) / (base.float() - new.float())[None])
    torch.testing.assert_close(res.relative, (base.float().mean() - patched.mean(-1)) / base.float().mean())
    k = rng.randint(0, 4)
    order = sorted(range(3), key=lambda i: -float((base.float()[None] - patched).mean(-1)[i]))
    assert res.top(k) == [res.senders[i] for i in order[:k]]


def test_top_refuses_a_k_that_is_not_a_count():
    """``top(-1)`` returned every group but the last (``order[:-1]``), ``top(1.5)`` a raw ``TypeError``."""
    from nnsight_lorsa.patching.experiments import PatchingResult
    from nnsight_lorsa.patching.path_patching import PathPatchingResult
    z = torch.zeros(3, 2)
    results = (PathPatchingResult([(MHSAHead(0, i),) for i in range(3)], [], z[0] + 1, z[0], z),
               PatchingResult([(MHSAHead(0, i),) for i in range(3)], z[0] + 1, z[0], z))
    for res in results:
        top = getattr(type(res).top, "__wrapped__", type(res).top)  # as a user calls it: no type hook
        for k in (-1, 1.5, True, None):
            with pytest.raises(ArgumentError, match="k must be an int >= 0"):
                top(res, k)
        assert len(top(res, 5)) == 3 and top(res, 0) == []
