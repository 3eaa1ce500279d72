"""`embank.open(shared_tier=...)`: two embedded stores share a real 3-master Redis
Cluster (Debian's redis-server, `redis-cli --cluster create`): rows one store read
from its medium are cluster hits for the other, and a write drops the stale copy."""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import embank
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None or shutil.which("redis-cli") is None,
    reason="needs redis-server and redis-cli (Debian's redis-server package)",
)


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[list[str]]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    try:
        import redis_cluster as rc  # type: ignore[import-not-found]
    finally:
        sys.path.pop(0)
    procs, addrs = rc.start(tmp_path / "cluster")
    try:
        yield addrs
    finally:
        rc.stop(procs)


def test_two_stores_share_the_cluster(tmp_path: Path, redis_cluster: list[str]) -> None:
    keys = np.arange(600, dtype=np.uint64)
    rows = np.random.default_rng(0).standard_normal((600, 8)).astype(np.float32)
    tier = {"redis_cluster": redis_cluster, "timeout_ms": 300}
    stores = []
    for name in ("a", "b"):
        s = embank.open(tmp_path / name, cache_bytes=1 << 18, shared_tier=tier)
        t = s.create_table("items", dim=8, medium="block")
        t.push(keys, rows)
        stores.append(s)
    a, b = stores
    # Fresh rows written through to each medium; a's reads fill the cluster.
    got, found = a.table("items").lookup(keys)
    assert found.all() and np.array_equal(got, rows)
    deadline = time.monotonic() + 20
    while a.stats()["shared_tier"]["puts"] < 600:
        assert time.monotonic() < deadline, a.stats()["shared_tier"]
        time.sleep(0.05)
    got, _ = b.table("items").lookup(keys)
    assert np.array_equal(got, rows)
    st = b.stats()["shared_tier"]
    assert st["hits"] == 600 and st["misses"] == 0, st
    # ... and the store used them: b never read its medium for these rows.
    assert b.table("items").stats()["medium_rows_read"] == 0
    # A write through b drops the cluster's copy: a reads its own medium for it again,
    # never the copy b had made stale.
    b.table("items").push(keys[:1], np.full((1, 8), 7.0, dtype=np.float32))
    assert b.stats()["shared_tier"]["invalidations"] >= 1
    for s in stores:
        s.close()
