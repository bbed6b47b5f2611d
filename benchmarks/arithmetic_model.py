"""A tiny Llama that adds: word-level tokens for 0..198, trained on ``a + b = c`` (a, b in 0..99).

The model the seed-003 / Lorsa §6.2 arithmetic measurements need (the packaged tinyshakespeare
model cannot add). Built offline, saved with its tokenizer to a git-ignored cache directory so that
``nnsight.LanguageModel(dir)`` loads it; later scripts call :func:`load_or_train`.

    OMP_NUM_THREADS=1 python -m benchmarks.arithmetic_model [--retrain] [--steps 3000]

Tokenizer: ``tokenizers`` WordLevel over whitespace-split words — ``<|bos|>`` (0), ``<|endoftext|>``
(1, EOS and pad), ``<unk>`` (2), ``+``, ``=``, ``;`` and every integer ``0``..``198`` as one token.
``"12 + 34 ="`` encodes to ``[12, +, 34, =]`` and ``"12 + 34 = 46"`` appends exactly the answer
token, which is what ``nnsight_lorsa.patching.tasks._arith_prompt`` needs. Decoding joins words
with spaces.

Training data: rows ``[BOS] a + b = c ; a' + b' = c' ; …`` (:func:`equation_rows`); the loss is the
next-token CE on the answer tokens only (the operands are random, nothing to learn there). A fixed
set of held-out pairs (:func:`split_pairs`, 10 % of the 100 × 100 grid) never appears in training;
accuracy is exact match of the argmax answer after ``[BOS] a + b =``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from benchmarks._synthetic import UNK_TOKEN, model_main, train_answer_lm, versions, wrap_tokenizer
from benchmarks._synthetic import load_or_train as cached_model
from nnsight_lorsa.assets import BOS_ID, BOS_TOKEN, EOS_TOKEN

CACHE = Path(__file__).resolve().parent.parent / ".cache" / "arithmetic-llama"
MAX_OPERAND = 99
MAX_NUMBER = 2 * MAX_OPERAND  # 198
SEP = ";"
EQS_PER_ROW = 4  # equations per training row: 1 + 6 * 4 = 25 tokens


def vocabulary() -> dict[str, int]:
    """Word → id: specials 0..2, then ``+ = ;``, then the numbers 0..198."""
    words = [BOS_TOKEN, EOS_TOKEN, UNK_TOKEN, "+", "=", SEP] + [str(n) for n in range(MAX_NUMBER + 1)]
    return {w: i for i, w in enumerate(words)}


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The word-level tokenizer (BOS prepended when encoding with special tokens, as the embedded model's)."""
    vocab = vocabulary()
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return wrap_tokenizer(tok, vocab)


def number_id(n: int) -> int:
    """Token id of the integer ``n`` (0..198)."""
    return vocabulary()[str(n)]


def split_pairs(heldout_fraction: float = 0.1, seed: int = 1234) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(train, held-out) operand pairs of the 100 × 100 grid; deterministic."""
    pairs = [(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]
    random.Random(seed).shuffle(pairs)
    n = int(len(pairs) * heldout_fraction)
    return pairs[n:], pairs[:n]


def equation_rows(pairs: torch.Tensor, n_rows: int, gen: torch.Generator,
                  eqs_per_row: int = EQS_PER_ROW) -> tuple[torch.Tensor, torch.Tensor]:
    """Random training rows from ``pairs`` ``(P, 2)``.

    Returns:
        ``(ids (n_rows, 1 + 6·eqs_per_row), answer_mask)``; row ``[BOS] a + b = a+b ; …`` with a
        trailing ``;``; ``answer_mask[r, t]`` is True where token ``t`` is an answer (``a+b``).
    """
    v = vocabulary()
    idx = torch.randint(0, len(pairs), (n_rows, eqs_per_row), generator=gen)
    ab = pairs[idx]  # (n, e, 2)
    a, b = ab[..., 0], ab[..., 1]
    num0 = v["0"]
    eq = torch.stack([a + num0, torch.full_like(a, v["+"]), b + num0, torch.full_like(a, v["="]),
                      a + b + num0, torch.full_like(a, v[SEP])], dim=-1)  # (n, e, 6)
    ids = torch.cat([torch.full((n_rows, 1), BOS_ID, dtype=torch.long), eq.reshape(n_rows, -1)], dim=1)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, 5::6] = True
    return ids, mask


@torch.no_grad()
def accuracy(model: LlamaForCausalLM, pairs: list[tuple[int, int]], batch_size: int = 1000) -> float:
    """Exact-match accuracy of the argmax next token after ``[BOS] a + b =``."""
    v = vocabulary()
    model.eval()
    right = 0
    for s in range(0, len(pairs), batch_size):
        chunk = torch.tensor(pairs[s:s + batch_size])
        a, b = chunk[:, 0], chunk[:, 1]
        x = torch.stack([torch.full_like(a, BOS_ID), a + v["0"], torch.full_like(a, v["+"]), b + v["0"],
                         torch.full_like(a, v["="])], 1)
        pred = model(input_ids=x).logits[:, -1].argmax(-1)
        right += int((pred == a + b + v["0"]).sum())
    return right / len(pairs)


def train(out_dir: Path = CACHE, *, steps: int = 3000, batch_size: int = 128, lr: float = 3e-3,
          layers: int = 2, d_model: int = 128, heads: int = 4, seed: int = 0, command: str = "") -> dict:
    """Train the adder and save model + tokenizer + ``training.json`` to ``out_dir``."""
    tok = build_tokenizer()
    train_pairs, held = split_pairs()
    tp = torch.tensor(train_pairs)
    model, tr = train_answer_lm(out_dir, tok, len(vocabulary()), lambda gen: equation_rows(tp, batch_size, gen),
                                lambda m: {"held-out acc": accuracy(m, held)}, steps=steps, lr=lr, layers=layers,
                                d_model=d_model, heads=heads, seed=seed)
    info = {
        "command": command, "steps": steps, "batch_size": batch_size, "eqs_per_row": EQS_PER_ROW, "lr": lr,
        "layers": layers, "d_model": d_model, "heads": heads, "seed": seed,
        "n_params": tr["n_params"], "vocab_size": len(vocabulary()),
        "train_pairs": len(train_pairs), "heldout_pairs": len(held), "answer_ce_last50": tr["answer_ce_last50"],
        "heldout_accuracy": accuracy(model, held), "train_accuracy": accuracy(model, train_pairs),
        "curve_step_ce_acc": tr["curve"], "wall_seconds": tr["wall_seconds"], **versions(),
    }
    (out_dir / "training.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def load_or_train(out_dir: Path = CACHE, retrain: bool = False, **kw) -> Path:
    """The cached model directory, training it first if missing (or ``retrain``)."""
    return cached_model(out_dir, train, retrain, **kw)


def main() -> None:
    model_main(__doc__ or "", CACHE, train, 3000,
               ("steps", "n_params", "heldout_accuracy", "train_accuracy", "wall_seconds"))


if __name__ == "__main__":
    main()
