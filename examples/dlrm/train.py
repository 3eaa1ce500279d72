#!/usr/bin/env python3
"""DLRM on Criteo-format click logs with its 26 embedding tables in embank.

    python examples/dlrm/train.py --synthetic 200000 --work /tmp/dlrm
    python examples/dlrm/train.py --train day_0.tsv --test day_1.tsv --work /data/dlrm --checkpoint-every 1000
    torchrun --nproc_per_node 2 examples/dlrm/train.py --synthetic 200000 --work /tmp/dlrm --local-shards 2

The model (``model.py``): bottom MLP over the 13 integer features, one pooled embedding
per categorical feature, dot interaction, top MLP. The tables are embank tables (Adagrad
in the store) behind one fused ``embank.torch.EmbeddingBagCollection``, trained by a
``SparseOptimizer``; the dense part by ``torch.optim.Adagrad``. Every
``--checkpoint-every`` batches the tables and the dense part are checkpointed under the
same batch id; ``--resume`` (after a crash or a kill) continues from the last one.

Many trainers: under ``torchrun`` the ranks share the tables on ``embank serve`` shards
(``--local-shards N`` starts them, ``--connect`` names running ones), split every global
batch, keep the dense part under ``DistributedDataParallel`` and give each row one update
per step for the whole batch, so the run reproduces one process. Checkpoints are
coordinated; a rank restarted by ``torchrun --max-restarts`` resumes every rank and shard.

Another shard count: the local shards keep their stores in ``WORK/shards/<i>/store``.
With them stopped (a finished run stops them), move ``WORK/shards`` aside, run
``embank reshard --from OLD/0/store OLD/1/store --to WORK/shards/0/store ...
WORK/shards/2/store``, then ``--resume --local-shards 3``: training goes on from the
checkpoint exactly as it would have on 2 shards (tests/python/test_dlrm_reshard.py).

Comparisons (``torch.nn.EmbeddingBag``, TorchRec, per-table modules, serving compact
rows) are in ``bench/dlrm_compare.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import embank
import embank.datasets as ds
import embank.torch as et
import shards
import torch
from model import DLRM, evaluate
from ranks import Ranks
from torch import nn

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover - the bar is optional
    tqdm = None

FEATURES = [f"c{j + 1}" for j in range(ds.NUM_SPARSE)]


def parser(description: str | None = __doc__) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    data = p.add_argument_group("data")
    data.add_argument("--train", nargs="*", default=[], help="Criteo-format TSV files to train on")
    data.add_argument("--test", nargs="*", default=[], help="Criteo-format TSV files to evaluate on")
    data.add_argument(
        "--synthetic", type=int, default=0, metavar="ROWS", help="or write ROWS (+ROWS/5 test) here"
    )
    data.add_argument("--synthetic-scale", type=int, default=100_000, help="values of the largest feature")
    data.add_argument("--hash-size", type=int, default=None, help="categorical ids modulo this")
    train = p.add_argument_group("training")
    train.add_argument("--work", required=True, type=Path, help="directory for the store, checkpoints, data")
    train.add_argument("--epochs", type=int, default=1)
    train.add_argument("--batch-size", type=int, default=512, help="the global batch (split across ranks)")
    train.add_argument("--dim", type=int, default=16)
    train.add_argument("--bottom", default="64,32", help="bottom MLP hidden sizes")
    train.add_argument("--top", default="128,64", help="top MLP hidden sizes")
    train.add_argument("--lr", type=float, default=0.05, help="Adagrad learning rate (dense and tables)")
    train.add_argument("--init", type=float, default=0.05, help="rows start uniform in [-init, init)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    train.add_argument("--eval-every", type=int, default=0, help="also evaluate every N batches")
    train.add_argument("--checkpoint-every", type=int, default=0, help="checkpoint every N batches (0: no)")
    train.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --work")
    train.add_argument("--metrics-out", type=Path, default=None, help="write the final metrics here as JSON")
    train.add_argument("--quiet", action="store_true", help="no progress bar; print checkpoints on stdout")
    tables = p.add_argument_group("tables")
    tables.add_argument("--medium", choices=["mmap", "block"], default="mmap", help="medium of the tables")
    tables.add_argument(
        "--cache-fraction", type=float, help="block medium: a DRAM row cache of this fraction"
    )
    tables.add_argument(
        "--staleness", type=int, metavar="K", help="SSP: gradients reach the tables K steps late"
    )
    tables.add_argument(
        "--connect",
        metavar="ADDRS",
        help="tables on running `embank serve` shards (host:port,..), or a cluster file (cluster.toml)",
    )
    tables.add_argument(
        "--local-shards", type=int, default=0, metavar="N", help="start N local shards for them"
    )
    tables.add_argument("--keep-shards", action="store_true", help="leave --local-shards running at the end")
    return p


def check(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    if not args.synthetic and not args.train:
        p.error("give --train files or --synthetic ROWS")
    if args.connect and args.local_shards:
        p.error("give --connect or --local-shards, not both")
    remote = bool(args.connect or args.local_shards)
    if remote and (args.cache_fraction is not None or args.medium != "mmap"):
        p.error("--medium and --cache-fraction are the shards' own settings (their serve config)")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        if not remote:
            p.error("torchrun's ranks share the tables on shards: give --local-shards or --connect")
        if args.staleness is not None:
            p.error("under torchrun every step updates each row once for all ranks: no --staleness")
    return args


def data(args: argparse.Namespace, ranks: Ranks) -> tuple[list[Path], list[Path], list[int]]:
    """Training and test files, and the synthetic features' cardinalities (none for files)."""
    args.work.mkdir(parents=True, exist_ok=True)
    if not args.synthetic:
        return [Path(x) for x in args.train], [Path(x) for x in args.test], []
    tag = f"synthetic-{args.synthetic}-{args.synthetic_scale}-{args.seed}"
    train, test = args.work / f"{tag}-train.tsv", args.work / f"{tag}-test.tsv"
    for f, rows, part in ((train, args.synthetic, 0), (test, max(args.synthetic // 5, 1), 1)):
        if not f.exists() and ranks.rank == 0:
            print(f"writing {rows} synthetic examples to {f}", file=sys.stderr)
            ds.write_synthetic(f, rows, seed=args.seed, part=part, scale=args.synthetic_scale)
    ranks.barrier()
    return [train], [test], ds.synthetic_cardinalities(args.synthetic_scale)


def open_store(args: argparse.Namespace, ranks: Ranks, cards: list[int], fresh: bool) -> embank.Store:
    """The tables' store: embedded under ``--work``, or on ``embank serve`` shards every
    rank shares (``--connect``, or ``--local-shards`` started by rank 0)."""
    if args.connect:
        store = embank.connect(args.connect if args.connect.endswith(".toml") else args.connect.split(","))
    elif args.local_shards:
        store = embank.connect(shards.shared(args.work, args.local_shards, fresh, ranks.rank, ranks.barrier))
    else:
        if fresh:
            shutil.rmtree(args.work / "store", ignore_errors=True)
        opts: dict[str, Any] = {}
        if args.medium == "block" and args.cache_fraction is not None:
            # A table's bytes: each row and its Adagrad state (dim floats each).
            rows = sum(cards) if cards else ds.NUM_SPARSE * (args.hash_size or 10_000_000)
            opts["cache_bytes"] = max(1 << 20, int(rows * args.dim * 8 * args.cache_fraction))
        return embank.open(args.work / "store", **opts)
    if fresh and ranks.rank == 0:
        for name in FEATURES:
            if name in store.tables():
                store.drop_table(name)  # a fresh run on shards that trained before
    return store


def tables_of(store: embank.Store, args: argparse.Namespace, cards: list[int], ranks: Ranks) -> list[Any]:
    """One table per categorical feature (Adagrad in the store), or the existing ones."""
    tables = []
    with ranks.rank_zero_first():  # rank 0 creates them while the others wait
        for j, name in enumerate(FEATURES):
            if name in store.tables():
                tables.append(store.table(name))
                continue
            t = store.create_table(
                name,
                dim=args.dim,
                init=embank.init.uniform(-args.init, args.init),
                seed=args.seed,
                optimizer=embank.optim.Adagrad(lr=args.lr, eps=1e-10),
                medium=args.medium,
                staleness_bound=args.staleness,
                capacity=max(cards[j] if cards else (args.hash_size or 1 << 20), 1024),
            )
            tables.append(t)
    return tables


def last_checkpoint(args: argparse.Namespace, ranks: Ranks) -> dict[str, Any] | None:
    """The dense part's last checkpoint with ``--resume``; None for a fresh run."""
    dense_file = args.work / "dense.pt"
    state = torch.load(dense_file, weights_only=False) if args.resume and dense_file.exists() else None
    if args.resume and state is None:
        print("no checkpoint to resume from: starting afresh", file=sys.stderr)
    if state is None and ranks.rank == 0:
        dense_file.unlink(missing_ok=True)
    ranks.barrier()
    return state


def rewind(store: embank.Store, batch: int, ranks: Ranks) -> None:
    """The tables back at the dense part's checkpoint. They reopen at their last one; a
    kill between the tables' and the dense part's checkpoint leaves them one ahead.
    Running shards kept every push since: return them to it in any case."""
    if ranks.rank == 0:
        kept = store.checkpoints()
        if store.remote or (kept and kept[-1] != batch):
            store.restore(batch)
    print(f"resuming after batch {batch}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = check(p, p.parse_args(argv))
    if args.threads:
        torch.set_num_threads(args.threads)
    ranks = Ranks()
    args.resume |= ranks.restarted  # a rank restarted by torchrun resumes from the last checkpoint
    args.quiet |= ranks.rank != 0
    train_files, test_files, cards = data(args, ranks)
    state = last_checkpoint(args, ranks)
    store = open_store(args, ranks, cards, fresh=state is None)
    if state is not None:
        rewind(store, int(state["batch"]), ranks)
    ranks.barrier()

    # The model: 26 tables in one fused collection, the dense part in torch.
    tables = tables_of(store, args, cards, ranks)
    sources = [t.worker(timeout=60) if args.staleness is not None else t for t in tables]
    collection = et.EmbeddingBagCollection(dict(zip(FEATURES, sources)), mode="sum")
    torch.manual_seed(args.seed)
    sizes = [int(x) for x in args.bottom.split(",")], [int(x) for x in args.top.split(",")]
    model = DLRM(collection, args.dim, *sizes)

    result = train(args, ranks, store, model, state, train_files, test_files)
    if store.remote:
        result["shards"] = len(store.served())
    if test_files:
        result.update(evaluate(model, batches(args, ranks, test_files), ranks))
        if ranks.rank == 0:
            line = f"test: auc {result['auc']:.4f} logloss {result['logloss']:.4f}"
            print(f"{line} ({result['examples_per_s']:,.0f} examples/s)", file=sys.stderr)
    if args.metrics_out and ranks.rank == 0:
        args.metrics_out.write_text(json.dumps(result, indent=1))
    store.close()
    ranks.barrier()
    if args.local_shards and not args.keep_shards and ranks.rank == 0:
        shards.stop(args.work)
    ranks.close()
    return 0


def batches(args: argparse.Namespace, ranks: Ranks, files: list[Path], skip: int = 0) -> Iterator[ds.Batch]:
    """This rank's share of every batch of ``files``, from batch ``skip`` on."""
    hash_size = None if args.synthetic else args.hash_size
    return ranks.share(ds.read_criteo(files, args.batch_size, hash_size=hash_size, skip_batches=skip))


def train(
    args: argparse.Namespace,
    ranks: Ranks,
    store: embank.Store,
    model: DLRM,
    state: dict[str, Any] | None,
    train_files: list[Path],
    test_files: list[Path],
) -> dict[str, Any]:
    """The epochs from the checkpoint ``state`` (or the start), checkpointing every
    ``--checkpoint-every`` batches; returns what was trained and how fast."""
    dense_opt = torch.optim.Adagrad(model.dense_parameters(), lr=args.lr)
    # The tables' rows: one update per step (for the whole global batch under torchrun).
    sparse_opt = et.SparseOptimizer(model, delay=args.staleness or 0, distributed=ranks.world > 1)
    if state is not None:
        model.load_state_dict(state["model"])
        dense_opt.load_state_dict(state["dense_opt"])
        torch.set_rng_state(state["rng"])

    def checkpoint(batch: int, epoch: int, in_epoch: int) -> None:
        dense = {"model": model.state_dict(), "dense_opt": dense_opt.state_dict(), "batch": batch,
                 "epoch": epoch, "in_epoch": in_epoch, "rng": torch.get_rng_state()}  # fmt: skip
        # From every rank: a barrier, every table (on every shard) checkpointed at this
        # batch id, then the dense part saved once.
        et.checkpoint(store, batch, dense, args.work / "dense.pt", sparse=sparse_opt)

    def train_batches(skip: int) -> Iterator[ds.Batch]:
        it = batches(args, ranks, train_files, skip)
        if args.medium == "block":  # rows can be cold: read the next batch's while this one trains
            it = model.tables.prefetch(it, lambda b: torch.from_numpy(b.sparse))
        return it

    start = (int(state["batch"]), int(state["epoch"]), int(state["in_epoch"])) if state else (0, 0, 0)
    eval_batches = (lambda: batches(args, ranks, test_files)) if test_files else None
    result = epochs(args, ranks, model, dense_opt, sparse_opt, train_batches, checkpoint, eval_batches, start)
    return {"mode": f"embank-{args.medium}", **result, "rows": store.stats()["rows"]}


def epochs(
    args: argparse.Namespace,
    ranks: Ranks,
    model: nn.Module,
    dense_opt: torch.optim.Optimizer,
    sparse_opt: Any,
    train_batches: Callable[[int], Iterator[ds.Batch]],
    checkpoint: Callable[[int, int, int], None],
    eval_batches: Callable[[], Iterator[ds.Batch]] | None,
    start: tuple[int, int, int] = (0, 0, 0),
) -> dict[str, Any]:
    """The training loop of ``args.epochs`` epochs (this one and ``bench/dlrm_compare.py``'s):
    ``train_batches(skip)`` yields an epoch's batches from batch ``skip`` on, ``checkpoint(
    batch, epoch, in_epoch)`` runs every ``--checkpoint-every`` batches, ``eval_batches()``
    every ``--eval-every``. ``start`` is (batches trained, epoch, batches into it). A
    ``sparse_opt`` with a ``flush`` (the store's) is flushed before each evaluation and at
    the end. Returns the trained batches, examples and time, and the evaluations."""
    flush = getattr(sparse_opt, "flush", lambda: None)
    train_model = ranks.parallel(model)  # several ranks: the dense gradients averaged
    loss_fn = nn.BCEWithLogitsLoss()
    history: list[dict[str, Any]] = []
    batch_no, start_epoch, skip = start
    examples, per_epoch = 0, None
    t_start = time.perf_counter()
    for epoch in range(start_epoch, args.epochs):
        in_epoch = skip if epoch == start_epoch else 0
        it = train_batches(in_epoch)
        bar = None
        if tqdm is not None and not args.quiet:
            it = bar = tqdm(it, f"epoch {epoch + 1}/{args.epochs}", per_epoch, unit="batch", initial=in_epoch)
        for b in it:
            logits = train_model(torch.from_numpy(b.dense), torch.from_numpy(b.sparse))
            loss = loss_fn(logits, torch.from_numpy(b.labels))
            dense_opt.zero_grad()
            sparse_opt.zero_grad()
            loss.backward()
            dense_opt.step()
            sparse_opt.step()
            batch_no, in_epoch, examples = batch_no + 1, in_epoch + 1, examples + len(b)
            if bar is not None:
                rate = examples / max(time.perf_counter() - t_start, 1e-9)
                bar.set_postfix(loss=f"{loss.item():.4f}", ex_per_s=f"{rate:,.0f}", refresh=False)
            if args.checkpoint_every and batch_no % args.checkpoint_every == 0:
                checkpoint(batch_no, epoch, in_epoch)
                if args.quiet and ranks.rank == 0:
                    print(f"checkpoint {batch_no}", flush=True)
            ranks.kill_hook(batch_no)
            if args.eval_every and batch_no % args.eval_every == 0 and eval_batches is not None:
                flush()
                m = evaluate(model, eval_batches(), ranks)
                history.append({"batch": batch_no, **m})
                print(f"batch {batch_no}: auc {m['auc']:.4f} logloss {m['logloss']:.4f}", file=sys.stderr)
        per_epoch = in_epoch
    flush()
    ranks.barrier()
    elapsed = time.perf_counter() - t_start
    examples = ranks.sum(examples)
    return {
        "staleness": args.staleness,
        "batches": batch_no,
        "examples_trained": examples,
        "seconds": elapsed,
        "examples_per_s": examples / elapsed if elapsed > 0 else 0.0,
        "history": history,
        "world_size": ranks.world,
    }


if __name__ == "__main__":
    sys.exit(main())
