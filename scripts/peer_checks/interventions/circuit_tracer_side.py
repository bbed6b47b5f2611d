"""circuit-tracer 0.5.0's side of the interventions check (its own venv; ``run.py`` starts it):
``python circuit_tracer_side.py WORK``.

Reads the models ``run.py`` wrote (``WORK/models/gpt2``, ``WORK/models/llama``), makes random transcoders with
circuit-tracer's own classes, writes them with its ``to_safetensors`` (plus the ``config.yaml`` its loaders read;
TopK sets, which its files cannot record, also as raw tensors), and runs its TransformerLens replacement model's
``feature_intervention``. Writes, per group, ``WORK/circuit_tracer/<group>/cases.json`` and ``results.safetensors``;
``WORK/circuit_tracer/versions.json``. The random draws are the probe's (same seeds, same order): a case of the default
subset is the same case as in ``--full``.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import _shared as S
import torch
import yaml

CPU = torch.device("cpu")
L = S.N_LAYERS


# ------------------------------------------------------------------------------------------------------------ GPT-2
def gpt2_tl_config(model_dir: Path) -> Any:
    from transformer_lens import HookedTransformerConfig

    d, h = S.GPT2["n_embd"], S.GPT2["n_head"]
    return HookedTransformerConfig(
        n_layers=L, d_model=d, d_head=d // h, n_heads=h, d_mlp=4 * d, n_ctx=32, d_vocab=S.VOCAB, act_fn="gelu_new",
        normalization_type="LN", eps=1e-5, positional_embedding_type="standard",
        original_architecture="GPT2LMHeadModel", tokenizer_name=str(model_dir), model_name="tiny-gpt2",
        default_prepend_bos=True, device="cpu", dtype=torch.float32)


def gpt2_replacement(hf: Any, model_dir: Path, ts: Any) -> Any:
    """circuit-tracer's TransformerLens replacement model of the HF GPT-2 (weights unprocessed) with ``ts``."""
    from circuit_tracer.replacement_model.replacement_model_transformerlens import TransformerLensReplacementModel
    from transformer_lens.pretrained.weight_conversions.gpt2 import convert_gpt2_weights

    cfg = gpt2_tl_config(model_dir)
    m = TransformerLensReplacementModel(cfg)
    m.load_and_process_state_dict(convert_gpt2_weights(hf, cfg), fold_ln=False, center_writing_weights=False,
                                  center_unembed=False, fold_value_biases=False)
    m._configure_replacement_model(ts)
    return m


def single_layer(layer: int, act: str, skip: bool, g: torch.Generator, d: int, d_tc: int, scales: dict) -> Any:
    from circuit_tracer.transcoder.activation_functions import JumpReLU, TopK
    from circuit_tracer.transcoder.single_layer_transcoder import SingleLayerTranscoder

    a = (JumpReLU(torch.rand(d_tc, generator=g) * scales["theta"], 0.1) if act == "jumprelu"
         else TopK(6) if act == "topk" else torch.nn.functional.relu)
    tc = SingleLayerTranscoder(d, d_tc, a, layer, skip_connection=skip, device=CPU, dtype=torch.float32)
    with torch.no_grad():
        tc.W_enc.copy_(torch.randn(d_tc, d, generator=g) * scales["enc"])
        tc.b_enc.copy_(torch.randn(d_tc, generator=g) * 0.5 - (0.0 if act == "topk" else scales["shift"]))
        tc.W_dec.copy_(torch.randn(d_tc, d, generator=g) * scales["dec"])
        tc.b_dec.copy_(torch.randn(d, generator=g) * 0.05)
        if skip:
            tc.W_skip.copy_(torch.randn(d, d, generator=g) * 0.1)
    return tc


def write_set(ts: Any, out: Path, in_hook: str, out_hook: str) -> None:
    ts.to_safetensors(str(out))
    (out / "config.yaml").write_text(yaml.safe_dump({
        "model_kind": "transcoder_set", "feature_input_hook": in_hook, "feature_output_hook": out_hook,
        "scan": "tiny", "transcoders": [f"layer_{layer}.safetensors" for layer in range(L)]}))


def write_clt(clt: Any, out: Path) -> None:
    clt.to_safetensors(str(out))
    (out / "config.yaml").write_text(yaml.safe_dump({
        "model_kind": "cross_layer_transcoder", "feature_input_hook": clt.feature_input_hook,
        "feature_output_hook": clt.feature_output_hook}))


GPT2_SETS = [("relu", "relu", False), ("jumprelu", "jumprelu", False), ("skip", "relu", True),
             ("jumprelu_skip", "jumprelu", True), ("topk", "topk", False)]
GPT2_CLTS = [("clt_relu", "relu"), ("clt_jumprelu", "jump_relu")]


def gpt2_modules(out: Path) -> dict[str, Any]:
    """The five per-layer sets and two CLTs on ``mlp.hook_in`` / ``mlp.hook_out``, written to ``out/<name>``."""
    from circuit_tracer.transcoder.cross_layer_transcoder import CrossLayerTranscoder
    from circuit_tracer.transcoder.single_layer_transcoder import TranscoderSet

    d = S.GPT2["n_embd"]
    scales = {"theta": 0.6, "enc": 0.3, "dec": 0.3, "shift": 0.4}
    mods: dict[str, Any] = {}
    for i, (name, act, skip) in enumerate(GPT2_SETS):
        g = torch.Generator().manual_seed(10 + i)
        ts = TranscoderSet({layer: single_layer(layer, act, skip, g, d, S.D_TC_GPT2, scales) for layer in range(L)},
                           feature_input_hook="mlp.hook_in", feature_output_hook="mlp.hook_out", scan="tiny")
        write_set(ts, out / name, "mlp.hook_in", "mlp.hook_out")
        if act == "topk":  # circuit-tracer's files cannot say TopK: the raw tensors, for our side to build from
            S.save_tensors(out / name / "topk_raw.safetensors",
                           {f"{k}_{layer}": v for layer, tc in enumerate(ts) for k, v in tc.state_dict().items()})
        mods[name] = ts
    for i, (name, act) in enumerate(GPT2_CLTS):
        g = torch.Generator().manual_seed(50 + i)
        clt = CrossLayerTranscoder(L, S.D_TC_GPT2, d, activation_function=act, lazy_decoder=False,
                                   lazy_encoder=False, device=CPU, dtype=torch.float32,
                                   feature_input_hook="mlp.hook_in", feature_output_hook="mlp.hook_out")
        with torch.no_grad():
            for n, p in clt.named_parameters():
                if "W_enc" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)
                elif "b_enc" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.5 - 0.4)
                elif "W_dec" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.2)
                elif "b_dec" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
                elif "threshold" in n:
                    p.copy_(torch.rand(p.shape, generator=g) * 0.6)
        write_clt(clt, out / name)
        mods[name] = clt
    return mods


def draw_interventions(rng: random.Random, n: int, acts: torch.Tensor, d_tc: int, kinds: list[str],
                       most: int) -> list[list]:
    """1 to ``most`` interventions ``[layer, pos | "all1", feature, value]`` on a prompt of ``n`` tokens, as the probe
    drew them (``acts``: circuit-tracer's clean activation cache, for the active and clean-value kinds)."""
    ivs: list[list] = []
    for _ in range(rng.randint(1, most)):
        layer, pos, f = rng.randrange(L), rng.randint(1, n - 1), rng.randrange(d_tc)
        kind = rng.choice(kinds)
        if kind in ("active_zero", "zero_active"):  # an active feature's ablation
            active = (acts[layer, 1:] != 0).nonzero()
            if len(active):
                pp, ff = active[rng.randrange(len(active))].tolist()
                pos, f = pp + 1, ff
            ivs.append([layer, pos, f, 0.0])
        elif kind == "zero":
            ivs.append([layer, pos, f, 0.0])
        elif kind == "clean":  # its own clean value (circuit-tracer's activation cache)
            ivs.append([layer, pos, f, float(acts[layer, pos, f])])
        elif kind in ("all_pos", "all"):  # every position but BOS
            ivs.append([layer, "all1", f, round(rng.uniform(-1, 3), 3)])
        else:
            ivs.append([layer, pos, f, round(rng.uniform(-2, 4), 3)])
    return ivs


def ct_interventions(ivs: list[list]) -> list[tuple]:
    return [(layer, slice(1, None) if p == "all1" else p, f, v) for layer, p, f, v in ivs]


def group_ct_gpt2(work: Path, hf: Any, mods: dict[str, Any], full: bool) -> None:
    """``feature_intervention(freeze_attention=False)`` (free: no frozen attention or layer constraint) on 25 cases
    per module (full): prompts of 5-9 tokens; 1-4 interventions each (set to a value, zero, zero an active feature,
    set to its clean value, set at every position from 1 on)."""
    out, sel = S.side_dir(work, "circuit_tracer", "ct_gpt2"), set(S.selected("ct_gpt2", full))
    mdir = S.model_dir(work, "gpt2")
    rng = random.Random(0)
    cases, tensors = [], {}
    for name, ts in mods.items():
        m = gpt2_replacement(hf, mdir, ts)
        for c in range(S.FULL["ct_gpt2"]):
            n = rng.randint(5, 9)
            ids = torch.tensor([S.BOS_ID] + [rng.randint(2, S.VOCAB - 1) for _ in range(n - 1)])
            with torch.no_grad():
                _, acts = m.get_activations(ids)  # (layer, pos, feature)
            ivs = draw_interventions(rng, n, acts, S.D_TC_GPT2, ["set", "zero", "clean", "active_zero", "all_pos"], 4)
            rng.randrange(4)  # the probe's second run's mode (freeze_attention / constrained_layers): not run here
            if c not in sel:
                continue
            key = f"{name}_{c}"
            with torch.no_grad():
                tensors[f"{key}.plain"] = hf(ids[None]).logits[0]
                tensors[f"{key}.base"] = m(ids[None])[0]
            logits, a = m.feature_intervention(ids, ct_interventions(ivs), freeze_attention=False)
            tensors.update({f"{key}.ids": ids, f"{key}.clean_acts": acts, f"{key}.logits": logits[0],
                            f"{key}.acts": a})
            cases.append({"key": key, "module": name, "ivs": ivs})
        del m
    S.save_tensors(out / "results.safetensors", tensors)
    S.write_json(out / "cases.json", cases)


def group_ct_constrained(work: Path, hf: Any, mods: dict[str, Any], full: bool) -> None:
    """An active feature zeroed with ``constrained_layers=range(n_layers)`` (every layer's MLP and attention frozen: the
    feature's direct effect) and with ``freeze_attention=True`` only, on one 10-token prompt, 8 features per module
    (full; a random permutation of the active ones, seed 3)."""
    out, sel = S.side_dir(work, "circuit_tracer", "ct_constrained"), S.selected("ct_constrained", full)
    mdir = S.model_dir(work, "gpt2")
    ids = torch.tensor(S.PROMPT_10)
    tensors: dict[str, torch.Tensor] = {"ids": ids}
    meta: dict[str, list] = {}
    for name in ("relu", "jumprelu", "skip", "jumprelu_skip", "clt_relu", "clt_jumprelu"):
        m = gpt2_replacement(hf, mdir, mods[name])
        with torch.no_grad():
            base = m(ids[None])[0, -1]
            _, acts = m.get_activations(ids)
        active = (acts[:, 1:] > 0).nonzero()
        g = torch.Generator().manual_seed(3)
        pick = active[torch.randperm(len(active), generator=g)[:S.FULL["ct_constrained"]]].tolist()
        meta[name] = []
        for i in sel:
            layer, p, f = pick[i]
            p += 1
            lo, _ = m.feature_intervention(ids, [(layer, p, f, 0.0)], constrained_layers=range(L))
            lo_f, _ = m.feature_intervention(ids, [(layer, p, f, 0.0)], freeze_attention=True)
            tensors[f"{name}_{i}"], tensors[f"{name}_{i}_fa"] = lo[0, -1], lo_f[0, -1]
            meta[name].append({"i": i, "layer": layer, "pos": p, "feature": f, "act": float(acts[layer, p, f])})
        tensors[f"{name}_base"] = base
        del m
    S.save_tensors(out / "results.safetensors", tensors)
    S.write_json(out / "cases.json", meta)


def group_ct_bos(work: Path, hf: Any, mods: dict[str, Any]) -> None:
    """The BOS ablation (ReLU set, layer 1, the feature most active at BOS): at position 0 and at ``slice(None)``."""
    out = S.side_dir(work, "circuit_tracer", "ct_bos")
    ts = mods["relu"]
    m = gpt2_replacement(hf, S.model_dir(work, "gpt2"), ts)
    ids = torch.tensor(S.PROMPT)
    with torch.no_grad():
        m.reset_hooks()
        _, cache = m.run_with_cache(ids[None])
        true = torch.stack([ts[layer].encode(cache[f"blocks.{layer}.mlp.hook_in"][0]) for layer in range(L)])
        _, acts = m.get_activations(ids)
        plain = hf(ids[None]).logits[0]
    layer = 1
    f = int(true[layer, 0].argmax())
    lo_bos, _ = m.feature_intervention(ids, [(layer, 0, f, 0.0)], freeze_attention=False)
    lo_all, _ = m.feature_intervention(ids, [(layer, slice(None), f, 0.0)], freeze_attention=False)
    S.save_tensors(out / "results.safetensors", {"ids": ids, "plain": plain, "bos": lo_bos[0], "all": lo_all[0]})
    S.write_json(out / "cases.json", {"layer": layer, "feature": f, "true_activation_at_bos": float(true[layer, 0, f]),
                                      "circuit_tracer_cache_at_bos": float(acts[layer, 0, f])})


def group_ct_call_options(work: Path, hf: Any, mods: dict[str, Any]) -> None:
    """Scale / steer as circuit-tracer expresses them (a set to ``-2a`` / ``a + 1.5`` from its cached ``a``; ReLU set)
    and ``feature_intervention``'s options ``apply_activation_function=False``, ``sparse=True``,
    ``return_activations=False`` (JumpReLU set) on one prompt."""
    out = S.side_dir(work, "circuit_tracer", "ct_call_options")
    mdir = S.model_dir(work, "gpt2")
    ids = torch.tensor(S.PROMPT)
    m = gpt2_replacement(hf, mdir, mods["relu"])
    with torch.no_grad():
        _, acts = m.get_activations(ids)
    layer, pos = 0, 3
    f = int(acts[layer, pos].argmax())
    a = float(acts[layer, pos, f])
    lo_scale, _ = m.feature_intervention(ids, [(layer, pos, f, -2.0 * a)], freeze_attention=False)
    lo_steer, _ = m.feature_intervention(ids, [(layer, pos, f, a + 1.5)], freeze_attention=False)
    del m
    m = gpt2_replacement(hf, mdir, mods["jumprelu"])
    ivs = [(0, 3, 7, 2.0), (1, slice(1, None), 11, 0.0)]
    lo_pre, pre = m.feature_intervention(ids, ivs, freeze_attention=False, apply_activation_function=False)
    lo_sparse, sparse = m.feature_intervention(ids, ivs, freeze_attention=False, sparse=True)
    lo_none, _ = m.feature_intervention(ids, ivs, freeze_attention=False, return_activations=False)
    S.save_tensors(out / "results.safetensors", {
        "ids": ids, "scale": lo_scale[0], "steer": lo_steer[0], "pre_logits": lo_pre[0], "pre": pre,
        "sparse_logits": lo_sparse[0], "sparse": sparse, "none_logits": lo_none[0]})
    S.write_json(out / "cases.json", {"scale_steer": {"layer": layer, "pos": pos, "feature": f, "activation": a,
                                                      "scale": -2.0, "steer": 1.5},
                                      "options": [[0, 3, 7, 2.0], [1, "all1", 11, 0.0]]})


# ------------------------------------------------------------------------------------------------------------ Llama
LLAMA_COMBOS = [("mlp.hook_in", "mlp.hook_out", "relu", False), ("hook_resid_mid", "hook_mlp_out", "jumprelu", True),
                ("ln2.hook_normalized", "hook_mlp_out", "relu", False),
                ("ln2.hook_normalized", "mlp.hook_out", "jumprelu", True),
                ("clt", "hook_resid_mid", "hook_mlp_out"), ("clt", "mlp.hook_in", "mlp.hook_out")]


def group_ct_llama(work: Path, full: bool) -> None:
    """circuit-tracer's ``ReplacementModel.from_config(..., backend="transformerlens")`` of the Llama, the weights
    loaded from the HF model, per-layer sets and CLTs on six hook pairs; free ``feature_intervention``, 8 cases per
    pair (full): 5-9 tokens, 1-3 interventions (set, zero an active feature, set from position 1 on)."""
    from circuit_tracer import ReplacementModel
    from circuit_tracer.transcoder.cross_layer_transcoder import CrossLayerTranscoder
    from circuit_tracer.transcoder.single_layer_transcoder import TranscoderSet
    from transformer_lens import HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions.llama import convert_llama_weights
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    out, sel = S.side_dir(work, "circuit_tracer", "ct_llama"), set(S.selected("ct_llama", full))
    mdir = S.model_dir(work, "llama")
    d, nh, nkv = S.LLAMA["hidden_size"], S.LLAMA["num_attention_heads"], S.LLAMA["num_key_value_heads"]
    tok = PreTrainedTokenizerFast.from_pretrained(str(mdir))
    hf = LlamaForCausalLM.from_pretrained(str(mdir)).eval()
    cfg = HookedTransformerConfig(
        d_model=d, d_head=d // nh, n_heads=nh, d_mlp=S.LLAMA["intermediate_size"], n_layers=L, n_ctx=64, eps=1e-5,
        d_vocab=S.VOCAB, act_fn="silu", normalization_type="RMS", positional_embedding_type="rotary",
        rotary_adjacent_pairs=False, rotary_dim=d // nh, final_rms=True, gated_mlp=True, n_key_value_heads=nkv,
        rotary_base=10000.0, original_architecture="LlamaForCausalLM", tokenizer_prepends_bos=True,
        dtype=torch.float32, default_prepend_bos=False)
    state = convert_llama_weights(hf, cfg)
    scales = {"theta": 0.3, "enc": 0.25, "dec": 0.2, "shift": 0.3}

    def clt(in_hook: str, out_hook: str, seed: int) -> Any:
        g = torch.Generator().manual_seed(seed)
        c = CrossLayerTranscoder(L, S.D_TC_LLAMA, d, activation_function="relu", lazy_decoder=False,
                                 lazy_encoder=False, device=CPU, dtype=torch.float32, feature_input_hook=in_hook,
                                 feature_output_hook=out_hook)
        with torch.no_grad():
            for n, p in c.named_parameters():
                p.copy_(torch.randn(p.shape, generator=g) * (0.25 if "W_enc" in n else 0.2 if "W_dec" in n else 0.3)
                        - (0.3 if "b_enc" in n else 0))
        return c

    rng = random.Random(3)
    cases, tensors = [], {}
    for ci, combo in enumerate(LLAMA_COMBOS):
        mod_dir = out / f"m{ci}"
        if combo[0] == "clt":
            ts = clt(combo[1], combo[2], 100 + ci)
            write_clt(ts, mod_dir)
        else:
            in_hook, out_hook, act, skip = combo
            g = torch.Generator().manual_seed(10 + ci)
            ts = TranscoderSet({layer: single_layer(layer, act, skip, g, d, S.D_TC_LLAMA, scales)
                                for layer in range(L)},
                               feature_input_hook=in_hook, feature_output_hook=out_hook, scan="tiny")
            write_set(ts, mod_dir, in_hook, out_hook)
        m = ReplacementModel.from_config(cfg, ts, backend="transformerlens")
        renamed = {k.replace(".mlp.", ".mlp.old_mlp.").replace("unembed.", "unembed.old_unembed."): v
                   for k, v in state.items()}
        loaded = m.load_state_dict(renamed, strict=False)
        if loaded.unexpected_keys:
            raise SystemExit(f"circuit-tracer's Llama replacement model: unexpected keys {loaded.unexpected_keys}")
        m.set_tokenizer(tok, default_padding_side="right")
        for c in range(S.FULL["ct_llama"]):
            n = rng.randint(5, 9)
            ids = torch.tensor([S.BOS_ID] + [rng.randint(2, S.VOCAB - 1) for _ in range(n - 1)])
            with torch.no_grad():
                _, acts = m.get_activations(ids)
            ivs = draw_interventions(rng, n, acts, S.D_TC_LLAMA, ["set", "zero_active", "all"], 3)
            if c not in sel:
                continue
            key = f"m{ci}_{c}"
            with torch.no_grad():
                tensors[f"{key}.base"] = m(ids[None])[0]
                tensors[f"{key}.plain"] = hf(ids[None]).logits[0]
            lo, a = m.feature_intervention(ids, ct_interventions(ivs), freeze_attention=False)
            tensors.update({f"{key}.ids": ids, f"{key}.logits": lo[0], f"{key}.acts": a, f"{key}.clean_acts": acts})
            cases.append({"key": key, "module": mod_dir.name, "clt": combo[0] == "clt",
                          "hooks": list(combo[1:3]) if combo[0] == "clt" else list(combo[:2]), "ivs": ivs})
        del m
    S.save_tensors(out / "results.safetensors", tensors)
    S.write_json(out / "cases.json", cases)


def main() -> None:
    work, full, hf = S.start_peer_side()
    mods = gpt2_modules(S.side_dir(work, "circuit_tracer", "gpt2_modules"))
    group_ct_gpt2(work, hf, mods, full)
    group_ct_constrained(work, hf, mods, full)
    group_ct_bos(work, hf, mods)
    group_ct_call_options(work, hf, mods)
    group_ct_llama(work, full)
    S.write_json(S.side_dir(work, "circuit_tracer") / "versions.json",
                 S.versions("circuit-tracer", "transformer-lens", "transformers", "torch"))
    print("[circuit_tracer_side] done", flush=True)


if __name__ == "__main__":
    main()
