#!/usr/bin/env bash
# Networked runs for docs/BENCHMARKS.md: two `embank serve` shards on loopback, the
# workload through the client (embank-tcp), next to the embedded store, the DRAM hash
# map and Redis (pipelined MGET) in the same run.
#
#   bench/serve.sh [ZERO_COPY=true|false] -- extra `embank bench` arguments
# (true: every pull/lookup reply is sent zero-copy, whatever the row size; false: copied)
#   e.g. bench/serve.sh true -- --workload ycsb-b --keys 2000000 --threads 4
#   ENGINES=embank-tcp bench/serve.sh false -- ...   (only the networked engine)
set -euo pipefail
zero_copy=${1:-true}
shift || true
[[ ${1:-} == -- ]] && shift
root=$(cd "$(dirname "$0")/.." && pwd)
bin=$root/target/release/embank
[[ -x $bin ]] || cargo build --release --locked -p embank-cli --features baselines
work=$(mktemp -d /tmp/embank-serve-bench.XXXXXX)
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT
addrs=()
for i in 0 1; do
    cat > "$work/shard$i.toml" <<TOML
store = "$work/shard$i"
listen = "127.0.0.1:0"
[limits]
zero_copy = $zero_copy
zero_copy_row_bytes_min = 0
TOML
    "$bin" serve --config "$work/shard$i.toml" > "$work/shard$i.out" &
    pids+=($!)
    for _ in $(seq 100); do grep -q 'listening on' "$work/shard$i.out" 2>/dev/null && break; sleep 0.1; done
    addrs+=("$(sed -n 's/.*listening on \([^ ,]*\).*/\1/p' "$work/shard$i.out")")
done
target="tcp://$(IFS=,; echo "${addrs[*]}")"
echo "shards: $target (zero_copy = $zero_copy)"
"$bin" bench --target "$target" --engines "${ENGINES:-embank-tcp,embank-mmap,hashmap,redis}" "$@"
