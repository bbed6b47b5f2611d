"""The IOI builder on SentencePiece / Llama-style tokenizers (docs/reliability.md, "Demo outputs, normalized effect
and SentencePiece IOI probe (2026-11-27)").

No SentencePiece tokenizer is among the offline fixtures (the embedded model's and the benchmark model's are a
byte-level BPE and a word-level one), so one is built here with ``tokenizers``, as Hugging Face converts Llama-2's:
a BPE with ``byte_fallback`` (the 256 ``<0xNN>`` tokens in its vocabulary), a ``Metaspace`` pre-tokenizer (``▁`` marks
a word start, prepended to the first word) and Llama's decoder (``▁`` → space, byte fallback, fuse, strip the one
leading space). Such a tokenizer decodes ``▁Mary`` alone as ``"Mary"``: ``single_token(" Mary")`` is None for every
name, and ``ioi_task`` refused (``TaskTokenizationError: only 0 single-token names``). The references below read
the vocabulary itself (``"▁" + name``) and the tokenizer's own encoding of each prompt, not the builder's code.
"""

from __future__ import annotations

import json
import random
from functools import cache

import pytest
from helpers import generated
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

import nnsight_lorsa
from nnsight_lorsa.patching.tasks import IOI_TEMPLATES, NAMES, TaskTokenizationError, ioi_task, name_tokens

#: names the tokenizer cannot hold as one token: not in its training text, or spelled through byte fallback
ODD_NAMES = (" Zoë", " Xqzj", " Ñandu", " Ωmega")


@cache
def llama_style(prepend: str = "first", vocab: int = 1200) -> PreTrainedTokenizerFast:
    """A Llama-2-style SentencePiece BPE (byte fallback, ``▁`` word starts) trained on the embedded corpus and the
    names, with ``prepend`` the Metaspace scheme (``"first"``: Llama-2's legacy=False conversion; ``"always"``)."""
    from pathlib import Path

    text = (Path(nnsight_lorsa.__file__).parent / "assets" / "tinyshakespeare.txt").read_text()[:60_000]
    names = " ".join(f"Then, {a.strip()} and {b.strip()} went to the park." for a in NAMES for b in NAMES)
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=prepend)
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator([text, names], trainer)
    spec = json.loads(tok.to_str())  # add the 256 byte-fallback tokens, as SentencePiece's vocabulary has them
    vocab_map = spec["model"]["vocab"]
    for b in range(256):
        vocab_map.setdefault(f"<0x{b:02X}>", len(vocab_map))
    spec["model"]["byte_fallback"] = True
    spec["decoder"] = json.loads(decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                                    decoders.Fuse(), decoders.Strip(" ", 1, 0)]).__getstate__())
    tok = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def encode(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def test_the_tokenizer_is_sentencepiece_style():
    """The fixture is what the probe claims: ``▁`` word starts that decode without their space alone, byte fallback
    for characters outside the vocabulary."""
    tok = llama_style()
    vocab = tok.get_vocab()
    assert "▁Mary" in vocab and tok.decode([vocab["▁Mary"]]) == "Mary"
    assert vocab["▁Mary"] in encode(tok, "Then, Mary went")
    ids = encode(tok, "Zoë")
    assert vocab["<0xC3>"] in ids and vocab["<0xAB>"] in ids and tok.decode(ids) == "Zoë"


@pytest.mark.parametrize("prepend", ["first", "always"])
def test_names_are_found_as_their_word_start_tokens(prepend):
    """Seen failing: ``name_tokens`` found no name (``TaskTokenizationError: only 0 single-token names``)."""
    tok = llama_style(prepend)
    vocab = tok.get_vocab()
    found = dict(name_tokens(tok, (*NAMES, *ODD_NAMES), min_count=5, search_vocab=False))
    want = {n: vocab["▁" + n.strip()] for n in NAMES if "▁" + n.strip() in vocab}
    assert len(want) >= 10 and found == want, (found, want)  # the odd names never: not single tokens


def test_the_vocabulary_search_finds_word_start_names_and_never_a_byte_token():
    tok = llama_style()
    vocab = tok.get_vocab()
    found = name_tokens(tok, ODD_NAMES, min_count=25)  # none of the given: the search must fill the pool
    assert len(found) >= 25
    for name, tid in found:
        piece = tok.convert_ids_to_tokens(tid)
        assert piece == "▁" + name[1:] and name[1].isupper() and name[2:].islower(), (name, piece)
        assert not piece.startswith("<0x") and vocab[piece] == tid


def check_ioi(tok, batch, n: int) -> None:
    """Every prompt against the tokenizer's own encoding of its meta text: BOS, the text's ids, the IO name's
    word-start token once and the subject's twice; the answers are the names' word-start tokens and the tokenizer's
    own next token after the prompt; the corrupt prompt holds neither."""
    vocab = tok.get_vocab()
    bos = [tok.bos_token_id]
    assert batch.clean.shape == batch.corrupt.shape and batch.clean.shape[0] == n
    for i, meta in enumerate(batch.meta):
        clean, corrupt = batch.clean[i].tolist(), batch.corrupt[i].tolist()
        assert clean == bos + encode(tok, meta["text"]) and corrupt == bos + encode(tok, meta["corrupt_text"])
        io, s = vocab["▁" + meta["io"].strip()], vocab["▁" + meta["s"].strip()]
        assert int(batch.correct_ids[i]) == io and int(batch.incorrect_ids[i]) == s, meta
        assert clean.count(io) == 1 and clean.count(s) == 2, meta
        assert io not in corrupt and s not in corrupt, meta
        for ans in (io, s):
            body = clean[1:]
            assert encode(tok, tok.decode(body + [ans])) == body + [ans], meta
        assert not any(tok.convert_ids_to_tokens(t).startswith("<0x") for t in clean + corrupt), meta


@pytest.mark.parametrize("template", IOI_TEMPLATES)
def test_ioi_builds_on_a_sentencepiece_tokenizer(template):
    """Seen failing: ``TaskTokenizationError: only 0 single-token names``."""
    tok = llama_style()
    batch = ioi_task(tok, 6, template=template, order="mixed", seed=3)
    check_ioi(tok, batch, 6)


def test_names_that_only_byte_fallback_spells_are_not_names():
    """A name spelled through ``<0xNN>`` tokens or several pieces is no single-token name; given only those, IOI takes
    word-start names from the vocabulary (checked by ``check_ioi``)."""
    tok = llama_style()
    with pytest.raises(TaskTokenizationError, match="only 0 single-token names"):
        name_tokens(tok, ODD_NAMES, min_count=1, search_vocab=False)
    check_ioi(tok, ioi_task(tok, 4, names=ODD_NAMES, seed=1), 4)


@generated(6, 300, seed=st.integers(0, 2**31 - 1))
def test_generated_ioi_batches_on_sentencepiece_tokenizers_are_what_they_claim(seed):
    rng = random.Random(seed)
    tok = llama_style(rng.choice(["first", "always"]), rng.choice([600, 1200, 3000]))
    n = rng.randint(1, 6)
    names = tuple(rng.sample(NAMES + ODD_NAMES, rng.randint(3, len(NAMES))))
    try:
        batch = ioi_task(tok, n, template=rng.choice(IOI_TEMPLATES), order=rng.choice(["ABBA", "BABA", "mixed"]),
                         names=names, seed=rng.randrange(10**6))
    except TaskTokenizationError as e:
        assert "single-token names" in str(e) or "lengths" in str(e), e
        return
    check_ioi(tok, batch, n)


@pytest.mark.parametrize("prepend", ["first", "always"])
@pytest.mark.parametrize("template", IOI_TEMPLATES)
def test_a_template_word_is_never_taken_as_a_name(template, prepend):
    """Seen failing (the sweep's seed 9888): given too few names the tokenizer can hold, the vocabulary search took
    ``▁When`` as a name, and "When Jun and When got a snack …, When decided to give it to" held the subject three
    times. The template's own words are excluded from the names; every prompt holds IO once and S twice."""
    tok = llama_style(prepend, 3000)
    words = set(template.replace("[A]", " ").replace("[B]", " ").replace("[S]", " ").replace(",", " ").split())
    for seed in range(3):  # 40 prompts a batch: every name of the pool is drawn
        try:
            batch = ioi_task(tok, 40, template=template, names=(" Mary", " John", *ODD_NAMES), order="mixed",
                             seed=seed)
        except TaskTokenizationError as e:
            assert "lengths" in str(e), e
            continue
        assert not {m["io"].strip() for m in batch.meta} & words and not {m["s"].strip() for m in batch.meta} & words
        check_ioi(tok, batch, 40)
