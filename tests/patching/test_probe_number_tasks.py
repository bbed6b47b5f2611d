"""Greater-than and arithmetic on SentencePiece / Llama-style tokenizers (docs/reliability.md, "Number tasks and
rounding-sized gaps probe (2026-11-27)").

No SentencePiece tokenizer is among the offline fixtures, so Llama-2-style ones are built here with ``tokenizers`` (as
``test_probe_sentencepiece_tasks`` builds its own): a BPE with ``byte_fallback`` and the 256 ``<0xNN>`` tokens, a
``Metaspace`` pre-tokenizer (``▁`` marks a word start), Llama's decoder, trained on the embedded corpus plus year and
sum sentences — with Llama-2's single digits (a ``Digits`` split: ``" 1364"`` is ``▁ 1 3 6 4``) or without (BPE merges
digits: ``▁136 4``), and one trained without digits (every digit spelled by byte fallback).

The references read the tokenizer's own encoding of the prompt text followed by the answer text, not the builders'
code: the answer token is what ``encode(prompt + answer)`` has after the prompt's ids. (``encode(decode(prompt +
[answer]))`` is no reference here: ``decode`` writes ``▁4`` as ``" 4"``, so a word-start answer after a number
round-trips.)
"""

from __future__ import annotations

import json
import random
import re
from functools import cache
from pathlib import Path

import pytest
from helpers import generated
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

import nnsight_lorsa
from nnsight_lorsa.patching.tasks import (
    NOUNS,
    TaskTokenizationError,
    arithmetic_grid,
    arithmetic_task,
    greater_than_task,
)

#: (split digits, Metaspace prepend scheme, vocabulary size, digits in the training text)
KINDS = [(True, "first", 1500, True), (True, "always", 1500, True), (False, "first", 1500, True),
         (False, "always", 3000, True), (True, "first", 800, False)]


@cache
def llama_numbers(split_digits: bool = True, prepend: str = "first", vocab: int = 1500,
                  digits: bool = True) -> PreTrainedTokenizerFast:
    text = (Path(nnsight_lorsa.__file__).parent / "assets" / "tinyshakespeare.txt").read_text()[:60_000]
    rng = random.Random(0)
    nums = " ".join(f"The {rng.choice(NOUNS)} lasted from the year {rng.randrange(10, 21)}{rng.randrange(100):02d} "
                    f"to {rng.randrange(10, 21)}{rng.randrange(100):02d}. {rng.randrange(100)} + {rng.randrange(100)} "
                    f"= {rng.randrange(200)}." for _ in range(3000)) if digits else ""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    meta = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=prepend)
    tok.pre_tokenizer = pre_tokenizers.Sequence([meta, pre_tokenizers.Digits(individual_digits=True)]) \
        if split_digits else meta
    text = text if digits else re.sub(r"[0-9]", "", text)
    tok.train_from_iterator([text, nums], trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"],
                                                              show_progress=False))
    spec = json.loads(tok.to_str())  # the 256 byte-fallback tokens, as SentencePiece's vocabulary has them
    for b in range(256):
        spec["model"]["vocab"].setdefault(f"<0x{b:02X}>", len(spec["model"]["vocab"]))
    spec["model"]["byte_fallback"] = True
    spec["decoder"] = json.loads(decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                                    decoders.Fuse(), decoders.Strip(" ", 1, 0)]).__getstate__())
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>")


def encode(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def is_byte(tok, tid: int) -> bool:
    return tok.convert_ids_to_tokens(int(tid)).startswith("<0x")


def answer_after(tok, prompt: list[int], text: str) -> int | None:
    """The tokenizer's own next token where ``text`` follows the prompt's text; None where it merges with the prompt
    or spans several tokens."""
    full = encode(tok, tok.decode(prompt) + text)
    return full[len(prompt)] if full[:len(prompt)] == prompt and len(full) == len(prompt) + 1 else None


def check_greater_than(tok, batch, n: int) -> None:
    bos = [tok.bos_token_id]
    assert batch.clean.shape == batch.corrupt.shape and batch.clean.shape[0] == n
    for i, meta in enumerate(batch.meta):
        clean, corrupt = batch.clean[i].tolist(), batch.corrupt[i].tolist()
        assert clean == bos + encode(tok, meta["text"]) and corrupt == bos + encode(tok, meta["corrupt_text"])
        start = int(re.search(r"year (\d+)", meta["text"]).group(1))
        shown = meta["text"].split()[-1]  # the end year's digits the prompt already holds
        for ans, year in ((batch.correct_ids[i], start + 1), (batch.incorrect_ids[i], start - 1)):
            rest = str(year)[len(shown):]
            assert str(year).startswith(shown) and rest, meta
            want = answer_after(tok, clean[1:], rest)
            got = tok.convert_ids_to_tokens(int(ans))
            assert int(ans) == want, (meta, year, got, want and tok.convert_ids_to_tokens(want))
            assert not is_byte(tok, ans), meta


@pytest.mark.parametrize("kind", KINDS[:3])  # (KINDS[3] merges 1360 unlike 1363: refused, lengths differ)
def test_greater_than_answers_continue_the_number(kind):
    """Seen failing: with Llama-2's single digits the builder refused (``neither two-digit nor single-digit answers
    are single tokens``: ``"7"`` alone is ``▁ 7``); with merged digits it answered the word-start ``▁8`` after
    ``"… to 137"``, where the tokenizer spells 1378 as ``▁137 8``."""
    tok = llama_numbers(*kind)
    check_greater_than(tok, greater_than_task(tok, 6, seed=5), 6)


def check_arithmetic(tok, batch, template: str) -> None:
    bos = [tok.bos_token_id]
    for i, meta in enumerate(batch.meta):
        a, b, b2 = meta["op1"], meta["op2"], meta["corrupt_op2"]
        for row, op2 in ((batch.clean[i].tolist(), b), (batch.corrupt[i].tolist(), b2)):
            text = template.format(op1=a, op2=op2)
            ids = encode(tok, text)
            assert row[:1] == bos and row[1:1 + len(ids)] == ids and not tok.decode(row[1 + len(ids):]).strip(), meta
        body = batch.clean[i].tolist()[1:]
        text = template.format(op1=a, op2=b)
        for ans, total in ((batch.correct_ids[i], a + b), (batch.incorrect_ids[i], None)):
            assert not is_byte(tok, ans), (meta, tok.convert_ids_to_tokens(int(ans)))
            if total is None:
                continue
            full = next(f for sep in (" ", "") if (f := encode(tok, text + sep + str(total)))[:len(body)] == body)
            assert int(ans) == full[len(body)], (meta, tok.convert_ids_to_tokens(int(ans)))


@pytest.mark.parametrize("kind", KINDS[:4])
def test_arithmetic_answers_are_the_tokenizers_next_token(kind):
    tok = llama_numbers(*kind)
    check_arithmetic(tok, arithmetic_task(tok, n_prompts=6, seed=2), "{op1} + {op2} =")
    grid = arithmetic_grid(tok, operands=[0, 7, 13, 99])
    for ids, op1, op2 in grid.groups:
        for row, a, b in zip(ids.tolist(), op1.tolist(), op2.tolist(), strict=True):
            assert row == [tok.bos_token_id] + encode(tok, f"{a} + {b} =")


def test_byte_fallback_digits_are_no_answers():
    """Seen failing: on a tokenizer without digit tokens (every digit ``<0x3N>``) ``arithmetic_task`` answered the
    byte-fallback tokens; now it refuses, naming the prompt (greater-than refused already)."""
    tok = llama_numbers(*KINDS[4])
    assert all(is_byte(tok, t) for t in encode(tok, "1234567890")[1:])  # after "▁"
    with pytest.raises(TaskTokenizationError, match="12 \\+ 34 ="):
        arithmetic_task(tok, pairs=[(12, 34)])
    with pytest.raises(TaskTokenizationError):
        greater_than_task(tok, 2)


@generated(4, 200, seed=st.integers(0, 2**31 - 1))
def test_generated_number_tasks_on_sentencepiece_tokenizers(seed):
    rng = random.Random(seed)
    tok = llama_numbers(*rng.choice(KINDS))
    n = rng.randint(1, 6)
    try:
        if rng.random() < 0.5:
            check_greater_than(tok, greater_than_task(tok, n, seed=rng.randrange(10**6), century=rng.randint(10, 20),
                                                      noun=rng.choice(NOUNS)), n)
        else:
            template = rng.choice(["{op1} + {op2} =", "{op1}+{op2}=", "Q: {op1} plus {op2} is"])
            check_arithmetic(tok, arithmetic_task(tok, n_prompts=n, seed=rng.randrange(10**6), template=template),
                             template)
    except TaskTokenizationError:
        pass
