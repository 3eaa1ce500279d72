"""Every call of the Python API, and every error it promises."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable

import embank
import numpy as np
import pytest
from embank import errors


def u64(*keys: int) -> np.ndarray[Any, np.dtype[np.uint64]]:
    return np.array(keys, dtype=np.uint64)


def test_open_create_pull_push_lookup_delete(store: embank.Store) -> None:
    t = store.create_table("user", dim=4, init=embank.init.normal(0, 0.01), seed=3)
    assert (t.name, t.dim, t.dtype) == ("user", 4, np.dtype(np.float32))
    assert len(t) == 0
    rows = t.pull(u64(1, 2, 1))
    assert rows.shape == (3, 4) and rows.dtype == np.float32 and rows.flags.c_contiguous
    np.testing.assert_array_equal(rows[0], rows[2])  # duplicate key, one row
    assert len(t) == 2
    assert np.abs(rows).max() < 0.1
    t.push(u64(1, 5), np.full((2, 4), 2.5, dtype=np.float32))
    got, found = t.lookup(u64(1, 5, 9))
    assert found.tolist() == [True, True, False]
    np.testing.assert_array_equal(got[:2], np.full((2, 4), 2.5, dtype=np.float32))
    np.testing.assert_array_equal(got[2], np.zeros(4, dtype=np.float32))
    assert len(t) == 3  # lookup created nothing
    got, _ = t.lookup(u64(9), default=-1.0)
    np.testing.assert_array_equal(got[0], np.full(4, -1.0, dtype=np.float32))
    got, _ = t.lookup(u64(9), default=np.arange(4, dtype=np.float32))
    np.testing.assert_array_equal(got[0], np.arange(4, dtype=np.float32))
    assert t.delete(u64(1, 1, 77)) == 1
    assert len(t) == 2
    _, found = t.lookup(u64(1))
    assert not found[0]


def test_keys_accept_lists_and_nonnegative_int64(store: embank.Store) -> None:
    t = store.create_table("t", dim=2)
    t.push([1, 2], np.ones((2, 2), dtype=np.float32))
    t.push(np.array([3], dtype=np.int64), np.ones((1, 2), dtype=np.float32))
    t.push(np.array([4], dtype=np.int32), np.ones((1, 2), dtype=np.float32))
    assert len(t) == 4
    assert t.pull([]).shape == (0, 2)
    big = np.array([2**64 - 1], dtype=np.uint64)
    t.push(big, np.ones((1, 2), dtype=np.float32))
    assert t.lookup(big)[1][0]


def test_duplicate_keys_in_push_last_wins(store: embank.Store) -> None:
    t = store.create_table("t", dim=1)
    t.push(u64(7, 7, 7), np.array([[1], [2], [3]], dtype=np.float32))
    assert t.pull(u64(7))[0, 0] == 3.0
    assert len(t) == 1


def test_initializers_are_deterministic_across_stores(tmp_path: Path) -> None:
    outs = []
    for name, order in (("a", [5, 9, 1]), ("b", [1, 5, 9])):
        with embank.open(tmp_path / name) as s:
            t = s.create_table("t", dim=8, init=embank.init.uniform(-1, 1), seed=4)
            rows = t.pull(order)
            outs.append({k: rows[i].tolist() for i, k in enumerate(order)})
    assert outs[0] == outs[1]
    with embank.open(tmp_path / "c") as s:
        z = s.create_table("z", dim=3).pull([1])
        c = s.create_table("c", dim=3, init=embank.init.constant(0.5)).pull([1])
        assert z.tolist() == [[0, 0, 0]] and c.tolist() == [[0.5, 0.5, 0.5]]
        m = s.create_table("m", dim=2, missing="init", init=embank.init.constant(2.0))
        rows, found = m.lookup([3])
        assert rows.tolist() == [[2.0, 2.0]] and not found[0] and len(m) == 0


def test_reopen_keeps_rows_and_tables(store_path: Path) -> None:
    with embank.open(store_path) as s:
        t = s.create_table("item", dim=3, capacity=10)
        keys = np.arange(5000, dtype=np.uint64)
        rows = np.random.default_rng(0).standard_normal((5000, 3)).astype(np.float32)
        t.push(keys, rows)
        s.create_table("other", dim=2)
        assert t.stats()["grow_count"] > 0
    with embank.open(store_path, create=False) as s:
        assert s.tables() == ["item", "other"]
        assert "item" in s and "nope" not in s
        np.testing.assert_array_equal(s["item"].pull(keys), rows)
        assert s.table("item").stats()["recovered"] is None
        assert s["item"].options["dim"] == 3


def test_export_streams_everything(store: embank.Store) -> None:
    t = store.create_table("t", dim=2)
    keys = np.arange(1000, dtype=np.uint64) * 3
    t.push(keys, np.stack([keys, keys], axis=1).astype(np.float32))
    seen = {}
    chunks = 0
    for k, r in t.export(chunk_size=100):
        assert len(k) <= 100 and r.shape == (len(k), 2)
        chunks += 1
        for key, row in zip(k.tolist(), r.tolist()):
            seen[key] = row
    assert chunks >= 10
    assert seen == {k: [float(k), float(k)] for k in keys.tolist()}
    with pytest.raises(ValueError):
        list(t.export(chunk_size=0))


def test_stats_and_flush_and_drop(store: embank.Store) -> None:
    t = store.create_table("t", dim=16, capacity=1000)
    t.pull(np.arange(100, dtype=np.uint64))
    store.flush()
    st = store.stats()
    assert st["rows"] == 100
    (ts,) = st["tables"]
    assert ts["rows"] == 100 and ts["capacity"] >= 1000 and 0 < ts["load_factor"] < 1
    assert ts["bytes_mapped"] > 0 and st["bytes_on_disk"] > 0
    assert sum(ts["probe_histogram"]) == 100
    json.dumps(st)
    store.drop_table("t")
    assert store.tables() == []
    with pytest.raises(embank.StoreClosedError):
        t.pull([1])
    with pytest.raises(KeyError):
        store.drop_table("t")


def run_model_ops(
    open_store: Callable[[], embank.Store], steps: int, max_keys: int, table: str = "t"
) -> dict[int, list[float]]:
    """Random pull/lookup/push/delete batches against a dict model, with the store closed
    and opened again (`open_store`) at random; returns the model. Shared by the embedded
    and the remote model tests."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    s = open_store()
    s.create_table(table, dim=2, capacity=4, missing=-1.0)
    model: dict[int, list[float]] = {}
    for step in range(steps):
        t = s.table(table)
        keys = [rng.randrange(60) for _ in range(rng.randrange(0, max_keys))]
        op = rng.choice(["push", "pull", "lookup", "delete", "reopen"])
        ctx = f"seed {seed} step {step} op {op} keys {keys}"
        if op == "push":
            rows = np.array([[rng.random(), k] for k in keys], dtype=np.float32).reshape(len(keys), 2)
            t.push(keys, rows)
            for i, k in enumerate(keys):
                model[k] = rows[i].tolist()
        elif op == "pull":
            got = t.pull(keys)
            for i, k in enumerate(keys):
                model.setdefault(k, [0.0, 0.0])
                assert got[i].tolist() == model[k], ctx
        elif op == "lookup":
            got, found = t.lookup(keys)
            for i, k in enumerate(keys):
                assert bool(found[i]) == (k in model), ctx
                assert got[i].tolist() == model.get(k, [-1.0, -1.0]), ctx
        elif op == "delete":
            n = t.delete(keys)
            assert n == len({k for k in keys if k in model}), ctx
            for k in keys:
                model.pop(k, None)
        else:
            s.close()
            s = open_store()
        assert len(s.table(table)) == len(model), ctx
    exported = {int(k): r.tolist() for ks, rs in s.table(table).export(7) for k, r in zip(ks, rs)}
    assert exported == model, f"seed {seed}: export"
    s.close()
    return model


def test_model_based_random_ops(store_path: Path) -> None:
    run_model_ops(lambda: embank.open(store_path), steps=400, max_keys=12)


# ---- errors -------------------------------------------------------------------------


def test_wrong_dim_shape_dtype_contiguity(store: embank.Store) -> None:
    t = store.create_table("t", dim=4)
    with pytest.raises(errors.InvalidInputError, match=r"shape \(2, 4\)"):
        t.push(u64(1, 2), np.ones((2, 3), dtype=np.float32))
    with pytest.raises(ValueError, match="shape"):
        t.push(u64(1, 2), np.ones(8, dtype=np.float32))
    with pytest.raises(TypeError, match="float32"):
        t.push(u64(1), np.ones((1, 4), dtype=np.float64))
    with pytest.raises(TypeError, match="numpy array"):
        t.push(u64(1), [[1.0, 2.0, 3.0, 4.0]])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="uint64"):
        t.pull(np.array([1.0, 2.0]))
    with pytest.raises(errors.InvalidInputError, match="1-D"):
        t.pull(np.zeros((2, 2), dtype=np.uint64))
    # Strided keys are copied (keys are small); strided rows are refused (rows are big).
    np.testing.assert_array_equal(t.lookup(np.arange(10, dtype=np.uint64)[::2])[1], np.zeros(5, bool))
    with pytest.raises(errors.InvalidInputError, match="contiguous"):
        t.push(u64(1, 2), np.ones((4, 2), dtype=np.float32).T)
    with pytest.raises(errors.InvalidInputError, match="non-negative"):
        t.pull(np.array([3, -1], dtype=np.int64))
    with pytest.raises(errors.InvalidInputError, match="non-finite"):
        t.push(u64(1), np.array([[1, np.nan, 1, 1]], dtype=np.float32))
    assert len(t) == 0, "refused calls wrote nothing"
    with pytest.raises(errors.ConfigError, match="dim"):
        store.create_table("bad", dim=0)
    with pytest.raises(errors.ConfigError, match="dim"):
        store.create_table("bad", dim=5000)
    with pytest.raises(errors.ConfigError):
        embank.init.uniform(1, 0)
    with pytest.raises(errors.InvalidInputError, match="bad table name"):
        store.create_table("a/b", dim=2)


def test_unknown_and_duplicate_table(store: embank.Store) -> None:
    store.create_table("t", dim=2)
    with pytest.raises(embank.NotFoundError) as e:
        store.table("missing")
    assert isinstance(e.value, KeyError)
    assert 'no table "missing"' in str(e.value)
    with pytest.raises(embank.TableExistsError, match=r"exists already \(dim 2, dtype f32, no optimizer\)"):
        store.create_table("t", dim=2)


def test_get_or_create(store: embank.Store) -> None:
    """``exist_ok=True`` returns the existing table when dim, dtype and optimizer match,
    and names both specs when they do not; the table and its rows are untouched."""
    adagrad = embank.optim.Adagrad(lr=0.1)
    t = store.create_table("g", dim=3, dtype="f16", optimizer=adagrad, exist_ok=True)  # created
    t.push([5], np.ones((1, 3), dtype=np.float32))
    again = store.create_table("g", dim=3, dtype="float16", optimizer=adagrad, exist_ok=True)
    np.testing.assert_array_equal(again.pull([5]), np.ones((1, 3), dtype=np.float32))
    for kwargs, asked in (
        ({"dim": 4, "dtype": "f16", "optimizer": adagrad}, "dim 4"),
        ({"dim": 3, "dtype": "f32", "optimizer": adagrad}, "dtype f32"),
        ({"dim": 3, "dtype": "f16"}, "no optimizer"),
    ):
        with pytest.raises(
            embank.TableExistsError, match=f"exists with dim 3, dtype f16, optimizer .*; asked for .*{asked}"
        ):
            store.create_table("g", exist_ok=True, **kwargs)  # type: ignore[arg-type]
    assert store.table("g").dim == 3 and store.tables().count("g") == 1


def test_the_torch_modules_say_how_to_get_pytorch() -> None:
    """Without PyTorch, ``import embank.torch`` (and ``embank.gpu``) names the extra to install."""
    for mod in ("embank.torch", "embank.gpu"):
        code = f"import sys; sys.modules['torch'] = None; import {mod}"
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert r.returncode != 0
        assert f"{mod} needs PyTorch: pip install 'embank[torch]'" in r.stderr, r.stderr


@pytest.mark.local_only("capacity is per shard and keys split unevenly, so a shard fills first")
def test_table_full_when_growth_is_off(store: embank.Store) -> None:
    t = store.create_table("t", dim=2, capacity=20, growth=False)
    cap = t.stats()["capacity"]
    t.pull(np.arange(cap, dtype=np.uint64))
    with pytest.raises(embank.TableFullError, match="full"):
        t.pull(u64(cap + 1))
    with pytest.raises(embank.TableFullError):
        t.push(u64(cap + 1), np.ones((1, 2), dtype=np.float32))
    assert len(t) == cap
    t.push(u64(0), np.full((1, 2), 9, dtype=np.float32))  # replacing still works
    assert t.pull(u64(0)).tolist() == [[9.0, 9.0]]


def test_store_locked_by_another_process(store_path: Path) -> None:
    code = textwrap.dedent(
        f"""
        import sys, embank
        s = embank.open({str(store_path)!r})
        print("ready", flush=True)
        sys.stdin.readline()
        s.close()
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        with pytest.raises(embank.StoreLockedError, match="in use") as e:
            embank.open(store_path)
        assert isinstance(e.value, OSError)
    finally:
        child.communicate("bye\n", timeout=30)
    embank.open(store_path).close()  # free again


def test_unknown_format_version(store_path: Path) -> None:
    embank.open(store_path).close()
    catalog = (store_path / "STORE").read_text()
    (store_path / "STORE").write_text(catalog.replace("embank-store 1 ", "embank-store 99 ", 1))
    with pytest.raises(embank.FormatVersionError, match="version 99"):
        embank.open(store_path)


def test_corrupt_catalog(store_path: Path) -> None:
    embank.open(store_path).close()
    data = bytearray((store_path / "STORE").read_bytes())
    data[-5] ^= 0x01
    (store_path / "STORE").write_bytes(bytes(data))
    with pytest.raises(embank.CorruptStoreError, match="checksum"):
        embank.open(store_path)


def test_closed_store(store_path: Path) -> None:
    with embank.open(store_path) as s:
        t = s.create_table("t", dim=2)
    assert s.closed
    s.close()  # idempotent
    for call in (lambda: s.tables(), lambda: s.table("t"), lambda: t.pull([1]), lambda: len(t), s.flush):
        with pytest.raises(embank.StoreClosedError):
            call()
    assert "closed" in repr(s)


def test_open_refuses_missing_or_foreign_directory(tmp_path: Path) -> None:
    with pytest.raises(embank.NotFoundError):
        embank.open(tmp_path / "nothing", create=False)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(embank.InvalidInputError, match="not empty"):
        embank.open(tmp_path)


def test_sigkill_after_flush_loses_nothing(store_path: Path) -> None:
    code = textwrap.dedent(
        f"""
        import numpy as np, embank, time
        s = embank.open({str(store_path)!r})
        t = s.create_table("t", dim=8, capacity=16)
        k = np.arange(20000, dtype=np.uint64)
        t.push(k, np.repeat(k.astype(np.float32)[:, None], 8, axis=1))
        s.flush()
        print("flushed", flush=True)
        i = 0
        while True:  # keep writing until killed
            t.push(k[:500], np.full((500, 8), -float(i), dtype=np.float32))
            i += 1
        """
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "flushed"
    child.kill()
    child.wait()
    with embank.open(store_path) as s:
        t = s.table("t")
        assert t.stats()["recovered"] is not None
        rows, found = t.lookup(np.arange(20000, dtype=np.uint64))
        assert found.all()
        assert (rows == rows[:, :1]).all(), "a row is torn"
        np.testing.assert_array_equal(rows[500:, 0], np.arange(500, 20000, dtype=np.float32))
        assert ((rows[:500, 0] == np.arange(500)) | (rows[:500, 0] <= 0)).all()


def test_cli_import_export_inspect(tmp_path: Path, store_path: Path) -> None:
    keys = np.arange(0, 3000, 3, dtype=np.uint64)
    rows = np.random.default_rng(1).standard_normal((len(keys), 5)).astype(np.float32)
    np.save(tmp_path / "k.npy", keys)
    np.save(tmp_path / "r.npy", rows)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "embank", *args], capture_output=True, text=True, env=env
        )

    r = cli(
        "import",
        str(store_path),
        "--table",
        "emb",
        "--keys",
        str(tmp_path / "k.npy"),
        "--rows",
        str(tmp_path / "r.npy"),
    )
    assert r.returncode == 0, r.stderr
    assert "imported 1000 rows" in r.stdout
    r = cli("inspect", str(store_path))
    assert r.returncode == 0, r.stderr
    assert "emb" in r.stdout and "1000" in r.stdout
    r = cli("inspect", str(store_path), "--json")
    assert json.loads(r.stdout)["tables"][0]["rows"] == 1000
    r = cli("export", str(store_path), "--table", "emb", "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    k2 = np.load(tmp_path / "out" / "emb.keys.npy")
    r2 = np.load(tmp_path / "out" / "emb.rows.npy")
    order = np.argsort(k2)
    np.testing.assert_array_equal(k2[order], keys)
    np.testing.assert_array_equal(r2[order], rows)
    r = cli("export", str(store_path), "--table", "nope")
    assert r.returncode == 1 and 'no table "nope"' in r.stderr
    r = cli("inspect", str(tmp_path / "missing"))
    assert r.returncode == 1 and "no embank store" in r.stderr
    r = cli("--help")
    assert r.returncode == 0 and "demo" in r.stdout


def test_cli_demo_small() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "embank", "demo", "--rows", "20000", "--dim", "8", "--seconds", "0.2"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert "keys/s" in r.stdout and "reopened in" in r.stdout and "embank / hash map" in r.stdout


def test_package_docstring_example() -> None:
    import doctest

    result = doctest.testmod(embank, verbose=False)
    assert result.attempted >= 1 and result.failed == 0


def test_abandoned_export_does_not_block_close(store_path: Path) -> None:
    s = embank.open(store_path)
    t = s.create_table("t", dim=2)
    t.push(np.arange(5000, dtype=np.uint64), np.ones((5000, 2), dtype=np.float32))
    it = t.export(chunk_size=100)
    next(it)
    s.close()  # must not wait for the half-read export
    with pytest.raises(embank.StoreClosedError):
        for _ in it:
            pass


@pytest.mark.parametrize(
    "huge_pages,random_access,row_writes",
    [(True, True, "mapped"), (False, False, "mapped"), (False, True, "file")],
)
def test_paging_options_keep_rows_across_a_reopen(
    tmp_path: Path, huge_pages: bool, random_access: bool, row_writes: str
) -> None:
    """``huge_pages`` (MADV_HUGEPAGE), ``mmap_random_access=False`` and ``row_writes="file"``
    change only how the kernel pages the mapped files and how rows reach them: rows
    written, overwritten, grown and reopened read back the same."""
    keys = np.arange(5000, dtype=np.uint64)
    rows = np.random.default_rng(1).standard_normal((5000, 8)).astype(np.float32)

    def opened() -> embank.Store:
        return embank.open(
            tmp_path / "s", huge_pages=huge_pages, mmap_random_access=random_access, row_writes=row_writes
        )

    with opened() as s:
        assert s.stats()["row_writes"] == row_writes
        t = s.create_table("t", dim=8, capacity=64)  # grows: the new index is advised too
        t.push(keys, rows)
        rows[::3] += 1.0
        t.push(keys[::3].copy(), np.ascontiguousarray(rows[::3]))  # scattered rewrites
        np.testing.assert_array_equal(t.pull(keys), rows)
    with opened() as s:
        np.testing.assert_array_equal(s.table("t").pull(keys), rows)


def test_a_bad_row_writes_is_refused(tmp_path: Path) -> None:
    with pytest.raises(errors.ConfigError, match="row_writes"):
        embank.open(tmp_path / "s", row_writes="mmap")


def test_a_limited_address_space_opens_the_mmap_medium(tmp_path: Path) -> None:
    """Under ``ulimit -v`` (or valgrind) the 1 TiB reservation of a rows mapping is
    refused: the medium reserves less instead, and rows written there read back after a
    reopen (before, ``open`` failed with "cannot map rows file: Cannot allocate memory")."""
    import resource

    script = (
        "import numpy as np, embank, sys\n"
        "k = np.arange(50_000, dtype=np.uint64)\n"
        "with embank.open(sys.argv[1]) as st:\n"
        "    t = st.create_table('t', dim=16, capacity=10_000_000)\n"
        "    t.push(k, np.ones((len(k), 16), np.float32) * k[:, None].astype(np.float32))\n"
        "with embank.open(sys.argv[1]) as st:\n"
        "    rows, found = st['t'].lookup(k)\n"
        "    assert found.all() and (rows[:, 0] == k.astype(np.float32)).all()\n"
        "print('rows read back')\n"
    )

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))

    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "s")],
        preexec_fn=limit,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "rows read back" in out.stdout
