"""Server-side optimizers against a numpy reference on the same gradient stream."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import embank
import numpy as np
import numpy.typing as npt
import pytest
from embank.errors import ConfigError, InvalidInputError

DIM = 8


Arr = npt.NDArray[Any]
Batch = tuple[Arr, Arr]


def _stream(seed: int, steps: int = 30, keys: int = 50, batch: int = 40) -> list[Batch]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        k = rng.integers(0, keys, batch).astype(np.uint64)  # duplicates on purpose
        g = rng.standard_normal((batch, DIM)).astype(np.float32)
        out.append((k, g))
    return out


def _summed(k: Arr, g: Arr) -> tuple[Arr, Arr]:
    uniq, inv = np.unique(k, return_inverse=True)
    sums = np.zeros((len(uniq), g.shape[1]), np.float64)
    np.add.at(sums, inv, g.astype(np.float64))
    return uniq, sums


def _rel_close(got: Arr, want: Arr) -> None:
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("medium", ["mmap", "block"])
def test_adagrad_matches_a_reference(store_path: Path, medium: str) -> None:
    lr, eps, acc0 = 0.05, 1e-10, 0.1
    with embank.open(store_path, cache_bytes=16 << 10) as s:
        t = s.create_table(
            "e",
            DIM,
            init=embank.init.constant(0.5),
            medium=medium,
            optimizer=embank.optim.Adagrad(lr=lr, eps=eps, initial_accumulator_value=acc0),
        )
        w: dict[int, Arr] = {}
        acc: dict[int, Arr] = {}
        for k, g in _stream(1):
            t.push_grad(k, g)
            uniq, sums = _summed(k, g)
            for key, gs in zip(uniq.tolist(), sums):
                wk = w.setdefault(key, np.full(DIM, 0.5))
                ak = acc.setdefault(key, np.full(DIM, acc0))
                ak += gs * gs
                wk -= lr * gs / (np.sqrt(ak) + eps)
        keys = np.array(sorted(w), np.uint64)
        _rel_close(t.pull(keys), np.stack([w[k] for k in sorted(w)]))
    # State persisted with the rows: one more step after reopening still matches.
    with embank.open(store_path) as s:
        t = s.table("e")
        assert t.optimizer == {"kind": "adagrad", "lr": lr, "eps": eps, "initial_accumulator_value": acc0}
        g = np.ones((len(keys), DIM), np.float32)
        t.push_grad(keys, g)
        for key in w:
            acc[key] += 1.0
            w[key] -= lr * 1.0 / (np.sqrt(acc[key]) + eps)
        _rel_close(t.pull(keys), np.stack([w[k] for k in sorted(w)]))


def test_adam_matches_a_reference_with_per_row_steps(store_path: Path) -> None:
    lr, b1, b2, eps = 0.01, 0.9, 0.999, 1e-8
    with embank.open(store_path) as s:
        t = s.create_table("e", DIM, optimizer=embank.optim.Adam(lr=lr, betas=(b1, b2), eps=eps))
        ref: dict[int, list[Any]] = {}
        for k, g in _stream(2):
            t.push_grad(k, g)
            uniq, sums = _summed(k, g)
            for key, gs in zip(uniq.tolist(), sums):
                r = ref.setdefault(key, [np.zeros(DIM), np.zeros(DIM), np.zeros(DIM), 0])
                r[3] += 1
                r[1] = b1 * r[1] + (1 - b1) * gs
                r[2] = b2 * r[2] + (1 - b2) * gs * gs
                mhat = r[1] / (1 - b1 ** r[3])
                vhat = r[2] / (1 - b2 ** r[3])
                r[0] -= lr * mhat / (np.sqrt(vhat) + eps)
        keys = np.array(sorted(ref), np.uint64)
        _rel_close(t.pull(keys), np.stack([ref[k][0] for k in sorted(ref)]))


def test_sgd_learning_rate_changes_and_persists(store_path: Path) -> None:
    with embank.open(store_path) as s:
        t = s.create_table("e", 2, optimizer=embank.optim.SGD(lr=1.0))
        t.push_grad([1], np.ones((1, 2), np.float32))
        t.set_lr(0.25)
        t.push_grad([1], np.ones((1, 2), np.float32))
        np.testing.assert_array_equal(t.pull([1]), [[-1.25, -1.25]])
    with embank.open(store_path) as s:
        assert s.table("e").optimizer == {"kind": "sgd", "lr": 0.25}


def test_optimizer_errors(store_path: Path) -> None:
    with pytest.raises(ConfigError, match="lr must be > 0"):
        embank.optim.Adagrad(lr=0)
    with pytest.raises(ConfigError, match="betas"):
        embank.optim.Adam(lr=0.1, betas=(1.0, 0.9))
    with embank.open(store_path) as s:
        plain = s.create_table("plain", 2)
        assert plain.optimizer is None
        with pytest.raises(ConfigError, match="no optimizer"):
            plain.push_grad([1], np.ones((1, 2), np.float32))
        t = s.create_table("t", 2, optimizer=embank.optim.SGD(lr=0.1))
        with pytest.raises(InvalidInputError, match="non-finite"):
            t.push_grad([1, 2], np.array([[0, 0], [np.inf, 0]], np.float32))
        assert len(t) == 0, "nothing was written"
        with pytest.raises(InvalidInputError):
            t.push_grad([1], np.ones((1, 3), np.float32))


def _reference_step(kind: str, hp: dict[str, float], r: list[Any], gs: Arr) -> None:
    """One update of a row's reference state ``r`` (f64) by its summed gradient ``gs``."""
    if kind == "rowwise_adagrad":
        r[1] += float(np.mean(gs * gs))
        r[0] -= hp["lr"] * gs / (np.sqrt(r[1]) + hp["eps"])
    elif kind == "adamw":
        lr, b1, b2, eps = hp["lr"], hp["b1"], hp["b2"], hp["eps"]
        r[0] *= 1 - lr * hp["weight_decay"]
        r[3] += 1
        r[1] = b1 * r[1] + (1 - b1) * gs
        r[2] = b2 * r[2] + (1 - b2) * gs * gs
        r[0] -= lr * (r[1] / (1 - b1 ** r[3])) / (np.sqrt(r[2] / (1 - b2 ** r[3])) + eps)
    else:  # ftrl
        lr, beta, l1, l2 = hp["lr"], hp["beta"], hp["l1"], hp["l2"]
        z, n = r[1], r[2]
        sigma = (np.sqrt(n + gs * gs) - np.sqrt(n)) / lr
        z += gs - sigma * r[0]
        n += gs * gs
        r[0] = np.where(np.abs(z) <= l1, 0.0, -(z - np.sign(z) * l1) / ((beta + np.sqrt(n)) / lr + l2))


NEW_OPTIMIZERS: dict[str, tuple[embank.optim.Optimizer, dict[str, float]]] = {
    "rowwise_adagrad": (
        embank.optim.RowWiseAdagrad(lr=0.05, eps=1e-8, initial_accumulator_value=0.1),
        {"lr": 0.05, "eps": 1e-8, "acc0": 0.1},
    ),
    "adamw": (
        embank.optim.AdamW(lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1),
        {"lr": 0.01, "b1": 0.9, "b2": 0.99, "eps": 1e-8, "weight_decay": 0.1},
    ),
    "ftrl": (
        embank.optim.Ftrl(lr=0.1, beta=1.0, l1=0.05, l2=0.01, initial_accumulator_value=0.1),
        {"lr": 0.1, "beta": 1.0, "l1": 0.05, "l2": 0.01, "acc0": 0.1},
    ),
}


def _fresh_state(kind: str, hp: dict[str, float]) -> list[Any]:
    w = np.full(DIM, 0.5)
    if kind == "rowwise_adagrad":
        return [w, hp["acc0"]]
    if kind == "adamw":
        return [w, np.zeros(DIM), np.zeros(DIM), 0]
    return [w, np.zeros(DIM), np.full(DIM, hp["acc0"])]


@pytest.mark.parametrize("kind", sorted(NEW_OPTIMIZERS))
def test_new_optimizers_match_a_reference_embedded_and_remote(store: embank.Store, kind: str) -> None:
    # 100 steps, duplicate ids in every batch (summed first, as FBGEMM's exact optimizers do).
    opt, hp = NEW_OPTIMIZERS[kind]
    t = store.create_table(f"new_{kind}", DIM, init=embank.init.constant(0.5), optimizer=opt)
    try:
        assert t.optimizer is not None and t.optimizer["kind"] == kind
        ref: dict[int, list[Any]] = {}
        for k, g in _stream(7, steps=100, keys=40, batch=32):
            t.push_grad(k, g)
            uniq, sums = _summed(k, g)
            for key, gs in zip(uniq.tolist(), sums):
                _reference_step(kind, hp, ref.setdefault(key, _fresh_state(kind, hp)), gs)
        keys = np.array(sorted(ref), np.uint64)
        _rel_close(t.pull(keys), np.stack([ref[k][0] for k in sorted(ref)]))
        if kind == "ftrl":  # a small gradient on a new row: |z| <= l1 gives an exact zero
            t.push_grad([10_000], np.full((1, DIM), 0.01, np.float32))
            np.testing.assert_array_equal(t.pull([10_000]), np.zeros((1, DIM), np.float32))
    finally:
        store.drop_table(f"new_{kind}")


@pytest.mark.parametrize("medium", ["mmap", "block"])
def test_rowwise_adagrad_state_is_one_float_a_row_and_persists(store_path: Path, medium: str) -> None:
    opt, hp = NEW_OPTIMIZERS["rowwise_adagrad"]
    ref: dict[int, list[Any]] = {}
    with embank.open(store_path, cache_bytes=16 << 10) as s:
        t = s.create_table("e", DIM, init=embank.init.constant(0.5), medium=medium, optimizer=opt)
        for k, g in _stream(3):
            t.push_grad(k, g)
            uniq, sums = _summed(k, g)
            for key, gs in zip(uniq.tolist(), sums):
                r = ref.setdefault(key, _fresh_state("rowwise_adagrad", hp))
                _reference_step("rowwise_adagrad", hp, r, gs)
    with embank.open(store_path) as s:
        t = s.table("e")
        keys = np.array(sorted(ref), np.uint64)
        g = np.ones((len(keys), DIM), np.float32)
        t.push_grad(keys, g)
        for key in ref:
            _reference_step("rowwise_adagrad", hp, ref[key], np.ones(DIM))
        _rel_close(t.pull(keys), np.stack([ref[k][0] for k in sorted(ref)]))


def test_new_optimizer_errors() -> None:
    with pytest.raises(ConfigError, match="rowwise_adagrad optimizer: eps"):
        embank.optim.RowWiseAdagrad(lr=0.1, eps=-1)
    with pytest.raises(ConfigError, match="weight_decay"):
        embank.optim.AdamW(lr=0.1, weight_decay=20.0)
    with pytest.raises(ConfigError, match="divides by 0"):
        embank.optim.Ftrl(lr=0.1, beta=0.0, initial_accumulator_value=0.0)
