"""The fused collection (one native call per step each way) against the per-table
modules it replaces, and against torch itself: after each step the tables' rows are
equal, for sum, weighted sum and mean bags, tables shared by features, ``(batch,
features)`` tensors, staleness workers, pushes from backward, embedded and through two
shards; bad input fails before anything is pushed; a GpuCache over a table hears the
fused pushes."""

from __future__ import annotations

import time
from typing import Any

import embank
import numpy as np
import pytest

torch = pytest.importorskip("torch")
et = pytest.importorskip("embank.torch")
gpu = pytest.importorskip("embank.gpu")

pytestmark = pytest.mark.torch

N, DIM = 80, 5


def tables(store: embank.Store, prefix: str, kind: str = "adagrad") -> list[embank.Table]:
    opt: Any = embank.optim.Adagrad(lr=0.2, eps=1e-10) if kind == "adagrad" else embank.optim.SGD(lr=0.2)
    return [
        store.create_table(
            f"{prefix}{j}", dim=DIM, init=embank.init.uniform(-0.5, 0.5), seed=j, optimizer=opt
        )
        for j in range(3)
    ]


def rows(ts: list[embank.Table]) -> Any:
    return np.stack([t.pull(np.arange(N, dtype=np.uint64)) for t in ts])


def random_features(rng: np.random.Generator, bags: int, weighted: bool) -> dict[str, tuple[Any, ...]]:
    out: dict[str, tuple[Any, ...]] = {}
    for name in ("f0", "f1", "f2", "f3"):
        sizes = rng.integers(0, 5, size=bags)
        ids = torch.from_numpy(rng.integers(0, N, size=int(sizes.sum())))
        offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64))
        w = torch.from_numpy(rng.uniform(0.5, 2.0, size=len(ids)).astype(np.float32)) if weighted else None
        out[name] = (ids, offsets, w)
    return out


@pytest.mark.parametrize(("mode", "weighted"), [("sum", False), ("mean", False), ("sum", True)])
def test_fused_steps_equal_the_per_table_modules(store: embank.Store, mode: str, weighted: bool) -> None:
    a, b = tables(store, "a"), tables(store, "b")
    # f0 and f3 share a table: one update per step with both features' gradients.
    fused = et.EmbeddingBagCollection({"f0": a[0], "f1": a[1], "f2": a[2], "f3": a[0]}, mode)
    plain = et.EmbeddingBagCollection({"f0": b[0], "f1": b[1], "f2": b[2], "f3": b[0]}, mode, fused=False)
    assert fused.fused and not plain.fused
    so_f, so_p = et.SparseOptimizer(fused), et.SparseOptimizer(plain)
    assert sorted(so_f.tables) == ["a0", "a1", "a2"]
    rng = np.random.default_rng(5)
    for _ in range(5):
        feats = random_features(rng, 16, weighted)
        target = torch.from_numpy(rng.normal(size=(16, DIM)).astype(np.float32))
        for model, so in ((fused, so_f), (plain, so_p)):
            out = model(feats)
            loss = sum(((v - target * (i + 1)) ** 2).sum() for i, v in enumerate(out.values()))
            so.zero_grad()
            loss.backward()
            so.step()
        np.testing.assert_allclose(rows(a), rows(b), rtol=1e-5, atol=1e-6)


def test_a_tensor_of_ids_and_pushes_from_backward(store: embank.Store) -> None:
    a, b = tables(store, "a", "sgd"), tables(store, "b", "sgd")
    names = ["x", "y", "z"]
    fused = et.EmbeddingBagCollection(dict(zip(names, a)), push="backward")
    ref = [torch.nn.Parameter(torch.from_numpy(t.pull(np.arange(N, dtype=np.uint64)).copy())) for t in b]
    opt = torch.optim.SGD(ref, lr=0.2)
    rng = np.random.default_rng(2)
    for _ in range(4):
        ids = torch.from_numpy(rng.integers(0, N, size=(32, 3)))
        out = fused(ids)
        assert [tuple(v.shape) for v in out.values()] == [(32, DIM)] * 3
        sum((v**2).sum() for v in out.values()).backward()
        opt.zero_grad()
        sum((torch.nn.functional.embedding(ids[:, j], ref[j]) ** 2).sum() for j in range(3)).backward()
        opt.step()
        np.testing.assert_allclose(rows(a), np.stack([r.detach().numpy() for r in ref]), rtol=1e-5, atol=1e-6)


def test_staleness_workers_hold_until_the_step(store: embank.Store) -> None:
    ts = [
        store.create_table(f"s{j}", dim=DIM, optimizer=embank.optim.SGD(lr=0.1), staleness_bound=0)
        for j in range(2)
    ]
    workers = [t.worker(timeout=0.2) for t in ts]
    fused = et.EmbeddingBagCollection({"f0": workers[0], "f1": workers[1]})
    so = et.SparseOptimizer(fused)
    ids = torch.tensor([[1, 2], [3, 4]])
    fused(ids)["f0"].sum().backward()
    # Bound 0: another worker may not pull key 1 until these gradients are pushed.
    with pytest.raises(embank.errors.EmbankTimeoutError):
        ts[0].worker(timeout=0.1).pull([1])
    assert so.step() == 4
    ts[0].worker(timeout=0.1).pull([1])
    fused.eval()
    with torch.no_grad():
        fused(ids)  # evaluation pulls through the tables: no holds
    ts[1].worker(timeout=0.1).pull([2])


def test_bad_input_fails_before_anything_is_pushed(store: embank.Store) -> None:
    a = tables(store, "a", "sgd")
    fused = et.EmbeddingBagCollection({"f0": a[0], "f1": a[1]})
    before = rows(a)
    with pytest.raises(embank.InvalidInputError, match="negative"):
        fused(
            {"f0": (torch.tensor([1, -2]), torch.tensor([0])), "f1": (torch.tensor([1]), torch.tensor([0]))}
        )
    with pytest.raises(embank.InvalidInputError, match="bags"):
        fused(
            {"f0": (torch.tensor([1, 2]), torch.tensor([0, 1])), "f1": (torch.tensor([1]), torch.tensor([0]))}
        )
    with pytest.raises(embank.InvalidInputError, match=r"\(batch, 2\)"):
        fused(torch.tensor([[1, 2, 3]]))
    with pytest.raises(embank.InvalidInputError, match="f1"):
        fused({"f0": (torch.tensor([1]), torch.tensor([0]))})
    so = et.SparseOptimizer(fused)
    out = fused(torch.tensor([[1, 2]]))
    with pytest.raises(embank.InvalidInputError, match="non-finite"):
        (out["f0"].sum() * float("nan")).backward()
    assert so.step() == 0
    np.testing.assert_array_equal(rows(a), before)


def test_a_gpu_cache_hears_the_fused_pushes(tmp_path: Any) -> None:
    with embank.open(tmp_path / "s") as store:
        a = tables(store, "a", "sgd")
        cache = gpu.GpuCache(a[0], 64, device="cpu", insert="sync")
        keys = torch.tensor([1, 2, 3])
        a[0].pull([1, 2, 3])  # created: the cache holds them
        before = cache.lookup(keys).clone()
        fused = et.EmbeddingBagCollection({"f0": a[0], "f1": a[1]})
        so = et.SparseOptimizer(fused)
        fused(torch.tensor([[1, 5], [2, 6]]))["f0"].sum().backward()
        so.step()
        after = cache.lookup(keys)
        np.testing.assert_allclose(after.numpy(), a[0].pull([1, 2, 3]), rtol=0, atol=0)
        assert not torch.equal(before[:2], after[:2]) and torch.equal(before[2], after[2])


def test_prefetch_reads_the_next_batch_ahead(tmp_path: Any) -> None:
    batches = [torch.from_numpy(np.arange(i * 64, (i + 1) * 64).reshape(32, 2)) for i in range(3)]
    with embank.open(tmp_path / "s") as store:
        for j in range(2):
            store.create_table(f"b{j}", dim=DIM, medium="block").pull(np.arange(0, 192, dtype=np.uint64))
    with embank.open(tmp_path / "s") as store:  # reopened: an empty row cache
        ts = [store.table(f"b{j}") for j in range(2)]
        fused = et.EmbeddingBagCollection({"f0": ts[0], "f1": ts[1]})
        it = fused.prefetch(iter(batches), lambda b: b)
        first = next(it)  # batch 1's rows are being read now
        assert torch.equal(first, batches[0])
        deadline = time.monotonic() + 10
        want = np.arange(64, 128, dtype=np.uint64)
        while time.monotonic() < deadline:
            hits0 = [t.stats()["cache_hits"] for t in ts]
            for j, t in enumerate(ts):
                t.pull(want[j::2])
            if all(t.stats()["cache_hits"] - h == 32 for t, h in zip(ts, hits0)):
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the next batch's rows never reached the row cache")
        assert [torch.equal(x, y) for x, y in zip(it, batches[1:])] == [True, True]


def test_prefetched_training_ends_on_exactly_the_unprefetched_rows(tmp_path: Any) -> None:
    """Reading ahead into a small row cache (rows evicted, written back, read again)
    changes when rows are read, never what training computes."""
    rng = np.random.default_rng(9)
    keys = 20_000  # 2 tables x 20 k rows x 128 B of row and Adagrad state: over the 1 MiB cache
    batches = [torch.from_numpy(rng.zipf(1.1, size=(256, 2)) % keys) for _ in range(30)] * 2
    finals = []
    for ahead in (False, True):
        with embank.open(tmp_path / f"s{ahead}", cache_bytes=1 << 20) as store:
            ts = [
                store.create_table(
                    f"b{j}", dim=16, medium="block", seed=j, optimizer=embank.optim.Adagrad(lr=0.1)
                )
                for j in range(2)
            ]
            fused = et.EmbeddingBagCollection({"f0": ts[0], "f1": ts[1]})
            so = et.SparseOptimizer(fused)
            it = fused.prefetch(iter(batches), lambda b: b) if ahead else iter(batches)
            for b in it:
                out = fused(b)
                so.zero_grad()
                sum(((v - 1.0) ** 2).sum() for v in out.values()).backward()
                so.step()
            finals.append(np.stack([t.pull(np.arange(keys, dtype=np.uint64)) for t in ts]))
            if ahead:
                assert sum(t.stats()["lookahead_rows"] for t in ts) > 0
    np.testing.assert_array_equal(finals[0], finals[1])
