"""Generated probe of the task builders (docs/reliability.md, "Path patching, tasks and metrics probe (2026-11-27)"):
on BPE tokenizers trained here on the embedded corpus (GPT-2-style byte-level, byte-level with single digits, and
SentencePiece-style Metaspace; three vocabulary sizes), the tinyshakespeare model's own and the IOI / greater-than
benchmark model's (two-digit year tokens: greater-than's two-digit form), every batch a builder
returns must be what it claims — or the builder refuses with ``TaskTokenizationError``:

* clean and corrupt ``(batch, pos)`` int64 of one shape, BOS first;
* each answer id is the token the tokenizer itself produces after the prompt: ``encode(decode(prompt + [answer]))``
  is ``prompt + [answer]`` (an answer that is a single token alone but merges with the prompt's last token in
  context would fail this);
* IOI: the prompt is the meta text, the IO name's token once and the subject's twice, the correct id the IO name, the
  incorrect the subject's, and neither answer in the corrupt prompt; greater-than: the prompt's last number followed by
  the correct (incorrect) answer is the start year + 1 (− 1); arithmetic: the correct token starts the sum's digits,
  the corrupt prompt holds the changed operand.
"""

from __future__ import annotations

import random
import re
from functools import cache

import pytest
from helpers import generated
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

import nnsight_lorsa
from nnsight_lorsa.patching.tasks import (
    IOI_TEMPLATES,
    NAMES,
    NOUNS,
    TaskTokenizationError,
    arithmetic_task,
    greater_than_task,
    ioi_task,
)

KINDS = ("bytelevel", "bytelevel_digits", "metaspace", "shakespeare", "benchmark")
SEEDS = st.integers(0, 2**31 - 1)


@cache
def tokenizer(kind: str, vocab: int) -> PreTrainedTokenizerFast:
    """A BPE trained on the embedded tinyshakespeare text plus year / sum / name sentences (so that names, years and
    numbers can be single tokens at the larger sizes); ``shakespeare`` / ``benchmark``: the embedded model's and the
    IOI / greater-than benchmark model's own."""
    if kind == "shakespeare":
        from nnsight_lorsa.envoy import load_model
        return load_model().tokenizer
    if kind == "benchmark":  # the IOI / greater-than model's word-level tokenizer: single-token names and years
        import importlib
        return importlib.import_module("benchmarks.ioi_greater_than_model").build_tokenizer()
    from pathlib import Path
    text = (Path(nnsight_lorsa.__file__).parent / "assets" / "tinyshakespeare.txt").read_text()[:200_000]
    extra = " ".join(f"The war lasted from the year 13{y:02d} to 13{y + 1:02d}. {y} + {(7 * y) % 100} = "
                     f"{y + (7 * y) % 100}." for y in range(100)) + " ".join(NAMES) * 20
    tok = Tokenizer(models.BPE(unk_token=None if kind.startswith("bytelevel") else "<unk>"))
    if kind == "metaspace":
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
        alphabet: list = []
    else:
        level = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.pre_tokenizer = level if kind == "bytelevel" else pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), level])
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator([text, extra], trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<bos>", "<eos>", "<unk>"], initial_alphabet=alphabet, show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                                   pad_token="<eos>")


def encode(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def run_task(seed: int) -> str:
    rng = random.Random(seed)
    kind = rng.choice(KINDS)
    tok = tokenizer(kind, rng.choice([300, 1000, 3000]) if kind not in ("shakespeare", "benchmark") else 0)
    task = rng.choice(["ioi", "greater_than", "arithmetic"])
    n = rng.randint(1, 6)
    try:
        if task == "ioi":
            batch = ioi_task(tok, n, template=rng.choice(IOI_TEMPLATES), order=rng.choice(["ABBA", "BABA", "mixed"]),
                             seed=rng.randrange(10**6))
        elif task == "greater_than":
            batch = greater_than_task(tok, n, seed=rng.randrange(10**6), century=rng.randint(10, 20),
                                      noun=rng.choice(NOUNS))
        else:
            batch = arithmetic_task(tok, n_prompts=n, seed=rng.randrange(10**6),
                                    template=rng.choice(["{op1} + {op2} =", "{op1}+{op2}=", "Q: {op1} plus {op2} is"]))
    except TaskTokenizationError:
        return "refused"
    where = f"seed {seed}: {kind} {task} {batch.meta[0]}"
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    assert batch.clean.shape == batch.corrupt.shape and batch.clean.shape[0] == n, where
    assert batch.correct_ids.shape == batch.incorrect_ids.shape == (n,), where
    for i in range(n):
        c, w = int(batch.correct_ids[i]), int(batch.incorrect_ids[i])
        assert c != w, where
        rows = {"clean": batch.clean[i].tolist(), "corrupt": batch.corrupt[i].tolist()}
        for name, row in rows.items():
            assert row[:len(bos)] == bos, where
            body = row[len(bos):]
            for ans in (c, w):  # the answer is the tokenizer's own next token after the prompt
                assert encode(tok, tok.decode(body + [ans])) == body + [ans], f"{where}: {name} answer {ans}"
        body, body_c = rows["clean"][len(bos):], rows["corrupt"][len(bos):]
        meta = batch.meta[i]
        if task == "ioi":
            text = tok.decode(body)
            io, s = meta["io"].strip(), meta["s"].strip()
            assert text == meta["text"] and body.count(w) == 2 and body.count(c) == 1, where  # the answers' tokens
            assert tok.decode([c]).strip() == io and tok.decode([w]).strip() == s, where
            assert c not in body_c and w not in body_c, where  # the corrupt prompt names neither
        elif task == "greater_than":
            start = int(re.search(r"year (\d+)", meta["text"]).group(1))
            last = tok.decode(body).split()[-1]
            assert int(last + tok.decode([c]).strip()) == start + 1, where
            assert int(last + tok.decode([w]).strip()) == start - 1, where
        else:
            total = meta["op1"] + meta["op2"]
            assert str(total).startswith(tok.decode([c]).strip()), where
            assert str(meta["corrupt_op2"]) in tok.decode(body_c), where
    return "checked"


@generated(12, 600, seed=SEEDS)
def test_generated_task_batches_hold_what_they_claim(seed):
    run_task(seed)


def test_clean_and_corrupt_prompts_of_different_lengths_are_refused():
    """``arithmetic_task`` (and ``greater_than_task``) stacked the clean and the corrupt prompts each to one length but
    never compared the two: on a SentencePiece-style BPE "66 + 21 =" is 12 tokens and its corrupt "66 + 68 =" 11, and
    the batch came back ``(1, 12)`` / ``(1, 11)`` — not the equal-length pair every builder promises (path patching
    then refuses it, activation patching pads one of them). Now ``TaskTokenizationError`` names the prompt."""
    tok = tokenizer("metaspace", 300)
    with pytest.raises(TaskTokenizationError, match="prompt 0 tokenizes to 12 tokens clean and 11 corrupt"):
        arithmetic_task(tok, pairs=[(66, 21)])


def test_prompts_holding_the_unknown_token_are_refused():
    """On the IOI / greater-than model's word-level tokenizer (which has no "+" nor three-digit sums, nor " 10" /
    " 20") ``arithmetic_task`` built "55 + 88 =" as ``55 <unk> <unk> …`` — clean and corrupt prompts the same ids,
    with the answers " 14" / " 15" — and ``greater_than_task(century=10)`` "… the year <unk>51 to <unk>": prompts
    that hold neither the operands nor the century. Now ``TaskTokenizationError`` names the prompt."""
    tok = tokenizer("benchmark", 0)
    with pytest.raises(TaskTokenizationError, match="unknown token"):
        arithmetic_task(tok, pairs=[(55, 88)])
    with pytest.raises(TaskTokenizationError, match="unknown token"):
        greater_than_task(tok, 2, century=10)
    assert tok.unk_token_id not in greater_than_task(tok, 2, century=13).clean  # the century it spells builds


def test_a_corrupt_arithmetic_prompt_keeps_its_clean_prompts_form():
    """Seen failing (the generated check's seed 35058): on a Metaspace BPE of 300 tokens " 104" starts with a bare
    ``▁``, so "Q: 49 plus 55 is" was built glued ("… is104", answer ``1``) while its corrupt "… plus 12 is" took the
    ``▁`` into the prompt: the two prompts asked different questions and the clean answer token was no next token of
    the corrupt prompt. The corrupt prompt now has its clean prompt's separator and moved tokens, or is refused."""
    tok = tokenizer("metaspace", 300)
    for pair in [(49, 55), (81, 52), (85, 55), *((a, b) for a in range(40, 60, 3) for b in range(50, 60, 4))]:
        try:
            batch = arithmetic_task(tok, pairs=[pair], template="Q: {op1} plus {op2} is")
        except TaskTokenizationError as e:
            assert "form" in str(e) or "length" in str(e), e
            continue
        clean, corrupt = batch.clean[0].tolist(), batch.corrupt[0].tolist()
        assert (tok.decode(clean[-1:]).strip() == "") == (tok.decode(corrupt[-1:]).strip() == ""), pair
        for row in (clean, corrupt):
            for ans in (int(batch.correct_ids[0]), int(batch.incorrect_ids[0])):
                assert encode(tok, tok.decode(row[1:] + [ans])) == row[1:] + [ans], pair
