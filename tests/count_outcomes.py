"""Count the outcome classes of hostile inputs (docs/reliability.md): the listed table and generated tampering.

Two sources, one classification (:func:`hostile_cases.classify`: ``named_error``, ``correct``,
``silent_wrong``, ``unclear_error``, ``raw_exception``, ``state_left``, ``data_lost``):

1. the listed table, ``tests/hostile_cases.py`` (every case written by hand);
2. generated tampering, seeded: for every file of every checkpoint fixture of that table (13 formats and
   kinds, each directory as its writer leaves it, with ``checksums.json`` where the writer puts one), random
   truncations, random byte flips, two tensors of one file swapped, and random edits of a config value
   (a random key, nested ones included, set to a random JSON value or deleted). A tampered directory must
   load the unmodified module (``correct``) or raise our named error naming a file of the checkpoint.

``silent_wrong`` is split: in a file without checksums (the peers' own files), a byte flip that only
changes a tensor's values, or two tensors of the same shape and dtype exchanged, is undetectable by design
(finite values edited, the structure intact; docs/reliability.md, "Known limits") and is counted on its own
line; any other silent wrong result is a bug.

    PYTHONPATH=. python tests/count_outcomes.py                 # both, ~1-2 min on 2 busy cores
    PYTHONPATH=. python tests/count_outcomes.py --per-file 4    # fewer generated cases per file
    PYTHONPATH=. python tests/count_outcomes.py --pytest        # also the property-based tampering tests' totals

Exit status 1 when any case is neither ``named_error`` nor ``correct`` (undetectable value edits aside).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import hostile_cases as hc
import torch

from nnsight_lorsa._atomic import MANIFEST

ROOT = Path(__file__).resolve().parent.parent
#: the property-based (hypothesis) tampering tests, run by ``--pytest``
PROPERTY_TESTS = ("tests/formats/test_hostile_inputs.py", "tests/training/test_activation_cache_tamper.py",
                  "tests/training/test_guards.py")
#: values a generated config edit writes
JSON_VALUES: list[Any] = [None, True, False, 0, -1, 1, 3, 2.5, 1e30, float("nan"), float("inf"), "", "x", "topk",
                          [], [1], {}, {"a": 1}, 10**40]
UNDETECTABLE = "silent_wrong (undetectable)"


def _leaves(doc: Any, prefix: tuple = ()) -> list[tuple]:
    if isinstance(doc, dict) and doc:
        return [p for k, v in doc.items() for p in _leaves(v, (*prefix, k))]
    return [prefix] if prefix else []


def _header_end(data: bytes) -> int:
    """The byte offset where a safetensors file's tensor data starts (0 when the header is unreadable)."""
    if len(data) < 8:
        return 0
    n = int.from_bytes(data[:8], "little")
    return 8 + n if 8 + n <= len(data) else 0


def _mutations(file: Path, rng: random.Random, n: int) -> list[tuple[str, Any, bool]]:
    """``n`` seeded mutations of ``file``: ``(label, mutate(path), values_only)``; ``values_only``: the
    mutation changes only tensor values (bytes after a safetensors header)."""
    data = file.read_bytes()
    out: list[tuple[str, Any, bool]] = []
    start = _header_end(data) if file.suffix == ".safetensors" else 0
    for _ in range(n):
        kind = rng.choice(["truncate", "flip", "flip3", "swap", "edit", "delete_key"])
        if kind == "truncate" and data:
            k = rng.randrange(len(data))
            out.append((f"truncate@{k}", lambda p, k=k: p.write_bytes(p.read_bytes()[:k]), False))
        elif kind in ("flip", "flip3") and data:
            spots = [(rng.randrange(len(data)), rng.randrange(1, 256)) for _ in range(1 if kind == "flip" else 3)]

            def flip(p: Path, spots: list = spots) -> None:
                b = bytearray(p.read_bytes())
                for i, mask in spots:
                    b[i] ^= mask
                p.write_bytes(bytes(b))
            values_only = bool(start) and all(i >= start for i, _ in spots)
            out.append((f"{kind}@{','.join(str(i) for i, _ in spots)}", flip, values_only))
        elif kind == "swap" and file.suffix == ".safetensors":
            pair, same = _swap_pair(file, rng)
            if pair:
                out.append((f"swap:{pair[0]}<->{pair[1]}", lambda p, pair=pair: _swap(p, pair), same))
        elif kind in ("edit", "delete_key") and file.suffix in (".json", ".yaml") and file.name != MANIFEST:
            doc = _read_doc(file)
            leaves = _leaves(doc)
            if not leaves:
                continue
            keys = rng.choice(leaves)
            value = hc.DELETE if kind == "delete_key" else rng.choice(JSON_VALUES)
            edit = hc.edit_yaml if file.suffix == ".yaml" else hc.edit_json
            shown = "deleted" if value is hc.DELETE else json.dumps(value)
            out.append((f"{'.'.join(map(str, keys))}={shown}", lambda p, keys=keys, value=value, edit=edit:
                        edit(p, keys, value), False))
    return out


def _read_doc(file: Path) -> Any:
    if file.suffix == ".yaml":
        import yaml

        return yaml.safe_load(file.read_text()) or {}
    return json.loads(file.read_text())


def _swap_pair(file: Path, rng: random.Random) -> tuple[tuple[str, str] | None, bool]:
    """Two tensors of the file to exchange: of the same shape and dtype (and different values) when some
    are (``same``: the file's structure stays valid), else any two."""
    from safetensors.torch import load_file

    st = load_file(str(file))
    keys = sorted(st)
    if len(keys) < 2:
        return None, False
    same = [(a, b) for i, a in enumerate(keys) for b in keys[i + 1:]
            if st[a].shape == st[b].shape and st[a].dtype == st[b].dtype and not torch.equal(st[a], st[b])]
    if same:
        return rng.choice(same), True
    a, b = rng.sample(keys, 2)
    return (a, b), False


def _swap(file: Path, pair: tuple[str, str]) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(file), framework="pt") as f:
        meta = f.metadata()
    st = load_file(str(file))
    a, b = pair
    st[a], st[b] = st[b], st[a]
    save_file(st, str(file), meta)


def generated_cases(fixtures: dict[str, Path], refs: dict[str, Any], per_file: int, seed: int) -> list[hc.Case]:
    from nnsight_lorsa.formats import load

    cases = []
    for name, base in sorted(fixtures.items()):
        spec = hc.LOADERS.get(name, {})
        files = sorted(p for p in base.rglob("*") if p.is_file())
        for file in files:
            rel = file.relative_to(base)
            rng = random.Random(f"{seed}:{name}:{rel}")
            for label, mutate, values_only in _mutations(file, rng, per_file):
                def run(tmp: Path, base: Path = base, rel: Path = rel, mutate: Any = mutate) -> Any:
                    d = tmp / base.name
                    shutil.copytree(base, d)
                    mutate(d / rel)
                    return load(d)
                needles = ((rel.name, spec.get("config", "?"), spec.get("weights", "?"), MANIFEST, base.name),)
                group = f"generated:{name}:{'manifest' if (base / MANIFEST).is_file() else 'no_manifest'}"
                case = hc.Case(f"{name}/{rel}/{label}", group, run, needles=needles,
                               check=lambda m, ref=refs[name]: hc.same_module(m, ref))
                case.values_only = values_only and not (base / MANIFEST).is_file()  # type: ignore[attr-defined]
                cases.append(case)
    return cases


def run_generated(per_file: int, seed: int) -> list[hc.Record]:
    from nnsight_lorsa.formats import load

    torch.manual_seed(0)
    torch.set_num_threads(1)
    records = []
    with tempfile.TemporaryDirectory() as tmp_root:
        root = Path(tmp_root)
        fixtures = hc.build_fixtures(root / "fixtures")
        refs = {name: load(path) for name, path in fixtures.items()}
        for i, case in enumerate(generated_cases(fixtures, refs, per_file, seed)):
            case_dir = root / f"case{i}"
            case_dir.mkdir()
            record = hc.classify(case, case_dir)
            if record.outcome == "silent_wrong" and getattr(case, "values_only", False):
                record.outcome = UNDETECTABLE
            records.append(record)
            shutil.rmtree(case_dir, ignore_errors=True)
    return records


def counts_table(title: str, records: list[hc.Record]) -> str:
    counts = Counter(r.outcome for r in records)
    order = [*hc.OUTCOMES[:3], UNDETECTABLE, *hc.OUTCOMES[3:]]
    lines = [f"{title}: {len(records)} cases", "| outcome | cases |", "|---|---|"]
    lines += [f"| {o} | {counts.get(o, 0)} |" for o in order if o != UNDETECTABLE or counts.get(o)]
    return "\n".join(lines)


def run_property_tests() -> str:
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *PROPERTY_TESTS],
                          cwd=ROOT, capture_output=True, text=True)
    tail = [line for line in done.stdout.splitlines() if " passed" in line or " failed" in line]
    return f"property-based tampering tests ({', '.join(PROPERTY_TESTS)}): {tail[-1] if tail else done.stdout[-500:]}"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--per-file", type=int, default=12, help="generated mutations per file of each fixture")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated mutations")
    p.add_argument("--skip-table", action="store_true", help="generated cases only")
    p.add_argument("--pytest", action="store_true", help="also run the property-based tampering tests")
    p.add_argument("--json", help="write every record (both sources) to this file")
    args = p.parse_args(argv)
    table = [] if args.skip_table else hc.run_all()
    generated = run_generated(args.per_file, args.seed)
    if not args.skip_table:
        print(counts_table("listed table (tests/hostile_cases.py)", table), end="\n\n")
    print(counts_table(f"generated tampering (seed {args.seed}, {args.per_file} per file)", generated), end="\n\n")
    print(counts_table("all", table + generated))
    bad = [r for r in table + generated if r.outcome not in (*hc.PASS, UNDETECTABLE)]
    if bad:
        print("\nnot passing:\n" + "\n".join(f"  {r.outcome:14s} {r.id}: {r.detail}" for r in bad))
    if args.pytest:
        print("\n" + run_property_tests())
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in table + generated], indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
