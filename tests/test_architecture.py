"""The package's layering (docs/architecture.md): imports point one way, and there are no import cycles."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "nnsight_lorsa"

#: rank of each top-level part: a module may import only from parts of a lower rank (or its own part)
RANKS = {
    "errors": 0, "_typing": 0, "_repr": 0, "_version": 0, "assets": 0, "_progress": 0, "_memory": 0,
    "_placement": 0.5,  # imports only errors (0); the replacement modules (1) read its offload marker
    "_checks": 0.5,  # imports only errors (0): its checks raise ArgumentError
    "modules": 1, "_atomic": 1, "ndif_rules": 1, "server_version": 1, "adapters": 2, "formats": 3,
    "envoy": 4,
    "attribution": 5, "patching": 5, "training": 5, "remote": 6, "sparse_attention": 6,
    "analysis": 6, "viz": 7, "demo": 8, "cli": 9, "__init__": 10,
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Modules of the package that ``path`` imports (anywhere in the file, function bodies included)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for guard in ast.walk(tree) if isinstance(guard, ast.If)
                   and isinstance(guard.test, ast.Name) and guard.test.id == "TYPE_CHECKING"
                   for stmt in guard.body for n in ast.walk(stmt)}  # annotations only: not an import at run time
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if target.startswith("nnsight_lorsa"):
                out.add(target)
                out.update(f"{target}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("nnsight_lorsa"))
    return out


def _part(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


FILES = sorted(PACKAGE.rglob("*.py"))
MODULES = {_module_name(p) for p in FILES}


def test_every_part_has_a_rank():
    assert {_part(_module_name(p)) for p in FILES} <= set(RANKS)


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down_the_layers(path):
    me = _part(_module_name(path))
    bad = [m for m in _imports(path) if m in MODULES and _part(m) != me and RANKS[_part(m)] >= RANKS[me]]
    assert not bad, f"{path.relative_to(PACKAGE)} ({me}, rank {RANKS[me]}) imports upward or sideways: {sorted(bad)}"


def test_no_import_cycles():
    graph = {}
    for p in FILES:
        name = _module_name(p)
        graph[name] = {m for m in _imports(p) if m in MODULES and m != name}
    seen: dict[str, int] = {}

    def visit(n: str, stack: list[str]) -> None:
        seen[n] = 1
        for m in graph[n]:
            if m.startswith(n + "."):  # a package importing its own submodules is not a cycle
                continue
            if seen.get(m) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*stack, n, m]))
            if m not in seen:
                visit(m, [*stack, n])
        seen[n] = 2

    for n in graph:
        if n not in seen:
            visit(n, [])


def test_the_top_level_is_small_and_tab_completes():
    import nnsight_lorsa

    assert len(nnsight_lorsa.__all__) <= 20
    assert set(nnsight_lorsa.__all__) <= set(dir(nnsight_lorsa))  # the lazy names too
    for name in nnsight_lorsa.__all__:
        assert getattr(nnsight_lorsa, name) is not None
    with pytest.raises(AttributeError):
        nnsight_lorsa.Resolver  # noqa: B018
    import nnsight  # noqa: F401  (nnsight mounts a `save` on every object: ours must still win)

    from nnsight_lorsa.formats.registry import load, save

    assert nnsight_lorsa.save is save and nnsight_lorsa.load is load


SUBPACKAGES = ["adapters", "analysis", "attribution", "envoy", "formats", "modules", "patching", "sparse_attention",
               "training", "viz"]


@pytest.mark.parametrize("name", SUBPACKAGES)
def test_every_subpackage_has_a_docstring_and_an_all(name):
    import importlib

    module = importlib.import_module(f"nnsight_lorsa.{name}")
    assert len((module.__doc__ or "").split()) >= 15, f"{name}: no real docstring"
    assert module.__all__ and all(hasattr(module, n) for n in module.__all__)
