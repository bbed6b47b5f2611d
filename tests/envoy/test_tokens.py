"""A model directory with weights and config but no tokenizer files loads (``envoy.load_model``, the way
the docs and the CLI load models) and works on token ids; text raises MissingTokenizerError saying what
is missing; tokenizer files that cannot be loaded raise it too, naming them."""

from __future__ import annotations

import warnings

import nnsight
import pytest
import torch
from helpers import LAYER, make_lorsa, make_transcoders, random_ids, tiny_hf_model

from nnsight_lorsa import LorsaSet, ReplacementModel, TranscoderSet, get_adapter
from nnsight_lorsa.envoy import load_model
from nnsight_lorsa.envoy.tokens import IdsOnlyTokenizer
from nnsight_lorsa.errors import MissingTokenizerError


@pytest.fixture(scope="module")
def no_tokenizer(tmp_path_factory):
    d = tmp_path_factory.mktemp("no_tokenizer")
    hf = tiny_hf_model("llama")
    hf.save_pretrained(d)
    assert not any(p.name.startswith(("tokenizer", "vocab", "special")) for p in d.iterdir())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return d, hf, load_model(str(d))


def test_traces_generation_and_attribution_take_token_ids(no_tokenizer):
    from nnsight_lorsa.attribution import attribute

    d, hf, model = no_tokenizer
    assert isinstance(model.tokenizer, IdsOnlyTokenizer)
    assert model.tokenizer.eos_token_id == hf.config.eos_token_id
    ids = random_ids(1, 8)
    with torch.no_grad():
        ref = hf(ids).logits
    adapter = get_adapter(model)
    rm = ReplacementModel(model, lorsas=LorsaSet(model, {LAYER: make_lorsa(hf, adapter)}),
                          transcoders=TranscoderSet(model, make_transcoders((0, 2))))
    with rm.trace(ids):
        rm.replace()
        logits = nnsight.save(model.lm_head.output)
    assert (logits - ref).abs().max() <= 1e-5 * ref.abs().max()
    with model.generate(ids, max_new_tokens=3, pad_token_id=hf.config.eos_token_id) as tracer:
        out = nnsight.save(tracer.result)
    assert out.shape == (1, 11) and torch.equal(out[:, :8], ids)
    graph = attribute(rm, ids[0], batch_size=16)
    assert torch.equal(graph.tokens, ids[0])


def test_text_raises_missing_tokenizer_error_naming_the_directory(no_tokenizer):
    from nnsight_lorsa.attribution import attribute
    from nnsight_lorsa.training import TokenDataset

    d, hf, model = no_tokenizer
    rm = ReplacementModel(model, transcoders=TranscoderSet(model, make_transcoders((0,))))
    with pytest.raises(MissingTokenizerError, match=r"attribute\(prompt=<text>\).*token ids"):
        attribute(rm, "to be or not")
    with pytest.raises(MissingTokenizerError, match=str(d)):
        TokenDataset.from_text(model.tokenizer, "to be or not to be", 8)
    with pytest.raises(MissingTokenizerError, match="tokenizer.json"), model.trace("to be"):
        nnsight.save(model.lm_head.output)
    assert TokenDataset(random_ids(4, 8)).tokens.shape == (4, 8)  # training data as ids needs none


def test_unloadable_tokenizer_files_are_named(tmp_path):
    hf = tiny_hf_model("llama")
    hf.save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{ not json")
    with pytest.raises(MissingTokenizerError, match=r"tokenizer\.json"):
        load_model(str(tmp_path))
