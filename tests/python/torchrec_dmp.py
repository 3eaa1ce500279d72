"""TorchRec's own DLRM, its embedding collection swapped for embank's, trained under
``torchrec.distributed.DistributedModelParallel`` (run by ``torchrun``, gloo on the CPU)
or in one process; used by ``test_torchrun.py``.

    torchrun --nproc_per_node 2 tests/python/torchrec_dmp.py --connect A,B --out dmp.pt
    python tests/python/torchrec_dmp.py --store /tmp/one --out one.pt

DMP shards the module types its sharders know (TorchRec's own collections); embank's
``EmbeddingBagCollection`` is none of them, so the plan is empty and DMP leaves it as it
is, wrapping the model in ``DistributedDataParallel``: the dense part is data-parallel
(gradients averaged across ranks), and the collection has no parameters for DDP to see.
Its rows live on ``embank serve`` shards every rank shares; ``SparseOptimizer(...,
distributed=True)`` averages every rank's row gradients and pushes each row once a step.
Each rank trains on its slice of the same global batch, so the run is the one process
training on the whole batch. Saves the global loss of every step, the tables (TorchRec's
state-dict layout) and the dense parameters to ``--out`` (rank 0).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import embank
import embank.torch as et
import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist
import torchrec  # type: ignore[import-untyped]
from torchrec.models.dlrm import DLRM  # type: ignore[import-untyped]

DIM, DENSE, GLOBAL_BATCH = 8, 4, 32
SIZES = {"dmp_t0": 300, "dmp_t1": 60}
FEATURES = {"f0": "dmp_t0", "f1": "dmp_t1", "f2": "dmp_t1"}  # dmp_t1 serves two features


def configs() -> list[Any]:
    return [
        torchrec.EmbeddingBagConfig(
            name=t,
            embedding_dim=DIM,
            num_embeddings=n,
            feature_names=[f for f, u in FEATURES.items() if u == t],
        )
        for t, n in SIZES.items()
    ]


Batch = tuple[npt.NDArray[np.float32], list[list[npt.NDArray[np.int64]]], npt.NDArray[np.float32]]


def global_batches(steps: int) -> list[Batch]:
    """``steps`` global batches: dense inputs, each example's ids per feature (bags of 0
    to 3 ids, popular ids more likely: rows repeat within and across batches), labels
    that depend on the ids and the dense inputs (something to learn)."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(steps):
        dense = rng.standard_normal((GLOBAL_BATCH, DENSE)).astype(np.float32)
        ids = [
            [(rng.zipf(1.3, size=rng.integers(0, 4)) - 1) % SIZES[FEATURES[f]] for f in FEATURES]
            for _ in range(GLOBAL_BATCH)
        ]
        score = dense[:, 0] + np.array([sum(int(b.sum()) % 3 - 1 for b in example) for example in ids])
        labels = (score + rng.standard_normal(GLOBAL_BATCH) > 0).astype(np.float32)
        out.append((dense, ids, labels))
    return out


def kjt_of(ids: list[list[npt.NDArray[np.int64]]]) -> Any:
    """The KeyedJaggedTensor of these examples (feature-major, as TorchRec lays it out)."""
    values = [example[j] for j in range(len(FEATURES)) for example in ids]
    return torchrec.KeyedJaggedTensor.from_lengths_sync(
        keys=list(FEATURES),
        values=torch.from_numpy(np.concatenate(values).astype(np.int64)),
        lengths=torch.tensor([len(v) for v in values], dtype=torch.int64),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--connect", help="comma-separated embank serve shards (under torchrun)")
    where.add_argument("--store", type=Path, help="an embedded store (one process)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    distributed = args.connect is not None
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    store = embank.connect(args.connect.split(",")) if distributed else embank.open(args.store)

    torch.manual_seed(0)
    start = torchrec.EmbeddingBagCollection(tables=configs()).state_dict()  # TorchRec's initial rows
    optimizer = ("exact_rowwise_adagrad", {"lr": 0.05, "eps": 1e-8})
    if rank == 0:  # one rank makes the tables and loads the rows; the others open them
        ebc = et.EmbeddingBagCollection.from_configs(store, configs(), optimizer=optimizer, push="step")
        et.load_state_dict(store, start)
    if distributed:
        dist.barrier()
    if rank != 0:
        ebc = et.EmbeddingBagCollection.from_configs(store, configs(), optimizer=optimizer, push="step")
    torch.manual_seed(1)
    model = DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=DENSE,
        dense_arch_layer_sizes=[16, DIM],
        over_arch_layer_sizes=[16, 1],
    )
    trained: torch.nn.Module = model
    if distributed:
        from torchrec.distributed import DistributedModelParallel  # type: ignore[import-untyped]

        dmp = DistributedModelParallel(model, device=torch.device("cpu"))
        assert not dmp.plan.plan, f"DMP sharded embank's collection: {dmp.plan}"
        trained = dmp
    dense_optimizer = torch.optim.Adagrad(trained.parameters(), lr=0.05)
    sparse = et.SparseOptimizer(model, distributed=distributed)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    share = GLOBAL_BATCH // world
    mine = slice(rank * share, (rank + 1) * share)
    losses = []
    for dense, ids, labels in global_batches(args.steps):
        logits = trained(torch.from_numpy(dense[mine]), kjt_of(ids[mine])).squeeze(1)
        loss = loss_fn(logits, torch.from_numpy(labels[mine]))
        dense_optimizer.zero_grad()
        loss.backward()  # DDP averages the dense gradients across ranks
        dense_optimizer.step()
        sparse.step()  # every rank's row gradients averaged, each row pushed once
        global_loss = loss.detach().clone()
        if distributed:
            dist.all_reduce(global_loss)
            global_loss /= world
        losses.append(float(global_loss))
    if rank == 0:
        torch.save(
            {
                "losses": losses,
                "tables": et.export_state_dict(ebc),
                "dense": {n: p.detach().clone() for n, p in model.named_parameters()},
                "data_parallel": distributed
                and isinstance(trained._dmp_wrapped_module, torch.nn.parallel.DistributedDataParallel),
            },
            args.out,
        )
    store.close()
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
