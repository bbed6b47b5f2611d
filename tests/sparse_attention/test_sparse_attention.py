"""Sparse-attention post-training (paper 003, §3): gated attention, GECO, training, IO, nnsight edits."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import transformers
from helpers import FAMILIES, SDPA_FAMILIES, random_ids, tiny_hf_model, tiny_tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st

from nnsight_lorsa.errors import (
    CheckpointError,
    GateConfigError,
    GateNotInstalledError,
    LorsaError,
    UnsupportedArchitectureError,
)
from nnsight_lorsa.modules.attention_gate import AttentionGate
from nnsight_lorsa.sparse_attention import (
    edge_statistics,
    install_gated_attention,
    load_gates,
    save_sparse_model,
    set_gate_mode,
)
from nnsight_lorsa.sparse_attention.attention import gated_attention_forward
from nnsight_lorsa.sparse_attention.geco import GECO
from nnsight_lorsa.sparse_attention.install import get_gates, uninstall_gated_attention
from nnsight_lorsa.sparse_attention.io import load_sparse_model
from nnsight_lorsa.sparse_attention.train import SparseAttentionTrainer, SparseTrainConfig, evaluate_sparse


def _gate_inputs(model: torch.nn.Module, ids: torch.Tensor, **kw) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """(scores, valid) each gate was called with, by layer."""
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = [g.register_forward_hook(lambda m, a, o, L=L: seen.__setitem__(L, (a[0].detach(), a[1])))
             for L, g in get_gates(model).items()]
    try:
        with torch.no_grad():
            model(input_ids=ids, **kw)
    finally:
        for h in hooks:
            h.remove()
    return seen


@pytest.mark.parametrize("family", FAMILIES)
def test_open_gates_reproduce_the_model(family: str) -> None:
    model = tiny_hf_model(family)
    ids = random_ids()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding on one row
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        ref_pad = model(input_ids=ids, attention_mask=mask).logits
        if family in SDPA_FAMILIES:  # transformers refuses SDPA for Gemma-2 (no soft-capping)
            model.set_attn_implementation("sdpa")
            ref_sdpa = model(input_ids=ids).logits
            model.set_attn_implementation("eager")
        else:
            ref_sdpa = ref
    install_gated_attention(model, init_bias=30.0)
    with torch.no_grad():
        out = model(input_ids=ids).logits
        out_pad = model(input_ids=ids, attention_mask=mask).logits
    assert (out - ref).abs().max() < 1e-5
    assert (out - ref_sdpa).abs().max() < 1e-5
    assert (out_pad - ref_pad)[:, 3:].abs().max() < 1e-5
    st = edge_statistics(model)
    assert st.active_fraction == 1.0
    seq = ids.shape[1]

    def allowed(n: int, window: int | None) -> int:  # causal edges of n tokens, each seeing its last `window` keys
        return sum(min(i + 1, window or n) for i in range(n))

    # a row of 10 tokens and one of 7 (3 padded), per layer: Gemma-2's sliding layers see their window only, Phi-3's
    # every layer (a window and no layer_types)
    window = getattr(model.config, "sliding_window", None)
    types = getattr(model.config, "layer_types", None) or [
        "full_attention" if window is None else "sliding_attention"] * model.config.num_hidden_layers
    windows = [window if t == "sliding_attention" else None for t in types]
    expected = torch.tensor([float(allowed(seq, w) + allowed(seq - 3, w)) for w in windows])
    assert torch.equal(st.possible, expected[:, None].expand_as(st.possible))
    uninstall_gated_attention(model)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref)


def test_eval_gate_is_deterministic_and_closes_negative_logits() -> None:
    model = tiny_hf_model("llama")
    gates = install_gated_attention(model, init_bias=0.0)
    with torch.no_grad():
        for g in gates.values():
            g.bias.copy_(torch.tensor([-0.02, 0.0, 0.02, 5.0]))
    ids = random_ids()
    with torch.no_grad():
        a, b = model(input_ids=ids).logits, model(input_ids=ids).logits
    assert torch.equal(a, b)
    st = edge_statistics(model)
    assert 0 < st.active_fraction < 1
    seen = _gate_inputs(model, ids)
    for layer, (scores, valid) in seen.items():
        logits = scores + gates[layer].bias[None, :, None, None]
        want = ((logits > 0) & valid).sum(dim=(0, 2, 3)).float()
        assert torch.equal(st.active[layer], want)


def test_training_gate_is_a_bernoulli_sample_with_straight_through_gradient() -> None:
    torch.manual_seed(0)
    gate = AttentionGate(2, init_bias=0.0).train()
    scores = torch.tensor([-2.0, -0.5, 0.0, 1.0, 3.0]).view(1, 1, 1, 5).expand(4000, 2, 1, 5).clone()
    valid = torch.ones(1, 1, 1, 5, dtype=torch.bool)
    scores.requires_grad_(True)
    a = gate(scores, valid)
    assert set(a.detach().unique().tolist()) <= {0.0, 1.0}
    freq = a.detach().mean(dim=(0, 1, 2))
    assert torch.allclose(freq, torch.sigmoid(scores[0, 0, 0].detach()), atol=0.03)
    a.sum().backward()
    assert scores.grad is not None and (scores.grad > 0).all()
    assert gate.bias.grad is not None and (gate.bias.grad > 0).all()


def test_gradients_reach_the_gate_bias_and_projections_through_the_model() -> None:
    model = tiny_hf_model("qwen3")
    install_gated_attention(model, init_bias=1.0)
    model.train()
    ids = random_ids()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    gate = get_gates(model)[1]
    assert gate.bias.grad is not None and gate.bias.grad.abs().sum() > 0
    assert gate.expected_edges_grad is not None and gate.expected_edges_grad.requires_grad


def test_expected_edge_count_matches_brute_force() -> None:
    model = tiny_hf_model("neox")
    install_gated_attention(model, init_bias=0.5)
    ids = random_ids(batch=2, seq=7)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    seen = _gate_inputs(model, ids, attention_mask=mask)
    st = edge_statistics(model)
    gates = get_gates(model)
    for layer, (scores, _) in seen.items():
        for h in range(scores.shape[1]):
            total, count = 0.0, 0
            for b in range(scores.shape[0]):
                for i in range(7):
                    for j in range(i + 1):
                        if mask[b, j] == 0:  # padded key: not an edge
                            continue
                        total += 1.0 / (1.0 + math.exp(-(scores[b, h, i, j].item() + gates[layer].bias[h].item())))
                        count += 1
            assert st.possible[layer, h].item() == count
            assert abs(st.expected[layer, h].item() - total) < 1e-4 * max(1.0, total)


def test_topk_mode_keeps_the_k_largest_weights_per_query() -> None:
    model = tiny_hf_model("gpt2")
    install_gated_attention(model, init_bias=30.0)
    ids = random_ids(batch=1, seq=9)
    for k in (1, 2, 4):
        set_gate_mode(model, "topk", top_k=k)
        with torch.no_grad():
            model(input_ids=ids)
        st = edge_statistics(model)
        kept = sum(min(k, i + 1) for i in range(9))
        assert torch.equal(st.active, torch.full_like(st.active, kept))
    seen = _gate_inputs(model, ids)
    scores, valid = seen[0]
    a = get_gates(model)[0](scores, valid)
    top = scores.masked_fill(~valid, float("-inf")).topk(4, dim=-1).indices
    kept = a.gather(-1, top)[:, :, 3:]  # queries 3.. see >= 4 keys: exactly their 4 largest scores are open
    assert torch.equal(kept, torch.ones_like(kept))
    assert torch.equal(a[:, :, 3:].sum(-1), 4 * torch.ones_like(a[:, :, 3:, 0]))


def test_closing_one_edge_in_a_trace_matches_manual_recomputation() -> None:
    from nnsight import TransformersModel

    hf = tiny_hf_model("llama")
    install_gated_attention(hf, init_bias=30.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = TransformersModel(hf, task="text-generation", tokenizer=tiny_tokenizer(), device="cpu")
    ids = random_ids()
    with model.trace(ids):
        gate = model.model.layers[1].self_attn.gate.output.save()
        model.model.layers[1].self_attn.gate.output[0, 2, 5, 3] = 0
        edited = model.lm_head.output.save()

    # manual: recompute layer 1's attention with the edge closed, feed it through the rest of the model
    captured = {}
    attn = hf.model.layers[1].self_attn

    def swap(module, args, kwargs, output):
        q, k, v = captured["q"], captured["k"], captured["v"]
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        s = q @ k.transpose(2, 3) * module.scaling
        causal = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
        p = s.masked_fill(~causal, float("-inf")).softmax(-1)
        p[0, 2, 5, 3] = 0
        z = (p @ v).transpose(1, 2).reshape(*output[0].shape[:2], -1)
        return (module.o_proj(z), *output[1:])

    def grab(module, args, kwargs):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        x = args[0] if args else kwargs["hidden_states"]
        cos, sin = kwargs["position_embeddings"]
        shape = (*x.shape[:-1], -1, module.head_dim)
        q = module.q_proj(x).view(shape).transpose(1, 2)
        k = module.k_proj(x).view(shape).transpose(1, 2)
        captured["q"], captured["k"] = apply_rotary_pos_emb(q, k, cos, sin)
        captured["v"] = module.v_proj(x).view(shape).transpose(1, 2)

    h1 = attn.register_forward_pre_hook(grab, with_kwargs=True)
    h2 = attn.register_forward_hook(swap, with_kwargs=True)
    try:
        with torch.no_grad():
            manual = hf(input_ids=ids).logits
    finally:
        h1.remove()
        h2.remove()
    with torch.no_grad():
        base = hf(input_ids=ids).logits
    assert gate[0, 2, 5, 3] == 0 and gate.sum() == 2 * 4 * 55 - 1  # 2 prompts x 4 heads x 55 causal edges, one closed
    assert (edited - manual).abs().max() < 1e-5
    assert (edited - base)[0, 5:].abs().max() > 1e-4  # the edit changed the later positions ...
    assert torch.equal(edited[1], base[1]) and torch.equal(edited[0, :5], base[0, :5])  # ... and nothing else


class _GatedAttention(torch.nn.Module):
    """The least an attention module carries for :func:`gated_attention_forward` (and transformers' eager)."""

    def __init__(self, heads: int, mode: str) -> None:
        super().__init__()
        self.gate = AttentionGate(heads, init_bias=30.0, mode=mode)
        self.is_causal, self.num_key_value_groups = True, 1
        self.eval()


def _padded_mask(dtype: torch.dtype, batch: int, seq: int, pad: int) -> torch.Tensor:
    """transformers' additive eager mask ``(batch, 1, seq, seq)``: 0 allowed, dtype-min masked (causal, row 0
    left-padded by ``pad`` keys)."""
    allowed = torch.ones(seq, seq, dtype=torch.bool).tril()[None, None].repeat(batch, 1, 1, 1)
    allowed[0, :, :, :pad] = False
    return torch.zeros(batch, 1, seq, seq, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gated_attention_is_transformers_eager_bit_for_bit_in_bf16_and_fp32(dtype) -> None:
    """Open gates in bf16 and fp32 compute exactly eager's ``softmax(q·kᵀ·s + mask) V`` (scores in the model's
    dtype, the fp16 widening does not reach them), padding mask included, on every query that sees a key."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 7, 16, generator=g).to(dtype) for _ in range(3))
    module = _GatedAttention(4, "dense")
    mask = _padded_mask(dtype, 2, 7, 2)
    with torch.no_grad():
        out, weights = gated_attention_forward(module, q, k, v, mask, 0.25)
        want, want_weights = eager_attention_forward(module, q, k, v, mask, 0.25)
    # row 0's first two queries see no key (left padding): eager averages them, the gate zeroes them
    assert torch.equal(out[1], want[1]) and torch.equal(out[0, 2:], want[0, 2:])
    assert torch.equal(weights[1], want_weights[1]) and torch.equal(weights[0, :, 2:], want_weights[0, :, 2:])


@pytest.mark.parametrize("mode", ["dense", "gated"])
def test_fp16_gated_attention_forms_scores_past_65504_in_fp32(mode) -> None:
    """fp16 queries and keys whose unscaled ``q·k`` passes 65504 (fp16's max): the scores were formed in fp16,
    ``inf``, and the output NaN, where the model's SDPA is finite. They are formed in fp32: the output is finite
    and within 1e-2 of max |output| of the same computation in fp32 (fp16 rounds the softmax and ``@ V``). A
    masked key whose scaled score passes 65504 stays masked (the fp16 mask's -65504 alone would let it in)."""
    g = torch.Generator().manual_seed(0)
    q, k = (100 * torch.randn(2, 2, 6, 16, generator=g) for _ in range(2))
    v = torch.randn(2, 2, 6, 16, generator=g)
    k[0, :, 0] = 1000 * q[0, :, -1].sign()  # row 0's padded key 0: scaled score ~3e5 for the last query
    q, k, v = q.half(), k.half(), v.half()
    assert (q.float() @ k.float().transpose(2, 3)).abs().max() > 65504
    module = _GatedAttention(2, mode)
    with torch.no_grad():
        out, weights = gated_attention_forward(module, q, k, v, _padded_mask(torch.float16, 2, 6, 2), 0.25)
        ref, ref_weights = gated_attention_forward(module, q.float(), k.float(), v.float(),
                                                   _padded_mask(torch.float32, 2, 6, 2), 0.25)
    assert out.dtype == weights.dtype == torch.float16
    assert bool(out.isfinite().all()) and bool(weights.isfinite().all())
    assert (out.float() - ref).abs().max() <= 1e-2 * ref.abs().max()
    assert (weights.float() - ref_weights)[0, :, :, :2].abs().max() == 0  # the padded keys stay masked


def test_an_fp16_model_with_gated_attention_stays_finite_where_its_sdpa_is() -> None:
    """An fp16 GPT-2 whose first layer's unscaled ``q·k`` is 102400 (queries and keys a constant 80 per
    dimension: past fp16's 65504, ``q·k·s`` = 25600 within it). Its SDPA attention is finite; gated attention
    with open gates (``mode="dense"``, the no-op configuration) gave NaN logits. Now finite, and within 5e-3 of
    max |logit| of the fp32 model (SDPA fp16 itself is ~7e-4 off, gated ~6e-4)."""
    model = tiny_hf_model("gpt2")
    d = model.config.n_embd
    with torch.no_grad():
        c_attn = model.transformer.h[0].attn.c_attn  # Conv1D (d, 3d): q | k | v
        c_attn.weight[:, : 2 * d] = 0
        c_attn.bias[: 2 * d] = 80.0
        ids = random_ids()
        ref = model(input_ids=ids).logits
        half = model.half()
        half.set_attn_implementation("sdpa")
        sdpa = half(input_ids=ids).logits.float()
        install_gated_attention(half, mode="dense")
        gated = half(input_ids=ids).logits.float()
    assert bool(sdpa.isfinite().all()) and (sdpa - ref).abs().max() <= 5e-3 * ref.abs().max()
    assert bool(gated.isfinite().all())
    assert (gated - ref).abs().max() <= 5e-3 * ref.abs().max()


def test_geco_lambda_moves_against_the_constraint() -> None:
    up = GECO(target=3.0, lr=1.0, ema=0.5)
    first = up.update(3.5)
    assert 1.0 < first < up.update(3.5)
    down = GECO(target=3.0, lr=1.0, ema=0.5)
    lams = [down.update(2.5) for _ in range(5)]
    assert all(b < a for a, b in zip([1.0, *lams], lams, strict=False))
    clamp = GECO(target=3.0, lr=10.0, ema=0.0, min_lambda=0.5, max_lambda=2.0)
    assert clamp.update(100.0) == 2.0 and clamp.update(-100.0) == 0.5
    with pytest.raises(GateConfigError):
        GECO(target=1.0, ema=1.0)


def _trainer(lora: bool = False) -> SparseAttentionTrainer:
    model = tiny_hf_model("llama", attn="eager")
    stream = torch.randint(3, 128, (400,), generator=torch.Generator().manual_seed(0))  # no EOS (2): one text
    cfg = SparseTrainConfig(total_steps=4, batch_size=4, seq_len=16, init_bias=2.0, target_batches=1,
                            lora_rank=4 if lora else None)
    return SparseAttentionTrainer(model, stream, cfg)


def test_checkpoint_resume_is_bit_exact(tmp_path) -> None:
    straight = _trainer()
    straight.train(4, progress=False)
    first = _trainer()
    first.train(2, progress=False)
    first.save_checkpoint(tmp_path)
    resumed = _trainer()
    resumed.load_checkpoint(tmp_path)
    resumed.train(2, progress=False)
    for (n, a), (_, b) in zip(straight.hf.named_parameters(), resumed.hf.named_parameters(), strict=True):
        assert torch.equal(a, b), n
    assert straight.geco.lam == resumed.geco.lam
    assert [r.ce for r in straight.history] == [r.ce for r in resumed.history]
    with pytest.raises(CheckpointError):
        resumed.load_checkpoint(tmp_path / "missing")


def test_lora_trains_only_adapters_and_gates() -> None:
    pytest.importorskip("peft")
    tr = _trainer(lora=True)
    before = {n: p.detach().clone() for n, p in tr.hf.named_parameters()}
    tr.train(2, progress=False)
    changed = {n for n, p in tr.hf.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("lora_" in n or n.endswith("gate.bias") for n in changed)
    assert any(n.endswith("gate.bias") for n in changed)
    merged = tr.finished_model()
    assert not any("lora_" in n for n, _ in merged.named_parameters())


def test_save_load_round_trip_hf_and_nnsight(tmp_path) -> None:
    import nnsight

    model = tiny_hf_model("llama")
    install_gated_attention(model, init_bias=0.0)
    with torch.no_grad():
        for g in get_gates(model).values():
            g.bias.copy_(torch.randn(4) * 0.05)
    ids = random_ids()
    with torch.no_grad():
        want = model(input_ids=ids).logits
    save_sparse_model(model, tmp_path, tokenizer=tiny_tokenizer())
    loaded = load_sparse_model(tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, want)
    assert edge_statistics(loaded).active_fraction == edge_statistics(model).active_fraction < 1
    dense = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)  # a normal HF directory
    assert not any(n.endswith("attn.gate.bias") for n, _ in dense.named_parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = nnsight.LanguageModel(str(tmp_path), tokenizer=tiny_tokenizer())
    load_gates(lm, tmp_path)
    with lm.trace(ids):
        g = lm.model.layers[0].self_attn.gate.output.save()
        out = lm.lm_head.output.save()
    assert (out - want).abs().max() < 1e-5 and g.shape == (2, 4, 10, 10)


def test_bad_input_raises_clear_errors(tmp_path) -> None:
    opt = transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=64, hidden_size=32, num_attention_heads=2, num_hidden_layers=1, ffn_dim=64,
        word_embed_proj_dim=32))
    with pytest.raises(UnsupportedArchitectureError, match="opt"):
        install_gated_attention(opt)
    with pytest.raises(GateConfigError):
        AttentionGate(4, mode="softmax")
    model = tiny_hf_model("llama")
    with pytest.raises(GateNotInstalledError):
        get_gates(model)
    install_gated_attention(model)
    with pytest.raises(GateConfigError):
        install_gated_attention(model)
    with pytest.raises(GateConfigError):
        set_gate_mode(model, "topk", top_k=0)
    assert all(g.mode == "gated" and g.top_k == 1 for g in get_gates(model).values())  # nothing half-applied
    q = torch.zeros(1, 4, 3, 16)
    with pytest.raises(GateNotInstalledError):
        gated_attention_forward(torch.nn.Module(), q, q, q, None, 0.25)
    with pytest.raises(CheckpointError):
        load_gates(tiny_hf_model("gpt2"), tmp_path)
    save_sparse_model(model, tmp_path)
    with pytest.raises(CheckpointError, match="do not fit"):
        load_gates(tiny_hf_model("gpt2"), tmp_path)
    assert issubclass(GateNotInstalledError, LorsaError) and issubclass(GateConfigError, LorsaError)


def test_evaluate_sparse_reports_ce_and_edges() -> None:
    model = tiny_hf_model("qwen2")
    install_gated_attention(model, init_bias=30.0)
    stream = torch.randint(3, 128, (200,), generator=torch.Generator().manual_seed(0))  # no EOS (2): one text
    with pytest.raises(GateConfigError, match="no BOS id"):  # Qwen2's config has no bos_token_id
        evaluate_sparse(model, stream, seq_len=16, batch_size=8)
    dense = evaluate_sparse(model, stream, seq_len=16, batch_size=8, bos_id=0)
    set_gate_mode(model, "topk", top_k=1)
    top1 = evaluate_sparse(model, stream, seq_len=16, batch_size=8, bos_id=0)
    assert dense["active_fraction"] == 1.0 and top1["active_fraction"] == pytest.approx(16 / (16 * 17 / 2))
    assert top1["ce"] != dense["ce"] and dense["tokens"] == top1["tokens"] == 13 * 15


def test_loose_constraint_sparsifies_and_train_function_resumes(tmp_path) -> None:
    from nnsight_lorsa.sparse_attention import train_sparse_attention

    stream = torch.randint(3, 128, (400,), generator=torch.Generator().manual_seed(0))  # no EOS (2): one text
    cfg = SparseTrainConfig(total_steps=8, batch_size=4, seq_len=16, init_bias=2.0, gate_lr=0.1, target_ce=100.0,
                            allow_slack_constraint=True)  # a deliberately vacuous τ
    with pytest.warns(UserWarning, match="slack"):
        model, summary = train_sparse_attention(tiny_hf_model("llama"), stream, cfg, progress=False)
    assert summary.history[-1].expected_fraction < summary.history[0].expected_fraction
    assert summary.history[-1].lam == cfg.min_lambda  # CE far below τ: λ falls to its floor
    assert not model.training
    half = SparseTrainConfig(**{**cfg.__dict__, "total_steps": 4})
    train_sparse_attention(tiny_hf_model("llama"), stream, half, progress=False, checkpoint_dir=tmp_path)
    resumed, s2 = train_sparse_attention(tiny_hf_model("llama"), stream, cfg, progress=False, checkpoint_dir=tmp_path)
    assert s2.steps == 8 and [r.ce for r in s2.history] == [r.ce for r in summary.history]
    for (n, a), (_, b) in zip(model.named_parameters(), resumed.named_parameters(), strict=True):
        assert torch.equal(a, b), n


def test_bos_id_defaults_to_the_models_own() -> None:
    from nnsight_lorsa.sparse_attention.train import resolve_bos_id

    hf = tiny_hf_model("llama")
    hf.config.bos_token_id = 5
    stream = torch.randint(3, 128, (400,), generator=torch.Generator().manual_seed(0))  # no EOS (2): one text
    cfg = SparseTrainConfig(total_steps=1, batch_size=4, seq_len=16, target_batches=1)
    assert cfg.bos_id is None
    tr = SparseAttentionTrainer(hf, stream, cfg)
    assert tr.bos_id == 5
    assert resolve_bos_id(hf, 7) == 7
    captured = []
    hook = tr.hf.register_forward_pre_hook(lambda _m, _a, kw: captured.append(kw["input_ids"][:, 0]),
                                           with_kwargs=True)
    tr.train_step()
    hook.remove()
    assert (captured[0] == 5).all()
    hf.config.bos_token_id = None
    with pytest.raises(GateConfigError, match="no BOS id"):
        SparseAttentionTrainer(hf, stream, cfg)


def test_recovery_phase_freezes_gates_and_trains_the_model_on_ce() -> None:
    stream = torch.randint(3, 128, (400,), generator=torch.Generator().manual_seed(0))  # no EOS (2): one text
    cfg = SparseTrainConfig(total_steps=4, batch_size=4, seq_len=16, init_bias=1.0, target_batches=1,
                            recover_fraction=0.5)
    tr = SparseAttentionTrainer(tiny_hf_model("llama"), stream, cfg)
    tr.train(2, progress=False)
    bias = [g.bias.detach().clone() for g in get_gates(tr.hf).values()]
    weight = tr.hf.model.layers[0].self_attn.q_proj.weight.detach().clone()
    tr.train(2, progress=False)
    assert all(torch.equal(b, g.bias) for b, g in zip(bias, get_gates(tr.hf).values(), strict=True))
    assert not torch.equal(weight, tr.hf.model.layers[0].self_attn.q_proj.weight)


def test_a_stream_of_documents_is_refused_whatever_target_ce_is():
    """A 1-D stream holding the model's EOS id is a corpus of documents: random windows of it start
    mid-document, so τ and the CE kept would mean nothing (a probe: held-out CE 3.00 → 5.80, no error, since
    the vacuous-constraint check cannot fire while target_ce keeps its default). Refused before training."""
    from nnsight_lorsa.errors import GateConfigError

    model = tiny_hf_model("llama", attn="eager")
    eos = model.config.eos_token_id
    stream = torch.randint(3, 128, (400,), generator=torch.Generator().manual_seed(0))
    stream[::50] = eos  # documents joined by EOS
    for target_ce in (None, 99.0):
        cfg = SparseTrainConfig(total_steps=1, batch_size=4, seq_len=16, target_batches=1, target_ce=target_ce,
                                allow_slack_constraint=True)
        with pytest.raises(GateConfigError, match=rf"holds the model's EOS id {eos} 8 time\(s\).*from_documents"):
            SparseAttentionTrainer(model, stream, cfg)


@settings(max_examples=8, deadline=None)
@given(st.integers(8, 160), st.lists(st.integers(0, 159), min_size=1, max_size=5), st.integers(3, 12),
       st.booleans())
def test_evaluate_sparse_refuses_a_stream_of_documents_as_the_trainer_does(length, at, seq_len, nnsight_model):
    """``evaluate_sparse`` on a 1-D stream holding the model's EOS id (the nnsight model's tokenizer's, else the
    config's): the trainer's ``GateConfigError`` (``check_one_text``), not a CE over windows that start
    mid-document. Before: evaluated as one text. The same stream without EOS is still evaluated."""
    from helpers import tiny_nnsight

    from nnsight_lorsa.errors import GateConfigError

    model, hf = tiny_nnsight("llama") if nnsight_model else (None, tiny_hf_model("llama"))
    target = model if nnsight_model else hf
    eos = model.tokenizer.eos_token_id if nnsight_model else hf.config.eos_token_id
    install_gated_attention(hf, init_bias=30.0)
    stream = torch.randint(3, 128, (length,), generator=torch.Generator().manual_seed(length))
    stream[torch.tensor([i % length for i in at])] = eos
    count = int((stream == eos).sum())
    with pytest.raises(GateConfigError, match=rf"holds the model's EOS id {eos} {count} time\(s\)"):
        evaluate_sparse(target, stream, seq_len=seq_len, bos_id=0)
    one_text = torch.where(stream == eos, torch.full_like(stream, 5), stream)
    if one_text.numel() >= seq_len - 1:
        assert evaluate_sparse(target, one_text, seq_len=seq_len, bos_id=0)["windows"] == one_text.numel() // (
            seq_len - 1)


def test_held_out_ce_is_reported_and_checked_against_the_constraint(monkeypatch) -> None:
    """``heldout=``: the held-out CE before and after training is in the summary (equal to evaluate_sparse of
    the returned model), and a rise beyond the constraint's allowance + tolerance is a named warning and
    ``heldout_violation`` — training CE alone could not show it (a probe: held-out 3.00 → 3.70, no word)."""
    import nnsight_lorsa.sparse_attention.train as train_module
    from nnsight_lorsa.errors import HeldoutConstraintWarning
    from nnsight_lorsa.sparse_attention import evaluate_sparse, train_sparse_attention

    stream = torch.randint(3, 128, (400,), generator=torch.Generator().manual_seed(0))
    heldout = torch.randint(3, 128, (160,), generator=torch.Generator().manual_seed(1))
    cfg = SparseTrainConfig(total_steps=2, batch_size=4, seq_len=16, target_batches=1)
    model, summary = train_sparse_attention(tiny_hf_model("llama"), stream, cfg, progress=False, heldout=heldout)
    assert summary.heldout_ce == pytest.approx(float(evaluate_sparse(model, heldout, seq_len=16)["ce"]), rel=1e-6)
    assert summary.heldout_base_ce is not None and summary.heldout_violation is not None
    # the check itself: a held-out rise of 2.8 nats under a training allowance of ~0 is reported
    ces = iter([3.0, 5.8])
    monkeypatch.setattr(train_module, "evaluate_sparse", lambda *a, **k: {"ce": next(ces)})
    with pytest.warns(HeldoutConstraintWarning, match=r"held-out CE 3.0000 -> 5.8000"):
        _, bad = train_sparse_attention(tiny_hf_model("llama"), stream, cfg, progress=False, heldout=heldout)
    assert bad.heldout_violation is True and (bad.heldout_base_ce, bad.heldout_ce) == (3.0, 5.8)


@pytest.mark.parametrize("where", ["loss", "grad"])
def test_a_non_finite_step_stops_with_a_named_error_and_changes_nothing(where) -> None:
    """A NaN loss (a NaN weight in the forward) or a NaN gradient (a backward hook) stops the step with
    NonFiniteError naming the step and the tensor; the model, the gates, GECO's lambda and the step are as before."""
    from nnsight_lorsa.errors import NonFiniteError

    tr = _trainer()
    tr.train(1, progress=False)
    before = {k: v.detach().clone() for k, v in tr.hf.state_dict().items()}
    lam, step = tr.geco.lam, tr.step
    q = tr.hf.model.layers[0].self_attn.q_proj
    if where == "loss":
        with torch.no_grad():
            q.weight[0, 0] = float("nan")
        before["model.layers.0.self_attn.q_proj.weight"] = q.weight.detach().clone()
    else:
        q.weight.register_hook(lambda g: torch.full_like(g, float("nan")))
    with pytest.raises(NonFiniteError, match=f"step {step}") as info:
        tr.train_step()
    assert info.value.tensor == where and info.value.step == step
    after = tr.hf.state_dict()
    assert all(torch.equal(before[k].nan_to_num(7.0), after[k].nan_to_num(7.0)) for k in before)
    assert tr.geco.lam == lam and tr.step == step


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_a_sparse_model_loads_back_in_the_dtype_it_was_saved_in(tmp_path, dtype) -> None:
    """``load_sparse_model`` is ``from_pretrained(directory)`` plus the gates: a bf16 / fp16 / fp64 model comes
    back in its own dtype with the logits it had when saved (not upcast to fp32, which moves bf16 logits by
    ~5e-3 of max |logit|, nor fp64 rounded to fp32); ``dtype=`` still chooses another."""
    from nnsight_lorsa.assets import default_model_dir

    model = transformers.AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=dtype).eval()
    install_gated_attention(model, init_bias=1.0)
    ids = torch.randint(2, 200, (2, 12), generator=torch.Generator().manual_seed(4))
    ids[:, 0] = 0
    with torch.no_grad():
        want = model(input_ids=ids).logits
    save_sparse_model(model, tmp_path)
    loaded = load_sparse_model(tmp_path)
    assert {p.dtype for n, p in loaded.named_parameters() if not n.endswith("gate.bias")} == {dtype}
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, want)
    upcast = load_sparse_model(tmp_path, dtype=torch.float32)
    assert {p.dtype for p in upcast.parameters()} == {torch.float32}
