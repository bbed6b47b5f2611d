"""Mutation probe, round 3 (docs/reliability.md): the labels and page data of ``attribution/export.py``'s
``decode_token``, ``viz/page.py`` and ``viz/graph_viewer.py`` that the earlier tests let a one-line change through,
against references written here (Python's own UTF-8 decoder, GPT-2's ``bytes_to_unicode``)."""

from __future__ import annotations

import codecs

import pytest
from helpers import generated
from hypothesis import strategies as st

from nnsight_lorsa.attribution.export import decode_token
from nnsight_lorsa.errors import ArgumentError


def _bytes_to_unicode() -> dict[int, str]:
    """openai/gpt-2 ``src/encoder.py``'s ``bytes_to_unicode``, as published (the reference alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(2**8):
        if b not in bs:
            bs.append(b)
            cs.append(2**8 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs], strict=True))


def _each_byte(err: UnicodeDecodeError) -> tuple[str, int]:
    return "".join(f"<0x{b:02X}>" for b in err.object[err.start:err.end]), err.end


codecs.register_error("round3_each_byte", _each_byte)


class ByteLevel:
    """A byte-level BPE tokenizer of one token per id (``vocab``: the tokens' bytes), decoding as Hugging Face's
    ``ByteLevel`` decoder does (UTF-8 with U+FFFD for what is no character; an unknown id as nothing)."""

    def __init__(self, vocab: list[bytes]) -> None:
        self.vocab, self.alphabet = vocab, _bytes_to_unicode()

    def __len__(self) -> int:
        return len(self.vocab)

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.vocab[i] for i in ids if 0 <= i < len(self.vocab)).decode("utf-8", "replace")

    def convert_ids_to_tokens(self, i: int) -> str:
        return "".join(self.alphabet[b] for b in self.vocab[i])


@generated(40, 400, text=st.text(min_size=1, max_size=6), cut=st.tuples(st.integers(0, 24), st.integers(0, 24)))
def test_partial_byte_labels_are_pythons_utf8_decoding_with_each_bad_byte_named(text, cut):
    """A token of any slice of any text's UTF-8 bytes (4-byte characters too): the ``partial_bytes`` label is
    Python's own decoding of those bytes, each byte of no complete character written ``<0xNN>``, where the token
    decodes alone with a U+FFFD, else the decoded text (mutant: a window of 3 bytes wrote a 4-byte character as
    four ``<0xNN>``)."""
    raw = text.encode("utf-8")[min(cut):max(cut)] or text.encode("utf-8")
    tok = ByteLevel([b"a", raw])
    alone = raw.decode("utf-8", "replace")
    want = raw.decode("utf-8", "round3_each_byte") if "\ufffd" in alone else alone
    assert decode_token(tok, 1, partial_bytes=True) == want
    assert decode_token(tok, 1) == alone


def test_a_four_byte_character_beside_a_partial_one_stays_whole():
    tok = ByteLevel([b"a", "\U0001f600".encode() + b"\xe2\x80", "\U0001f600".encode()])
    assert decode_token(tok, 1, partial_bytes=True) == "\U0001f600<0xE2><0x80>"
    assert decode_token(tok, 2, partial_bytes=True) == "\U0001f600"


def test_a_whole_token_keeps_its_decoded_text_even_where_its_bytes_read_otherwise():
    """``partial_bytes`` changes only tokens that decode with a U+FFFD: a tokenizer whose ``decode`` rewrites a whole
    token (here: strips its leading space) keeps its text (mutant: every token labelled by its bytes)."""

    class Stripping(ByteLevel):
        def decode(self, ids: list[int]) -> str:
            return super().decode(ids).lstrip(" ")

    tok = Stripping([b" the", b" \xe2"])
    assert decode_token(tok, 0, partial_bytes=True) == "the"
    assert decode_token(tok, 1, partial_bytes=True) == " <0xE2>"


def test_the_first_id_past_the_vocabulary_is_refused():
    """``len(tokenizer)`` itself is outside ``[0, len)`` (mutant ``<=``: it decoded as ``''``); the last id is not."""
    tok = ByteLevel([b"a", b"b", b"c"])
    assert decode_token(tok, 2) == "c"
    with pytest.raises(ArgumentError, match=r"token id 3 is outside the tokenizer's vocabulary \[0, 3\)"):
        decode_token(tok, 3)
    with pytest.raises(ArgumentError, match=r"token id -1 is outside"):
        decode_token(tok, -1)


@pytest.fixture(scope="module")
def byte_bpe():
    from transformers import AutoTokenizer

    from nnsight_lorsa.assets import default_model_dir

    return AutoTokenizer.from_pretrained(default_model_dir())  # the embedded byte-level BPE, local files


WORDS = st.sampled_from([" the", " cat", "ab", "é", "日本", "\U0001f600", "\ufffd", "—", "\n"])


@generated(30, 300, text=st.lists(WORDS | st.text(st.characters(blacklist_categories=("Cs",)), max_size=3),
                                  min_size=1, max_size=8).map("".join),
           cut=st.tuples(st.integers(0, 30), st.integers(0, 30)))
def test_token_pieces_join_to_the_decoded_ids_and_leave_whole_tokens_alone(byte_bpe, text, cut):
    """Any text's ids with a slice of tokens dropped (characters cut at the end or in the middle, a literal U+FFFD
    too): the pieces join to ``decode(ids)`` (mutant: a last token that ends in a cut character got ``""``), and a
    token that decodes alone without U+FFFD after one that does too keeps its own text (mutant: ``"\\ufffd" in`` the
    prefix, not at its end, gave every later token ``""``)."""
    from nnsight_lorsa.viz import token_pieces

    ids = byte_bpe(text, add_special_tokens=False)["input_ids"]
    a, b = min(cut), max(cut)
    ids = ids[:a] + ids[b:] if ids[:a] + ids[b:] else ids
    pieces = token_pieces(byte_bpe, ids)
    assert "".join(pieces) == byte_bpe.decode(ids)
    alone = [byte_bpe.decode([i]) for i in ids]
    for j in range(len(ids)):
        if "\ufffd" not in alone[j] and (j == 0 or "\ufffd" not in alone[j - 1]):
            assert pieces[j] == alone[j], (j, pieces, alone)


def test_finite_replaces_non_finite_floats_inside_tuples_too():
    """``finite`` goes through nested dicts, lists and tuples (a tuple written as a JSON list; mutant: tuples left
    as they were, so a NaN inside one reached ``embed_json``, which refuses it)."""
    import json

    from nnsight_lorsa.viz.page import embed_json, finite

    nan, inf = float("nan"), float("inf")
    data = {"a": (1.5, nan, [inf, (2, -inf, "x")]), "b": [(nan,)], "c": True}
    assert finite(data) == {"a": [1.5, None, [None, [2, None, "x"]]], "b": [[None]], "c": True}
    assert json.loads(embed_json(finite(data)))["a"] == [1.5, None, [None, [2, None, "x"]]]


def test_heatmap_and_contexts_nan_are_null_and_a_1d_heatmap_is_one_row():
    """A heatmap's NaN is ``null`` (an empty cell; mutant: 0.0, a coloured zero), 1-D values are one row whose
    ``cols`` label the values (mutant: one column, which refused the labels), a contexts table's NaN activation is
    ``null`` ("–"; mutant: NaN kept, which the page's strict JSON refused)."""
    import torch

    from nnsight_lorsa.viz.graph_viewer import normalize_details

    nan = float("nan")
    got = normalize_details({"a": {"heatmap": torch.tensor([1.0, nan, 3.0]), "cols": ["k0", "k1", "k2"], "title": "z"},
                             "b": torch.tensor([[nan, 2.0]])})
    assert got == {"a": [{"type": "heatmap", "title": "z", "rows": ["0"], "cols": ["k0", "k1", "k2"],
                          "values": [[1.0, None, 3.0]]}],
                   "b": [{"type": "heatmap", "title": "", "rows": ["0"], "cols": ["0", "1"], "values": [[None, 2.0]]}]}
    ctx = normalize_details({"c": [("the cat", 2.5), ("a dog", nan)]})
    assert ctx == {"c": [{"type": "contexts", "title": "Top activations", "rows": [["the cat", 2.5], ["a dog", None]]}]}


def test_the_page_holds_the_details_of_the_drawn_nodes_only():
    """``render_html``'s page data: the details of nodes the pruning dropped are left out of the page (documented:
    nothing to show; mutant: every given entry embedded), the drawn nodes' are there."""
    import json
    import re

    import torch

    from nnsight_lorsa.attribution import prune
    from nnsight_lorsa.attribution.graph import EMBEDDING, LOGIT, LORSA, MLP_ERROR, Graph, NodeTable
    from nnsight_lorsa.viz import render_html

    rows = [(LORSA, 0, 0, 0), (LORSA, 0, 0, 1), (MLP_ERROR, 0, 0, -1), (EMBEDDING, -1, 0, 3), (LOGIT, 1, 0, 7)]
    kind, layer, pos, index = (torch.tensor(c) for c in zip(*rows, strict=True))
    A = torch.zeros(5, 5)
    A[0, 3], A[1, 3], A[4, 0], A[4, 1], A[4, 2] = 1.0, 0.5, 2.0, 0.25, 0.5
    nodes = NodeTable(kind, layer, pos, index, torch.tensor([1.0, 0.5, 0.1, 0.0, 0.0]), [], torch.zeros(5, dtype=bool))
    g = Graph(tokens=torch.tensor([3]), nodes=nodes, adjacency=A, values=A.sum(1), logit_probs=torch.tensor([1.0]),
              feature_rows=(kind == LORSA) | (kind == LOGIT), layout_ids=torch.arange(5), prompt="p")
    pr = prune(g, 1.0, 1.0)
    pr.node_mask[1] = False  # the second head pruned from the drawing
    page = render_html(g, pr, details={"A0_0_0": "drawn", "A0_1_0": "pruned"})
    data = json.loads(re.search(r"id='graph-data'>(.*?)</script>", page, re.S).group(1))
    assert "A0_1_0" not in {n["node_id"] for n in data["graph"]["nodes"]}
    assert data["details"] == {"A0_0_0": [{"type": "text", "text": "drawn"}]}


def _page_labels(tokenizer, ids: list[int]) -> list[str]:
    """The x-axis labels ``render_html`` gives the page for a graph of ``ids`` (embeddings and one logit)."""
    import json
    import re

    import torch

    from nnsight_lorsa.attribution import prune
    from nnsight_lorsa.attribution.graph import EMBEDDING, LOGIT, Graph, NodeTable
    from nnsight_lorsa.viz import render_html

    n = len(ids)
    rows = [(EMBEDDING, -1, p, t) for p, t in enumerate(ids)] + [(LOGIT, 1, n - 1, ids[-1])]
    kind, layer, pos, index = (torch.tensor(c) for c in zip(*rows, strict=True))
    A = torch.zeros(n + 1, n + 1)
    A[n, :n] = 1.0
    nodes = NodeTable(kind, layer, pos, index, torch.zeros(n + 1), [], torch.zeros(n + 1, dtype=torch.bool))
    g = Graph(tokens=torch.tensor(ids), nodes=nodes, adjacency=A, values=A.sum(1), logit_probs=torch.tensor([1.0]),
              feature_rows=kind == LOGIT, layout_ids=torch.arange(n + 1))
    page = render_html(g, prune(g), tokenizer=tokenizer)
    return json.loads(re.search(r"id='graph-data'>(.*?)</script>", page, re.S).group(1))["labels"]


@pytest.mark.parametrize("text", ["ab\ufffd cd", "ROMEO: café — 日本語", "\U0001f600x", "x\u00e9"])
@pytest.mark.parametrize("drop", [None, 1, -2])
def test_the_viewers_token_labels_join_to_the_decoded_prompt(byte_bpe, text, drop):
    """The x-axis labels join to ``tokenizer.decode(tokens)``, also where the prompt holds a U+FFFD that no later
    token completes: a literal one, or a byte left alone by a token dropped (ids cut mid-character). Seen failing:
    such a U+FFFD vanished from the axis (its tokens labelled ``""``, the next token by its own text)."""
    ids = byte_bpe(text, add_special_tokens=False)["input_ids"]
    if drop is not None and len(ids) > 2:
        ids = ids[:drop] + ids[drop:][1:]
    labels = _page_labels(byte_bpe, ids)
    assert len(labels) == len(ids) and "".join(labels) == byte_bpe.decode(ids)
