"""Three gaps in reading the ecosystem's files (2026-11-30, tenth session), each against files its peer's own code
read or wrote, no peer installed here:

* a GemmaScope-2 transcoder whose ``config.json`` gives ``affine_connection`` as ``1`` / ``0`` is read as SAELens
  6.54.12 reads it (``tests/fixtures/peers/saelens/gemma_3/make.py``: SAELens's own loader built the references); the
  string ``"false"`` — a skip transcoder in SAELens, which tests truthiness — is refused by name;
* a bf16 Lorsa written by Llamascopium 2.0.0b34, loaded as fp32 and saved again, keeps the file's bf16 rotary tables
  (``tests/fixtures/peers/llamascopium_resave/make.py``); they were written in fp32 from our angles, so that our reload
  lost ``table_dtype`` (0.20 relative max off our load of the original) and theirs used other tables (4 entries one
  bf16 step apart: 2.6e-5 off their reload of the original, now 3.6e-7);
* ``load`` of a local folder above a GemmaScope-2 folder (the hook folder, the repo's top) reads the one found within
  two levels, and refuses several by name, listing them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from peer_reference import PEER_FIXTURES, rel_error
from safetensors import safe_open
from safetensors.torch import load_file

from nnsight_lorsa.errors import CheckpointError, FormatDetectionError
from nnsight_lorsa.formats import load, save
from nnsight_lorsa.modules.transcoder import SkipTranscoder, Transcoder

GEMMA_3 = PEER_FIXTURES / "saelens" / "gemma_3"
REPO = GEMMA_3 / "gemma-scope-2-tiny-pt"
RESAVE = PEER_FIXTURES / "llamascopium_resave"
REL = 1e-6


def _reference(case: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    path = GEMMA_3 / "references" / f"{case}.safetensors"
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    return load_file(str(path)), meta


# ------------------------------------------------------------------ 1. affine_connection as SAELens reads it
@pytest.mark.parametrize(("case", "value", "cls", "theirs"), [
    ("skip_transcoder_int_1", 1, SkipTranscoder, "JumpReLUSkipTranscoder"),
    ("transcoder_int_0", 0, Transcoder, "JumpReLUTranscoder"),
])
def test_affine_connection_as_an_int_is_read_as_saelens_reads_it(case: str, value: int, cls: type,
                                                                  theirs: str) -> None:
    ref, meta = _reference(case)
    folder = REPO / meta["folder"]
    assert json.loads((folder / "config.json").read_text())["affine_connection"] == value
    module = load(folder)  # was: CheckpointError "'affine_connection' must be true or false, got 1"
    assert type(module) is cls and meta["class"] == theirs
    assert module.cfg.extra["saelens"]["architecture"] == json.loads(meta["cfg"])["architecture"]
    with torch.no_grad():
        acts = module.encode(ref["x"])
        assert torch.equal(acts != 0, ref["encode"] != 0)
        assert rel_error(acts, ref["encode"]) <= REL
        assert rel_error(module(ref["x"]), ref["forward"]) <= REL


@pytest.mark.parametrize("value", ["false", "true", 2, 1.0, None, []])
def test_affine_connection_other_than_a_bool_or_0_1_is_refused_by_name(tmp_path: Path, value: object) -> None:
    """SAELens built a skip transcoder from ``"affine_connection": "false"`` (the fixture's reference says so): a
    silent surprise; every value but a JSON boolean or 0 / 1 is refused, naming the key and the value."""
    ref, meta = _reference("skip_transcoder_string_false")
    assert meta["class"] == "JumpReLUSkipTranscoder"  # what SAELens made of "false"
    d = tmp_path / "gemma-scope-2-tiny-pt" / meta["folder"]
    shutil.copytree(REPO / meta["folder"], d)
    if value != "false":
        cfg = json.loads((d / "config.json").read_text())
        cfg["affine_connection"] = value
        (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"key 'affine_connection' must be true or false \(or 0 / 1\), got "):
        load(d)


# ------------------------------------------------------------------ 2. a bf16 Llamascopium Lorsa saved again
def test_bf16_lorsa_loaded_as_fp32_is_saved_with_its_own_rotary_tables(tmp_path: Path) -> None:
    src = RESAVE / "bf16_n128"
    theirs = load_file(str(src / "sae_weights.safetensors"))
    module = load(src, dtype=torch.float32)
    assert module.W_Q.dtype == torch.float32 and module.cfg.rotary.table_dtype == "bfloat16"  # type: ignore[union-attr]
    out = save(module, tmp_path / "again", format="llamascopium")
    ours = load_file(str(out / "sae_weights.safetensors"))
    for key in ("rotary_cos", "rotary_sin"):  # what their reload uses (load_state_dict overwrites the buffers)
        assert ours[key].dtype == theirs[key].dtype == torch.bfloat16
        assert torch.equal(ours[key], theirs[key])
    assert ours["W_Q"].dtype == torch.float32
    # our reload keeps rounding its tables to bf16: the same module as the load of the original
    again = load(out)
    assert again.cfg.rotary == module.cfg.rotary
    x = load_file(str(src / "reference.safetensors"))["x"]
    with torch.no_grad():
        assert torch.equal(again(x), module(x))
    # the committed reverse file is what save writes today, and Llamascopium's fp32 reload of it was theirs of the
    # original (make.py step 3)
    committed = load_file(str(RESAVE / "reverse" / "bf16_n128" / "sae_weights.safetensors"))
    assert committed.keys() == ours.keys() and all(torch.equal(committed[k], ours[k]) for k in ours)
    result = json.loads((RESAVE / "reverse" / "result.json").read_text())["bf16_n128"]
    assert result["rotary_tables_equal"] and result["fp32_reload_max_rel_vs_original"] <= REL


def test_fp32_tables_are_their_init_s() -> None:
    """Without a ``table_dtype`` the tables are their ``__init__``'s for the weights' dtype: angles ``pos / freq``
    (what the peer's own bf16 file holds, rounded)."""
    from nnsight_lorsa.formats.llamascopium import _their_cos_sin

    theirs = load_file(str(RESAVE / "bf16_n128" / "sae_weights.safetensors"))
    doc = json.loads((RESAVE / "bf16_n128" / "config.json").read_text())
    cos, sin = _their_cos_sin(doc, doc["n_ctx"], torch.bfloat16)
    assert torch.equal(cos, theirs["rotary_cos"]) and torch.equal(sin, theirs["rotary_sin"])
    cos32, _ = _their_cos_sin(doc, doc["n_ctx"], torch.float32)
    assert cos32.dtype == torch.float32 and torch.equal(cos32.to(torch.bfloat16), theirs["rotary_cos"])


# ------------------------------------------------------------------ 3. a GemmaScope-2 folder below the one given
def test_the_only_gemma_3_folder_below_is_read(tmp_path: Path) -> None:
    ref, meta = _reference("resid_post")
    module = load(REPO / "resid_post")  # the hook folder: one SAE in it (was: FormatDetectionError)
    assert module.cfg.extra["saelens"]["folder"] == meta["folder"] == "resid_post/layer_1_width_16k_l0_small"
    with torch.no_grad():
        assert rel_error(module(ref["x"]), ref["forward"]) <= REL
    root = tmp_path / "gemma-scope-2-tiny-pt"  # the repo's top, holding one SAE two levels down
    shutil.copytree(REPO / meta["folder"], root / meta["folder"])
    (root / ".cache" / "huggingface").mkdir(parents=True)  # hidden folders are not looked into
    for where in (root, str(root)):
        module = load(where)
        assert module.cfg.extra["saelens"]["model_name"] == "google/gemma-3-tiny-pt"
        with torch.no_grad():
            assert rel_error(module(ref["x"]), ref["forward"]) <= REL
    assert load(root, format="saelens").cfg.d_sae == module.cfg.d_sae


def test_several_checkpoints_below_are_refused_listing_them(tmp_path: Path) -> None:
    with pytest.raises(FormatDetectionError, match="8 checkpoints within 2 levels") as info:
        load(REPO)
    msg = str(info.value)
    for folder in ("resid_post/layer_1_width_16k_l0_small", "transcoder/layer_0_width_16k_l0_small",
                   "mlp_out/layer_2_width_16k_l0_small"):
        assert repr(folder) in msg
    assert "subfolder='attn_out/layer_1_width_16k_l0_small'" in msg
    module = load(REPO, subfolder="mlp_out/layer_2_width_16k_l0_small")  # what the message says to do
    assert module.cfg.extra["saelens"]["folder"] == "mlp_out/layer_2_width_16k_l0_small"
    with pytest.raises(FormatDetectionError, match="layer_0_width_16k_l0_small"):
        load(REPO / "transcoder", format="saelens")
    # one GemmaScope-2 folder beside a checkpoint of another format: ambiguous too
    root = tmp_path / "mixed"
    shutil.copytree(REPO / "resid_post", root / "resid_post")
    shutil.copytree(PEER_FIXTURES / "saelens" / "standard", root / "standard")
    with pytest.raises(FormatDetectionError, match=r"2 checkpoints .*'resid_post/layer_1_width_16k_l0_small'"):
        load(root)
    # no GemmaScope-2 folder below: the detection error is the one it was
    shutil.rmtree(root / "resid_post")
    with pytest.raises(FormatDetectionError, match="no known sparse-coder checkpoint files"):
        load(root)
