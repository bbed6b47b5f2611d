"""Our ``attribute`` (transcoder / CLT attribution graphs) against circuit-tracer 0.5.0's own ``attribute``, across
model families and transcoder kinds, on the same models, files and tokens.

What it checks, per case (``cases.py``: groups ``base``, ``more``, ``g3``, ``g3b``, ``g3c``, ``edge``, ``bf16``, ``ui``,
``budget`` and the ``*_p`` copies with the pad token off BOS; 125 cases in all):

1. (circuit-tracer's venv, ``their_side.py``) a random tiny Hugging Face model — Llama, Gemma-2 (soft-capping,
   sliding windows), Gemma-3 (local / global RoPE bases, QK-norm), Qwen2, Qwen3, GPT-2; 3-4 layers, d_model 32-64,
   random norm gains and biases — and the same model as circuit-tracer's TransformerLens replacement model (its
   logits must equal the model's to 1e-4 before anything else runs); random transcoders made with circuit-tracer's
   own classes (per-layer sets: ReLU, JumpReLU with or without negative thresholds, TopK, skip connections, mixed
   activations; CLTs: ReLU, JumpReLU), written by circuit-tracer (float32 or bfloat16 files) and read back by its
   loaders; hooks ``mlp.hook_in``/``mlp.hook_out``, ``ln2.hook_normalized``, ``hook_resid_mid``, ``hook_mlp_out``
   in several pairings; circuit-tracer's ``attribute`` on 2-12 tokens, with its logit settings (``max_n_logits``,
   ``desired_logit_prob``, explicit ``attribution_targets``), batch sizes and feature budgets
   (``max_feature_nodes``, ``update_interval`` 1-7).
2. (our environment, ``our_side.py``) the same model with nnsight, the same files with our ``TranscoderSet`` /
   ``CLTSet.from_pretrained`` (TopK: from circuit-tracer's raw tensors), our ``attribute(..., zero_positions=1)``
   with the same settings. Group ``variants``: also our cached engine, ``memory="lean"``, ``attribute(tracer=...)``,
   batch 3 and a call after calls on other prompts, each against circuit-tracer's graph.
3. (``compare.py``) per case: the node sets (the feature set of a full graph; under a budget the features whose
   rows were computed), activations (÷ circuit-tracer's largest), error-node norms (our error node's activation
   against the norm of circuit-tracer's error vector, ÷ its largest), the logit targets and their probabilities
   (÷ the largest), every edge among the shared nodes (max |diff| ÷ circuit-tracer's largest edge), and the
   row-sum closure of both graphs (below). Group ``prune``: our ``prune`` at (0.8, 0.98) and (0.5, 0.9) and
   ``graph_scores`` against circuit-tracer's ``prune_graph`` and ``compute_graph_scores`` on the same graphs.

Node mapping, by ``(kind, layer, pos, index)``: our transcoder feature ``(L, p, f)`` ↔ circuit-tracer's selected
feature ``(L, p, f)``; our MLP error ``(L, p)`` ↔ its error node ``n_f + L·n_pos + p``; embedding ``p`` ↔ its
embedding ``p``; logit of token ``t`` ↔ its logit of ``t``. Left out: our bias nodes (circuit-tracer has none) and
the MLP error nodes at position 0 (circuit-tracer's carry nothing there; ours, with ``zero_positions=1``, carry
that position's MLP output).

Conventions (the same on both sides unless said): no feature nodes at position 0 (``zero_positions=1``, as
circuit-tracer); attention patterns and norm scales frozen; logit targets as circuit-tracer picks them (at most
``max_n_logits`` by probability up to ``desired_logit_prob``), the target being the mean-subtracted logit; one
thread per process. Row sums (each computed feature row and logit row, ``|Σ edges − value|`` ÷ the row's mass): ours
close (bias nodes; under a budget the ``residual``, the unkept features' share) to fp32 rounding, ~1e-6, and to
~2e-4 on the models whose BOS embedding is the all-zero padding row (pad token = BOS: the groups without ``_p``, GPT-2
aside), where position 0's frozen norm scale 1/√eps scales the rounding up; circuit-tracer's rows close as well once
our bias and position-0 error edges and our residual are added to them (``row_sums.theirs_closed``) — a gap left
there is a share of a value that no node of circuit-tracer's carries.

Three known differences, where ours is right (each ``known`` case is re-run aligned, ``<case>_aligned``, same
seed, and the aligned run must agree):

- **GPT-2's embedding node** (``gpt2_embedding``): ours is ``wte[token] + wpe[pos]``, what the residual stream starts
  from; circuit-tracer's is ``hook_embed`` (the token embedding) alone, and no node of its graph carries the position
  embedding, so its rows miss that share (its closed rows off by 0.63-1.02 of the row mass, edges by 0.39-0.55 of
  the largest). Aligned: ``wpe`` zeroed.
- **Gemma-3's RoPE tables** (``gemma3_rope``): circuit-tracer's ``_deduplicate_attention_buffers`` keeps one
  ``rotary_sin``/``rotary_cos`` (the last layer's) for all layers, so where local and global layers use different
  bases (``rope_local_base_freq`` ≠ ``rope_theta``, as in every released Gemma-3) its replacement model computes
  other logits than the model (``theirs.logits_vs_model_rel.after_configure`` 0.05-0.12 here, < 2e-6 before); ours
  equal the model's. Aligned: that sharing switched off (``ct_no_dedup``); group ``g3b`` (one base for all layers)
  and ``g3c`` (sharing off) agree too.
- **Per-layer sets mixing skip and no-skip layers** (``mixed_skip``): circuit-tracer's ``TranscoderSet`` takes layer
  0's ``W_skip is not None`` for the whole set (``theirs.set_skip_connection`` against ``skip_per_layer``), so the
  other layers' skip paths are not attributed through their inputs (edges off by ~0.2 of the largest; its closed
  rows off by 5e-4 to 0.12 of the row mass); ours attributes each layer's skip as its file says. Aligned:
  circuit-tracer reads the same set with an all-zero ``W_skip`` on the layers without one (``ct_pad_skip``; ours
  reads the mixed files).

A case is as expected (``status``) when ``agree``: equal node sets and logit targets, activations within
``TOL["activation"]`` (tiny activations of 2-token prompts reach 3e-5), error norms, logit probabilities and edges
within 1e-5, both row-sum closures within ``TOL["row_sum"]`` (``TOL["row_sum_zero_bos"]`` on the zero-BOS models);
``differs_as_expected``: a known-difference case whose graph differs by more than ``DIFFERS`` (edges, or the node /
target sets, or circuit-tracer's logits against the model's) while our rows close (GPT-2: with the same features and
values, circuit-tracer's closed rows off by more than ``DIFFERS``; Gemma-3: circuit-tracer's logits off the model's).
Prune: every node circuit-tracer keeps is kept by ours (ours may keep 1-2 more: the bias nodes take part in each
row's normalisation); the scores are reported.

Installing the peer (its own venv; never a dependency of nnsight-lorsa)::

    python -m venv V; V/bin/pip install torch==2.13.0 circuit-tracer==0.5.0 'transformers>=4.57,<4.58'

Running (our environment, nnsight-lorsa installed; offline: ``HF_HUB_OFFLINE=1`` for every step; one thread per
process; cases run one after another)::

    python scripts/peer_checks/circuit_tracer_attribution/run.py --python V/bin/python --work DIR \\
        [--groups default|all|base,more,...,prune,variants | --cases NAME,...] \\
        [--out benchmarks/results/attribution_vs_circuit_tracer_families.json]

``--groups default`` (the default): 35 cases across every family, kind and option, the three known differences
with their aligned re-runs (39 graphs), pruning on 3 graphs and the variants on 1 (6 minutes on 2 slow cores);
``all``: every group, ``prune`` and ``variants`` (125 cases, 134 graphs; 23 minutes); ``--cases``: named cases.
``DIR/<case>/`` keeps both sides' files and logs (``theirs.log``, ``ours.log``); the exit status is 0 when every case
is as expected. Tensors pass between the processes as safetensors, metadata as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any

import torch
from cases import (
    CASES,
    DEFAULT_CASES,
    DEFAULT_PRUNE,
    DEFAULT_VARIANTS,
    GROUPS,
    KNOWN,
    PRUNE_CASES,
    VARIANT_CASES,
    VARIANTS,
    aligned,
    known_difference,
)
from compare import compare_graph, compare_prune, row_sums

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "attribution_vs_circuit_tracer_families.json"
#: an agreeing case: max relative differences (see the docstring for the scales); row sums of a model whose BOS
#: embedding is the zero padding row (pad token = BOS, not GPT-2): ``row_sum_zero_bos``
TOL = {"activation": 1e-4, "error_norm": 1e-5, "logit_prob": 1e-5, "adjacency": 1e-5, "row_sum": 1e-5,
       "row_sum_zero_bos": 1e-3}
#: a known difference must show above this
DIFFERS = 1e-3
META_GROUPS = ("default", "all", "prune", "variants")
HEADLINE = ("same_nodes", "same_logit_targets", "activation_rel", "error_norm_rel", "logit_prob_rel",
            "adj_maxdiff_over_maxedge", "row_sum_ours", "row_sum_theirs_closed", "theirs_logits_vs_model_rel")


def build_plan(groups: list[str], names: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Case name -> ``{group, spec, prune, variants, known, aligned_of}`` in run order (``names``: those cases, in
    place of ``groups``); every known-difference case followed by its aligned re-run."""
    plan: dict[str, dict[str, Any]] = {}

    def add(name: str, prune: bool = False, variants: tuple[str, ...] = ()) -> None:
        group, spec = CASES[name]
        e = plan.setdefault(name, {"group": group, "spec": spec, "prune": False, "variants": []})
        e["prune"] |= prune
        e["variants"] += [v for v in variants if v not in e["variants"]]

    for name in names or ():
        add(name, prune=name in PRUNE_CASES)
    for g in groups if not names else ():
        if g in ("all", "prune"):
            for name in PRUNE_CASES:
                add(name, prune=True)
        if g in ("all", "variants"):
            for name in VARIANT_CASES:
                add(name, variants=VARIANTS)
        if g == "all":
            for cases in GROUPS.values():
                for name in cases:
                    add(name)
        elif g == "default":
            for name in DEFAULT_CASES:
                add(name, prune=name in DEFAULT_PRUNE, variants=VARIANTS if name in DEFAULT_VARIANTS else ())
        elif g in GROUPS:
            for name in GROUPS[g]:
                add(name)
    out: dict[str, dict[str, Any]] = {}
    for name, e in plan.items():
        known = known_difference(e["spec"])
        out[name] = {**e, "known": known, "aligned_of": None}
        if known:
            out[f"{name}_aligned"] = {"group": e["group"], "spec": aligned(e["spec"]), "prune": False, "variants": [],
                                      "known": None, "aligned_of": name}
    return out


def run_side(cmd: list[str], log: Path, env: dict[str, str]) -> tuple[bool, float]:
    """Run one side, stdout and stderr to ``log``; (exit status 0, seconds)."""
    t0 = time.time()
    with log.open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=log.parent).returncode
    return rc == 0, time.time() - t0


def tail(log: Path, n: int = 12) -> list[str]:
    return log.read_text(errors="replace").splitlines()[-n:]


def headline(res: dict[str, Any]) -> dict[str, Any]:
    """The numbers a case is judged by."""
    g, rs = res["graph"], res["row_sums"]
    return {"same_nodes": g.get("same_feature_set", g.get("same_visited_set")),
            "same_logit_targets": g["same_logit_targets"], "activation_rel": g.get("activation_rel"),
            "error_norm_rel": g["error_norm_rel"], "logit_prob_rel": g.get("logit_prob_rel"),
            "adj_maxdiff_over_maxedge": g["adj_maxdiff_over_maxedge"], "row_sum_ours": rs["ours"],
            "row_sum_theirs_closed": rs["theirs_closed"],
            "theirs_logits_vs_model_rel": res["theirs"]["logits_vs_model_rel"]["after_configure"]}


def zero_bos(spec: dict[str, Any]) -> bool:
    """Whether the case's model has an all-zero BOS embedding: Hugging Face zeroes the padding row, and the pad token
    is the BOS token unless ``pad`` is set (GPT-2 has no padding row). Its frozen norm scale at position 0 is then
    1/√eps, which scales up fp32 rounding there: rows close to ~1e-4 of their mass instead of ~1e-6."""
    return spec["family"] != "gpt2" and not spec.get("pad")


def within(h: dict[str, Any], keys: tuple[str, ...], row_tol: float = TOL["row_sum"]) -> list[str]:
    """The tolerances of ``keys`` (``TOL`` names) that ``h`` misses."""
    field = {"activation": "activation_rel", "error_norm": "error_norm_rel", "logit_prob": "logit_prob_rel",
             "adjacency": "adj_maxdiff_over_maxedge"}
    bad = [k for k in keys if k in field and (h[field[k]] is None or h[field[k]] > TOL[k])]
    if "row_sum" in keys and h["row_sum_theirs_closed"] > row_tol:
        bad.append("row_sum_theirs")
    return bad


def verdict(known: str | None, h: dict[str, Any], spec: dict[str, Any]) -> str:
    """``agree`` / ``differs_as_expected`` when the case met its expectation, else ``UNEXPECTED: <why>``."""
    row_tol = TOL["row_sum_zero_bos"] if zero_bos(spec) else TOL["row_sum"]
    if h["row_sum_ours"] > row_tol:
        return "UNEXPECTED: our rows do not close"
    if known is None:
        bad = [] if h["same_nodes"] and h["same_logit_targets"] else ["node / target sets"]
        bad += within(h, ("activation", "error_norm", "logit_prob", "adjacency", "row_sum"), row_tol)
        return "agree" if not bad else "UNEXPECTED: " + ", ".join(bad)
    differs = (not h["same_nodes"] or not h["same_logit_targets"] or h["adj_maxdiff_over_maxedge"] > DIFFERS
               or h["theirs_logits_vs_model_rel"] > DIFFERS)
    if not differs:
        return f"UNEXPECTED: no {known} difference"
    if known == "gemma3_rope" and h["theirs_logits_vs_model_rel"] <= DIFFERS:
        return "UNEXPECTED: circuit-tracer's logits equal the model's"
    if known in ("gpt2_embedding", "mixed_skip"):  # the same features and values, other edges
        bad = [] if h["same_nodes"] and h["same_logit_targets"] else ["node / target sets"]
        bad += within(h, ("activation", "logit_prob"))
        if known == "gpt2_embedding" and h["row_sum_theirs_closed"] <= DIFFERS:  # wpe's share on no node
            bad.append("circuit-tracer's rows close")
        if bad:
            return "UNEXPECTED: " + ", ".join(bad)
    return "differs_as_expected"


def run_case(name: str, e: dict[str, Any], python: str, work: Path, env: dict[str, str],
             their_env: dict[str, str]) -> dict[str, Any]:
    case = work / name
    if case.exists():
        shutil.rmtree(case)
    case.mkdir(parents=True)
    out: dict[str, Any] = {"group": e["group"], "spec": e["spec"],
                           "expect": f"differs:{e['known']}" if e["known"] else "agree"}
    if e["aligned_of"]:
        out["aligned_of"] = e["aligned_of"]
    prune = ["--prune"] if e["prune"] else []
    ok, out["theirs_s"] = run_side([python, str(HERE / "their_side.py"), str(case), json.dumps(e["spec"]), *prune],
                                   case / "theirs.log", their_env)
    if not ok:
        return out | {"status": "error: their side failed", "as_expected": False, "log_tail": tail(case / "theirs.log")}
    ok, out["ours_s"] = run_side([sys.executable, str(HERE / "our_side.py"), str(case), *prune], case / "ours.log",
                                 env)
    if not ok:
        return out | {"status": "error: our side failed", "as_expected": False, "log_tail": tail(case / "ours.log")}
    theirs = json.loads((case / "theirs.json").read_text())
    ours = json.loads((case / "ours.json").read_text())
    out["theirs"] = {k: theirs[k] for k in ("n_active", "n_selected", "logits_vs_model_rel", "attribute_cpu_s",
                                            "skip_per_layer", "set_skip_connection") if k in theirs}
    if "refused" in ours:
        return out | {"status": f"UNEXPECTED: refused ({ours['refused']['error']})", "as_expected": False,
                      "refusal": ours["refused"]}
    out["ours"] = {"summary": ours["summary"], "model_logits_vs_their_env_rel": ours["model_logits_vs_their_env_rel"]}
    res = {"theirs": theirs, "graph": compare_graph(case), "row_sums": row_sums(case)}
    out["headline"] = headline(res)
    out["graph"], out["row_sums"] = res["graph"], res["row_sums"]
    out["status"] = verdict(e["known"], out["headline"], e["spec"])
    out["as_expected"] = not out["status"].startswith("UNEXPECTED")
    if e["prune"]:
        p = compare_prune(case)
        p["as_expected"] = all(v["nodes_both"] == v["nodes_theirs"] for k, v in p.items() if "/" in k)
        out["prune"] = p
    if e["variants"]:
        out["variants"] = {}
        for v in e["variants"]:
            ok, secs = run_side([sys.executable, str(HERE / "our_side.py"), str(case), "--variant", v],
                                case / f"ours_{v}.log", env)
            if not ok:
                out["variants"][v] = {"status": "error: our side failed", "as_expected": False,
                                      "log_tail": tail(case / f"ours_{v}.log")}
                continue
            g = compare_graph(case, f"ours_{v}")
            r = {"same_nodes": g.get("same_feature_set", g.get("same_visited_set")),
                 "same_logit_targets": g["same_logit_targets"], "activation_rel": g.get("activation_rel"),
                 "logit_prob_rel": g.get("logit_prob_rel"), "adj_maxdiff_over_maxedge": g["adj_maxdiff_over_maxedge"],
                 "ours_s": secs}
            r["as_expected"] = bool(r["same_nodes"] and r["same_logit_targets"]) and not within(
                r, ("activation", "logit_prob", "adjacency"))
            out["variants"][v] = r
    return out


def git_state() -> dict[str, Any]:
    """The commit of the checkout our package runs from, and whether the package's files differ from it."""
    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True).stdout.strip()

    return {"commit": git("rev-parse", "HEAD"), "package_modified": bool(git("status", "--porcelain", "nnsight_lorsa"))}


def summarize(cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Counts, and the max of each headline number over the agreeing cases."""
    agree = [c["headline"] for c in cases.values() if c.get("status") == "agree"]
    mx = {k: max((h[k] for h in agree if h[k] is not None), default=None) for k in HEADLINE
          if k not in ("same_nodes", "same_logit_targets")}
    statuses: dict[str, int] = {}
    for c in cases.values():
        statuses[c["status"]] = statuses.get(c["status"], 0) + 1
    return {"n_cases": len(cases), "statuses": statuses, "max_over_agreeing": mx,
            "families": sorted({c["spec"]["family"] for c in cases.values()})}


def known_section(cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per known difference: which side is right and why, and each case's measured difference next to its aligned
    re-run."""
    out: dict[str, Any] = {}
    for name, c in cases.items():
        if not c["expect"].startswith("differs:") or "headline" not in c:
            continue
        known = c["expect"].split(":", 1)[1]
        right, why, key = KNOWN[known]
        sec = out.setdefault(known, {"right": right, "why": why, "aligned_by": key, "cases": []})
        twin = cases.get(f"{name}_aligned", {})
        entry = {"case": name, "measured": c["headline"], "status": c["status"], "aligned_case": f"{name}_aligned",
                 "aligned": twin.get("headline"), "aligned_status": twin.get("status")}
        if known == "mixed_skip":
            entry["theirs_skip"] = {k: c["theirs"].get(k) for k in ("skip_per_layer", "set_skip_connection")}
        sec["cases"].append(entry)
    return out


def fmt(x: Any) -> str:
    return f"{x:.1e}" if isinstance(x, float) else str(x)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--python", required=True, help="the Python of the venv with circuit-tracer 0.5.0")
    p.add_argument("--work", required=True, type=Path, help="working folder (one folder per case)")
    p.add_argument("--groups", default="default",
                   help=f"comma-separated, of {', '.join((*META_GROUPS, *GROUPS))} (default: default)")
    p.add_argument("--cases", default="", help="comma-separated case names (cases.py): run these instead of --groups")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the JSON written (default %(default)s)")
    args = p.parse_args()
    groups = [g for g in args.groups.split(",") if g]
    if unknown := [g for g in groups if g not in GROUPS and g not in META_GROUPS]:
        p.error(f"unknown group(s) {unknown}; known: {[*META_GROUPS, *GROUPS]}")
    names = [c for c in args.cases.split(",") if c]
    if unknown := [c for c in names if c not in CASES]:
        p.error(f"unknown case(s) {unknown}")
    if not Path(args.python).exists():
        p.error(f"--python {args.python}: no such file")

    offline = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env = dict(os.environ, **offline)
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    # the peer's process sees neither our PYTHONPATH nor our home's caches
    their_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(work), "LANG": "C.UTF-8", **offline}
    os.environ.update(offline)
    torch.set_num_threads(1)

    plan = build_plan(groups, names)
    t0 = time.time()
    cases: dict[str, dict[str, Any]] = {}
    for i, (name, e) in enumerate(plan.items(), 1):
        cases[name] = run_case(name, e, args.python, work, env, their_env)
        h = cases[name].get("headline", {})
        extra = "".join(f" {k}={v['as_expected']}" for k, v in cases[name].get("variants", {}).items())
        if "prune" in cases[name]:
            extra += f" prune={cases[name]['prune']['as_expected']}"
        print(f"[{i}/{len(plan)} {time.time() - t0:.0f}s] {name}: {cases[name]['status']} "
              + " ".join(f"{k}={fmt(h[k])}" for k in HEADLINE if k in h) + extra, flush=True)
    runtime = time.time() - t0

    versions: dict[str, Any] = {}
    for side, file in (("theirs", "theirs.json"), ("ours", "ours.json")):
        for name in cases:
            f = work / name / file
            if f.exists() and "versions" in (meta := json.loads(f.read_text())):
                versions[side] = meta["versions"]
                break
    versions["ours_checkout"] = git_state()
    variants = {n: c.pop("variants") for n, c in cases.items() if "variants" in c}
    prune = {n: c.pop("prune") for n, c in cases.items() if "prune" in c}
    all_ok = (all(c["as_expected"] for c in cases.values()) and all(r["as_expected"] for r in prune.values())
              and all(r["as_expected"] for v in variants.values() for r in v.values()))
    result = {
        "what": "nnsight_lorsa.attribute against circuit-tracer 0.5.0's attribute across families and transcoder "
                "kinds (scripts/peer_checks/circuit_tracer_attribution/run.py docstring)",
        "date": date.today().isoformat(),
        "command": shlex.join(["python", *sys.argv]),
        "groups": groups if not names else None,
        "cases_asked": names or None,
        "runtime_s": round(runtime, 1),
        "tolerance": TOL,
        "differs_above": DIFFERS,
        "versions": versions,
        "all_as_expected": all_ok,
        "summary": summarize(cases),
        "known_differences": known_section(cases),
        "prune": prune,
        "variants": variants,
        "cases": cases,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {args.out} ({len(cases)} cases, {runtime:.0f} s); all as expected: {all_ok}")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
