"""Checkpoints from Python, embedded and through two shards; a training process
SIGKILLed after a checkpoint comes back to exactly that checkpoint."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import embank
import numpy as np
import pytest
from embank import errors


def step(t: embank.Table, b: int) -> None:
    rng = np.random.default_rng(b)
    keys = rng.integers(0, 50, size=40).astype(np.uint64)
    t.pull(keys)
    t.push_grad(keys, rng.standard_normal((40, 4)).astype(np.float32))


def table_rows(t: embank.Table) -> dict[int, list[float]]:
    return {int(k): r.tolist() for ks, rs in t.export() for k, r in zip(ks, rs)}


def test_checkpoint_and_restore(store: embank.Store) -> None:
    t = store.create_table(
        "emb", dim=4, init=embank.init.normal(0, 0.1), optimizer=embank.optim.Adagrad(lr=0.1)
    )
    for b in range(1, 6):
        step(t, b)
    store.checkpoint(5)
    at5 = table_rows(t)
    for b in range(6, 9):
        step(t, b)
    store.checkpoint(8)
    at8 = table_rows(t)
    step(t, 9)
    assert store.checkpoints() == [5, 8]
    with pytest.raises(errors.InvalidInputError, match="increase"):
        store.checkpoint(8)
    store.restore(8)
    t = store.table("emb")
    assert table_rows(t) == at8
    store.restore(5)
    t = store.table("emb")
    assert table_rows(t) == at5
    assert store.checkpoints() == [5]
    with pytest.raises(errors.NotFoundError, match="retained"):
        store.restore(8)
    # Training goes on from the restored state exactly as it did the first time.
    for b in range(6, 9):
        step(t, b)
    assert table_rows(t) == at8


def test_sigkill_returns_to_the_last_checkpoint(store_path: Path) -> None:
    code = textwrap.dedent(
        f"""
        import os, signal, sys
        import numpy as np
        import embank
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_checkpoint import step
        s = embank.open({str(store_path)!r})
        t = s.create_table("emb", dim=4, optimizer=embank.optim.Adam(lr=0.01))
        for b in range(1, 11):
            step(t, b)
        s.checkpoint(10)
        for b in range(11, 30):
            step(t, b)   # reach the medium, but are after the checkpoint
        s.flush()        # even flushed
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    with embank.open(store_path) as s:
        assert s.checkpoints() == [10]
        recovered = table_rows(s.table("emb"))
    with embank.open(store_path.parent / "replay") as r:
        t = r.create_table("emb", dim=4, optimizer=embank.optim.Adam(lr=0.01))
        for b in range(1, 11):
            step(t, b)
        assert recovered == table_rows(t)


@pytest.mark.parametrize("background", [True, False])
def test_killed_writer_reopens_at_once_and_repairs_in_the_background(
    store_path: Path, background: bool
) -> None:
    """A writer SIGKILLed mid-stream: the reopened store serves every pushed row at once
    (the repair goes on behind it, or, with ``background_repair=False``, is done first);
    ``wait_repaired`` ends with exact counts and the table keeps taking writes."""
    code = textwrap.dedent(
        f"""
        import os, signal
        import numpy as np
        import embank
        s = embank.open({str(store_path)!r})
        t = s.create_table("rows", dim=8, capacity=20_000)
        keys = np.arange(20_000, dtype=np.uint64)
        t.push(keys, np.repeat(keys[:, None].astype(np.float32), 8, axis=1))
        t.delete(keys[:1000])
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    with embank.open(store_path, background_repair=background) as s:
        t = s.table("rows")
        recovered = t.stats()["recovered"]
        assert recovered["background"] is background
        keys = np.arange(20_000, dtype=np.uint64)
        rows, found = t.lookup(keys)
        assert not found[:1000].any() and found[1000:].all()
        np.testing.assert_array_equal(rows[1000:, 0], keys[1000:].astype(np.float32))
        t.push(keys[:10], np.zeros((10, 8), np.float32))  # writes during the repair
        s.wait_repaired()
        assert t.stats()["recovered"]["pending"] is False
        assert len(t) == 19_010


def test_export_checkpoint_and_changes(store_path: Path, tmp_path: Path) -> None:
    with embank.open(store_path) as s:
        t = s.create_table("emb", dim=4, optimizer=embank.optim.SGD(lr=0.5))
        for b in range(1, 6):
            step(t, b)
        s.checkpoint(5)
        at5 = table_rows(t)
        for b in range(6, 9):
            step(t, b)
        t.delete([int(next(iter(at5)))])
        got = {
            int(k): r.tolist()
            for ks, rs in s.export_checkpoint("emb", 5, chunk_size=16)
            for k, r in zip(ks, rs)
        }
        assert got == at5
        keys, rows, deleted = s.export_changes("emb", since=5)
        now = table_rows(t)
        assert {int(k): r.tolist() for k, r in zip(keys, rows)} == {int(k): now[int(k)] for k in keys}
        assert deleted.tolist() == [int(next(iter(at5)))]
        changed = set(keys.tolist()) | set(deleted.tolist())
        assert all(k in changed for k in set(at5) | set(now) if at5.get(k) != now.get(k))
    # The CLI exports the checkpoint from the store on disk.
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "embank",
            "export",
            str(store_path),
            "--table",
            "emb",
            "--checkpoint",
            "5",
            "--out",
            str(tmp_path / "x"),
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    keys = np.load(tmp_path / "x" / "emb.keys.npy")
    rows = np.load(tmp_path / "x" / "emb.rows.npy")
    assert {int(k): r.tolist() for k, r in zip(keys, rows)} == at5


def test_lookup_at_a_checkpoint(store: embank.Store) -> None:
    """lookup_checkpoint (and table.lookup(checkpoint=...)) reads a table as it was at a
    retained checkpoint while training goes on, embedded and through `embank serve`."""
    # The remote shards outlive a test: their checkpoints of earlier tests are retained.
    base = max(store.checkpoints(), default=0)
    t = store.create_table("emb", dim=4, optimizer=embank.optim.SGD(lr=0.5))
    for b in range(1, 6):
        step(t, b)
    store.checkpoint(base + 5)
    at5 = table_rows(t)
    for b in range(6, 9):
        step(t, b)
    gone = int(next(iter(at5)))
    t.delete([gone])
    t.push([1000], np.ones((1, 4), dtype=np.float32))  # absent at checkpoint 5
    keys = np.arange(0, 1001, dtype=np.uint64)
    rows, found = store.lookup_checkpoint("emb", base + 5, keys)
    assert {int(k): r.tolist() for k, r, f in zip(keys, rows, found) if f} == at5
    assert table_rows(t) != at5 and not found[1000] and found[gone]
    rows2, found2 = t.lookup(keys, checkpoint=base + 5)
    assert np.array_equal(rows, rows2) and np.array_equal(found, found2)
    assert store.served()[0]["readable"][-1] == base + 5
    with pytest.raises(errors.NotFoundError):
        store.lookup_checkpoint("emb", base + 4, keys)
    with pytest.raises(errors.InvalidInputError, match="not both"):
        t.lookup(keys, checkpoint=base + 5, min_checkpoint=base + 5)


def test_checkpoint_metadata(store: embank.Store) -> None:
    # The remote shards outlive a test: their checkpoints of earlier tests are retained.
    base = max(store.checkpoints(), default=0)
    t = store.create_table("emb", dim=4, optimizer=embank.optim.SGD(lr=0.1))
    step(t, 1)
    store.checkpoint(base + 1, meta=b"topic=emb partition=0 offset=42")
    step(t, 2)
    store.checkpoint(base + 2)
    info = [c for c in store.checkpoint_info() if c["batch_id"] > base]
    assert [(c["batch_id"], c["meta"]) for c in info] == [
        (base + 1, b"topic=emb partition=0 offset=42"),
        (base + 2, b""),
    ]
    assert all(c["seq"] > 0 and c["unix_seconds"] > 0 for c in info)
    with pytest.raises(errors.InvalidInputError, match="metadata"):
        store.checkpoint(base + 3, meta=b"x" * (64 * 1024 + 1))
    with pytest.raises(TypeError, match="bytes"):
        store.checkpoint(base + 3, meta="text")  # type: ignore[arg-type]
    assert store.checkpoints()[-2:] == [base + 1, base + 2]
