"""Regenerate the peer fixtures under ``tests/fixtures/peers/<peer>/``: files written by each peer
library's OWN code (tiny random weights), the peer's own outputs on fixed inputs, and the reverse
direction (what our ``save(..., format=<peer>)`` writes, loaded by the peer and compared).

The peers are never dependencies of nnsight-lorsa: each lives in its own virtual environment::

    python -m venv V; V/bin/pip install torch==2.13.0; V/bin/pip install <peer>

with ``<peer>`` one of ``sae-lens`` (saelens), ``eai-sparsify`` (sparsify), ``circuit-tracer``
(circuit_tracer), ``llamascopium`` (llamascopium). Then, from the repository root, in OUR environment
(the one with nnsight-lorsa installed)::

    python scripts/make_peer_fixtures.py --peer saelens --python V/bin/python

Layout: one script per peer, ``scripts/peer_fixtures/<peer>.py``, run as
``<venv>/bin/python scripts/peer_fixtures/<peer>.py OUT_DIR``; it imports only the peer (and torch /
safetensors), never nnsight-lorsa. Steps for ``--peer NAME``:

1. (our env) if this file has a reverse writer for NAME (:data:`REVERSE`), it saves our modules in
   NAME's format under ``OUT_DIR/reverse/<case>/`` with our outputs on fixed inputs
   (``ours_outputs.safetensors``);
2. (peer env) ``scripts/peer_fixtures/NAME.py OUT_DIR`` writes one folder per fixture case
   ``OUT_DIR/<case>/`` (the peer's files + ``reference.safetensors``: the inputs ``x`` and the peer's
   own outputs) and, when ``OUT_DIR/reverse/`` exists, loads each reverse case in the peer and writes
   ``OUT_DIR/reverse/result.json`` (per case: pass/fail and the max relative error).

``tests/formats/test_peer_fixtures_<peer>.py`` loads every case with ``nnsight_lorsa.formats.load``
(format detected) without the peer installed. No pickles are written: safetensors and JSON only.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEER_SCRIPTS = ROOT / "scripts" / "peer_fixtures"
FIXTURES = ROOT / "tests" / "fixtures" / "peers"


def _reverse_saelens(out: Path) -> None:
    from peer_fixtures_reverse import write_reverse  # type: ignore[import-not-found]
    write_reverse("saelens", out)


def _reverse_sparsify(out: Path) -> None:
    from peer_fixtures_reverse import write_reverse  # type: ignore[import-not-found]
    write_reverse("sparsify", out)


def _reverse_circuit_tracer(out: Path) -> None:
    from _reverse_circuit_tracer import write_reverse  # type: ignore[import-not-found]
    write_reverse(out)


#: peer -> (our env) writer of ``OUT_DIR/reverse/<case>/`` (our ``save`` in the peer's format)
REVERSE: dict[str, Callable[[Path], None]] = {"saelens": _reverse_saelens, "sparsify": _reverse_sparsify,
                                               "circuit_tracer": _reverse_circuit_tracer}


def peers() -> list[str]:
    """The peers that have a fixture script (``scripts/peer_fixtures/<peer>.py``)."""
    return sorted(p.stem for p in PEER_SCRIPTS.glob("*.py") if not p.stem.startswith("_"))


def make(peer: str, python: str, out: Path) -> None:
    """Regenerate ``out`` (default ``tests/fixtures/peers/<peer>``) for ``peer`` with the peer's ``python``."""
    script = PEER_SCRIPTS / f"{peer}.py"
    if not script.is_file():
        raise SystemExit(f"no fixture script {script}; peers with one: {peers()}")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    if peer in REVERSE:
        sys.path.insert(0, str(PEER_SCRIPTS))
        REVERSE[peer](out / "reverse")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the peer env never sees our package
    subprocess.run([python, str(script), str(out)], check=True, env=env, cwd=ROOT)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peer", required=True, help=f"one of {peers()}")
    parser.add_argument("--python", required=True, help="the python of a venv with that peer installed")
    parser.add_argument("--out", type=Path, default=None, help="default: tests/fixtures/peers/<peer>")
    args = parser.parse_args(argv)
    make(args.peer, args.python, args.out or FIXTURES / args.peer)


if __name__ == "__main__":
    main()
