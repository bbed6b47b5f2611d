"""What every side of the interventions peer check shares: the models' configurations, the case counts (full and
default subset), the work-folder layout and the JSON / tensor helpers. Imports only the standard library and torch, so
circuit-tracer's and SAELens's interpreters (which do not have nnsight-lorsa) import it too: each side script is run as
``python <folder>/<side>.py WORK``, which puts this folder first on ``sys.path``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # scripts/peer_checks: peer_io
from peer_io import clear_work, finite, read_json, write_json  # noqa: E402, F401  (after the path it is found on)

# ------------------------------------------------------------------------------------------------------------ models
#: the word-level tokenizer of both models: ``<bos>`` 0 (also EOS), ``<unk>`` 1, ``w0`` … ``w37`` = 2 … 39
VOCAB, BOS_ID = 40, 0
#: tiny random GPT-2 (``GPT2LMHeadModel``): drawn after ``torch.manual_seed(GPT2_SEED)``, then every bias and
#: LayerNorm parameter moved by ``N(0, 1) * GPT2_PERTURB`` (the global generator, in ``named_parameters`` order)
GPT2 = {"vocab_size": VOCAB, "n_positions": 32, "n_embd": 32, "n_layer": 3, "n_head": 4,
        "activation_function": "gelu_new", "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        "layer_norm_epsilon": 1e-5, "bos_token_id": BOS_ID, "eos_token_id": BOS_ID, "initializer_range": 0.3}
GPT2_SEED, GPT2_PERTURB = 0, 0.1
#: tiny random Llama (``LlamaForCausalLM``, GQA 4/2): ``torch.manual_seed(LLAMA_SEED)``, then every norm weight moved
#: by ``N(0, 1) * LLAMA_PERTURB``
LLAMA = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
         "bos_token_id": BOS_ID, "eos_token_id": BOS_ID, "pad_token_id": 1, "tie_word_embeddings": False,
         "initializer_range": 0.2, "rope_theta": 10000.0}
LLAMA_SEED, LLAMA_PERTURB = 1, 0.3
N_LAYERS = 3
#: circuit-tracer's transcoder widths (GPT-2, Llama) and SAELens's SAE / transcoder width
D_TC_GPT2, D_TC_LLAMA, D_SAE = 48, 64, 40
#: the fixed prompts of the deterministic checks (BOS first)
PROMPT = [0, 5, 9, 13, 2, 30, 17, 8]
PROMPT_10 = [0, 5, 9, 13, 2, 30, 17, 8, 21, 11]

# ------------------------------------------------------------------------------------------------------------- cases
#: the probe's case counts (``--full``): per module (``ct_gpt2``: 7 modules; ``ct_constrained``: 6), per hook
#: combination (``ct_llama``: 6) or in all (the SAELens groups). Every case is drawn in both modes (the random draws
#: go on in the same order), so a default-subset case is the same case as in ``--full``.
FULL = {"ct_gpt2": 25, "ct_llama": 8, "ct_constrained": 8, "sl_gpt2": 60, "sl_centred": 50, "sl_transcoders": 24}
#: the probe's case counts in all (``--full``)
FULL_CASES = {"ct_gpt2": 7 * 25, "ct_llama": 6 * 8, "ct_constrained": 6 * 8, "sl_gpt2": 60, "sl_centred": 50,
              "sl_transcoders": 24}
#: the default subset runs every ``DEFAULT_STRIDE[group]``-th case (indices 0, s, 2s, …)
DEFAULT_STRIDE = {"ct_gpt2": 2, "ct_llama": 2, "ct_constrained": 2, "sl_gpt2": 2, "sl_centred": 2,
                  "sl_transcoders": 2}
#: the deterministic groups (one fixed prompt each, run in both modes)
FIXED_GROUPS = ("ct_bos", "ct_call_options", "sl_batch", "sl_experiments", "sl_centred_pair")
CT_GROUPS = ("ct_gpt2", "ct_llama", "ct_constrained", "ct_bos", "ct_call_options")
SL_GROUPS = ("sl_gpt2", "sl_centred", "sl_transcoders", "sl_batch", "sl_experiments", "sl_centred_pair")


def selected(group: str, full: bool) -> list[int]:
    """The case indices run for ``group`` (``0 … FULL[group] - 1``, or every ``DEFAULT_STRIDE``-th)."""
    return list(range(0, FULL[group], 1 if full else DEFAULT_STRIDE[group]))


# ------------------------------------------------------------------------------------------------------ work folder
def setup() -> None:
    """No network, one thread (every side calls this first)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    torch.set_num_threads(1)


def model_dir(work: Path, family: str) -> Path:
    """The Hugging Face folder (weights, config, tokenizer) of ``family`` (``gpt2`` / ``llama``)."""
    return work / "models" / family


def side_dir(work: Path, side: str, group: str | None = None) -> Path:
    """Where side ``side`` (``circuit_tracer``, ``saelens``, ``ours``) writes (``group``'s sub-folder)."""
    d = work / side if group is None else work / side / group
    d.mkdir(parents=True, exist_ok=True)
    return d


def plan(work: Path) -> dict[str, Any]:
    """``WORK/plan.json`` (written by ``run.py``): ``{"full": bool}``."""
    return read_json(work / "plan.json")


def start_peer_side() -> tuple[Path, bool, Any]:
    """A peer side's start (``circuit_tracer_side.py``, ``saelens_side.py``): :func:`setup`, warnings off, and
    ``(work, full, the random GPT-2 in eval mode)`` from ``argv[1]`` and its plan."""
    import warnings

    from transformers import GPT2LMHeadModel

    setup()
    warnings.filterwarnings("ignore")
    work = Path(sys.argv[1])
    hf = GPT2LMHeadModel.from_pretrained(str(model_dir(work, "gpt2"))).eval()
    return work, bool(plan(work)["full"]), hf




def save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """``tensors`` (detached, contiguous, dense) as one safetensors file."""
    from safetensors.torch import save_file

    out = {}
    for k, v in tensors.items():
        v = v.detach()
        out[k] = (v.to_dense() if v.is_sparse else v).contiguous()
    save_file(out, str(path))


def versions(*dists: str) -> dict[str, str]:
    """Installed versions of the distributions ``dists`` (and Python)."""
    import importlib.metadata as md
    import platform

    out = {"python": platform.python_version()}
    for d in dists:
        try:
            out[d] = md.version(d)
        except md.PackageNotFoundError:
            out[d] = "not installed"
    return out
