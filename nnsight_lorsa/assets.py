"""Where the shipped assets are: the embedded default model, its Lorsa, transcoders and corpus.

The package ships, under ``nnsight_lorsa/assets/``, a small (~1.3M parameter) Llama-architecture LM
trained on tinyshakespeare (with its byte-level BPE tokenizer), a Lorsa for its layer 2, TopK transcoders
for its MLPs and the training corpus, so that demos and tests run offline. This module only locates them
(``nnsight_lorsa.envoy.load_model()`` loads the model into nnsight); the script that built the model is
``scripts/tinymodel.py`` in the source repository, not part of the installed package.
"""

from __future__ import annotations

from pathlib import Path

__all__ = [
    "BOS_TOKEN",
    "EOS_TOKEN",
    "BOS_ID",
    "EOS_ID",
    "default_model_dir",
    "default_lorsa_dir",
    "default_transcoder_dir",
    "default_corpus_path",
]

# The special tokens of the embedded model's tokenizer (its post-processor prepends BOS when encoding).
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|endoftext|>"  # also the padding token
BOS_ID = 0
EOS_ID = 1

_ASSETS = Path(__file__).resolve().parent / "assets"


def default_model_dir() -> Path:
    """Directory of the packaged default model (``nnsight_lorsa/assets/tinyshakespeare-llama``).

    It is a normal Hugging Face model directory (``config.json``, ``model.safetensors``, tokenizer files
    and ``training.json``) loadable with ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer``.
    The path is returned whether or not it exists; it exists in any installed copy of the package.
    """
    return _ASSETS / "tinyshakespeare-llama"


def default_lorsa_dir() -> Path:
    """The packaged Lorsa for layer 2 of the default model
    (``LorsaSet.from_pretrained(model, default_lorsa_dir())``)."""
    return _ASSETS / "tinyshakespeare-llama-lorsa"


def default_transcoder_dir() -> Path:
    """The packaged TopK transcoders for every MLP of the default model (``layer_{L}`` subdirectories in our
    safetensors+JSON format; trained by ``benchmarks/train_sparse_coders_tinyshakespeare.py --save-dir``)."""
    return _ASSETS / "tinyshakespeare-llama-transcoders"


def default_corpus_path() -> Path:
    """Path of the packaged training corpus ``nnsight_lorsa/assets/tinyshakespeare.txt`` (~1.1 MB UTF-8)."""
    return _ASSETS / "tinyshakespeare.txt"
