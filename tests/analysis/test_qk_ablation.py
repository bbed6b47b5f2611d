"""App. F.1 QK feature ablation: exact against the Lorsa module's own pattern functions on edited inputs."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import LAYER, coordinate_sae, make_clt, make_lorsa, make_transcoder, random_ids, tiny_nnsight

from nnsight_lorsa import LorsaSet, ReplacementModel, get_adapter
from nnsight_lorsa.analysis import QKFeatureImpacts, qk_feature_impacts
from nnsight_lorsa.envoy.read import attention_activations
from nnsight_lorsa.errors import ConfigMismatchError, LayerOutOfRangeError, ShapeError
from nnsight_lorsa.modules.sae import SAEConfig, SparseAutoencoder


def sharp_setup(family: str):
    """Tiny model + a Lorsa whose QK weights are scaled up (peaked patterns, large KLs)."""
    model, hf = tiny_nnsight(family)
    lorsa = make_lorsa(hf, get_adapter(model))
    with torch.no_grad():
        lorsa.W_Q.mul_(6.0)
        lorsa.W_K.mul_(6.0)
    return model, hf, lorsa, LorsaSet(model, {LAYER: lorsa})


def busiest_head(model, lorsa, tokens) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(head, x, positions, activation mask (b, s) without BOS) for the head active most often."""
    act = attention_activations(model, LAYER, tokens)
    _, cache = lorsa(act.x, act.positions, return_cache=True)
    active = cache.z > 0
    active[:, 0] = False
    head = int(active.sum((0, 1)).argmax())
    return head, act.x, act.positions, active[..., head]


def rows(lorsa, head: int, x_q: torch.Tensor, x_k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Reference pattern of the head's QK head with queries from ``x_q`` and keys from ``x_k``, computed
    with the module's ``qk`` and ``attention_scores_softmax``: ``(b, s, s)``."""
    g = head // lorsa.cfg.group_size
    q, _ = lorsa.qk(x_q, positions)
    _, k = lorsa.qk(x_k, positions)
    return lorsa.attention_scores_softmax(q[:, [g]], k[:, [g]], None)[:, 0]


def kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return torch.where(p > 0, p * (p.log() - q.log()), torch.zeros(())).sum(-1)


def reference_max(values: torch.Tensor, where: torch.Tensor) -> float:
    return float(values[where].max()) if where.any() else 0.0


class FixedCodes(SparseAutoencoder):
    """An 'SAE' whose code is a fixed ``(b, s, n)`` table (so we choose where each feature is active)."""

    def __init__(self, codes: torch.Tensor, W_dec: torch.Tensor) -> None:
        super().__init__(SAEConfig(d_in=W_dec.shape[1], d_sae=W_dec.shape[0]))
        self.codes = codes
        with torch.no_grad():
            self.W_dec.copy_(W_dec)

    def encode(self, x):
        assert x.shape[:2] == self.codes.shape[:2]
        return self.codes.clone()


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2", "olmo2", "phi3", "gemma"])  # + whole-projection QK-norm,
# fused qkv with partial rotary, MQA
@torch.no_grad()
def test_kl_equals_reference_on_edited_inputs(family):
    model, hf, lorsa, ls = sharp_setup(family)
    rm = ReplacementModel(model, lorsas=ls)
    tokens = random_ids(batch=3, seq=10, seed=5)
    head, x, positions, active = busiest_head(model, lorsa, tokens)
    d = lorsa.cfg.d_model
    sae = coordinate_sae(d)
    res = qk_feature_impacts(rm, LAYER, head, sae, tokens, batch_size=2)
    assert res.n_activations == int(active.sum()) > 0 and res.n_tokens == 3 * 9
    assert res.qk_head == head // lorsa.cfg.group_size
    base = rows(lorsa, head, x, x, positions)
    q_ref, k_ref = torch.zeros(2 * d), torch.zeros(2 * d)
    q_loc = {}
    for f in range(2 * d):
        c, sign = f % d, 1.0 if f < d else -1.0
        on = sign * x[..., c] > 0                              # where feature f is active
        x_edit = x.clone()
        x_edit[..., c] = torch.where(on, torch.zeros(()), x[..., c])   # the known input edit
        kl_q = kl(base, rows(lorsa, head, x_edit, x, positions))      # queries edited, keys not
        kl_k = kl(base, rows(lorsa, head, x, x_edit, positions))      # keys edited, queries not
        q_ref[f] = reference_max(kl_q, active & on)
        k_ref[f] = reference_max(kl_k, active & (on.cummax(1).values))
        if (active & on).any():
            q_loc[f] = (active & on) & (kl_q == kl_q[active & on].max())
        assert res.q_count[f] == int((active & on).sum())
        assert res.k_count[f] == int((active & on.cummax(1).values).sum())
    torch.testing.assert_close(res.q_kl, q_ref, atol=2e-6, rtol=1e-3)
    torch.testing.assert_close(res.k_kl, k_ref, atol=2e-6, rtol=1e-3)
    assert q_ref.max() > 2e-3 and k_ref.max() > 2e-3          # the test is not comparing zeros
    for f, where in q_loc.items():                             # the reported location is a maximum
        if q_ref[f] > 1e-3:
            b, i = int(res.q_window[f]), int(res.q_position[f])
            assert where[b, i] or abs(float(res.q_kl[f]) - q_ref[f]) < 1e-4
    # chunking and batching change nothing but the last bits: other matmul shapes round the scores differently (an
    # AVX-512 CPU, two xdist workers: a KL of 0.117 2.7e-6 apart); 10x under the reference's bound
    again = qk_feature_impacts(rm, LAYER, head, sae, tokens, batch_size=3, chunk=7)
    torch.testing.assert_close(again.q_kl, res.q_kl, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(again.k_kl, res.k_kl, atol=1e-5, rtol=1e-4)
    assert torch.equal(again.q_count, res.q_count) and torch.equal(again.k_count, res.k_count)
    top = res.top_query_features(3)
    assert [t[0] for t in top] == res.q_kl.topk(3).indices.tolist() and top[0][1] == float(res.q_kl.max())


def _span_directions(lorsa, g: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Unit directions: orthogonal to W_Q^g and W_K^g; in W_Q's column span ⟂ W_K; in W_K's span ⟂ W_Q."""
    wq, wk = lorsa.W_Q[g].double(), lorsa.W_K[g].double()     # (d, e)
    gen = torch.Generator().manual_seed(seed)

    def perp(v, basis):
        qb, _ = torch.linalg.qr(basis)
        return v - qb @ (qb.T @ v)

    d = wq.shape[0]
    r = torch.randn(d, dtype=torch.float64, generator=gen)
    out = {"none": perp(r, torch.cat([wq, wk], 1)),
           "q_only": perp(wq @ torch.randn(wq.shape[1], dtype=torch.float64, generator=gen), wk),
           "k_only": perp(wk @ torch.randn(wk.shape[1], dtype=torch.float64, generator=gen), wq)}
    return {k: (v / v.norm()).float() for k, v in out.items()}


@pytest.mark.parametrize("family", ["llama", "qwen3", "olmo2", "phi3", "gemma"])
@torch.no_grad()
def test_orthogonal_feature_has_no_impact_aligned_one_does(family):
    model, hf, lorsa, ls = sharp_setup(family)
    rm = ReplacementModel(model, lorsas=ls)
    tokens = random_ids(batch=3, seq=10, seed=5)
    head, x, positions, active = busiest_head(model, lorsa, tokens)
    dirs = _span_directions(lorsa, head // lorsa.cfg.group_size)
    w_dec = torch.stack([dirs["none"], dirs["q_only"], dirs["k_only"], dirs["q_only"] + dirs["k_only"]])
    x_norm = float(x.norm(dim=-1).mean())
    codes = torch.full((*x.shape[:2], 4), x_norm)              # every feature active everywhere
    res = qk_feature_impacts(rm, LAYER, head, FixedCodes(codes, w_dec), tokens, batch_size=4)
    n = res.n_activations
    assert res.q_count.tolist() == [n] * 4 and res.k_count.tolist() == [n] * 4
    assert res.q_kl[0] < 1e-9 and res.k_kl[0] < 1e-9          # orthogonal to both: no impact
    assert res.q_kl[1] > 1e-3 and res.k_kl[1] < 1e-9          # only on Q
    assert res.q_kl[2] < 1e-9 and res.k_kl[2] > 1e-3          # only on K
    assert res.q_kl[3] > 1e-3 and res.k_kl[3] > 1e-3
    assert [t[0] for t in res.top_key_features(2)] == res.k_kl.topk(2).indices.tolist()


@torch.no_grad()
def test_feature_only_at_key_positions_has_no_q_impact():
    model, hf, lorsa, ls = sharp_setup("llama")
    rm = ReplacementModel(model, lorsas=ls)
    tokens = random_ids(batch=3, seq=10, seed=5)
    head, x, positions, active = busiest_head(model, lorsa, tokens)
    g = head // lorsa.cfg.group_size
    direction = (lorsa.W_Q[g] @ torch.randn(lorsa.cfg.d_qk_head) + lorsa.W_K[g] @ torch.randn(lorsa.cfg.d_qk_head))
    direction = direction / direction.norm()
    where = ~active                                            # never at an activation's query position
    where[:, 0] = True
    codes = (where.float() * float(x.norm(dim=-1).mean()))[..., None]
    res = qk_feature_impacts(rm, LAYER, head, FixedCodes(codes, direction[None]), tokens, batch_size=3)
    assert res.q_count[0] == 0 and res.q_kl[0] == 0 and res.q_window[0] == -1
    present = where.cummax(1).values & active
    assert res.k_count[0] == int(present.sum())
    x_edit = x - codes * direction                             # the feature removed where it is active
    k_ref = kl(rows(lorsa, head, x, x, positions), rows(lorsa, head, x, x_edit, positions))
    torch.testing.assert_close(res.k_kl[0], k_ref[present].max(), atol=2e-6, rtol=1e-3)
    assert res.k_kl[0] > 1e-3
    b, i = int(res.k_window[0]), int(res.k_position[0])
    assert present[b, i] and abs(float(k_ref[b, i]) - float(res.k_kl[0])) < 1e-4


def test_update_keeps_the_first_maximum_per_feature():
    r = QKFeatureImpacts.empty(0, 0, 0, 4)
    r.update("q", torch.tensor([0.1, 0.5, 0.5, 0.2]), torch.tensor([1, 1, 1, 3]), torch.tensor([0, 0, 1, 2]),
             torch.tensor([4, 5, 6, 7]))
    r.update("q", torch.tensor([0.3, 0.0]), torch.tensor([3, 2]), torch.tensor([5, 6]), torch.tensor([1, 2]))
    assert r.q_kl.tolist() == pytest.approx([0, 0.5, 0.0, 0.3])
    assert r.q_window.tolist() == [-1, 0, 6, 5] and r.q_position.tolist() == [-1, 5, 2, 1]
    assert r.q_count.tolist() == [0, 3, 1, 2]
    assert [f for f, *_ in r.top_query_features(10)] == [1, 3, 2] and r.top_key_features(5) == []


@torch.no_grad()
def test_bad_input_raises_before_the_model_runs():
    model, hf = tiny_nnsight("llama")
    lorsa = make_lorsa(hf, get_adapter(model))
    ls = LorsaSet(model, {LAYER: lorsa})
    rm = ReplacementModel(model, lorsas=ls)
    sae = coordinate_sae(lorsa.cfg.d_model)
    calls = []
    handle = hf.model.embed_tokens.register_forward_pre_hook(lambda *a: calls.append(1))
    tokens = random_ids(batch=2, seq=6)
    try:
        with pytest.raises(ShapeError, match="head"):
            qk_feature_impacts(rm, LAYER, lorsa.cfg.n_ov_heads, sae, tokens)
        with pytest.raises(ShapeError, match="head"):
            qk_feature_impacts(rm, LAYER, -1, sae, tokens)
        with pytest.raises(LayerOutOfRangeError, match="no Lorsa for layer 2"):
            qk_feature_impacts(rm, LAYER + 1, 0, sae, tokens)
        with pytest.raises(ConfigMismatchError, match="d_model=64"):
            qk_feature_impacts(rm, LAYER, 0, SparseAutoencoder(SAEConfig(d_in=32, d_sae=8)), tokens)
        with pytest.raises(ShapeError, match="tokens"):
            qk_feature_impacts(rm, LAYER, 0, sae, tokens[0])
        # a transcoder / CLT of the attention's width ran: its decoder rows are MLP-output directions
        for coder in (make_transcoder(skip=False, d_in=64, d_sae=16), make_clt().by_layer()[0]):
            with pytest.raises(ConfigMismatchError, match=f"got a {type(coder).__name__}, whose decoder rows"):
                qk_feature_impacts(rm, LAYER, 0, coder, tokens)
        with pytest.raises(ShapeError, match="features"):
            qk_feature_impacts(rm, LAYER, 0, sae, tokens, features=[0, 128])
        assert calls == []
        # a feature subset evaluates only those features (and the model does run)
        head = int(lorsa(attention_activations(model, LAYER, tokens).x, return_cache=True)[1].z[:, 1:].sum((0, 1))
                   .argmax())
        calls.clear()
        full = qk_feature_impacts(rm, LAYER, head, sae, tokens)
        assert calls and full.n_activations > 0
        pick = [f for f, *_ in full.top_query_features(2)]
        res = qk_feature_impacts(rm, LAYER, head, sae, tokens, features=pick)
        assert set(((res.q_count + res.k_count) > 0).nonzero().flatten().tolist()) == set(pick)
        for name in ("q_count", "k_count", "q_window", "k_position"):
            assert torch.equal(getattr(res, name)[pick], getattr(full, name)[pick])
        torch.testing.assert_close(res.q_kl[pick], full.q_kl[pick], atol=1e-9, rtol=1e-5)
        torch.testing.assert_close(res.k_kl[pick], full.k_kl[pick], atol=1e-9, rtol=1e-5)
    finally:
        handle.remove()


@pytest.mark.parametrize(("model_dtype", "lorsa_dtype"),
                         [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32),
                          (torch.float32, torch.bfloat16), (torch.float64, torch.float64),
                          (torch.bfloat16, torch.float64)], ids=str)
@torch.no_grad()
def test_kl_in_any_dtype_equals_the_fp64_reference_on_the_same_inputs(model_dtype, lorsa_dtype):
    """Issue 21: with the model and the Lorsa in bf16 / fp16 / fp64, the ablations run in fp32 (documented) on the
    attention input the model gives and the Lorsa's own (rounded) weights: the max KLs equal an fp64 reference
    computed from the same input and weights (upcast, exact) at the locations where the Lorsa is active (its own
    dtype's decision), to fp32 rounding (relative 1e-4 of the largest KL)."""
    model, hf = tiny_nnsight("llama", dtype=model_dtype)
    lorsa = make_lorsa(tiny_nnsight("llama")[1], get_adapter(model))
    with torch.no_grad():
        lorsa.W_Q.mul_(6.0)
        lorsa.W_K.mul_(6.0)
    lorsa = lorsa.to(lorsa_dtype)
    rm = ReplacementModel(model, lorsas=LorsaSet(model, {LAYER: lorsa}))
    tokens = random_ids(batch=3, seq=10, seed=5)
    act = attention_activations(model, LAYER, tokens)
    _, cache = lorsa(act.x.to(lorsa_dtype), act.positions, return_cache=True)
    active = cache.z > 0
    active[:, 0] = False
    head = int(active.sum((0, 1)).argmax())
    active = active[..., head]
    ref = copy.deepcopy(lorsa).double()  # the same weights, upcast exactly
    x = act.x.double()
    d = lorsa.cfg.d_model
    sae = coordinate_sae(d)
    res = qk_feature_impacts(rm, LAYER, head, sae, tokens, batch_size=2)
    assert res.n_activations == int(active.sum()) > 0
    base = rows(ref, head, x, x, act.positions)
    q_ref, k_ref = torch.zeros(2 * d, dtype=torch.float64), torch.zeros(2 * d, dtype=torch.float64)
    for f in range(2 * d):
        c, sign = f % d, 1.0 if f < d else -1.0
        on = sign * x[..., c] > 0
        x_edit = x.clone()
        x_edit[..., c] = torch.where(on, torch.zeros((), dtype=x.dtype), x[..., c])
        q_ref[f] = reference_max(kl(base, rows(ref, head, x_edit, x, act.positions)), active & on)
        k_ref[f] = reference_max(kl(base, rows(ref, head, x, x_edit, act.positions)), active & on.cummax(1).values)
    assert q_ref.max() > 2e-3 and k_ref.max() > 2e-3
    for got, want in ((res.q_kl, q_ref), (res.k_kl, k_ref)):
        assert got.dtype == torch.float32 and got.device.type == "cpu"
        err = float((got.double() - want).abs().max() / want.abs().max())
        assert err <= 1e-4, (model_dtype, lorsa_dtype, err)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("gain", [0.5, 4.0])
@torch.no_grad()
def test_an_sae_normalising_its_input_ablates_in_the_inputs_scale(family, gain):
    """The coordinate SAE with ``constant_norm_rescale``: feature ``c`` is ``relu(x_c) · √d / ‖x‖`` and its decoder
    row, in the input's scale (``denormalize``: ``· ‖x‖ / √d``), is ``relu(x_c) e_c`` again — the plain coordinate
    SAE's ablation, so the KLs must be the plain SAE's. The decoder row was taken as it stands (``a_f d_f`` in the
    normalised scale): KLs off by the factor ``√d / ‖x‖`` in the edit (16x too small at a pre-attention gain of 4).
    With ``layer_norm``, against the edit written out (``x_c − a_f · std(x)``)."""
    model, hf, lorsa, ls = sharp_setup(family)
    norm = hf.model.layers[LAYER].input_layernorm if family == "llama" else hf.transformer.h[LAYER].ln_1
    norm.weight.mul_(gain)  # ‖x‖ / √d away from 1, as a trained pre-attention norm's gain
    rm = ReplacementModel(model, lorsas=ls)
    tokens = random_ids(batch=2, seq=9, seed=4)
    head, x, positions, active = busiest_head(model, lorsa, tokens)
    d = lorsa.cfg.d_model
    plain = coordinate_sae(d)
    res = {}
    for mode in ("none", "constant_norm_rescale", "layer_norm"):
        sae = SparseAutoencoder(SAEConfig(d_in=d, d_sae=2 * d, activation="relu", normalize_activations=mode))
        sae.load_state_dict(plain.state_dict())
        res[mode] = qk_feature_impacts(rm, LAYER, head, sae, tokens, batch_size=2)
    assert res["none"].q_kl.max() > 1e-4 and res["none"].k_kl.max() > 1e-4  # not comparing zeros
    rescaled = res["constant_norm_rescale"]
    torch.testing.assert_close(rescaled.q_kl, res["none"].q_kl, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(rescaled.k_kl, res["none"].k_kl, atol=1e-6, rtol=1e-4)
    assert torch.equal(rescaled.q_count, res["none"].q_count)
    # layer_norm: feature c's activation relu(±(x_c − μ) / (σ + 1e-5)), its row back in the input's scale · σ
    base = rows(lorsa, head, x, x, positions)
    mu, sd = x.mean(-1, keepdim=True), x.std(-1, keepdim=True)
    for f in range(0, 2 * d, 7):
        c, sign = f % d, 1.0 if f < d else -1.0
        a = (sign * (x[..., c] - mu[..., 0]) / (sd[..., 0] + 1e-5)).relu()
        x_edit = x.clone()
        x_edit[..., c] = x[..., c] - sign * a * sd[..., 0]
        on = a > 0
        q_ref = reference_max(kl(base, rows(lorsa, head, x_edit, x, positions)), active & on)
        k_ref = reference_max(kl(base, rows(lorsa, head, x, x_edit, positions)), active & on.cummax(1).values)
        assert abs(float(res["layer_norm"].q_kl[f]) - q_ref) <= 1e-3 * q_ref + 2e-6, f
        assert abs(float(res["layer_norm"].k_kl[f]) - k_ref) <= 1e-3 * k_ref + 2e-6, f
