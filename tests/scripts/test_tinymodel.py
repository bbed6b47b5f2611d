"""Tests for the embedded default model: its packaged asset (located by nnsight_lorsa.assets) and the
script that builds it (scripts/tinymodel.py, outside the installed package)."""

from __future__ import annotations

import json
import math
import types

import pytest
import torch
from helpers import ROOT, load_script
from transformers import AutoModelForCausalLM, AutoTokenizer

from nnsight_lorsa.assets import BOS_ID, EOS_ID, default_corpus_path, default_model_dir

_SCRIPT = ROOT / "scripts" / "tinymodel.py"


_tm = load_script(_SCRIPT, "tinymodel")  # the builder script (not part of the package)
corpus_cross_entropy = _tm.corpus_cross_entropy
tiny_llama_config = _tm.tiny_llama_config
train_tiny_llama = _tm.train_tiny_llama
train_tokenizer = _tm.train_tokenizer


@pytest.fixture(scope="module")
def asset():
    path = default_model_dir()
    info = json.loads((path / "training.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    return model, tok, info


def test_packaged_asset_loads_offline_and_beats_uniform(asset):
    model, tok, info = asset
    assert sum(f.stat().st_size for f in default_model_dir().iterdir()) < 10 * 2**20

    # Tokenizer: BOS prepended, EOS/pad set, lossless round trip.
    enc = tok("hello")
    assert enc.input_ids[0] == BOS_ID == tok.bos_token_id
    assert tok.eos_token_id == tok.pad_token_id == EOS_ID
    assert tok.decode(tok("ROMEO:\nWherefore art thou").input_ids, skip_special_tokens=True) == (
        "ROMEO:\nWherefore art thou"
    )

    # Architecture: Llama-3 style GQA and llama3 rope actually used by the rotary embedding.
    cfg = model.config
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 32)
    assert cfg.rope_parameters["rope_type"] == "llama3"
    assert model.model.rotary_emb.rope_type == "llama3"

    # Held-out slice (inside the validation split): CE near the recorded val CE, far below uniform.
    text = default_corpus_path().read_text(encoding="utf-8")
    assert info["val_chars"] > 2000
    ids = tok(text[-2000:], add_special_tokens=False).input_ids
    ce = corpus_cross_entropy(model, ids, seq_len=info["seq_len"])
    uniform = math.log(len(tok))
    assert info["uniform_ce"] == pytest.approx(uniform)
    assert ce < info["val_ce"] + 0.5
    assert ce < uniform - 2.0


def _first_and_second_copy_ce(model, seg: torch.Tensor) -> tuple[float, float]:
    """Mean CE (nats/token) on the first and second copy of ``[BOS] + seg + seg`` (``seg``: [batch, n])."""
    n = seg.shape[1]
    x = torch.cat([torch.full((seg.shape[0], 1), BOS_ID), seg, seg], dim=1)
    with torch.no_grad():
        logp = model(input_ids=x).logits.log_softmax(-1)
    nll = -logp[:, :-1].gather(-1, x[:, 1:, None])[..., 0]  # nll[:, i] scores token i + 1
    return nll[:, 4:n].mean().item(), nll[:, n + 1 :].mean().item()  # skip the unpredictable copy start


def test_packaged_asset_copies_repeated_sequences(asset):
    """Induction-like copying: a repeated segment is far easier the second time, for held-out text and
    for random tokens (which only in-context copying can predict)."""
    model, tok, info = asset
    text = default_corpus_path().read_text(encoding="utf-8")
    ids = torch.tensor(tok(text[-info["val_chars"] :], add_special_tokens=False).input_ids)
    natural = torch.stack([ids[s : s + 40] for s in range(1000, 9000, 1000)])
    first, second = _first_and_second_copy_ce(model, natural)
    assert second < first - 1.0, (first, second)

    rand = torch.randint(2, len(tok), (8, 40), generator=torch.Generator().manual_seed(0))
    first, second = _first_and_second_copy_ce(model, rand)
    assert second < first - 1.0, (first, second)


def test_train_tiny_llama_few_steps_produces_loadable_dir(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(default_corpus_path().read_text(encoding="utf-8")[:20_000], encoding="utf-8")
    out = tmp_path / "model"
    info = train_tiny_llama(
        corpus,
        out,
        steps=3,
        seq_len=16,
        batch_size=2,
        vocab_size=300,
        induction_warmup_steps=2,
        progress=False,
        eval_batches=4,
    )
    assert info["steps"] == 3 and info["corpus_tokens_seen"] == 3 * 2 * 16
    assert info["induction_warmup_steps"] <= 2
    assert math.isfinite(info["val_ce"]) and math.isfinite(info["train_loss"])
    assert json.loads((out / "training.json").read_text())["val_ce"] == pytest.approx(info["val_ce"])

    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    enc = tok(["First Citizen:", "to be"], padding=True, return_tensors="pt")
    assert enc.input_ids.shape[0] == 2 and (enc.input_ids[:, 0] == EOS_ID).any()  # left padding
    with torch.no_grad():
        logits = model(**enc).logits
    assert logits.shape == (*enc.input_ids.shape, 300)


def test_train_tokenizer_special_tokens_and_errors():
    tok = train_tokenizer("the quick brown fox jumps over the lazy dog\n" * 50, vocab_size=300)
    assert tok.token_to_id("<|bos|>") == BOS_ID and tok.token_to_id("<|endoftext|>") == EOS_ID
    enc = tok.encode("the fox")
    assert enc.ids[0] == BOS_ID
    assert tok.decode(enc.ids) == "the fox"
    with pytest.raises(ValueError):
        train_tokenizer("abc", vocab_size=100)


def test_tiny_llama_config_llama3_rope():
    cfg = tiny_llama_config(512)
    assert cfg.rope_parameters["rope_type"] == "llama3"
    assert cfg.rope_parameters["original_max_position_embeddings"] == 64 < cfg.max_position_embeddings
    with pytest.raises(ValueError):
        tiny_llama_config(512, rope_original_max_position_embeddings=1024)


def test_embedded_model_reads_the_same_on_transformers_4_and_5(tmp_path):
    """The asset carries RoPE both as transformers 5 reads it (``rope_parameters``) and as transformers 4
    does (``rope_theta`` + ``rope_scaling``), and names its tokenizer ``PreTrainedTokenizerFast`` (known
    to both); ``readable_by_transformers_4`` adds exactly that to a transformers-5 save."""
    from nnsight_lorsa.adapters.base import check_rope_read

    d = default_model_dir()
    cfg = json.loads((d / "config.json").read_text())
    rp = cfg["rope_parameters"]
    assert rp["rope_type"] == "llama3" and cfg["rope_theta"] == rp["rope_theta"]
    assert cfg["rope_scaling"] == {k: v for k, v in rp.items() if k != "rope_theta"}
    assert json.loads((d / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    # transformers 4 keeps the JSON keys as attributes and runs rope_scaling / rope_theta: the same RoPE
    check_rope_read(types.SimpleNamespace(**cfg), transformers_major=4)
    # the script's post-save step, on a transformers-5 save
    (tmp_path / "config.json").write_text(json.dumps({"rope_parameters": rp}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TokenizersBackend"}))
    _tm.readable_by_transformers_4(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["rope_scaling"] == cfg["rope_scaling"] and written["rope_theta"] == rp["rope_theta"]
    tok = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert tok["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tok["model_input_names"] == ["input_ids", "attention_mask"]
    # the installed transformers' tokenizer gives only what a causal LM's generate takes (transformers 4's
    # PreTrainedTokenizerFast would add token_type_ids without model_input_names)
    from nnsight_lorsa.envoy.tokens import load_tokenizer

    assert list(load_tokenizer(d)("to be or not", return_tensors="pt")) == ["input_ids", "attention_mask"]
