"""Small models of other architectures trained on the bundled tinyshakespeare corpus (benchmarks only).

The benchmarks that compare architectures (``sparse_attention_tinyshakespeare.py``, ``lorsa_recipe.py``)
train them here: a GPT-2 (``GPT2LMHeadModel``: learned positions, Conv1D fused QKV) and a GPT-NeoX
(``GPTNeoXForCausalLM``: partial rotary, ``rotary_pct`` 0.25, per-head interleaved fused QKV, parallel
residual as in Pythia), both in the embedded Llama's size class (d_model 128, 4 layers, 4 heads, MLP 512)
with its tokenizer, trained with its recipe (``scripts/tinymodel.py``: induction warm-up, repeat
augmentation, AdamW, warm-up + cosine schedule) but shorter. Saved as Hugging Face directories (with the
tokenizer and a ``training.json`` giving the held-out CE next to the unigram baseline's); never committed.

    OMP_NUM_THREADS=1 python -m benchmarks._tiny_models --arch gpt2 --out /tmp/ts-gpt2
    OMP_NUM_THREADS=1 python -m benchmarks._tiny_models --arch neox --out /tmp/ts-neox
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from benchmarks._timing import parser, script, start

ARCHS = ("gpt2", "neox")


def split_ids(tokenizer, val_fraction: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """Corpus token ids (no BOS): the first ``1 - val_fraction`` of the characters, and the rest
    (held out), as in ``scripts/tinymodel.py``."""
    from nnsight_lorsa.assets import default_corpus_path

    text = default_corpus_path().read_text(encoding="utf-8")
    cut = int(len(text) * (1.0 - val_fraction))
    enc = lambda t: torch.tensor(tokenizer(t, add_special_tokens=False)["input_ids"], dtype=torch.long)  # noqa: E731
    return enc(text[:cut]), enc(text[cut:])


def unigram_ce(train_ids: torch.Tensor, val_ids: torch.Tensor, vocab: int) -> float:
    """Held-out CE (nats/token) of the add-one-smoothed unigram distribution of the training tokens."""
    counts = torch.bincount(train_ids, minlength=vocab).double() + 1.0
    logp = (counts / counts.sum()).log()
    return float(-logp[val_ids].mean())


def tiny_config(arch: str, vocab_size: int):
    """The ``transformers`` config of a d_model-128, 4-layer, 4-head model of ``arch`` (no dropout)."""
    from transformers import GPT2Config, GPTNeoXConfig

    from nnsight_lorsa.assets import BOS_ID, EOS_ID

    ids = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": EOS_ID}
    if arch == "gpt2":
        return GPT2Config(vocab_size=vocab_size, n_positions=512, n_embd=128, n_layer=4, n_head=4, n_inner=512,
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **ids)
    if arch == "neox":
        return GPTNeoXConfig(vocab_size=vocab_size, max_position_embeddings=512, hidden_size=128,
                             num_hidden_layers=4, num_attention_heads=4, intermediate_size=512, rotary_pct=0.25,
                             rotary_emb_base=10000, use_parallel_residual=True, hidden_dropout=0.0,
                             attention_dropout=0.0, tie_word_embeddings=False, **ids)
    raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")


def train_tiny(arch: str, out: Path, steps: int, warmup_steps: int, seq_len: int = 128, batch_size: int = 16) -> dict:
    """Train a ``tiny_config(arch)`` model with the embedded Llama's recipe (``scripts/tinymodel.py``) and save it.

    Same tokenizer (copied from the Llama asset: trained on the same split), same induction warm-up (at
    most ``warmup_steps``), same repeat augmentation, AdamW (lr 3e-3, betas 0.9/0.95, weight decay 0.1 on
    matrices) and schedule, for ``steps`` steps of ``batch_size`` windows of ``seq_len`` tokens. Shorter
    than the Llama's run (CPU budget), so its CE is higher. Returns (and writes to ``out/training.json``)
    the held-out CE (``val_ce``, nats/token, ``corpus_cross_entropy``) and the unigram baseline's.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nnsight_lorsa.assets import default_model_dir

    tm = script("tinymodel")
    t0 = time.perf_counter()
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(default_model_dir())
    train_ids, val_ids = split_ids(tok)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, len(tok)), attn_implementation="eager",
                                             dtype=torch.float32)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=3e-3, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(0)
    warm, warm_ce = tm._induction_warmup(model, warmup_steps, gen, progress=True)
    n_starts = train_ids.numel() - (seq_len - 1) + 1
    model.train()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = tm._lr_at(step, steps, 3e-3, max(1, min(100, steps // 10)))
        starts = torch.randint(0, n_starts, (batch_size,), generator=gen)
        x = tm._repeat_augment(tm._windows_with_bos(train_ids, starts, seq_len), 0.5, gen)
        loss = tm.lm_step(model, opt, x)
        if step % 100 == 0:
            print(f"step {step} loss {loss:.3f}", flush=True)
    model.eval()
    val_ce = tm.corpus_cross_entropy(model, val_ids, seq_len=seq_len)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    info = {"arch": arch, "model_type": model.config.model_type, "steps": steps, "induction_warmup_steps": warm,
            "induction_warmup_second_copy_ce": warm_ce, "seq_len": seq_len, "batch_size": batch_size,
            "n_params": sum(p.numel() for p in model.parameters()), "val_ce": val_ce,
            "val_tokens": val_ids.numel(), "unigram_val_ce": unigram_ce(train_ids, val_ids, len(tok)),
            "wall_seconds": time.perf_counter() - t0, "torch_threads": torch.get_num_threads()}
    (out / "training.json").write_text(json.dumps(info, indent=1))
    return info


def main() -> None:
    args = parser(__doc__, arch="gpt2", out=Path("/tmp/ts-gpt2"), steps=600, warmup_steps=150, seq_len=128,
                  batch_size=16, threads=1).parse_args()
    if args.arch not in ARCHS:
        raise SystemExit(f"--arch must be one of {ARCHS}")
    start(args, seed=None)
    print(json.dumps(train_tiny(args.arch, args.out, args.steps, args.warmup_steps, args.seq_len, args.batch_size)))


if __name__ == "__main__":
    main()
