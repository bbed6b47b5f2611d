"""Cross-entropy of the embedded model as the installed transformers loads it, and the RoPE it runs.

    python scripts/embedded_model_ce.py [MODEL_DIR [TOKENIZER_DIR]]   # default: the embedded model

The first 512 tokens of the last 20 000 characters of the packaged corpus, fp32, ``AutoTokenizer`` +
``AutoModelForCausalLM`` (``model(ids, labels=ids).loss``); the rotary type is
``model.model.rotary_emb.rope_type``. Used for ``docs/compatibility.md`` (run it in each environment).
"""

from __future__ import annotations

import sys

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from nnsight_lorsa.assets import default_corpus_path, default_model_dir


def main() -> None:
    model_dir = sys.argv[1] if len(sys.argv) > 1 else str(default_model_dir())
    tok_dir = sys.argv[2] if len(sys.argv) > 2 else model_dir
    tok = AutoTokenizer.from_pretrained(tok_dir)
    dtype = {"dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype": torch.float32}
    model = AutoModelForCausalLM.from_pretrained(model_dir, **dtype).eval()
    text = default_corpus_path().read_text(encoding="utf-8")[-20000:]
    ids = tok(text, return_tensors="pt").input_ids[:, :512]
    with torch.no_grad():
        ce = model(ids, labels=ids).loss.item()
    rope = getattr(model.model.rotary_emb, "rope_type", None)
    print(f"transformers {transformers.__version__}: CE {ce:.4f} nats/token, rope_type {rope}")


if __name__ == "__main__":
    main()
