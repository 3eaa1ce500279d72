"""Training DLRM on the device with tables 10x its cache: the check of "train on a GPU with
tables beyond its memory" (``embank.gpu.TrainCache``).

One model (examples/dlrm/model.py: 26 tables of ``--rows`` rows at ``--dim``, Zipf ids,
batches of ``--batch``), trained for ``--steps`` steps after ``--warmup`` three ways, each
in the same run, Adagrad on the tables and SGD on the dense part:

(a) ``resident``: every table a ``torch.nn.EmbeddingBag(sparse=True)`` in device memory,
    ``torch.optim.Adagrad`` on its sparse gradients: the speed of light for a cache;
(b) ``host``: ``embank.torch.EmbeddingBagCollection`` over the tables (pulled and pooled
    on the host, the pooled rows sent up, their gradients down, updated on the host);
(c) ``cache``: a ``TrainCache`` of ``--cache-fraction`` of each table's rows, updates on
    the device, dirty rows written back when evicted: its finds, placements and updates
    through the native kernels (``--kernels native``, the default where they run: CUDA,
    or the CPU in a build with their emulator); ``cache_triton``: the same cache through
    the Triton kernels and PyTorch operations (CUDA only); ``cache_shared``: TorchRec's
    drop-in (``EmbeddingBagCollection.from_configs(..., shared_train_cache=True)``), one
    cache over every table the size of the 26 caches together, a step's ids of every
    feature found, placed, pooled and updated in one call each.

Reported: examples/s of each (median of ``--repeats`` timed windows; ``train.json`` is
rewritten after each way, so a run cut short keeps the ways done), (c) against (a) and
(b), the caches' hit rate beside the hit rate the planner's model predicts for a cache of
that size over the same Zipf (the share of draws falling on the most popular rows), the
rows (c) wrote back, the largest difference between (b)'s and (c)'s losses, and each way's
AUC over held-out batches (the same for every way; goal: (c) within 0.001 of (b)).

``python examples/gpu_cache/train_bench.py --out W`` (CUDA; ``W/train.json``); on the CPU
``--device cpu --small-run`` is a smoke test (``make test`` runs it).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import embank
import embank.datasets as ds
import embank.optim as eo
import numpy as np
import torch
from embank import _gpu_train_native
from embank import torch as et
from embank.gpu import TrainCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dlrm"))
from model import DLRM, auc

LR_TABLES, LR_DENSE = 0.05, 0.1


def zipf_cdf(rows: int, a: float) -> np.ndarray:
    c = np.cumsum(np.arange(1, rows + 1, dtype=np.float64) ** -a)
    return c / c[-1]


def batch(rng: np.random.Generator, n: int, rows: int, cdf: np.ndarray) -> tuple[torch.Tensor, ...]:
    draw = np.minimum(np.searchsorted(cdf, rng.random((n, ds.NUM_SPARSE))), rows - 1)
    sparse = (draw * 2654435761) % rows  # popular ids scattered over the table
    dense = rng.standard_normal((n, ds.NUM_DENSE)).astype(np.float32)
    # The label leans on the first dense feature and on the first table's id (a learned
    # sign a row), so the AUC measures the tables' training too.
    sign = np.where((draw[:, 0] * 40503 >> 4) & 1, 1.0, -1.0)
    labels = (rng.random(n) < 1 / (1 + np.exp(-dense[:, 0] - 0.8 * sign))).astype(np.float32)
    return torch.from_numpy(dense), torch.from_numpy(sparse.astype(np.int64)), torch.from_numpy(labels)


class Resident(torch.nn.Module):
    def __init__(self, rows: int, dim: int, device: torch.device) -> None:
        super().__init__()
        self.bags = torch.nn.ModuleList(
            torch.nn.EmbeddingBag(rows, dim, mode="sum", sparse=True, device=device)
            for _ in range(ds.NUM_SPARSE)
        )
        for b in self.bags:
            torch.nn.init.uniform_(b.weight, -0.05, 0.05)

    def forward(self, sparse: torch.Tensor) -> dict[str, torch.Tensor]:
        return {f"c{i}": b(sparse[:, i : i + 1]) for i, b in enumerate(self.bags)}


class Keyed(torch.nn.Module):
    """A collection's ``KeyedTensor`` as the dict DLRM takes."""

    def __init__(self, ebc: torch.nn.Module) -> None:
        super().__init__()
        self.ebc = ebc

    def forward(self, sparse: torch.Tensor) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = self.ebc(sparse).to_dict()
        return out


class Bags(torch.nn.Module):
    """Per-feature embank bags (one id per feature) in feature order."""

    def __init__(self, bags: list[et.EmbeddingBag]) -> None:
        super().__init__()
        self.bags = torch.nn.ModuleList(bags)

    def forward(self, sparse: torch.Tensor) -> dict[str, torch.Tensor]:
        return {f"c{i}": b(sparse[:, i : i + 1]) for i, b in enumerate(self.bags)}


def run(kind: str, args: argparse.Namespace, device: torch.device, work: Path) -> dict[str, Any]:
    torch.manual_seed(0)
    caches: list[TrainCache] = []
    store = None
    if kind == "resident":
        tables: torch.nn.Module = Resident(args.rows, args.dim, device)
    else:
        store = embank.open(str(work / kind))
        init = embank.init.uniform(-0.05, 0.05)
        opt = eo.Adagrad(lr=LR_TABLES, initial_accumulator_value=0.0, eps=1e-10)
        ts = [
            store.create_table(f"c{i}", dim=args.dim, optimizer=opt, init=init, capacity=max(1024, args.rows))
            for i in range(ds.NUM_SPARSE)
        ]
        if kind == "host":
            tables = et.EmbeddingBagCollection({t.name: t for t in ts}, push="backward")
        elif kind == "cache_shared":  # TorchRec's drop-in, one cache over every table
            configs = [
                et.EmbeddingBagConfig(
                    num_embeddings=args.rows,
                    embedding_dim=args.dim,
                    name=t.name,
                    feature_names=[t.name],
                    weight_init_min=-0.05,
                    weight_init_max=0.05,
                )
                for t in ts
            ]
            ebc = et.EmbeddingBagCollection.from_configs(
                store,
                configs,
                opt,
                train_cache_rows=max(1, int(args.rows * args.cache_fraction)),
                shared_train_cache=True,
                device=device,
                train_cache_options={"kernels": args.kernels},
            )
            caches = ebc.train_caches()
            tables = Keyed(ebc)
        else:
            rows = max(1, int(args.rows * args.cache_fraction))
            kernels = "triton" if kind == "cache_triton" else args.kernels
            caches = [TrainCache(t, rows_max=rows, device=device, kernels=kernels) for t in ts]
            tables = Bags([et.EmbeddingBag(c, "sum", push="backward") for c in caches])
    model = DLRM(tables, args.dim, [64, args.dim], [64, 32]).to(device)
    dense_opt = torch.optim.SGD(model.dense_parameters(), lr=LR_DENSE)
    sparse_opt = torch.optim.Adagrad(tables.parameters(), lr=LR_TABLES) if kind == "resident" else None
    rng = np.random.default_rng(1)
    cdf = zipf_cdf(args.rows, args.zipf)
    losses: list[torch.Tensor] = []
    windows: list[float] = []
    per_window = max(1, args.steps // args.repeats)

    def train_step() -> torch.Tensor:
        dense, sparse, labels = (x.to(device) for x in batch(rng, args.batch, args.rows, cdf))
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, sparse), labels)
        dense_opt.zero_grad()
        if sparse_opt is not None:
            sparse_opt.zero_grad()
        loss.backward()
        dense_opt.step()
        if sparse_opt is not None:
            sparse_opt.step()
        return loss.detach()  # no host wait a step

    for w in range(args.repeats + 1):  # window 0 warms up
        n = args.warmup if w == 0 else per_window
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(n):
            losses.append(train_step())
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if w > 0:
            windows.append(n * args.batch / (time.perf_counter() - t0))
    out: dict[str, Any] = {
        "examples_per_s": float(np.median(windows)),
        "windows": windows,
        "losses": [float(x) for x in losses],
    }
    if args.profile_steps:
        out["profile"] = profile(train_step, args.profile_steps, device)
    out["auc"] = evaluate(model, args, device, cdf)
    if caches:
        st = [c.stats() for c in caches]
        hits, misses = sum(s["hits"] for s in st), sum(s["misses"] for s in st)
        out["hit_rate"] = hits / max(1, hits + misses)
        out["written_back"] = sum(s["written_back"] for s in st)
        out["overflow"] = sum(s["overflow"] for s in st)
        # The planner's model of an LRU cache over a Zipf: the most popular rows' share of draws.
        out["hit_rate_model"] = float(cdf[max(1, int(args.rows * args.cache_fraction)) - 1])
        t0 = time.perf_counter()
        for c in caches:
            c.flush()
        out["flush_s"] = time.perf_counter() - t0
    for c in caches:
        c.close()
    if store is not None:
        store.close()
    return out


def profile(train_step: Any, steps: int, device: torch.device) -> dict[str, float]:
    """Where a step's time goes, over ``steps`` steps under PyTorch's profiler (after the
    timed ones): the host's wall time, PyTorch operations called from Python, and on CUDA
    the kernels run (the native ones too) and the time the device was busy with them. A
    device busy for a small share of the step says the host bounds it."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch_profile(activities=acts) as prof:
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            train_step()
        if cuda:
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
    events = prof.events()
    ops = [
        e
        for e in events
        if e.name.startswith("aten::")
        and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
    ]
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    syncs = [
        e
        for e in events
        if e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
    ]
    return {
        "steps": steps,
        "wall_ms_per_step": wall * 1e3 / steps,
        "torch_ops_per_step": len(ops) / steps,
        "kernels_per_step": len(kernels) / steps,
        "device_busy_ms_per_step": sum(e.device_time for e in kernels) / 1e3 / steps,
        "runtime_syncs_per_step": len(syncs) / steps,
    }


def evaluate(
    model: torch.nn.Module, args: argparse.Namespace, device: torch.device, cdf: np.ndarray
) -> float:
    """AUC over ``--eval-batches`` held-out batches (the same for every way), in eval mode."""
    model.eval()
    rng = np.random.default_rng(99)
    scores, labels = [], []
    with torch.no_grad():
        for _ in range(args.eval_batches):
            dense, sparse, y = (x.to(device) for x in batch(rng, args.batch, args.rows, cdf))
            scores.append(torch.sigmoid(model(dense, sparse)).cpu().numpy())
            labels.append(y.cpu().numpy())
    model.train()
    return auc(np.concatenate(labels), np.concatenate(scores))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="directory for train.json and the stores")
    p.add_argument("--device", default="cuda")
    p.add_argument("--rows", type=int, default=1_000_000, help="rows of each of the 26 tables")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--steps", type=int, default=200, help="timed steps of each way")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--repeats", type=int, default=5, help="timed windows (the median is reported)")
    p.add_argument("--zipf", type=float, default=1.05)
    p.add_argument("--cache-fraction", type=float, default=0.1)
    p.add_argument("--eval-batches", type=int, default=20, help="held-out batches for the AUC")
    p.add_argument("--ways", default="resident,host,cache,cache_shared,cache_triton")
    p.add_argument(
        "--kernels",
        default="auto",
        help='the cache way\'s kernels: "native", "triton", "torch" (default: native where it runs)',
    )
    p.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="after the timed steps, this many under PyTorch's profiler (the host's and the device's time)",
    )
    p.add_argument("--json", type=Path, default=None, help="the results (default: OUT/train.json)")
    p.add_argument("--small-run", action="store_true", help="a smoke test: tiny sizes")
    args = p.parse_args(argv)
    if args.kernels == "auto":
        args.kernels = "native" if _gpu_train_native.usable(torch.device(args.device)) else "torch"
    if args.small_run:
        args.rows, args.dim, args.batch, args.steps, args.warmup, args.repeats = 2000, 8, 64, 6, 2, 2
        args.eval_batches, args.profile_steps = 2, min(args.profile_steps, 2)
    if args.out is None:  # the stores in a directory removed at the end, the figures printed
        with tempfile.TemporaryDirectory(prefix="embank-train-bench-") as tmp:
            return bench(args, Path(tmp))
    return bench(args, args.out)


def bench(args: argparse.Namespace, work: Path) -> int:
    work.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    result: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
    for kind in args.ways.split(","):
        if kind == "cache_triton" and device.type != "cuda":
            print(f"{kind:>8}: skipped (the Triton kernels run on CUDA)", flush=True)
            continue
        try:
            r = run(kind, args, device, work)
        except Exception as e:  # one way failing on a lent GPU must not cost the others
            traceback.print_exc()
            result[kind] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{kind:>8}: failed: {result[kind]['error']}", flush=True)
            (args.json or work / "train.json").write_text(
                json.dumps({k: v for k, v in result.items() if k != "_losses"}, indent=1)
            )
            continue
        result[kind] = {k: v for k, v in r.items() if k != "losses"}
        result[kind]["last_loss"] = r["losses"][-1]
        result.setdefault("_losses", {})[kind] = r["losses"]
        print(
            f"{kind:>8}: {r['examples_per_s']:>12,.0f} examples/s",
            {
                k: v
                for k, v in r.items()
                if k in ("auc", "hit_rate", "hit_rate_model", "written_back", "overflow", "flush_s")
            },
            flush=True,
        )
        (args.json or work / "train.json").write_text(
            json.dumps({k: v for k, v in result.items() if k != "_losses"}, indent=1)
        )
    losses = result.pop("_losses")
    for cache in ("cache", "cache_shared", "cache_triton"):
        for base in ("resident", "host"):
            if "examples_per_s" in result.get(cache, {}) and "examples_per_s" in result.get(base, {}):
                ratio = result[cache]["examples_per_s"] / result[base]["examples_per_s"]
                result[f"{cache}_over_{base}"] = ratio
                print(f"{cache} / {base}: {ratio:.2f}x")
    if "cache" in losses:
        if "host" in losses:
            diff = float(np.max(np.abs(np.array(losses["cache"]) - np.array(losses["host"]))))
            result["largest_loss_difference_cache_host"] = diff
            result["auc_difference_cache_host"] = abs(result["cache"]["auc"] - result["host"]["auc"])
            if "cache_shared" in losses:
                d = float(np.max(np.abs(np.array(losses["cache_shared"]) - np.array(losses["host"]))))
                result["largest_loss_difference_cache_shared_host"] = d
            print(f"largest loss difference, cache against host: {diff:.3g}")
            print(f"AUC difference, cache against host: {result['auc_difference_cache_host']:.2g}")
    (args.json or work / "train.json").write_text(json.dumps(result, indent=1))
    failed = [k for k, v in result.items() if isinstance(v, dict) and "error" in v]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
