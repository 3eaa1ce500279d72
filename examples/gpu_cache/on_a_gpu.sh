#!/usr/bin/env bash
# The GPU cache's checks and measurements on a machine with an NVIDIA GPU, in one call of
# about five minutes (an H100): the CUDA tests (compiled Triton kernels against the
# PyTorch path and against a model, the one sync of a warm lookup, a side stream against
# a writer), then examples/gpu_cache/bench.py at full size with the Triton kernels, then
# its hit path with the PyTorch kernels for comparison. Each step has its own time limit,
# so one that fails or hangs leaves the others' results.
#
# Needs: python3 with torch (CUDA), triton, numpy and pytest; embank importable, either
# installed or as python/embank with its built extension (python/embank/_native.abi3.so,
# from `make develop`) - the script puts ./python first on PYTHONPATH.
#
#   bash examples/gpu_cache/on_a_gpu.sh OUT_DIR [WORK_DIR]
#
# OUT_DIR gets env.txt, pytest.txt, bench.txt, gpu_cache.json, hit_rate.png, warmup.png,
# bench_torch.txt, gpu_cache_torch.json, profile.txt. WORK_DIR (default /tmp/embank-gpu) holds the
# stores (about 3 GB).
set -u
out=${1:?usage: on_a_gpu.sh OUT_DIR [WORK_DIR]}
work=${2:-/tmp/embank-gpu}
py=${PYTHON:-python3}
mkdir -p "$out" "$work"
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
step() { echo "== $(date -u +%H:%M:%S) $*" >&2; }

step env
{
    nvidia-smi -L
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv
    "$py" -c 'import sys, torch, triton, numpy, embank; print(sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "numpy", numpy.__version__, torch.cuda.get_device_name(), "embank", embank.__file__)'
    nproc
} 2>&1 | tee "$out/env.txt"

step tests
timeout "${TESTS_TIMEOUT:-120}" "$py" -m pytest -q -p no:cacheprovider -rs \
    tests/python/test_gpu.py tests/python/test_gpu_regressions.py 2>&1 | tee "$out/pytest.txt"

step bench, Triton kernels
timeout "${BENCH_TIMEOUT:-240}" "$py" examples/gpu_cache/bench.py --out "$work/triton" --kernels triton --profile \
    2>&1 | tee "$out/bench.txt"
cp "$work"/triton/*.json "$work"/triton/*.png "$work"/triton/*.txt "$out/" 2>/dev/null

step bench hit path, PyTorch kernels
timeout "${TORCH_TIMEOUT:-60}" "$py" examples/gpu_cache/bench.py --out "$work/torch" --kernels torch \
    --rows 1000000 --batches 20 --zipf 0.99 --size-fractions 0.1 2>&1 | tee "$out/bench_torch.txt"
cp "$work/torch/gpu_cache.json" "$out/gpu_cache_torch.json" 2>/dev/null
step done
