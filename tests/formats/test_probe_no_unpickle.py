"""Round-2 probe guard: no loader in the package may unpickle untrusted input.

Every ``torch.load`` call must pass ``weights_only=True`` and every ``np.load`` call
``allow_pickle=False``; ``pickle.load``/``pickle.loads`` must not appear at all.
"""

from __future__ import annotations

import ast
from pathlib import Path

import nnsight_lorsa

PKG = Path(nnsight_lorsa.__file__).parent


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            base = node.func.value
            name = base.id if isinstance(base, ast.Name) else None
            yield name, node.func.attr, node


def _kw(node: ast.Call, key: str):
    for kw in node.keywords:
        if kw.arg == key and isinstance(kw.value, ast.Constant):
            return kw.value.value
    return None


def unsafe_loads(root: Path) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for base, attr, node in _calls(tree):
            where = f"{path.relative_to(root)}:{node.lineno}"
            if base == "torch" and attr == "load" and _kw(node, "weights_only") is not True:
                bad.append(f"{where} torch.load without weights_only=True")
            if base in {"np", "numpy"} and attr == "load" and _kw(node, "allow_pickle") is not False:
                bad.append(f"{where} np.load without allow_pickle=False")
            if base in {"pickle", "cloudpickle", "dill"} and attr in {"load", "loads"}:
                bad.append(f"{where} {base}.{attr}")
    return bad


def test_no_loader_unpickles():
    assert unsafe_loads(PKG) == []


def test_guard_detects_unsafe_load(tmp_path):
    (tmp_path / "m.py").write_text(
        "import torch, numpy as np, pickle\n"
        "torch.load('a')\nnp.load('b')\npickle.loads(b'')\n"
        "torch.load('c', weights_only=True)\nnp.load('d', allow_pickle=False)\n"
    )
    assert len(unsafe_loads(tmp_path)) == 3
