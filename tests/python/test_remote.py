"""embank.connect against real `embank serve` processes: the embedded store's
model-based test through two shards, optimizers over the wire, and the errors a
remote store adds (a shard down, a wrong token)."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import embank
import numpy as np
import pytest
from conftest import tls_section
from embank import errors
from test_store import run_model_ops


def test_model_based_random_ops_through_two_shards(cluster: list[str]) -> None:
    # Requests of at most 5 keys, so batches split into many; "reopen" reconnects.
    model = run_model_ops(lambda: embank.connect(cluster, keys_per_request_max=5), 300, 30, table="model")
    with embank.connect(cluster) as s:
        assert s.remote and s.path == "tcp://" + ",".join(cluster)
        per_shard = [sh["rows"] for sh in s.table("model").stats()["shards"]]
        assert sum(per_shard) == len(model) and all(n > 0 for n in per_shard), per_shard
        s.drop_table("model")


def test_optimizer_over_the_wire_matches_embedded(cluster: list[str], store_path: Path) -> None:
    opt = embank.optim.Adam(lr=0.01)
    rng = np.random.default_rng(3)
    with embank.connect(cluster) as remote, embank.open(store_path) as local:
        r = remote.create_table("emb", dim=8, init=embank.init.normal(0, 0.1), seed=5, optimizer=opt)
        e = local.create_table("emb", dim=8, init=embank.init.normal(0, 0.1), seed=5, optimizer=opt)
        for _ in range(20):
            keys = rng.integers(0, 100, size=300).astype(np.uint64)
            grads = rng.standard_normal((300, 8)).astype(np.float32)
            r.push_grad(keys, grads)
            e.push_grad(keys, grads)
        r.set_lr(0.5)
        e.set_lr(0.5)
        keys = np.arange(100, dtype=np.uint64)
        r.push_grad(keys, np.ones((100, 8), dtype=np.float32))
        e.push_grad(keys, np.ones((100, 8), dtype=np.float32))
        np.testing.assert_array_equal(r.pull(keys), e.pull(keys))
        assert r.optimizer is not None and r.optimizer["kind"] == "adam"
        assert r.lookahead(keys) in (True, False)
        remote.drop_table("emb")


def start_shard(config: Path) -> tuple[subprocess.Popen[str], str]:
    p = subprocess.Popen(
        [sys.executable, "-m", "embank", "serve", "--config", str(config)], stdout=subprocess.PIPE, text=True
    )
    assert p.stdout is not None
    line = p.stdout.readline()
    assert "listening on" in line, line
    return p, line.split("listening on ")[1].split()[0].rstrip(",")


@pytest.fixture
def lone_shard(tmp_path: Path, tls_dir: Path) -> Iterator[tuple[subprocess.Popen[str], str, Path]]:
    config = tmp_path / "shard.toml"
    config.write_text(
        f'store = "{tmp_path / "s"}"\nlisten = "127.0.0.1:0"\ntoken = "s3cret"\n' + tls_section(tls_dir)
    )
    p, addr = start_shard(config)
    yield p, addr, config
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=60)


def test_a_token_sent_to_a_server_without_one_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client with a token believes the server checks it: a server with none says so
    (it used to accept the connection silently)."""
    monkeypatch.delenv("EMBANK_TLS_CA_FILE", raising=False)  # a plain loopback server
    config = tmp_path / "open.toml"
    config.write_text(f'store = "{tmp_path / "s"}"\nlisten = "127.0.0.1:0"\n')
    p, addr = start_shard(config)
    try:
        with pytest.raises(errors.UnauthorizedError, match="this server takes no token"):
            embank.connect([addr], token="s3cret")
        with embank.connect([addr]) as s:
            assert s.tables() == []
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=60)


def test_token_and_a_shard_that_goes_down(lone_shard: tuple[subprocess.Popen[str], str, Path]) -> None:
    proc, addr, _ = lone_shard
    with pytest.raises(errors.UnauthorizedError, match="this server requires a token"):
        embank.connect([addr])
    with pytest.raises(PermissionError, match="wrong token"):
        embank.connect([addr], token="wrong")
    s = embank.connect(addr, token="s3cret")
    t = s.create_table("t", dim=3)
    t.push([1, 2], np.ones((2, 3), dtype=np.float32))
    s.flush()
    proc.kill()
    proc.wait()
    with pytest.raises(errors.ShardUnavailableError, match=f"shard 0 \\({addr}\\)") as e:
        t.pull([1])
    assert isinstance(e.value, ConnectionError)
    with pytest.raises(errors.ShardUnavailableError, match="unreachable"):
        embank.connect([addr], token="s3cret", connect_timeout=1.0)
    with pytest.raises(errors.ShardUnavailableError):
        s.close()  # the final flush cannot reach the shard; the client is closed anyway
    assert s.closed
    s.close()  # idempotent
    with pytest.raises(errors.StoreClosedError):
        s.table("t")


def test_connect_argument_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EMBANK_TLS_CA_FILE", raising=False)
    with pytest.raises(errors.ConfigError, match="at least one"):
        embank.connect([])
    with pytest.raises(errors.ConfigError, match=r'"localhost" has no port: write host:port'):
        embank.connect(["localhost"])
    with pytest.raises(errors.ConfigError, match="timeout"):
        embank.connect(["127.0.0.1:1"], timeout=0)
    with pytest.raises(errors.ShardUnavailableError):
        embank.connect(["127.0.0.1:1"], connect_timeout=0.5)
    with pytest.raises(errors.ConfigError, match="in_flight_per_shard must be at least 1"):
        embank.connect(["127.0.0.1:1"], in_flight_per_shard=0)
    with pytest.raises(errors.ConfigError, match="need tls_ca_file"):
        embank.connect(["127.0.0.1:1"], tls_server_name="x")


def test_a_cluster_file_gives_what_the_arguments_do_not(tmp_path: Path) -> None:
    """A setting of the file applies unless given as an argument, whatever its value
    (an argument equal to the default still wins); a key the client does not know is
    refused, named."""
    cluster = tmp_path / "cluster.toml"
    cluster.write_text('timeout_seconds = -1.0\n[[shards]]\nreplicas = ["127.0.0.1:1"]\n')
    with pytest.raises(errors.ConfigError, match="timeout_seconds must be a positive"):
        embank.connect(cluster)
    with pytest.raises(errors.ShardUnavailableError):  # the argument wins: no config error
        embank.connect(cluster, timeout=30.0, connect_timeout=0.5)
    cluster.write_text('timeout = 3.0\n[[shards]]\nreplicas = ["127.0.0.1:1"]\n')
    with pytest.raises(errors.ConfigError, match="timeout"):
        embank.connect(cluster)


def test_mutual_tls(tmp_path: Path, tls_dir: Path) -> None:
    config = tmp_path / "mtls.toml"
    config.write_text(
        f'store = "{tmp_path / "s"}"\nlisten = "127.0.0.1:0"\n' + tls_section(tls_dir, client_ca=True)
    )
    p, addr = start_shard(config)
    try:
        with pytest.raises(
            errors.ShardUnavailableError, match=r"CertificateRequired.*set tls_cert_file and tls_key_file"
        ):
            embank.connect([addr])
        with pytest.raises(errors.ConfigError, match="both"):
            embank.connect([addr], tls_cert_file=tls_dir / "client.pem")
        with embank.connect(
            [addr], tls_cert_file=tls_dir / "client.pem", tls_key_file=tls_dir / "client.key"
        ) as s:
            t = s.create_table("t", dim=2)
            t.push([7], np.ones((1, 2), dtype=np.float32))
            np.testing.assert_array_equal(t.pull([7]), np.ones((1, 2), dtype=np.float32))
        with pytest.raises(errors.ShardUnavailableError, match="TLS handshake failed"):
            embank.connect([addr], tls_ca_file=tls_dir / "server.pem")  # not the CA
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=60)


def test_connect_to_the_admin_port_fails_at_once_naming_what_answered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("EMBANK_TLS_CA_FILE")  # a clear-text client, as most first tries are
    admin = socket.socket()
    admin.bind(("127.0.0.1", 0))
    admin_addr = f"127.0.0.1:{admin.getsockname()[1]}"
    admin.close()
    config = tmp_path / "shard.toml"
    config.write_text(f'store = "{tmp_path / "s"}"\nlisten = "127.0.0.1:0"\nadmin = "{admin_addr}"\n')
    p, _ = start_shard(config)
    try:
        started = time.monotonic()
        with pytest.raises(errors.ShardUnavailableError, match=r'not an embank server.*"HTTP/1\.1 400'):
            embank.connect([admin_addr], timeout=3)
        # One answer, no retries: it used to take 8 hellos and ~20 s.
        assert time.monotonic() - started < 2.5
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=60)


def test_a_cluster_file_is_the_shard_map_switched_to_while_connected(
    tmp_path: Path, cluster: list[str]
) -> None:
    """Connected through a cluster file, a store follows it: a higher ``version`` (here a
    second shard) is switched to between calls, tables opened before it included; an
    older one is ignored."""
    a, b = cluster
    with embank.connect(cluster) as both:
        both.create_table("mapped", dim=4)
    f = tmp_path / "cluster.toml"
    f.write_text(f'version = 1\nreload_seconds = 0.05\n[[shards]]\nreplicas = ["{a}"]\n')
    keys = np.arange(200, dtype=np.uint64)
    try:
        with embank.connect(f) as s:
            t = s.table("mapped")
            t.push(keys, np.ones((200, 4), dtype=np.float32))  # every key on a
            f.write_text(f'version = 0\n[[shards]]\nreplicas = ["{b}"]\n')
            time.sleep(0.5)
            assert s.path == f"tcp://{a}"
            shards = f'[[shards]]\nreplicas = ["{a}"]\n[[shards]]\nreplicas = ["{b}"]\n'
            f.write_text("version = 2\nreload_seconds = 0.05\n" + shards)
            deadline = time.monotonic() + 10
            while s.path != f"tcp://{a},{b}":
                assert time.monotonic() < deadline, s.path
                time.sleep(0.02)
            _, found = t.lookup(keys)
            # Keys the new map routes to b were written to a: not found there.
            assert 50 < int(found.sum()) < 150, int(found.sum())
    finally:
        with embank.connect(cluster) as both:
            both.drop_table("mapped")


def test_check_config_refuses_what_serve_refuses(tmp_path: Path) -> None:
    """``embank serve --check-config`` runs the checks ``serve`` runs before it listens:
    a non-loopback address without a token, or without TLS; a port alone; a declared
    table whose dim differs from the store's (read from its catalog, not opened)."""
    store = tmp_path / "s"
    with embank.open(store) as s:
        s.create_table("items", dim=4)

    def check(body: str) -> subprocess.CompletedProcess[str]:
        config = tmp_path / "serve.toml"
        config.write_text(f'store = "{store}"\n' + body)
        cmd = [sys.executable, "-m", "embank", "serve", "--config", str(config), "--check-config"]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60)

    for body, refusal in (
        ('listen = "0.0.0.0:7072"\n', "requires an auth token"),
        ('listen = "0.0.0.0:7072"\ntoken = "s3cret"\n', "requires TLS"),
        ('listen = "7072"\n', 'a port alone; write host:port, e.g. "127.0.0.1:7072"'),
        (
            '[[tables]]\nname = "items"\ndim = 8\n',
            'table "items" exists in .* with dim 4, but the config says dim 8',
        ),
    ):
        out = check(body)
        assert out.returncode != 0 and re.search(refusal, out.stderr), (body, out.stderr)
    out = check('listen = "127.0.0.1:7072"\n[[tables]]\nname = "items"\ndim = 4\n')
    assert out.returncode == 0 and out.stdout.startswith("config ok"), out.stderr


def test_shard_of_is_where_the_client_routes_each_key(cluster: list[str]) -> None:
    """``embank.shard_of`` answers what ``embank.connect`` does: keys written through two
    shards are found on the shard it names, and on no other; the values are pinned (the
    same as the Rust test ``shard_of_is_pinned``)."""
    keys = np.arange(2_000, dtype=np.uint64)
    with embank.connect(cluster) as both:
        both.create_table("routed", dim=2).push(keys, np.ones((len(keys), 2), dtype=np.float32))
    try:
        want = embank.shard_of(keys, 2)
        assert want.dtype == np.uint32 and want.shape == keys.shape
        for i, addr in enumerate(cluster):
            with embank.connect([addr]) as one:
                _, found = one.table("routed").lookup(keys)
            bad = np.flatnonzero(found != (want == i))
            assert bad.size == 0, f"shard {i} ({addr}): keys {keys[bad][:5]} found={found[bad][:5]}"
    finally:
        with embank.connect(cluster) as both:
            both.drop_table("routed")
    pinned = np.array([0, 1, 3, 14, 15, 92, 2**64 - 1], dtype=np.uint64)
    assert embank.shard_of(pinned, 2).tolist() == [0, 1, 1, 0, 0, 0, 1]
    assert embank.shard_of(pinned, 1000).tolist() == [728, 649, 436, 217, 671, 53, 74]
    assert embank.shard_of([3, 14, 15, 92], 2).tolist() == [1, 0, 0, 0]  # lists, as the docstring
    many = np.arange(1 << 20, dtype=np.uint64)  # past the size that releases the GIL
    np.testing.assert_array_equal(embank.shard_of(many, 3)[: len(keys)], embank.shard_of(keys, 3))
    with pytest.raises(errors.InvalidInputError, match="shards must be between 1"):
        embank.shard_of(keys, 0)
    with pytest.raises(errors.InvalidInputError, match="non-negative"):
        embank.shard_of(np.array([-1]), 2)


def test_connect_reads_the_shard_map_from_an_http_url_or_any_file(tmp_path: Path, cluster: list[str]) -> None:
    """A string that is an ``http://`` URL or the path of an existing file (whatever its
    name) is a cluster file, reloaded as the client runs: from a URL, a higher version
    is switched to as from a file. It used to be read as a file path ("cannot read client
    config") or as an address list."""
    import http.server
    import threading

    a, b = cluster
    served = tmp_path / "www"
    served.mkdir()
    (served / "cluster.toml").write_text(
        f'version = 1\nreload_seconds = 0.05\n[[shards]]\nreplicas = ["{a}"]\n'
    )

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, directory=str(served), **kwargs)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/cluster.toml"
    with embank.connect(cluster) as both:
        both.create_table("from_url", dim=2)
    try:
        with embank.connect(url) as s:
            assert s.path == f"tcp://{a}"
            t = s.table("from_url")
            t.push([1, 2], np.ones((2, 2), dtype=np.float32))
            shards = f'[[shards]]\nreplicas = ["{a}"]\n[[shards]]\nreplicas = ["{b}"]\n'
            (served / "cluster.toml").write_text("version = 2\nreload_seconds = 0.05\n" + shards)
            deadline = time.monotonic() + 10
            while s.path != f"tcp://{a},{b}":
                assert time.monotonic() < deadline, (
                    f"still on {s.path} after 10 s; the map at {url} has 2 shards"
                )
                time.sleep(0.02)
        with pytest.raises(errors.ShardUnavailableError, match="404"):
            embank.connect(url.replace("cluster.toml", "missing.toml"))
        # A file not named .toml is a cluster file too, not one address.
        plain = tmp_path / "cluster"
        plain.write_text(f'[[shards]]\nreplicas = ["{a}"]\n[[shards]]\nreplicas = ["{b}"]\n')
        with embank.connect(str(plain)) as s:
            assert s.path == f"tcp://{a},{b}" and "from_url" in s.tables()
    finally:
        httpd.shutdown()
        httpd.server_close()
        with embank.connect(cluster) as both:
            both.drop_table("from_url")


def test_a_frozen_replica_costs_a_read_milliseconds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A group of two servers holding the same rows; one is frozen (SIGSTOP): every read
    still answers, in far less than the timeout, from the other; the frozen one is
    ejected, counted in replica_counts(), and readmitted once it runs again."""
    for var in ("EMBANK_TLS_CA_FILE", "EMBANK_TLS_CERT_FILE", "EMBANK_TLS_KEY_FILE"):
        monkeypatch.delenv(var, raising=False)
    procs, addrs = [], []
    keys = np.arange(1000, dtype=np.uint64)
    rows = np.arange(1000 * 4, dtype=np.float32).reshape(1000, 4)
    for name in ("a", "b"):
        config = tmp_path / f"{name}.toml"
        config.write_text(f'store = "{tmp_path / name}"\nlisten = "127.0.0.1:0"\n')
        p, addr = start_shard(config)
        procs.append(p)
        addrs.append(addr)
        with embank.connect([addr]) as one:
            one.create_table("t", dim=4).push(keys, rows)
    try:
        with embank.connect([addrs], timeout=30, deadline_min=0.1) as store:
            t = store.table("t")
            for _ in range(50):
                t.lookup(keys[:200])
            procs[0].send_signal(signal.SIGSTOP)
            longest = 0.0
            try:
                until = time.monotonic() + 1.5
                while time.monotonic() < until:
                    started = time.monotonic()
                    got, found = t.lookup(keys[:200])
                    longest = max(longest, time.monotonic() - started)
                    assert found.all() and np.array_equal(got, rows[:200])
                a = store.replica_counts()[0][0]
                assert a["ejected"] and a["ejections"] == 1, a
            finally:
                procs[0].send_signal(signal.SIGCONT)
            assert longest < 2.0, f"a read took {longest:.2f} s with one replica frozen"
            until = time.monotonic() + 10
            while store.replica_counts()[0][0]["ejected"]:
                assert time.monotonic() < until, store.replica_counts()
                time.sleep(0.05)
            counts = store.replica_counts()[0]
            assert counts[0]["readmissions"] == 1 and counts[1]["ejections"] == 0, counts
            assert sum(c["hedges_sent"] for c in counts) >= 0 and counts[1]["answered"] > 0
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=60)


def test_a_write_to_a_silent_primary_fails_at_its_deadline_naming_the_shard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write no other replica can take fails at its deadline (``deadline_alone_min``
    here 0.5 s, 5 s by default), naming the shard and the wait, instead of hanging until
    the 30 s timeout; the store works again once the server runs."""
    for var in ("EMBANK_TLS_CA_FILE", "EMBANK_TLS_CERT_FILE", "EMBANK_TLS_KEY_FILE"):
        monkeypatch.delenv(var, raising=False)
    config = tmp_path / "s.toml"
    config.write_text(f'store = "{tmp_path / "s"}"\nlisten = "127.0.0.1:0"\n')
    p, addr = start_shard(config)
    try:
        with embank.connect([addr], timeout=30, deadline_alone_min=0.5) as store:
            t = store.create_table("t", dim=4)
            keys = np.arange(100, dtype=np.uint64)
            t.push(keys, np.ones((100, 4), dtype=np.float32))
            p.send_signal(signal.SIGSTOP)
            started = time.monotonic()
            try:
                with pytest.raises(errors.EmbankTimeoutError) as e:
                    t.push(keys, np.zeros((100, 4), dtype=np.float32))
            finally:
                p.send_signal(signal.SIGCONT)
            took = time.monotonic() - started
            assert 0.4 < took < 3.0, took
            message = str(e.value)
            assert addr in message and "within 500 ms" in message and "deadline_alone_min" in message, message
            # The timed-out push may or may not have been applied (or be being applied).
            rows, found = t.lookup(keys)
            assert found.all() and np.isin(rows, (0.0, 1.0)).all(), rows
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=60)


def test_a_train_cache_over_two_served_shards_trains_as_the_embedded_table(
    tmp_path: Path, tls_dir: Path, store_path: Path
) -> None:
    """embank.gpu.TrainCache over a remote table: misses read with their state from each
    shard's primary (``LOOKUP_WITH_STATE``), evicted rows written back with it
    (``PUSH_WITH_STATE``), a checkpoint on every shard; rows and state equal an embedded
    table trained through ``push_grad`` alone."""
    torch = pytest.importorskip("torch")
    from embank import gpu

    # Shards of its own: checkpoints stay on a store (the shared cluster's would then refuse
    # the lower batch ids of the tests that run after this one).
    shards = []
    for i in range(2):
        config = tmp_path / f"shard{i}.toml"
        config.write_text(f'store = "{tmp_path / f"s{i}"}"\nlisten = "127.0.0.1:0"\n' + tls_section(tls_dir))
        shards.append(start_shard(config))
    cluster = [addr for _, addr in shards]

    try:
        opt = embank.optim.Adam(lr=0.01)
        rng = np.random.default_rng(6)
        with (
            embank.connect(cluster, tls_ca_file=str(tls_dir / "ca.pem")) as remote,
            embank.open(store_path) as local,
        ):
            r = remote.create_table("tc", dim=8, init=embank.init.normal(0, 0.1), seed=5, optimizer=opt)
            e = local.create_table("tc", dim=8, init=embank.init.normal(0, 0.1), seed=5, optimizer=opt)
            cache = gpu.TrainCache(r, rows_max=40, slots=8, device="cpu")
            for b in range(1, 16):
                keys = rng.integers(0, 300, size=120)
                grads = rng.standard_normal((120, 8)).astype(np.float32)
                cache.pull(torch.from_numpy(keys))
                cache.push_grad(torch.from_numpy(keys), torch.from_numpy(grads))
                e.pull(keys.astype(np.uint64))
                e.push_grad(keys.astype(np.uint64), grads)
                if b % 5 == 0:
                    cache.checkpoint(b)
            assert cache.stats()["evicted"] > 0
            cache.close()
            keys = np.arange(300, dtype=np.uint64)
            got, got_found = r.lookup_with_state(keys)
            want, want_found = e.lookup_with_state(keys)
            np.testing.assert_array_equal(got_found, want_found)
            np.testing.assert_array_equal(got[got_found], want[want_found])
            assert remote.checkpoints()[-1] == 15
    finally:
        for p, _ in shards:
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=60)
