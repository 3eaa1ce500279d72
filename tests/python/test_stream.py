"""The update stream from Python: a training store's publisher feeding `embank serve`
replicas through a real Redis (Streams), replica groups in `embank.connect`, versioned
reads, and the loud failure of a publisher whose broker is gone."""

from __future__ import annotations

import os
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
import numpy.typing as npt
import pytest
from conftest import tls_section
from embank.errors import EmbankTimeoutError, PublishError, ShardUnavailableError, UnsupportedError

DIM = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Redis:
    def __init__(self, d: Path) -> None:
        self.port = free_port()
        self.dir = d
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                *("redis-server", "--port", str(self.port), "--bind", "127.0.0.1"),
                *("--save", "", "--appendonly", "yes", "--dir", str(self.dir)),
            ],
            stdout=subprocess.DEVNULL,
        )
        deadline = time.time() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                assert time.time() < deadline, "redis-server did not start"
                time.sleep(0.05)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[Redis]:
    r = Redis(tmp_path)
    yield r
    if r.proc is not None and r.proc.poll() is None:
        r.kill()


def replica(
    d: Path, url: str, topic: str, partition: int, tls_dir: Path, tables: str = ""
) -> tuple[subprocess.Popen[str], str]:
    config = d / f"replica-{partition}-{len(list(d.glob('*.toml')))}.toml"
    config.write_text(
        f'store = "{config.with_suffix(".store")}"\nlisten = "127.0.0.1:0"\n'
        f'[updates]\ntransport = "redis"\nbrokers = "{url}"\ntopic = "{topic}"\npartition = {partition}\n'
        + tls_section(tls_dir)
        + tables
    )
    p = subprocess.Popen(
        [sys.executable, "-m", "embank", "serve", "--config", str(config)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "EMBANK_LOG": "warn"},
    )
    assert p.stdout is not None
    line = p.stdout.readline()
    assert "replica of" in line, line
    return p, line.split("listening on ")[1].split()[0].rstrip(",")


def lookup_when_served(remote: embank.Store, keys: npt.NDArray[Any], batch: int) -> tuple[Any, Any]:
    """``remote``'s lookup of ``keys`` once a replica serves checkpoint ``batch`` (30 s)."""
    deadline = time.time() + 30
    while True:
        try:
            return remote.table("emb").lookup(keys)
        except (ShardUnavailableError, embank.NotFoundError):
            assert time.time() < deadline, f"the replica never served checkpoint {batch}"
            time.sleep(0.05)


def train(store: embank.Store, batches: range, rng: np.random.Generator) -> None:
    t = store.table("emb")
    for b in batches:
        keys = rng.integers(0, 2000, 256).astype(np.uint64)
        rows = t.pull(keys)
        t.push_grad(keys, (rng.random(rows.shape, dtype=np.float32) - 0.5))
        t.delete(rng.integers(0, 2000, 3).astype(np.uint64))
        store.checkpoint(b)


def test_replica_groups_serve_the_published_checkpoint_and_fail_over(
    tmp_path: Path, redis: Redis, tls_dir: Path
) -> None:
    rng = np.random.default_rng(3)
    trainer = embank.open(tmp_path / "trainer")
    trainer.create_table(
        "emb", dim=DIM, init=embank.init.normal(0, 0.1), optimizer=embank.optim.Adagrad(lr=0.1)
    )
    pub = trainer.publisher("redis", redis.url, topic="py", partitions=2)
    train(trainer, range(1, 6), rng)
    pub.flush(timeout=30)
    status = pub.status()
    assert status["published_batch_id"] == 5 and status["pending"] == 0, status
    procs = [replica(tmp_path, redis.url, "py", p, tls_dir) for p in (0, 0, 1)]
    try:
        # The replica groups from a client config file.
        cluster = tmp_path / "cluster.toml"
        cluster.write_text(
            f'min_checkpoint = 5\ntimeout_seconds = 5.0\ntls_ca_file = "{tls_dir / "ca.pem"}"\n'
            f'[[shards]]\nreplicas = ["{procs[0][1]}", "{procs[1][1]}"]\n'
            f'[[shards]]\nreplicas = ["{procs[2][1]}"]\n'
        )
        remote = embank.connect(cluster)
        deadline = time.time() + 30
        while True:
            try:
                t = remote.table("emb")
                keys = np.arange(2000, dtype=np.uint64)
                rows, found = t.lookup(keys)
                break
            except (ShardUnavailableError, embank.NotFoundError):
                assert time.time() < deadline, "replicas never served checkpoint 5"
                time.sleep(0.05)
        want = dict()
        for k, r in trainer.export_checkpoint("emb", 5):
            for key, row in zip(k.tolist(), r):
                want[key] = row
        assert int(found.sum()) == len(want)
        for i in np.flatnonzero(found)[:500]:
            np.testing.assert_array_equal(rows[i], want[int(keys[i])])
        assert [s["batch_id"] for s in remote.served()] == [5, 5]
        with pytest.raises(UnsupportedError, match="replica of"):
            t.push(np.array([1], dtype=np.uint64), np.zeros((1, DIM), dtype=np.float32))
        with pytest.raises(ShardUnavailableError, match="checkpoint 6 or later"):
            t.lookup(keys[:10], min_checkpoint=6)
        # Replica 1 of shard 0 has checkpoint 5 too; then replica 0 dies: reads go on.
        deadline = time.time() + 30
        with embank.connect([procs[1][1]], min_checkpoint=5) as one:
            while True:
                try:
                    one.table("emb").lookup(keys[:1])
                    break
                except (ShardUnavailableError, embank.NotFoundError):
                    assert time.time() < deadline, "replica 1 never served checkpoint 5"
                    time.sleep(0.05)
        procs[0][0].send_signal(signal.SIGKILL)
        procs[0][0].wait()
        for _ in range(20):
            rows2, found2 = t.lookup(keys)
            np.testing.assert_array_equal(found2, found)
            np.testing.assert_array_equal(rows2, rows)
        remote.close()
    finally:
        for p, _ in procs:
            p.kill()
            p.wait()
        pub.close()
        trainer.close()


def test_a_replica_serves_the_stream_as_int8_rows(tmp_path: Path, redis: Redis, tls_dir: Path) -> None:
    """Training in f32, serving int8: the replica's table (from its [[tables]]) stores the
    published rows quantized, and a reset keeps its type."""
    rng = np.random.default_rng(8)
    trainer = embank.open(tmp_path / "trainer")
    trainer.create_table("emb", dim=DIM, init=embank.init.normal(0, 0.1), optimizer=embank.optim.SGD(lr=0.1))
    pub = trainer.publisher("redis", redis.url, topic="q8", partitions=1)
    train(trainer, range(1, 4), rng)
    pub.flush(timeout=30)
    tables = f'[[tables]]\nname = "emb"\ndim = {DIM}\ndtype = "int8"\n'
    proc, addr = replica(tmp_path, redis.url, "q8", 0, tls_dir, tables)
    try:
        remote = embank.connect([addr], tls_ca_file=str(tls_dir / "ca.pem"), min_checkpoint=3)
        keys = np.arange(2000, dtype=np.uint64)
        rows, found = lookup_when_served(remote, keys, 3)
        assert remote.table("emb").stored_dtype == "int8"
        want: dict[int, np.ndarray[tuple[int, ...], np.dtype[np.float32]]] = {}
        for k, r in trainer.export_checkpoint("emb", 3):
            want.update(zip(k.tolist(), r))
        assert int(found.sum()) == len(want)
        for i in np.flatnonzero(found):
            w = want[int(keys[i])]
            lo, hi = float(w.min()), float(w.max())
            step = (hi - lo) / 255
            assert np.abs(rows[i] - w).max() <= step / 2 + 1e-6, (rows[i], w)
        # Rows as stored from the replica (its served view reads them decoded and encodes
        # them again: the same values, to float32 rounding of the recomputed scale).
        stored, found_stored = remote.table("emb").lookup_stored(keys)
        assert stored.shape == (len(keys), DIM + 8) and (found_stored == found).all()
        np.testing.assert_allclose(embank.decode_rows(stored, "int8", DIM), rows, rtol=0, atol=1e-5)
        remote.close()
    finally:
        proc.kill()
        proc.wait()
        pub.close()
        trainer.close()


def test_publisher_raises_when_the_broker_stays_down(tmp_path: Path, redis: Redis) -> None:
    rng = np.random.default_rng(4)
    with embank.open(tmp_path / "trainer") as trainer:
        trainer.create_table("emb", dim=DIM, optimizer=embank.optim.SGD(lr=0.1))
        with trainer.publisher("redis", redis.url, topic="down", checkpoints_pending_max=1, timeout=1) as pub:
            train(trainer, range(1, 2), rng)
            pub.flush(timeout=30)
            redis.kill()
            train(trainer, range(2, 3), rng)
            # A checkpoint raises once an attempt has failed: wait for the publisher
            # thread's first one (on a busy machine it may not have run yet).
            deadline = time.monotonic() + 30
            while not pub.status()["last_error"]:
                assert time.monotonic() < deadline, "no publish attempt failed with the broker down"
                time.sleep(0.01)
            with pytest.raises(PublishError, match="2 checkpoints wait to be published"):
                train(trainer, range(3, 4), rng)
            assert trainer.checkpoints()[-1] == 3  # the checkpoint itself was taken
            with pytest.raises(EmbankTimeoutError, match="not published"):
                pub.flush(timeout=0.3)
            assert pub.status()["last_error"]
            redis.start()
            pub.flush(timeout=30)
            assert pub.status()["published_batch_id"] == 3
            assert pub.status()["full_snapshots"] == 2


def test_a_flush_before_the_first_checkpoint_returns_at_once(tmp_path: Path, redis: Redis) -> None:
    with embank.open(tmp_path / "trainer") as trainer:
        trainer.create_table("emb", dim=DIM, optimizer=embank.optim.SGD(lr=0.1))
        with trainer.publisher("redis", redis.url, topic="none-yet", timeout=1) as pub:
            started = time.monotonic()
            pub.flush(timeout=20)  # waited out the whole timeout, then raised
            assert time.monotonic() - started < 10
            train(trainer, range(1, 2), np.random.default_rng(5))
            pub.flush(timeout=30)
            assert pub.status()["published_batch_id"] == 1


def test_the_stream_is_trimmed_to_keep_checkpoints(tmp_path: Path, redis: Redis) -> None:
    """keep_checkpoints reaches the publisher: the stream is trimmed to a full snapshot
    with that many checkpoints after it, and stays short; 0 never trims."""
    lengths, batch = {}, 0
    with embank.open(tmp_path / "trainer") as trainer:
        trainer.create_table("emb", dim=DIM, optimizer=embank.optim.SGD(lr=0.1))
        for keep, topic in ((2, "kept"), (0, "all")):
            with trainer.publisher("redis", redis.url, topic=topic, keep_checkpoints=keep) as pub:
                for b in range(1, 21):
                    # Every key rewritten: each checkpoint's changes weigh a snapshot.
                    keys = np.arange(500, dtype=np.uint64)
                    trainer.table("emb").push(keys, np.full((500, DIM), b, dtype=np.float32))
                    batch += 1
                    trainer.checkpoint(batch)
                    pub.flush(timeout=30)
                s = pub.status()
            out = subprocess.run(
                ["redis-cli", "-p", str(redis.port), "XLEN", f"{topic}.0"], capture_output=True, text=True
            )
            lengths[keep] = int(out.stdout)
            if keep:
                assert s["trims"] >= 5 and s["retention_snapshots"] >= 5 and s["trimmed_to_seq"], s
            else:
                assert s["trims"] == 0 and s["retention_snapshots"] == 0, s
    # 20 checkpoints of 1 rows message + 1 commit (and the first's reset): trimmed, at
    # most 2 checkpoints and 2 snapshots of 3 messages.
    assert lengths[0] == 41 and lengths[2] <= 12, lengths


def test_the_old_name_of_a_bound_still_works_and_warns(tmp_path: Path, redis: Redis) -> None:
    with embank.open(tmp_path / "trainer") as trainer:
        with pytest.warns(DeprecationWarning, match="max_pending= is deprecated: use checkpoints"):
            pub = trainer.publisher("redis", redis.url, topic="old", max_pending=1)
        pub.close()


def test_a_failing_publisher_does_not_hold_back_the_others(tmp_path: Path, redis: Redis) -> None:
    """Two publishers, one per broker: while the first one's broker is down, the second
    is still told of every checkpoint (its replicas stay fresh without a flush), and
    checkpoint() raises one PublishError naming every failing publisher."""
    rng = np.random.default_rng(5)
    (tmp_path / "second").mkdir()
    second = Redis(tmp_path / "second")
    try:
        with embank.open(tmp_path / "trainer") as trainer:
            trainer.create_table("emb", dim=DIM, optimizer=embank.optim.SGD(lr=0.1))
            # The failing one first: the order in which checkpoint() tells them.
            down = trainer.publisher("redis", redis.url, topic="a", checkpoints_pending_max=1, timeout=1)
            up = trainer.publisher("redis", second.url, topic="b", checkpoints_pending_max=1, timeout=1)
            train(trainer, range(1, 2), rng)
            down.flush(timeout=30)
            up.flush(timeout=30)
            redis.kill()
            train(trainer, range(2, 3), rng)
            deadline = time.monotonic() + 30
            while not down.status()["last_error"]:
                assert time.monotonic() < deadline, "no publish attempt failed with the broker down"
                time.sleep(0.01)
            for b in (3, 4):
                with pytest.raises(PublishError) as caught:
                    train(trainer, range(b, b + 1), rng)
                # The healthy publisher got the checkpoint all the same: published with no flush.
                deadline = time.monotonic() + 30
                while up.status()["published_batch_id"] != b:
                    assert time.monotonic() < deadline, (
                        f"the healthy publisher was not told of checkpoint {b}: {up.status()}"
                    )
                    time.sleep(0.01)
                assert "1 of 2 publishers failed at checkpoint" in str(caught.value), caught.value
                assert len(caught.value.errors) == 1 and "a.*" in str(caught.value), caught.value
            # Both brokers down: one error names both.
            second.kill()
            with pytest.raises(PublishError, match="1 of 2 publishers failed at checkpoint 5"):
                train(trainer, range(5, 6), rng)  # the second is told, and its attempt fails
            deadline = time.monotonic() + 30
            while not up.status()["last_error"]:
                assert time.monotonic() < deadline, "no publish attempt failed with the second broker down"
                time.sleep(0.01)
            with pytest.raises(PublishError) as caught:
                train(trainer, range(6, 7), rng)
            assert len(caught.value.errors) == 2, caught.value
            assert "2 of 2 publishers failed at checkpoint 6" in str(caught.value), caught.value
            assert "a.*" in str(caught.value) and "b.*" in str(caught.value), caught.value
            assert trainer.checkpoints()[-1] == 6  # the checkpoints themselves were taken
            redis.start()
            second.start()
            down.flush(timeout=30)
            up.flush(timeout=30)
            assert down.status()["published_batch_id"] == up.status()["published_batch_id"] == 6
    finally:
        if second.proc is not None and second.proc.poll() is None:
            second.kill()


def test_a_trainer_through_a_train_cache_publishes_what_its_checkpoints_hold(
    tmp_path: Path, redis: Redis, tls_dir: Path
) -> None:
    """A trainer updating its rows on the device (``embank.gpu.TrainCache``, a cache small
    enough to evict every step) publishes at each ``cache.checkpoint``: a replica serves
    checkpoint 6 equal, row for row, to a trainer that never had a cache."""
    torch = pytest.importorskip("torch")
    from embank import gpu

    opt = embank.optim.Adagrad(lr=0.1)
    stores = {n: embank.open(tmp_path / n) for n in ("cached", "plain")}
    for s in stores.values():
        s.create_table("emb", dim=DIM, init=embank.init.normal(0, 0.1), optimizer=opt)
    pub = stores["cached"].publisher("redis", redis.url, topic="tc", partitions=1)
    cache = gpu.TrainCache(stores["cached"].table("emb"), rows_max=64, slots=8, device="cpu")
    plain = stores["plain"].table("emb")
    rng = np.random.default_rng(8)
    for b in range(1, 7):
        keys = rng.integers(0, 2000, 256)
        grads = rng.random((256, DIM), dtype=np.float32) - 0.5
        cache.pull(torch.from_numpy(keys))
        cache.push_grad(torch.from_numpy(keys), torch.from_numpy(grads))
        cache.checkpoint(b)
        plain.pull(keys.astype(np.uint64))
        plain.push_grad(keys.astype(np.uint64), grads)
    assert cache.stats()["evicted"] > 0
    pub.flush(timeout=30)
    proc, addr = replica(tmp_path, redis.url, "tc", 0, tls_dir)
    try:
        keys = np.arange(2000, dtype=np.uint64)
        with embank.connect([addr], min_checkpoint=6, tls_ca_file=str(tls_dir / "ca.pem")) as remote:
            rows, found = lookup_when_served(remote, keys, 6)
        want, want_found = plain.lookup(keys)
        np.testing.assert_array_equal(found, want_found)
        np.testing.assert_array_equal(rows[found], want[want_found])
    finally:
        proc.kill()
        proc.wait()
        cache.close()
        pub.close()
        for s in stores.values():
            s.close()
