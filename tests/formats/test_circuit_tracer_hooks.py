"""circuit-tracer files attach only where their ``config.yaml`` says they read and write: a transcoder / CLT whose
``feature_input_hook`` / ``feature_output_hook`` is not our MLP site (the MLP module's input and output) is refused
by name (``hook_sites.check_mlp_hooks``), in every family; our writers record the hooks of that site and refuse
others."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import yaml
from helpers import head_logits, make_clt, make_transcoder, random_ids, tiny_nnsight, unembed
from peer_reference import PEER_FIXTURES

from nnsight_lorsa import CLTSet, TranscoderSet, get_adapter
from nnsight_lorsa.errors import UnsupportedArchitectureError
from nnsight_lorsa.formats import load
from nnsight_lorsa.formats.circuit_tracer import save_circuit_tracer_clt, save_circuit_tracer_transcoders
from nnsight_lorsa.formats.hook_sites import check_mlp_hooks

FAMILIES = ("llama", "gpt2", "neox", "gemma2", "olmo2", "phi3", "gemma")
#: the families with a pre-MLP norm (OLMo-2 has none: no ``ln2`` to read and ``hook_resid_mid`` is the MLP's own
#: input, ``test_olmo2_without_pre_norms_reads_resid_mid_at_the_mlp_and_refuses_hook_normalized``)
PRE_NORM_FAMILIES = tuple(f for f in FAMILIES if f != "olmo2")
LAYER = 1


def _rehook(directory: Path, **hooks: str) -> Path:
    """Rewrite the hooks a written ``config.yaml`` records, as in a file circuit-tracer's users write (which has no
    ``checksums.json``: ours is dropped, the edit would fail its check)."""
    (directory / "checksums.json").unlink()
    cfg = yaml.safe_load((directory / "config.yaml").read_text())
    cfg.update(hooks)
    (directory / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return directory


def _relu_tc():
    return make_transcoder(skip=False, activation="relu", activation_params={})


def _files(tmp_path: Path, name: str, **hooks: str) -> tuple[Path, Path]:
    """A per-layer set (layers 0 and 1) and a 3-layer CLT, written by our writers, with ``hooks`` recorded."""
    tcs = save_circuit_tracer_transcoders({0: _relu_tc(), 1: _relu_tc()}, tmp_path / f"tc_{name}")
    clt = save_circuit_tracer_clt(make_clt(), tmp_path / f"clt_{name}")
    return _rehook(tcs, **hooks), _rehook(clt, **hooks)


@torch.no_grad()
def _unit_norms(hf, adapter) -> None:
    """Every pre-MLP norm with gain exactly 1 and no bias (Gemma's ``1 + weight``: weight 0)."""
    for layer in range(adapter.n_layers):
        norm = hf.get_submodule(adapter.mlp_norm_path(layer))
        norm.weight.fill_(0.0 if "Gemma" in type(norm).__name__ else 1.0)
        if getattr(norm, "bias", None) is not None:
            norm.bias.zero_()


@pytest.mark.parametrize("family", FAMILIES)
def test_hooks_that_are_not_our_site_are_refused(family: str, tmp_path: Path) -> None:
    """``hook_resid_mid`` is refused where the family has no residual between attention and MLP (GPT-NeoX with a
    parallel residual, the tiny model's), naming the hook, the layer, the MLP site and the norm; an output hook
    other than the MLP's is refused everywhere."""
    model, _ = tiny_nnsight(family)
    adapter = get_adapter(model)
    tc_dir, clt_dir = _files(tmp_path, "mid", feature_input_hook="hook_resid_mid", feature_output_hook="mlp.hook_out")
    if family == "neox":
        assert model.config.use_parallel_residual
        with pytest.raises(UnsupportedArchitectureError, match=rf"feature_input_hook: 'hook_resid_mid'.*layer 0.*"
                                                               rf"'{adapter.mlp_path(0)}'.*parallel residual"):
            TranscoderSet.from_pretrained(model, tc_dir)
        one = load(tc_dir)[LAYER]  # the layer it is bound to is the one named
        with pytest.raises(UnsupportedArchitectureError, match=rf"'hook_resid_mid'.*layer {LAYER}.*"
                                                               rf"'{adapter.mlp_path(LAYER)}'.*"
                                                               rf"'{adapter.mlp_norm_path(LAYER)}'"):
            TranscoderSet(model, {LAYER: one})
        with pytest.raises(UnsupportedArchitectureError, match=r"'hook_resid_mid'.*layer 0.*parallel residual"):
            CLTSet.from_pretrained(model, clt_dir)
    else:
        TranscoderSet.from_pretrained(model, tc_dir)
        CLTSet.from_pretrained(model, clt_dir)
    for out in ("hook_resid_post", "blocks.1.hook_mlp_out", "mlp.hook_post"):
        tc_dir, clt_dir = _files(tmp_path, out, feature_input_hook="mlp.hook_in", feature_output_hook=out)
        for directory, loader in ((tc_dir, TranscoderSet.from_pretrained), (clt_dir, CLTSet.from_pretrained)):
            with pytest.raises(UnsupportedArchitectureError, match=rf"feature_output_hook: '{out}'.*layer 0.*output"):
                loader(model, directory)


def _resid_mid(module):
    module.cfg.extra["circuit_tracer"] = {"feature_input_hook": "hook_resid_mid", "feature_output_hook": "mlp.hook_out"}
    return module


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2", "phi3", "gemma"])  # OLMo-2: PRE_NORM_FAMILIES
def test_hook_resid_mid_transcoders_read_the_norm_input(family: str) -> None:
    """A ``hook_resid_mid`` transcoder / CLT reads the residual BEFORE the pre-MLP norm (the norm's input) and
    writes the MLP output: its reconstruction equals the module applied to the hooked resid_mid by hand (and not to
    the MLP input); with ``error=True`` the logits are the plain model's."""
    model, hf = tiny_nnsight(family)
    adapter = get_adapter(model)
    ids = random_ids()
    with torch.no_grad():
        plain = head_logits(hf, ids)
    tc = _resid_mid(_relu_tc())
    tcs = TranscoderSet(model, {LAYER: tc})
    with model.trace(ids):
        site = tcs.replace(LAYER, error=True)
        args, kwargs = model.get(adapter.mlp_norm_path(LAYER)).inputs
        mid = (args[0] if args else kwargs["hidden_states"]).save()
        mlp_in = model.get(adapter.mlp_path(LAYER)).inputs[0][0].save()
        recons = site.hook_sae_recons.output.save()
        logits = unembed(model).output.save()
    with torch.no_grad():
        assert torch.allclose(recons, tc(mid), rtol=1e-5, atol=1e-6)
        assert not torch.allclose(recons, tc(mlp_in), rtol=1e-3, atol=1e-3)  # not the MLP input: not vacuous
    assert torch.equal(logits, plain)  # error=True: the model's own output, bit for bit
    with model.trace(ids):
        tcs.replace(LAYER)
        spliced = unembed(model).output.save()
    seen = []  # by hand, on the plain HF model: MLP output := tc(the norm's input)
    pre = hf.get_submodule(adapter.mlp_norm_path(LAYER)).register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    post = hf.get_submodule(adapter.mlp_path(LAYER)).register_forward_hook(lambda m, a, o: tc(seen[-1]))
    try:
        with torch.no_grad():
            by_hand = head_logits(hf, ids)
    finally:
        pre.remove()
        post.remove()
    assert not torch.allclose(by_hand, plain, rtol=1e-3, atol=1e-3)
    assert torch.allclose(spliced, by_hand, rtol=1e-5, atol=1e-5)

    clt = _resid_mid(make_clt())
    clts = CLTSet(model, clt)
    mids: list = []
    rec: list = []  # filled inside the trace (objects from outside keep what is appended)
    with model.trace(ids):
        env = clts.replace(error=True)
        for layer in range(clt.n_layers):  # in the model's order
            args, kwargs = model.get(adapter.mlp_norm_path(layer)).inputs
            mids.append((args[0] if args else kwargs["hidden_states"]).save())
            rec.append(env.hook_sae_recons[layer].output.save())
        logits = unembed(model).output.save()
    with torch.no_grad():
        by_hand = clt(torch.stack(mids))
    for layer in range(clt.n_layers):
        assert torch.allclose(rec[layer], by_hand[layer], rtol=1e-5, atol=1e-5)
    assert torch.equal(logits, plain)


def test_hook_resid_mid_attribution_and_evaluate_read_resid_mid() -> None:
    """The attribution reads a ``hook_resid_mid`` transcoder or CLT at the frozen pre-MLP norm's input: its graph is
    exact (the graphs' values and edges: tests/attribution/test_transcoder_hook_sites_attribution.py); the graph of a
    traced pass (unedited) is that graph. ``evaluate`` of a CLT measures it on resid_mid."""
    from nnsight_lorsa.attribution import attribute
    from nnsight_lorsa.envoy.replacement_model import ReplacementModel
    from nnsight_lorsa.training import TokenDataset, evaluate
    from nnsight_lorsa.training.metrics import FVUAccumulator

    model, hf = tiny_nnsight("llama")
    adapter = get_adapter(model)
    ids = random_ids()
    for transcoders in (TranscoderSet(model, {LAYER: _resid_mid(_relu_tc())}), CLTSet(model, _resid_mid(make_clt()))):
        graph = attribute(ReplacementModel(model, transcoders=transcoders), ids[0], max_feature_nodes=8)
        assert graph.edge_sum_error("mass").max() < 1e-5
        bundle = ReplacementModel(model, transcoders=transcoders)
        with model.trace(ids[:1]) as tracer:
            bundle.replace()
            handle = attribute(bundle, tracer=tracer, max_feature_nodes=8)
        traced = handle.graph
        assert torch.equal(traced.layout_ids, graph.layout_ids)
        assert torch.allclose(traced.densify(), graph.densify(), atol=1e-5 * float(graph.densify().abs().max()))
    clt = _resid_mid(make_clt())
    ev = evaluate(CLTSet(model, clt), TokenDataset(ids), batch_size=2)
    mids, outs = [], []
    hooks = [hf.get_submodule(adapter.mlp_norm_path(layer)).register_forward_hook(
        lambda m, a, o: mids.append(a[0])) for layer in range(clt.n_layers)]
    hooks += [hf.get_submodule(adapter.mlp_path(layer)).register_forward_hook(
        lambda m, a, o: outs.append(o)) for layer in range(clt.n_layers)]
    try:
        with torch.no_grad():
            hf(ids)
            recon = clt(torch.stack(mids))
    finally:
        for h in hooks:
            h.remove()
    for layer in range(clt.n_layers):
        acc = FVUAccumulator()
        acc.update(outs[layer][:, 1:].reshape(-1, adapter.d_model).float(),
                   recon[layer][:, 1:].reshape(-1, adapter.d_model).float())
        assert ev.fvu[layer] == pytest.approx(float(acc.value()), rel=1e-4)


@pytest.mark.parametrize("family", PRE_NORM_FAMILIES)
def test_ln2_hook_normalized_before_the_gain(family: str, tmp_path: Path) -> None:
    """``ln2.hook_normalized`` is the pre-MLP norm BEFORE its gain (and bias). With a gain it is computed from the
    norm's input as the norm computes it — an RMSNorm's ``x / rms(x)`` (Llama, Gemma-2), a LayerNorm's ``(x − mean x)
    / σ(x)`` (GPT-2, GPT-NeoX; until 2026-11-29 refused) —: the reconstruction equals the transcoder applied to that
    by hand; with unit norms it is the MLP input in every family. Weights not loaded yet: computed (no gain needed)."""
    model, hf = tiny_nnsight(family)
    adapter = get_adapter(model)
    output = "mlp.hook_out" if family == "gemma2" else "hook_mlp_out"
    tc_dir, clt_dir = _files(tmp_path, "ln2", feature_input_hook="ln2.hook_normalized", feature_output_hook=output)
    norm = adapter.mlp_norm_path(LAYER)
    rms = "RMSNorm" in type(hf.get_submodule(norm)).__name__
    assert rms == (family in ("llama", "gemma2", "phi3", "gemma"))
    tcs = TranscoderSet(model, {LAYER: load(tc_dir)[LAYER]})
    CLTSet.from_pretrained(model, clt_dir)
    assert tcs.site(LAYER).site_paths == (adapter.mlp_path(LAYER),)
    ids = random_ids()
    with model.trace(ids):
        site = tcs.replace(LAYER)
        mid = _norm_input(model, adapter, LAYER)
        recons = site.hook_sae_recons.output.save()
    m = hf.get_submodule(norm)
    eps = getattr(m, "eps", getattr(m, "variance_epsilon", None))
    with torch.no_grad():
        x = mid.float()
        if not rms:
            x = x - x.mean(-1, keepdim=True)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        assert torch.allclose(recons, tcs[LAYER](x), rtol=1e-5, atol=1e-6)
        assert not torch.allclose(recons, tcs[LAYER](m(mid)), rtol=1e-3, atol=1e-3)  # the gain matters
    _unit_norms(hf, adapter)
    with torch.no_grad():  # the claim that makes it the MLP input: norm(x) == x normalised, no gain
        x = torch.randn(3, adapter.d_model, generator=torch.Generator().manual_seed(0))
        m = hf.get_submodule(norm)
        if isinstance(m, torch.nn.LayerNorm):
            ref = (x - x.mean(-1, keepdim=True)) * torch.rsqrt(x.var(-1, unbiased=False, keepdim=True) + m.eps)
        else:
            eps = getattr(m, "eps", getattr(m, "variance_epsilon", 0.0))
            ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        assert torch.allclose(m(x), ref, atol=1e-5)
    tcs = TranscoderSet.from_pretrained(model, tc_dir)
    assert list(tcs) == [0, 1]
    assert tcs.site(LAYER).input_paths == (adapter.mlp_path(LAYER),)  # unit gain: the MLP's own input
    CLTSet.from_pretrained(model, clt_dir)
    unloaded = copy.deepcopy(hf).to("meta")
    check_mlp_hooks(load(tc_dir)[LAYER], adapter, unloaded, (LAYER,))


def test_hook_mlp_out_is_the_mlp_output_or_the_post_norm_output(tmp_path: Path) -> None:
    """``hook_mlp_out`` with the MLP's input: the MLP output on Llama / GPT-2 (no post-norm); on Gemma-2
    ``post_feedforward_layernorm``'s output, which the splice then replaces."""
    tc_dir, clt_dir = _files(tmp_path, "out", feature_input_hook="mlp.hook_in", feature_output_hook="hook_mlp_out")
    for family in ("llama", "gpt2", "gemma2"):
        model, _ = tiny_nnsight(family)
        adapter = get_adapter(model)
        tcs = TranscoderSet.from_pretrained(model, tc_dir)
        clts = CLTSet.from_pretrained(model, clt_dir)
        post = adapter.mlp_post_norm_path(LAYER) if family == "gemma2" else adapter.mlp_path(LAYER)
        assert tcs.site(LAYER).site_paths == (post,)
        assert tcs.site(LAYER).input_paths == (adapter.mlp_path(LAYER),)
        assert clts.site().site_paths[LAYER] == post


def test_writers_record_and_require_our_site(tmp_path: Path) -> None:
    """The writers' defaults name the MLP module's input and output (``mlp.hook_in`` / ``mlp.hook_out``: what
    our sets read and write); a hook that does not name that site in every family is refused before writing."""
    clt_dir = save_circuit_tracer_clt(make_clt(), tmp_path / "clt")
    tc_dir = save_circuit_tracer_transcoders({0: _relu_tc()}, tmp_path / "tc")
    for directory in (clt_dir, tc_dir):
        cfg = yaml.safe_load((directory / "config.yaml").read_text())
        assert (cfg["feature_input_hook"], cfg["feature_output_hook"]) == ("mlp.hook_in", "mlp.hook_out")
    model, _ = tiny_nnsight("llama")
    CLTSet.from_pretrained(model, clt_dir)
    TranscoderSet.from_pretrained(model, tc_dir)
    for hooks in ({"feature_input_hook": "hook_resid_mid"}, {"feature_input_hook": "ln2.hook_normalized"},
                  {"feature_output_hook": "hook_mlp_out"}, {"feature_output_hook": "hook_resid_post"}):
        (hook,) = hooks.values()
        with pytest.raises(UnsupportedArchitectureError, match=rf"{next(iter(hooks))}='{hook}'"):
            save_circuit_tracer_clt(make_clt(), tmp_path / "bad_clt", **hooks)
        with pytest.raises(UnsupportedArchitectureError, match=rf"{next(iter(hooks))}='{hook}'"):
            save_circuit_tracer_transcoders({LAYER: _relu_tc()}, tmp_path / "bad_tc", **hooks)
        assert not (tmp_path / "bad_clt").exists() and not (tmp_path / "bad_tc").exists()


def test_circuit_tracer_written_clts_record_hook_resid_mid_and_still_load() -> None:
    """The circuit-tracer-written CLT fixtures record ``hook_resid_mid`` (its default): they still load (the
    format is unchanged), and carry the hook that ``check_mlp_hooks`` refuses at attach time."""
    for case in ("clt_relu", "clt_jumprelu"):
        clt = load(PEER_FIXTURES / "circuit_tracer" / case)
        assert clt.cfg.extra["circuit_tracer"]["feature_input_hook"] == "hook_resid_mid"


def _check_generation(model, replacements, ids: torch.Tensor) -> None:
    """``replacements`` serve every KV-cached step of a 4-token greedy generation from ``ids``: each step's last
    logits equal a full-sequence trace of the same prefix's, replaced the same way."""
    import nnsight

    gen = {"max_new_tokens": 4, "min_new_tokens": 4, "do_sample": False, "pad_token_id": 1}
    with model.generate(ids, **gen) as tracer:
        replacements.replace()
        steps = nnsight.save([])
        for _ in tracer.iter[:4]:
            steps.append(unembed(model).output[:, -1].clone())
        out = nnsight.save(tracer.result)
    assert len(steps) == 4
    for k, step in enumerate(steps):
        with model.trace(out[:, :ids.shape[1] + k]):
            replacements.replace()
            last = nnsight.save(unembed(model).output[:, -1])
        assert torch.allclose(step, last, rtol=1e-4, atol=1e-5), k


def test_hook_resid_mid_in_generation_and_beside_an_sae_on_the_norm() -> None:
    """A ``hook_resid_mid`` transcoder and CLT serve every KV-cached generation step (each step's logits equal a
    full-sequence trace of the same prefix's), and one spliced by a ReplacementModel next to an SAE on the same
    layer's pre-MLP norm output (spliced first; the transcoder reads the norm's input) gives the hand computation."""
    from helpers import make_sae

    from nnsight_lorsa import SAESet
    from nnsight_lorsa.envoy.replacement_model import ReplacementModel

    model, hf = tiny_nnsight("llama")
    adapter = get_adapter(model)
    ids = random_ids(1, 6)
    for replacements in (TranscoderSet(model, {LAYER: _resid_mid(_relu_tc())}), CLTSet(model, _resid_mid(make_clt()))):
        _check_generation(model, replacements, ids)

    tc = _resid_mid(_relu_tc())
    norm = adapter.mlp_norm_path(LAYER)
    sae = make_sae()
    rm = ReplacementModel(model, transcoders=TranscoderSet(model, {LAYER: tc}), saes=SAESet(model, {norm: sae}))
    with model.trace(ids):
        rm.replace(error=False)
        spliced = unembed(model).output.save()
    seen = []  # by hand: the norm's output := sae(norm output); the MLP's := tc(the norm's input)
    hooks = [hf.get_submodule(norm).register_forward_pre_hook(lambda m, a: seen.append(a[0])),
             hf.get_submodule(norm).register_forward_hook(lambda m, a, o: sae(o)),
             hf.get_submodule(adapter.mlp_path(LAYER)).register_forward_hook(lambda m, a, o: tc(seen[-1]))]
    try:
        with torch.no_grad():
            by_hand = head_logits(hf, ids)
    finally:
        for h in hooks:
            h.remove()
    assert torch.allclose(spliced, by_hand, rtol=1e-5, atol=1e-5)


GEMMASCOPE = {"feature_input_hook": "ln2.hook_normalized", "feature_output_hook": "hook_mlp_out"}


def _gemmascope(module):
    """GemmaScope's / circuit-tracer's ``gemma`` hooks: ``x / rms(x)`` before the pre-MLP norm's gain in, the post-MLP
    norm's output out (a file written by hand: our writers record the MLP module's call)."""
    module.cfg.extra["circuit_tracer"] = dict(GEMMASCOPE)
    return module


def _before_gain(hf, adapter, layer: int, resid_mid: torch.Tensor) -> torch.Tensor:
    """``ln2.hook_normalized`` by hand: transformers' own ``Gemma2RMSNorm._norm`` of the fp32 residual (the norm's
    ``forward`` without its ``(1 + weight)`` gain)."""
    return hf.get_submodule(adapter.mlp_norm_path(layer))._norm(resid_mid.float())


def _norm_input(model, adapter, layer: int):
    args, kwargs = model.get(adapter.mlp_norm_path(layer)).inputs
    return (args[0] if args else kwargs["hidden_states"]).save()


def _gemma2_plain(dtype: torch.dtype = torch.float32):
    """The tiny Gemma-2 (nnsight and Hugging Face) in ``dtype``, its adapter, prompts and the plain model's logits on
    them."""
    model, hf = tiny_nnsight("gemma2", dtype=dtype)
    ids = random_ids()
    with torch.no_grad():
        return model, hf, get_adapter(model), ids, head_logits(hf, ids)


def _hooked(handles: list, run):
    """``run()`` without gradients while the Hugging Face hooks ``handles`` are registered; they are removed after."""
    try:
        with torch.no_grad():
            return run()
    finally:
        for h in handles:
            h.remove()


def test_gemmascope_transcoder_on_gemma2_reads_before_the_gain_and_writes_the_post_norm_output() -> None:
    """A GemmaScope transcoder on Gemma-2 reads the pre-MLP norm's ``x / rms(x)`` before its ``1 + weight`` gain
    (not the MLP input) and replaces ``post_feedforward_layernorm``'s output: its reconstruction equals the
    transcoder applied by hand to the hooked residual's normalisation, the error term is the post-norm's own output
    minus it, ``error=True`` logits are the plain model's bit for bit, ``error=False`` logits a hand-hooked HF run."""
    model, hf, adapter, ids, plain = _gemma2_plain()
    tc = _gemmascope(_relu_tc())
    tcs = TranscoderSet(model, {LAYER: tc})
    post = adapter.mlp_post_norm_path(LAYER)
    assert tcs.site(LAYER).site_paths == (post,)
    true = []  # the post-norm's own output, hooked on the plain model
    hook = hf.get_submodule(post).register_forward_hook(lambda m, a, o: true.append(o.detach()))
    try:
        with model.trace(ids):
            site = tcs.replace(LAYER, error=True)
            mid = _norm_input(model, adapter, LAYER)
            mlp_in = model.get(adapter.mlp_path(LAYER)).inputs[0][0].save()
            recons = site.hook_sae_recons.output.save()
            err = site.hook_error.output.save()
            logits = unembed(model).output.save()
    finally:
        hook.remove()
    with torch.no_grad():
        x = _before_gain(hf, adapter, LAYER, mid)
        eps = hf.get_submodule(adapter.mlp_norm_path(LAYER)).eps
        assert torch.equal(x, mid * torch.rsqrt(mid.pow(2).mean(-1, keepdim=True) + eps))
        assert torch.allclose(recons, tc(x), rtol=1e-5, atol=1e-6)
        assert not torch.allclose(recons, tc(mlp_in), rtol=1e-3, atol=1e-3)  # the gain matters: not vacuous
    assert torch.allclose(err, true[-1] - recons, rtol=1e-5, atol=1e-6)  # the error term at the post-norm
    assert torch.equal(logits, plain)  # error=True: the model's own output, bit for bit

    with model.trace(ids):
        tcs.replace(LAYER)
        mid = _norm_input(model, adapter, LAYER)
        layer_out = model.get(adapter.layer_path(LAYER)).output
        resid = (layer_out[0] if isinstance(layer_out, tuple) else layer_out).save()
        spliced = unembed(model).output.save()
    with torch.no_grad():  # the layer added to its residual what the splice returned as the post-norm's output
        assert torch.allclose(resid - mid, tc(_before_gain(hf, adapter, LAYER, mid)), rtol=1e-4, atol=1e-5)
    seen = []  # by hand, on the plain HF model: post_feedforward_layernorm's output := tc(x / rms(x))
    hooks = [hf.get_submodule(adapter.mlp_norm_path(LAYER)).register_forward_pre_hook(lambda m, a: seen.append(a[0])),
             hf.get_submodule(post).register_forward_hook(
                 lambda m, a, o: tc(_before_gain(hf, adapter, LAYER, seen[-1])).to(o.dtype))]
    by_hand = _hooked(hooks, lambda: head_logits(hf, ids))
    assert not torch.allclose(by_hand, plain, rtol=1e-3, atol=1e-3)
    assert torch.allclose(spliced, by_hand, rtol=1e-5, atol=1e-5)


def test_gemmascope_clt_on_gemma2() -> None:
    """A CLT with GemmaScope's hooks: layer ``l`` encodes ``x / rms(x)`` of the pre-MLP norm's input before the gain
    and each ``post_feedforward_layernorm``'s output is replaced (``error=True``: the plain logits bit for bit;
    ``error=False``: a hand-hooked HF run)."""
    model, hf, adapter, ids, plain = _gemma2_plain()
    clt = _gemmascope(make_clt())
    clts = CLTSet(model, clt)
    assert clts.site().site_paths == tuple(adapter.mlp_post_norm_path(layer) for layer in range(clt.n_layers))
    mids: list = []
    rec: list = []
    with model.trace(ids):
        env = clts.replace(error=True)
        for layer in range(clt.n_layers):
            mids.append(_norm_input(model, adapter, layer))
            rec.append(env.hook_sae_recons[layer].output.save())
        logits = unembed(model).output.save()
    with torch.no_grad():
        by_hand = clt(torch.stack([_before_gain(hf, adapter, layer, m) for layer, m in enumerate(mids)]))
    for layer in range(clt.n_layers):
        assert torch.allclose(rec[layer], by_hand[layer], rtol=1e-5, atol=1e-5)
    assert torch.equal(logits, plain)

    with model.trace(ids):
        clts.replace()
        spliced = unembed(model).output.save()
    xs: dict = {}  # by hand: each post-norm's output := the CLT's layer output from the layers' x / rms(x) so far

    def read(layer):
        return lambda m, a: xs.__setitem__(layer, _before_gain(hf, adapter, layer, a[0]))

    def write(layer):
        def hook(m, a, o):
            acts = [clt.encode_layer(xs[source], source) for source in range(layer + 1)]
            return clt.reconstruct_layer(acts, layer, xs[layer]).to(o.dtype)
        return hook

    hooks = [hf.get_submodule(adapter.mlp_norm_path(layer)).register_forward_pre_hook(read(layer))
             for layer in range(clt.n_layers)]
    hooks += [hf.get_submodule(adapter.mlp_post_norm_path(layer)).register_forward_hook(write(layer))
              for layer in range(clt.n_layers)]
    by_hand_logits = _hooked(hooks, lambda: head_logits(hf, ids))
    assert not torch.allclose(by_hand_logits, plain, rtol=1e-3, atol=1e-3)
    assert torch.allclose(spliced, by_hand_logits, rtol=1e-5, atol=1e-5)


def test_gemmascope_in_generation_evaluate_and_attribution() -> None:
    """GemmaScope transcoders / CLTs on Gemma-2 serve every KV-cached generation step (each step's logits equal a
    full-sequence trace's); ``evaluate`` measures a transcoder against the post-norm's output; the attribution reads
    them before the pre-MLP norm's gain and writes the post-norm's output (an exact graph: values and edges,
    tests/attribution/test_transcoder_hook_sites_attribution.py); the unedited traced pass's graph is that graph."""

    from nnsight_lorsa.attribution import attribute
    from nnsight_lorsa.envoy.replacement_model import ReplacementModel
    from nnsight_lorsa.training import TokenDataset, evaluate
    from nnsight_lorsa.training.metrics import FVUAccumulator

    model, hf = tiny_nnsight("gemma2")
    adapter = get_adapter(model)
    ids = random_ids(1, 6)
    tcs = TranscoderSet(model, {LAYER: _gemmascope(_relu_tc())})
    clts = CLTSet(model, _gemmascope(make_clt()))
    for replacements in (tcs, clts):
        _check_generation(model, replacements, ids)
        bundle = ReplacementModel(model, transcoders=replacements)
        graph = attribute(bundle, ids[0], max_feature_nodes=8)
        assert graph.edge_sum_error("mass").max() < 1e-5
        with model.trace(ids) as tracer:
            bundle.replace()
            handle = attribute(bundle, tracer=tracer, max_feature_nodes=8)
        traced = handle.graph
        assert torch.equal(traced.layout_ids, graph.layout_ids)
        assert torch.allclose(traced.densify(), graph.densify(), atol=1e-5 * float(graph.densify().abs().max()))

    batch = random_ids(2, 8)
    ev = evaluate(tcs, TokenDataset(batch), batch_size=2)
    seen, outs = [], []
    hooks = [hf.get_submodule(adapter.mlp_norm_path(LAYER)).register_forward_pre_hook(lambda m, a: seen.append(a[0])),
             hf.get_submodule(adapter.mlp_post_norm_path(LAYER)).register_forward_hook(
                 lambda m, a, o: outs.append(o))]
    _hooked(hooks, lambda: hf(batch))
    with torch.no_grad():
        recon = tcs[LAYER](_before_gain(hf, adapter, LAYER, seen[0]))
    acc = FVUAccumulator()
    acc.update(outs[0][:, 1:].reshape(-1, adapter.d_model).float(), recon[:, 1:].reshape(-1, adapter.d_model).float())
    assert ev.fvu == pytest.approx(float(acc.value()), rel=1e-4)


def test_gemmascope_features_are_ordered_at_the_post_norm() -> None:
    """A GemmaScope transcoder's features are computed when ``post_feedforward_layernorm`` runs (its output is
    replaced there), after the MLP: ReplacementModel orders them between an SAE on the MLP output and one on the
    post-norm, so an ablation of such a feature and a steer of an SAE feature on the same layer's MLP in one trace
    body (after ``prepare``) run, and equal a hand-hooked HF run; path patching refuses an SAE sender on the post-norm
    the transcoder replaces (and on the MLP output, which then only feeds it)."""
    from helpers import make_sae

    from nnsight_lorsa import SAESet
    from nnsight_lorsa.envoy.replacement_model import ReplacementModel
    from nnsight_lorsa.envoy.targets import Feature
    from nnsight_lorsa.errors import ConfigMismatchError
    from nnsight_lorsa.patching import ablate, path_patching, steer

    model, hf = tiny_nnsight("gemma2")
    adapter = get_adapter(model)
    mlp, post = adapter.mlp_path(LAYER), adapter.mlp_post_norm_path(LAYER)
    tc, sae = _gemmascope(_relu_tc()), make_sae()
    r = ReplacementModel(model, saes=SAESet(model, {mlp: sae}), transcoders=TranscoderSet(model, {LAYER: tc}),
                         error=False)
    tc_feature, sae_feature = Feature(LAYER, 7, kind="transcoder"), Feature(mlp, 4)
    assert r.sort([Feature(post, 1), tc_feature, sae_feature]) == [sae_feature, tc_feature, Feature(post, 1)]
    ids = random_ids()
    with model.trace(ids):
        r.prepare([sae_feature, tc_feature])  # the transcoder reads the pre-MLP norm: spliced before it runs
        steer(r(sae_feature), 1.5)
        ablate(r(tc_feature))
        logits = unembed(model).output.save()
    seen = []

    def sae_hook(module, args, output):
        acts = sae.encode(output).clone()
        acts[:, :, 4] = acts[:, :, 4] + 1.5
        return sae.decode(acts)

    def tc_hook(module, args, output):
        acts = tc.encode(_before_gain(hf, adapter, LAYER, seen[-1])).clone()
        acts[:, :, 7] = 0
        return tc.decode(acts)

    hooks = [hf.get_submodule(adapter.mlp_norm_path(LAYER)).register_forward_pre_hook(lambda m, a: seen.append(a[0])),
             hf.get_submodule(mlp).register_forward_hook(sae_hook),
             hf.get_submodule(post).register_forward_hook(tc_hook)]
    want = _hooked(hooks, lambda: head_logits(hf, ids))
    assert torch.allclose(logits, want, rtol=1e-5, atol=1e-5)
    for site in (post, mlp):
        r2 = ReplacementModel(model, saes=SAESet(model, {site: make_sae()}),
                              transcoders=TranscoderSet(model, {LAYER: _gemmascope(_relu_tc())}), error=False)
        with pytest.raises(ConfigMismatchError, match=rf"SAE sender at '{site}'.*layer {LAYER}'s transcoder replaces"):
            path_patching(r2, ids, [(Feature(site, 0), Feature(LAYER, 7, kind="transcoder"))],
                          corrupt=random_ids(seed=2), metric=lambda logits: logits[:, -1, 0])


def test_gemmascope_transcoder_on_a_bf16_gemma2_reads_the_fp32_normalisation() -> None:
    """On a bf16 Gemma-2 an fp32 GemmaScope transcoder reads ``x / rms(x)`` as the norm computes it, in fp32 from the
    bf16 residual (``Gemma2RMSNorm._norm(x.float())``, not rounded to bf16), and ``error=True`` leaves the logits the
    plain model's bit for bit."""
    model, hf, adapter, ids, plain = _gemma2_plain(torch.bfloat16)
    tc = _gemmascope(_relu_tc())
    with model.trace(ids):
        site = TranscoderSet(model, {LAYER: tc}).replace(LAYER, error=True)
        mid = _norm_input(model, adapter, LAYER)
        recons = site.hook_sae_recons.output.save()
        logits = unembed(model).output.save()
    assert mid.dtype == torch.bfloat16 and recons.dtype == torch.float32
    with torch.no_grad():
        x = _before_gain(hf, adapter, LAYER, mid)
        assert x.dtype == torch.float32
        assert torch.allclose(recons, tc(x), rtol=1e-6, atol=1e-6)
        assert not torch.allclose(recons, tc(x.to(torch.bfloat16).float()), rtol=1e-6, atol=1e-6)  # not rounded
    assert torch.equal(logits, plain)


def test_olmo2_without_pre_norms_reads_resid_mid_at_the_mlp_and_refuses_hook_normalized(tmp_path: Path) -> None:
    """OLMo-2 has no pre-MLP norm: ``hook_resid_mid`` is the MLP's own input (``error=True``: the plain logits bit for
    bit; without: the module on the MLP's input), and ``ln2.hook_normalized`` has no site there — refused by name."""
    model, hf = tiny_nnsight("olmo2")
    adapter = get_adapter(model)
    assert adapter.mlp_norm_path(LAYER) is None
    ids = random_ids()
    plain = head_logits(hf, ids)
    tc = _resid_mid(_relu_tc())
    tcs = TranscoderSet(model, {LAYER: tc})
    for error in (True, False):
        with model.trace(ids):
            site = tcs.replace(LAYER, error=error)
            mlp_in = model.get(adapter.mlp_path(LAYER)).inputs[0][0].save()
            recons = site.hook_sae_recons.output.save()
            logits = unembed(model).output.save()
        with torch.no_grad():
            assert torch.allclose(recons, tc(mlp_in), rtol=1e-5, atol=1e-6)
        assert torch.equal(logits, plain) == error
    tc_dir, clt_dir = _files(tmp_path, "normalized", feature_input_hook="ln2.hook_normalized",
                             feature_output_hook="mlp.hook_out")
    for directory, loader in ((tc_dir, TranscoderSet.from_pretrained), (clt_dir, CLTSet.from_pretrained)):
        with pytest.raises(UnsupportedArchitectureError, match=r"ln2.hook_normalized.*no pre-MLP norm"):
            loader(model, directory)
