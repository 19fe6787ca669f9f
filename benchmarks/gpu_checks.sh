#!/usr/bin/env bash
# Every GPU measurement and check of the project in one run, for a short lease on a GPU machine
# (about 7 minutes on one H100/H200). From the repository root, with a CUDA build of torch:
#
#     OUT=gpu-results TORCH_SGN_DATA=<dir holding fashion_mnist/> bash benchmarks/gpu_checks.sh
#
# Writes into $OUT: env.txt, ggn_cost_cuda.txt/.json, time_to_accuracy_cuda.txt/.json,
# cuda_graphs.txt and pytest.txt. Each part has its own time limit, so one that fails or
# hangs leaves the others' results.
set -u
OUT=${OUT:-gpu-results}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  $PY -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0])"
  lscpu | grep 'Model name' || true
  git rev-parse --short HEAD 2>/dev/null || true
} 2>&1 | tee "$OUT/env.txt"

part() {  # part NAME SECONDS COMMAND...: one timed part, its output in $OUT/NAME.txt
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s): $*"
  local start=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  echo "=== $name: exit $? after $((SECONDS - start))s"
  tail -n 25 "$OUT/$name.txt"
}

# 1. The cost table of issue 4 on the GPU: both engines, the five paper models.
part ggn_cost_cuda 170 $PY benchmarks/ggn_cost.py --devices cuda --repeats 10 --warmup 3 \
  --out "$OUT/ggn_cost_cuda.json"
# 2. What CUDA graphs would buy (measured, not a feature).
part cuda_graphs 60 $PY benchmarks/cuda_graphs.py --repeats 20
# 3. Time to 85% test accuracy on Fashion-MNIST: SGN(5), SGD(0.1), Adam, 20 s each.
part time_to_accuracy_cuda 120 $PY benchmarks/time_to_accuracy_fashion.py --device cuda \
  --budget 20 --target 0.85 --eval-every 10 --only "SGN(5) fast" "SGD lr 0.1" "Adam lr 1e-3" \
  --out "$OUT/time_to_accuracy_cuda.json"
# 4. The test suite on this machine's torch, the CUDA tests included.
part pytest 150 $PY -m pytest -q -x -p no:cacheprovider tests
