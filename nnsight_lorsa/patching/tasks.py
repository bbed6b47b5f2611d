"""Tokenizer-aware task builders: clean/corrupt prompt batches with correct/incorrect answer tokens.

* :func:`induction_task` — repeated random tokens (Olsson et al.; Lorsa paper §6.1 / App. E.3).
* :func:`ioi_task` — indirect object identification templates (Draye et al. 2025 App. A.2).
* :func:`greater_than_task` — "from the year 1363 to 13" (Draye et al. 2025 App. A.1).
* :func:`arithmetic_task` / :func:`arithmetic_grid` — ``op1 + op2 =`` over the 100 × 100 operand
  grid (Lorsa paper §6.2, Fig. 7).

Every builder returns a :class:`TaskBatch` of equal-length clean and corrupt token ids; the
metric is the logit difference ``correct − incorrect`` at the last position. Names, years and
numbers are split by the tokenizer as it will: a template that cannot be tokenized as the task
needs (a name that is not one token, an answer that is not one token, clean and corrupt prompts
of different lengths, a prompt holding the tokenizer's unknown token) raises :class:`TaskTokenizationError` naming
the culprit.
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .._checks import is_collection, is_int
from .._placement import check_device_arg, is_index_dtype
from .._repr import FieldsRepr
from ..envoy.tokens import check_tokenizer
from ..errors import ArgumentError, ConfigMismatchError, LorsaError

IOI_TEMPLATES = (
    "Then, [B] and [A] went to the park. [S] gave a ball to",
    "When [B] and [A] got a snack at the cafe, [S] decided to give it to",
    "After the lunch, [B] and [A] went to the mall. [S] gave a gift to",
)
NAMES = (" Mary", " John", " Tom", " James", " Anne", " Kate", " Paul", " Mark", " Jane", " Lucy", " Henry",
         " Edward", " Richard", " Romeo", " Juliet", " Peter", " Anna", " Sam", " Ben", " Rose")
NOUNS = ("demonstrations", "war", "reign", "expedition", "voyage", "siege", "famine", "plague")


class TaskTokenizationError(LorsaError, ValueError):
    """A task's template cannot be tokenized as the task needs (e.g. a name spans several tokens)."""


@dataclass(repr=False)
class TaskBatch(FieldsRepr):
    """Clean and corrupt prompts of one task.

    Attributes:
        name: the task.
        clean, corrupt: ``(batch, pos)`` int64 token ids (same shape; BOS first if the tokenizer adds one),
            on the CPU as built (``model.trace`` moves them to the model's device; :meth:`to` moves them all).
        correct_ids, incorrect_ids: ``(batch,)`` int64 next-token ids compared at the last position.
        meta: one dict per prompt (text, operands, names ...).

    Source: ours (the clean/corrupt batch every task builder returns).
    """

    name: str
    clean: torch.Tensor
    corrupt: torch.Tensor
    correct_ids: torch.Tensor
    incorrect_ids: torch.Tensor
    meta: list[dict[str, Any]] = field(default_factory=list)

    def __len__(self) -> int:
        return int(self.clean.shape[0])

    def to(self, device: str | torch.device) -> TaskBatch:
        """The same batch with its four id tensors on ``device``.

        Raises:
            ArgumentError: ``device`` not a device (a str, ``torch.device`` or GPU index; ``_placement``'s check).
            PlacementError: a device this machine lacks.

        Source: ours (the clean/corrupt batch every task builder returns).
        """
        d = check_device_arg(device, "TaskBatch.to")
        return TaskBatch(self.name, self.clean.to(d), self.corrupt.to(d), self.correct_ids.to(d),
                         self.incorrect_ids.to(d), list(self.meta))

    def select(self, rows: Any) -> TaskBatch:
        """The sub-batch ``rows``: an index, a slice, a list / 1-D integer tensor of indices (negative ones count from
        the end, as Python's) or a ``(len(self),)`` bool mask.

        Raises:
            ArgumentError: ``rows`` of another kind (a float, a bool, a string), an index outside ``[-n, n)``, or a
                selection of no prompt (an empty task is no experiment).

        Source: ours (the clean/corrupt batch every task builder returns).
        """
        n = len(self)
        if isinstance(rows, torch.Tensor) and rows.dtype == torch.bool and tuple(rows.shape) == (n,):
            idx = rows.to("cpu").nonzero().flatten()
        elif isinstance(rows, slice) and all(v is None or is_int(v) for v in (rows.start, rows.stop, rows.step)) \
                and rows.step != 0:
            idx = torch.arange(n, device="cpu")[rows]
        else:
            items: list[Any] | None = None
            if is_int(rows):
                items = [rows]
            elif isinstance(rows, (list, tuple, range)):
                items = list(rows)
            elif isinstance(rows, torch.Tensor) and rows.dim() == 1 and is_index_dtype(rows.dtype):
                items = rows.tolist()
            if items is None or not all(is_int(i) and -n <= i < n for i in items):
                raise ArgumentError(f"TaskBatch.select: rows must be an index, a slice, a list of indices in "
                                    f"[-{n}, {n}) or a ({n},) bool mask, got {rows!r}"[:300])
            idx = torch.tensor([int(i) % n for i in items], dtype=torch.long, device="cpu")
        if idx.numel() == 0:
            raise ArgumentError(f"TaskBatch.select({rows!r}) selects none of the {n} prompts")
        on = self.clean.device
        return TaskBatch(self.name, self.clean[idx.to(on)], self.corrupt[idx.to(self.corrupt.device)],
                         self.correct_ids[idx.to(self.correct_ids.device)],
                         self.incorrect_ids[idx.to(self.incorrect_ids.device)], [self.meta[int(i)] for i in idx])


def _check_int(value: Any, name: str, low: int | None = None) -> None:
    """Raise :class:`~nnsight_lorsa.errors.ArgumentError` unless ``value`` is an int (not a bool), ``>= low``."""
    if not is_int(value) or (low is not None and value < low):
        raise ArgumentError(f"{name} must be an int{'' if low is None else f' >= {low}'}, got {value!r}")


def _check_items(value: Any, name: str, kind: str, where: str) -> None:
    """Raise :class:`~nnsight_lorsa.errors.ArgumentError` unless ``value`` is a collection (a list, tuple, range, set,
    or a 1-D tensor / array) of ``kind`` items: ``"str"`` (texts), ``"int"`` (ints, not bools) or ``"pair"`` (two
    ints each); ``"text"``: one str. A str, a mapping or a one-shot iterator is none."""
    if kind == "text":
        ok = isinstance(value, str)
    elif not is_collection(value):
        ok = False
    elif kind == "str":
        ok = all(isinstance(v, str) for v in value)
    elif kind == "int":
        ok = all(is_int(v) for v in value)
    else:
        ok = all(isinstance(v, (list, tuple)) and len(v) == 2 and all(is_int(x) for x in v) for v in value)
    if not ok:
        what = {"text": "a str", "str": "a list of str", "int": "a list of ints",
                "pair": "a list of (op1, op2) pairs of ints"}[kind]
        raise ArgumentError(f"{where}: {name} must be {what}, got {value!r}"[:300])


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _bos(tokenizer: Any) -> list[int]:
    bos = getattr(tokenizer, "bos_token_id", None)
    return [] if bos is None else [int(bos)]


def single_token(tokenizer: Any, text: str) -> int | None:
    """The id of ``text`` if the tokenizer encodes it as exactly one token, else None (alone: for a word as it stands
    after another — ``" Mary"`` on a SentencePiece tokenizer — :func:`word_token`)."""
    ids = _encode(tokenizer, text)
    if len(ids) != 1 or tokenizer.decode(ids) != text:  # an unknown-token fallback is not the text
        return None
    return ids[0]


#: the word a name is encoded after (:func:`word_token`): names stand after a word in every IOI template
_BEFORE = "and"


def word_token(tokenizer: Any, text: str) -> int | None:
    """The id of ``text`` (a word with its leading space, e.g. ``" Mary"``) as the one token the tokenizer gives it
    after a word (``"and Mary"`` encodes as ``"and"``'s ids plus that token, and decodes back to ``"and"``'s text plus
    ``text``), else None: :func:`next_token` after ``"and"``.

    In context, not alone: a SentencePiece / Llama-style tokenizer writes the space as the word-start mark ``▁``
    and decodes ``▁Mary`` alone as ``"Mary"`` (the leading space stripped), so :func:`single_token` finds no word
    there; a byte-level BPE (``ĠMary``) gives the same id both ways. A word spelled through several pieces,
    byte-fallback tokens (``<0xC3>``…) or the unknown token is not one token.
    """
    return next_token(tokenizer, _BEFORE, text)


def continuation(tokenizer: Any, before: str, text: str) -> list[int] | None:
    """The ids ``text`` adds after ``before`` where the tokenizer encodes them together: ``encode(before + text)`` is
    ``encode(before)`` plus these ids and decodes back to ``before``'s decoded text plus ``text``; None where
    ``before``'s tokens change (``text`` merges with its last token), or the text does not decode back (an
    unknown-token fallback). Without special tokens.

    The token a model predicts after a prompt is this, not ``text`` encoded alone: a SentencePiece / Llama-style
    tokenizer spells a digit that continues a number (``"136"`` + ``"4"``) as ``4`` and the same digit alone as the
    word-start ``▁4``.
    """
    head = _encode(tokenizer, before)
    ids = _encode(tokenizer, before + text)
    if len(ids) <= len(head) or ids[:len(head)] != head \
            or tokenizer.decode(ids) != tokenizer.decode(head) + text:  # (a tokenizer may add a prefix space)
        return None
    return ids[len(head):]


_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def is_byte_token(tokenizer: Any, tid: int) -> bool:
    """Whether ``tid`` is a byte-fallback token (SentencePiece's ``<0xNN>``: one byte of a character the vocabulary
    does not hold)."""
    piece = tokenizer.convert_ids_to_tokens(int(tid))
    return isinstance(piece, str) and _BYTE_TOKEN.fullmatch(piece) is not None


def next_token(tokenizer: Any, before: str, text: str) -> int | None:
    """The id of ``text`` as the one token the tokenizer gives it after ``before`` (:func:`continuation` of one
    token, not a byte-fallback token), else None: the answer token of a prompt ``before`` whose answer is ``text``.
    """
    ids = continuation(tokenizer, before, text)
    if ids is None or len(ids) != 1 or is_byte_token(tokenizer, ids[0]):
        return None
    return ids[0]


def _word_text(tokenizer: Any, tid: int) -> str:
    """What token ``tid`` adds to the text after a word: ``" Mary"`` for ``▁Mary`` and ``ĠMary`` alike."""
    before = _encode(tokenizer, _BEFORE)
    head = tokenizer.decode(before)
    full = tokenizer.decode([*before, tid])
    return full[len(head):] if full.startswith(head) else ""


def _stack(rows: list[list[int]], what: str) -> torch.Tensor:
    lengths = {len(r) for r in rows}
    if len(lengths) != 1:
        raise TaskTokenizationError(f"{what}: prompts tokenize to different lengths {sorted(lengths)}")
    return _host_ids(rows)


def _pair(tokenizer: Any, clean: list[list[int]], corrupt: list[list[int]],
          what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The clean and corrupt prompts stacked, refused unless all of them (clean *and* corrupt) share one length and
    none holds the tokenizer's unknown token."""
    for i, (a, b) in enumerate(zip(clean, corrupt, strict=True)):
        if len(a) != len(b):
            raise TaskTokenizationError(f"{what}: prompt {i} tokenizes to {len(a)} tokens clean and {len(b)} corrupt: "
                                        "clean and corrupt prompts must share one length")
    _check_known(tokenizer, clean + corrupt, what)
    return _stack(clean, what), _stack(corrupt, what)


def _check_known(tokenizer: Any, rows: list[list[int]], what: str) -> None:
    """Refuse prompts holding the tokenizer's unknown token: the words it stands for (operands, a century, a
    template's word) are not in the prompt the model sees, and clean and corrupt prompts may even be equal."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None:
        return
    for row in rows:
        if int(unk) in row:
            raise TaskTokenizationError(f"{what}: the prompt {tokenizer.decode(row)!r} holds the unknown token "
                                        f"{tokenizer.unk_token!r}: the tokenizer cannot spell it")


def _host_ids(rows: Any) -> torch.Tensor:
    """Token ids as an int64 tensor on the CPU (host-side: nnsight moves a trace's inputs to the
    model's device; the metrics move the answer ids to the logits' device)."""
    return torch.tensor(rows, dtype=torch.long, device="cpu")


# ------------------------------------------------------------------ induction
def induction_task(tokenizer: Any, n_prompts: int = 8, seq_len: int = 20, *, seed: int = 0,
                   token_pool: Sequence[int] | None = None) -> TaskBatch:
    """Repeated random tokens: clean ``[BOS] s s[:-1]`` predicts ``s[-1]`` by induction.

    The corrupt prompt repeats nothing (``[BOS] s' s[:-1]`` with a fresh ``s'``): same length, same
    last tokens, no earlier occurrence to copy from — where the pool holds at least ``2·seq_len + 1`` tokens;
    a smaller pool draws ``s'`` from all of it, so ``s'`` may share tokens with ``s``. ``incorrect_ids`` is a
    random pool token not in ``s``. ``token_pool`` (default: all non-special ids of the vocabulary) restricts the
    tokens, e.g. to single-token names for "repeated-name" prompts.

    Returns:
        :class:`TaskBatch` with ``clean, corrupt: (n_prompts, 1 + 2·seq_len − 1)`` (BOS if any).

    Raises:
        ArgumentError: ``tokenizer`` not a tokenizer (None: a model loaded without one).
        TaskTokenizationError: the pool has fewer than ``seq_len + 1`` distinct tokens.
        ArgumentError: ``n_prompts`` or ``seed`` not an int (``n_prompts >= 1``), ``seq_len`` not an int
            ``>= 2`` (one repeated token is no induction), ``token_pool`` not a list of ints or an entry that is
            not a token id in ``[0, len(tokenizer))``.

    Source: Lorsa paper (He et al. 2025) §6.1, App. E; Olsson et al. 2022 (induction heads).
    """
    check_tokenizer(tokenizer, "induction_task")
    _check_int(n_prompts, "n_prompts", 1)
    _check_int(seq_len, "seq_len", 2)
    _check_int(seed, "seed")
    vocab = len(tokenizer)
    if token_pool is not None:
        _check_items(token_pool, "token_pool", "int", "induction_task")
        bad = [t for t in token_pool if not is_int(t)
               or not 0 <= t < vocab]
        if bad:
            raise ArgumentError(f"token_pool must hold token ids in [0, {vocab}), got {bad[:5]}")
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    pool = list(dict.fromkeys(int(t) for t in (token_pool if token_pool is not None else range(vocab))
                              if t not in special))  # distinct, in the given order
    if len(pool) < seq_len + 1:
        raise TaskTokenizationError(f"induction needs at least {seq_len + 1} distinct tokens, the pool has {len(pool)}")
    rng = random.Random(seed)
    bos = _bos(tokenizer)
    clean, corrupt, correct, incorrect, meta = [], [], [], [], []
    for _ in range(n_prompts):
        s = rng.sample(pool, seq_len + 1)
        seq, other = s[:seq_len], s[seq_len]
        fresh = rng.sample([t for t in pool if t not in seq], seq_len) if len(pool) >= 2 * seq_len + 1 else \
            rng.sample(pool, seq_len)
        clean.append(bos + seq + seq[:-1])
        corrupt.append(bos + fresh + seq[:-1])
        correct.append(seq[-1])
        incorrect.append(other)
        meta.append({"sequence": seq})
    return TaskBatch("induction", _host_ids(clean), _host_ids(corrupt), _host_ids(correct),
                     _host_ids(incorrect), meta)


def name_tokens(tokenizer: Any, names: Sequence[str] = NAMES, pattern: str = r"^ [A-Z][a-z]+$",
                min_count: int = 2, search_vocab: bool = True, exclude: Collection[str] = ()) -> list[tuple[str, int]]:
    """Names that are single tokens where they stand in a prompt, after a word (:func:`word_token`: ``ĠMary`` of a
    byte-level BPE, ``▁Mary`` of a SentencePiece / Llama-style one): those of ``names`` first, then
    (``search_vocab``) vocabulary tokens whose text after a word matches ``pattern`` (e.g. the small BPE of the
    tinyshakespeare model has few names; byte-fallback tokens never match). ``exclude``: words (without their
    leading space) never taken as names — a prompt template's own words (a vocabulary search on a small vocabulary
    otherwise finds ``" When"``, and "When … When gave …" holds the subject three times).

    Returns:
        ``[(name, token id), ...]``, the name as given (``" Mary"``).

    Raises:
        TaskTokenizationError: fewer than ``min_count`` single-token names.
    """
    banned = {w.strip() for w in exclude}
    found = [(n, t) for n in names if n.strip() not in banned and (t := word_token(tokenizer, n)) is not None]
    if search_vocab and len(found) < min_count:
        seen = {t for _, t in found}
        for tid in range(len(tokenizer)):
            text = _word_text(tokenizer, tid)
            if tid not in seen and re.match(pattern, text) and text.strip() not in banned \
                    and word_token(tokenizer, text) == tid:
                found.append((text, tid))
    if len(found) < min_count:
        raise TaskTokenizationError(f"only {len(found)} single-token names ({[n for n, _ in found]}); "
                                    f"the task needs {min_count}")
    return found


# ------------------------------------------------------------------ IOI
def ioi_task(tokenizer: Any, n_prompts: int = 8, *, template: str = IOI_TEMPLATES[0],
             names: Sequence[str] = NAMES, seed: int = 0, order: str = "BABA") -> TaskBatch:
    """Indirect object identification (Draye et al. 2025 App. A.2): "Then, [B] and [A] went to the
    park. [S] gave a ball to" with S = B; the answer is the indirect object A, the distractor S.

    ``order``: ``"BABA"`` (the subject named first, as above), ``"ABBA"`` (the indirect object named
    first: "Then, A and B went … B gave a ball to") or ``"mixed"`` (alternating, Wang et al.'s two
    patterns) — so that "the second name" is not the answer of every prompt.

    Corrupt ("ABC") prompts put three other names in the slots, so the clean IO/S logit difference
    has no support there. One ``template`` per batch (prompts must share a length; see
    :data:`IOI_TEMPLATES`). Names must be single tokens (:func:`name_tokens`, falling back to
    capitalised vocabulary tokens).

    Raises:
        ArgumentError: ``tokenizer`` not a tokenizer (None: a model loaded without one).
        TaskTokenizationError: fewer than 5 single-token names, or a template whose clean and
            corrupt prompts tokenize to different lengths or hold the unknown token.
        ConfigMismatchError: an unknown ``order``.
        ArgumentError: ``n_prompts`` not an int ``>= 1`` or ``seed`` not an int; ``template`` not a str, ``names`` not
            a list of str.

    Source: Draye et al. 2025, *Sparse Attention Post-Training for Mechanistic Interpretability* App. A.2; Wang et al.
    2023, *Interpretability in the Wild*.
    """
    check_tokenizer(tokenizer, "ioi_task")
    _check_items(template, "template", "text", "ioi_task")
    _check_items(names, "names", "str", "ioi_task")
    if order not in ("BABA", "ABBA", "mixed"):
        raise ConfigMismatchError(f"order must be 'BABA', 'ABBA' or 'mixed', got {order!r}")
    words = set(re.findall(r"[^\W\d_]+", re.sub(r"\[[ABS]\]", " ", template)))  # the template's own words
    pool = name_tokens(tokenizer, names, min_count=5, exclude=words)
    _check_int(n_prompts, "n_prompts", 1)
    _check_int(seed, "seed")
    rng = random.Random(seed)
    bos = _bos(tokenizer)
    clean, corrupt, correct, incorrect, meta = [], [], [], [], []
    for k in range(n_prompts):
        (a, ta), (b, tb), (c, _), (d, _), (e, _) = rng.sample(pool, 5)
        abba = order == "ABBA" or (order == "mixed" and k % 2 == 1)
        first, second = (a, b) if abba else (b, a)  # the names in the [B] and [A] slots
        text = template.replace("[B]", first.strip()).replace("[A]", second.strip()).replace("[S]", b.strip())
        text_c = template.replace("[A]", c.strip()).replace("[B]", d.strip()).replace("[S]", e.strip())
        ids, ids_c = _encode(tokenizer, text), _encode(tokenizer, text_c)
        if len(ids) != len(ids_c):
            raise TaskTokenizationError(f"IOI template {template!r}: clean/corrupt lengths differ with names "
                                        f"{a, b} vs {c, d, e}")
        if ids.count(ta) != 1 or ids.count(tb) != 2:  # a name's token also spelled by the template's other words
            raise TaskTokenizationError(f"IOI template {template!r} with names {a, b}: the prompt holds the IO "
                                        f"token {ids.count(ta)} times and the subject's {ids.count(tb)} times "
                                        "(1 and 2 expected); pass other names=")
        clean.append(bos + ids)
        corrupt.append(bos + ids_c)
        correct.append(ta)
        incorrect.append(tb)
        meta.append({"text": text, "io": a, "s": b, "order": "ABBA" if abba else "BABA", "corrupt_text": text_c})
    return TaskBatch("ioi", *_pair(tokenizer, clean, corrupt, "IOI"), _host_ids(correct),
                     _host_ids(incorrect), meta)


# ------------------------------------------------------------------ greater-than
def greater_than_task(tokenizer: Any, n_prompts: int = 8, *, seed: int = 0, century: int = 13,
                      noun: str = "war", years: Sequence[int] | None = None) -> TaskBatch:
    """Greater-than (Draye et al. 2025 App. A.1): "The war lasted from the year 1363 to 13" → "64"…"99".

    If the tokenizer has every two-digit number as a single token after the century prefix (as it spells it after
    the prompt, :func:`next_token`: ``64`` after "… to 13", not the word-start ``▁64`` a SentencePiece tokenizer
    gives "64" alone), the answer is the two-digit token (correct: ``YY+1``, incorrect: ``YY−1``); otherwise (digit
    tokenizers, like Llama-3's or the tinyshakespeare BPE) the prompt ends one digit later —
    "from the year 1363 to 136" — and the answer is the final digit as the tokenizer continues the number with it
    (correct ``Y+1``, incorrect ``Y−1``; the App. A.1 simplification for LLaMA; never a byte-fallback token).
    One ``noun`` per batch (see :data:`NOUNS`). Corrupt prompts start in year ``..01`` / ``..0``. ``years``: the start
    years' last two digits to draw from (e.g. held-out ones; default all usable: 02–97, or with one-digit answers
    those with a last digit 1–8 and a decade digit 1–9).

    Raises:
        ArgumentError: ``tokenizer`` not a tokenizer (None: a model loaded without one).
        TaskTokenizationError: neither form tokenizes into single answer tokens of equal-length prompts without
            the unknown token (e.g. a century the tokenizer cannot spell).
        ConfigMismatchError: ``years`` empty or holding a value the form cannot use.
        ArgumentError: ``n_prompts`` not an int ``>= 1`` or ``seed`` not an int; ``century`` not an int ``>= 0``,
            ``noun`` not a str, ``years`` not a list of ints.

    Source: Draye et al. 2025, *Sparse Attention Post-Training for Mechanistic Interpretability* App. A.1.
    """
    check_tokenizer(tokenizer, "greater_than_task")
    _check_int(n_prompts, "n_prompts", 1)
    _check_int(seed, "seed")
    _check_int(century, "century", 0)
    _check_items(noun, "noun", "text", "greater_than_task")
    if years is not None:
        _check_items(years, "years", "int", "greater_than_task")
    rng = random.Random(seed)
    bos = _bos(tokenizer)
    # the answers as the tokenizer spells them after the prompt (next_token), not alone: a SentencePiece tokenizer
    # writes "64" alone as "▁64" (or "▁ 6 4"), after "… to 13" as "64"
    tail = f"The {noun} lasted from the year {century}63 to {century}"
    clean, corrupt, correct, incorrect, meta = [], [], [], [], []
    two_digit = all(next_token(tokenizer, tail, f"{y:02d}") is not None for y in range(1, 99))
    usable = [yy for yy in range(100) if (2 <= yy <= 97 if two_digit else 1 <= yy % 10 <= 8 and yy >= 10)]
    pool = usable if years is None else [int(y) for y in years]
    if not pool or any(y not in usable for y in pool):
        raise ConfigMismatchError(f"greater-than years must be in {usable[0]:02d}–{usable[-1]:02d}"
                                  f"{'' if two_digit else ' with a last digit 1–8'}, got {list(pool)}")
    for _ in range(n_prompts):
        if two_digit:
            yy = rng.randrange(2, 98) if years is None else rng.choice(pool)
            text = f"The {noun} lasted from the year {century}{yy:02d} to {century}"
            text_c = f"The {noun} lasted from the year {century}01 to {century}"
            c_id, i_id = next_token(tokenizer, text, f"{yy + 1:02d}"), next_token(tokenizer, text, f"{yy - 1:02d}")
        else:
            if years is None:
                y, decade = rng.randrange(1, 9), rng.randrange(1, 10)
            else:
                decade, y = divmod(rng.choice(pool), 10)
            text = f"The {noun} lasted from the year {century}{decade}{y} to {century}{decade}"
            text_c = f"The {noun} lasted from the year {century}{decade}0 to {century}{decade}"
            c_id, i_id = next_token(tokenizer, text, str(y + 1)), next_token(tokenizer, text, str(y - 1))
        if c_id is None or i_id is None:
            raise TaskTokenizationError(
                f"greater-than: neither two-digit nor single-digit answers are single tokens after {text!r} (the "
                "answer must be one token, not a byte-fallback one, that continues the prompt's last number)")
        clean.append(bos + _encode(tokenizer, text))
        corrupt.append(bos + _encode(tokenizer, text_c))
        correct.append(c_id)
        incorrect.append(i_id)
        meta.append({"text": text, "corrupt_text": text_c})
    return TaskBatch("greater_than", *_pair(tokenizer, clean, corrupt, "greater-than"),
                     _host_ids(correct), _host_ids(incorrect), meta)


# ------------------------------------------------------------------ arithmetic
def _spells(tokenizer: Any, token: int, number: int) -> bool:
    """Whether ``token`` decodes to the start of ``number``'s digits (not an unknown-token fallback)."""
    text = tokenizer.decode([token]).strip()
    return bool(text) and str(number).startswith(text)


def _arith_prompt(tokenizer: Any, a: int, b: int, template: str, like: tuple[str, int] | None = None
                  ) -> tuple[list[int], int, int, tuple[str, int]]:
    """(prompt ids, first token of the answer, first token of a wrong answer, form) or raise.

    A whitespace-only first answer token (" 122" → " ", "1", …) moves into the prompt. ``form``: ``(sep, moved)``,
    the separator between the prompt and the sum (``" "``, else ``""``) and how many whitespace-only tokens moved;
    ``like``: a form the prompt must have (a corrupt prompt has its clean prompt's: "… is ▁" and "… is" — or
    "… is 104" and "… is104" — would answer different questions)."""
    text = template.format(op1=a, op2=b)
    ids = _encode(tokenizer, text)
    total = a + b
    for sep in (" ", "") if like is None else (like[0],):
        full = _encode(tokenizer, text + sep + str(total))
        if full[:len(ids)] != ids or len(full) <= len(ids):
            continue
        prompt = list(ids)
        while len(full) > len(prompt) + 1 and not tokenizer.decode(full[len(prompt):len(prompt) + 1]).strip():
            prompt.append(full[len(prompt)])
        if like is not None and len(prompt) - len(ids) != like[1]:
            continue
        ans = full[len(prompt)]
        if not _spells(tokenizer, ans, total) or is_byte_token(tokenizer, ans):  # an unknown / byte-fallback token
            continue
        for wrong in (total + 10, total + 1, total - 1, total + 50, total - 50, total + 100, total // 2 + 1):
            w = _encode(tokenizer, text + sep + str(wrong))
            if (wrong >= 0 and w[:len(prompt)] == prompt and len(w) > len(prompt) and w[len(prompt)] != ans
                    and _spells(tokenizer, w[len(prompt)], wrong) and not is_byte_token(tokenizer, w[len(prompt)])):
                return prompt, ans, w[len(prompt)], (sep, len(prompt) - len(ids))
    shape = "" if like is None else f" in its clean prompt's form (separator {like[0]!r}, {like[1]} space tokens moved)"
    raise TaskTokenizationError(f"arithmetic: {text!r} + answer does not tokenize with the prompt as a prefix "
                                f"and a distinct first answer token (not a byte-fallback one){shape}")


def arithmetic_task(tokenizer: Any, pairs: Sequence[tuple[int, int]] | None = None, *,
                    template: str = "{op1} + {op2} =", n_prompts: int = 8, seed: int = 0) -> TaskBatch:
    """``op1 + op2 =`` prompts (Lorsa paper §6.2): correct = the answer's first token, incorrect = the
    first token of a wrong sum, each as the tokenizer encodes the prompt followed by the sum (a leading
    whitespace-only token, e.g. Llama-2's ``▁`` before its single digits, moves into the prompt; never a
    byte-fallback token). Corrupt prompts change ``op2`` and keep their clean prompt's form (the same separator
    before the sum and the same whitespace token moved, or the pair is refused). Default pairs: random two-digit
    operands (equal lengths). The App. D.4 "op2 = 3 → op2 = 5" style edits use these.

    Raises:
        ArgumentError: ``tokenizer`` not a tokenizer (None: a model loaded without one).
        TaskTokenizationError: a prompt cannot be tokenized as needed, holds the unknown token, or prompts (clean or
            corrupt) differ in length.
        ArgumentError: ``n_prompts`` not an int ``>= 1`` or ``seed`` not an int; ``template`` not a str holding
            ``{op1}`` and ``{op2}`` and no other field, ``pairs`` not a list of ``(op1, op2)`` pairs of ints.

    Source: Lorsa paper (He et al. 2025) §6.2, Fig. 7.
    """
    check_tokenizer(tokenizer, "arithmetic_task")
    _check_items(template, "template", "text", "arithmetic_task")
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as e:  # an unmatched brace
        raise ArgumentError(f"arithmetic_task: template {template!r} is no format string: {e}") from e
    if fields != {"op1", "op2"}:
        raise ArgumentError(f"arithmetic_task: template must hold {{op1}} and {{op2}} and no other field, got "
                            f"{template!r} (fields {sorted(fields)}): without them every prompt is the same text")
    if pairs is not None:
        _check_items(pairs, "pairs", "pair", "arithmetic_task")
    if pairs is None:
        _check_int(n_prompts, "n_prompts", 1)
    _check_int(seed, "seed")
    rng = random.Random(seed)
    pairs = list(pairs) if pairs is not None else [(rng.randrange(10, 100), rng.randrange(10, 100))
                                                   for _ in range(n_prompts)]
    bos = _bos(tokenizer)
    clean, corrupt, correct, incorrect, meta = [], [], [], [], []
    unlike: list[TaskTokenizationError] = []  # corrupt prompts only buildable in another form than their clean one
    for a, b in pairs:
        ids, ans, wrong, form = _arith_prompt(tokenizer, a, b, template)
        b2 = (b + 37) % 90 + 10 if b >= 10 else (b + 3) % 10
        try:
            ids_c = _arith_prompt(tokenizer, a, b2, template, like=form)[0]
        except TaskTokenizationError as e:  # refused below: by the lengths / unknown-token check first, else this
            ids_c = _arith_prompt(tokenizer, a, b2, template)[0]
            unlike.append(e)
        clean.append(bos + ids)
        corrupt.append(bos + ids_c)
        correct.append(ans)
        incorrect.append(wrong)
        meta.append({"op1": a, "op2": b, "corrupt_op2": b2})
    paired = _pair(tokenizer, clean, corrupt, "arithmetic")
    if unlike:
        raise unlike[0]
    return TaskBatch("arithmetic", *paired, _host_ids(correct), _host_ids(incorrect), meta)


@dataclass(repr=False)
class ArithmeticGrid(FieldsRepr):
    """The ``op1 + op2 =`` prompts of an operand grid, grouped by token length.

    Attributes:
        operands: the operand values (e.g. ``range(100)``), ``n`` of them.
        groups: ``(ids (m, pos), op1 (m,), op2 (m,))`` per prompt length; every ``(op1, op2)`` pair
            of the grid is in exactly one group.
    """

    operands: list[int]
    groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]

    def assemble(self, values: Sequence[torch.Tensor]) -> torch.Tensor:
        """Per-group values ``(m, …)`` (any device or dtype) → an fp32 CPU grid ``(n, n, …)`` indexed
        ``[op1, op2]`` (by operand rank)."""
        rank = {v: i for i, v in enumerate(self.operands)}
        first = values[0]
        grid = torch.full((len(self.operands), len(self.operands), *first.shape[1:]), float("nan"),
                          dtype=torch.float32, device="cpu")  # a host-side table, whatever the values' device
        for (_, a, b), v in zip(self.groups, values, strict=True):
            ia = torch.tensor([rank[int(x)] for x in a], device="cpu")
            ib = torch.tensor([rank[int(x)] for x in b], device="cpu")
            grid[ia, ib] = v.detach().to(device="cpu", dtype=torch.float32)
        return grid


def arithmetic_grid(tokenizer: Any, operands: Sequence[int] = range(100), *,
                    template: str = "{op1} + {op2} =") -> ArithmeticGrid:
    """All ``len(operands)²`` prompts of the operand plot (Lorsa paper Fig. 7), grouped by length so
    each group runs as one batch. Raises :class:`TaskTokenizationError` if a prompt cannot be tokenized (or holds
    the unknown token)."""
    bos = _bos(tokenizer)
    by_len: dict[int, list[tuple[list[int], int, int]]] = {}
    for a in operands:
        for b in operands:
            ids = bos + _encode(tokenizer, template.format(op1=a, op2=b))
            if len(ids) <= len(bos):
                raise TaskTokenizationError(f"empty prompt for {a}, {b}")
            _check_known(tokenizer, [ids], "arithmetic grid")
            by_len.setdefault(len(ids), []).append((ids, a, b))
    groups = [(_host_ids([r[0] for r in rows]), _host_ids([r[1] for r in rows]),
               _host_ids([r[2] for r in rows])) for _, rows in sorted(by_len.items())]
    return ArithmeticGrid(list(operands), groups)
