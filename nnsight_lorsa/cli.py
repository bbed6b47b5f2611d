"""Command line: ``nnsight-lorsa demo`` (the main job), the package's only command line.

Bad arguments (checked before any work, :func:`~.demo.run_demo`) print a usage error and exit with
status 2; another named error (e.g. a layer outside the model, a training that turns non-finite —
``NonFiniteError``, or batches with too few counted tokens — ``TooFewTokensError``) prints its message on
one line and exits with 1, without a traceback.

The embedded model is rebuilt by ``python scripts/tinymodel.py`` in the source repository (not installed).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields


def main(argv: list[str] | None = None) -> int:
    from .demo import DemoConfig

    parser = argparse.ArgumentParser(prog="nnsight-lorsa", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a Lorsa on one layer, splice it into a trace, report FVU/L0/CE")
    defaults = DemoConfig()
    demo.add_argument("--model", dest="model_dir", help="local Hugging Face model directory (default: embedded)")
    demo.add_argument("--text", dest="text_path",
                      help="text file to train and evaluate on, cut into documents on the tokenizer's EOS text "
                           "(else blank lines): one window from each document's start (default: embedded corpus)")
    for f in fields(DemoConfig):
        if f.name in ("model_dir", "text_path", "progress"):
            continue
        default = getattr(defaults, f.name)
        kind = int if isinstance(default, int) or f.name in ("layer", "n_ov_heads") else (
            float if isinstance(default, float) else str)
        demo.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, type=kind, default=default)
    demo.add_argument("--no-progress", dest="progress", action="store_false")
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
