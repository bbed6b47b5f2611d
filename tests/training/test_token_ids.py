"""Token ids without a tokenizer: ``TokenDataset.from_ids`` and ``read_token_ids`` (issue 24, "token ids
everywhere"). Each layout is checked against the text path it stands for (the same windows bit for bit)."""

from __future__ import annotations

import functools
import pickle

import numpy as np
import pytest
import torch
from helpers import tiny_tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from nnsight_lorsa.errors import ArgumentError
from nnsight_lorsa.training.dataset import TokenDataset, read_token_ids

TOK = tiny_tokenizer()
BOS, EOS = 0, 1


def _docs(n: int) -> list[str]:
    return [" ".join(f"w{2 + (d * 31 + i * 7) % 90}" for i in range(3 + (d * 5) % 17)) for d in range(n)]


def _same(a: TokenDataset, b: TokenDataset) -> None:
    assert torch.equal(a.tokens, b.tokens)
    assert (a.target_mask is None) == (b.target_mask is None)
    if a.target_mask is not None:
        assert torch.equal(a.target_mask, b.target_mask)


def test_a_stream_with_eos_ids_gives_the_windows_of_its_documents():
    docs = _docs(12)
    ids = [t for d in docs for t in TOK(d, add_special_tokens=False)["input_ids"] + [EOS]]
    _same(TokenDataset.from_ids(torch.tensor(ids), 16, tokenizer=TOK),
          TokenDataset.from_documents(TOK, docs, 16))


def test_a_stream_whose_documents_start_with_bos_gets_no_second_bos():
    docs = _docs(5)
    ids = [t for d in docs for t in [BOS, *TOK(d, add_special_tokens=False)["input_ids"], EOS]]
    data = TokenDataset.from_ids(torch.tensor(ids), 16, tokenizer=TOK)
    _same(data, TokenDataset.from_documents(TOK, docs, 16))
    assert bool((data.tokens[:, 1] != BOS).all())


def test_a_stream_without_eos_is_one_document_in_consecutive_windows():
    text = " ".join(f"w{2 + i % 97}" for i in range(400))
    ids = torch.tensor(TOK(text, add_special_tokens=False)["input_ids"], dtype=torch.int32)
    _same(TokenDataset.from_ids(ids, 32, tokenizer=TOK), TokenDataset.from_text(TOK, text, 32))


def test_rows_with_an_attention_mask_are_documents():
    docs = _docs(7)
    rows = [TOK(d, add_special_tokens=False)["input_ids"] for d in docs]
    width = max(map(len, rows)) + 3
    ids = torch.tensor([r + [EOS] * (width - len(r)) for r in rows])
    mask = torch.tensor([[True] * len(r) + [False] * (width - len(r)) for r in rows])
    _same(TokenDataset.from_ids(ids, 12, target_mask=mask, tokenizer=TOK),
          TokenDataset.from_documents(TOK, docs, 12))


def test_a_model_config_stands_in_for_the_tokenizer():
    """No tokenizer: BOS, EOS (a list, as Llama 3 has) and the vocabulary come from the model config."""
    class Config:
        bos_token_id, eos_token_id, vocab_size = 0, [1, 5], 50

    stream = torch.tensor([7, 8, 9, 1, 10, 11, 5, 12, 13, 14])
    data = TokenDataset.from_ids(stream, 4, config=Config())
    assert data.tokens.tolist() == [[0, 7, 8, 9], [0, 10, 11, 1], [0, 12, 13, 14]]  # padded with its EOS
    assert data.target_mask.tolist() == [[True] * 4, [True, True, True, False], [True] * 4]
    with pytest.raises(ArgumentError, match="outside the vocabulary"):
        TokenDataset.from_ids(torch.tensor([3, 60]), 2, config=Config())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=120), st.integers(2, 12))
def test_generated_streams_give_well_formed_windows(stream, seq_len):
    """Every window starts with BOS, its real tokens are a prefix, and it holds a document's first tokens."""
    try:
        data = TokenDataset.from_ids(torch.tensor(stream), seq_len, tokenizer=TOK)
    except ValueError as e:  # no document with a token, or a single one shorter than a window
        assert "no document" in str(e) or "fewer than one window" in str(e)
        return
    assert data.tokens.shape[1] == seq_len and bool((data.tokens[:, 0] == BOS).all())
    docs, cur = [], []
    for t in stream + [EOS]:
        if t == EOS:
            docs.append(cur)
            cur = []
        else:
            cur.append(t)
    docs = [d[1:] if d[:1] == [BOS] else d for d in docs if d and d != [BOS]]
    if len(docs) > 1:  # one window per document: BOS and the document's first tokens, the rest masked
        assert len(data) == len(docs)
        for row, mask, doc in zip(data.tokens.tolist(), data.target_mask.tolist(), docs, strict=True):
            real = [t for t, m in zip(row, mask, strict=True) if m]
            assert real == ([BOS] + doc)[:seq_len] and mask == sorted(mask, reverse=True)
    else:  # one document: consecutive windows of it
        assert data.target_mask is None
        assert data.tokens[:, 1:].flatten().tolist() == docs[0][: len(data) * (seq_len - 1)]


@pytest.mark.parametrize("suffix", [".npy", ".safetensors", ".pt"])
def test_each_file_kind_round_trips(tmp_path, suffix):
    ids = torch.randint(0, 50, (6, 9), device="cpu")
    mask = torch.arange(9, device="cpu")[None] < torch.tensor([9, 3, 5, 9, 1, 7], device="cpu")[:, None]
    path = tmp_path / f"ids{suffix}"
    if suffix == ".npy":
        np.save(path, ids.numpy().astype(np.int32))
    elif suffix == ".safetensors":
        save_file({"input_ids": ids, "attention_mask": mask}, str(path))
    else:
        torch.save({"input_ids": ids, "attention_mask": mask}, path)
    got, got_mask = read_token_ids(path)
    assert torch.equal(got, ids) and got.dtype == torch.long
    assert got_mask is None if suffix == ".npy" else torch.equal(got_mask, mask)


class _Evil:
    def __reduce__(self):
        return (print, ("unpickled!",))


@pytest.mark.parametrize(("name", "write", "needle"), [
    ("ids.txt", lambda p: p.write_text("1 2 3"), "not '.txt'"),
    ("ids.npy", lambda p: p.write_bytes(b"\x93NUMPY garbage"), "cannot be read"),
    ("ids.npy", lambda p: np.save(p, np.zeros(4, np.float32)), "float32"),
    ("ids.npy", lambda p: np.save(p, np.array([{"a": 1}], dtype=object), allow_pickle=True), "cannot be read"),
    ("ids.safetensors", lambda p: p.write_bytes(b"\x00" * 3), "cannot be read"),
    ("ids.safetensors", lambda p: save_file({"a": torch.zeros(2), "b": torch.zeros(2)}, str(p)), "no token ids"),
    ("ids.safetensors", lambda p: save_file({"input_ids": torch.zeros(2, 3, dtype=torch.long),
                                             "attention_mask": torch.ones(3, 2, dtype=torch.bool)}, str(p)),
     "attention_mask"),
    ("ids.pt", lambda p: p.write_bytes(pickle.dumps(_Evil())), "cannot be read"),
])
def test_bad_files_are_named_errors_that_name_the_file(tmp_path, capsys, name, write, needle):
    path = tmp_path / name
    write(path)
    with pytest.raises(ArgumentError, match=needle) as info:
        read_token_ids(path)
    assert str(path) in str(info.value)
    assert "unpickled!" not in capsys.readouterr().out


@pytest.mark.parametrize(("ids", "needle"), [
    (torch.tensor([1.0, 2.0]), "integer"), (torch.zeros(2, 2, 2, dtype=torch.long), "3-D"),
    (torch.tensor([3, -1, 4]), "negative"),
])
def test_bad_ids_are_argument_errors(ids, needle):
    with pytest.raises(ArgumentError, match=needle):
        TokenDataset.from_ids(ids, 4, tokenizer=TOK)


def test_a_mask_with_padding_before_a_real_token_is_refused():
    with pytest.raises(ArgumentError, match="prefix"):
        TokenDataset.from_ids(torch.ones(2, 3, dtype=torch.long), 4,
                              target_mask=torch.tensor([[True, False, True], [True, True, True]]), tokenizer=TOK)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(2, 40), min_size=0, max_size=10), min_size=1, max_size=5),
       st.integers(0, 3), st.sampled_from(["dedicated", "eos", "bos", "unknown"]), st.integers(2, 12))
def test_rows_without_a_mask_never_count_their_padding(docs, extra, pad_kind, seq_len):
    """2-D ids without ``target_mask``: right-padded rows give the windows of their documents (a dedicated pad id,
    no EOS or BOS, marks the padding), or an ``ArgumentError`` asking for the mask (a pad id equal to EOS or BOS
    and rows ending with it; no pad id known and a row ending with 2 or more copies of one id); never the pads as
    real tokens, except the one documented case: no pad id known and one pad after the longest row. Before: every
    id was real."""
    from types import SimpleNamespace

    from nnsight_lorsa.errors import TooFewTokensError

    pad = {"dedicated": 45, "eos": EOS, "bos": BOS, "unknown": 47}[pad_kind]
    tok = SimpleNamespace(bos_token_id=BOS, eos_token_id=EOS if pad_kind != "unknown" else None,
                          pad_token_id=pad if pad_kind != "unknown" else None)
    width = max(1, max(map(len, docs))) + extra
    ids = torch.tensor([d + [pad] * (width - len(d)) for d in docs], dtype=torch.long)
    real = torch.tensor([[True] * len(d) + [False] * (width - len(d)) for d in docs])
    padded = not bool(real.all())
    rows = [d + [pad] * (width - len(d)) for d in docs]
    runs = [next((k for k in range(1, width + 1) if r[-k] != r[-1]), width + 1) - 1 for r in rows]
    ambiguous = {"dedicated": False, "eos": padded, "bos": padded, "unknown": max(runs) >= 2}[pad_kind]
    make = functools.partial(TokenDataset.from_ids, ids, seq_len, tokenizer=tok)
    if ambiguous:
        with pytest.raises(ArgumentError, match="target_mask"):
            make()
        return
    # what a researcher means: the documents (no padding where none was detectable, all real)
    want_mask = real if pad_kind == "dedicated" else torch.ones_like(real)
    try:
        want = TokenDataset.from_ids(ids, seq_len, target_mask=want_mask, tokenizer=tok)
    except TooFewTokensError:
        with pytest.raises(TooFewTokensError):
            make()
        return
    _same(make(), want)
    if pad_kind == "dedicated":
        assert not bool((make().tokens[make().target_mask] == pad).any())
