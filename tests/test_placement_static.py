"""Every tensor the package creates takes its device from an argument or an existing tensor (issue 21).

A ``torch.zeros(n)`` without ``device=`` lands on the CPU: harmless on a CPU machine, a device-mismatch
``RuntimeError`` (or a silent host round trip) once the model is on a GPU, which no CPU test can see. So
every call of a torch tensor factory in ``nnsight_lorsa/`` must say where its tensor goes: a ``device=``
keyword (``device=x.device``, ``device=HOST`` for host-side tables), a ``**kw`` that carries one, or an
immediate ``.to(...)``. ``*_like`` factories inherit the device and are not factories here.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "nnsight_lorsa"

FACTORIES = {"zeros", "ones", "empty", "full", "arange", "randn", "rand", "randint", "tensor", "as_tensor",
             "linspace", "logspace", "eye", "randperm", "Generator", "normal", "empty_strided", "tril_indices",
             "triu_indices", "bartlett_window", "hann_window"}


def _says_where(call: ast.Call, parent: ast.AST | None) -> bool:
    if any(k.arg == "device" or k.arg is None for k in call.keywords):  # device=… or **kw
        return True
    # torch.as_tensor(x).to(device=…) / .to(tensor) / .to(device)
    return (isinstance(parent, ast.Attribute) and parent.attr == "to" and parent.value is call)


def unplaced_factories(root: Path = PACKAGE) -> list[str]:
    """``file:line: torch.<factory>`` for each factory call that does not say where its tensor goes."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FACTORIES
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                    and not _says_where(node, parents.get(node))):
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}: torch.{node.func.attr}")
    return found


def test_every_tensor_factory_says_where_its_tensor_goes():
    found = unplaced_factories()
    assert not found, "tensor factories without device= (add device=x.device, or device=HOST for a " \
                      "host-side table):\n" + "\n".join(found)


def test_the_check_finds_an_unplaced_factory(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(
        "import torch\n"
        "a = torch.zeros(3)\n"                              # found
        "b = torch.zeros(3, device=x.device)\n"             # placed
        "c = torch.ones(2, **kw)\n"                          # placed by **kw
        "d = torch.as_tensor(v).to(device=t.device)\n"     # placed by .to
        "e = torch.zeros_like(t)\n")                        # inherits
    assert unplaced_factories(tmp_path / "pkg") == ["pkg/m.py:2: torch.zeros"]
