"""embank.gpu.TrainCache written through (``write="through"``): many trainers over one
table. Alone, the table trains as without the cache and equals every cached row after
each step; ``refresh_every`` bounds how long a row changed by someone else stays stale;
under a real ``torchrun`` of two ranks (gloo, the table on two `embank serve` shards)
training through their caches ends with the table bit for bit as training through the
table, every rank's cached rows equal to the table's after every step."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import embank
import embank.optim as eo
import numpy as np
import pytest

torch = pytest.importorskip("torch")
from embank import gpu  # noqa: E402
from embank._gpu_buckets import EMPTY  # noqa: E402
from embank.errors import InvalidInputError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).parent / "torchrun"
DIM, KEYS = 8, 400

OPTIMIZERS: dict[str, Any] = {
    "sgd": eo.SGD(lr=0.05),
    "adagrad": eo.Adagrad(lr=0.1, initial_accumulator_value=0.01),
    "adam": eo.Adam(lr=0.01),
    "ftrl": eo.Ftrl(lr=0.1, l1=0.001, l2=0.01),
    "fbgemm_adam": eo.FbgemmAdam(lr=0.01, weight_decay=0.01),
}


def _cached_equal_table(cache: Any, table: embank.Table, what: str) -> int:
    held = cache.keys != EMPTY
    keys = cache.keys[held].numpy().astype(np.uint64)
    rec, found = table.lookup_with_state(keys)
    assert found.all(), f"{what}: a cached row the table lacks"
    got = cache.records[held].numpy()
    assert np.array_equal(got, rec), f"{what}: cached rows differ from the table's: {np.abs(got - rec).max()}"
    return int(keys.size)


# The native kernels on the CPU: their emulator, in a test build (make test builds it).
NEEDS_EMULATOR = pytest.mark.skipif(not embank._native.gpu_emulator(), reason="a build without the emulator")


@pytest.mark.parametrize(
    ("kind", "kernels"),
    [(k, "torch") for k in OPTIMIZERS]
    + [pytest.param(k, "native", marks=NEEDS_EMULATOR) for k in ("sgd", "adam")],
)
def test_a_write_through_cache_trains_as_the_table_and_equals_it_each_step(
    tmp_path: Path, kind: str, kernels: str
) -> None:
    stores = {name: embank.open(str(tmp_path / name)) for name in ("cached", "reference")}
    tables = {name: s.create_table("emb", dim=DIM, optimizer=OPTIMIZERS[kind]) for name, s in stores.items()}
    # Small buckets: evictions every step, and more misses than a bucket holds now and then.
    cache = gpu.TrainCache(
        tables["cached"], rows_max=48, slots=8, device="cpu", write="through", kernels=kernels
    )
    rng = np.random.default_rng(5)
    checked = 0
    for step in range(1, 41):
        ids = (rng.zipf(1.2, 96) - 1) % KEYS
        grads = rng.standard_normal((len(ids), DIM)).astype(np.float32)
        got = cache.pull(torch.from_numpy(ids)).numpy()
        assert np.array_equal(got, tables["reference"].pull(ids.astype(np.uint64))), f"{kind}: pull {step}"
        cache.push_grad(torch.from_numpy(ids), torch.from_numpy(grads), step)
        tables["reference"].push_grad(ids.astype(np.uint64), grads, step)
        checked += _cached_equal_table(cache, tables["cached"], f"{kind}, step {step}")
    keys = np.arange(KEYS, dtype=np.uint64)
    (want, want_found), (have, found) = (tables[n].lookup_with_state(keys) for n in ("reference", "cached"))
    assert np.array_equal(found, want_found) and np.array_equal(have[found], want[want_found]), kind
    st = cache.stats()
    assert st["dirty"] == 0 and st["written_back"] == 0, st
    assert st["evicted"] > 0 and st["overflow"] > 0 and checked > 1000, (st, checked)
    cache.close()
    for s in stores.values():
        s.close()


@pytest.mark.parametrize("kernels", ["torch", pytest.param("native", marks=NEEDS_EMULATOR)])
def test_a_push_of_rows_not_cached_updates_them_once(tmp_path: Path, kernels: str) -> None:
    """push_grad of ids no pull brought in (or evicted since): the rows are read before
    the table takes the push, so the cache holds them updated once, as the table does
    (read after it, they were updated twice)."""
    s = embank.open(str(tmp_path / "s"))
    t = s.create_table("emb", dim=DIM, optimizer=eo.SGD(lr=0.5))
    cache = gpu.TrainCache(t, rows_max=16, device="cpu", write="through", kernels=kernels)
    cache.push_grad(torch.tensor([3, 7]), torch.ones(2, DIM))
    assert t.pull([3, 7])[:, 0].tolist() == [-0.5, -0.5]
    assert cache.pull(torch.tensor([3, 7]))[:, 0].tolist() == [-0.5, -0.5]
    assert _cached_equal_table(cache, t, "after the push") == 2
    cache.close()
    s.close()


def test_refresh_every_bounds_how_long_a_row_written_elsewhere_stays_stale(tmp_path: Path) -> None:
    s = embank.open(str(tmp_path / "s"))
    t = s.create_table("emb", dim=DIM, optimizer=eo.SGD(lr=1.0))  # zero gradients: rows stay
    t.push([1, 2], np.ones((2, DIM), np.float32))
    cache = gpu.TrainCache(t, rows_max=16, device="cpu", write="through", refresh_every=3)
    ids = torch.tensor([1, 2])
    zero = torch.zeros(2, DIM)
    assert cache.pull(ids)[0, 0].item() == 1.0
    t.push([1], np.full((1, DIM), 7.0, np.float32))  # another writer
    seen = []
    for step in range(1, 7):
        seen.append(cache.pull(ids)[0, 0].item())
        cache.push_grad(ids, zero, step)
    # Steps 1-3 read the cached row; the third step's end drops it; 4-6 read the new one.
    assert seen == [1.0, 1.0, 1.0, 7.0, 7.0, 7.0], seen
    assert cache.stats()["refreshes"] == 2
    with pytest.raises(InvalidInputError, match="refresh_every needs"):
        gpu.TrainCache(t, rows_max=16, device="cpu", refresh_every=3)
    with pytest.raises(InvalidInputError, match='write must be "back" or "through"'):
        gpu.TrainCache(t, rows_max=16, device="cpu", write="around")
    cache.close()
    s.close()


def test_distributed_takes_write_through_caches_of_step_modules_only(tmp_path: Path) -> None:
    from embank import torch as et

    s = embank.open(str(tmp_path / "s"))
    t = s.create_table("emb", dim=DIM, optimizer=eo.SGD(lr=0.1))
    back = et.EmbeddingBag(gpu.TrainCache(t, rows_max=8, device="cpu"))
    with pytest.raises(InvalidInputError, match='write="through"'):
        et.SparseOptimizer(back, distributed=True)
    through = gpu.TrainCache(t, rows_max=8, device="cpu", write="through")
    with pytest.raises(InvalidInputError, match='need push="step"'):
        et.SparseOptimizer(et.EmbeddingBag(through, push="backward"), distributed=True)
    s.close()


def _plain_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("EMBANK_TLS_")}


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not installed")
def test_two_ranks_through_their_caches_train_the_table_as_through_the_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k in [k for k in os.environ if k.startswith("EMBANK_TLS_")]:
        monkeypatch.delenv(k)
    sys.path.insert(0, str(ROOT / "examples" / "dlrm"))
    try:
        import shards  # type: ignore[import-not-found]
    finally:
        sys.path.pop(0)
    addrs = shards.start(tmp_path, 2, fresh=True)
    try:
        out = {}
        # Through the table, through caches of PyTorch operations, and (in a test build)
        # through caches of the native kernels.
        runs = ["plain", "torch"] + (["native"] if embank._native.gpu_emulator() else [])
        for i, name in enumerate(runs):
            cmd = [str(TORCHRUN), "--nproc_per_node", "2", "--master_port", str(29600 + i)]
            cmd += [str(ROOT / "tests" / "python" / "train_through_child.py"), "--addrs", ",".join(addrs)]
            cmd += ["--table", name, "--out", str(tmp_path / f"{name}.npy")]
            cmd += ["--cached", "--kernels", name] if name != "plain" else []
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_plain_env())
            assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
            out[name] = (np.load(tmp_path / f"{name}.npy"), r.stdout + r.stderr)
        plain = out["plain"][0]
        for name in runs[1:]:
            assert "cached rows checked" in out[name][1], out[name][1][-2000:]
            cached = out[name][0]
            assert np.array_equal(np.isnan(plain), np.isnan(cached)), name
            same = np.array_equal(plain[~np.isnan(plain)], cached[~np.isnan(cached)])
            assert same, (name, np.nanmax(np.abs(plain - cached)))
    finally:
        shards.stop(tmp_path)
