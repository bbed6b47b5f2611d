"""The tests' tiny word-level tokenizer, for the benchmarks that build the same tiny models
(``benchmarks/bench_trace_overhead.py``). Imports nothing of ``nnsight_lorsa``.

``tests/helpers.py`` keeps its own copy (the loopback server imports it with only ``tests/`` on its
path); ``tests/benchmarks/test_benchmarks_package.py`` checks that the two agree."""

from __future__ import annotations

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

__all__ = ["tiny_tokenizer"]


def tiny_tokenizer(vocab: int = 128) -> PreTrainedTokenizerFast:
    """Word-level tokenizer of the tests' tiny models: ``<bos>``=0, ``<eos>``=1 (also pad), then
    ``w2 … w{vocab-1}``; left padding."""
    words = {"<bos>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, vocab)}}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<eos>", padding_side="left")
