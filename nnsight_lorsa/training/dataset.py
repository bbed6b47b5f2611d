"""Token windows of a corpus, each starting with BOS (one corpus cut into consecutive windows, or
one window per document): what activations are collected on and
evaluations run on (:class:`TokenDataset`), and the loss mask of a batch of windows."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .._checks import is_int, is_real
from .._placement import is_index_dtype
from .._typing import Int
from ..envoy.nnsight_internals import check_token_ids
from ..errors import ArgumentError, ShapeError, TooFewTokensError


def _loss_mask(input_ids: torch.Tensor, target_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``(batch, pos)`` bool: the positions whose activations count — ``target_mask`` (default every
    position; False at padding) except BOS (column 0)."""
    real = torch.ones_like(input_ids, dtype=torch.bool) if target_mask is None else target_mask.to(
        input_ids.device, torch.bool)
    loss_mask = real.clone()
    loss_mask[:, 0] = False
    return loss_mask


def check_dataset_ids(dataset: Any, model: Any, where: str, n_windows: int | None = None) -> None:
    """Refuse a :class:`TokenDataset` whose first ``n_windows`` windows (None: all) hold an id ``model`` does not
    embed or are longer than its learned positions (:func:`~..envoy.nnsight_internals.check_token_ids`), before the
    model runs on them: read at each call of ``where`` (its ``tokens`` may have been edited since it was built, and a
    dataset built without a tokenizer or config knows no bound); an id outside the vocabulary was torch's
    ``IndexError`` from inside the embedding (on CUDA a device-side assert, which ends the process's CUDA context).

    Raises:
        ArgumentError: naming ``where``, the vocabulary and the ids' range, or the positions and the windows' length.

    Source: ours.
    """
    check_token_ids(dataset.tokens[:n_windows], model, f"{where}: the dataset's windows")


def _check_seq_len(seq_len: Any, where: str) -> None:
    """``seq_len`` an int ≥ 2 (a window holds at least one predicted token after its first), else
    :class:`ArgumentError` naming ``where``."""
    if not is_int(seq_len) or seq_len < 2:
        raise ArgumentError(f"{where}: seq_len must be an int >= 2 (a window's first token and at least one it "
                            f"predicts), got {seq_len!r}")


def check_zero_one(mask: Any, where: str) -> None:
    """``mask`` a tensor of booleans, or of numbers that are all 0 or 1 (an attention mask or a target mask: the
    training data's and the head analyses' one rule); else :class:`ArgumentError` naming ``where`` (a mask of 0.5
    would be read as True).

    Source: ours."""
    if not isinstance(mask, torch.Tensor):
        raise ArgumentError(f"{where} must be a bool tensor (or of 0 / 1), got {type(mask).__name__}")
    if mask.dtype != torch.bool and mask.numel() and not bool(((mask == 0) | (mask == 1)).all()):
        odd = mask[(mask != 0) & (mask != 1)].flatten()[0].item()
        raise ArgumentError(f"{where} must hold only 0 and 1 (or be a bool tensor), got the value {odd!r}")


def _refuse_left_padding(tokens: torch.Tensor, target_mask: torch.Tensor, where: str) -> None:
    """Raise :class:`ArgumentError` where ``target_mask`` has the signature of left padding (a Hugging Face
    ``attention_mask`` of a tokenizer with ``padding_side="left"``): every row is ``k`` positions outside the
    mask then counted to the end, the ``k`` vary between rows or some ``k`` is 2 or more, and every position
    outside the mask holds the one same id (a pad id). The model runs without an attention mask, so pads on
    the left change every later token's activations, and the BOS after them would count. A mask that keeps
    only the answers, or only leaves BOS out, or right padding, is not that signature."""
    mask = target_mask.to("cpu", torch.bool)
    seq = mask.shape[1]
    k = (~mask).to(torch.int64).cumprod(dim=1).sum(dim=1)  # each row's positions outside the mask before its first
    if int(k.max()) == 0 or not bool((mask == (torch.arange(seq, device="cpu") >= k[:, None])).all()):
        return
    if len(set(k.tolist())) == 1 and int(k.max()) < 2:
        return
    pads = tokens.to("cpu")[~mask]
    if not bool((pads == pads[0]).all()):
        return
    rows = (k > 0).nonzero().flatten().tolist()
    raise ArgumentError(
        f"{where}: target_mask looks like left padding — rows {rows[:8]}{' …' if len(rows) > 8 else ''} start with "
        f"{sorted(set(k[rows].tolist()))[:8]} positions of the one id {int(pads[0])} outside the mask, then count to "
        "the end. The model runs without an attention mask, so pads on the left change every later token's "
        "activations (and the BOS after them would count): pad on the right (tokenizer.padding_side = 'right'), "
        "or pass the rows and their attention_mask, padded on the right, to TokenDataset.from_ids(ids, seq_len, "
        "target_mask=attention_mask)")


def _vocab_size(config: Any) -> int | None:
    """``config.vocab_size`` when it is a positive int, else None (unknown)."""
    v = getattr(config, "vocab_size", None)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def special_token_id(tokenizer: Any, config: Any, given: int | None = None, name: str = "bos_token_id") -> int | None:
    """The model's special token id ``name`` (``"bos_token_id"``, ``"eos_token_id"``): ``given`` if not
    None, else the tokenizer's attribute ``name``, else the model config's, else None. The one rule for
    the BOS every window starts with (:class:`TokenDataset`, sparse-attention training). An attribute
    that is not an int (a list of EOS ids, ``True``) does not count.

    Raises:
        ArgumentError: ``given`` neither None nor an int ``>= 0`` (2.5 was rounded, ``True`` read as 1).

    Source: ours."""
    if given is not None:
        _check_given_id(given, name)
        return int(given)
    for src in (tokenizer, config):
        value = getattr(src, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _check_given_ids_known(tokenizer: Any, config: Any, where: str, **given: Any) -> None:
    """Without ``config.vocab_size`` (the windows' own bound), refuse a ``bos_token_id`` / ``pad_token_id`` the
    caller gave past the tokenizer's ids (``len(tokenizer)`` and its special ids): it would be an ``IndexError`` in the
    model's embedding later, not here."""
    if _vocab_size(config) is not None or not hasattr(tokenizer, "__len__"):
        return
    specials = [i for i in (getattr(tokenizer, "all_special_ids", None) or []) if is_int(i)]
    bound = max([len(tokenizer), *(int(i) + 1 for i in specials)])
    for name, value in given.items():
        if value is not None and value >= bound:
            raise ArgumentError(f"{where}: {name}={value} is past the tokenizer's {bound} ids (pass "
                                "config=model.config to bound ids by the model's vocabulary instead)")


def _check_special_sources(tokenizer: Any, config: Any, where: str) -> None:
    """The objects the special token ids and the vocabulary size are read from (by attribute): ``config`` None or a
    model config (a model itself, or an object with none of the attributes, would be passed over without a word:
    no BOS, no vocabulary bound), ``tokenizer`` None or an object with token id attributes."""
    ids = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")
    if config is not None and (hasattr(config, "config") or not any(hasattr(config, a) for a in ids)):
        raise ArgumentError(f"{where}: config must be None or the model's config (model.config: its vocab_size and "
                            f"special token ids), got a {type(config).__name__}")
    if tokenizer is not None and not any(hasattr(tokenizer, a) for a in ids[1:]):
        raise ArgumentError(f"{where}: tokenizer must be None or a tokenizer (its bos / eos / pad token ids), got a "
                            f"{type(tokenizer).__name__}")


def _check_text_args(tokenizer: Any, text: Any, where: str, name: str) -> None:
    """The text constructors' ``tokenizer`` (:func:`~nnsight_lorsa.envoy.tokens.check_tokenizer`) and ``text`` (one
    str) or ``documents`` (a list / tuple of str: a str would be read as one document per character)."""
    from ..envoy.tokens import check_tokenizer  # a tokenizer needs transformers: not on the light install's path

    check_tokenizer(tokenizer, where)
    ok = isinstance(text, str) if name == "text" else isinstance(text, (list, tuple)) and all(
        isinstance(d, str) for d in text)
    if not ok:
        what = "a str" if name == "text" else "a list of str (one per document)"
        raise ArgumentError(f"{where}: {name} must be {what}, got {text!r}"[:300])


def _check_given_id(given: Any, name: str) -> None:
    """A token id given by the caller (``bos_token_id=``, ``pad_token_id=``): an int ``>= 0``, else
    :class:`ArgumentError` naming ``name``."""
    if not is_int(given) or given < 0:
        raise ArgumentError(f"{name} must be None or a token id (an int >= 0), got {given!r}")


def _pad_id(tokenizer: Any, given: int | None, config: Any = None) -> int:
    """Padding id: ``given``, else the tokenizer's pad id, else its EOS id, else the config's pad / first EOS
    id, else 0 (padding is masked out of every measure anyway). A ``given`` that is not a token id is refused
    (:class:`ArgumentError`; it was passed over for the tokenizer's)."""
    if given is not None:
        _check_given_id(given, "pad_token_id")
    eos = getattr(config, "eos_token_id", None)
    for pad in (given, getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None),
                getattr(config, "pad_token_id", None), eos[0] if isinstance(eos, (list, tuple)) and eos else eos):
        if isinstance(pad, int) and not isinstance(pad, bool):
            return pad
    return 0


def _known_pad_id(tokenizer: Any, config: Any) -> int | None:
    """:func:`_pad_id` without its last resort: the tokenizer's pad id, else its EOS id, else the config's pad /
    first EOS id; None when none of them says (the 0 :func:`_pad_id` falls back to is no one's pad)."""
    pad = _pad_id(tokenizer, None, config)
    if pad != 0:
        return pad
    eos = getattr(config, "eos_token_id", None)
    said = (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None),
            getattr(config, "pad_token_id", None), eos[0] if isinstance(eos, (list, tuple)) and eos else eos)
    return 0 if any(isinstance(v, int) and not isinstance(v, bool) and v == 0 for v in said) else None


def _trailing_run(ids: torch.Tensor, value: int) -> torch.Tensor:
    """``(rows,)`` int64: how many positions at the end of each row of 2-D ``ids`` hold ``value``."""
    return (ids.flip(1) == value).to(torch.int64).cumprod(dim=1).sum(dim=1)


def _rows_mask(ids: torch.Tensor, pad: int | None, specials: set[int]) -> torch.Tensor:
    """The real tokens of 2-D ``ids`` given without a mask (:meth:`TokenDataset.from_ids`): each row's positions
    before its trailing run of the pad id when the pad id is known and is no EOS / BOS id (a dedicated pad
    token is not text); every position when no row ends with what could be padding.

    Raises:
        ArgumentError: the pad id equals an EOS or BOS id (GPT-2's ``<|endoftext|>``, Llama's ``</s>`` as pad)
            and some row ends with it — a pad or the document's own EOS, the ids cannot tell; or no pad id is
            known and some row ends with 2 or more copies of one id (as padding does).
    """
    n_rows, width = ids.shape
    if pad is not None and pad not in specials:
        return torch.arange(width, device="cpu") < (width - _trailing_run(ids, pad))[:, None]
    if pad is not None:
        run = _trailing_run(ids, pad)
        why = f"the pad id {pad} is also an EOS / BOS id, so a trailing {pad} may be padding or the document's own"
    else:
        run = (ids.flip(1) == ids[:, -1:]).to(torch.int64).cumprod(dim=1).sum(dim=1)
        run = torch.where(run >= 2, run, torch.zeros_like(run))
        why = ("no pad id is known (no tokenizer or config pad / EOS id) and a row ending with 2 or more copies of "
               "one id looks padded")
    rows = (run > 0).nonzero().flatten().tolist()
    if rows:
        raise ArgumentError(
            f"TokenDataset.from_ids: 2-D ids without target_mask, and rows {rows[:8]}{' …' if len(rows) > 8 else ''} "
            f"end with {sorted(set(run[rows].tolist()))[:8]} positions of what may be padding: {why}. Pass the "
            "rows' attention_mask as target_mask (padding on the right; torch.ones_like(ids, dtype=torch.bool) "
            "when every id is a real token)")
    return torch.ones(n_rows, width, dtype=torch.bool, device="cpu")


def _eos_ids(tokenizer: Any, config: Any, given: int | Sequence[int] | None) -> set[int]:
    """The end-of-text ids a token stream is cut at: ``given``, else the tokenizer's, else ``config``'s
    (an int or a list of ints, as Llama 3's config has); empty when none is known. A ``given`` of another kind is
    refused (:class:`ArgumentError`; it was passed over for the tokenizer's)."""
    one_id = is_int(given) and int(given) >= 0  # type: ignore[arg-type]
    if given is not None and not one_id and not (
            isinstance(given, (list, tuple)) and given and all(is_int(v) and v >= 0 for v in given)):
        raise ArgumentError(f"eos_token_id must be None, a token id or a non-empty list of them, got {given!r}")
    if one_id:
        given = int(given)  # type: ignore[arg-type]
    for src in (given, getattr(tokenizer, "eos_token_id", None), getattr(config, "eos_token_id", None)):
        if isinstance(src, int) and not isinstance(src, bool):
            return {src}
        if isinstance(src, (list, tuple)) and src and all(isinstance(v, int) for v in src):
            return set(src)
    return set()


def read_token_ids(path: str | Path) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token ids from a file: ``(ids, target_mask)`` for :meth:`TokenDataset.from_ids`.

    * ``.npy``: one integer array, 1-D (a stream) or 2-D (one document per row); read with
      ``allow_pickle=False``.
    * ``.safetensors``: the tensor ``input_ids`` (else ``tokens``, else the file's only tensor), and
      optionally ``attention_mask`` (2-D ids: each row's real tokens, padding on the right).
    * ``.pt`` / ``.pth``: a tensor, or a dict with those keys; read with ``torch.load(weights_only=True)``
      (never unpickles code).

    Returns int64 ids on the CPU and the bool mask (or None).

    Raises:
        ArgumentError: an unknown suffix, an unreadable or corrupt file, no ids tensor in it, ids that are
            not integers, or a mask of another shape or holding values other than 0 and 1; the message names the
            file.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    try:
        if suffix == ".npy":
            import numpy as np

            found: dict[str, Any] = {"input_ids": torch.from_numpy(np.load(path, allow_pickle=False))}
        elif suffix == ".safetensors":
            from safetensors.torch import load_file

            found = dict(load_file(str(path), device="cpu"))
        elif suffix in (".pt", ".pth"):
            obj = torch.load(path, map_location="cpu", weights_only=True)
            found = {"input_ids": obj} if isinstance(obj, torch.Tensor) else obj if isinstance(obj, dict) else {}
        else:
            raise ArgumentError(f"{path}: token ids are read from .npy, .safetensors, .pt or .pth files, not "
                                f"{suffix or 'a file without a suffix'!r}")
    except ArgumentError:
        raise
    except Exception as e:  # numpy / safetensors / torch each raise their own kinds on a corrupt file
        raise ArgumentError(f"{path}: cannot be read as {suffix} token ids ({type(e).__name__}: {e})") from None
    tensors = {k: v for k, v in found.items() if isinstance(k, str) and isinstance(v, torch.Tensor)}
    key: str | None = next((k for k in ("input_ids", "tokens") if k in tensors), None)
    if key is None and len(tensors) == 1:
        key = next(iter(tensors))
    if key is None:
        raise ArgumentError(f"{path}: no token ids in it (a tensor 'input_ids' or 'tokens', or a single tensor); "
                            f"it holds {sorted(map(str, found))[:8]}")
    ids = tensors[key]
    if not is_index_dtype(ids.dtype):
        raise ArgumentError(f"{path}: {key!r} holds {ids.dtype} values, not integer token ids")
    mask = tensors.get("attention_mask")
    if mask is not None:
        check_zero_one(mask, f"{path}: 'attention_mask'")
    if mask is not None and tuple(mask.shape) != tuple(ids.shape):
        raise ArgumentError(f"{path}: 'attention_mask' is {tuple(mask.shape)}, 'input_ids' {tuple(ids.shape)}")
    return ids.to("cpu", torch.long), None if mask is None else mask.to("cpu").bool()


def _token_ids(tokenizer: Any, text: str) -> list[int]:
    """``text``'s token ids without special tokens, for text that is cut into model-length windows next.

    A Hugging Face tokenizer is called with ``verbose=False``: its "Token indices sequence length is longer
    than the specified maximum sequence length" warning is about feeding the whole text to the model, which
    never happens here (the ids are cut into ``seq_len`` windows). Only that call is quieted: the
    tokenizer's other warnings, and this one on later calls elsewhere, still appear.
    """
    try:
        from transformers import PreTrainedTokenizerBase
    except ImportError:  # pragma: no cover - transformers is a dependency
        PreTrainedTokenizerBase = ()  # type: ignore[assignment,misc]  # noqa: N806
    if isinstance(tokenizer, PreTrainedTokenizerBase):
        return list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


#: end-of-text markers of common tokenizers, tried by ``document_separator="auto"`` after the tokenizer's own
END_OF_TEXT = ("<|endoftext|>", "<|end_of_text|>", "<|eot_id|>", "</s>", "<eos>", "<|im_end|>", "[SEP]")


def auto_separator(tokenizer: Any, text: str) -> str:
    """The separator ``document_separator="auto"`` splits ``text`` on: the tokenizer's EOS text if ``text``
    holds it, else the first of :data:`END_OF_TEXT` it holds, else a blank line (``"\\n\\n"``). Blank lines
    come last because they also separate paragraphs inside a document (a window would then start mid-document)."""
    eos = getattr(tokenizer, "eos_token", None)
    for marker in ([eos] if isinstance(eos, str) and eos else []) + list(END_OF_TEXT):
        if marker in text:
            return marker
    return "\n\n"


class TokenDataset:
    """A corpus cut into ``(n_windows, seq_len)`` token windows, each starting with BOS.

    Args:
        tokens: ``(n_windows, seq_len)`` int64 token ids.
        target_mask: optional ``(n_windows, seq_len)`` bool — the positions that count (default all):
            the prediction of a kept token counts in the evaluations' CE and KL, and the activations at
            a kept position count in training (loss, scale factors, dead counters) and in FVU / L0 /
            dead fraction (BOS, column 0, never does). False at padding (:meth:`from_documents`) or
            outside the answers of a task dataset. Padding must sit on the right of the real tokens
            (causal attention then leaves the real tokens' activations untouched); a mask with the
            signature of left padding (each row pads of one id outside the mask, then counted to the
            end, the pad counts varying or reaching 2: a left-padding tokenizer's ``attention_mask``)
            is refused.

        vocab_size: the model's vocabulary size, when known: every id must be below it (the
            constructors from text pass ``config.vocab_size``). Kept by :meth:`split`.

    Raises:
        ShapeError: (a ``ValueError``) ``tokens`` empty or not 2-D, or ``target_mask`` of another shape.
        ArgumentError: (a ``ValueError`` and ``TypeError``) ``tokens`` not an integer tensor (float or
            bool ids), a negative id, an id ``>= vocab_size``, ``vocab_size`` not a positive int, a
            ``target_mask`` that is not a tensor of booleans or of 0 / 1 (a value of 0.5 is not read as True),
            or one of left padding.

    Source: ours (BOS-started token windows, the inputs activations are collected and evaluated on).
    """

    def __init__(self, tokens: Int[torch.Tensor, "n seq"], target_mask: torch.Tensor | None = None, *,
                 vocab_size: int | None = None) -> None:
        if not isinstance(tokens, torch.Tensor) or not is_index_dtype(tokens.dtype):
            what = f"a {tokens.dtype} tensor" if isinstance(tokens, torch.Tensor) else type(tokens).__name__
            raise ArgumentError(f"tokens must be an integer tensor of token ids, got {what}")
        if tokens.dim() != 2 or tokens.shape[0] == 0:
            raise ShapeError(f"TokenDataset: tokens must be a non-empty (n_windows, seq_len) tensor, got "
                             f"{tuple(tokens.shape)}")
        if target_mask is not None:
            check_zero_one(target_mask, "TokenDataset: target_mask")
        if target_mask is not None and tuple(target_mask.shape) != tuple(tokens.shape):
            raise ShapeError(f"TokenDataset: target_mask must be {tuple(tokens.shape)} like tokens, got "
                             f"{tuple(target_mask.shape)}")
        if vocab_size is not None and (not isinstance(vocab_size, int) or isinstance(vocab_size, bool)
                                       or vocab_size < 1):
            raise ArgumentError(f"vocab_size must be a positive int or None, got {vocab_size!r}")
        if tokens.numel():
            low, high = int(tokens.min()), int(tokens.max())
            if low < 0:
                raise ArgumentError(f"tokens holds a negative token id ({low})")
            if vocab_size is not None and high >= vocab_size:
                raise ArgumentError(f"tokens holds token id {high}, outside the vocabulary of {vocab_size} ids")
        if target_mask is not None:
            _refuse_left_padding(tokens, target_mask, "TokenDataset")
        self.tokens = tokens
        self.target_mask = None if target_mask is None else target_mask.bool()
        self.vocab_size = vocab_size

    @classmethod
    def from_text(cls, tokenizer: Any, text: str, seq_len: int, bos_token_id: int | None = None, *,
                  document_separator: str | None = None, config: Any = None) -> TokenDataset:
        """Windows of ``seq_len`` tokens from ``text``.

        ``document_separator=None`` (default): ``text`` is one document, tokenized once (no special
        tokens) and cut into consecutive windows ``[BOS] + seq_len-1`` tokens (the tail shorter than a
        window is dropped). Right for a corpus that is one long text (the embedded tinyshakespeare);
        wrong for a file of many documents (stories, articles): windows would then start mid-document,
        where the model was never trained, and its CE would be inflated — use a separator.

        ``document_separator`` given: ``text`` is split on it into documents (empty ones dropped) and
        handed to :meth:`from_documents` (one window per document, starting at its start). ``"auto"``
        splits on the first end-of-text marker that occurs in ``text`` — the tokenizer's EOS text, then
        the common ones of other tokenizers (:data:`END_OF_TEXT`: ``<|endoftext|>``, ``</s>``, …; a corpus
        prepared for another model's tokenizer keeps its own marker) — and only when none occurs on blank
        lines; if that finds a single document, ``text`` is that one document (consecutive windows, as
        with ``None``); if it finds none (the text is only separators), :meth:`from_documents` refuses it.
        :func:`auto_separator` says which it picks.

        BOS: ``bos_token_id`` if given, else the tokenizer's, else ``config.bos_token_id`` (the model
        config); if none exists no BOS is prepended (windows then start with the text's first token).

        Raises:
            ArgumentError: ``seq_len`` not an int ≥ 2; ``bos_token_id`` not None or a token id (an int ≥ 0),
                ``document_separator`` not None or a str; ``config`` not None or a model config (a model, or an
                object without its token ids); ``tokenizer`` no tokenizer, ``text`` not a str.

        Source: ours (BOS-started token windows, the inputs activations are collected and evaluated on).
        """
        _check_seq_len(seq_len, "TokenDataset.from_text")
        _check_text_args(tokenizer, text, "TokenDataset.from_text", "text")
        _check_special_sources(tokenizer, config, "TokenDataset.from_text")
        if document_separator is not None and not isinstance(document_separator, str):
            raise ArgumentError(f"TokenDataset.from_text: document_separator must be None, 'auto' or a str, got "
                                f"{document_separator!r}")
        if document_separator is not None:
            sep = document_separator if document_separator != "auto" else auto_separator(tokenizer, text)
            docs = [d for d in (d.strip() for d in text.split(sep)) if d]
            if len(docs) != 1 or document_separator != "auto":  # none: refused there (not the separators' ids)
                return cls.from_documents(tokenizer, docs, seq_len, bos_token_id=bos_token_id, config=config)
        ids = _token_ids(tokenizer, text)  # the whole text: no warning that it exceeds the model's length
        bos = special_token_id(tokenizer, config, bos_token_id)
        _check_given_ids_known(tokenizer, config, "TokenDataset.from_text", bos_token_id=bos_token_id)
        return cls._consecutive(ids, seq_len, bos, _vocab_size(config), "text")

    @classmethod
    def _consecutive(cls, ids: Sequence[int], seq_len: int, bos: int | None, vocab_size: int | None,
                     what: str) -> TokenDataset:
        """Consecutive windows ``[BOS] + seq_len-1`` ids of one document ``ids`` (the short tail dropped)."""
        body = seq_len - 1 if bos is not None else seq_len
        n = len(ids) // body
        if n == 0:
            raise TooFewTokensError(f"TokenDataset: {what} has {len(ids)} tokens, fewer than one window of "
                                    f"seq_len={seq_len}: give a longer text or a smaller seq_len")
        t = torch.tensor(list(ids[: n * body]), dtype=torch.long, device="cpu").view(n, body)
        if bos is not None:
            t = torch.cat([torch.full((n, 1), bos, dtype=torch.long, device="cpu"), t], dim=1)
        return cls(t, vocab_size=vocab_size)

    @classmethod
    def from_documents(cls, tokenizer: Any, documents: Sequence[str], seq_len: int, *,
                       bos_token_id: int | None = None, pad_token_id: int | None = None,
                       config: Any = None) -> TokenDataset:
        """One window per document, starting at the document's start, as language models are trained.

        Each window is ``[BOS] + `` the document's first ``seq_len-1`` tokens (tokenized without special
        tokens; a longer document is truncated). A shorter document is padded on the right to
        ``seq_len`` and its padding is left out of ``target_mask``, so the evaluations' CE, KL, FVU and
        L0 and the positions a trainer learns from count real tokens only (right padding under causal
        attention leaves the real tokens' activations untouched; the padded positions still run through
        the model: keep ``seq_len`` near the documents' length for speed).

        Args:
            tokenizer: a Hugging Face tokenizer.
            documents: the texts; empty ones (no tokens) are skipped.
            seq_len: window length (BOS included).
            bos_token_id: BOS id; default the tokenizer's, else ``config.bos_token_id``; if neither
                exists no BOS is prepended (each window starts with the document's first token).
            pad_token_id: padding id; default the tokenizer's pad id, else its EOS id, else 0 (padding
                is masked out of CE / KL either way).
            config: the model config (e.g. ``model.config``), consulted for the BOS id and the vocabulary
                size (``vocab_size``: every id is checked to be below it).

        Raises:
            TooFewTokensError: (a ``ValueError``) no document has a token.
            ArgumentError: ``seq_len`` not an int ≥ 2; ``bos_token_id`` / ``pad_token_id`` not None or a token id
                (an int ≥ 0); ``config`` not None or a model config; ``tokenizer`` no tokenizer, ``documents`` not
                a list of str (a str was one document per character).

        Source: ours (BOS-started token windows, the inputs activations are collected and evaluated on).
        """
        _check_seq_len(seq_len, "TokenDataset.from_documents")
        _check_text_args(tokenizer, documents, "TokenDataset.from_documents", "documents")
        _check_special_sources(tokenizer, config, "TokenDataset.from_documents")
        bos, pad = special_token_id(tokenizer, config, bos_token_id), _pad_id(tokenizer, pad_token_id)  # kinds checked
        _check_given_ids_known(tokenizer, config, "TokenDataset.from_documents", bos_token_id=bos_token_id,
                               pad_token_id=pad_token_id)
        return cls._one_window_each([_token_ids(tokenizer, doc) for doc in documents], seq_len, bos, pad,
                                    _vocab_size(config))

    @classmethod
    def _one_window_each(cls, documents: Sequence[Sequence[int]], seq_len: int, bos: int | None, pad: int,
                         vocab_size: int | None) -> TokenDataset:
        """One window per document of ids: ``[BOS] +`` its first ids (a document that already starts with
        BOS keeps its own), right-padded with ``pad`` and masked there; documents without a token skipped."""
        rows, masks = [], []
        for doc in documents:
            doc = list(doc)
            head = [] if bos is None or (doc and doc[0] == bos) else [bos]
            ids = head + doc[: seq_len - len(head)]
            if len(ids) == len(head) or (bos is not None and ids == [bos]):
                continue
            rows.append(ids + [pad] * (seq_len - len(ids)))
            masks.append([True] * len(ids) + [False] * (seq_len - len(ids)))
        if not rows:
            raise TooFewTokensError(f"TokenDataset: no document has a token (of {len(documents)} documents, "
                                    "BOS aside): give non-empty documents")
        return cls(torch.tensor(rows, dtype=torch.long, device="cpu"),
                   torch.tensor(masks, dtype=torch.bool, device="cpu"), vocab_size=vocab_size)

    @classmethod
    def from_ids(cls, ids: torch.Tensor, seq_len: int, *, target_mask: torch.Tensor | None = None,
                 tokenizer: Any = None, config: Any = None, bos_token_id: int | None = None,
                 eos_token_id: int | Sequence[int] | None = None) -> TokenDataset:
        """Windows of ``seq_len`` ids from token ids already tokenized (a model without a tokenizer, a corpus
        prepared elsewhere; :func:`read_token_ids` reads them from a file).

        * ``ids`` 1-D, a token stream: cut into documents at each end-of-text id (``eos_token_id``, else the
          tokenizer's, else ``config.eos_token_id``; the EOS id itself is dropped), one window from each
          document's start as :meth:`from_documents` makes them. A stream without an EOS id, or with a single
          document, is one document cut into consecutive windows as :meth:`from_text` does.
        * ``ids`` 2-D ``(n_documents, length)``: one document per row, its real tokens those of
          ``target_mask`` (the Hugging Face ``attention_mask``, padding on the right), one window from each
          row's start. Without ``target_mask`` the padding comes from the pad id (the tokenizer's pad id, else
          its EOS id, else the config's pad / EOS id): a pad id that is no EOS or BOS id marks each row's
          trailing run of it as padding; a pad id equal to an EOS or BOS id (GPT-2, Llama without a pad
          token) cannot tell a pad from a document's own EOS, so rows ending with it are refused; with no pad
          id known, a row ending with 2 or more copies of one id is refused (one pad after the longest row's
          length cannot be told from text); otherwise every id is real. Pass ``target_mask`` whenever the rows
          were padded.

        BOS is prepended as in :meth:`from_text` (``bos_token_id``, else the tokenizer's, else the config's),
        unless the document already starts with it. ``config.vocab_size`` bounds the ids when given.

        Raises:
            ArgumentError: ``ids`` not an integer tensor, not 1-D or 2-D, a negative id or one outside the
                vocabulary, ``target_mask`` not of booleans or 0 / 1, of another shape or with padding before a
                real token, or given with 1-D ``ids`` (a stream has no padding; it was ignored), or 2-D ``ids``
                without ``target_mask`` whose padding is ambiguous (above); ``seq_len`` not an int ≥ 2;
                ``bos_token_id`` not None or a token id, ``eos_token_id`` not None, a token id or a list of them;
                ``config`` not None or a model config, ``tokenizer`` not None or an object with token id attributes.
            TooFewTokensError: (a ``ValueError``) fewer ids than one window (a stream of one document), or no
                document with a token.

        Source: ours (BOS-started token windows, the inputs activations are collected and evaluated on).
        """
        _check_seq_len(seq_len, "TokenDataset.from_ids")
        _check_special_sources(tokenizer, config, "TokenDataset.from_ids")
        if not isinstance(ids, torch.Tensor) or not is_index_dtype(ids.dtype):
            what = f"a {ids.dtype} tensor" if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise ArgumentError(f"ids must be an integer tensor of token ids, got {what}")
        if ids.dim() not in (1, 2):
            raise ArgumentError(f"ids must be a 1-D token stream or a 2-D (documents, length) tensor, got "
                                f"{ids.dim()}-D {tuple(ids.shape)}")
        if target_mask is not None and ids.dim() == 1:
            raise ArgumentError("from_ids: target_mask applies to 2-D ids (one document per row, padding on the "
                                "right); a 1-D token stream is cut at its EOS ids and has no padding")
        bos, vocab = special_token_id(tokenizer, config, bos_token_id), _vocab_size(config)
        pad = _pad_id(tokenizer, None, config)
        ids = ids.to("cpu", torch.long)
        if ids.numel() and int(ids.min()) < 0:
            raise ArgumentError(f"ids holds a negative token id ({int(ids.min())})")
        if ids.dim() == 2:
            if target_mask is None:  # the padding from the pad id where that is unambiguous, else refused
                specials = _eos_ids(tokenizer, config, eos_token_id) | ({bos} if bos is not None else set())
                target_mask = _rows_mask(ids, _known_pad_id(tokenizer, config), specials) if ids.numel() \
                    else torch.ones_like(ids, dtype=torch.bool)
            check_zero_one(target_mask, "from_ids: target_mask")
            if tuple(target_mask.shape) != tuple(ids.shape):
                raise ArgumentError(f"target_mask must be {tuple(ids.shape)} like ids, got {tuple(target_mask.shape)}")
            mask = target_mask.to("cpu").bool()
            lengths = mask.sum(dim=1)
            if not bool((mask == (torch.arange(ids.shape[1], device="cpu") < lengths[:, None])).all()):
                raise ArgumentError("target_mask must mark each row's real tokens as a prefix (padding on the right)")
            docs = [row[: int(n)].tolist() for row, n in zip(ids, lengths, strict=True)]
            return cls._one_window_each(docs, seq_len, bos, pad, vocab)
        eos = _eos_ids(tokenizer, config, eos_token_id)
        stream = ids.tolist()
        docs, start = [], 0
        for i, t in enumerate(stream):
            if t in eos:
                docs.append(stream[start:i])
                start = i + 1
        docs.append(stream[start:])
        docs = [d for d in docs if d and d != [bos]]
        if len(docs) > 1:
            return cls._one_window_each(docs, seq_len, bos, pad, vocab)
        one = docs[0] if docs else []
        if bos is not None and one[:1] == [bos]:
            one = one[1:]
        return cls._consecutive(one, seq_len, bos, vocab, "the token stream")

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_len(self) -> int:
        """Tokens per window (``tokens.shape[1]``).

        Source: ours (BOS-started token windows, the inputs activations are collected and evaluated on).
        """
        return self.tokens.shape[1]

    def split(self, holdout_fraction: float) -> tuple[TokenDataset, TokenDataset]:
        """(train, held-out): the last ``holdout_fraction`` of windows are held out (at least one; at least one
        is kept for training).

        Raises:
            ArgumentError: ``holdout_fraction`` not a number in ``(0, 1)`` (``1.5`` held out every window and
                left an empty training set).
            TooFewTokensError: fewer than 2 windows (no split leaves both parts a window).

        Source: ours (BOS-started token windows, the inputs activations are collected and evaluated on).
        """
        if not is_real(holdout_fraction) or not 0.0 < holdout_fraction < 1.0:
            raise ArgumentError(f"TokenDataset.split(holdout_fraction=...) must be a number in (0, 1), got "
                                f"{holdout_fraction!r}")
        if len(self) < 2:
            raise TooFewTokensError(f"TokenDataset.split: {len(self)} window(s); a split needs at least 2 (one "
                                    "for training, one held out)")
        # the count the fraction names, without float error: 8 / 14849 of 14849 windows is 7.9999… (held out 7
        # until 2026-11-30: the demo's --heldout-windows 8 held out 7)
        n_hold = min(len(self) - 1, max(1, math.floor(len(self) * holdout_fraction + 1e-9 * len(self))))
        return self._rows(slice(None, -n_hold)), self._rows(slice(-n_hold, None))

    def _rows(self, rows: slice) -> TokenDataset:
        """The windows ``rows`` of this dataset, its mask and vocabulary kept (checked once, here at the whole:
        a part of a mask the whole passed may look like left padding on its own)."""
        out = object.__new__(TokenDataset)
        out.tokens, out.vocab_size = self.tokens[rows], self.vocab_size
        out.target_mask = None if self.target_mask is None else self.target_mask[rows]
        return out

    def targets(self, start: int, stop: int) -> torch.Tensor | None:
        """``target_mask`` of windows ``start:stop``: rows of the ``(n_windows, seq_len)`` mask (None: every token
        counts).

        Raises:
            ArgumentError: ``start`` / ``stop`` not ints with ``0 <= start <= stop`` (checked with or without a mask).

        Source: ours (BOS-started token windows, the inputs activations are collected and evaluated on).
        """
        if not (is_int(start) and is_int(stop) and 0 <= start <= stop):
            raise ArgumentError(f"TokenDataset.targets: start and stop must be ints with 0 <= start <= stop, got "
                                f"{start!r}, {stop!r}")
        return None if self.target_mask is None else self.target_mask[start:stop]

    def batch(self, index: int, batch_size: int, seed: int = 0) -> Int[torch.Tensor, "batch seq"]:
        """Batch ``index`` of an endless shuffled stream (a new permutation each epoch, from ``seed``):
        the windows :func:`_window_ids` picks, ``(batch_size, seq)``. An epoch is ``n_windows // batch_size``
        batches, no window twice: when ``batch_size`` does not divide ``n_windows`` each epoch leaves out the
        ``n_windows % batch_size`` windows its permutation puts last (others each epoch); a ``batch_size`` above
        ``n_windows`` gives every window in each batch, ``(n_windows, seq)``.

        Source: ours (BOS-started token windows, the inputs activations are collected and evaluated on).
        """
        return self.tokens[_window_ids(len(self), index, batch_size, seed)]

    def batch_targets(self, index: int, batch_size: int, seed: int = 0) -> torch.Tensor | None:
        """``target_mask`` of :meth:`batch` ``(index, batch_size, seed)`` (None: every token counts).

        Source: ours (BOS-started token windows, the inputs activations are collected and evaluated on).
        """
        m = self.target_mask
        return None if m is None else m[_window_ids(len(self), index, batch_size, seed)]

    @staticmethod
    def sample_stream(ids: Int[torch.Tensor, " n"], batch_size: int, seq_len: int, generator: torch.Generator,
                      bos_token_id: int) -> Int[torch.Tensor, "batch seq"]:
        """``(batch_size, seq_len)`` random windows of a token stream that is one long text: BOS then
        ``seq_len - 1`` consecutive tokens from random starts (what sparse-attention training draws from
        a stream, where a :class:`TokenDataset` has fixed windows).

        The starts are drawn on ``generator`` (a CPU generator: the same windows on every device); the
        windows are on ``ids``' device (``ids``: 1-D, at least ``seq_len - 1`` tokens).

        Source: ours (BOS-started token windows, the inputs activations are collected and evaluated on).
        """
        starts = torch.randint(0, ids.numel() - seq_len + 2, (batch_size,), generator=generator,
                               device=generator.device)
        body = torch.stack([ids[s: s + seq_len - 1] for s in starts.tolist()])
        return torch.cat([torch.full((batch_size, 1), bos_token_id, dtype=torch.long, device=ids.device), body], dim=1)


def _window_ids(n_windows: int, index: int, batch_size: int, seed: int) -> Int[torch.Tensor, " batch"]:
    """The windows of batch ``index`` of an endless stream over ``n_windows`` windows: a new seeded
    permutation each epoch (``seed * 1_000_003 + epoch``), cut into ``n_windows // batch_size`` batches."""
    if not is_int(index) or index < 0:
        raise ArgumentError(f"a batch index must be an int >= 0, got {index!r}")
    if not is_int(batch_size) or batch_size < 1:
        raise ArgumentError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if not is_int(seed):
        raise ArgumentError(f"seed must be an int, got {seed!r}")
    per_epoch = max(1, n_windows // batch_size)
    epoch, k = divmod(index, per_epoch)
    g = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n_windows, generator=g, device="cpu")[k * batch_size:(k + 1) * batch_size]
