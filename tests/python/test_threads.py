"""The bindings under threads: no call can deadlock another.

Each scenario runs in its own process (``threads_child.py``) that dumps every
thread's stack and exits with status 1 when it passes its deadline, so a deadlock
fails the test instead of hanging it. The scenarios:

- ``flush-status``: ``Publisher.status()`` while another thread waits in
  ``Publisher.flush()`` (issue 33: the flush's thread held the publisher's lock
  across the GIL release, and the status call waited for that lock holding the GIL).
- ``close-flush``: ``Publisher.close()`` while another thread waits in a long
  ``flush()``: the flush fails at once (``StoreClosedError``).
- ``export``: two threads draining one export iterator (the same shape in
  ``Export.__next__``).
- ``stress``: every method of every object with background state — publisher,
  exports, worker, embedded and remote store and table — from ten threads at once,
  the publisher closed while others still call it.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_stream import Redis

CHILD = Path(__file__).with_name("threads_child.py")
DEADLINE_SECONDS = 40


def run_child(*args: str) -> str:
    try:
        done = subprocess.run(
            [sys.executable, str(CHILD), args[0], str(DEADLINE_SECONDS), *args[1:]],
            capture_output=True,
            text=True,
            timeout=DEADLINE_SECONDS + 30,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{args[0]}: the process hung past its deadline (a deadlock): {e.stderr!r}")
    assert done.returncode == 0 and done.stdout.startswith("ok"), (
        f"{args[0]}: exit status {done.returncode} (1 with thread stacks: a deadlock)\n"
        f"stdout: {done.stdout}\nstderr: {done.stderr[-6000:]}"
    )
    return done.stdout


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[Redis]:
    """A redis-server the child kills (its publisher's broker goes down)."""
    (tmp_path / "redis").mkdir()
    r = Redis(tmp_path / "redis")
    yield r
    if r.proc is not None and r.proc.poll() is None:
        r.kill()


def test_publisher_status_during_a_flush(tmp_path: Path, redis: Redis) -> None:
    assert redis.proc is not None
    out = run_child("flush-status", str(tmp_path / "store"), redis.url, str(redis.proc.pid))
    assert "status calls during a flush" in out


def test_close_wakes_a_flush_in_flight(tmp_path: Path, redis: Redis) -> None:
    assert redis.proc is not None
    out = run_child("close-flush", str(tmp_path / "store"), redis.url, str(redis.proc.pid))
    assert "at the close" in out


def test_two_threads_drain_one_export_iterator(tmp_path: Path) -> None:
    out = run_child("export", str(tmp_path / "store"))
    assert "chunks read" in out


def test_every_object_with_background_state_from_ten_threads(
    tmp_path: Path, redis: Redis, cluster: list[str]
) -> None:
    assert redis.proc is not None
    run_child("stress", str(tmp_path / "store"), redis.url, str(redis.proc.pid), ",".join(cluster))
