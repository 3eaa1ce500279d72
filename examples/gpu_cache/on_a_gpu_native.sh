#!/usr/bin/env bash
# The native GPU path's checks and measurements on a machine with an NVIDIA GPU, in one
# device call (at most 10 minutes): each step has its own limit, ~9.3 minutes together
# (~6 expected), and native.json / train.json are written into OUT_DIR as each bench's
# sections end, so a cut run keeps what was done. The CUDA
# tests (the native path on CUDA and on the emulator where the build has it; the
# Triton/PyTorch paths' tests too), then
# examples/gpu_cache/native_bench.py at full size, then TrainCache's CUDA test (its native,
# Triton and PyTorch paths alike) and examples/gpu_cache/train_bench.py (DLRM trained
# through TrainCache: one shared cache, the host path, a cache a table, Triton's; 3 steps
# of each under PyTorch's profiler: the host's and the device's time a step).
#
#   bash examples/gpu_cache/on_a_gpu_native.sh OUT_DIR [WORK_DIR]
#
# Needs python3 with torch (CUDA), numpy, pytest (triton for the Triton tests); embank
# importable (installed: tools/device_bundle.sh readies a wheel and says how; or
# python/embank with its built extension, which the script then puts first).
set -u
out=${1:?usage: on_a_gpu_native.sh OUT_DIR [WORK_DIR]}
work=${2:-/tmp/embank-gpu-native}
py=${PYTHON:-python3}
mkdir -p "$out" "$work"
export PYTHONUNBUFFERED=1
# The checkout's package first where it holds a built extension (make develop); else the
# installed one (tools/device_bundle.sh's wheel).
if compgen -G "python/embank/_native*.so" >/dev/null; then
    export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
fi
step() { echo "== $(date -u +%H:%M:%S) $*" >&2; }

step env
{
    nvidia-smi -L
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv
    "$py" -c 'import sys, torch, numpy, embank; print(sys.version.split()[0], "torch", torch.__version__, "numpy", numpy.__version__, torch.cuda.get_device_name(), "emulator", embank._native.gpu_emulator())'
    nproc
} 2>&1 | tee "$out/env.txt"

step tests
timeout "${TESTS_TIMEOUT:-130}" "$py" -m pytest -q -p no:cacheprovider -rs -x \
    tests/python/test_gpu_native.py tests/python/test_gpu.py tests/python/test_gpu_regressions.py \
    2>&1 | tee "$out/pytest.txt" | tail -40

step native bench
timeout "${BENCH_TIMEOUT:-170}" "$py" examples/gpu_cache/native_bench.py --out "$work" --json "$out/native.json" \
    ${BENCH_ARGS:-} 2>&1 | tee "$out/bench.txt" | tail -150

step train tests
timeout "${TRAIN_TESTS_TIMEOUT:-60}" "$py" -m pytest -q -p no:cacheprovider -rs -x -k cuda \
    tests/python/test_gpu_train.py 2>&1 | tee "$out/pytest_train.txt" | tail -20

step train bench
# The ways most wanted first (train.json is rewritten after each: a cut run keeps them).
timeout "${TRAIN_TIMEOUT:-190}" "$py" examples/gpu_cache/train_bench.py --out "$work/train" --json "$out/train.json" \
    ${TRAIN_ARGS:---steps 100 --warmup 20 --profile-steps 3 --ways resident,cache_shared,host,cache,cache_triton} \
    2>&1 | tee "$out/train.txt" | tail -20
step done
