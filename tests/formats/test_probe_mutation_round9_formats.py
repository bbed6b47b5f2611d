"""Mutation probe, round 9 (docs/reliability.md): hook sites, the format registry, file validation and sparsify
files. Each test was seen failing with one hand-made mutant of ``formats/hook_sites.py``, ``formats/registry.py``,
``formats/validate.py`` or ``formats/sparsify.py`` and passing on the clean tree; the reference is the documented rule
(the modules' tables and docstrings, sparsify's ``SparseCoder`` layout and forward), a plain-torch formula or a
save / load round trip, never the code under test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import make_sae, tiny_config
from safetensors.torch import save_file

from nnsight_lorsa import get_adapter
from nnsight_lorsa.formats.hook_sites import sae_site_path
from nnsight_lorsa.formats.sparsify import load_sparsify, save_sparsify

_ADAPTERS: dict = {}


def adapter(family: str):
    """The family's adapter from its tiny config (paths only; no weights needed)."""
    if family not in _ADAPTERS:
        _ADAPTERS[family] = get_adapter(tiny_config(family))
    return _ADAPTERS[family]


def topk_sae(seed: int = 0):
    return make_sae(seed, activation="topk", activation_params={"k": 8}, apply_b_dec_to_input=True)


# ------------------------------------------------------------------ hook sites
def test_a_sparsify_sae_on_a_gemma2_mlp_hookpoint_is_the_hf_mlp_modules_output(tmp_path: Path) -> None:
    """sparsify hooks the Hugging Face module its hookpoint names: ``layers.1.mlp`` is Gemma-2's ``mlp`` itself, whose
    output comes before ``post_feedforward_layernorm`` (module table: a sparsify SAE ``layers.L.mlp`` is
    ``mlp_path(L)``'s output; only TransformerLens's ``hook_mlp_out`` is taken after the post-norm)."""
    ad = adapter("gemma2")
    m = load_sparsify(save_sparsify(topk_sae(), tmp_path / "layers.1.mlp"), adapter=ad)
    assert m.cfg.extra["sparsify"]["site"]["module_path"] == "model.layers.1.mlp"
    assert sae_site_path(m, ad) == "model.layers.1.mlp"


def test_a_sparsify_transcoder_on_a_gpt2_hookpoint_names_its_layer_and_mlp(tmp_path: Path) -> None:
    """sparsify names GPT-2's blocks ``h.L`` (the base model's ``h`` ModuleList, not ``layers``): a transcoder saved
    under ``h.1.mlp`` replaces layer 1's MLP, ``transformer.h.1.mlp``'s input (module docstring's table)."""
    from helpers import make_transcoder

    ad = adapter("gpt2")
    m = load_sparsify(save_sparsify(make_transcoder(skip=False), tmp_path / "h.1.mlp"), adapter=ad)
    assert m.cfg.layer == 1
    assert m.cfg.extra["sparsify"]["site"] == {"layer": 1, "site": "mlp_in", "module_path": "transformer.h.1.mlp",
                                               "io": "input"}


def _llamascopium_sae(directory: Path, hook: str, d: int = 64, f: int = 128) -> Path:
    """A folded (``norm_activation: inference``) llamascopium SAE in their layout (llamascopium_sae's docstring)."""
    g = torch.Generator().manual_seed(3)
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({
        "sae_type": "sae", "d_model": d, "expansion_factor": f // d, "act_fn": "relu", "norm_activation": "inference",
        "hook_point_in": hook, "hook_point_out": hook, "use_decoder_bias": True}))
    save_file({"W_E": torch.randn(d, f, generator=g), "b_E": torch.randn(f, generator=g),
               "W_D": torch.randn(f, d, generator=g), "b_D": torch.randn(d, generator=g)},
              str(directory / "sae_weights.safetensors"))
    return directory


def test_a_llamascopium_sae_on_hook_mlp_out_of_gemma2_is_placed_after_the_post_norm(tmp_path: Path) -> None:
    """A llamascopium file names TransformerLens hooks: ``blocks.1.hook_mlp_out`` is, on Gemma-2, taken after
    ``ln2_post`` ("that which is added to the residual stream"): ``post_feedforward_layernorm``'s output, as for a
    SAELens file (module table), not the MLP module's output a sparsify hookpoint would name."""
    from nnsight_lorsa.formats.llamascopium_sae import load_llamascopium_sae

    ad = adapter("gemma2")
    m = load_llamascopium_sae(_llamascopium_sae(tmp_path / "sae", "blocks.1.hook_mlp_out"), adapter=ad)
    assert sae_site_path(m, ad) == "model.layers.1.post_feedforward_layernorm"


PEER_FIELDS = Path(__file__).resolve().parents[1] / "fixtures" / "peers" / "fields"


@pytest.mark.parametrize("head", [0, 1])
def test_a_one_head_saelens_sae_has_no_site_whichever_head(tmp_path: Path, head: int) -> None:
    """SAELens ``metadata.hook_head_index`` selects one head of the hook's activations (an index: head 0 is a head
    like any other): no module output of ours is that slice, so no site is derived, for head 0 too (the peer's own
    file, its head index set to ``head``; sae_site_path's documented refusal)."""
    import shutil

    from nnsight_lorsa.errors import ConfigMismatchError
    from nnsight_lorsa.formats import load

    case = tmp_path / "case"
    shutil.copytree(PEER_FIELDS / "saelens" / "hook_head_index_resid", case)
    cfg = json.loads((case / "cfg.json").read_text())
    cfg["metadata"]["hook_head_index"] = head
    (case / "cfg.json").write_text(json.dumps(cfg))
    m = load(case, format="saelens")
    assert m.cfg.extra["saelens"]["hook_head_index"] == head
    with pytest.raises(ConfigMismatchError, match=f"head {head}"):
        sae_site_path(m, adapter("llama"))


# ------------------------------------------------------------------ the registry
def test_load_all_lists_named_errors_but_lets_a_crash_through(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """load_all's contract: a subfolder that fails with one of the package's named errors (a ``LorsaError``) is
    listed in ``failures`` and the others load; anything else (a bug, a torch RuntimeError, MemoryError) is no
    property of the file and propagates instead of being filed as a failure."""
    from nnsight_lorsa.errors import CheckpointError
    from nnsight_lorsa.formats import load_all, registry

    for name in ("layers.0", "layers.1"):
        save_sparsify(topk_sae(), tmp_path / name)
    real = registry.load

    def failing(kind: type[Exception]):
        def load(path, **kw):  # noqa: ANN001, ANN202
            if Path(path).name == "layers.1":
                raise kind("layers.1 broke")
            return real(path, **kw)
        return load

    monkeypatch.setattr(registry, "load", failing(CheckpointError))
    with pytest.warns(registry.PartialLoadWarning):
        out = load_all(tmp_path, format="sparsify")
    assert list(out) == ["layers.0"] and isinstance(out.failures["layers.1"], CheckpointError)
    monkeypatch.setattr(registry, "load", failing(RuntimeError))
    with pytest.raises(RuntimeError, match="layers.1 broke"):
        load_all(tmp_path, format="sparsify")


# ------------------------------------------------------------------ validation
def test_a_scaled_size_is_the_nearest_integer_of_a_product_that_float_rounding_left_below_it() -> None:
    """scaled_size's rule: ``d_model · expansion_factor`` must be integral (within 1e-6) and is that integer; float
    products land a hair below it (100 · 0.57 = 56.99999999999999 in IEEE doubles), which is 57, not 56."""
    from nnsight_lorsa.formats.validate import scaled_size

    assert 100 * 0.57 < 57  # the float product the rule has to absorb
    assert scaled_size(100, 0.57, "cfg.json", "expansion_factor") == 57
    assert scaled_size(64, 2, "cfg.json", "expansion_factor") == 128


@pytest.mark.parametrize("key", ["W_dec", "encoder.weight"])
def test_a_sparsify_tensor_stored_transposed_is_a_named_shape_error(tmp_path: Path, key: str) -> None:
    """sparsify's layout: ``encoder.weight (num_latents, d_in)``, ``W_dec (num_latents, d_in)``; one stored the other
    way round (``.T`` before ``save_file``) holds the right number of values in the wrong shape: a CheckpointError
    naming the file and the key (validate.check_tensor_inventory), not a torch size-mismatch error or a load."""
    from safetensors.torch import load_file

    from nnsight_lorsa.errors import CheckpointError

    d = save_sparsify(topk_sae(), tmp_path / "layers.0")
    state = load_file(str(d / "sae.safetensors"))
    state[key] = state[key].T.contiguous()
    (d / "checksums.json").unlink()  # as sparsify writes it: no manifest
    save_file(state, str(d / "sae.safetensors"))
    with pytest.raises(CheckpointError, match=rf"sae\.safetensors.*tensor '{key}' has shape \(64, 128\)"):
        load_sparsify(d)


def test_check_mlp_hooks_checks_every_layer_it_is_given() -> None:
    """``ln2.hook_normalized`` where the family has no pre-MLP norm (OLMo-2: its norms come after the MLP) is no
    tensor of ours: refused at every layer it is given, also when that layer comes second. (GPT-2's LayerNorm with a
    gain, the case this test held until 2026-11-29, is now computed: ``(x − mean x) / σ(x)`` of its input.)"""
    from helpers import make_transcoder, tiny_hf_model

    from nnsight_lorsa.errors import UnsupportedArchitectureError
    from nnsight_lorsa.formats.hook_sites import check_mlp_hooks

    tc = make_transcoder(skip=False, extra={"circuit_tracer": {"feature_input_hook": "ln2.hook_normalized",
                                                               "feature_output_hook": "mlp.hook_out"}})
    hf = tiny_hf_model("gpt2")
    with torch.no_grad():
        hf.transformer.h[1].ln_2.weight.fill_(1.5)
    check_mlp_hooks(tc, get_adapter(hf), hf, [0, 1])
    olmo = tiny_hf_model("olmo2")
    with pytest.raises(UnsupportedArchitectureError, match=r"at layer 0 "):
        check_mlp_hooks(tc, get_adapter(olmo), olmo, [0, 1])


# ------------------------------------------------------------------ sparsify files
def _rewrite_cfg(directory: Path, **edits: object) -> None:
    """Edit a saved ``cfg.json`` as a sparsify run would have written it (sparsify writes no checksums manifest)."""
    (directory / "checksums.json").unlink()
    cfg = json.loads((directory / "cfg.json").read_text())
    cfg.update(edits)
    (directory / "cfg.json").write_text(json.dumps(cfg))


def test_a_sparsify_file_with_num_latents_0_has_d_in_times_expansion_factor_latents(tmp_path: Path) -> None:
    """sparsify's ``SparseCoderConfig.num_latents`` defaults to 0, meaning ``d_in · expansion_factor`` latents (the
    module docstring; what a run trained with ``--expansion_factor`` writes): such a file loads with that many."""
    sae = topk_sae()  # d_in 64, 128 latents: expansion_factor 2
    d = save_sparsify(sae, tmp_path / "layers.0")
    _rewrite_cfg(d, num_latents=0, expansion_factor=2)
    m = load_sparsify(d)
    assert m.cfg.d_sae == 128
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(m(x), sae(x), rtol=0, atol=0)


def test_a_sparsify_sae_records_our_module_path_as_its_hook_given_an_adapter(tmp_path: Path) -> None:
    """``SAEConfig.hook`` is the module path when an adapter is given (the loaders' rule, formats/saelens.py's
    docstring; sparsify's hookpoint ``h.1`` names GPT-2's ``transformer.h.1``), the hookpoint itself without."""
    d = save_sparsify(topk_sae(), tmp_path / "h.1")
    assert load_sparsify(d, adapter=adapter("gpt2")).cfg.hook == "transformer.h.1"
    assert load_sparsify(d).cfg.hook == "h.1"


def test_a_sparsify_cfg_with_null_options_takes_their_defaults(tmp_path: Path) -> None:
    """A JSON ``null`` is an unset field (validate.config_value: "missing/null fields take the default"; pydantic /
    dataclass dumps write unset optionals as null): ``multi_topk: null``, ``skip_connection: null`` and
    ``transcode: null`` load as False, the ``k`` coder with no skip path."""
    sae = topk_sae()
    d = save_sparsify(sae, tmp_path / "layers.0")
    _rewrite_cfg(d, multi_topk=None, skip_connection=None, transcode=None)
    m = load_sparsify(d)
    assert m.cfg.extra["sparsify"]["multi_topk"] is False and type(m) is type(sae)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(m(x), sae(x), rtol=0, atol=0)
