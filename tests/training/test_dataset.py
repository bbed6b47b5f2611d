"""TokenDataset windows: one corpus cut into consecutive windows, or one window per document (from its
start, the model's own BOS, padding left out of CE)."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from helpers import LAYER, VOCAB, make_lorsa, tiny_nnsight, tiny_tokenizer
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from nnsight_lorsa import LorsaSet, get_adapter
from nnsight_lorsa.training import TokenDataset, evaluate


def bos3_tokenizer(bos: bool = True) -> PreTrainedTokenizerFast:
    """Word-level: ``<unk>``=0, ``<pad>``=1, ``<eos>``=2, ``<s>``=3 (BOS, not 0), ``w4 … w127``."""
    words = {"<unk>": 0, "<pad>": 1, "<eos>": 2, "<s>": 3, **{f"w{i}": i for i in range(4, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    extra = {"bos_token": "<s>"} if bos else {}
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
                                   **extra)


DOCS = ["w10 w11 w12", "w20 w21 w22 w23 w24 w25 w26 w27 w28 w29", "w30", "w40 w41 w42 w43 w44"]
TEXT = " <eos> ".join(DOCS) + " <eos>"


def test_windows_start_at_document_starts_with_the_tokenizers_bos() -> None:
    tok = bos3_tokenizer()
    data = TokenDataset.from_text(tok, TEXT, 6, document_separator="auto")  # splits on "<eos>"
    assert data.tokens.tolist() == [[3, 10, 11, 12, 1, 1], [3, 20, 21, 22, 23, 24], [3, 30, 1, 1, 1, 1],
                                    [3, 40, 41, 42, 43, 44]]
    assert data.target_mask is not None
    assert data.target_mask.sum(1).tolist() == [4, 6, 2, 6] and not data.target_mask[0, 4:].any()
    same = TokenDataset.from_documents(tok, DOCS + [""], 6)
    assert torch.equal(same.tokens, data.tokens) and torch.equal(same.target_mask, data.target_mask)
    # a given separator; blank lines when the EOS text is absent
    blank = TokenDataset.from_text(tok, "\n\n".join(DOCS), 6, document_separator="auto")
    assert torch.equal(blank.tokens, data.tokens)
    assert torch.equal(TokenDataset.from_text(tok, "|".join(DOCS), 6, document_separator="|").tokens, data.tokens)
    # explicit ids win; the split keeps the masks
    other = TokenDataset.from_documents(tok, DOCS, 6, bos_token_id=7, pad_token_id=2)
    assert other.tokens[:, 0].tolist() == [7] * 4 and other.tokens[2, 2:].tolist() == [2] * 4
    train, held = data.split(0.5)
    assert held.target_mask is not None and torch.equal(held.target_mask, data.target_mask[2:])
    with pytest.raises(ValueError, match="no document"):
        TokenDataset.from_documents(tok, ["", " "], 6)


def test_bos_from_the_model_config_else_none() -> None:
    tok = bos3_tokenizer(bos=False)
    assert tok.bos_token_id is None
    data = TokenDataset.from_documents(tok, DOCS, 4, config=types.SimpleNamespace(bos_token_id=5))
    assert data.tokens[:, 0].tolist() == [5] * 4 and data.tokens[1].tolist() == [5, 20, 21, 22]
    bare = TokenDataset.from_documents(tok, DOCS, 4)  # no BOS anywhere: none prepended
    assert bare.tokens.tolist() == [[10, 11, 12, 1], [20, 21, 22, 23], [30, 1, 1, 1], [40, 41, 42, 43]]
    legacy = TokenDataset.from_text(tok, TEXT, 4, config=types.SimpleNamespace(bos_token_id=5))
    assert legacy.tokens[:, 0].tolist() == [5] * len(legacy)


def test_one_document_keeps_the_consecutive_windows() -> None:
    """``document_separator=None`` (the demo's embedded corpus): [BOS] + consecutive seq_len-1 tokens."""
    tok = tiny_tokenizer()
    text = " ".join(f"w{2 + i % 100}" for i in range(50))
    data = TokenDataset.from_text(tok, text, 8)
    ids = torch.tensor([2 + i % 100 for i in range(49)]).view(7, 7)
    assert torch.equal(data.tokens, torch.cat([torch.zeros(7, 1, dtype=torch.long), ids], 1))
    assert data.target_mask is None


@torch.no_grad()
def test_padding_is_left_out_of_the_evaluations_ce() -> None:
    model, hf = tiny_nnsight("llama")
    adapter = get_adapter(model)
    tok = bos3_tokenizer()
    data = TokenDataset.from_text(tok, TEXT, 8, document_separator="auto")
    assert data.tokens[:, 0].tolist() == [3] * 4 and data.target_mask is not None
    assert (~data.target_mask).any()  # some padding
    lorsa = make_lorsa(hf, adapter)
    ev = evaluate(LorsaSet(model, {LAYER: lorsa}), data, at=LAYER, batch_size=3)
    logits = hf(input_ids=data.tokens).logits
    keep = data.target_mask[:, 1:]
    want = F.cross_entropy(logits[:, :-1][keep].double(), data.tokens[:, 1:][keep])
    assert ev.n_tokens == int(keep.sum()) == 3 + 7 + 1 + 5
    assert ev.ce_orig == pytest.approx(float(want), rel=1e-5)
    # each document alone, unpadded, gives the same CE: padding changes nothing
    alone = [F.cross_entropy(hf(input_ids=r[m][None]).logits[0, :-1].double(), r[m][1:], reduction="sum")
             for r, m in zip(data.tokens, data.target_mask, strict=True)]
    assert ev.ce_orig == pytest.approx(float(sum(alone)) / ev.n_tokens, rel=1e-5)


def test_auto_with_a_single_document_cuts_it_into_consecutive_windows() -> None:
    tok = tiny_tokenizer()
    text = " ".join(f"w{2 + i % 100}" for i in range(50))
    assert torch.equal(TokenDataset.from_text(tok, text, 8, document_separator="auto").tokens,
                       TokenDataset.from_text(tok, text, 8).tokens)
    one = TokenDataset.from_text(tok, text, 8, document_separator="|")  # explicit: one document, one window
    assert one.tokens.tolist() == [[0, 2, 3, 4, 5, 6, 7, 8]]


# --------------------------------------------------------------------------- issue 25: the length warning
class _Records:
    """Collects the records of transformers' library logger (it does not propagate to pytest's caplog)."""

    def __enter__(self):
        import logging

        self.records: list[logging.LogRecord] = []
        self.handler = logging.Handler(logging.DEBUG)
        self.handler.emit = self.records.append  # type: ignore[method-assign]
        self.logger = logging.getLogger("transformers")
        self.logger.addHandler(self.handler)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self.handler)

    def messages(self) -> list[str]:
        return [r.getMessage() for r in self.records]


def test_from_text_does_not_warn_that_the_whole_text_exceeds_the_models_length() -> None:
    """The corpus is tokenized whole and then cut into windows: transformers' "Token indices sequence length is
    longer than the specified maximum sequence length" warning (printed on every demo run) is not emitted by
    ``from_text`` / ``from_documents``; the same tokenizer still warns when a long text is tokenized elsewhere."""
    tok = bos3_tokenizer()
    tok.model_max_length = 16
    text = " ".join(f"w{4 + i % 100}" for i in range(400))  # 400 tokens > 16
    with _Records() as rec:
        data = TokenDataset.from_text(tok, text, 8)
        docs = TokenDataset.from_documents(tok, [text, text], 8)
    assert len(data) == 400 // 7 and len(docs) == 2
    assert not [m for m in rec.messages() if "Token indices sequence length" in m], rec.messages()
    with _Records() as rec:  # not silenced for good: a direct call on a long text still warns
        tok(text, add_special_tokens=False)
    assert any("Token indices sequence length is longer" in m for m in rec.messages()), rec.messages()


@pytest.mark.parametrize("marker", ["<|endoftext|>", "</s>", "<|end_of_text|>"])
def test_auto_split_prefers_an_end_of_text_marker_over_paragraphs(marker):
    """A corpus whose documents hold paragraphs (blank lines) and end with another tokenizer's end-of-text
    marker: "auto" splits on the marker, so every window starts at a document's start — splitting on blank
    lines started windows mid-document (the model's CE there is not its CE)."""
    from helpers import tiny_tokenizer

    from nnsight_lorsa.training.dataset import auto_separator

    tok = tiny_tokenizer()  # its EOS text, "<eos>", does not occur below
    docs = [f"w{2 + i} w3 w4\n\nw5 w6 w7\n\nw8 w9" for i in range(6)]
    text = f" {marker} ".join(docs)
    assert auto_separator(tok, text) == marker
    data = TokenDataset.from_text(tok, text, 12, document_separator="auto")
    assert len(data) == len(docs)
    starts = [int(data.tokens[i, 1]) for i in range(len(docs))]  # after BOS: each document's first word
    assert starts == [int(tok.convert_tokens_to_ids(f"w{2 + i}")) for i in range(len(docs))]
    plain = "\n\n".join(docs)  # no marker: paragraphs are all there is to split on
    assert auto_separator(tok, plain) == "\n\n"
