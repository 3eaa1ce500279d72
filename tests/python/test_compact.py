"""Compact rows: f16 and int8 tables through the Python API (embedded and on
`embank serve` shards), and `embank import` quantizing, de-quantizing and
de-pruning."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import embank
import numpy as np
import numpy.typing as npt
import pytest
from embank import errors


def as_f16(rows: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    return rows.astype(np.float16).astype(np.float32)


def as_int8(rows: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """The documented formula (docs/FORMAT.md), in numpy."""
    lo = rows.min(axis=1, keepdims=True)
    scale = ((rows.max(axis=1, keepdims=True) - lo) / np.float32(255)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(scale > 0, np.clip(np.round((rows - lo) / scale), 0, 255), 0)
    # numpy rounds half to even, the format half away from zero: equal except at exact
    # halves, which random rows do not hit.
    out: npt.NDArray[np.float32] = (q.astype(np.float32) * scale + lo).astype(np.float32)
    return out


def fused8(rows: npt.NDArray[np.float32]) -> npt.NDArray[np.uint8]:
    """Rows in the fused 8-bit row-wise layout: q bytes, then f32 scale and f32 bias."""
    lo = rows.min(axis=1, keepdims=True).astype(np.float32)
    scale = ((rows.max(axis=1, keepdims=True) - lo) / np.float32(255)).astype(np.float32)
    q = np.clip(np.round((rows - lo) / scale), 0, 255).astype(np.uint8)
    return np.concatenate([q, scale.view(np.uint8), lo.view(np.uint8)], axis=1)


@pytest.mark.parametrize("dtype", ["f32", "f16", "int8"])
def test_every_dtype_reads_back_its_rounding_embedded_and_remote(store: embank.Store, dtype: str) -> None:
    rng = np.random.default_rng(3)
    keys = np.arange(1000, dtype=np.uint64) * 7
    rows = rng.standard_normal((1000, 24)).astype(np.float32)
    t = store.create_table(f"t_{dtype}", dim=24, dtype=dtype)
    assert t.stored_dtype == dtype and t.dtype == np.float32
    t.push(keys, rows)
    got, found = t.lookup(keys)
    assert found.all()
    want = {"f32": rows, "f16": as_f16(rows), "int8": as_int8(rows)}[dtype]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    if dtype == "int8":
        step = (rows.max(axis=1) - rows.min(axis=1)) / 255
        assert (np.abs(got - rows) <= step[:, None] / 2 + 1e-6).all(), "int8 error within half a step"
    assert t.stats()["dtype"] == dtype
    # Rows as stored: decoded, exactly lookup's rows (missing keys: the default, encoded).
    ask = np.concatenate([keys[::3], np.array([1, 2], dtype=np.uint64)])
    stored, found = t.lookup_stored(ask)
    assert stored.dtype == np.uint8 and stored.shape == (len(ask), t.row_bytes)
    assert t.row_bytes == {"f32": 96, "f16": 48, "int8": 32}[dtype]
    assert found.tolist() == [True] * (len(ask) - 2) + [False, False]
    want_rows, _ = t.lookup(ask)
    np.testing.assert_array_equal(embank.decode_rows(stored, dtype, 24), want_rows)
    if dtype == "int8":  # byte for byte the fused 8-bit row-wise layout of the rows pushed
        np.testing.assert_array_equal(stored[:-2], fused8(rows[::3]))
    with pytest.raises(errors.InvalidInputError, match=r"\(n, 32\) uint8"):
        embank.decode_rows(stored[:, :-1], "int8", 24)


def decode_reference(stored: npt.NDArray[np.uint8], dtype: str, dim: int) -> npt.NDArray[np.float32]:
    """Stored rows decoded by the documented formulas (docs/FORMAT.md), in numpy: f32 and
    f16 little-endian, int8 ``q * scale + bias`` (a float32 multiply, then a float32 add)."""
    if dtype == "f32":
        return stored.view("<f4").astype(np.float32)
    if dtype == "f16":
        return stored.view("<f2").astype(np.float32)
    q = stored[:, :dim].astype(np.float32)
    tail = np.ascontiguousarray(stored[:, dim:]).view("<f4").astype(np.float32)
    out: npt.NDArray[np.float32] = q * tail[:, 0:1]
    out += tail[:, 1:2]
    return out


@pytest.mark.parametrize("dtype", ["f32", "f16", "int8"])
def test_python_sizes_encodes_and_decodes_with_the_store_s_codec(store: embank.Store, dtype: str) -> None:
    """``embank._native``'s ``row_bytes``, ``encode_rows`` and ``decode_rows`` are the
    store's codec (crates/embank-core/src/layout.rs): the rows pushed encode to exactly
    what ``lookup_stored`` returns, which decodes to exactly what ``lookup`` returns and
    to what the format's formulas give."""
    from embank import _native

    rng = np.random.default_rng(11)
    dim = 13  # odd: no row is a multiple of a vector
    keys = np.arange(300, dtype=np.uint64)
    rows = (rng.standard_normal((300, dim)) * rng.uniform(0.01, 100, (300, 1))).astype(np.float32)
    rows[7] = 2.5  # a constant row: scale 0
    t = store.create_table(f"codec_{dtype}", dim=dim, dtype=dtype)
    t.push(keys, rows)
    stored, found = t.lookup_stored(keys)
    assert found.all()
    assert _native.row_bytes(dtype, dim) == t.row_bytes == stored.shape[1], (dtype, stored.shape)
    np.testing.assert_array_equal(_native.encode_rows(rows, dtype, dim), stored)
    decoded = _native.decode_rows(stored, dtype, dim)
    np.testing.assert_array_equal(decoded, t.lookup(keys)[0])
    np.testing.assert_array_equal(decoded, decode_reference(stored, dtype, dim))
    np.testing.assert_array_equal(embank.decode_rows(stored, dtype, dim), decoded)
    if dtype == "int8":
        plain = np.arange(300) != 7  # fused8 divides by the scale
        np.testing.assert_array_equal(stored[plain], fused8(rows[plain]))
    with pytest.raises(errors.InvalidInputError, match="stored dtype must be one of f32, f16, int8"):
        _native.decode_rows(stored, "float16", dim)
    shape = rf"\(n, {dim}\) float32, got shape \(300, {dim - 1}\)"
    with pytest.raises(errors.InvalidInputError, match=shape):
        _native.encode_rows(np.ascontiguousarray(rows[:, 1:]), dtype, dim)
    assert _native.decode_rows(stored[:0], dtype, dim).shape == (0, dim)


def test_int8_refuses_training_and_says_why(store: embank.Store) -> None:
    t = store.create_table("serve8", dim=4, dtype="int8")
    t.push(np.array([1], dtype=np.uint64), np.ones((1, 4), dtype=np.float32))
    with pytest.raises(errors.EmbankError, match="int8"):
        t.push_grad(np.array([1], dtype=np.uint64), np.ones((1, 4), dtype=np.float32))
    with pytest.raises(errors.ConfigError, match="int8 table is for serving"):
        store.create_table("train8", dim=4, dtype="int8", optimizer=embank.optim.SGD(lr=0.1))
    with pytest.raises(errors.ConfigError, match="expected f32, f16 or int8"):
        store.create_table("bad", dim=4, dtype="bf16")


def test_a_dtype_that_is_not_f32_f16_or_int8_is_refused(store: embank.Store) -> None:
    """Names that mean another type elsewhere are refused, not mapped: ``uint8`` used to
    give an int8 table silently (and numpy's ``float`` is 64-bit, its ``i8`` and ``u8``
    8-byte integers). The unambiguous aliases stay."""
    for name in ("uint8", "u8", "i8", "float", "float64", "bfloat16", ""):
        with pytest.raises(errors.ConfigError, match=r"unknown dtype .*: expected f32, f16 or int8"):
            store.create_table("bad", dim=4, dtype=name)
    assert "bad" not in store.tables()
    for name, stored in (("float32", "f32"), ("F16", "f16"), ("half", "f16"), ("INT8", "int8")):
        assert store.create_table(f"t_{stored}_{name}", dim=4, dtype=name).stored_dtype == stored


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "embank", *args], capture_output=True, text=True, env=dict(os.environ)
    )


def test_import_quantizes_dequantizes_and_deprunes(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    keys = np.arange(2000, dtype=np.uint64)
    rows = rng.standard_normal((2000, 16)).astype(np.float32)
    np.save(tmp_path / "k.npy", keys)
    np.save(tmp_path / "r.npy", rows)
    store = tmp_path / "s"
    # Quantize an f32 export into an int8 table.
    r = cli(
        "import",
        str(store),
        "--table",
        "q",
        "--keys",
        str(tmp_path / "k.npy"),
        "--rows",
        str(tmp_path / "r.npy"),
        "--dtype",
        "int8",
    )
    assert r.returncode == 0 and "stored as int8" in r.stdout, r.stderr
    # De-quantize fused 8-bit rows into an f32 table: exactly q * scale + bias.
    np.save(tmp_path / "r8.npy", fused8(rows))
    r = cli(
        "import",
        str(store),
        "--table",
        "dq",
        "--keys",
        str(tmp_path / "k.npy"),
        "--rows",
        str(tmp_path / "r8.npy"),
    )
    assert r.returncode == 0 and "stored as f32" in r.stdout, r.stderr
    r = cli("inspect", str(store))
    assert "dtype int8" in r.stdout and "dtype f32" in r.stdout, r.stdout
    # --dtype on an existing table of another type is refused.
    r = cli(
        "import",
        str(store),
        "--table",
        "q",
        "--keys",
        str(tmp_path / "k.npy"),
        "--rows",
        str(tmp_path / "r.npy"),
        "--dtype",
        "f16",
    )
    assert r.returncode == 1 and "exists with dtype int8" in r.stderr
    # De-pruning: 5000 original ids, every third pruned, the rest mapped to pruned rows.
    mapping = np.full(5000, -1, dtype=np.int64)
    kept = np.array([i for i in range(5000) if i % 3], dtype=np.int64)
    mapping[kept] = rng.permutation(len(kept)) % 2000
    np.save(tmp_path / "map.npy", mapping)
    r = cli(
        "import",
        str(store),
        "--table",
        "dp",
        "--remap",
        str(tmp_path / "map.npy"),
        "--rows",
        str(tmp_path / "r.npy"),
        "--missing",
        "-1",
    )
    assert r.returncode == 0 and f"{5000 - len(kept)} pruned ids" in r.stdout, r.stderr
    bad = mapping.copy()
    bad[7] = 2000
    np.save(tmp_path / "bad.npy", bad)
    r = cli(
        "import",
        str(store),
        "--table",
        "dp2",
        "--remap",
        str(tmp_path / "bad.npy"),
        "--rows",
        str(tmp_path / "r.npy"),
    )
    assert r.returncode == 1 and "original id 7 maps to row 2000" in r.stderr
    with embank.open(store) as s:
        got, found = s.table("q").lookup(keys)
        np.testing.assert_allclose(got, as_int8(rows), rtol=0, atol=1e-6)
        got, _ = s.table("dq").lookup(keys)
        np.testing.assert_allclose(got, as_int8(rows), rtol=0, atol=1e-6)
        # The de-pruned table answers every original id as the remapped lookup would.
        ids = np.arange(5000, dtype=np.uint64)
        got, found = s.table("dp").lookup(ids)
        np.testing.assert_array_equal(found, mapping >= 0)
        want = np.where((mapping >= 0)[:, None], rows[np.maximum(mapping, 0)], np.float32(-1))
        np.testing.assert_array_equal(got, want)
        assert "dp2" not in s.tables()


def test_lookup_pooled_matches_torch_embedding_bag_and_the_cache_hits(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import embank.torch as et

    rng = np.random.default_rng(9)
    with embank.open(tmp_path / "s", pooled_cache_bytes=1 << 20) as s:
        t = s.create_table("items", dim=8, missing="init", init=embank.init.uniform(-1, 1), seed=3)
        keys = np.arange(300, dtype=np.uint64)
        rows = rng.standard_normal((300, 8)).astype(np.float32)
        t.push(keys, rows)
        ids = rng.integers(0, 300, 60).astype(np.uint64)
        offsets = np.array([0, 5, 5, 17, 40], dtype=np.int64)  # bag 1 is empty
        weights = rng.random(60).astype(np.float32)
        for mode, w in (("sum", None), ("sum", weights), ("mean", None)):
            bag = torch.nn.EmbeddingBag.from_pretrained(torch.from_numpy(rows), mode=mode)
            want = bag(torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(offsets),
                       per_sample_weights=None if w is None else torch.from_numpy(w)).numpy()  # fmt: skip
            for _ in range(3):  # first sight, cached, hit
                got = t.lookup_pooled(ids, offsets, w, mode)
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        st = s.stats()["pooled"]
        assert st["hits"] == 3 * 5 and st["entries"] == 3 * 5, st
        # A write to a member row is seen by the next call, never the cached bag.
        t.push(ids[:1], np.full((1, 8), 100.0, dtype=np.float32))
        got = t.lookup_pooled(ids, offsets)
        rows2 = rows.copy()
        rows2[int(ids[0])] = 100.0
        want = torch.nn.EmbeddingBag.from_pretrained(torch.from_numpy(rows2), mode="sum")(
            torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(offsets)
        ).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        assert s.stats()["pooled"]["invalidated"] >= 1
        # The module in eval mode pools in the store and matches the training path.
        m = et.EmbeddingBag(t, mode="sum", pooled=True)
        plain = et.EmbeddingBag(t, mode="sum")
        m.eval()
        plain.eval()
        x = torch.from_numpy(ids.astype(np.int64))
        o = torch.from_numpy(offsets)
        with torch.no_grad():
            np.testing.assert_allclose(m(x, o).numpy(), plain(x, o).numpy(), rtol=1e-5, atol=1e-5)
        with pytest.raises(errors.InvalidInputError, match="weights need mode"):
            t.lookup_pooled(ids, offsets, weights, "mean")
        with pytest.raises(errors.InvalidInputError, match="offsets decrease"):
            t.lookup_pooled(ids, np.array([0, 9, 3]))


def test_place_hot_on_demand_and_automatically(tmp_path: Path) -> None:
    with embank.open(
        tmp_path / "s", hot_placement={"keys": 64, "every_seconds": 0.1, "sample_every": 1}
    ) as s:
        t = s.create_table("t", dim=4, capacity=10_000)
        # 0.84 of the index's slots: keys past their home bucket, no growth.
        keys = np.arange(11_000, dtype=np.uint64)
        t.push(keys, np.repeat(keys.astype(np.float32)[:, None], 4, axis=1))
        away = np.array([k for k in range(11_000) if t.home_fraction([k]) == 0.0][:64], dtype=np.uint64)
        assert len(away) == 64
        r = t.place_hot(away[:32])
        assert r["held"] == 32 and r["home_before"] == 0.0 and r["home_after"] == 1.0, r
        assert t.home_fraction(away[:32]) == 1.0
        # The other 32 are found by the table's own sample of reads.
        import time

        deadline = time.monotonic() + 20
        while t.home_fraction(away[32:]) < 1.0:
            assert time.monotonic() < deadline, t.stats()["hot_placements"]
            t.lookup(away[32:])
            time.sleep(0.005)
        rows, found = t.lookup(keys)
        assert found.all() and (rows[:, 0] == keys.astype(np.float32)).all()
    with pytest.raises(errors.ConfigError, match="hot_placement"):
        embank.open(tmp_path / "t", hot_placement={"keys": 0})
