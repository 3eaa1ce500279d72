"""Many trainers: the DLRM example under a real `torchrun --nproc_per_node 2` (gloo on
the CPU), its tables on two real `embank serve` shards the example starts; a rank
SIGKILLed mid-epoch and restarted by torchrun; coordinated checkpoints."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import embank
import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "dlrm" / "train.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"
ROWS = "50000"


def _plain_env() -> dict[str, str]:
    """The environment without the TLS settings other tests' servers use (the example's
    shards speak plain TCP on loopback)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("EMBANK_TLS_")}


def _data(tmp: Path) -> Path:
    """The synthetic data once, copied into each run's work directory."""
    d = tmp / "data"
    if not d.exists():
        subprocess.run(
            [sys.executable, str(TRAIN), "--synthetic", ROWS, "--work", str(d), "--epochs", "0", "--quiet"],
            check=True, capture_output=True, timeout=300,
        )  # fmt: skip
    return d


def _run(
    tmp: Path, name: str, cmd: list[str], env: dict[str, str] | None = None, extra: tuple[str, ...] = ()
) -> tuple[dict, str]:  # type: ignore[type-arg]
    work = tmp / name
    work.mkdir()
    for f in _data(tmp).glob("synthetic-*.tsv"):
        shutil.copy(f, work / f.name)
    args = [
        *extra,
        "--synthetic",
        ROWS,
        "--work",
        str(work),
        "--quiet",
        "--threads",
        "1",
        "--metrics-out",
        str(work / "m.json"),
    ]
    r = subprocess.run(
        cmd + [str(TRAIN)] + args + (["--local-shards", "2"] if cmd[0] == str(TORCHRUN) else []),
        capture_output=True, text=True, timeout=600, env={**_plain_env(), **(env or {})},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    metrics = json.loads((work / "m.json").read_text())
    shutil.rmtree(work)  # the stores of 26 tables (a shard's about 0.5 GB): keep the disk small
    return metrics, r.stdout + r.stderr


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not installed")
def test_two_ranks_match_one_process_and_survive_a_killed_rank(tmp_path: Path) -> None:
    single, _ = _run(tmp_path, "single", [sys.executable])
    two, _ = _run(tmp_path, "two", [str(TORCHRUN), "--nproc_per_node", "2"])
    assert two["world_size"] == 2 and two["shards"] == 2
    # The same global batches: the AUC of one process training them, within 0.002.
    assert abs(two["auc"] - single["auc"]) <= 0.002, (two["auc"], single["auc"])
    # Rank 1 SIGKILLed after batch 25; torchrun restarts both ranks, which resume every
    # rank and shard from the checkpoint at batch 20 and end exactly where the
    # uninterrupted run ended.
    killed, out = _run(
        tmp_path,
        "killed",
        [str(TORCHRUN), "--nproc_per_node", "2", "--max-restarts", "1"],
        env={"EMBANK_DLRM_KILL": "1:25"},
        extra=("--checkpoint-every", "10"),
    )
    assert "killed after batch 25" in out and "resuming after batch 20" in out, out[-3000:]
    assert killed["batches"] == two["batches"]
    assert killed["auc"] == two["auc"] and killed["logloss"] == two["logloss"], (killed, two)


def test_a_checkpoint_that_fails_on_one_shard_fails_and_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k in [k for k in os.environ if k.startswith("EMBANK_TLS_")]:
        monkeypatch.delenv(k)
    sys.path.insert(0, str(TRAIN.parent))
    try:
        import shards  # type: ignore[import-not-found]
    finally:
        sys.path.pop(0)
    from embank import torch as et

    addrs = shards.start(tmp_path, 2, fresh=True)
    try:
        store = embank.connect(addrs)
        store.create_table("t", dim=4)
        ahead = embank.connect([addrs[0]])
        ahead.checkpoint(100)  # shard 0 alone is at batch 100
        dense = tmp_path / "dense.pt"
        with pytest.raises(embank.errors.InvalidInputError, match=r"shard 0 \(127\.0\.0\.1:\d+\)"):
            et.checkpoint(store, 50, {"w": torch.zeros(2)}, dense)
        assert not dense.exists()  # the dense part is saved only after every shard checkpointed
        et.checkpoint(store, 101, {"w": torch.zeros(2)}, dense)
        assert dense.exists() and store.checkpoints()[-1] == 101
        ahead.close()
        store.close()
    finally:
        shards.stop(tmp_path)


DMP = ROOT / "tests" / "python" / "torchrec_dmp.py"


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not installed")
def test_torchrecs_dlrm_swapped_under_distributed_model_parallel_trains_as_one_process(
    tmp_path: Path, cluster: list[str]
) -> None:
    """TorchRec's DLRM over embank.torch.EmbeddingBagCollection.from_configs, wrapped in
    torchrec.distributed.DistributedModelParallel on two ranks (gloo, the tables on two
    `embank serve` shards): DMP leaves embank's collection unsharded and the dense part
    data-parallel; after 100 steps every step's loss, every row and every dense parameter
    within 1e-6 of one process training on the whole batch with an embedded store."""
    pytest.importorskip("fbgemm_gpu")
    pytest.importorskip("torchrec")
    with embank.connect(cluster) as store:
        for name in ("dmp_t0", "dmp_t1"):
            if name in store:
                store.drop_table(name)
    try:
        one = subprocess.run(
            [sys.executable, str(DMP), "--store", str(tmp_path / "one"), "--out", str(tmp_path / "one.pt")],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert one.returncode == 0, one.stderr[-4000:]
        two = subprocess.run(
            [str(TORCHRUN), "--standalone", "--nproc_per_node", "2", str(DMP), "--connect", ",".join(cluster),
             "--out", str(tmp_path / "two.pt")],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert two.returncode == 0, two.stderr[-4000:]
    finally:
        with embank.connect(cluster) as store:
            for name in ("dmp_t0", "dmp_t1"):
                if name in store:
                    store.drop_table(name)
    want, got = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert got["data_parallel"], "DMP did not wrap the dense part in DistributedDataParallel"
    assert len(got["losses"]) == len(want["losses"]) == 100
    assert want["losses"][-1] < want["losses"][0] - 0.1, want["losses"]  # it learned something
    for i, (g, w) in enumerate(zip(got["losses"], want["losses"])):
        assert abs(g - w) <= 1e-6, f"step {i}: loss {g} under DMP, {w} in one process"
    for part in ("tables", "dense"):
        assert sorted(got[part]) == sorted(want[part])
        for key in want[part]:
            torch.testing.assert_close(got[part][key], want[part][key], rtol=0, atol=1e-6, msg=key)
