#!/usr/bin/env python3
"""DLRM on Criteo-format click logs with its 26 embedding tables in embank.

    python examples/dlrm/train.py --synthetic 200000 --work /tmp/dlrm
    python examples/dlrm/train.py --train day_0.tsv --test day_1.tsv --hash-size 1000000 --work /data/dlrm

Model: bottom MLP over the 13 integer features, one pooled embedding per categorical
feature (an embank table each, Adagrad in the store), pairwise dot interaction, top MLP.
Every ``--checkpoint-every`` batches the dense part is saved with ``torch.save`` and the
tables with ``store.checkpoint`` under the same batch id; ``--resume`` (after a crash or
a kill) restores both to the last such batch and continues with the next one.
Many trainers: ``torchrun --nproc_per_node N examples/dlrm/train.py --local-shards 2 ...``
(or ``--connect host:port,...`` to running ``embank serve`` shards) splits every global
batch of ``--batch-size`` across the ranks, keeps the dense part under
``DistributedDataParallel`` (gloo) and the tables on the shards; each step every row gets
one update with the global batch's gradient (``SparseOptimizer(distributed=True)``), so
the run reproduces one process training the same batches. Checkpoints are coordinated
(``embank.torch.checkpoint``: a barrier, every shard at the same batch id, the dense
part saved once); a rank killed and restarted by ``torchrun --max-restarts`` resumes
every rank and shard from the last one.
``--baseline`` trains the same model with ``torch.nn.EmbeddingBag(sparse=True)`` and
``torch.optim.Adagrad`` in DRAM, starting from the same rows. ``--serve-dtypes f16,int8``
then serves the trained tables as compact rows (exported, loaded into tables of each
type) and reports the test AUC of each against the f32 tables it came from.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import embank
import embank.datasets as ds
import embank.torch as et
import numpy as np
import torch
from torch import nn

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover - the bar is optional
    tqdm = None


def mlp(sizes: list[int], last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2 or last_relu:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """``bags``: one module per feature called with ``(ids, offsets)``, or ``collection``:
    one module taking the ``(n, 26)`` ids and returning a list of pooled ``(n, dim)``."""

    def __init__(
        self,
        bags: list[nn.Module],
        dim: int,
        bottom: list[int],
        top: list[int],
        collection: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.bags = nn.ModuleList(bags)
        self.collection = collection
        self.bottom = mlp([ds.NUM_DENSE, *bottom, dim], last_relu=True)
        f = ds.NUM_SPARSE + 1
        self.top = mlp([dim + f * (f - 1) // 2, *top, 1], last_relu=False)
        self.register_buffer("tri", torch.triu_indices(f, f, offset=1), persistent=False)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)
        n = sparse.shape[0]
        offsets = torch.arange(n, dtype=torch.int64)
        if self.collection is not None:
            embs = self.collection(sparse)
        else:
            embs = [bag(sparse[:, j].contiguous(), offsets) for j, bag in enumerate(self.bags)]
        z = torch.stack([x, *embs], dim=1)  # (n, f, dim)
        inter = torch.bmm(z, z.transpose(1, 2))[:, self.tri[0], self.tri[1]]
        return self.top(torch.cat([x, inter], dim=1)).squeeze(1)


class EmbankTables(nn.Module):
    """The 26 embank tables as one fused ``embank.torch.EmbeddingBagCollection``: one
    native call per step pulls and pools every feature, one reduces the gradients."""

    def __init__(self, sources: list[Any]) -> None:
        super().__init__()
        self.ebc = et.EmbeddingBagCollection({f"c{j + 1}": s for j, s in enumerate(sources)}, mode="sum")

    def forward(self, sparse: torch.Tensor) -> list[torch.Tensor]:
        return list(self.ebc(sparse).values())


class TorchRecTables(nn.Module):
    """TorchRec's FusedEmbeddingBagCollection (fbgemm's CPU kernels, Adagrad fused into
    backward) over the same 26 features, for the --torchrec comparison."""

    def __init__(self, sizes: list[int], dim: int, lr: float, init: list[torch.Tensor]) -> None:
        super().__init__()
        from torchrec import EmbeddingBagConfig
        from torchrec.modules.embedding_configs import PoolingType
        from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection

        self.names = [f"c{j + 1}" for j in range(len(sizes))]
        tables = [
            EmbeddingBagConfig(
                name=f"t_{n}",
                embedding_dim=dim,
                num_embeddings=size,
                feature_names=[n],
                pooling=PoolingType.SUM,
            )
            for n, size in zip(self.names, sizes)
        ]
        self.ebc = FusedEmbeddingBagCollection(
            tables,
            optimizer_type=torch.optim.Adagrad,
            optimizer_kwargs={"lr": lr, "eps": 1e-10},
            device=torch.device("cpu"),
        )
        with torch.no_grad():
            for (_, p), rows in zip(self.ebc.named_parameters(), init):
                p.copy_(rows)

    def forward(self, sparse: torch.Tensor) -> list[torch.Tensor]:
        from torchrec import KeyedJaggedTensor

        n = sparse.shape[0]
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=self.names,
            values=sparse.t().reshape(-1),
            lengths=torch.ones(n * len(self.names), dtype=torch.int32),
        )
        pooled = self.ebc(kjt).to_dict()
        return [pooled[k] for k in self.names]


class NoSparseStep:
    """The sparse optimizer of --torchrec: fused into backward, nothing to do."""

    def step(self) -> None: ...

    def zero_grad(self) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return {}


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney U, ties counted half)."""
    order = np.argsort(scores, kind="mergesort")
    s, y = scores[order], labels[order]
    ranks = np.empty(len(s), dtype=np.float64)
    i = 0
    while i < len(s):  # average ranks of ties
        j = i
        while j + 1 < len(s) and s[j + 1] == s[i]:
            j += 1
        ranks[i : j + 1] = (i + j) / 2.0 + 1.0
        i = j + 1
    pos = y > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def evaluate(model: DLRM, batches: Iterator[ds.Batch], dist: Any = None) -> dict[str, float]:
    """AUC and log loss; with ``dist`` (torch.distributed) every rank scores its share of
    each batch and the scores of all ranks are gathered, in the order one process
    would have them."""
    model.eval()
    labels, scores = [], []
    with torch.no_grad():
        for b in batches:
            scores.append(torch.sigmoid(model(torch.from_numpy(b.dense), torch.from_numpy(b.sparse))).numpy())
            labels.append(b.labels)
    model.train()
    if dist is not None:
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, (labels, scores))
        # Batch by batch, rank by rank: a batch's rows in their order.
        labels = [part for i in range(len(labels)) for part in (r[0][i] for r in every)]
        scores = [part for i in range(len(scores)) for part in (r[1][i] for r in every)]
    y, p = np.concatenate(labels), np.concatenate(scores).astype(np.float64)
    pc = np.clip(p, 1e-7, 1 - 1e-7)
    return {
        "auc": auc(y, p),
        "logloss": float(-np.mean(y * np.log(pc) + (1 - y) * np.log(1 - pc))),
        "examples": len(y),
    }


def init_rows(store: embank.Store, dim: int, keys: np.ndarray, args: argparse.Namespace) -> torch.Tensor:
    """The rows embank's initializer gives ``keys`` (without storing them): the baseline
    starts from the same embedding values as the embank run."""
    scratch = store.create_table(
        "init-scratch",
        dim=dim,
        init=embank.init.uniform(-args.init, args.init),
        seed=args.seed,
        missing="init",
    )
    rows, _ = scratch.lookup(keys.astype(np.uint64))
    store.drop_table("init-scratch")
    return torch.from_numpy(rows)


def materialize(tables: list[embank.Table], batches: Iterator[ds.Batch], quiet: bool) -> None:
    """Creates every row ``batches`` touch (feature ``j``'s ids in ``tables[j]``) with a
    pull, which creates missing rows with the table's initializer: the rows the training
    steps' own first pulls would create, so the run's results do not change."""
    t0 = time.perf_counter()
    ids: list[list[np.ndarray]] = [[] for _ in tables]
    for b in batches:
        for j in range(len(tables)):
            ids[j].append(b.sparse[:, j])
    rows = 0
    for t, parts in zip(tables, ids):
        keys = np.unique(np.concatenate(parts)).astype(np.uint64)
        for lo in range(0, len(keys), 1 << 16):
            t.pull(keys[lo : lo + (1 << 16)])
        rows += len(keys)
    if not quiet:
        print(f"materialized {rows:,} rows in {time.perf_counter() - t0:.2f} s", file=sys.stderr)


def atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    data = p.add_argument_group("data")
    data.add_argument("--train", nargs="*", default=[], help="Criteo-format TSV files to train on")
    data.add_argument("--test", nargs="*", default=[], help="Criteo-format TSV files to evaluate on")
    data.add_argument(
        "--synthetic",
        type=int,
        default=0,
        metavar="ROWS",
        help="generate ROWS training examples (and ROWS/5 test ones) into --work instead",
    )
    data.add_argument(
        "--synthetic-scale",
        type=int,
        default=100_000,
        help="distinct values of the largest synthetic feature",
    )
    data.add_argument(
        "--hash-size",
        type=int,
        default=None,
        help="categorical ids modulo this (needed by --baseline on real Criteo data)",
    )
    train = p.add_argument_group("training")
    train.add_argument("--work", required=True, type=Path, help="directory for the store, checkpoints, data")
    train.add_argument("--epochs", type=int, default=1)
    train.add_argument("--batch-size", type=int, default=512)
    train.add_argument("--dim", type=int, default=16)
    train.add_argument("--bottom", default="64,32", help="bottom MLP hidden sizes")
    train.add_argument("--top", default="128,64", help="top MLP hidden sizes")
    train.add_argument("--lr", type=float, default=0.05, help="Adagrad learning rate (dense and tables)")
    train.add_argument(
        "--init", type=float, default=0.05, help="embedding rows start uniform in [-init, init)"
    )
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    train.add_argument("--eval-every", type=int, default=0, help="also evaluate every N batches")
    st = p.add_argument_group("tables")
    st.add_argument(
        "--baseline",
        action="store_true",
        help="torch.nn.EmbeddingBag(sparse=True) + torch.optim.Adagrad in DRAM instead of embank",
    )
    st.add_argument(
        "--torchrec",
        action="store_true",
        help="TorchRec FusedEmbeddingBagCollection (fbgemm-gpu-cpu) in DRAM instead of embank (comparison)",
    )
    st.add_argument("--medium", choices=["mmap", "block"], default="mmap", help="embank medium of the tables")
    st.add_argument(
        "--connect",
        default=None,
        metavar="ADDRS",
        help="tables on these running `embank serve` shards (host:port,host:port) instead of a local store",
    )
    st.add_argument(
        "--local-shards",
        type=int,
        default=0,
        metavar="N",
        help="start N local `embank serve` shards under --work and keep the tables there "
        "(what several torchrun processes share); stopped at the end unless --keep-shards",
    )
    st.add_argument("--keep-shards", action="store_true", help="leave --local-shards running at the end")
    st.add_argument(
        "--cache-fraction",
        type=float,
        default=None,
        help="block medium: DRAM row cache as this fraction of the tables' rows (e.g. 0.1)",
    )
    st.add_argument(
        "--staleness",
        type=int,
        default=None,
        metavar="K",
        help="SSP bound K: gradients reach the tables K steps late; pulls held by a worker",
    )
    st.add_argument(
        "--serve-dtypes",
        default="",
        metavar="LIST",
        help="after training, serve the tables as these element types (e.g. f16,int8) and "
        "report each one's test AUC next to the f32 tables'",
    )
    st.add_argument(
        "--gpu-cache-rows",
        type=int,
        default=0,
        metavar="N",
        help="after training, also evaluate through an embank.gpu.GpuCache of N rows per table "
        "(sync inserts; on CUDA if present, else the CPU) and report its AUC and hit rate",
    )
    st.add_argument(
        "--per-table",
        action="store_true",
        help="one embank.torch.EmbeddingBag per table (a pull and a push_grad each per step) instead "
        "of the fused EmbeddingBagCollection (one native call each way)",
    )
    st.add_argument(
        "--no-lookahead",
        action="store_true",
        help="do not read the next batch's rows ahead of its step (on by default with --medium block)",
    )
    st.add_argument(
        "--materialize",
        action="store_true",
        help="create every row the training set touches before training starts, as TorchRec and "
        "nn.EmbeddingBag allocate theirs up front (the rows a first pull would create: same results); "
        "by default embank creates a row at its first pull, inside the timed steps",
    )
    st.add_argument("--checkpoint-every", type=int, default=0, help="checkpoint every N batches (0: never)")
    st.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --work")
    st.add_argument("--metrics-out", type=Path, default=None, help="write the final metrics here as JSON")
    st.add_argument("--quiet", action="store_true", help="no progress bar; print checkpoints on stdout")
    st.add_argument(
        "--preload",
        action="store_true",
        help="parse the training files into memory first: examples/s then times training only",
    )
    args = p.parse_args(argv)
    if args.materialize and (args.torchrec or args.baseline):
        p.error("--materialize applies to embank tables (--torchrec, --baseline allocate every row up front)")
    if args.torchrec:
        if args.checkpoint_every or args.resume:
            p.error("--torchrec is for comparison runs: no --checkpoint-every or --resume")
        args.baseline = True  # DRAM tables indexed by dense ids, like --baseline
    if not args.synthetic and not args.train:
        p.error("give --train files or --synthetic ROWS")
    if args.baseline and not args.synthetic and args.hash_size is None:
        p.error("--baseline on Criteo files needs --hash-size (fixed-size torch tables)")
    if args.serve_dtypes and (args.baseline or not (args.test or args.synthetic)):
        p.error("--serve-dtypes serves embank tables and needs test data")
    if args.baseline and (args.staleness is not None or args.medium != "mmap"):
        p.error("--staleness and --medium apply to embank tables, not --baseline")
    if args.connect and args.local_shards:
        p.error("give --connect or --local-shards, not both")
    remote = bool(args.connect or args.local_shards)
    if remote and args.baseline:
        p.error("--connect/--local-shards hold embank tables: not with --baseline or --torchrec")
    if remote and (args.cache_fraction is not None or args.medium != "mmap"):
        p.error("--medium and --cache-fraction are the shards' own settings (their serve config)")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        if not remote:
            p.error(
                f"{world} processes (torchrun) share the tables on embank serve shards: "
                "give --local-shards N or --connect ADDRS"
            )
        if args.staleness is not None:
            p.error("under torchrun every step updates each row once for all ranks: no --staleness")
        if args.serve_dtypes or args.gpu_cache_rows:
            p.error("--serve-dtypes and --gpu-cache-rows are single-process evaluations")
    return args


class Vocab:
    """Synthetic values are 32-bit hashes of dense ids: the baseline's fixed-size tables
    index them by the dense id (one more row for a missing value); embank takes the
    hashed value itself as the key. Both start from the row embank's initializer gives
    the hashed value, so the two runs are the same model."""

    def __init__(self, cards: list[int], seed: int) -> None:
        self.keys: list[np.ndarray] = []
        self.index: list[dict[int, int]] = []
        for card in cards:
            hashed = ds.synthetic_values(np.arange(card, dtype=np.int64), seed)
            self.keys.append(np.append(hashed, ds.MISSING_ID))
            self.index.append({int(h): i for i, h in enumerate(hashed.tolist())})

    def apply(self, sparse: np.ndarray) -> None:
        for j, m in enumerate(self.index):
            miss = len(self.keys[j]) - 1  # the last row: a missing value
            sparse[:, j] = [m.get(int(x), miss) for x in sparse[:, j].tolist()]


def split(b: ds.Batch, rank: int, world: int) -> ds.Batch:
    """This rank's contiguous share of a global batch."""
    lo, hi = len(b) * rank // world, len(b) * (rank + 1) // world
    return ds.Batch(b.dense[lo:hi], b.sparse[lo:hi], b.labels[lo:hi])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    dist: Any = None
    if world > 1:
        import datetime
        import faulthandler
        import signal

        import torch.distributed as dist

        faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` prints a stuck rank's stacks
        timeout = datetime.timedelta(minutes=5)
        # The process group's keys under a prefix of their own per torchrun restart: with
        # the agent's store shared by every attempt, a restarted rank could otherwise read
        # the address a killed rank published and fail to connect (seen with gloo).
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            world,
            is_master=rank == 0 and not agent,
            timeout=timeout,
        )
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(
            "nccl" if torch.cuda.is_available() else "gloo",
            store=dist.PrefixStore(f"embank-dlrm/attempt-{attempt}", store),
            rank=rank,
            world_size=world,
            timeout=timeout,
        )
    # A rank restarted by torchrun (--max-restarts) resumes from the last checkpoint.
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        args.resume = True
    if rank != 0:
        args.quiet = True

    def barrier() -> None:
        if dist is not None:
            dist.barrier()

    args.work.mkdir(parents=True, exist_ok=True)
    train_files, test_files = [Path(x) for x in args.train], [Path(x) for x in args.test]
    cards: list[int] = []
    if args.synthetic:
        tag = f"synthetic-{args.synthetic}-{args.synthetic_scale}-{args.seed}"
        train_files, test_files = [args.work / f"{tag}-train.tsv"], [args.work / f"{tag}-test.tsv"]
        for f, rows, part in (
            (train_files[0], args.synthetic, 0),
            (test_files[0], max(args.synthetic // 5, 1), 1),
        ):
            if not f.exists() and rank == 0:
                print(f"writing {rows} synthetic examples to {f}", file=sys.stderr)
                ds.write_synthetic(f, rows, seed=args.seed, part=part, scale=args.synthetic_scale)
        barrier()
        cards = ds.synthetic_cardinalities(args.synthetic_scale)
    hash_size = None if args.synthetic else args.hash_size

    # --- the store, back at the checkpoint the dense part was saved with ---
    store_dir = args.work / ("baseline-scratch" if args.baseline else "store")
    ckpt_file = args.work / "dense.pt"
    state = torch.load(ckpt_file, weights_only=False) if args.resume and ckpt_file.exists() else None
    if args.resume and state is None:
        print("no checkpoint to resume from: starting afresh", file=sys.stderr)
    remote = bool(args.connect or args.local_shards)
    if state is None and rank == 0:
        import shutil

        if not remote:
            shutil.rmtree(store_dir, ignore_errors=True)
        ckpt_file.unlink(missing_ok=True)
    barrier()
    vocab_rows = sum(cards) if cards else ds.NUM_SPARSE * (hash_size or 10_000_000)
    opts: dict[str, Any] = {}
    if args.medium == "block" and args.cache_fraction is not None:
        # A table's bytes: each row and its Adagrad state (dim floats each).
        opts["cache_bytes"] = max(1 << 20, int(vocab_rows * args.dim * 8 * args.cache_fraction))
    if remote:
        import shards

        if args.local_shards:
            if rank == 0:
                shards.start(args.work, args.local_shards, fresh=state is None)
            barrier()
            addrs = shards.running(args.work)
            if addrs is None:
                raise RuntimeError(f"the local shards under {args.work} are not running")
        else:
            addrs = args.connect.split(",")
        store = embank.connect(addrs)
        if state is None and rank == 0:
            for name in [f"c{j + 1}" for j in range(ds.NUM_SPARSE)]:
                if name in store.tables():
                    store.drop_table(name)  # a fresh run on shards that trained before
    else:
        store = embank.open(store_dir, **opts)
    start_batch, start_epoch, start_skip = 0, 0, 0
    if state is not None:
        start_batch = int(state["batch"])
        start_epoch, start_skip = int(state["epoch"]), int(state["in_epoch"])
        if not args.baseline and rank == 0:
            # The tables reopen at their last checkpoint; a kill between the tables' and the
            # dense part's checkpoint leaves them one ahead: go back to the dense part's.
            # Running shards kept every push since: return them to it in any case.
            kept = store.checkpoints()
            if remote or (kept and kept[-1] != start_batch):
                store.restore(start_batch)
        print(f"resuming after batch {start_batch}", file=sys.stderr, flush=True)
    barrier()

    # --- the model ---
    bags: list[nn.Module] = []
    tables: list[embank.Table] = []
    vocab = Vocab(cards, args.seed) if args.baseline and cards else None
    collection: nn.Module | None = None
    if args.torchrec:
        keyss = [
            vocab.keys[j] if vocab else np.arange(hash_size or 0, dtype=np.int64)
            for j in range(ds.NUM_SPARSE)
        ]
        collection = TorchRecTables(
            [len(k) for k in keyss], args.dim, args.lr, [init_rows(store, args.dim, k, args) for k in keyss]
        )
    if rank != 0:
        barrier()  # rank 0 creates the tables on the shards first
    for j in range(ds.NUM_SPARSE if collection is None else 0):
        if args.baseline:
            keys = vocab.keys[j] if vocab else np.arange(hash_size, dtype=np.int64)  # type: ignore[arg-type]
            bag = nn.EmbeddingBag(len(keys), args.dim, mode="sum", sparse=True)
            with torch.no_grad():
                bag.weight.copy_(init_rows(store, args.dim, keys, args))
            bags.append(bag)
            continue
        name = f"c{j + 1}"
        if name in store.tables():
            t = store.table(name)
        else:
            t = store.create_table(
                name,
                dim=args.dim,
                init=embank.init.uniform(-args.init, args.init),
                seed=args.seed,
                optimizer=embank.optim.Adagrad(lr=args.lr, eps=1e-10),
                medium=args.medium,
                staleness_bound=args.staleness,
                capacity=max(cards[j] if cards else (hash_size or 1 << 20), 1024),
            )
        tables.append(t)
        bags.append(t.worker(timeout=60) if args.staleness is not None else t)  # type: ignore[arg-type]
    if tables:
        # One fused collection (the default), or one EmbeddingBag module per table.
        if args.per_table:
            bags = [et.EmbeddingBag(s, mode="sum") for s in bags]
        else:
            collection, bags = EmbankTables(bags), []
    if rank == 0:
        barrier()
    torch.manual_seed(args.seed)  # the dense layers start alike whichever tables were built
    model = DLRM(
        bags,
        args.dim,
        [int(x) for x in args.bottom.split(",")],
        [int(x) for x in args.top.split(",")],
        collection,
    )
    dense_opt = torch.optim.Adagrad(
        [q for n, q in model.named_parameters() if not n.startswith(("bags.", "collection."))], lr=args.lr
    )
    sparse_opt: Any
    if args.torchrec:
        sparse_opt = NoSparseStep()
    elif args.baseline:
        sparse_opt = torch.optim.Adagrad([b.weight for b in bags], lr=args.lr, eps=1e-10)  # type: ignore[union-attr]
    else:
        sparse_opt = et.SparseOptimizer(model, delay=args.staleness or 0, distributed=world > 1)
    if state is not None:
        model.load_state_dict(state["model"])
        dense_opt.load_state_dict(state["dense_opt"])
        torch.set_rng_state(state["rng"])
        if args.baseline:
            sparse_opt.load_state_dict(state["sparse_opt"])
    # Many ranks: the dense part under DDP (its gradients averaged), the tables shared.
    train_model: nn.Module = model
    if world > 1:
        train_model = nn.parallel.DistributedDataParallel(model)
    # A test hook: EMBANK_DLRM_KILL=RANK:BATCH SIGKILLs that rank after that batch, once.
    kill_at = None
    if os.environ.get("EMBANK_DLRM_KILL") and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
        kr, kb = os.environ["EMBANK_DLRM_KILL"].split(":")
        kill_at = (int(kr), int(kb))

    def flush() -> None:
        if not args.baseline:
            sparse_opt.flush()

    def checkpoint(batch: int, epoch: int, in_epoch: int) -> None:
        dense = {
            "model": model.state_dict(),
            "dense_opt": dense_opt.state_dict(),
            "batch": batch,
            "epoch": epoch,
            "in_epoch": in_epoch,
            "rng": torch.get_rng_state(),
        }
        if args.baseline:
            atomic_save({**dense, "sparse_opt": sparse_opt.state_dict()}, ckpt_file)
        else:
            # Every rank calls it: a barrier, the tables (every shard) at this batch id, then
            # the dense part once; a kill between the two resumes from here - 1.
            et.checkpoint(store, batch, dense, ckpt_file, sparse=sparse_opt)

    def parsed(files: list[Path], skip: int = 0) -> Iterator[ds.Batch]:
        for b in ds.read_criteo(files, args.batch_size, hash_size=hash_size, skip_batches=skip):
            if vocab is not None:
                vocab.apply(b.sparse)
            if world > 1:
                if len(b) < world:
                    continue  # a last batch too small to give every rank a row
                b = split(b, rank, world)
            yield b

    preloaded = list(parsed(train_files)) if args.preload else None

    def batches(files: list[Path], skip: int = 0) -> Iterator[ds.Batch]:
        if preloaded is not None and files == train_files:
            return iter(preloaded[skip:])
        return parsed(files, skip)

    if args.materialize and tables and state is None:
        materialize(tables, batches(train_files), quiet=args.quiet)
    loss_fn = nn.BCEWithLogitsLoss()
    history: list[dict[str, Any]] = []
    batch_no, examples = start_batch, 0
    t_start = time.perf_counter()
    per_epoch: int | None = None  # known once an epoch has been read through
    for epoch in range(start_epoch, args.epochs):
        skip = start_skip if epoch == start_epoch else 0
        in_epoch = skip
        it: Iterator[ds.Batch] = batches(train_files, skip)
        # Reading ahead pays where a row can be cold (a row cache over the block medium);
        # on the mmap medium every row is already in DRAM.
        if tables and not args.no_lookahead and args.medium == "block":
            if isinstance(collection, EmbankTables):
                it = collection.ebc.prefetch(it, lambda b: torch.from_numpy(b.sparse))
            else:
                it = et.lookahead(it, lambda b: {t: b.sparse[:, j] for j, t in enumerate(tables)})
        bar = None
        if tqdm is not None and not args.quiet:
            bar = tqdm(
                it,
                desc=f"epoch {epoch + 1}/{args.epochs}",
                unit="batch",
                initial=skip,
                total=per_epoch,
                dynamic_ncols=True,
                file=sys.stderr,
            )
            it = iter(bar)
        for b in it:
            logits = train_model(torch.from_numpy(b.dense), torch.from_numpy(b.sparse))
            loss = loss_fn(logits, torch.from_numpy(b.labels))
            dense_opt.zero_grad()
            sparse_opt.zero_grad()
            loss.backward()
            dense_opt.step()
            sparse_opt.step()
            batch_no += 1
            in_epoch += 1
            examples += len(b)
            if bar is not None:
                rate = examples / max(time.perf_counter() - t_start, 1e-9)
                bar.set_postfix(loss=f"{loss.item():.4f}", ex_per_s=f"{rate:,.0f}", refresh=False)
            if args.checkpoint_every and batch_no % args.checkpoint_every == 0:
                checkpoint(batch_no, epoch, in_epoch)
                if args.quiet and rank == 0:
                    print(f"checkpoint {batch_no}", flush=True)
            if kill_at is not None and kill_at == (rank, batch_no):
                import signal

                print(
                    f"rank {rank}: killed after batch {batch_no} (EMBANK_DLRM_KILL)",
                    file=sys.stderr,
                    flush=True,
                )
                os.kill(os.getpid(), signal.SIGKILL)
            if args.eval_every and batch_no % args.eval_every == 0 and test_files:
                flush()
                m = evaluate(model, batches(test_files), dist)
                history.append({"batch": batch_no, **m})
                print(f"batch {batch_no}: auc {m['auc']:.4f} logloss {m['logloss']:.4f}", file=sys.stderr)
        if bar is not None:
            bar.close()
        per_epoch = in_epoch
    flush()
    barrier()
    elapsed = time.perf_counter() - t_start
    if dist is not None:
        total = torch.tensor([examples], dtype=torch.int64)
        dist.all_reduce(total)
        examples = int(total.item())
    result: dict[str, Any] = {
        "mode": "torchrec" if args.torchrec else "baseline" if args.baseline else f"embank-{args.medium}",
        "staleness": args.staleness,
        "batches": batch_no,
        "examples_trained": examples,
        "seconds": elapsed,
        "examples_per_s": examples / elapsed if elapsed > 0 else 0.0,
        "history": history,
        "world_size": world,
    }
    if not args.baseline and not remote:
        st = store.stats()
        hits = sum(t["cache_hits"] for t in st["tables"])
        misses = sum(t["cache_misses"] for t in st["tables"])
        result["rows"] = st["rows"]
        result["cache_budget_bytes"] = st["cache"]["budget_bytes"] if args.medium == "block" else 0
        result["cache_hit_rate"] = hits / (hits + misses) if hits + misses else None
        result["cache_hits"], result["cache_misses"] = hits, misses
        result["lookahead_rows"] = sum(t["lookahead_rows"] for t in st["tables"])
        result["medium_rows_read"] = sum(t["medium_rows_read"] for t in st["tables"])
        if st["cache"]:
            result["rows_written_back"] = st["cache"]["rows_written_back"]
        result["device_reads"], result["device_writes"] = st["io"]["reads"], st["io"]["writes"]
    if remote:
        result["rows"] = store.stats()["rows"]
        result["shards"] = len(store.served())
    if test_files:
        result.update(evaluate(model, batches(test_files), dist))
    if test_files and rank == 0:
        print(
            f"test: auc {result['auc']:.4f} logloss {result['logloss']:.4f} "
            f"({result['examples_per_s']:,.0f} examples/s)",
            file=sys.stderr,
        )
    if args.serve_dtypes and test_files:
        result["serve"] = serve_compact(args, model, tables, lambda: batches(test_files), result)
    if args.gpu_cache_rows and test_files and tables:
        result["gpu_cache"] = eval_gpu_cache(args, model, tables, lambda: batches(test_files), result)
    if args.metrics_out and rank == 0:
        args.metrics_out.write_text(json.dumps(result, indent=1))
    store.close()
    barrier()
    if args.local_shards and not args.keep_shards and rank == 0:
        import shards

        shards.stop(args.work)
    if dist is not None:
        dist.destroy_process_group()
    return 0


def eval_gpu_cache(
    args: argparse.Namespace,
    model: DLRM,
    tables: list[embank.Table],
    test: Any,
    trained: dict[str, Any],
) -> dict[str, Any]:
    """Evaluates with every table behind an ``embank.gpu.GpuCache`` (sync inserts, so
    every row is the table's): the AUC must be the plain evaluation's."""
    from embank.gpu import GpuCache

    trained_bags, trained_collection = model.bags, model.collection
    model.collection = None
    caches = [GpuCache(t, rows_max=args.gpu_cache_rows, insert="sync") for t in tables]
    model.bags = nn.ModuleList([et.EmbeddingBag(c, mode="sum") for c in caches])
    m = evaluate(model, test())
    st = [c.stats() for c in caches]
    hits, misses = sum(s["hits"] for s in st), sum(s["misses"] for s in st)
    out = {
        **m,
        "auc_delta": m["auc"] - trained["auc"],
        "hit_rate": hits / (hits + misses) if hits + misses else None,
        "device": st[0]["device"],
        "kernels": st[0]["kernels"],
    }
    print(
        f"through the GPU cache ({out['device']}, {out['kernels']} kernels): auc {m['auc']:.4f} "
        f"({out['auc_delta']:+.5f}), hit rate {out['hit_rate'] or 0:.3f}",
        file=sys.stderr,
    )
    for c in caches:
        c.close()
    model.bags, model.collection = trained_bags, trained_collection
    return out


def serve_compact(
    args: argparse.Namespace,
    model: DLRM,
    tables: list[embank.Table],
    test: Any,
    trained: dict[str, Any],
) -> dict[str, Any]:
    """Exports the trained f32 tables into tables of each ``--serve-dtypes`` type (a store
    each, the same initializer for ids the test data adds), swaps them into the model and
    evaluates: the AUC of serving compact rows against serving the f32 rows."""
    import shutil

    out: dict[str, Any] = {}
    trained_bags, trained_collection = model.bags, model.collection
    model.collection = None
    for dt in [d for d in args.serve_dtypes.split(",") if d]:
        path = args.work / f"serve-{dt}"
        shutil.rmtree(path, ignore_errors=True)
        served = embank.open(path)
        bags: list[nn.Module] = []
        for t in tables:
            s = served.create_table(
                t.name,
                dim=args.dim,
                dtype=dt,
                init=embank.init.uniform(-args.init, args.init),
                seed=args.seed,
                capacity=max(len(t) * 2, 1024),
            )
            for keys, rows in t.export():
                s.push(keys, rows)
            bags.append(et.EmbeddingBag(s, mode="sum"))
        model.bags = nn.ModuleList(bags)
        m = evaluate(model, test())
        st = served.stats()["tables"]
        rows_bytes = sum(t["rows"] * t["record_bytes"] for t in st)
        out[dt] = {
            **m,
            "auc_delta": m["auc"] - trained["auc"],
            "record_bytes": st[0]["record_bytes"],
            "rows_bytes": rows_bytes,
        }
        print(
            f"served as {dt}: auc {m['auc']:.4f} ({m['auc'] - trained['auc']:+.5f} against f32), "
            f"logloss {m['logloss']:.4f}, {st[0]['record_bytes']} B records, "
            f"{rows_bytes / 2**20:.1f} MiB of rows",
            file=sys.stderr,
        )
        served.close()
    model.bags, model.collection = trained_bags, trained_collection
    return out


if __name__ == "__main__":
    sys.exit(main())
