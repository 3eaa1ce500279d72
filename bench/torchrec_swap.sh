#!/usr/bin/env bash
# TorchRec's DLRM trained with its own FusedEmbeddingBagCollection (FBGEMM's fused
# row-wise Adagrad) and with embank's collection swapped in (examples/torchrec_swap),
# ROUNDS rounds alternating the two, then embank with FTRL once. Every run prints one JSON
# line (examples/s of the training loop, test AUC, FTRL's share of exact zeros).
#
#   bash bench/torchrec_swap.sh [EXAMPLES] [ROUNDS] [WORK]
#
# Needs TorchRec: pip install --no-deps -r requirements-torchrec.txt
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-400000}
ROUNDS=${2:-3}
WORK=${3:-/tmp/embank-torchrec-swap}
PY=${PY:-.venv/bin/python}
THREADS=${THREADS:-2}  # torch threads of each run
mkdir -p "$WORK"
for r in $(seq "$ROUNDS"); do
  for ebc in torchrec embank; do
    $PY examples/torchrec_swap/train.py --ebc "$ebc" --rows "$N" --threads "$THREADS" --work "$WORK" 2>/dev/null
  done
done
$PY examples/torchrec_swap/train.py --ebc embank --optimizer ftrl --rows "$N" --threads "$THREADS" --work "$WORK" 2>/dev/null
