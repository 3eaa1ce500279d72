from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import embank
import pytest


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """Two real `embank serve` processes (shards) on free loopback ports."""
    procs: list[subprocess.Popen[str]] = []
    addrs: list[str] = []
    for i in range(2):
        d = tmp_path_factory.mktemp(f"shard{i}")
        # Shard 0 sends every pull/lookup reply zero-copy; shard 1 copies small rows (the default).
        config = d / "serve.toml"
        min_bytes = 0 if i == 0 else 1024
        config.write_text(f'store = "{d / "store"}"\n[limits]\nzero_copy_min_row_bytes = {min_bytes}\n')
        p = subprocess.Popen(
            [sys.executable, "-m", "embank", "serve", "--config", str(config), "--listen", "127.0.0.1:0"],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "EMBANK_LOG": "warn"},
        )
        procs.append(p)
        assert p.stdout is not None
        line = p.stdout.readline()
        assert "listening on" in line, line
        addrs.append(line.split("listening on ")[1].split()[0].rstrip(","))
    yield addrs
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0 and "stopped cleanly" in out, out


@pytest.fixture(params=["local", "remote"])
def store(request: pytest.FixtureRequest, store_path: Path) -> Iterator[embank.Store]:
    """The same tests run on an embedded store and on two shards through embank.connect."""
    if request.param == "local":
        s = embank.open(store_path)
        yield s
        s.close()
        return
    if request.node.get_closest_marker("local_only"):
        pytest.skip(str(request.node.get_closest_marker("local_only").args[0]))
    addrs: list[str] = request.getfixturevalue("cluster")
    s = embank.connect(addrs)
    yield s
    for name in s.tables():
        s.drop_table(name)
    s.close()
