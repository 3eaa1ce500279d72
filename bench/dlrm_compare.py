#!/usr/bin/env python3
"""The DLRM example (examples/dlrm/train.py) as a benchmark: the same model, data and
flags, with other tables beside embank's fused collection, and the measurements.

    python bench/dlrm_compare.py --synthetic 400000 --threads 2 --work W --preload [--baseline | --torchrec]
    python bench/dlrm_compare.py --synthetic 400000 --threads 2 --work W --serve-dtypes f16,int8

``--baseline`` trains the same model with ``torch.nn.EmbeddingBag(sparse=True)`` and
``torch.optim.Adagrad`` in DRAM, starting from the rows embank's initializer gives the
same ids, so both runs are one model; ``--torchrec`` with TorchRec's
``FusedEmbeddingBagCollection`` (fbgemm's CPU kernels, Adagrad fused into backward);
``--per-table`` with one ``embank.torch.EmbeddingBag`` per table instead of the fused
collection. ``--materialize`` creates every row the training set touches before the
timed steps, as the torch tables are allocated up front; ``--preload`` parses the
training files first, so examples/s times training only. After training,
``--serve-dtypes f16,int8`` serves the trained tables as compact rows (exported into
tables of each type) and ``--gpu-cache-rows N`` evaluates through an
``embank.gpu.GpuCache`` of N rows per table, each reporting its test AUC against the
f32 tables'. ``--metrics-out`` writes every number as JSON (bench/dlrm_fused.sh reads
it); runs under ``torchrun`` as the example does (``--local-shards``, ``--connect``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "dlrm"))
import shards
import train
from model import DLRM, evaluate
from ranks import Ranks

FEATURES = train.FEATURES


class PerTable(nn.Module):
    """One module per feature called with ``(ids, offsets)`` (``torch.nn.EmbeddingBag``,
    ``embank.torch.EmbeddingBag``), as DLRM's tables: ``(n, 26)`` ids in, pooled rows out."""

    def __init__(self, bags: list[nn.Module]) -> None:
        super().__init__()
        self.bags = nn.ModuleList(bags)

    def forward(self, sparse: torch.Tensor) -> dict[str, torch.Tensor]:
        offsets = torch.arange(sparse.shape[0], dtype=torch.int64)
        return {
            n: bag(sparse[:, j].contiguous(), offsets) for j, (n, bag) in enumerate(zip(FEATURES, self.bags))
        }


class TorchRecTables(nn.Module):
    """TorchRec's FusedEmbeddingBagCollection (fbgemm's CPU kernels, Adagrad fused into
    backward) over the same 26 features, for the --torchrec comparison."""

    def __init__(self, sizes: list[int], dim: int, lr: float, init: list[torch.Tensor]) -> None:
        super().__init__()
        from torchrec import EmbeddingBagConfig
        from torchrec.modules.embedding_configs import PoolingType
        from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection

        tables = [
            EmbeddingBagConfig(
                name=f"t_{n}",
                embedding_dim=dim,
                num_embeddings=size,
                feature_names=[n],
                pooling=PoolingType.SUM,
            )
            for n, size in zip(FEATURES, sizes)
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

    def forward(self, sparse: torch.Tensor) -> dict[str, torch.Tensor]:
        from torchrec import KeyedJaggedTensor

        n = sparse.shape[0]
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=FEATURES,
            values=sparse.t().reshape(-1),
            lengths=torch.ones(n * len(FEATURES), dtype=torch.int32),
        )
        pooled = self.ebc(kjt).to_dict()
        return {k: pooled[k] for k in FEATURES}


class NoSparseStep:
    """The sparse optimizer of --torchrec: fused into backward, nothing to do."""

    def step(self) -> None: ...

    def zero_grad(self) -> None: ...

    def flush(self) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return {}


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
    p = train.parser(__doc__)
    g = p.add_argument_group("comparison")
    g.add_argument(
        "--baseline",
        action="store_true",
        help="torch.nn.EmbeddingBag(sparse=True) + torch.optim.Adagrad in DRAM instead of embank",
    )
    g.add_argument(
        "--torchrec",
        action="store_true",
        help="TorchRec FusedEmbeddingBagCollection (fbgemm-gpu-cpu) in DRAM instead of embank",
    )
    g.add_argument(
        "--per-table",
        action="store_true",
        help="one embank.torch.EmbeddingBag per table (a pull and a push_grad each per step) instead "
        "of the fused EmbeddingBagCollection (one native call each way)",
    )
    g.add_argument(
        "--materialize",
        action="store_true",
        help="create every row the training set touches before training starts, as TorchRec and "
        "nn.EmbeddingBag allocate theirs up front (the rows a first pull would create: same results); "
        "by default embank creates a row at its first pull, inside the timed steps",
    )
    g.add_argument(
        "--preload",
        action="store_true",
        help="parse the training files into memory first: examples/s then times training only",
    )
    g.add_argument(
        "--no-lookahead",
        action="store_true",
        help="do not read the next batch's rows ahead of its step (on by default with --medium block)",
    )
    g.add_argument(
        "--serve-dtypes",
        default="",
        metavar="LIST",
        help="after training, serve the tables as these element types (e.g. f16,int8) and "
        "report each one's test AUC next to the f32 tables'",
    )
    g.add_argument(
        "--gpu-cache-rows",
        type=int,
        default=0,
        metavar="N",
        help="after training, also evaluate through an embank.gpu.GpuCache of N rows per table "
        "(sync inserts; on CUDA if present, else the CPU) and report its AUC and hit rate",
    )
    args = train.check(p, p.parse_args(argv))
    if args.resume:
        p.error("the bench times fresh runs: no --resume (examples/dlrm/train.py resumes)")
    if args.materialize and (args.torchrec or args.baseline):
        p.error("--materialize applies to embank tables (--torchrec, --baseline allocate every row up front)")
    if args.torchrec:
        if args.checkpoint_every:
            p.error("--torchrec is for comparison runs: no --checkpoint-every")
        args.baseline = True  # DRAM tables indexed by dense ids, like --baseline
    if args.baseline and not args.synthetic and args.hash_size is None:
        p.error("--baseline on Criteo files needs --hash-size (fixed-size torch tables)")
    if args.serve_dtypes and (args.baseline or not (args.test or args.synthetic)):
        p.error("--serve-dtypes serves embank tables and needs test data")
    if args.baseline and (args.staleness is not None or args.medium != "mmap"):
        p.error("--staleness and --medium apply to embank tables, not --baseline")
    if (args.connect or args.local_shards) and args.baseline:
        p.error("--connect/--local-shards hold embank tables: not with --baseline or --torchrec")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and (args.serve_dtypes or args.gpu_cache_rows):
        p.error("--serve-dtypes and --gpu-cache-rows are single-process evaluations")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    ranks = Ranks()
    args.quiet |= ranks.rank != 0
    train_files, test_files, cards = train.data(args, ranks)
    hash_size = None if args.synthetic else args.hash_size
    remote = bool(args.connect or args.local_shards)
    ckpt_file = args.work / "dense.pt"
    if ranks.rank == 0:
        ckpt_file.unlink(missing_ok=True)
    ranks.barrier()

    # --- the tables: torch's or TorchRec's in DRAM, or embank's (fused or per table) ---
    vocab = Vocab(cards, args.seed) if args.baseline and cards else None
    tables: list[embank.Table] = []
    if args.baseline:
        shutil.rmtree(args.work / "baseline-scratch", ignore_errors=True)
        store = embank.open(args.work / "baseline-scratch")  # for init_rows
        keyss = [
            vocab.keys[j] if vocab else np.arange(hash_size or 0, dtype=np.int64)
            for j in range(ds.NUM_SPARSE)
        ]
        embeddings: nn.Module
        if args.torchrec:
            inits = [init_rows(store, args.dim, k, args) for k in keyss]
            embeddings = TorchRecTables([len(k) for k in keyss], args.dim, args.lr, inits)
        else:
            bags = []
            for keys in keyss:
                bag = nn.EmbeddingBag(len(keys), args.dim, mode="sum", sparse=True)
                with torch.no_grad():
                    bag.weight.copy_(init_rows(store, args.dim, keys, args))
                bags.append(bag)
            embeddings = PerTable(bags)
    else:
        store = train.open_store(args, ranks, cards, fresh=True)
        tables = train.tables_of(store, args, cards, ranks)
        sources = [t.worker(timeout=60) if args.staleness is not None else t for t in tables]
        if args.per_table:
            embeddings = PerTable([et.EmbeddingBag(s, mode="sum") for s in sources])
        else:
            embeddings = et.EmbeddingBagCollection(dict(zip(FEATURES, sources)), mode="sum")
    torch.manual_seed(args.seed)  # the dense layers start alike whichever tables were built
    model = DLRM(
        embeddings, args.dim, [int(x) for x in args.bottom.split(",")], [int(x) for x in args.top.split(",")]
    )
    dense_opt = torch.optim.Adagrad(model.dense_parameters(), lr=args.lr)
    sparse_opt: Any
    if args.torchrec:
        sparse_opt = NoSparseStep()
    elif args.baseline:
        sparse_opt = torch.optim.Adagrad([b.weight for b in embeddings.bags], lr=args.lr, eps=1e-10)
    else:
        sparse_opt = et.SparseOptimizer(model, delay=args.staleness or 0, distributed=ranks.world > 1)

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
            et.checkpoint(store, batch, dense, ckpt_file, sparse=sparse_opt)

    def parsed(files: list[Path]) -> Iterator[ds.Batch]:
        for b in ds.read_criteo(files, args.batch_size, hash_size=hash_size):
            if vocab is not None:
                vocab.apply(b.sparse)
            yield b

    preloaded = list(ranks.share(parsed(train_files))) if args.preload else None

    def batches(files: list[Path]) -> Iterator[ds.Batch]:
        if preloaded is not None and files == train_files:
            return iter(preloaded)
        return ranks.share(parsed(files))

    if args.materialize and tables:
        materialize(tables, batches(train_files), quiet=args.quiet)

    # --- training, timed: examples/dlrm/train.py's loop ---
    def train_batches(skip: int) -> Iterator[ds.Batch]:
        it: Iterator[ds.Batch] = batches(train_files)
        # Reading ahead pays where a row can be cold (a row cache over the block medium);
        # on the mmap medium every row is already in DRAM.
        if tables and not args.no_lookahead and args.medium == "block":
            if isinstance(embeddings, et.EmbeddingBagCollection):
                it = embeddings.prefetch(it, lambda b: torch.from_numpy(b.sparse))
            else:
                it = et.lookahead(it, lambda b: {t: b.sparse[:, j] for j, t in enumerate(tables)})
        return it

    eval_batches = (lambda: batches(test_files)) if test_files else None
    trained = train.epochs(args, ranks, model, dense_opt, sparse_opt, train_batches, checkpoint, eval_batches)

    # --- what it measured ---
    mode = "torchrec" if args.torchrec else "baseline" if args.baseline else f"embank-{args.medium}"
    result: dict[str, Any] = {"mode": mode, **trained}
    if not args.baseline and not remote:
        result.update(store_counters(store, args))
    if remote:
        result["rows"] = store.stats()["rows"]
        result["shards"] = len(store.served())
    if test_files:
        result.update(evaluate(model, batches(test_files), ranks))
    if test_files and ranks.rank == 0:
        print(
            f"test: auc {result['auc']:.4f} logloss {result['logloss']:.4f} "
            f"({result['examples_per_s']:,.0f} examples/s)",
            file=sys.stderr,
        )
    if args.serve_dtypes and test_files:
        result["serve"] = serve_compact(args, model, tables, lambda: batches(test_files), result)
    if args.gpu_cache_rows and test_files and tables:
        result["gpu_cache"] = eval_gpu_cache(args, model, tables, lambda: batches(test_files), result)
    if args.metrics_out and ranks.rank == 0:
        args.metrics_out.write_text(json.dumps(result, indent=1))
    store.close()
    ranks.barrier()
    if args.local_shards and not args.keep_shards and ranks.rank == 0:
        shards.stop(args.work)
    ranks.close()
    return 0


def store_counters(store: embank.Store, args: argparse.Namespace) -> dict[str, Any]:
    """The embedded store's rows, row cache and device counters after training."""
    st = store.stats()
    hits = sum(t["cache_hits"] for t in st["tables"])
    misses = sum(t["cache_misses"] for t in st["tables"])
    out: dict[str, Any] = {
        "rows": st["rows"],
        "cache_budget_bytes": st["cache"]["budget_bytes"] if args.medium == "block" else 0,
        "cache_hit_rate": hits / (hits + misses) if hits + misses else None,
        "cache_hits": hits,
        "cache_misses": misses,
        "lookahead_rows": sum(t["lookahead_rows"] for t in st["tables"]),
        "medium_rows_read": sum(t["medium_rows_read"] for t in st["tables"]),
    }
    if st["cache"]:
        out["rows_written_back"] = st["cache"]["rows_written_back"]
    out["device_reads"], out["device_writes"] = st["io"]["reads"], st["io"]["writes"]
    return out


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

    trained_tables = model.tables
    caches = [GpuCache(t, rows_max=args.gpu_cache_rows, insert="sync") for t in tables]
    model.tables = PerTable([et.EmbeddingBag(c, mode="sum") for c in caches])
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
    model.tables = trained_tables
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
    out: dict[str, Any] = {}
    trained_tables = model.tables
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
        model.tables = PerTable(bags)
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
    model.tables = trained_tables
    return out


if __name__ == "__main__":
    sys.exit(main())
