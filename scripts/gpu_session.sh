#!/usr/bin/env bash
# The GPU checks of issue 21 as one script for a session with a CUDA device (docs/benchmarks.md, "Running the
# GPU checks"). The caller sets PYTHONPATH (the package and its wheels) and OUT (a folder whose files come back);
# run from the repository root. Each step runs under its own `timeout`, and as soon as it ends its status is
# written to <raw>/<step>.json and merged into <raw>/session.json, packed into $OUT/session_files.tar (a step stopped by its timeout keeps what the
# benchmark flushed: gpu_scale writes its JSON after every part and every token count).
#
#   scripts/gpu_session.sh                 # every step, in order: suite ab variants c d offload
#   scripts/gpu_session.sh suite d ab variants c; scripts/gpu_session.sh offload   # over two commands (safer)
#
# Steps (times on an H200; the whole script is held to GPU_SESSION_BUDGET_S, default 540 s = 9 min, so that it
# fits one 10-minute device command: a step gets min(its timeout, what is left), and is skipped with < 20 s):
#   suite    python3 -m pytest -m gpu -n 8 (~100 s)                         -> $OUT/gpu_suite.xml, gpu_suite.log
#   ab       gpu_scale --skip c d: (a) Lorsa forward vs floor, (b) replace vs plain trace (~100 s)
#   variants lorsa_forward_variants: each stage of the Lorsa forward and its alternatives, RoPE's pair swap,
#            split halves and one compiled kernel among them (~60 s + the compile) -> $OUT/lorsa_forward_variants.json
#   c        gpu_scale --skip a b d: (c) Lorsa training throughput, fp32 and bf16 masters (~90 s)
#   d        gpu_scale --skip a b c --attr-lorsa 15 --tokens 512 1024 2048 4096: (d) with per-phase times (~200 s)
#   offload  gpu_scale --skip a b c --offload --shared-weights --attr-lorsa all --cap-gb 80 --tokens 1024 4096: the
#            paper's Lorsa on all 32 layers + 32 transcoders, offloaded, under an 80 GB cap, the layers sharing one
#            set of pinned host weights (308 s at 1024 tokens on 2026-11-26 with distinct weights, 209 s of it
#            building them; a command of its own, timeout 420 s)
#   memsnap  the offload step's run at its first length (1024 tokens) with --memory-snapshot (every allocation of
#            the timed call recorded with its Python stack; the live ones at the peak by nnsight_lorsa frame, the 20
#            largest, into the JSON: where the device peak is; slower than offload — at 4096 tokens the 10^6-entry
#            buffer may overflow, `truncated`; not in the default steps; timeout 540 s)
#            -> $OUT/gpu_scale_memsnap.json, recorded under its own key (..._memory_snapshot)
#   dprof    the d step's 1024-token prompt with --profile-kernels 40: one more attribute call under
#            torch.profiler, its top operators by device time and by host time in the row (`kernel_profile`: where
#            a batch's time above the floor goes, kernel by kernel; not in the default steps; timeout 240 s; at 4096
#            tokens the profiled call did not end in 147 s on an H200, 2026-11-27: a 32 s call, ~5x under the profiler)
#   oprof    the offload step's run at 1024 tokens (a 35 s call) with --profile-kernels 40: where the offloaded
#            all-layer call's 5-7x the floor goes (not in the default steps; timeout 420 s)
#   orows    the offload step's run at 1024 tokens with 512 feature rows (--attr-rows 512; the default 64 rows are
#            19 batches, under the call's fixed part: steady_per_row_vs_floor is each batch's own cost; ~150 s,
#            not in the default steps; timeout 420 s) -> gpu_scale_orows.json
#   zprod    zpre_head_product: one 8B Lorsa layer's recomputed-row z_pre, forward + backward, the gather against
#            the head product (frozen.HEAD_PRODUCT) at 1024 and 4096 tokens, batch 2, bf16 (~60 s; not in the
#            default steps) -> zpre_head_product.json
#   gnodes   gathered_nodes: a gathered site's node writes and reads at the 8B width, the former per-node products
#            against the chunked grid products, 1024 and 4096 tokens, bf16, and the chunked grid with chunks of
#            2^23, 2^25 (frozen.NODE_CHUNK_ELEMENTS_DEVICE) and 2^27 numbers (~45 s; not in the default steps)
#            -> gathered_nodes.json
#   pin      offload_placement_rate: GB/s of moving modules to pinned host memory, default host allocator and
#            cudaHostRegister with 8 threads (~30 s; not in the default steps) -> offload_placement_rate.json
#   -> $OUT/gpu_scale_<step>.json (the benchmark's JSON), $OUT/<step>.log
#
# Then, on the machine with the repository: python scripts/gpu_record.py <the folder $OUT came back as>
# merges them into benchmarks/results/gpu_suite_<GPU>.json, gpu_scale_8b_<GPU>.json and gpu_session_<GPU>.json.
#
# GPU_SESSION_SMALL=1: the same steps at gpu_scale's CPU scale (--scale small --device cpu --dtype float32,
# 1 repeat, 1 training step, layer 1 for 15, 32/64 tokens), pytest without workers unless GPU_SESSION_WORKERS is
# set: proves the commands and the recording work before device time is spent (every gpu test is skipped there).
# GPU_SESSION_DRY_RUN=1: print each step's command, run nothing.
set -u

OUT="${OUT:?set OUT to the output folder}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
# the device returns at most 8 files from $OUT: the steps write into a folder outside it (GPU_SESSION_RAW, default
# a new one under /tmp), packed after every step (and every 20 s while one runs) into $OUT/session_files.tar, beside
# a copy of session.json; gpu_record.py reads the archive
DEST="$OUT"
OUT="${GPU_SESSION_RAW:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_session_raw.XXXXXX")}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
pack() {
  tar -C "$OUT" -cf "$DEST/session_files.tar.part" . 2>/dev/null && mv -f "$DEST/session_files.tar.part" "$DEST/session_files.tar"
  [ -f "$OUT/session.json" ] && cp -f "$OUT/session.json" "$DEST/session.json"
  return 0
}
cd "$(dirname "$0")/.." || exit 2  # the repository root: python -m benchmarks.gpu_scale, pytest's rootdir
PY="${PYTHON:-python3}"
SMALL="${GPU_SESSION_SMALL:-0}"
BUDGET="${GPU_SESSION_BUDGET_S:-540}"
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(suite ab variants c d offload)
START=$(date +%s)

if [ "$SMALL" = 1 ]; then
  SCALE=(--scale small --device cpu --dtype float32 --repeats 1 --train-steps 1)
  LAYER=1; D_TOKENS=(32 64); OFF_TOKENS=(32); WORKERS="${GPU_SESSION_WORKERS:-0}"
  VARIANTS=(--scale small --device cpu --dtype float32 --seq 64 --repeats 1)
  ZPROD=(--device cpu --dtype float32 --tokens 64 --repeats 1); ROWS_MANY=16
  GNODES=(--device cpu --dtype float32 --tokens 32 --d 64 --repeats 1 --chunks 10 12)
else
  ROWS_MANY=512; GNODES=(--device cuda --dtype bfloat16 --tokens 1024 4096 --d 4096 --chunks 23 25 27)
  VARIANTS=(); ZPROD=(); SCALE=(); LAYER=15; D_TOKENS=(512 1024 2048 4096); OFF_TOKENS=(1024 4096); WORKERS="${GPU_SESSION_WORKERS:-8}"
fi
# pytest-xdist runs the suite on WORKERS processes (73 cases ~40-50 s on an H200; 178 since 2026-11-27 evening, not yet
# timed there: their CPU cases take ~2.4x the former ones); without it the suite runs serially: longer (and pyproject's
# addopts, which name -n, are replaced)
if "$PY" -c "import xdist" 2>/dev/null; then XDIST=(-n "$WORKERS" --maxprocesses "$WORKERS"); XDIST_ON=1; SUITE_S=180
else XDIST=(-o "addopts=-ra"); XDIST_ON=0; SUITE_S=480; echo "pytest-xdist not installed: the gpu suite runs serially (timeout ${SUITE_S}s)"; fi

# the session's record: device, versions, commit (GPU_SESSION_COMMIT, else git's, else unknown)
COMMIT="${GPU_SESSION_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
"$PY" - "$OUT/session.json" "$COMMIT" "$SMALL" "$BUDGET" "$XDIST_ON" <<'EOF'
import datetime, importlib, json, sys
path, commit, small, budget = sys.argv[1], sys.argv[2], sys.argv[3] == "1", int(sys.argv[4])
info = {"commit": commit, "small": small, "budget_s": budget, "xdist": sys.argv[5] != "0",
        "started": datetime.datetime.now(
    datetime.timezone.utc).isoformat(timespec="seconds"), "steps": {}}
for name in ("torch", "transformers", "nnsight"):
    try:
        info[name] = importlib.import_module(name).__version__
    except Exception as e:  # recorded, not fatal: the steps say what fails
        info[name] = f"unavailable: {type(e).__name__}"
try:
    import torch
    info["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() and not small else "cpu"
except Exception:
    info["device"] = "unknown"
json.dump(info, open(path, "w"), indent=1)
print("session:", info)
EOF

# record STEP RC T0_NS T1_NS TIMEOUT COMMAND...: $OUT/<step>.json and its entry in $OUT/session.json
record() {
  "$PY" - "$OUT" "$@" <<'EOF'
import json, sys
out, step, rc, t0, t1, limit, *command = sys.argv[1:]
rc, seconds, limit = int(rc), round((int(t1) - int(t0)) / 1e9, 3), float(limit)
status = {"step": step, "rc": rc, "seconds": seconds, "timeout_s": limit, "timed_out": rc in (124, 137),
          "skipped": rc == -1, "command": " ".join(command)}
json.dump(status, open(f"{out}/{step}.json", "w"), indent=1)
session = json.load(open(f"{out}/session.json"))
session["steps"][step] = status
json.dump(session, open(f"{out}/session.json", "w"), indent=1)
print("step", json.dumps(status), flush=True)
EOF
}

# run_step STEP TIMEOUT COMMAND...
run_step() {
  local step=$1 limit=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - START) ))
  (( left < limit )) && limit=$left
  if [ "${GPU_SESSION_DRY_RUN:-0}" = 1 ]; then echo "[$step] timeout $limit: $*"; return; fi
  if (( limit < 20 )); then record "$step" -1 0 0 "$limit" "$@"; return; fi
  echo "== [$step] timeout ${limit}s: $*" | tee "$OUT/$step.log"
  local t0 rc packer
  t0=$(date +%s%N)
  ( while sleep 20; do pack; done ) &
  packer=$!
  timeout --kill-after=10 "$limit" "$@" >>"$OUT/$step.log" 2>&1
  rc=$?
  kill "$packer" 2>/dev/null; wait "$packer" 2>/dev/null
  tail -n 5 "$OUT/$step.log"
  record "$step" "$rc" "$t0" "$(date +%s%N)" "$limit" "$@"
  pack
}

GS=("$PY" -m benchmarks.gpu_scale ${SCALE[@]+"${SCALE[@]}"})
for step in "${STEPS[@]}"; do
  case "$step" in
    suite)   run_step suite "$SUITE_S" "$PY" -m pytest -m gpu ${XDIST[@]+"${XDIST[@]}"} -q -p no:cacheprovider \
               --junitxml="$OUT/gpu_suite.xml" ;;
    ab)      run_step ab 150 "${GS[@]}" --skip c d --out "$OUT/gpu_scale_ab.json" ;;
    variants) run_step variants 150 "$PY" -m benchmarks.lorsa_forward_variants ${VARIANTS[@]+"${VARIANTS[@]}"} \
               --out "$OUT/lorsa_forward_variants.json" ;;
    c)       run_step c 150 "${GS[@]}" --skip a b d --out "$OUT/gpu_scale_c.json" ;;
    d)       run_step d 240 "${GS[@]}" --skip a b c --attr-lorsa "$LAYER" --tokens "${D_TOKENS[@]}" \
               --out "$OUT/gpu_scale_d.json" ;;
    memsnap) run_step memsnap 540 "${GS[@]}" --skip a b c --offload --shared-weights --attr-lorsa all --cap-gb 80 \
               --tokens "${OFF_TOKENS[0]}" --memory-snapshot --out "$OUT/gpu_scale_memsnap.json" ;;
    dprof)   run_step dprof 240 "${GS[@]}" --skip a b c --attr-lorsa "$LAYER" --tokens "${D_TOKENS[1]}" \
               --profile-kernels 40 --out "$OUT/gpu_scale_dprof.json" ;;
    oprof)   run_step oprof 420 "${GS[@]}" --skip a b c --offload --shared-weights --attr-lorsa all --cap-gb 80 \
               --tokens "${OFF_TOKENS[0]}" --profile-kernels 40 --out "$OUT/gpu_scale_oprof.json" ;;
    pin)     run_step pin 90 "$PY" -m benchmarks.offload_placement_rate --out "$OUT/offload_placement_rate.json" ;;
    orows)   run_step orows 420 "${GS[@]}" --skip a b c --offload --shared-weights --attr-lorsa all --cap-gb 80 \
               --tokens "${OFF_TOKENS[0]}" --attr-rows "$ROWS_MANY" --out "$OUT/gpu_scale_orows.json" ;;
    gnodes)  run_step gnodes 120 "$PY" -m benchmarks.gathered_nodes "${GNODES[@]}" --out "$OUT/gathered_nodes.json" ;;
    zprod)   run_step zprod 120 "$PY" -m benchmarks.zpre_head_product ${ZPROD[@]+"${ZPROD[@]}"} \
               --out "$OUT/zpre_head_product.json" ;;
    offload) run_step offload 420 "${GS[@]}" --skip a b c --offload --shared-weights --attr-lorsa all --cap-gb 80 \
               --tokens "${OFF_TOKENS[@]}" --out "$OUT/gpu_scale_offload.json" ;;
    *)       echo "unknown step $step (suite ab variants c d offload memsnap dprof oprof orows pin zprod gnodes)" >&2; exit 2 ;;
  esac
done
pack
echo "session done in $(( $(date +%s) - START )) s; files in $DEST/session_files.tar (and $OUT)"
