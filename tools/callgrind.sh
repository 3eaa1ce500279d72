#!/bin/bash
# Instruction counts of the embedded engine's hot paths, to compare two builds exactly
# (wall time on a shared 2-core VM varies by 15-25 %; instruction counts do not):
#
#   tools/callgrind.sh OUT [EMBANK]      # e.g. OUT=/tmp/cg-after, EMBANK=target/release/embank
#
# Runs `embank bench` (hps-a pulls, then train: pull + push) on the mmap medium, one
# thread, a fixed 400 batches of 500 keys over 200,000 rows of dim 64, under valgrind,
# counting only inside the engine's pull (and push: the load's pushes included). The
# program of `cargo build --release -p embank-cli` keeps the symbols the counting needs
# (the wheel's is stripped). Prints one total a workload; the files OUT.<workload>.out
# open in callgrind_annotate. Needs valgrind.
set -euo pipefail
OUT=${1:?usage: tools/callgrind.sh OUT [EMBANK]}
EMBANK=${2:-target/release/embank}
E='<embank_bench::engines::Embank as embank_bench::engines::Engine>'
for wl in hps-a train; do
  dir=$(mktemp -d)
  tog=(--toggle-collect="$E::pull")
  [ "$wl" = train ] && tog+=(--toggle-collect="$E::push")
  valgrind --tool=callgrind --callgrind-out-file="$OUT.$wl.out" --collect-atstart=no "${tog[@]}" \
    "$EMBANK" bench --workload "$wl" --keys 200000 --dim 64 --threads 1 --ops 400 \
    --engines embank-mmap --skip-limits --dir "$dir" > "$OUT.$wl.log" 2>&1
  rm -rf "$dir"
  echo "$wl: $(grep -h '^summary:' "$OUT.$wl.out" | cut -d' ' -f2) instructions"
done
