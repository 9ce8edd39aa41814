#!/usr/bin/env bash
# The GPU acceptance of the CUDA issue in one device call (a lease is short: nothing here waits on
# anything else). The CUDA tests and the kernel tests compiled for real, then benchmarks/gpu.py's
# two sections as separate processes, so one that fails or runs long leaves the other's figures.
# Logs and results go to $OUT (the device tool's folder; /tmp/gpu-acceptance elsewhere).
#
#     bash benchmarks/gpu_acceptance.sh            # about 10 minutes on an H100/H200
#
# Needs pytest-xdist (the lent GPU machines' image has it; WORKERS=0 runs the tests in one process).
set -u
OUT=${OUT:-/tmp/gpu-acceptance}
mkdir -p "$OUT/kernel" "$OUT/engine"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export SPECSERVE_CACHE_DIR=${SPECSERVE_CACHE_DIR:-/tmp/specserve-cache}
PYTHON=${PYTHON:-python3}
{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
  $PYTHON -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
  nproc; g++ --version | head -1
} 2>&1 | tee "$OUT/machine.txt"
# The CPU half of the CPU/GPU equality test needs our C++ kernels: build them while the GPU tests compile.
$PYTHON -c "import kernels.native as n; n.load(); print('cpu kernels', n.isa())" >>"$OUT/machine.txt" 2>&1 &

# SIGINT at the time limit: pytest still prints its failures. One tuning config per kernel: the
# tests check results, and tuning every shape's six configs made them outrun the limit.
SPECSERVE_TRITON_AUTOTUNE=0 timeout -s INT "${TESTS_S:-200}" $PYTHON -m pytest -q -p no:randomly \
  -p no:cacheprovider $([ "${WORKERS:-12}" != 0 ] && echo "-n ${WORKERS:-12}") --tb=short \
  tests/kernels/test_tree_attention.py tests/kernels/test_metadata.py tests/specserve/test_cuda_graphs.py \
  tests/specserve/test_device.py 2>&1 | tee "$OUT/tests.log" | grep -E "^(FAILED|ERROR)|passed|failed|^E " | head -60
echo "tests: exit ${PIPESTATUS[0]}"
wait

timeout "${KERNEL_S:-130}" $PYTHON benchmarks/gpu.py --out "$OUT/kernel" --skip engine --budget-s 330 \
  2>&1 | tr '\r' '\n' | grep -v "/s\]" | tee "$OUT/kernel/log.txt" | tail -45
echo "kernel: exit ${PIPESTATUS[0]}"
timeout "${ENGINE_S:-250}" $PYTHON benchmarks/gpu.py --out "$OUT/engine" --skip kernel --budget-s 215 \
  2>&1 | tr '\r' '\n' | grep -v "/s\]" | tee "$OUT/engine/log.txt" | tail -45
echo "engine: exit ${PIPESTATUS[0]}"
