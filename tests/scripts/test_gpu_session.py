"""``scripts/gpu_session.sh`` (the GPU session's steps) and ``scripts/gpu_record.py`` (their files merged into
``benchmarks/results``), checked without a GPU: the session's commands parse with the benchmark's own parser,
and a session's files merge into the layout of the recorded H200 files."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys

import pytest
from helpers import ROOT, load_script

RESULTS = ROOT / "benchmarks" / "results"
SCRIPT = ROOT / "scripts" / "gpu_session.sh"


def dry_run(tmp_path, *steps: str, **env) -> dict[str, list[str]]:
    """Each step's command of a dry run (``GPU_SESSION_DRY_RUN=1``) of ``steps`` (none: the default ones), as argv
    lists."""
    run_env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable, "GPU_SESSION_DRY_RUN": "1",
               "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
               "TMPDIR": str(tmp_path), **env}  # the raw folder (mktemp -d) inside the test's own
    proc = subprocess.run(["bash", str(SCRIPT), *steps], capture_output=True, text=True, timeout=300, env=run_env,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = {}
    for line in proc.stdout.splitlines():
        if line.startswith("[") and "]: " not in line and ": " in line:
            head, command = line.split(": ", 1)
            steps[head[1:head.index("]")]] = shlex.split(command)
    return steps


def gpu_scale_args(monkeypatch, argv: list[str], name: str):
    """The options ``gpu_scale``'s parser makes of a step's ``python -m benchmarks.gpu_scale …`` argv (its ``main``
    stopped at ``start``, before anything runs)."""
    assert argv[1:3] == ["-m", "benchmarks.gpu_scale"], argv
    gpu_scale = load_script(ROOT / "benchmarks" / "gpu_scale.py", name)
    captured = {}

    class Parsed(Exception):
        pass

    def capture(args):
        captured["args"] = args
        raise Parsed

    monkeypatch.setattr(gpu_scale, "start", capture)
    monkeypatch.setattr(sys, "argv", ["gpu_scale.py", *argv[3:]])
    with pytest.raises(Parsed):
        gpu_scale.main()
    return captured["args"], gpu_scale


@pytest.mark.parametrize("small", ["0", "1"])
def test_every_benchmark_step_parses_with_gpu_scales_parser(tmp_path, monkeypatch, small):
    """The session's gpu_scale commands (GPU scale and ``GPU_SESSION_SMALL=1``) parse with the benchmark's
    argparse: known flags, valid values, a Lorsa layer inside the scale; the suite step writes its JUnit XML."""
    steps = dry_run(tmp_path, GPU_SESSION_SMALL=small)
    assert list(steps) == ["suite", "ab", "variants", "c", "d", "offload"]
    assert steps["variants"][1:3] == ["-m", "benchmarks.lorsa_forward_variants"]
    assert steps["variants"][-2:][0] == "--out" and steps["variants"][-1].endswith("/lorsa_forward_variants.json")
    assert ("--scale" in steps["variants"]) == (small == "1")
    assert steps["suite"][1:4] == ["-m", "pytest", "-m"] and steps["suite"][4] == "gpu"
    assert any(a.startswith("--junitxml=") and a.endswith("/gpu_suite.xml") for a in steps["suite"])
    for step in ("ab", "c", "d", "offload"):
        args, gpu_scale = gpu_scale_args(monkeypatch, steps[step], "gpu_scale_for_session_test")
        scale = gpu_scale.SCALES[args.scale]
        assert args.scale == ("small" if small == "1" else "8b") and args.out.endswith(f"gpu_scale_{step}.json")
        assert sorted(args.skip) == sorted({"ab": ["c", "d"], "c": ["a", "b", "d"]}.get(step, ["a", "b", "c"]))
        if step == "d":
            assert int(args.attr_lorsa) == scale["layer"] and not args.offload
            assert args.tokens == ([32, 64] if small == "1" else [512, 1024, 2048, 4096])
        if step == "offload":
            assert args.attr_lorsa == "all" and args.offload and args.cap_gb == 80 and args.shared_weights
            assert args.tokens == ([32] if small == "1" else [1024, 4096])


def _fake_out(folder, device: str = "NVIDIA H200") -> None:
    """The files of a session: two suite cases (one failed), (d) at 512 and 8192 tokens, the offloaded run."""
    folder.mkdir()
    (folder / "session.json").write_text(json.dumps({
        "commit": "abc1234", "small": False, "device": device, "torch": "2.11.0+cu130", "transformers": "5.17.0",
        "nnsight": "0.8.1", "steps": {"suite": {"step": "suite", "rc": 1, "command": "python3 -m pytest -m gpu -n 8",
                                                "timed_out": False}}}))
    (folder / "gpu_suite.xml").write_text(
        '<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="2" failures="1" errors="0" skipped="0" '
        'time="41.5"><testcase classname="tests.attribution.test_devices_dtypes" name="test_a[cuda]" time="1"/>'
        '<testcase classname="tests.envoy.test_placement" name="test_b[cuda]" time="2"><failure message="boom">trace\n'
        'more</failure></testcase></testsuite></testsuites>')
    shapes = json.loads((RESULTS / "gpu_scale_8b_NVIDIA_H200.json").read_text())["shapes"]
    row = {"seconds": 1.0, "target_rows": 74, "batches": 19, "per_row_vs_floor": 1.5}
    base = {"scale": "8b", "shapes": shapes, "device": device, "dtype": "bfloat16", "torch": "2.11.0+cu130"}
    (folder / "gpu_scale_d.json").write_text(json.dumps({
        **base, "command": "python gpu_scale.py --skip a b c --attr-lorsa 15", "d_lorsa_layers": [15],
        "d_offload": False, "d_attribution": [{**row, "tokens": 512}, {**row, "tokens": 8192}]}))
    (folder / "gpu_scale_offload.json").write_text(json.dumps({
        **base, "command": "python gpu_scale.py --offload --attr-lorsa all", "cap_gb": 80.0,
        "d_lorsa_layers": list(range(32)), "d_offload": True, "d_module_bytes": 5,
        "d_attribution": [{**row, "tokens": 1024}]}))


def test_gpu_record_merges_a_session_into_the_recorded_layout(tmp_path):
    """Into copies of the recorded H200 files: the suite record replaces the former (kept in ``history``) with
    the same fields; (d)'s 512-token row is replaced (the former in ``history``), 8192 added, the other rows
    and parts kept; the offloaded all-layer run gets its own list; the session is logged."""
    record = load_script(ROOT / "scripts" / "gpu_record.py", "gpu_record_for_test")
    results = tmp_path / "results"
    results.mkdir()
    for name in ("gpu_suite_NVIDIA_H200.json", "gpu_scale_8b_NVIDIA_H200.json"):
        shutil.copy(RESULTS / name, results / name)
    before_suite = json.loads((results / "gpu_suite_NVIDIA_H200.json").read_text())
    before = json.loads((results / "gpu_scale_8b_NVIDIA_H200.json").read_text())
    _fake_out(tmp_path / "out")
    assert record.main([str(tmp_path / "out"), "--results", str(results), "--date", "2026-12-01"]) == 0

    suite = json.loads((results / "gpu_suite_NVIDIA_H200.json").read_text())
    assert set(before_suite) - {"note"} <= set(suite)
    assert (suite["tests"], suite["failures"], suite["seconds"], suite["commit"]) == (2, 1, 41.5, "abc1234")
    assert suite["cases"] == ["test_devices_dtypes::test_a[cuda]"]
    assert suite["failed"] == [{"case": "test_placement::test_b[cuda]", "message": "boom"}]
    assert suite["history"][-1]["passed_cases"] == len(before_suite["cases"]) == before_suite["tests"]

    scale = json.loads((results / "gpu_scale_8b_NVIDIA_H200.json").read_text())
    assert set(before) <= set(scale)
    for key in ("a_forward_vs_floor", "b_replace_vs_trace", "c_training", "a_forward_vs_floor_before"):
        assert scale[key] == before[key]
    tokens = [r["tokens"] for r in scale["d_attribution"]]
    assert tokens == sorted({r["tokens"] for r in before["d_attribution"]} | {8192})
    new_512 = next(r for r in scale["d_attribution"] if r["tokens"] == 512)
    assert new_512["per_row_vs_floor"] == 1.5 and new_512["date"] == "2026-12-01" and new_512["commit"] == "abc1234"
    old_512 = next(r for r in before["d_attribution"] if r["tokens"] == 512)
    assert {"key": "d_attribution", "value": old_512, "date": old_512["date"]} in scale["history"]
    offloaded = [r["tokens"] for r in scale["d_attribution_offload_all_lorsas"]]
    assert offloaded == sorted({r["tokens"] for r in before.get("d_attribution_offload_all_lorsas", [])} | {1024})
    new_1024 = next(r for r in scale["d_attribution_offload_all_lorsas"] if r["tokens"] == 1024)
    assert new_1024["date"] == "2026-12-01" and new_1024["commit"] == "abc1234"
    assert scale["d_attribution_offload_all_lorsas_meta"] == {"lorsa_layers": list(range(32)), "offload": True,
                                                              "module_bytes": 5, "cap_gb": 80.0}
    assert scale["command"][:len(before["command"])] == before["command"] and len(scale["command"]) == len(
        before["command"]) + 2
    sessions = json.loads((results / "gpu_session_NVIDIA_H200.json").read_text())["sessions"]
    assert len(sessions) == 1 and sessions[0]["commit"] == "abc1234"


def test_gpu_record_refuses_a_small_session_into_the_results(tmp_path):
    """A ``GPU_SESSION_SMALL=1`` session checks the script: recorded only into another folder."""
    record = load_script(ROOT / "scripts" / "gpu_record.py", "gpu_record_for_test")
    _fake_out(tmp_path / "out", device="cpu")
    session = json.loads((tmp_path / "out" / "session.json").read_text())
    (tmp_path / "out" / "session.json").write_text(json.dumps({**session, "small": True}))
    assert record.main([str(tmp_path / "out")]) == 2
    assert record.main([str(tmp_path / "out"), "--results", str(tmp_path / "r")]) == 0
    assert (tmp_path / "r" / "gpu_scale_8b_cpu.json").is_file()


def test_gpu_record_replaces_the_forward_variants_and_keeps_the_former_in_history(tmp_path):
    """``lorsa_forward_variants.json`` replaces the recorded H200 file; the former record, its notes included,
    is the last entry of ``history`` (twice: both former records, in order)."""
    record = load_script(ROOT / "scripts" / "gpu_record.py", "gpu_record_for_variants_test")
    results = tmp_path / "results"
    results.mkdir()
    name = "lorsa_forward_variants_8b_NVIDIA_H200.json"
    shutil.copy(RESULTS / name, results / name)
    before = json.loads((results / name).read_text())
    _fake_out(tmp_path / "out")
    for i, median in enumerate((0.004, 0.003)):
        (tmp_path / "out" / "lorsa_forward_variants.json").write_text(json.dumps(
            {"scale": "8b", "device": "NVIDIA H200", "rope_same_bits": True,
             "times": {"rope_module": {"median_s": median}, "rope_pair_swap": {"median_s": median / 2}}}))
        assert record.main([str(tmp_path / "out"), "--results", str(results), "--date", f"2026-12-0{i + 1}"]) == 0
    now = json.loads((results / name).read_text())
    assert now["times"]["rope_module"]["median_s"] == 0.003 and now["date"] == "2026-12-02"
    assert now["commit"] == "abc1234" and now["rope_same_bits"] is True
    n = len(before.get("history", []))  # the recorded file's own history comes first, untouched
    assert now["history"][:n] == before.get("history", [])
    assert now["history"][n] == {k: v for k, v in before.items() if k != "history"}
    assert now["history"][n + 1]["times"]["rope_module"]["median_s"] == 0.004 and len(now["history"]) == n + 2


def test_gpu_record_keeps_the_pinned_placement_rate_and_skips_a_cpu_run(tmp_path):
    """Step ``pin``'s ``offload_placement_rate.json`` becomes ``offload_placement_rate_<GPU>.json`` (the former
    record in ``history``); a run that found no CUDA device (``skipped``) is not recorded."""
    record = load_script(ROOT / "scripts" / "gpu_record.py", "gpu_record_for_pin_test")
    results = tmp_path / "results"
    results.mkdir()
    _fake_out(tmp_path / "out")
    (tmp_path / "out" / "offload_placement_rate.json").write_text(json.dumps({"skipped": "no CUDA device"}))
    assert record.main([str(tmp_path / "out"), "--results", str(results)]) == 0
    assert not list(results.glob("offload_placement_rate_*"))
    for i, rate in enumerate((0.3, 9.5)):
        (tmp_path / "out" / "offload_placement_rate.json").write_text(json.dumps(
            {"device": "NVIDIA H200", "runs": {"default": {"gb_per_s": rate}}}))
        assert record.main([str(tmp_path / "out"), "--results", str(results), "--date", f"2026-12-0{i + 1}"]) == 0
    now = json.loads((results / "offload_placement_rate_NVIDIA_H200.json").read_text())
    assert now["runs"]["default"]["gb_per_s"] == 9.5 and now["commit"] == "abc1234"
    assert [h["runs"]["default"]["gb_per_s"] for h in now["history"]] == [0.3]


def test_gpu_record_carries_phase_peaks_and_keeps_a_memory_snapshot_run_apart(tmp_path, monkeypatch):
    """A row's ``phase_peaks`` and ``memory_snapshot`` are merged with it; a ``--memory-snapshot`` run (its timed call
    slowed by the recording) goes to its own key, the offloaded run's rows untouched by it; the session's ``memsnap``
    step parses with gpu_scale's parser and asks for the snapshot."""
    record = load_script(ROOT / "scripts" / "gpu_record.py", "gpu_record_for_snapshot_test")
    _fake_out(tmp_path / "out")
    peaks = {"frozen_forward": 7, "backward": 9, "between": 1}
    snap = {"peak_bytes": 9, "groups": [{"where": "nnsight_lorsa/attribution/frozen.py:1:f", "bytes": 9, "count": 1}]}
    offload = json.loads((tmp_path / "out" / "gpu_scale_offload.json").read_text())
    offload["d_attribution"] = [{**offload["d_attribution"][0], "phase_peaks": peaks, "memory_snapshot": None}]
    (tmp_path / "out" / "gpu_scale_offload.json").write_text(json.dumps(offload))
    memsnap = {**offload, "d_memory_snapshot": True,
               "d_attribution": [{**offload["d_attribution"][0], "seconds": 99.0, "memory_snapshot": snap}]}
    (tmp_path / "out" / "gpu_scale_memsnap.json").write_text(json.dumps(memsnap))
    results = tmp_path / "results"
    assert record.main([str(tmp_path / "out"), "--results", str(results), "--date", "2026-12-01"]) == 0
    scale = json.loads((results / "gpu_scale_8b_NVIDIA_H200.json").read_text())
    (row,) = scale["d_attribution_offload_all_lorsas"]
    assert row["phase_peaks"] == peaks and row["memory_snapshot"] is None and row["seconds"] == 1.0
    (snapped,) = scale["d_attribution_offload_all_lorsas_memory_snapshot"]
    assert snapped["memory_snapshot"] == snap and snapped["seconds"] == 99.0

    parsed, _ = gpu_scale_args(monkeypatch, dry_run(tmp_path / "o2", "memsnap")["memsnap"],
                               "gpu_scale_for_memsnap_test")
    assert parsed.memory_snapshot == 1_000_000 and parsed.offload and parsed.attr_lorsa == "all"
    assert parsed.out.endswith("gpu_scale_memsnap.json") and parsed.tokens == [1024]


def test_the_profile_steps_profile_the_d_and_offload_runs_at_1024_tokens(tmp_path, monkeypatch):
    """``dprof`` and ``oprof`` (not default steps): the ``d`` step's Lorsa layer and the ``offload`` step's all-layer
    run at 1024 tokens (4096 did not finish under the profiler on an H200), with one more call under the profiler
    (``--profile-kernels 40``), each into its own JSON."""
    default = dry_run(tmp_path / "default")
    d, off = default["d"], default["offload"]
    args, gpu_scale = gpu_scale_args(monkeypatch, dry_run(tmp_path, "dprof")["dprof"], "gpu_scale_for_dprof_test")
    assert args.profile_kernels == 40 and not args.offload and sorted(args.skip) == ["a", "b", "c"]
    assert int(args.attr_lorsa) == gpu_scale.SCALES[args.scale]["layer"]
    assert args.tokens == [int(d[d.index("--tokens") + 2])] == [1024]
    assert args.out.endswith("gpu_scale_dprof.json")
    args, _ = gpu_scale_args(monkeypatch, dry_run(tmp_path / "o", "oprof")["oprof"], "gpu_scale_for_oprof_test")
    assert args.profile_kernels == 40 and args.offload and args.shared_weights and args.attr_lorsa == "all"
    assert args.tokens == [int(off[off.index("--tokens") + 1])] == [1024] and args.cap_gb == 80
    assert args.out.endswith("gpu_scale_oprof.json")
