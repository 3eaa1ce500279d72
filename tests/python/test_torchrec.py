"""embank as a drop-in for TorchRec's EmbeddingBagCollection: step-for-step parity of
row-wise Adagrad with FBGEMM's own CPU kernel, TorchRec-layout state dicts in and out
(weights and row-wise momentum), a DCP round trip, and the look-alikes that work without
TorchRec. The TorchRec comparisons skip cleanly when torchrec or fbgemm-gpu-cpu is absent
(``requirements-torchrec.txt``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import embank
import numpy as np
import pytest

torch = pytest.importorskip("torch")
et = pytest.importorskip("embank.torch")

pytestmark = pytest.mark.torch

LR, EPS = 0.05, 1e-8
# A small vocabulary and bags of up to 5 ids: every batch repeats ids within a bag and
# across bags and features (t1 serves two features).
SIZES = {"t0": 40, "t1": 25}


def torchrec_or_skip() -> Any:
    pytest.importorskip("fbgemm_gpu")
    return pytest.importorskip("torchrec")


def configs(torchrec: Any) -> list[Any]:
    return [
        torchrec.EmbeddingBagConfig(
            name="t0", embedding_dim=8, num_embeddings=SIZES["t0"], feature_names=["f0"]
        ),
        torchrec.EmbeddingBagConfig(
            name="t1", embedding_dim=4, num_embeddings=SIZES["t1"], feature_names=["f1", "f2"]
        ),
    ]


def fused(torchrec: Any) -> Any:
    """TorchRec's collection with FBGEMM's fused exact row-wise Adagrad on the CPU."""
    modules = pytest.importorskip("torchrec.modules.fused_embedding_modules")
    torch.manual_seed(0)
    return modules.FusedEmbeddingBagCollection(
        tables=configs(torchrec),
        optimizer_type=torchrec.optim.RowWiseAdagrad,
        optimizer_kwargs={"lr": LR, "eps": EPS},
        device=torch.device("cpu"),
    )


def batches(torchrec: Any, steps: int, seed: int = 1) -> list[tuple[Any, Any]]:
    """``steps`` random (KeyedJaggedTensor, target) pairs, batch 6, bags of 0 to 5 ids."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        lengths = rng.integers(0, 6, size=18)  # 3 features x 6 examples
        vocab = np.repeat([SIZES["t0"], SIZES["t1"], SIZES["t1"]], 6)
        values = np.concatenate([rng.integers(0, v, size=n) for v, n in zip(vocab, lengths)])
        kjt = torchrec.KeyedJaggedTensor.from_lengths_sync(
            keys=["f0", "f1", "f2"], values=torch.from_numpy(values), lengths=torch.from_numpy(lengths)
        )
        out.append((kjt, torch.from_numpy(rng.standard_normal((6, 16)).astype(np.float32))))
    return out


def step(ebc: Any, kjt: Any, target: Any) -> None:
    """One training step of a squared loss on the pooled output (both fused: backward updates)."""
    values = ebc(kjt).values()
    ((values - target) ** 2).sum().backward()


def fbgemm_state(febc: Any) -> dict[str, Any]:
    """The fused collection's weights and row-wise momentum, in the flat export layout."""
    out = {k: v.detach().clone() for k, v in febc.state_dict().items()}
    for param, entries in febc.fused_optimizer().state_dict()["state"].items():
        for name, m in entries.items():
            out[f"embedding_bags.{param}.momentum1"] = m.detach().clone()
            assert name == f"{param}.momentum_1"
    return out


def assert_rows_close(got: Any, want: Any, what: str, rtol: float = 1e-6) -> None:
    """Row by row: the largest difference within ``rtol`` of the row's largest value."""
    got, want = got.reshape(len(got), -1), want.reshape(len(want), -1)
    scale = want.abs().amax(dim=1).clamp_min(1e-30)
    rel = (got - want).abs().amax(dim=1) / scale
    worst = int(rel.argmax())
    assert float(rel[worst]) <= rtol, (
        f"{what}: row {worst} differs by {float(rel[worst]):.3g} relative (> {rtol}): "
        f"embank {got[worst].tolist()} vs TorchRec {want[worst].tolist()}"
    )


def assert_state_close(store_or_ebc: Any, want: dict[str, Any], what: str) -> None:
    got = et.export_state_dict(store_or_ebc, num_embeddings=SIZES, optimizer_state=True, chunk_rows=7)
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    for key in want:
        assert_rows_close(got[key], want[key], f"{what}: {key}")


def test_rowwise_adagrad_matches_fbgemm_step_for_step(tmp_path: Path) -> None:
    """100 steps of batches with repeated ids: every row and every row-wise accumulator
    within 1e-6 relative of FBGEMM's CPU kernel (EXACT_ROWWISE_ADAGRAD), checked every
    10 steps."""
    torchrec = torchrec_or_skip()
    EmbOptimType = pytest.importorskip("fbgemm_gpu.split_embedding_configs").EmbOptimType

    reference = fused(torchrec)
    with embank.open(tmp_path / "s") as store:
        ebc = et.EmbeddingBagCollection.from_configs(
            store, configs(torchrec), optimizer=(EmbOptimType.EXACT_ROWWISE_ADAGRAD, {"lr": LR, "eps": EPS})
        )
        et.load_state_dict(store, reference.state_dict())  # the same starting rows
        for i, (kjt, target) in enumerate(batches(torchrec, 100)):
            step(reference, kjt, target)
            step(ebc, kjt, target)
            if (i + 1) % 10 == 0:
                assert_state_close(ebc, fbgemm_state(reference), f"after step {i + 1}")


def test_output_is_torchrecs_keyed_tensor(tmp_path: Path) -> None:
    torchrec = torchrec_or_skip()
    reference = fused(torchrec)
    with embank.open(tmp_path / "s") as store:
        ebc = et.EmbeddingBagCollection.from_configs(
            store, configs(torchrec), optimizer={"optimizer": "exact_rowwise_adagrad", "learning_rate": LR}
        )
        et.load_state_dict(store, reference.state_dict())
        kjt, _ = batches(torchrec, 1)[0]
        got, want = ebc(kjt), reference(kjt)
        assert isinstance(got, torchrec.KeyedTensor)
        assert got.keys() == want.keys() == ["f0", "f1", "f2"]
        assert got.length_per_key() == want.length_per_key() == [8, 4, 4]
        torch.testing.assert_close(got.values(), want.values(), rtol=1e-6, atol=1e-7)
        assert [c.name for c in ebc.embedding_bag_configs()] == ["t0", "t1"]


def test_trained_in_torchrec_then_embank_then_torchrec_equals_torchrec_throughout(tmp_path: Path) -> None:
    """30 steps in TorchRec, the state (weights and momentum) loaded into embank, 30 steps
    there, exported back into a fresh TorchRec collection, 30 more steps: after each leg
    equal to TorchRec having trained all along."""
    torchrec = torchrec_or_skip()
    data = batches(torchrec, 90, seed=5)
    reference = fused(torchrec)
    leg = fused(torchrec)
    for kjt, target in data[:30]:
        step(reference, kjt, target)
        step(leg, kjt, target)
    with embank.open(tmp_path / "s") as store:
        ebc = et.EmbeddingBagCollection.from_configs(
            store, configs(torchrec), optimizer=("exact_rowwise_adagrad", {"lr": LR, "eps": EPS})
        )
        loaded = et.load_state_dict(
            store, leg.state_dict(), optimizer_state_dict=leg.fused_optimizer().state_dict(), chunk_rows=9
        )
        assert loaded == ["t0", "t1"]
        assert_state_close(ebc, fbgemm_state(reference), "loaded into embank")
        for kjt, target in data[30:60]:
            step(reference, kjt, target)
            step(ebc, kjt, target)
        assert_state_close(ebc, fbgemm_state(reference), "trained in embank")
        exported = et.export_state_dict(ebc, optimizer_state=True)
    back = fused(torchrec)
    back.load_state_dict({k: v for k, v in exported.items() if not k.endswith("momentum1")})
    for param, entries in back.fused_optimizer().state_dict()["state"].items():
        for m in entries.values():  # views of FBGEMM's own accumulators
            m.copy_(exported[f"embedding_bags.{param}.momentum1"])
    assert_rows_close(fbgemm_state(back)["embedding_bags.t0.weight.momentum1"], exported[
        "embedding_bags.t0.weight.momentum1"], "momentum written into FBGEMM")  # fmt: skip
    for kjt, target in data[60:]:
        step(reference, kjt, target)
        step(back, kjt, target)
    want, got = fbgemm_state(reference), fbgemm_state(back)
    for key in want:
        assert_rows_close(got[key], want[key], f"back in TorchRec: {key}")


def test_distributed_checkpoint_round_trip_without_a_process_group(tmp_path: Path) -> None:
    """The exported state dict saved with torch.distributed.checkpoint in one process (no
    process group), loaded into preallocated tensors, loaded into a fresh store."""
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    cfgs = [et.EmbeddingBagConfig(num_embeddings=50, embedding_dim=4, name="t", feature_names=["f"])]
    opt = embank.optim.RowWiseAdagrad(lr=0.1)
    with embank.open(tmp_path / "a") as store:
        ebc = et.EmbeddingBagCollection.from_configs(store, cfgs, optimizer=opt)
        for i in range(5):
            ids = torch.tensor([i, i + 1, i + 1, 40])
            ebc({"f": (ids, torch.tensor([0, 2]))}).values().sum().backward()
        # Exported into file-backed tensors (how a table larger than DRAM leaves:
        # its pages go to the file), which DCP then reads like any tensor.
        files = {
            "embedding_bags.t.weight": (50, 4),
            "embedding_bags.t.weight.momentum1": (50,),
        }
        out = {
            k: torch.from_file(str(tmp_path / k), shared=True, size=int(np.prod(shape))).view(shape)
            for k, shape in files.items()
        }
        saved = et.export_state_dict(ebc, optimizer_state=True, out=out)
        assert all(saved[k] is out[k] for k in out)
    assert sorted(saved) == ["embedding_bags.t.weight", "embedding_bags.t.weight.momentum1"]
    assert int((saved["embedding_bags.t.weight.momentum1"] > 0).sum()) == 7  # keys 0..5 and 40
    dcp.save(saved, checkpoint_id=str(tmp_path / "dcp"))
    into = {k: torch.zeros_like(v) for k, v in saved.items()}
    dcp.load(into, checkpoint_id=str(tmp_path / "dcp"))
    with embank.open(tmp_path / "b") as store:
        ebc = et.EmbeddingBagCollection.from_configs(store, cfgs, optimizer=opt)
        et.load_state_dict(ebc, into)
        again = et.export_state_dict(ebc, optimizer_state=True)
    for k in saved:
        torch.testing.assert_close(again[k], saved[k], rtol=0, atol=0)


def test_chunks_stream_and_load(tmp_path: Path) -> None:
    """state_dict_chunks yields at most chunk_rows rows at a time, in order; loading the
    chunks into another store reproduces the table; a key never written exports as the
    initializer's row (what a pull would give), its accumulator as 0."""
    cfgs = [et.EmbeddingBagConfig(num_embeddings=23, embedding_dim=3, name="t", feature_names=["f"])]
    with embank.open(tmp_path / "a") as a, embank.open(tmp_path / "b") as b:
        ebc = et.EmbeddingBagCollection.from_configs(a, cfgs, optimizer=("sgd", {"lr": 0.5}))
        ebc({"f": (torch.tensor([3, 4]), torch.tensor([0]))}).values().sum().backward()
        chunks = list(et.state_dict_chunks(ebc, chunk_rows=5))
        assert [(k, s, len(r)) for k, s, r in chunks] == [
            ("embedding_bags.t.weight", s, min(5, 23 - s)) for s in range(0, 23, 5)
        ]
        table = a.table("t")
        whole = torch.cat([r for _, _, r in chunks])
        fresh = torch.from_numpy(table.pull(np.arange(23, dtype=np.uint64)))  # creates the rest
        torch.testing.assert_close(whole, fresh, rtol=0, atol=0)
        assert len(table) == 23
        low, high = cfgs[0].get_weight_init_min(), cfgs[0].get_weight_init_max()
        assert float(whole.min()) >= low - 0.5 and float(whole.max()) <= high
        et.EmbeddingBagCollection.from_configs(b, cfgs, optimizer=("sgd", {"lr": 0.5}))
        assert et.load_state_dict(b, iter(chunks)) == ["t"]
        torch.testing.assert_close(
            torch.from_numpy(b.table("t").pull(np.arange(23, dtype=np.uint64))), whole, rtol=0, atol=0
        )


def test_state_dict_through_two_served_shards(cluster: list[str], tmp_path: Path) -> None:
    """TorchRec's state dict loaded into tables on two `embank serve` shards (rows spread
    over both), streamed back in chunks equal to it, trained there and loaded into a
    plain TorchRec collection with strict=True: its outputs are the served collection's.
    Optimizer state crosses the wire too: the served tables' weights and momentum1 after
    training equal an embedded twin's trained alike, and a momentum1 loaded into them is
    what an export gives back."""
    torchrec = torchrec_or_skip()
    torch.manual_seed(3)
    reference = torchrec.EmbeddingBagCollection(tables=configs(torchrec))
    given = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    store = embank.connect(cluster)
    try:
        for name in SIZES:
            if name in store:
                store.drop_table(name)
        ebc = et.EmbeddingBagCollection.from_configs(
            store, configs(torchrec), optimizer=("exact_rowwise_adagrad", {"lr": LR, "eps": EPS})
        )
        assert et.load_state_dict(store, given, chunk_rows=7) == ["t0", "t1"]
        for i, addr in enumerate(cluster):  # each shard holds a part of each table
            with embank.connect([addr]) as shard:
                held = {n: len(shard.table(n)) for n in SIZES}
                assert all(0 < held[n] < SIZES[n] for n in SIZES), f"shard {i} holds {held} of {SIZES}"
        chunks = list(et.state_dict_chunks(ebc, chunk_rows=16))
        want = [
            (f"embedding_bags.{n}.weight", s, min(16, SIZES[n] - s))
            for n in SIZES
            for s in range(0, SIZES[n], 16)
        ]
        assert [(k, s, len(r)) for k, s, r in chunks] == want
        exported = et.export_state_dict(ebc, chunk_rows=16)
        assert sorted(exported) == sorted(given)
        for key in given:
            torch.testing.assert_close(exported[key], given[key], rtol=0, atol=0, msg=key)

        data = batches(torchrec, 10, seed=9)
        with embank.open(tmp_path / "twin") as twin_store:
            twin = et.EmbeddingBagCollection.from_configs(
                twin_store, configs(torchrec), optimizer=("exact_rowwise_adagrad", {"lr": LR, "eps": EPS})
            )
            et.load_state_dict(twin_store, given)
            for kjt, target in data:
                step(ebc, kjt, target)  # trained on the shards
                step(twin, kjt, target)  # and embedded
            served_state = et.export_state_dict(ebc, optimizer_state=True, chunk_rows=16)
            twin_state = et.export_state_dict(twin, optimizer_state=True, chunk_rows=16)
        assert sorted(served_state) == sorted(twin_state)
        assert any(k.endswith("momentum1") for k in served_state)
        for key in twin_state:
            torch.testing.assert_close(served_state[key], twin_state[key], rtol=1e-6, atol=1e-7, msg=key)
        trained = et.export_state_dict(ebc, chunk_rows=16)
        torch.manual_seed(4)
        plain = torchrec.EmbeddingBagCollection(tables=configs(torchrec))
        plain.load_state_dict(trained, strict=True)
        ebc.eval()
        with torch.no_grad():
            for kjt, _ in data:
                torch.testing.assert_close(plain(kjt).values(), ebc(kjt).values(), rtol=1e-6, atol=1e-7)

        momentum = {"embedding_bags.t1.weight.momentum1": torch.full((SIZES["t1"],), 0.25)}
        et.load_state_dict(store, {**given, **momentum})
        again = et.export_state_dict(ebc, optimizer_state=True, chunk_rows=16)
        key = "embedding_bags.t1.weight.momentum1"
        torch.testing.assert_close(again[key], momentum[key], rtol=0, atol=0)
        for key in given:
            torch.testing.assert_close(again[key], given[key], rtol=0, atol=0, msg=key)
    finally:
        for name in SIZES:
            if name in store:
                store.drop_table(name)
        store.close()


def test_push_with_state_round_trips_and_refuses_bad_state(tmp_path: Path) -> None:
    with embank.open(tmp_path / "s") as store:
        t = store.create_table("t", dim=2, optimizer=embank.optim.RowWiseAdagrad(lr=0.1))
        assert t.state_len == 1
        records = np.array([[1.0, 2.0, 0.5], [3.0, 4.0, 0.0]], np.float32)
        t.push_with_state([7, 9], records)
        got, found = t.lookup_with_state([7, 9, 11])
        np.testing.assert_array_equal(got[:2], records)
        np.testing.assert_array_equal(found, [True, True, False])
        np.testing.assert_array_equal(got[2], [0.0, 0.0, 0.0])
        t.push_grad([7], np.array([[1.0, 1.0]], np.float32))  # the loaded accumulator is used
        step = 0.1 / (np.sqrt(0.5 + 1.0) + 1e-8)  # s = 0.5 + mean([1, 1]^2)
        np.testing.assert_allclose(t.pull([7])[0], [1 - step, 2 - step], rtol=1e-6)
        with pytest.raises(embank.errors.InvalidInputError, match="accumulator"):
            t.push_with_state([8], np.array([[1.0, 1.0, -1.0]], np.float32))
        with pytest.raises(embank.errors.InvalidInputError, match="non-finite"):
            t.push_with_state([8], np.array([[np.nan, 1.0, 1.0]], np.float32))
        assert t.lookup_with_state([8])[1].tolist() == [False]


def test_optimizer_specs() -> None:
    spec = et.optimizer_from_spec
    o = embank.optim
    assert spec(("exact_rowwise_adagrad", {"lr": 0.02, "eps": 1e-6})) == o.RowWiseAdagrad(0.02, eps=1e-6)
    assert spec({"optimizer": "EXACT_ROW_WISE_ADAGRAD", "learning_rate": 0.02}) == o.RowWiseAdagrad(0.02)
    assert spec(("adagrad", {"lr": 0.1})) == o.Adagrad(0.1, eps=1e-8)  # FBGEMM's default eps
    assert spec(("exact_sgd", {"learning_rate": 0.1})) == o.SGD(0.1)
    assert spec(("adamw", {"lr": 0.1, "weight_decay": 0.1})) == o.AdamW(0.1, weight_decay=0.1)
    assert spec(("ftrl", {"lr": 0.1, "l1": 0.5})) == o.Ftrl(0.1, l1=0.5)
    assert spec({"optimizer": "sgd", "lr": 0.1, "stochastic_rounding": True, "weight_decay": 0.0}) == o.SGD(
        0.1
    )
    assert spec((torch.optim.Adagrad, {"lr": 0.3})) == o.Adagrad(0.3, eps=1e-8)
    assert spec((torch.optim.Adagrad, {"lr": 0.3, "eps": 1e-10})) == o.Adagrad(0.3, eps=1e-10)
    same = o.Ftrl(0.1)
    assert spec(same) is same
    with pytest.raises(embank.errors.ConfigError, match="weight_decay"):
        spec(("exact_rowwise_adagrad", {"lr": 0.1, "weight_decay": 0.01}))
    with pytest.raises(embank.errors.ConfigError, match="not supported"):
        spec(("lars_sgd", {"lr": 0.1}))
    with pytest.raises(embank.errors.ConfigError, match="learning rate"):
        spec({"optimizer": "sgd"})


def test_optimizer_specs_take_fbgemms_enum() -> None:
    torchrec_or_skip()
    EmbOptimType = pytest.importorskip("fbgemm_gpu.split_embedding_configs").EmbOptimType

    spec = et.optimizer_from_spec
    assert spec((EmbOptimType.EXACT_ROWWISE_ADAGRAD, {"lr": 0.1})) == embank.optim.RowWiseAdagrad(0.1)
    assert spec({"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": 0.1}) == embank.optim.Adagrad(
        0.1, eps=1e-8
    )
    assert spec((EmbOptimType.EXACT_SGD, {"lr": 0.1})) == embank.optim.SGD(0.1)


def test_look_alikes_without_torchrec(tmp_path: Path) -> None:
    """embank's own config and KeyedTensor: the same shapes as TorchRec's."""
    kt = et.KeyedTensor(keys=["a", "b"], length_per_key=[2, 3], values=torch.arange(10.0).view(2, 5))
    assert kt.keys() == ["a", "b"] and kt.length_per_key() == [2, 3] and kt.offset_per_key() == [0, 2, 5]
    torch.testing.assert_close(kt["b"], torch.tensor([[2.0, 3.0, 4.0], [7.0, 8.0, 9.0]]))
    torch.testing.assert_close(kt.to_dict()["a"], torch.tensor([[0.0, 1.0], [5.0, 6.0]]))
    cfgs = [
        et.EmbeddingBagConfig(
            num_embeddings=10, embedding_dim=2, name="x", feature_names=["fx"], pooling="mean"
        ),
        et.EmbeddingBagConfig(
            10, 3, "y", ["fy"], pooling=et.PoolingType.MEAN, weight_init_min=1, weight_init_max=2
        ),
    ]
    with embank.open(tmp_path / "s") as store:
        ebc = et.EmbeddingBagCollection.from_configs(store, cfgs, optimizer=("sgd", {"lr": 0.1}))
        assert store.tables() == ["x", "y"]
        assert store.table("y").options["init"] == {"kind": "uniform", "low": 1.0, "high": 2.0}
        out = ebc(
            {
                "fx": (torch.tensor([1, 2]), torch.tensor([0, 1])),
                "fy": (torch.tensor([3, 3]), torch.tensor([0, 1])),
            }
        )
        assert out.keys() == ["fx", "fy"] and out.values().shape == (2, 5)
        assert float(out["fy"].detach().min()) >= 1.0
        # Reopening the same tables, mixed pooling and a dim that disagrees.
        et.EmbeddingBagCollection.from_configs(store, cfgs, optimizer=("sgd", {"lr": 0.1}))
        with pytest.raises(embank.errors.ConfigError, match="dim"):
            et.EmbeddingBagCollection.from_configs(store, [et.EmbeddingBagConfig(10, 4, "x", ["fx"])])
        mixed = et.EmbeddingBagCollection.from_configs(
            store, [cfgs[0], et.EmbeddingBagConfig(10, 3, "z", ["fz"])]
        )
        assert mixed.modes == ["mean", "sum"]
        with pytest.raises(
            embank.errors.InvalidInputError, match=r"is_weighted=True needs SUM.*\['x', 'y'\]"
        ):
            et.EmbeddingBagCollection.from_configs(store, cfgs, is_weighted=True)
        with pytest.raises(embank.errors.ConfigError, match="optimizer"):
            et.EmbeddingBagCollection.from_configs(store, cfgs, optimizer=("adagrad", {"lr": 0.1}))


def test_torchrec_swap_example_learns_alike(tmp_path: Path) -> None:
    """examples/torchrec_swap as a user runs it, on a small set: TorchRec's DLRM trains
    with either collection to about the same AUC, and FTRL's L1 leaves exact zeros."""
    torchrec_or_skip()
    import json
    import subprocess
    import sys

    train = Path(__file__).resolve().parents[2] / "examples" / "torchrec_swap" / "train.py"

    def run(*extra: str) -> dict[str, Any]:
        r = subprocess.run(
            [sys.executable, str(train), "--rows", "8000", "--threads", "1", "--work", str(tmp_path), *extra],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr[-2000:]
        result: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
        return result

    reference, swapped = run("--ebc", "torchrec"), run("--ebc", "embank")
    assert reference["auc"] > 0.6, reference
    assert abs(swapped["auc"] - reference["auc"]) < 0.005, (swapped, reference)
    ftrl = run("--ebc", "embank", "--optimizer", "ftrl")
    assert ftrl["zero_share_of_trained_rows"] > 0.05, ftrl
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("store-")]  # removed after


# --- issue 57: what TorchRec users bring along keeps its meaning ------------------------


def with_weights(torchrec: Any, kjt: Any, seed: int) -> Any:
    """``kjt`` with a weight per id (a leaf that requires grad)."""
    weights = torch.from_numpy(
        np.random.default_rng(seed).uniform(0.5, 2.0, len(kjt.values())).astype(np.float32)
    )
    return torchrec.KeyedJaggedTensor(
        keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(), weights=weights.requires_grad_(True)
    )


def test_unpooled_configs_are_refused(tmp_path: Path) -> None:
    """TorchRec's EmbeddingConfig is a table of TorchRec's EmbeddingCollection (one row per
    id): an EmbeddingBagCollection pooling it would be another model."""
    torchrec = torchrec_or_skip()
    unpooled = [torchrec.EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"])]
    with embank.open(tmp_path / "s") as store:
        with pytest.raises(embank.errors.ConfigError, match="EmbeddingCollection"):
            et.EmbeddingBagCollection.from_configs(store, unpooled, optimizer=("sgd", {"lr": 0.1}))
        assert store.tables() == []


def test_weights_given_to_an_unweighted_collection_are_ignored_as_torchrec_does(tmp_path: Path) -> None:
    """TorchRec's EmbeddingBagCollection(is_weighted=False) pools a weighted KJT's ids
    unweighted; so does from_configs by default, and is_weighted=True pools with them."""
    torchrec = torchrec_or_skip()
    plain = torchrec.EmbeddingBagCollection(tables=configs(torchrec), is_weighted=False)
    weighted = torchrec.EmbeddingBagCollection(tables=configs(torchrec), is_weighted=True)
    weighted.load_state_dict(plain.state_dict())
    with embank.open(tmp_path / "s") as store:
        ebc = et.EmbeddingBagCollection.from_configs(store, configs(torchrec), optimizer=("sgd", {"lr": LR}))
        wbc = et.EmbeddingBagCollection.from_configs(
            store, configs(torchrec), optimizer=("sgd", {"lr": LR}), is_weighted=True
        )
        et.load_state_dict(store, plain.state_dict())
        assert not ebc.is_weighted() and wbc.is_weighted()
        for i, (kjt, _) in enumerate(batches(torchrec, 3)):
            kjt = with_weights(torchrec, kjt, i)
            for ours, theirs in ((ebc, plain), (wbc, weighted)):
                got, want = ours(kjt).values(), theirs(kjt).values()
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
            with pytest.raises(embank.errors.InvalidInputError, match="no weights"):
                wbc(batches(torchrec, 1, seed=i)[0][0])  # no weights


def test_weight_gradients_and_rows_match_fbgemm(tmp_path: Path) -> None:
    """A weighted collection trained 10 steps with SGD: every step the KJT weights'
    gradients (dot(row, gradient of its bag)) equal FusedEmbeddingBagCollection's
    (is_weighted=True, FBGEMM's fused SGD on the CPU), and the rows after each step too."""
    torchrec = torchrec_or_skip()
    modules = pytest.importorskip("torchrec.modules.fused_embedding_modules")
    torch.manual_seed(0)
    reference = modules.FusedEmbeddingBagCollection(
        tables=configs(torchrec), is_weighted=True, optimizer_type=torch.optim.SGD,
        optimizer_kwargs={"lr": LR}, device=torch.device("cpu"),
    )  # fmt: skip
    with embank.open(tmp_path / "s") as store:
        ebc = et.EmbeddingBagCollection.from_configs(
            store, configs(torchrec), optimizer=("exact_sgd", {"lr": LR}), is_weighted=True
        )
        et.load_state_dict(store, reference.state_dict())
        worst = 0.0
        for i, (kjt, target) in enumerate(batches(torchrec, 10, seed=3)):
            ours, theirs = with_weights(torchrec, kjt, i), with_weights(torchrec, kjt, i)
            step(reference, theirs, target)
            step(ebc, ours, target)
            assert ours.weights().grad is not None, "no gradient reached the KJT's weights"
            torch.testing.assert_close(ours.weights().grad, theirs.weights().grad, rtol=1e-5, atol=1e-6)
            worst = max(worst, float((ours.weights().grad - theirs.weights().grad).abs().max()))
            want = {k: v.detach() for k, v in reference.state_dict().items()}
            got = et.export_state_dict(ebc, num_embeddings=SIZES)
            for key in want:
                assert_rows_close(got[key], want[key], f"after step {i + 1}: {key}")
        assert worst < 1e-5, worst


def test_ids_beyond_num_embeddings_are_refused_and_never_dropped_from_an_export(tmp_path: Path) -> None:
    """TorchRec's collection raises for an id >= num_embeddings; so does embank, naming the
    feature, the id and the bound. Grown past it on request, the table's export refuses
    to leave the rows behind, and with a larger num_embeddings includes them."""
    torchrec = torchrec_or_skip()
    beyond = torchrec.KeyedJaggedTensor.from_lengths_sync(
        keys=["f0", "f1", "f2"], values=torch.tensor([3, 45, 1, 2]), lengths=torch.tensor([2, 0, 1, 0, 1, 0])
    )
    with pytest.raises(Exception, match="45"):
        torchrec.EmbeddingBagCollection(tables=configs(torchrec))(beyond)
    with embank.open(tmp_path / "s") as store:
        ebc = et.EmbeddingBagCollection.from_configs(store, configs(torchrec), optimizer=("sgd", {"lr": LR}))
        with pytest.raises(embank.errors.InvalidInputError, match=r"feature 'f0': id 45 .*num_embeddings 40"):
            ebc(beyond)
        with pytest.raises(embank.errors.InvalidInputError, match="feature 'f0': id 45"):
            ebc.lookahead(beyond)
        assert len(store.table("t0")) == 0  # refused before anything was pulled
        grown = et.EmbeddingBagCollection.from_configs(
            store, configs(torchrec), optimizer=("sgd", {"lr": LR}), allow_ids_beyond_num_embeddings=True
        )
        grown(beyond).values().sum().backward()
        trained = store.table("t0").pull([45])[0]
        with pytest.raises(
            embank.errors.InvalidInputError, match=r"'t0' holds 1 rows with ids >= .* 40.*'t0': 46"
        ):
            et.export_state_dict(grown)
        with pytest.raises(embank.errors.InvalidInputError, match="'t0' holds 1 rows"):
            list(et.state_dict_chunks(grown, optimizer_state=True))
        out = et.export_state_dict(grown, num_embeddings={"t0": 46})
        assert out["embedding_bags.t0.weight"].shape == (46, 8)
        np.testing.assert_array_equal(out["embedding_bags.t0.weight"][45].numpy(), trained)


def test_exact_adagrad_without_eps_uses_fbgemms_default(tmp_path: Path) -> None:
    """EmbOptimType.EXACT_ADAGRAD without eps: FBGEMM's default eps (1e-8), not PyTorch's
    (1e-10). Gradients of about 1e-6 (a loss scaled down) make eps matter: 20 steps
    against FusedEmbeddingBagCollection(torch.optim.Adagrad) (FBGEMM's CPU kernel), rows
    and accumulators within 1e-6 relative."""
    torchrec = torchrec_or_skip()
    EmbOptimType = pytest.importorskip("fbgemm_gpu.split_embedding_configs").EmbOptimType
    modules = pytest.importorskip("torchrec.modules.fused_embedding_modules")
    torch.manual_seed(0)
    reference = modules.FusedEmbeddingBagCollection(
        tables=configs(torchrec), optimizer_type=torch.optim.Adagrad, optimizer_kwargs={"lr": LR},
        device=torch.device("cpu"),
    )  # fmt: skip
    with embank.open(tmp_path / "s") as store:
        ebc = et.EmbeddingBagCollection.from_configs(
            store, configs(torchrec), optimizer=(EmbOptimType.EXACT_ADAGRAD, {"lr": LR})
        )
        et.load_state_dict(store, reference.state_dict())
        for i, (kjt, target) in enumerate(batches(torchrec, 20, seed=7)):
            for model in (reference, ebc):
                (1e-6 * ((model(kjt).values() - target) ** 2).sum()).backward()
            assert_state_close(ebc, fbgemm_state(reference), f"after step {i + 1}")


def fbgemm_adam(
    steps: list[tuple[list[int], Any]], w: Any, lr: float, b1: float, b2: float, eps: float
) -> Any:
    """FBGEMM's Adam (``EmbOptimType.ADAM``; its CUDA kernel, FBGEMM has none on the CPU)
    on rows ``w``: one step count ``t`` for the whole table (``iter``, counted by every
    training forward), each row's moments updated only when it has a gradient:
    ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``,
    ``w -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)``."""
    w, m, v = w.clone(), torch.zeros_like(w), torch.zeros_like(w)
    for t, (rows, g) in enumerate(steps, start=1):
        for r, gr in zip(rows, g):
            m[r] = b1 * m[r] + (1 - b1) * gr
            v[r] = b2 * v[r] + (1 - b2) * gr * gr
            w[r] -= lr * (m[r] / (1 - b1**t)) / (torch.sqrt(v[r] / (1 - b2**t)) + eps)
    return w


def test_fbgemms_adam_spec_is_the_table_step_adam_not_embanks_per_row_adam(tmp_path: Path) -> None:
    """FBGEMM's Adam corrects bias by the table's step count, embank.optim.Adam by each
    row's: a row first trained at step 10 moves differently (here by more than 1e-2 after
    20 steps). So a TorchRec Adam spec maps to embank.optim.FbgemmAdam, which matches."""
    torchrec_or_skip()
    EmbOptimType = pytest.importorskip("fbgemm_gpu.split_embedding_configs").EmbOptimType
    rng = np.random.default_rng(0)
    start = torch.from_numpy(rng.uniform(-0.1, 0.1, (4, 3)).astype(np.float32))
    steps = []
    for t in range(20):
        rows = [0, 1] if t < 10 else [0, 1, 2]  # row 2 first trained at step 11
        steps.append((rows, torch.from_numpy(rng.standard_normal((len(rows), 3)).astype(np.float32))))
    want = fbgemm_adam(steps, start, lr=0.05, b1=0.9, b2=0.999, eps=1e-8)
    with embank.open(tmp_path / "s") as store:
        table = store.create_table("t", dim=3, optimizer=embank.optim.Adam(0.05))
        table.push(np.arange(4, dtype=np.uint64), start.numpy())
        for rows, g in steps:
            table.push_grad(np.array(rows, np.uint64), g.numpy())
        got = torch.from_numpy(table.pull(np.arange(4, dtype=np.uint64)))
    torch.testing.assert_close(got[:2], want[:2], rtol=1e-5, atol=1e-6)  # trained from step 1: alike
    assert float((got[2] - want[2]).abs().max()) > 1e-2  # the per-row step count differs
    for spec in (
        (EmbOptimType.ADAM, {"lr": 0.05}),
        {"optimizer": EmbOptimType.ADAM, "learning_rate": 0.05},
        (torch.optim.Adam, {"lr": 0.05}),
        ("adam", {"lr": 0.05}),
    ):
        assert et.optimizer_from_spec(spec) == embank.optim.FbgemmAdam(0.05)
    with embank.open(tmp_path / "f") as store:
        table = store.create_table(
            "t", dim=3, optimizer=et.optimizer_from_spec((EmbOptimType.ADAM, {"lr": 0.05}))
        )
        table.push(np.arange(4, dtype=np.uint64), start.numpy())
        for t, (rows, g) in enumerate(steps, start=1):
            table.push_grad(np.array(rows, np.uint64), g.numpy(), step=t)
        got = torch.from_numpy(table.pull(np.arange(4, dtype=np.uint64)))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # row 2 too
    with pytest.raises(
        embank.errors.ConfigError, match=r"not supported by embank; use EmbOptimType\.EXACT_ROW"
    ):
        et.optimizer_from_spec((EmbOptimType.LARS_SGD, {"lr": 0.05}))


def mixed_configs(torchrec: Any) -> list[Any]:
    """configs() with t1 (features f1, f2) pooling MEAN, t0 SUM."""
    cfgs = configs(torchrec)
    cfgs[1].pooling = torchrec.PoolingType.MEAN
    return cfgs


def test_sum_and_mean_tables_in_one_collection_match_torchrec(tmp_path: Path) -> None:
    """SUM and MEAN tables in one collection: outputs equal TorchRec's
    EmbeddingBagCollection (training and eval), and 30 steps equal FBGEMM's fused row-wise
    Adagrad (FusedEmbeddingBagCollection) row for row."""
    torchrec = torchrec_or_skip()
    modules = pytest.importorskip("torchrec.modules.fused_embedding_modules")
    torch.manual_seed(0)
    reference = modules.FusedEmbeddingBagCollection(
        tables=mixed_configs(torchrec), optimizer_type=torchrec.optim.RowWiseAdagrad,
        optimizer_kwargs={"lr": LR, "eps": EPS}, device=torch.device("cpu"),
    )  # fmt: skip
    plain = torchrec.EmbeddingBagCollection(tables=mixed_configs(torchrec))
    plain.load_state_dict(reference.state_dict())
    with embank.open(tmp_path / "s") as store:
        ebc = et.EmbeddingBagCollection.from_configs(
            store, mixed_configs(torchrec), optimizer=("exact_rowwise_adagrad", {"lr": LR, "eps": EPS})
        )
        et.load_state_dict(store, reference.state_dict())
        kjt, _ = batches(torchrec, 1)[0]
        want = plain(kjt).values().detach()
        torch.testing.assert_close(ebc(kjt).values().detach(), want, rtol=1e-6, atol=1e-7)
        with torch.no_grad():
            torch.testing.assert_close(ebc(kjt).values(), want, rtol=1e-6, atol=1e-7)
        for i, (kjt, target) in enumerate(batches(torchrec, 30, seed=11)):
            step(reference, kjt, target)
            step(ebc, kjt, target)
            if (i + 1) % 10 == 0:
                assert_state_close(ebc, fbgemm_state(reference), f"after step {i + 1}")


def unpooled_configs(torchrec: Any, cls: Any = None) -> list[Any]:
    """configs() as TorchRec's EmbeddingConfigs (tables of an EmbeddingCollection, which
    TorchRec wants of one dim: 4), or as ``cls`` configs of the same tables."""
    cls = cls or torchrec.EmbeddingConfig
    return [
        cls(name="t0", embedding_dim=4, num_embeddings=SIZES["t0"], feature_names=["f0"]),
        cls(name="t1", embedding_dim=4, num_embeddings=SIZES["t1"], feature_names=["f1", "f2"]),
    ]


def test_embedding_collection_matches_torchrec_row_for_row_and_fbgemm_step_for_step(tmp_path: Path) -> None:
    """embank.torch.EmbeddingCollection: every id's row and the lengths as TorchRec's
    EmbeddingCollection gives them (training and eval), loaded from its state dict
    (``embeddings.<t>.weight``); 20 steps of a squared loss on the rows equal FBGEMM's
    fused row-wise Adagrad on the CPU (FusedEmbeddingBagCollection, each id its own bag:
    FBGEMM's FusedEmbeddingCollection runs on CUDA only), rows and accumulators within
    1e-6 relative, and the export is in TorchRec's EmbeddingCollection layout."""
    torchrec = torchrec_or_skip()
    EmbOptimType = pytest.importorskip("fbgemm_gpu.split_embedding_configs").EmbOptimType
    modules = pytest.importorskip("torchrec.modules.fused_embedding_modules")
    torch.manual_seed(0)
    reference = modules.FusedEmbeddingBagCollection(
        tables=unpooled_configs(torchrec, torchrec.EmbeddingBagConfig),
        optimizer_type=torchrec.optim.RowWiseAdagrad, optimizer_kwargs={"lr": LR, "eps": EPS},
        device=torch.device("cpu"),
    )  # fmt: skip
    plain = torchrec.EmbeddingCollection(tables=unpooled_configs(torchrec))
    plain.load_state_dict(
        {k.replace("embedding_bags.", "embeddings."): v for k, v in reference.state_dict().items()}
    )
    names = ["f0", "f1", "f2"]
    data = batches(torchrec, 20, seed=13)
    with embank.open(tmp_path / "s") as store:
        spec = (EmbOptimType.EXACT_ROWWISE_ADAGRAD, {"lr": LR, "eps": EPS})
        ec = et.EmbeddingCollection.from_configs(store, unpooled_configs(torchrec), optimizer=spec)
        assert et.load_state_dict(store, plain.state_dict()) == ["t0", "t1"]
        want = plain(data[0][0])
        for got in (ec(data[0][0]), ec.eval()(data[0][0])):
            assert sorted(got) == sorted(want) == names
            for f in names:
                assert isinstance(got[f], torchrec.JaggedTensor)
                torch.testing.assert_close(got[f].lengths(), want[f].lengths(), rtol=0, atol=0)
                torch.testing.assert_close(
                    got[f].values().detach(), want[f].values().detach(), rtol=0, atol=0
                )
        ec.train()
        for i, (kjt, _) in enumerate(data):
            rows = ec(kjt)
            n = [len(rows[f].values()) for f in names]
            rng = np.random.default_rng(i)
            targets = [torch.from_numpy(rng.standard_normal((k, 4)).astype(np.float32)) for k in n]
            sum(((rows[f].values() - t) ** 2).sum() for f, t in zip(names, targets)).backward()
            # FBGEMM: each id its own bag, features padded with empty bags to one batch size.
            m = max(n)
            lengths = torch.cat([(torch.arange(m) < k).long() for k in n])
            singles = torchrec.KeyedJaggedTensor.from_lengths_sync(
                keys=names, values=kjt.values(), lengths=lengths
            )
            blocks = torch.split(reference(singles).values(), [4, 4, 4], dim=1)
            sum(((b[:k] - t) ** 2).sum() for b, k, t in zip(blocks, n, targets)).backward()
            if (i + 1) % 5 == 0:
                want_state = {
                    k.replace("embedding_bags.", "embeddings."): v for k, v in fbgemm_state(reference).items()
                }
                got_state = et.export_state_dict(ec, optimizer_state=True)
                assert sorted(got_state) == sorted(want_state)
                for key in want_state:
                    assert_rows_close(got_state[key], want_state[key], f"after step {i + 1}: {key}")


def test_embedding_collection_refuses_pooled_configs_and_ids_beyond(tmp_path: Path) -> None:
    """Without TorchRec: embank's EmbeddingConfig; an EmbeddingBagConfig is refused, an
    id >= num_embeddings raises, push="step" trains through SparseOptimizer."""
    cfgs = [et.EmbeddingConfig(num_embeddings=10, embedding_dim=2, name="t", feature_names=["a", "b"])]
    with embank.open(tmp_path / "s") as store:
        with pytest.raises(embank.errors.ConfigError, match="EmbeddingBagCollection"):
            et.EmbeddingCollection.from_configs(store, [et.EmbeddingBagConfig(10, 2, "u", ["c"])])
        ec = et.EmbeddingCollection.from_configs(store, cfgs, optimizer=("sgd", {"lr": 1.0}), push="step")
        ids = {
            "a": (torch.tensor([1, 2, 2]), torch.tensor([0, 1])),
            "b": (torch.tensor([3]), torch.tensor([0, 1])),
        }
        out = ec(ids)
        assert out["a"].values().shape == (3, 2) and out["a"].lengths().tolist() == [1, 2]
        assert out["b"].lengths().tolist() == [1, 0]
        before = store.table("t").pull([2])[0].copy()
        sparse = et.SparseOptimizer(ec)
        (out["a"].values().sum() + out["b"].values().sum()).backward()
        assert sparse.step() == 3
        np.testing.assert_allclose(store.table("t").pull([2])[0], before - 2.0, rtol=1e-6)  # id 2 twice
        with pytest.raises(embank.errors.InvalidInputError, match=r"feature 'b': id 10 .*num_embeddings 10"):
            ec({"a": (torch.tensor([1]), torch.tensor([0])), "b": (torch.tensor([10]), torch.tensor([0]))})


def test_sequential_example_trains_as_torchrecs_embedding_collection(tmp_path: Path) -> None:
    """examples/sequential (SASRec over embank.torch.EmbeddingCollection beside TorchRec's
    EmbeddingCollection), small: 200 steps, every step's loss within 1e-4 of TorchRec's,
    and the loss goes down."""
    torchrec_or_skip()
    import json
    import subprocess
    import sys

    train = Path(__file__).resolve().parents[2] / "examples" / "sequential" / "train.py"
    r = subprocess.run(
        [sys.executable, str(train), "--items", "3000", "--users", "3000", "--batch-size", "32",
         "--threads", "1", "--work", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["steps"] == 200 and result["loss_diff_max"] <= 1e-4, result
    curve = result["loss_every_20"]["embank"]
    assert curve[-1] < curve[0] - 0.05, result
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("store-")]  # removed after
