"""embank.gpu.TrainCache, the write-back cache a trainer updates on the device: against a
reference trained through the table alone (random batches, evictions, checkpoints, a
reopen), and a SIGKILL mid-epoch resumed from the last checkpoint. On the CPU here (the
same PyTorch operations run on CUDA)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import embank
import embank.optim as eo
import numpy as np
import numpy.typing as npt
import pytest

torch = pytest.importorskip("torch")
from embank import gpu  # noqa: E402
from embank import torch as et  # noqa: E402
from embank.errors import InvalidInputError  # noqa: E402

DIM = 8
KEYS = 400

OPTIMIZERS: dict[str, Any] = {
    "sgd": eo.SGD(lr=0.05),
    "adagrad": eo.Adagrad(lr=0.1, initial_accumulator_value=0.01),
    "rowwise_adagrad": eo.RowWiseAdagrad(lr=0.1),
    "adam": eo.Adam(lr=0.01),
    "adamw": eo.AdamW(lr=0.01, weight_decay=0.05),
    "ftrl": eo.Ftrl(lr=0.1, l1=0.001, l2=0.01),
    "fbgemm_adam": eo.FbgemmAdam(lr=0.01, weight_decay=0.01),
    "partial_rowwise_lamb": eo.PartialRowWiseLamb(lr=0.01),
}


def _batch(rng: np.random.Generator, n: int = 96) -> npt.NDArray[Any]:
    """Zipf-skewed ids over KEYS keys, with repeats."""
    return (rng.zipf(1.2, n) - 1) % KEYS


def _records(t: embank.Table) -> npt.NDArray[Any]:
    rec, found = t.lookup_with_state(np.arange(KEYS, dtype=np.uint64))
    rec[~found] = np.nan  # a key the table does not hold
    return rec


def _assert_same(got: npt.NDArray[Any], want: npt.NDArray[Any], exact: bool, what: str) -> float:
    assert np.array_equal(np.isnan(got), np.isnan(want)), f"{what}: the tables hold different keys"
    diff = float(np.nanmax(np.abs(got - want))) if got.size else 0.0
    if exact:
        assert diff == 0.0, f"{what}: differs by {diff}"
    else:
        assert diff <= 1e-6, f"{what}: differs by {diff}"
    return diff


NATIVE_KINDS = ("sgd", "adagrad", "rowwise_adagrad", "adam", "adamw", "ftrl")
# The native kernels on the CPU: their emulator, in a test build (make test builds it).
EMULATOR = embank._native.gpu_emulator()
NEEDS_EMULATOR = pytest.mark.skipif(not EMULATOR, reason="a build without the emulator")


@pytest.mark.parametrize(
    ("kind", "write_back", "kernels"),
    [(k, "background", "torch") for k in OPTIMIZERS]
    + [("adagrad", "inline", "torch")]
    + [
        pytest.param(k, w, "native", marks=NEEDS_EMULATOR)
        for k, w in [(k, "background") for k in NATIVE_KINDS] + [("adam", "inline")]
    ],
)
def test_a_write_back_cache_trains_as_the_table_alone(
    tmp_path: Path, kind: str, write_back: str, kernels: str
) -> None:
    opt = OPTIMIZERS[kind]
    stores = {name: embank.open(str(tmp_path / name)) for name in ("cached", "reference")}
    tables = {name: s.create_table("emb", dim=DIM, optimizer=opt) for name, s in stores.items()}
    # Small buckets: evictions every step, and now and then more misses than a bucket holds.
    cache = gpu.TrainCache(
        tables["cached"], rows_max=48, slots=8, device="cpu", write_back=write_back, kernels=kernels
    )
    rng = np.random.default_rng(11)
    # The cache's arithmetic is the store's, bit for bit, for every kind (on the CPU).
    exact = True
    seen: dict[str, int] = {}
    diffs = []
    for step in range(1, 61):
        ids = _batch(rng)
        grads = rng.standard_normal((len(ids), DIM)).astype(np.float32)
        got = cache.pull(torch.from_numpy(ids)).numpy()
        want = tables["reference"].pull(ids.astype(np.uint64))
        _assert_same(got, want, exact, f"{kind}: pull of step {step}")
        cache.push_grad(torch.from_numpy(ids), torch.from_numpy(grads), step)
        tables["reference"].push_grad(ids.astype(np.uint64), grads, step)
        if step % 10 == 0:
            cache.checkpoint(step)
            stores["reference"].checkpoint(step)
            diffs.append(
                _assert_same(
                    _records(tables["cached"]),
                    _records(tables["reference"]),
                    exact,
                    f"{kind}: checkpoint {step}",
                )
            )
            assert tables["cached"].optimizer_step == tables["reference"].optimizer_step
        if step == 30:
            # Reopen both stores (the cache is flushed and closed first).
            for k, v in cache.stats().items():
                seen[k] = seen.get(k, 0) + v if isinstance(v, int) else v
            cache.close()
            for name in list(stores):
                stores[name].close()
                stores[name] = embank.open(str(tmp_path / name))
                tables[name] = stores[name].table("emb")
            cache = gpu.TrainCache(
                tables["cached"], rows_max=48, slots=8, device="cpu", write_back=write_back, kernels=kernels
            )
    st = cache.stats()
    assert seen["evicted"] > 0 and st["evicted"] > 0, (seen, st)
    assert seen["written_back"] > 0 and seen["overflow"] + st["overflow"] > 0, (seen, st)
    assert st["hits"] > 0 and st["misses"] > 0
    cache.close()
    for s in stores.values():
        s.close()


def test_between_write_backs_the_table_keeps_the_rows_of_the_last(tmp_path: Path) -> None:
    s = embank.open(str(tmp_path / "s"))
    t = s.create_table("emb", dim=DIM, optimizer=eo.SGD(lr=1.0))
    t.push([1, 2], np.ones((2, DIM), np.float32))
    cache = gpu.TrainCache(t, rows_max=8, device="cpu", write_back_every=3)
    for _ in range(1, 3):
        cache.push_grad(torch.tensor([1]), torch.ones(1, DIM))
        assert t.pull([1])[0, 0] == 1.0, "a write-back cache wrote through"
    assert cache.stats()["dirty"] == 1
    cache.push_grad(torch.tensor([2]), torch.ones(1, DIM))  # the third step: written back
    assert t.pull([1, 2])[:, 0].tolist() == [-1.0, 0.0]
    assert cache.stats()["dirty"] == 0
    # Bad input: refused with nothing changed.
    with pytest.raises(InvalidInputError, match="not finite"):
        cache.push_grad(torch.tensor([1]), torch.full((1, DIM), float("nan")))
    with pytest.raises(InvalidInputError, match="shape"):
        cache.push_grad(torch.tensor([1, 2]), torch.ones(1, DIM))
    with pytest.raises(InvalidInputError, match="non-negative"):
        cache.pull(torch.tensor([-3]))
    assert cache.pull(torch.tensor([1]))[0, 0].item() == -1.0
    cache.close()
    with pytest.raises(InvalidInputError, match="closed"):
        cache.pull(torch.tensor([1]))
    plain = s.create_table("plain", dim=DIM)
    with pytest.raises(InvalidInputError, match="no optimizer"):
        gpu.TrainCache(plain, rows_max=8, device="cpu")
    with pytest.raises(InvalidInputError, match="rows_max or bytes_max"):
        gpu.TrainCache(t, device="cpu")
    by_bytes = gpu.TrainCache(t, bytes_max=1 << 20, device="cpu")
    assert by_bytes.rows_max > 0 and by_bytes.rows_max * (4 * DIM + 17) <= 1 << 20
    by_bytes.close()
    s.close()


@pytest.mark.parametrize("kernels", ["torch", pytest.param("native", marks=NEEDS_EMULATOR)])
def test_one_cache_over_several_tables_trains_each_as_alone(tmp_path: Path, kernels: str) -> None:
    """A TrainCache over three tables (one dim, optimizer, store), keyed by keys_of: the
    same ids in every table are distinct rows; each table ends as a reference trained by
    its own pushes; evicted rows go back to their own tables."""
    opt = OPTIMIZERS["adam"]
    s, r = embank.open(str(tmp_path / "s")), embank.open(str(tmp_path / "r"))
    tables = [s.create_table(f"t{i}", dim=DIM, optimizer=opt) for i in range(3)]
    refs = [r.create_table(f"t{i}", dim=DIM, optimizer=opt) for i in range(3)]
    cache = gpu.TrainCache(tables, rows_max=48, slots=8, device="cpu", kernels=kernels)
    rng = np.random.default_rng(3)
    for step in range(1, 31):
        ids = [_batch(rng, 40) for _ in tables]
        keys = torch.cat([cache.keys_of(i, torch.from_numpy(x)) for i, x in enumerate(ids)])
        want = np.concatenate([t.pull(x.astype(np.uint64)) for t, x in zip(refs, ids)])
        np.testing.assert_array_equal(cache.pull(keys).numpy(), want, err_msg=f"step {step}")
        grads = rng.standard_normal((len(keys), DIM)).astype(np.float32)
        cache.push_grad(keys, torch.from_numpy(grads), step)
        for t, x, g in zip(refs, ids, np.split(grads, 3)):
            t.push_grad(x.astype(np.uint64), g, step)
        if step % 10 == 0:
            cache.checkpoint(step)
            for a, b in zip(tables, refs):
                _assert_same(_records(a), _records(b), True, f"{a.name}, checkpoint {step}")
    st = cache.stats()
    assert st["evicted"] > 0 and st["written_back"] > 0 and st["overflow"] > 0, st
    assert "tables='t0', 't1', 't2'" in repr(cache)
    # Keys naming no table, ids too large, a table not the cache's: refused.
    with pytest.raises(InvalidInputError, match="names no table"):
        cache.pull(torch.tensor([3 << 48]))
    with pytest.raises(InvalidInputError, match="below 2"):
        cache.keys_of(1, torch.tensor([1 << 48]))
    with pytest.raises(InvalidInputError, match="not one of"):
        cache.keys_of("t9", torch.tensor([1]))
    with pytest.raises(InvalidInputError, match="pulls one table"):
        et.EmbeddingBag(cache)
    cache.close()
    other = s.create_table("wide", dim=DIM + 1, optimizer=opt)
    with pytest.raises(InvalidInputError, match="one dim and optimizer"):
        gpu.TrainCache([tables[0], other], rows_max=8, device="cpu")
    with pytest.raises(InvalidInputError, match="one store"):
        gpu.TrainCache([tables[0], refs[1]], rows_max=8, device="cpu")
    with pytest.raises(InvalidInputError, match="a cache of one table"):
        gpu.TrainCache(tables[:2], rows_max=8, device="cpu", write="through")
    s.close()
    r.close()


@pytest.mark.parametrize("kernels", ["torch", pytest.param("native", marks=NEEDS_EMULATOR)])
@pytest.mark.parametrize("write_back", ["inline", "background"])
def test_a_failed_write_back_loses_no_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernels: str, write_back: str
) -> None:
    """An evicted dirty row whose write to the table fails stays readable (a miss reads
    it) and, inline, reaches the table at the next flush; the native path overwrites the
    row's slot on the device before the write, so the writer parks it."""
    s = embank.open(str(tmp_path / "s"))
    t = s.create_table("emb", dim=2, optimizer=eo.SGD(lr=0.5))
    cache = gpu.TrainCache(t, rows_max=1, slots=1, device="cpu", write_back=write_back, kernels=kernels)
    cache.push_grad(torch.tensor([1]), torch.ones(1, 2))  # row 1: -0.5, dirty

    def fail(keys: Any, records: Any) -> None:
        raise OSError("disk full")

    writer = cache._writer
    monkeypatch.setattr(writer, "write", fail)
    if write_back == "inline":
        with pytest.raises(OSError, match="disk full"):
            cache.pull(torch.tensor([2]))  # evicts row 1: its write fails
    else:
        cache.pull(torch.tensor([2]))
        writer.close()  # the writer thread failed and stopped
        with pytest.raises(InvalidInputError, match="disk full"):
            cache.pull(torch.tensor([3]))
    parked = writer.take(np.array([1], np.uint64))[1]
    assert parked is not None and parked[0, 0] == -0.5  # parked, readable
    monkeypatch.undo()
    if write_back == "background":  # the writer stopped: the store does not close over the row
        with pytest.raises(InvalidInputError, match="disk full"):
            s.close()
        return
    assert cache.pull(torch.tensor([1]))[0].tolist() == [-0.5, -0.5]  # a miss reads it
    cache.flush()
    assert t.pull([1])[0].tolist() == [-0.5, -0.5]
    cache.close()
    s.close()


@NEEDS_EMULATOR
def test_native_kernels_refuse_what_they_do_not_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """kernels="native": a table-step optimizer and a build without the kernels' emulator
    (on the CPU) are refused by name; bad input is refused before any kernel runs, with
    nothing changed."""
    s = embank.open(str(tmp_path / "s"))
    lamb = s.create_table("lamb", dim=DIM, optimizer=eo.PartialRowWiseLamb(lr=0.01))
    with pytest.raises(InvalidInputError, match=r"partial_rowwise_lamb.*needs"):
        gpu.TrainCache(lamb, rows_max=8, device="cpu", kernels="native")
    t = s.create_table("emb", dim=DIM, optimizer=eo.SGD(lr=1.0))
    t.push([1], np.ones((1, DIM), np.float32))
    cache = gpu.TrainCache(t, rows_max=8, device="cpu", kernels="native")
    cache.push_grad(torch.tensor([1]), torch.ones(1, DIM))
    with pytest.raises(InvalidInputError, match="not finite"):
        cache.push_grad(torch.tensor([1]), torch.full((1, DIM), float("inf")))
    with pytest.raises(InvalidInputError, match="shape"):
        cache.push_grad(torch.tensor([1, 2]), torch.ones(1, DIM))
    with pytest.raises(InvalidInputError, match="non-negative"):
        cache.pull(torch.tensor([-3]))
    with pytest.raises(InvalidInputError, match="unique int64 ids"):
        cache.pull_unique(torch.tensor([1], dtype=torch.int32))  # an address of other ids
    from embank import _gpu_train_native as native  # the kernels' own guards (internal callers)

    slot = native.find(cache, torch.tensor([1]))
    with pytest.raises(InvalidInputError, match=r"grads: torch\.float32"):
        native.update(cache, slot, torch.ones(1, DIM, dtype=torch.float64))
    with pytest.raises(InvalidInputError, match=r"grads: torch\.float32"):
        native.update(cache, slot, torch.ones(1, DIM + 1))
    with pytest.raises(InvalidInputError, match=r"slots: torch\.int64"):
        native.update(cache, slot.int(), torch.ones(1, DIM))
    with pytest.raises(InvalidInputError, match=r"ids: torch\.int64"):
        native.find(cache, torch.tensor([1.0]))
    assert cache.pull(torch.tensor([1]))[0].tolist() == [0.0] * DIM
    assert cache.stats()["updates"] == 1
    cache.close()
    assert t.pull([1])[0].tolist() == [0.0] * DIM
    monkeypatch.setattr(embank._native, "gpu_emulator", lambda: False)
    with pytest.raises(InvalidInputError, match="gpu-emulator"):
        gpu.TrainCache(t, rows_max=8, device="cpu", kernels="native")
    with pytest.raises(InvalidInputError, match='"native", "triton"'):
        gpu.TrainCache(t, rows_max=8, device="cpu", kernels="cuda")
    s.close()


_TRAIN = textwrap.dedent(
    """
    import sys
    import numpy as np, torch, embank, embank.optim as eo
    from embank import gpu

    path, first, last, kill_after = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    store = embank.open(path)
    t = store.table("emb") if "emb" in store.tables() else store.create_table(
        "emb", dim=8, optimizer=eo.Adagrad(lr=0.1, initial_accumulator_value=0.01)
    )
    cache = gpu.TrainCache(t, rows_max=48, slots=8, device="cpu")
    for step in range(first, last + 1):
        rng = np.random.default_rng(step)
        ids = (rng.zipf(1.2, 96) - 1) % 400
        grads = rng.standard_normal((len(ids), 8)).astype(np.float32)
        cache.pull(torch.from_numpy(ids))
        cache.push_grad(torch.from_numpy(ids), torch.from_numpy(grads))
        if step % 5 == 0:
            cache.checkpoint(step)
            print("checkpoint", step, flush=True)
        if kill_after and step == kill_after:
            print("mid-epoch", step, flush=True)
            sys.stdin.read()  # the parent kills it here, rows written back since the checkpoint
    cache.close()
    store.close()
    """
)


def test_sigkill_mid_epoch_resumes_exactly(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONHASHSEED": "0"}

    def run(path: Path, first: int, last: int) -> None:
        subprocess.run(
            [sys.executable, "-c", _TRAIN, str(path), str(first), str(last), "0"], check=True, env=env
        )

    run(tmp_path / "whole", 1, 30)
    child = subprocess.Popen(
        [sys.executable, "-c", _TRAIN, str(tmp_path / "killed"), "1", "30", "18"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert child.stdout is not None
    for line in child.stdout:
        if line.startswith("mid-epoch"):
            break
    # Steps 16-18 evicted dirty rows into the table after checkpoint 15: the kill leaves them.
    child.send_signal(signal.SIGKILL)
    child.wait()
    s = embank.open(str(tmp_path / "killed"))
    assert s.checkpoints()[-1] == 15
    s.close()
    run(tmp_path / "killed", 16, 30)
    got, want = (embank.open(str(tmp_path / n)) for n in ("killed", "whole"))
    a, b = _records(got.table("emb")), _records(want.table("emb"))
    assert not np.isnan(a).all()
    assert np.array_equal(a, b, equal_nan=True), f"differs by {np.nanmax(np.abs(a - b))}"
    got.close()
    want.close()


def test_module_docs_run() -> None:
    import doctest

    from embank import _gpu_train

    failed, tried = doctest.testmod(_gpu_train)
    assert tried > 0 and failed == 0


@pytest.mark.parametrize("push", ["step", "backward"])
def test_modules_train_through_the_cache_as_through_the_table(tmp_path: Path, push: str) -> None:
    from embank import torch as et

    def train(cached: bool) -> npt.NDArray[Any]:
        store = embank.open(str(tmp_path / f"{cached}-{push}"))
        t = store.create_table("emb", dim=DIM, optimizer=eo.Adagrad(lr=0.1, initial_accumulator_value=0.01))
        u = store.create_table("seq", dim=DIM, optimizer=eo.SGD(lr=0.05))
        caches = [gpu.TrainCache(x, rows_max=40, slots=8, device="cpu") for x in (t, u)] if cached else []
        bag = et.EmbeddingBag(caches[0] if cached else t, "sum", push=push)
        seq = et.Embedding(caches[1] if cached else u, push=push)
        torch.manual_seed(3)
        dense = torch.nn.Linear(2 * DIM, 1)
        sparse = et.SparseOptimizer([bag, seq]) if push == "step" else None
        dense_opt = torch.optim.SGD(dense.parameters(), lr=0.01)
        rng = np.random.default_rng(5)
        for _ in range(25):
            ids = torch.from_numpy(_batch(rng, 64))
            offsets = torch.arange(0, 64, 4)
            weights = torch.from_numpy(rng.random(64).astype(np.float32))
            x = torch.cat([bag(ids, offsets, weights), seq(ids[::4])], 1)
            loss = dense(x).square().mean()
            dense_opt.zero_grad()
            loss.backward()
            dense_opt.step()
            if sparse is not None:
                sparse.step()
        for c in caches:
            c.close()
        out: npt.NDArray[Any] = np.concatenate([_records(t), _records(u)], 1)
        store.close()
        return out

    want, got = train(False), train(True)
    assert np.array_equal(got, want, equal_nan=True), f"differs by {np.nanmax(np.abs(got - want))}"


def test_distributed_sparse_optimizer_refuses_a_train_cache(tmp_path: Path) -> None:
    from embank import torch as et

    s = embank.open(str(tmp_path / "s"))
    t = s.create_table("emb", dim=DIM, optimizer=eo.SGD(lr=0.1))
    bag = et.EmbeddingBag(gpu.TrainCache(t, rows_max=8, device="cpu"))
    with pytest.raises(InvalidInputError, match="write-back TrainCache keeps its rows on one trainer"):
        et.SparseOptimizer(bag, distributed=True)
    s.close()


def test_the_training_bench_runs_on_the_cpu(tmp_path: Path) -> None:
    """examples/gpu_cache/train_bench.py, the GPU check's script, at tiny sizes: the three
    ways train, and the cache's losses are the host path's (the same arithmetic)."""
    import json

    bench = Path(__file__).resolve().parents[2] / "examples" / "gpu_cache" / "train_bench.py"
    subprocess.run(
        [
            sys.executable,
            str(bench),
            "--device",
            "cpu",
            "--small-run",
            "--profile-steps",
            "2",
            "--out",
            str(tmp_path),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    r = json.loads((tmp_path / "train.json").read_text())
    # PyTorch operations a step (a count, not a time): the shared cache joins its 26
    # features in a few (fewer than a cache a table, or the resident tables' sparse steps).
    ops = {
        way: r[way]["profile"]["torch_ops_per_step"] for way in ("resident", "host", "cache", "cache_shared")
    }
    assert ops["cache_shared"] < min(ops["cache"], ops["resident"]) / 2, ops
    assert r["largest_loss_difference_cache_host"] == 0.0 and r["auc_difference_cache_host"] == 0.0
    assert r["largest_loss_difference_cache_shared_host"] == 0.0
    assert 0.0 < r["cache"]["auc"] < 1.0
    assert 0 < r["cache"]["hit_rate"] < 1 and r["cache"]["written_back"] > 0
    # The cache way runs the native kernels where they run (here: their emulator).
    assert r["args"]["kernels"] == ("native" if EMULATOR else "torch")


def test_the_training_bench_keeps_going_past_a_way_that_fails(tmp_path: Path) -> None:
    """A way that fails (here: kernels no cache takes) is recorded with its error in
    train.json, the next ways still run, and the bench exits non-zero."""
    import json

    bench = Path(__file__).resolve().parents[2] / "examples" / "gpu_cache" / "train_bench.py"
    out = tmp_path / "r.json"
    args = ["--device", "cpu", "--small-run", "--ways", "cache,host", "--kernels", "nope", "--json", str(out)]
    run = subprocess.run(
        [sys.executable, str(bench), *args, "--out", str(tmp_path)], capture_output=True, timeout=300
    )
    assert run.returncode == 1, run.stderr[-2000:]
    r = json.loads(out.read_text())
    assert "kernels must be" in r["cache"]["error"] and r["host"]["examples_per_s"] > 0


@pytest.mark.parametrize("way", ["caches", "shared", pytest.param("shared_native", marks=NEEDS_EMULATOR)])
def test_from_configs_trains_through_caches_as_the_fused_collection(tmp_path: Path, way: str) -> None:
    """TorchRec's drop-in with ``train_cache_rows``: a table with two features, another
    with one, trained with a fused row-wise Adagrad as the default (fused, on the host)
    collection trains them: one update a table a step, its features' gradients summed
    (within float rounding: the two sum them in other orders). Through a cache a table,
    or one cache over both (``shared_train_cache``: every feature in one call), its
    kernels PyTorch's or the native ones."""
    configs = [
        et.EmbeddingBagConfig(num_embeddings=KEYS, embedding_dim=DIM, name="t0", feature_names=["f0", "f1"]),
        et.EmbeddingBagConfig(num_embeddings=KEYS, embedding_dim=DIM, name="t1", feature_names=["f2"]),
    ]
    opt = eo.RowWiseAdagrad(lr=0.1)

    def train(cached: bool) -> npt.NDArray[Any]:
        store = embank.open(str(tmp_path / str(cached)))
        shared = cached and way.startswith("shared")
        ebc = et.EmbeddingBagCollection.from_configs(
            store,
            configs,
            opt,
            train_cache_rows=40 if cached else None,
            device="cpu",
            shared_train_cache=shared,
            train_cache_options={"kernels": "native"} if way == "shared_native" and cached else None,
        )
        assert ebc.fused != cached and len(ebc.train_caches()) == (0 if not cached else 1 if shared else 2)
        rng = np.random.default_rng(9)
        for step in range(1, 21):
            inputs = {
                f: (torch.from_numpy(_batch(rng, 48)), torch.arange(0, 48, 3)) for f in ("f0", "f1", "f2")
            }
            out = ebc(inputs)
            out.values().square().sum().backward()
            if step % 10 == 0:
                for c in ebc.train_caches():
                    c.flush()
                store.checkpoint(step)
        for c in ebc.train_caches():
            c.close()
        got: npt.NDArray[Any] = np.concatenate([_records(store.table(c.name)) for c in configs], 1)
        store.close()
        return got

    want, got = train(False), train(True)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got[~np.isnan(got)], want[~np.isnan(want)], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("weighted", [False, True])
def test_a_shared_cache_pools_mixed_modes_and_weights_as_the_fused_collection(
    tmp_path: Path, weighted: bool
) -> None:
    """shared_train_cache with tables pooling SUM and MEAN (bags of several ids, an
    empty bag), or weighted bags whose weights want their gradient: the outputs, the
    weights' gradients and the trained tables are the fused host collection's (within
    float rounding), and an id past num_embeddings is refused as there."""
    pools = ["sum", "sum"] if weighted else ["sum", "mean"]
    configs = [
        et.EmbeddingBagConfig(
            num_embeddings=KEYS, embedding_dim=DIM, name=f"t{i}", feature_names=[f"f{i}"], pooling=p
        )
        for i, p in enumerate(pools)
    ]
    opt = eo.Adagrad(lr=0.1)
    offsets = torch.tensor([0, 3, 3, 7, 12, 20, 30])  # bag 1 empty

    def train(shared: bool) -> tuple[list[Any], npt.NDArray[Any]]:
        store = embank.open(str(tmp_path / str(shared)))
        ebc = et.EmbeddingBagCollection.from_configs(
            store,
            configs,
            opt,
            train_cache_rows=40 if shared else None,
            shared_train_cache=shared,
            device="cpu",
            is_weighted=weighted,
        )
        rng = np.random.default_rng(4)
        seen: list[Any] = []
        for _ in range(12):
            inputs: dict[str, Any] = {}
            for f in ("f0", "f1"):
                w = torch.from_numpy(rng.random(36).astype(np.float32)).requires_grad_(True)
                inputs[f] = (
                    (torch.from_numpy(_batch(rng, 36)), offsets, w)
                    if weighted
                    else (
                        torch.from_numpy(_batch(rng, 36)),
                        offsets,
                    )
                )
            out = ebc(inputs)
            out.values().square().sum().backward()
            seen.append(out.values().detach().numpy().copy())
            if weighted:
                seen.extend(inputs[f][2].grad.numpy().copy() for f in ("f0", "f1"))
        with pytest.raises(InvalidInputError, match="cannot set"):
            et.EmbeddingBagCollection.from_configs(
                store, configs, opt, train_cache_rows=8, train_cache_options={"rows_max": 3}
            )
        with pytest.raises(InvalidInputError, match="not below num_embeddings"):
            bad = (torch.tensor([KEYS]), torch.tensor([0])) + ((torch.ones(1),) if weighted else ())
            ebc({f: bad for f in ("f0", "f1")})
        store.checkpoint(1)
        got: npt.NDArray[Any] = np.concatenate([_records(store.table(c.name)) for c in configs], 1)
        store.close()
        return seen, got

    (want_seen, want), (got_seen, got) = train(False), train(True)
    for a, b in zip(got_seen, want_seen):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got[~np.isnan(got)], want[~np.isnan(want)], rtol=1e-5, atol=1e-6)


def test_a_shared_cache_takes_a_tensor_of_ids_as_the_same_ids_jagged(tmp_path: Path) -> None:
    """A ``(batch, features)`` tensor through a shared cache (its own path: the features
    joined without a launch each) pools and trains as the same ids given jagged, and
    refuses what the jagged path refuses: an id past num_embeddings, a bad shape."""
    configs = [
        et.EmbeddingBagConfig(
            num_embeddings=KEYS,
            embedding_dim=DIM,
            name=f"t{i}",
            feature_names=[f"f{i}"],
            pooling="mean" if i == 1 else "sum",
        )
        for i in range(3)
    ]

    def train(dense: bool) -> tuple[list[Any], npt.NDArray[Any]]:
        store = embank.open(str(tmp_path / str(dense)))
        ebc = et.EmbeddingBagCollection.from_configs(
            store, configs, eo.Adagrad(lr=0.1), train_cache_rows=40, shared_train_cache=True, device="cpu"
        )
        rng = np.random.default_rng(2)
        seen = []
        for _ in range(8):
            ids = torch.from_numpy(np.stack([_batch(rng, 32) for _ in range(3)], 1))
            x = ids if dense else {f"f{i}": (ids[:, i], torch.arange(32)) for i in range(3)}
            out = ebc(x)
            out.values().square().sum().backward()
            seen.append(out.values().detach().numpy().copy())
        if dense:
            with pytest.raises(InvalidInputError, match="'f2': id 400 is not below num_embeddings 400"):
                ebc(torch.tensor([[1, 2, KEYS]]))
            with pytest.raises(InvalidInputError, match="must be"):
                ebc(torch.tensor([[1, 2]]))
        store.checkpoint(1)
        got: npt.NDArray[Any] = np.concatenate([_records(store.table(c.name)) for c in configs], 1)
        store.close()
        return seen, got

    (want_seen, want), (got_seen, got) = train(False), train(True)
    for a, b in zip(got_seen, want_seen):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(got, want)


def test_gradients_of_one_step_are_one_update(tmp_path: Path) -> None:
    """add_grad (what the modules' backward calls): two gradients of step 1 for a row make
    one update of their sum, applied by the next pull; a gradient of step 2 applies
    step 1's first."""
    s = embank.open(str(tmp_path / "s"))
    t = s.create_table("emb", dim=2, optimizer=eo.Adagrad(lr=1.0))
    t.push([5], np.ones((1, 2), np.float32))
    ref = s.create_table("ref", dim=2, optimizer=eo.Adagrad(lr=1.0))
    ref.push([5], np.ones((1, 2), np.float32))
    cache = gpu.TrainCache(t, rows_max=8, device="cpu")
    k = torch.tensor([5])
    cache.pull(k)
    cache.add_grad(k, torch.full((1, 2), 0.25), 1)
    cache.add_grad(k, torch.full((1, 2), 0.5), 1)
    cache.add_grad(k, torch.full((1, 2), 1.0), 2)  # applies step 1's sum
    ref.push_grad([5], np.full((1, 2), 0.75, np.float32))
    ref.push_grad([5], np.full((1, 2), 1.0, np.float32))
    got = cache.pull(k).numpy()  # applies step 2's
    np.testing.assert_array_equal(got, ref.pull([5]))
    assert cache.stats()["updates"] == 2
    cache.close()
    s.close()


_KERNELS_SCRIPT = r"""
import sys
import embank, embank.optim as eo, numpy as np, torch
from embank import gpu

store, device = embank.open(sys.argv[1]), sys.argv[2]
kinds = {"sgd": eo.SGD(lr=0.05), "adagrad": eo.Adagrad(lr=0.1, initial_accumulator_value=0.01),
         "adam": eo.Adam(lr=0.01), "adamw": eo.AdamW(lr=0.01, weight_decay=0.05),
         "ftrl": eo.Ftrl(lr=0.1, l1=0.001, l2=0.01), "rowwise_adagrad": eo.RowWiseAdagrad(lr=0.1)}
# The native kernels too where they run (CUDA; the CPU in a build with their emulator).
paths = ("triton", "torch") + (("native",) if device == "cuda" or embank._native.gpu_emulator() else ())
for name, opt in kinds.items():
    for dim in (3, 8, 33):
        got, stats, tensors = {}, {}, {}
        for kernels in paths:
            t = store.create_table(f"{name}-{dim}-{kernels}", dim=dim, optimizer=opt)
            c = gpu.TrainCache(t, rows_max=32, slots=8 if dim != 33 else 5, device=device, kernels=kernels)
            rng = np.random.default_rng(1)
            for _ in range(15):
                ids = torch.from_numpy(rng.integers(0, 60, 40)).to(device)
                g = torch.from_numpy(rng.standard_normal((40, dim)).astype(np.float32)).to(device)
                c.pull(ids)
                c.push_grad(ids, g)
            stats[kernels] = {k: v for k, v in c.stats().items() if k != "hit_rate"}
            tensors[kernels] = [x.cpu().clone() for x in (c.keys, c.used, c.dirty, c.records)]
            c.close()
            got[kernels] = t.lookup_with_state(np.arange(60, dtype=np.uint64))[0]
        for p in paths[1:]:
            assert stats[p] == stats["triton"], (p, stats)
            diff = np.abs(got[p] - got["triton"]).max()
            assert diff == 0, f"{name} dim {dim}: the {p} path differs from the Triton one by {diff}"
            same = [torch.equal(a, b) for a, b in zip(tensors[p], tensors["triton"])]
            assert all(same), f"{name} dim {dim}: {p}'s keys, used, dirty, records alike: {same}"
print("kernels agree:", ", ".join(paths))
"""


def _kernels_agree(tmp_path: Path, device: str) -> None:
    """Runs the script above in a fresh Python: interpreted on the CPU, compiled on CUDA."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    r = subprocess.run(
        [sys.executable, "-c", _KERNELS_SCRIPT, str(tmp_path / "s"), device],
        env=env,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0 and "kernels agree" in r.stdout, r.stderr[-3000:]
    if device == "cuda" or embank._native.gpu_emulator():
        assert "native" in r.stdout, r.stdout


def test_the_triton_update_is_the_pytorch_path_bit_for_bit_in_the_interpreter(tmp_path: Path) -> None:
    """The find and the update: every element-wise kind (and row-wise Adagrad) at dims 3, 8
    and 33 (masked lanes; buckets of 8 and 5 slots), with evictions and overflow; the stats
    and the cache's tensors alike too; the PyTorch path is the store's arithmetic (the
    model test above). The native kernels (in their emulator) against both."""
    pytest.importorskip("triton")
    _kernels_agree(tmp_path, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_compiled_update_is_the_pytorch_path(tmp_path: Path) -> None:
    _kernels_agree(tmp_path, "cuda")


@pytest.mark.parametrize("kernels", ["torch", pytest.param("native", marks=NEEDS_EMULATOR)])
def test_two_threads_train_through_one_cache(tmp_path: Path, kernels: str) -> None:
    """Two trainers share a cache (and so its buckets, evictions and writer), each on its
    own keys: every key ends as a reference trained by its thread's steps alone."""
    import threading

    opt = eo.Adagrad(lr=0.1, initial_accumulator_value=0.01)
    s = embank.open(str(tmp_path / "s"))
    t = s.create_table("emb", dim=DIM, optimizer=opt)
    ref = s.create_table("ref", dim=DIM, optimizer=opt)
    cache = gpu.TrainCache(t, rows_max=32, slots=8, device="cpu", kernels=kernels)
    errors: list[BaseException] = []

    def trainer(offset: int) -> None:
        try:
            rng = np.random.default_rng(offset)
            for _ in range(40):
                ids = _batch(rng, 32) * 2 + offset  # even keys for one, odd for the other
                grads = rng.standard_normal((len(ids), DIM)).astype(np.float32)
                cache.pull(torch.from_numpy(ids))
                cache.push_grad(torch.from_numpy(ids), torch.from_numpy(grads))
        except BaseException as e:  # reported by the test
            errors.append(e)

    threads = [threading.Thread(target=trainer, args=(o,)) for o in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    cache.checkpoint(1)
    for offset in (0, 1):  # the reference: each thread's steps, one thread at a time
        rng = np.random.default_rng(offset)
        for _ in range(40):
            ids = (_batch(rng, 32) * 2 + offset).astype(np.uint64)
            grads = rng.standard_normal((len(ids), DIM)).astype(np.float32)
            ref.pull(ids)
            ref.push_grad(ids, grads)
    keys = np.arange(2 * KEYS, dtype=np.uint64)
    a, fa = t.lookup_with_state(keys)
    b, fb = ref.lookup_with_state(keys)
    assert np.array_equal(fa, fb) and np.array_equal(a[fa], b[fb])
    assert cache.stats()["evicted"] > 0
    cache.close()
    s.close()


def test_the_store_writes_its_caches_rows_at_checkpoint_close_and_state_dict_export(tmp_path: Path) -> None:
    """Whoever checkpoints the store (``store.checkpoint``, ``embank.torch.checkpoint``),
    closes it, or exports a state dict gets the rows trained through its open TrainCaches;
    a state dict loaded into the tables empties the caches, so the next pull reads it."""
    from embank import torch as et

    configs = [et.EmbeddingBagConfig(num_embeddings=KEYS, embedding_dim=DIM, name="t0", feature_names=["f0"])]
    opt = eo.Adagrad(lr=0.1)
    exports, at5 = {}, {}
    for cached in (False, True):
        store = embank.open(str(tmp_path / str(cached)))
        ebc = et.EmbeddingBagCollection.from_configs(
            store, configs, opt, train_cache_rows=40 if cached else None, device="cpu"
        )
        rng = np.random.default_rng(2)
        for step in range(1, 11):
            out = ebc({"f0": (torch.from_numpy(_batch(rng, 48)), torch.arange(0, 48, 3))})
            out.values().square().sum().backward()
            if step == 5:
                et.checkpoint(store, step)  # no flush of the caches by hand
                at5[cached] = _records(store.table("t0"))
        if cached:
            assert ebc.train_caches()[0].stats()["dirty"] > 0
        exports[cached] = et.export_state_dict(ebc, optimizer_state=True)
        if not cached:
            store.close()
            continue
        # Closing the store writes the rows too: a reopen holds the cache's dirty ones.
        cache = ebc.train_caches()[0]
        assert cache.stats()["dirty"] == 0  # the export wrote them
        out = ebc({"f0": (torch.from_numpy(_batch(rng, 48)), torch.arange(0, 48, 3))})
        out.values().square().sum().backward()
        cache.pull(torch.tensor([0]))  # applies the step's gathered gradient
        dirty = cache.dirty.nonzero().reshape(-1)
        assert dirty.numel() > 0
        keys, records = cache.keys[dirty].numpy().astype(np.uint64), cache.records[dirty].numpy()
        store.close()
        again = embank.open(str(tmp_path / str(cached)))
        got, found = again.table("t0").lookup_with_state(keys)
        assert found.all() and np.array_equal(got, records)
        assert again.checkpoints() == [5]
        again.close()
    assert np.array_equal(np.isnan(at5[True]), np.isnan(at5[False]))
    np.testing.assert_allclose(
        at5[True][~np.isnan(at5[True])], at5[False][~np.isnan(at5[False])], rtol=1e-5, atol=1e-6
    )
    for k in exports[False]:
        np.testing.assert_allclose(exports[True][k].numpy(), exports[False][k].numpy(), rtol=1e-5, atol=1e-6)
    # A state dict loaded underneath a cache: the next pull answers the loaded rows.
    store = embank.open(str(tmp_path / "load"))
    ebc = et.EmbeddingBagCollection.from_configs(store, configs, opt, train_cache_rows=40, device="cpu")
    cache = ebc.train_caches()[0]
    cache.pull(torch.arange(10))
    cache.push_grad(torch.arange(10), torch.ones(10, DIM))
    weight = torch.full((KEYS, DIM), 3.0)
    et.load_state_dict(ebc, {"embedding_bags.t0.weight": weight})
    assert (cache.pull(torch.arange(10)) == 3.0).all()
    cache.close()
    store.close()


def test_duplicates_are_summed_in_their_order_on_the_cpu_and_alike_every_run_on_cuda() -> None:
    """A step's duplicate ids' gradients: on the CPU added in their order (the store's
    order of operations); on CUDA the same bits every run (not atomics in any order)."""
    from embank._device import sum_rows

    g = torch.randn(4000, 5, generator=torch.Generator().manual_seed(3))
    inverse = torch.randint(0, 50, (4000,), generator=torch.Generator().manual_seed(4))
    want = torch.zeros(50, 5)
    for i in range(4000):
        want[inverse[i]] += g[i]
    assert torch.equal(sum_rows(inverse, g, 50), want)
    if torch.cuda.is_available():
        gc, ic = g.cuda(), inverse.cuda()
        first = sum_rows(ic, gc, 50)
        assert all(torch.equal(sum_rows(ic, gc, 50), first) for _ in range(20))
        torch.testing.assert_close(first.cpu(), want, rtol=1e-5, atol=1e-5)


def test_a_call_on_another_stream_waits_for_the_last_calls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An update is launched and not waited for: a pull, push or flush on another CUDA
    stream than the last call's first makes its stream wait for that one (never on the
    same stream). CUDA's streams stood in for by fakes that record the waits."""
    from embank._device import StreamFollower

    class Stream:
        def __init__(self, name: str) -> None:
            self.name, self.waited = name, []  # type: ignore[var-annotated]

        def __eq__(self, other: object) -> bool:
            return isinstance(other, Stream) and other.name == self.name

        def wait_stream(self, other: Stream) -> None:
            self.waited.append(other.name)

    a, b = Stream("a"), Stream("b")
    now = [a]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: now[0])
    recorded: list[tuple[int, str]] = []  # the tensors held across calls, used on a new stream
    monkeypatch.setattr(
        StreamFollower, "record", staticmethod(lambda t, st: recorded.append((t.data_ptr(), st.name)))
    )
    s = embank.open(str(tmp_path / "s"))
    t = s.create_table("emb", dim=DIM, optimizer=eo.Adagrad(lr=0.1))
    cache = gpu.TrainCache(t, rows_max=32, slots=8, device="cpu")
    cache._streams = StreamFollower(torch.device("cuda", 0), cache._kept)  # the CPU cache, CUDA's
    cache._streams.follow()  # as the constructor does: its arrays were made on a
    ids, grads = torch.arange(5), torch.ones(5, DIM)
    cache.pull(ids)
    cache.push_grad(ids, grads)
    assert a.waited == [] and b.waited == []
    now[0] = b
    cache.pull(ids)  # after a's update
    assert b.waited == ["a"]
    cache.push_grad(ids, grads)
    now[0] = a
    assert cache.flush() == 5  # after b's update
    assert a.waited == ["b"] and b.waited == ["a"]
    now[0] = b
    assert cache.stats()["rows"] == 5  # counts after a's flush
    assert b.waited == ["a", "a"]
    # A pull's slots held for its gradient, which comes on another stream: recorded there.
    recorded.clear()
    cache.pull(ids)
    slot = cache._last_pull[1]  # type: ignore[index]
    now[0] = a
    cache.push_grad(ids, grads)
    assert (slot.data_ptr(), "a") in recorded
    # Gradients gathered on a, applied by a flush on b: recorded on b.
    recorded.clear()
    cache.add_grad(ids, grads, step=cache._step + 1)
    g = cache._gathered[2][0]  # type: ignore[index]
    now[0] = b
    cache.flush()
    assert (g.data_ptr(), "b") in recorded
    cache.close()
    s.close()
