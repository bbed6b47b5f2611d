"""A tiny Llama that does IOI and greater-than as ``ioi_task`` / ``greater_than_task`` build them.

The model the seed-003 circuit-size measurements need (the packaged tinyshakespeare model does
neither task). Built offline, saved with its tokenizer to a git-ignored cache directory so that
``nnsight.LanguageModel(dir)`` loads it; later scripts call :func:`load_or_train`.

    OMP_NUM_THREADS=1 python -m benchmarks.ioi_greater_than_model [--retrain] [--steps 2000]

Tokenizer: ``tokenizers`` WordLevel over GPT-2-style byte-level words — a split regex
(``" ?[A-Za-z]+"``, ``" ?\\d\\d"``, digits, punctuation) then byte-level mapping, so a word keeps its
leading space (``"ĠMary"``) and decodes back to ``" Mary"``. The vocabulary: ``<|bos|>`` (0),
``<|endoftext|>`` (1, EOS and pad), ``<unk>`` (2), every word of the three ``IOI_TEMPLATES`` and of
the greater-than template, the 20 ``NAMES`` (each one token, leading space), the ``NOUNS``, the
centuries ``" 11"``…``" 19"`` and the two-digit years ``"00"``…``"99"``; ``" 1363"`` is
``[" 13", "63"]``, which is what ``greater_than_task``'s two-digit form needs.

Training data (:func:`task_rows`): one prompt a row, ``[BOS] prompt answer`` right-padded, CE on the
answer token only; half IOI, half greater-than:

* IOI: a template of ``IOI_TEMPLATES`` with two names; the repeated name ``[S]`` is the first
  (``[B]``, as ``ioi_task`` builds it) or the second (``[A]``) name, each half the time, and the
  answer is the other name — so "the second name" is no shortcut, the model has to find the repeat.
  Pairs of two held-out names (:data:`HELD_NAMES`) never occur.
* greater-than: "The {noun} lasted from the year {C}{YY} to {C}" with ``noun`` of ``NOUNS``,
  ``C`` in 11…19, start ``YY`` in 2…97 (not ``13YY`` with ``YY`` in :data:`HELD_YEARS`: each year
  token is trained as a start year in the other centuries), answer half the time uniform over
  ``YY+1``…``99``, half over ``YY+1``…``YY+5``.

Held-out evaluation (:func:`heldout_tasks`): ``ioi_task(names=HELD_NAMES)`` for each template (both
names held out: pairs never trained on) and ``greater_than_task`` prompts (century 13) whose start
year is ``13YY`` with ``YY`` in :data:`HELD_YEARS`. IOI accuracy: argmax is the indirect object;
greater-than accuracy: argmax is a two-digit year > YY.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from benchmarks._synthetic import UNK_TOKEN, model_main, train_answer_lm, versions, wrap_tokenizer
from benchmarks._synthetic import load_or_train as cached_model
from nnsight_lorsa.assets import BOS_TOKEN, EOS_ID, EOS_TOKEN
from nnsight_lorsa.patching.tasks import IOI_TEMPLATES, NAMES, NOUNS, TaskBatch, greater_than_task, ioi_task

CACHE = Path(__file__).resolve().parent.parent / ".cache" / "ioi-greater-than-llama"
SPLIT = r" ?[A-Za-z]+| ?\d\d|\d|[^\sA-Za-z\d]+|\s+"
CENTURIES = tuple(range(11, 20))
GT_TEMPLATE = "The {noun} lasted from the year {century}{yy:02d} to {century}"
HELD_NAMES = (" Mary", " Tom", " Kate", " Henry", " Juliet", " Ben")  # no training prompt has two of them
HELD_CENTURY = 13  # greater_than_task's default
HELD_YEARS = tuple(sorted(random.Random(1234).sample(range(2, 98), 10)))  # never a start year in 13xx


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def vocabulary() -> dict[str, int]:
    """Word → id: specials 0..2, template words, names, nouns, centuries, then ``00``..``99``."""
    texts = [t.replace("[A]", "A").replace("[B]", "B").replace("[S]", "S") for t in IOI_TEMPLATES]
    texts += ["".join(NAMES), "".join(f" {n}" for n in NOUNS), GT_TEMPLATE.format(noun="war", century=13, yy=63)]
    texts += [f" {c}" for c in CENTURIES] + [f"{y:02d}" for y in range(100)]
    words = [BOS_TOKEN, EOS_TOKEN, UNK_TOKEN]
    pre = _pre_tokenizer()
    for text in texts:
        for w, _ in pre.pre_tokenize_str(text):
            if w not in words and w not in ("ĠA", "ĠB", "ĠS", "Ġ"):
                words.append(w)
    return {w: i for i, w in enumerate(words)}


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The byte-level word tokenizer (BOS prepended when encoding with special tokens)."""
    vocab = vocabulary()
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    tok.pre_tokenizer = _pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    return wrap_tokenizer(tok, vocab)


def ioi_example(rng: random.Random) -> tuple[str, str]:
    """(prompt, answer name with its leading space): a random template, names not both held out,
    the repeated name first or second."""
    while True:
        b, a = rng.sample(NAMES, 2)
        if not (a in HELD_NAMES and b in HELD_NAMES):
            break
    s, io = (b, a) if rng.random() < 0.5 else (a, b)
    text = rng.choice(IOI_TEMPLATES).replace("[A]", a.strip()).replace("[B]", b.strip()).replace("[S]", s.strip())
    return text, io


def gt_example(rng: random.Random) -> tuple[str, str]:
    """(prompt, answer ``"YY'"`` with ``YY' > YY``): half the time uniform over ``YY+1``…``99``, half
    over the next five years; no start year ``{HELD_CENTURY}{YY}`` with ``YY`` in :data:`HELD_YEARS`."""
    while True:
        century, yy = rng.choice(CENTURIES), rng.randrange(2, 98)
        if not (century == HELD_CENTURY and yy in HELD_YEARS):
            break
    text = GT_TEMPLATE.format(noun=rng.choice(NOUNS), century=century, yy=yy)
    end = rng.randrange(yy + 1, 100) if rng.random() < 0.5 else rng.randrange(yy + 1, min(yy + 6, 100))
    return text, f"{end:02d}"


def task_rows(tok: PreTrainedTokenizerFast, n_rows: int, rng: random.Random,
              ioi_frac: float = 0.5) -> tuple[torch.Tensor, torch.Tensor, list[tuple[str, str]]]:
    """``n_rows`` training rows ``[BOS] prompt answer`` right-padded with EOS.

    Returns:
        ``(ids (n, T), answer_mask (n, T), [(prompt, answer)…])``; the mask is True on each row's answer token.
    """
    examples = [ioi_example(rng) if rng.random() < ioi_frac else gt_example(rng) for _ in range(n_rows)]
    enc = [tok(p)["input_ids"] + tok(a, add_special_tokens=False)["input_ids"] for p, a in examples]
    width = max(len(e) for e in enc)
    ids = torch.full((n_rows, width), EOS_ID, dtype=torch.long)
    mask = torch.zeros(n_rows, width, dtype=torch.bool)
    for i, e in enumerate(enc):
        ids[i, :len(e)] = torch.tensor(e)
        mask[i, len(e) - 1] = True
    return ids, mask, examples


def start_year(text: str) -> int:
    """The two-digit start year of a greater-than prompt ("… the year 1363 to 13" → 63)."""
    m = re.search(r"year \d\d(\d\d) to", text)
    assert m is not None, text
    return int(m.group(1))


def heldout_tasks(tok: PreTrainedTokenizerFast, n_ioi: int = 64, n_gt: int = 64,
                  seed: int = 0) -> dict[str, list[TaskBatch]]:
    """Held-out task batches built by the library builders: ``{"ioi": [one per template],
    "greater_than": [one per noun]}`` (IOI: both names of :data:`HELD_NAMES`; greater-than: start
    year in :data:`HELD_YEARS`, century 13, about ``n_gt`` prompts each)."""
    ioi = [ioi_task(tok, n_ioi, template=t, names=HELD_NAMES, seed=seed + i) for i, t in enumerate(IOI_TEMPLATES)]
    gt = []
    for i, noun in enumerate(NOUNS):
        full = greater_than_task(tok, 12 * n_gt, seed=seed + i, noun=noun)
        rows = [j for j, m in enumerate(full.meta) if start_year(m["text"]) in HELD_YEARS]
        gt.append(full.select(rows[:n_gt]))
    return {"ioi": ioi, "greater_than": gt}


def year_values(tok: PreTrainedTokenizerFast) -> torch.Tensor:
    """``(vocab,)`` the two-digit value of each token (−1 for non-years)."""
    vals = torch.full((len(tok),), -1, dtype=torch.long)
    for y in range(100):
        vals[tok.convert_tokens_to_ids(f"{y:02d}")] = y
    return vals


def task_accuracy(task: TaskBatch, logits: torch.Tensor, tok: PreTrainedTokenizerFast) -> float:
    """IOI: argmax = the indirect object; greater-than: argmax is a year > the start year."""
    pred = logits[:, -1].argmax(-1)
    if task.name == "ioi":
        return float((pred == task.correct_ids).float().mean())
    yy = torch.tensor([start_year(m["text"]) for m in task.meta])
    return float((year_values(tok)[pred] > yy).float().mean())


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, tasks: dict[str, list[TaskBatch]], tok: PreTrainedTokenizerFast) -> dict:
    """Held-out accuracy and mean logit difference (correct − incorrect) per task (plain forward)."""
    model.eval()
    out = {}
    for name, batches in tasks.items():
        acc, ld, n = 0.0, 0.0, 0
        for t in batches:
            lg = model(input_ids=t.clean).logits
            acc += task_accuracy(t, lg, tok) * len(t)
            ld += float((lg[:, -1].gather(1, t.correct_ids[:, None]) - lg[:, -1].gather(1, t.incorrect_ids[:, None]))
                        .sum())
            n += len(t)
        out[f"{name} acc"] = acc / n
        out[f"{name} LD"] = ld / n
    return out


def train(out_dir: Path = CACHE, *, steps: int = 2000, batch_size: int = 128, lr: float = 3e-3, layers: int = 2,
          d_model: int = 128, heads: int = 4, seed: int = 0, command: str = "") -> dict:
    """Train the model and save model + tokenizer + ``training.json`` to ``out_dir``."""
    tok = build_tokenizer()
    rng = random.Random(seed)
    held = heldout_tasks(tok)
    _, info = train_answer_lm(out_dir, tok, len(vocabulary()), lambda gen: task_rows(tok, batch_size, rng)[:2],
                              lambda m: evaluate(m, held, tok), steps=steps, lr=lr, layers=layers,
                              d_model=d_model, heads=heads, seed=seed)
    model = LlamaForCausalLM.from_pretrained(out_dir)
    info = {"command": command, "steps": steps, "batch_size": batch_size, "lr": lr, "layers": layers,
            "d_model": d_model, "heads": heads, "seed": seed, "vocab_size": len(vocabulary()),
            "held_names": list(HELD_NAMES), "held_years": list(HELD_YEARS), **info,
            "heldout": evaluate(model, held, tok), **versions()}
    (out_dir / "training.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def load_or_train(out_dir: Path = CACHE, retrain: bool = False, **kw) -> Path:
    """The cached model directory, training it first if missing (or ``retrain``)."""
    return cached_model(out_dir, train, retrain, **kw)


def main() -> None:
    model_main(__doc__ or "", CACHE, train, 2000, ("steps", "n_params", "heldout", "wall_seconds"))


if __name__ == "__main__":
    main()
