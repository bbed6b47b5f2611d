"""Build the embedded default model: a tiny Llama-architecture LM trained on tinyshakespeare.

The package ships a small (~1.3M parameter) ``LlamaForCausalLM`` plus its byte-level BPE tokenizer under
``nnsight_lorsa/assets/tinyshakespeare-llama`` so that demos and tests run offline (the package locates it
with ``nnsight_lorsa.assets``; ``nnsight_lorsa.envoy.load_model()`` loads it). This script, which is not part
of the installed package, holds everything needed to rebuild that asset from the packaged corpus::

    python scripts/tinymodel.py --steps 1000 --seq-len 256 --batch-size 16 --threads 2 \
        --out nnsight_lorsa/assets/tinyshakespeare-llama

(the measured numbers of the shipped asset are in its ``training.json``, whose ``command`` records the same
run under this script's former name, ``python -m nnsight_lorsa.tinymodel``).

The architecture mirrors Llama-3 at toy scale: RMSNorm, SwiGLU MLP, grouped-query attention (4 query
heads sharing 2 key/value heads) and ``llama3``-type rotary position embedding frequency scaling.

Induction (in-context copying) is built in deliberately. Plain next-token training on this ~0.4M-token
corpus, within a CPU budget of minutes, gives a model with no measurable copying ability, even when half
the training windows contain an exact repeat. So training has two phases: (1) a short "induction
warm-up" on repeated random-token segments at random offsets and lengths, until content-based copying
is learned; (2) corpus training in which a share of the windows repeat a natural-text segment, which
keeps (and adapts) the copying circuit on in-distribution text. Validation CE is always measured on
plain held-out text.

Data format used for training and evaluation: every sequence is ``[<|bos|>] + window`` where ``window``
is ``seq_len - 1`` consecutive corpus tokens, so the model always sees BOS at position 0, exactly as it
does when text is encoded by the packaged tokenizer (whose post-processor prepends BOS).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from tqdm.auto import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from nnsight_lorsa.assets import BOS_ID, BOS_TOKEN, EOS_ID, EOS_TOKEN, default_corpus_path, default_model_dir

__all__ = [
    "train_tokenizer",
    "tiny_llama_config",
    "corpus_cross_entropy",
    "train_tiny_llama",
    "main",
]


def train_tokenizer(text: str, vocab_size: int = 1024) -> Tokenizer:
    """Train a byte-level BPE tokenizer on ``text``.

    Args:
        text: training text (any Unicode; byte-level BPE never produces unknown tokens).
        vocab_size: total vocabulary size including the 256 byte symbols and the 2 special tokens.
            Must be at least 258.

    Returns:
        A ``tokenizers.Tokenizer`` with ``<|bos|>`` at id 0 and ``<|endoftext|>`` (used as EOS and
        padding) at id 1. Its post-processor prepends BOS when encoding with special tokens (the
        default), so ``tok.encode("hello").ids[0] == 0``; decoding reproduces the input text exactly.

    Raises:
        ValueError: if ``vocab_size < 258`` or ``text`` is empty.
    """
    if vocab_size < 258:
        raise ValueError(f"vocab_size must be >= 258 (256 bytes + 2 special tokens), got {vocab_size}")
    if not text:
        raise ValueError("cannot train a tokenizer on empty text")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS_TOKEN, EOS_TOKEN],  # ids 0 and 1, in this order
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Feed the text in line batches: one huge string works too but gives no parallelism.
    lines = text.splitlines(keepends=True)
    chunk = 1000
    tok.train_from_iterator(("".join(lines[i : i + chunk]) for i in range(0, len(lines), chunk)), trainer)
    assert tok.token_to_id(BOS_TOKEN) == BOS_ID and tok.token_to_id(EOS_TOKEN) == EOS_ID
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, BOS_ID)],
    )
    return tok


def tiny_llama_config(
    vocab_size: int,
    *,
    hidden_size: int = 128,
    intermediate_size: int = 512,
    num_hidden_layers: int = 4,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 32,
    max_position_embeddings: int = 512,
    rope_theta: float = 10000.0,
    rope_original_max_position_embeddings: int = 64,
) -> LlamaConfig:
    """Config of the tiny Llama-3-style model (defaults: ~1.3M parameters with ``vocab_size=1024``).

    Grouped-query attention (``num_key_value_heads < num_attention_heads``), untied embeddings,
    ``rms_norm_eps=1e-5``, BOS id 0 and EOS/pad id 1 (see :func:`train_tokenizer`), and Llama-3.1 rotary
    scaling: ``rope_type="llama3"`` with factor 8, low/high frequency factors 1/4 and
    ``original_max_position_embeddings=rope_original_max_position_embeddings`` (in positions; must be
    smaller than ``max_position_embeddings``).

    Note (transformers 5): RoPE settings live only in ``config.rope_parameters`` (``rope_theta`` included;
    there is no top-level ``config.rope_theta`` attribute and ``config.rope_scaling`` is a deprecated alias).
    A missing ``original_max_position_embeddings`` would silently default to ``max_position_embeddings``,
    so it is always set explicitly here.

    Raises:
        ValueError: if the head/hidden sizes are inconsistent or the rope lengths are out of order.
    """
    if num_attention_heads % num_key_value_heads != 0:
        raise ValueError(f"{num_attention_heads=} must be a multiple of {num_key_value_heads=}")
    if not 0 < rope_original_max_position_embeddings < max_position_embeddings:
        raise ValueError(
            f"need 0 < rope_original_max_position_embeddings ({rope_original_max_position_embeddings}) "
            f"< max_position_embeddings ({max_position_embeddings})"
        )
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        hidden_act="silu",
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=EOS_ID,
        # A fresh dict each call: transformers standardises (mutates) this dict in place.
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": float(rope_theta),
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": int(rope_original_max_position_embeddings),
        },
    )


def _windows_with_bos(ids: torch.Tensor, starts: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[len(starts), seq_len]`` int64 batch: BOS then ``ids[s : s + seq_len - 1]`` for each start."""
    offsets = torch.arange(seq_len - 1)
    body = ids[starts[:, None] + offsets[None, :]]
    bos = torch.full((len(starts), 1), BOS_ID, dtype=ids.dtype)
    return torch.cat([bos, body], dim=1)


def _repeat_augment(x: torch.Tensor, fraction: float, gen: torch.Generator) -> torch.Tensor:
    """Turn a random ``fraction`` of the rows of a ``[batch, seq]`` BOS-first batch into repeats, in place.

    A chosen row ``[BOS] + w`` becomes ``[BOS] + w[:k] + w[:k] + w[k : len(w) - k]`` with ``k`` uniform in
    ``[min(8, len(w) // 2), len(w) // 2]``: a natural-text segment, its exact repetition, then its natural
    continuation. Predicting the second copy rewards in-context copying (induction heads), which plain
    next-token training on a corpus this small does not produce within a CPU-sized budget.
    """
    n = x.shape[1] - 1
    k_max = n // 2
    if fraction <= 0.0 or k_max < 1:
        return x
    k_min = max(1, min(8, k_max))
    rows = (torch.rand(x.shape[0], generator=gen) < fraction).nonzero().flatten().tolist()
    for r in rows:
        k = int(torch.randint(k_min, k_max + 1, (1,), generator=gen))
        w = x[r, 1:].clone()
        x[r, 1:] = torch.cat([w[:k], w[:k], w[k : n - k]])
    return x


@torch.no_grad()

def readable_by_transformers_4(model_dir: Path) -> None:
    """Make a transformers-5 model directory load identically on transformers 4.56+ as well.

    transformers 5 writes RoPE only as ``rope_parameters`` and names the tokenizer class
    ``TokenizersBackend``; transformers 4 reads ``rope_theta`` + ``rope_scaling`` (it would silently run
    unscaled RoPE) and knows ``PreTrainedTokenizerFast`` (the same fast tokenizer; transformers 5 maps that
    name to ``TokenizersBackend``), whose default ``model_input_names`` add ``token_type_ids``, which a
    causal LM's ``generate`` rejects; transformers 5 defaults to ``input_ids`` + ``attention_mask``. Adds
    the transformers-4 keys next to the transformers-5 ones.
    """
    cfg_path = model_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    params = cfg.get("rope_parameters") or {}
    if params:
        cfg["rope_theta"] = params["rope_theta"]
        cfg["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tok_path = model_dir / "tokenizer_config.json"
    tok = json.loads(tok_path.read_text())
    if tok.get("tokenizer_class") == "TokenizersBackend":
        tok["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok.setdefault("model_input_names", ["input_ids", "attention_mask"])
    tok_path.write_text(json.dumps(tok, indent=2) + "\n")

def corpus_cross_entropy(
    model: PreTrainedModel,
    token_ids: torch.Tensor | list[int],
    seq_len: int = 128,
    batch_size: int = 16,
) -> float:
    """Mean next-token cross-entropy of ``model`` on a token stream, in nats per predicted token.

    The stream (1-D, corpus tokens without BOS) is cut into consecutive non-overlapping windows of
    ``seq_len - 1`` tokens; each is evaluated as ``[BOS] + window`` so every window token is predicted
    exactly once (the first from BOS alone). A shorter final window is evaluated too.

    Args:
        model: a causal LM returning ``.logits`` of shape ``[batch, seq, vocab]``.
        token_ids: 1-D sequence of token ids (no BOS), length >= 1.
        seq_len: positions per evaluated sequence including BOS (>= 2).
        batch_size: windows per forward pass.

    Raises:
        ValueError: if ``token_ids`` is empty or ``seq_len < 2``.
    """
    ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
    if ids.numel() == 0:
        raise ValueError("token_ids is empty")
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    body = seq_len - 1
    n_full = ids.numel() // body
    total_nll, total_n = 0.0, 0
    batches: list[torch.Tensor] = []
    if n_full:
        starts = torch.arange(n_full) * body
        batches += list(_windows_with_bos(ids, starts, seq_len).split(batch_size))
    if ids.numel() % body:
        tail = ids[n_full * body :]
        batches.append(torch.cat([torch.tensor([BOS_ID]), tail])[None])
    for x in batches:
        x = x.to(device)
        logits = model(input_ids=x).logits[:, :-1].float()
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum")
        total_nll += nll.item()
        total_n += x[:, 1:].numel()
    model.train(was_training)
    return total_nll / total_n


def lm_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> float:
    """One next-token step on ``x (batch, seq)``: CE, backward, gradient clipping at 1, ``opt.step()``; the loss."""
    logits = model(input_ids=x).logits[:, :-1]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return float(loss.item())


def _lr_at(step: int, steps: int, lr: float, warmup: int, min_ratio: float = 0.1) -> float:
    """Linear warmup for ``warmup`` steps, then cosine decay from ``lr`` to ``min_ratio * lr``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def _induction_warmup(
    model: PreTrainedModel,
    max_steps: int,
    gen: torch.Generator,
    *,
    batch_size: int = 32,
    row_len: int = 96,
    min_copy: int = 8,
    max_copy: int = 40,
    lr: float = 1e-3,
    target_ce: float = 0.5,
    progress: bool = True,
) -> tuple[int, float]:
    """Seed an induction circuit by training on repeated random-token segments.

    Each row is ``[BOS] + noise + s + s + noise`` (``row_len`` tokens, all uniform random ids >= 2) with
    ``len(s)`` uniform in ``[min_copy, max_copy]`` and a random start, so neither the absolute position nor
    the distance of the copy is fixed: only content-based in-context copying (a previous-token head
    feeding an induction head) predicts the second copy. The loss is the CE on the second copy, excluding
    its unpredictable first token. Such heads form within a few hundred steps here, whereas training
    on tinyshakespeare alone does not produce them within a CPU-sized budget. Stops early once that CE
    (nats/token, batch mean) falls below ``target_ce``. Uses its own AdamW optimizer (constant ``lr``,
    weight decay 0.1 on matrices, grad-norm clip 1.0).

    Returns:
        ``(steps_done, second_copy_ce)``; ``(0, nan)`` if ``max_steps == 0``.
    """
    if max_steps <= 0:
        return 0, float("nan")
    if not 2 <= min_copy <= max_copy or 1 + 2 * max_copy > row_len:
        raise ValueError(f"need 2 <= {min_copy=} <= {max_copy=} and 1 + 2 * max_copy <= {row_len=}")
    vocab = model.config.vocab_size
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
    )
    model.train()
    second_ce, done = float("nan"), 0
    bar = tqdm(range(max_steps), desc="induction warm-up", disable=not progress, dynamic_ncols=True)
    for _ in bar:
        x = torch.randint(2, vocab, (batch_size, row_len), generator=gen)
        x[:, 0] = BOS_ID
        mask = torch.zeros(batch_size, row_len, dtype=torch.bool)  # target positions to score
        lengths = torch.randint(min_copy, max_copy + 1, (batch_size,), generator=gen).tolist()
        for r, n in enumerate(lengths):
            a = 1 + int(torch.randint(0, row_len - 2 * n, (1,), generator=gen))
            x[r, a + n : a + 2 * n] = x[r, a : a + n]
            mask[r, a + n + 1 : a + 2 * n] = True
        logits = model(input_ids=x).logits[:, :-1]
        nll = F.cross_entropy(logits.reshape(-1, vocab), x[:, 1:].reshape(-1), reduction="none")
        loss = nll[mask[:, 1:].reshape(-1)].mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        done += 1
        second_ce = loss.item()
        bar.set_postfix(second_copy_ce=f"{second_ce:.3f}")
        if second_ce < target_ce:
            break
    bar.close()
    return done, second_ce


def train_tiny_llama(
    corpus_path: str | Path,
    out_dir: str | Path,
    *,
    steps: int,
    seq_len: int = 128,
    batch_size: int = 32,
    lr: float = 3e-3,
    seed: int = 0,
    val_fraction: float = 0.05,
    vocab_size: int = 1024,
    warmup_steps: int | None = None,
    weight_decay: float = 0.1,
    repeat_fraction: float = 0.5,
    induction_warmup_steps: int = 1500,
    eval_batches: int | None = None,
    eval_every: int | None = None,
    progress: bool = True,
    command: str | None = None,
) -> dict:
    """Train the tiny Llama from scratch on a text file and save it as a Hugging Face model directory.

    The first ``1 - val_fraction`` of the characters is the training split (the tokenizer is trained on
    it too); the rest is held out. After the induction warm-up (see ``induction_warmup_steps``), each
    step draws ``batch_size`` random windows from the training token
    stream, each evaluated as ``[BOS] + (seq_len - 1) tokens``, and takes an AdamW step (betas 0.9/0.95,
    decoupled weight decay on matrices only, grad-norm clip 1.0) under linear-warmup + cosine schedule
    (down to 10% of ``lr``). The seed fixes initialisation and window sampling.

    Writes to ``out_dir`` (created if needed): ``config.json`` + ``model.safetensors`` (fp32), the
    tokenizer as a ``PreTrainedTokenizerFast`` (``tokenizer.json``, ``tokenizer_config.json``; BOS
    ``<|bos|>``, EOS/pad ``<|endoftext|>``, left padding) and ``training.json`` with the measured numbers.

    Args:
        corpus_path: UTF-8 text file.
        out_dir: output directory (existing files with the same names are overwritten).
        steps: optimizer steps (>= 1).
        seq_len: positions per training sequence including BOS (2 ..= 512).
        batch_size: sequences per step; corpus tokens seen = ``steps * batch_size * seq_len``.
        lr: peak learning rate.
        seed: ``torch.manual_seed`` value.
        val_fraction: held-out fraction of the corpus characters (0 < f < 1).
        vocab_size: BPE vocabulary size.
        warmup_steps: defaults to ``max(1, min(100, steps // 10))``.
        weight_decay: AdamW weight decay for 2-D weights.
        induction_warmup_steps: at most this many steps of :func:`_induction_warmup` (random-token
            repeats, batch 32 x 96 tokens) before the corpus training, stopping early once the copy is
            learned; 0 disables. Without it the model does not learn in-context copying at this budget.
        repeat_fraction: fraction of training sequences in which a natural-text segment is immediately
            repeated (see ``_repeat_augment``) so that the model learns induction-style copying; 0 disables.
            Validation always uses plain, unmodified text.
        eval_batches: cap on validation windows (``None``: the whole held-out split).
        eval_every: also measure the validation CE every this many steps (recorded as ``val_curve``);
            ``None`` measures it only at the end.
        progress: show a tqdm progress bar.
        command: how the run was launched, recorded in ``training.json`` (default: a Python call string).

    Returns:
        The ``training.json`` dict: ``steps``, ``tokens_seen`` (corpus plus warm-up tokens; also
        ``corpus_tokens_seen`` and ``induction_warmup_tokens`` separately), ``train_loss`` (mean CE over the last
        ``min(50, steps)`` steps, nats/token), ``val_ce`` (nats/token on the held-out split), ``val_tokens``,
        ``uniform_ce`` (= ln vocab), ``wall_seconds`` (training and evaluation, excluding saving),
        ``n_params``, hyper-parameters, versions and ``command``.

    Raises:
        ValueError: on invalid arguments or a corpus too small for ``seq_len``.
    """
    import transformers

    t0 = time.perf_counter()
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if not 0.0 <= repeat_fraction <= 1.0:
        raise ValueError(f"repeat_fraction must be in [0, 1], got {repeat_fraction}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    max_pos = 512
    if not 2 <= seq_len <= max_pos:
        raise ValueError(f"seq_len must be in [2, {max_pos}], got {seq_len}")
    corpus_path, out_dir = Path(corpus_path), Path(out_dir)
    if command is None:
        command = (
            f"train_tiny_llama({str(corpus_path)!r}, {str(out_dir)!r}, steps={steps}, seq_len={seq_len}, "
            f"batch_size={batch_size}, lr={lr}, seed={seed}, val_fraction={val_fraction}, "
            f"vocab_size={vocab_size}, repeat_fraction={repeat_fraction}, "
            f"induction_warmup_steps={induction_warmup_steps})"
        )

    torch.manual_seed(seed)
    text = corpus_path.read_text(encoding="utf-8")
    split = int(len(text) * (1.0 - val_fraction))
    train_text, val_text = text[:split], text[split:]
    if not train_text or not val_text:
        raise ValueError(f"corpus of {len(text)} characters is too small to split with {val_fraction=}")

    raw_tok = train_tokenizer(train_text, vocab_size=vocab_size)
    train_ids = torch.tensor(raw_tok.encode(train_text, add_special_tokens=False).ids, dtype=torch.long)
    val_ids = torch.tensor(raw_tok.encode(val_text, add_special_tokens=False).ids, dtype=torch.long)
    if train_ids.numel() < seq_len:
        raise ValueError(f"training split has {train_ids.numel()} tokens, fewer than {seq_len=}")

    config = tiny_llama_config(raw_tok.get_vocab_size(), max_position_embeddings=max_pos)
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
    )
    warmup = warmup_steps if warmup_steps is not None else max(1, min(100, steps // 10))

    gen = torch.Generator().manual_seed(seed)
    warm_steps, warm_ce = _induction_warmup(model, induction_warmup_steps, gen, progress=progress)
    n_starts = train_ids.numel() - (seq_len - 1) + 1
    eval_ids = val_ids
    if eval_batches is not None:
        eval_ids = val_ids[: max(1, eval_batches) * (seq_len - 1)]
    losses: list[float] = []
    val_curve: list[tuple[int, float]] = []
    model.train()
    bar = tqdm(range(steps), desc="train tiny llama", disable=not progress, dynamic_ncols=True)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, steps, lr, warmup)
        starts = torch.randint(0, n_starts, (batch_size,), generator=gen)
        x = _repeat_augment(_windows_with_bos(train_ids, starts, seq_len), repeat_fraction, gen)
        losses.append(lm_step(model, opt, x))
        if eval_every and (step + 1) % eval_every == 0 and step + 1 < steps:
            val_curve.append((step + 1, corpus_cross_entropy(model, eval_ids, seq_len=seq_len)))
            bar.write(f"step {step + 1}: val CE {val_curve[-1][1]:.4f} nats/token")
        if step % 10 == 0 or step == steps - 1:
            bar.set_postfix(loss=f"{losses[-1]:.3f}", lr=f"{opt.param_groups[0]['lr']:.2e}")
    bar.close()

    val_ce = corpus_cross_entropy(model, eval_ids, seq_len=seq_len)
    val_curve.append((steps, val_ce))
    wall = time.perf_counter() - t0

    out_dir.mkdir(parents=True, exist_ok=True)
    model.eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    for f in out_dir.glob("*.safetensors"):
        f.chmod(0o644)  # safetensors writes 0600; package data must be world-readable
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=raw_tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        padding_side="left",
        model_max_length=max_pos,
    )
    hf_tok.save_pretrained(out_dir)
    readable_by_transformers_4(out_dir)

    tail = losses[-min(50, len(losses)) :]
    info = {
        "command": command,
        "corpus": corpus_path.name,
        "corpus_chars": len(text),
        "train_chars": len(train_text),
        "val_chars": len(val_text),
        "train_tokens": int(train_ids.numel()),
        "val_tokens": int(eval_ids.numel()),
        "vocab_size": raw_tok.get_vocab_size(),
        "n_params": n_params,
        "steps": steps,
        "seq_len": seq_len,
        "batch_size": batch_size,
        "tokens_seen": steps * batch_size * seq_len + warm_steps * 32 * 96,
        "corpus_tokens_seen": steps * batch_size * seq_len,
        "induction_warmup_steps": warm_steps,
        "induction_warmup_tokens": warm_steps * 32 * 96,
        "induction_warmup_second_copy_ce": warm_ce,
        "lr": lr,
        "warmup_steps": warmup,
        "weight_decay": weight_decay,
        "repeat_fraction": repeat_fraction,
        "seed": seed,
        "val_fraction": val_fraction,
        "train_loss": sum(tail) / len(tail),
        "train_loss_last_n_steps": len(tail),
        "val_ce": val_ce,
        "val_curve": [[s_, round(v, 4)] for s_, v in val_curve],
        "uniform_ce": math.log(raw_tok.get_vocab_size()),
        "loss_units": "nats/token",
        "wall_seconds": wall,
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
    }
    (out_dir / "training.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    return info


def main(argv: list[str] | None = None) -> dict:
    """CLI: ``python scripts/tinymodel.py --steps N --out DIR`` (rebuilds the packaged asset)."""
    p = argparse.ArgumentParser(prog="python scripts/tinymodel.py", description=(__doc__ or "").split("\n")[0])
    p.add_argument("--steps", type=int, required=True, help="optimizer steps")
    p.add_argument("--out", type=Path, default=default_model_dir(), help="output model directory")
    p.add_argument("--corpus", type=Path, default=default_corpus_path(), help="UTF-8 training text")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--val-fraction", type=float, default=0.05)
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--induction-warmup-steps", type=int, default=1500, help="max random-repeat steps first")
    p.add_argument("--repeat-fraction", type=float, default=0.5, help="share of repeated-segment sequences")
    p.add_argument("--eval-every", type=int, default=None, help="log validation CE every N steps")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads value")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    raw_argv = sys.argv[1:] if argv is None else argv
    info = train_tiny_llama(
        args.corpus,
        args.out,
        steps=args.steps,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        val_fraction=args.val_fraction,
        vocab_size=args.vocab_size,
        eval_every=args.eval_every,
        repeat_fraction=args.repeat_fraction,
        induction_warmup_steps=args.induction_warmup_steps,
        progress=not args.no_progress,
        command=shlex.join(["python", "scripts/tinymodel.py", *raw_argv]),
    )
    print(json.dumps({k: info[k] for k in ("steps", "tokens_seen", "train_loss", "val_ce", "wall_seconds")}))
    return info


if __name__ == "__main__":
    main()
