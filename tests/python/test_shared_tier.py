"""`embank.open(shared_tier=...)`: two embedded stores share a real 3-master Redis
Cluster (Debian's redis-server, `redis-cli --cluster create`): rows one store read
from its medium are cluster hits for the other, and a write drops the stale copy."""

from __future__ import annotations

import shutil
import socket
import subprocess
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


def _port() -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = int(s.getsockname()[1])
        if p < 55000:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p + 10000))  # the cluster bus port
                    return p
                except OSError:
                    pass


def _cli(port: int, *args: str) -> str:
    r = subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True, text=True)
    return r.stdout + r.stderr


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[list[str]]:
    procs, ports = [], []
    for i in range(3):
        port, d = _port(), tmp_path / f"redis{i}"
        d.mkdir()
        args = ["--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes"]
        args += ["--cluster-config-file", "nodes.conf", "--save", "", "--appendonly", "no", "--dir", str(d)]
        procs.append(subprocess.Popen(["redis-server", *args], stdout=subprocess.DEVNULL))
        ports.append(port)
    try:
        for p in ports:
            deadline = time.monotonic() + 20
            while "PONG" not in _cli(p, "ping"):
                assert time.monotonic() < deadline
                time.sleep(0.05)
        addrs = [f"127.0.0.1:{p}" for p in ports]
        r = subprocess.run(
            ["redis-cli", "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True, text=True,
        )  # fmt: skip
        assert r.returncode == 0, r.stdout
        deadline = time.monotonic() + 30
        while not all("cluster_state:ok" in _cli(p, "cluster", "info") for p in ports):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        yield addrs
    finally:
        for pr in procs:
            pr.kill()
            pr.wait()


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
