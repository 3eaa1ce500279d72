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


@pytest.fixture(scope="session", autouse=True)
def tls_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A development CA and certificates (`embank cert`). Every `embank serve` the tests
    start speaks TLS, and `embank.connect` finds the CA through EMBANK_TLS_CA_FILE, so
    every remote test runs over TLS."""
    d = tmp_path_factory.mktemp("tls")
    subprocess.run([sys.executable, "-m", "embank", "cert", "--out", str(d)], check=True, capture_output=True)
    os.environ["EMBANK_TLS_CA_FILE"] = str(d / "ca.pem")
    yield d
    os.environ.pop("EMBANK_TLS_CA_FILE", None)


def tls_section(tls_dir: Path, client_ca: bool = False) -> str:
    """The [tls] table of a test server's config."""
    text = f'[tls]\ncert_file = "{tls_dir / "server.pem"}"\nkey_file = "{tls_dir / "server.key"}"\n'
    if client_ca:
        text += f'client_ca_file = "{tls_dir / "ca.pem"}"\n'
    return text


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory, tls_dir: Path) -> Iterator[list[str]]:
    """Two real `embank serve` processes (shards) on free loopback ports, over TLS."""
    procs: list[subprocess.Popen[str]] = []
    addrs: list[str] = []
    for i in range(2):
        d = tmp_path_factory.mktemp(f"shard{i}")
        # Shard 0 sends every pull/lookup reply zero-copy; shard 1 copies small rows (the default).
        config = d / "serve.toml"
        min_bytes = 0 if i == 0 else 1024
        config.write_text(
            f'store = "{d / "store"}"\n[limits]\nzero_copy_row_bytes_min = {min_bytes}\n'
            + tls_section(tls_dir)
        )
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


@pytest.fixture(scope="module")
def gpu_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[embank.Store]:
    """One store for the module's tests (a table each): a store's files take seconds
    to remove."""
    store = embank.open(tmp_path_factory.mktemp("gpu") / "s")
    yield store
    store.close()
