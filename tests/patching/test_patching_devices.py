"""Patching, head analysis, dashboards and sparse attention with the model on a device and in a dtype.

Every device-parametrised test runs a workflow on ``device`` (the CPU always; CUDA as a ``gpu`` case,
skipped without one) and checks its numbers against the same workflow on the fp32 CPU model, as a
relative bound: ``max |got − want| / max |want| < DEVICE_REL`` (1e-4: fp32 on another device differs
by kernel rounding only). The replacement modules are built once in fp32 on the CPU and copied to the
device, and the model is the same random model moved there, so both runs compute the same function.

The dtype tests (CPU) run the model in bf16 / fp16 with fp32 replacement modules and the reverse; each
bound below is stated next to its test, and each test also checks that the effect it bounds is several
times larger than the bound (so that an intervention that did nothing would fail).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from helpers import DEVICES, make_lorsa, make_sae, make_transcoders, random_ids, relative, tiny_nnsight, unembed

from nnsight_lorsa import get_adapter
from nnsight_lorsa.analysis.heads import collect_top_activations, mhsa_correlation, ov_feature_cosines, ov_logit_lens
from nnsight_lorsa.analysis.qk_ablation import qk_feature_impacts
from nnsight_lorsa.errors import PlacementError
from nnsight_lorsa.patching import Feature, LorsaHead, MHSAHead, ablate, mean_activations, patch, read, scale, steer
from nnsight_lorsa.patching.circuit import circuit_size
from nnsight_lorsa.patching.experiments import ablation_effect, activation_patching, random_ablation_control
from nnsight_lorsa.patching.path_patching import HeadInput, path_patching
from nnsight_lorsa.patching.tasks import induction_task
from nnsight_lorsa.viz.dashboard import head_dashboard_data

#: relative bound of a device run against the fp32 CPU run
DEVICE_REL = 1e-4
LAYER = 1


_BASE: dict[str, Any] = {}


def base() -> dict[str, Any]:
    """The fp32 CPU replacement modules (built once, from the fp32 CPU model)."""
    if not _BASE:
        model, hf = tiny_nnsight("llama")
        _BASE["lorsa"] = make_lorsa(hf, get_adapter(model), LAYER)
        _BASE["tcs"] = make_transcoders((0, 2), skip_layer=2)
        _BASE["sae"] = make_sae()
    return _BASE


def setup(device: str = "cpu", dtype: torch.dtype = torch.float32, rep_dtype: torch.dtype | None = None,
          rep_device: str | None = None, sae: bool = False):
    """(nnsight model, HF model, ReplacementModel) on ``device`` in ``dtype``; the Lorsa of layer 1 and the
    transcoders of layers 0, 2 (and an SAE on layer 2's output) on ``rep_device`` in ``rep_dtype``
    (default: the model's)."""
    b = base()
    rep_device = device if rep_device is None else rep_device
    rep_dtype = dtype if rep_dtype is None else rep_dtype
    model, hf = tiny_nnsight("llama", device=device, dtype=dtype)

    def move(m):
        return copy.deepcopy(m).to(device=rep_device, dtype=rep_dtype)

    from nnsight_lorsa import ReplacementModel

    r = ReplacementModel(model, lorsas={LAYER: move(b["lorsa"])},
                         transcoders={k: move(v) for k, v in b["tcs"].items()},
                         saes={"model.layers.2": move(b["sae"])} if sae else None)
    return model, hf, r


TARGETS = [MHSAHead(0, 1), LorsaHead(LAYER, 3), Feature(2, 5, "transcoder")]


def intervene(model, r, ids, clean_vals=None):
    """Ablate / scale / steer / patch through the bundle; returns the logits (and the values read)."""
    with torch.no_grad(), model.trace(ids):
        r.prepare(TARGETS + [LorsaHead(LAYER, 7)])
        ablate(r(TARGETS[0]), positions=[2, 5])
        scale(r(TARGETS[1]), 3.0)
        read_l = read(r(LorsaHead(LAYER, 7)))
        if clean_vals is not None:
            patch(r(LorsaHead(LAYER, 7)), clean_vals, positions=-1)
        steer(r(TARGETS[2]), 2.0)
        logits = unembed(model).output.save()
    return logits, read_l


@pytest.mark.parametrize("device", DEVICES)
def test_interventions_through_the_bundle_on_device(device):
    """ablate / scale / read / patch / steer on MHSA heads, Lorsa heads and transcoder features."""
    ids = random_ids()
    other = random_ids(seed=7)
    model0, hf0, r0 = setup()
    _, src0 = intervene(model0, r0, other)
    want, read0 = intervene(model0, r0, ids, src0[:, -1])
    model, hf, r = setup(device)
    _, src = intervene(model, r, other.to(device))  # token ids on the device, or on the CPU: both work
    got, read_d = intervene(model, r, ids, src0[:, -1])  # values patched in from the CPU run
    assert got.device.type == device
    assert max(relative(got, want), relative(read_d, read0), relative(src, src0)) < DEVICE_REL
    plain = hf0(ids).logits
    assert relative(want, plain) > 100 * DEVICE_REL  # the interventions did something


@pytest.mark.parametrize("device", DEVICES)
def test_activation_patching_and_mean_ablation_on_device(device):
    ids, corrupt = random_ids(), random_ids(seed=5)
    groups = [MHSAHead(0, 0), LorsaHead(LAYER, 3), (MHSAHead(2, 1), Feature(2, 5, "transcoder"))]
    kw = {"correct_ids": torch.tensor([5, 9]), "incorrect_ids": 6}
    results = []
    for dev in ("cpu", device):
        model, hf, r = setup(dev)
        means = mean_activations(setup()[2], [MHSAHead(1, 2), LorsaHead(LAYER, 4)], corrupt)  # CPU means
        res = activation_patching(r, ids, corrupt, groups, **kw)
        ab = ablation_effect(r, ids, [MHSAHead(1, 2), LorsaHead(LAYER, 4)], mode="mean", means=means, **kw)
        ctl = random_ablation_control(r, ids, [MHSAHead(0, h) for h in range(4)], 2, n_samples=2, **kw)
        for t in (res.clean, res.patched, ab.ablated, ctl.samples):
            assert t.device.type == "cpu" and t.dtype == torch.float32
        results.append((res.clean, res.corrupt, res.patched, ab.ablated, ab.relative, ctl.samples))
    for got, want in zip(results[1], results[0], strict=True):
        assert relative(got, want) < DEVICE_REL
    assert relative(results[0][3], results[0][0]) > 100 * DEVICE_REL  # the mean ablation moved the metric


@pytest.mark.parametrize("device", DEVICES)
def test_path_patching_on_device(device):
    clean, corrupt = random_ids(), random_ids(seed=5)
    senders = [MHSAHead(0, 2), LorsaHead(LAYER, 3), Feature(0, 7, "transcoder"), (MHSAHead(0, 1), MHSAHead(2, 2))]
    kw = {"correct_ids": 5, "incorrect_ids": 6}
    out = []
    for dev in ("cpu", device):
        model, hf, r = setup(dev)
        res = path_patching(r, clean, senders, corrupt=corrupt, **kw)
        recv = path_patching(r, clean, [MHSAHead(0, 2)], corrupt=corrupt, receivers=[HeadInput(MHSAHead(2, 1), "v")],
                             **kw)
        means = {MHSAHead(0, 2): torch.zeros(16, dtype=torch.float64), LorsaHead(LAYER, 3): torch.tensor(0.25)}
        mean = path_patching(r, clean, [MHSAHead(0, 2), LorsaHead(LAYER, 3)], mode="mean", means=means, **kw)
        out.append((res.clean, res.corrupt, res.patched, recv.patched, mean.patched))
    for got, want in zip(out[1], out[0], strict=True):
        assert relative(got, want) < DEVICE_REL
    assert relative(out[0][2], out[0][0][None].expand_as(out[0][2])) > 100 * DEVICE_REL


@pytest.mark.parametrize("device", DEVICES)
def test_circuit_size_and_task_builders_on_device(device):
    """A task built on the CPU feeds traces on the device (as built, moved with ``TaskBatch.to``, a
    ``select``ed sub-batch); circuit size with MHSA and Lorsa heads, mean fills from the CPU."""
    out = []
    for dev in ("cpu", device):
        model, hf, r = setup(dev)
        task = induction_task(model.tokenizer, n_prompts=3, seq_len=5, seed=0)
        assert task.clean.device.type == "cpu"
        comps = [MHSAHead(layer, h) for layer in (0, 2) for h in range(4)] + [LorsaHead(LAYER, h) for h in range(4)]
        means = mean_activations(setup()[2], comps, task.corrupt)
        cs = circuit_size(r, task.to(dev), comps, mode="mean", means=means, ks=[0, 2, 5, 12])
        sub = task.select([0, 2]).to(dev)
        ab = ablation_effect(r, sub.clean, comps[:3], correct_ids=sub.correct_ids, incorrect_ids=sub.incorrect_ids)
        assert cs.scores.device.type == "cpu" and cs.per_prompt_curve.device.type == "cpu"
        out.append((cs.scores, cs.per_prompt_curve, cs.global_curve, cs.metric_all, cs.metric_none, ab.ablated,
                    cs.per_prompt_k, torch.tensor(cs.global_k)))
    for got, want in zip(out[1][:6], out[0][:6], strict=True):
        assert relative(got, want) < 1e-3  # curves are ratios of metric differences: looser
    assert torch.equal(out[1][6], out[0][6]) and torch.equal(out[1][7], out[0][7])


def _analysis(device: str, dtype: torch.dtype = torch.float32, rep_dtype: torch.dtype | None = None,
              rep_device: str | None = None) -> dict[str, Any]:
    model, hf, r = setup(device, dtype, rep_dtype, rep_device)
    tokens = random_ids(batch=6, seq=12, seed=11)
    vals, ids, strings = ov_logit_lens(r, LAYER, [0, 3, 5], k=5)
    top = collect_top_activations(r, LAYER, tokens, n_top=3, batch_size=4)
    corr = mhsa_correlation(r, LAYER, tokens, batch_size=4)
    sae = base()["sae"]  # stays on the CPU in fp32 whatever the Lorsa's placement
    cos = ov_feature_cosines(r.lorsas[LAYER], 3, sae_in_decoder=sae.W_dec, sae_out_encoder=sae.W_enc.T, k=4)
    for t in (vals, top.values, corr.contrib, cos["v"][0]):
        assert t.device.type == "cpu" and t.dtype == torch.float32
    return {"lens": vals, "lens_ids": ids, "top": top, "corr": corr, "cos_v": cos["v"][0], "cos_o": cos["o"][0],
            "r": r, "tokens": tokens, "strings": strings}


@pytest.mark.parametrize("device", DEVICES)
def test_head_analysis_on_device(device):
    """OV logit lens, top activations, MHSA correlation (lstsq on the host) and SAE cosines."""
    want, got = _analysis("cpu"), _analysis(device)
    assert relative(got["lens"], want["lens"]) < DEVICE_REL and torch.equal(got["lens_ids"], want["lens_ids"])
    assert got["strings"] == want["strings"]
    assert relative(got["top"].values.clamp_min(0), want["top"].values.clamp_min(0)) < DEVICE_REL
    assert torch.equal(got["top"].count, want["top"].count)
    assert relative(got["corr"].contrib, want["corr"].contrib) < 1e-3
    assert torch.equal(got["corr"].count, want["corr"].count)
    assert relative(got["cos_v"], want["cos_v"]) < DEVICE_REL and relative(got["cos_o"], want["cos_o"]) < DEVICE_REL


@pytest.mark.parametrize("device", DEVICES)
def test_qk_feature_impacts_and_dashboard_data_on_device(device):
    """App. F.1 ablation KLs (the SAE on the CPU, the Lorsa on the device) and a dashboard's data."""
    out = []
    for dev in ("cpu", device):
        a = _analysis(dev)
        r, tokens, top = a["r"], a["tokens"], a["top"]
        head = top.top_heads(1)[0]
        qk = qk_feature_impacts(r, LAYER, head, base()["sae"], tokens, batch_size=3)
        data = head_dashboard_data(r, LAYER, head, top, tokens, n_contexts=3, correlation=a["corr"], qk_features=qk)
        out.append((qk, data))
    (qk0, d0), (qk1, d1) = out
    assert qk0.n_activations == qk1.n_activations > 0
    assert relative(qk1.q_kl, qk0.q_kl) < 1e-3 and relative(qk1.k_kl, qk0.k_kl) < 1e-3 and float(qk0.k_kl.max()) > 0
    assert [c["tokens"] for c in d1["contexts"]] == [c["tokens"] for c in d0["contexts"]]
    contrib0 = [x for c in d0["contexts"] for x in c["contrib"]]
    contrib1 = [x for c in d1["contexts"] for x in c["contrib"]]
    assert relative(contrib1, contrib0) < 1e-3  # rounded to 4 decimals in the data
    assert [x["id"] for x in d1["logit_lens"]] == [x["id"] for x in d0["logit_lens"]]
    assert relative([x["logit"] for x in d1["logit_lens"]], [x["logit"] for x in d0["logit_lens"]]) < 1e-3
    f0, f1 = ({m["head"]: m["fraction"] for m in d["mhsa"]} for d in (d0, d1))
    assert f1.keys() == f0.keys() and relative([f1[k] for k in f0], list(f0.values())) < 1e-2


def _one_text(stream: torch.Tensor, hf: Any) -> torch.Tensor:
    """``stream`` with the config's EOS id (2 in the tiny Llama; ``random_ids`` draws it) replaced by 3: one text,
    as ``evaluate_sparse`` takes a stream (a stream holding EOS is a corpus of documents, refused)."""
    return torch.where(stream == hf.config.eos_token_id, torch.full_like(stream, 3), stream)


def _sparse_run(device: str, dtype: torch.dtype = torch.float32, steps: int = 3) -> dict[str, Any]:
    from nnsight_lorsa.sparse_attention import SparseTrainConfig, evaluate_sparse
    from nnsight_lorsa.sparse_attention.install import get_gates
    from nnsight_lorsa.sparse_attention.train import SparseAttentionTrainer

    model, hf = tiny_nnsight("llama", device=device, dtype=dtype)
    stream = random_ids(batch=1, seq=400, seed=4).flatten()
    held = _one_text(random_ids(batch=1, seq=200, seed=8).flatten(), hf)
    # init_bias 30: every gate open (P(closed) < e^-20 per edge), so the sampled training gates do not
    # depend on the device's random stream and the run is comparable across devices; the gate path
    # (noise drawn on the device, straight-through, edge statistics, GECO) runs all the same
    cfg = SparseTrainConfig(total_steps=steps, batch_size=4, seq_len=16, lr=1e-3, gate_lr=1e-1, init_bias=30.0,
                            target_batches=2, seed=0)
    trainer = SparseAttentionTrainer(model, stream, cfg)
    trainer.train(progress=False)
    ev = evaluate_sparse(trainer.finished_model(), held, seq_len=16, batch_size=4)
    gate = get_gates(trainer.hf)[0]
    q = trainer.hf.model.layers[0].self_attn.q_proj.weight.detach().float().cpu()
    return {"ce": [h.ce for h in trainer.history], "base": trainer.base_ce, "eval": ev,
            "bias": gate.bias.detach().float().cpu(), "gate": gate, "dq": q - tiny_nnsight("llama")[1].model.layers[
                0].self_attn.q_proj.weight.detach()}


@pytest.mark.parametrize("device", DEVICES)
def test_sparse_attention_trains_and_evaluates_on_device(device):
    want, got = _sparse_run("cpu"), _sparse_run(device)
    assert got["gate"].bias.device.type == device and got["gate"].bias.dtype == torch.float32
    assert relative(got["ce"], want["ce"]) < 1e-3 and relative(got["base"], want["base"]) < DEVICE_REL
    assert relative(got["eval"]["ce"], want["eval"]["ce"]) < 1e-3
    assert got["eval"]["active_fraction"] == want["eval"]["active_fraction"] == 1.0
    assert relative(got["bias"], want["bias"]) < DEVICE_REL
    assert relative(got["dq"], want["dq"]) < 1e-2 and float(want["dq"].abs().max()) > 1e-4  # the same update, and one


def test_a_replacement_on_the_meta_device_raises_placement_error():
    model, hf, r = setup()
    r.lorsas[LAYER].to("meta")
    with pytest.raises(PlacementError, match="Lorsa of layer 1.*meta"):
        ov_logit_lens(r, LAYER, [0])
    with pytest.raises(PlacementError, match="meta"):
        mhsa_correlation(r, LAYER, random_ids())


# ---------------------------------------------------------------- dtypes (CPU)
#: (model dtype, replacement dtype, bound on the logits and analysis outputs, bound on the patching effects),
#: relative to the largest fp32 value of each quantity. bf16 keeps 8 bits of mantissa (2^-8 ≈ 4e-3 per
#: rounding), fp16 11 (5e-4); three layers of rounding give the logit bounds (measured, 1–2 threads: bf16
#: model ≤ 5e-3, bf16 modules ≤ 2.3e-2, fp16 ≤ 6e-4 / 2.7e-3). The effects are differences of two runs'
#: metrics, 0.1–0.4 on logits of at most 0.6 in this random model, so the same absolute rounding is a large
#: fraction of them (measured ≤ 0.16 bf16, ≤ 0.11 bf16 modules, ≤ 0.044 fp16, and the reduction order of
#: the thread count moves them): the bounds are 2× that. An intervention that did not happen is off by
#: the whole effect (≈ 1), which every bound catches.
DTYPES = [
    pytest.param(torch.bfloat16, torch.float32, 3e-2, 0.3, id="bf16-model-fp32-modules"),
    pytest.param(torch.float16, torch.float32, 5e-3, 0.1, id="fp16-model-fp32-modules"),
    pytest.param(torch.float32, torch.bfloat16, 6e-2, 0.3, id="fp32-model-bf16-modules"),
    pytest.param(torch.float32, torch.float16, 1e-2, 0.1, id="fp32-model-fp16-modules"),
]


@pytest.mark.parametrize(("dtype", "rep_dtype", "bound", "effect_bound"), DTYPES)
def test_patching_effects_in_reduced_precision_match_fp32(dtype, rep_dtype, bound, effect_bound):
    """Interventions, activation patching and path patching with the model and the replacement modules
    in different dtypes: logits within ``bound``, metric effects within ``effect_bound`` of the fp32 run
    (relative to the largest fp32 value); the interventions move the logits by more than 5× ``bound``."""
    ids, corrupt = random_ids(), random_ids(seed=5)
    kw = {"correct_ids": torch.tensor([5, 9]), "incorrect_ids": 6}
    groups = [MHSAHead(0, 0), LorsaHead(LAYER, 3), Feature(2, 5, "transcoder")]
    out = []
    for dt, rdt in ((torch.float32, torch.float32), (dtype, rep_dtype)):
        model, hf, r = setup("cpu", dt, rdt)
        logits, _ = intervene(model, r, ids)
        res = activation_patching(r, ids, corrupt, groups, **kw)
        pp = path_patching(r, ids, groups, corrupt=corrupt, **kw)
        assert res.patched.dtype == pp.patched.dtype == torch.float32  # metrics in fp32 whatever the model's dtype
        out.append((logits, res.patched - res.corrupt[None], pp.effect, res.clean - res.corrupt))
    assert relative(out[1][0], out[0][0]) < bound
    for got, want in zip(out[1][1:], out[0][1:], strict=True):
        assert relative(got, want) < effect_bound
    plain = tiny_nnsight("llama")[1](ids).logits
    assert relative(out[0][0], plain) > 5 * bound


@pytest.mark.parametrize(("dtype", "rep_dtype", "bound", "effect_bound"), DTYPES)
def test_head_analysis_in_reduced_precision_matches_fp32(dtype, rep_dtype, bound, effect_bound):
    """OV logit lens (fp32 from the stored weights: bf16/fp16 rounding of the weights only), top
    activations and SAE cosines within ``bound`` of the fp32 run."""
    want, got = _analysis("cpu"), _analysis("cpu", dtype, rep_dtype)
    assert relative(got["lens"], want["lens"]) < bound / 4
    assert relative(got["top"].values.clamp_min(0), want["top"].values.clamp_min(0)) < bound
    assert relative(got["cos_v"], want["cos_v"]) < bound / 4 and relative(got["cos_o"], want["cos_o"]) < bound / 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gate_statistics_stay_exact_in_reduced_precision(dtype):
    """Edge counts in fp32 (an fp16 count overflows past 65504, a bf16 one is inexact past 256); held-out
    CE of an open-gated model within 2e-2 (relative) of the fp32 one."""
    from nnsight_lorsa.sparse_attention import edge_statistics, evaluate_sparse, install_gated_attention
    from nnsight_lorsa.sparse_attention.install import get_gates

    held = _one_text(random_ids(batch=1, seq=1200, seed=8).flatten(), tiny_nnsight("llama")[1])
    evs = []
    for dt in (torch.float32, dtype):
        model, hf = tiny_nnsight("llama", dtype=dt)
        install_gated_attention(hf, init_bias=30.0)
        evs.append(evaluate_sparse(hf, held, seq_len=300, batch_size=4))
        st = edge_statistics(hf)
        g = get_gates(hf)[0]
        assert g.possible_edges is not None and g.possible_edges.dtype == torch.float32
        assert st.possible[0, 0] == 4 * 300 * 301 / 2  # 180600 allowed edges per head (> fp16's 65504)
        assert torch.equal(st.active, st.possible)
    assert abs(evs[1]["ce"] - evs[0]["ce"]) / evs[0]["ce"] < 2e-2


@pytest.mark.parametrize("target", TARGETS + [LorsaHead(LAYER, 7)], ids=str)
def test_a_steer_past_the_edited_values_dtype_range_is_refused(target):
    """``steer`` / ``scale`` / ``ablate(means=...)`` refuse NaN / inf values (ArgumentError); a finite fp32 value
    past fp16's range (|v| > 65504) became inf only when cast to an fp16 site, after that check, and the
    logits went non-finite silently. Checked after the cast now, naming the value and the dtype; the same
    value on the fp32 model, and a value within range on the fp16 one, still apply."""
    from nnsight_lorsa.errors import ArgumentError

    ids = random_ids()
    for dtype in (torch.float16, torch.float32):
        model, hf, r = setup("cpu", dtype, torch.float16)
        # the replacement modules are fp16 in both runs: a Lorsa head / feature is edited in fp16 there
        fits = dtype == torch.float32 and isinstance(target, MHSAHead)
        width = (16,) if isinstance(target, MHSAHead) else (1,)
        for value in (torch.full(width, 1e5), 1e5):
            if fits:
                assert bool(torch.isfinite(_steered(model, r, ids, target, value)).all())
            else:
                with pytest.raises(ArgumentError, match=r"delta.*float16"):
                    _steered(model, r, ids, target, value)
        assert bool(torch.isfinite(_steered(model, r, ids, target, torch.full(width, 2.0))).all())


def _steered(model, r, ids, target, value):
    with torch.no_grad(), model.trace(ids):
        r.prepare([target])
        steer(r(target), value)
        out = unembed(model).output.save()
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
def test_mean_activations_keep_the_precision_of_an_fp64_model(dtype):
    """The means are averaged in at least fp32 and returned in the values' dtype: an fp64 model's (and fp64
    modules') means are their fp64 means, not fp64 values rounded to fp32 first; bf16 ones are averaged in
    fp32 (a bf16 sum would round every partial sum)."""
    ids = random_ids(batch=6, seq=12, seed=11)
    model, hf, r = setup("cpu", dtype)
    targets = [MHSAHead(1, 2), LorsaHead(LAYER, 4), Feature(2, 5, "transcoder")]
    means = mean_activations(r, targets, ids)
    vals = {}
    with torch.no_grad(), model.trace(ids):
        r.prepare(targets)
        for t in targets:
            vals[t] = read(r(t))
    for t in targets:
        v = vals[t]
        want = v.mean((0, 1)) if dtype == torch.float64 else v.float().mean((0, 1)).to(v.dtype)
        assert means[t].dtype == v.dtype and torch.equal(means[t], want), t
