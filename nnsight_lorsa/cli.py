"""Command line: ``nnsight-lorsa demo`` (the main job), the package's only command line.

Bad arguments (checked before any work, :func:`~.demo.run_demo`) print a usage error and exit with
status 2; another named error (e.g. a layer outside the model, a training that turns non-finite —
``NonFiniteError``, or batches with too few counted tokens — ``TooFewTokensError``) prints its message on
one line and exits with 1, without a traceback. Ctrl-C during training checkpoints it
(:class:`~.demo.TrainingInterrupted`), prints where and the command that resumes, and exits with 130; Ctrl-C
at another stage (:class:`~.demo.DemoInterrupted`) prints the stage and what was kept, and exits with 130.

The embedded model is rebuilt by ``python scripts/tinymodel.py`` in the source repository (not installed).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import fields

#: what ``nnsight-lorsa --help`` says (plain text: the module docstring above is Sphinx markup)
DESCRIPTION = """\
nnsight-lorsa: Lorsa (low-rank sparse attention) replacements for nnsight models.

  nnsight-lorsa demo          train a Lorsa on one layer of the embedded model (or --model DIR),
                              splice it into a trace, report FVU / L0 / CE, show its top heads and
                              write pictures: head dashboards, an attribution graph, training curves

Exit status: 0 done; 1 a named error (message on one line, e.g. NonFiniteError); 2 bad arguments
(checked before any work); 130 interrupted by Ctrl-C (training checkpointed, resume command printed).
Run "nnsight-lorsa demo --help" for the demo's options."""

#: the help line of each demo option (the DemoConfig field's name), ``%(default)s`` filled in by argparse
HELP = {
    "model_dir": "local Hugging Face model directory (config.json and weights) (default: the embedded "
                 "tinyshakespeare Llama)",
    "text_path": "UTF-8 text file to train and evaluate on, cut into documents on the tokenizer's EOS text "
                 "(else blank lines): one window from each document's start (default: the embedded corpus)",
    "tokens_path": "token ids instead of a text: .npy, .safetensors (input_ids, optional attention_mask) or .pt; "
                   "a 1-D stream is cut into documents at the model's EOS ids, a 2-D array is one document per "
                   "row; one window from each document's start (no tokenizer needed) (default: none)",
    "layer": "the layer whose attention the Lorsa replaces (default: the middle layer)",
    "seq_len": "tokens per window, BOS included (default: %(default)s)",
    "batch_size": "windows per training / evaluation batch (default: %(default)s)",
    "steps": "training steps (default: %(default)s)",
    "n_ov_heads": "Lorsa OV heads, a multiple of the QK heads (default: 8 x d_model, the paper's ratio)",
    "qk_heads_per_mhsa_head": "Lorsa QK heads per MHSA head (default: %(default)s)",
    "top_k": "OV heads active per token (default: %(default)s)",
    "lr": "peak learning rate (default: %(default)s)",
    "heldout_windows": "windows held out for evaluation, at most 20%% of the text (default: %(default)s)",
    "n_show": "top heads shown with their contexts and z-patterns (default: %(default)s)",
    "out_dir": "directory for the trained Lorsa (lorsa/), demo_results.json, the pictures (training_curves.png, "
               "dashboards/, graph.html, graph.json) and, on Ctrl-C, the checkpoint (checkpoint/, "
               "lorsa_interrupted/); one that holds an earlier run's outputs is refused unless --overwrite, or "
               "--resume DIR/checkpoint continues the interrupted run there (default: none; the pictures and an "
               "interrupted run's checkpoint then go to a new temporary directory, printed)",
    "seed": "seed of the Lorsa's initialisation and the batch order (default: %(default)s)",
    "device": "where the model runs: cpu, cuda, cuda:1, or auto (device_map=auto over the visible GPUs) "
              "(default: %(default)s)",
    "dtype": "the model's weights: float32, bfloat16 or float16; the Lorsa trains in fp32 (default: %(default)s)",
    "threads": "torch's CPU threads (torch.set_num_threads): lower it (e.g. to 1) on a machine busy with other "
               "work, where the default can make each step several times slower (default: torch's own)",
    "resume": "continue the training saved by an interrupted run (the checkpoint directory it printed); give "
              "the same other arguments: another --steps, --lr, --batch-size, --seq-len, --seed, --dtype or data "
              "than the checkpoint records is refused (default: start afresh)",
}


METAVAR = {"out_dir": "DIR", "resume": "DIR", "threads": "N", "layer": "L", "n_ov_heads": "N"}


def _parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    import torch

    from .demo import DemoConfig

    parser = argparse.ArgumentParser(prog="nnsight-lorsa", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo}")
    demo = sub.add_parser("demo", help="train a Lorsa on one layer, splice it into a trace, report FVU/L0/CE",
                          description="Train a Lorsa on one layer, splice it into a trace, report FVU / L0 / dead "
                                      "heads / CE and show its top heads. Runs offline on the embedded model and "
                                      "corpus by default.")
    defaults = DemoConfig()
    demo.add_argument("--model", dest="model_dir", metavar="DIR", help=HELP["model_dir"])
    demo.add_argument("--text", dest="text_path", metavar="FILE", help=HELP["text_path"])
    demo.add_argument("--tokens", dest="tokens_path", metavar="FILE", help=HELP["tokens_path"])
    for f in fields(DemoConfig):
        if f.name in ("model_dir", "text_path", "tokens_path", "progress", "pictures", "overwrite"):
            continue
        default = getattr(defaults, f.name)
        kind = int if isinstance(default, int) or f.name in ("layer", "n_ov_heads", "threads") else (
            float if isinstance(default, float) else str)
        help_line = HELP[f.name].replace("torch's own", f"torch's own, here {torch.get_num_threads()}")
        demo.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, type=kind, default=default,
                          metavar=METAVAR.get(f.name, f.name.upper()), help=help_line)
    demo.add_argument("--no-progress", dest="progress", action="store_false",
                      help="no training progress bar (default: shown)")
    demo.add_argument("--no-pictures", dest="pictures", action="store_false",
                      help="write no pictures: no head dashboards, attribution graph or training curves (default: "
                           "written to --out-dir or a new temporary directory, paths printed)")
    demo.add_argument("--overwrite", action="store_true",
                      help="delete the outputs an earlier run left in --out-dir (only the demo's own: lorsa/, "
                           "demo_results.json, the pictures, checkpoint/, lorsa_interrupted/; other files stay) "
                           "before this run writes its own (default: such a directory is refused)")
    return parser, demo


def _resume_command(argv: list[str], checkpoint: str) -> str:
    """``nnsight-lorsa demo`` with ``argv``'s arguments, any ``--resume`` replaced by ``checkpoint``."""
    args, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--resume":
            skip = True
        elif not a.startswith("--resume="):
            args.append(a)
    return shlex.join(["nnsight-lorsa", *args, "--resume", checkpoint])


def main(argv: list[str] | None = None) -> int:
    from .demo import DemoConfig, DemoInterrupted, TrainingInterrupted

    argv = sys.argv[1:] if argv is None else list(argv)
    parser, demo = _parser()
    args = parser.parse_args(argv)
    from .demo import run_demo
    from .errors import ArgumentError, LorsaError

    cfg = DemoConfig(**{f.name: getattr(args, f.name) for f in fields(DemoConfig)})
    try:
        run_demo(cfg)
    except ArgumentError as e:  # checked before any work: argparse's usage error and status
        demo.error(str(e))
    except LorsaError as e:
        print(f"nnsight-lorsa demo: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except TrainingInterrupted as e:
        if e.checkpoint is None:
            print(f"nnsight-lorsa demo: interrupted after step {e.step}: nothing trained, nothing saved",
                  file=sys.stderr)
        else:
            print(f"nnsight-lorsa demo: interrupted after step {e.step}: the checkpoint is in {e.checkpoint}, "
                  f"the Lorsa trained so far in {e.lorsa}\nresume with: {_resume_command(argv, str(e.checkpoint))}",
                  file=sys.stderr)
        return 130
    except DemoInterrupted as e:
        kept = f"the trained Lorsa is in {e.kept}" if e.kept is not None else "no trained Lorsa was saved"
        print(f"nnsight-lorsa demo: interrupted while {e.stage}: {kept}; every file written is whole (none "
              "half-written)", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
