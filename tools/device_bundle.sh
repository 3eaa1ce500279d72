#!/usr/bin/env bash
# Readies this checkout for a GPU machine with no network (a device lent to a session runs
# a command over a copy of the working tree, with the ignored paths it is told to carry):
# builds the wheel (`make wheel`: the CUDA path loads libcuda at run time; no emulator)
# and copies it into .device/ (ignored by git), then prints the command to run there.
#
#   bash tools/device_bundle.sh
#
# There, the image's python3 has torch, numpy and pytest: the wheel goes in with
# `--no-deps --no-index`, and examples/gpu_cache/on_a_gpu_native.sh runs against it (it
# puts ./python first on PYTHONPATH only where ./python/embank holds a built extension,
# which an uncarried checkout does not).
set -euo pipefail
cd "$(dirname "$0")/.."
make -s wheel >/dev/null
rm -rf .device && mkdir -p .device
cp dist/embank-*.whl .device/
ls -l .device
cat <<'RUN'
carry [".device"], timeout_s 600, command (OUT gets 8 files at most: this makes 8):
  set -o pipefail; python3 -m pip install -q --no-deps --no-index .device/embank-*.whl && bash examples/gpu_cache/on_a_gpu_native.sh "$OUT" 2>&1 | tee "$OUT/run.log"
RUN
