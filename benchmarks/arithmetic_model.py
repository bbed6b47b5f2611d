"""A tiny Llama that adds: word-level tokens for 0..198, trained on ``a + b = c`` (a, b in 0..99).

The model the seed-003 / Lorsa §6.2 arithmetic measurements need (the packaged tinyshakespeare
model cannot add). Built offline, saved with its tokenizer to a git-ignored cache directory so that
``nnsight.LanguageModel(dir)`` loads it; later scripts call :func:`load_or_train`.

    OMP_NUM_THREADS=1 python benchmarks/arithmetic_model.py [--retrain] [--steps 3000]

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

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from nnsight_lorsa.tinymodel import BOS_ID, BOS_TOKEN, EOS_ID, EOS_TOKEN, tiny_llama_config

CACHE = Path(__file__).resolve().parent.parent / ".cache" / "arithmetic-llama"
UNK_TOKEN = "<unk>"
MAX_OPERAND = 99
MAX_NUMBER = 2 * MAX_OPERAND  # 198
SEP = ";"
EQS_PER_ROW = 4  # equations per training row: 1 + 6 * 4 = 25 tokens


def vocabulary() -> dict[str, int]:
    """Word → id: specials 0..2, then ``+ = ;``, then the numbers 0..198."""
    words = [BOS_TOKEN, EOS_TOKEN, UNK_TOKEN, "+", "=", SEP] + [str(n) for n in range(MAX_NUMBER + 1)]
    return {w: i for i, w in enumerate(words)}


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The word-level tokenizer (BOS prepended when encoding with special tokens, as the tinymodel's)."""
    vocab = vocabulary()
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1", special_tokens=[(BOS_TOKEN, BOS_ID)])
    assert vocab[BOS_TOKEN] == BOS_ID and vocab[EOS_TOKEN] == EOS_ID
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN,
                                   pad_token=EOS_TOKEN, unk_token=UNK_TOKEN, padding_side="left",
                                   model_max_length=64)


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
    import transformers

    t0 = time.perf_counter()
    torch.manual_seed(seed)
    tok = build_tokenizer()
    config = tiny_llama_config(len(vocabulary()), hidden_size=d_model, intermediate_size=4 * d_model,
                               num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                               head_dim=d_model // heads, max_position_embeddings=64,
                               rope_original_max_position_embeddings=32)
    model = LlamaForCausalLM(config)
    train_pairs, held = split_pairs()
    tp = torch.tensor(train_pairs)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.98))
    gen = torch.Generator().manual_seed(seed)
    warm = 100
    curve = []
    losses: list[float] = []
    for step in range(steps):
        cos = 0.5 * (1 + math.cos(math.pi * (step - warm) / (steps - warm)))
        f = (step + 1) / warm if step < warm else 0.1 + 0.9 * cos
        for g in opt.param_groups:
            g["lr"] = lr * f
        model.train()
        x, mask = equation_rows(tp, batch_size, gen)
        logits = model(input_ids=x).logits[:, :-1]
        m = mask[:, 1:]
        loss = F.cross_entropy(logits[m], x[:, 1:][m])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if (step + 1) % 250 == 0 or step + 1 == steps:
            acc = accuracy(model, held)
            curve.append([step + 1, round(sum(losses[-50:]) / len(losses[-50:]), 4), round(acc, 4)])
            print(f"step {step + 1}: answer CE {curve[-1][1]:.4f}  held-out acc {acc:.4f}  "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    wall = time.perf_counter() - t0
    model.eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    info = {
        "command": command, "steps": steps, "batch_size": batch_size, "eqs_per_row": EQS_PER_ROW, "lr": lr,
        "layers": layers, "d_model": d_model, "heads": heads, "seed": seed,
        "n_params": sum(p.numel() for p in model.parameters()), "vocab_size": len(vocabulary()),
        "train_pairs": len(train_pairs), "heldout_pairs": len(held),
        "answer_ce_last50": round(sum(losses[-50:]) / 50, 4),
        "heldout_accuracy": accuracy(model, held), "train_accuracy": accuracy(model, train_pairs),
        "curve_step_ce_acc": curve, "wall_seconds": round(wall, 1), "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__, "transformers_version": transformers.__version__,
    }
    (out_dir / "training.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def load_or_train(out_dir: Path = CACHE, retrain: bool = False, **kw) -> Path:
    """The cached model directory, training it first if missing (or ``retrain``)."""
    if retrain or not (out_dir / "training.json").exists():
        train(out_dir, **kw)
    return out_dir


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--retrain", action="store_true")
    p.add_argument("--out", type=Path, default=CACHE)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    args = p.parse_args()
    torch.set_num_threads(1)
    cmd = "OMP_NUM_THREADS=1 python " + " ".join(sys.argv)
    if args.retrain or not (args.out / "training.json").exists():
        train(args.out, steps=args.steps, batch_size=args.batch_size, lr=args.lr, layers=args.layers,
              d_model=args.d_model, heads=args.heads, command=cmd)
    info = json.loads((args.out / "training.json").read_text())
    print(json.dumps({k: info[k] for k in ("steps", "n_params", "heldout_accuracy", "train_accuracy",
                                           "wall_seconds")}))


if __name__ == "__main__":
    main()
