"""SAELens 6.54.12's side of the interventions check (its own venv; ``run.py`` starts it):
``python saelens_side.py WORK``.

Reads the GPT-2 ``run.py`` wrote (``WORK/models/gpt2``) into a ``HookedSAETransformer`` — weights unprocessed
(``fold_ln`` / ``center_writing_weights`` / ``center_unembed`` / ``fold_value_biases`` off) for every group but the
centred ones, TransformerLens's default processing (all four on) for ``sl_centred`` and ``sl_centred_pair`` — makes
random SAEs and transcoders with SAELens's own classes, writes them with its ``save_model`` and reads them back with
``SAE.load_from_disk``; edits go in through forward hooks on ``<hook>.hook_sae_acts_post`` (``run_with_hooks``), the
SAEs attached by ``add_sae(sae, use_error_term=...)``. Writes, per group, ``WORK/saelens/<group>/cases.json`` and
``results.safetensors``; ``WORK/saelens/versions.json``. The random draws are the probe's (same seeds, same order): a
case of the default subset is the same case as in ``--full``.
"""

from __future__ import annotations

import random
from functools import partial
from pathlib import Path
from typing import Any

import _shared as S
import torch

L, DS = S.N_LAYERS, S.D_SAE
D, H = S.GPT2["n_embd"], S.GPT2["n_head"]
ARCHS = ["standard", "jumprelu", "topk", "gated"]
TC_ARCHS = ["transcoder", "skip_transcoder", "jumprelu_transcoder", "jumprelu_skip_transcoder"]
#: (layer, order in the layer, hook) of the SAE sites drawn from: module outputs only (an SAE file recording a module's
#: input, ``hook_resid_mid`` / ``attn.hook_z``, is refused by our loader at every key)
SITES = [(layer, o, f"blocks.{layer}.{h}") for layer in range(L)
         for o, h in ((0, "hook_resid_pre"), (2, "hook_attn_out"), (4, "hook_mlp_out"), (6, "hook_resid_post"))]
#: the seeds of the stacked groups' draws (the probe's)
DRAW_SEED = {"sl_gpt2": 1, "sl_centred": 7}
#: an edit's kinds on ``hook_sae_acts_post`` (``acts`` is (batch, pos, d_sae))
EDITS = ["set", "zero", "scale", "steer", "set_all", "zero_all", "clean"]


def hooked(hf: Any, centred: bool) -> Any:
    """The ``HookedSAETransformer`` of the HF GPT-2: unprocessed, or with TransformerLens's default processing."""
    from sae_lens import HookedSAETransformer
    from transformer_lens import HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions.gpt2 import convert_gpt2_weights

    cfg = HookedTransformerConfig(
        n_layers=L, d_model=D, d_head=D // H, n_heads=H, d_mlp=4 * D, n_ctx=32, d_vocab=S.VOCAB, act_fn="gelu_new",
        normalization_type="LN", eps=1e-5, positional_embedding_type="standard",
        original_architecture="GPT2LMHeadModel", model_name="tiny-gpt2", default_prepend_bos=False, device="cpu",
        dtype=torch.float32)
    model = HookedSAETransformer(cfg)
    model.load_and_process_state_dict(convert_gpt2_weights(hf, cfg), fold_ln=centred, center_writing_weights=centred,
                                      center_unembed=centred, fold_value_biases=centred)
    model.eval()
    model.set_use_hook_mlp_in(True)
    return model


def make_sae(arch: str, hook: str, seed: int, out_hook: str | None = None, centred: bool = False) -> Any:
    """A random SAE / transcoder of SAELens's class for ``arch`` on ``hook`` (transcoders: ``hook`` in, ``out_hook``
    out); ``apply_b_dec_to_input`` for odd seeds (SAEs); ``centred``: recorded as trained on TransformerLens's centred
    residual (``model_from_pretrained_kwargs.center_writing_weights``)."""
    from sae_lens.registry import get_sae_class

    g = torch.Generator().manual_seed(seed)
    extra: dict[str, Any] = {}
    if arch == "topk":
        extra["k"] = 5
    if arch.endswith("transcoder"):
        extra.update(d_out=D, apply_b_dec_to_input=False)
    else:
        extra["apply_b_dec_to_input"] = bool(seed % 2)
    cls, cfg_cls = get_sae_class(arch)
    sae = cls(cfg_cls(d_in=D, d_sae=DS, **extra))
    sae.cfg.metadata.hook_name = hook
    if out_hook:
        sae.cfg.metadata.hook_name_out = out_hook
    if centred:
        sae.cfg.metadata.model_from_pretrained_kwargs = {"center_writing_weights": True}
    scales = {"W_enc": 0.4, "W_dec": 0.25, "b_mag": 0.5, "r_mag": 0.3, "b_dec": 0.1, "W_skip": 0.1}
    with torch.no_grad():
        for n, p in sae.named_parameters():
            if n in ("b_enc", "b_gate"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 - 0.3)
            elif n == "threshold":
                p.copy_(torch.rand(p.shape, generator=g) * 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * scales.get(n, 0.1))
    return sae


def written(sae: Any, path: Path) -> Any:
    """``sae`` written by SAELens's ``save_model`` and read back by ``SAE.load_from_disk``."""
    from sae_lens import SAE

    sae.save_model(str(path))
    return SAE.load_from_disk(str(path))


def edit_hook(acts: torch.Tensor, hook: Any, j: int, ivs: list[dict], recorded: dict) -> torch.Tensor:
    """SAE ``j``'s edits on its ``hook_sae_acts_post`` (its value before them recorded)."""
    recorded[j] = acts.detach().clone()
    for iv in ivs:
        if iv["sae"] != j:
            continue
        p, f, v, kind = iv["pos"], iv["f"], iv["v"], iv["kind"]
        if kind == "set":
            acts[:, p, f] = v
        elif kind == "zero":
            acts[:, p, f] = 0
        elif kind == "scale":
            acts[:, p, f] *= v
        elif kind == "steer":
            acts[:, p, f] += v
        elif kind == "set_all":
            acts[:, :, f] = v
        elif kind == "zero_all":
            acts[:, :, f] = 0
        # "clean": no edit (its value written back)
    return acts


def record_input(x: torch.Tensor, hook: Any, j: int, store: dict) -> torch.Tensor:
    """SAE ``j``'s live input (``hook_sae_input``), recorded."""
    store[j] = x.detach().clone()
    return x


def draw_case(rng: random.Random, tc_archs: list[str], tc_inputs: list[str]) -> tuple[torch.Tensor, list[tuple], bool]:
    """A prompt, 1-3 SAEs / transcoders at distinct sites (sorted in the model's order) and the error flag, as the
    probe drew them (``resid_pre(l)`` = ``resid_post(l - 1)``: one of them; an MLP transcoder excludes an SAE on that
    MLP's output)."""
    n = rng.randint(4, 8)
    ids = torch.tensor([S.BOS_ID] + [rng.randint(2, S.VOCAB - 1) for _ in range(n - 1)])
    chosen: list[tuple] = []
    taken: set = set()
    for _ in range(rng.randint(1, 3)):
        if rng.random() < 0.25:
            layer = rng.randrange(L)
            arch = rng.choice(tc_archs)
            in_hook = rng.choice([f"blocks.{layer}.{h}" for h in tc_inputs])
            if ("mlp", layer) in taken or ("mlpout", layer) in taken:
                continue
            taken.add(("mlp", layer))
            chosen.append((layer, 5, arch, in_hook, f"blocks.{layer}.hook_mlp_out"))
        else:
            layer, o, hook = rng.choice(SITES)
            arch = rng.choice(ARCHS)
            site = ("resid", layer - 1) if o == 0 else ("resid", layer) if o == 6 else (hook,)
            if site in taken or (o == 4 and ("mlp", layer) in taken) or any(x[3] == hook for x in chosen):
                continue
            taken.add(site)
            if o == 4:
                taken.add(("mlpout", layer))
            chosen.append((layer, o, arch, hook, None))
    chosen.sort(key=lambda t: (t[0], t[1]))
    return ids, chosen, rng.random() < 0.6


def draw_edits(rng: random.Random, n_saes: int, n: int) -> list[dict]:
    ivs = []
    for j in range(n_saes):
        for _ in range(rng.randint(0, 3)):
            ivs.append({"sae": j, "kind": rng.choice(EDITS), "pos": rng.randrange(n), "f": rng.randrange(DS),
                        "v": round(rng.uniform(-2, 4), 3)})
    return ivs


def group_stacked(work: Path, hf: Any, group: str, full: bool) -> None:
    """``sl_gpt2`` (unprocessed model; transcoders on ``hook_resid_mid`` / ``hook_mlp_in``, with and without skip) or
    ``sl_centred`` (default processing, files recording the centred residual; transcoders without skip, also on
    ``ln2.hook_normalized``): per case 1-3 SAEs / transcoders attached together with the error term (60 %) or without,
    0-3 edits each; the logits, each SAE's features before its edits, the unedited replacement's logits, the plain
    model's; centred: also each SAE's encoder fed its own live input minus its mean (``hyp<j>``)."""
    centred = group == "sl_centred"
    out, sel = S.side_dir(work, "saelens", group), set(S.selected(group, full))
    model = hooked(hf, centred)
    tc_archs = ["transcoder", "jumprelu_transcoder"] if centred else TC_ARCHS
    tc_inputs = ["hook_resid_mid", "hook_mlp_in"] + (["ln2.hook_normalized"] if centred else [])
    rng = random.Random(DRAW_SEED[group])
    cases, tensors = [], {}
    k = 0  # the SAEs' seeds: 1000 + k, k counting every SAE drawn
    for c in range(S.FULL[group]):
        ids, chosen, use_err = draw_case(rng, tc_archs, tc_inputs)
        if c not in sel:
            k += len(chosen)
            draw_edits(rng, len(chosen), len(ids))
            continue
        model.reset_saes()
        meta = []
        for j, (layer, o, arch, hook, out_hook) in enumerate(chosen):
            d = out / f"sae_{c}_{j}"
            model.add_sae(written(make_sae(arch, hook, 1000 + k, out_hook, centred), d), use_error_term=use_err)
            k += 1
            meta.append({"dir": d.name, "arch": arch, "hook": hook, "hook_out": out_hook, "layer": layer, "order": o})
        ivs = draw_edits(rng, len(chosen), len(ids))
        recorded: dict[int, torch.Tensor] = {}
        live_in: dict[int, torch.Tensor] = {}

        hooks = []
        for j, m in enumerate(meta):
            site = m["hook_out"] or m["hook"]
            hooks.append((f"{site}.hook_sae_acts_post", partial(edit_hook, j=j, ivs=ivs, recorded=recorded)))
            if centred:
                hooks.append((f"{site}.hook_sae_input", partial(record_input, j=j, store=live_in)))
        key = f"c{c}"
        with torch.no_grad():
            tensors[f"{key}.logits"] = model.run_with_hooks(ids[None], fwd_hooks=hooks)[0]
            tensors[f"{key}.base"] = model(ids[None])[0]
            model.reset_saes()
            tensors[f"{key}.plain_tl"] = model(ids[None])[0]
            tensors[f"{key}.plain_hf"] = hf(ids[None]).logits[0]
        tensors[f"{key}.ids"] = ids
        for j in recorded:
            tensors[f"{key}.acts{j}"] = recorded[j][0]
        if centred:
            from sae_lens import SAE

            for j, m in enumerate(meta):
                x = live_in[j]
                with torch.no_grad():
                    tensors[f"{key}.hyp{j}"] = SAE.load_from_disk(str(out / m["dir"])).encode(
                        x - x.mean(-1, keepdim=True))[0]
        cases.append({"key": key, "use_error_term": use_err, "saes": meta, "ivs": ivs})
    S.save_tensors(out / "results.safetensors", tensors)
    S.write_json(out / "cases.json", cases)


def group_transcoders(work: Path, hf: Any, full: bool) -> None:
    """One transcoder spliced without the error term (``add_sae(use_error_term=False)``): the four architectures ×
    inputs ``hook_resid_mid`` / ``hook_mlp_in`` × three layers (24 cases, full; 7 tokens); the logits, the
    transcoder's input and its ``forward`` there (skip path included), and two splices by hand with plain hooks on
    the model without SAEs: ``forward(x)`` (``hand``) and ``decode(encode(x))`` (``no_skip``)."""
    out, sel = S.side_dir(work, "saelens", "sl_transcoders"), set(S.selected("sl_transcoders", full))
    model = hooked(hf, False)
    rng = random.Random(5)
    cases, tensors = [], {}
    c = 0
    for arch in TC_ARCHS:
        for in_name in ("hook_resid_mid", "hook_mlp_in"):
            for layer in range(L):
                ids = torch.tensor([S.BOS_ID] + [rng.randint(2, S.VOCAB - 1) for _ in range(6)])
                if c not in sel:
                    c += 1
                    continue
                in_hook, out_hook = f"blocks.{layer}.{in_name}", f"blocks.{layer}.hook_mlp_out"
                model.reset_saes()
                sae = written(make_sae(arch, in_hook, 5000 + c, out_hook), out / f"tc_{c}")
                model.add_sae(sae, use_error_term=False)
                key = f"t{c}"
                with torch.no_grad():
                    logits, cache = model.run_with_cache(ids[None])
                    x = cache[in_hook]
                    tensors[f"{key}.direct"] = sae(x)[0]
                    model.reset_saes()
                    for name, fn in (("hand", sae), ("no_skip", lambda v, s=sae: s.decode(s.encode(v)))):
                        tensors[f"{key}.{name}"] = model.run_with_hooks(ids[None], fwd_hooks=[
                            (out_hook, lambda a, hook, f=fn, v=x: f(v))])[0]
                tensors.update({f"{key}.ids": ids, f"{key}.logits": logits[0], f"{key}.x": x[0]})
                cases.append({"key": key, "dir": f"tc_{c}", "arch": arch, "in": in_name, "layer": layer})
                c += 1
    S.save_tensors(out / "results.safetensors", tensors)
    S.write_json(out / "cases.json", cases)


def setter(acts: torch.Tensor, hook: Any, vals: list) -> torch.Tensor:
    """``acts[:, :, f] = v`` for each ``(f, v)`` (a scalar or a (batch, pos) tensor)."""
    for f, v in vals:
        acts[:, :, f] = v
    return acts


def group_batch(work: Path, hf: Any) -> None:
    """Per-row edits in a batch of two prompts (error term on and off): three replacements (JumpReLU SAE on
    ``blocks.0.hook_resid_post``, a transcoder ``blocks.1.hook_resid_mid`` → ``hook_mlp_out``, TopK SAE on
    ``blocks.2.hook_mlp_out``); row 0: SAE0 feature 3 at position 2 set to 2.5; row 1: every SAE0 feature at position 5
    zeroed, transcoder feature 10 steered by +1 everywhere; both rows: SAE2 feature 7 at the last position × −1."""
    out = S.side_dir(work, "saelens", "sl_batch")
    model = hooked(hf, False)
    ids = torch.tensor([S.PROMPT, [0, 11, 3, 25, 7, 7, 19, 4]])
    specs = [("jumprelu", "blocks.0.hook_resid_post", None), ("transcoder", "blocks.1.hook_resid_mid",
                                                               "blocks.1.hook_mlp_out"),
             ("topk", "blocks.2.hook_mlp_out", None)]
    saes = [written(make_sae(arch, h, 7000 + j, ho), out / f"sae_{j}") for j, (arch, h, ho) in enumerate(specs)]

    def h0(a: torch.Tensor, hook: Any) -> torch.Tensor:
        a[0, 2, 3] = 2.5
        a[1, 5, :] = 0
        return a

    def h1(a: torch.Tensor, hook: Any) -> torch.Tensor:
        a[1, :, 10] += 1.0
        return a

    def h2(a: torch.Tensor, hook: Any) -> torch.Tensor:
        a[:, -1, 7] *= -1
        return a

    tensors = {"ids": ids}
    for err in (True, False):
        model.reset_saes()
        for sae in saes:
            model.add_sae(sae, use_error_term=err)
        with torch.no_grad():
            tensors[f"logits_{err}"] = model.run_with_hooks(ids, fwd_hooks=[
                ("blocks.0.hook_resid_post.hook_sae_acts_post", h0), ("blocks.1.hook_mlp_out.hook_sae_acts_post", h1),
                ("blocks.2.hook_mlp_out.hook_sae_acts_post", h2)])
    model.reset_saes()
    S.save_tensors(out / "results.safetensors", tensors)
    S.write_json(out / "cases.json", {"saes": [f"sae_{j}" for j in range(len(specs))], "transcoder": "sae_1"})


def group_experiments(work: Path, hf: Any) -> None:
    """The experiments by hand with hooks (error term on and off), 3 prompts of 8 tokens, corrupt = positions 2-4
    redrawn, metric = logit(correct) − logit(incorrect) at the last position; replacements A (JumpReLU SAE,
    ``blocks.0.hook_resid_post``), B (standard SAE, ``blocks.1.hook_mlp_out``), C (transcoder
    ``blocks.2.hook_resid_mid`` → ``hook_mlp_out``), each with its feature of largest mean clean activation.
    Activation patching (clean feature values into the corrupt run at every position: A, B, C, A+B, all three
    attached); zero and mean ablation on the clean run (A+C attached; mean over the corrupt batch and positions); path
    patching of A, B, A+B (A+B attached; corrupt values into the clean run, every later layer's ``hook_attn_out``
    frozen to its clean value, and without the freeze)."""
    out = S.side_dir(work, "saelens", "sl_experiments")
    model = hooked(hf, False)
    g = torch.Generator().manual_seed(11)
    clean = torch.cat([torch.zeros(3, 1, dtype=torch.long), torch.randint(2, S.VOCAB, (3, 7), generator=g)], 1)
    corrupt = clean.clone()
    corrupt[:, 2:5] = torch.randint(2, S.VOCAB, (3, 3), generator=g)
    correct, incorrect = torch.tensor([3, 7, 11]), torch.tensor([5, 9, 13])
    specs = {"A": ("jumprelu", "blocks.0.hook_resid_post", None), "B": ("standard", "blocks.1.hook_mlp_out", None),
             "C": ("transcoder", "blocks.2.hook_resid_mid", "blocks.2.hook_mlp_out")}
    saes = {k: written(make_sae(arch, h, 9100 + j, ho), out / k) for j, (k, (arch, h, ho)) in enumerate(specs.items())}

    def act(k: str) -> str:
        return f"{specs[k][2] or specs[k][1]}.hook_sae_acts_post"

    def metric(lo: torch.Tensor) -> torch.Tensor:
        return lo[torch.arange(3), -1, correct] - lo[torch.arange(3), -1, incorrect]

    def attach(keys: str, err: bool) -> None:
        model.reset_saes()
        for k in keys:
            model.add_sae(saes[k], use_error_term=err)

    def run(x: torch.Tensor, hooks: tuple | list = (), cache_names: tuple | list = ()) -> tuple[torch.Tensor, dict]:
        cache: dict[str, torch.Tensor] = {}

        def keep(a: torch.Tensor, hook: Any) -> torch.Tensor:
            cache[hook.name] = a.detach().clone()
            return a

        with torch.no_grad():
            lo = model.run_with_hooks(x, fwd_hooks=list(hooks) + [(n, keep) for n in cache_names])
        return lo, cache

    def put(k: str, feats: dict, value: Any) -> tuple[str, Any]:
        return act(k), partial(setter, vals=[(feats[k], value)])

    res: dict[str, torch.Tensor] = {"clean": clean, "corrupt": corrupt, "correct": correct, "incorrect": incorrect}
    meta: dict[str, Any] = {}
    for err in (True, False):
        attach("ABC", err)
        lo_clean, cc = run(clean, cache_names=[act(k) for k in "ABC"])
        feats = {k: int(cc[act(k)].mean((0, 1)).argmax()) for k in "ABC"}
        meta[f"feats_{err}"] = feats
        lo_cor, _ = run(corrupt)
        res[f"ap_clean_{err}"], res[f"ap_corrupt_{err}"] = metric(lo_clean), metric(lo_cor)
        for name in ("A", "B", "C", "AB"):
            res[f"ap_{name}_{err}"] = metric(run(corrupt, [put(k, feats, cc[act(k)][:, :, feats[k]])
                                                          for k in name])[0])
        attach("AC", err)
        res[f"ab_base_{err}"] = metric(run(clean)[0])
        res[f"ab_zero_{err}"] = metric(run(clean, [put(k, feats, 0.0) for k in "AC"])[0])
        _, cm = run(corrupt, cache_names=[act(k) for k in "AC"])
        res[f"ab_mean_{err}"] = metric(run(clean, [put(k, feats, cm[act(k)][:, :, feats[k]].mean())
                                                   for k in "AC"])[0])
        attach("AB", err)
        attn = [f"blocks.{layer}.hook_attn_out" for layer in range(L)]
        lo_c, cc = run(clean, cache_names=[act(k) for k in "AB"] + attn)
        _, cr = run(corrupt, cache_names=[act(k) for k in "AB"])
        res[f"pp_clean_{err}"] = metric(lo_c)
        first_later = {"A": 1, "B": 2}
        for name in ("A", "B", "AB"):
            senders = [put(k, feats, cr[act(k)][:, :, feats[k]]) for k in name]
            frozen = [(f"blocks.{layer}.hook_attn_out", lambda a, hook, c=cc: c[hook.name])
                      for layer in range(min(first_later[k] for k in name), L)]
            res[f"pp_{name}_{err}"] = metric(run(clean, senders + frozen)[0])
            res[f"ppfree_{name}_{err}"] = metric(run(clean, senders)[0])
    model.reset_saes()
    S.save_tensors(out / "results.safetensors", res)
    S.write_json(out / "cases.json", meta)


def group_centred_pair(work: Path, hf: Any) -> None:
    """The centred-residual difference on one prompt (default processing, files recording it, error term on): two
    standard SAEs (``blocks.0.hook_resid_post``, ``blocks.1.hook_resid_post``); run A ablates SAE 1's feature most
    active at position 3 (there), recording SAE 2's features and live input; run B also zeroes the SAE-2 feature
    that run A moved most, at every position."""
    from sae_lens.registry import get_sae_class

    out = S.side_dir(work, "saelens", "sl_centred_pair")
    model = hooked(hf, True)
    hooks = ["blocks.0.hook_resid_post", "blocks.1.hook_resid_post"]
    saes = []
    for i, hook in enumerate(hooks):
        cls, cfg_cls = get_sae_class("standard")
        sae = cls(cfg_cls(d_in=D, d_sae=DS, apply_b_dec_to_input=False))
        g = torch.Generator().manual_seed(i)
        with torch.no_grad():
            sae.W_enc.copy_(torch.randn(D, DS, generator=g) * 0.4)
            sae.b_enc.copy_(torch.randn(DS, generator=g) * 0.5 - 0.3)
            sae.W_dec.copy_(torch.randn(DS, D, generator=g) * 0.25)
            sae.b_dec.copy_(torch.randn(D, generator=g) * 0.1)
        sae.cfg.metadata.hook_name = hook
        sae.cfg.metadata.model_from_pretrained_kwargs = {"center_writing_weights": True}
        saes.append(written(sae, out / f"sae{i}"))
        model.add_sae(saes[-1], use_error_term=True)
    ids = torch.tensor([S.PROMPT])
    acts1, acts2 = f"{hooks[0]}.hook_sae_acts_post", f"{hooks[1]}.hook_sae_acts_post"
    rec: dict[str, torch.Tensor] = {}

    def ablate_f(a: torch.Tensor, hook: Any, f: int) -> torch.Tensor:
        a[:, 3, f] = 0
        return a

    def keep(a: torch.Tensor, hook: Any, name: str) -> torch.Tensor:
        rec[name] = a.detach().clone()
        return a

    with torch.no_grad():
        _, cache = model.run_with_cache(ids)
        f = int(cache[acts1][0, 3].argmax())
        lo_a = model.run_with_hooks(ids, fwd_hooks=[(acts1, partial(ablate_f, f=f)),
                                                     (acts2, partial(keep, name="acts2")),
                                                     (f"{hooks[1]}.hook_sae_input", partial(keep, name="x2"))])
        g_feat = int((rec["acts2"] - cache[acts2]).abs().amax((0, 1)).argmax())
        lo_b = model.run_with_hooks(ids, fwd_hooks=[(acts1, partial(ablate_f, f=f)),
                                                     (acts2, partial(setter, vals=[(g_feat, 0.0)]))])
        x2 = rec["x2"]
        hyp2 = saes[1].encode(x2 - x2.mean(-1, keepdim=True))
    model.reset_saes()
    S.save_tensors(out / "results.safetensors", {"ids": ids, "acts2": rec["acts2"], "hyp2": hyp2, "logits_a": lo_a,
                                                 "logits_b": lo_b})
    S.write_json(out / "cases.json", {"f": f, "g": g_feat, "saes": ["sae0", "sae1"]})


def main() -> None:
    work, full, hf = S.start_peer_side()
    group_stacked(work, hf, "sl_gpt2", full)
    group_stacked(work, hf, "sl_centred", full)
    group_transcoders(work, hf, full)
    group_batch(work, hf)
    group_experiments(work, hf)
    group_centred_pair(work, hf)
    S.write_json(S.side_dir(work, "saelens") / "versions.json",
                 S.versions("sae-lens", "transformer-lens", "transformers", "torch"))
    print("[saelens_side] done", flush=True)


if __name__ == "__main__":
    main()
