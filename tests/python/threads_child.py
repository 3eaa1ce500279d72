"""The process test_threads.py runs: calls of the bindings from several threads at once.

A deadlock must fail the test, never hang it: ``faulthandler`` dumps every thread's
stack and exits with status 1 after ``deadline`` seconds. Run as

    python threads_child.py SCENARIO DEADLINE STORE_DIR [REDIS_URL REDIS_PID [SHARDS]]

and prints ``ok`` plus a summary line when every thread finished.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import embank
import numpy as np
from embank.errors import EmbankTimeoutError, NotFoundError, PublishError, StoreClosedError

DIM = 8
ROWS = 20_000


def run_threads(work: dict[str, Callable[[], None]]) -> None:
    """Runs each function on its own thread; re-raises the first failure."""
    failures: list[tuple[str, BaseException]] = []

    def wrap(name: str, f: Callable[[], None]) -> Callable[[], None]:
        def go() -> None:
            try:
                f()
            except BaseException as e:  # reported by the main thread
                failures.append((name, e))

        return go

    threads = [threading.Thread(target=wrap(n, f), name=n) for n, f in work.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        name, e = failures[0]
        raise RuntimeError(f"thread {name} failed: {e!r}") from e


def filled_store(path: Path) -> embank.Store:
    store = embank.open(path)
    t = store.create_table("emb", dim=DIM, optimizer=embank.optim.Adagrad(lr=0.1))
    keys = np.arange(ROWS, dtype=np.uint64)
    t.push(keys, np.ones((ROWS, DIM), dtype=np.float32))
    store.checkpoint(1)
    return store


def publisher_down(store: embank.Store, url: str, redis_pid: int) -> embank.Publisher:
    """A publisher that published checkpoint 1, then lost its broker, with checkpoint 2
    waiting: its flush waits for its whole timeout."""
    p = store.publisher("redis", url, topic="threads", checkpoints_pending_max=1000, timeout=1)
    p.flush(timeout=30)
    os.kill(redis_pid, signal.SIGKILL)
    store.checkpoint(2)
    return p


def flush_and_status(store: embank.Store, url: str, redis_pid: int) -> str:
    """Issue 33's hang: status() while another thread waits in flush()."""
    p = publisher_down(store, url, redis_pid)
    in_flush = threading.Event()
    statuses = 0

    def flush() -> None:
        in_flush.set()
        try:
            p.flush(timeout=2)
        except EmbankTimeoutError:
            return
        raise AssertionError("flush returned with the broker down")

    def status() -> None:
        nonlocal statuses
        in_flush.wait()
        time.sleep(0.2)  # the flush is waiting now, without the GIL
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            assert p.status()["published_batch_id"] == 1
            statuses += 1

    run_threads({"flush": flush, "status": status})
    p.close()
    return f"{statuses} status calls during a flush"


def close_during_flush(store: embank.Store, url: str, redis_pid: int) -> str:
    """close() while another thread waits in a long flush(): the flush fails at once."""
    p = publisher_down(store, url, redis_pid)
    in_flush = threading.Event()
    took: list[float] = []

    def flush() -> None:
        in_flush.set()
        started = time.monotonic()
        try:
            p.flush(timeout=30)
        except StoreClosedError:
            took.append(time.monotonic() - started)
            return
        raise AssertionError("flush returned with the broker down")

    def close() -> None:
        in_flush.wait()
        time.sleep(0.3)
        p.close()

    run_threads({"flush": flush, "close": close})
    assert took and took[0] < 10, f"the flush ended {took} s after it began, not at the close"
    return f"the flush ended {took[0]:.2f} s after it began, at the close"


def export_shared(store: embank.Store) -> str:
    """Two threads draining one native export iterator (chunks of one bucket)."""
    counts = {"a": 0, "b": 0}
    for it in (store._s.export_checkpoint("emb", 1, 64), store.table("emb")._t.export(64)):
        seen: list[np.ndarray[Any, Any]] = []

        def drain(name: str, it: Any = it, seen: list[np.ndarray[Any, Any]] = seen) -> Callable[[], None]:
            def go() -> None:
                for keys, rows in it:
                    assert rows.shape == (len(keys), DIM)
                    seen.append(keys)
                    counts[name] += 1

            return go

        run_threads({"a": drain("a"), "b": drain("b")})
        got = np.sort(np.concatenate(seen))
        assert np.array_equal(got, np.arange(ROWS, dtype=np.uint64)), f"{len(got)} keys exported"
    return f"chunks read: {counts}"


def stress(store: embank.Store, url: str, redis_pid: int, shards: list[str], seconds: float) -> str:
    """Every method of every object with background state — publisher, exports,
    worker, embedded and remote store and table — from several threads at once, and
    the publisher closed while the others still call it."""
    p = publisher_down(store, url, redis_pid)
    table = store.table("emb")
    remote = embank.connect(shards)
    if "threads" in remote:
        remote.drop_table("threads")
    remote_table = remote.create_table("threads", dim=DIM)
    calls: dict[str, int] = {}
    stop = time.monotonic() + seconds
    rng_keys = np.arange(0, ROWS, 7, dtype=np.uint64)[:500]

    def loop(name: str, f: Callable[[int], None], tolerate: tuple[type[BaseException], ...] = ()) -> None:
        i = 0
        while time.monotonic() < stop:
            try:
                f(i)
            except tolerate:
                pass
            i += 1
        calls[name] = i

    def publisher_calls(i: int) -> None:
        if i % 3 == 0:
            p.flush(timeout=0.05)
        elif i % 3 == 1:
            p.status()
        else:
            p._checkpointed()

    def closer() -> None:
        time.sleep(seconds / 2)
        p.close()
        calls["close"] = 1

    def table_calls(i: int) -> None:
        keys = rng_keys[(i * 13) % 400 :][:100]
        table.pull(keys)
        table.lookup(keys)
        table.push_grad(keys, np.full((len(keys), DIM), 0.01, dtype=np.float32))
        table.lookahead(keys)
        len(table)
        table.stats()

    def worker_calls(i: int) -> None:
        w = table.worker(timeout=5)
        keys = rng_keys[(i * 7) % 400 :][:50]
        rows = w.pull(keys)
        w.push_grad(keys, np.zeros_like(rows))
        w.release()

    def store_calls(i: int) -> None:
        store.checkpoint(3 + i)
        store.checkpoints()
        store.served()
        store.stats()
        store.flush()

    def export_calls(i: int) -> None:
        batch = store.checkpoints()[-1]
        for n, _ in enumerate(store.export_checkpoint("emb", batch, chunk_size=4096)):
            if n == 2:
                break
        for n, _ in enumerate(table.export(chunk_size=4096)):
            if n == 2:
                break

    def remote_calls(i: int) -> None:
        keys = rng_keys[:100]
        remote_table.push(keys, np.full((len(keys), DIM), float(i), dtype=np.float32))
        remote_table.pull(keys)
        remote_table.lookup(keys)
        len(remote_table)
        remote.served()
        for n, _ in enumerate(remote_table.export(chunk_size=4096)):
            if n == 1:
                break

    # Once closed, a publisher's calls fail (StoreClosedError; PublishError from a
    # notify); a flush with its broker down times out.
    closed = (StoreClosedError, EmbankTimeoutError, PublishError)
    work = {
        "publisher-1": lambda: loop("publisher-1", publisher_calls, closed),
        "publisher-2": lambda: loop("publisher-2", publisher_calls, closed),
        "publisher-close": closer,
        "table-1": lambda: loop("table-1", table_calls),
        "table-2": lambda: loop("table-2", table_calls),
        "worker": lambda: loop("worker", worker_calls),
        "store": lambda: loop("store", store_calls),
        # A checkpoint may leave retention between checkpoints() and its export.
        "export": lambda: loop("export", export_calls, (NotFoundError,)),
        "remote-1": lambda: loop("remote-1", remote_calls),
        "remote-2": lambda: loop("remote-2", remote_calls),
    }
    run_threads(work)
    remote.drop_table("threads")
    remote.close()
    idle = [n for n, c in calls.items() if c == 0]
    assert not idle, f"threads that made no call: {idle}"
    return json.dumps(calls)


def main() -> None:
    scenario, deadline, store_dir = sys.argv[1], float(sys.argv[2]), Path(sys.argv[3])
    faulthandler.dump_traceback_later(deadline, exit=True)
    store = filled_store(store_dir)
    if scenario == "flush-status":
        summary = flush_and_status(store, sys.argv[4], int(sys.argv[5]))
    elif scenario == "close-flush":
        summary = close_during_flush(store, sys.argv[4], int(sys.argv[5]))
    elif scenario == "export":
        summary = export_shared(store)
    elif scenario == "stress":
        shards = sys.argv[6].split(",")
        summary = stress(store, sys.argv[4], int(sys.argv[5]), shards, seconds=4.0)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    store.close()
    faulthandler.cancel_dump_traceback_later()
    print("ok", summary, flush=True)


if __name__ == "__main__":
    main()
