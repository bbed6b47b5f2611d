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
from helpers import make_clt, make_transcoder, tiny_nnsight
from peer_reference import PEER_FIXTURES

from nnsight_lorsa import CLTSet, TranscoderSet, get_adapter
from nnsight_lorsa.errors import UnsupportedArchitectureError
from nnsight_lorsa.formats import load
from nnsight_lorsa.formats.circuit_tracer import save_circuit_tracer_clt, save_circuit_tracer_transcoders
from nnsight_lorsa.formats.hook_sites import check_mlp_hooks

FAMILIES = ("llama", "gpt2", "neox", "gemma2")
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
def test_hook_resid_mid_is_refused(family: str, tmp_path: Path) -> None:
    """``hook_resid_mid`` (circuit-tracer's default; the residual BEFORE the pre-MLP norm) is refused, naming the
    hook, the layer and the MLP site we would have used; so is another output than the MLP's."""
    model, _ = tiny_nnsight(family)
    adapter = get_adapter(model)
    tc_dir, clt_dir = _files(tmp_path, "mid", feature_input_hook="hook_resid_mid", feature_output_hook="hook_mlp_out")
    with pytest.raises(UnsupportedArchitectureError,
                       match=rf"feature_input_hook: 'hook_resid_mid'.*layer 0.*'{adapter.mlp_path(0)}'"):
        TranscoderSet.from_pretrained(model, tc_dir)
    one = load(tc_dir)[LAYER]  # the layer it is bound to is the one named
    with pytest.raises(UnsupportedArchitectureError, match=rf"'hook_resid_mid'.*layer {LAYER}.*"
                                                           rf"'{adapter.mlp_path(LAYER)}'.*"
                                                           rf"'{adapter.mlp_norm_path(LAYER)}'"):
        TranscoderSet(model, {LAYER: one})
    with pytest.raises(UnsupportedArchitectureError,
                       match=rf"feature_input_hook: 'hook_resid_mid'.*layer 0.*'{adapter.mlp_path(0)}'"):
        CLTSet.from_pretrained(model, clt_dir)
    for out in ("hook_resid_post", "blocks.1.hook_mlp_out", "mlp.hook_post"):
        tc_dir, clt_dir = _files(tmp_path, out, feature_input_hook="mlp.hook_in", feature_output_hook=out)
        for directory, loader in ((tc_dir, TranscoderSet.from_pretrained), (clt_dir, CLTSet.from_pretrained)):
            with pytest.raises(UnsupportedArchitectureError, match=rf"feature_output_hook: '{out}'.*layer 0.*output"):
                loader(model, directory)


@pytest.mark.parametrize("family", FAMILIES)
def test_ln2_hook_normalized_only_where_the_norm_has_no_gain(family: str, tmp_path: Path) -> None:
    """``ln2.hook_normalized`` is the pre-MLP norm BEFORE its gain (and bias): our MLP input only where the gain is
    all ones and the bias zero. The tiny models' norms have random gains: refused; with unit norms: accepted,
    and there the normalised residual is indeed what the MLP reads."""
    model, hf = tiny_nnsight(family)
    adapter = get_adapter(model)
    output = "mlp.hook_out" if family == "gemma2" else "hook_mlp_out"
    tc_dir, clt_dir = _files(tmp_path, "ln2", feature_input_hook="ln2.hook_normalized", feature_output_hook=output)
    norm = adapter.mlp_norm_path(LAYER)
    with pytest.raises(UnsupportedArchitectureError, match=rf"'ln2.hook_normalized'.*layer {LAYER}.*'{norm}'.*gain"):
        TranscoderSet(model, {LAYER: load(tc_dir)[LAYER]})
    with pytest.raises(UnsupportedArchitectureError, match=r"'ln2.hook_normalized'.*layer 0.*gain"):
        TranscoderSet.from_pretrained(model, tc_dir)
    with pytest.raises(UnsupportedArchitectureError, match=r"'ln2.hook_normalized'.*layer 0.*gain"):
        CLTSet.from_pretrained(model, clt_dir)
    _unit_norms(hf, adapter)
    with torch.no_grad():  # the claim that makes it acceptable: norm(x) == x normalised, no gain
        x = torch.randn(3, adapter.d_model, generator=torch.Generator().manual_seed(0))
        m = hf.get_submodule(norm)
        if isinstance(m, torch.nn.LayerNorm):
            ref = (x - x.mean(-1, keepdim=True)) * torch.rsqrt(x.var(-1, unbiased=False, keepdim=True) + m.eps)
        else:
            eps = getattr(m, "eps", getattr(m, "variance_epsilon", 0.0))
            ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        assert torch.allclose(m(x), ref, atol=1e-5)
    assert list(TranscoderSet.from_pretrained(model, tc_dir)) == [0, 1]
    CLTSet.from_pretrained(model, clt_dir)
    unloaded = copy.deepcopy(hf).to("meta")  # weights not loaded yet: the gain cannot be checked, so refused
    with pytest.raises(UnsupportedArchitectureError, match=r"'ln2.hook_normalized'.*not loaded"):
        check_mlp_hooks(load(tc_dir)[LAYER], adapter, unloaded, (LAYER,))


def test_hook_mlp_out_is_the_mlp_output_only_without_post_norms(tmp_path: Path) -> None:
    """``hook_mlp_out`` with the MLP's input: accepted on Llama / GPT-2 (no post-norm), refused on Gemma-2."""
    tc_dir, clt_dir = _files(tmp_path, "out", feature_input_hook="mlp.hook_in", feature_output_hook="hook_mlp_out")
    for family in ("llama", "gpt2"):
        model, _ = tiny_nnsight(family)
        TranscoderSet.from_pretrained(model, tc_dir)
        CLTSet.from_pretrained(model, clt_dir)
    gemma, _ = tiny_nnsight("gemma2")
    with pytest.raises(UnsupportedArchitectureError, match="'hook_mlp_out'.*post_feedforward_layernorm"):
        TranscoderSet.from_pretrained(gemma, tc_dir)


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
