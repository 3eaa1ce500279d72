"""The most any row cache can hit on a training file: optimal caches as a ceiling.

Reads a Criteo-format file (label, 13 dense, 26 categorical columns, tab-separated,
as `examples/dlrm/train.py --synthetic` writes it), groups its lines in batches as the
example does (`embank.datasets.read_criteo`), and counts each batch's distinct
(table, id) rows once, as a step's pull reads them. For caches holding a fraction
of the distinct rows it prints the hit rate and the device reads per step of:

  - the most read rows, fixed (an oracle that knows every row's count in advance);
  - Belady's MIN (evicts the row read again furthest in the future): the optimum of
    any demand cache, whatever its policy.

Against a measured run (`--medium block --cache-fraction F`), this says how far a
better eviction policy could take the block medium at that size: misses cannot fall
below MIN's.

    .venv/bin/python bench/hit_ceiling.py W/synthetic-400000-100000-0-train.tsv \
        [--batch 512] [--fractions 0.05,0.1,0.2]
"""

import argparse
import collections
import heapq

import numpy as np
from embank.datasets import read_criteo


def steps(path: str, batch: int) -> list[list[tuple[int, int]]]:
    """Each batch's distinct (table, id) rows, the ids as the example reads them."""
    out: list[list[tuple[int, int]]] = []
    for b in read_criteo(path, batch):
        rows = {(t, int(v)) for t in range(b.sparse.shape[1]) for v in np.unique(b.sparse[:, t])}
        out.append(sorted(rows))
    return out


def belady_hits(seq: list[int], capacity: int) -> int:
    """Hits of Belady's MIN over `seq` with room for `capacity` keys."""
    never = len(seq)
    next_use = [never] * len(seq)
    last: dict[int, int] = {}
    for i in range(len(seq) - 1, -1, -1):
        next_use[i] = last.get(seq[i], never)
        last[seq[i]] = i
    cached: dict[int, int] = {}  # key -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, key), stale entries skipped
    hits = 0
    for i, k in enumerate(seq):
        if k in cached:
            hits += 1
        elif len(cached) >= capacity:
            while True:
                nu, victim = heapq.heappop(heap)
                if cached.get(victim) == -nu:
                    del cached[victim]
                    break
        if capacity > 0:
            cached[k] = next_use[i]
            heapq.heappush(heap, (-next_use[i], k))
    return hits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("train", help="Criteo-format training file")
    ap.add_argument("--batch", type=int, default=512, help="lines per step (the example's --batch-size)")
    ap.add_argument(
        "--fractions", default="0.05,0.1,0.2", help="cache sizes as fractions of the distinct rows"
    )
    args = ap.parse_args()
    batches = steps(args.train, args.batch)
    ids: dict[tuple[int, int], int] = {}
    seq = [ids.setdefault(r, len(ids)) for b in batches for r in b]
    reads, distinct = len(seq), len(ids)
    counts = sorted(collections.Counter(seq).values(), reverse=True)
    print(
        f"{len(batches)} steps of {args.batch} lines: {reads:,} row reads "
        f"({reads / len(batches):,.0f} a step), "
        f"{distinct:,} distinct rows (first reads alone: {distinct / reads:.1%} of reads)"
    )
    for fraction in (float(x) for x in args.fractions.split(",")):
        capacity = int(distinct * fraction)
        fixed = sum(counts[:capacity]) / reads
        best = belady_hits(seq, capacity) / reads
        print(
            f"cache of {fraction:.0%} ({capacity:,} rows): most read rows fixed {fixed:.1%} hits, "
            f"Belady's MIN {best:.1%} hits, "
            f"{(1 - best) * reads / len(batches):,.0f} device reads a step at best"
        )


if __name__ == "__main__":
    main()
