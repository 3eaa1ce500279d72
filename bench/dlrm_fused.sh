#!/usr/bin/env bash
# DLRM training throughput (bench/dlrm_compare.py: the DLRM example with its comparison
# modes), --preload (training only, parsing excluded), 3 rounds of
# alternating runs: embank's fused collection (tables in DRAM; with every row created
# before training, as TorchRec's and nn.EmbeddingBag's are: fused-mat; on the block medium
# with a row cache of 10 % of the tables' bytes; and checkpointing every 100 batches:
# ONLY="fused fused-ckpt100"), the per-table modules, torch's
# nn.EmbeddingBag (--baseline) and, when torchrec is installed, TorchRec's
# FusedEmbeddingBagCollection. Prints every run and the median of each.
#
#   bash bench/dlrm_fused.sh [EXAMPLES] [ROUNDS] [WORK]      (ONLY="fused torchrec": those runs)
#
# TorchRec is for the comparison only, not part of make test:
#   .venv/bin/pip install --no-deps torchrec==1.9.2 fbgemm-gpu-cpu==1.9.0 tensordict \
#       iopath pyre-extensions typing-inspect mypy-extensions portalocker pyvers cloudpickle
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-400000}
ROUNDS=${2:-3}
WORK=${3:-/tmp/embank-dlrm-bench}
PY=${PY:-.venv/bin/python}
rm -rf "$WORK" && mkdir -p "$WORK/data"
$PY examples/dlrm/train.py --synthetic "$N" --work "$WORK/data" --epochs 0 --quiet >/dev/null
declare -A RUNS=(
  [fused]=""
  [fused-mat]="--materialize"
  [fused-block10]="--medium block --cache-fraction 0.1"
  [per-table]="--per-table"
  [fused-ckpt100]="--checkpoint-every 100"
  [baseline]="--baseline"
)
ORDER=(fused per-table baseline fused-block10)
if $PY -c "import torchrec" 2>/dev/null; then
  RUNS[torchrec]="--torchrec"
  ORDER+=(torchrec)
fi
if [ -n "${ONLY:-}" ]; then read -r -a ORDER <<< "$ONLY"; fi  # e.g. ONLY="fused baseline torchrec"
RUNS[torchrec]=${RUNS[torchrec]:---torchrec}
for r in $(seq "$ROUNDS"); do
  for name in "${ORDER[@]}"; do
    w="$WORK/$name-$r"
    mkdir -p "$w" && ln -s "$WORK"/data/synthetic-* "$w/"
    # shellcheck disable=SC2086
    $PY bench/dlrm_compare.py --synthetic "$N" --batch-size 512 --threads 2 --seed 0 --work "$w" \
      --preload --quiet --metrics-out "$w/m.json" ${RUNS[$name]} >/dev/null 2>&1
    $PY - "$name" "$r" "$w/m.json" <<'EOF'
import json, sys
name, r, path = sys.argv[1:]
m = json.load(open(path))
hit = m.get("cache_hit_rate")
extra = f" hit {hit:.3f} medium reads {m.get('medium_rows_read', 0) / m['seconds']:,.0f}/s" if hit else ""
if hit and "device_writes" in m:
    extra += f" device {m['device_reads'] / m['seconds']:,.0f} reads/s + {m['device_writes'] / m['seconds']:,.0f} writes/s"
print(f"{name:14s} round {r}: {m['examples_per_s']:9,.0f} ex/s  auc {m['auc']:.4f}  {m['seconds']:.1f} s{extra}")
EOF
    find "$w" -name store -maxdepth 1 -exec rm -rf {} +
  done
done | tee "$WORK/runs.txt"
$PY - "$WORK/runs.txt" <<'EOF'
import collections, statistics, sys
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    name = line.split()[0]
    runs[name].append(float(line.split(":")[1].split()[0].replace(",", "")))
base = {k: statistics.median(v) for k, v in runs.items()}
print()
for k, v in runs.items():
    ratios = " ".join(f"{base[k] / base[o]:.2f}x {o}" for o in ("baseline", "torchrec", "fused") if o in base and o != k)
    print(f"{k:14s} median {base[k]:9,.0f} ex/s  min {min(v):9,.0f}  ({ratios})")
EOF
