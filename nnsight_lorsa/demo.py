"""The main job: train a Lorsa on one layer, splice it in a trace, report and show its heads.

``nnsight-lorsa demo`` runs end to end offline on the embedded default (a small Llama-architecture
model trained on tinyshakespeare, shipped in ``nnsight_lorsa/assets``); ``--model DIR`` and
``--text FILE`` take a local Hugging Face model directory and a text file instead (cut into documents on
the tokenizer's EOS text, e.g. ``<|endoftext|>``, else on blank lines: one window from each document's
start, with the model's BOS, short documents padded and their padding left out of CE); ``--tokens FILE``
takes token ids instead of a text (``.npy`` / ``.safetensors`` / ``.pt``: a stream cut at the model's EOS
ids, or one document per row with an optional ``attention_mask``;
:meth:`~.training.dataset.TokenDataset.from_ids`), so a model without a tokenizer runs too.
The Lorsa trains with the default :class:`~.training.LorsaRecipe` (QK and OV from the MHSA and one
batch, closed-form output scale and ``b_D``; docs/training.md, "The Lorsa training recipe").

Every argument and the output directory are checked before any work (:func:`run_demo` raises
:class:`~.errors.ArgumentError`; the command line prints the message and exits with status 2): sizes
are positive (``seq_len >= 2``), the output directory is created and a probe file written and removed,
and — once the model's config is known, before the Lorsa exists — the Lorsa's shape fits the model and
its training (weights, gradients, Adam state, one batch's activations) fits in this machine's memory, and
``seq_len`` is within the model's positions (``max_position_embeddings``).
With ``out_dir`` the trained Lorsa is saved as soon as training ends, before evaluation. An ``out_dir`` holding an
earlier run's outputs (:data:`OUTPUT_FILES`, :data:`OUTPUT_DIRS`) is refused unless ``overwrite`` (``--overwrite``:
those, and only those, are deleted first) or ``resume`` continues the interrupted run whose directory it is.
``--resume`` refuses another batch size, window length, seed, model dtype or training data than the checkpoint's
run recorded (``Trainer.run_info``; ``CheckpointError`` naming the option and both values).

Ctrl-C during training stops at the end of the step under way (a second Ctrl-C stops at once): the
trainer is checkpointed to ``out_dir/checkpoint`` (a new temporary directory without ``out_dir``) and
the Lorsa trained so far saved beside it (``lorsa_interrupted/``); :func:`run_demo` then raises
:class:`TrainingInterrupted` (a ``KeyboardInterrupt`` naming both), and the command line prints where they
are and the command that resumes (``--resume DIR``) and exits with status 130. The resumed run, once it has
written its ``lorsa/`` (and ``demo_results.json``), removes the superseded ``lorsa_interrupted/`` beside it.

The run ends with pictures (unless ``pictures=False``, ``--no-pictures``), written to ``out_dir`` (a new
temporary directory ``nnsight-lorsa-demo-*`` without it) and their paths printed
(:func:`write_pictures`): ``training_curves.png`` (the trainer's logged history), ``dashboards/L{layer}_H{head}.html``
(the top heads' dashboards), ``graph.html`` (the attribution graph of the demo's prompt in the viewer) and
``graph.json`` (the same graph as circuit-tracer / Neuronpedia graph JSON). On the embedded model the graph
also holds the shipped transcoders' features (the Lorsa's layer keeps its Lorsa); with ``--model DIR``
it has the Lorsa's heads, the other modules' error nodes, embeddings, biases and logits.
Top activations leave out the first :data:`SKIP_START` positions of every window (BOS and the
start-of-document artefacts: heads that fire only at a window's first tokens) and keep one entry per window.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ._atomic import atomic_file
from ._checks import is_int
from ._placement import check_device_arg
from .envoy.loading import load_model  # re-exported: the loader lives in the glue layer (envoy)
from .envoy.nnsight_internals import hf_module
from .errors import ArgumentError, PlacementError
from .formats.hub import SET_INDEX

__all__ = ["PROMPT", "SKIP_START", "DemoConfig", "DemoInterrupted", "TrainingInterrupted", "load_model", "run_demo",
           "write_pictures"]

#: positions at the start of every window left out of the top activations (BOS and the first tokens,
#: where some heads fire only because the window looks like a document start)
SKIP_START = 4
#: the prompt whose next token the demo predicts inside a trace and whose attribution graph it draws
PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?"


@dataclass
class DemoConfig:
    """What the demo trains and how long (checked by :func:`run_demo` before any work)."""

    model_dir: str | None = None
    text_path: str | None = None
    tokens_path: str | None = None  # token ids (.npy / .safetensors / .pt) instead of a text: no tokenizer needed
    layer: int | None = None  # default: the middle layer
    seq_len: int = 128
    batch_size: int = 16
    steps: int = 1500
    n_ov_heads: int | None = None  # default: 8 * d_model (the paper's ratio)
    qk_heads_per_mhsa_head: int = 4
    top_k: int = 16
    lr: float = 4e-3
    heldout_windows: int = 64
    n_show: int = 5
    out_dir: str | None = None
    seed: int = 0
    device: str = "cpu"  # "cpu", "cuda", "cuda:1", or "auto" (device_map="auto" over the visible GPUs)
    dtype: str = "float32"  # the model's weights: float32, bfloat16 or float16 (the Lorsa trains in fp32)
    progress: bool = True
    threads: int | None = None  # torch's intra-op CPU threads (torch.set_num_threads); default: torch's own
    resume: str | None = None  # a checkpoint written by an interrupted run (its directory): training continues
    pictures: bool = True  # write the dashboards, the attribution graph and the training curves (module docstring)
    overwrite: bool = False  # delete an earlier run's outputs (only the demo's own, OUTPUTS) in out_dir first


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped the demo's training; what was trained is kept.

    Attributes:
        checkpoint: the trainer's checkpoint directory (``--resume`` it), or None when the interrupt came
            before the first step (nothing trained, nothing saved).
        lorsa: the Lorsa trained so far, saved with :meth:`~.envoy.lorsa_set.LorsaSet.save` (or None).
        step: the steps taken.
    """

    def __init__(self, checkpoint: Path | None, lorsa: Path | None, step: int) -> None:
        super().__init__(f"training interrupted after step {step}")
        self.checkpoint, self.lorsa, self.step = checkpoint, lorsa, step


class DemoInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped the demo outside its training (loading, evaluating, writing pictures or results).

    Every file the demo writes is replaced atomically (a sibling temporary renamed over it), so an interrupted
    run leaves each output whole or absent, never half-written.

    Attributes:
        stage: what the run was doing (``"loading the model and the data"``, ``"evaluating"``, …).
        kept: the trained Lorsa's directory when it was already saved (``out_dir/lorsa``), else None.
    """

    def __init__(self, stage: str, kept: Path | None) -> None:
        super().__init__(f"interrupted while {stage}")
        self.stage, self.kept = stage, kept


#: below this difference (nats) between zero-ablated and original CE, "CE recovered" is not reported
_MIN_CE_GAP = 0.05
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: ``--threads`` above this and above the machine's CPU count is refused (oversubscribing a few times is allowed)
_MAX_THREADS = 256
_POSITIVE = ("seq_len", "batch_size", "steps", "qk_heads_per_mhsa_head", "top_k", "heldout_windows")


def _check_config(cfg: DemoConfig) -> None:
    """Sizes, paths and numbers of ``cfg`` that can be checked without the model.

    Raises:
        ArgumentError: a non-positive or non-integer size (``seq_len < 2``), a negative ``layer`` or
            ``n_show``, a non-finite or non-positive ``lr``, a ``seed`` outside torch's range
            ``[-2**63, 2**64)``, ``threads`` above both the CPU count and :data:`_MAX_THREADS`, a missing model
            directory or text file, a text file that is not UTF-8, a model directory without ``config.json`` or
            weights.
    """
    for name in _POSITIVE:
        v = getattr(cfg, name)
        if not is_int(v) or v < 1:
            raise ArgumentError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
    if cfg.seq_len < 2:
        raise ArgumentError(f"--seq-len must be at least 2 (BOS and one predicted token), got {cfg.seq_len}")
    if cfg.n_ov_heads is not None and (not is_int(cfg.n_ov_heads) or cfg.n_ov_heads < 1):
        raise ArgumentError(f"--n-ov-heads must be a positive integer, got {cfg.n_ov_heads!r}")
    if cfg.layer is not None and (not is_int(cfg.layer) or cfg.layer < 0):
        raise ArgumentError(f"--layer must be a non-negative integer, got {cfg.layer!r}")
    if not is_int(cfg.n_show) or cfg.n_show < 0:
        raise ArgumentError(f"--n-show must be a non-negative integer, got {cfg.n_show!r}")
    if cfg.threads is not None and (not is_int(cfg.threads) or cfg.threads < 1):
        raise ArgumentError(f"--threads must be a positive integer, got {cfg.threads!r}")
    cpus = os.cpu_count() or 1
    if cfg.threads is not None and cfg.threads > max(cpus, _MAX_THREADS):  # libgomp aborts the process on 10**9
        raise ArgumentError(f"--threads {cfg.threads}: more than this machine's {cpus} CPUs can use "
                            f"(at most {max(cpus, _MAX_THREADS)})")
    if cfg.resume is not None and not (Path(cfg.resume) / "trainer.json").is_file():
        raise ArgumentError(f"--resume {cfg.resume}: not a demo checkpoint (no trainer.json); it is the directory "
                            "an interrupted run printed")
    for flag in ("pictures", "overwrite"):
        if not isinstance(getattr(cfg, flag), bool):
            raise ArgumentError(f"{flag} must be True or False, got {getattr(cfg, flag)!r}")
    if not is_int(cfg.seed) or not -2**63 <= cfg.seed < 2**64:  # torch.manual_seed's range (a raw ValueError)
        raise ArgumentError(f"--seed must be an integer from -2**63 to 2**64 - 1, got {cfg.seed!r}")
    if not isinstance(cfg.lr, (int, float)) or not math.isfinite(cfg.lr) or cfg.lr <= 0:
        raise ArgumentError(f"--lr must be a positive finite number, got {cfg.lr!r}")
    if cfg.dtype not in _DTYPES:
        raise ArgumentError(f"--dtype must be one of {sorted(_DTYPES)}, got {cfg.dtype!r}")
    if cfg.device != "auto":
        try:  # the package's one device check: a device this machine lacks (cuda:7 on one GPU) is refused here
            device = check_device_arg(cfg.device, f"--device {cfg.device!r}")
        except PlacementError as e:  # an argument of the run: argparse's usage error, before any work
            raise ArgumentError(str(e)) from None
        if device is None or device.type not in ("cpu", "cuda"):
            raise ArgumentError(f"--device {cfg.device}: the demo runs on cpu or cuda")
    if cfg.model_dir is not None and not Path(cfg.model_dir).is_dir():
        raise ArgumentError(f"--model {cfg.model_dir}: not a directory (a local Hugging Face model directory)")
    if cfg.text_path is not None and cfg.tokens_path is not None:
        raise ArgumentError("--text and --tokens both given: train on a text file or on a token-id file, not both")
    if cfg.tokens_path is not None and not Path(cfg.tokens_path).is_file():
        raise ArgumentError(f"--tokens {cfg.tokens_path}: no such file")
    if cfg.text_path is not None and not Path(cfg.text_path).is_file():
        raise ArgumentError(f"--text {cfg.text_path}: no such file")
    if cfg.text_path is not None:
        try:
            Path(cfg.text_path).read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise ArgumentError(f"--text {cfg.text_path}: not UTF-8 text (byte {e.start}: {e.reason}); "
                                "convert it, e.g. iconv -f latin1 -t utf-8") from None
        except OSError as e:
            raise ArgumentError(f"--text {cfg.text_path}: cannot be read ({e.strerror or e})") from None
    if cfg.model_dir is not None:
        d = Path(cfg.model_dir)
        weights = [p.name for p in d.iterdir()
                   if p.suffix in (".safetensors", ".bin") or p.name.endswith(".index.json")]
        missing = [what for what, ok in (("config.json", (d / "config.json").is_file()),
                                         ("weights (*.safetensors or pytorch_model*.bin)", bool(weights))) if not ok]
        if missing:
            raise ArgumentError(f"--model {cfg.model_dir}: not a Hugging Face model directory, no "
                                f"{' and no '.join(missing)} (it holds {sorted(p.name for p in d.iterdir())[:8]})")


def _check_out_dir(out_dir: str) -> None:
    """Create ``out_dir`` (with parents) and write and remove a probe file in it.

    Raises:
        ArgumentError: it cannot be created or written (the OS error says why).
    """
    out = Path(out_dir)
    probe = out / f".nnsight-lorsa-probe-{os.getpid()}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"probe")
        probe.unlink()
    except OSError as e:
        raise ArgumentError(f"--out-dir {out_dir}: cannot be created or written ({e.strerror or e}); "
                            "nothing was trained") from e


#: what a run writes into ``out_dir`` (files, then directories); an earlier run's are refused or, with
#: ``overwrite``, deleted (only these names, and a directory only where it holds what the demo writes there)
OUTPUT_FILES = ("demo_results.json", "training_curves.png", "graph.html", "graph.json")
OUTPUT_DIRS = ("lorsa", "lorsa_interrupted", "checkpoint", "dashboards")
_DASHBOARD = re.compile(r"L\d+_H\d+\.html")


def _ours(d: Path) -> bool | None:
    """Whether the directory ``out_dir/d.name`` holds what the demo writes there: a saved Lorsa set (``layer_*``
    folders, and the set index ``set.json`` since 2026-11-28), a trainer checkpoint (``trainer.json``), head
    dashboards; None where it is empty."""
    children = list(d.iterdir())
    if not children:
        return None
    if d.name in ("lorsa", "lorsa_interrupted"):
        return all((c.is_dir() and re.fullmatch(r"layer_\d+", c.name)) or (c.is_file() and c.name == SET_INDEX)
                   for c in children)
    if d.name == "checkpoint":
        return (d / "trainer.json").is_file()
    return any(c.is_file() and _DASHBOARD.fullmatch(c.name) for c in children)  # dashboards


def _check_earlier_outputs(cfg: DemoConfig) -> None:
    """An ``out_dir`` holding an earlier run's outputs (:data:`OUTPUT_FILES`, :data:`OUTPUT_DIRS`) is refused, so
    that no reader mistakes them for this run's (another head's dashboard, pictures under ``--no-pictures``);
    with ``cfg.overwrite`` they are deleted first (the dashboards folder's ``L*_H*.html`` pages only) and named.
    With ``cfg.resume`` = ``out_dir/checkpoint`` the run continues in the interrupted run's directory: its
    ``checkpoint/`` and ``lorsa_interrupted/`` are expected there (a new interrupt replaces them) and never deleted.

    Raises:
        ArgumentError: earlier outputs without ``overwrite`` (naming them, ``--overwrite`` and, for an
            interrupted run's checkpoint, ``--resume``), or a directory of one of those names that is not the
            demo's (never deleted).
    """
    assert cfg.out_dir is not None
    out = Path(cfg.out_dir)
    in_place = cfg.resume is not None and Path(cfg.resume).resolve() == (out / "checkpoint").resolve()
    found: list[Path] = [out / f for f in OUTPUT_FILES if (out / f).exists()]
    for name in OUTPUT_DIRS:
        d = out / name
        if not d.exists():
            continue
        ours = _ours(d) if d.is_dir() else False
        if ours is False:
            raise ArgumentError(f"--out-dir {out}: {name}{'/' if d.is_dir() else ''} there is not the demo's output "
                                f"(the run writes {name}/ there) and is not deleted, also not with --overwrite: "
                                "move it or choose another --out-dir")
        if ours and not (in_place and name in ("checkpoint", "lorsa_interrupted")):
            found.append(d)
    if not found:
        return
    names = ", ".join(p.name + ("/" if p.is_dir() else "") for p in found)
    if not cfg.overwrite:
        hint = (f", or --resume {out / 'checkpoint'} to continue the interrupted run"
                if (out / "checkpoint").is_dir() and cfg.resume is None else "")
        raise ArgumentError(f"--out-dir {out}: holds an earlier run's outputs ({names}) that this run would leave "
                            f"beside its own: give --overwrite to delete those (only those), another --out-dir{hint}")
    for p in found:
        if p.name == "dashboards":
            for page in p.iterdir():
                if page.is_file() and _DASHBOARD.fullmatch(page.name):
                    page.unlink()
            if not any(p.iterdir()):
                p.rmdir()
        elif p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()
    print(f"--overwrite: removed the earlier run's {names} from {out}")


def _memory_bytes() -> int | None:
    """This machine's physical memory in bytes (None where the OS does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None


def _training_bytes(d_model: int, n_qk: int, d_qk: int, n_ov: int, batch: int, seq: int) -> int:
    """A lower bound on the memory (bytes, fp32) that training a Lorsa of this shape needs: weights,
    gradients and Adam's two moments (4 copies of ``2·n_qk·d_qk·d_model + 2·n_ov·d_model`` parameters)
    plus one batch's per-head activations (value, pre-activation, activation: ``3·batch·seq·n_ov``)
    and QK patterns (``batch·n_qk·seq²``)."""
    params = 2 * n_qk * d_qk * d_model + 2 * n_ov * d_model
    return 4 * (4 * params + 3 * batch * seq * n_ov + batch * n_qk * seq * seq)


def _check_sizes(cfg: DemoConfig, d_model: int, n_qk: int, d_qk: int, n_ov: int) -> None:
    """The Lorsa's shape against the model and the machine's memory, before anything is allocated
    (then :func:`_check_positions`).

    Raises:
        ArgumentError: ``n_ov_heads`` not a multiple of the QK head count, ``top_k > n_ov_heads``, or a
            training that needs more than this machine's physical memory (:func:`_training_bytes`).
    """
    if n_ov % n_qk:
        raise ArgumentError(f"--n-ov-heads {n_ov} must be a multiple of the {n_qk} QK heads "
                            "(the model's heads x --qk-heads-per-mhsa-head)")
    if cfg.top_k > n_ov:
        raise ArgumentError(f"--top-k {cfg.top_k} exceeds the {n_ov} OV heads")
    need, have = _training_bytes(d_model, n_qk, d_qk, n_ov, cfg.batch_size, cfg.seq_len), _memory_bytes()
    if have is not None and need > have:
        raise ArgumentError(f"training this Lorsa ({n_ov} OV heads, {n_qk} QK heads x {d_qk}, d_model {d_model}, "
                            f"batch {cfg.batch_size} x {cfg.seq_len} tokens) needs at least {need / 2**30:.3g} GiB, "
                            f"more than this machine's {have / 2**30:.3g} GiB: lower --n-ov-heads, "
                            "--qk-heads-per-mhsa-head, --batch-size or --seq-len")


def _check_positions(cfg: DemoConfig, config: Any) -> None:
    """``seq_len`` against the positions the model has (``max_position_embeddings`` / ``n_positions`` of its
    text config): GPT-2's learned position table raised a raw ``IndexError`` past it, a rotary model ran
    silently on positions it was never trained on.

    Raises:
        ArgumentError: ``seq_len`` above the model's positions.
    """
    text = getattr(config, "get_text_config", lambda: config)()
    limits = [v for v in (getattr(text, k, None) for k in ("max_position_embeddings", "n_positions"))
              if isinstance(v, int) and not isinstance(v, bool) and v > 0]  # (narrows for mypy)
    if limits and cfg.seq_len > min(limits):
        raise ArgumentError(f"--seq-len {cfg.seq_len} exceeds the model's {min(limits)} positions "
                            "(max_position_embeddings in its config.json): lower --seq-len")


@contextmanager
def _stop_at_step_end(trainer: Any) -> Iterator[None]:
    """While training: the first Ctrl-C (SIGINT) makes the next step raise ``KeyboardInterrupt`` before it
    starts, so the trainer is left exactly after a whole step; a second Ctrl-C interrupts at once (the
    default). Outside the main thread (no signal handler can be set) Ctrl-C keeps its default."""
    stop = False
    step = trainer.train_step

    def guarded() -> dict[str, float]:
        if stop:
            raise KeyboardInterrupt
        return step()

    def on_sigint(signum: int, frame: Any) -> None:
        nonlocal stop
        if stop:
            raise KeyboardInterrupt
        stop = True
        print("\ninterrupted: stopping after this step (Ctrl-C again to stop now)", flush=True)

    trainer.train_step = guarded
    try:
        previous = signal.signal(signal.SIGINT, on_sigint)
    except ValueError:  # not the main thread
        previous = None
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
        trainer.train_step = step


def _save_interrupted(trainer: Any, model: Any, layer: int, out: Path | None) -> TrainingInterrupted:
    """Checkpoint ``trainer`` and save its folded Lorsa (in ``out`` or a new temporary directory)."""
    from .envoy.lorsa_set import LorsaSet

    if trainer.step == 0 or trainer.s_in is None:
        return TrainingInterrupted(None, None, trainer.step)
    where = out if out is not None else Path(tempfile.mkdtemp(prefix="nnsight-lorsa-interrupted-"))
    trainer.save_checkpoint(where / "checkpoint")
    LorsaSet(model, {layer: trainer.folded()}).save(where / "lorsa_interrupted")
    return TrainingInterrupted(where / "checkpoint", where / "lorsa_interrupted", trainer.step)


#: the run's settings a resume must share (with the data's hash, :func:`_run_info`), beside ``--steps`` / ``--lr``
_RUN_OPTIONS = ("batch_size", "seq_len", "seed", "dtype")


def _run_info(cfg: DemoConfig, train: Any) -> dict[str, Any]:
    """What a checkpoint records of the run (``Trainer.run_info``) so that ``--resume`` can refuse another: the
    batch size, window length, seed and model dtype, and the sha256 of the training windows' token ids (and target
    mask), which the text / token file, the tokenizer, ``--seq-len`` and the held-out split determine."""
    digest = hashlib.sha256(train.tokens.to("cpu", torch.int64).contiguous().numpy().tobytes())
    if train.target_mask is not None:
        digest.update(train.target_mask.to("cpu", torch.bool).contiguous().numpy().tobytes())
    return {**{k: getattr(cfg, k) for k in _RUN_OPTIONS}, "data_sha256": digest.hexdigest()}


def _model_kind(config: Any, adapter: Any) -> str:
    """The model's own ``model_type`` (``qwen2``), with the adapter family where it differs
    (``qwen2, llama adapter``: Qwen2 and Mistral are served by the Llama adapter)."""
    model_type = getattr(config, "model_type", None) or adapter.family
    return model_type if model_type == adapter.family else f"{model_type}, {adapter.family} adapter"


def _context(tokenizer: Any, ids: torch.Tensor, pos: int, width: int = 12) -> str:
    left = tokenizer.decode(ids[max(1, pos - width):pos])
    tok = tokenizer.decode(ids[pos:pos + 1])
    right = tokenizer.decode(ids[pos + 1:pos + 4])
    return (left + "[[" + tok + "]]" + right).replace("\n", "⏎")


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    """Train, evaluate, splice and inspect; return (and optionally write) the measured numbers.

    With ``cfg.out_dir``: the trained (folded) Lorsa is saved to ``out_dir/lorsa`` as soon as training
    ends and ``out_dir/demo_results.json`` holds the training numbers, then the evaluation's once it
    completes — a failure later does not lose the training.

    Raises:
        ArgumentError: ``cfg`` not a :class:`DemoConfig`; a bad setting (see the module docstring), or an
            ``out_dir`` holding an earlier run's outputs without ``overwrite``, before any work.
        LayerOutOfRangeError: ``cfg.layer`` outside the model.
        TooFewTokensError: the first batch has fewer counted tokens than the Lorsa's ``d_qk_head`` (raise
            ``batch_size`` or ``seq_len``), before the first step.
        NonFiniteError: training turned non-finite (e.g. a far too large ``lr``); the message names the step
            and the tensor.
        CheckpointError: ``cfg.resume`` is not a readable checkpoint of this layer's Lorsa, or its run had other
            steps, learning rate, batch size, window length, seed, dtype or data (named, with both values).
        TrainingInterrupted: Ctrl-C during training; the trainer was checkpointed first (see the module
            docstring).
        DemoInterrupted: Ctrl-C anywhere else; it names the stage and what was kept (every file the run
            writes is replaced atomically, so none is left half-written).
    """
    if not isinstance(cfg, DemoConfig):
        raise ArgumentError(f"run_demo(cfg=...) must be a DemoConfig, got a {type(cfg).__name__}")
    state: dict[str, Any] = {"stage": "checking the arguments", "kept": None}
    try:
        return _run(cfg, state)
    except TrainingInterrupted:
        raise
    except KeyboardInterrupt:
        raise DemoInterrupted(state["stage"], state["kept"]) from None


def _run(cfg: DemoConfig, state: dict[str, Any]) -> dict[str, Any]:
    """:func:`run_demo`'s work; ``state["stage"]`` says what it is doing, ``state["kept"]`` what it has written."""
    from .adapters.registry import get_adapter
    from .analysis.top_activations import TopActivations
    from .assets import default_corpus_path
    from .envoy.lorsa_set import LorsaSet
    from .envoy.read import attention_activations
    from .modules.lorsa import Lorsa
    from .modules.lorsa_config import LorsaConfig
    from .training import ActivationSource, LorsaObjective, TokenDataset, TrainConfig, Trainer, evaluate

    _check_config(cfg)
    token_file = None
    if cfg.tokens_path is not None:  # read before any work: a bad file is an argument error
        from .training.dataset import read_token_ids

        try:
            token_file = read_token_ids(cfg.tokens_path)
        except ArgumentError as e:  # the message names the file; the command line's names the option too
            why = str(e).removeprefix(f"{cfg.tokens_path}: ").strip().splitlines()[0]
            raise ArgumentError(f"--tokens {cfg.tokens_path}: {why}") from None
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    out = None if cfg.out_dir is None else Path(cfg.out_dir)
    if cfg.out_dir is not None:
        _check_out_dir(cfg.out_dir)
        _check_earlier_outputs(cfg)
    torch.manual_seed(cfg.seed)
    t0 = time.time()
    state["stage"] = "loading the model and the data"
    model = load_model(cfg.model_dir, device=cfg.device, dtype=_DTYPES[cfg.dtype])
    adapter = get_adapter(model)
    layer = adapter.n_layers // 2 if cfg.layer is None else adapter.check_layer(cfg.layer)
    mhsa = adapter.mhsa_weights(hf_module(model), layer)
    n_ov = cfg.n_ov_heads or 8 * adapter.d_model
    _check_sizes(cfg, adapter.d_model, mhsa.n_heads * cfg.qk_heads_per_mhsa_head, mhsa.head_dim, n_ov)
    _check_positions(cfg, model.config)
    if token_file is not None:  # a stream cut at the model's EOS ids, or one document per row
        try:
            data = TokenDataset.from_ids(token_file[0], cfg.seq_len, target_mask=token_file[1],
                                         tokenizer=model.tokenizer, config=model.config)
        except ValueError as e:  # too short for one window, ids outside the vocabulary (ArgumentError too)
            raise ArgumentError(f"--tokens {cfg.tokens_path}: {e}") from e
        text = None
    else:
        text = Path(cfg.text_path or default_corpus_path()).read_text(encoding="utf-8")
        # the embedded corpus is one document (consecutive windows, the numbers in docs/training.md);
        # a --text file is cut into documents (EOS text, else blank lines), one window at each start
        try:
            data = TokenDataset.from_text(model.tokenizer, text, cfg.seq_len, config=model.config,
                                          document_separator="auto" if cfg.text_path else None)
        except ValueError as e:  # too short for one window, or no document with a token
            raise ArgumentError(f"--text {cfg.text_path or default_corpus_path()}: {e}") from e
    if len(data) < 2:
        raise ArgumentError(f"the text gives {len(data)} window of {cfg.seq_len} tokens; training and a held-out "
                            "split need at least 2: use a longer text or a smaller --seq-len")
    train, heldout = data.split(min(0.2, cfg.heldout_windows / len(data)))
    if len(heldout) < cfg.heldout_windows:  # said, not silent: the held-out split is at most 20 % of the text
        print(f"note: holding out {len(heldout)} of the text's {len(data)} windows (20 %), fewer than "
              f"--heldout-windows {cfg.heldout_windows}")
    lcfg = LorsaConfig.from_mhsa(mhsa, n_ov_heads=n_ov, top_k=cfg.top_k,
                                 qk_heads_per_mhsa_head=cfg.qk_heads_per_mhsa_head, layer=layer,
                                 architecture=adapter.family)
    lorsa = Lorsa(lcfg, device=mhsa.W_O.device)  # fp32, on its layer's device
    docs_note = " (one per document, from its start)"
    if text is not None and cfg.text_path and data.target_mask is not None:
        from .training.dataset import auto_separator

        docs_note += f", documents split on {auto_separator(model.tokenizer, text)!r}"
    source_name = "corpus" if token_file is None else f"token ids from {cfg.tokens_path}"
    print(f"model: {cfg.model_dir or 'embedded tinyshakespeare Llama'} ({_model_kind(model.config, adapter)}, "
          f"{adapter.n_layers} layers, "
          f"d_model {adapter.d_model}); {source_name}: {len(data)} windows x {cfg.seq_len} tokens"
          f"{docs_note if data.target_mask is not None else ''}")
    print(f"Lorsa for layer {layer}: {lcfg.n_qk_heads} QK heads x {lcfg.d_qk_head}, {n_ov} OV heads, top_k {cfg.top_k}")
    source = ActivationSource.attention(model, layer, train, cfg.batch_size, seed=cfg.seed)
    run_info = _run_info(cfg, train)
    if cfg.resume is None:
        trainer = Trainer(LorsaObjective(lorsa, mhsa=mhsa), source, TrainConfig(total_steps=cfg.steps, lr=cfg.lr))
        trainer.run_info = run_info
    else:
        from .errors import CheckpointError

        trainer = Trainer.resume(cfg.resume, source, device=mhsa.W_O.device)
        saved = getattr(trainer.module, "cfg", None)
        if saved is None or saved.to_dict() != lcfg.to_dict():  # another kind's config differs too
            raise CheckpointError(f"--resume {cfg.resume}: its Lorsa is not the one these arguments train "
                                  "(give the interrupted run's --model, --text, --layer and Lorsa sizes)")
        given = {"--steps": (trainer.config.total_steps, cfg.steps), "--lr": (trainer.config.lr, cfg.lr),
                 **{f"--{k.replace('_', '-')}": (trainer.run_info[k], run_info[k]) for k in _RUN_OPTIONS
                    if k in trainer.run_info}}
        differ = [f"{k} {new} (the checkpoint's: {old})" for k, (old, new) in given.items() if old != new]
        saved_data = trainer.run_info.get("data_sha256")
        if saved_data is not None and saved_data != run_info["data_sha256"]:  # --text / --tokens / --model, split
            differ.append(f"the data: training token ids of sha256 {run_info['data_sha256'][:12]}… (the "
                          f"checkpoint's: {str(saved_data)[:12]}…; give the same --text / --tokens, --model and "
                          "--heldout-windows)")
        if differ:  # the saved TrainConfig rules on resume: another value given would be ignored silently
            raise CheckpointError(f"--resume {cfg.resume}: the interrupted run trained with other settings: "
                                  f"{', '.join(differ)}; give the interrupted run's values")
        if not trainer.run_info:  # a checkpoint of a run before these were recorded: said, not silent
            print(f"note: {cfg.resume} does not record the interrupted run's --batch-size, --seq-len, --seed, "
                  "--dtype or data: they cannot be checked")
        trainer.run_info = run_info
        print(f"resuming from {cfg.resume} at step {trainer.step} of {trainer.config.total_steps}")
    state["stage"] = "training"
    try:
        with _stop_at_step_end(trainer):
            trainer.train(progress=cfg.progress)
    except KeyboardInterrupt:
        raise _save_interrupted(trainer, model, layer, out) from None
    t_train = time.time() - t0
    folded: Any = trainer.folded()  # the trained Lorsa (LorsaSet refuses another kind)
    lorsas = LorsaSet(model, {layer: folded})
    result: dict[str, Any] = {"layer": layer, "config": lcfg.to_dict(), "steps": trainer.config.total_steps,
                              **run_info, "train_seconds": round(t_train, 1),
                              "train_history": trainer.history[-1:]}
    state["stage"] = "saving the trained Lorsa" if out is not None else "evaluating"
    if out is not None:  # the training is kept whatever happens next
        lorsas.save(out / "lorsa")
        atomic_file(out / "demo_results.json", json.dumps(result, indent=1).encode("utf-8"))
        state["kept"] = out / "lorsa"
        print(f"saved the trained Lorsa to {out / 'lorsa'}")
        stale = out / "lorsa_interrupted"  # an interrupted run's Lorsa, superseded now that lorsa/ is written
        if cfg.resume is not None and stale.is_dir() and _ours(stale) is not False:
            shutil.rmtree(stale)
    state["stage"] = "evaluating"

    ev = evaluate(lorsas, heldout, at=layer, batch_size=cfg.batch_size, progress=None if cfg.progress else False)
    numbers = ev.summary()
    gap = ev.ce_zero - ev.ce_orig
    if not gap >= _MIN_CE_GAP:  # the JSON says what the printout says: no ratio, and why
        numbers["ce_recovered"] = None
        numbers["ce_recovered_note"] = (f"zero-ablating the layer changes CE by {gap:+.4f} nats, under "
                                        f"{_MIN_CE_GAP}, so the ratio means nothing here")
    print(f"\nheld-out evaluation ({ev.n_tokens} tokens):")
    print(f"  FVU {ev.fvu:.4f}   L0 {ev.l0:.2f}   dead heads {ev.dead_frac:.1%}")
    recovered = (f"CE recovered {ev.ce_recovered:.1%}" if numbers["ce_recovered"] is not None else
                 f"CE recovered n/a: {numbers['ce_recovered_note']}")
    print(f"  CE orig {ev.ce_orig:.4f}   CE lorsa {ev.ce_spliced:.4f}   CE zero-ablated {ev.ce_zero:.4f}   "
          f"({recovered})")

    # the flagship: replace MHSA by Lorsa inside a trace and read its heads there
    import nnsight

    from .envoy.tokens import IdsOnlyTokenizer

    prompt: Any = PROMPT
    if isinstance(model.tokenizer, IdsOnlyTokenizer):  # no tokenizer: the first held-out window's ids
        prompt = heldout.tokens[:1, : min(heldout.seq_len, 16)]
    with model.trace(prompt):
        site = lorsas.replace(layer=layer)
        z = nnsight.save(site.hook_z.output)
        logits = nnsight.save(model.get(lorsas.adapter.lm_head_path).output)
    next_tok = model.tokenizer.decode(logits[0, -1].argmax())
    active = (z[0, -1] > 0).nonzero().flatten().tolist()
    print(f"\nwith model.trace(prompt): lorsa.replace(layer={layer}) -> next token {next_tok!r}; "
          f"{len(active)} heads active on the last token: {active[:10]}")

    # top heads with their top-activating contexts and z-patterns
    top = TopActivations.empty(n_ov, n_top=3, distinct_windows=True)
    keep = torch.ones_like(heldout.tokens, dtype=torch.bool) if heldout.target_mask is None \
        else heldout.target_mask.clone()
    keep[:, :SKIP_START] = False  # BOS, the start-of-document artefacts and padding never shown
    for i in range(0, len(heldout), cfg.batch_size):
        ids = heldout.tokens[i:i + cfg.batch_size]
        with model.trace(ids, use_cache=False):
            z_b = nnsight.save(lorsas.replace(layer=layer).hook_z.output)
        top.update(z_b, i, keep[i:i + cfg.batch_size])
    shown = []
    print(f"\ntop {cfg.n_show} heads (by max activation) on held-out text, positions {SKIP_START}+ of each window:")
    for h in top.top_heads(cfg.n_show):
        print(f"  head {h} (QK group {h // lcfg.group_size}, active on {top.frequency[h]:.2%} of tokens)")
        for v, w, p in zip(top.values[h].tolist(), top.window[h].tolist(), top.position[h].tolist(), strict=True):
            if w < 0 or not v > 0:
                continue
            ids = heldout.tokens[w]
            act = attention_activations(model, layer, ids[None], adapter=adapter)
            zp = folded.z_pattern(act.x.to(folded.W_O), [h], act.positions)[0, 0, p, : p + 1].cpu()
            keys = zp.abs().topk(min(3, p + 1)).indices.tolist()
            contrib = ", ".join(f"{model.tokenizer.decode(ids[k:k + 1])!r}@{k - p}:{zp[k]:+.2f}" for k in keys)
            print(f"    z={v:6.2f}  {_context(model.tokenizer, ids, p)}")
            print(f"             z-pattern (key, offset, contribution): {contrib}")
            shown.append({"head": h, "z": v, "window": w, "position": p})
    result.update({"eval": numbers, "top_heads": shown})
    if cfg.pictures:
        state["stage"] = "writing the pictures"
        t_pics = time.time()
        where = out if out is not None else Path(tempfile.mkdtemp(prefix="nnsight-lorsa-demo-"))
        pictures = write_pictures(where, model, lorsas, layer, trainer.history, top, heldout.tokens,
                                  top.top_heads(cfg.n_show), embedded=cfg.model_dir is None, prompt=prompt)
        result["pictures"] = {k: str(v) if isinstance(v, Path) else [str(x) for x in v] for k, v in pictures.items()}
        result["pictures_seconds"] = round(time.time() - t_pics, 1)
        print(f"\npictures ({result['pictures_seconds']} s), in {where}:")
        print(f"  training curves      {pictures['training_curves']}")
        for page in pictures["dashboards"]:
            print(f"  head dashboard       {page}")
        print(f"  attribution graph    {pictures['graph_html']}  (open in a browser)")
        print(f"  graph JSON           {pictures['graph_json']}  (circuit-tracer / Neuronpedia format)")
    result["total_seconds"] = round(time.time() - t0, 1)
    print(f"\ntotal time {result['total_seconds']} s (training {result['train_seconds']} s)")
    if out is not None:
        state["stage"] = "saving the results"
        atomic_file(out / "demo_results.json", json.dumps(result, indent=1).encode("utf-8"))
        print(f"saved the results to {out / 'demo_results.json'}")
    return result


def write_pictures(where: Path, model: Any, lorsas: Any, layer: int, history: list[dict[str, float]], top: Any,
                   tokens: torch.Tensor, heads: list[int], *, embedded: bool, prompt: Any = PROMPT) -> dict[str, Any]:
    """The demo's pictures in ``where`` (created); returns their paths.

    Args:
        model: the nnsight model; lorsas: its :class:`~.envoy.lorsa_set.LorsaSet` (the trained Lorsa of
            ``layer``); history: the trainer's logged history (``Trainer.history``).
        top: the heads' :class:`~.analysis.top_activations.TopActivations` over ``tokens``
            ``(n_windows, seq_len)``; heads: the heads that get a dashboard.
        embedded: the embedded model: its shipped transcoders join the attribution graph.
        prompt: what the graph attributes: text, or ``(1, pos)`` token ids (a model without a tokenizer).

    Returns:
        ``{"training_curves": Path, "dashboards": [Path, ...], "graph_html": Path, "graph_json": Path}``.

    Raises:
        ArgumentError: an empty history (nothing trained); ``where`` not a str / ``os.PathLike``, ``model`` not an
            nnsight model, ``lorsas`` not a ``LorsaSet`` — before anything is written. Attribution's errors for a
            model it cannot attribute (e.g. ``UnsupportedArchitectureError``).
    """
    from ._checks import check_instance
    from .attribution import Graph, attribute, prune, save_neuronpedia
    from .envoy.lorsa_set import LorsaSet
    from .envoy.nnsight_internals import check_traceable
    from .envoy.replacement_model import ReplacementModel
    from .formats.files import check_path
    from .viz import head_dashboard_data, plot_training_curves, render_html, write_dashboard

    check_path(where, "write_pictures", "a directory")  # every argument before the directory is made
    check_traceable(model, "write_pictures")
    check_instance(lorsas, LorsaSet, "write_pictures", "lorsas")
    if not isinstance(history, list) or not history or not all(isinstance(e, dict) and "step" in e for e in history):
        raise ArgumentError("write_pictures: history must be the trainer's non-empty list of logged entries "
                            "(Trainer.history)")
    where = Path(where)
    where.mkdir(parents=True, exist_ok=True)
    curves = plot_training_curves(history, where / "training_curves.png",
                                  title=f"Lorsa of layer {layer}: training ({history[-1]['step']:.0f} steps)"
                                  if history else "")
    analysis = ReplacementModel(model, lorsas=lorsas)
    pages = [write_dashboard(where / "dashboards" / f"L{layer}_H{h}.html",
                             head_dashboard_data(analysis, layer, h, top, tokens, n_contexts=3))
             for h in heads]
    transcoders = None
    if embedded:
        from .assets import default_transcoder_dir
        from .envoy.transcoder_set import TranscoderSet
        from .formats import load

        transcoders = TranscoderSet(model, {int(d.name.split("_")[1]): load(d)
                                            for d in sorted(default_transcoder_dir().glob("layer_*"))})
    graph = attribute(ReplacementModel(model, lorsas=lorsas, transcoders=transcoders),
                      prompt if isinstance(prompt, str) else prompt.reshape(-1),
                      max_feature_nodes=1024, batch_size=64, progress=False,
                      dtype=torch.float32 if embedded else None)  # the tiny model: exact sums cost nothing
    assert isinstance(graph, Graph)  # a prompt, no tracer: the clean graph
    kept = prune(graph)
    html = where / "graph.html"
    render_html(graph, kept, tokenizer=model.tokenizer, path=html,
                title=f"attribution graph: {prompt if isinstance(prompt, str) else 'the first held-out window'!r} "
                      f"(Lorsa of layer {layer})")
    js = save_neuronpedia(graph, where / "graph.json", kept, tokenizer=model.tokenizer, slug="nnsight-lorsa-demo")
    return {"training_curves": curves, "dashboards": pages, "graph_html": html, "graph_json": js}
