#!/usr/bin/env bash
# The larger-than-memory comparison of docs/BENCHMARKS.md: hps-a (Zipf 1.2 pulls)
# over a key space about 4x the DRAM budget.
#
#   bench/hps-a.sh [KEYS] [BUDGET] [OUT_DIR]     defaults: 8000000 keys (4 GiB of
#                                                 dim-128 rows), 1G budget, bench-out
#   WARMUP=SECS (default 10): run before each measured phase, not counted.
#
# Run 1, one process: embank-block (io_uring + row cache of BUDGET), embank-block-pread,
# RocksDB (block cache of BUDGET, O_DIRECT reads so the page cache adds nothing).
# Run 2: embank-mmap in a memory cgroup of BUDGET + the index's size, so the page
# cache holding its rows gets the same DRAM as embank-block's row cache plus index
# (needs root and the cgroup v1 memory controller, or is reported as skipped).
set -euo pipefail
KEYS=${1:-8000000}
BUDGET=${2:-1G}
OUT=${3:-bench-out}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
cargo build --release --locked -p embank-cli --features baselines
BIN=target/release/embank
WARMUP=${WARMUP:-10}
# 24,000 batches of 500 keys per thread: 12 M Zipf draws that do not repeat, so the
# keys touched really exceed the cache (192 MiB of key streams for 2 threads).
STREAM=${STREAM:-24000}
COMMON=(--workload hps-a --keys "$KEYS" --dim 128 --batch 500 --duration 10 --warmup "$WARMUP" --stream-batches "$STREAM")

"$BIN" bench "${COMMON[@]}" --cache-bytes "$BUDGET" \
    --engines embank-block,embank-block-pread,rocksdb --out "$OUT/hps-a.json" | tee "$OUT/hps-a.txt"

to_bytes() { python3 -c "import sys; s=sys.argv[1]; m={'K':1<<10,'M':1<<20,'G':1<<30}; print(int(float(s[:-1])*m[s[-1].upper()]) if s[-1].upper() in m else int(s))" "$1"; }
# Index: 256-byte buckets, a power of two at or above keys / (14 * 0.7).
INDEX=$(python3 -c "import math,sys; k=int(sys.argv[1]); b=1<<math.ceil(math.log2(max(1,k/(14*0.7)))); print(b*256+4096)" "$KEYS")
# The cgroup also holds the bench's own memory: the key streams (8 bytes a key) and ~64 MiB.
THREADS=$(nproc)
LIMIT=$(( $(to_bytes "$BUDGET") + INDEX + STREAM * 500 * 8 * THREADS + (64 << 20) ))
CG=/sys/fs/cgroup/memory/embank-hps-a
if mkdir -p "$CG" 2>/dev/null && echo "$LIMIT" > "$CG/memory.limit_in_bytes" 2>/dev/null; then
    echo "embank-mmap in memory cgroup $CG limited to $LIMIT bytes (budget + index + key streams + 64 MiB)"
    # The subshell joins the cgroup, then runs the bench; the limit covers its page cache.
    (echo $BASHPID > "$CG/cgroup.procs"; exec "$BIN" bench "${COMMON[@]}" --skip-limits --mmap-random-access true \
        --engines embank-mmap --out "$OUT/hps-a-mmap-cgroup.json") | tee "$OUT/hps-a-mmap-cgroup.txt"
    rmdir "$CG" 2>/dev/null || true
else
    echo "embank-mmap with limited memory: skipped (cannot create a memory cgroup here: needs root and cgroup v1 memory)" \
        | tee "$OUT/hps-a-mmap-cgroup.txt"
fi
