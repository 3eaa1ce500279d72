"""embank.torch against PyTorch itself: after each step the rows of an embank table equal
those of ``torch.nn.EmbeddingBag``/``Embedding(sparse=True)`` with the same sparse
optimizer, for random bags (sum, mean, per-sample weights), shared tables and keyed
jagged input, embedded and through two shards."""

from __future__ import annotations

import doctest
from typing import Any

import embank
import numpy as np
import numpy.typing as npt
import pytest

torch = pytest.importorskip("torch")
et = pytest.importorskip("embank.torch")

pytestmark = pytest.mark.torch

N, DIM = 60, 6


def make(store: embank.Store, name: str, optimizer: Any) -> tuple[embank.Table, Any]:
    """An embank table and a torch weight starting from the same rows."""
    t = store.create_table(name, dim=DIM, init=embank.init.uniform(-0.5, 0.5), seed=3, optimizer=optimizer)
    w = torch.nn.Parameter(torch.from_numpy(t.pull(np.arange(N, dtype=np.uint64)).copy()))
    return t, w


def torch_opt(kind: str, params: list[Any]) -> Any:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.3)
    if kind == "adagrad":
        return torch.optim.Adagrad(params, lr=0.3, eps=1e-10)
    # torch.optim.SparseAdam adds eps before the bias correction (eps / sqrt(1 - beta2^t)
    # in effect); embank's Adam adds it after, as torch.optim.Adam does. Dense Adam after
    # one step updates exactly the rows with a gradient, so it is the reference.
    return torch.optim.Adam(params, lr=0.3, betas=(0.9, 0.999), eps=1e-8)


def embank_opt(kind: str) -> Any:
    if kind == "sgd":
        return embank.optim.SGD(lr=0.3)
    if kind == "adagrad":
        return embank.optim.Adagrad(lr=0.3, eps=1e-10)
    return embank.optim.Adam(lr=0.3, betas=(0.9, 0.999), eps=1e-8)


def rows_of(t: embank.Table) -> npt.NDArray[np.float32]:
    return t.pull(np.arange(N, dtype=np.uint64))


def random_bags(rng: np.random.Generator, bags: int) -> tuple[Any, Any]:
    sizes = rng.integers(0, 7, size=bags)  # empty bags too
    ids = torch.from_numpy(rng.integers(0, N, size=int(sizes.sum())))
    offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64))
    return ids, offsets


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "adam"])
@pytest.mark.parametrize(("mode", "weighted"), [("sum", False), ("mean", False), ("sum", True)])
def test_embedding_bag_steps_equal_torch(store: embank.Store, kind: str, mode: str, weighted: bool) -> None:
    t, w = make(store, "t", embank_opt(kind))
    ref = torch.nn.EmbeddingBag(N, DIM, mode=mode, sparse=kind != "adam")
    ref.weight = w
    ours = et.EmbeddingBag(t, mode=mode)
    sparse = et.SparseOptimizer(ours)
    opt = torch_opt(kind, [w])
    rng = np.random.default_rng(11)
    # torch's Adam counts steps per table and moves rows without a gradient once their
    # moments are non-zero; embank's Adam is lazy with a step count per row: equal after one
    # step. SGD and Adagrad agree step after step.
    steps = 1 if kind == "adam" else 4
    for step in range(steps):
        ids, offsets = random_bags(rng, 24)
        psw = torch.from_numpy(rng.uniform(0.5, 2.0, size=len(ids)).astype(np.float32)) if weighted else None
        target = torch.from_numpy(rng.normal(size=(24, DIM)).astype(np.float32))
        out_ours = ours(ids, offsets, psw)
        out_ref = ref(ids, offsets, per_sample_weights=psw)
        if step == 0:  # the same rows pooled alike (later the rows differ in the last bits)
            torch.testing.assert_close(out_ours, out_ref, rtol=1e-6, atol=1e-6)
        ((out_ours - target) ** 2).mean().backward()
        ((out_ref - target) ** 2).mean().backward()
        sparse.step()
        opt.step()
        opt.zero_grad()
        np.testing.assert_allclose(rows_of(t), w.detach().numpy(), rtol=1e-6, atol=1e-6)


def test_a_shared_table_gets_one_update_per_step(store: embank.Store) -> None:
    # A two-tower model's item table, looked up for positives and for negatives: torch
    # sums both gradients into one Adagrad update; so must embank.
    t, w = make(store, "item", embank_opt("adagrad"))
    pos, neg = et.Embedding(t), et.Embedding(t)
    sparse = et.SparseOptimizer([pos, neg])
    assert sparse.tables == ["item"]
    opt = torch_opt("adagrad", [w])
    user = torch.from_numpy(np.random.default_rng(2).normal(size=(16, DIM)).astype(np.float32))
    rng = np.random.default_rng(5)
    for _ in range(3):
        p = torch.from_numpy(rng.integers(0, N, size=16))
        n = torch.from_numpy(rng.integers(0, N, size=(16, 4)))
        ours = (user * pos(p)).sum(1) - (user[:, None, :] * neg(n)).sum(-1).mean(1)
        ref = (user * torch.nn.functional.embedding(p, w, sparse=True)).sum(1) - (
            user[:, None, :] * torch.nn.functional.embedding(n, w, sparse=True)
        ).sum(-1).mean(1)
        torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
        (-torch.nn.functional.logsigmoid(ours)).sum().backward()
        (-torch.nn.functional.logsigmoid(ref)).sum().backward()
        assert sparse.step() == len(np.unique(p)) + len(np.unique(n))  # one push of both lookups
        opt.step()
        opt.zero_grad()
        np.testing.assert_allclose(rows_of(t), w.detach().numpy(), rtol=1e-6, atol=1e-6)
    # Pushed from backward, two lookups would be two Adagrad updates: not what torch does.
    twice = et.Embedding(t, push="backward")
    before = rows_of(t)
    (twice(torch.tensor([1])).sum() + twice(torch.tensor([1])).sum()).backward()
    assert not np.allclose(rows_of(t)[1], before[1])


def test_push_in_backward_equals_torch_for_a_single_lookup(store: embank.Store) -> None:
    t, w = make(store, "t", embank_opt("adagrad"))
    ours = et.EmbeddingBag(t, mode="mean", push="backward")
    ref = torch.nn.EmbeddingBag(N, DIM, mode="mean", sparse=True)
    ref.weight = w
    opt = torch_opt("adagrad", [w])
    rng = np.random.default_rng(8)
    for _ in range(3):
        ids = torch.from_numpy(rng.integers(0, N, size=(10, 3)))  # fixed-size bags, 2-D input
        ours(ids).pow(2).sum().backward()
        ref(ids).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    np.testing.assert_allclose(rows_of(t), w.detach().numpy(), rtol=1e-6, atol=1e-6)


def test_embedding_keeps_the_input_shape_and_eval_pushes_nothing(store: embank.Store) -> None:
    t = store.create_table("t", dim=3, init=embank.init.constant(1.0), optimizer=embank.optim.SGD(lr=1.0))
    emb = et.Embedding(t)
    sparse = et.SparseOptimizer(emb)
    ids = torch.tensor([[1, 2, 3], [3, 2, 1]])
    assert emb(ids).shape == (2, 3, 3)
    emb.eval()
    with torch.no_grad():
        emb(ids).sum()
    assert sparse.step() == 0
    np.testing.assert_array_equal(t.pull([1, 2, 3]), np.ones((3, 3), np.float32))


def test_collection_over_a_mapping_with_a_shared_table(store: embank.Store) -> None:
    a, wa = make(store, "a", embank_opt("sgd"))
    b, wb = make(store, "b", embank_opt("sgd"))
    ebc = et.EmbeddingBagCollection({"f1": a, "f2": b, "f3": a})  # f1 and f3 share table a
    sparse = et.SparseOptimizer(ebc)
    assert sorted(sparse.tables) == ["a", "b"]
    feats = {
        "f1": (torch.tensor([1, 2, 3]), torch.tensor([0, 2])),
        "f2": (torch.tensor([4, 5]), torch.tensor([0, 1])),
        "f3": (torch.tensor([1, 9]), torch.tensor([0, 0])),
    }
    out = ebc(feats)
    assert list(out) == ["f1", "f2", "f3"] and all(v.shape == (2, DIM) for v in out.values())
    sum(v.sum() for v in out.values()).backward()
    sparse.step()
    opt = torch_opt("sgd", [wa, wb])
    f = torch.nn.functional
    ref = [
        f.embedding_bag(torch.tensor([1, 2, 3]), wa, torch.tensor([0, 2]), sparse=True, mode="sum"),
        f.embedding_bag(torch.tensor([4, 5]), wb, torch.tensor([0, 1]), sparse=True, mode="sum"),
        f.embedding_bag(torch.tensor([1, 9]), wa, torch.tensor([0, 0]), sparse=True, mode="sum"),
    ]
    sum(r.sum() for r in ref).backward()
    opt.step()
    np.testing.assert_allclose(rows_of(a), wa.detach().numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(rows_of(b), wb.detach().numpy(), rtol=1e-6, atol=1e-6)
    with pytest.raises(embank.InvalidInputError, match="f2"):
        ebc({"f1": feats["f1"], "f3": feats["f3"]})


def test_bad_input_is_refused_with_nothing_pushed(store: embank.Store) -> None:
    t = store.create_table("t", dim=2, optimizer=embank.optim.SGD(lr=1.0))
    bag = et.EmbeddingBag(t)
    with pytest.raises(embank.InvalidInputError, match="negative"):
        bag(torch.tensor([1, -2]), torch.tensor([0]))
    with pytest.raises(embank.InvalidInputError, match="integer"):
        bag(torch.tensor([1.0, 2.0]), torch.tensor([0]))
    with pytest.raises(embank.InvalidInputError, match="offsets"):
        bag(torch.tensor([1, 2]))
    with pytest.raises(embank.InvalidInputError, match="mode"):
        et.EmbeddingBag(t, mode="max")
    with pytest.raises(embank.InvalidInputError, match="push"):
        et.Embedding(t, push="later")
    with pytest.raises(embank.InvalidInputError, match="per_sample_weights"):
        et.EmbeddingBag(t, mode="mean")(torch.tensor([1]), torch.tensor([0]), torch.tensor([1.0]))
    assert len(t) == 0


def test_delayed_pushes_under_a_staleness_bound(store: embank.Store) -> None:
    # SSP with k = 2 on one worker: each step's gradient lands two steps later, and the
    # store's bound (holds per key) is never exceeded, so no pull waits.
    t = store.create_table(
        "t", dim=1, init=embank.init.constant(0.0), optimizer=embank.optim.SGD(lr=1.0), staleness_bound=2
    )
    with t.worker(timeout=5) as w:
        emb = et.Embedding(w)
        sparse = et.SparseOptimizer(emb, delay=2)
        seen = []
        for _ in range(6):
            x = emb(torch.tensor([7]))
            seen.append(float(x.item()))
            (-x).sum().backward()  # gradient -1: each push adds 1
            sparse.step()
        assert seen == [0, 0, 0, 1, 2, 3]
        assert sparse.flush() == 2
    np.testing.assert_array_equal(t.pull([7]), [[6.0]])


def test_evaluating_through_a_worker_takes_no_holds(store: embank.Store) -> None:
    # BSP: a held key cannot be pulled again before its push. Evaluation pushes nothing,
    # so its pulls must not hold (they would wait forever on the second batch).
    t = store.create_table("t", dim=2, optimizer=embank.optim.SGD(lr=1.0), staleness_bound=0)
    with t.worker(timeout=1) as w:
        emb = et.Embedding(w)
        emb.eval()
        for _ in range(3):
            emb(torch.tensor([1, 2]))
        emb.train()
        with torch.no_grad():
            emb(torch.tensor([1, 2]))
            emb(torch.tensor([1, 2]))
        assert t.stats()["holds_outstanding"] == 0


def test_lookahead_yields_every_batch_in_order(store: embank.Store) -> None:
    t = store.create_table("t", dim=2)
    t.push(np.arange(100, dtype=np.uint64), np.ones((100, 2), np.float32))
    batches = [np.arange(i * 10, i * 10 + 10) for i in range(5)]
    got = list(et.lookahead(iter(batches), lambda b: {t: torch.from_numpy(b)}))
    assert [g.tolist() for g in got] == [b.tolist() for b in batches]
    assert list(et.lookahead(iter([]), lambda b: {})) == []


def test_module_docs_run() -> None:
    import embank.datasets

    for mod in (et, embank.datasets):
        failed, tried = doctest.testmod(mod)
        assert tried > 0 and failed == 0, mod.__name__


def test_collection_takes_torchrec_keyed_jagged_tensors(store: embank.Store) -> None:
    torchrec = pytest.importorskip("torchrec")  # optional: installed for the comparison runs only
    a, _ = make(store, "a", embank_opt("sgd"))
    b, _ = make(store, "b", embank_opt("sgd"))
    ebc = et.EmbeddingBagCollection({"f1": a, "f2": b})
    kjt = torchrec.KeyedJaggedTensor.from_lengths_sync(
        keys=["f1", "f2"], values=torch.tensor([1, 2, 3, 4, 5]), lengths=torch.tensor([2, 1, 0, 2])
    )
    out = ebc(kjt)
    ref = ebc(
        {
            "f1": (torch.tensor([1, 2, 3]), torch.tensor([0, 2])),
            "f2": (torch.tensor([4, 5]), torch.tensor([0, 0])),
        }
    )
    for k in ("f1", "f2"):
        torch.testing.assert_close(out[k], ref[k])
