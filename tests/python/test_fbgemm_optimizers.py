"""FBGEMM's Adam, PARTIAL_ROWWISE_ADAM, LAMB and PARTIAL_ROWWISE_LAMB (``embank.optim.
FbgemmAdam``, ``PartialRowWiseAdam``, ``Lamb``, ``PartialRowWiseLamb``) step for step
against a written reference of FBGEMM's update rules (``fbgemm_gpu/codegen/genscript/
optimizers.py``: FBGEMM has no CPU kernel of any of the four, ``SplitTableBatchedEmbedding
BagsCodegen`` asserts "not supported in CPU mode"), with the table's step t: one for every
row of a step, advancing in steps a row (or a whole table) skips. Then the step through a
checkpoint and a restore, through the torch layer, and TorchRec's specs mapped."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import embank
import numpy as np
import numpy.typing as npt
import pytest

DIM, KEYS, STEPS = 8, 12, 25
PARAMS = {"lr": 0.03, "beta1": 0.8, "beta2": 0.99, "eps": 1e-6, "weight_decay": 0.02}
KINDS = {
    "fbgemm_adam": embank.optim.FbgemmAdam,
    "partial_rowwise_adam": embank.optim.PartialRowWiseAdam,
    "lamb": embank.optim.Lamb,
    "partial_rowwise_lamb": embank.optim.PartialRowWiseLamb,
}


def optimizer(kind: str) -> embank.optim.Optimizer:
    p = PARAMS
    made: embank.optim.Optimizer = KINDS[kind](
        p["lr"], (p["beta1"], p["beta2"]), eps=p["eps"], weight_decay=p["weight_decay"]
    )
    return made


class Reference:
    """FBGEMM's rule in float64 for a table of rows ``w``: m per element; v per element,
    or one per row (the partial row-wise kinds: the mean of g^2); bias correction with the
    table's step t; decoupled weight decay; LAMB's per-row trust ratio ``||w|| / ||r||``."""

    def __init__(self, kind: str, w: npt.NDArray[np.float32]) -> None:
        self.kind = kind
        self.w = w.astype(np.float64)
        self.m = np.zeros_like(self.w)
        self.v = np.zeros((len(w), 1 if kind.startswith("partial") else DIM))

    def step(self, t: int, keys: npt.NDArray[np.uint64], grads: npt.NDArray[np.float32]) -> None:
        p = PARAMS
        lr, b1, b2, eps, wd = p["lr"], p["beta1"], p["beta2"], p["eps"], p["weight_decay"]
        summed: dict[int, npt.NDArray[np.float64]] = {}
        for k, g in zip(keys.tolist(), grads.astype(np.float64)):
            summed[k] = summed[k] + g if k in summed else g
        for k, g in summed.items():
            w, m, v = self.w[k], self.m[k], self.v[k]
            m[:] = b1 * m + (1 - b1) * g
            v[:] = b2 * v + (1 - b2) * (np.mean(g * g) if len(v) == 1 else g * g)
            r = m / (1 - b1**t) / (np.sqrt(v / (1 - b2**t)) + eps) + wd * w
            if "lamb" in self.kind:
                w -= lr * (np.linalg.norm(w) / np.linalg.norm(r)) * r
            else:
                w -= lr * r


def schedule(seed: int = 7) -> list[npt.NDArray[np.uint64]]:
    """Each step's ids: repeats within and across steps; keys 10 and 11 first at step 9;
    every 6th step no id at all (the table's step still advances)."""
    rng = np.random.default_rng(seed)
    out = []
    for t in range(1, STEPS + 1):
        high = KEYS if t >= 9 else KEYS - 2
        n = 0 if t % 6 == 0 else 7
        out.append(rng.integers(0, high, size=n).astype(np.uint64))
    return out


def start_rows() -> npt.NDArray[np.float32]:
    return np.random.default_rng(3).uniform(-0.5, 0.5, (KEYS, DIM)).astype(np.float32)


def matches_fbgemms_rule(store: Any, kind: str) -> float:
    """25 steps of FBGEMM's rule through ``store``'s table ``t``, every row checked after
    each; returns the largest difference."""
    rng = np.random.default_rng(11)
    ref = Reference(kind, start_rows())
    worst = 0.0
    table = store.create_table("t", dim=DIM, optimizer=optimizer(kind))
    table.push(np.arange(KEYS, dtype=np.uint64), start_rows())
    for t, keys in enumerate(schedule(), start=1):
        grads = rng.standard_normal((len(keys), DIM)).astype(np.float32)
        ref.step(t, keys, grads)
        # Two ranks, each pushing the keys it owns (key modulo 2), both as step t.
        for rank in (0, 1):
            own = keys % np.uint64(2) == np.uint64(rank)
            if own.any():
                table.push_grad(keys[own], np.ascontiguousarray(grads[own]), step=t)
        got = table.pull(np.arange(KEYS, dtype=np.uint64))
        diff = float(np.abs(got - ref.w).max())
        worst = max(worst, diff)
        assert diff < 1e-5, f"{kind}: step {t}: rows differ by {diff}"
    assert table.optimizer_step == STEPS
    return worst


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_kind_matches_fbgemms_rule_for_25_steps_pushed_by_two_ranks(tmp_path: Path, kind: str) -> None:
    with embank.open(tmp_path / "s") as store:
        worst = matches_fbgemms_rule(store, kind)
    print(f"{kind}: max abs diff over {STEPS} steps {worst:.2e}")


def test_a_restore_continues_with_the_checkpoints_step(tmp_path: Path) -> None:
    """Checkpoint at step 10, train on, restore: the table's step is 10 again, and 15 more
    steps pushed without a step (each call a step) give the uninterrupted run's rows."""
    rng = np.random.default_rng(5)
    ids = schedule(9)
    grads = [rng.standard_normal((len(k), DIM)).astype(np.float32) for k in ids]
    runs = []
    for name, interrupt in (("a", False), ("b", True)):
        with embank.open(tmp_path / name) as store:
            table = store.create_table("t", dim=DIM, optimizer=optimizer("lamb"))
            table.push(np.arange(KEYS, dtype=np.uint64), start_rows())
            for t in range(1, 11):
                table.push_grad(ids[t - 1], grads[t - 1], step=t)
            store.checkpoint(10)
            if interrupt:
                for t in range(11, 15):
                    table.push_grad(ids[t], grads[t] * 3, step=t)
                assert table.optimizer_step == 14
                store.restore(10)
                table = store.table("t")
                assert table.optimizer_step == 10
        with embank.open(tmp_path / name) as store:  # and through a close and reopen
            table = store.table("t")
            assert table.optimizer_step == 10
            for t in range(11, STEPS + 1):
                table.push_grad(ids[t - 1], grads[t - 1])
            assert table.optimizer_step == STEPS
            runs.append(table.pull(np.arange(KEYS, dtype=np.uint64)))
    np.testing.assert_array_equal(runs[0], runs[1])


def test_the_torch_layer_numbers_its_steps_and_tables_a_step_skips_keep_up(tmp_path: Path) -> None:
    """A fused collection of two tables; in some steps table b has no ids. Its rows
    are bias-corrected with the collection's step count when next trained, as FBGEMM's
    TBE does (its ``iter`` advances every training forward), pushed at the backward
    (FBGEMM's fused backward) or by SparseOptimizer.step."""
    torch = pytest.importorskip("torch")
    et = pytest.importorskip("embank.torch")
    rng = np.random.default_rng(2)
    batches = []
    for t in range(1, 16):
        a = rng.integers(0, KEYS, size=4)
        b = rng.integers(0, KEYS, size=0 if t % 3 else 3)  # table b: only every 3rd step
        batches.append((a, b, rng.standard_normal((2, 2 * DIM)).astype(np.float32)))
    for push in ("backward", "step"):
        refs = {n: Reference("partial_rowwise_adam", start_rows()) for n in ("a", "b")}
        with embank.open(tmp_path / push) as store:
            tables = {
                n: store.create_table(n, dim=DIM, optimizer=optimizer("partial_rowwise_adam")) for n in "ab"
            }
            for table in tables.values():
                table.push(np.arange(KEYS, dtype=np.uint64), start_rows())
            ebc = et.EmbeddingBagCollection({"fa": tables["a"], "fb": tables["b"]}, push=push)
            sparse = et.SparseOptimizer(ebc) if push == "step" else None
            for t, (a, b, coef) in enumerate(batches, start=1):
                # Two bags per feature: the first id alone, the rest together.
                bags = {
                    n: (torch.from_numpy(ids.astype(np.int64)), torch.tensor([0, min(1, len(ids))]))
                    for n, ids in (("fa", a), ("fb", b))
                }
                out = ebc(bags)
                (torch.cat([out["fa"], out["fb"]], 1) * torch.from_numpy(coef)).sum().backward()
                if sparse is not None:
                    sparse.step()
                for n, ids, c in (("a", a, coef[:, :DIM]), ("b", b, coef[:, DIM:])):
                    g = np.stack([c[0] if i == 0 else c[1] for i in range(len(ids))]) if len(ids) else c[:0]
                    refs[n].step(t, ids.astype(np.uint64), g)
            for n, table in tables.items():
                got = table.pull(np.arange(KEYS, dtype=np.uint64))
                diff = float(np.abs(got - refs[n].w).max())
                assert diff < 1e-5, f"push={push}, table {n}: rows differ by {diff}"
            assert tables["a"].optimizer_step == 15 and tables["b"].optimizer_step == 15


def test_torchrec_specs_map_to_the_table_step_kinds() -> None:
    et = pytest.importorskip("embank.torch")
    spec, o = et.optimizer_from_spec, embank.optim
    fused = {"learning_rate": 0.02, "beta1": 0.8, "beta2": 0.99, "weight_decay": 0.01}
    assert spec({"optimizer": "adam", **fused}) == o.FbgemmAdam(0.02, (0.8, 0.99), weight_decay=0.01)
    assert spec(("partial_row_wise_adam", {"lr": 0.1})) == o.PartialRowWiseAdam(0.1, eps=1e-8)
    assert spec(("lamb", {"lr": 0.1, "eps": 1e-6})) == o.Lamb(0.1, eps=1e-6)
    assert spec(("PARTIAL_ROWWISE_LAMB", {"lr": 0.1, "betas": (0.5, 0.6)})) == o.PartialRowWiseLamb(
        0.1, (0.5, 0.6)
    )
    assert spec({"optimizer": "lamb", "lr": 0.1, "weight_decay_mode": "DECOUPLE"}) == o.Lamb(0.1)
    with pytest.raises(embank.errors.ConfigError, match="weight_decay_mode"):
        spec({"optimizer": "adam", "lr": 0.1, "weight_decay_mode": "COUNTER"})
    with pytest.raises(embank.errors.ConfigError, match="momentum"):
        spec({"optimizer": "lamb", "lr": 0.1, "momentum": 0.9})
    with pytest.raises(embank.errors.ConfigError, match="betas"):
        o.Lamb(0.1, (1.0, 0.9))
    for kind, cls in KINDS.items():
        assert f'"kind": "{kind}"' in cls(0.1)._json()


def test_fbgemms_enum_maps_and_fbgemm_has_no_cpu_kernel_of_them() -> None:
    """EmbOptimType's four map; FBGEMM's own CPU module refuses them (why the reference
    above is written out rather than FBGEMM run)."""
    et = pytest.importorskip("embank.torch")
    configs = pytest.importorskip("fbgemm_gpu.split_embedding_configs")
    training = pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_training")
    common = pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_common")
    E = configs.EmbOptimType
    spec = et.optimizer_from_spec
    want: dict[Any, type] = {
        E.ADAM: embank.optim.FbgemmAdam,
        E.PARTIAL_ROWWISE_ADAM: embank.optim.PartialRowWiseAdam,
        E.LAMB: embank.optim.Lamb,
        E.PARTIAL_ROWWISE_LAMB: embank.optim.PartialRowWiseLamb,
    }
    for enum, cls in want.items():
        assert spec(
            {"optimizer": enum, "learning_rate": 0.1, "weight_decay_mode": training.WeightDecayMode.NONE}
        ) == cls(0.1)
        with pytest.raises(AssertionError, match="not supported in CPU mode"):
            training.SplitTableBatchedEmbeddingBagsCodegen(
                [(10, 4, common.EmbeddingLocation.HOST, training.ComputeDevice.CPU)], optimizer=enum
            )


@pytest.mark.parametrize("kind", list(KINDS))
def test_served_tables_carry_the_step_to_every_shard(cluster: list[str], kind: str) -> None:
    """The same 25 steps through two `embank serve` shards (PUSH_GRAD_AT carries the step
    in every shard's part; a shard no id of a step reached catches up at its next push):
    the rows equal FBGEMM's rule, and the table's step is the newest of its shards'."""
    store = embank.connect(cluster)
    try:
        if "t" in store:
            store.drop_table("t")
        matches_fbgemms_rule(store, kind)
        store.drop_table("t")
    finally:
        store.close()
