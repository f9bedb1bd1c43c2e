#!/bin/bash
# The GPU checks of one short device session (`make gpu-session`); steps 1-3 took 4 minutes on an H200:
#   1. scripts/gpu_smoke.py: serial vs k3 in one process, lanes on CUDA streams, delays per lane;
#   2. the test files with CUDA-only tests (split backward, lane streams, pinned offload, memory);
#   3. `k3sched run` at one rank (NCCL under torchrun), serial and k3 with offload: losses bitwise
#      equal, both traces validated, a checkpoint resumed bitwise;
#   4. `k3sched probe` at larger shapes (bf16, hidden 1024): GEMMs, launch, HBM, PCIe and the
#      operator profile on the GPU;
#   5. serial and k3 runs of the probed config: k3/serial measured against predicted.
# Each step has its own time limit; logs go to OUT (default out/gpu_session). Exit 0 when every
# check passed, 1 otherwise. DEVICE=cpu runs the same on CPU threads (a dry run; SHAPES to shrink
# step 4 and 5). WHEELS=DIR: install the wheels in DIR first (a machine without a package index).
set -u
cd "$(dirname "$0")/.."
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-out/gpu_session}
SHAPES=${SHAPES:-"--set model.hidden=1024 --set model.expert_hidden=2048 --set model.dense_hidden=4096 --set model.seq_len=1024 --set model.vocab=8192 --set model.dtype=bf16 --set model.heads=8"}
mkdir -p "$OUT"
RUNS=$(mktemp -d /tmp/k3sched_gpu_session.XXXXXX)
trap 'rm -rf "$RUNS"' EXIT
T0=$(date +%s)
FAILED=()
step() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
verdict() { if [ "$2" -eq 0 ]; then echo "  ok: $1"; else echo "  FAILED: $1 (rc $2)"; FAILED+=("$1"); fi; }
check() { local name=$1 log=$2; shift 2; "$@" >> "$log" 2>&1; verdict "$name" $?; }  # NAME LOG COMMAND...

if [ -n "${WHEELS:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$RUNS/site" "$WHEELS"/*.whl \
    || { echo "gpu_session: could not install the wheels in $WHEELS"; exit 1; }
  export PYTHONPATH="$RUNS/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
$PY -c 'import sys, torch; print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda, torch.cuda.is_available(), "|", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")'

step "1. gpu_smoke on $DEVICE"
check smoke "$OUT/smoke.log" timeout 200 $PY scripts/gpu_smoke.py --device "$DEVICE" --json "$OUT/smoke.json"
tail -1 "$OUT/smoke.log"

step "2. test files with CUDA-only tests"
check tests "$OUT/tests.log" timeout 200 $PY -m pytest -q -p no:cacheprovider -rs tests/e2e/test_gpu_smoke.py \
  tests/unit/moe/test_moe_split.py tests/unit/runtime/test_runtime_executor.py tests/unit/offload/test_offload_manager.py tests/unit/runtime/test_memory_measure.py \
  tests/unit/runtime/test_failures.py --deselect tests/e2e/test_gpu_smoke.py::test_gpu_smoke_on_cuda
tail -1 "$OUT/tests.log"

step "3. one-rank runs (k3sched run --device $DEVICE)"
ONE="--set parallel.pp=1 --set parallel.ep=1 --set parallel.dp=1 --set schedule.offload=all"
export K3SCHED_DETERMINISTIC=1 CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}
for s in serial k3; do
  check "run $s" "$OUT/runs.log" timeout 90 $PY -m k3sched.cli run configs/tiny-cpu.yaml $ONE --strategy $s \
    --device "$DEVICE" --out "$RUNS/$s" --steps 4 --save-every 2 --timeout 80
  check "validate $s" "$OUT/runs.log" timeout 60 $PY -m k3sched.cli validate --plan "$RUNS/$s/plan.json" \
    "$RUNS/$s/trace_rank0.json" --json "$OUT/validation_$s.json"
done
check "resume k3" "$OUT/runs.log" timeout 90 $PY -m k3sched.cli run configs/tiny-cpu.yaml $ONE --device "$DEVICE" \
  --out "$RUNS/resumed" --steps 4 --resume "$RUNS/k3/checkpoints/step_2" --timeout 80
$PY - "$RUNS" <<'PY'
import json, sys
from pathlib import Path
s, k, r = (json.loads((Path(sys.argv[1]) / n / "summary.json").read_text()) for n in ("serial", "k3", "resumed"))
print(f"  device {k['device']}: serial {s['losses']}\n  k3 {k['losses']}\n  resumed (steps 3-4) {r['losses']}")
sys.exit(0 if s["losses"] == k["losses"] and r["losses"] == k["losses"][2:] else 1)
PY
verdict "serial = k3 = resumed, bitwise" $?

step "4. probe at larger shapes"
check probe "$OUT/probe.log" timeout 180 $PY -m k3sched.cli probe --nproc 2 --quick --config configs/tiny-cpu.yaml \
  --set parallel.pp=1 --set parallel.ep=1 --set parallel.dp=1 $SHAPES --set hardware.device_memory_gb=64 \
  --set hardware.host_memory_gb=64 -o "$OUT/probed.yaml" --timeout 120
grep -E "^│ (peak_tflops|hbm_gbps|pcie_gbps|launch_us|operator profile) " "$OUT/probe.log" | cut -c1-150

step "5. serial and k3 of the probed config"
if [ -f "$OUT/probed.yaml" ]; then
  for s in serial k3; do
    check "probed $s" "$OUT/probed_runs.log" timeout 120 $PY -m k3sched.cli run "$OUT/probed.yaml" \
      --set schedule.offload=all --strategy $s --device "$DEVICE" --out "$RUNS/probed_$s" --steps 6 --timeout 100
  done
  $PY - "$RUNS" <<'PY'
import json, sys
from pathlib import Path
s, k = (json.loads((Path(sys.argv[1]) / f"probed_{n}" / "summary.json").read_text()) for n in ("serial", "k3"))
for n, d in (("serial", s), ("k3", k)):
    print(f"  {n}: measured {d['measured_step_time_us'] / 1e3:.2f} ms, predicted {d['predicted_step_time_us'] / 1e3:.2f} ms"
          f" (x{d['measured_over_predicted']:.3f})")
print(f"  k3/serial measured {k['measured_step_time_us'] / s['measured_step_time_us']:.3f}, "
      f"predicted {k['predicted_step_time_us'] / s['predicted_step_time_us']:.3f}")
sys.exit(0 if s["losses"] == k["losses"] else 1)
PY
  verdict "probed: serial = k3 bitwise" $?
fi

step "done: ${#FAILED[@]} failed${FAILED[*]:+: ${FAILED[*]}}"
[ ${#FAILED[@]} -eq 0 ]
