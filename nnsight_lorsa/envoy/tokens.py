"""Models without a tokenizer: everything runs on token ids; text needs a tokenizer, and says so.

nnsight's ``TransformersModel`` builds a transformers pipeline, which for ``task="text-generation"``
needs a tokenizer object: a model directory with weights and ``config.json`` but no tokenizer files
fails to load with transformers' messages ("Impossible to guess which tokenizer to use", "install
sentencepiece or tiktoken"), which point the wrong way. :func:`load_tokenizer` gives such a directory an
:class:`IdsOnlyTokenizer`: traces, generation, training (``TokenDataset(ids)``) and attribution take
token ids as usual, and anything that must turn text into ids (``model.trace("text")``,
``attribute(rm, "text")``, ``TokenDataset.from_text``) raises
:class:`~nnsight_lorsa.errors.MissingTokenizerError` naming what is missing. ``nnsight_lorsa.envoy.load_model``
and the CLI load models this way.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerFast

from ..errors import ArgumentError, CheckpointError, MissingTokenizerError

#: files any transformers tokenizer is loaded from (one of them must exist)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt",
                   "tokenizer.tiktoken")

__all__ = ["TOKENIZER_FILES", "IdsOnlyTokenizer", "check_tokenizer", "ids_only_tokenizer", "load_tokenizer",
           "tokenizer_of"]


def _missing(what: str, where: str) -> MissingTokenizerError:
    return MissingTokenizerError(
        f"{what}: text needs a tokenizer to become token ids, and the model was loaded without one ({where}). "
        "Pass token ids instead (traces, generate, TokenDataset(ids), attribute(rm, ids) all take them), or load "
        "the model with tokenizer=AutoTokenizer.from_pretrained(<a directory with "
        f"{' / '.join(TOKENIZER_FILES[:4])}>)")


class IdsOnlyTokenizer(PreTrainedTokenizerFast):  # type: ignore[misc]
    """A stand-in tokenizer for a model without one (:func:`ids_only_tokenizer`): it knows the special
    tokens and pads; turning text into tokens raises :class:`MissingTokenizerError`."""

    ids_only = True

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        where = self.init_kwargs.get("where", "no tokenizer files")
        raise _missing(f"{type(self).__name__} asked to encode text", where)

    __call__ = encode = encode_plus = batch_encode_plus = tokenize = _refuse


def ids_only_tokenizer(vocab_size: int, *, bos_token_id: int | None = None, eos_token_id: int | None = None,
                       pad_token_id: int | None = None, where: str = "no tokenizer files") -> IdsOnlyTokenizer:
    """An :class:`IdsOnlyTokenizer` for a vocabulary of ``vocab_size`` ids: id ``i`` is the token
    ``"<id_i>"``; ``bos`` / ``eos`` / ``pad`` from the model config (pad defaults to eos, as nnsight
    does); ``where`` says in its errors why there is no real tokenizer. nnsight's pipeline accepts it
    (a ``PreTrainedTokenizerFast``)."""
    from tokenizers import Tokenizer, models

    vocab = {f"<id_{i}>": i for i in range(vocab_size)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))

    def tok(i: int | None) -> str | None:
        return f"<id_{i}>" if isinstance(i, int) and 0 <= i < vocab_size else None

    pad = pad_token_id if pad_token_id is not None else eos_token_id
    return IdsOnlyTokenizer(tokenizer_object=core, bos_token=tok(bos_token_id), eos_token=tok(eos_token_id),
                            pad_token=tok(pad), where=where, model_input_names=["input_ids", "attention_mask"])


def check_tokenizer(tokenizer: Any, where: str) -> None:
    """Refuse what is no tokenizer (None: a model loaded without one) before a task reads it: it must encode
    (be callable or have ``encode``) and ``decode``.

    Raises:
        ArgumentError: naming ``where`` and what was given.

    Source: ours (the task builders', ``TokenDataset``'s text constructors').
    """
    if not callable(getattr(tokenizer, "decode", None)) or not (callable(tokenizer)
                                                                  or callable(getattr(tokenizer, "encode", None))):
        raise ArgumentError(f"{where}: tokenizer must be a tokenizer (e.g. model.tokenizer; a model loaded without "
                            f"one has None), got a {type(tokenizer).__name__}")


def _first_id(value: Any) -> int | None:
    if isinstance(value, (list, tuple)):
        value = value[0] if value else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def load_tokenizer(directory: str | os.PathLike[str]) -> Any:
    """The tokenizer of a local Hugging Face model directory: ``AutoTokenizer.from_pretrained``, or an
    :class:`IdsOnlyTokenizer` (vocabulary size and special ids from ``config.json``) when the directory
    holds none of :data:`TOKENIZER_FILES`. Offline: both loads pass ``local_files_only=True``.

    Raises:
        MissingTokenizerError: tokenizer files exist but cannot be loaded (e.g. a SentencePiece model
            without the ``sentencepiece`` package): the message names the files and the cause.
        ArgumentError: ``directory`` not a str / ``os.PathLike``.
        CheckpointError: no tokenizer files and no ``config.json`` transformers can load (a missing directory: it
            was transformers' ``OSError`` about reaching huggingface.co, though the load is offline).

    Source: ours (models without tokenizer files; transformers ``AutoTokenizer``).
    """
    from transformers import AutoConfig, AutoTokenizer

    from ..formats.files import check_path

    check_path(directory, "load_tokenizer", "a model directory")
    d = Path(directory)
    present = [f for f in TOKENIZER_FILES if (d / f).is_file()]
    if not present:
        try:
            config = AutoConfig.from_pretrained(str(d), local_files_only=True)
        except Exception as e:  # transformers raises OSError / ValueError / KeyError … for no or a bad config
            raise CheckpointError(f"load_tokenizer({str(d)!r}): none of the tokenizer files {list(TOKENIZER_FILES)} "
                                  f"and no model config transformers can load (not a model directory?): "
                                  f"{type(e).__name__}") from e
        text_config = getattr(config, "get_text_config", lambda: config)()
        return ids_only_tokenizer(int(text_config.vocab_size), bos_token_id=_first_id(text_config.bos_token_id),
                                  eos_token_id=_first_id(text_config.eos_token_id),
                                  pad_token_id=_first_id(getattr(text_config, "pad_token_id", None)),
                                  where=f"{d} has none of {list(TOKENIZER_FILES)}")
    try:
        return AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    except Exception as e:  # transformers raises many kinds here (missing optional packages, bad files)
        raise MissingTokenizerError(f"{d}: tokenizer files {present} could not be loaded ({type(e).__name__}: "
                                    f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}); token ids "
                                    "work without one: remove the files, or install what the message "
                                    "asks for") from e


def tokenizer_of(model: Any, what: str) -> Any:
    """``model.tokenizer``, for ``what`` (named in the error) that must turn text into ids.

    Raises:
        MissingTokenizerError: the model has no tokenizer, or only an :class:`IdsOnlyTokenizer`.
    """
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None or getattr(tokenizer, "ids_only", False):
        where = getattr(tokenizer, "init_kwargs", {}).get("where", "model.tokenizer is None")
        raise _missing(what, where)
    return tokenizer
