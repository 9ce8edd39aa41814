#!/usr/bin/env bash
# The GPU acceptance in one device call (a lease is short: nothing here waits on anything else).
# Steps, each a separate process so one that fails or runs long leaves the others' figures:
#   tests   the CUDA tests and the kernel tests compiled for real (bf16, int8 and fp8 caches)
#   kernel  benchmarks/gpu.py's kernel section (the CUDA issue)
#   engine  benchmarks/gpu.py's engine section (the CUDA issue)
#   kv      benchmarks/kernels.py over bf16, int8 and fp8 caches (the quantized-KV issue)
#   tp      tensor parallelism over NCCL: one rank through the worker path, two on two GPUs (scale-out issue)
# Logs and results go to $OUT (the device tool's folder; /tmp/gpu-acceptance elsewhere).
#
#     bash benchmarks/gpu_acceptance.sh                  # all steps, about 13 minutes on an H100/H200
#     STEPS="tests kv" bash benchmarks/gpu_acceptance.sh # the quantized-KV issue's points, about 6
#
# Needs pytest-xdist (the lent GPU machines' image has it; WORKERS=0 runs the tests in one process).
set -u
OUT=${OUT:-/tmp/gpu-acceptance}
STEPS=" ${STEPS:-tests kernel engine kv tp} "
mkdir -p "$OUT/kernel" "$OUT/engine" "$OUT/kv"
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

if [[ $STEPS == *" tests "* ]]; then
# SIGINT at the time limit: pytest still prints its failures. One tuning config per kernel: the
# tests check results, and tuning every shape's six configs made them outrun the limit.
SPECSERVE_TRITON_AUTOTUNE=0 timeout -s INT "${TESTS_S:-200}" $PYTHON -m pytest -q -p no:randomly \
  -p no:cacheprovider $([ "${WORKERS:-12}" != 0 ] && echo "-n ${WORKERS:-12}") --tb=short \
  tests/kernels/test_tree_attention.py tests/kernels/test_metadata.py tests/specserve/test_cuda_graphs.py \
  tests/specserve/test_device.py 2>&1 | tee "$OUT/tests.log" | grep -E "^(FAILED|ERROR)|passed|failed|^E " | awk 'NR <= 60'  # head would stop pytest (SIGPIPE)
echo "tests: exit ${PIPESTATUS[0]}"
fi
wait

if [[ $STEPS == *" kernel "* ]]; then
timeout "${KERNEL_S:-130}" $PYTHON benchmarks/gpu.py --out "$OUT/kernel" --skip engine --budget-s 330 \
  2>&1 | tr '\r' '\n' | grep -v "/s\]" | tee "$OUT/kernel/log.txt" | tail -45
echo "kernel: exit ${PIPESTATUS[0]}"
fi
if [[ $STEPS == *" engine "* ]]; then
timeout "${ENGINE_S:-250}" $PYTHON benchmarks/gpu.py --out "$OUT/engine" --skip kernel --budget-s 215 \
  2>&1 | tr '\r' '\n' | grep -v "/s\]" | tee "$OUT/engine/log.txt" | tail -45
echo "engine: exit ${PIPESTATUS[0]}"
fi
if [[ $STEPS == *" kv "* ]]; then
# One kernel config for every cache dtype (tuning 6 configs per shape and dtype outruns the lease).
SPECSERVE_TRITON_AUTOTUNE=0 timeout "${KV_S:-200}" $PYTHON benchmarks/kernels.py --out "$OUT/kv/kernels" \
  --batches 1 8 64 --contexts 2048 8192 --trees 1 16 64 --rep-ms 100 --kv-dtypes int8 fp8 \
  2>&1 | tr '\r' '\n' | grep -v "/s\]" | tee "$OUT/kv/log.txt" | tail -30
echo "kv: exit ${PIPESTATUS[0]}"
fi
if [[ $STEPS == *" tp "* ]]; then
timeout "${TP_S:-120}" $PYTHON -m pytest -q -p no:randomly -p no:cacheprovider --tb=short -m cuda \
  tests/specserve/test_parallel.py 2>&1 | tee "$OUT/tp.log" | grep -E "^(FAILED|ERROR)|passed|failed|skipped|^E " \
  | awk 'NR <= 30'
echo "tp: exit ${PIPESTATUS[0]}"
fi
