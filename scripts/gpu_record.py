"""Merge the files a GPU session's ``scripts/gpu_session.sh`` wrote to ``$OUT`` into ``benchmarks/results``.

    python scripts/gpu_record.py <folder>            # the folder $OUT came back as
    python scripts/gpu_record.py <folder> --note "after the host-overhead round" --results /tmp/results

What it writes, ``<GPU>`` the device's name with every non-alphanumeric character as ``_`` (as
``benchmarks/gpu_scale.py`` names its files: ``NVIDIA_H200``):

* ``gpu_suite_<GPU>.json`` from ``gpu_suite.xml`` (pytest's JUnit XML): device, versions, date, commit,
  command, counts (tests, failures, errors, skipped, seconds), ``cases`` (the passed ones as
  ``<test file>::<test>[<params>]``), ``failed`` (with the first line of each message) and ``skipped_cases``;
  the record it replaces moves to ``history`` (without its case list).
* ``gpu_scale_<scale>_<GPU>.json`` from each ``gpu_scale_*.json`` (the benchmark's own JSON): parts (a), (b),
  (c) replace the file's (the former value moves to ``history`` with its date); (d)'s rows replace the rows of
  the same token count in their list — ``d_attribution`` for the resident run with the Lorsa on the scale's
  layer, ``d_attribution_offload_all_lorsas`` for the offloaded paper Lorsa on every layer, and so on
  (:func:`d_key`), whose run settings go to ``<key>_meta``; each command is appended to ``command``. A row is
  kept whole: its ``phase_peaks`` (the device peak inside each phase) and, from a ``--memory-snapshot`` run (its own
  key, ``..._memory_snapshot``), its ``memory_snapshot`` (the live allocations at the peak by code location).
* ``lorsa_forward_variants_<scale>_<GPU>.json`` from ``lorsa_forward_variants.json`` (the benchmark's own JSON):
  replaces the file, the former record (its notes included) appended to ``history``.
* ``offload_placement_rate_<GPU>.json`` from ``offload_placement_rate.json`` (step ``pin``) and
  ``zpre_head_product_<GPU>.json`` from ``zpre_head_product.json`` (step ``zprod``) and ``gathered_nodes_<GPU>.json``
  from ``gathered_nodes.json`` (step ``gnodes``): the same way.
* ``gpu_session_<GPU>.json``: every session's ``session.json`` (commit, versions, each step's exit status and
  seconds; a step stopped by its timeout has ``timed_out``), appended.

The folder holds either those files or ``session_files.tar``, the archive gpu_session.sh packs them into (the
device returns at most 8 files; a session of five steps writes 14): it is read from the archive then.

A session run with ``GPU_SESSION_SMALL=1`` (CPU scale) is refused unless ``--results`` names another folder: its
numbers are a check of the script, not measurements to record. Standard library only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
#: parts of gpu_scale's JSON that one run measures whole (replaced, the former kept in ``history``)
PARTS = ("a_forward_vs_floor", "b_replace_vs_trace", "c_training", "c_training_tf32", "c_training_bfloat16_masters")


def safe_name(device: str) -> str:
    """The device's name as gpu_scale puts it in file names."""
    return "".join(c if c.isalnum() else "_" for c in device)


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def dump(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1) + "\n")


def suite_record(xml_path: Path, session: dict[str, Any], date: str, note: str | None) -> dict[str, Any]:
    """The ``gpu_suite_<GPU>.json`` record of one JUnit XML file."""
    root = ET.parse(xml_path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    passed, failed, skipped = [], [], []
    for case in (c for s in suites for c in s.iter("testcase")):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        if problem is not None:
            lines = (problem.get("message") or problem.text or "").strip().splitlines()
            failed.append({"case": name, "message": lines[0][:300] if lines else ""})
        elif case.find("skipped") is not None:
            skipped.append(name)
        else:
            passed.append(name)

    def total(key: str) -> int:
        return sum(int(s.get(key, 0)) for s in suites)

    step = session.get("steps", {}).get("suite", {})
    record = {"device": session.get("device"), "torch": session.get("torch"),
              "transformers": session.get("transformers"), "nnsight": session.get("nnsight"), "date": date,
              "commit": session.get("commit"), "command": step.get("command", "python -m pytest -m gpu"),
              "tests": total("tests"), "failures": total("failures"), "errors": total("errors"),
              "skipped": total("skipped"), "seconds": round(sum(float(s.get("time", 0)) for s in suites), 3)}
    if note:
        record["note"] = note
    if step.get("timed_out"):
        record["timed_out"] = True
    record.update({"cases": sorted(passed), "failed": failed, "skipped_cases": sorted(skipped)})
    return record


def merge_suite(target: Path, record: dict[str, Any]) -> None:
    old = load(target)
    history = old.pop("history", [])
    if old:
        cases = old.pop("cases", [])
        history.append({**old, "passed_cases": len(cases)})
    dump(target, {**record, "history": history})


def d_key(run: dict[str, Any]) -> str:
    """Where a run's (d) rows go: ``d_attribution`` (resident, the Lorsa on the scale's layer), with
    ``_offload`` if offloaded and ``_all_lorsas`` / ``_lorsas_<layers>`` for other Lorsa layers, and
    ``_rows_<n>`` for a feature budget other than 64 (``--attr-rows``), ``_memory_snapshot`` for a run under
    ``--memory-snapshot`` (its timed call records every allocation: its seconds are not the other rows')."""
    shapes = run.get("shapes", {})
    layers = run.get("d_lorsa_layers", [shapes.get("layer")])
    key = "d_attribution" + ("_offload" if run.get("d_offload") else "")
    if layers == list(range(shapes.get("n_layers", -1))):
        key += "_all_lorsas"
    elif layers != [shapes.get("layer")]:
        key += "_lorsas_" + "_".join(str(x) for x in layers)
    if run.get("d_rows", 64) != 64:  # another feature budget than the default's: rows not comparable with its
        key += f"_rows_{run['d_rows']}"
    if run.get("d_memory_snapshot"):
        key += "_memory_snapshot"
    return key


def merge_scale(target: Path, run: dict[str, Any], date: str, commit: str | None, note: str | None) -> list[str]:
    """Merge one gpu_scale JSON into ``target``; returns the keys it set."""
    out = load(target)
    if not out:
        out = {k: run.get(k) for k in ("scale", "shapes", "device", "dtype", "torch")}
        out["command"] = []
    history = out.setdefault("history", [])
    commands = out["command"] if isinstance(out.get("command"), list) else [out["command"]]
    command = run.get("command", "")
    commands.append(f"{command}   # {date}" + (f", {commit}" if commit else ""))
    out["command"] = commands
    out["torch"], out["dtype"] = run.get("torch", out.get("torch")), run.get("dtype", out.get("dtype"))
    stamp = {"date": date, **({"commit": commit} if commit else {})}
    changed = []
    for part in (*PARTS, "lorsa_bytes"):
        if part not in run:
            continue
        if part in out and part != "lorsa_bytes":
            history.append({"key": part, "value": out[part], "date": out.get("date")})
        out[part] = {**run[part], **stamp} if isinstance(run[part], dict) else run[part]
        changed.append(part)
    rows = run.get("d_attribution") or []
    if rows:
        key = d_key(run)
        kept = {row["tokens"]: row for row in out.get(key, [])}
        for row in rows:
            if row["tokens"] in kept:
                history.append({"key": key, "value": kept[row["tokens"]], "date": kept[row["tokens"]].get("date")})
            kept[row["tokens"]] = {**row, **stamp}
        out[key] = [kept[t] for t in sorted(kept)]
        out[f"{key}_meta"] = {"lorsa_layers": run.get("d_lorsa_layers"), "offload": run.get("d_offload", False),
                              "module_bytes": run.get("d_module_bytes"), "cap_gb": run.get("cap_gb")}
        changed.append(key)
    if changed:
        out["date"] = date
        if note:
            out.setdefault("notes", []).append(f"{date}: {note}")
    dump(target, out)
    return changed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path, help="the files gpu_session.sh wrote to $OUT")
    p.add_argument("--results", type=Path, default=RESULTS, help="where to merge them (default benchmarks/results)")
    p.add_argument("--note", default=None, help="a note stored with the records")
    p.add_argument("--date", default=datetime.date.today().isoformat())
    args = p.parse_args(argv)
    folder: Path = args.folder
    archive = folder / "session_files.tar"
    if archive.is_file():  # gpu_session.sh packs its files (the device returns at most 8): read them from it
        scratch = tempfile.TemporaryDirectory()
        with tarfile.open(archive) as tar:
            tar.extractall(scratch.name, filter="data")  # refuses links and paths outside the folder
        folder = Path(scratch.name)
    session = load(folder / "session.json")
    if session.get("small") and args.results.resolve() == RESULTS.resolve():
        print("a GPU_SESSION_SMALL=1 session (CPU scale) checks the script: pass --results <another folder> "
              "to record it", file=sys.stderr)
        return 2
    runs = {path: load(path) for path in sorted(folder.glob("gpu_scale_*.json"))}
    device = session.get("device") or next((r.get("device") for r in runs.values() if r.get("device")), None)
    if not device or device == "unknown":
        print(f"{folder}: no device name (session.json or a gpu_scale JSON)", file=sys.stderr)
        return 2
    session["device"] = device
    name, written = safe_name(device), []
    if (folder / "gpu_suite.xml").is_file():
        target = args.results / f"gpu_suite_{name}.json"
        merge_suite(target, suite_record(folder / "gpu_suite.xml", session, args.date, args.note))
        written.append(f"{target}")
    for path, run in runs.items():
        if not run:
            continue
        target = args.results / f"gpu_scale_{run.get('scale', '8b')}_{name}.json"
        keys = merge_scale(target, run, args.date, session.get("commit"), args.note)
        written.append(f"{target} <- {path.name}: {', '.join(keys)}")
    for source, stem in (("lorsa_forward_variants.json", None), ("offload_placement_rate.json",
                                                                  "offload_placement_rate"),
                         ("zpre_head_product.json", "zpre_head_product"), ("gathered_nodes.json", "gathered_nodes")):
        record = load(folder / source)
        if not record or "skipped" in record:
            continue
        stem = stem or f"lorsa_forward_variants_{record.get('scale', '8b')}"
        target = args.results / f"{stem}_{name}.json"
        former = load(target)
        history = former.pop("history", [])
        if former:
            history.append(former)  # the whole former record, its notes included
        dump(target, {**record, "date": args.date, "commit": session.get("commit"),
                      **({"note": args.note} if args.note else {}), "history": history})
        written.append(f"{target} <- {source}")
    if session:
        target = args.results / f"gpu_session_{name}.json"
        log = load(target)
        entry = {**session, "date": args.date, **({"note": args.note} if args.note else {})}
        log.setdefault("sessions", []).append(entry)
        dump(target, log)
        written.append(str(target))
    print("\n".join(written) or "nothing to record")
    return 0


if __name__ == "__main__":
    sys.exit(main())
